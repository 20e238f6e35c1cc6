"""Phi-3 (``Phi3ForCausalLM``: Phi-4, Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini) on the
Llama decoder: tiny random transformers Phi-3 models written as sharded Hugging Face
folders give transformers' logits at tp 1, 2 and 3 (tp 3: 4 -> 6 query heads, 2 -> 3 KV
heads, MLP 128 -> 129), with RoPE over the whole head, over half of it
(``partial_rotary_factor``) and under LongRoPE (up to its original context, the one it is
served in). The fused ``qkv_proj`` / ``gate_up_proj`` tensors load into exactly the
parameters the split Llama tensors load into; the dummy ``phi-4`` shape lists exactly
transformers' tensors; the Triton ops pass the unrotated tail through."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # the Triton test's kernels: set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

from tests.model.util import (  # noqa: E402
    assert_same_steps,
    fp8_quantization_config,
    full_logits,
    hf_checkpoints,
    load,
    new_pool,
    run,
    save_gguf_file,
    save_hf_folder,
)
from tpserve.model.config import ModelConfig  # noqa: E402
from tpserve.model.kv_hadamard import resolve_kv_cache_hadamard  # noqa: E402
from tpserve.model.layers.rotary import cos_sin_cache, inverse_frequencies  # noqa: E402
from tpserve.model.loader.checkpoint import open_checkpoint  # noqa: E402
from tpserve.model.loader.dummy import hf_tensors, shape_config, shape_hf_config  # noqa: E402
from tpserve.model.runner_config import resolve_max_model_len  # noqa: E402
from tpserve.parallel.launch import run_ranks  # noqa: E402
from tpserve.parallel.shard import InMemorySource, NarrowSource  # noqa: E402

TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
# LongRoPE: every position of the 32 tokens below within the original context of 32
ORIGINAL = 32
LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.3, 2.5, 4.0],
            "long_factor": [1.5, 3.0, 6.0, 11.0]}
LONG_TOKENS = [(7 * i + 3) % 256 for i in range(ORIGINAL)]


def _hf_model(kind: str):
    """A tiny transformers Phi-3: ``plain`` (RoPE over the whole head of 16), ``partial``
    (over its first 8 dims, tied embeddings) or ``longrope`` (partial too, as Phi-4-mini;
    128 positions, original context 32)."""
    import transformers as tf

    torch.manual_seed({"plain": 10, "partial": 11, "longrope": 12}[kind])
    if kind == "plain":
        cfg = tf.Phi3Config(**TINY, rope_theta=10000.0, max_position_embeddings=256)
    elif kind == "partial":
        cfg = tf.Phi3Config(**TINY, rope_theta=10000.0, max_position_embeddings=256,
                            partial_rotary_factor=0.5, tie_word_embeddings=True)
    else:
        cfg = tf.Phi3Config(**TINY, rope_theta=10000.0, max_position_embeddings=128,
                            original_max_position_embeddings=ORIGINAL,
                            partial_rotary_factor=0.5, tie_word_embeddings=True,
                            rope_scaling=dict(LONGROPE))
    cfg.architectures = ["Phi3ForCausalLM"]
    model = tf.Phi3ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # non-trivial norms, so that they are really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _tokens(kind: str) -> list[int]:
    return LONG_TOKENS if kind == "longrope" else TOKENS


def _max_positions(kind: str) -> int:
    """The RoPE table's length: a LongRoPE table stops at the original context."""
    return ORIGINAL if kind == "longrope" else 512


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (folder, transformers' logits); each tiny checkpoint is written once."""
    return hf_checkpoints(tmp_path_factory, _hf_model, _tokens)


def _logits(group, folder, kind):
    model, comm = load(folder, group, max_positions=_max_positions(kind))
    return full_logits(model, comm, _tokens(kind))


def test_checkpoint_stores_fused_tensors(checkpoints):
    folder, _ = checkpoints("plain")
    index = json.loads(open(f"{folder}/model.safetensors.index.json").read())["weight_map"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in index
    assert "model.layers.0.mlp.gate_up_proj.weight" in index
    assert not any(".q_proj." in n or ".gate_proj." in n for n in index)


@pytest.mark.parametrize("kind", ["plain", "partial", "longrope"])
def test_tp1_equals_transformers(checkpoints, kind):
    folder, ref = checkpoints(kind)
    model, comm = load(folder, max_positions=_max_positions(kind))
    assert model.cfg.rotary_dim == (16 if kind == "plain" else 8)
    assert (full_logits(model, comm, _tokens(kind)) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind,tp", [("plain", 2), ("plain", 3), ("partial", 2),
                                     ("partial", 3), ("longrope", 3)])
def test_tensor_parallel_equals_transformers(checkpoints, kind, tp):
    folder, ref = checkpoints(kind)
    results = run_ranks(_logits, tp, folder, kind, timeout_s=300)
    assert len(results) == tp
    for logits in results:
        assert (logits - ref).abs().max().item() < 1e-4


def _split_as_llama(hf, folder):
    """The Phi-3 ``hf``'s weights as a Llama checkpoint: q/k/v and gate/up split apart."""
    import transformers as tf

    c = hf.config
    cfg = tf.LlamaConfig(**TINY, rope_theta=10000.0, max_position_embeddings=256)
    cfg.architectures = ["LlamaForCausalLM"]
    llama = tf.LlamaForCausalLM(cfg).to(torch.float32).eval()
    q = c.num_attention_heads * (c.hidden_size // c.num_attention_heads)
    kv = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    state = {}
    for name, t in hf.state_dict().items():
        if ".qkv_proj." in name:
            for part, rows in zip("qkv", t.split([q, kv, kv]), strict=True):
                state[name.replace(".qkv_proj.", f".{part}_proj.")] = rows
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2)
            state[name.replace(".gate_up_proj.", ".gate_proj.")] = gate
            state[name.replace(".gate_up_proj.", ".up_proj.")] = up
        else:
            state[name] = t
    llama.load_state_dict(state)
    return save_hf_folder(llama, folder)


def _parameters(group, phi3_folder, llama_folder):
    """Every parameter of the Phi-3 and the Llama model on this rank, unquantized and
    quantized at load (``--quantization fp8``), as (dtype, its bytes): fp8 tensors do not
    cross a process boundary."""
    from tpserve.model.quant.fp8 import Fp8LinearMethod

    out = []
    for quant in (None, Fp8LinearMethod()):
        for folder in (phi3_folder, llama_folder):
            model, _ = load(folder, group, quant_method=quant)
            out.append({n: (str(p.dtype), p.detach().contiguous().view(torch.uint8).clone())
                        for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("tp", [1, 3])
def test_fused_tensors_load_as_the_split_ones(checkpoints, tmp_path, tp):
    """Each rank's parameters from the fused tensors are exactly those from the split
    ones (head padding and replicated rows at tp 3), also quantized at load."""
    folder, _ = checkpoints("plain")
    llama = _split_as_llama(_hf_model("plain"), tmp_path / "llama")
    for phi3, llama_params, phi3_fp8, llama_fp8 in run_ranks(_parameters, tp, folder,
                                                              str(llama), timeout_s=300):
        for ours, theirs in ((phi3, llama_params), (phi3_fp8, llama_fp8)):
            assert ours.keys() == theirs.keys()
            for name, (dtype, data) in ours.items():
                assert dtype == theirs[name][0] and torch.equal(data, theirs[name][1]), name
        assert phi3_fp8["model.layers.0.self_attn.qkv_proj.weight"][0] == "torch.float8_e4m3fn"


def test_longrope_differs_past_the_original_context(checkpoints):
    """Why LongRoPE is served within its original context only: past it transformers
    recomputes every position, the first ones included, with the long factors, so a
    token's logits depend on how long its sequence grows (no static table, no KV cache
    written once, can give that)."""
    _, ref = checkpoints("longrope")
    hf = _hf_model("longrope")
    with torch.no_grad():
        longer = hf(torch.tensor([LONG_TOKENS + [5]])).logits[0, :ORIGINAL]
    # far past the 1e-4 our logits are held to (random tiny weights: small differences)
    assert (longer - ref).abs().max().item() > 1e-3


# ----------------------------------------------------------------------------- the config

def _phi3_hub_config(**keys) -> dict:
    """A ``config.json`` as the Phi-3 repositories write it (``rope_scaling``, top-level
    ``rope_theta``, ``partial_rotary_factor`` and ``original_max_position_embeddings``):
    Phi-3-mini's shape unless ``keys`` say otherwise."""
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064,
            "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096, "rope_scaling": None,
            "sliding_window": 2047, "bos_token_id": 1, "eos_token_id": 32000, **keys}


def _phi4_mini(**keys) -> dict:
    return _phi3_hub_config(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
        num_key_value_heads=8, partial_rotary_factor=0.75, max_position_embeddings=131072,
        original_max_position_embeddings=4096, sliding_window=262144,
        tie_word_embeddings=True,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 48 for i in range(48)],
                      "long_factor": [1.0 + i for i in range(48)]}, **keys)


