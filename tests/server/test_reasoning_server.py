"""``tpserve serve FOLDER --reasoning-parser deepseek_r1`` through the real openai client,
on the thinking SmolLM2 (``tests/server/thinking_model.py``: real weights that answer
"What is the capital of France?" with ``<think> capital of France</think> Paris.``).

The raw output each chat answer is split from comes from ``/v1/completions`` on the same
server with the chat's rendered prompt (completions are never parsed, as in vLLM), so
every split is checked against the model's own text."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.server.serverproc import ServerProcess, stopped_on_exit
from tests.server.thinking_model import write_thinking_smollm2

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
          "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_thinking_smollm2(tmp_path_factory.mktemp("thinking") / "SmolLM2-thinking")


@pytest.fixture(scope="module")
def servers(folder):
    with stopped_on_exit({}) as started:
        # vLLM's --reasoning-config naming the parser's own tags is taken as it is
        started["r1"] = ServerProcess(str(folder), "--reasoning-parser", "deepseek_r1",
                                      "--reasoning-config",
                                      '{"reasoning_start_str": "<think>", '
                                      '"reasoning_end_str": "</think>"}',
                                      "--served-model-name", "thinker", "r1",
                                      "--no-engine-process", wait=False)
        started["qwen3"] = ServerProcess(str(folder), "--reasoning-parser", "qwen3",
                                         "--no-engine-process", wait=False)
        for s in started.values():
            s.wait_until_healthy()
        yield started


def raw_output(server, folder, messages, max_tokens=24, **template) -> str:
    """The model's whole output text for ``messages`` (greedy), unparsed."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template(messages, tokenize=False, **template)
    return _continued(server, tok(text, add_special_tokens=False)["input_ids"], max_tokens)[1]


def _continued(server, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """The model's greedy token ids and text after ``prompt`` (a completion: no budget,
    nothing parsed)."""
    client = server.client()
    r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                  max_tokens=max_tokens, temperature=0,
                                  extra_body={"return_token_ids": True})
    return r.choices[0].token_ids, r.choices[0].text


def chat(server, messages=QUESTION, max_tokens=24, **kwargs):
    client = server.client()
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=messages, temperature=0,
                                          max_tokens=max_tokens, **kwargs)


def test_the_answer_and_its_reasoning_are_split_at_the_tags(servers, folder):
    raw = raw_output(servers["r1"], folder, QUESTION, add_generation_prompt=True)
    assert raw == "<think> capital of France</think> Paris."  # what the weights were made for
    for name in ("r1", "qwen3"):  # the output begins with <think>: both parsers split it
        m = chat(servers[name]).choices[0].message
        assert (m.reasoning, m.content) == (" capital of France", " Paris."), name
        assert m.model_extra["reasoning_content"] == " capital of France"
    m = chat(servers["r1"], extra_body={"include_reasoning": False}).choices[0].message
    assert (m.reasoning, m.content) == (None, " Paris.")


def test_streamed_reasoning_comes_first_and_adds_up_to_the_whole(servers):
    whole = chat(servers["r1"], logprobs=True).choices[0]
    client = servers["r1"].client()
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=QUESTION, temperature=0,
        max_tokens=24, stream=True, logprobs=True)
    kinds, reasoning, content, logprobs = [], "", "", 0
    for chunk in stream:
        for c in chunk.choices:
            delta = c.delta.model_dump(exclude_none=True)
            assert not {"reasoning", "content"} <= delta.keys() or delta["content"] == ""
            if delta.get("reasoning"):
                kinds.append("reasoning")
                reasoning += delta["reasoning"]
                assert delta["reasoning_content"] == delta["reasoning"]
            elif delta.get("content"):
                kinds.append("content")
                content += delta["content"]
            if c.logprobs is not None:
                logprobs += len(c.logprobs.content)
    assert (reasoning, content) == (whole.message.reasoning, whole.message.content)
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # reasoning first
    assert logprobs == len(whole.logprobs.content) > 0  # every token's, reasoning or not


