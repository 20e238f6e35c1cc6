"""FP8 checkpoints (``quantization_config`` of vLLM's "fp8" or compressed-tensors' FP8) served
as stored, against ``--quantization fp8`` of the unquantized original, on real safetensors
folders written here (``tests/model/util.py``) and real gloo ranks.

The model pads at tp 2 (6 query / 3 KV heads -> 8 / 4, MLP 99 -> 100), so every fused part
and the row-parallel layers have padding rows or columns on the last rank.

Exact: a checkpoint quantized per channel by ``quantize_per_row`` loads into the codes and
scales ``--quantization fp8`` computes from the original, at tp 1 and tp 2 (padding rows:
zero codes, ``MIN_SCALE``), and the logits are equal (weight-only and W8A8 paths). One
scale per tensor: each part (q, k, v, gate, up) keeps its own scale on its rows, and the
weight-only logits equal the unquantized model on the dequantized weights. tp 2 equals tp 1
within float32 summation order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.util import CPU, LINEAR_NAMES, full_logits, save_fp8_folder, save_hf_folder
from tpserve.model.attention.backend import select_attention
from tpserve.model.kernels.backend import select_ops
from tpserve.model.kv_pool import KVPool
from tpserve.model.loader.build import build_model
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.plan import SeqChunk, StepPlan
from tpserve.model.quant.fp8 import FP8, FP8_MAX, MIN_SCALE, Fp8LinearMethod, dequantize
from tpserve.model.quant.fp8_checkpoint import Fp8CheckpointMethod
from tpserve.model.quant.methods import linear_method
from tpserve.parallel.comm import Communicator
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.linear import input_quantization
from tpserve.parallel.state import TPGroup

TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12]
CALIBRATION = [5, 60, 222, 31, 140, 8, 77, 19, 240, 101, 43]
SHAPE = dict(hidden_size=48, intermediate_size=99, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=3, vocab_size=256,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
ONE = TPGroup(0, 1, CPU, None)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The unquantized original, its per-channel FP8 checkpoint (vLLM "fp8" and
    compressed-tensors configs), its per-tensor one, and the per-tensor one dequantized."""
    import transformers as tf

    torch.manual_seed(5)
    cfg = tf.LlamaConfig(**SHAPE)
    cfg.architectures = ["LlamaForCausalLM"]
    hf = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # rows of very different magnitudes: per-row scales matter
        for name, p in hf.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(torch.rand(p.shape[0], 1) * 4 + 0.05)
    root = tmp_path_factory.mktemp("fp8ckpt")
    base = save_hf_folder(hf, root / "base")
    out = {"base": base,
           "channel": save_fp8_folder(base, root / "channel"),
           "channel-ct": save_fp8_folder(base, root / "channel-ct", fmt="compressed-tensors"),
           "tensor": save_fp8_folder(base, root / "tensor", scales="tensor")}
    deq = root / "tensor-dequantized"  # the per-tensor checkpoint's weights as float32
    shutil.copytree(base, deq)
    for f in deq.glob("*.safetensors"):
        fp8 = load_file(str(out["tensor"] / f.name))
        state = {k: (dequantize(v, fp8[k + "_scale"]) if v.dtype == FP8 else v)
                 for k, v in fp8.items() if not k.endswith("_scale")}
        save_file(state, str(f), metadata={"format": "pt"})
    out["tensor-dequantized"] = deq
    scales = calibrated_input_scales(hf)
    out["static"] = save_fp8_folder(base, root / "static", scales="tensor",
                                    input_scales=scales)
    out["static-ct"] = save_fp8_folder(base, root / "static-ct", scales="tensor",
                                       fmt="compressed-tensors", input_scales=scales)
    out["static-clip"] = save_fp8_folder(  # scales 16x too small: most inputs clip
        base, root / "static-clip", scales="tensor",
        input_scales={k: v / 16 for k, v in scales.items()})
    return out


