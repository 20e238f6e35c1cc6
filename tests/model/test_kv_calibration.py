"""The FP8 KV cache's start-up calibration (``--calculate-kv-scales``,
``model/kv_calibration.py``): the scale rule, the calibration tokens, the runner's choice
between checkpoint scales, calibration and 1.0, agreement over tp ranks on gloo, and the
flag's resolution."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_fp8_kv_cache import _with_scale_tensors
from tests.model.test_tiny_models import _hf_model
from tests.model.util import load, save_hf_folder
from tpserve.model.kv_cache_dtype import FP8_KV_DTYPE, FP8_MAX
from tpserve.model.kv_calibration import (
    HEADROOM,
    calibrate_kv_scales,
    calibration_text,
    calibration_token_ids,
    kv_amax,
    scales_from_amax,
)
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.plan import SeqChunk, StepLimits
from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.state import TPGroup

CPU = torch.device("cpu")
LIMITS = StepLimits(max_num_seqs=2, max_num_batched_tokens=48, max_model_len=64,
                    block_size=16)


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return tiny_llama


def test_scale_maps_the_maximum_to_448_over_the_headroom_and_zero_to_one():
    amax = torch.tensor([[448.0, 0.0], [224.0, 2.0]])
    assert HEADROOM == 2.0
    f32 = torch.float32
    assert torch.equal(scales_from_amax(amax),
                       torch.tensor([[2.0, 1.0], [1.0, 2 * 2.0 / 448]], dtype=f32))
    assert torch.equal(scales_from_amax(amax, 1.0),
                       torch.tensor([[1.0, 1.0], [0.5, 2.0 / 448]], dtype=f32))
    assert scales_from_amax(amax).dtype == torch.float32


def test_calibration_tokens_are_the_text_through_the_tokenizer_or_seeded_random():
    tok = open_checkpoint(None).tokenizer()  # the embedded SmolLM2's
    full = list(tok(calibration_text())["input_ids"])
    assert len(full) > 1000
    assert calibration_token_ids(tok, 49152, 300, 0) == full[:300]
    assert calibration_token_ids(tok, 49152, 5000, 0) == full
    rand = calibration_token_ids(None, 100, 64, seed=7)
    assert rand == calibration_token_ids(None, 100, 64, seed=7)
    assert rand != calibration_token_ids(None, 100, 64, seed=8)
    assert len(rand) == 64 and min(rand) >= 0 and max(rand) < 100 and len(set(rand)) > 30


def _float32_amax(folder: str, ids: list[int]) -> torch.Tensor:
    """The oracle: the float32 model's cache maxima after one prefill of ``ids``."""
    model, comm = load(folder)
    return kv_amax(model, model.attn_backend, ids, 16, torch.float32, CPU)


def test_runner_calibrates_from_the_prefill_and_codes_peak_at_448_over_headroom(folder):
    cfg = RunnerConfig(model=folder, load_format="dummy", kv_cache_dtype="fp8_e4m3",
                       calculate_kv_scales=True, kv_cache_memory=2**20, seed=3)
    runner = ModelRunner(cfg, LIMITS, TPGroup(0, 1, CPU, None))
    # dummy weights: 48 seeded random ids (the step's token budget caps the prefill)
    ids = calibration_token_ids(None, runner.model_config.vocab_size, 48, 3)
    model, comm = load(folder, load_format="dummy")
    model.load_state_dict(runner.model.state_dict())
    want = scales_from_amax(kv_amax(model, model.attn_backend, ids, 16, torch.float32, CPU))
    assert torch.equal(runner.model.kv_scales(), want)
    assert "scales calibrated on 48 tokens (K " in "\n".join(runner.plan.describe())
    # the same prefill into the fp8 pool: each layer's largest code is 448 / HEADROOM
    from tests.model.util import run
    pool = runner.kv_pool
    run(runner.model, pool, [SeqChunk(ids, 0, list(range(3)), True)])
    for k, v in pool.layers:
        for cache in (k, v):
            assert cache.dtype == FP8_KV_DTYPE
            assert cache[:3].float().abs().max().item() == FP8_MAX / HEADROOM


