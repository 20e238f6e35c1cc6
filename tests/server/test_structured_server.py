"""Structured output through a real ``tpserve serve`` of SmolLM2 and the openai client:
JSON schemas (whole and streamed, n > 1), regex, choice, JSON objects, free requests in the
same batch, and compile errors as 400s naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.server.serverproc import SMALL, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 40},
                    "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 40},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "color", "hobbies", "address"],
}
PERSON = [{"role": "user", "content": "Describe a fictional person as JSON with name, age, "
                                      "favourite color, hobbies and address."}]
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*SMALL, "--max-num-seqs", "32")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=600)


def person(client, seed: int, stream: bool = False) -> tuple[str, str]:
    kwargs = dict(model=MODEL, messages=PERSON, temperature=0.7, seed=seed, max_tokens=250,
                  response_format=RESPONSE_FORMAT)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


SEEDS = 8  # whole and streamed: 16 requests, one batch under --max-num-seqs 32


@pytest.fixture(scope="module")
def many_seeds(client) -> dict[bool, list[tuple[str, str]]]:
    """``person`` for seeds 0-7, whole (False) and streamed (True): the 16 requests are
    sent together, so the engine runs them in one batch (--max-num-seqs 32) instead of two
    batches one after the other with a tail of long answers each."""
    with ThreadPoolExecutor(2 * SEEDS) as pool:
        futures = {stream: [pool.submit(person, client, s, stream) for s in range(SEEDS)]
                   for stream in (False, True)}
        return {stream: [f.result(timeout=600) for f in fs] for stream, fs in futures.items()}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_many_seeds(many_seeds, stream):
    results = many_seeds[stream]
    assert [finish for _, finish in results] == ["stop"] * SEEDS, results
    for text, _ in results:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in results}) > 1


def test_json_schema_n2_and_completions(client):
    with ThreadPoolExecutor(2) as pool:  # both requests in flight together
        chat = pool.submit(client.chat.completions.create, model=MODEL, messages=PERSON,
                           temperature=0.7, seed=3, n=2, max_tokens=250,
                           response_format=RESPONSE_FORMAT)
        completion = pool.submit(client.completions.create, model=MODEL,
                                 prompt="A person as JSON:", temperature=0, max_tokens=250,
                                 extra_body={"guided_json": SCHEMA})
        r, completion = chat.result(), completion.result()
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    r = completion
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_regex_choice_and_grammar(client):
    ask = [{"role": "user", "content": "Give me a phone number."}]
    r = client.chat.completions.create(model=MODEL, messages=ask, temperature=0.7, seed=1,
                                       max_tokens=30,
                                       extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop"
    ask = [{"role": "user", "content": "Is the sky blue?"}]
    for body in ({"guided_choice": ["yes", "no"]},
                 {"structured_outputs": {"choice": ["yes", "no"]}},
                 {"guided_grammar": 'root ::= "yes" | "no"'}):
        r = client.chat.completions.create(model=MODEL, messages=ask, temperature=0,
                                           max_tokens=30, extra_body=body)
        assert r.choices[0].message.content in ("yes", "no"), body
        assert r.choices[0].finish_reason == "stop"


def test_json_object(client):
    ask = [{"role": "user", "content": "Give the name and age of a person as a JSON object."}]
    r = client.chat.completions.create(model=MODEL, messages=ask, temperature=0.7, seed=0,
                                       max_tokens=250, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"]}
TAGGED = re.compile(r"The answer: (\{.*?\})\.", re.S)


def test_structural_tag_formats(client):
    """vLLM's ``structural_tag``: xgrammar's ``format`` (here one tag: the whole output is
    ``<city>`` + a JSON object of the schema + ``</city>``), and the legacy ``structures``
    and ``triggers``: free text, but every ``The`` (the trigger, the model's own first word)
    opens ``The answer: `` + an object of the schema + ``.``; through ``response_format``
    and ``structured_outputs.structural_tag``."""
    ask = [{"role": "user", "content": "Which city is the capital of France?"}]
    one_tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<city>", "content": {"type": "json_schema", "json_schema": CITY},
        "end": "</city>"}}
    for body in ({"response_format": one_tag},
                 {"extra_body": {"structured_outputs": {"structural_tag": json.dumps(one_tag)}}}):
        r = client.chat.completions.create(model=MODEL, messages=ask, temperature=0,
                                           max_tokens=60, **body).choices[0]
        whole = re.fullmatch(r"<city>(.*)</city>", r.message.content, re.S)
        assert whole and r.finish_reason == "stop", r.message.content
        jsonschema.validate(json.loads(whole.group(1)), CITY)
    plain = client.chat.completions.create(model=MODEL, messages=ask, temperature=0,
                                           max_tokens=60).choices[0].message.content
    assert plain.startswith("The ") and not plain.startswith("The answer: ")
    legacy = {"type": "structural_tag", "triggers": ["The"],
              "structures": [{"begin": "The answer: ", "schema": CITY, "end": "."}]}
    for body in ({"response_format": legacy},
                 {"extra_body": {"structured_outputs": {"structural_tag": json.dumps(legacy)}}}):
        r = client.chat.completions.create(model=MODEL, messages=ask, temperature=0,
                                           max_tokens=200, **body).choices[0]
        text = r.message.content
        assert text.startswith("The answer: ") and r.finish_reason == "stop", text
        tags = TAGGED.findall(text)
        for tag in tags:
            jsonschema.validate(json.loads(tag), CITY)
        assert "The" not in TAGGED.sub("", text)  # every trigger opened a whole tag


def test_free_requests_unchanged_in_a_constrained_batch(client):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]

    def free(p: str) -> str:
        return client.completions.create(model=MODEL, prompt=p, temperature=0,
                                         max_tokens=40).choices[0].text

    alone = [free(p) for p in prompts]
    with ThreadPoolExecutor(9) as pool:
        constrained = [pool.submit(person, client, s) for s in range(6)]
        mixed = list(pool.map(free, prompts))
        for f in constrained:
            text, finish = f.result()
            assert finish == "stop"
            jsonschema.validate(json.loads(text), SCHEMA)
    assert mixed == alone


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "Unsupported type"),
    ({"guided_json": '{"type": "object", "properties": {'}, "guided_json", "JSON"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "parenthesis"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "EBNF"),
    ({"guided_grammar": 'start ::= "a"'}, "guided_grammar", "root"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "at most one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice",
     "at most one"),
    ({"structured_outputs": {"structural_tag": "a"}}, "structured_outputs.structural_tag",
     "not JSON"),
    ({"structured_outputs": {"structural_tag": '{"type": "structural_tag", "format": '
                                               '{"type": "bogus"}}'}},
     "structured_outputs.structural_tag", "bogus"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "needs format"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<"],
                          "structures": [{"begin": "<a>", "end": "</a>"}],
                          "format": {"type": "tag"}}}, "response_format", "not both"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<"],
                          "structures": [{"begin": "<a>"}]}}, "response_format", "end"),
    ({"structured_outputs": {"structural_tag": '{"triggers": "<a", "structures": '
                                               '[{"begin": "<a>", "end": "</a>"}]}'}},
     "structured_outputs.structural_tag", "list of strings"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", ""),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "structured"),
])
def test_bad_constraints_400(client, server, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=5,
                                       extra_body=body)
    err = info.value.body
    assert info.value.status_code == 400
    assert err["param"].startswith(param), err
    assert words in err["message"], err
    assert client.models.list().data  # the server is still up
