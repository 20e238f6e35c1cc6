"""The Triton attention back-end (the CUDA path): the fused RoPE + KV write kernel, the
split-K GQA decode kernel and the varlen paged prefill kernel.

Its metadata (``TritonMetadata``) adds to the common inputs the launch shapes that CUDA
graphs fix: the prefill kernel's tile table (built on rank 0 from the step's shape and sent
in the plan as ``attn_extra``) and the decode kernel's slots. Kernels are reached through
their modules, so a test that re-imports them for Triton's interpreter needs no reload here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from tpserve.model.attention.backend import AttentionBackend, GraphAttentionState
from tpserve.model.attention.metadata import AttentionMetadata
from tpserve.model.kernels import triton_decode_attention, triton_prefill_attention, triton_rope
from tpserve.model.kernels.decode_launch import default_num_splits

# Query rows per tile of the prefill kernel by default (``TritonAttention.tile_m`` is the
# height a runner's tables are built for: ``query_tile_rows``).
PREFILL_TILE_M = triton_prefill_attention.BLOCK_M
_TILE_SHIFT = 16  # a tile entry is (sequence << 16) | query block


def prefill_tiles(query_lens: list[int], first_seq: int, tile_m: int = PREFILL_TILE_M
                  ) -> list[int]:
    """The prefill kernel's work list: one entry per ``tile_m`` new tokens of each sequence
    ``first_seq ..``, packed as ``(sequence << 16) | query_block``."""
    tiles = []
    for i, n in enumerate(query_lens):
        seq = (first_seq + i) << _TILE_SHIFT
        tiles.extend(seq | m for m in range(-(-n // tile_m)))
    return tiles


def max_prefill_tiles(num_tokens: int, num_seqs: int, tile_m: int = PREFILL_TILE_M) -> int:
    """An upper bound on ``len(prefill_tiles(...))`` for any step of ``num_tokens`` new
    tokens over at most ``num_seqs`` sequences (each sequence wastes at most one tile)."""
    return -(-num_tokens // tile_m) + min(num_seqs, num_tokens)


@dataclass
class TritonMetadata(AttentionMetadata):
    """The common metadata plus the launch shapes CUDA graphs fix:

    - ``decode_slots`` (host int, >= ``num_decodes``): the decode kernel runs over the first
      ``decode_slots`` token rows with context lengths ``decode_seq_lens`` ([decode_slots],
      0 past ``num_decodes``); a slot of length 0 writes nothing, so its row, a prefill
      token's in a mixed step, is the prefill kernel's alone (the two may run at once).
    - ``prefill_tiles`` (int32): the prefill kernel's work list (``prefill_tiles()``),
      padded with -1 entries that do nothing. ``None`` means "build it from
      ``query_start_loc``" (one host sync; tests and tools only).
    - ``tile_m``: the query rows of a tile, which the table was built for and the prefill
      launch is given.
    """

    prefill_tiles: torch.Tensor | None = None
    decode_slots: int | None = None
    decode_seq_lens: torch.Tensor | None = None
    tile_m: int = PREFILL_TILE_M

    @classmethod
    def of(cls, common: AttentionMetadata, **extra) -> TritonMetadata:
        return cls(**{f.name: getattr(common, f.name) for f in fields(AttentionMetadata)},
                   **extra)

    @property
    def num_decode_slots(self) -> int:
        return self.num_decodes if self.decode_slots is None else self.decode_slots

    def decode_lens(self) -> torch.Tensor:
        if self.decode_seq_lens is not None:
            return self.decode_seq_lens
        return self.seq_lens[: self.num_decodes]

    def tiles(self) -> torch.Tensor:
        if self.prefill_tiles is not None:
            return self.prefill_tiles
        qsl = self.query_start_loc.tolist()
        lens = [b - a for a, b in zip(qsl[self.num_decodes:-1], qsl[self.num_decodes + 1:],
                                       strict=True)]
        return torch.tensor(prefill_tiles(lens, self.num_decodes, self.tile_m),
                            dtype=torch.int32, device=self.query_start_loc.device)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: TritonMetadata, scale: float, kv_scale: torch.Tensor | None = None,
                    side_stream: torch.cuda.Stream | None = None,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the new tokens ``q [T, Hq, D]`` over their sequences' cached
    context (any cache dtype; rounded to q's dtype as it is read; an FP8 cache is scaled
    by ``kv_scale``, read on the device); with a sliding ``window``, over its last
    ``window`` positions only; with ``softcap`` c (None: off; else > 0) over logits
    capped to ``c tanh(s / c)`` (``AttentionBackend.forward``).

    The K/V of the new tokens must already be in the cache. The first ``meta.decode_slots``
    rows go to the split-K decode kernel (a padding slot, of length 0, writes nothing), the
    prefill kernel works through ``meta.prefill_tiles``; the two write disjoint rows. With
    ``side_stream`` (CUDA) and both kinds of work in the step, the decode kernel runs on
    that stream, forked from and joined back into the current one, so it can share the
    GPU with the prefill kernel (a memory-bound and a compute-bound kernel); its scratch
    is allocated on the current stream before the fork. Both launch shapes come from host
    ints and tensor sizes only, so any step is CUDA-graph capturable once its buffers are
    static (a capture records the fork and join as graph edges). Rows no tile or slot
    covers (padding tokens) are left unwritten.
    """
    out = torch.empty_like(q)
    slots = meta.num_decode_slots
    prefill = meta.num_seqs > meta.num_decodes
    fork = side_stream is not None and slots > 0 and prefill
    main = torch.cuda.current_stream(q.device) if fork else None
    if slots:
        dec = triton_decode_attention
        splits = default_num_splits(k_cache.dtype, slots, k_cache.shape[2], meta.max_seq_len)
        partials = (dec.split_partials(slots, q.shape[1], splits, q.shape[2], q.device)
                    if splits > 1 else None)
        if fork:
            side_stream.wait_stream(main)
        with torch.cuda.stream(side_stream if fork else None):  # None: no switch
            dec.decode_attention(q[:slots], k_cache, v_cache, meta.block_tables[:slots],
                                 meta.decode_lens(), scale, out[:slots], splits,
                                 kv_scale=kv_scale, partials=partials, window=window,
                                 softcap=softcap)
    if prefill:
        triton_prefill_attention.prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.tiles(), scale, out, block_m=meta.tile_m, kv_scale=kv_scale, window=window,
            softcap=softcap)
    if fork:
        main.wait_stream(side_stream)
    return out


