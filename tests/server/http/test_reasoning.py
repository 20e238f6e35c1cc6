"""Reasoning parsers on their own: where an output starts (the prompt's last tag, else the
parser's default) and the split of its text into reasoning and content, whole and fed in
pieces (every way of cutting the text gives the whole split). The tokenizer is the
thinking SmolLM2's (``tests/server/thinking_model.py``), whose tags are real tokens."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from tests.server.thinking_model import write_thinking_smollm2
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.server.http.reasoning import REASONING_PARSERS, ReasoningSplit


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = write_thinking_smollm2(tmp_path_factory.mktemp("thinking") / "model")
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def parsers(tokenizer):
    return {name: cls(tokenizer) for name, cls in REASONING_PARSERS.items()}


def test_the_tags_must_be_tokens_of_the_model():
    plain = open_checkpoint(None).tokenizer()
    for name, cls in REASONING_PARSERS.items():
        with pytest.raises(ValueError, match=f"--reasoning-parser {name} needs the tokens "
                                             "<think> and </think>"):
            cls(plain)


def test_the_prompts_last_tag_says_where_the_output_starts(parsers, tokenizer):
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    hello = tokenizer.encode("Hello there")
    for name, parser in parsers.items():
        assert (parser.start_id, parser.end_id) == (start, end)
        assert not parser.needs_special_tokens
        opened = parser.plan(hello + [end] + hello + [start])
        assert (opened.opens, opened.grammar_after) == (True, end)
        closed = parser.plan(hello + [start] + hello + [end] + hello)
        assert (closed.opens, closed.grammar_after) == (False, None)
        untagged = parser.plan(hello, include=False)
        assert (untagged.opens, untagged.grammar_after, untagged.include) == \
            (name == "deepseek_r1", end, False)
        # a grammar waits for the end tag only where the output reasons: qwen3's output
        # from no tag reasons only when it begins with the start tag
        assert [p.grammar_after_if_first for p in (opened, closed, untagged)] == [
            None, None, start if name == "qwen3" else None]


CASES = [  # text, (deepseek_r1's split, qwen3's) with no tag in the prompt
    ("<think>Let me see.</think>Paris.", ("Let me see.", "Paris."), ("Let me see.", "Paris.")),
    ("Let me see.</think>\n\nParis.", ("Let me see.", "\n\nParis."),
     (None, "Let me see.</think>\n\nParis.")),
    ("Thinking, cut short", ("Thinking, cut short", None), (None, "Thinking, cut short")),
    ("<think>Cut short", ("Cut short", None), ("Cut short", None)),
    ("<think></think>Paris.", (None, "Paris."), (None, "Paris.")),
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    ("<thin", ("<thin", None), (None, "<thin")),
    ("x <think>y", ("x <think>y", None), (None, "x <think>y")),
    ("ends on a tag</think>", ("ends on a tag", None), (None, "ends on a tag</think>")),
    ("", (None, None), (None, None)),
]


@pytest.mark.parametrize("text,r1,qwen3", CASES)
def test_whole_outputs_split_at_the_tags(parsers, text, r1, qwen3):
    for name, want in (("deepseek_r1", r1), ("qwen3", qwen3)):
        parser = parsers[name]
        assert ReasoningSplit.whole(parser.plan([]), text) == want, name
    # a prompt that opened the reasoning, and one that closed it (an output that begins
    # with <think> still reasons), whatever the parser
    opened = parsers["qwen3"].plan([parsers["qwen3"].start_id])
    assert ReasoningSplit.whole(opened, text) == r1
    closed = parsers["deepseek_r1"].plan([parsers["deepseek_r1"].end_id])
    assert ReasoningSplit.whole(closed, text) == qwen3


def _streamed(plan, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    split = ReasoningSplit(plan)
    steps = [split.feed(p) for p in pieces] + [split.finish()]
    return "".join(r for r, _ in steps), "".join(c for _, c in steps), steps


@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_any_cut_of_the_stream_gives_the_whole_split(parsers, text):
    rng = random.Random(text)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts.append(list(text))  # one character at a time
    for _ in range(20):
        points = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    for parser in parsers.values():
        for plan in (parser.plan([]), parser.plan([parser.start_id])):
            whole = ReasoningSplit.whole(plan, text)
            for pieces in cuts:
                reasoning, content, _ = _streamed(plan, pieces)
                assert (reasoning or None, content or None) == whole, (pieces, parser.name)


def test_text_that_may_be_a_tag_is_held_until_it_is_not(parsers):
    plan = parsers["deepseek_r1"].plan([])
    _, _, steps = _streamed(plan, ["<th", "ink>Hmm</th", "is is not it", "</thi", "nk>Yes"])
    assert steps == [("", ""), ("Hmm", ""), ("</this is not it", ""), ("", ""),
                     ("", "Yes"), ("", "")]
    plan = parsers["qwen3"].plan([])
    _, _, steps = _streamed(plan, ["<", "b>bold</think>"])
    assert steps == [("", ""), ("", "<b>bold</think>"), ("", "")]
