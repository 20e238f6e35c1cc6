"""The FP8 KV cache (``--kv-cache-dtype fp8``) on the torch reference path: the convention
of ``model/kv_cache_dtype`` (scale, saturate, read back ``q * s``), checkpoint scales, the
pool and memory plan, and the tiny Llama against its float32 cache at tp 1 and tp 2.

Tolerance for the model: e4m3 keeps 4 significant bits, so each cached K/V element is off
by at most 2^-4 relative (plus 2^-9 s absolute near zero) - 32 times bfloat16's 2^-9. As in
``test_kv_cache_dtype``, attention averages that error over the head dimension and the
context, so the logits move by much less than the element bound; we allow ``2^-4 *
max|logit|`` (measured on the tiny Llama: about 2^-6). The comparison is teacher-forced
(both caches see the float32 run's greedy tokens), so one near-tie cannot derail the rest;
greedy agreement is asserted exactly at every step whose float32 top-2 margin exceeds twice
the bound, and reported (not asserted) elsewhere.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.model.test_tiny_models import TOKENS, _hf_model
from tests.model.util import load, new_pool, run, save_hf_folder
from tpserve.model.attention.torch_backend import TorchAttention
from tpserve.model.kernels import torch_ops
from tpserve.model.kv_cache_dtype import FP8_KV_DTYPE, FP8_MAX
from tpserve.model.kv_pool import KVPool, kv_bytes_per_block
from tpserve.model.plan import SeqChunk, StepLimits, StepPlan
from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.state import TPGroup

CPU = torch.device("cpu")
FP8 = FP8_KV_DTYPE
REL_TOL = 2**-4


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return tiny_llama


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


# ------------------------------------------------------------------ the reference ops


def test_write_stores_the_scaled_saturated_e4m3_value():
    x = torch.tensor([[[0.0, 1.0, -1.0, 3.3]], [[500.0, -1e6, 7e-4, 0.1]]])  # [2, 1, 4]
    scale = torch.tensor([0.5, 2.0])
    k_cache = torch.zeros(1, 4, 1, 4, dtype=FP8)
    v_cache = torch.zeros(1, 4, 1, 4, dtype=FP8)
    torch_ops.write_kv(x, x, k_cache, v_cache, torch.tensor([2, -1]), scale)
    assert torch.equal(_bits(k_cache[0, 2]), _bits((x[0] / 0.5).to(FP8)))
    assert torch.equal(_bits(v_cache[0, 2]), _bits((x[0] / 2.0).to(FP8)))
    assert not _bits(k_cache[0, [0, 1, 3]]).any()  # slot -1: nothing written
    saturated = torch_ops.quantize_kv(x[1], torch.tensor(1.0)).float()
    assert saturated.tolist() == [[FP8_MAX, -FP8_MAX, 0.0, 0.1015625]]  # 7e-4 < 2^-10: 0
    assert torch.equal(torch_ops.dequantize_kv(k_cache[0, 2], scale[0]),
                       (x[0] / 0.5).to(FP8).float() * 0.5)


def _random_step(hkv: int, d: int, page: int, gen: torch.Generator):
    """A mixed step (2 decodes, a chunked and a fresh prefill) over a random FP8 cache."""
    chunks = [SeqChunk([1], 20, [3, 0], True), SeqChunk([1], 5, [1], True),
              SeqChunk([1] * 9, 13, [4, 2], True), SeqChunk([1] * 6, 0, [5], True)]
    attn = TorchAttention(FP8)
    meta = StepPlan.build(chunks, page, attn).metadata(attn)
    kv_scale = torch.tensor([0.02, 0.05])
    x = torch.randn(2, 6, page, hkv, d, generator=gen) * 3
    return meta, torch_ops.quantize_kv(x[0], kv_scale[0]), \
        torch_ops.quantize_kv(x[1], kv_scale[1]), kv_scale


def test_reference_attention_over_fp8_is_attention_over_the_dequantized_cache():
    """Exactly: the reference reads ``q * s`` in float32 and then is the float32 path."""
    gen = torch.Generator().manual_seed(0)
    hkv, group, d, page = 2, 3, 32, 16
    meta, k8, v8, kv_scale = _random_step(hkv, d, page, gen)
    assert (k8.float().abs() == FP8_MAX).any()  # some K saturated at this scale
    q = torch.randn(int(meta.query_start_loc[-1]), hkv * group, d, generator=gen)
    got = torch_ops.paged_attention(q, k8, v8, meta, d ** -0.5, kv_scale)
    want = torch_ops.paged_attention(q, torch_ops.dequantize_kv(k8, kv_scale[0]),
                                     torch_ops.dequantize_kv(v8, kv_scale[1]), meta, d ** -0.5)
    assert torch.equal(got, want)
    assert not got.isnan().any()


# ------------------------------------------------------------------ the model


def teacher_forced_logits(model, comm, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits after the prompt (one prefill) and after each later token of ``tokens`` (one
    decode each): ``len(tokens) - prompt_len + 1`` rows."""
    pool = new_pool(model, comm)
    blocks = list(range(pool.num_blocks))
    rows = [run(model, pool, [SeqChunk(tokens[:prompt_len], 0, blocks, True)])[0]]
    for i in range(prompt_len, len(tokens)):
        rows.append(run(model, pool, [SeqChunk(tokens[i:i + 1], i, blocks, True)])[0])
    return torch.stack(rows)


