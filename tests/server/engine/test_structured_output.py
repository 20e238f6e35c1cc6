"""Structured output in ``EngineCore`` on CPU with a tiny random Llama (vocabulary: the
first 256 SmolLM2 tokens, which hold the single characters): the matcher and bitmask
bookkeeping under batching, asynchronous scheduling, preemption and n > 1, and grammars
compiled off the engine thread (held at a gate through the compiler's ``compile_hook``,
which then runs the real compile): free requests run meanwhile, aborts, failures, cache
hits. A random model makes the grammar do all the work."""

from __future__ import annotations

import json
import queue
import random
import re
import threading
import time

import jsonschema
import pytest
import xgrammar as xgr

from tests.server.engine.test_engine_core import make_core, run_to_end
from tpserve.model.sampling_params import SamplingParams, StructuredOutput
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.errors import EngineError
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.step_loop import StepLoop
from tpserve.server.engine.structured.lark import converted, lark_to_ebnf, looks_like_lark
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
def folder(tiny_llama):
    return tiny_llama


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


class Gate:
    """A ``compile_hook`` that holds every compile until ``open`` (at most ``HOLD_S``: a
    test that fails early never leaves the worker stuck), then runs the real compile;
    ``specs`` lists what it was asked to compile, in order."""

    HOLD_S = 120.0

    def __init__(self, is_open: bool = False):
        self.specs: list[StructuredOutput] = []
        self.entered = threading.Event()
        self._open = threading.Event()
        if is_open:
            self._open.set()

    def open(self) -> None:
        self._open.set()

    def __call__(self, compile_now, spec: StructuredOutput):
        self.specs.append(spec)
        self.entered.set()
        if not self._open.wait(timeout=self.HOLD_S):
            raise TimeoutError("the test never opened the gate")
        return compile_now(spec)


def add(core: EngineCore, rid: str, prompt_ids: list[int], params: SamplingParams
        ) -> tuple[RequestState, list]:
    outs: list = []
    state = RequestState(rid, prompt_ids, params, outs.append)
    core.add(state)
    return state, outs


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.open()


def test_free_requests_run_while_a_grammar_compiles(folder, smollm2_tokenizer, gate):
    """While a constrained request's compile is held, a free request arriving after it is
    stepped to completion; the constrained one waits outside the scheduler (counted as
    waiting) and, once the gate opens, finishes with valid output, its queue time
    covering the compile."""
    core = make_core(folder, smollm2_tokenizer, num_blocks=40, compile_hook=gate)
    json_state, json_outs = add(core, "json", prompt(1), SamplingParams(
        structured=JSON, temperature=0, max_tokens=100))
    _, free_outs = add(core, "free", prompt(2), SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True))
    assert gate.entered.wait(timeout=60)
    assert core.stats()["num_requests_waiting"] == 2  # "free" in the scheduler, "json" not
    steps = 0
    while "free" in core.requests:
        # every step runs "free", but the one that only reads back its last token
        assert core.step() or "free" not in core.requests
        steps += 1
        assert steps < 200
    assert free_outs[-1].finished and len(tokens(free_outs)) == 20
    assert json_outs == [] and not json_state.seqs
    assert core.has_unfinished and core.scheduler.num_waiting == 0
    assert core.stats()["num_requests_waiting"] == 1
    # nothing to run: once "free"'s last in-flight step is read back, a step waits
    # (boundedly) for the compile instead, and says it sent nothing to the ranks
    for _ in range(2):
        assert not core.step()
    assert core.counters["grammar_wait_seconds_total"] > 0
    released = time.monotonic()
    gate.open()
    run_to_end(core)
    jsonschema.validate(json.loads(text(json_outs)), SCHEMA)
    assert finish(json_outs) == "stop" and json_outs[-1].finished
    assert json_state.arrival < released <= json_state.seqs[0].first_scheduled_time
    assert core.histograms["request_queue_time_seconds"].export()
    assert core.stats()["num_requests_waiting"] == 0 and core.grammars.num_inflight == 0
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    core.close()


