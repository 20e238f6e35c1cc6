"""``tpserve serve FILE.gguf --quantization gguf`` through the real openai client: the
embedded SmolLM2-135M's weights written as a llama.cpp GGUF file whose decoder linear
weights are ``Q8_0`` blocks (``gguf.quants.quantize``), served at tp 2 with those blocks
held as 8-bit codes (SmolLM2's 9 query heads pad to 10: o_proj has padding columns). The
oracle is the same file dequantized at load (``--quantization auto``), run in process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.util import embedded_state, save_gguf_file
from tests.server.serverproc import ServerProcess
from tests.server.test_int_checkpoint_server import check_stored_server
from tpserve.model.loader.checkpoint import open_checkpoint

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory) -> tuple[Path, Path]:
    """(the Q8_0 GGUF file, a folder with the embedded tokenizer for ``--tokenizer``)."""
    import transformers as tf

    from tests.model.util import hf_config

    ckpt = open_checkpoint(None)
    root = tmp_path_factory.mktemp("smollm2-q8")
    config = tf.LlamaConfig(**{k: v for k, v in hf_config(ckpt.config).items()
                               if k not in ("architectures", "model_type")})
    with torch.device("meta"):  # the config only: the weights are the embedded model's
        hf = tf.LlamaForCausalLM(config)
    path = save_gguf_file(hf, root / "SmolLM2-135M-Q8_0.gguf", "llama",
                          state=embedded_state(ckpt), linear_type=gguf.GGMLQuantizationType.Q8_0)
    ckpt.tokenizer().save_pretrained(str(root / "tokenizer"))
    return path, root / "tokenizer"


def test_q8_0_blocks_served_as_stored_give_the_dequantized_files_logprobs(q8_file):
    path, tokenizer = q8_file
    server = ServerProcess(str(path), "--no-engine-process", "--tensor-parallel-size", "2",
                           "--quantization", "gguf", "--tokenizer", str(tokenizer),
                           log_level="info")
    try:  # the oracle: the same file, dequantized at load (auto)
        check_stored_server(server, "linear layers: gguf weights, as stored (the GGUF "
                            "file's blocks (210 x Q8_0), 8-bit, groups of 32)", path)
    finally:
        assert server.stop() == 0, server.output()
