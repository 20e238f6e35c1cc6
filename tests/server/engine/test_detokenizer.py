"""IncrementalDetokenizer against the SmolLM2 byte-level BPE tokenizer (from its GGUF), and
against a Llama-2-style SentencePiece one where its prompt context matters."""

from __future__ import annotations

import pytest

from tests.server.engine.test_token_texts import sentencepiece_tokenizer
from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, this is a plain sentence.",
    "Héllo wörld — café naïve façade Ærøskøbing",
    "Emoji: 😀🎉🇫🇷👨‍👩‍👧 done",
    "中文测试：你好世界。日本語のテキスト、한국어 텍스트",
    " leading space and  double  spaces\nnew line\ttab",
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer  # the embedded SmolLM2's, converted from its GGUF, shared


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids, prompt=None, **params):
    """Feeds ``ids`` one by one (stopping when stopped), then flushes; returns (pieces, detok)."""
    detok = IncrementalDetokenizer(
        tok, prompt if prompt is not None else encode(tok, "Q: say something.\nA:"),
        SamplingParams(**params),
    )
    pieces = []
    for t in ids:
        pieces.append(detok.add_token(t))
        if detok.stopped:
            break
    pieces.append(detok.flush())
    return pieces, detok


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tok, text):
    ids = encode(tok, text)
    pieces, detok = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert detok.output_text == text
    assert not any("\ufffd" in p for p in pieces)
    assert not detok.stopped and detok.stop_reason is None


def test_multibyte_is_held_until_complete(tok):
    ids = encode(tok, "🎉")
    assert len(ids) > 1  # split across tokens, so the first ones alone are partial bytes
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    assert [detok.add_token(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_token(ids[-1]) == "🎉"


def test_incomplete_tail_comes_out_at_flush(tok):
    ids = encode(tok, "ok 🎉")[:-1]
    full = tok.decode(ids)
    assert full.endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    streamed = "".join(detok.add_token(t) for t in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == full


def test_prompt_context_keeps_leading_space(tok):
    prompt = encode(tok, "The answer is")
    ids = encode(tok, " forty two")
    pieces, _ = stream(tok, ids, prompt=prompt)
    assert pieces[0] == " forty"
    assert "".join(pieces) == " forty two"


def test_prompt_ending_mid_character(tok):
    prompt = encode(tok, "x 🎉")[:-1]  # prompt cut inside the emoji
    ids = encode(tok, " fine")
    pieces, _ = stream(tok, ids, prompt=prompt)
    assert "".join(pieces) == tok.decode(ids) == " fine"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    ids = encode(tok, "<|im_start|>assistant\nHi there<|im_end|>")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    pieces, detok = stream(tok, ids, skip_special_tokens=skip)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == detok.output_text == expected
    assert ("<|im_end|>" in expected) is not skip


def test_special_tokens_kept_side_by_side_have_no_space_between(tok):
    """What a request's ``spaces_between_special_tokens: false`` asks, and what it gets
    either way (``http/unsupported.py``): the tokenizer puts nothing between them."""
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>")]
    ids = encode(tok, "Hi") + ids + encode(tok, "there")
    pieces, _ = stream(tok, ids, skip_special_tokens=False)
    assert "".join(pieces) == "Hi<|im_end|><|im_start|>there"


def test_stop_string_spanning_tokens(tok):
    text = "Hello world. STOP here and more"
    ids = encode(tok, text)
    # " STOP" is two tokens (" ST", "OP"); "world. STOP" spans three
    for stop in ("STOP", "world. STOP", "d. S"):
        pieces, detok = stream(tok, ids, stop=(stop,))
        expected = text[: text.index(stop)]
        assert "".join(pieces) == detok.output_text == expected
        assert detok.stopped and detok.stop_reason == stop
        # a prefix of the stop string was held, never emitted then retracted
        assert all(expected.startswith("".join(pieces[: i + 1])) for i in range(len(pieces)))


def test_stop_string_held_back_then_released(tok):
    ids = encode(tok, "Hello world. STOP")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=("STOPPER",)))
    pieces = [detok.add_token(t) for t in ids]
    assert "".join(pieces) == "Hello world. "  # "STOP" could start "STOPPER"
    assert not detok.stopped
    assert detok.flush() == "STOP"
    assert detok.output_text == "Hello world. STOP"


def test_many_long_stop_strings_hold_back_vllms_fixed_length(tok):
    """Past EXACT_HOLD_CHARS characters of stop strings in all (a hostile request: the
    exact search costs time quadratic in their lengths, per token, on the engine thread),
    the stream holds back vLLM's fixed length, the longest stop string's less one; the
    text, the matches and the stream's pieces adding up to it stay as they were."""
    text = "Hello world, this is a plain sentence. And more words to close it."
    ids = encode(tok, text)
    long_stops = tuple(f"{i:04d}" + "z" * 996 for i in range(5))  # 5,000 characters
    pieces, detok = stream(tok, ids, stop=long_stops)
    assert not detok.stopped and "".join(pieces) == detok.output_text == text
    assert "".join(pieces[:-1]) == "" and pieces[-1] == text  # held: shorter than 999
    few = long_stops[:4]  # 4,000 characters: the exact hold-back, nothing held here
    pieces, _ = stream(tok, ids, stop=few)
    assert pieces[-1] == "" and "".join(pieces) == text
    # a match among many long stop strings still cuts where it starts
    hit = ("plain", *long_stops)
    pieces, detok = stream(tok, ids, stop=hit)
    assert detok.stop_reason == "plain" and "".join(pieces) == text[:text.index("plain")]
    held = IncrementalDetokenizer(tok, [], SamplingParams(stop=("x" * 3000 + "!", "y" * 2000)))
    got = "".join(held.add_token(t) for t in encode(tok, "a" * 3500))
    assert got == "a" * 500  # 3,500 characters less the 3,000 held back


def test_stop_at_very_start(tok):
    ids = encode(tok, "Hello world")
    pieces, detok = stream(tok, ids, stop=("Hello",))
    assert "".join(pieces) == "" and detok.output_text == ""
    assert detok.stop_reason == "Hello"


def test_include_stop_str_in_output(tok):
    text = "Hello world. STOP here and more"
    pieces, detok = stream(tok, encode(tok, text), stop=("STOP",), include_stop_str_in_output=True)
    assert "".join(pieces) == detok.output_text == "Hello world. STOP"
    assert detok.stop_reason == "STOP"


@pytest.mark.parametrize("min_tokens, stop, expected", [
    (0, ".", "a"),
    (2, ".", "a. b"),  # the text of tokens 1-2 ("a.") cannot end the output
    (3, ".", "a. b"),  # "a. b" is tokens 1-3; the "." after it ends past them
    (4, ".", "a. b. c"),
    (3, "a.", "a. b. c. d."),  # ends inside the first 3 tokens' text: never a stop
    (3, " b.", "a."),  # ends past them, though it starts inside: a stop (as vLLM)
])
def test_min_tokens_hold_back_stop_strings(tok, min_tokens, stop, expected):
    """vLLM's rule: a stop string counts only where it ends past the text of the first
    ``min_tokens`` output tokens."""
    ids = encode(tok, "a. b. c. d.")  # a | . | ' b' | . | ' c' | . | ' d' | .
    pieces, detok = stream(tok, ids, stop=(stop,), min_tokens=min_tokens)
    assert "".join(pieces) == detok.output_text == expected
    assert detok.stopped == (expected != "a. b. c. d.")


def test_earliest_stop_wins(tok):
    text = "one two three four five"
    ids = encode(tok, text)
    pieces, detok = stream(tok, ids, stop=("four", "two", "three"))
    assert "".join(pieces) == "one "
    assert detok.stop_reason == "two"
    # when both complete at the same character, the longer (earlier-starting) one wins
    _, detok = stream(tok, ids, stop=("wo", "two"))
    assert detok.output_text == "one " and detok.stop_reason == "two"


def test_nothing_after_stop(tok):
    ids = encode(tok, "alpha STOP beta gamma")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=("STOP",)))
    pieces = [detok.add_token(t) for t in ids]  # keeps feeding after the stop
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.output_text == "alpha "
    with pytest.raises(RuntimeError):
        detok.add_token(ids[0])


