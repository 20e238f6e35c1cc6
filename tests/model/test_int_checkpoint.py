"""GPTQ, AWQ and compressed-tensors pack-quantized checkpoints (``quantization_config``
"gptq" / "awq" / "compressed-tensors") served as stored: integer codes packed 8 (4-bit) or 4
(8-bit) to an int32, float16 group scales and zero points (or symmetric ones), on
real safetensors folders written here (``tests/model/int_checkpoints.py``) and real gloo
ranks, against the same model with the dequantized weights stored as float32.

The model pads at tp 2 (6 query / 3 KV heads -> 8 / 4), so q/k/v have padding rows and
o_proj padding columns on the last rank; groups of 32 columns span two ranks' columns
(o_proj at tp 3, down_proj at tp 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.model.int_checkpoints import save_int_folders
from tests.model.util import (
    CPU,
    full_logits,
    graphs_and_eager,
    save_fp8_folder,
    save_hf_folder,
)
from tpserve.model.attention.backend import select_attention
from tpserve.model.kernels.backend import select_ops
from tpserve.model.loader.build import build_model
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.quant.methods import linear_method, resolve_quantization
from tpserve.model.quant.wna16 import dequantize
from tpserve.model.quant.wna16_method import Wna16Method
from tpserve.parallel.comm import Communicator
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.state import TPGroup

TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12]
SHAPE = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=3, vocab_size=256,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
ONE = TPGroup(0, 1, CPU, None)
# name: (format, bits, group size, act-order, GPTQ checkpoint_format)
KINDS = {"gptq-4bit-g32": ("gptq", 4, 32, False, "gptq"),
         "ct-4bit-g32-symmetric": ("compressed-tensors", 4, 32, False, "symmetric"),
         "ct-4bit-g16-act-order": ("compressed-tensors", 4, 16, True, ""),
         "ct-8bit-per-row": ("compressed-tensors", 8, -1, False, "symmetric"),
         "gptq-4bit-act-order": ("gptq", 4, 32, True, "gptq"),
         "gptq-8bit-per-row": ("gptq", 8, -1, False, "gptq"),
         "gptq_v2-4bit-g16": ("gptq", 4, 16, False, "gptq_v2"),
         "awq-4bit-g32": ("awq", 4, 32, False, "gptq"),
         "awq-4bit-g16": ("awq", 4, 16, False, "gptq")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each kind's (quantized folder, dequantized float32 twin), and the original."""
    import transformers as tf

    torch.manual_seed(7)
    cfg = tf.LlamaConfig(**SHAPE)
    cfg.architectures = ["LlamaForCausalLM"]
    hf = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("intckpt")
    base = save_hf_folder(hf, root / "base")
    out = {name: save_int_folders(base, root / name, fmt, bits, gs, act, version,
                                  symmetric=version == "symmetric")
           for name, (fmt, bits, gs, act, version) in KINDS.items()}
    out["base"] = (base, base)
    return out


def load_as_served(folder: Path, group: TPGroup, quantization: str = "auto",
                   tp_comm: str = "allreduce"):
    ckpt = open_checkpoint(str(folder))
    resolved = resolve_quantization(quantization, ckpt.quantization)
    method = linear_method(resolved, "torch", CPU, torch.float32, 32, ckpt.quantization)
    comm = Communicator(group)
    model = build_model(ckpt, comm, CPU, torch.float32, select_ops("torch"),
                        select_attention("torch", torch.float32), 512, tp_comm=tp_comm,
                        quant_method=method)
    return model, comm, method


