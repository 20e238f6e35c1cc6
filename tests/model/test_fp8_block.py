"""Block-wise FP8 checkpoints (``weight_block_size`` / compressed-tensors ``strategy:
"block"``) served as stored, on the torch reference back-end (CPU, float32), against an
exact oracle: the unquantized model on the block-dequantized weights, every linear input
fake-quantized per token and group of ``bk`` columns by hooks. The shape's blocks are
``[8, 16]`` (not square, so a transposed scale would show), hidden 64 (4 heads of 16),
intermediate 96: every tp of 1..3 splits the columns in whole 16-column groups (tp 3 pads
the query heads), tp 4 does not (24 MLP columns a rank) and is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.test_fp8_checkpoint import TOKENS, _rewrite, load_as_served
from tests.model.util import CPU, full_logits, save_fp8_folder, save_hf_folder
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.quant.fp8 import FP8, MIN_SCALE, dequantize
from tpserve.model.quant.fp8_block import (
    Fp8BlockMethod,
    block_mm_supported,
    dequantize_blocks,
    expand_scale,
    quantize_per_group,
)
from tpserve.parallel.comm import Communicator
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.linear import (
    InputQuantization,
    RowParallelLinear,
    input_quantization,
)
from tpserve.parallel.shard import ShardMap
from tpserve.parallel.state import TPGroup

BLOCK = (8, 16)
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
ONE = TPGroup(0, 1, CPU, None)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The unquantized original (rows and columns of very different magnitudes, so that
    block scales differ along both), its block-wise FP8 checkpoint as vLLM's "fp8" and as
    compressed-tensors write it, and the "fp8" one's weights dequantized to float32."""
    import transformers as tf

    torch.manual_seed(11)
    cfg = tf.LlamaConfig(**SHAPE)
    cfg.architectures = ["LlamaForCausalLM"]
    hf = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(torch.rand(p.shape[0], 1) * 4 + 0.05)
                p.mul_(torch.rand(1, p.shape[1]) * 4 + 0.05)
    root = tmp_path_factory.mktemp("fp8block")
    base = save_hf_folder(hf, root / "base")
    out = {"base": base,
           "block": save_fp8_folder(base, root / "block", block=BLOCK),
           "block-ct": save_fp8_folder(base, root / "block-ct", fmt="compressed-tensors",
                                       block=BLOCK)}
    deq = root / "block-dequantized"
    shutil.copytree(base, deq)
    for f in deq.glob("*.safetensors"):
        fp8 = load_file(str(out["block"] / f.name))
        state = {k: (dequantize_blocks(v, fp8[k + "_scale_inv"], BLOCK[0], BLOCK[1])
                     if v.dtype == FP8 else v)
                 for k, v in fp8.items() if not k.endswith("_scale_inv")}
        save_file(state, str(f), metadata={"format": "pt"})
    out["block-dequantized"] = deq
    return out


def group_quantized_inputs(model) -> None:
    """Every linear layer's input replaced by its per-token, per-group fake quantization
    (``quantize_per_group`` then dequantized), as the block-wise W8A8 product sees it."""
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            continue

        def hook(_, args):
            x = args[0]
            q, s = quantize_per_group(x.reshape(-1, x.shape[-1]), BLOCK[1])
            return (dequantize(q, expand_scale(s, 1, tuple(q.shape), BLOCK[1]))
                    .reshape(x.shape),)
        mod.register_forward_pre_hook(hook)


def test_block_checkpoints_are_read_as_block_wise(folders):
    for fmt, scale_name in (("block", "weight_scale_inv"), ("block-ct", "weight_scale")):
        ckpt = open_checkpoint(str(folders[fmt]))
        q = ckpt.quantization
        assert (q.method, q.weight_block, q.scale_name) == ("fp8", BLOCK, scale_name)
        assert "block-wise weight scales [8, 16]" in q.describe()
        _, _, method = load_as_served(folders[fmt], ONE, "fp8")
        assert isinstance(method, Fp8BlockMethod) and method.block == BLOCK