def test_phi3_mini_4k_serves_its_context_with_its_sliding_window():
    cfg = ModelConfig.from_hf(_phi3_hub_config())
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_scaling) == (96, 96, None)
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm)
    assert resolve_max_model_len(None, cfg) == 4096
    assert {cfg.window_of(i) for i in range(cfg.num_hidden_layers)} == {2047}


def test_phi4_mini_config():
    """Phi-4-mini: RoPE over 96 of 128 head dims, LongRoPE with the attention factor of
    factor 131072 / 4096 = 32, served up to its original 4,096 tokens."""
    cfg = ModelConfig.from_hf(_phi4_mini())
    s = cfg.rope_scaling
    assert (cfg.head_dim, cfg.rotary_dim, cfg.tie_word_embeddings) == (128, 96, True)
    assert (s.rope_type, s.factor, s.original_max_position_embeddings) == ("longrope", 32, 4096)
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert resolve_max_model_len(None, cfg) == 4096
    with pytest.raises(ValueError, match="exceeds the model's context of 4096 tokens "
                                         r"\(LongRoPE: up to original_max_position_embeddings"):
        resolve_max_model_len(8192, cfg)
    with pytest.raises(ValueError, match="LongRoPE model is served up to its "
                                         r"original_max_position_embeddings \(4096 tokens\)"):
        cos_sin_cache(96, 4097, cfg.rope_theta, s)
    assert cos_sin_cache(96, 4096, cfg.rope_theta, s).shape == (4096, 96)