def test_abort_while_waiting_for_the_grammar(folder, smollm2_tokenizer, gate):
    """Aborting requests that wait for their grammar ends them at once with an ``abort``
    delta per sibling; a queued compile no one waits for any more is dropped, a running
    one finishes (and serves a later request of the same schema); neither aborted
    request ever reaches the scheduler."""
    core = make_core(folder, smollm2_tokenizer, num_blocks=40, compile_hook=gate)
    _, json_outs = add(core, "json", prompt(1), SamplingParams(
        structured=JSON, temperature=0, max_tokens=100, n=2))
    _, phone_outs = add(core, "phone", prompt(3), SamplingParams(
        structured=PHONE, temperature=0, max_tokens=30))
    assert gate.entered.wait(timeout=60)  # the JSON compile runs; the regex one is queued
    assert not core.step()
    assert core.stats()["num_requests_waiting"] == 3
    core.abort("phone")
    assert core.grammars.num_inflight == 1  # the queued regex compile was cancelled
    core.abort("json")
    for outs, n in ((json_outs, 2), (phone_outs, 1)):
        assert len(outs) == 1 and outs[0].finished
        assert [(d.index, d.finish_reason, d.token_ids) for d in outs[0].deltas] == [
            (i, "abort", ()) for i in range(n)]
    assert not core.has_unfinished and core.stats()["num_requests_waiting"] == 0
    # a later request with the same schema shares the JSON compile still running
    again_state, again_outs = add(core, "again", prompt(4), SamplingParams(
        structured=JSON, temperature=0, max_tokens=100))
    gate.open()
    run_to_end(core)
    jsonschema.validate(json.loads(text(again_outs)), SCHEMA)
    assert gate.specs == [JSON]  # compiled once; the regex never was
    assert len(json_outs) == 1 and len(phone_outs) == 1  # never admitted after the abort
    assert core.counters["prompt_tokens_total"] == len(again_state.prompt_token_ids)
    assert core.grammars.num_inflight == 0 and not core.requests
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    core.close()


def test_a_failed_compile_ends_only_its_request(folder, smollm2_tokenizer):
    """A regex xgrammar refuses (the HTTP layer would have answered 400; the engine sees it
    here directly) ends its request with the ``EngineError`` a request that cannot start
    gets; the requests around it run as if it had never come."""
    greedy = dict(temperature=0, max_tokens=30)
    alone = make_core(folder, smollm2_tokenizer, num_blocks=40)
    _, phone_alone = add(alone, "phone", prompt(3), SamplingParams(structured=PHONE, **greedy))
    _, free_alone = add(alone, "free", prompt(2), SamplingParams(ignore_eos=True, **greedy))
    run_to_end(alone)
    core = make_core(folder, smollm2_tokenizer, num_blocks=40)
    _, phone_outs = add(core, "phone", prompt(3), SamplingParams(structured=PHONE, **greedy))
    _, bad_outs = add(core, "bad", prompt(5), SamplingParams(
        structured=StructuredOutput("regex", "(ab"), **greedy))
    _, free_outs = add(core, "free", prompt(2), SamplingParams(ignore_eos=True, **greedy))
    run_to_end(core)
    assert len(bad_outs) == 1 and isinstance(bad_outs[0], EngineError)
    assert "could not start the request" in str(bad_outs[0])
    assert "GrammarError" in str(bad_outs[0]) and "parenthesis" in str(bad_outs[0])
    assert tokens(phone_outs) == tokens(phone_alone)
    assert re.fullmatch(r"\d{3}-\d{4}", text(phone_outs))
    assert tokens(free_outs) == tokens(free_alone)
    assert core.grammars.num_inflight == 0 and not core.requests
    # a failure is not cached: the same regex is compiled (and refused) again
    _, again = add(core, "bad-again", prompt(5), SamplingParams(
        structured=StructuredOutput("regex", "(ab"), **greedy))
    run_to_end(core)
    assert len(again) == 1 and isinstance(again[0], EngineError)
    alone.close()
    core.close()


def test_cached_grammar_is_admitted_at_once(folder, smollm2_tokenizer):
    """A grammar in the cache puts its request into the scheduler in ``add`` itself (no
    compile, no wait); requests of one new schema share a single compile."""
    gate = Gate(is_open=True)
    core = make_core(folder, smollm2_tokenizer, num_blocks=40, compile_hook=gate)
    params = SamplingParams(structured=JSON, temperature=1.0, seed=3, max_tokens=100)
    first, _ = add(core, "a", prompt(1), params)
    second, _ = add(core, "b", prompt(2), params)  # same schema, while "a"'s compiles
    assert core.scheduler.num_waiting == 0 and core.awaiting.num_sequences == 2
    run_to_end(core)
    assert gate.specs == [JSON]
    cached, cached_outs = add(core, "c", prompt(3), params)
    assert gate.specs == [JSON]  # not compiled again
    assert core.awaiting.num_sequences == 0
    assert [s.seq_id for s in core.scheduler.waiting] == [s.seq_id for s in cached.seqs]
    assert core.step()  # the very next step runs it
    assert cached.seqs[0].num_computed_tokens > 0
    run_to_end(core)
    jsonschema.validate(json.loads(text(cached_outs)), SCHEMA)
    assert first.seqs and second.seqs
    core.close()


