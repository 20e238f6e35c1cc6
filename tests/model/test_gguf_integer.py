"""GGUF ``Q8_0`` / ``Q4_0`` / ``Q4_1`` weights served as stored (``--quantization gguf``,
``loader/gguf_integer.py``): the blocks read as WNA16 codes, scales and zero points, against
the ``gguf`` package's own dequantization, and a tiny Llama written as a real GGUF file
(q/k rows permuted as llama.cpp's converter does) served both ways: as stored, and
dequantized at load (the default), on real gloo ranks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.model.util import (
    CPU,
    full_logits,
    graphs_and_eager,
    load_resolved,
    recompose_blocks,
    save_gguf_file,
)
from tpserve.model.loader.checkpoint import embedded_model_path, open_checkpoint
from tpserve.model.loader.gguf_integer import Form, GGUFBlocks, stored_integer
from tpserve.model.quant.fp8 import Fp8LinearMethod
from tpserve.model.quant.methods import linear_method, resolve_quantization
from tpserve.model.quant.wna16 import dequantize
from tpserve.model.quant.wna16_method import Wna16Method
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.state import TPGroup

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
TYPES = {"Q8_0": (Q.Q8_0, 8), "Q4_0": (Q.Q4_0, 4), "Q4_1": (Q.Q4_1, 4)}
# 64 / 128 columns: whole 32-column blocks on each of 2 ranks (o_proj, down_proj)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12]


def _tensor(values: np.ndarray, qtype) -> SimpleNamespace:
    """A GGUF reader's tensor record of ``values`` quantized to ``qtype``."""
    data = gguf.quants.quantize(values, qtype)
    return SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=qtype, data=data,
                           shape=tuple(reversed(values.shape)))


@pytest.mark.parametrize("kind", TYPES)
def test_blocks_equal_the_gguf_packages_dequantization(kind):
    """Values quantized by the ``gguf`` package: ``(code - zero) * scale`` (``Q4_1``:
    ``code * scale + offset``) of every element equals ``gguf.quants.dequantize`` of the
    same bytes exactly: whole, a range of rows, a range of whole blocks of columns, and
    rows of a q tensor with llama.cpp's per-head permutation undone."""
    qtype, bits = TYPES[kind]
    values = np.random.default_rng(3).standard_normal((48, 96)).astype(np.float32)
    t = _tensor(values, qtype)
    want = torch.from_numpy(gguf.quants.dequantize(t.data, qtype).reshape(48, 96).copy())
    form = Form(bits, 32, kind == "Q4_1")
    assert torch.equal(recompose_blocks(t, form), want)
    codes = GGUFBlocks(t, "codes", None, form).read()
    assert codes.min() >= 0 and codes.max() < 2**bits and codes.float().std() > 1
    assert torch.equal(recompose_blocks(t, form, dim=0, start=8, length=16), want[8:24])
    assert torch.equal(recompose_blocks(t, form, dim=1, start=32, length=64), want[:, 32:96])
    # a head-permuted q of 6 heads of 8 rows: read as 3 + 3 heads equals the whole
    heads = GGUFBlocks(t, "codes", 6, form)
    whole = heads.read()
    assert torch.equal(torch.cat([heads.read(0, 0, 24), heads.read(0, 24, 24)]), whole)
    assert torch.equal(whole.reshape(6, 2, 4, 96).transpose(1, 2).reshape(48, 96), codes)