def test_a_json_schema_constrains_the_answer_after_the_reasoning(servers):
    free = chat(servers["r1"]).choices[0].message
    r = chat(servers["r1"], max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    m = r.choices[0].message
    assert m.reasoning == free.reasoning  # the free tokens up to </think> are the same
    jsonschema.validate(json.loads(m.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"


def test_a_named_tool_call_comes_after_the_reasoning(servers):
    tool = {"type": "function", "function": {"name": "capital", "parameters": SCHEMA}}
    r = chat(servers["r1"], max_tokens=64, tools=[tool],
             tool_choice={"type": "function", "function": {"name": "capital"}})
    m = r.choices[0].message
    assert m.reasoning == " capital of France", (m, r.choices[0].finish_reason)
    assert [c.function.name for c in m.tool_calls] == ["capital"], (m, r.choices[0])
    jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), SCHEMA)


CAPITAL = {"type": "function", "function": {"name": "capital", "parameters": SCHEMA}}
FORCED = [{"type": "function", "function": {"name": "capital"}}, "required"]


@pytest.mark.parametrize("tool_choice", FORCED, ids=["named", "required"])
def test_qwen3_forced_call_when_the_output_does_not_think(servers, folder, tool_choice):
    """``--reasoning-parser qwen3``: an output that does not begin with ``<think>`` is all
    answer, so a forced call's grammar applies from its first token (not after a
    ``</think>`` such an output never writes). This model's own first token would be
    ``<think>`` (the test below), so ``logit_bias`` takes it away here."""
    think = AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids("<think>")
    r = chat(servers["qwen3"], [{"role": "user", "content": "Give me a JSON object "
                                 "describing a cat."}], max_tokens=64, tools=[CAPITAL],
             tool_choice=tool_choice, logit_bias={str(think): -100})
    m = r.choices[0].message
    assert m.reasoning is None and m.content is None
    assert [t.function.name for t in m.tool_calls] == ["capital"], (m.content, r.choices[0])
    jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), SCHEMA)


@pytest.mark.parametrize("tool_choice", FORCED, ids=["named", "required"])
def test_qwen3_forced_call_after_thinking(servers, tool_choice):
    """The same forced call where the output begins with ``<think>``: the thinking is free
    and comes back as the reasoning, the call follows ``</think>``."""
    r = chat(servers["qwen3"], max_tokens=64, tools=[CAPITAL], tool_choice=tool_choice)
    m = r.choices[0].message
    assert m.reasoning == " capital of France" and m.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
        ("capital", {"city": "Paris"})]