@pytest.mark.parametrize("keys,rope_type", [
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 48,
                       "long_factor": [2.0] * 48}}, "longrope"),  # Phi-3-mini-128k's old name
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                       "long_factor": [2.0] * 48, "factor": 8.0, "attention_factor": 1.5}},
     "longrope"),
])
def test_longrope_names_and_fields(keys, rope_type):
    cfg = ModelConfig.from_hf(_phi3_hub_config(max_position_embeddings=131072, **keys))
    s = cfg.rope_scaling
    assert s.rope_type == rope_type and s.short_factor == tuple(
        keys["rope_scaling"]["short_factor"])
    want = keys["rope_scaling"].get("attention_factor",
                                     math.sqrt(1 + math.log(32) / math.log(4096)))
    assert s.attention_factor == pytest.approx(want)


@pytest.mark.parametrize("keys,message", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 47,
                       "long_factor": [2.0] * 48}}, "short_factor has 47 entries; RoPE "
                                                    "rotates 96 dims of each head, 48 pairs"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}},
     "'longrope' needs a list 'long_factor'"),
    # transformers' Phi3Config reads "yarn" as "longrope" too
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "'longrope' needs a list"),
    ({"partial_rotary_factor": 0.15625}, "even number of dims from 2 to the head's 96; "
                                         "partial_rotary_factor gives 15"),
])
def test_bad_rope_is_refused(keys, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(_phi3_hub_config(**keys))


@pytest.mark.parametrize("keys,rotary_dim", [
    ({}, 64),
    ({"partial_rotary_factor": None}, 64),
    ({"partial_rotary_factor": 0.25}, 16),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, 32),
    # the RoPE parameters' own factor wins over the top-level key, as in transformers
    ({"partial_rotary_factor": 0.25,
      "rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     32),
])
def test_partial_rotary_factor_of_any_architecture(keys, rotary_dim):
    """Read from any config.json (as vLLM's Llama reads it), top-level or in the RoPE
    parameters."""
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 128,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, **keys}
    assert ModelConfig.from_hf(d).rotary_dim == rotary_dim


@pytest.mark.parametrize("fmt", ["hub", "saved"])
def test_longrope_table_equals_transformers(fmt):
    """Our partial LongRoPE table is transformers' cos and sin at every position of the
    original context (where transformers uses the short factors); both config formats
    (the hub's ``rope_scaling``, transformers 5's saved ``rope_parameters``)."""
    import transformers as tf
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf = tf.Phi3Config(**{k: v for k, v in _phi4_mini().items()
                          if k not in ("architectures", "model_type")})
    d = _phi4_mini() if fmt == "hub" else {**hf.to_dict(), "architectures": ["Phi3ForCausalLM"]}
    cfg = ModelConfig.from_hf(d)
    emb = Phi3RotaryEmbedding(hf)
    assert cfg.rope_scaling.attention_factor == pytest.approx(emb.attention_scaling, abs=1e-12)
    inv = inverse_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(inv, emb.inv_freq, rtol=0, atol=1e-9)
    n = 4096
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
    half = cos.shape[-1] // 2
    want = torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1)
    assert want.shape == (n, 96)
    torch.testing.assert_close(cos_sin_cache(cfg.rotary_dim, n, cfg.rope_theta,
                                             cfg.rope_scaling), want, rtol=0, atol=2e-6)


