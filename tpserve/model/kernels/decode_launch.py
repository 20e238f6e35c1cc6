"""Which launch of the decode attention kernel (``triton_decode_attention``) runs for which
KV-cache dtype and grid, and into how many splits it cuts the keys: the measured launch
tables and the split rule, in host Python only (no Triton), so the engine's CUDA-graph
planning, the benchmarks and the tests read them without compiling anything.

Results never depend on the launch or the split count beyond rounding: every entry here
is a speed choice, and the comments beside each give the measurement that chose it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tpserve.model.kv_cache_dtype import is_fp8

# Measured on an H200 (bf16, Hq/Hkv = 32/8, D=128, page 16): 64-key tiles, 4 warps, 3 stages
# reach 3.7-4.3 TB/s of KV reads for batches that fill the GPU; small batches need splits.
BLOCK_N = 64  # keys per inner-loop tile
# the fewest keys a split is given by default (batch 1, 1152 keys: 16 splits 7.4 us, 8 splits
# 8.3 us; bench/tune_decode.py)
MIN_TOKENS_PER_SPLIT = 128


class DecodeLaunch(NamedTuple):
    """Tile and launch of ``_decode_split_kernel`` (tuning only: results do not depend on
    them beyond rounding; ``fp16_dot`` and ``late_widen`` apply to an FP8 cache:
    ``late_widen`` transposes the e4m3 K tile before widening it, so the compiler may widen
    in the matmul operand's registers instead of staging a widened copy; ``swap_qk``
    computes the scores transposed, ``K q^T``, so the widened K tile is the matmul's first
    operand, which Hopper's tensor cores may read from registers; ``heads_first`` orders the
    grid KV head fastest, so the programs of one sequence run together and read whole token
    rows of the cache; ``scale_v`` (with ``fp16_dot``) multiplies the widened V tile by the
    V scale, see ``triton_decode_attention``'s docstring). ``target_programs`` is the grid
    size ``decode_num_splits`` adds splits towards for this launch. ``lazy_rescale`` (for
    one-warp programs, where the test is warp-uniform): the running maximum, and with it the
    rescaling of the accumulator and sum, moves only when a tile's scores exceed it by more
    than ``triton_decode_attention.LAZY_TAU`` (log2 units), so most tiles skip
    ``BLOCK_G x HEAD_DIM`` multiplies; probabilities then stay below ``2**LAZY_TAU`` (exact
    in fp16 and float32 alike). ``fma``: the products as float32 broadcast multiplies and sums over
    ``next_pow2(GROUP)`` rows (not over an FP8 cache; ``triton_decode_attention``'s
    docstring). ``min_split_tokens``: the fewest keys of the longest sequence a split is
    given (``decode_num_splits``); it and ``target_programs`` choose the split count only
    (``SPLIT_FIELDS``).
    ``maxnreg`` caps the registers a thread (ptxas spills past it) so more programs fit on
    an SM; ``None`` leaves the compiler's choice. ``bt_ahead`` loads a tile's block-table
    entries one tile ahead (a loop-carried tensor) instead of in the tile's own iteration:
    the K/V loads then no longer hang on a load of the same iteration, and Triton's
    pipeliner keeps ``num_stages - 1`` tiles of them in flight instead of waiting for
    every outstanding copy at the top of each iteration (``DEPBAR.LE SB0, 0x0`` in the
    SASS without it; ``offline_sass.py``)."""

    block_n: int
    num_warps: int
    num_stages: int
    fp16_dot: bool
    late_widen: bool = False
    swap_qk: bool = False
    heads_first: bool = False
    scale_v: bool = False
    target_programs: int = 264  # ~2 programs of 4 warps per SM on a 132-SM H200 (measured)
    lazy_rescale: bool = False
    maxnreg: int | None = None
    bt_ahead: bool = False
    fma: bool = False
    min_split_tokens: int = MIN_TOKENS_PER_SPLIT


# the DecodeLaunch fields that choose the split count (``default_num_splits``), not the kernel
SPLIT_FIELDS = ("target_programs", "min_split_tokens")


BF16_LAUNCH = DecodeLaunch(BLOCK_N, 4, 3, False)
# An FP8 cache (94e9eb8, bench/time_fp8_decode.py --sweep, same shapes): 128-key tiles, 4
# warps, 2 stages, fp16 matmul operands: 1.05-1.17x the bf16 cache's speed at batch 1-128
# where the bf16-tuned launch with bf16 operands ran 0.78-0.91x.
# With the V scale in the widened V tile (scale_v, 2026-12-02; no byte-wise transposes of
# e4m3 V in shared memory, 111 registers a thread at 64-key tiles) 64-key tiles, 4 warps,
# 3 stages are the best of r5's ten launches at 64 x 1,152 and 16 x 2,048 (62.1 / 34.0 us
# against 67.1 / 36.9 for the launch above without scale_v), 5 % behind 128-key tiles at
# 128 x 2,048 (204.8 / 199.2; 216.1 before) (bench/time_fp8_decode.py --sweep-set r5).
# Programs of one warp with 32-key tiles beat both (--sweep-set r6): a tile's score max and
# sum then need no exchange between warps through shared memory (4-warp programs split the
# keys over the warps and pass 9 barriers a tile in the SASS). Best at about 1,024 programs:
# 55.7 us at 64 x 1,152 (2 splits), 167.0 at 128 x 2,048 (1), 30.2 at 16 x 2,048 (8),
# against 61.4 / 205.1 / 33.9 for the 4-warp launch before.
# With the block table a tile ahead (bt_ahead, 2026-12-03, bench/time_decode_bt_ahead.py):
# 16-key tiles, 4 stages (20 KB shared a program, 154 registers): 51.5 us at 64 x 1,152
# against 55.5 for the 32-key launch without it, 158.9-160.3 / 165.4 at 128 x 2,048, 27.8 /
# 30.2 at 16 x 2,048, 27.3 / 30.5 at 64 x 512; bt_ahead on the 32-key launch alone gained
# nothing (its 28 KB of shared memory then caps the programs an SM). In the engine it
# measured no different (serving runs at the H200's 700 W cap, SM clocks ~1.8 GHz: decode
# attention 2.094 vs 2.121 ms a step; bench/README.md round 15).
# The query heads as the matmuls' columns (s^T = K q^T, o^T = V^T p^T; round 9's
# heads_as_cols) on this loop, 2026-12-03 (bench/README.md round 16): 438 SASS instructions a
# tile against 520, equal alone (55.78 against 55.82 us at 64 x 1,152), slower serving
# (7,058.5 / 7,071.9 against 7,203.7 / 7,218.0 out tok/s), so removed again.
FP8_LAUNCH = DecodeLaunch(16, 1, 4, True, scale_v=True, target_programs=1024, bt_ahead=True)
# ... but one-warp programs leave the GPU nearly idle when few sequences decode (batch 1 x
# 1,024 keys: 8.45 us against 6.5 for bf16): below FP8_SMALL_GRID sequence x KV-head pairs
# the 4-warp launch of rounds 3-4 runs, with scale_v. --sweep-set r7 (x 1,152 keys, 8 KV
# heads, at the split counts the engine's graphs take): batch 1: 6.72 us against one
# warp's 7.99, batch 2: 8.10 / 8.25, batch 4: 9.37 / 8.99, batch 8: 13.05 / 12.27.
FP8_SMALL_LAUNCH = DecodeLaunch(128, 4, 2, True, scale_v=True)
FP8_SMALL_GRID = 32
# A float32 cache (round 38, 2026-12-06, H100): ieee products run on the CUDA cores, and the
# bf16 launch there spent 165 us a layer of qwen3-0.6b's decode step (2 splits of 300 keys,
# 16 programs; its 64-key tile spills 616 bytes a thread; 236 us at 4 splits in the sweep).
# The FMA form split down to 32 keys towards 1,024 programs: over 16-key tiles at 4 warps the
# step's attention took 230 us instead of 4,631 (the step 2.08 ms instead of 6.63); 8-key
# tiles in one-warp programs were then the fastest launch and split count at every shape of
# bench/tune_decode.py --dtype float32 but one (within 0.8 %): batch 1 x 600 keys 7.9 us,
# 8 x 600 16.7, 64 x 1,152 210.5 (16 q heads) and 231.5 (32), against 9.1 / 26.0 / 311.7 /
# 507.6 for the 16-key, 4-warp tiles
FP32_LAUNCH = DecodeLaunch(8, 1, 3, False, target_programs=1024, fma=True,
                           min_split_tokens=32)
MAX_SPLITS = 32
TARGET_PROGRAMS = BF16_LAUNCH.target_programs  # the default of decode_num_splits


def default_launch(kv_dtype: torch.dtype, num_seqs: int, num_kv_heads: int) -> DecodeLaunch:
    """The measured launch for ``num_seqs`` sequences over a cache of ``kv_dtype`` with
    ``num_kv_heads`` heads: ``BF16_LAUNCH`` for a 16-bit cache, ``FP32_LAUNCH`` for a float32
    one; for an FP8 one ``FP8_LAUNCH``, or ``FP8_SMALL_LAUNCH`` under ``FP8_SMALL_GRID``
    (sequence, head) pairs."""
    if kv_dtype == torch.float32:
        return FP32_LAUNCH
    if not is_fp8(kv_dtype):
        return BF16_LAUNCH
    return FP8_LAUNCH if num_seqs * num_kv_heads >= FP8_SMALL_GRID else FP8_SMALL_LAUNCH


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      target_programs: int = TARGET_PROGRAMS,
                      min_tokens: int = MIN_TOKENS_PER_SPLIT) -> int:
    """Split count (a power of two <= MAX_SPLITS) from host ints only.

    Splits are added while the grid is below ``target_programs`` (a launch's own:
    ``default_num_splits``) and each split still gets at least ``min_tokens`` keys of the
    longest sequence (the launch's ``min_split_tokens``). Results never depend on it, so a
    CUDA graph may be captured with ``max_seq_len`` = the model's maximum length: splits
    past a sequence's end exit at once (measured cost: <= ~10% on short contexts).
    """
    splits = 1
    while (splits * 2 <= MAX_SPLITS
           and num_seqs * num_kv_heads * splits < target_programs
           and max_seq_len >= 2 * splits * min_tokens):
        splits *= 2
    return splits


def default_num_splits(kv_dtype: torch.dtype, num_seqs: int, num_kv_heads: int,
                       max_seq_len: int) -> int:
    """The split count ``decode_attention``'s default launch for this grid takes:
    ``decode_num_splits`` towards ``default_launch(...).target_programs``, each split
    given at least its ``min_split_tokens``."""
    launch = default_launch(kv_dtype, num_seqs, num_kv_heads)
    return decode_num_splits(num_seqs, num_kv_heads, max_seq_len, launch.target_programs,
                             launch.min_split_tokens)
