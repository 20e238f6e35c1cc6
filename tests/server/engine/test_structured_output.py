"""Structured output in ``EngineCore`` on CPU with a tiny random Llama (vocabulary: the
first 256 SmolLM2 tokens, which hold the single characters): the matcher and bitmask
bookkeeping under batching, asynchronous scheduling, preemption and n > 1. A random model
makes the grammar do all the work."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from tests.model.test_tiny_models import _hf_model
from tests.model.util import save_hf_folder
from tests.server.engine.test_engine_core import make_core
from tpserve.model.sampling_params import SamplingParams, StructuredOutput
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.structured.spec import GrammarError, choice_grammar

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 2},
                         "pet": {"type": "object",
                                 "properties": {"legs": {"type": "integer", "minimum": 0, "maximum": 8}},
                                 "required": ["legs"]}},
          "required": ["name", "age", "color", "tags", "pet"]}
JSON = StructuredOutput("json", json.dumps(SCHEMA))
PHONE = StructuredOutput("regex", r"\d{3}-\d{4}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_hf_folder(_hf_model("llama"), tmp_path_factory.mktemp("structured")))


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(17, 256) for _ in range(rng.randrange(5, 20))]


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        core.add(RequestState(rid, prompt, params, outs[rid].append))
    steps = 0
    while core.has_unfinished:
        core.step()
        steps += 1
        assert steps < 2000
    return outs


def tokens(outs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for o in outs for d in o.deltas if d.index == index for t in d.token_ids]


def text(outs: list[RequestOutput], index: int = 0) -> str:
    return "".join(d.text for o in outs for d in o.deltas if d.index == index)


def finish(outs: list[RequestOutput], index: int = 0) -> str | None:
    return [d.finish_reason for o in outs for d in o.deltas if d.index == index][-1]


def test_batched_async_preempted_equals_alone(folder, smollm2_tokenizer):
    """Greedy constrained and free requests batched together, with asynchronous scheduling
    and preemption, give exactly the tokens each gives alone with synchronous steps."""
    greedy = dict(temperature=0, max_tokens=100)
    requests = {
        "json-a": (prompt(1), SamplingParams(structured=JSON, **greedy)),
        "free": (prompt(2), SamplingParams(ignore_eos=True, **greedy)),
        "phone": (prompt(3), SamplingParams(structured=PHONE, **greedy)),
        "json-b": (prompt(4), SamplingParams(structured=JSON, **greedy)),
        "free-2": (prompt(5), SamplingParams(ignore_eos=True, **greedy)),
    }
    alone = {}
    for rid, req in requests.items():
        core = make_core(folder, smollm2_tokenizer, num_blocks=40, async_scheduling=False)
        alone[rid] = run(core, {rid: req})[rid]
    # 16 blocks of 16 tokens cannot hold five sequences of up to 120 tokens at once
    core = make_core(folder, smollm2_tokenizer, num_blocks=16, budget=32)
    together = run(core, requests)
    assert core.counters["num_preemptions_total"] > 0
    for rid in requests:
        assert tokens(together[rid]) == tokens(alone[rid]), rid
    for rid in ("json-a", "json-b"):
        jsonschema.validate(json.loads(text(together[rid])), SCHEMA)
        assert finish(together[rid]) == "stop"
    assert re.fullmatch(r"\d{3}-\d{4}", text(together["phone"]))
    assert finish(together["phone"]) == "stop"
    assert len(tokens(together["free"])) == 100
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_siblings_have_their_own_matchers(folder, smollm2_tokenizer):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=100, structured=JSON)
    outs = run(make_core(folder, smollm2_tokenizer, num_blocks=40), {"r": (prompt(6), params)})
    texts = [text(outs["r"], i) for i in range(4)]
    for i, t in enumerate(texts):
        assert finish(outs["r"], i) == "stop", t
        jsonschema.validate(json.loads(t), SCHEMA)
    assert len(set(texts)) > 1  # the siblings sampled differently
    assert outs["r"][-1].finished


def test_matcher_termination_ends_the_request(folder, smollm2_tokenizer):
    spec = StructuredOutput("grammar", choice_grammar(["yes", "no", "maybe so"]))
    # ignore_eos does not keep a finished grammar going: the matcher terminated
    params = SamplingParams(temperature=0, max_tokens=30, structured=spec, ignore_eos=True)
    outs = run(make_core(folder, smollm2_tokenizer, num_blocks=40), {"r": (prompt(7), params)})
    assert text(outs["r"]) in ("yes", "no", "maybe so")
    assert finish(outs["r"]) == "stop"
    # the stop token (EOS) is the last token, and it was allowed only at the end
    assert tokens(outs["r"])[-1] == smollm2_tokenizer.eos_token_id


def test_compiled_grammars_are_cached_and_errors_are_grammar_errors(folder, smollm2_tokenizer):
    core: EngineCore = make_core(folder, smollm2_tokenizer, num_blocks=16)
    assert core.grammars.compile(JSON) is core.grammars.compile(
        StructuredOutput("json", json.dumps(SCHEMA)))
    with pytest.raises(GrammarError, match="parenthesis"):
        core.grammars.compile(StructuredOutput("regex", "(ab"))