def test_checkpoint_scales_win_and_the_flag_off_keeps_one(tmp_path):
    folder = str(save_hf_folder(_hf_model("llama"), tmp_path / "m"))
    off = ModelRunner(RunnerConfig(model=folder, kv_cache_dtype="fp8_e4m3",
                                   kv_cache_memory=2**20), LIMITS, TPGroup(0, 1, CPU, None))
    assert torch.equal(off.model.kv_scales(), torch.ones(2, 2))
    assert "scales 1.0 (the checkpoint has none; --calculate-kv-scales computes them)" in \
        "\n".join(off.plan.describe())
    _with_scale_tensors(folder, {"model.layers.0.self_attn.k_scale": torch.tensor(0.5)})
    on = ModelRunner(RunnerConfig(model=folder, kv_cache_dtype="fp8_e4m3",
                                  calculate_kv_scales=True, kv_cache_memory=2**20),
                     LIMITS, TPGroup(0, 1, CPU, None))
    assert on.model.kv_scales().tolist() == [[0.5, 1.0], [1.0, 1.0]]
    assert "scales from the checkpoint (K 0.5..1" in "\n".join(on.plan.describe())


def _calibrate_on_ranks(group, folder, ids, tp_comm):
    model, _ = load(folder, group, kv_dtype=FP8_KV_DTYPE, tp_comm=tp_comm)
    mine = kv_amax(model, model.attn_backend, ids, 16, torch.float32, CPU)
    return mine, calibrate_kv_scales(model, model.attn_backend, ids, 16, torch.float32, CPU)


@pytest.mark.parametrize("tp_comm", ["allreduce", "allgather"])
def test_ranks_agree_on_the_maximum_over_their_heads(folder, tp_comm):
    """tp 2: each rank sees its own KV heads; after the max all-reduce every rank holds
    tp 1's scales (up to float32 rounding of the row-parallel sums)."""
    ids = calibration_token_ids(None, 256, 40, 0)
    want = scales_from_amax(_float32_amax(folder, ids))
    (amax0, got0), (amax1, got1) = run_ranks(_calibrate_on_ranks, 2, folder, ids, tp_comm,
                                             timeout_s=300)
    assert torch.equal(got0, got1)
    assert torch.equal(got0, scales_from_amax(torch.maximum(amax0, amax1)))
    assert not torch.equal(amax0, amax1)  # the ranks did see different heads
    assert torch.allclose(got0, want, rtol=1e-5, atol=0)


def test_server_flag_is_off_by_default_and_refused_without_an_fp8_cache():
    from tests.test_cli import _cfg
    assert not _cfg("--device", "cpu", "--kv-cache-dtype", "fp8").runner.calculate_kv_scales
    assert _cfg("--device", "cpu", "--kv-cache-dtype", "fp8",
                "--calculate-kv-scales").runner.calculate_kv_scales
    with pytest.raises(ValueError, match="--calculate-kv-scales needs --kv-cache-dtype fp8; "
                                         "the KV cache is float32, which has no scales"):
        _cfg("--device", "cpu", "--calculate-kv-scales")
    with pytest.raises(ValueError, match="--calculate-kv-scales needs --kv-cache-dtype fp8"):
        RunnerConfig(calculate_kv_scales=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels on a GPU")
def test_triton_calibration_on_the_gpu_equals_the_torch_reference(folder):
    """The GPU path (Triton RoPE + KV write and prefill attention, float32 model and
    temporary cache) against the CPU torch reference: the same scales up to float32
    rounding."""
    from tpserve.model.attention.backend import select_attention
    from tpserve.model.kernels.backend import select_ops
    from tpserve.model.loader.build import build_model
    from tpserve.parallel.comm import Communicator

    cuda = torch.device("cuda")
    model = build_model(open_checkpoint(folder), Communicator(TPGroup(0, 1, cuda, None)), cuda,
                        torch.float32, select_ops("triton"),
                        select_attention("triton", FP8_KV_DTYPE), 512)
    ids = calibration_token_ids(None, 256, 40, 0)
    got = calibrate_kv_scales(model, model.attn_backend, ids, 16, torch.float32, cuda)
    want = scales_from_amax(_float32_amax(folder, ids))
    assert torch.allclose(got.cpu(), want, rtol=1e-4, atol=0)
    assert torch.equal(model.kv_scales().cpu(), got.cpu())


def test_the_embedded_model_calibrates_on_its_tokenized_text(smollm2_path):
    """A real checkpoint: the calibration text through the GGUF's own tokenizer (the first
    64 tokens: the step's token budget), scales from the float32 cache of that prefill."""
    limits = StepLimits(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
                        block_size=16)
    runner = ModelRunner(RunnerConfig(kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True,
                                      kv_cache_memory=2**22), limits, TPGroup(0, 1, CPU, None))
    ids = list(runner.ckpt.tokenizer()(calibration_text())["input_ids"])[:64]
    want = scales_from_amax(_float32_amax(str(smollm2_path), ids))
    assert torch.equal(runner.model.kv_scales(), want)
    assert want.ne(1.0).all()
    assert "scales calibrated on 64 tokens (K " in "\n".join(runner.plan.describe())
