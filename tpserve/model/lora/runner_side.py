"""A model runner's LoRA side (``--enable-lora``): the step's per-token slots
(``parallel.lora.LoraBatch``), every LoRA-able layer's slots with the start-up adapters
(``attach.attach_lora``), and an adapter loaded into a slot on every rank while serving
(``load``: the runner's ``CMD_LORA`` brings the ranks here together)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from tpserve.model.lora.adapter import LoraConfig
from tpserve.model.lora.attach import attach_lora, clear_slot, load_adapter, lora_layers
from tpserve.parallel.lora import LoraBatch

logger = logging.getLogger(__name__)


class RunnerLora:
    def __init__(self, model: nn.Module, cfg: LoraConfig, max_tokens: int,
                 dtype: torch.dtype, device: torch.device, log: bool):
        """``max_tokens``: the most tokens a forward may take (padding included); ``log``:
        this rank writes the start-up line. The slots count as weights in the plan."""
        self.model = model
        self.cfg = cfg
        self.batch = LoraBatch(max_tokens, cfg.max_loras, cfg.max_lora_rank, dtype, device)
        nbytes = attach_lora(model, cfg, self.batch)
        if device.type == "cuda":  # the weights' old storage (now in w_ext): the plan reads
            torch.cuda.empty_cache()  # free memory and counts what the parameters hold
        if log:
            logger.info("LoRA: %d adapter(s) (%s) in %d slot(s) of rank %d on every "
                        "projection: %.1f MiB per rank", len(cfg.modules),
                        ", ".join(m.name for m in cfg.modules) or "none", cfg.max_loras,
                        cfg.max_lora_rank, nbytes / 2**20)

    def all_base(self) -> None:
        """Profiling and warm-up steps run the adapters' products (masked: every token on
        the base model), so their workspace is measured and nothing new is allocated
        later."""
        self.batch.set(None, True)

    def load(self, slot: int, path: str,
             gather_ints: Callable[[list[int]], list[list[int]]]) -> None:
        """Every rank: the adapter folder ``path`` into ``slot``, then one all-gather
        (``gather_ints``) of who could. ValueError if any rank could not: the slot is then
        clear on every rank."""
        layers = lora_layers(self.model)
        error = None
        try:
            load_adapter(layers, self.cfg.max_lora_rank, slot, path, path)
        except (ValueError, OSError) as e:
            error = str(e)
        failed = [r for r, (ok,) in enumerate(gather_ints([error is None])) if not ok]
        if failed:
            clear_slot(layers, slot)
            raise ValueError(error or f"rank(s) {failed} could not load {path}")