def calibrated_input_scales(hf) -> dict[str, float]:
    """Static activation scales as AutoFP8 calibrates them: each linear layer's largest
    input magnitude over calibration tokens (not the test's) / 448, per checkpoint weight;
    k_proj's then halved and v_proj's doubled, so that the parts of the fused qkv differ
    (the served layer must take their maximum)."""
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in hf.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR_NAMES:
            def hook(_, args, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
            hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        hf(torch.tensor([CALIBRATION]))
    for h in hooks:
        h.remove()
    factor = {"k_proj": 0.5, "v_proj": 2.0}
    return {f"{n}.weight": a / 448 * factor.get(n.rsplit(".", 1)[-1], 1.0)
            for n, a in amax.items()}


def load_as_served(folder: Path, group: TPGroup, quantization: str,
                   weight_only_max_tokens: int = 32):
    """The model as the runner builds it: ``linear_method`` picks the method from the
    resolved ``--quantization`` and the checkpoint's own quantization."""
    ckpt = open_checkpoint(str(folder))
    method = linear_method(quantization, "torch", CPU, torch.float32, weight_only_max_tokens,
                           ckpt.quantization)
    comm = Communicator(group)
    model = build_model(ckpt, comm, CPU, torch.float32, select_ops("torch"),
                        select_attention("torch", torch.float32), 512, quant_method=method)
    return model, comm, method


def linear_tensors(model) -> dict[str, torch.Tensor]:
    """Every linear layer's fp8 codes (as bytes) and scales."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("proj.weight"):
            assert p.dtype == FP8, name
            out[name] = p.detach().view(torch.uint8).clone()
        elif name.endswith("weight_scale"):
            assert p.dtype == torch.float32, name
            out[name] = p.detach().clone()
    return out


@pytest.mark.parametrize("fmt", ["channel", "channel-ct"])
def test_per_channel_checkpoint_is_exactly_quantization_fp8_of_the_original(folders, fmt):
    served, comm, method = load_as_served(folders[fmt], ONE, "fp8")
    assert isinstance(method, Fp8CheckpointMethod)
    ref, ref_comm, ref_method = load_as_served(folders["base"], ONE, "fp8")
    assert type(ref_method) is Fp8LinearMethod
    got, want = linear_tensors(served), linear_tensors(ref)
    assert got.keys() == want.keys() and len(got) == 2 * 4 * SHAPE["num_hidden_layers"]
    for name in want:
        assert torch.equal(got[name], want[name]), name
    for name, p in ref.named_parameters():  # embedding, norms, LM head: as loaded
        if not name.endswith(("proj.weight", "weight_scale")):
            assert torch.equal(dict(served.named_parameters())[name], p), name
    assert torch.equal(full_logits(served, comm, TOKENS), full_logits(ref, ref_comm, TOKENS))


def test_per_channel_checkpoint_w8a8_logits_equal_quantization_fp8(folders):
    served, comm, _ = load_as_served(folders["channel"], ONE, "fp8", weight_only_max_tokens=0)
    ref, ref_comm, _ = load_as_served(folders["base"], ONE, "fp8", weight_only_max_tokens=0)
    assert torch.equal(full_logits(served, comm, TOKENS), full_logits(ref, ref_comm, TOKENS))


def test_per_tensor_scales_are_each_parts_own_on_its_rows(folders):
    served, _, _ = load_as_served(folders["tensor"], ONE, "fp8")
    stored = {}
    for f in folders["tensor"].glob("*.safetensors"):
        stored.update(load_file(str(f)))
    attn = served.model.layers[1].self_attn.qkv_proj
    q, kv = 6 * 8, 3 * 8
    want = torch.cat([stored[f"model.layers.1.self_attn.{p}_proj.weight_scale"].expand(n)
                      for p, n in (("q", q), ("k", kv), ("v", kv))])
    assert torch.equal(attn.weight_scale, want)
    assert len(set(want.tolist())) == 3  # three different scales, none shared
    mlp = served.model.layers[0].mlp.gate_up_proj
    want = torch.cat([stored[f"model.layers.0.mlp.{p}_proj.weight_scale"].expand(99)
                      for p in ("gate", "up")])
    assert torch.equal(mlp.weight_scale, want)
    codes = stored["model.layers.0.mlp.down_proj.weight"].view(torch.uint8)
    assert torch.equal(served.model.layers[0].mlp.down_proj.weight.view(torch.uint8), codes)


def test_per_tensor_checkpoint_equals_the_unquantized_model_on_its_dequantized_weights(folders):
    # the weight-only reference multiplies by the dequantized weight in float32: the same
    # function as the unquantized model holding that weight
    served, comm, _ = load_as_served(folders["tensor"], ONE, "fp8")
    deq, deq_comm, method = load_as_served(folders["tensor-dequantized"], ONE, "none")
    assert method is None
    assert torch.equal(full_logits(served, comm, TOKENS), full_logits(deq, deq_comm, TOKENS))


def _tp_rank(group: TPGroup, folders: dict[str, str]) -> dict[str, object]:
    served, comm, _ = load_as_served(Path(folders["channel"]), group, "fp8")
    ref, ref_comm, _ = load_as_served(Path(folders["base"]), group, "fp8")
    tensor, tensor_comm, _ = load_as_served(Path(folders["tensor"]), group, "fp8")
    static, static_comm, _ = load_as_served(Path(folders["static"]), group, "fp8",
                                            weight_only_max_tokens=0)
    got, want = linear_tensors(served), linear_tensors(ref)
    same = sorted(n for n in want if torch.equal(got[n], want[n]))
    qkv = served.model.layers[0].self_attn.qkv_proj
    return {"same": same, "names": sorted(want),
            "qkv_scale": qkv.weight_scale.clone(),
            "gate_up_scale": served.model.layers[0].mlp.gate_up_proj.weight_scale.clone(),
            "logits": full_logits(served, comm, TOKENS),
            "ref_logits": full_logits(ref, ref_comm, TOKENS),
            "tensor_logits": full_logits(tensor, tensor_comm, TOKENS),
            "static_logits": full_logits(static, static_comm, TOKENS)}


def test_tp2_with_padding_equals_quantization_fp8_and_tp1(folders):
    paths = {k: str(v) for k, v in folders.items()}
    ranks = run_ranks(_tp_rank, 2, paths)
    one, one_comm, _ = load_as_served(folders["channel"], ONE, "fp8")
    tensor, tensor_comm, _ = load_as_served(folders["tensor"], ONE, "fp8")
    want, want_tensor = full_logits(one, one_comm, TOKENS), full_logits(tensor, tensor_comm,
                                                                        TOKENS)
    static, static_comm, _ = load_as_served(folders["static"], ONE, "fp8",
                                            weight_only_max_tokens=0)
    want_static = full_logits(static, static_comm, TOKENS)
    full_qkv = one.model.layers[0].self_attn.qkv_proj.weight_scale
    full_gate_up = one.model.layers[0].mlp.gate_up_proj.weight_scale
    for r in ranks:
        # every rank's codes and scales, padding included, are --quantization fp8's
        assert r["same"] == r["names"]
        assert torch.equal(r["logits"], r["ref_logits"])
        assert torch.allclose(r["logits"], want, rtol=1e-4, atol=1e-4)
        assert torch.allclose(r["tensor_logits"], want_tensor, rtol=1e-4, atol=1e-4)
        # static scales quantize elementwise: a rank's columns as the whole row's
        assert torch.allclose(r["static_logits"], want_static, rtol=1e-4, atol=1e-4)
    # tp 2 layout: 4 KV heads (2 per rank; rank 1's second is padding), each with 2 query
    # heads: rank 0 holds checkpoint query heads 0-3, rank 1 heads 4, 5 and two padding
    # heads; head_dim 8; the MLP's 99 rows per part are 50 per rank, rank 1's last padding
    d, pad = 8, torch.full((8,), MIN_SCALE)
    q_full, k_full, v_full = full_qkv.split([48, 24, 24])
    for r, ranked in enumerate(ranks):
        q, k, v = ranked["qkv_scale"].split([32, 16, 16])
        assert torch.equal(q, q_full[:32] if r == 0 else torch.cat([q_full[32:], pad, pad]))
        kv_want = [k_full[2 * r * d:(2 * r + 2) * d], v_full[2 * r * d:(2 * r + 2) * d]]
        if r == 1:
            kv_want = [torch.cat([x[2 * d:3 * d], pad]) for x in (k_full, v_full)]
        assert torch.equal(k, kv_want[0]) and torch.equal(v, kv_want[1])
        gate, up = ranked["gate_up_scale"].split([50, 50])
        g_full, u_full = full_gate_up.split([99, 99])
        tail = torch.full((1,), MIN_SCALE) if r == 1 else torch.empty(0)
        assert torch.equal(gate, torch.cat([g_full[50 * r:50 * r + 50], tail]))
        assert torch.equal(up, torch.cat([u_full[50 * r:50 * r + 50], tail]))


def _rewrite(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of folder ``src`` with ``config(dict)`` / ``tensors(dict)`` edits applied."""
    shutil.copytree(src, dst)
    if config is not None:
        d = json.loads((dst / "config.json").read_text())
        config(d)
        (dst / "config.json").write_text(json.dumps(d))
    if tensors is not None:
        for f in dst.glob("*.safetensors"):
            state = load_file(str(f))
            tensors(state)
            save_file(state, str(f), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "hqq", "nbits": 4}, "quant_method 'hqq' is not supported"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "per-tensor"},
     "activation_scheme = 'per-tensor' is not supported"),
    ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]},
     "ignored_layers"),
])
def test_unsupported_quantization_is_refused_naming_the_method(folders, tmp_path, qc, words):
    def edit(d):
        d["quantization_config"] = qc

    folder = _rewrite(folders["channel"], tmp_path / "m", config=edit)
    with pytest.raises(ValueError, match=words):
        open_checkpoint(str(folder))