def test_kv_cache_hadamard_is_off_with_partial_rotary():
    """Not on by default for an FP8 cache, refused when asked, and refused by the model
    when a back-end has it anyway (a caller that does not pass ``rotary_dim``)."""
    assert resolve_kv_cache_hadamard(None, "fp8_e4m3", 128, False, rotary_dim=128)
    assert not resolve_kv_cache_hadamard(None, "fp8_e4m3", 128, False, rotary_dim=96)
    assert not resolve_kv_cache_hadamard(False, "fp8_e4m3", 128, False, rotary_dim=96)
    with pytest.raises(ValueError, match="rotates 96 of its 128 head dims.*"
                                         "--no-kv-cache-hadamard"):
        resolve_kv_cache_hadamard(True, "fp8_e4m3", 128, False, rotary_dim=96)


def test_the_server_config_leaves_the_rotation_off_with_partial_rotary(checkpoints):
    """``tpserve serve`` with an FP8 cache on a partial-rotary model: the rotation is off
    (the config passes the model's rotary dim), and asking for it is refused."""
    from tpserve.cli import build_parser
    from tpserve.server.config import config_from_args

    folder, _ = checkpoints("partial")
    parser, _ = build_parser()

    def cfg(*flags: str):
        return config_from_args(parser.parse_args(["serve", folder, "--device", "cpu",
                                                   "--kv-cache-dtype", "fp8", *flags]))

    assert cfg().runner.kv_cache_hadamard is False
    with pytest.raises(ValueError, match="rotates 8 of its 16 head dims"):
        cfg("--kv-cache-hadamard")


def test_model_refuses_the_hadamard_rotation_with_partial_rotary(checkpoints):
    folder, _ = checkpoints("partial")
    with pytest.raises(ValueError, match="rotates 8 of its 16 head dims"):
        load(folder, k_hadamard=True)


# ----------------------------------------------------------------------------- loading

def test_narrow_source_reads_inside_its_part():
    full = torch.arange(60.0).reshape(10, 6)
    part = NarrowSource(InMemorySource(full), 0, 3, 4)
    assert part.shape == (4, 6)
    assert torch.equal(part.read(), full[3:7])
    assert torch.equal(part.read(0, 1, 2), full[4:6])
    assert torch.equal(part.read(1, 2, 3), full[3:7, 2:5])
    assert torch.equal(NarrowSource(part, -1, 1, 2).read(0, 1), full[4:7, 1:3])
    with pytest.raises(ValueError, match=r"units \[3, 5\) of dim 0 lie outside"):
        part.read(0, 3, 2)  # would be the next part's row 7
    with pytest.raises(ValueError, match="lie outside a tensor of shape"):
        NarrowSource(InMemorySource(full), 0, 8, 3)


def test_fused_tensor_of_the_wrong_size_is_refused(checkpoints):
    folder, _ = checkpoints("plain")
    model, _ = load(folder)
    bad = [("model.layers.1.self_attn.qkv_proj.weight", torch.zeros(63, 64))]
    with pytest.raises(ValueError, match=r"qkv_proj.weight': a fused tensor of shape "
                                         r"\(63, 64\); expected 64 \+ 32 \+ 32 = 128 rows"):
        model.load_weights(bad)


