"""What a rank needs to build its model and KV pool: ``RunnerConfig``, resolved once at
start-up (part of the server's config tree), and the context-length rule."""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.model.config import ModelConfig
from tpserve.model.families import architecture_family
from tpserve.model.kernels.backend import KERNEL_BACKENDS
from tpserve.model.kv_cache_dtype import KV_CACHE_DTYPE_NAMES, KV_CACHE_DTYPES, is_fp8
from tpserve.model.loader.build import DTYPE_NAMES
from tpserve.model.lora.adapter import LoraConfig
from tpserve.model.pooling import RUNNERS, PoolerConfig
from tpserve.model.quant.fp8 import DEFAULT_FAST_ACCUM, DEFAULT_WEIGHT_ONLY_MAX_TOKENS
from tpserve.model.quant.methods import QUANTIZATIONS
from tpserve.parallel.comm import TP_COMM_MODES

DEVICES = ("cuda", "cpu")


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """What a rank needs to build its model and KV pool (part of the server's config tree).

    Every value is concrete: ``server.config`` resolves the ``auto`` flags (dtype, KV cache
    dtype, device, kernel back-end) before this is built, and nothing resolves them later.
    The defaults describe a CPU runner. The bounds of the steps it runs come separately
    (``StepLimits``: the scheduler's limits)."""

    model: str | None = None
    load_format: str = "auto"
    # --hf-overrides as canonical JSON (loader/hf_overrides), laid over config.json
    hf_overrides: str | None = None
    # --tokenizer: a local tokenizer folder (a repository id is fetched by the config)
    tokenizer: str | None = None
    # --generation-config (auto | vllm | FOLDER): whose generation_config.json eos ids end
    # a generation beside the model's (model/generation_config.py)
    generation_config: str = "auto"
    dtype: str = "float32"
    kv_cache_dtype: str = "float32"
    # fp8 cache, checkpoint without KV scales: calibrate them at start-up (kv_calibration)
    calculate_kv_scales: bool = False
    # q and K rotated by a Hadamard matrix after RoPE (kv_hadamard; resolved by the config)
    kv_cache_hadamard: bool = False
    seed: int = 0
    device: str = "cpu"
    kernel_backend: str = "torch"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None  # the KV pool in blocks a rank (vLLM's)
    # --kv-offloading-size: host memory for the prefix cache's second tier, in bytes,
    # summed over the tensor-parallel ranks (model/kv_offload.py); 0: none
    kv_offloading_bytes: int = 0
    # --cpu-offload-gb: at least this many bytes of each rank's weights held in host memory
    # instead of device memory, the last decoder layers streamed (model/weight_offload.py)
    cpu_offload_bytes: int = 0
    enforce_eager: bool = False
    cuda_graph_max_tokens: int = 512
    disable_custom_all_reduce: bool = False
    tp_comm: str = "allreduce"
    # --enable-expert-parallel: a mixture of experts' experts split whole over the ranks
    expert_parallel: bool = False
    quantization: str = "none"
    fp8_weight_only_max_tokens: int = DEFAULT_WEIGHT_ONLY_MAX_TOKENS
    fp8_fast_accum: bool = DEFAULT_FAST_ACCUM  # --fp8-fast-accum: _scaled_mm's fp8 sums
    overlap_attention: bool = False  # --overlap-attention: decode beside prefill (Triton, CUDA)
    memory_history: int = 0  # allocator events kept per rank (--memory-history); 0: off
    nvtx: bool = False  # named NVTX ranges (--nvtx); a no-op off CUDA
    # --disable-sliding-window: full attention, the context capped at the window
    disable_sliding_window: bool = False
    # --runner: generate (an LM head, sampling) or pooling (no LM head: embeddings, the
    # pooling given by ``pooler``; steps run eagerly, no CUDA graphs)
    runner: str = "generate"
    pooler: PoolerConfig | None = None
    # --enable-lora: the adapters served, each in its slot (model/lora); None: no LoRA
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        for flag, value, names in (("--dtype", self.dtype, DTYPE_NAMES),
                                   ("--kv-cache-dtype", self.kv_cache_dtype,
                                    KV_CACHE_DTYPE_NAMES)):
            if value not in names:
                raise ValueError(f"{flag} must be one of {', '.join(names)} once "
                                 f"resolved, got {value!r}")
        if self.calculate_kv_scales and not is_fp8(KV_CACHE_DTYPES[self.kv_cache_dtype]):
            raise ValueError("--calculate-kv-scales needs --kv-cache-dtype fp8; the KV cache "
                             f"is {self.kv_cache_dtype}, which has no scales")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)} once resolved, "
                             f"got {self.device!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"--kernel-backend must be one of {', '.join(KERNEL_BACKENDS)} "
                             f"once resolved, got {self.kernel_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError("--cuda-graph-max-tokens must be >= 0")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("--kv-cache-memory must be a positive number of bytes")
        if self.num_gpu_blocks_override is not None:
            if self.num_gpu_blocks_override < 1:
                raise ValueError("--num-gpu-blocks-override must be >= 1, got "
                                 f"{self.num_gpu_blocks_override}")
            if self.kv_cache_memory is not None:
                raise ValueError("--num-gpu-blocks-override and --kv-cache-memory both size "
                                 "the KV pool: give one")
        if self.kv_offloading_bytes < 0:
            raise ValueError("--kv-offloading-size must be >= 0 GiB")
        if self.tp_comm not in TP_COMM_MODES:
            raise ValueError(f"--tp-comm must be one of {', '.join(TP_COMM_MODES)}; got "
                             f"{self.tp_comm!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}; got "
                             f"{self.quantization!r}")
        if self.fp8_weight_only_max_tokens < 0:
            raise ValueError("--fp8-weight-only-max-tokens must be >= 0, got "
                             f"{self.fp8_weight_only_max_tokens}")
        if self.memory_history < 0:
            raise ValueError(f"--memory-history must be a number of events >= 1, got "
                             f"{self.memory_history}")
        if self.memory_history and self.device != "cuda":
            raise ValueError(f"--memory-history records the CUDA caching allocator's events, "
                             f"but this server runs on {self.device} (no CUDA device): "
                             "leave the flag out, or serve on a GPU")

        if self.runner not in RUNNERS:
            raise ValueError(f"--runner must be one of {', '.join(RUNNERS)} once resolved, "
                             f"got {self.runner!r}")
        if (self.pooler is not None) != self.pooling:
            raise ValueError("a pooler config goes with --runner pooling, and only with it")
        if self.cpu_offload_bytes < 0:
            raise ValueError("--cpu-offload-gb must be >= 0")
        if self.cpu_offload_bytes and self.lora is not None:
            raise ValueError("--cpu-offload-gb with --enable-lora: the adapters rebuild the "
                             "layers' weights, which offloading streams from host memory; "
                             "serve the adapters without offloading")
        if self.lora is not None and self.pooling:
            raise ValueError("--enable-lora serves adapters for generation; --runner pooling "
                             "(embeddings, classifiers) takes none")

    @property
    def pooling(self) -> bool:
        return self.runner == "pooling"

    @property
    def uses_cuda_graphs(self) -> bool:
        """Graphs capture decode and mixed steps' logits; a pooling runner has neither."""
        return self.device == "cuda" and not self.enforce_eager and not self.pooling


