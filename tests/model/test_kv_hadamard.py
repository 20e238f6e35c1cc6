"""The Hadamard rotation of q and K after RoPE (``model/kv_hadamard``, ``--kv-cache-hadamard``)
on the torch reference path: the matrix, the invariance of every attention score, the
resolution of the flag, and the model: the cache holds rotated K, the logits of a float32
cache do not move, and an FP8 cache with the rotation follows the float32 cache within
``test_fp8_kv_cache``'s bound. (The Triton kernel against this reference:
``test_triton_kv_hadamard``.)"""

from __future__ import annotations

import pytest
import torch

from tests.model.test_fp8_kv_cache import (
    REL_TOL,
    compare_to_fp32,
    fp32_greedy,
    teacher_forced_logits,
)
from tests.model.test_tiny_models import TINY, TOKENS
from tests.model.util import load, new_pool, run, save_hf_folder
from tpserve.cli import build_parser
from tpserve.model.kv_cache_dtype import FP8_KV_DTYPE
from tpserve.model.kv_hadamard import hadamard_rotate, hadamard_signs, resolve_kv_cache_hadamard
from tpserve.model.plan import SeqChunk
from tpserve.parallel.launch import run_ranks
from tpserve.server.config import config_from_args


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_signs_are_sylvesters_matrix(n):
    h = hadamard_signs(n)
    popcount = torch.tensor([[bin(i & j).count("1") for j in range(n)] for i in range(n)])
    assert torch.equal(h, 1.0 - 2.0 * (popcount % 2).float())
    assert torch.equal(h @ h, n * torch.eye(n))


