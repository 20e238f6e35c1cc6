"""SageMaker's ``/invocations``: which route answers a body, and that ``--api-key`` guards
it (the routes themselves are exercised against real servers in
``tests/server/test_first_contact.py`` and ``tests/server/test_embeddings_server.py``)."""

from __future__ import annotations

import pytest

from tpserve.model.pooling import PoolerConfig
from tpserve.server.http.app import needs_api_key
from tpserve.server.http.invocations import invocation_path

EMBEDDER = PoolerConfig()
CLASSIFIER = PoolerConfig(labels=("no", "yes"))


@pytest.mark.parametrize(("body", "generative", "embedder", "classifier"), [
    ({"messages": []}, "/v1/chat/completions", "/v1/embeddings", "/classify"),
    ({"prompt": "x"}, "/v1/completions", "/v1/completions", "/v1/completions"),
    ({"input": "x"}, "/v1/responses", "/v1/embeddings", "/classify"),
    ({"query": "q", "documents": []}, "/rerank", "/rerank", "/rerank"),
    ({"text_1": "a", "text_2": "b"}, "/score", "/score", "/score"),
    ({"data_1": "a", "data_2": "b"}, "/score", "/score", "/score"),  # vLLM's other forms
    ({"queries": "a", "documents": ["b"]}, "/score", "/score", "/score"),
    ({"queries": "a", "items": ["b"]}, "/score", "/score", "/score"),
    # the first rule that matches wins: a rerank body with a prompt is a rerank
    ({"query": "q", "documents": [], "prompt": "x"}, "/rerank", "/rerank", "/rerank"),
    ({"messages": [], "prompt": "x"}, "/v1/chat/completions", "/v1/embeddings", "/classify"),
    ({"query": "q"}, None, None, None),
    ({}, None, None, None),
    (["messages"], None, None, None),
    ("prompt", None, None, None),
])
def test_the_route_a_body_names(body, generative, embedder, classifier):
    assert invocation_path(body, None) == generative
    assert invocation_path(body, EMBEDDER) == embedder
    assert invocation_path(body, CLASSIFIER) == classifier


def test_the_api_key_guards_invocations_and_not_ping():
    assert needs_api_key("/invocations") and needs_api_key("/classify")
    assert not needs_api_key("/ping") and not needs_api_key("/health")