def fp32_greedy(folder: str, n: int) -> tuple[list[int], torch.Tensor]:
    from tests.model.test_kv_cache_dtype import greedy_with_logits
    tokens, logits = greedy_with_logits(*load(folder), TOKENS, n)
    return TOKENS + tokens, logits


def compare_to_fp32(want: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    """Figures of an FP8-cache run against the float32 cache's (both ``[steps, vocab]``)."""
    top2 = want.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    bound = REL_TOL * want.abs().max().item()
    agree = got.argmax(-1) == want.argmax(-1)
    sure = margin > 2 * bound
    return {"rel_err": (got - want).abs().max().item() / want.abs().max().item(),
            "logprob_err": (got.log_softmax(-1) - want.log_softmax(-1)).abs().max().item(),
            "agree": agree.float().mean().item(), "sure_steps": int(sure.sum()),
            "sure_agree": bool(agree[sure].all())}


def assert_fp8_greedy(folder: str, backend: str, n: int) -> dict[str, float]:
    """The tiny Llama over an FP8 cache on ``backend``, teacher-forced on the float32
    cache's ``n`` greedy tokens: logits within the module's bound, greedy agreement where
    the float32 margin is clear of it; on the Triton back-end also equal (to float32
    rounding) to the torch back-end's over the same cache values."""
    tokens, want = fp32_greedy(folder, n)
    got = teacher_forced_logits(*load(folder, kv_dtype=FP8, backend=backend), tokens,
                                len(TOKENS))[:n]
    figures = compare_to_fp32(want, got)
    assert figures["rel_err"] <= REL_TOL, figures
    assert figures["sure_agree"], figures
    if backend != "torch":
        ref = teacher_forced_logits(*load(folder, kv_dtype=FP8), tokens, len(TOKENS))[:n]
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)
    return figures


def test_fp8_cache_follows_the_float32_cache_on_the_torch_backend(folder):
    figures = assert_fp8_greedy(folder, "torch", 32)
    print("tiny llama, FP8 vs float32 cache:", figures)


def _with_scale_tensors(folder: str, tensors: dict[str, torch.Tensor]) -> str:
    """Adds ``tensors`` to the checkpoint as one more shard named in its index."""
    save_file(tensors, f"{folder}/kv-scales.safetensors", metadata={"format": "pt"})
    index_path = f"{folder}/model.safetensors.index.json"
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update(dict.fromkeys(tensors, "kv-scales.safetensors"))
    with open(index_path, "w") as f:
        json.dump(index, f)
    return folder


def test_checkpoint_scales_are_loaded_and_used(tmp_path):
    folder = str(save_hf_folder(_hf_model("llama"), tmp_path / "m"))
    model, comm = load(folder, kv_dtype=FP8)
    assert torch.equal(model.kv_scales(), torch.ones(2, 2))  # none in the checkpoint: 1.0
    _with_scale_tensors(folder, {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
                                 "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([0.25]),
                                 "model.layers.1.self_attn.kv_scale": torch.tensor(2.0)})
    model, comm = load(folder, kv_dtype=FP8)
    assert model.kv_scales().tolist() == [[0.5, 0.25], [2.0, 2.0]]
    # the write divides by them: layer 0's cached V is 4x what a unit scale stores
    unit, _ = load(folder, kv_dtype=FP8)
    unit.model.layers[0].self_attn.kv_scale.fill_(1.0)
    caches = []
    for m in (model, unit):
        pool = new_pool(m, comm)
        run(m, pool, [SeqChunk(TOKENS, 0, [0], True)])
        caches.append(pool.layers[0][1][0, : len(TOKENS)].float())
    small = caches[1].abs() < 100  # away from saturation and from the subnormal range
    small &= caches[1].abs() > 1
    assert torch.allclose(caches[0][small], caches[1][small] * 4, rtol=2**-3)
    limits = StepLimits(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                        block_size=16)
    runner = ModelRunner(RunnerConfig(model=folder, kv_cache_dtype="fp8_e4m3",
                                      kv_cache_memory=2**20), limits, TPGroup(0, 1, CPU, None))
    assert "scales from the checkpoint" in "\n".join(runner.plan.describe())


