"""tpserve: a tensor-parallel, OpenAI-compatible inference server for Llama-family models."""

__version__ = "0.1.0"
