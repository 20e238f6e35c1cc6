"""Chat messages as the chat template reads them (``prompts.PromptProcessor.render_chat``,
vLLM's ``parse_chat_messages``), on the app over the fake engine, in process: a request's
own ``chat_template`` only with ``--trust-request-chat-template``, the content format
``auto`` detects, tool results, refusal and Responses text parts, custom roles, history
tool-call arguments and reasoning."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from tests.server.http.fake_engine import FakeEngine
from tpserve.server.http.app import build_app
from tpserve.server.http.content_format import detected_content_format
from tpserve.server.http.frontend import FrontendOptions
from tpserve.server.http.prompts import UNTRUSTED_TEMPLATE

MODEL = "smol"
HI = {"role": "user", "content": "Hi"}
SHOWS = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
PARTS = "{% for m in messages %}{% for p in m.content %}[{{ p.type }}:{{ p.text }}]" \
        "{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer) -> FakeEngine:
    return FakeEngine(smollm2_tokenizer, max_model_len=256)


@pytest.fixture()
def app(engine) -> Iterator:
    clients = []

    def make(chat_template: str | None = None, **options) -> TestClient:
        options.setdefault("trust_request_chat_template", True)
        c = TestClient(build_app(engine, served_model_names=(MODEL,), api_key=None,
                                 chat_template=chat_template,
                                 frontend=FrontendOptions(**options)))
        clients.append(c.__enter__())
        return c
    yield make
    for c in clients:
        c.__exit__(None, None, None)


def prompt_of(c: TestClient, messages: list[dict], **extra) -> str:
    r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                             "messages": messages,
                                             "return_prompt_text": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()["prompt_text"]


def test_a_requests_chat_template_needs_the_trust_flag(app, engine):
    """vLLM's: without --trust-request-chat-template (the default) a request's own template
    is refused with 400, on chat and on /tokenize of a chat; the server's is used as ever."""
    c = app(chat_template=SHOWS, trust_request_chat_template=False)
    for path in ("/v1/chat/completions", "/tokenize"):
        r = c.post(path, json={"model": MODEL, "max_tokens": 1, "messages": [HI],
                               "chat_template": "{{ messages[0].content }}"})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {
            "message": UNTRUSTED_TEMPLATE, "type": "invalid_request_error",
            "param": "chat_template", "code": None}
    assert UNTRUSTED_TEMPLATE == ("Chat template is passed with request, but "
                                  "--trust-request-chat-template is not set. Refused request "
                                  "with untrusted chat template.")
    assert prompt_of(c, [HI]) == "user:Hi;"
    trusting = app(chat_template=SHOWS)
    assert prompt_of(trusting, [HI], chat_template="<{{ messages[0].content }}>") == "<Hi>"
    r = trusting.post("/tokenize", json={"messages": [HI], "chat_template": "<{{ 1 }}>"})
    assert r.json()["tokens"] == engine.tokenizer.encode("<1>", add_special_tokens=False)


@pytest.mark.parametrize("template, fmt", [
    (PARTS, "openai"),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    ("{%- set loop_messages = messages[1:] %}{% set rest = loop_messages %}"
     "{% for message in rest %}{% for c in message.content | reverse %}{% endfor %}"
     "{% endfor %}", "openai"),  # aliases of messages, a slice, a filter
    ("{% for m in messages | selectattr('role', 'eq', 'user') %}{% generation %}"
     "{% for c in m['content'][1:] %}{{ c }}{% endfor %}{% endgeneration %}{% endfor %}",
     "openai"),  # transformers' generation block
    ("{% for message in messages %}{% if message.content is string %}{{ message.content }}"
     "{% else %}{% for c in message.content %}{{ c.text }}{% endfor %}{% endif %}{% endfor %}",
     "openai"),
    (SHOWS, "string"),
    ("{% for m in messages %}{{ m['content'] | trim }}{% endfor %}", "string"),
    ("{% for c in messages[0]['content'] %}{{ c }}{% endfor %}", "string"),  # no message var
    ("{% for m in others %}{% for c in m.content %}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}{% for c in m.tool_calls %}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}", "string"),  # does not parse
    ("", "string"),
])
def test_auto_content_format_reads_the_templates_loops(template, fmt):
    assert detected_content_format(template) == fmt


