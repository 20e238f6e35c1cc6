"""The model runner: one per rank. Builds the model and the KV pool from the memory plan,
receives each step's plan and runs the forward. Rank 0 drives (``execute``); ranks > 0
loop in ``worker_loop`` until told to shut down.

Invariant: every rank issues the same collectives in the same order. Start-up (load,
profile, agree on the block count) and every step are lockstep; rank 0 sends NOOP steps
while idle so the workers' waits never reach the collective timeout.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from tpserve.model.attention.backend import select_attention
from tpserve.model.cuda_graphs import StepGraphs, graph_reserve_bytes
from tpserve.model.fault import START, fault_from_env
from tpserve.model.gpu_processes import other_gpu_processes
from tpserve.model.kernels.backend import select_ops
from tpserve.model.kv_cache_dtype import KV_CACHE_DTYPES
from tpserve.model.kv_calibration import (
    calibrate_kv_scales,
    checkpoint_calibration_ids,
    describe_kv_scales,
)
from tpserve.model.kv_offload import HostKV, host_slots
from tpserve.model.kv_pool import KVPool, kv_bytes_per_block
from tpserve.model.layers.moe import experts_line
from tpserve.model.loader.build import DTYPES, build_model
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.lora.runner_side import RunnerLora
from tpserve.model.memory import (
    AllocatorReading,
    MemoryPlan,
    allocator_snapshot,
    allocator_stats,
    check_blocks_override,
    kv_budget,
    plan_from_ints,
    read_allocator,
    read_memory,
    start_memory_history,
)
from tpserve.model.memory_advice import (
    FitInputs,
    allocation_failed,
    explain_no_fit,
    explain_oom,
    explain_pool_oom,
    explain_start_oom,
    pool_flag,
    seq_options,
    smaller_kv_dtypes,
    tp_options,
)
from tpserve.model.plan import (
    CMD_KV_COPY,
    CMD_LORA,
    CMD_MEMORY,
    CMD_NOOP,
    CMD_RELOAD,
    CMD_SHUTDOWN,
    CMD_SLEEP,
    CMD_STEP,
    CMD_WAKE,
    HEADER_LEN,
    StepLimits,
    StepPlan,
)
from tpserve.model.pooling import PoolRows, sum_rows
from tpserve.model.prompt_logprobs import PromptLogprobs, score_prompt_rows, score_slice_rows
from tpserve.model.quant.methods import linear_method, served_quantization
from tpserve.model.quant.wna16_method import graph_scratch_bytes
from tpserve.model.reload import ReloadUndo, agreed_reload
from tpserve.model.runner_config import RunnerConfig, resolve_max_model_len
from tpserve.model.sleep import RankSleep, SleepError
from tpserve.model.startup_profile import profile_workspace, warm_kernels
from tpserve.model.weight_offload import offloadable_bytes, resident_weight_bytes
from tpserve.parallel.comm import Communicator
from tpserve.parallel.nvtx import Ranges
from tpserve.parallel.p2p_all_reduce import P2PAllReduce
from tpserve.parallel.state import (
    TPGroup,
    destroy_tp_group,
    init_tp_group,
    is_single_host,
    pick_device,
)

logger = logging.getLogger(__name__)

class ModelRunner:
    def __init__(self, cfg: RunnerConfig, limits: StepLimits, group: TPGroup,
                 show_progress: bool = False, ranges: Ranges | None = None):
        """``ranges``: the NVTX ranges of this rank's steps and collectives; default: from
        ``cfg.nvtx`` (tests pass a recording pair to see them off CUDA)."""
        self.cfg = cfg
        self.limits = limits
        if cfg.memory_history:  # before anything is allocated: the weights are recorded too
            start_memory_history(group.device, cfg.memory_history)
        self.ranges = ranges if ranges is not None else Ranges.for_device(cfg.nvtx,
                                                                          group.device)
        p2p = None if cfg.disable_custom_all_reduce else P2PAllReduce.create(
            group.group, group.world_size, group.device, is_single_host(group.world_size))
        self.comm = Communicator(group, p2p, self.ranges)
        self.device = device = group.device
        self.fault = fault_from_env(group.rank)  # test hook, parsed once; None when off
        if self.fault is not None:
            self.fault.fire(0, START)
        self.steps = 0
        # rank 0: the prompt log-probabilities of the last step run (None when its plan
        # scored no prompt rows); every run replaces them (see model/prompt_logprobs.py)
        self.prompt_logprobs: PromptLogprobs | None = None
        # rank 0, pooling runner: the pooled sums ``[count, hidden]`` float32 (device) of the
        # last step run (``model/pooling.PoolRows``), None when it pooled nothing
        self.pooled: torch.Tensor | None = None
        t0 = time.monotonic()
        free0, total = read_memory(device)
        self.ckpt = open_checkpoint(cfg.model, cfg.load_format, cfg.seed, cfg.hf_overrides,
                                    cfg.tokenizer, cfg.disable_sliding_window,
                                    cfg.generation_config)
        self.reload_undo: ReloadUndo | None = None  # what takes the last reload back
        mcfg = self.model_config = self.ckpt.config
        # validates only: the config tree holds the resolved length
        self.max_model_len = resolve_max_model_len(limits.max_model_len, mcfg)
        self.dtype = DTYPES[cfg.dtype]
        self.kv_dtype = KV_CACHE_DTYPES[cfg.kv_cache_dtype]
        self.ops = select_ops(cfg.kernel_backend)
        self.attn = select_attention(cfg.kernel_backend, self.kv_dtype, cfg.kv_cache_hadamard,
                                     cfg.overlap_attention, (self.dtype, device))
        quant = linear_method(cfg.quantization, cfg.kernel_backend, device, self.dtype,
                              cfg.fp8_weight_only_max_tokens, self.ckpt.quantization,
                              fast_accum=cfg.fp8_fast_accum)
        stored = served_quantization(cfg.quantization, self.ckpt.quantization)
        # a GGUF file served dequantized whose blocks --quantization gguf could hold
        dequantized = (self.ckpt.quantization if quant is None and getattr(
            self.ckpt.quantization, "dequantizable", False) else None)
        if quant is not None and group.rank == 0:
            products = (f"; {quant.describe_products()}"
                        if getattr(quant, "scaled_mm", False) else "")
            logger.info("linear layers: %s weights, %s%s", cfg.quantization,
                        f"as stored ({stored.describe()})" if stored else "quantized at load",
                        products)
        elif dequantized is not None and group.rank == 0:
            logger.info("linear layers: %s", dequantized.describe_dequantized(
                self.dtype.itemsize, cfg.dtype))
        try:
            self.model = build_model(self.ckpt, self.comm, device, self.dtype, self.ops,
                                     self.attn, self.max_model_len, show_progress,
                                     tp_comm=cfg.tp_comm, quant_method=quant,
                                     expert_parallel=cfg.expert_parallel,
                                     lm_head=not cfg.pooling,
                                     cpu_offload_bytes=cfg.cpu_offload_bytes)
        except RuntimeError as e:  # CUDA's OutOfMemoryError, or the CPU allocator's
            if not allocation_failed(e):
                raise
            raise MemoryError(explain_start_oom("loading the weights", str(e), str(device),
                                                group.rank, free0, total,
                                                other_gpu_processes(device))) from None
        tp = self.comm.world_size
        t, b = limits.max_num_batched_tokens, limits.max_num_seqs
        self.lora: RunnerLora | None = None
        if cfg.lora is not None:  # never with FP8 layers (RunnerConfig refuses them)
            self.lora = RunnerLora(self.model, cfg.lora, max(t, b) + tp, self.dtype, device,
                                   group.rank == 0)
        self.kv_calibration_tokens = 0
        if cfg.calculate_kv_scales and not self.model.kv_scales_from_checkpoint:
            self._calibrate_kv_scales()
        weights = resident_weight_bytes(self.model)
        stream = self.model.weight_stream
        if stream is not None:
            if group.rank == 0:
                logger.info(stream.describe())
            if device.type != "cuda":  # the host copy is in the same memory: no saving
                weights += stream.host_bytes
        if mcfg.num_experts and group.rank == 0:
            logger.info(experts_line(self.model, mcfg, weights))
        bs = limits.block_size
        self.max_blocks_per_seq = math.ceil(self.max_model_len / bs)
        self.max_payload = sum(StepPlan.payload_sizes(
            t, b, self.max_blocks_per_seq, sampled=b, extra=self.attn.max_plan_extra(t, b),
            pending=b, prompt=t, lora=t if cfg.lora is not None else 0))
        self.header_buf = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
        self.payload_buf = torch.zeros(self.max_payload, dtype=torch.int64, device=device)
        # the last step's sampled tokens (rank 0 stores them; see SeqChunk.pending_src)
        self.sampled_buf = torch.zeros(b, dtype=torch.int64, device=device)
        self._pin = device.type == "cuda"
        static = (HEADER_LEN + self.max_payload + b) * 8
        try:
            workspace, measured = profile_workspace(self)
        except RuntimeError as e:  # CUDA's OutOfMemoryError, or the CPU allocator's
            if not allocation_failed(e):
                raise
            raise MemoryError(explain_start_oom("profiling the largest step", str(e),
                                                str(device), group.rank, free0, total,
                                                other_gpu_processes(device))) from None
        kv_heads = mcfg.kv_heads_for(tp)
        per_block = kv_bytes_per_block(mcfg.num_hidden_layers, bs, kv_heads,
                                       mcfg.head_dim, self.kv_dtype)
        slots = host_slots(cfg.kv_offloading_bytes, tp, per_block)
        if cfg.kv_offloading_bytes and slots < 1:
            raise ValueError(f"--kv-offloading-size: {cfg.kv_offloading_bytes} bytes over "
                             f"{tp} rank(s) hold no KV block of {per_block} bytes")
        if slots:  # the copies' device staging buffers, allocated once (model/kv_offload)
            static += HostKV.staging_bytes(per_block, slots)
        workspace += static
        use_graphs = cfg.uses_cuda_graphs
        max_mixed = min(cfg.cuda_graph_max_tokens, t)
        # sequence parallel: graph buckets are whole multiples of tp (no padding inside)
        multiple = tp if cfg.tp_comm == "allgather" else 1
        # reserve for the graphs' pool: their logits outputs plus a margin; measured below
        graphs = (graph_reserve_bytes(b, max_mixed, mcfg.vocab_size, multiple)
                  + graph_scratch_bytes(self.model, max_mixed) if use_graphs else 0)
        override = cfg.num_gpu_blocks_override
        budget, how = kv_budget(device, total, free0, cfg.gpu_memory_utilization, weights,
                                workspace, graphs, cfg.kv_cache_memory)
        if override is not None:  # the same on every rank: nothing to agree
            warning = check_blocks_override(override, budget // per_block, how,
                                            self.max_blocks_per_seq, bs, self.max_model_len)
            if warning and group.rank == 0:
                logger.warning(warning)
            num_blocks, how = override, f"--num-gpu-blocks-override {override}"
        else:
            mine = torch.tensor([max(budget, 0) // per_block], dtype=torch.int64,
                                device=device)
            num_blocks = int(self.comm.all_reduce_min(mine).item())  # every rank measured
        stored_weights = None  # this rank's, the GGUF blocks held as stored: about
        if dequantized is not None:  # (the linear weights' saving split over the ranks)
            saved = (dequantized.dequantized_bytes(self.dtype.itemsize)
                     - dequantized.stored_bytes)
            stored_weights = max(weights - saved // tp, 0)
        self.fit = FitInputs(
            device.type, total, free0, cfg.gpu_memory_utilization,
            cfg.kv_cache_memory if override is None else override * per_block,
            weights, workspace, graphs, per_block, bs, self.max_model_len,
            self.kv_dtype.itemsize, b, tp, smaller_kv_dtypes(self.kv_dtype),
            tp_options(mcfg, tp, bs, self.kv_dtype, weights),
            seq_options(limits, mcfg.vocab_size, use_graphs, max_mixed, multiple),
            stored_weights, 0 if self.model.weight_stream is not None or self.lora is not None
            else offloadable_bytes(self.model.model.layers))
        if num_blocks < self.max_blocks_per_seq:
            raise MemoryError(explain_no_fit(self.fit, other_gpu_processes(device),
                                             str(device), group.rank))
        try:  # a pool the flags sized past what the device (or host) can allocate
            self.kv_pool = KVPool(mcfg.num_hidden_layers, num_blocks, bs, kv_heads,
                                  mcfg.head_dim, self.kv_dtype, device)
        except RuntimeError as e:
            if not allocation_failed(e):
                raise
            if device.type == "cuda":
                torch.cuda.empty_cache()  # free as read after the failed attempt
            raise MemoryError(explain_pool_oom(
                self.fit, pool_flag(how, cfg.gpu_memory_utilization), num_blocks, str(e),
                read_memory(device)[0], str(device), group.rank,
                other_gpu_processes(device))) from None
        self.host_kv: HostKV | None = None  # the prefix cache's host tier, if any
        if slots:
            self.host_kv = HostKV(self.kv_pool, slots, per_block)
            if group.rank == 0:
                logger.info("KV offloading: %d blocks (%d tokens) of %shost memory a rank, "
                            "%.2f GiB; device staging %.1f MiB", slots, slots * bs,
                            "pinned " if device.type == "cuda" else "",
                            self.host_kv.nbytes / 2**30,
                            HostKV.staging_bytes(per_block, slots) / 2**20)
        if device.type == "cuda":
            warm_kernels(self)
        self.graphs: StepGraphs | None = None
        self._graph_shape = (max_mixed, multiple)
        graphs_reserve, graphs = graphs, 0
        if use_graphs:
            graphs = self.capture_graphs()
        free_now, _ = read_memory(device)
        named = other_gpu_processes(device)
        others = named.used_bytes if named.processes else total - free0
        self.plan = MemoryPlan(str(device), total, free0, cfg.gpu_memory_utilization, weights,
                               workspace, measured, graphs, self.kv_pool.nbytes, num_blocks,
                               bs, per_block, self.max_model_len, how, rank=group.rank,
                               graphs_reserve=graphs_reserve, other_processes=others,
                               free=free_now, after_warmup=read_allocator(device),
                               kv_cache_dtype=cfg.kv_cache_dtype,
                               kv_scales=describe_kv_scales(
                                   self.model, self.kv_dtype, cfg.kv_cache_hadamard,
                                   self.kv_calibration_tokens))
        # every rank's plan, gathered once while the ranks are in lockstep
        self.rank_plans = [plan_from_ints(v) for v in self._gather_ints(self.plan.as_ints())]
        self.startup_s = time.monotonic() - t0
        self.segments_after_warmup = allocator_stats(device)["segments"]
        self.sleep_state = RankSleep(self)  # awake; sleep mode: ``sleep`` / ``wake_up``

    def capture_graphs(self) -> int:
        """Captures the CUDA graphs of every step bucket (start-up, and a wake-up from
        sleep: the weights' and the pool's addresses changed); returns their bytes."""
        max_mixed, multiple = self._graph_shape
        self.graphs = StepGraphs(self.model, self.kv_pool, self.attn,
                                 self.limits.max_num_seqs, self.max_blocks_per_seq,
                                 self.max_model_len, self.device, max_mixed,
                                 token_multiple=multiple,
                                 lora=self.lora.batch if self.lora else None)
        return self.graphs.capture()

    # ----------------------------------------------------------------- sleep mode
    def sleep(self, level: int) -> list[dict[str, float]]:
        """Rank 0, between steps, nothing running: every rank gives back its weights' (level
        1: copied to host memory first), KV pool's and graphs' device memory
        (``model/sleep.py``; ``CMD_SLEEP``). Returns each rank's figures. SleepError (every
        rank still awake) if any rank could not copy its weights to host memory."""
        self.send_command(CMD_SLEEP, level)
        return self.sleep_state.agreed_sleep(level)

    def wake_up(self, weights: bool, kv: bool) -> list[dict[str, float]]:
        """Rank 0, between steps: every rank takes back its weights and / or KV pool
        (``CMD_WAKE``); once both are back the CUDA graphs are captured again. Returns each
        rank's figures. SleepError (every rank as asleep as before) if any rank could not."""
        self.send_command(CMD_WAKE, int(weights), int(kv))
        return self.sleep_state.agreed_wake(weights, kv)

    def load_lora_adapter(self, slot: int, path: str) -> None:
        """Rank 0, between steps: every rank loads the adapter folder ``path`` into ``slot``
        (``CMD_LORA``; the workers in ``worker_loop``). ValueError if any rank could not:
        the slot is then cleared on every rank."""
        self._send_path(CMD_LORA, path, slot)
        self.lora.load(slot, path, self._gather_ints)

    def reload_weights(self, path: str, undo: bool = False) -> dict[str, float | str]:
        """Rank 0, between steps, no KV block in use: every rank reads the checkpoint at
        ``path`` (empty: the served one again; ``undo``: the one served before the last
        reload) into its weights in place (``CMD_RELOAD``; ``model/reload.py``).
        ValueError (every rank as before) if any rank could not."""
        self._send_path(CMD_RELOAD, path, int(undo))
        return agreed_reload(self, path, undo)

    def _send_path(self, cmd: int, path: str, *args: int) -> None:
        """Rank 0: a command naming a path: the header (``cmd``, ``args``, the path's byte
        count), then the path's bytes as the payload (``_received_path`` on the workers)."""
        data = path.encode()
        if len(data) > self.payload_buf.shape[0]:
            raise ValueError(f"a path of {len(data)} bytes is too long")
        self.send_command(cmd, *args, len(data))
        if self.comm.world_size > 1 and data:
            self.payload_buf[: len(data)].copy_(torch.tensor(list(data), dtype=torch.int64))
            self.comm.broadcast(self.payload_buf[: len(data)])

    def _received_path(self, n: int) -> str:
        if n:
            self.comm.broadcast(self.payload_buf[:n])
        return bytes(self.payload_buf[:n].tolist()).decode()

    def _calibrate_kv_scales(self) -> None:
        """Every layer's FP8 KV scales from one prefill of the calibration text (every rank,
        in lockstep: a forward and one all-reduce); its temporary cache is freed before the
        memory plan's profile."""
        t0 = time.monotonic()
        lim = self.limits
        ids = checkpoint_calibration_ids(
            self.ckpt, min(self.max_model_len, lim.max_num_batched_tokens), self.cfg.seed)
        try:
            calibrate_kv_scales(self.model, self.attn, ids, lim.block_size, self.dtype,
                                self.device)
        except torch.OutOfMemoryError as e:
            free, total = read_memory(self.device)
            raise MemoryError(explain_start_oom(
                "calibrating the KV cache scales (--no-calculate-kv-scales skips it)", str(e),
                str(self.device), self.comm.rank, free, total,
                other_gpu_processes(self.device))) from None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.kv_calibration_tokens = len(ids)
        if self.comm.rank == 0:
            logger.info("KV cache scales calibrated on %d tokens in %.1f s", len(ids),
                        time.monotonic() - t0)

    # ----------------------------------------------------------------- memory figures
    def _gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length on every rank), in rank order: one
        all-gather, so every rank must call it at the same point."""
        t = torch.tensor([values], dtype=torch.int64, device=self.device)
        return self.comm.all_gather(t, dim=0).cpu().tolist()

    def gather_allocator(self) -> list[AllocatorReading]:
        """Rank 0: every rank's allocator reading now, between steps (``CMD_MEMORY`` then
        one small all-gather; the host waits for the device once). Ranks > 0 answer it in
        ``worker_loop``."""
        self.send_command(CMD_MEMORY)
        return [AllocatorReading.from_ints(v)
                for v in self._gather_ints(read_allocator(self.device).as_ints())]

    def allocator_snapshot(self) -> bytes:
        """This rank's allocator segments and its recorded events (``--memory-history``) as
        the pickle https://pytorch.org/memory_viz reads; between steps."""
        if not self.cfg.memory_history:
            raise ValueError("the allocator's history is not recorded (--memory-history)")
        return allocator_snapshot(self.device)

    def explain_oom(self, exc: BaseException) -> str:
        """What an out-of-memory step asked for, what was free, what this server holds by
        component, other processes on the device, and the flags that would help."""
        free, _ = read_memory(self.device)
        return explain_oom(str(exc), self.plan, read_allocator(self.device), free,
                           other_gpu_processes(self.device), self.limits.max_num_batched_tokens)

    # ----------------------------------------------------------------------- stepping
    def execute(self, plan: StepPlan, pool: PoolRows | None = None) -> torch.Tensor:
        """Rank 0: send the plan to every rank, run it (``run``); returns the logits of the sampled
        rows ``[S, vocab]`` in the model's dtype (the sampler widens them to float32 where
        its pipeline changes them; a step of plain greedy rows takes their argmax as is).
        Nothing here waits for the device: on CUDA the plan goes up from pinned memory, so
        the host can prepare the next step meanwhile."""
        return self.run(self.upload(plan), pool)

    def upload(self, plan: StepPlan) -> StepPlan:
        """Rank 0, first half of ``execute``: the plan into the device buffers and to every
        rank; returns the device-side plan ``run`` takes."""
        header, payload = plan.pack()
        self._send(header, payload)
        if self.comm.world_size > 1 and plan.pending_rows.shape[0]:
            self.comm.broadcast(self.sampled_buf)
        return StepPlan.unpack(header, self.payload_buf[:payload.shape[0]])

    def _send(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        """Rank 0: a command's ``header`` (``HEADER_LEN`` int64) and ``payload`` into the
        device buffers, then to every rank. On CUDA they go up from pinned memory without
        waiting for the step before (the caching host allocator keeps each block until its
        copy is done). An empty payload is not sent."""
        n = payload.shape[0]
        if self._pin:
            header, payload = header.pin_memory(), payload.pin_memory()
        self.header_buf.copy_(header, non_blocking=True)
        self.payload_buf[:n].copy_(payload, non_blocking=True)
        if self.comm.world_size > 1:
            self.comm.broadcast(self.header_buf)
            if n:
                self.comm.broadcast(self.payload_buf[:n])

    def run(self, plan: StepPlan, pool: PoolRows | None = None) -> torch.Tensor:
        """Rank 0, second half of ``execute``: the forward of an uploaded plan; a pooling
        runner's ``pool`` rows summed into ``pooled`` (the other ranks need not know: a
        pooling runner never replays graphs, so every rank runs the same eager forward)."""
        with self.ranges.range("forward"):
            return self._run_explained(plan, pool)

    def store_sampled(self, token_ids: torch.Tensor) -> None:
        """Rank 0: keep this step's sampled tokens (device) for the next step's pending
        rows (``SeqChunk.pending_src``)."""
        self.sampled_buf[: token_ids.shape[0]].copy_(token_ids)

    def copy_kv(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]],
                batches: list[int], join: int = -1) -> None:
        """Rank 0: every rank runs a step's copies between its pool and its host tier now,
        ahead of the step (``BlockManager.take_copies``): the join of load batch ``join``
        (-1: none), the stores ``(block, slot)``, then the loads ``(slot, block)``, load
        ``i`` in batch ``batches[i]``, and the join again where it names one of those
        batches (``CMD_KV_COPY``, as many messages as the receive buffer needs; each one
        join, stores, or loads of one batch)."""
        cap = self.payload_buf.shape[0] // 2
        messages = [(0, 0, -1, join, [])] if join >= 0 else []
        for i in range(0, len(stores), cap):
            part = stores[i:i + cap]
            messages.append((len(part), 0, -1, -1, [b for b, _ in part] + [s for _, s in part]))
        i = 0
        while i < len(loads):  # a message per batch, or per cap
            end = i + 1
            while end < len(loads) and end - i < cap and batches[end] == batches[i]:
                end += 1
            part = loads[i:end]
            messages.append((0, len(part), batches[i], -1,
                             [s for s, _ in part] + [b for _, b in part]))
            i = end
        if loads and join >= batches[0]:
            messages.append((0, 0, -1, join, []))
        for n_stores, n_loads, batch, joined, ints in messages:
            if self.comm.world_size > 1:
                header = torch.zeros(HEADER_LEN, dtype=torch.int64)
                header[:5] = torch.tensor([CMD_KV_COPY, n_stores, n_loads, batch, joined])
                self._send(header, torch.tensor(ints, dtype=torch.int64))
            self._copy_kv(n_stores, n_loads, batch, joined, ints)

    @torch.inference_mode()
    def _copy_kv(self, n_stores: int, n_loads: int, batch: int, join: int,
                 ints: list[int]) -> None:
        """One message of ``copy_kv``: a join, stores (blocks, then slots) or loads (slots,
        then blocks), ``ints`` in halves."""
        assert self.host_kv is not None, "KV copies listed without a host tier"
        n = len(ints) // 2
        with self.ranges.range("kv_copy"):
            if join >= 0:
                self.host_kv.join(join)
            if n_stores:
                self.host_kv.store(ints[:n], ints[n:])
            elif n_loads:
                self.host_kv.load(ints[:n], ints[n:], batch)

    def send_command(self, cmd: int, *args: int) -> None:
        """Rank 0: a command's header (the command, then ``args``) to the workers: NOOP
        (heartbeat while idle), SHUTDOWN, and the commands of LoRA loads and sleep mode."""
        if self.comm.world_size > 1:
            self.header_buf.zero_()
            self.header_buf[:1 + len(args)] = torch.tensor([cmd, *args])
            self.comm.broadcast(self.header_buf)

    def worker_loop(self) -> None:
        """Ranks > 0: run every plan rank 0 sends until SHUTDOWN."""
        while True:
            self.comm.broadcast(self.header_buf)
            header = self.header_buf.cpu()
            cmd = int(header[0])
            if cmd == CMD_SHUTDOWN:
                return
            if cmd == CMD_NOOP:
                continue
            if cmd == CMD_MEMORY:
                self._gather_ints(read_allocator(self.device).as_ints())
                continue
            if cmd == CMD_LORA:
                path = self._received_path(int(header[2]))
                try:
                    self.lora.load(int(header[1]), path, self._gather_ints)
                except ValueError as e:  # rank 0 reports it; the slot is clear everywhere
                    logger.warning("rank %d: LoRA adapter %s: %s", self.comm.rank, path, e)
                continue
            if cmd == CMD_RELOAD:
                path = self._received_path(int(header[2]))
                try:
                    agreed_reload(self, path, bool(header[1]))
                except ValueError as e:  # rank 0 reports it; every rank is as before
                    logger.warning("rank %d: reload: %s", self.comm.rank, e)
                continue
            if cmd in (CMD_SLEEP, CMD_WAKE):
                try:
                    if cmd == CMD_SLEEP:
                        self.sleep_state.agreed_sleep(int(header[1]))
                    else:
                        self.sleep_state.agreed_wake(bool(header[1]), bool(header[2]))
                except SleepError as e:  # rank 0 reports it; every rank is as before
                    logger.warning("rank %d: %s", self.comm.rank, e)
                continue
            if cmd == CMD_KV_COPY:  # a join, stores or loads
                counts = [int(x) for x in header[1:5]]
                n = 2 * (counts[0] + counts[1])
                if n:
                    self.comm.broadcast(self.payload_buf[:n])
                self._copy_kv(*counts, self.payload_buf[:n].tolist())
                continue
            if cmd != CMD_STEP:
                raise RuntimeError(f"unknown command {cmd} from rank 0")
            with self.ranges.range("prepare"):
                n = StepPlan.payload_len(header)
                self.comm.broadcast(self.payload_buf[:n])
                plan = StepPlan.unpack(header, self.payload_buf[:n])
                if plan.pending_rows.shape[0]:
                    self.comm.broadcast(self.sampled_buf)
            with self.ranges.range("forward"):
                self._run_explained(plan)

    def _run_explained(self, plan: StepPlan, pool: PoolRows | None = None) -> torch.Tensor:
        """``_run``; an out-of-memory error is logged with ``explain_oom`` and re-raised
        (what happens next is the engine's recovery's business)."""
        try:
            return self._run(plan, pool)
        except torch.OutOfMemoryError as e:
            logger.error("rank %d: %s", self.comm.rank, self.explain_oom(e))
            raise

    @torch.inference_mode()
    def _run(self, plan: StepPlan, pool: PoolRows | None) -> torch.Tensor:
        self.steps += 1
        if self.fault is not None:
            self.fault.fire(self.steps)
        if plan.pending_rows.shape[0]:
            plan.input_ids[plan.pending_rows] = self.sampled_buf[plan.pending_src]
        self.prompt_logprobs = None
        self.pooled = None
        scored = plan.prompt_rows.shape[0] > 0
        if not scored and self.graphs is not None and self.graphs.can_run(plan):
            return self.graphs.run(plan)  # never for a pooling runner: it has no graphs
        if self.lora is not None:
            self.lora.batch.set(plan.lora_slots, plan.lora_slots.shape[0] > 0)
        hidden = self.model(plan.input_ids, plan.positions, self.kv_pool.layers,
                            plan.metadata(self.attn))
        if self.cfg.pooling:  # no logits: nothing is sampled (an empty [0, hidden])
            if pool is not None and pool.count:
                self.pooled = sum_rows(hidden, pool)
            return hidden[plan.logits_indices]
        logits = self.model.compute_logits(hidden[plan.logits_indices])
        if scored:
            self.prompt_logprobs = score_prompt_rows(
                self.model.compute_logits, hidden, plan.prompt_rows, plan.prompt_targets,
                score_slice_rows(self.limits.max_num_seqs, self.plan.workspace,
                                 self.model_config.vocab_size),
                plan.prompt_top, self.comm.rank == 0)
        return logits


def run_worker(rank: int, world_size: int, init_method: str, cfg: RunnerConfig,
               limits: StepLimits, timeout_s: float) -> None:
    """Entry point of a spawned rank: join the group, build, serve steps, leave."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    group = init_tp_group(rank, world_size, init_method, pick_device(rank, cfg.device),
                          timeout_s)
    try:
        ModelRunner(cfg, limits, group).worker_loop()
    finally:
        destroy_tp_group(group)