class TritonGraphState(GraphAttentionState):
    """Static decode lengths and tile table for mixed-step graphs: the decode kernel runs
    over ``min(max_num_seqs, bucket)`` slots (length 0 past the real decodes), the prefill
    kernel over ``max_prefill_tiles(bucket, max_num_seqs, tile_m)`` tiles (-1 past the
    real ones)."""

    def __init__(self, max_num_seqs: int, max_tokens: int, device: torch.device,
                 tile_m: int = PREFILL_TILE_M):
        self.max_num_seqs = max_num_seqs
        self.tile_m = tile_m
        self.decode_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        n_tiles = max_prefill_tiles(max_tokens, max_num_seqs, tile_m) if max_tokens else 0
        self.tiles = torch.full((n_tiles,), -1, dtype=torch.int32, device=device)

    def reset(self) -> None:
        self.decode_lens.zero_()
        self.tiles.fill_(-1)

    def fill(self, meta: AttentionMetadata, extra: torch.Tensor) -> None:
        nd, n = meta.num_decodes, extra.shape[0]
        self.decode_lens[:nd].copy_(meta.seq_lens[:nd])
        self.decode_lens[nd:].zero_()
        self.tiles[:n].copy_(extra)
        self.tiles[n:].fill_(-1)

    def mixed_metadata(self, static: AttentionMetadata, bucket: int) -> TritonMetadata:
        s = self.max_num_seqs
        slots = min(s, bucket)
        return TritonMetadata.of(
            static, prefill_tiles=self.tiles[: max_prefill_tiles(bucket, s, self.tile_m)],
            decode_slots=slots, decode_seq_lens=self.decode_lens[:slots], tile_m=self.tile_m)


