"""``tpserve loadtest``: a load generator and report for OpenAI-compatible servers: streamed
completions or chat requests, or /v1/embeddings requests (``--endpoint embeddings``).

Wire it into a CLI with ``add_arguments(subparser)`` and ``main(parsed_args)``.
"""

from tpserve.loadtest.args import add_arguments
from tpserve.loadtest.cli import main

__all__ = ["add_arguments", "main"]
