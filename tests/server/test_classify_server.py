"""Sequence classifiers served end to end (``tpserve serve`` picks ``--runner pooling`` for a
``*ForSequenceClassification`` checkpoint by itself): a tiny one-label Qwen3 reranker at
tp 2 and a three-label Llama classifier at tp 1, written by transformers with SmolLM2's
tokenizer. ``/classify`` answers transformers' probabilities (sigmoid of one label, softmax
of three) and most probable label; ``/score`` and ``/rerank`` on the reranker are its
sigmoid over each pair tokenized as one input, as vLLM scores with a cross-encoder; what a
classifier cannot answer is a 400 in OpenAI's envelope, and the KV pool is free after."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.model.test_classifier import _hf_classifier
from tests.server.serverproc import ServerProcess, stopped_on_exit

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Rerankers!",
         "tensor parallel inference " * 6]
QUERY = "Which animal jumps?"
FLAGS = ("--kv-cache-memory", "32MiB", "--max-model-len", "128", "--check-integrity")


def _model(kind: str):
    hf = _hf_classifier(kind)
    if kind == "qwen3":  # SmolLM2's ids (49,152) over the tiny vocabulary
        import transformers as tf

        cfg = hf.config
        cfg.vocab_size = 49152
        torch.manual_seed(53)
        hf = tf.AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            hf.score.weight.mul_(20.0)
    return hf.eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_tokenizer):
    """kind -> (server, transformers' model); both start before either is waited for."""
    models = {"reranker": _model("qwen3"), "classifier": _model("llama")}
    models["classifier"].config.vocab_size = 256  # token-id inputs only (below 256)
    servers = {}
    for kind, hf in models.items():
        folder = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(folder)
        smollm2_tokenizer.save_pretrained(folder)
        flags = ("--tensor-parallel-size", "2") if kind == "reranker" else ()
        servers[kind] = ServerProcess(str(folder), *FLAGS, *flags, "--served-model-name",
                                      kind, wait=False, log_level="info")
    with stopped_on_exit(servers) as started:
        yield {kind: (started[kind].wait_until_healthy(), models[kind]) for kind in models}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json=body, timeout=120)


def _probs(hf, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return (torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)).tolist()


def test_classify_answers_transformers_probabilities(served, smollm2_tokenizer):
    server, hf = served["classifier"]
    inputs = [[5, 9, 13, 200], [3, 17, 200, 45, 9, 88, 131, 7]]
    r = _post(server, "/classify", {"model": "classifier", "input": inputs})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "classifier"
    assert body["usage"]["prompt_tokens"] == 12
    for k, (ids, item) in enumerate(zip(inputs, body["data"], strict=True)):
        want = _probs(hf, ids)
        assert item["index"] == k and item["num_classes"] == 3
        assert item["probs"] == pytest.approx(want, abs=1e-5)
        assert item["label"] == ("bad", "good", "neutral")[max(range(3), key=want.__getitem__)]
    assert ("serving /classify, /score and /rerank (--runner pooling): a classifier of 3 "
            "label(s) (bad, good, neutral; softmax)") in server.output()
    r = _post(server, "/classify", {"input": inputs[1], "use_activation": False})
    assert r.status_code == 200, r.text
    with torch.no_grad():
        logits = hf(torch.tensor([inputs[1]])).logits[0].tolist()
    assert r.json()["data"][0]["probs"] == pytest.approx(logits, abs=1e-4)


def test_reranker_scores_pairs_as_one_input(served, smollm2_tokenizer):
    server, hf = served["reranker"]
    pair_ids = [smollm2_tokenizer(text=QUERY, text_pair=t)["input_ids"] for t in TEXTS]
    want = [_probs(hf, ids)[0] for ids in pair_ids]
    r = _post(server, "/v1/score", {"text_1": QUERY, "text_2": TEXTS})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, pair_ids))
    r = _post(server, "/rerank", {"query": QUERY, "documents": TEXTS, "top_n": 2})
    assert r.status_code == 200, r.text
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    results = r.json()["results"]
    assert [x["index"] for x in results] == order
    assert [x["relevance_score"] for x in results] == pytest.approx([want[i] for i in order],
                                                                     abs=1e-5)
    r = _post(server, "/score", {"queries": QUERY, "documents": TEXTS[:2],
                                 "use_activation": False})  # the logits
    assert r.status_code == 200, r.text
    with torch.no_grad():
        logits = [hf(torch.tensor([ids])).logits[0, 0].item() for ids in pair_ids[:2]]
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(logits, abs=1e-4)
    # a document cut to its first 3 tokens before the pair is tokenized
    doc = smollm2_tokenizer.decode(smollm2_tokenizer(TEXTS[2], add_special_tokens=False)
                                   ["input_ids"][:3])
    r = _post(server, "/rerank", {"query": QUERY, "documents": TEXTS[2],
                                  "max_tokens_per_doc": 3})
    assert r.status_code == 200, r.text
    cut = smollm2_tokenizer(text=QUERY, text_pair=doc)["input_ids"]
    assert r.json()["results"][0]["relevance_score"] == pytest.approx(_probs(hf, cut)[0],
                                                                      abs=1e-5)
    assert r.json()["usage"] == {"prompt_tokens": len(cut), "total_tokens": len(cut)}
    r = _post(server, "/classify", {"input": TEXTS[0]})
    ids = smollm2_tokenizer(TEXTS[0])["input_ids"]
    assert r.json()["data"][0]["probs"] == pytest.approx(_probs(hf, ids), abs=1e-5)
    assert r.json()["data"][0]["label"] == "relevance"


def test_what_a_classifier_cannot_answer_is_a_400(served):
    reranker, _ = served["reranker"]
    classifier, _ = served["classifier"]
    for server, path, body, param in (
            (reranker, "/v1/embeddings", {"input": "x"}, "model"),
            (reranker, "/v1/completions", {"prompt": "x", "max_tokens": 2}, "model"),
            (classifier, "/score", {"text_1": "a", "text_2": "b"}, "model"),
            (reranker, "/classify", {}, "input"),
            (reranker, "/classify", {"input": "x", "chat_template": "y"}, "chat_template"),
            (reranker, "/score", {"text_1": "", "text_2": "b"}, "text_1"),
            (reranker, "/score", {"text_1": "a", "text_2": "b", "cache_salt": ""}, "cache_salt"),
            (reranker, "/rerank", {"query": "a", "documents": "b", "max_tokens_per_query": -1},
             "max_tokens_per_query"),
            (classifier, "/classify", {"input": "x", "use_activation": False,
                                       "activation": True}, "activation")):
        r = _post(server, path, body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param, (path, r.json())
    for server in (reranker, classifier):
        server.wait_pool_free()