def test_quantized_checkpoint_with_fused_tensors_is_refused(checkpoints, tmp_path):
    """An FP8 method loads each part's scales by shard id from the part's own tensor; a
    fused one is refused when the folder is opened."""
    folder, _ = checkpoints("plain")
    quantized = shutil.copytree(folder, tmp_path / "fp8")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = fp8_quantization_config()
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized checkpoints that store q/k/v or gate/up "
                                         "fused"):
        open_checkpoint(str(quantized))


# ----------------------------------------------------------------------------- dummy phi-4

def test_phi4_shape_is_transformers_tensors():
    """The dummy ``phi-4`` lists exactly the tensors (fused names and shapes) transformers
    builds from the same config.json, 14.7 B parameters as microsoft/phi-4."""
    import transformers as tf

    hf_cfg = tf.Phi3Config(**{k: v for k, v in shape_hf_config("phi-4").items()
                              if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf = tf.Phi3ForCausalLM(hf_cfg)
    want = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    cfg = shape_config("phi-4")
    tensors = dict(hf_tensors(cfg))
    assert tensors == want
    assert sum(torch.Size(s).numel() for s in tensors.values()) == 14_659_507_200
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta) == (128, 128, 250000.0)
    assert resolve_max_model_len(None, cfg) == 16384


TINY_PHI4 = json.dumps({"hidden_size": 64, "intermediate_size": 100, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2,
                        "vocab_size": 256}, sort_keys=True)


def _dummy_logits(group):
    model, comm = load("phi-4", group, "dummy", hf_overrides=TINY_PHI4)
    return full_logits(model, comm, TOKENS)


def test_dummy_phi4_loads_fused_and_does_not_depend_on_tp():
    """Dummy weights are generated per (fused) tensor name and read in each rank's slices:
    the logits at tp 3 (padded heads and MLP columns) are tp 1's."""
    cfg = open_checkpoint("phi-4", "dummy", hf_overrides=TINY_PHI4).config
    assert "model.layers.0.self_attn.qkv_proj.weight" in dict(hf_tensors(cfg))
    want = _dummy_logits(None)
    assert want.abs().max().item() > 0
    for logits in run_ranks(_dummy_logits, 3, timeout_s=300):
        assert (logits - want).abs().max().item() < 1e-4


# ----------------------------------------------------------------------------- Triton

@pytest.mark.parametrize("kind", ["partial", "longrope"])
def test_partial_rotary_through_the_triton_ops(kernels, backend, checkpoints, kind):
    """A tiny Phi-3 whose RoPE covers half of each head on the Triton norm, RoPE and
    attention kernels (under ``TRITON_INTERPRET=1`` off CUDA): its logits over a prefill
    and a decode step equal the torch reference's."""
    from tests.model.test_triton_kernels import DEVICE
    from tpserve.model.loader.build import build_model
    from tpserve.model.plan import SeqChunk

    folder, _ = checkpoints(kind)
    ref_model, comm = load(folder, max_positions=_max_positions(kind))
    model = build_model(open_checkpoint(folder), comm, DEVICE, torch.float32,
                        kernels["triton_ops"], backend.TritonAttention(torch.float32),
                        _max_positions(kind))
    assert model.cfg.rotary_dim * 2 == model.cfg.head_dim
    tokens = _tokens(kind)[:-1]
    assert_same_steps(ref_model, model, comm,
                      [[SeqChunk(tokens, 0, [0, 1], True)],
                       [SeqChunk([5], len(tokens), [0, 1], True)]], DEVICE)


def test_phi3_mini_heads_and_window_through_the_triton_ops(kernels, backend, tmp_path):
    """Phi-3-mini's shape in small: heads of 96 (the Triton kernels tile them as 128) and a
    sliding window (8, shorter than the prompt), on the Triton norm, RoPE and attention
    kernels (the interpreter off CUDA): a prefill, a chunk over the cache and decodes give
    transformers' logits."""
    import transformers as tf

    from tests.model.test_triton_kernels import DEVICE
    from tpserve.model.loader.build import build_model
    from tpserve.model.plan import SeqChunk

    torch.manual_seed(13)
    cfg = tf.Phi3Config(**{**TINY, "hidden_size": 192, "num_attention_heads": 2,
                           "num_key_value_heads": 2}, rope_theta=10000.0,
                        max_position_embeddings=256, sliding_window=8)
    cfg.architectures = ["Phi3ForCausalLM"]
    hf = tf.Phi3ForCausalLM(cfg).eval()
    tokens = TOKENS + [5, 6, 7]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    folder = save_hf_folder(hf, tmp_path / "phi3-mini-like")
    comm = load(str(folder))[1]
    model = build_model(open_checkpoint(str(folder)), comm, DEVICE, torch.float32,
                        kernels["triton_ops"], backend.TritonAttention(torch.float32), 512)
    assert (model.cfg.head_dim, model.cfg.window_of(1)) == (96, 8)
    pool = new_pool(model, comm, device=DEVICE)
    got = [run(model, pool, [SeqChunk(tokens[:9], 0, [0], True)], all_logits=True),
           run(model, pool, [SeqChunk(tokens[9:14], 9, [0], True)], all_logits=True)]
    got += [run(model, pool, [SeqChunk([t], p, [0], True)])
            for p, t in enumerate(tokens[14:], start=14)]
    assert (torch.cat(got).cpu() - want).abs().max().item() < 1e-4


def test_triton_back_end_refuses_what_its_kernels_cannot_do(backend):
    attn = backend.TritonAttention(torch.float32)
    with pytest.raises(ValueError, match="multiple of 8 of at least 16; this model's is 100: "
                                         r"the torch back-end \(--kernel-backend torch"):
        attn.check_model(100, 100, False)
    attn.check_model(96, 96, False)  # Phi-3-mini, Phi-3.5-mini: tiled as 128
    with pytest.raises(ValueError, match="norms q/k heads only under RoPE over the whole"):
        attn.check_model(128, 64, True)
    attn.check_model(128, 96, False)  # Phi-4-mini


# ----------------------------------------------------------------------------- GGUF


def _phi3_gguf(kind: str, path, **extra) -> str:
    """The tiny ``kind`` Phi-3 as llama.cpp's converter writes a ``phi3`` file: fused
    ``attn_qkv`` / ``ffn_up``, q/k rows unpermuted, ``rope.dimension_count`` the rotated
    dims of a head, and ``extra`` keys (e.g. the sliding window)."""
    hf = _hf_model(kind)
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    rotary = int(head_dim * (getattr(hf.config, "partial_rotary_factor", None) or 1.0))

    def metadata(w):
        w.add_uint32("phi3.rope.dimension_count", rotary)
        for key, value in extra.items():
            w.add_uint32(f"phi3.{key}", value)

    return str(save_gguf_file(hf, path, "phi3", metadata))


@pytest.mark.parametrize("kind,tp", [("plain", 1), ("partial", 1), ("partial", 3)])
def test_phi3_gguf_equals_transformers(checkpoints, tmp_path, kind, tp):
    """A ``phi3`` GGUF file (fused tensors loaded part by part, partial rotary from
    ``rope.dimension_count``) gives transformers' logits, at tp 3 with padded heads too."""
    _, ref = checkpoints(kind)
    path = _phi3_gguf(kind, tmp_path / f"{kind}.gguf")
    cfg = open_checkpoint(path).config
    assert (cfg.architecture, cfg.rotary_dim) == ("Phi3ForCausalLM",
                                                  16 if kind == "plain" else 8)
    results = run_ranks(_logits, tp, path, kind, timeout_s=300)
    assert len(results) == tp
    for logits in results:
        assert (logits - ref).abs().max().item() < 1e-4


def test_phi3_gguf_sliding_window_and_longrope(tmp_path):
    """A window in the metadata is every layer's, as a config.json's is (it does not cap
    the context); LongRoPE factors stored as tensors are refused by name."""
    path = _phi3_gguf("plain", tmp_path / "window.gguf", **{"attention.sliding_window": 100})
    cfg = open_checkpoint(path).config
    assert cfg.window_of(0) == cfg.window_of(cfg.num_hidden_layers - 1) == 100
    assert resolve_max_model_len(None, cfg) == cfg.max_position_embeddings
    hf = _hf_model("plain")
    factors = np.ones(8, dtype=np.float32)
    path = save_gguf_file(hf, tmp_path / "longrope.gguf", "phi3",
                          extra_tensors={"rope_factors_long.weight": factors,
                                         "rope_factors_short.weight": factors})
    with pytest.raises(ValueError, match="LongRoPE factors as tensors .*not supported"):
        open_checkpoint(str(path))