@pytest.mark.parametrize("kind", KINDS)
def test_served_as_stored_equals_the_dequantized_model(folders, kind):
    quantized, twin = folders[kind]
    served, comm, method = load_as_served(quantized, ONE)
    fmt, bits, gs, act_order, version = KINDS[kind]
    assert method == Wna16Method(fmt, bits, gs, int(fmt == "gptq" and version == "gptq"),
                                 symmetric=version == "symmetric", act_order=act_order)
    dense, dense_comm, none = load_as_served(twin, ONE)
    assert none is None
    # every layer's weight, dequantized from what is served, is the twin's float32 weight
    params = dict(dense.named_parameters())
    for name, mod in served.named_modules():
        if isinstance(getattr(mod, "quant_method", None), Wna16Method):
            assert mod.qweight.dtype == torch.int32
            assert mod.qweight.shape == (mod.g_idx.numel() * bits // 32, mod.scales.shape[1])
            w = dequantize(mod.qweight, mod.scales, mod.zeros, mod.g_idx, bits)
            # act-order columns are served sorted by group (tp 1: every group whole)
            assert (mod.perm is not None) == act_order, name
            if act_order:
                assert torch.equal(mod.g_idx, mod.g_idx.sort().values), name
                assert mod.group_runs == (0, gs), name
                w = torch.empty_like(w).index_copy_(1, mod.perm.long(), w)
            assert torch.equal(w, params[f"{name}.weight"]), name
    # the same weights make the same function (act-order: summed in the sorted order)
    _same_function(full_logits(served, comm, TOKENS), full_logits(dense, dense_comm, TOKENS),
                   act_order)


def _same_function(got: torch.Tensor, want: torch.Tensor, act_order: bool) -> None:
    """Bit-equal logits, or with act-order (the served columns sorted by group, so every
    product sums its columns in another float32 order) within 1e-5."""
    if act_order:
        assert (got - want).abs().max() <= 1e-5 and not torch.equal(got, torch.zeros_like(got))
    else:
        assert torch.equal(got, want)


def test_captured_steps_reserve_the_largest_dequantized_weight(folders):
    """From ``DEQUANT_MIN_M`` rows a product dequantizes its layer's weight into a ``[K,
    N]`` scratch, so the graphs' reserve grows by the largest one (the tiny Llama's
    gate_up, K 48 by N 192), and by nothing below that size or without integer layers."""
    from tpserve.model.quant.wna16 import DEQUANT_MIN_M
    from tpserve.model.quant.wna16_method import graph_scratch_bytes

    served, _, _ = load_as_served(folders["gptq-4bit-g32"][0], ONE)
    dense, _, _ = load_as_served(folders["gptq-4bit-g32"][1], ONE)
    gate_up = served.model.layers[0].mlp.gate_up_proj
    want = gate_up.g_idx.numel() * gate_up.qweight.shape[1] * 4  # float32 on CPU
    assert (gate_up.g_idx.numel(), gate_up.qweight.shape[1]) == (48, 192)
    sizes = [m.g_idx.numel() * m.qweight.shape[1] * 4 for m in served.modules()
             if hasattr(m, "qweight")]
    assert want == max(sizes) and len(set(sizes)) > 1
    assert graph_scratch_bytes(served, DEQUANT_MIN_M) == want
    assert graph_scratch_bytes(served, 512) == want
    assert graph_scratch_bytes(served, DEQUANT_MIN_M - 1) == 0
    assert graph_scratch_bytes(dense, 512) == 0


def test_the_served_linear_layers_hold_bits_per_weight(folders):
    """4 bits a weight plus a scale and a zero point per group of 32 (float32 model)."""
    served, _, _ = load_as_served(folders["gptq-4bit-g32"][0], ONE)
    layer = served.model.layers[0].mlp.down_proj  # [48 out, 96 in]
    sizes = {n: (p.dtype, tuple(p.shape)) for n, p in layer.named_parameters()}
    assert sizes == {"qweight": (torch.int32, (12, 48)), "scales": (torch.float32, (3, 48)),
                     "zeros": (torch.float32, (3, 48)), "g_idx": (torch.int32, (96,))}


def _tp_rank(group: TPGroup, folders: dict[str, str], tp_comm: str
             ) -> dict[str, torch.Tensor]:
    out = {}
    for kind, path in folders.items():
        model, comm, _ = load_as_served(Path(path), group, tp_comm=tp_comm)
        out[kind] = full_logits(model, comm, TOKENS)
    return out


@pytest.mark.parametrize("tp, tp_comm", [(2, "allreduce"), (3, "allreduce"),
                                         (2, "allgather")])
def test_tensor_parallel_equals_tp1(folders, tp, tp_comm):
    """Every rank's logits equal tp 1's on the dequantized twin, with the all-reduce and
    with sequence parallelism (all-gather in, reduce-scatter out of each block)."""
    kinds = ("gptq-4bit-act-order", "gptq-8bit-per-row", "awq-4bit-g32",
             "ct-4bit-g16-act-order")
    ranks = run_ranks(_tp_rank, tp, {k: str(folders[k][0]) for k in kinds}, tp_comm)
    for kind in kinds:
        dense, comm, _ = load_as_served(folders[kind][1], ONE)
        want = full_logits(dense, comm, TOKENS)
        for r in ranks:
            assert torch.allclose(r[kind], want, rtol=1e-4, atol=1e-4), (kind, tp, tp_comm)


def test_gptq_zero_biases_are_skipped_and_others_refused(folders, tmp_path):
    from tests.model.test_fp8_checkpoint import _rewrite

    def nonzero(state):
        name = "model.layers.1.self_attn.o_proj.bias"
        if name in state:
            state[name] = state[name] + 1
    broken = _rewrite(folders["gptq-4bit-g32"][0], tmp_path / "bias", tensors=nonzero)
    with pytest.raises(ValueError, match="model.layers.1.self_attn.o_proj.bias.*has no "
                                         "place in the model"):
        load_as_served(broken, ONE)


def test_parts_of_a_fused_layer_with_different_g_idx_are_refused(folders, tmp_path):
    from tests.model.test_fp8_checkpoint import _rewrite

    def shuffle(state):
        name = "model.layers.0.self_attn.k_proj.g_idx"
        if name in state:
            state[name] = state[name].flip(0).contiguous()
    broken = _rewrite(folders["gptq-4bit-act-order"][0], tmp_path / "g", tensors=shuffle)
    with pytest.raises(ValueError, match="layers.0.self_attn.[qkv]_proj.g_idx': part [qkv]'s "
                                         "g_idx differs from the other parts'"):
        load_as_served(broken, ONE)


@pytest.mark.parametrize("kind, edit, words", [
    ("ct-4bit-g32-symmetric", lambda g: g["weights"].update(num_bits=3),
     "weights.num_bits = 3"),
    ("ct-4bit-g32-symmetric", lambda g: g["weights"].update(dynamic=True),
     "config_groups.group_0.weights"),
    ("ct-4bit-g32-symmetric", lambda g: g["weights"].update(strategy="tensor"),
     "config_groups.group_0.weights"),
    ("ct-4bit-g32-symmetric", lambda g: g.update(input_activations={"num_bits": 8}),
     "config_groups.group_0.input_activations"),
    ("ct-4bit-g32-symmetric", lambda g: g.update(targets=["re:.*proj"]), "targets"),
])
def test_unsupported_compressed_tensors_groups_are_refused(folders, tmp_path, kind, edit,
                                                           words):
    from tests.model.test_fp8_checkpoint import _rewrite

    folder = _rewrite(folders[kind][0], tmp_path / "m", config=lambda d: edit(
        d["quantization_config"]["config_groups"]["group_0"]))
    with pytest.raises(ValueError, match=words):
        open_checkpoint(str(folder))


@pytest.mark.parametrize("kind, edit, words", [
    ("gptq-4bit-g32", {"bits": 3}, "bits = 3 is not supported"),
    ("gptq-4bit-g32", {"bits": 2}, "bits = 2 is not supported"),
    ("gptq-4bit-g32", {"lm_head": True}, "lm_head = True is not supported"),
    ("gptq-4bit-g32", {"checkpoint_format": "marlin"}, "checkpoint_format = 'marlin'"),
    ("gptq-4bit-g32", {"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
    ("gptq-4bit-g32", {"group_size": 0}, "group_size = 0"),
    ("awq-4bit-g32", {"bits": 8}, "AWQ checkpoints are served in 4 bits"),
    ("awq-4bit-g32", {"version": "gemv"}, "version = 'gemv'"),
    ("awq-4bit-g32", {"zero_point": False}, "zero_point = False"),
    ("awq-4bit-g32", {"modules_to_not_convert": ["model.layers.0.mlp.down_proj"]},
     "modules_to_not_convert"),
    ("ct-4bit-g32-symmetric", {"ignore": ["lm_head", "re:.*down_proj"]}, "ignore"),
    ("ct-4bit-g32-symmetric", {"sparsity_config": {"format": "sparse-24"}},
     "sparsity_config"),
])
def test_unsupported_settings_are_refused_naming_the_field(folders, tmp_path, kind, edit,
                                                           words):
    from tests.model.test_fp8_checkpoint import _rewrite

    folder = _rewrite(folders[kind][0], tmp_path / "m",
                      config=lambda d: d["quantization_config"].update(edit))
    with pytest.raises(ValueError, match=words):
        open_checkpoint(str(folder))


def test_the_quantization_flag_must_match_the_checkpoint(folders, tmp_path):
    gptq = open_checkpoint(str(folders["gptq-4bit-g32"][0])).quantization
    awq = open_checkpoint(str(folders["awq-4bit-g32"][0])).quantization
    assert resolve_quantization("auto", gptq) == "gptq"
    assert resolve_quantization("gptq", gptq) == "gptq"
    assert resolve_quantization("auto", awq) == "awq"
    # vLLM's kernel names for these checkpoints, and the checkpoint's own spelling
    assert resolve_quantization("gptq_marlin", gptq) == "gptq"
    assert resolve_quantization("awq_marlin", awq) == "awq"
    ct = open_checkpoint(str(folders["ct-4bit-g32-symmetric"][0])).quantization
    assert resolve_quantization("auto", ct) == "compressed-tensors"
    assert resolve_quantization("compressed-tensors", ct) == "compressed-tensors"
    ct_fp8 = open_checkpoint(str(save_fp8_folder(folders["base"][0], tmp_path / "fp8",
                                                 fmt="compressed-tensors"))).quantization
    assert resolve_quantization("compressed-tensors", ct_fp8) == "fp8"
    for flag, ckpt in (("fp8", gptq), ("none", gptq), ("gptq", awq), ("awq", gptq),
                       ("awq_marlin", gptq), ("gptq", ct), ("compressed-tensors", awq)):
        with pytest.raises(ValueError, match=r"--quantization [\w-]+: the checkpoint is "
                                             "quantized"):
            resolve_quantization(flag, ckpt)
    for flag in ("gptq", "awq"):
        with pytest.raises(ValueError, match=f"--quantization {flag} serves the checkpoints "
                                             "whose config.json's"):
            resolve_quantization(flag, None)


def test_a_shard_that_does_not_pack_is_refused(folders, tmp_path):
    """tp 2 splits an MLP of 104 columns into 52 a rank: not a whole number of int32s."""
    import transformers as tf

    cfg = tf.LlamaConfig(**{**SHAPE, "intermediate_size": 104})
    cfg.architectures = ["LlamaForCausalLM"]
    base = save_hf_folder(tf.AutoModelForCausalLM.from_config(cfg).eval(), tmp_path / "b")
    folder, _ = save_int_folders(base, tmp_path / "q", "gptq", 4, 8)
    ranks = run_ranks(_refusal_rank, 2, str(folder))
    for r in ranks:
        assert "52 input columns do not pack by 8" in r


def _refusal_rank(group: TPGroup, folder: str) -> str:
    try:
        load_as_served(Path(folder), group)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_the_config_tree_serves_the_checkpoints_method_in_fp16_on_a_gpu(folders):
    """``--quantization auto`` is the checkpoint's method; ``--dtype auto`` on a GPU is
    fp16 for integer weights (their scales are fp16, as vLLM serves them), bf16 otherwise."""
    from tpserve.cli import build_parser
    from tpserve.model.loader.build import resolve_dtype
    from tpserve.server.config import config_from_args

    parser, _ = build_parser()

    def runner(*args: str):
        return config_from_args(parser.parse_args(["serve", *args])).runner

    gptq, awq = str(folders["gptq-4bit-g32"][0]), str(folders["awq-4bit-g32"][0])
    assert runner(gptq).quantization == "gptq"
    assert runner(awq, "--quantization", "awq").quantization == "awq"
    assert runner(gptq).dtype == ("float16" if torch.cuda.is_available() else "float32")
    with pytest.raises(ValueError, match="--quantization gptq serves the checkpoints whose"):
        runner(str(folders["base"][0]), "--quantization", "gptq")
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", cuda, integer_weights=True) == "float16"
    assert resolve_dtype("auto", cuda) == "bfloat16"
    assert resolve_dtype("bf16", cuda, integer_weights=True) == "bfloat16"


def test_an_older_export_with_a_side_settings_file_is_read(folders, tmp_path):
    """AutoGPTQ's ``quantize_config.json`` / AutoAWQ's ``quant_config.json`` beside a
    config.json without ``quantization_config``: read as vLLM reads them."""
    from tests.model.test_fp8_checkpoint import _rewrite

    for fmt, kind, name, settings in (
            ("gptq", "gptq-4bit-act-order", "quantize_config.json",
             {"bits": 4, "group_size": 32, "desc_act": True, "sym": False}),
            ("awq", "awq-4bit-g32", "quant_config.json",
             {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"})):
        folder = _rewrite(folders[kind][0], tmp_path / kind,
                          config=lambda d: d.pop("quantization_config"))
        (folder / name).write_text(json.dumps(settings))
        served, comm, method = load_as_served(folder, ONE)
        assert method == Wna16Method(fmt, 4, 32, int(fmt == "gptq"), act_order=fmt == "gptq")
        dense, dense_comm, _ = load_as_served(folders[kind][1], ONE)
        _same_function(full_logits(served, comm, TOKENS),
                       full_logits(dense, dense_comm, TOKENS), fmt == "gptq")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: GPU only")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_integer_steps_replay_in_cuda_graphs_as_they_run_eagerly(tmp_path, dtype):
    """On a GPU, the Triton ops (the WNA16 kernel, split over K at decode): a prefill, a
    mixed step and a pure decode of a tiny Llama (heads of 16: the attention kernels'
    smallest) from GPTQ act-order, AWQ and symmetric 8-bit compressed-tensors folders,
    through captured graphs, equal the eager forward; the eager forward equals the
    dequantized twin's logits on the CPU reference (float32; 16-bit within rounding)."""
    import transformers as tf

    from tpserve.model.plan import SeqChunk, StepLimits
    from tpserve.model.runner_config import RunnerConfig

    torch.manual_seed(11)
    cfg = tf.LlamaConfig(**{**SHAPE, "hidden_size": 64, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "intermediate_size": 128})
    cfg.architectures = ["LlamaForCausalLM"]
    base = save_hf_folder(tf.AutoModelForCausalLM.from_config(cfg).eval(), tmp_path / "b")
    limits = StepLimits(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256,
                        block_size=16)
    steps = [[SeqChunk(TOKENS, 0, [0], True), SeqChunk(TOKENS[:5], 0, [1], True)],
             [SeqChunk([7], 13, [0], True), SeqChunk(TOKENS[5:], 5, [1], True)],
             [SeqChunk([9], 14, [0], True), SeqChunk([4], 13, [1], True)]]
    tol = 1e-4 if dtype == "float32" else 5e-2
    for fmt, bits, gs, act, sym in (("gptq", 4, 32, True, False), ("awq", 4, 32, False, False),
                                    ("compressed-tensors", 8, 32, False, True)):
        folder, twin = save_int_folders(base, tmp_path / fmt, fmt, bits, gs, act,
                                        symmetric=sym)
        rc = RunnerConfig(model=str(folder), dtype=dtype, device="cuda",
                          kernel_backend="triton", quantization=fmt,
                          kv_cache_memory=64 * 2**20, cuda_graph_max_tokens=128)
        graphed, eager = graphs_and_eager(rc, limits, steps)
        for got, ref in zip(graphed, eager, strict=True):
            torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
        dense, comm, _ = load_as_served(twin, ONE)
        want = full_logits(dense, comm, TOKENS)
        torch.testing.assert_close(eager[0][0], want[-1], atol=tol * 10, rtol=tol * 10)


def test_the_reference_scales_whole_groups_where_they_run_in_column_order():
    """``consecutive_groups`` finds ``g_idx = first + k // size`` (a row-parallel rank's
    whole groups, one group of every column, a shorter last group) and nothing else (act-order, a rank starting
    mid-group); ``dequantize`` with those runs gives the gathered result exactly."""
    from tpserve.model.quant.wna16 import consecutive_groups, pack_rows

    k = 256
    cases = [(torch.arange(k) // 32, 8, (0, 32)), (4 + torch.arange(k) // 32, 12, (4, 32)),
             (torch.zeros(k, dtype=torch.long), 1, (0, k)),
             (torch.arange(k) // 48, 6, (0, 48)),  # a shorter last group: 5 x 48 + 16
             ((torch.arange(k) + 16) // 32, 9, None),
             ((torch.arange(k) // 32)[torch.randperm(k, generator=torch.Generator()
                                                     .manual_seed(0))], 8, None)]
    gen = torch.Generator().manual_seed(1)
    for g_idx, groups, want in cases:
        g_idx = g_idx.to(torch.int32)
        assert consecutive_groups(g_idx, groups) == want
        qweight = pack_rows(torch.randint(0, 16, (k, 5), generator=gen), 4)
        scales, zeros = torch.rand(groups, 5, generator=gen), torch.rand(groups, 5) * 16
        gathered = dequantize(qweight, scales, zeros, g_idx, 4)
        if want is not None:
            assert torch.equal(dequantize(qweight, scales, zeros, g_idx, 4, want), gathered)