@pytest.mark.parametrize("fmt", ["block", "block-ct"])
def test_block_w8a8_is_the_dequantized_model_with_group_quantized_inputs(folders, fmt):
    """Exactly (``torch.equal``): the block scales apply to their own rows and columns,
    and each input group is quantized over its own 16 columns, by the norms and the SiLU
    gate for qkv, gate/up and down (their fused variants), by o itself."""
    served, comm, _ = load_as_served(folders[fmt], ONE, "fp8", weight_only_max_tokens=0)
    layer = served.model.layers[0]
    for fed in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert input_quantization(fed, len(TOKENS)) == InputQuantization(None, 16)
    got = full_logits(served, comm, TOKENS)
    deq, deq_comm, _ = load_as_served(folders["block-dequantized"], ONE, "none")
    group_quantized_inputs(deq)
    assert torch.equal(got, full_logits(deq, deq_comm, TOKENS))
    # per-token scales (one group the whole row) would give other logits
    plain, plain_comm, _ = load_as_served(folders["block-dequantized"], ONE, "none")
    assert not torch.allclose(got, full_logits(plain, plain_comm, TOKENS), rtol=1e-4,
                              atol=1e-4)


def test_block_weight_only_steps_multiply_the_unquantized_input(folders):
    """Steps of at most ``--fp8-weight-only-max-tokens`` (here 32 > 13 tokens): the block-
    dequantized weights times the unquantized activations, exactly."""
    served, comm, _ = load_as_served(folders["block"], ONE, "fp8", weight_only_max_tokens=32)
    deq, deq_comm, _ = load_as_served(folders["block-dequantized"], ONE, "none")
    assert torch.equal(full_logits(served, comm, TOKENS), full_logits(deq, deq_comm, TOKENS))


def test_block_scales_are_kept_per_block_of_rows(folders):
    """Where every aligned run of 8 rows shares its scales (every layer of this shape at tp
    1), the layer keeps one row of scales per 8 rows: the checkpoint's own."""
    served, _, _ = load_as_served(folders["block"], ONE, "fp8")
    stored = {}
    for f in folders["block"].glob("*.safetensors"):
        stored.update(load_file(str(f)))
    mlp = served.model.layers[1].mlp
    assert mlp.down_proj.weight_scale_rows == 8
    want = stored["model.layers.1.mlp.down_proj.weight_scale_inv"]
    assert want.shape == (8, 6) and torch.equal(mlp.down_proj.weight_scale, want)
    gate_up = torch.cat([stored[f"model.layers.1.mlp.{p}_proj.weight_scale_inv"]
                         for p in ("gate", "up")])
    assert torch.equal(mlp.gate_up_proj.weight_scale, gate_up)
    assert not hasattr(mlp.down_proj, "weight_scale_inv")


def _tp_rank(group: TPGroup, folders: dict[str, str]) -> dict[str, torch.Tensor]:
    served, comm, _ = load_as_served(Path(folders["block"]), group, "fp8",
                                     weight_only_max_tokens=0)
    return {"logits": full_logits(served, comm, TOKENS),
            "o_scale": served.model.layers[0].self_attn.o_proj.weight_scale.clone()}


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_equals_tp1(folders, tp):
    """At tp 2 and 3 (3: padding query heads; rank 2's attention columns are all padding)
    every rank quantizes each input group over the columns tp 1 does: the logits equal tp
    1's up to float32 summation order."""
    ranks = run_ranks(_tp_rank, tp, {k: str(v) for k, v in folders.items()})
    one, one_comm, _ = load_as_served(folders["block"], ONE, "fp8", weight_only_max_tokens=0)
    want = full_logits(one, one_comm, TOKENS)
    full_o = one.model.layers[0].self_attn.o_proj.weight_scale
    for r, ranked in enumerate(ranks):
        assert torch.allclose(ranked["logits"], want, rtol=1e-4, atol=1e-4)
        if tp == 3 and r == 2:  # two padding heads: 32 zero columns, MIN_SCALE groups
            assert torch.equal(ranked["o_scale"], torch.full((8, 2), MIN_SCALE))
        else:  # two heads of 16 columns a rank: two groups
            assert torch.equal(ranked["o_scale"], full_o[:, 2 * r:2 * r + 2])


