"""Sliding-window attention: a token at position p attends to positions p - W + 1 .. p
(transformers' mask). The Triton decode and prefill kernels (Triton's interpreter off CUDA)
equal the torch reference for windows shorter than, across and longer than the context,
over chunked prefills and split decodes; tiny Mistral (every layer windowed) and Qwen2
(``use_sliding_window`` from ``max_window_layers`` on) checkpoints equal transformers at
tp 1 and 2, prefilled whole, in chunks, verified as a draft and decoded a token at a time,
in float32; and the
window no longer caps the context."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.model.test_tiny_models import TINY
from tests.model.test_triton_kernels import DEVICE, _close, _make_batch, _randn
from tests.model.util import load, new_pool, run, save_hf_folder
from tpserve.model.config import ModelConfig
from tpserve.model.kernels import torch_ops
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.plan import SeqChunk
from tpserve.model.runner_config import resolve_max_model_len
from tpserve.parallel.launch import run_ranks

WINDOWS = [1, 5, 16, 40, 1000]


def _ref(q, k_cache, v_cache, meta, scale, window):
    tables = meta.block_tables.clone()
    tables[tables >= k_cache.shape[0]] = 0
    return torch_ops.paged_attention(q, k_cache, v_cache, replace(meta, block_tables=tables),
                                     scale, window=window)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_decode_kernel_window(kernels, window, splits, head_dim):
    gen = torch.Generator().manual_seed(21)
    hkv, group, page, dtype = 2, 4, 8, torch.float32
    lens = [1, 7, 33, 100, 300]
    meta, k_cache, v_cache = _make_batch([(n - 1, 1) for n in lens], page, hkv, head_dim,
                                         dtype, gen)
    q = _randn(len(lens), hkv * group, head_dim, dtype=dtype, gen=gen)
    out = torch.full_like(q, float("nan"))
    kernels["triton_decode_attention"].decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125, out, splits,
        window=window)
    want = _ref(q, k_cache, v_cache, meta, 0.125, window)
    _close(out, want, dtype)
    if window < 300:  # the window really changes the answer
        assert not torch.allclose(want, _ref(q, k_cache, v_cache, meta, 0.125, None))


MIXED = [(4, 1), (39, 1), (0, 7), (20, 33), (36, 1), (100, 33), (0, 70)]  # (ctx, q_len)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_window_mixed_batch(backend, window, dtype):
    """Decodes, fresh prefills (longer than the window) and chunked prefills over a cached
    prefix, through the back-end's split between the two kernels."""
    gen = torch.Generator().manual_seed(22)
    hkv, group, page, head_dim = 2, 2, 16, 64
    meta, k_cache, v_cache = _make_batch(MIXED, page, hkv, head_dim, dtype, gen)
    num_tokens = int(meta.query_start_loc[-1])
    q = _randn(num_tokens, hkv * group, head_dim, dtype=dtype, gen=gen)
    out = backend.paged_attention(q, k_cache, v_cache, meta, 0.125, window=window)
    _close(out, _ref(q, k_cache, v_cache, meta, 0.125, window), dtype)


def _hf(kind: str, windowed: bool = True):
    """The tiny model of ``kind``; ``windowed`` False: the same weights without a window."""
    import transformers as tf

    torch.manual_seed(31)
    if kind == "mistral":
        cfg = tf.MistralConfig(**TINY, rope_theta=10000.0,
                               sliding_window=8 if windowed else None)
        cfg.architectures = ["MistralForCausalLM"]
    else:  # layer 0 attends to everything, layer 1 to its window
        cfg = tf.Qwen2Config(**TINY, rope_theta=10000.0, use_sliding_window=windowed,
                             sliding_window=6, max_window_layers=1)
        cfg.architectures = ["Qwen2ForCausalLM"]
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


TOKENS = [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12, 33, 71, 140, 2, 60, 61, 8,
          19, 230, 111, 4, 90, 45, 45, 3, 18, 200]