@pytest.mark.parametrize("bad,msg", [(torch.ones(3), "one value per layer"),
                                     (torch.tensor(-1.0), "finite and > 0")])
def test_a_bad_checkpoint_scale_is_named(tmp_path, bad, msg):
    folder = str(save_hf_folder(_hf_model("llama"), tmp_path / "m"))
    _with_scale_tensors(folder, {"model.layers.1.self_attn.k_scale": bad})
    with pytest.raises(ValueError, match=f"model.layers.1.self_attn.k_scale.*{msg}"):
        load(folder, kv_dtype=FP8)


def test_fp8_blocks_cost_half_of_bfloat16_and_the_plan_says_so(folder):
    assert kv_bytes_per_block(2, 16, 2, 16, FP8) * 2 == kv_bytes_per_block(2, 16, 2, 16,
                                                                           torch.bfloat16)
    pool = KVPool(2, 3, 16, 2, 16, FP8, CPU)
    assert pool.buffer.dtype == FP8 and pool.nbytes == 3 * 2 * 2 * 16 * 2 * 16
    limits = StepLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                        block_size=16)
    runners = {kv: ModelRunner(RunnerConfig(model=folder, kv_cache_dtype=kv,
                                            kv_cache_memory=2**20),
                               limits, TPGroup(0, 1, CPU, None))
               for kv in ("bfloat16", "fp8_e4m3")}
    half, fp8 = runners["bfloat16"].plan, runners["fp8_e4m3"].plan
    assert runners["fp8_e4m3"].kv_pool.buffer.dtype == FP8
    assert fp8.bytes_per_block * 2 == half.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 2
    assert fp8.num_blocks == 2 * half.num_blocks and fp8.kv_tokens == 2 * half.kv_tokens
    assert (f"capacity: {fp8.num_blocks} blocks x 16 tokens = {fp8.kv_tokens} tokens of "
            "fp8_e4m3 cache (128 bytes per token, scales 1.0 (the checkpoint has none; "
            "--calculate-kv-scales computes them), K not rotated (--kv-cache-hadamard)); "
            ) in "\n".join(fp8.describe())
    assert (f"= {half.kv_tokens} tokens of bfloat16 cache (256 bytes per token); "
            ) in "\n".join(half.describe())


def test_runner_config_names_the_flag():
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of bfloat16, float16, "
                                         "float32, fp8_e4m3 once resolved, got 'fp8'"):
        RunnerConfig(kv_cache_dtype="fp8")  # aliases are resolved by the server's config


# ------------------------------------------------------------------ tp 2 on gloo


def _tp2_fp8(group, folder, tokens, prompt_len):
    out = {}
    for mode in ("allreduce", "allgather"):
        model, comm = load(folder, group, kv_dtype=FP8, tp_comm=mode)
        out[mode] = teacher_forced_logits(model, comm, tokens, prompt_len)
    return out


def test_fp8_cache_at_tp2_both_comm_modes(folder):
    """Each rank caches its own KV heads in FP8 with the same scales: tp 2 gives tp 1's
    FP8 logits (up to float32 rounding, which can move an element across an e4m3 rounding
    boundary: allowed one e4m3 step's worth, 2^-8 max|logit|), in both --tp-comm modes."""
    tokens, want32 = fp32_greedy(folder, 12)
    want = teacher_forced_logits(*load(folder, kv_dtype=FP8), tokens, len(TOKENS))
    for rank_out in run_ranks(_tp2_fp8, 2, folder, tokens, len(TOKENS), timeout_s=300):
        for mode, got in rank_out.items():
            err = (got - want).abs().max().item() / want.abs().max().item()
            assert err <= 2**-8, (mode, err)
            assert compare_to_fp32(want32, got[:12])["rel_err"] <= REL_TOL


@pytest.mark.parametrize("flag", ["fp8", "fp8_e4m3"])
def test_server_flag_resolves_to_fp8_e4m3(flag):
    from tests.test_cli import _cfg
    cfg = _cfg("--device", "cpu", "--kv-cache-dtype", flag)
    assert cfg.runner.kv_cache_dtype == "fp8_e4m3" and cfg.runner.dtype == "float32"


def test_server_flag_error_names_the_flag(capsys):
    from tests.test_cli import _cfg
    with pytest.raises(SystemExit):
        _cfg("--device", "cpu", "--kv-cache-dtype", "int8")
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "fp8_e4m3" in err
