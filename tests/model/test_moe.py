"""Mixtures of experts: tiny random Mixtral, Qwen2-MoE (a sigmoid-gated shared expert, a
dense layer by ``mlp_only_layers``, top-k weights not renormalized), Qwen3-MoE (q/k
head norms, renormalized) and Granite-MoE (Granite's multipliers) checkpoints written by transformers give transformers' logits in
float32 at tp 1, 2 and 3 (tp 3 pads the heads and each expert's columns), prefilled whole,
in chunks and decoded, and in sequence-parallel mode, from safetensors folders and from
llama.cpp GGUF files (``llama`` with experts, ``qwen2moe``, ``qwen3moe``); the dummy shapes
hold transformers' tensors; what cannot be served is refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.model.test_tiny_models import TINY
from tests.model.util import hf_checkpoints, load, tiny_hf_model, whole_and_stepped
from tpserve.model.config import ModelConfig
from tpserve.model.loader.dummy import hf_tensors, shape_config, shape_hf_config
from tpserve.model.quant.fp8 import Fp8LinearMethod
from tpserve.parallel.launch import run_ranks

TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12, 33, 71, 140, 2, 60, 61, 8]
KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe")


def _hf_moe(kind: str, all_sparse: bool = False):
    """The tiny model of ``kind``; ``all_sparse``: Qwen2-MoE without its dense layer."""
    import transformers as tf

    torch.manual_seed({"mixtral": 70, "qwen2_moe": 71, "qwen3_moe": 72, "granitemoe": 73}[kind])
    tiny = {**TINY, "num_hidden_layers": 3}
    if kind == "mixtral":
        cfg = tf.MixtralConfig(**tiny, num_local_experts=4, num_experts_per_tok=2,
                               rope_theta=10000.0, sliding_window=None)
    elif kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**tiny, num_experts=6, num_experts_per_tok=2,
                                moe_intermediate_size=40, shared_expert_intermediate_size=48,
                                norm_topk_prob=False, mlp_only_layers=[] if all_sparse else [1],
                                rope_theta=10000.0)
    elif kind == "granitemoe":  # Granite's multipliers, a softmax over the top-k logits
        cfg = tf.GraniteMoeConfig(**tiny, num_local_experts=5, num_experts_per_tok=2,
                                  rope_theta=10000.0, embedding_multiplier=12.0,
                                  residual_multiplier=0.22, attention_multiplier=0.125,
                                  logits_scaling=8.0, tie_word_embeddings=True)
    else:
        cfg = tf.Qwen3MoeConfig(**tiny, head_dim=32, num_experts=8, num_experts_per_tok=3,
                                moe_intermediate_size=32, norm_topk_prob=True,
                                rope_theta=1000000.0)
    arch = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "granitemoe": "GraniteMoeForCausalLM"}[kind]
    # routers times 50, far from ties: rounding never flips an expert
    return tiny_hf_model(cfg, arch, biases=True, scaled=(
        ("gate.weight", "shared_expert_gate.weight", "router.weight"), 50.0))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return hf_checkpoints(tmp_path_factory, _hf_moe, lambda kind: TOKENS)


def _steps(group, folder: str, tp_comm: str, expert_parallel: bool = False
           ) -> list[torch.Tensor]:
    model, comm = load(folder, group, tp_comm=tp_comm, expert_parallel=expert_parallel)
    return whole_and_stepped(model, comm, TOKENS, 7, 8)


@pytest.mark.parametrize("kind", KINDS)
def test_moe_equals_transformers(checkpoints, kind):
    folder, want = checkpoints(kind)
    for tp in (1, 2, 3):
        for whole, stepped in run_ranks(_steps, tp, folder, "allreduce"):
            assert (whole - want).abs().max().item() < 1e-4, (kind, tp)
            assert (stepped - want).abs().max().item() < 1e-4, (kind, tp)
    for whole, stepped in run_ranks(_steps, 2, folder, "allgather"):
        assert (whole - want).abs().max().item() < 1e-4, (kind, "allgather")
        assert (stepped - want).abs().max().item() < 1e-4, (kind, "allgather")


@pytest.mark.parametrize("kind", KINDS)
def test_expert_parallel_equals_transformers(checkpoints, kind):
    """``--enable-expert-parallel``: each of 2 ranks holds half the experts whole (Qwen2-MoE's
    shared expert and dense layer still split by columns), with either reduction; at tp 3
    (Mixtral's 4, Qwen2-MoE's 6, Qwen3-MoE's 8, Granite-MoE's 5 experts) uneven ranges."""
    folder, want = checkpoints(kind)
    for tp, tp_comm in ((2, "allreduce"), (2, "allgather"), (3, "allreduce")):
        for whole, stepped in run_ranks(_steps, tp, folder, tp_comm, True):
            assert (whole - want).abs().max().item() < 1e-4, (kind, tp, tp_comm)
            assert (stepped - want).abs().max().item() < 1e-4, (kind, tp, tp_comm)


def test_configs_read_as_transformers_builds_them():
    cfgs = {kind: ModelConfig.from_hf(_hf_moe(kind).config.to_dict()) for kind in KINDS}
    mixtral, qwen2, qwen3, granite = (cfgs[k] for k in KINDS)
    assert (granite.num_experts, granite.moe_intermediate_size, granite.norm_topk_prob,
            granite.embedding_multiplier, granite.attention_scale) == (5, 128, True, 12.0,
                                                                        0.125)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.norm_topk_prob, mixtral.moe_layers) == (4, 2, 128, True, (0, 1, 2))
    assert (qwen2.num_experts, qwen2.shared_expert_intermediate_size, qwen2.norm_topk_prob,
            qwen2.moe_layers, qwen2.qkv_bias) == (6, 48, False, (0, 2), True)
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.norm_topk_prob,
            qwen3.qk_norm, qwen3.shared_expert_intermediate_size) == (8, 3, True, True, 0)
    stepped = ModelConfig.from_hf({**_hf_moe("qwen3_moe").config.to_dict(),
                                   "decoder_sparse_step": 2})
    assert stepped.moe_layers == (1,)  # (i + 1) % 2 == 0, as transformers builds it
    assert qwen3.describe_padding(3).endswith(
        "; expert width 32 -> 48 (+50.0% expert FLOPs)")  # 11 columns each, aligned to 16
    assert qwen3.describe_padding(2) is None
    assert qwen2.describe_padding(2) == "tp 2: padding expert width 40 -> 48 (+20.0% expert FLOPs)"


def test_the_dense_and_sparse_layers_each_matter(checkpoints):
    """The shared expert and the dense layer are really loaded and run: zeroing either
    changes transformers' answer by far more than the tolerance above."""
    _, want = checkpoints("qwen2_moe")
    x = torch.tensor([TOKENS])
    for part in ("layers.0.mlp.shared_expert.down_proj", "layers.1.mlp.down_proj"):
        hf = _hf_moe("qwen2_moe")
        with torch.no_grad():
            hf.get_submodule("model." + part).weight.zero_()
            assert (hf(x).logits[0] - want).abs().max() > 1e-2, part


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_dummy_shapes_hold_transformers_tensors(shape):
    import transformers as tf

    d = shape_hf_config(shape)
    cfg = tf.AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items()
                                                      if k != "model_type"})
    small = dict(num_hidden_layers=2, num_local_experts=2, num_experts=2,
                 num_experts_per_tok=2, vocab_size=64, hidden_size=64, intermediate_size=64,
                 moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16)
    for key, value in small.items():  # transformers' names, the shape's structure
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    with torch.device("meta"):
        hf = tf.AutoModelForCausalLM.from_config(cfg)
    ours = ModelConfig.from_hf({**d, **{k: v for k, v in small.items() if k in d
                                        or k in ("num_hidden_layers", "vocab_size")}})
    state = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert dict(hf_tensors(ours)) == _per_expert(state, ours)
    full = shape_config(shape)
    params = sum(_numel(s) for _, s in hf_tensors(full))
    assert params == {"qwen3-30b-a3b": 30_532_122_624, "mixtral-8x7b": 46_702_792_704}[shape]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _per_expert(state: dict[str, tuple[int, ...]], cfg: ModelConfig
                ) -> dict[str, tuple[int, ...]]:
    """transformers 5's fused expert tensors (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]) as checkpoints store them, one per expert and part."""
    mixtral = cfg.architecture == "MixtralForCausalLM"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for name, shape in state.items():
        if mixtral:  # as Mixtral's checkpoints name its block
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):
            e, two_i, h = shape
            for i in range(e):
                out[f"{name[:-len('gate_up_proj')]}{i}.{gate}.weight"] = (two_i // 2, h)
                out[f"{name[:-len('gate_up_proj')]}{i}.{up}.weight"] = (two_i // 2, h)
        elif name.endswith("experts.down_proj"):
            e, h, i_ = shape
            for i in range(e):
                out[f"{name[:-len('down_proj')]}{i}.{down}.weight"] = (h, i_)
        else:
            out[name] = shape
    return out


def test_refusals(checkpoints, tmp_path):
    from tpserve.model.quant.fp8_checkpoint import Fp8CheckpointMethod

    folder, _ = checkpoints("qwen3_moe")
    from tpserve.model.quant.wna16_method import Wna16Method

    for method in (Fp8CheckpointMethod(), Wna16Method("gptq", 4, 128, 1)):
        with pytest.raises(ValueError, match="mixture of experts: the experts of an FP8, "
                                             "GPTQ or AWQ checkpoint"):
            load(folder, quant_method=method)
    with pytest.raises(ValueError, match="--enable-expert-parallel: LlamaForCausalLM has no "
                                         "experts"):
        load(None, expert_parallel=True)
    with pytest.raises(ValueError, match="num_experts_per_tok must be from 1 to the 8"):
        ModelConfig.from_hf({**_hf_moe("qwen3_moe").config.to_dict(),
                             "num_experts_per_tok": 9})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: GPU only")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_moe_steps_replay_in_cuda_graphs_as_they_run_eagerly(checkpoints, dtype):
    """On a GPU, the Triton ops: a prefill, a mixed step and a pure decode of the tiny
    Qwen3-MoE through captured graphs (the grouped expert products read their offsets on
    the device) equal the eager forward, and the eager forward equals transformers' logits
    (float32; bf16 within its rounding)."""
    from tpserve.model.plan import SeqChunk, StepLimits, StepPlan
    from tpserve.model.runner import ModelRunner
    from tpserve.model.runner_config import RunnerConfig
    from tpserve.parallel.state import TPGroup

    folder, want = checkpoints("qwen3_moe")
    dev = torch.device("cuda", 0)
    cfg = RunnerConfig(model=folder, dtype=dtype, device="cuda", kernel_backend="triton",
                       kv_cache_memory=64 * 2**20, cuda_graph_max_tokens=128)
    limits = StepLimits(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256,
                        block_size=16)
    runners = [ModelRunner(cfg, limits, TPGroup(0, 1, dev, None)),
               ModelRunner(replace(cfg, enforce_eager=True), limits, TPGroup(0, 1, dev, None))]
    steps = [[SeqChunk(TOKENS, 0, [0, 1], True), SeqChunk(TOKENS[:5], 0, [2], True)],
             [SeqChunk([7], 20, [0, 1], True), SeqChunk(TOKENS[5:15], 5, [2], True)],
             [SeqChunk([9], 21, [0, 1], True), SeqChunk([4], 15, [2], True)]]
    outs = [[], []]
    for runner, out in zip(runners, outs, strict=True):
        for chunks in steps:
            out.append(runner.execute(StepPlan.build(chunks, 16, runner.attn)).float().cpu())
    tol = 1e-4 if dtype == "float32" else 5e-2
    for got, eager in zip(*outs, strict=True):
        torch.testing.assert_close(got, eager, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[1][0][0], want[-1], atol=tol * 10, rtol=tol * 10)


def test_a_checkpoint_missing_one_expert_is_refused(tmp_path):
    """transformers' own file (one tensor per expert and part) less one expert's up
    projection: the layer's gate/up parameter is not loaded, and loading says so."""
    from safetensors.torch import load_file, save_file

    _hf_moe("qwen3_moe").save_pretrained(tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    state = load_file(path)
    del state["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e.g. \['model.layers.0.mlp."
                                         r"experts.w13'\]"):
        load(str(tmp_path))


# llama.cpp's names of a mixture of experts' tensors (experts stacked, one tensor per part)
GGUF_MOE_NAMES = {"mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
                  "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps",
                  "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                  "mlp.shared_expert.up_proj": "ffn_up_shexp",
                  "mlp.shared_expert.down_proj": "ffn_down_shexp",
                  "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
GGUF_ARCHES = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _gguf_state(hf) -> dict[str, torch.Tensor]:
    """transformers 5's state as llama.cpp's converter lays it out: gate and up stacked
    apart, the shared expert's gate a vector."""
    state = {}
    for name, t in hf.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            state[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            state[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            state[name + ".weight"] = t
        elif name.endswith("shared_expert_gate.weight"):
            state[name] = t[0]
        else:
            state[name] = t
    return state


def _gguf_logits(group, path: str) -> torch.Tensor:
    model, comm = load(path, group)
    return whole_and_stepped(model, comm, TOKENS, 7, 8)


@pytest.mark.parametrize("kind", KINDS[:3])
def test_moe_gguf_equals_transformers(checkpoints, tmp_path, kind):
    """A llama.cpp file of each (Mixtral as ``llama`` with experts, q/k rows permuted;
    ``qwen2moe`` all layers sparse, as llama.cpp reads it, so its dense layer is dropped
    from the reference; ``qwen3moe``) gives transformers' logits at tp 1 and 2."""
    from tests.model.util import save_gguf_file

    hf = _hf_moe(kind, all_sparse=True)  # llama.cpp's qwen2moe: every layer sparse
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0]
    cfg = hf.config
    arch = GGUF_ARCHES[kind]

    def metadata(w):
        w.add_uint32(f"{arch}.expert_count", cfg.num_experts if kind != "mixtral"
                     else cfg.num_local_experts)
        w.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
        if kind != "mixtral":
            w.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
        if kind == "qwen2_moe":
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length",
                         cfg.shared_expert_intermediate_size)

    path = str(save_gguf_file(hf, tmp_path / f"{kind}.gguf", arch, metadata,
                              layer_names=GGUF_MOE_NAMES, state=_gguf_state(hf)))
    for tp in (1, 2):
        for whole, stepped in run_ranks(_gguf_logits, tp, path):
            assert (whole - want).abs().max().item() < 1e-4, (kind, tp)
            assert (stepped - want).abs().max().item() < 1e-4, (kind, tp)



def _fp8_steps(group, folder: str, expert_parallel: bool = False) -> list[torch.Tensor]:
    model, comm = load(folder, group, quant_method=Fp8LinearMethod(weight_only_max_tokens=10**6),
                       expert_parallel=expert_parallel)
    experts = model.model.layers[0].mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == torch.float8_e4m3fn
    return whole_and_stepped(model, comm, TOKENS, 7, 8)


def _dequantized(hf, folder: str):
    """``hf`` with every linear and expert weight replaced by our tp 1 fp8 weight,
    dequantized (the router stays as it is: it is never quantized)."""
    from tests.model.util import copy_dequantized_layer

    ours, _ = load(folder, quant_method=Fp8LinearMethod())
    with torch.no_grad():
        for mine, theirs in zip(ours.model.layers, hf.model.layers, strict=True):
            mlps = None
            if hasattr(mine.mlp, "experts"):
                ex = mine.mlp.experts
                theirs.mlp.experts.gate_up_proj.copy_(ex.w13.float() * ex.w13_scale[..., None])
                theirs.mlp.experts.down_proj.copy_(ex.w2.float() * ex.w2_scale[..., None])
                mlps = [(mine.mlp.shared_expert, theirs.mlp.shared_expert)]
            copy_dequantized_layer(mine, theirs, ours.cfg, mlps)
    return hf


def test_moe_quantized_at_load(checkpoints):
    """``--quantization fp8`` on Qwen2-MoE: the experts (per expert and output row, the
    down projection's scales tp-invariant) and every linear layer in e4m3; with weight-only
    products every step, at tp 1 and 2 (experts split by columns or whole), whole, chunked
    and decoded, the logits equal transformers' over the same fp8 weights dequantized."""
    folder, plain = checkpoints("qwen2_moe")
    with torch.no_grad():
        want = _dequantized(_hf_moe("qwen2_moe"), folder)(torch.tensor([TOKENS])).logits[0]
    assert (want - plain).abs().max() > 1e-3  # the fp8 weights give another answer
    for tp, expert_parallel in ((1, False), (2, False), (2, True)):
        for whole, stepped in run_ranks(_fp8_steps, tp, folder, expert_parallel):
            assert (whole - want).abs().max().item() < 1e-4, (tp, expert_parallel)
            assert (stepped - want).abs().max().item() < 1e-4, (tp, expert_parallel)


def test_the_start_up_line_says_where_the_experts_are(checkpoints):
    from tpserve.model.layers.moe import experts_line

    model, _ = load(checkpoints("qwen2_moe")[0])
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    weights = sum(p.numel() * 4 for p in model.parameters())
    line = experts_line(model, model.cfg, weights * 2**20)  # as if 2**20 times larger
    assert line.startswith("mixture of experts: 6 experts, 2 per token, in 2 of 3 layers, "
                           "a shared expert 48 wide; experts ")
    assert f"experts {experts * 4 / 2**30:.2f} GiB of the rank's {weights / 2**10:.2f} GiB" \
        in line and line.endswith("a token reading 33.3% of them")


@pytest.mark.parametrize("kind", ["granitemoe", "mixtral"])
def test_transformers_own_files_load(tmp_path, kind):
    """``save_pretrained``'s files (the hub's layout: Granite-MoE's stacked
    ``input_linear`` / ``output_linear`` and ``router.layer``, Mixtral's ``w1``/``w3``/``w2``
    per expert), not the in-memory names the other tests write, give the same logits."""
    from tests.model.util import full_logits

    hf = _hf_moe(kind)
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0]
    model, comm = load(str(tmp_path))
    assert (full_logits(model, comm, TOKENS) - want).abs().max().item() < 1e-4


def test_a_gguf_mixture_of_another_architecture_is_refused(tmp_path):
    from tests.model.test_tiny_models import _hf_model
    from tests.model.util import save_gguf_file

    path = save_gguf_file(_hf_model("qwen2"), tmp_path / "q.gguf", "qwen2",
                          lambda w: w.add_uint32("qwen2.expert_count", 4))
    with pytest.raises(ValueError, match="a qwen2 mixture of experts is not supported"):
        load(str(path))