def test_stop_string_with_multibyte(tok):
    text = "Price: 5€ — café 😀 then more"
    ids = encode(tok, text)
    for stop in ("😀", "é 😀", "€"):
        pieces, detok = stream(tok, ids, stop=(stop,), include_stop_str_in_output=True)
        assert "".join(pieces) == text[: text.index(stop) + len(stop)]
        assert not any("\ufffd" in p for p in pieces)


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return sentencepiece_tokenizer(tmp_path_factory.mktemp("spm"))


@pytest.mark.parametrize("prompt_text", ["Crabs: 🦀🦀", "Sum: ∑≠"])
def test_first_token_keeps_its_space_after_a_prompt_ending_in_byte_fallback(spm, prompt_text):
    """A SentencePiece decoder drops a text's first space: the first output token keeps
    its space only decoded after prompt tokens. After two byte-fallback characters, the
    prompt's last 5 tokens start inside the first one and decode to U+FFFDs; the context
    is the shortest suffix of 4 to 23 tokens whose decode holds none (as vLLM primes its
    detokenizer), one that starts on a character's first byte, and " in" stays " in"."""
    prompt = spm.encode(prompt_text)
    last = prompt_text[-2:].encode()
    assert spm.convert_ids_to_tokens(prompt)[-len(last):] == [f"<0x{b:02X}>" for b in last]
    assert "\ufffd" in spm.decode(prompt[-5:])
    out = spm.encode(" in the", add_special_tokens=False)
    assert spm.convert_ids_to_tokens(out)[0] == "▁in" and spm.decode(out[:1]) == "in"
    pieces, detok = stream(spm, out, prompt=prompt)
    assert pieces[0] == " in"
    assert "".join(pieces) == detok.output_text == " in the"
