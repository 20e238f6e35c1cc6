"""The FP8 KV cache's scales calibrated at start-up (``--calculate-kv-scales``, off by
default).

A checkpoint without ``k_scale``/``v_scale`` tensors leaves every scale at 1.0 (vLLM's
default). That saturates a model whose K or V pass 448, and puts a model whose values stay
far below 1 among e4m3's subnormals (below 2^-6, one to three significant bits). e4m3's
grid is otherwise relative (3 mantissa bits at every scale), so for a model in between
(the embedded SmolLM2: K maxima 10-34, V 0.6-20) the scale mostly moves values across
grid points: measured, calibration did not beat 1.0 there (``bench/README.md``).

Calibration: one prefill of a fixed text (``data/kv_calibration.txt``: dialogue, prose, code,
a table, numbers, two other languages; tokenized by the model's own tokenizer, or seeded
random token ids for dummy weights, which have no meaningful tokenizer) into a temporary
cache in the model's dtype; per layer, the largest ``|K|`` (after RoPE) and ``|V|`` written
there; the maximum over ranks (one all-reduce: ranks hold different heads); then
``scale = amax * HEADROOM / 448``, so values up to ``HEADROOM`` times the calibration's
maxima are stored before they saturate.

Invariants: every rank ends with the same scales; each scale is finite and > 0 (a layer
whose K or V was all zero keeps 1.0); the temporary cache is freed before the caller goes
on, and the scales then never change (CUDA graphs bake in their address, not their value).
Every rank must call ``calibrate_kv_scales`` at the same point (it runs a forward and a
collective).
"""

from __future__ import annotations

from importlib import resources

import torch

from tpserve.model.kv_cache_dtype import FP8_MAX, is_fp8
from tpserve.model.kv_pool import KVPool
from tpserve.model.loader.checkpoint import Checkpoint, DummyCheckpoint
from tpserve.model.plan import SeqChunk, StepPlan

# the multiple of the calibration's maxima that still fits below e4m3's largest value
HEADROOM = 2.0
# tokens of the calibration prefill, at most (fewer where --max-model-len or the step's
# token budget is smaller)
MAX_CALIBRATION_TOKENS = 1024


def calibration_text() -> str:
    return resources.files("tpserve.model").joinpath("data/kv_calibration.txt").read_text(
        encoding="utf-8")


def calibration_token_ids(tokenizer, vocab_size: int, max_tokens: int, seed: int
                          ) -> list[int]:
    """The calibration prefill's token ids: the text through ``tokenizer`` (None: dummy
    weights, seeded random ids below ``vocab_size``), at most ``max_tokens``."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (max_tokens,), generator=g).tolist()
    ids = list(tokenizer(calibration_text())["input_ids"])
    return ids[:max_tokens]


def checkpoint_calibration_ids(ckpt: Checkpoint, max_tokens: int, seed: int) -> list[int]:
    """``calibration_token_ids`` for a checkpoint: its own tokenizer, or random ids for
    dummy weights; at most ``min(max_tokens, MAX_CALIBRATION_TOKENS)``."""
    tokenizer = None if isinstance(ckpt, DummyCheckpoint) else ckpt.tokenizer()
    return calibration_token_ids(tokenizer, ckpt.config.vocab_size,
                                 min(max_tokens, MAX_CALIBRATION_TOKENS), seed)


@torch.inference_mode()
def kv_amax(model, attn, token_ids: list[int], block_size: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """``[num_layers, 2]`` float32: this rank's largest ``|K|`` and ``|V|`` per layer after
    one prefill of ``token_ids`` into a temporary cache of ``dtype`` (freed on return)."""
    cfg = model.cfg
    nblocks = -(-len(token_ids) // block_size)
    pool = KVPool(cfg.num_hidden_layers, nblocks, block_size,
                  cfg.kv_heads_for(model.comm.world_size), cfg.head_dim, dtype, device)
    plan = StepPlan.build([SeqChunk(list(token_ids), 0, list(range(nblocks)), True)],
                          block_size, attn).to(device)
    model(plan.input_ids, plan.positions, pool.layers, plan.metadata(attn))
    n = len(token_ids)  # the slots written: the first n of blocks 0.. (the rest: garbage)
    amax = torch.stack([torch.stack((k.flatten(0, 1)[:n].abs().amax(),
                                     v.flatten(0, 1)[:n].abs().amax()))
                        for k, v in pool.layers]).float()
    del pool
    return amax


def scales_from_amax(amax: torch.Tensor, headroom: float = HEADROOM) -> torch.Tensor:
    """``amax * headroom / 448`` per entry; 1.0 where ``amax`` is 0 (nothing to scale)."""
    scales = amax.double() * headroom / FP8_MAX
    return torch.where(amax > 0, scales, torch.ones_like(scales)).float()


def calibrate_kv_scales(model, attn, token_ids: list[int], block_size: int,
                        dtype: torch.dtype, device: torch.device,
                        headroom: float = HEADROOM) -> torch.Tensor:
    """Sets every layer's ``kv_scale`` from one calibration prefill (see the module
    docstring); returns the scales, ``[num_layers, 2]`` (a copy, on ``device``)."""
    amax = kv_amax(model, attn, token_ids, block_size, dtype, device)
    amax = model.comm.all_reduce_max(amax)
    scales = scales_from_amax(amax, headroom)
    for layer, s in zip(model.model.layers, scales, strict=True):
        layer.self_attn.kv_scale.copy_(s)
    return scales


def describe_kv_scales(model, kv_dtype: torch.dtype, hadamard: bool,
                       calibration_tokens: int) -> str:
    """How the FP8 cache's scales were chosen, for the memory plan's log line ("" for
    other cache dtypes); reads ``model``'s scales once, at start-up. ``calibration_tokens``:
    the tokens ``calibrate_kv_scales`` ran over (0: not calibrated)."""
    if not is_fp8(kv_dtype):
        return ""
    if hadamard:
        rotated = "K Hadamard-rotated"
    elif model.kv_scales_from_checkpoint:
        rotated = "K not rotated: the checkpoint's scales are for unrotated K"
    else:
        rotated = "K not rotated (--kv-cache-hadamard)"
    scales = model.kv_scales()
    if model.kv_scales_from_checkpoint:
        how = "scales from the checkpoint"
    elif calibration_tokens:
        how = f"scales calibrated on {calibration_tokens} tokens"
    else:
        return ("scales 1.0 (the checkpoint has none; --calculate-kv-scales computes "
                f"them), {rotated}")
    return (f"{how} (K {scales[:, 0].min().item():.3g}..{scales[:, 0].max().item():.3g}, "
            f"V {scales[:, 1].min().item():.3g}..{scales[:, 1].max().item():.3g}), "
            f"{rotated}")
