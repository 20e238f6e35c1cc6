"""GGUF K-quants (``Q2_K`` .. ``Q6_K``), ``Q5_0`` / ``Q5_1`` and files that mix types
by tensor, as llama.cpp's ``Q4_K_M`` does, served as stored (``--quantization gguf``,
``loader/gguf_blocks.py``, ``loader/gguf_integer.py``): every type's blocks against the
``gguf`` package's dequantization, and a tiny Llama written as a real GGUF file of random
blocks (the package cannot quantize to the K-quants) served as stored and dequantized at
load (the default), on real gloo ranks and through the Triton kernels."""

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
    random_blocks,
    recompose_blocks,
    save_gguf_file,
    tiny_hf_model,
)
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.loader.gguf_blocks import BLOCK_TYPES
from tpserve.model.loader.gguf_integer import Form, GGUFBlocks
from tpserve.model.quant.methods import ModuleMethods
from tpserve.model.quant.wna16 import dequantize
from tpserve.model.quant.wna16_method import Wna16Method
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.state import TPGroup

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
# hidden 256: whole 256-column superblocks; at tp 2 a rank's o/down columns split them
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12]
# layer -> llama.cpp tensor -> type: layer 0 as Q4_K_M (a Q6_K v and down), layer 1 mixing
# Q5_K, Q5_0 and Q8_0, layer 2 as Q2_K / Q3_K_S files (every module's form differs from
# some other's)
MIXES = {
    "Q4_K_M": {0: dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q4_K",
                       ffn_gate="Q4_K", ffn_up="Q4_K", ffn_down="Q6_K"),
               1: dict(attn_q="Q5_K", attn_k="Q5_K", attn_v="Q5_K", attn_output="Q8_0",
                       ffn_gate="Q5_0", ffn_up="Q5_1", ffn_down="Q4_K"),
               2: dict(attn_q="Q2_K", attn_k="Q2_K", attn_v="Q3_K", attn_output="Q3_K",
                       ffn_gate="Q2_K", ffn_up="Q2_K", ffn_down="Q4_0")},
    "Q4_K": {layer: dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                   "ffn_up", "ffn_down"), "Q4_K") for layer in (0, 1, 2)},
}
# the modules' forms for MIXES["Q4_K_M"]: (layer, module) -> (bits, group, offset)
FORMS = {(0, "qkv_proj"): (8, 16, True), (0, "o_proj"): (4, 32, True),
         (0, "gate_up_proj"): (4, 32, True), (0, "down_proj"): (8, 16, False),
         (1, "qkv_proj"): (8, 32, True), (1, "o_proj"): (8, 32, False),
         (1, "gate_up_proj"): (8, 32, True), (1, "down_proj"): (4, 32, True),
         (2, "qkv_proj"): (4, 16, True), (2, "o_proj"): (4, 16, False),
         (2, "gate_up_proj"): (4, 16, True), (2, "down_proj"): (4, 32, False)}


def _tensor(kind: str, rows: int, cols: int, seed: int) -> SimpleNamespace:
    raw = random_blocks(kind, rows, cols, np.random.default_rng(seed))
    return SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=getattr(Q, kind),
                           data=raw, shape=(cols, rows))


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_every_type_recomposes_to_the_gguf_packages_dequantization(kind):
    """Each type's codes, scales and zero points (or offsets), in its own form and in the
    widest (8 bits, groups of 16, offsets: a module mixing it with ``Q6_K``), recompose in
    float32 to ``gguf.quants.dequantize`` of the same bytes bit for bit: whole, a range of
    rows, a range of columns inside 256-column superblocks, and a q tensor's rows with
    llama.cpp's per-head permutation undone."""
    bt = BLOCK_TYPES[kind]
    rows, cols = 48, 768
    t = _tensor(kind, rows, cols, seed=5)
    want = torch.from_numpy(
        gguf.quants.dequantize(t.data, getattr(Q, kind)).reshape(rows, cols).copy())
    assert want.abs().max() > 0 and torch.isfinite(want).all()
    codes = GGUFBlocks(t, "codes", None, Form(8, 16, True)).read()
    assert codes.min() == 0 and codes.max() == 2**bt.bits - 1  # every code reached
    own = Form(4 if bt.bits <= 4 else 8, bt.group, bt.zero is None)
    for form in (own, Form(8, 16, True)):
        assert torch.equal(recompose_blocks(t, form), want), form
        assert torch.equal(recompose_blocks(t, form, dim=0, start=8, length=16), want[8:24])
        assert torch.equal(recompose_blocks(t, form, dim=1, start=64, length=320), want[:, 64:384])
        heads = recompose_blocks(t, form, heads=6)
        assert torch.equal(heads.reshape(6, 2, 4, cols).transpose(1, 2).reshape(rows, cols),
                           want)
        halves = [recompose_blocks(t, form, heads=6, dim=0, start=s, length=24) for s in (0, 24)]
        assert torch.equal(torch.cat(halves), heads)


