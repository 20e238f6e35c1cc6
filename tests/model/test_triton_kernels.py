"""Triton kernels against the torch reference ops.

On a machine without CUDA the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1``
is set below before any kernel module is imported (``@triton.jit`` picks the interpreter when
the kernel is defined; kernel modules imported earlier without it are re-imported). With
CUDA the same tests run the compiled kernels on the GPU. Cases are kept tiny: the interpreter
executes every program instance in Python.
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
from dataclasses import replace

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from tpserve.model.attention.triton_backend import (  # noqa: E402
    TritonMetadata,
    max_prefill_tiles,
    prefill_tiles,
)
from tpserve.model.kernels import decode_launch as launches  # noqa: E402
from tpserve.model.kernels import torch_ops  # noqa: E402

_KERNEL_MODULES = (  # dependency order, for re-import
    "triton_support", "triton_norm", "triton_activation", "triton_fp8_kv", "triton_fp8_quant",
    "triton_fp8",
    "triton_fp8_fused", "triton_rope", "triton_softcap",
    "triton_decode_attention", "triton_prefill_attention", "triton_moe", "triton_ops",
)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-4}


def _kernel_modules() -> dict:
    """The triton_* modules, built for the interpreter when running on CPU."""
    names = [f"tpserve.model.kernels.{m}" for m in _KERNEL_MODULES]
    if DEVICE.type == "cpu" and names[1] in sys.modules:
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(sys.modules[names[1]]._rms_norm_kernel, InterpretedFunction):
            for name in names:
                if name in sys.modules:
                    importlib.reload(sys.modules[name])
    return {m: importlib.import_module(n) for m, n in zip(_KERNEL_MODULES, names, strict=True)}


def interpreted_modules(mp: pytest.MonkeyPatch, pairs, interpret: bool) -> list:
    """The kernel modules ``pairs`` names (``(module, one of its kernels)``, in dependency
    order), imported. With ``interpret`` (off CUDA) the interpreter's index fix is applied
    first and each module already imported with compiled kernels is reloaded, so that its
    kernels (and those of the modules after it) are interpreter functions."""
    if interpret:
        _fix_interpreter_index(mp)
        from triton.runtime.interpreter import InterpretedFunction
        for name, kernel in pairs:
            mod = sys.modules.get(name)
            if mod is not None and not isinstance(getattr(mod, kernel), InterpretedFunction):
                importlib.reload(mod)
    return [importlib.import_module(name) for name, _ in pairs]


def _fix_interpreter_index(mp: pytest.MonkeyPatch) -> None:
    """Let the interpreter use runtime scalars as ``range`` bounds under NumPy >= 2.4.

    Triton 3.6.0's interpreter holds scalars as 1-element arrays and converts them with
    ``int(array)``, which NumPy 2.4 rejects (triton-lang/triton#9171, fixed upstream by
    converting the single element instead). Compiled kernels are unaffected.
    """
    from triton.runtime import interpreter
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    mp.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


@pytest.fixture(scope="module")
def mods():
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE.type == "cpu":
            _fix_interpreter_index(mp)
        yield _kernel_modules()


@pytest.fixture(scope="module")
def ops(mods):
    return mods["triton_ops"]


@pytest.fixture(scope="module")
def attn(mods):
    """The Triton attention back-end's module (it reaches the kernels through ``mods``)."""
    from tpserve.model.attention import triton_backend

    return triton_backend


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = ATOL[dtype] * scale
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _randn(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


# ----------------------------------------------------------------------------- elementwise


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 100)])
def test_rms_norm(ops, dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = _randn(*shape, dtype=dtype, gen=gen) * 3
    w = _randn(shape[-1], dtype=dtype, gen=gen)
    _close(ops.rms_norm(x, w, 1e-6), torch_ops.rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_unit_offset(ops, dtype, residual):
    """Gemma's norm: ``1 + w`` in float32, the product rounded once to ``x``'s dtype (an
    fp32 weight does not promote)."""
    gen = torch.Generator().manual_seed(4)
    x = _randn(6, 80, dtype=dtype, gen=gen) * 3
    for w in (_randn(80, dtype=dtype, gen=gen) * 0.5, _randn(80, dtype=torch.float32, gen=gen)):
        if residual:
            res = _randn(6, 80, dtype=dtype, gen=gen)
            got, got_sum = ops.add_rms_norm(x, res.clone(), w, 1e-6, unit_offset=True)
            want, want_sum = torch_ops.add_rms_norm(x, res.clone(), w, 1e-6, unit_offset=True)
            _close(got_sum, want_sum, dtype)
        else:
            got = ops.rms_norm(x, w, 1e-6, unit_offset=True)
            want = torch_ops.rms_norm(x, w, 1e-6, unit_offset=True)
        _close(got, want, dtype)
        assert got.dtype == dtype
        plain = torch_ops.rms_norm(x, w, 1e-6)
        assert not torch.allclose(want.float(), plain.float(), atol=0.1)  # the offset acts


def test_rms_norm_fp32_weight_promotes(ops):
    gen = torch.Generator().manual_seed(1)
    x = _randn(5, 64, dtype=torch.bfloat16, gen=gen)
    w = _randn(64, dtype=torch.float32, gen=gen)
    _close(ops.rms_norm(x, w, 1e-5), torch_ops.rms_norm(x, w, 1e-5), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(ops, dtype):
    gen = torch.Generator().manual_seed(2)
    x = _randn(7, 96, dtype=dtype, gen=gen)
    res = _randn(7, 96, dtype=dtype, gen=gen)
    w = _randn(96, dtype=dtype, gen=gen)
    x_before, res_before = x.clone(), res.clone()
    out, summed = ops.add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_summed = torch_ops.add_rms_norm(x, res, w, 1e-6)
    _close(summed, ref_summed, dtype)
    _close(out, ref_out, dtype)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("quantize", [False, True], ids=["bf16-out", "fp8-out"])
def test_add_rms_norm_writes_the_sum_over_the_residual(mods, backend, quantize):
    """``sum_out=residual`` (what ``RMSNorm`` passes): the sum lands in the residual's own
    storage, bit for bit what the out-of-place call returns, with the same normed output;
    ``x`` is untouched; a ``sum_out`` that cannot hold the sum is refused."""
    if backend == "triton":
        add, add_fp8 = mods["triton_norm"].add_rms_norm, mods["triton_fp8_fused"].add_rms_norm_fp8
    else:
        add, add_fp8 = torch_ops.add_rms_norm, torch_ops.add_rms_norm_fp8
    fn = add_fp8 if quantize else add
    gen = torch.Generator().manual_seed(4)
    x = _randn(6, 80, dtype=torch.bfloat16, gen=gen)
    res = _randn(6, 80, dtype=torch.bfloat16, gen=gen)
    w = _randn(80, dtype=torch.bfloat16, gen=gen)
    x_before = x.clone()
    want = fn(x, res.clone(), w, 1e-6)
    got = fn(x, res, w, 1e-6, res)
    summed = got[-1]
    assert summed.data_ptr() == res.data_ptr() and torch.equal(res, want[-1])
    for g, e in zip(got[:-1], want[:-1], strict=True):
        assert g == e if isinstance(g, torch.dtype) else torch.equal(g, e)
    assert torch.equal(x, x_before)
    with pytest.raises(ValueError, match="cannot hold the sum"):
        fn(x, res, w, 1e-6, res.float())
    with pytest.raises(ValueError, match="cannot hold the sum"):
        fn(x, res, w, 1e-6, torch.empty(80, 6, dtype=torch.bfloat16, device=DEVICE).t())


def test_rms_norm_layer_carries_the_residual_stream_in_one_buffer(ops):
    """``RMSNorm(x, residual)`` returns the residual tensor itself holding ``x + residual``
    (no new buffer a layer); a residual narrower than the sum is left alone and the sum
    is a new tensor."""
    from tpserve.model.layers.norm import RMSNorm
    norm = RMSNorm(64, 1e-6, ops, torch.bfloat16).to(DEVICE)
    gen = torch.Generator().manual_seed(5)
    x = _randn(3, 64, dtype=torch.bfloat16, gen=gen)
    res = _randn(3, 64, dtype=torch.bfloat16, gen=gen)
    expected = ops.add_rms_norm(x, res.clone(), norm.weight, 1e-6)
    out, summed = norm(x, res)
    assert summed is res and torch.equal(summed, expected[1]) and torch.equal(out, expected[0])
    narrow = res.clone()
    out, summed = norm(x.float(), narrow)  # a float32 sum cannot go over a bf16 residual
    assert summed is not narrow and summed.dtype == torch.float32
    assert torch.equal(narrow, res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 96), (2, 3, 2 * 1100)])
def test_silu_and_mul(ops, dtype, shape):
    gen = torch.Generator().manual_seed(3)
    x = _randn(*shape, dtype=dtype, gen=gen) * 4
    _close(ops.silu_and_mul(x), torch_ops.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 96), (2, 3, 2 * 1100)])
