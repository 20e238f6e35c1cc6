"""Gemma 1, 2 and 3: tiny random checkpoints written by transformers as sharded folders
give transformers' logits in float32, at tp 1, 2 and 3 (3: padded heads and MLP), prefilled
whole, in chunks and decoded a token at a time, in both ``--tp-comm`` modes.

What each exercises, beyond Llama: norms scaling by ``1 + w`` (made non-trivial), the
GeLU-tanh gate, the embedding scaled by sqrt(hidden); Gemma 2's sandwich norms,
``query_pre_attn_scalar``, softcapped attention and final logits (small caps, so they
change the answer) and its every-other-layer window; Gemma 3's q/k head norms, its windowed
layers' own RoPE base beside the full layers' linearly scaled one, and its five-in-six
window pattern. Heads are wider than hidden / heads, as Gemma's are."""

from __future__ import annotations

import pytest
import torch

from tests.model.util import hf_checkpoints, load, whole_and_stepped
from tpserve.model.config import ModelConfig
from tpserve.model.runner_config import resolve_max_model_len
from tpserve.parallel.launch import run_ranks

TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12, 33, 71, 140, 2, 60, 61, 8,
          19, 230, 111, 4, 90]
TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256,
            rms_norm_eps=1e-6)
ARCH = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
        "gemma3": "Gemma3ForCausalLM"}


def _config(kind: str, **changes):
    import transformers as tf

    if kind == "gemma":
        cfg = tf.GemmaConfig(**TINY, num_hidden_layers=2, hidden_act="gelu")  # legacy name
    elif kind == "gemma2":
        cfg = tf.Gemma2Config(**TINY, num_hidden_layers=3, query_pre_attn_scalar=24,
                              sliding_window=6, attn_logit_softcapping=1.5,
                              final_logit_softcapping=0.5)
    else:
        cfg = tf.Gemma3TextConfig(
            **TINY, num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10.0}})
    for key, value in changes.items():
        setattr(cfg, key, value)
    cfg.architectures = [ARCH[kind]]
    return cfg


def _hf_model(kind: str, sharp: bool = True, **changes):
    """The tiny model of ``kind``; ``sharp``: q/k weights times 8, attention logits of a few
    units (where a softcap of 1.5 bends them)."""
    import transformers as tf

    torch.manual_seed({"gemma": 40, "gemma2": 41, "gemma3": 42}[kind])
    model = tf.AutoModelForCausalLM.from_config(_config(kind, **changes),
                                                dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from 1 + 0, so the unit offset is really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if sharp and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return hf_checkpoints(tmp_path_factory, _hf_model, lambda kind: TOKENS)


def _steps(group, folder: str, tp_comm: str = "allreduce") -> list[torch.Tensor]:
    """Every position's logits from one whole prefill, and from prefill 9 + chunk 8 +
    decodes."""
    model, comm = load(folder, group, tp_comm=tp_comm)
    return whole_and_stepped(model, comm, TOKENS, 9, 8)


def _check(folder: str, want: torch.Tensor, tp: int, tp_comm: str = "allreduce") -> None:
    results = run_ranks(_steps, tp, folder, tp_comm, timeout_s=300)
    assert len(results) == tp
    for whole, stepped in results:
        assert (whole - want).abs().max().item() < 1e-4, (tp, tp_comm)
        assert (stepped - want).abs().max().item() < 1e-4, (tp, tp_comm)


@pytest.mark.parametrize("kind", ["gemma", "gemma2", "gemma3"])
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_gemma_equals_transformers(checkpoints, kind, tp):
    folder, want = checkpoints(kind)
    _check(folder, want, tp)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_sequence_parallel_equals_transformers(checkpoints, kind):
    """``--tp-comm allgather``: the sandwich norms run on each rank's tokens."""
    folder, want = checkpoints(kind)
    _check(folder, want, 2, "allgather")


def test_the_features_change_the_answer(checkpoints):
    """The tiny models' caps, scales and RoPE bases matter: transformers' own logits move
    when each is switched off, so equality above tests them."""
    _, want2 = checkpoints("gemma2")
    _, want3 = checkpoints("gemma3")
    x = torch.tensor([TOKENS])
    with torch.no_grad():
        for kind, want, change in (
                ("gemma2", want2, {"attn_logit_softcapping": None}),
                ("gemma2", want2, {"final_logit_softcapping": None}),
                ("gemma2", want2, {"query_pre_attn_scalar": 32}),
                ("gemma2", want2, {"sliding_window": 100}),
                ("gemma3", want3, {"rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                       "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default",
                                          "rope_theta": 1000000.0}}}),
                ("gemma3", want3, {"sliding_window": 100})):
            other = _hf_model(kind, **change)
            assert not torch.allclose(other(x).logits[0], want, atol=1e-3), change