def _types(mix: str, gname: str) -> str:
    layer, name = gname.split(".")[1:3]
    return MIXES[mix][int(layer)][name]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    import transformers as tf

    torch.manual_seed(12)  # the linear weights: random blocks; the rest: the model's
    hf = tiny_hf_model(tf.LlamaConfig(**SHAPE), "LlamaForCausalLM")
    root = tmp_path_factory.mktemp("kquants")
    out = {}
    for seed, mix in enumerate(MIXES):
        rng = np.random.default_rng(seed)

        def blocks(gname, values, mix=mix, rng=rng):
            kind = _types(mix, gname)
            return random_blocks(kind, *values.shape, rng), getattr(Q, kind)

        out[mix] = str(save_gguf_file(hf, root / f"{mix}.gguf", "llama",
                                      linear_blocks=blocks))
    return out


def _served_weights(model) -> dict[str, tuple[Wna16Method, torch.Tensor]]:
    return {name: (mod.quant_method,
                   dequantize(mod.qweight, mod.scales, mod.zeros, mod.g_idx,
                              mod.quant_method.bits, offset=mod.quant_method.offset))
            for name, mod in model.named_modules()
            if isinstance(getattr(mod, "quant_method", None), Wna16Method)}


def test_a_mixed_file_is_served_as_stored_a_form_per_module(files):
    """The ``Q4_K_M``-like file: ``--quantization gguf`` builds each decoder module in its
    form (``FORMS``: a Q6_K v makes its q/k/v 8 bits in groups of 16 with offsets, a lone
    Q6_K down keeps its zero point 32), and every served weight equals the default's (the
    blocks dequantized at load) bit for bit in float32; the logits agree within float32
    summation order (the reference multiplies a transposed dequantized weight, which BLAS
    may sum in another order at these sizes), with the same greedy token everywhere."""
    one = TPGroup(0, 1, CPU, None)
    served, comm, methods = load_resolved(files["Q4_K_M"], "gguf", one)
    assert isinstance(methods, ModuleMethods)
    dense, dense_comm, none = load_resolved(files["Q4_K_M"], "auto", one)
    assert none is None
    params = dict(dense.named_parameters())
    weights = _served_weights(served)
    assert len(weights) == len(FORMS)
    for name, (method, w) in weights.items():
        layer, module = int(name.split(".")[2]), name.split(".")[-1]
        bits, group, offset = FORMS[(layer, module)]
        assert method == Wna16Method("gguf", bits, group, offset=offset), name
        assert torch.equal(w, params[f"{name}.weight"]), name
    got, want = full_logits(served, comm, TOKENS), full_logits(dense, dense_comm, TOKENS)
    # 1e-4: three layers of random blocks; the order BLAS sums in varies between runs
    # (a run measured 1e-6, one exceeded 1e-5); a wrong weight moves logits by ~1
    assert (got - want).abs().max() <= 1e-4 * want.abs().max() and want.abs().max() > 0
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_file_of_one_k_quant_takes_one_method(files):
    """A file all ``Q4_K``: one method for every module (4 bits, groups of 32, the offsets
    ``-dmin * m``), each served weight bit for bit the default's."""
    one = TPGroup(0, 1, CPU, None)
    served, comm, method = load_resolved(files["Q4_K"], "gguf", one)
    assert method == Wna16Method("gguf", 4, 32, offset=True)
    params = dict(load_resolved(files["Q4_K"], "auto", one)[0].named_parameters())
    weights = _served_weights(served)
    assert len(weights) == 4 * SHAPE["num_hidden_layers"]
    for name, (_, w) in weights.items():
        assert torch.equal(w, params[f"{name}.weight"]), name