def test_which_files_are_servable_and_in_which_forms():
    """A file is servable as stored when its decoder linear weights are all of the served
    types (``gguf_blocks.BLOCK_TYPES``); each module (q/k/v, o, gate/up, down of a layer)
    takes 4 bits if its parts have at most 4, else 8, the smallest group, and the type's
    zero point when all its parts are of one such type, else offsets. One form for all: one
    method; forms that differ (a ``Q4_K_M`` file): a method per module. An ``IQ`` type, a
    float type or Phi-3's fused q/k/v is not servable; embeddings and norms do not count."""
    def record(name, qtype):  # GGUF's shape: columns first
        return SimpleNamespace(name=name, tensor_type=qtype, shape=(512, 256))

    lin = ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.1.attn_output.weight"]
    other = [record("token_embd.weight", Q.Q6_K), record("blk.0.attn_norm.weight", Q.F32)]
    q8 = stored_integer([record(n, Q.Q8_0) for n in lin] + other)
    assert (q8.method, q8.bits, q8.group_size, q8.dequantizable) == ("gguf", 8, 32, True)
    assert (q8.modules, q8.block_types) == ((), (("Q8_0", 3),))
    # 3 x 256 x 512 weights: a byte each, a 2-byte scale and a byte zero point per 32
    assert (q8.linear_weights, q8.stored_bytes) == (3 * 256 * 512, 3 * 256 * 16 * 35)
    assert stored_integer([record(n, Q.Q4_0) for n in lin]).bits == 4
    q41 = stored_integer([record(n, Q.Q4_1) for n in lin])
    assert (q41.bits, q41.offset, q8.offset) == (4, True, False)
    q4k = stored_integer([record(n, Q.Q4_K) for n in lin])
    assert (q4k.bits, q4k.group_size, q4k.offset, q4k.modules) == (4, 32, True, ())
    q6k = stored_integer([record(n, Q.Q6_K) for n in lin])
    assert (q6k.bits, q6k.group_size, q6k.offset, q6k.modules) == (8, 16, False, ())
    # types by module: each module in its own type's form
    mixed = stored_integer([record(lin[0], Q.Q8_0), record(lin[1], Q.Q4_0),
                            record(lin[2], Q.Q5_1)])
    assert mixed.modules == ((0, "down_proj", 4, 32, False), (0, "qkv_proj", 8, 32, False),
                             (1, "o_proj", 8, 32, True))
    assert (mixed.quant_method, mixed.bits, mixed.group_size) == ("Q4_0+Q5_1+Q8_0", 8, 32)
    # Q4_K_M's q/k/v: Q4_K q and k with a Q6_K v, one module in 8 bits, groups of 16, offsets
    q4km = stored_integer([record("blk.0.attn_q.weight", Q.Q4_K),
                           record("blk.0.attn_k.weight", Q.Q4_K),
                           record("blk.0.attn_v.weight", Q.Q6_K),
                           record("blk.0.ffn_gate.weight", Q.Q4_K),
                           record("blk.0.ffn_up.weight", Q.Q4_K),
                           record("blk.0.ffn_down.weight", Q.Q6_K)])
    assert q4km.modules == ((0, "down_proj", 8, 16, False), (0, "gate_up_proj", 4, 32, True),
                            (0, "qkv_proj", 8, 16, True))
    assert q4km.describe() == (
        "the GGUF file's blocks (4 x Q4_K, 2 x Q6_K) in 3 modules: 1 in 4-bit groups of 32 "
        "with offsets, 1 in 8-bit groups of 16, 1 in 8-bit groups of 16 with offsets")
    methods = linear_method("gguf", "torch", CPU, torch.float32, 32, q4km)
    assert methods.of(0, "qkv_proj") == Wna16Method("gguf", 8, 16, offset=True)
    assert methods.of(0, "down_proj") == Wna16Method("gguf", 8, 16)
    assert methods.of(0, "gate_up_proj") == Wna16Method("gguf", 4, 32, offset=True)
    with pytest.raises(ValueError, match="no weight for layer 0's o_proj"):
        methods.of(0, "o_proj")
    assert resolve_quantization("auto", q4km) == "none"  # dequantized at load
    assert linear_method("none", "torch", CPU, torch.float32, 32, q4km) is None
    q3k = stored_integer([record(n, Q.Q3_K) for n in lin])
    assert (q3k.bits, q3k.group_size, q3k.offset, q3k.modules) == (4, 16, False, ())
    for unserved in (Q.IQ4_XS, Q.IQ4_NL, Q.IQ2_XXS, Q.F16):
        assert stored_integer([record(n, unserved) for n in lin]) is None
    assert stored_integer([record(lin[0], Q.Q4_K), record(lin[1], Q.IQ4_XS)]) is None
    # Phi-3's fused q/k/v (loaded part by part) is not served as stored
    assert stored_integer([record(n, Q.Q8_0) for n in lin]
                          + [record("blk.0.attn_qkv.weight", Q.Q8_0)]) is None
    embedded = open_checkpoint(str(embedded_model_path()))
    assert embedded.quantization.quant_method == "Q4_1"
    assert resolve_quantization("gguf", embedded.quantization) == "gguf"
    assert resolve_quantization("auto", embedded.quantization) == "none"
    with pytest.raises(ValueError, match="all of the types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                                         "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"):
        resolve_quantization("gguf", stored_integer([record(n, Q.IQ4_XS) for n in lin]))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    import transformers as tf

    torch.manual_seed(11)
    cfg = tf.LlamaConfig(**SHAPE)
    cfg.architectures = ["LlamaForCausalLM"]
    hf = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("ggufint")
    return {kind: str(save_gguf_file(hf, root / f"{kind}.gguf", "llama",
                                     linear_type=qtype))
            for kind, (qtype, _) in TYPES.items()}


@pytest.mark.parametrize("kind", TYPES)
def test_served_as_stored_equals_the_file_dequantized_at_load(files, kind):
    """``--quantization gguf`` holds every decoder linear weight as its codes (int32-packed)
    with fp16-exact scales and the type's zero point, and gives bit for bit the logits of
    the default, which dequantizes the same blocks at load; ``auto``, ``none`` and ``fp8``
    keep serving such a file as before (dequantized; fp8 quantizes the floats)."""
    _, bits = TYPES[kind]
    served, comm, method = load_resolved(files[kind], "gguf", TPGroup(0, 1, CPU, None))
    offset = kind == "Q4_1"
    assert method == Wna16Method("gguf", bits, 32, offset=offset)
    one = TPGroup(0, 1, CPU, None)
    dense, dense_comm, none = load_resolved(files[kind], "auto", one)
    assert none is None and load_resolved(files[kind], "none", one)[2] is None
    assert isinstance(load_resolved(files[kind], "fp8", one)[2], Fp8LinearMethod)
    params = dict(dense.named_parameters())
    layers = 0
    for name, mod in served.named_modules():
        if isinstance(getattr(mod, "quant_method", None), Wna16Method):
            layers += 1
            assert mod.qweight.dtype == torch.int32
            assert mod.qweight.shape[0] == mod.g_idx.numel() * bits // 32
            if not offset:  # the type's zero point; Q4_1: every block's own offset
                assert set(mod.zeros.unique().tolist()) == {2.0 ** (bits - 1)}
            w = dequantize(mod.qweight, mod.scales, mod.zeros, mod.g_idx, bits,
                           offset=offset)
            assert torch.equal(w, params[f"{name}.weight"]), name
    assert layers == 2 * SHAPE["num_hidden_layers"] * 2  # qkv, o, gate_up, down a layer
    got, want = full_logits(served, comm, TOKENS), full_logits(dense, dense_comm, TOKENS)
    assert torch.equal(got, want) and got.abs().max() > 0


def _tp_logits(group: TPGroup, path: str, quantization: str) -> torch.Tensor:
    model, comm, _ = load_resolved(path, quantization, group)
    return full_logits(model, comm, TOKENS)


@pytest.mark.parametrize("kind", TYPES)
def test_two_ranks_serve_the_blocks_as_one_does(files, kind):
    """At tp 2 each rank holds its rows of q/k/v and gate/up (whole heads, unpermuted) and
    its 32-column blocks of o and down: the logits equal tp 1's dequantized model within
    float32 summation order."""
    want = full_logits(*load_resolved(files[kind], "auto", TPGroup(0, 1, CPU, None))[:2], TOKENS)
    for got in run_ranks(_tp_logits, 2, files[kind], "gguf"):
        assert (got - want).abs().max() <= 1e-5


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter's run; on a GPU: test_the_blocks_on_the_gpu_kernels")
@pytest.mark.parametrize("kind", TYPES)
def test_the_triton_kernels_serve_the_blocks_as_the_reference_does(files, kind):
    """The Triton back-end (the WNA16 kernels; Triton's interpreter off CUDA) on the 32-column
    groups: a scale row per packed row of a K step, 13 rows through 16-row tiles."""
    pytest.importorskip("triton")
    one = TPGroup(0, 1, CPU, None)
    model, comm, method = load_resolved(files[kind], "gguf", one, "triton")
    assert method.backend == "triton"
    want = full_logits(*load_resolved(files[kind], "gguf", one)[:2], TOKENS)
    assert (full_logits(model, comm, TOKENS) - want).abs().max() <= 1e-5


def test_the_embedded_q4_1_model_served_as_stored_gives_its_logits():
    """The embedded SmolLM2 (a real llama.cpp Q4_1 file, its token embedding Q8_0):
    ``--quantization gguf`` holds its 210 Q4_1 weights (30 layers, 7 each) at 4 bits with
    their offsets; each served weight is the default's (dequantized at load) bit for bit,
    and the logits agree within float32 summation order (the reference multiplies a
    transposed dequantized weight, which BLAS may sum in another order at these sizes),
    with the same greedy token at every position."""
    path = str(embedded_model_path())
    one = TPGroup(0, 1, CPU, None)
    served, comm, method = load_resolved(path, "gguf", one)
    assert method == Wna16Method("gguf", 4, 32, offset=True)
    dense, dense_comm, _ = load_resolved(path, "auto", one)
    params = dict(dense.named_parameters())
    layers = 0
    for name, mod in served.named_modules():
        if isinstance(getattr(mod, "quant_method", None), Wna16Method):
            layers += 1
            w = dequantize(mod.qweight, mod.scales, mod.zeros, mod.g_idx, 4, offset=True)
            assert torch.equal(w, params[f"{name}.weight"]), name
    assert layers == 30 * 4  # qkv, o, gate_up, down
    got, want = full_logits(served, comm, TOKENS), full_logits(dense, dense_comm, TOKENS)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels on a GPU")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", TYPES)