def test_auto_content_format_on_the_app(app, smollm2_tokenizer):
    """auto: the parts for a template that loops over a message's content (the request's,
    the server's, or the model's), else a string; string and openai are taken as set."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    auto = app()
    assert prompt_of(auto, [HI], chat_template=PARTS) == "[text:Hi]"
    assert prompt_of(auto, parts, chat_template=PARTS) == "[text:a][text:b]"
    assert prompt_of(auto, parts, chat_template=SHOWS) == "user:a\nb;"
    assert prompt_of(app(chat_template=PARTS), [HI]) == "[text:Hi]"
    assert prompt_of(auto, [HI]) == smollm2_tokenizer.apply_chat_template(
        [HI], tokenize=False, add_generation_prompt=True)  # SmolLM2's: a string
    assert prompt_of(app(chat_template_content_format="string"), [HI],
                     chat_template=PARTS) == "[:][:]"  # the loop walks the string
    assert prompt_of(app(chat_template_content_format="openai"), [HI],
                     chat_template=SHOWS) == "user:[{'type': 'text', 'text': 'Hi'}];"


def test_tool_results_are_strings_in_the_openai_format(app):
    """vLLM gives a tool message's text parts to the template as one string (joined by
    newlines) in the openai format too; other roles keep their parts."""
    messages = [HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1",
         "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}]},
        {"role": "tool", "tool_call_id": "c2"}]
    c = app(chat_template_content_format="openai")
    assert prompt_of(c, messages, chat_template=SHOWS) == \
        "user:[{'type': 'text', 'text': 'Hi'}];assistant:[];tool:4\n2;tool:;"


def test_refusal_and_responses_text_parts_are_text(app):
    """OpenAI's refusal part (of an assistant message; vLLM takes it anywhere) and vLLM's
    input_text / output_text parts reach the template as text (in the openai format: text
    parts)."""
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Hm."},
                                                  {"type": "refusal", "refusal": "No."}]},
                {"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]
    assert prompt_of(app(), messages, chat_template=SHOWS) == \
        "user:Hi;assistant:Hm.\nNo.;user:x;"
    assert prompt_of(app(), messages, chat_template=PARTS) == \
        "[text:Hi][text:Hm.][text:No.][text:x]"
    r = app().post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "assistant", "content": [{"type": "refusal"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.content")


@pytest.mark.parametrize("role", ["ipython", "observation", "wizard"])
def test_custom_roles_reach_the_template(app, role):
    """vLLM's CustomChatCompletionMessageParam: any role is handed to the template."""
    assert prompt_of(app(), [HI, {"role": role, "content": "42"}], chat_template=SHOWS) == \
        f"user:Hi;{role}:42;"


def test_the_function_role_is_refused(app):
    r = app().post("/v1/chat/completions", json={"model": MODEL, "messages": [
        HI, {"role": "function", "name": "f", "content": "42"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.1.role"
    assert "function role" in r.json()["error"]["message"]


def test_history_arguments_that_are_not_json_become_an_empty_object(app):
    """vLLM's _postprocess_messages: JSON arguments decoded, others (empty, malformed) {}."""
    calls = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}(" \
            "{% for k, v in c.function.arguments | items %}{{ k }}={{ v }}{% endfor %})" \
            "{% endfor %}{% endfor %}"
    messages = [HI, {"role": "assistant", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": arguments}}
        for i, arguments in enumerate(["", "{not json", '{"a": 1}'])]}]
    assert prompt_of(app(), messages, chat_template=calls) == "f()f()f(a=1)"


def test_history_reasoning_reaches_the_template_under_both_names(app):
    """vLLM sets an assistant turn's reasoning as ``reasoning`` and ``reasoning_content``
    (from either field), and on no other role."""
    reads = "{% for m in messages %}{{ m.role }}:{{ m.reasoning }}/{{ m.reasoning_content }};" \
            "{% endfor %}"
    messages = [{"role": "user", "content": "Hi", "reasoning": "U"},
                {"role": "assistant", "content": "x", "reasoning": "R1"},
                {"role": "assistant", "content": "y", "reasoning_content": "R2"},
                {"role": "assistant", "content": "z"}]
    assert prompt_of(app(), messages, chat_template=reads) == \
        "user:/;assistant:R1/R1;assistant:R2/R2;assistant:/;"


def test_echo_repeats_the_last_message_where_its_role_is_the_answers(app, engine):
    """vLLM's chat ``echo``: the answer starts with the last message where its role is the
    answer's (without a generation prompt, the last message's own role: a continued user
    turn too; with one, ``--response-role``'s), else nothing is echoed."""
    c = app(chat_template=SHOWS)

    def answer(messages, **extra) -> tuple[str, str]:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                 "messages": messages, "echo": True, **extra})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        return message["role"], message["content"]

    generated = engine.expected_text(0, 2)
    assert answer([HI], add_generation_prompt=False) == ("user", "Hi" + generated)
    assert answer([HI, {"role": "assistant", "content": "Hel"}],
                  add_generation_prompt=False) == ("assistant", "Hel" + generated)
    assert answer([HI]) == ("assistant", generated)  # a new turn: nothing to repeat


def test_tools_reach_the_template_as_vllm_dumps_them(app):
    """vLLM shows the template every tool's ``name``, ``description`` and ``parameters``
    (None where the request leaves them out) and ``strict`` only when set: a Hermes-style
    template that reads ``parameters`` renders a tool without arguments (OpenAI's spec makes
    them optional), and a JSON-dumping one writes the nulls."""
    hermes = ("{% for t in tools %}{{ t.function.name }}({{ t.function.parameters }})"
              "{% endfor %}|{{ tools | tojson }}")
    tools = [{"type": "function", "function": {"name": "now"}},
             {"type": "function", "function": {"name": "f", "description": "d",
                                               "parameters": {"type": "object"},
                                               "strict": True}}]
    assert prompt_of(app(), [HI],
                     chat_template=hermes, tools=tools, tool_choice="none") == (
        "now(None)f({'type': 'object'})|"
        '[{"type": "function", "function": {"name": "now", "description": null, '
        '"parameters": null}}, {"type": "function", "function": {"name": "f", '
        '"description": "d", "parameters": {"type": "object"}, "strict": true}}]')
