"""``tpserve serve FOLDER`` of integer-weight checkpoint folders through the real openai client,
with the default ``--quantization auto``.

The folders are the embedded SmolLM2-135M written as Hugging Face folders with every linear
weight quantized to 4 bits in groups of 128 columns (``tests/model/int_checkpoints.py``;
SmolLM2's 576 columns are four and a half groups), GPTQ with act-order at tp 2 and
llm-compressor's symmetric pack-quantized at tp 1 (AWQ and the other layouts:
``tests/model/test_int_checkpoint.py``); the oracle is each folder's dequantized float32
twin, run here in process. At tp 2 SmolLM2's 9 query heads pad to 10, so o_proj has padding
columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model.int_checkpoints import save_int_folders
from tests.model.util import embedded_state, save_embedded_folder
from tests.server.serverproc import ServerProcess
from tests.server.test_fp8_checkpoint_server import check_served_logprobs, in_process_logprobs
from tpserve.model.loader.checkpoint import open_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The embedded GGUF's weights as a float32 Hugging Face folder with its tokenizer."""
    ckpt = open_checkpoint(None)
    state = embedded_state(ckpt)
    state.pop("lm_head.weight", None)  # tied to the embedding
    return save_embedded_folder(tmp_path_factory.mktemp("smollm2") / "SmolLM2", ckpt, state)


@pytest.mark.parametrize("fmt, tp, words", [
    ("gptq", 2, "'gptq', 4-bit, groups of 128, act-order"),
    ("compressed-tensors", 1, "'compressed-tensors', 4-bit, groups of 128, symmetric"),
])
def test_served_as_stored_with_the_dequantized_models_logprobs(base, tmp_path, fmt, tp, words):
    folder, twin = save_int_folders(base, tmp_path / f"SmolLM2-{fmt}", fmt, 4, 128,
                                    act_order=fmt == "gptq", symmetric=fmt != "gptq")
    server = ServerProcess(str(folder), "--no-engine-process", "--tensor-parallel-size",
                           str(tp), log_level="info")
    try:
        check_stored_server(server, f"linear layers: {fmt} weights, as stored "
                            f"(quantization_config.quant_method {words})", twin)
    finally:
        assert server.stop() == 0, server.output()


def check_stored_server(server: ServerProcess, log_line: str, oracle: Path) -> None:
    """The server logged ``log_line`` at start-up, serves ``oracle``'s log-probabilities
    (the model loaded in process, unquantized) and answers a greedy completion in full."""
    assert log_line in server.output(), server.output()
    check_served_logprobs(server, in_process_logprobs(str(oracle), None))
    client = server.client()
    r = client.completions.create(model=client.models.list().data[0].id,
                                  prompt="The capital of France is", max_tokens=8,
                                  temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