def test_gemma_configs_read_as_transformers_reads_them():
    g1 = ModelConfig.from_hf(_config("gemma").to_dict())
    assert (g1.hidden_act, g1.norm_unit_offset, g1.tie_word_embeddings) == (
        "gelu_tanh", True, True)
    assert g1.embed_scale == 8.0 and g1.sliding_window is None and not g1.sandwich_norms
    g2 = ModelConfig.from_hf(_config("gemma2").to_dict())
    assert [g2.window_of(i) for i in range(3)] == [6, None, 6]
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (1.5, 0.5)
    assert g2.attention_scale == 24 ** -0.5 and g2.sandwich_norms and not g2.qk_norm
    g3 = ModelConfig.from_hf(_config("gemma3").to_dict())
    assert g3.qk_norm and g3.local_rope_layers == (0, 2) and g3.local_rope_theta == 10.0
    assert g3.rope_theta == 1e6 and g3.rope_scaling.rope_type == "linear"
    # Gemma 3's max_position_embeddings already counts the linear factor (as vLLM reads it)
    assert resolve_max_model_len(None, g3) == 256


def test_older_gemma_config_files():
    """config.json files written before transformers' per-layer-type RoPE: Gemma 3's
    ``rope_local_base_freq``, ``rope_scaling`` and ``sliding_window_pattern``; Gemma 2
    without ``layer_types`` (every other layer windowed, the first one)."""
    base = dict(TINY, num_hidden_layers=7, sliding_window=6)
    g3 = ModelConfig.from_hf({**base, "architectures": ["Gemma3ForCausalLM"],
                              "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                              "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                              "sliding_window_pattern": 6})
    assert g3.local_rope_layers == (0, 1, 2, 3, 4, 6)
    assert [g3.window_of(i) for i in (4, 5, 6)] == [6, None, 6]
    assert (g3.rope_theta, g3.local_rope_theta, g3.rope_scaling.factor) == (1e6, 1e4, 8.0)
    assert g3.local_rope_scaling is None and g3.attn_logit_softcap is None
    g2 = ModelConfig.from_hf({**base, "architectures": ["Gemma2ForCausalLM"]})
    assert [g2.window_of(i) for i in range(3)] == [6, None, 6]
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (50.0, 30.0)
    assert g2.attention_scale == 256 ** -0.5  # transformers' default query_pre_attn_scalar


def test_gemma_refusals():
    base = dict(TINY, num_hidden_layers=2, architectures=["Gemma3ForCausalLM"])
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf({**base, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="hidden activation 'relu'"):
        ModelConfig.from_hf({**base, "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="attn_logit_softcap must be > 0"):
        ModelConfig.from_hf({**base, "attn_logit_softcapping": 0.0})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):  # a Llama's must be named
        ModelConfig.from_hf(dict(TINY, num_hidden_layers=2, hidden_act="gelu",
                                 architectures=["LlamaForCausalLM"]))


def multimodal_gemma3(seed: int):
    """A tiny Gemma3ForConditionalGeneration: the tiny Gemma 3 as its language model (norms
    made non-trivial) beside a one-layer SigLIP vision tower."""
    import transformers as tf

    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=28, patch_size=14)
    cfg = tf.Gemma3Config(text_config=_config("gemma3").to_dict(),
                          vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=255, boi_token_index=253, eoi_token_index=254)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    hf = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return hf


@pytest.mark.parametrize("saved_by", ["save_pretrained", "state_dict"])
def test_multimodal_gemma3_serves_its_language_model(tmp_path, saved_by):
    """A Gemma3ForConditionalGeneration checkpoint (Gemma 3 4B and up): its language model
    alone, from ``text_config`` and the tensors under either naming (transformers'
    ``save_pretrained`` writes ``language_model.model.*``, its state dict holds
    ``model.language_model.*``), the vision tower and projector skipped; text logits equal
    transformers' at tp 1 and 2."""
    from tests.model.util import save_hf_folder

    hf = multimodal_gemma3(43)
    cfg = hf.config
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([TOKENS])).logits[0]
    folder = tmp_path / saved_by
    if saved_by == "save_pretrained":
        hf.save_pretrained(folder)
    else:
        save_hf_folder(hf, folder)
    own = ModelConfig.from_hf(cfg.to_dict())
    assert own.architecture == "Gemma3ForConditionalGeneration" and own.qk_norm
    assert own.local_rope_layers == (0, 2) and own.tie_word_embeddings
    _check(str(folder), want, 1)
    _check(str(folder), want, 2)