class QueueOutbox:
    """The step loop's outputs as ``(request id, item)`` in one queue."""

    def __init__(self):
        self.items: queue.Queue = queue.Queue()

    def send_now(self, target, item) -> None:
        self.items.put((target, item))

    def send_step(self, batch, idle: bool) -> None:
        for target, item in batch:
            self.items.put((target, item))

    def until_finished(self, rid: str, timeout: float = 120.0) -> list:
        """Outputs (of any request) up to ``rid``'s last one; each get has a timeout."""
        seen = []
        while True:
            target, item = self.items.get(timeout=timeout)
            seen.append((target, item))
            if target == rid and (isinstance(item, BaseException) or item.finished):
                return seen


def test_step_loop_serves_and_aborts_while_a_grammar_compiles(folder, smollm2_tokenizer,
                                                              gate):
    """The engine thread: a free request submitted after a held constrained one finishes;
    an abort through the inbox ends the waiting one; a later request of the same schema
    finishes once the gate opens; stopping the loop closes the compiler."""
    core = make_core(folder, smollm2_tokenizer, num_blocks=40, compile_hook=gate)
    outbox = QueueOutbox()
    loop = StepLoop(core, outbox)
    loop.start()
    try:
        def submit(rid: str, params: SamplingParams, seed: int) -> None:
            loop.submit([RequestState(rid, prompt(seed), params, loop.emitter(rid))])

        submit("json", SamplingParams(structured=JSON, temperature=0, max_tokens=100), 1)
        assert gate.entered.wait(timeout=60)
        submit("free", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), 2)
        seen = outbox.until_finished("free")
        assert {rid for rid, _ in seen} == {"free"}
        loop.abort("json")
        (rid, out), = outbox.until_finished("json")
        assert [d.finish_reason for d in out.deltas] == ["abort"]
        submit("again", SamplingParams(structured=JSON, temperature=0, max_tokens=100), 3)
        gate.open()
        seen = outbox.until_finished("again")
        assert {rid for rid, _ in seen} == {"again"}
        jsonschema.validate(json.loads(text([o for _, o in seen])), SCHEMA)
    finally:
        loop.request_stop()
        loop.join(timeout=60)
    assert not loop.is_alive() and loop.dead_reason is None
    with pytest.raises(RuntimeError, match="closed"):
        core.grammars.request(PHONE)


def test_a_gated_grammar_starts_after_its_token(folder, smollm2_tokenizer):
    """``structured_after`` (a reasoning model's end of thinking): the tokens up to and
    including the first gate token are exactly the free request's, the rest follow the
    schema; batched with asynchronous steps and preemption, the same as alone."""
    greedy = dict(temperature=0, max_tokens=100)
    free = run(make_core(folder, smollm2_tokenizer, num_blocks=40, async_scheduling=False),
               {"free": (prompt(8), SamplingParams(ignore_eos=True, **greedy))})["free"]
    free_tokens = tokens(free)
    gate = free_tokens[5]
    cut = free_tokens.index(gate) + 1  # the first time the gate token is sampled
    gated = SamplingParams(structured=JSON, structured_after=gate, **greedy)
    alone = run(make_core(folder, smollm2_tokenizer, num_blocks=40, async_scheduling=False),
                {"gated": (prompt(8), gated)})["gated"]
    got = tokens(alone)
    assert got[:cut] == free_tokens[:cut]
    jsonschema.validate(json.loads(smollm2_tokenizer.decode(got[cut:-1])), SCHEMA)
    assert finish(alone) == "stop" and got[-1] == smollm2_tokenizer.eos_token_id
    # the free tokens do not parse: the grammar did not apply to them
    with pytest.raises(ValueError):
        json.loads(smollm2_tokenizer.decode(got[:-1]))

    core = make_core(folder, smollm2_tokenizer, num_blocks=16, budget=32)
    # the schema compiled first, so that all four requests start together and preempt one
    # another whatever the machine's load (a compile still running when the free requests
    # start could let them finish first: no preemption)
    core.grammars.compile(JSON)
    together = run(core, {"gated": (prompt(8), gated),
                          "json": (prompt(1), SamplingParams(structured=JSON, **greedy)),
                          "free": (prompt(2), SamplingParams(ignore_eos=True, **greedy)),
                          "free-2": (prompt(5), SamplingParams(ignore_eos=True, **greedy))})
    assert core.counters["num_preemptions_total"] > 0
    assert tokens(together["gated"]) == got
    jsonschema.validate(json.loads(text(together["json"])), SCHEMA)