def test_gelu_tanh_and_mul(ops, dtype, shape):
    """Gemma's gate, over gates far into both saturations of tanh."""
    gen = torch.Generator().manual_seed(5)
    x = _randn(*shape, dtype=dtype, gen=gen) * 6
    got, want = ops.gelu_tanh_and_mul(x), torch_ops.gelu_tanh_and_mul(x)
    _close(got, want, dtype)
    assert not torch.allclose(want.float(), torch_ops.silu_and_mul(x).float(), atol=0.1)


# ----------------------------------------------------------------------------- rope + cache


def _cos_sin_cache(max_pos: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,page", [(64, 64, 16), (128, 64, 8), (96, 96, 16),
                                                     (96, 64, 8)])
def test_rope_and_write_kv(mods, dtype, head_dim, rotary_dim, page):
    """Heads of 96 (Phi-3-mini) are tiled as 128: the pad is never read or written."""
    gen = torch.Generator().manual_seed(4)
    tokens, hq, hkv, num_blocks = 7, 12, 3, 5
    # q/k/v as strided views of one fused projection output, as the model produces them.
    qkv = _randn(tokens, (hq + 2 * hkv) * head_dim, dtype=dtype, gen=gen)
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.tensor([0, 5, 6, 7, 100, 3, 64], device=DEVICE)
    slots = torch.tensor([3, -1, 17, 0, 39, -1, 8], device=DEVICE)
    cs = _cos_sin_cache(128, rotary_dim)
    k_cache = _randn(num_blocks, page, hkv, head_dim, dtype=dtype, gen=gen)
    v_cache = _randn(num_blocks, page, hkv, head_dim, dtype=dtype, gen=gen)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = torch_ops.rope_and_write_kv(q.clone(), k.clone(), v, positions, cs,
                                               ref_kc, ref_vc, slots)
    out_q, out_k = mods["triton_rope"].rope_and_write_kv(q, k, v, positions, cs, k_cache,
                                                         v_cache, slots)
    _close(out_q, ref_q, dtype)
    _close(out_k, ref_k, dtype)
    _close(k_cache, ref_kc, dtype)  # also: the slots of the -1 tokens stay untouched
    assert torch.equal(v_cache, ref_vc)


