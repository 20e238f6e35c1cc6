"""Builds the model for this rank and loads its shards."""

from __future__ import annotations

import logging

import torch
from torch import nn

from tpserve.model.attention.backend import AttentionBackend
from tpserve.model.kernels.backend import Ops
from tpserve.model.loader.checkpoint import Checkpoint
from tpserve.model.registry import model_class
from tpserve.model.weight_offload import place_layers
from tpserve.parallel.comm import Communicator

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DTYPE_NAMES = ("bfloat16", "float16", "float32")  # the resolved, canonical names


def resolve_dtype(name: str, device: torch.device, integer_weights: bool = False) -> str:
    """The canonical dtype name (``DTYPE_NAMES``) for a ``--dtype`` value: ``auto`` is
    bf16 on GPU (fp16 for a GPTQ / AWQ checkpoint, ``integer_weights``: its scales are
    fp16, which bf16 would round, and vLLM serves these in fp16 too) and fp32 on CPU.
    Called once, when the config tree is built."""
    if name == "auto":
        if device.type != "cuda":
            return "float32"
        return "float16" if integer_weights else "bfloat16"
    if name not in DTYPES:
        raise ValueError(f"unknown --dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return str(DTYPES[name]).removeprefix("torch.")


def build_model(ckpt: Checkpoint, comm: Communicator, device: torch.device,
                dtype: torch.dtype, ops: Ops, attn: AttentionBackend, max_positions: int,
                show_progress: bool = False, tp_comm: str = "allreduce",
                quant_method=None, lm_head: bool = True,
                expert_parallel: bool = False, cpu_offload_bytes: int = 0) -> nn.Module:
    """The model with this rank's shards loaded. With a ``quant_method`` each linear layer
    then processes (quantizes) its loaded shard, layer by layer in module order on every
    rank, and the loaded copy is freed: ``parameters()`` then counts what is served.
    ``lm_head`` False: the model of a pooling runner, without an LM head;
    ``expert_parallel``: a mixture of experts' experts split whole over the ranks;
    ``cpu_offload_bytes`` > 0: the decoder layers are built and loaded in host memory, then
    placed on ``device`` one at a time, the last ones streamed from host memory so that the
    device holds at least that many fewer bytes (``model.weight_stream``)."""
    cfg = ckpt.config
    cfg.check_tensor_parallel(comm.world_size)
    padding = cfg.describe_padding(comm.world_size)
    if padding and comm.rank == 0:
        logger.warning(padding)  # a cost the user chose by --tensor-parallel-size
    host = torch.device("cpu")
    with torch.device(device):
        model = model_class(cfg.architecture)(cfg, comm, ops, attn, dtype, max_positions,
                                                  tp_comm=tp_comm, quant_method=quant_method,
                                                  lm_head=lm_head,
                                                  expert_parallel=expert_parallel,
                                                  layers_device=host if cpu_offload_bytes
                                                  else None)
    if cfg.classifier_from_token:  # the label tokens' ids, for the head built at load
        model.classifier_token_ids = label_token_ids(ckpt.tokenizer(),
                                                     cfg.classifier_from_token)
    ckpt.load_into(model, show_progress)

    def process(modules) -> None:  # (name, module) pairs, in module order
        if quant_method is None:
            return
        for name, sub in modules:
            finish = getattr(sub, "process_weights_after_loading", None)
            if finish is not None:
                try:
                    finish()
                except ValueError as e:
                    raise ValueError(f"{ckpt.description}: {name}: {e}") from None

    if cpu_offload_bytes:
        # all but the decoder layers now; each layer once it is on the device
        process((name, m) for name, m in model.named_modules()
                if name != "model.layers" and not name.startswith("model.layers."))

        def agree(count: int) -> int:  # the largest count any rank needs
            t = torch.tensor([-count], dtype=torch.int64, device=device)
            return -int(comm.all_reduce_min(t).item())

        model.weight_stream = place_layers(
            model.model.layers, device, cpu_offload_bytes,
            lambda i, layer: process(layer.named_modules(prefix=f"model.layers.{i}")), agree)
    else:
        process(model.named_modules())
    if device.type == "cuda" and (quant_method is not None or cpu_offload_bytes):
        torch.cuda.empty_cache()  # the loaded copies: the memory plan reads free memory
    return model.eval()


def label_token_ids(tokenizer, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """Each label token's id in ``tokenizer``'s vocabulary (``convert_tokens_to_ids``, as
    vLLM maps ``classifier_from_token``); ValueError naming a token it does not have."""
    ids = []
    for token in tokens:
        i = tokenizer.convert_tokens_to_ids(token)
        if i is None or (i == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the "
                             "model's tokenizer")
        ids.append(int(i))
    return tuple(ids)