@pytest.mark.parametrize("edit, words", [
    (lambda g: g["weights"].update(type="int"), "config_groups.group_0.weights"),
    (lambda g: g["weights"].update(strategy="group", group_size=128),
     "config_groups.group_0.weights"),
    (lambda g: g["input_activations"].update(dynamic=False),  # static per token
     "config_groups.group_0.input_activations"),
    (lambda g: g["input_activations"].update(type="int"),
     "config_groups.group_0.input_activations"),
])
def test_compressed_tensors_other_schemes_are_refused_naming_the_field(folders, tmp_path,
                                                                       edit, words):
    def config(d):
        edit(d["quantization_config"]["config_groups"]["group_0"])

    folder = _rewrite(folders["channel-ct"], tmp_path / "m", config=config)
    with pytest.raises(ValueError, match=words):
        open_checkpoint(str(folder))


def test_broken_fp8_tensors_fail_the_load_naming_them(folders, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"

    def widen(state):
        if name in state:
            state[name] = state[name].float()

    widened = _rewrite(folders["channel"], tmp_path / "widened", tensors=widen)
    with pytest.raises(ValueError, match=f"{name}.*stored as torch.float32, not "
                                         "float8_e4m3fn"):
        load_as_served(widened, ONE, "fp8")

    def drop(state):
        state.pop("model.layers.1.self_attn.k_proj.weight_scale", None)

    dropped = _rewrite(folders["channel"], tmp_path / "dropped", tensors=drop)
    index = json.loads((dropped / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("model.layers.1.self_attn.k_proj.weight_scale")
    (dropped / "model.safetensors.index.json").write_text(json.dumps(index))
    # the load names the checkpoint tensor missing from the fused qkv scale
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e\.g\. \['model\.layers\.1\."
                                         r"self_attn\.k_proj\.weight_scale'\]"):
        load_as_served(dropped, ONE, "fp8")


def test_none_on_an_fp8_checkpoint_is_refused(folders):
    ckpt = open_checkpoint(str(folders["channel"]))
    with pytest.raises(ValueError, match="--quantization none: the checkpoint is quantized "
                                         "\\(quantization_config.quant_method 'fp8'\\)"):
        linear_method("none", "torch", CPU, torch.float32, 32, ckpt.quantization)


def test_quantization_flag_resolves_against_the_checkpoint(folders):
    from tpserve.cli import build_parser
    from tpserve.server.config import config_from_args

    parser, _ = build_parser()

    def resolved(*args: str) -> str:
        cfg = config_from_args(parser.parse_args(["serve", *args]))
        return cfg.runner.quantization

    fp8, base = str(folders["channel"]), str(folders["base"])
    assert resolved(fp8) == "fp8"  # auto, the default: the checkpoint's own
    assert resolved(fp8, "--quantization", "auto") == "fp8"
    assert resolved(fp8, "--quantization", "fp8") == "fp8"
    assert resolved(str(folders["channel-ct"])) == "fp8"
    assert resolved(base) == "none"
    assert resolved(base, "--quantization", "fp8") == "fp8"  # quantized at load
    assert resolved(base, "--load-format", "dummy") == "none"
    # dummy weights are random floats, whatever the folder's config says
    assert resolved(fp8, "--load-format", "dummy") == "none"
    with pytest.raises(ValueError, match="--quantization none: the checkpoint is quantized"):
        resolved(fp8, "--quantization", "none")


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq"])
def test_cli_exits_2_naming_an_unsupported_method(folders, tmp_path, capsys, method):
    from tpserve.cli import main

    def edit(d):
        d["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}

    folder = _rewrite(folders["base"], tmp_path / "m", config=edit)
    assert main(["serve", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"quantization_config.quant_method {method!r} is not supported" in err, err
    assert main(["serve", str(folders["channel"]), "--quantization", "none"]) == 2
    assert "--quantization none: the checkpoint is quantized" in capsys.readouterr().err


def fake_quantized_inputs(model, folder: Path) -> None:
    """Forward pre-hooks on every linear layer of ``model`` (an unquantized one) that
    replace its input ``x`` by ``x`` quantized to e4m3 with the static scale ``s`` the
    checkpoint in ``folder`` stores for it (the largest of a fused layer's parts) and
    widened again: ``float(e4m3(clamp(x / s, -448, 448))) * s``."""
    stored = {}
    for f in folder.glob("*.safetensors"):
        stored.update({k: v for k, v in load_file(str(f)).items()
                       if k.endswith("input_scale")})
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj",
                                                                          "up_proj")}
    for name, mod in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        if leaf not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            continue
        s = max(float(stored[f"{prefix}.{p}.input_scale"]) for p in parts.get(leaf, (leaf,)))

        def hook(_, args, s=s):
            x = args[0]
            return ((x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s,)
        mod.register_forward_pre_hook(hook)


@pytest.mark.parametrize("fmt", ["static", "static-ct", "static-clip"])
def test_static_scales_quantize_every_w8a8_input(folders, fmt):
    """W8A8 with the checkpoint's input_scale is the unquantized model on the dequantized
    weights with every linear input fake-quantized by that scale: exactly, clipping
    included (``static-clip``'s scales are 16x too small). The norms and the SiLU gate
    quantize the inputs of qkv, gate/up and down (with those layers' scales), o its own."""
    served, comm, method = load_as_served(folders[fmt], ONE, "fp8", weight_only_max_tokens=0)
    assert method.static_activations
    layer = served.model.layers[1]
    for fed in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        how = input_quantization(fed, len(TOKENS))
        assert how is not None and how.static_scale is fed.input_scale and how.group is None
    qkv = layer.self_attn.qkv_proj
    stored = {}
    for f in folders[fmt].glob("*.safetensors"):
        stored.update(load_file(str(f)))
    v_scale = stored["model.layers.1.self_attn.v_proj.input_scale"]
    assert torch.equal(qkv.input_scale, v_scale.reshape(1))  # the largest part's (v: x2)
    got = full_logits(served, comm, TOKENS)
    deq, deq_comm, _ = load_as_served(folders["tensor-dequantized"], ONE, "none")
    fake_quantized_inputs(deq, folders[fmt])
    assert torch.equal(got, full_logits(deq, deq_comm, TOKENS))
    # the scales matter: dynamic per-token scales on the same weights give other logits
    dynamic, dyn_comm, _ = load_as_served(folders["tensor"], ONE, "fp8",
                                          weight_only_max_tokens=0)
    want_dynamic = full_logits(dynamic, dyn_comm, TOKENS)
    assert not torch.allclose(got, want_dynamic, rtol=1e-3, atol=1e-3)


def test_clipping_scales_cost_more_than_calibrated_ones(folders):
    """Against the unquantized model, the calibrated static checkpoint errs less than
    the one whose scales are 16x too small (its inputs clip)."""
    base, base_comm, _ = load_as_served(folders["base"], ONE, "none")
    want = full_logits(base, base_comm, TOKENS)
    err = {}
    for fmt in ("static", "static-clip"):
        model, comm, _ = load_as_served(folders[fmt], ONE, "fp8", weight_only_max_tokens=0)
        err[fmt] = (full_logits(model, comm, TOKENS) - want).abs().mean().item()
    assert err["static"] * 2 < err["static-clip"], err


def test_static_scales_leave_weight_only_steps_unquantized(folders):
    """Steps at or under ``--fp8-weight-only-max-tokens`` multiply the unquantized input:
    the static checkpoint's logits there are the per-tensor dynamic checkpoint's."""
    static, comm, _ = load_as_served(folders["static"], ONE, "fp8")
    tensor, tensor_comm, _ = load_as_served(folders["tensor"], ONE, "fp8")
    assert torch.equal(full_logits(static, comm, TOKENS),
                       full_logits(tensor, tensor_comm, TOKENS))


def test_static_checkpoint_with_a_missing_or_malformed_input_scale_fails_the_load(
        folders, tmp_path):
    name = "model.layers.0.mlp.up_proj.input_scale"

    def drop(state):
        state.pop(name, None)

    dropped = _rewrite(folders["static"], tmp_path / "dropped", tensors=drop)
    index = json.loads((dropped / "model.safetensors.index.json").read_text())
    index["weight_map"].pop(name)
    (dropped / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e\.g\. \['model\.layers\.0\."
                                         r"mlp\.up_proj\.input_scale'\]"):
        load_as_served(dropped, ONE, "fp8")

    def per_channel(state):
        if name in state:
            state[name] = state[name].expand(4).contiguous()

    wide = _rewrite(folders["static"], tmp_path / "wide", tensors=per_channel)
    with pytest.raises(ValueError, match=f"{name}.*input_scale has shape \\(4,\\)"):
        load_as_served(wide, ONE, "fp8")
    ckpt = open_checkpoint(str(folders["static-ct"]))
    assert ckpt.quantization.static_activations
    assert "static activation scales" in ckpt.quantization.describe()
    assert not open_checkpoint(str(folders["tensor"])).quantization.static_activations


def gpu_shaped_model():
    """A random transformers Llama every linear layer of which FP8 matrix products take
    (hidden 256, intermediate 512: multiples of 16 and of 128) and the Triton attention too
    (head_dim 64)."""
    import transformers as tf

    torch.manual_seed(7)
    cfg = tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                         max_position_embeddings=512, rms_norm_eps=1e-5)
    cfg.architectures = ["LlamaForCausalLM"]
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def gpu_shaped_folders(root: Path, clip: float = 1.0) -> dict[str, Path]:
    """``gpu_shaped_model`` unquantized, its per-tensor FP8 checkpoint (dynamic
    activations), and that checkpoint with calibrated static activation scales multiplied
    by ``clip``."""
    hf = gpu_shaped_model()
    base = save_hf_folder(hf, root / "base")
    scales = {k: v * clip for k, v in calibrated_input_scales(hf).items()}
    return {"base": base, "tensor": save_fp8_folder(base, root / "tensor", scales="tensor"),
            "static": save_fp8_folder(base, root / "static", scales="tensor",
                                      input_scales=scales)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton / _scaled_mm products: GPU only")
def test_static_checkpoint_on_the_gpu_matches_the_float32_reference(tmp_path):
    """A static checkpoint whose scales clip (1/16 of the calibrated ones) in bf16 on the
    GPU's fp8 kernels (W8A8 at every M: the Triton W8A8 kernel with the static quantizer)
    against the float32 torch reference on the CPU: its mean error is a small fraction of
    what per-token dynamic scales would change (bf16 rounding alone moves some codes one
    e4m3 step, so an exact match is not expected)."""
    folders = gpu_shaped_folders(tmp_path, clip=1 / 16)
    dev = torch.device("cuda", 0)
    ckpt = open_checkpoint(str(folders["static"]))
    method = linear_method("fp8", "triton", dev, torch.bfloat16, 0, ckpt.quantization)
    assert method.static_activations and method.scaled_mm == (
        torch.cuda.get_device_capability() >= (8, 9))
    comm = Communicator(TPGroup(0, 1, dev, None))
    model = build_model(ckpt, comm, dev, torch.bfloat16, select_ops("torch"),
                        select_attention("torch", torch.bfloat16), 512, quant_method=method)
    for layer in (model.model.layers[0].self_attn.qkv_proj, model.model.layers[1].mlp.down_proj):
        assert layer.input_scale.device == dev and method.uses_w8a8(len(TOKENS), layer.weight)
    cfg = model.cfg
    pool = KVPool(cfg.num_hidden_layers, 4, 16, cfg.kv_heads_for(1), cfg.head_dim,
                  torch.bfloat16, dev)
    plan = StepPlan.build([SeqChunk(TOKENS, 0, [0], True)], 16, model.attn_backend).to(dev)
    with torch.no_grad():
        hidden = model(plan.input_ids, plan.positions, pool.layers,
                       plan.metadata(model.attn_backend))
        got = model.compute_logits(hidden).float().cpu()
    ref, ref_comm, _ = load_as_served(folders["static"], ONE, "fp8", weight_only_max_tokens=0)
    want = full_logits(ref, ref_comm, TOKENS)
    dynamic, dyn_comm, _ = load_as_served(folders["tensor"], ONE, "fp8",
                                          weight_only_max_tokens=0)
    other = full_logits(dynamic, dyn_comm, TOKENS)
    assert (got - want).abs().mean() < 0.1 * (other - want).abs().mean()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: GPU only")
def test_static_checkpoint_steps_replay_in_cuda_graphs_as_they_run_eagerly(tmp_path):
    """A static checkpoint of a model the Triton attention takes (head_dim 64), every step
    W8A8 (``fp8_weight_only_max_tokens`` 0: decode steps through the Triton W8A8 kernel,
    the static quantizer reading its scale on the device): a prefill, a mixed step and a
    decode step through captured graphs equal the eager ones."""
    runners = graph_and_eager_runners(gpu_shaped_folders(tmp_path)["static"])
    for runner in runners:
        assert runner.model.model.layers[0].mlp.down_proj.quant_method.static_activations
    replays_equal_eager(runners)


def graph_and_eager_runners(folder: Path) -> list:
    """Two one-GPU runners of an FP8 checkpoint, every step W8A8
    (``fp8_weight_only_max_tokens`` 0): one replaying CUDA graphs, one eager."""
    from dataclasses import replace

    from tpserve.model.plan import StepLimits
    from tpserve.model.runner import ModelRunner
    from tpserve.model.runner_config import RunnerConfig

    dev = torch.device("cuda", 0)
    rc = RunnerConfig(model=str(folder), dtype="bfloat16", kv_cache_dtype="bfloat16",
                      device="cuda", kernel_backend="triton", quantization="fp8",
                      fp8_weight_only_max_tokens=0, kv_cache_memory=32 * 2**20,
                      cuda_graph_max_tokens=128)
    limits = StepLimits(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                        block_size=16)
    runners = [ModelRunner(rc, limits, TPGroup(0, 1, dev, None)),
               ModelRunner(replace(rc, enforce_eager=True), limits, TPGroup(0, 1, dev, None))]
    assert runners[0].graphs is not None and runners[1].graphs is None
    return runners


def replays_equal_eager(runners: list) -> None:
    """A prefill, a mixed step and a decode step through the graph runner equal the eager
    runner's (bf16 tolerance)."""
    dev = torch.device("cuda", 0)
    a, b = list(range(5, 45)), list(range(100, 107))
    steps = [
        [SeqChunk(a, 0, [0, 1, 2], True), SeqChunk(b, 0, [3], True)],
        [SeqChunk([7], 40, [0, 1, 2], True), SeqChunk([9], 7, [3], True),
         SeqChunk(list(range(50, 80)), 0, [4, 5], True)],
        [SeqChunk([3], 41, [0, 1, 2], True), SeqChunk([4], 8, [3], True),
         SeqChunk([6], 30, [4, 5], True)],
    ]
    outs = [[], []]
    for runner, out in zip(runners, outs, strict=True):
        for chunks in steps:
            logits = runner.execute(StepPlan.build(chunks, 16, runner.attn))
            out.append(logits.float().clone())
            runner.store_sampled(torch.arange(11, 11 + logits.shape[0], device=dev))
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