def test_a_prompt_that_closed_the_reasoning_is_answered_with_content(servers, folder):
    """The final assistant message ends with </think> and is continued: the output is all
    answer, and a grammar applies from its first token."""
    messages = QUESTION + [{"role": "assistant", "content": "<think>Easy.</think>"}]
    template = {"continue_final_message": True, "add_generation_prompt": False}
    raw = raw_output(servers["r1"], folder, messages, **template)
    m = chat(servers["r1"], messages, extra_body=template).choices[0].message
    assert (m.reasoning, m.content) == (None, raw)
    r = chat(servers["r1"], messages, max_tokens=64, extra_body=template, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_without_a_tag_deepseek_r1_reasons_and_qwen3_answers(servers, folder):
    messages = [{"role": "user", "content": "Give me a JSON object describing a cat."}]
    raw = raw_output(servers["r1"], folder, messages, add_generation_prompt=True)
    assert "<think>" not in raw and "</think>" not in raw
    m = chat(servers["r1"], messages).choices[0].message
    assert (m.reasoning, m.content) == (raw, None)
    m = chat(servers["qwen3"], messages).choices[0].message
    assert (m.reasoning, m.content) == (None, raw)


def test_reasoning_in_the_history_reaches_the_template(servers):
    """An assistant turn's ``reasoning_content`` is given to the template, as vLLM does
    (this model's template does not print it, so the prompt is the same)."""
    history = QUESTION + [{"role": "assistant", "content": "Paris.",
                           "reasoning_content": "Easy."},
                          {"role": "user", "content": "And of Spain?"}]
    r = chat(servers["r1"], history)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_the_responses_api_gives_the_reasoning_its_own_item(servers, folder):
    """``/v1/responses``: a reasoning item (its text as ``reasoning_text``), then the
    message; the usage counts the reasoning's tokens (up to and including </think>);
    streamed, reasoning-text deltas come before the output-text deltas."""
    client = servers["r1"].client()
    model = client.models.list().data[0].id
    r = client.responses.create(model=model, input=QUESTION, max_output_tokens=24,
                                temperature=0)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == " capital of France"
    assert r.output_text == " Paris."
    tok = AutoTokenizer.from_pretrained(str(folder))
    thinking = tok("<think> capital of France</think>", add_special_tokens=False)["input_ids"]
    assert r.usage.output_tokens_details.reasoning_tokens == len(thinking) == 5
    events = list(client.responses.create(model=model, input=QUESTION, max_output_tokens=24,
                                          temperature=0, stream=True))
    deltas = [(e.type, e.delta) for e in events if e.type.endswith(".delta")]
    kinds = [k for k, _ in deltas]
    assert kinds == sorted(kinds, key=["response.reasoning_text.delta",
                                       "response.output_text.delta"].index)
    assert "".join(d for k, d in deltas if k == "response.reasoning_text.delta") == \
        " capital of France"
    assert "".join(d for k, d in deltas if k == "response.output_text.delta") == " Paris."
    final = events[-1].response
    assert final.usage.output_tokens_details.reasoning_tokens == 5
    assert [item.type for item in final.output] == ["reasoning", "message"]


def test_the_messages_api_gives_the_reasoning_a_thinking_block(servers):
    """``/v1/messages`` (``thinking`` enabled, which a server with a reasoning parser
    accepts): a signed ``thinking`` block, then the text; streamed, the thinking deltas and
    the signature close their block before the text's opens, and the final message is the
    same."""
    client = anthropic.Anthropic(base_url=servers["r1"].base, api_key="none", max_retries=0,
                                 timeout=120)
    fields = {"model": "thinker", "messages": QUESTION, "max_tokens": 24,
              "thinking": {"type": "enabled", "budget_tokens": 16},
              "extra_body": {"temperature": 0}}
    m = client.messages.create(**fields)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in m.content] == [
        ("thinking", " capital of France"), ("text", " Paris.")]
    assert len(m.content[0].signature) == 32 and m.stop_reason == "end_turn"
    with client.messages.stream(**fields) as stream:
        events = [(e.type, getattr(e, "index", None),
                   getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == [
        ("thinking", " capital of France"), ("text", " Paris.")]
    assert final.usage.output_tokens == m.usage.output_tokens
    blocks = [e for e in events if e[0].startswith("content_block")
              and e[0] != "content_block_delta" or e[2] == "signature_delta"]
    assert blocks == [("content_block_start", 0, None),
                      ("content_block_delta", 0, "signature_delta"),
                      ("content_block_stop", 0, None), ("content_block_start", 1, None),
                      ("content_block_stop", 1, None)]
    assert {(i, d) for k, i, d in events if k == "content_block_delta"} == {
        (0, "thinking_delta"), (0, "signature_delta"), (1, "text_delta")}
    # the thinking block sent back is accepted (it reaches the template as the turn's
    # reasoning_content, which this model's template does not print)
    again = client.messages.create(**{**fields, "messages": [
        *QUESTION, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": "And of Spain?"}]})
    assert again.type == "message"


def test_every_served_name_is_listed_and_answers(servers):
    client = servers["r1"].client()
    assert [m.id for m in client.models.list().data] == ["thinker", "r1"]
    r = client.chat.completions.create(model="r1", messages=QUESTION, max_tokens=24,
                                       temperature=0)
    assert (r.model, r.choices[0].message.content) == ("r1", " Paris.")


# ------------------------------------------------------------ thinking_token_budget

BUDGETED = 12  # max_tokens of the budget tests: the free answer and some tokens after


@pytest.fixture(scope="module")
def asked(folder):
    """The tokenizer, and the question's prompt ids as the chat template renders them."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    return tok, tok(text, add_special_tokens=False)["input_ids"]


def _forced(server, asked, name: str, budget: int) -> list[int]:
    """What a budget puts before the end tag: the start tag the model writes (deepseek_r1's
    outputs begin in the thinking, so a budget of 0 ends it before the tag), and the
    first ``budget`` tokens of the model's own thinking."""
    tok, prompt = asked
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    free, _ = _continued(server, prompt, BUDGETED)
    assert free[0] == start and free[4] == end  # <think> capital of France</think>
    if name == "r1" and budget == 0:
        return [end]
    return [start, *free[1:1 + budget], end]


@pytest.mark.parametrize("budget", [0, 1, 2, 3])
def test_a_thinking_budget_ends_the_thinking_where_it_is_spent(servers, asked, budget):
    """``thinking_token_budget`` (vLLM's): the output thinks for ``budget`` tokens, then
    the end tag is forced and the model answers from there: token for token what a
    completion of the prompt and those forced tokens continues with. A budget of 3 is
    exactly this model's own thinking, so nothing changes."""
    tok, prompt = asked
    for name in ("r1", "qwen3"):
        forced = _forced(servers[name], asked, name, budget)
        rest, text = _continued(servers[name], prompt + forced, BUDGETED - len(forced))
        r = chat(servers[name], max_tokens=BUDGETED, extra_body={"thinking_token_budget": budget,
                                            "return_token_ids": True})
        c = r.choices[0]
        assert c.token_ids == forced + rest, name
        thought = tok.decode(forced[1:-1]) if len(forced) > 1 else ""
        assert (c.message.reasoning, c.message.content) == (thought or None, text or None), name
        if budget == 3:
            assert (c.message.reasoning, c.message.content) == (" capital of France",
                                                                " Paris.")


def test_a_budgeted_stream_adds_up_to_the_whole_and_completions_obey_it(servers, asked):
    whole = chat(servers["qwen3"], max_tokens=BUDGETED,
                 extra_body={"thinking_token_budget": 1}).choices[0].message
    assert whole.reasoning == " capital"
    client = servers["qwen3"].client()
    model = client.models.list().data[0].id
    reasoning = content = ""
    for chunk in client.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, max_tokens=BUDGETED, stream=True,
            extra_body={"thinking_token_budget": 1}):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content or None) == (whole.reasoning, whole.content)
    # a completion is never parsed, but its thinking is counted all the same
    prompt = asked[1]
    forced = _forced(servers["r1"], asked, "r1", 1)
    rest, _ = _continued(servers["r1"], prompt + forced, BUDGETED - len(forced))
    r = servers["r1"].client().completions.create(
        model="r1", prompt=prompt, max_tokens=BUDGETED, temperature=0,
        extra_body={"thinking_token_budget": 1, "return_token_ids": True})
    assert r.choices[0].token_ids == forced + rest


def test_budget_tokens_caps_a_messages_thinking_block(servers, asked):
    """``/v1/messages``' ``thinking.budget_tokens`` is the thinking's cap: the block holds
    its first token, and the text is the model's answer after the forced end tag."""
    forced = _forced(servers["r1"], asked, "r1", 1)
    _, text = _continued(servers["r1"], asked[1] + forced, BUDGETED - len(forced))
    client = anthropic.Anthropic(base_url=servers["r1"].base, api_key="none", max_retries=0,
                                 timeout=120)
    m = client.messages.create(model="thinker", messages=QUESTION, max_tokens=BUDGETED,
                               thinking={"type": "enabled", "budget_tokens": 1},
                               extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in m.content] == [
        ("thinking", " capital"), ("text", text)]


@pytest.mark.parametrize("extra, message", [
    ({"thinking_token_budget": -1}, "thinking_token_budget must be at least 0"),
    ({"thinking_token_budget": 2, "use_beam_search": True, "n": 2},
     "thinking_token_budget is not supported with beam search"),
    ({"thinking_token_budget": 2, "allowed_token_ids": [1, 2]},
     "needs the end of the thinking allowed")])
def test_a_budget_that_cannot_be_honoured_is_a_400(servers, extra, message):
    client = servers["r1"].client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="r1", messages=QUESTION, max_tokens=8,
                                       extra_body=extra)
    assert refused.value.body["param"] == "thinking_token_budget"
    assert message in refused.value.body["message"]