def test_a_split_that_cuts_a_block_is_refused_naming_the_columns():
    """tp 4: 24 of the MLP's 96 columns a rank; rank 1's first group would mix
    checkpoint blocks 1 and 2."""
    method = Fp8BlockMethod("torch", weight_only_max_tokens=0, block=BLOCK)
    with pytest.raises(ValueError, match=r"whole 16-column blocks, but its columns 0\.\.15 "
                                         r"come from blocks \[1, 2\]"):
        RowParallelLinear(96, 64, Communicator(ONE), in_map=ShardMap.contiguous(96, 4, 1),
                          quant_method=method)


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme = 'static' is not supported: block-wise"),
    ({"quant_method": "fp8", "weight_block_size": [128, 100]},
     r"weight_block_size = \[128, 100\] is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]},
     r"weight_block_size = \[128\] is not supported"),
])
def test_unsupported_block_configs_are_refused_naming_the_field(folders, tmp_path, qc, words):
    def edit(d):
        d["quantization_config"] = qc

    with pytest.raises(ValueError, match=words):
        open_checkpoint(str(_rewrite(folders["block"], tmp_path / "m", config=edit)))


def test_compressed_tensors_block_with_other_activations_is_refused(folders, tmp_path):
    def edit(d):
        d["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(
            strategy="token")

    with pytest.raises(ValueError, match="input_activations .* per group of 16 columns"):
        open_checkpoint(str(_rewrite(folders["block-ct"], tmp_path / "m", config=edit)))


def test_a_block_scale_of_the_wrong_shape_fails_the_load(folders, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"

    def transpose(state):
        if name in state:
            state[name] = state[name].t().contiguous()

    folder = _rewrite(folders["block"], tmp_path / "t", tensors=transpose)
    with pytest.raises(ValueError, match=r"down_proj.weight_scale_inv'.*has shape \(6, 8\); "
                                         r"expected \[8, ceil"):
        load_as_served(folder, ONE, "fp8")
    assert json.loads((folder / "config.json").read_text())["quantization_config"][
        "weight_block_size"] == [8, 16]


def test_dequantized_blocks_are_the_original_weights_within_e4m3_rounding(folders):
    """The oracle's own check: each stored block times its scale is the original weight
    within half an e4m3 step (rows and columns span 80x in magnitude, so a scale applied
    to the wrong block would miss by far more, or clip)."""
    base, block = {}, {}
    for f in folders["base"].glob("*.safetensors"):
        base.update(load_file(str(f)))
    for f in folders["block"].glob("*.safetensors"):
        block.update(load_file(str(f)))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        w = base[name]
        got = dequantize_blocks(block[name], block[name + "_scale_inv"], *BLOCK)
        scale = expand_scale(block[name + "_scale_inv"], BLOCK[0], tuple(w.shape), BLOCK[1])
        bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10)  # normal / subnormal steps
        assert ((got - w).abs() <= bound * (1 + 1e-6)).all()


def test_quantize_per_group_scales_each_group_by_its_own_amax():
    """Each row's columns ``[16 b, 16 b + 16)`` (the last 4 columns a short group) take
    their own amax / 448; a zero group gets ``MIN_SCALE`` and zero codes."""
    from tpserve.model.quant.fp8 import quantize_per_row

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 52, generator=g) * torch.logspace(-2, 2, 52)
    x[1, 16:32] = 0
    q, s = quantize_per_group(x, 16)
    assert q.shape == (3, 52) and s.shape == (3, 4)
    for b in range(4):
        cols = slice(16 * b, min(16 * b + 16, 52))
        want_q, want_s = quantize_per_row(x[:, cols])
        assert torch.equal(s[:, b:b + 1], want_s)
        assert torch.equal(q[:, cols].view(torch.uint8), want_q.view(torch.uint8))
    assert s[1, 1] == MIN_SCALE and (q[1, 16:32].float() == 0).all()
    assert (s[:, 3:] != s[:, :1]).all()  # the groups' magnitudes differ


def gpu_block_folder(root: Path) -> Path:
    """A block-wise ([128, 128]) FP8 checkpoint of ``gpu_shaped_model`` (its base folder
    beside it, ``root / "base"``)."""
    from tests.model.test_fp8_checkpoint import gpu_shaped_model

    return save_fp8_folder(save_hf_folder(gpu_shaped_model(), root / "base"), root / "block",
                           block=(128, 128))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton block GEMM: GPU only")
