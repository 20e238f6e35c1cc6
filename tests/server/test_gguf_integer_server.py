"""``tpserve serve FILE.gguf --quantization gguf`` through the real openai client: the
embedded SmolLM2-135M's weights written as llama.cpp GGUF files, served at tp 2 with their
blocks held as stored (SmolLM2's 9 query heads pad to 10: o_proj has padding columns):
decoder linear weights all ``Q8_0`` (``gguf.quants.quantize``), and mixed as llama.cpp's
``Q4_K_M`` mixes them (``tests.model.util.quantize_k`` for the K-quants), a form per module.
The oracle is the same file dequantized at load (``--quantization auto``), run in process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.util import embedded_state, quantize_k, save_gguf_file
from tests.server.serverproc import ServerProcess
from tests.server.test_int_checkpoint_server import check_stored_server
from tpserve.model.loader.checkpoint import open_checkpoint

gguf = pytest.importorskip("gguf")


def _smollm2_gguf(root: Path, name: str, **quantize) -> Path:
    """The embedded model's weights written as a llama.cpp GGUF file, its decoder linear
    weights quantized as ``quantize`` says (``save_gguf_file``'s ``linear_type`` or
    ``linear_blocks``)."""
    import transformers as tf

    from tests.model.util import hf_config

    ckpt = open_checkpoint(None)
    config = tf.LlamaConfig(**{k: v for k, v in hf_config(ckpt.config).items()
                               if k not in ("architectures", "model_type")})
    with torch.device("meta"):  # the config only: the weights are the embedded model's
        hf = tf.LlamaForCausalLM(config)
    return save_gguf_file(hf, root / name, "llama", state=embedded_state(ckpt), **quantize)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A folder with the embedded tokenizer, for ``--tokenizer``."""
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    open_checkpoint(None).tokenizer().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory) -> Path:
    return _smollm2_gguf(tmp_path_factory.mktemp("smollm2-q8"), "SmolLM2-135M-Q8_0.gguf",
                         linear_type=gguf.GGMLQuantizationType.Q8_0)


def _q4_k_m_type(gname: str) -> str:
    """llama.cpp's ``Q4_K_M`` choice for SmolLM2's tensors: ``Q4_K``, with ``Q6_K`` for
    ``attn_v`` and every third ``ffn_down``; a tensor of 576 input columns (not whole
    256-column superblocks) takes the fallback, ``Q5_0`` for ``Q4_K`` and ``Q8_0`` for
    ``Q6_K``; only ``ffn_down`` (1,536 columns) keeps a K-quant."""
    layer, name = int(gname.split(".")[1]), gname.split(".")[2]
    if name == "ffn_down":
        return "Q6_K" if layer % 3 == 0 else "Q4_K"
    return "Q8_0" if name == "attn_v" else "Q5_0"


def _q4_k_m_blocks(gname: str, values):
    kind = _q4_k_m_type(gname)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    if kind.endswith("_K"):
        return quantize_k(values, kind), qtype
    return gguf.quants.quantize(values, qtype), qtype


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory) -> Path:
    return _smollm2_gguf(tmp_path_factory.mktemp("smollm2-q4km"), "SmolLM2-135M-Q4_K_M.gguf",
                         linear_blocks=_q4_k_m_blocks)


def test_q8_0_blocks_served_as_stored_give_the_dequantized_files_logprobs(q8_file, tokenizer):
    server = ServerProcess(str(q8_file), "--no-engine-process", "--tensor-parallel-size", "2",
                           "--quantization", "gguf", "--tokenizer", str(tokenizer),
                           log_level="info")
    try:  # the oracle: the same file, dequantized at load (auto)
        check_stored_server(server, "linear layers: gguf weights, as stored (the GGUF "
                            "file's blocks (210 x Q8_0), 8-bit, groups of 32)", q8_file)
    finally:
        assert server.stop() == 0, server.output()


def test_a_q4_k_m_file_is_served_a_form_per_module(q4_k_m_file, tokenizer):
    """SmolLM2 as llama.cpp's ``Q4_K_M`` lays it out (``Q4_K`` and ``Q6_K`` down
    projections, ``Q5_0`` / ``Q8_0`` elsewhere), at tp 2: each module in its own form, the
    log-probabilities those of the same file dequantized at load."""
    server = ServerProcess(str(q4_k_m_file), "--no-engine-process", "--tensor-parallel-size",
                           "2", "--quantization", "gguf", "--tokenizer", str(tokenizer),
                           log_level="info")
    try:
        check_stored_server(
            server, "linear layers: gguf weights, as stored (the GGUF file's blocks (20 x "
            "Q4_K, 150 x Q5_0, 10 x Q6_K, 30 x Q8_0) in 120 modules: 20 in 4-bit groups of "
            "32 with offsets, 10 in 8-bit groups of 16, 60 in 8-bit groups of 32, 30 in 8-bit "
            "groups of 32 with offsets)", q4_k_m_file)
    finally:
        assert server.stop() == 0, server.output()