def test_sixteen_bit_weights_round_the_scales_once_more(files):
    """In float16 a K-quant's scale ``d * sc`` and offset ``-dmin * m`` (up to 17
    significant bits) are held in float16: each served weight is within ``2**-10 (|q s| +
    |z|)`` plus its own rounding of the file's dequantized weight, which rounds once; the
    modules whose scales are ``d`` itself (``Q8_0``, ``Q4_0``; ``Q5_0`` and ``Q5_1``, with an
    integer zero point as the offset ``-16 d``, exact) are served bit for bit."""
    one = TPGroup(0, 1, CPU, None)
    served = load_resolved(files["Q4_K_M"], "gguf", one, dtype=torch.float16)[0]
    dense = dict(load_resolved(files["Q4_K_M"], "auto", one, dtype=torch.float16)[0]
                 .named_parameters())
    exact = {"model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate_up_proj",
             "model.layers.2.mlp.down_proj"}
    rounded = 0
    for name, (method, w) in _served_weights(served).items():
        want = dense[f"{name}.weight"].float()
        if name in exact:
            assert torch.equal(w.float(), want), name
            continue
        mod = served.get_submodule(name)
        s, z = mod.scales.float(), mod.zeros.float()
        mag = (dequantize(mod.qweight, s.abs(), z.abs(), mod.g_idx, method.bits, offset=True)
               if method.offset else
               dequantize(mod.qweight, s, z, mod.g_idx, method.bits).abs())
        assert ((w.float() - want).abs() <= 2.0 ** -10 * (mag + want.abs())).all(), name
        rounded += int((w.float() != want).sum())
    assert rounded > 0  # the scales' rounding shows: these weights are not all bit for bit


def _tp_logits(group: TPGroup, path: str) -> torch.Tensor:
    model, comm, _ = load_resolved(path, "gguf", group)
    return full_logits(model, comm, TOKENS)


def test_two_ranks_serve_the_mixed_file_as_one_does(files):
    """At tp 2 each rank holds its rows of q/k/v and gate/up and its half of o's and down's
    columns (128 and 256: half a 256-column superblock, whole 16- and 32-column groups):
    the logits equal tp 1's dequantized model within float32 summation order."""
    want = full_logits(*load_resolved(files["Q4_K_M"], "auto", TPGroup(0, 1, CPU, None))[:2],
                       TOKENS)
    for got in run_ranks(_tp_logits, 2, files["Q4_K_M"]):
        assert (got - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max()))


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter's run; on a GPU: test_the_mixed_file_on_the_gpu")
def test_the_triton_kernels_serve_the_mixed_file_as_the_reference_does(files):
    """The Triton back-end (the WNA16 kernels; Triton's interpreter off CUDA) on every form
    of the mixed file: 8- and 4-bit codes in groups of 16 and 32, with offsets or a zero
    point; 13 rows through 16-row tiles."""
    pytest.importorskip("triton")
    one = TPGroup(0, 1, CPU, None)
    model, comm, methods = load_resolved(files["Q4_K_M"], "gguf", one, "triton")
    assert {m.backend for m in methods.methods.values()} == {"triton"}
    want = full_logits(*load_resolved(files["Q4_K_M"], "gguf", one)[:2], TOKENS)
    got = full_logits(model, comm, TOKENS)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels on a GPU")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_mixed_file_on_the_gpu(files, dtype):
    """On a GPU, the mixed file's every form through the Triton kernels: a prefill and two
    decode steps replayed in CUDA graphs equal the eager forward, and the eager prefill's
    last logits equal the CPU reference's (the file dequantized at load, float32) within
    float32 summation order (float16: its rounding, the scales' included)."""
    from tpserve.model.plan import SeqChunk, StepLimits
    from tpserve.model.runner_config import RunnerConfig

    n = len(TOKENS)
    limits = StepLimits(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128,
                        block_size=16)
    steps = [[SeqChunk(TOKENS, 0, [0], True)], [SeqChunk([7], n, [0], True)],
             [SeqChunk([9], n + 1, [0], True)]]
    rc = RunnerConfig(model=files["Q4_K_M"], dtype=dtype, device="cuda",
                      kernel_backend="triton", quantization="gguf",
                      kv_cache_memory=64 * 2**20, cuda_graph_max_tokens=64)

    def check(runner):
        got = {(m.quant_method.bits, m.quant_method.group_size, m.quant_method.offset,
                m.quant_method.backend) for m in runner.model.modules()
               if isinstance(getattr(m, "quant_method", None), Wna16Method)}
        assert got == {(*form, "triton") for form in FORMS.values()}

    graphed, eager = graphs_and_eager(rc, limits, steps, check)
    tol = 1e-4 if dtype == "float32" else 1e-2
    for got, ref in zip(graphed, eager, strict=True):
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    dense, comm, _ = load_resolved(files["Q4_K_M"], "auto", TPGroup(0, 1, CPU, None))
    want = full_logits(dense, comm, TOKENS)[-1]
    assert float((eager[0][0] - want).abs().max()) <= tol * float(want.abs().max())


