"""``tpserve serve FOLDER`` of an FP8 checkpoint folder (vLLM's "fp8" ``quantization_config``)
through the real openai client, with the default ``--quantization auto``.

The folder is the embedded SmolLM2-135M written as a Hugging Face folder with every linear
weight quantized per channel by ``quantize_per_row``, so the served model is exactly
``--quantization fp8`` of the embedded one: its next-token log-probabilities equal that
model's, computed here in process (float32, CPU; the server's prefill steps differ only in
how the prompts are batched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.model.util import fp8_quantization_config, fp8_state, full_logits, load
from tests.server.serverproc import ServerProcess
from tpserve.model.loader import gguf_file
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.quant.fp8 import Fp8LinearMethod

TEXT = Path(__file__).parents[1] / "data" / "pride_and_prejudice_ch1.txt"
CUTS = [16, 40]


def write_fp8_smollm2(folder: Path) -> Path:
    """The embedded GGUF's weights (dequantized, Hugging Face names) as an FP8 folder, with
    its tokenizer and an equivalent ``config.json``."""
    ckpt = open_checkpoint(None)
    c = ckpt.config
    state = {name: src.read().float().contiguous()
             for name, src in gguf_file.iter_weights(ckpt.reader, c)}
    state.pop("lm_head.weight", None)  # tied to the embedding
    folder.mkdir(parents=True)
    save_file(fp8_state(state), str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": [c.architecture], "model_type": "llama",
              "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_hidden_layers,
              "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
              "max_position_embeddings": c.max_position_embeddings,
              "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
              "eos_token_id": list(c.eos_token_ids),
              "quantization_config": fp8_quantization_config("fp8")}
    (folder / "config.json").write_text(json.dumps(config))
    ckpt.tokenizer().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_fp8_smollm2(tmp_path_factory.mktemp("smollm2") / "SmolLM2-FP8")


@pytest.fixture(scope="module")
def server(folder):
    s = ServerProcess(str(folder), "--no-engine-process", log_level="info")
    yield s
    assert s.stop() == 0, s.output()


def test_start_up_says_the_weights_are_served_as_stored(server):
    assert "linear layers: fp8 weights, as stored (quantization_config.quant_method 'fp8')" \
        in server.output(), server.output()


def test_greedy_answer_is_coherent(server):
    client = server.client()
    r = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


def test_logprobs_are_quantization_fp8_of_the_embedded_model(server):
    tok = open_checkpoint(None).tokenizer()
    ids = tok(TEXT.read_text())["input_ids"][:max(CUTS)]
    client = server.client()
    r = client.completions.create(model=client.models.list().data[0].id,
                                  prompt=[ids[:c] for c in CUTS], max_tokens=1,
                                  temperature=0, logprobs=3)
    model, comm = load(None, quant_method=Fp8LinearMethod())
    with torch.no_grad():
        want = full_logits(model, comm, ids).float().log_softmax(-1)
    for choice in r.choices:
        pos = CUTS[choice.index] - 1
        top = want[pos].topk(3)
        served = choice.logprobs.top_logprobs[0]
        assert list(served) == [tok.decode([t]) for t in top.indices.tolist()], served
        assert list(served.values()) == pytest.approx(top.values.tolist(), abs=1e-3)