def model_context(model: ModelConfig) -> int:
    """The model's context: ``resolve_max_model_len``'s rule."""
    if model.context_cap is not None:  # --disable-sliding-window: the window caps it
        return min(_scaled_context(model), model.context_cap)
    return _scaled_context(model)


def _scaled_context(model: ModelConfig) -> int:
    scaling = model.rope_scaling
    # Gemma 3's max_position_embeddings already counts its full layers' linear scaling
    # (vLLM skips the factor for gemma3 alike)
    if (scaling is None or scaling.rope_type in ("llama3", "freq_factors")
            or architecture_family(model.architecture) == "Gemma3ForCausalLM"):
        return model.max_position_embeddings
    if scaling.rope_type == "yarn":
        return int(scaling.original_max_position_embeddings * scaling.factor)
    if scaling.rope_type == "longrope":  # the short factors' context (rope_scaling.RopeScaling)
        return scaling.original_max_position_embeddings
    return int(model.max_position_embeddings * scaling.factor)


def resolve_max_model_len(requested: int | None, model: ModelConfig) -> int:
    """The model's context when ``requested`` is None; else ``requested``, which must not
    exceed it.

    The context is derived as vLLM's ``_get_and_verify_max_len`` derives it:
    ``max_position_embeddings``, except under RoPE scaling that stretches positions
    (``model_context``): ``linear`` multiplies it by the factor, and ``yarn`` is
    ``original_max_position_embeddings`` times the factor whatever
    ``max_position_embeddings`` says (Qwen2.5 and Qwen3 configs with YaRN added by hand keep
    the original context there, e.g. 32768 x 4 = 131072). ``llama3`` is not multiplied:
    its ``max_position_embeddings`` is already the long context. A sliding window does not
    cap it (its layers attend to the window only), unless ``--disable-sliding-window``
    turned it off (``ModelConfig.context_cap``, vLLM's rule). One cap is ours, not vLLM's: under
    ``longrope`` ``original_max_position_embeddings`` (the long factors are not served:
    ``rope_scaling.RopeScaling``)."""
    context = limit = model_context(model)
    if requested is None:
        return limit
    if requested > limit:
        scaling = model.rope_scaling
        why = ""
        if scaling is not None and scaling.rope_type == "longrope" and limit == context:
            why = (" (LongRoPE: up to original_max_position_embeddings; past it transformers "
                   "switches the whole sequence, cached keys included, to the long factors, "
                   "which tpserve's static RoPE table cannot do)")
        raise ValueError(f"--max-model-len {requested} exceeds the model's context of {limit} "
                         f"tokens{why}")
    return requested
