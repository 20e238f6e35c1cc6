"""``tpserve serve --runner pooling``: /v1/embeddings through real servers and the real
``openai`` client, on a tiny Qwen3 embedding checkpoint written as Qwen3-Embedding's are
(a base model's tensors without the ``model.`` prefix and no LM head, its architecture
``Qwen3ForCausalLM``, sentence-transformers' ``modules.json`` asking for last-token pooling
and normalization, ``is_matryoshka``). Every vector equals transformers' ``Qwen3Model``
pooled the same way, in float32: at tp 1 (the checkpoint's pooling) and tp 2 (MEAN by
``--pooler-config``, sequence parallel, in one process); score and rerank are the cosines
of those vectors; bad requests get 400 in OpenAI's envelope, and the KV pool is free
afterwards."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from tests.model.test_tiny_models import TINY
from tests.server.serverproc import ServerProcess, stopped_on_exit

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings!",
         "tensor parallel inference " * 12]
MESSAGES = [{"role": "user", "content": "Find documents about foxes."}]


def _base_model():
    import transformers as tf

    torch.manual_seed(11)
    cfg = tf.Qwen3Config(**{**TINY, "vocab_size": 49152}, head_dim=32,
                         rope_theta=1000000.0, tie_word_embeddings=True)
    model = tf.Qwen3Model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer):
    """The folder, and transformers' base model of it."""
    model = _base_model()
    folder = tmp_path_factory.mktemp("tiny-qwen3-embedding")
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.config.is_matryoshka = True
    model.config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert not any(k.startswith(("model.", "lm_head")) for k in state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    smollm2_tokenizer.save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": True, "include_prompt": True}))
    return folder, model


@pytest.fixture(scope="module")
def servers(checkpoint):
    folder = str(checkpoint[0])
    common = ("--runner", "pooling", "--kv-cache-memory", "32MiB", "--max-model-len", "128",
              "--max-num-batched-tokens", "64", "--check-integrity")
    started = {
        "last": ServerProcess(folder, *common, "--served-model-name", "emb", wait=False),
        "mean": ServerProcess(folder, *common, "--tensor-parallel-size", "2",
                              "--tp-comm", "allgather",
                              "--pooler-config", '{"pooling_type": "mean"}',
                              "--no-engine-process", wait=False, log_level="info"),
    }
    with stopped_on_exit(started) as s:
        for server in s.values():
            server.wait_until_healthy()
        yield s


def reference(model, ids: list[int], kind: str, normalize: bool = True,
              dimensions: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    v = h[-1] if kind == "LAST" else h.mean(0)
    if dimensions is not None:
        v = v[:dimensions]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def close(got, want: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got, dtype=torch.float32), want, atol=1e-5, rtol=1e-4)


def test_openai_client_batches_equal_transformers(servers, checkpoint, smollm2_tokenizer):
    """The openai client asks for base64 and decodes it; several inputs, one answer."""
    model = checkpoint[1]
    out = servers["last"].client().embeddings.create(model="emb", input=TEXTS)
    assert out.model == "emb" and [d.index for d in out.data] == [0, 1, 2]
    lens = [len(ids_of(smollm2_tokenizer, t)) for t in TEXTS]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(lens)
    for d, text in zip(out.data, TEXTS, strict=True):
        assert len(d.embedding) == 64
        assert close(d.embedding, reference(model, ids_of(smollm2_tokenizer, text), "LAST"))


def test_float_encoding_token_ids_and_the_body(servers, checkpoint, smollm2_tokenizer):
    ids = ids_of(smollm2_tokenizer, TEXTS[0])
    r = httpx.post(f"{servers['last'].base}/v1/embeddings", timeout=60,
                   json={"input": [ids, ids[:5]], "encoding_format": "float"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("embd-")
    assert body["usage"] == {"prompt_tokens": len(ids) + 5, "completion_tokens": 0,
                             "total_tokens": len(ids) + 5, "prompt_tokens_details": None}
    assert [d["object"] for d in body["data"]] == ["embedding"] * 2
    assert close(body["data"][0]["embedding"], reference(checkpoint[1], ids, "LAST"))
    assert close(body["data"][1]["embedding"], reference(checkpoint[1], ids[:5], "LAST"))


def test_dimensions_normalize_and_truncation(servers, checkpoint, smollm2_tokenizer):
    model, client = checkpoint[1], servers["last"].client()
    ids = ids_of(smollm2_tokenizer, TEXTS[2])
    cut = client.embeddings.create(model="emb", input=TEXTS[2], dimensions=16)
    assert len(cut.data[0].embedding) == 16
    assert close(cut.data[0].embedding, reference(model, ids, "LAST", dimensions=16))
    for off in ({"normalize": False}, {"use_activation": False}):  # vLLM's newer name
        raw = client.embeddings.create(model="emb", input=TEXTS[2], extra_body=off)
        assert close(raw.data[0].embedding, reference(model, ids, "LAST", normalize=False))
    short = client.embeddings.create(model="emb", input=TEXTS[2],
                                     extra_body={"truncate_prompt_tokens": 7})
    assert short.usage.prompt_tokens == 7
    assert close(short.data[0].embedding, reference(model, ids[-7:], "LAST"))


def test_chat_messages_are_embedded_as_rendered(servers, checkpoint, smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                 add_generation_prompt=False)
    ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    r = httpx.post(f"{servers['last'].base}/v1/embeddings", timeout=60,
                   json={"messages": MESSAGES, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert close(r.json()["data"][0]["embedding"], reference(checkpoint[1], ids, "LAST"))


def test_sagemaker_invocations_embed_an_input_or_messages(servers, checkpoint,
                                                         smollm2_tokenizer):
    """On an embedding server ``/invocations`` answers ``input`` and ``messages`` as
    /v1/embeddings does."""
    base = servers["last"].base
    for body in ({"input": TEXTS[0], "encoding_format": "float"},
                 {"messages": MESSAGES, "encoding_format": "float"}):
        got = httpx.post(f"{base}/invocations", json=body, timeout=60)
        want = httpx.post(f"{base}/v1/embeddings", json=body, timeout=60)
        assert got.status_code == want.status_code == 200, got.text
        assert got.json()["data"] == want.json()["data"]
        assert got.json()["usage"] == want.json()["usage"]
    ids = ids_of(smollm2_tokenizer, TEXTS[0])
    first = httpx.post(f"{base}/invocations", json={"input": TEXTS[0],
                                                    "encoding_format": "float"}, timeout=60)
    assert close(first.json()["data"][0]["embedding"], reference(checkpoint[1], ids, "LAST"))


def test_tp2_mean_pooling_equals_transformers(servers, checkpoint, smollm2_tokenizer):
    assert ("serving /v1/embeddings, /score and /rerank (--runner pooling): "
            "64-dimensional embeddings, MEAN pooling, normalized (the checkpoint's "
            "sentence-transformers modules and --pooler-config)") in servers["mean"].output()
    out = servers["mean"].client().embeddings.create(model=servers["mean"].client()
                                                     .models.list().data[0].id, input=TEXTS)
    for d, text in zip(out.data, TEXTS, strict=True):
        assert close(d.embedding, reference(checkpoint[1], ids_of(smollm2_tokenizer, text),
                                            "MEAN"))


def test_score_is_the_cosine_of_the_embeddings(servers, checkpoint, smollm2_tokenizer):
    """vLLM's score API on an embedding model: one text_1 against every text_2, or two
    lists pairwise; each score the cosine similarity of transformers' embeddings."""
    model = checkpoint[1]

    def vec(text):
        return reference(model, ids_of(smollm2_tokenizer, text), "LAST")

    base = servers["last"].base
    r = httpx.post(f"{base}/score", json={"text_1": TEXTS[0], "text_2": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    for d, text in zip(body["data"], TEXTS, strict=True):
        assert abs(d["score"] - float(vec(TEXTS[0]) @ vec(text))) < 1e-5
    assert abs(body["data"][0]["score"] - 1.0) < 1e-5
    # each distinct text embedded once
    assert body["usage"]["prompt_tokens"] == sum(len(ids_of(smollm2_tokenizer, t))
                                                 for t in TEXTS)
    pairwise = httpx.post(f"{base}/v1/score", timeout=60,
                          json={"text_1": TEXTS[1:], "text_2": TEXTS[:2]}).json()["data"]
    for d, (a, b) in zip(pairwise, zip(TEXTS[1:], TEXTS[:2], strict=True), strict=True):
        assert abs(d["score"] - float(vec(a) @ vec(b))) < 1e-5
    bad = httpx.post(f"{base}/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"


def test_cache_salt_keeps_prefix_cache_hits_apart(servers):
    """vLLM's cache_salt on embeddings: a prompt's blocks are hit again under its own salt
    only (LAST pooling takes prefix-cache hits)."""
    server = servers["last"]
    body = {"input": list(range(2000, 2048)), "encoding_format": "float"}

    def hits_of(salt: str) -> float:
        before = server.metric("prefix_cache_hits_total")
        r = httpx.post(f"{server.base}/v1/embeddings", json={**body, "cache_salt": salt},
                       timeout=60)
        assert r.status_code == 200, r.text
        return server.metric("prefix_cache_hits_total") - before

    assert hits_of("tenant-a") == 0
    assert hits_of("tenant-b") == 0  # tenant-a's blocks are not tenant-b's
    assert hits_of("tenant-a") > 0


def test_score_forms_and_token_limits(servers, checkpoint, smollm2_tokenizer):
    """vLLM's other spellings of /score's sides give the same scores; rerank takes one
    document as a string and its usage has prompt_tokens; max_tokens_per_query /
    max_tokens_per_doc cut each text to its first N tokens before it is embedded."""
    model, base = checkpoint[1], servers["last"].base

    def vec(text):
        return reference(model, ids_of(smollm2_tokenizer, text), "LAST")

    want = httpx.post(f"{base}/score", json={"text_1": TEXTS[0], "text_2": TEXTS},
                      timeout=60).json()["data"]
    for body in ({"queries": TEXTS[0], "documents": TEXTS}, {"queries": TEXTS[0], "items": TEXTS},
                 {"data_1": TEXTS[0], "data_2": TEXTS}):
        r = httpx.post(f"{base}/v1/score", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(
            [d["score"] for d in want], abs=1e-6), body
    bad = httpx.post(f"{base}/score", json={"queries": TEXTS[0], "text_2": TEXTS}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2", bad.text

    def first(text, n):
        return smollm2_tokenizer.decode(smollm2_tokenizer(text, add_special_tokens=False)
                                        ["input_ids"][:n])

    query = "a quick brown fox"
    r = httpx.post(f"{base}/rerank", timeout=60, json={
        "query": query, "documents": TEXTS[2], "max_tokens_per_query": 2,
        "max_tokens_per_doc": 5})
    assert r.status_code == 200, r.text
    (result,) = r.json()["results"]
    assert result["document"] == {"text": TEXTS[2]}
    q, d = first(query, 2), first(TEXTS[2], 5)
    assert result["relevance_score"] == pytest.approx(float(vec(q) @ vec(d)), abs=1e-5)
    used = len(ids_of(smollm2_tokenizer, q)) + len(ids_of(smollm2_tokenizer, d))
    assert r.json()["usage"] == {"prompt_tokens": used, "total_tokens": used}
    r = httpx.post(f"{base}/score", timeout=60, json={"text_1": query, "text_2": TEXTS[2],
                                                      "max_tokens_per_doc": 128})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens_per_doc"


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_cosine(servers, checkpoint, smollm2_tokenizer, path):
    model = checkpoint[1]
    query = "a quick brown fox"

    def vec(text):
        return reference(model, ids_of(smollm2_tokenizer, text), "LAST")

    want = sorted(((float(vec(query) @ vec(d)), i) for i, d in enumerate(TEXTS)),
                  reverse=True)
    r = httpx.post(servers["last"].base + path, timeout=60,
                   json={"query": query, "documents": TEXTS, "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == [i for _, i in want[:2]]
    for x, (score, i) in zip(results, want, strict=False):
        assert abs(x["relevance_score"] - score) < 1e-5
        assert x["document"] == {"text": TEXTS[i]}
    used = sum(len(ids_of(smollm2_tokenizer, t)) for t in [query, *TEXTS])
    assert r.json()["usage"] == {"prompt_tokens": used, "total_tokens": used}
    none = httpx.post(servers["last"].base + path, json={"query": query, "documents": []},
                      timeout=60)
    assert none.status_code == 400 and none.json()["error"]["param"] == "documents"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["fine", ""]}, "input.1", "must not be empty"),
    ({"input": [[1, 2], [49152]]}, "input.1", "token id 49152 is out of range"),
    ({"input": "word " * 200}, "input", "maximum context length is 128"),
    ({"input": "x", "dimensions": 65}, "dimensions", "at most the model's 64"),
    ({"input": "x", "dimensions": 0}, "dimensions", "at least 1"),
    ({"input": "x", "messages": MESSAGES}, "messages", "exactly one of input and messages"),
    ({}, "input", "exactly one of input and messages"),
    ({"input": "x", "embed_dtype": "float16"}, "embed_dtype", "float32"),
    ({"input": "x", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs",
     "applies to messages, not to input"),
    ({"input": "x", "add_generation_prompt": True}, "add_generation_prompt",
     "applies to messages, not to input"),
    ({"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message", "cannot both be true"),
    ({"input": "x", "priority": 3}, "priority", "--scheduling-policy priority"),
    ({"input": "x", "cache_salt": ""}, "cache_salt", "must not be empty"),
    ({"input": "x", "normalize": True, "use_activation": False}, "use_activation",
     "normalize and use_activation disagree"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
])
def test_bad_requests_get_400(servers, body, param, words):
    r = httpx.post(f"{servers['last'].base}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_generation_is_refused_and_the_pool_ends_free(servers):
    client = servers["last"].client()
    with pytest.raises(openai.BadRequestError, match="answers /v1/embeddings only"):
        client.chat.completions.create(model="emb", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="answers /v1/embeddings only"):
        client.completions.create(model="emb", prompt="hi")
    for server in servers.values():
        server.wait_pool_free()