def test_the_first_token_decides_whether_the_grammar_waits(folder, smollm2_tokenizer):
    """``structured_after_if_first`` (a qwen3-style model: its output reasons only when it
    begins with the start tag): a first token other than that one is the grammar's, and
    the grammar applies from it, exactly as without a gate; that one first makes the
    grammar wait for ``structured_after``. Both together, with asynchronous steps."""
    greedy = dict(temperature=0, max_tokens=100)
    free = run(make_core(folder, smollm2_tokenizer, num_blocks=40, async_scheduling=False),
               {"free": (prompt(8), SamplingParams(ignore_eos=True, **greedy))})["free"]
    free_tokens = tokens(free)
    start, gate = free_tokens[0], free_tokens[5]  # the free greedy choice begins with start
    cut = free_tokens.index(gate) + 1
    away = ((start, -100.0),)  # the start tag never chosen: the grammar from the first token
    requests = {
        "json": (prompt(8), SamplingParams(structured=JSON, logit_bias=away, **greedy)),
        "answers": (prompt(8), SamplingParams(structured=JSON, logit_bias=away,
                                              structured_after=gate,
                                              structured_after_if_first=start, **greedy)),
        "reasons": (prompt(8), SamplingParams(structured=JSON, structured_after=gate,
                                              structured_after_if_first=start, **greedy))}
    outs = run(make_core(folder, smollm2_tokenizer, num_blocks=40), requests)
    assert tokens(outs["answers"]) == tokens(outs["json"])
    jsonschema.validate(json.loads(text(outs["answers"])), SCHEMA)
    reasons = tokens(outs["reasons"])  # start is the greedy choice among what the mask allows
    assert reasons[:cut] == free_tokens[:cut]
    jsonschema.validate(json.loads(smollm2_tokenizer.decode(reasons[cut:-1])), SCHEMA)
    assert finish(outs["reasons"]) == "stop"


def test_structured_after_needs_a_grammar():
    with pytest.raises(ValueError, match="structured_after"):
        SamplingParams(structured_after=5)
    with pytest.raises(ValueError, match="structured_after_if_first"):
        SamplingParams(structured=JSON, structured_after_if_first=5)


def grammar_accepts(ebnf: str, text: str) -> bool:
    """Whether the EBNF grammar ``ebnf`` accepts ``text`` whole."""
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(ebnf)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_choice_grammar_writes_characters_as_they_are():
    """A choice's characters go into the grammar as they are (quotes, backslashes and
    control characters escaped), so one beyond U+FFFF is one character, not two lone
    surrogates no output can hold; its language is exactly the choices. vLLM's choice
    grammar writes the characters as they are too. A lone surrogate is refused."""
    choices = ["👍", 'a"b\\c\n', "é"]
    grammar = choice_grammar(choices)
    assert grammar == 'root ::= "👍" | "a\\"b\\\\c\\n" | "é"'
    assert all(grammar_accepts(grammar, c) for c in choices)
    assert not any(grammar_accepts(grammar, c) for c in ("👎", "a\"b\\c", ""))
    with pytest.raises(GrammarError, match="choice 1 holds a lone surrogate"):
        choice_grammar(["ok", "a\ud83d"])


def test_a_choice_beyond_the_bmp_is_output_whole(folder, smollm2_tokenizer):
    """A random model under the choice grammar of emoji outputs one of the choices, its
    bytes whole (vLLM: the answer is one of the choices)."""
    choices = ["👍", "no 👎"]
    spec = StructuredOutput("grammar", choice_grammar(choices))
    core = make_core(folder, smollm2_tokenizer, num_blocks=40)
    params = {f"r{i}": (prompt(30 + i), SamplingParams(temperature=1.0, seed=i, max_tokens=30,
                                                      structured=spec)) for i in range(4)}
    outs = run(core, params)
    for rid in params:
        assert text(outs[rid]) in choices, text(outs[rid])
        assert finish(outs[rid]) == "stop"