class TritonAttention(AttentionBackend):
    """Differences from the torch reference, all within rounding: RoPE rotates ``q`` in
    place; attention rounds probabilities to the input dtype before the P.V matmul.

    With ``overlap`` (``--overlap-attention``), a CUDA step with both decodes and prefill
    runs decode attention on a second stream of this back-end's (one per device, made at
    the first such step, which is an eager one: the runner's warm-up precedes capture).

    ``queries`` (the model's activation dtype and device; None: ``PREFILL_TILE_M``) fixes
    ``tile_m``, the prefill tiles' query rows (``query_tile_rows``), which every tile
    table of this back-end's plans and graphs is built for."""

    name = "triton"

    def __init__(self, kv_cache_dtype: torch.dtype, k_hadamard: bool = False,
                 overlap: bool = False,
                 queries: tuple[torch.dtype, torch.device] | None = None):
        super().__init__(kv_cache_dtype, k_hadamard, overlap, queries)
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.tile_m = (PREFILL_TILE_M if queries is None
                       else triton_prefill_attention.query_tile_rows(*queries))

    def side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The stream decode attention runs on beside prefill attention (None: off CUDA or
        without ``overlap``)."""
        if not self.overlap or device.type != "cuda":
            return None
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        return self._side_streams[device]

    def check_model(self, head_dim: int, rotary_dim: int, head_norm: bool) -> None:
        """Beyond the base's: the kernels tile a whole head (a multiple of 8 of at least
        16, padded to a power of two), and the RoPE kernel norms q/k heads only when RoPE
        covers them whole."""
        super().check_model(head_dim, rotary_dim, head_norm)
        torch_instead = "the torch back-end (--kernel-backend torch, slower) serves it"
        if head_dim < 16 or head_dim % 8:
            raise ValueError(f"the Triton kernels need a head dim that is a multiple of 8 of "
                             f"at least 16; this model's is {head_dim}: {torch_instead}")
        if head_norm and rotary_dim != head_dim:
            raise ValueError(f"the Triton RoPE kernel norms q/k heads only under RoPE over "
                             f"the whole head; this model rotates {rotary_dim} of its "
                             f"{head_dim} head dims: {torch_instead}")

    def plan_extra(self, query_lens: list[int], num_decodes: int) -> list[int]:
        return prefill_tiles(query_lens[num_decodes:], num_decodes, self.tile_m)

    def max_plan_extra(self, num_tokens: int, num_seqs: int) -> int:
        return max_prefill_tiles(num_tokens, num_seqs, self.tile_m)

    def metadata(self, common: AttentionMetadata, extra: torch.Tensor | None = None
                 ) -> TritonMetadata:
        return TritonMetadata.of(common, prefill_tiles=None if extra is None else extra.int(),
                                 tile_m=self.tile_m)

    def graph_state(self, max_num_seqs: int, max_tokens: int, device: torch.device
                    ) -> TritonGraphState:
        return TritonGraphState(max_num_seqs, max_tokens, device, self.tile_m)

    def rope_and_write_kv(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                          meta: AttentionMetadata, kv_scale=None,
                          head_norm=None) -> torch.Tensor:
        q, _ = triton_rope.rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache,
                                             v_cache, meta.slot_mapping, kv_scale=kv_scale,
                                             hadamard=self.k_hadamard,
                                             head_norm=head_norm)
        return q

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_scale=None, window=None, softcap=None) -> torch.Tensor:
        if not isinstance(meta, TritonMetadata):  # common metadata only (tests, tools)
            meta = self.metadata(meta)
        return paged_attention(q, k_cache, v_cache, meta, scale, kv_scale,
                               self.side_stream(q.device), window, softcap)


BACKEND = TritonAttention
