"""``tpserve serve FOLDER`` of an FP8 checkpoint folder (vLLM's "fp8" ``quantization_config``)
through the real openai client, with the default ``--quantization auto``.

The folder is the embedded SmolLM2-135M written as a Hugging Face folder with every linear
weight quantized per channel by ``quantize_per_row``, so the served model is exactly
``--quantization fp8`` of the embedded one: its next-token log-probabilities equal that
model's, computed here in process (float32, CPU; the server's prefill steps differ only in
how the prompts are batched)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.util import (
    embedded_state,
    fp8_block_state,
    fp8_quantization_config,
    fp8_state,
    full_logits,
    load,
    save_embedded_folder,
)
from tests.server.serverproc import ServerProcess
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.quant.fp8 import Fp8LinearMethod
from tpserve.model.quant.fp8_block import Fp8BlockMethod
from tpserve.model.quant.fp8_checkpoint import Fp8CheckpointMethod

TEXT = Path(__file__).parents[1] / "data" / "pride_and_prejudice_ch1.txt"
CUTS = [16, 40]


def write_fp8_smollm2(folder: Path, input_scales: dict[str, float] | None = None,
                      block: tuple[int, int] | None = None) -> Path:
    """The embedded GGUF's weights (dequantized, Hugging Face names) as an FP8 folder, with
    its tokenizer and an equivalent ``config.json``; with ``input_scales`` (checkpoint
    weight name -> scale) static activation scales too, as ``neuralmagic/*-FP8`` stores
    them; with ``block`` block-wise weight scales (transformers' FineGrainedFP8)."""
    ckpt = open_checkpoint(None)
    state = embedded_state(ckpt)
    state.pop("lm_head.weight", None)  # tied to the embedding
    tensors = fp8_state(state) if block is None else fp8_block_state(state, block)
    for name in input_scales or ():
        tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(
            input_scales[name], dtype=torch.float32)
    return save_embedded_folder(folder, ckpt, tensors,
                                quantization_config=fp8_quantization_config(
                                    "fp8", static=input_scales is not None, block=block))


def calibrated_input_scales(ids: list[int]) -> dict[str, float]:
    """Each linear layer's largest input magnitude over ``ids`` / 448 (AutoFP8's static
    calibration), from the unquantized embedded model, per checkpoint weight name."""
    model, comm = load(None)
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
             "gate_up_proj": ("gate_proj", "up_proj")}
    amax: dict[str, float] = {}
    def recorder(names: list[str]):
        def hook(_, args):
            for n in names:
                amax[n] = max(amax.get(n, 0.0), args[0].abs().max().item())
        return hook

    for name, mod in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            mod.register_forward_pre_hook(
                recorder([f"{prefix}.{p}.weight" for p in parts.get(leaf, (leaf,))]))
    with torch.no_grad():
        full_logits(model, comm, ids)
    return {n: a / 448 for n, a in amax.items()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_fp8_smollm2(tmp_path_factory.mktemp("smollm2") / "SmolLM2-FP8")


@pytest.fixture(scope="module")
def static_folder(tmp_path_factory) -> Path:
    ids = open_checkpoint(None).tokenizer()(TEXT.read_text())["input_ids"]
    return write_fp8_smollm2(tmp_path_factory.mktemp("smollm2") / "SmolLM2-FP8-static",
                             calibrated_input_scales(ids[200:456]))  # not the test's text


@pytest.fixture(scope="module")
def server(folder):
    s = ServerProcess(str(folder), "--no-engine-process", log_level="info")
    yield s
    assert s.stop() == 0, s.output()


def test_start_up_says_the_weights_are_served_as_stored(server):
    assert "linear layers: fp8 weights, as stored (quantization_config.quant_method 'fp8')" \
        in server.output(), server.output()


def test_greedy_answer_is_coherent(server):
    client = server.client()
    r = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


def text_ids() -> list[int]:
    return open_checkpoint(None).tokenizer()(TEXT.read_text())["input_ids"][:max(CUTS)]


def in_process_logprobs(model_path: str | None, method) -> torch.Tensor:
    model, comm = load(model_path, quant_method=method)
    with torch.no_grad():
        return full_logits(model, comm, text_ids()).float().log_softmax(-1)


def check_served_logprobs(server, want: torch.Tensor) -> list[tuple[int, object]]:
    """The server's top-3 next-token log-probabilities after each cut of the text equal
    ``want``'s (tokens in order, values within 1e-3); returns each cut's position and
    ``want``'s top 3 there."""
    tok = open_checkpoint(None).tokenizer()
    ids = text_ids()
    client = server.client()
    r = client.completions.create(model=client.models.list().data[0].id,
                                  prompt=[ids[:c] for c in CUTS], max_tokens=1,
                                  temperature=0, logprobs=3)
    tops = []
    for choice in r.choices:
        top = want[CUTS[choice.index] - 1].topk(3)
        served = choice.logprobs.top_logprobs[0]
        assert list(served) == [tok.decode([t]) for t in top.indices.tolist()], served
        assert list(served.values()) == pytest.approx(top.values.tolist(), abs=1e-3)
        tops.append((CUTS[choice.index] - 1, top))
    return tops


def test_logprobs_are_quantization_fp8_of_the_embedded_model(server):
    check_served_logprobs(server, in_process_logprobs(None, Fp8LinearMethod()))


def test_static_activation_scales_serve_what_the_checkpoint_was_calibrated_for(static_folder):
    """``activation_scheme: "static"``: served as stored (``--quantization auto``); with
    every step W8A8 (``--fp8-weight-only-max-tokens 0``) the next-token log-probabilities
    are those of the checkpoint's model in process on the static scales (which quantize
    each value alone, so how the server batches the prompts changes nothing)."""
    server = ServerProcess(str(static_folder), "--no-engine-process",
                           "--fp8-weight-only-max-tokens", "0", log_level="info")
    try:
        assert ("linear layers: fp8 weights, as stored (quantization_config.quant_method "
                "'fp8', static activation scales)") in server.output(), server.output()
        method = Fp8CheckpointMethod(weight_only_max_tokens=0, static_activations=True)
        tops = check_served_logprobs(server, in_process_logprobs(str(static_folder), method))
        # per-token dynamic scales give other log-probabilities
        other = in_process_logprobs(None, Fp8LinearMethod(weight_only_max_tokens=0))
        for pos, top in tops:
            assert (other[pos, top.indices] - top.values).abs().max() > 2e-3
    finally:
        assert server.stop() == 0, server.output()


def test_block_wise_checkpoint_serves_its_blocks(tmp_path):
    """``weight_block_size [128, 128]`` (SmolLM2's 576 columns: four and a half blocks;
    its q rows end mid-block, so the fused qkv keeps one scale row per weight row): served
    as stored with every step W8A8, the next-token log-probabilities are those of the
    block-wise model in process (activations quantized per token and 128 columns), not
    those of per-channel scales."""
    folder = write_fp8_smollm2(tmp_path / "SmolLM2-FP8-block", block=(128, 128))
    server = ServerProcess(str(folder), "--no-engine-process",
                           "--fp8-weight-only-max-tokens", "0", log_level="info")
    try:
        assert ("linear layers: fp8 weights, as stored (quantization_config.quant_method "
                "'fp8', block-wise weight scales [128, 128])") in server.output(), \
            server.output()
        method = Fp8BlockMethod(weight_only_max_tokens=0, block=(128, 128))
        tops = check_served_logprobs(server, in_process_logprobs(str(folder), method))
        other = in_process_logprobs(None, Fp8LinearMethod(weight_only_max_tokens=0))
        for pos, top in tops:
            assert (other[pos, top.indices] - top.values).abs().max() > 2e-3
    finally:
        assert server.stop() == 0, server.output()