@pytest.mark.parametrize("lark, accepted, refused", [
    # xgrammar's Lark reader (vLLM's current backend compiles Lark with it)
    ('start: "yes" | "no"', ["yes", "no"], ["maybe", ""]),
    ('start: /[0-9]+/ "!"\n%ignore " "', ["12!"], ["a!", "!"]),
    # the conversion: single quotes, no start rule (the first is the entry), priorities,
    # modifiers, aliases, continuation lines, comments, [optional], ~ repeats, ranges
    ("rule: 'hello'", ["hello"], ["hell", "Hello"]),
    ("""// numbers
?start: num
    | "-" num -> negative   # a minus
num.2: DIGIT ~ 1..3 [ "." DIGIT+ ]
DIGIT: '0'..'9'
""", ["1", "-12.5", "123"], ["1234", "1.", "--1", "a"]),
    ("start: root '!'\nroot: 'a' | 'b' root", ["a!", "bba!"], ["a", "!"]),
    ("start: 'q\\'' \"\\x41\\u00e9\\U0001F600\" '\\d'", ["q'Aé😀\\d"], ["q'Aé😀d"]),
    ("start: ('['..']' | '\\t'..'-')+", ["[\\]", "\t- ,"], ["a", "^", "."]),
])
def test_lark_grammars_are_read_as_vllm_reads_them(lark, accepted, refused):
    """A grammar without ``::=`` is Lark (vLLM's test): xgrammar's Lark reader's grammar
    (what vLLM's xgrammar backend compiles now), else the own conversion of the forms
    vLLM's earlier releases converted to EBNF; either way EBNF whose language is the
    Lark grammar's."""
    assert looks_like_lark(lark) and not looks_like_lark('root ::= "a"')
    ebnf = lark_to_ebnf(lark)
    assert all(grammar_accepts(ebnf, s) for s in accepted), ebnf
    assert not any(grammar_accepts(ebnf, s) for s in refused), ebnf


def test_the_lark_conversion_writes_ebnf():
    """The own conversion, rule by rule: ``:`` to ``::=``, the entry rule to ``root``
    (a rule named root renamed), ``[x]`` to ``(x)?``, ``~`` to braces, ranges to classes,
    single quotes to JSON strings, aliases, modifiers and priorities dropped."""
    lark = ("?start: a | 'b'\n  | [a] ~ 2 -> two\nroot.2: '\"'..'z' \"x\" ~ 1..3\n"
            "!a: root+ | ")
    assert converted(lark) == ('root ::= a | "b" | (a)?{2}\n'
                               'root_ ::= ["-z] "x"{1,3}\n'
                               'a ::= root_+ | ""\n')


@pytest.mark.parametrize("lark, message", [
    ("start: 'a' /b+/", r"line 1: regular expressions \(/b\+/\) cannot be converted"),
    ("start: 'a'\n%import common.WORD", "line 2: %import cannot be converted"),
    ("start: 'a' b", "line 1: the rule b is not defined"),
    ("start: ('a'\n", r"line 1: expected \), found the end of the rule"),
    ("start: 'a'\n'b'", r"line 2: expected a rule \(name: ...\)"),
    ("| 'a'", "line 1: '|' continues no rule"),
    ("start: 'a'i", r"line 1: string flags \(i\) cannot be converted"),
    ("start: x{'a'}", r"templates \(name\{...\}\) cannot be converted"),
    ("start: 'ab'..'z'", "line 1: a range needs two single characters"),
    ("start: 'a'\nstart: 'b'", "line 2: the rule start is defined twice"),
])
def test_lark_neither_reader_takes_is_a_grammar_error(lark, message):
    """A Lark grammar neither xgrammar's reader nor the conversion takes is a
    GrammarError (a 400 naming the field) with the conversion's reason and line, then
    the reader's (vLLM answers 400 "Invalid grammar specification")."""
    with pytest.raises(GrammarError, match=message) as caught:
        lark_to_ebnf(lark)
    assert "(xgrammar's Lark reader: Lark error at line" in str(caught.value)


def test_a_lark_grammar_constrains_the_engine(folder, smollm2_tokenizer):
    """The EBNF of a Lark grammar (converted: single quotes, no start rule) constrains a
    random model to the grammar's language."""
    spec = StructuredOutput("grammar", lark_to_ebnf("answer: 'yes' | 'no' | 'n' DIGIT\n"
                                                    "DIGIT: '0'..'9'"))
    core = make_core(folder, smollm2_tokenizer, num_blocks=40)
    params = {f"r{i}": (prompt(40 + i), SamplingParams(temperature=1.0, seed=i, max_tokens=20,
                                                      structured=spec)) for i in range(4)}
    outs = run(core, params)
    for rid in params:
        assert re.fullmatch(r"yes|no|n[0-9]", text(outs[rid])), text(outs[rid])
        assert finish(outs[rid]) == "stop"