# ----------------------------------------------------------------------------- attention


def _make_batch(seqs, page, hkv, head_dim, dtype, gen):
    """KV pool and metadata for ``seqs = [(ctx, q_len), ...]``; leading q_len 1 are decodes.

    Blocks are a shuffled permutation of a pool larger than needed; block-table padding is
    out of range so a stray read by a kernel would fail loudly (see ``_ref``).
    """
    lens = [c + n for c, n in seqs]
    nblocks = [(n + page - 1) // page for n in lens]
    pool = sum(nblocks) + 3
    perm = torch.randperm(pool, generator=gen)
    table = torch.full((len(seqs), max(nblocks) + 2), pool + 10_000, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nblocks):
        table[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    qlens = torch.tensor([n for _, n in seqs])
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = qlens.cumsum(0)
    slot_mapping = torch.cat([
        table[i, (pos := torch.arange(c, c + n)) // page].long() * page + pos % page
        for i, (c, n) in enumerate(seqs)])
    meta = TritonMetadata(
        slot_mapping=slot_mapping.to(DEVICE), query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        block_tables=table.to(DEVICE),
        num_decodes=len(list(itertools.takewhile(lambda s: s[1] == 1, seqs))),
        max_query_len=int(qlens.max()), max_seq_len=max(lens))
    k_cache = _randn(pool, page, hkv, head_dim, dtype=dtype, gen=gen)
    v_cache = _randn(pool, page, hkv, head_dim, dtype=dtype, gen=gen)
    return meta, k_cache, v_cache


def _ref(q, k_cache, v_cache, meta, scale):
    """torch_ops.paged_attention on a copy of ``meta`` with in-range block-table padding.

    The reference's batched decode path gathers block-table entries up to the longest decode
    context for every decode (then masks them), so it needs padding that is a valid block.
    """
    tables = meta.block_tables.clone()
    tables[tables >= k_cache.shape[0]] = 0
    return torch_ops.paged_attention(q, k_cache, v_cache, replace(meta, block_tables=tables),
                                     scale)


ATTN_SHAPES = [  # (group = Hq / Hkv, page size, head dim)
    (1, 16, 64),
    (4, 8, 128),
    (8, 32, 64),
    (2, 16, 96),  # Phi-3-mini's head: tiled as 128, the pad masked
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,page,head_dim", ATTN_SHAPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention(mods, dtype, group, page, head_dim, splits):
    gen = torch.Generator().manual_seed(5)
    hkv = 2
    lens = [1, 7, 33, 100, 300] if splits > 1 else [1, 7, 33, 100]
    meta, k_cache, v_cache = _make_batch([(n - 1, 1) for n in lens], page, hkv, head_dim,
                                         dtype, gen)
    assert meta.num_decodes == len(lens)
    q = _randn(len(lens), hkv * group, head_dim, dtype=dtype, gen=gen)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    mods["triton_decode_attention"].decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, out, splits)
    _close(out, _ref(q, k_cache, v_cache, meta, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_block_table_a_tile_ahead_changes_no_bit(mods, dtype, splits):
    """``bt_ahead`` (a tile's block-table entries loaded in the iteration before) only moves
    a load: over scattered pages and lengths that end inside, at and past 16-key tiles, the
    output equals the launch without it bit for bit, and the reference."""
    gen = torch.Generator().manual_seed(12)
    hkv, group, page, head_dim = 2, 4, 8, 64
    lens = [1, 16, 17, 48, 95]
    meta, k_cache, v_cache = _make_batch([(n - 1, 1) for n in lens], page, hkv, head_dim,
                                         dtype, gen)
    q = _randn(len(lens), hkv * group, head_dim, dtype=dtype, gen=gen)
    outs = []
    for ahead in (False, True):
        out = torch.full_like(q, float("nan"))
        mods["triton_decode_attention"].decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125, out, splits,
            block_n=16, num_warps=1, num_stages=4, bt_ahead=ahead)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    _close(outs[1], _ref(q, k_cache, v_cache, meta, 0.125), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_lazy_rescale_equals_the_reference_when_scores_climb(mods, dtype, splits):
    """``lazy_rescale``: keys whose scores climb along the context (K rows scaled up with
    the position, so the running maximum passes itself by more than ``LAZY_TAU`` several
    times; plus one early outlier key) and plain random keys: both the rescaling and the
    skipping branch, one-warp programs of 32-key tiles as the fp8 launch, equal the torch
    reference."""
    dec = mods["triton_decode_attention"]
    gen = torch.Generator().manual_seed(8)
    hkv, group, page, head_dim = 2, 4, 16, 64
    lens = [5, 90, 300]
    meta, k_cache, v_cache = _make_batch([(n - 1, 1) for n in lens], page, hkv, head_dim,
                                         dtype, gen)
    q = _randn(len(lens), hkv * group, head_dim, dtype=dtype, gen=gen)
    climbing = k_cache.clone()
    tables = meta.block_tables.cpu()
    for i, n in enumerate(lens):  # token t of sequence i: its K row times 1 + t / 25
        for t in range(n):
            blk, off = int(tables[i, t // page]), t % page
            climbing[blk, off] = (k_cache[blk, off].float() * (1 + t / 25)).to(dtype)
            if t == 3:  # an outlier before the climb: the maximum holds for a while
                climbing[blk, off] = (k_cache[blk, off].float() * 6).to(dtype)
    scale = head_dim ** -0.5
    for kc in (k_cache, climbing):
        out = torch.full_like(q, float("nan"))
        dec.decode_attention(q, kc, v_cache, meta.block_tables, meta.seq_lens, scale, out,
                             splits, block_n=32, num_warps=1, num_stages=3, lazy_rescale=True)
        _close(out, _ref(q, kc, v_cache, meta, scale), dtype)


@pytest.mark.parametrize("group,page,head_dim", ATTN_SHAPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_fma_form_equals_the_reference_in_float32(mods, group, page, head_dim, splits):
    """``fma`` (float32: the products as broadcast multiplies summed on the CUDA cores over
    ``next_pow2(GROUP)`` rows, not ``tl.dot`` over 16 padded ones), the float32 cache's
    default launch (``FP32_LAUNCH``: 8-key tiles, one warp): every group size of
    ``ATTN_SHAPES`` (1 to 8 query heads a KV head, a head dim padded from 96), contexts
    inside and past one tile, with and without splits, equal the torch reference; a
    length-0 slot writes nothing; an fp16 q and cache too (32-key tiles, 4 warps); an FP8
    cache is refused."""
    dec = mods["triton_decode_attention"]
    gen = torch.Generator().manual_seed(14)
    hkv = 2
    lens = [1, 7, 16, 17, 100, 300]
    meta, k_cache, v_cache = _make_batch([(n - 1, 1) for n in lens], page, hkv, head_dim,
                                         torch.float32, gen)
    q = _randn(len(lens), hkv * group, head_dim, dtype=torch.float32, gen=gen)
    scale = head_dim ** -0.5
    seq_lens = meta.seq_lens.clone()
    seq_lens[1] = 0  # a CUDA-graph padding slot
    out = torch.full_like(q, 3.25)
    assert launches.default_launch(torch.float32, len(lens), hkv) is launches.FP32_LAUNCH
    dec.decode_attention(q, k_cache, v_cache, meta.block_tables, seq_lens, scale, out, splits)
    assert torch.equal(out[1], torch.full_like(out[1], 3.25))
    ref = _ref(q, k_cache, v_cache, meta, scale)
    _close(out[[0, *range(2, len(lens))]], ref[[0, *range(2, len(lens))]], torch.float32)
    half = torch.empty_like(q, dtype=torch.float16)
    dec.decode_attention(q.half(), k_cache.half(), v_cache.half(), meta.block_tables,
                         meta.seq_lens, scale, half, splits, block_n=32, num_warps=4,
                         fma=True)
    _close(half, _ref(q.half(), k_cache.half(), v_cache.half(), meta, scale), torch.float16)
    fp8 = torch.float8_e4m3fn
    with pytest.raises(AssertionError, match="FMA form"):
        dec.decode_attention(q, k_cache.to(fp8), v_cache.to(fp8), meta.block_tables,
                             seq_lens, scale, out, splits,
                             kv_scale=torch.ones(2, device=DEVICE), fma=True)


def test_decode_padding_sequence_writes_nothing(mods):
    """A zero-length (CUDA-graph padding) decode slot leaves its output row as it was: in a
    mixed step that row is a prefill token's, which the prefill kernel may be writing at
    the same time (``--overlap-attention``)."""
    gen = torch.Generator().manual_seed(6)
    meta, k_cache, v_cache = _make_batch([(9, 1)], 16, 1, 64, torch.float16, gen)
    seq_lens = torch.tensor([10, 0], dtype=torch.int32, device=DEVICE)
    tables = torch.cat([meta.block_tables, meta.block_tables])
    q = _randn(2, 4, 64, dtype=torch.float16, gen=gen)
    for splits in (1, 2):
        out = torch.full_like(q, 3.25)
        mods["triton_decode_attention"].decode_attention(
            q, k_cache, v_cache, tables, seq_lens, 0.125, out, splits)
        assert torch.equal(out[1], torch.full_like(out[1], 3.25))
        _close(out[:1], _ref(q[:1], k_cache, v_cache, meta, 0.125),
               torch.float16)


def test_decode_num_splits():
    """The split rule and the launch tables (``decode_launch``, host Python)."""
    pick = launches.decode_num_splits
    assert pick(1, 8, 100) == 1  # short context: never split
    assert pick(1, 8, 32768) == 32  # one long sequence: split up to the cap
    assert pick(256, 8, 32768) == 1  # grid already fills the GPU
    assert pick(4, 8, 1024) == 8  # limited by the grid (4 * 8 * 8 = 256 programs)
    assert pick(1, 8, 512) == 4  # limited by MIN_TOKENS_PER_SPLIT (128 keys each)
    assert pick(1, 8, 512, 1024, 32) == 16  # ... or a launch's own minimum (32 keys each)
    assert pick(1, 8, 512, 1024, 16) == 32 and pick(1, 8, 500, 1024, 16) == 16
    # a launch's own grid target (the FP8 cache's one-warp programs aim at ~1,024)
    assert pick(64, 8, 2048, 1024) == 2 and pick(128, 8, 2048, 1024) == 1
    assert pick(16, 8, 2048, 1024) == 8 and pick(16, 8, 2048) == 4
    fp8 = torch.float8_e4m3fn
    assert launches.default_launch(fp8, launches.FP8_SMALL_GRID // 8, 8) is launches.FP8_LAUNCH
    assert launches.default_launch(fp8, launches.FP8_SMALL_GRID // 8 - 1, 8) is launches.FP8_SMALL_LAUNCH
    assert launches.default_launch(torch.bfloat16, 64, 8) is launches.BF16_LAUNCH
    assert launches.default_num_splits(fp8, 64, 8, 2048) == 2  # the one-warp launch's target
    assert launches.default_num_splits(torch.bfloat16, 64, 8, 2048) == 1
    # a float32 cache: the FMA launch, split towards 1,024 programs down to 32 keys each
    assert launches.default_launch(torch.float32, 1, 8) is launches.FP32_LAUNCH and launches.FP32_LAUNCH.fma
    assert launches.default_num_splits(torch.float32, 1, 8, 1024) == 32
    assert launches.default_num_splits(torch.float32, 1, 8, 600) == 16
    assert launches.default_num_splits(torch.float32, 64, 8, 1024) == 2


MIXED = [(4, 1), (39, 1), (0, 7), (20, 33), (36, 1), (100, 33), (0, 1)]  # (ctx, q_len)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,page,head_dim", ATTN_SHAPES)
def test_paged_attention_mixed_batch(attn, dtype, group, page, head_dim):
    """Decodes, fresh prefills and chunked prefills over a cached prefix, in one batch."""
    gen = torch.Generator().manual_seed(7)
    hkv = 2
    meta, k_cache, v_cache = _make_batch(MIXED, page, hkv, head_dim, dtype, gen)
    assert meta.num_decodes == 2
    num_tokens = int(meta.query_start_loc[-1])
    q = _randn(num_tokens, hkv * group, head_dim, dtype=dtype, gen=gen)
    scale = head_dim ** -0.5
    out = attn.paged_attention(q, k_cache, v_cache, meta, scale)
    _close(out, _ref(q, k_cache, v_cache, meta, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_small_tiles(mods, dtype):
    """16x16 tiles: several unmasked key tiles, several query blocks, q_len 100."""
    gen = torch.Generator().manual_seed(8)
    seqs = [(0, 1), (37, 100), (0, 19)]
    meta, k_cache, v_cache = _make_batch(seqs, 16, 1, 64, dtype, gen)
    meta.num_decodes = 0
    q = _randn(120, 4, 64, dtype=dtype, gen=gen)
    out = torch.full_like(q, float("nan"))
    tiles = prefill_tiles([1, 100, 19], 0, tile_m=16)
    assert len(tiles) == 1 + 7 + 2 and tiles[1] == (1 << 16) | 0 and tiles[7] == (1 << 16) | 6
    mods["triton_prefill_attention"].prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        torch.tensor(tiles, dtype=torch.int32, device=DEVICE), 0.125, out, block_m=16,
        block_n=16)
    _close(out, _ref(q, k_cache, v_cache, meta, 0.125), dtype)


def _graph_padded_step(dtype: torch.dtype, group: int):
    """A mixed step in the launch shapes a mixed-step CUDA graph fixes (more decode slots
    than decodes, padding tokens after the real ones, padding sequences, -1 tiles): its q,
    caches and padded metadata, the reference output of its real rows and their count."""
    gen = torch.Generator().manual_seed(10)
    hkv, page, d = 2, 16, 64
    real = [(4, 1), (39, 1), (20, 33), (0, 70), (0, 1)]  # 2 decodes, 3 prefills
    meta, k_cache, v_cache = _make_batch(real, page, hkv, d, dtype, gen)
    n = int(meta.query_start_loc[-1])
    q = _randn(n, hkv * group, d, dtype=dtype, gen=gen)
    want = _ref(q, k_cache, v_cache, meta, d ** -0.5)
    tokens, slots_n, seqs_n = 128, 16, 9  # the "bucket": T, decode slots, sequence slots
    pad_t, pad_s = tokens - n, seqs_n - len(real)
    qp = torch.cat([q, _randn(pad_t, hkv * group, d, dtype=dtype, gen=gen)])
    qsl = torch.cat([meta.query_start_loc, torch.full((pad_s,), n, dtype=torch.int32,
                                                      device=DEVICE)])
    lens = torch.cat([meta.seq_lens, torch.zeros(pad_s, dtype=torch.int32, device=DEVICE)])
    tables = torch.cat([meta.block_tables, torch.zeros(pad_s, meta.block_tables.shape[1],
                                                       dtype=torch.int32, device=DEVICE)])
    dlens = torch.zeros(slots_n, dtype=torch.int32, device=DEVICE)
    dlens[:2] = meta.seq_lens[:2]
    tiles = prefill_tiles([33, 70, 1], 2)
    tiles += [-1] * (max_prefill_tiles(tokens, seqs_n) - len(tiles))
    padded = TritonMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((pad_t,), -1, device=DEVICE)]),
        query_start_loc=qsl, seq_lens=lens, block_tables=tables, num_decodes=0,
        max_query_len=tokens, max_seq_len=512,
        prefill_tiles=torch.tensor(tiles, dtype=torch.int32, device=DEVICE),
        decode_slots=slots_n, decode_seq_lens=dlens)
    return qp, k_cache, v_cache, padded, want, n


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_attention_with_graph_padding(attn, dtype, group):
    """The launch shapes a mixed-step CUDA graph fixes: the real rows must equal the
    reference; padding changes nothing else (the cache is read-only)."""
    qp, k_cache, v_cache, padded, want, n = _graph_padded_step(dtype, group)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = attn.paged_attention(qp, k_cache, v_cache, padded, qp.shape[-1] ** -0.5)
    _close(got[:n], want, dtype)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)


def test_float32_queries_on_a_gpu_take_16_row_prefill_tiles(attn, monkeypatch):
    """float32 on CUDA tiles the prefill by 16 query rows (64-row tiles spill registers;
    round 37: 12-46x slower). A back-end told its queries are float32 on CUDA builds every
    table for 16 rows (plans, the graph buffers and their metadata) and the launch is
    given that height: the padded mixed step, in 9 tiles where 64 rows take 4, equals the
    reference. bf16 on CUDA, float32 elsewhere and a back-end told nothing keep 64 rows."""
    cuda = torch.device("cuda")  # a device object: nothing here touches a GPU
    for queries in ((torch.bfloat16, cuda), (torch.float32, torch.device("cpu")), None):
        assert attn.TritonAttention(torch.float32, queries=queries).tile_m == 64
    backend = attn.TritonAttention(torch.float32, queries=(torch.float32, cuda))
    assert backend.tile_m == 16
    assert backend.plan_extra([1, 1, 33, 70, 1], 2) == prefill_tiles([33, 70, 1], 2, 16)
    assert len(prefill_tiles([33, 70, 1], 2, 16)) == 9
    assert len(prefill_tiles([33, 70, 1], 2)) == 4
    assert backend.max_plan_extra(128, 9) == max_prefill_tiles(128, 9, 16) == 8 + 9
    qp, k_cache, v_cache, padded, want, n = _graph_padded_step(torch.float32, 4)
    state = backend.graph_state(9, 128, DEVICE)
    assert state.tiles.numel() == 17
    state.fill(padded, torch.tensor(backend.plan_extra([1, 1, 33, 70, 1], 2),
                                    dtype=torch.int32, device=DEVICE))
    meta = state.mixed_metadata(padded, 128)
    assert meta.tile_m == 16 and meta.prefill_tiles.numel() == 17
    # the graph state's table, with the padded step's own 16 decode slots and their lengths
    # (``fill`` copied none: ``padded`` counts its two decodes as slots only)
    meta = attn.TritonMetadata.of(padded, prefill_tiles=meta.prefill_tiles, decode_slots=16,
                                  decode_seq_lens=padded.decode_seq_lens, tile_m=meta.tile_m)
    kernel, heights = attn.triton_prefill_attention, []
    launch = kernel.prefill_attention

    def recorded(*args, block_m, **kwargs):  # the real launch, its height kept
        heights.append(block_m)
        return launch(*args, block_m=block_m, **kwargs)

    monkeypatch.setattr(kernel, "prefill_attention", recorded)
    got = attn.paged_attention(qp, k_cache, v_cache, meta, qp.shape[-1] ** -0.5)
    assert heights == [16]
    _close(got[:n], want, torch.float32)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA streams: GPU only")
@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_on_two_streams_equals_one(attn, group):
    """``--overlap-attention``: decode attention on a side stream beside prefill attention
    gives the one-stream result bit for bit, run eagerly and replayed from a CUDA graph
    (the fork and the join captured as graph edges), over many replays."""
    qp, k_cache, v_cache, padded, want, n = _graph_padded_step(torch.bfloat16, group)
    scale = qp.shape[-1] ** -0.5
    one = attn.paged_attention(qp, k_cache, v_cache, padded, scale)
    side = torch.cuda.Stream(DEVICE)
    two = attn.paged_attention(qp, k_cache, v_cache, padded, scale, side_stream=side)
    assert torch.equal(two[:n], one[:n])
    _close(two[:n], want, torch.bfloat16)
    static_out = torch.empty_like(qp)
    graph = torch.cuda.CUDAGraph()
    warm = torch.cuda.Stream(DEVICE)
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        attn.paged_attention(qp, k_cache, v_cache, padded, scale, side_stream=side)
    torch.cuda.current_stream().wait_stream(warm)
    with torch.cuda.graph(graph):
        static_out.copy_(attn.paged_attention(qp, k_cache, v_cache, padded, scale,
                                              side_stream=side))
    for _ in range(20):
        static_out.zero_()
        graph.replay()
        assert torch.equal(static_out[:n], one[:n])


def test_end_to_end_rope_write_then_attend(mods, attn):
    """The layer's order of ops: rope + cache write of new tokens, then paged attention."""
    gen = torch.Generator().manual_seed(9)
    dtype, hq, hkv, d, page = torch.bfloat16, 8, 2, 64, 16
    seqs = [(12, 1), (0, 9), (17, 5)]
    meta, k_cache, v_cache = _make_batch(seqs, page, hkv, d, dtype, gen)
    n = int(meta.query_start_loc[-1])
    positions = torch.cat([torch.arange(c, c + m) for c, m in seqs]).to(DEVICE)
    q, k, v = (_randn(n, h, d, dtype=dtype, gen=gen) for h in (hq, hkv, hkv))
    cs = _cos_sin_cache(64, d)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    rq, _ = torch_ops.rope_and_write_kv(q, k, v, positions, cs, ref_kc, ref_vc,
                                        meta.slot_mapping)
    ref = _ref(rq, ref_kc, ref_vc, meta, d ** -0.5)
    tq, _ = mods["triton_rope"].rope_and_write_kv(q.clone(), k.clone(), v, positions, cs,
                                                  k_cache, v_cache, meta.slot_mapping)
    _close(attn.paged_attention(tq, k_cache, v_cache, meta, d ** -0.5), ref, dtype)


def test_mixed_step_graph_shapes_through_the_model(mods, attn, tiny_llama):
    """The exact forward a mixed-step CUDA graph captures (capture-shaped metadata: decode
    slots for every sequence slot, a -1-padded tile table, padding tokens and sequences),
    through a tiny model on the Triton ops, equals the plain torch-ops forward."""
    from tests.model.util import load, new_pool, run
    from tpserve.model.cuda_graphs import MIXED, StepGraphs
    from tpserve.model.loader.build import build_model
    from tpserve.model.loader.checkpoint import open_checkpoint
    from tpserve.model.plan import SeqChunk, StepPlan

    if DEVICE.type != "cpu":
        pytest.skip("CPU oracle check; on CUDA the runner captures this path at start-up")
    folder = tiny_llama
    ref_model, comm = load(folder)
    model = build_model(open_checkpoint(folder, "auto"), comm, DEVICE, torch.float32,
                        mods["triton_ops"], attn.TritonAttention(torch.float32), 512)
    pool = new_pool(ref_model, comm, num_blocks=32, block_size=16)
    seqs = [list(range(3, 40)), [7, 7, 100]]
    run(ref_model, pool, [SeqChunk(s, 0, t, True) for s, t in zip(seqs, [[3, 17, 4], [9]],
                                                                   strict=True)])
    step = [SeqChunk([42], 37, [3, 17, 4], True), SeqChunk([43], 3, [9], True),
            SeqChunk(list(range(50, 70)), 0, [10, 11], True)]
    plan = StepPlan.build(step, 16, model.attn_backend)
    graphs = StepGraphs(model, pool, model.attn_backend, max_num_seqs=4, max_blocks_per_seq=8,
                        max_model_len=128, device=DEVICE, max_mixed_tokens=32)
    assert graphs.select(plan) == (MIXED, 32)
    before = pool.buffer.clone()
    graphs._fill(MIXED, 32, plan)
    with torch.inference_mode():
        got = graphs._forward(MIXED, 32)[:3]
    pool.buffer.copy_(before)
    want = run(ref_model, pool, step)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_bfloat16_kv_cache_under_a_float32_model(mods, attn, tiny_llama):
    """The Triton back-end writes and reads a bfloat16 cache under a float32 model: the
    same greedy tokens as the float32 cache on the torch back-end, within the tolerance
    justified in ``test_kv_cache_dtype``."""
    from tests.model.test_kv_cache_dtype import assert_same_greedy

    if DEVICE.type != "cpu":
        pytest.skip("CPU oracle check (the model helpers run on CPU)")
    assert_same_greedy(tiny_llama, torch.bfloat16, "triton", 8)


def test_qwen3_head_norms_through_the_triton_ops(mods, attn, tmp_path):
    """A tiny Qwen3 (q and k heads RMS-normed before RoPE, heads wider than hidden / heads)
    on the Triton norm, RoPE and attention kernels: its logits over a prefill and a decode
    step equal the torch reference's on CPU. On CUDA the same forward runs compiled."""
    from tests.model.test_tiny_models import TOKENS, _hf_model
    from tests.model.util import assert_same_steps, load, save_hf_folder
    from tpserve.model.loader.build import build_model
    from tpserve.model.loader.checkpoint import open_checkpoint
    from tpserve.model.plan import SeqChunk

    folder = str(save_hf_folder(_hf_model("qwen3"), tmp_path / "qwen3"))
    ref_model, comm = load(folder)
    model = build_model(open_checkpoint(folder, "auto"), comm, DEVICE, torch.float32,
                        mods["triton_ops"], attn.TritonAttention(torch.float32), 512)
    assert model.cfg.qk_norm
    assert_same_steps(ref_model, model, comm,
                      [[SeqChunk(TOKENS, 0, [0], True)],
                       [SeqChunk([5], len(TOKENS), [0], True)]], DEVICE)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_through_the_triton_ops(mods, attn, tmp_path, kind):
    """Tiny Gemma 2 (softcapped attention in both kernels, sandwich and unit-offset norms,
    the GeLU-tanh gate) and Gemma 3 (unit-offset q/k head norms in the RoPE kernel, two
    RoPE tables) on the Triton ops: logits over a prefill, a chunk over a cached prefix and
    a decode step equal the torch reference's on CPU."""
    from tests.model.test_gemma import TOKENS, _hf_model
    from tests.model.util import assert_same_steps, load, save_hf_folder
    from tpserve.model.loader.build import build_model
    from tpserve.model.loader.checkpoint import open_checkpoint
    from tpserve.model.plan import SeqChunk

    folder = str(save_hf_folder(_hf_model(kind), tmp_path / kind))
    ref_model, comm = load(folder)
    model = build_model(open_checkpoint(folder, "auto"), comm, DEVICE, torch.float32,
                        mods["triton_ops"], attn.TritonAttention(torch.float32), 512)
    assert model.cfg.norm_unit_offset
    assert_same_steps(ref_model, model, comm,
                      [[SeqChunk(TOKENS[:10], 0, [0, 1], True)],
                       [SeqChunk(TOKENS[10:], 10, [0, 1], True)],
                       [SeqChunk([5], len(TOKENS), [0, 1], True)]], DEVICE)


def test_smollm3_nope_layers_through_the_triton_ops(mods, attn, tmp_path):
    """SmolLM3's NoPE layers on the Triton RoPE kernel: the identity table is one row
    expanded over every position (stride 0), which the kernel reads as a table; logits
    over a prefill, a chunk and a decode equal the torch reference's."""
    from tests.model.test_smollm3 import TOKENS, _hf_smollm3
    from tests.model.util import assert_same_steps, load, save_hf_folder
    from tpserve.model.loader.build import build_model
    from tpserve.model.loader.checkpoint import open_checkpoint
    from tpserve.model.plan import SeqChunk

    folder = str(save_hf_folder(_hf_smollm3(), tmp_path / "smollm3"))
    ref_model, comm = load(folder)
    model = build_model(open_checkpoint(folder, "auto"), comm, DEVICE, torch.float32,
                        mods["triton_ops"], attn.TritonAttention(torch.float32), 512)
    assert model.cfg.nope_layers == (1, 3)
    assert_same_steps(ref_model, model, comm,
                      [[SeqChunk(TOKENS[:9], 0, [0, 1], True)],
                       [SeqChunk(TOKENS[9:], 9, [0, 1], True)],
                       [SeqChunk([5], len(TOKENS), [0, 1], True)]], DEVICE)