def test_the_blocks_on_the_gpu_kernels(files, kind, dtype):
    """On a GPU, each type served as stored (``Q4_1``: the kernels' ``OFFSET`` form; groups
    of 32): a prefill and two decode steps replayed in CUDA graphs equal the eager forward,
    and the eager prefill's last logits equal the CPU reference's (the file dequantized at
    load, float32) within float32 summation order (float16: its rounding)."""
    from tpserve.model.plan import SeqChunk, StepLimits
    from tpserve.model.runner_config import RunnerConfig

    n = len(TOKENS)
    limits = StepLimits(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128,
                        block_size=16)
    steps = [[SeqChunk(TOKENS, 0, [0], True)], [SeqChunk([7], n, [0], True)],
             [SeqChunk([9], n + 1, [0], True)]]
    rc = RunnerConfig(model=files[kind], dtype=dtype, device="cuda", kernel_backend="triton",
                      quantization="gguf", kv_cache_memory=64 * 2**20,
                      cuda_graph_max_tokens=64)
    method = Wna16Method("gguf", TYPES[kind][1], 32, backend="triton", offset=kind == "Q4_1")

    def check(runner):
        assert method in {getattr(m, "quant_method", None) for m in runner.model.modules()}

    graphed, eager = graphs_and_eager(rc, limits, steps, check)
    tol = 1e-5 if dtype == "float32" else 1e-2
    for got, ref in zip(graphed, eager, strict=True):
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    dense, comm, _ = load_resolved(files[kind], "auto", TPGroup(0, 1, CPU, None))
    want = full_logits(dense, comm, TOKENS)[-1]
    assert float((eager[0][0] - want).abs().max()) <= tol * float(want.abs().max())
