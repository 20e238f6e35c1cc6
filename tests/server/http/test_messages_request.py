"""A Messages request's chat request (``messages/request.py``), where the chat request
itself shows what the conversion did: thinking blocks and the ``thinking`` field."""

from __future__ import annotations

import pytest

from tpserve.server.http.http_errors import APIError
from tpserve.server.http.messages.request import MessagesRequest, chat_request

ASK = {"role": "user", "content": "Capital of France?"}


def convert(reasons: bool = False, **fields):
    return chat_request(MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "messages": [ASK], **fields}), reasons)


def test_thinking_blocks_are_the_turns_reasoning_content():
    turn = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "It is ", "signature": "x"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "thinking", "thinking": "Paris.", "signature": "y"},
        {"type": "text", "text": "Paris."}]}
    chat = convert(messages=[ASK, turn, {"role": "user", "content": "And Spain?"}])
    answer = chat.messages[1]
    assert (answer.role, answer.text(), answer.reasoning_content) == (
        "assistant", "Paris.", "It is Paris.")
    plain = convert(messages=[ASK, {"role": "assistant", "content": "Paris."},
                              {"role": "user", "content": "And Spain?"}]).messages[1]
    assert plain.reasoning_content is None


def test_the_thinking_field_reaches_the_template_or_is_refused():
    assert convert().chat_template_kwargs is None
    assert convert(thinking={"type": "disabled"}).chat_template_kwargs == {
        "enable_thinking": False}
    assert convert(True, thinking={"type": "enabled", "budget_tokens": 1024}
                   ).chat_template_kwargs == {"enable_thinking": True}
    assert convert(True, thinking={"type": "adaptive"}).chat_template_kwargs == {
        "enable_thinking": True}
    # the request's own template arguments win
    assert convert(thinking={"type": "disabled"},
                   chat_template_kwargs={"enable_thinking": True, "x": 1}
                   ).chat_template_kwargs == {"enable_thinking": True, "x": 1}
    with pytest.raises(APIError, match="--reasoning-parser") as refused:
        convert(thinking={"type": "enabled", "budget_tokens": 1024})
    assert (refused.value.status, refused.value.param) == (400, "thinking")
    with pytest.raises(APIError, match="got 'on'"):
        convert(True, thinking={"type": "on"})


def test_budget_tokens_is_the_thinking_token_budget():
    assert convert(True, thinking={"type": "enabled", "budget_tokens": 1024}
                   ).thinking_token_budget == 1024
    assert convert(True, thinking={"type": "enabled"}).thinking_token_budget is None
    assert convert(True, thinking={"type": "adaptive"}).thinking_token_budget is None
    assert convert(thinking={"type": "disabled"}).thinking_token_budget is None
    for bad in (-1, 2.5, "8", True):
        with pytest.raises(APIError, match="budget_tokens must be a whole number") as refused:
            convert(True, thinking={"type": "enabled", "budget_tokens": bad})
        assert (refused.value.status, refused.value.param) == (400, "thinking.budget_tokens")


def test_claude_codes_billing_header_is_not_in_the_prompt():
    """The per-request billing block would change every prompt's start (no prefix-cache
    hits); the other system blocks stay, and a string system is kept whole."""
    header = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1f2e;"}
    rules = {"type": "text", "text": "You are a coding agent.", "cache_control": {
        "type": "ephemeral"}}
    chat = convert(system=[header, rules])
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "You are a coding agent."), ("user", "Capital of France?")]
    assert [m.role for m in convert(system=[header]).messages] == ["user"]
    assert convert(system=header["text"]).messages[0].text() == header["text"]


def test_only_a_final_assistant_turn_may_hold_no_content_block():
    with pytest.raises(APIError, match="messages.1.content holds no content block"):
        convert(messages=[ASK, {"role": "assistant", "content": []},
                          {"role": "user", "content": "And Spain?"}])
    chat = convert(messages=[ASK, {"role": "assistant", "content": []}])
    assert chat.continue_final_message and chat.messages[-1].text() == ""