@torch.no_grad()
def _steps(group, folder: str) -> list[torch.Tensor]:
    """Logits of every position: one whole prefill; and prefill 11 + chunk 9 + a drafted
    chunk of 5 (every position sampled: each a decode of its own length,
    ``StepPlan.build``) + decodes."""
    model, comm = load(folder, group)
    pool = new_pool(model, comm)
    blocks = list(range(4))
    whole = run(model, pool, [SeqChunk(TOKENS, 0, blocks, True)], all_logits=True)
    pool = new_pool(model, comm)
    parts = [run(model, pool, [SeqChunk(TOKENS[:11], 0, blocks, True)], all_logits=True),
             run(model, pool, [SeqChunk(TOKENS[11:20], 11, blocks, True)], all_logits=True)]
    parts.append(run(model, pool, [SeqChunk(TOKENS[20:25], 20, blocks, True, sample_rows=5)]))
    parts += [run(model, pool, [SeqChunk([t], p, blocks, True)])
              for p, t in enumerate(TOKENS[25:], start=25)]
    return [whole, torch.cat(parts)]


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_windowed_models_equal_transformers(tmp_path, kind):
    hf = _hf(kind)
    folder = save_hf_folder(hf, tmp_path / kind)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    windows = [cfg.window_of(i) for i in range(cfg.num_hidden_layers)]
    assert windows == ([8, 8] if kind == "mistral" else [None, 6])
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0]
        full = _hf(kind, windowed=False)
        full.load_state_dict(hf.state_dict())
        unwindowed = full(torch.tensor([TOKENS])).logits[0]
    assert not torch.allclose(want, unwindowed, atol=1e-3)  # the window matters here
    for world in (1, 2):
        for whole, stepped in run_ranks(_steps, world, str(folder)):
            assert torch.allclose(whole, want, atol=1e-4), (kind, world)
            assert torch.allclose(stepped, want, atol=1e-4), (kind, world)


def test_the_window_no_longer_caps_the_context():
    base = {"architectures": ["MistralForCausalLM"], "vocab_size": 8, "hidden_size": 64,
            "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
            "max_position_embeddings": 32768, "sliding_window": 4096}
    cfg = ModelConfig.from_hf(base)
    assert resolve_max_model_len(None, cfg) == 32768 and cfg.window_of(1) == 4096
    # transformers' Llama has no sliding window; Qwen's only with use_sliding_window
    assert ModelConfig.from_hf({**base, "architectures": ["LlamaForCausalLM"]}
                               ).sliding_window is None
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"]}
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": False}).sliding_window is None
    mixed = ModelConfig.from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert [mixed.window_of(i) for i in range(2)] == [None, 4096]
    listed = ModelConfig.from_hf({**base, "layer_types": ["sliding_attention",
                                                          "full_attention"]})
    assert [listed.window_of(i) for i in range(2)] == [4096, None]
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        ModelConfig.from_hf({**base, "sliding_window": -1})
    assert DEVICE.type in ("cpu", "cuda")


def test_disable_sliding_window_caps_the_context(tmp_path):
    """vLLM's --disable-sliding-window: every layer attends to everything, and the context
    is capped at the window."""
    from tpserve.cli import build_parser
    from tpserve.server.config import config_from_args

    folder = str(save_hf_folder(_hf("mistral"), tmp_path / "mistral"))

    def cfg(*argv):
        return config_from_args(build_parser()[0].parse_args(["serve", folder, *argv]))

    assert cfg().scheduler.max_model_len == 256  # the window (8) does not cap it
    off = cfg("--disable-sliding-window")
    assert off.runner.disable_sliding_window and off.scheduler.max_model_len == 8
    with pytest.raises(ValueError, match="exceeds the model's context of 8 tokens"):
        cfg("--disable-sliding-window", "--max-model-len", "9")
    model, _ = load(folder)
    assert [layer.self_attn.window for layer in model.model.layers] == [8, 8]
    headless = open_checkpoint(folder, disable_sliding_window=True).config
    assert headless.window_of(0) is None and headless.context_cap == 8
