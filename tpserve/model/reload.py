"""Weights read again in place (``--enable-sleep-mode``'s ``POST /reload_weights``, and
vLLM's ``collective_rpc("reload_weights")``): a reinforcement-learning loop's trainer
writes a new checkpoint of the same model and the server serves it without a restart.

Every rank opens the checkpoint (without a path, the one served now is read again: the
start-up's or the last one read, e.g. after the trainer overwrote its folder), checks that
it is the same model (``ModelConfig`` equal: architecture, shapes, vocabulary), agrees with
the others (one all-reduce), then reads its shards into the same tensors
(``Checkpoint.load_into``), so the CUDA graphs stay valid. Only a model whose served tensors
are the checkpoint's can (``reload_refusal`` names the others). The FP8 KV cache's scales
become the new checkpoint's, 1.0 where it has none (``kv_cache_dtype``); a checkpoint with
scales is refused where the cache holds rotated K and the served checkpoint had none. A
load that fails on any rank after the check (a tensor missing, a truncated file) is undone
on every rank by reading the previous checkpoint again; if that fails too, the engine fails
(``ReloadLostError``). With the weights asleep, the new checkpoint is what they wake up
from (vLLM's loop: sleep at level 2, train, load the new weights, wake).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from tpserve.model.fault import RELOAD
from tpserve.model.kv_cache_dtype import is_fp8
from tpserve.model.loader.checkpoint import Checkpoint, open_checkpoint
from tpserve.model.sleep import SleepError, level2_refusal

if TYPE_CHECKING:
    from tpserve.model.runner import ModelRunner


def reload_refusal(runner: ModelRunner) -> str | None:
    """Why this model's weights cannot be replaced in place, or None."""
    if runner.kv_calibration_tokens:
        return ("its FP8 KV cache scales were calibrated on the served weights at start-up "
                "(--calculate-kv-scales)")
    return level2_refusal(runner)


def _open(runner: ModelRunner, path: str) -> Checkpoint:
    """The checkpoint at ``path`` (the one served now when empty: the start-up's, or the
    last one read), checked to be the served model's. ValueError or OSError naming what
    differs."""
    cfg = runner.cfg
    if not path:
        return runner.ckpt
    # a dummy-served model given a path reads that checkpoint's weights
    load_format = "auto" if cfg.load_format == "dummy" else cfg.load_format
    ckpt = open_checkpoint(path, load_format, cfg.seed, cfg.hf_overrides, cfg.tokenizer,
                           cfg.disable_sliding_window, cfg.generation_config)
    if ckpt.config != runner.model_config:
        old, new = vars(runner.model_config), vars(ckpt.config)
        diff = [f"{k} {old[k]!r} -> {new[k]!r}" for k in old if old[k] != new[k]]
        raise ValueError(f"{path} is not the served model's shape: {'; '.join(diff[:4])}")
    if (ckpt.quantization is None) != (runner.ckpt.quantization is None):
        raise ValueError(f"{path}: quantized unlike the served checkpoint")
    if ckpt.kv_scales and not runner.ckpt.kv_scales and cfg.kv_cache_hadamard \
            and is_fp8(runner.kv_dtype):
        raise ValueError(f"{path} has FP8 KV cache scales, chosen for unrotated K, and this "
                         "server rotates K (--kv-cache-hadamard, on by default when the "
                         "checkpoint served at start-up has no scales); start it with "
                         "--no-kv-cache-hadamard to serve checkpoints with KV scales")
    return ckpt


class ReloadLostError(RuntimeError):
    """A failed load could not be undone: the weights are neither the old nor the new
    checkpoint's on some rank. The engine cannot serve on (it fails, as a failed step)."""


class ReloadUndo(NamedTuple):
    """What takes the last reload back (``runner.reload_undo``): the checkpoint served
    before it, and the sleep level of the weights it woke (0: they were awake)."""

    ckpt: Checkpoint
    woke: int


def agreed_reload(runner: ModelRunner, path: str,
                  undo: bool = False) -> dict[str, float | str | None]:
    """Every rank, in lockstep: the weights of ``path`` (or the served checkpoint; with
    ``undo``, the one served before the last reload) read into the model; with the weights
    asleep (``sleep.py``), they wake up from it. ValueError (every rank serving what it
    served before, or as asleep as before) if any rank could not open, check or load it;
    ReloadLostError if a failed load could not be undone. ``undo`` is how data parallelism
    takes back a reload that another replica could not make (``server/data_parallel.py``):
    weights the reload woke from their sleep go back to sleep (``ReloadUndo.woke``: the
    level they slept at), to wake from the checkpoint before; awake ones read it now."""
    why = reload_refusal(runner)
    if why is not None:  # the same on every rank: no collective needed to agree
        raise ValueError(f"the weights cannot be read again in place: {why}")
    state = runner.sleep_state
    ckpt, error = None, None
    try:
        if undo and runner.reload_undo is None:
            raise ValueError("no reload to undo")
        ckpt = runner.reload_undo.ckpt if undo else _open(runner, path)
    except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: agreed below
        error = e
    if not runner.comm.all_true(error is None):
        raise ValueError(f"reload: {error or 'another rank could not open the checkpoint'}")
    t0 = time.monotonic()
    woke = state.level if state.weights_asleep else 0
    if undo and runner.reload_undo.woke:  # back to sleep, to wake from ``ckpt``
        state.sleep_weights(runner.reload_undo.woke)
    elif state.weights_asleep:  # a wake-up of the weights from the new checkpoint
        try:
            state.agreed_wake(True, False, ckpt)
        except SleepError as e:
            raise ValueError(f"reload: {e}") from None
    else:
        _agreed_load(runner, ckpt)
    # a level-2 sleep now reads this one; an undo forgets the one it leaves
    runner.reload_undo = None if undo else ReloadUndo(runner.ckpt, woke)
    runner.ckpt = ckpt
    return {"path": path or None, "description": ckpt.description,
            "seconds": round(time.monotonic() - t0, 3)}


def _agreed_load(runner: ModelRunner, ckpt: Checkpoint) -> None:
    """``ckpt`` read into the awake weights on every rank, or, if any rank failed, the
    previous checkpoint read again on every rank (ValueError), or ReloadLostError."""
    error = None
    try:
        if runner.fault is not None:
            runner.fault.fire_event(RELOAD)
        ckpt.load_into(runner.model, False)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    except Exception as e:  # noqa: BLE001 - a truncated file, a missing tensor: agreed
        error = e
    if runner.comm.all_true(error is None):
        return
    try:  # the previous weights, on every rank
        runner.ckpt.load_into(runner.model, False)
        restored = None
    except Exception as e:  # noqa: BLE001 - agreed below
        restored = e
    if not runner.comm.all_true(restored is None):
        raise ReloadLostError(f"reload: {error or 'another rank could not load it'}, "
                              f"and the previous weights could not be read again "
                              f"({restored or 'on another rank'})")
    raise ValueError(f"reload: {error or 'another rank could not load it'}; the "
                     "previous weights were read again")