def test_the_default_says_what_serving_as_stored_would_take(files, caplog):
    """Served dequantized (``auto``), a servable file's start-up log names its block types
    and both sizes of its linear weights: dequantized (elements x the dtype's bytes) and as
    stored (each module's codes at 4 or 8 bits, a 16-bit scale per group, and a 16-bit
    offset or an 8-bit zero point); the does-not-fit advice holds the weights as stored
    (none when served as stored already)."""
    from tpserve.model.plan import StepLimits
    from tpserve.model.runner import ModelRunner
    from tpserve.model.runner_config import RunnerConfig

    h, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    elements = {"qkv_proj": (h + 2 * kv) * h, "o_proj": h * h,
                "gate_up_proj": 2 * inter * h, "down_proj": h * inter}
    want = sum(elements[module] * bits // 8
               + elements[module] // group * (2 + (2 if offset else 1))
               for (_, module), (bits, group, offset) in FORMS.items())
    total = SHAPE["num_hidden_layers"] * sum(elements.values())
    q = open_checkpoint(files["Q4_K_M"]).quantization
    assert (q.linear_weights, q.stored_bytes) == (total, want)
    assert dict(q.block_types) == {"Q2_K": 4, "Q3_K": 2, "Q4_0": 1, "Q4_K": 6, "Q5_0": 1,
                                   "Q5_1": 1, "Q5_K": 3, "Q6_K": 2, "Q8_0": 1}
    limits = StepLimits(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                        block_size=16)
    with caplog.at_level("INFO", logger="tpserve.model.runner"):
        runner = ModelRunner(RunnerConfig(model=files["Q4_K_M"], dtype="bfloat16",
                                          kv_cache_memory=2**20), limits,
                             TPGroup(0, 1, CPU, None))
    # the does-not-fit advice's weights as stored: the linear weights' saving taken off
    assert runner.fit.stored_weights == runner.fit.weights - (total * 2 - want)
    served = ModelRunner(RunnerConfig(model=files["Q4_K_M"], quantization="gguf",
                                      kv_cache_memory=2**20), limits, TPGroup(0, 1, CPU, None))
    assert served.fit.stored_weights is None
    gib = 2.0**30
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("linear layers:"))
    assert line == ("linear layers: the GGUF file's blocks (4 x Q2_K, 2 x Q3_K, 1 x Q4_0, "
                    "6 x Q4_K, 1 x Q5_0, 1 x Q5_1, 3 x Q5_K, 2 x Q6_K, 1 x Q8_0) dequantized "
                    f"to bfloat16 at load: {total * 2 / gib:.2f} GiB over all ranks; "
                    f"--quantization gguf serves them as stored in {want / gib:.2f} GiB")