def test_rotation_keeps_every_score_and_undoes_itself():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 64, generator=gen)
    k = torch.randn(5, 4, 64, generator=gen)
    k[..., 3] += 50  # an outlier channel, as RoPE's slow frequencies make
    scores = torch.einsum("thd,shd->hts", q, k)
    rq, rk = hadamard_rotate(q), hadamard_rotate(k)
    torch.testing.assert_close(torch.einsum("thd,shd->hts", rq, rk), scores,
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(hadamard_rotate(rk), k, rtol=1e-5, atol=1e-5)
    # the outlier is spread over the head: each channel gets +-50/8 of it
    assert k.abs().max() > 45 and rk.abs().max() < 15


@pytest.mark.parametrize("flag,kv,head_dim,scales,want", [
    (None, "fp8_e4m3", 64, False, True), (None, "fp8_e4m3", 128, False, True),
    (None, "bfloat16", 64, False, False), (None, "fp8_e4m3", 80, False, False),
    (None, "fp8_e4m3", 16, False, True), (None, "fp8_e4m3", 1024, False, False),
    (None, "fp8_e4m3", 128, True, False), (True, "fp8_e4m3", 128, True, True),
    (False, "fp8_e4m3", 64, False, False), (True, "float32", 64, False, True),
    (True, "fp8_e4m3", 32, False, True)])
def test_resolution(flag, kv, head_dim, scales, want):
    """On by default with an fp8 cache, unless the head cannot take it or the checkpoint's
    own KV scales (chosen for unrotated K) are there."""
    assert resolve_kv_cache_hadamard(flag, kv, head_dim, scales) is want


@pytest.mark.parametrize("head_dim", [80, 1, 24, 1024])
def test_asking_for_it_with_a_head_it_cannot_take_is_refused(head_dim):
    with pytest.raises(ValueError, match=f"--kv-cache-hadamard needs a head dim that is a "
                                         f"power of two from 2 to 512; this model's is "
                                         f"{head_dim}"):
        resolve_kv_cache_hadamard(True, "fp8_e4m3", head_dim)


def test_the_server_flag_defaults_on_with_an_fp8_cache(smollm2_path):
    parser, _ = build_parser()

    def runner(*flags):
        return config_from_args(parser.parse_args(["serve", str(smollm2_path), *flags])).runner

    assert runner("--kv-cache-dtype", "fp8").kv_cache_hadamard is True
    assert runner("--kv-cache-dtype", "fp8", "--no-kv-cache-hadamard").kv_cache_hadamard is False
    assert runner().kv_cache_hadamard is False
    assert runner("--kv-cache-hadamard").kv_cache_hadamard is True


def test_a_checkpoint_with_kv_scales_is_not_rotated_by_default(tmp_path):
    """The scales of a checkpoint were chosen for unrotated K: the default leaves K as it is
    and the capacity line says why; the flag still rotates it."""
    from tests.model.test_fp8_kv_cache import _with_scale_tensors
    from tests.model.test_tiny_models import _hf_model
    from tpserve.model.loader.checkpoint import open_checkpoint
    from tpserve.model.plan import StepLimits
    from tpserve.model.runner import ModelRunner
    from tpserve.parallel.state import TPGroup

    folder = str(save_hf_folder(_hf_model("llama"), tmp_path / "m"))
    assert open_checkpoint(folder).kv_scales is False
    _with_scale_tensors(folder, {"model.layers.0.self_attn.k_proj.output_scale":
                                 torch.tensor(0.5)})
    assert open_checkpoint(folder).kv_scales is True
    parser, _ = build_parser()
    limits = StepLimits(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                        block_size=16)
    for flags, rotated in (((), "K not rotated: the checkpoint's scales are for unrotated K"),
                           (("--kv-cache-hadamard",), "K Hadamard-rotated")):
        cfg = config_from_args(parser.parse_args(
            ["serve", folder, "--kv-cache-dtype", "fp8", "--kv-cache-memory", "1MiB",
             *flags])).runner
        assert cfg.kv_cache_hadamard is bool(flags)
        runner = ModelRunner(cfg, limits, TPGroup(0, 1, torch.device("cpu"), None))
        line = "\n".join(runner.plan.describe())
        assert f"scales from the checkpoint (K 0.5..1, V 1..1), {rotated})" in line, line


# ------------------------------------------------------------------ the model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny Llama with 2 heads of 32 and 1 KV head (multi-query)."""
    import transformers as tf

    torch.manual_seed(5)
    cfg = tf.LlamaConfig(**(TINY | dict(num_attention_heads=2, num_key_value_heads=1)),
                         rope_theta=10000.0)
    cfg.architectures = ["LlamaForCausalLM"]
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return str(save_hf_folder(model, tmp_path_factory.mktemp("hadamard")))


def _prefill_cache(folder: str, k_hadamard: bool):
    model, comm = load(folder, k_hadamard=k_hadamard)
    pool = new_pool(model, comm)
    logits = run(model, pool, [SeqChunk(TOKENS, 0, [0, 1], True)], all_logits=True)
    n = len(TOKENS)
    return logits, [k.flatten(0, 1)[:n] for k, _ in pool.layers], \
        [v.flatten(0, 1)[:n] for _, v in pool.layers]


def test_the_cache_holds_rotated_k_and_the_logits_do_not_move(folder):
    plain_logits, plain_k, plain_v = _prefill_cache(folder, False)
    logits, k, v = _prefill_cache(folder, True)
    assert len(k) == 2 and k[0].shape == (len(TOKENS), 1, 32)
    for got, want in zip(k, plain_k, strict=True):
        assert not torch.allclose(got, want, atol=1e-2)
        torch.testing.assert_close(got, hadamard_rotate(want), rtol=1e-5, atol=1e-5)
    for got, want in zip(v, plain_v, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # V is not rotated
    torch.testing.assert_close(logits, plain_logits, rtol=1e-4, atol=1e-4)


def test_an_fp8_cache_with_the_rotation_follows_the_float32_cache(folder):
    from tests.model.test_kv_cache_dtype import greedy_with_logits

    n = 24
    tokens, want = greedy_with_logits(*load(folder), TOKENS, n)
    got = teacher_forced_logits(*load(folder, kv_dtype=FP8_KV_DTYPE, k_hadamard=True),
                                TOKENS + tokens, len(TOKENS))[:n]
    figures = compare_to_fp32(want, got)
    print("tiny llama (head 32), FP8 + Hadamard vs float32 cache:", figures)
    assert figures["rel_err"] <= REL_TOL, figures
    assert figures["sure_agree"], figures


def _tp2_rotated_fp8(group, folder, tokens, prompt_len):
    out = {}
    for mode in ("allreduce", "allgather"):
        model, comm = load(folder, group, kv_dtype=FP8_KV_DTYPE, tp_comm=mode, k_hadamard=True)
        out[mode] = teacher_forced_logits(model, comm, tokens, prompt_len)
    return out


def test_the_rotation_at_tp2_both_comm_modes(tiny_llama):
    """Each rank rotates its own heads (the tiny Llama: heads of 16, one KV head a rank):
    tp 2 gives tp 1's logits over the rotated FP8 cache, in both --tp-comm modes (within
    one e4m3 step's worth, as ``test_fp8_kv_cache``'s tp 2 test allows)."""
    tokens, want32 = fp32_greedy(tiny_llama, 12)
    want = teacher_forced_logits(*load(tiny_llama, kv_dtype=FP8_KV_DTYPE, k_hadamard=True),
                                 tokens, len(TOKENS))
    for rank_out in run_ranks(_tp2_rotated_fp8, 2, tiny_llama, tokens, len(TOKENS),
                              timeout_s=300):
        for mode, got in rank_out.items():
            err = (got - want).abs().max().item() / want.abs().max().item()
            assert err <= 2**-8, (mode, err)
            assert compare_to_fp32(want32, got[:12])["rel_err"] <= REL_TOL