def _fp8_logits(group, folder: str, weight_only: bool) -> torch.Tensor:
    from tests.model.util import full_logits
    from tpserve.model.quant.fp8 import Fp8LinearMethod

    method = Fp8LinearMethod(weight_only_max_tokens=10**6) if weight_only else Fp8LinearMethod()
    model, comm = load(folder, group, quant_method=method)
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    return full_logits(model, comm, TOKENS)


def _dequantized(hf, folder: str):
    """``hf`` with every linear weight replaced by our tp 1 fp8 weight, dequantized."""
    from tests.model.util import copy_dequantized_layer
    from tpserve.model.quant.fp8 import Fp8LinearMethod

    ours, _ = load(folder, quant_method=Fp8LinearMethod())
    for mine, theirs in zip(ours.model.layers, hf.model.layers, strict=True):
        copy_dequantized_layer(mine, theirs, ours.cfg)
    return hf


@pytest.mark.parametrize("kind", ["gemma", "gemma2", "gemma3"])
def test_gemma_quantized_at_load(tmp_path, kind):
    """``--quantization fp8`` on Gemma (its norms and GeLU gate hand the linear layers
    unquantized input, which they quantize themselves where they want it quantized): with
    weight-only products every step, at tp 1 and 2, the logits equal transformers' over
    the same fp8 weights dequantized; with the default W8A8 steps they stay within the
    activations' fp8 error of those (sandwich norms rescale each sublayer's small output,
    its relative error with it, so that error is not small on random weights)."""
    from tests.model.util import save_hf_folder

    folder = str(save_hf_folder(_hf_model(kind, sharp=False), tmp_path / kind))
    with torch.no_grad():
        want = _dequantized(_hf_model(kind, sharp=False), folder)(
            torch.tensor([TOKENS])).logits[0]
    for tp in (1, 2):
        for logits in run_ranks(_fp8_logits, tp, folder, True):
            assert (logits - want).abs().max().item() < 1e-4, tp
    (w8a8,) = run_ranks(_fp8_logits, 1, folder, False)
    err = (w8a8 - want).abs().max().item() / want.abs().max().item()
    assert 0 < err < 0.15, err


def _gemma_gguf(model, path, arch: str) -> str:
    """``model`` as llama.cpp's converter writes a Gemma GGUF: norms stored ``1 + w``, Gemma
    2/3's four norms under their llama.cpp names, the softcaps and the window as metadata
    (Gemma 3's window pattern and local RoPE base left to llama.cpp's defaults: the tiny
    Gemma 3 written here follows them)."""
    from tests.model.util import save_gguf_file

    cfg = model.config

    def metadata(w):
        if arch != "gemma":
            w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
        if arch == "gemma2":
            w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
            w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
        if arch == "gemma3":
            w.add_string(f"{arch}.rope.scaling.type", "linear")
            w.add_float32(f"{arch}.rope.scaling.factor", 4.0)

    sandwich = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
    save_gguf_file(model, path, arch, metadata,
                   layer_names=sandwich if arch != "gemma" else None, norm_shift=1.0)
    return str(path)


def _gguf_model(kind: str):
    """The tiny models as a GGUF file can describe them: llama.cpp's head-dim attention
    scale (``query_pre_attn_scalar`` = head_dim); Gemma 3's windows five in six layers
    from the first and its local RoPE base 10,000."""
    if kind == "gemma":
        return _hf_model(kind)
    if kind == "gemma2":
        return _hf_model(kind, query_pre_attn_scalar=32)
    types = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    return _hf_model(kind, query_pre_attn_scalar=32, num_hidden_layers=7, layer_types=types,
                     rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                         "rope_theta": 1000000.0},
                                      "sliding_attention": {"rope_type": "default",
                                                            "rope_theta": 10000.0}})


@pytest.mark.parametrize("kind", ["gemma", "gemma2", "gemma3"])
def test_gemma_gguf_equals_transformers(tmp_path, kind):
    """A Gemma GGUF file (llama.cpp's ``gemma``, ``gemma2``, ``gemma3``) gives transformers'
    logits at tp 1 and 2: its ``1 + w`` norms read back as ``w``, Gemma 2/3's four norms
    under llama.cpp's names, the softcaps, the window and Gemma 3's linear scaling from
    metadata."""
    hf = _gguf_model(kind)
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0]
    path = _gemma_gguf(hf, tmp_path / f"{kind}.gguf", kind)
    _check(path, want, 1)
    _check(path, want, 2)
