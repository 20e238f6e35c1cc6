"""Weights read again in place (``--enable-sleep-mode``'s ``POST /reload_weights``, and
vLLM's ``collective_rpc("reload_weights")``): a reinforcement-learning loop's trainer
writes a new checkpoint of the same model and the server serves it without a restart.

Every rank opens the checkpoint (without a path, the one served now is read again: the
start-up's or the last one read, e.g. after the trainer overwrote its folder), checks that it is the same model (``ModelConfig``
equal: architecture, shapes, vocabulary), agrees with the others (one all-reduce), then
reads its shards into the same tensors (``Checkpoint.load_into``), so the CUDA graphs stay
valid. Only a model whose served tensors are the checkpoint's can (``sleep.level2_refusal``
names the others). A load that fails on any rank after the check (a tensor missing, a
read error) is undone on every rank by reading the previous checkpoint again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from tpserve.model.loader.checkpoint import Checkpoint, open_checkpoint
from tpserve.model.sleep import level2_refusal

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
    ckpt = open_checkpoint(path, cfg.load_format, cfg.seed, cfg.hf_overrides, cfg.tokenizer,
                           cfg.disable_sliding_window)
    if ckpt.config != runner.model_config:
        old, new = vars(runner.model_config), vars(ckpt.config)
        diff = [f"{k} {old[k]!r} -> {new[k]!r}" for k in old if old[k] != new[k]]
        raise ValueError(f"{path} is not the served model's shape: {'; '.join(diff[:4])}")
    if (ckpt.quantization is None) != (runner.ckpt.quantization is None):
        raise ValueError(f"{path}: quantized unlike the served checkpoint")
    return ckpt


def agreed_reload(runner: ModelRunner, path: str) -> dict[str, float | str]:
    """Every rank, in lockstep: the weights of ``path`` (or the served checkpoint) read
    into the model. ValueError (every rank serving what it served before) if any rank
    could not open or check it, or could not load it."""
    why = reload_refusal(runner)
    if why is not None:  # the same on every rank: no collective needed to agree
        raise ValueError(f"the weights cannot be read again in place: {why}")
    if runner.sleep_state.weights_asleep:
        raise ValueError("the weights are asleep: POST /wake_up?tags=weights first")
    ckpt, error = None, None
    try:
        ckpt = _open(runner, path)
    except (OSError, ValueError) as e:
        error = e
    if not runner.sleep_state.all_ok(error is None):
        raise ValueError(f"reload: {error or 'another rank could not open the checkpoint'}")
    t0 = time.monotonic()
    try:
        ckpt.load_into(runner.model, False)
    except (OSError, ValueError, RuntimeError) as e:
        error = e
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    if not runner.sleep_state.all_ok(error is None):
        runner.ckpt.load_into(runner.model, False)  # the previous weights, every rank
        raise ValueError(f"reload: {error or 'another rank could not load it'}; the "
                         "previous weights were read again")
    runner.ckpt = ckpt  # a level-2 sleep now reads this one
    return {"path": path or None, "description": ckpt.description,
            "seconds": round(time.monotonic() - t0, 3)}