@pytest.mark.parametrize("weight_only_max_tokens", [0, 32], ids=["w8a8", "weight-only"])
def test_block_checkpoint_on_the_gpu_matches_the_float32_reference(tmp_path,
                                                                  weight_only_max_tokens):
    """A float32 model on the GPU's kernels (the group quantizer and the block GEMM,
    W8A8 or weight-only) against the float32 torch reference on the CPU: they differ by
    summation order only, under 1 % of what per-channel scales on the same weights change.
    (In bf16, rounding the activations moves group-quantized codes one e4m3 step, as large
    a change as the scale layout itself: the first H200 run; bf16 is checked per kernel in
    ``test_triton_fp8_block.py`` and by the CUDA-graph test below.)"""
    from tpserve.model.attention.backend import select_attention
    from tpserve.model.kernels.backend import select_ops
    from tpserve.model.kv_pool import KVPool
    from tpserve.model.loader.build import build_model
    from tpserve.model.plan import SeqChunk, StepPlan
    from tpserve.model.quant.methods import linear_method

    folder = gpu_block_folder(tmp_path)
    dev = torch.device("cuda", 0)
    ckpt = open_checkpoint(str(folder))
    served = linear_method("fp8", "triton", dev, torch.bfloat16, weight_only_max_tokens,
                           ckpt.quantization)
    assert isinstance(served, Fp8BlockMethod) and served.scaled_mm
    method = Fp8BlockMethod("triton", weight_only_max_tokens=weight_only_max_tokens,
                            scaled_mm=True, block=(128, 128))  # W8A8 in float32 too
    comm = Communicator(TPGroup(0, 1, dev, None))
    model = build_model(ckpt, comm, dev, torch.float32, select_ops("torch"),
                        select_attention("torch", torch.float32), 512, quant_method=method)
    assert model.model.layers[0].mlp.down_proj.weight_scale_rows == 128
    cfg = model.cfg
    pool = KVPool(cfg.num_hidden_layers, 4, 16, cfg.kv_heads_for(1), cfg.head_dim,
                  torch.float32, dev)
    plan = StepPlan.build([SeqChunk(TOKENS, 0, [0], True)], 16, model.attn_backend).to(dev)
    with torch.no_grad():
        hidden = model(plan.input_ids, plan.positions, pool.layers,
                       plan.metadata(model.attn_backend))
        got = model.compute_logits(hidden).float().cpu()
    ref, ref_comm, _ = load_as_served(folder, ONE, "fp8",
                                      weight_only_max_tokens=weight_only_max_tokens)
    assert isinstance(ref.model.layers[0].mlp.down_proj.quant_method, Fp8BlockMethod)
    want = full_logits(ref, ref_comm, TOKENS)
    base, base_comm, _ = load_as_served(tmp_path / "base", ONE, "fp8",
                                        weight_only_max_tokens=weight_only_max_tokens)
    other = full_logits(base, base_comm, TOKENS)
    assert (got - want).abs().mean() < 0.01 * (other - want).abs().mean()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: GPU only")
def test_block_checkpoint_steps_replay_in_cuda_graphs_as_they_run_eagerly(tmp_path):
    """Prefill, mixed and decode steps of a block-wise checkpoint (every step W8A8: the
    group quantizer and the block GEMM) through captured graphs equal the eager ones."""
    from tests.model.test_fp8_checkpoint import graph_and_eager_runners, replays_equal_eager

    runners = graph_and_eager_runners(gpu_block_folder(tmp_path))
    for runner in runners:
        assert isinstance(runner.model.model.layers[0].mlp.down_proj.quant_method,
                          Fp8BlockMethod)
    replays_equal_eager(runners)


def test_block_method_names_its_products():
    """The runner's start-up line says which products the W8A8 steps take."""
    method = Fp8BlockMethod("triton", weight_only_max_tokens=32, scaled_mm=True, block=BLOCK)
    assert method.describe_products() == ("fp8 x fp8 products above 32 tokens (the Triton "
                                          "block-scaled GEMM, activations per token and 16 "
                                          "columns)")
    assert Fp8BlockMethod("triton", weight_only_max_tokens=32, scaled_mm=True, block=BLOCK,
                          block_mm=True).describe_products() == (
        "fp8 x fp8 products above 32 tokens (the Triton block-scaled GEMM; cuBLAS's block "
        "scaling above 64, activations per token and 16 columns)")
    assert not block_mm_supported(torch.device("cpu"))
