"""LoRA adapters as PEFT saves them (``adapter_config.json`` and
``adapter_model.safetensors``), read and checked against what tpserve applies.

tpserve applies LoRA to the attention and MLP projections (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, and Phi-3's fused
``qkv_proj`` and ``gate_up_proj``: ``TARGETS``) of every family it serves, a mixture of experts' shared expert and dense layers included (not its
routed experts). What it would have to ignore is refused by name: DoRA, LoRA biases,
``modules_to_save`` (fully trained embeddings or heads), per-module ranks or alphas
(``rank_pattern``, ``alpha_pattern``), adapters on other modules (embeddings, the LM head),
a rank above ``--max-lora-rank``, and pickled ``adapter_model.bin`` files.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tpserve.model.checkpoint_names import LANGUAGE_MODEL_PREFIXES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the part of a fused checkpoint projection (Phi-3's ``qkv_proj``, ``gate_up_proj``): one
# A for every part, B's rows every part's stacked in ``checkpoint_parts()`` order
FUSED = "fused"
# a checkpoint projection -> (our fused layer, its part: ``checkpoint_parts()``'s id)
TARGETS = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", None), "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
    "qkv_proj": ("qkv_proj", FUSED), "gate_up_proj": ("gate_up_proj", FUSED),
}
# PEFT's tensor names: ``base_model.model.<module>.lora_A[.<adapter name>].weight``
_TENSOR = re.compile(r"^base_model\.model\.(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoraModule:
    """One adapter served under ``name`` (``--lora-modules name=path``): ``path`` a local
    PEFT folder, ``base_model_name`` the model /v1/models names as its parent (None: the
    served model)."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoraModule:
        """One ``--lora-modules`` entry: ``NAME=PATH`` or vLLM's JSON object form."""
        if text.lstrip().startswith("{"):
            try:
                raw = json.loads(text)
                return cls(str(raw["name"]), str(raw["path"]), raw.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {text!r}: a JSON entry needs \"name\" and "
                                 f"\"path\" ({e})") from None
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: expected NAME=PATH")
        return cls(name, path)


@dataclass(frozen=True)
class LoraConfig:
    """The adapters served (``--enable-lora``), each in its own slot: ``modules[i]`` is slot
    ``i``, fixed at start-up. ``max_loras`` slots of rank ``max_lora_rank`` are allocated
    on every LoRA layer (vLLM's flags)."""

    modules: tuple[LoraModule, ...]
    max_loras: int
    max_lora_rank: int
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: adapters loaded into free slots (and
    # unloaded) while serving, by /v1/load_lora_adapter and /v1/unload_lora_adapter
    runtime_updates: bool = False

    def __post_init__(self) -> None:
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}")
        if len(self.modules) > self.max_loras:
            raise ValueError(f"--lora-modules gives {len(self.modules)} adapters but "
                             f"--max-loras is {self.max_loras}: every adapter tpserve serves "
                             "keeps a slot on the device; raise --max-loras")

    def slot_of(self, name: str) -> int | None:
        """The slot of the adapter served as ``name``; None for any other name."""
        return next((i for i, m in enumerate(self.modules) if m.name == name), None)


@dataclass(frozen=True)
class AdapterConfig:
    """What ``adapter_config.json`` says that changes the answer."""

    rank: int
    alpha: float
    rslora: bool

    @property
    def scale(self) -> float:
        """PEFT's ``scaling``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def read_adapter_config(folder: str | Path, max_rank: int) -> AdapterConfig:
    """The folder's adapter config; ValueError naming what tpserve cannot apply."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{folder}: no {CONFIG_FILE} (a PEFT LoRA adapter folder has one)")
    raw = json.loads(path.read_text())  # a JSONDecodeError is a ValueError
    if not isinstance(raw, dict):
        raise ValueError(f"{folder}: {CONFIG_FILE} is not a JSON object")
    kind = raw.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{folder}: peft_type {kind!r}; only LORA adapters are served")
    refused = {
        "use_dora": "DoRA (use_dora)",
        "modules_to_save": "modules_to_save (fully trained modules beside the adapter)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out (transposed, Conv1D-style weights)",
        "lora_bias": "LoRA biases (lora_bias)",
    }
    for key, what in refused.items():
        if raw.get(key):
            raise ValueError(f"{folder}: {what} is not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{folder}: bias {raw['bias']!r} (trained biases) is not supported; "
                         "only bias 'none'")
    rank, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ValueError(f"{folder}: r must be an integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{folder}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise ValueError(f"{folder}: rank {rank} exceeds --max-lora-rank {max_rank}")
    if rank < 1:
        raise ValueError(f"{folder}: rank {rank} must be at least 1")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora")))


def _module_path(peft_module: str) -> str:
    """Our name of a module: a multimodal checkpoint's language model's renamed as the
    model's own weights are (``checkpoint_names.LANGUAGE_MODEL_PREFIXES``)."""
    for theirs, ours in LANGUAGE_MODEL_PREFIXES.items():
        if peft_module.startswith(theirs):
            return ours + peft_module[len(theirs):]
    return peft_module


AdapterLayout = dict[tuple[str, object], tuple[str, str]]


def read_adapter_layout(folder: str | Path, max_rank: int
                        ) -> tuple[AdapterConfig, AdapterLayout]:
    """The adapter's config and where its matrices are: ``(our layer's path, part) ->
    (A's tensor name, B's)``, their shapes checked from the file's header (no tensor is
    read: the start-up check). ValueError for anything ``read_adapter_config`` refuses,
    a module outside ``TARGETS``, a rank that is not the config's, or an A without its
    B."""
    cfg = read_adapter_config(folder, max_rank)
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        pickled = (Path(folder) / "adapter_model.bin").is_file()
        raise ValueError(f"{folder}: no {WEIGHTS_FILE}" + (
            " (adapter_model.bin is a pickle, which tpserve does not load: save the adapter "
            "with safe_serialization=True)" if pickled else ""))
    halves: dict[tuple[str, object], dict[str, str]] = {}
    shapes: dict[str, list[int]] = {}
    with _weights(folder) as f:
        names = sorted(f.keys(), key=lambda n: _TENSOR.match(n) is None)  # LoRA's first
        for name in names:
            m = _TENSOR.match(name)
            if m is None:
                raise ValueError(f"{folder}: tensor {name!r} is not a LoRA A or B matrix of a "
                                 "projection (a module trained beside the adapter?)")
            module, _, proj = _module_path(m.group(1)).rpartition(".")
            if proj not in TARGETS:
                raise ValueError(f"{folder}: an adapter on {m.group(1)!r}; tpserve applies "
                                 f"LoRA to {', '.join(TARGETS)} only")
            layer, part = TARGETS[proj]
            halves.setdefault((f"{module}.{layer}", part), {})[m.group(2)] = name
            shapes[name] = f.get_slice(name).get_shape()
    layout: AdapterLayout = {}
    for key, pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{folder}: {key[0]} part {key[1]} has only {', '.join(pair)}")
        a, b = shapes[pair["lora_A"]], shapes[pair["lora_B"]]
        if len(a) != 2 or len(b) != 2 or a[0] != cfg.rank or b[1] != cfg.rank:
            raise ValueError(f"{folder}: {key[0]}: lora_A {tuple(a)} and lora_B "
                             f"{tuple(b)} are not of rank {cfg.rank} (the config's r)")
        layout[key] = (pair["lora_A"], pair["lora_B"])
    if not layout:
        raise ValueError(f"{folder}: {WEIGHTS_FILE} holds no LoRA tensors")
    return cfg, layout


def read_adapter(folder: str | Path, max_rank: int
                 ) -> tuple[AdapterConfig, dict[tuple[str, object], tuple[torch.Tensor,
                                                                          torch.Tensor]]]:
    """The adapter's config and its tensors: ``(our layer's path, part) -> (A, B)`` in the
    checkpoint's shapes (``A [r, in]``, ``B [out, r]``), after ``read_adapter_layout``'s
    checks."""
    cfg, layout = read_adapter_layout(folder, max_rank)
    with _weights(folder) as f:
        return cfg, {key: (f.get_tensor(a), f.get_tensor(b)) for key, (a, b) in layout.items()}


@contextlib.contextmanager
def _weights(folder: str | Path) -> Iterator[Any]:
    """The folder's ``WEIGHTS_FILE`` opened; a file safetensors cannot read (truncated,
    not safetensors at all) is a ValueError naming it, as every other refusal here."""
    try:
        with safe_open(str(Path(folder) / WEIGHTS_FILE), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{folder}: {WEIGHTS_FILE} cannot be read: {e}") from None
