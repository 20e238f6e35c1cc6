"""``TokenTexts``, the token texts of log-probability entries, against SmolLM2's byte-level BPE
tokenizer (from its GGUF) and a Llama-2-style SentencePiece tokenizer trained here offline
(``sentencepiece_tokenizer``); and ``stop_rules.token_logprobs``, which reads them for a
sequence's sampled tokens."""

from __future__ import annotations

import pytest

from tpserve.model.sampler import SamplerOutput
from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.sequence import Sequence
from tpserve.server.engine.stop_rules import token_logprobs
from tpserve.server.engine.token_texts import TokenTexts, leading_space_marker

SPLIT_TEXTS = [
    "Party 🎉 time",
    "Emoji: 😀🎉🇫🇷👨‍👩‍👧 done",
    "中文测试：你好世界。日本語のテキスト、한국어 텍스트",
    "Math: ∑≠∞ ⌘ 𝔸 ok",
]


def sentencepiece_tokenizer(folder):
    """A Llama-2-style tokenizer: SentencePiece BPE over 1,000 pieces trained on the test
    data (no download), "▁" for a space, byte fallback for every character it lacks (each
    emoji, "∑"), the decoder dropping a text's first space; saved under ``folder``."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    with open("tests/data/pride_and_prejudice_ch1.txt") as f:
        lines = f.read().splitlines()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(folder / "sp"), vocab_size=1000,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2,
        unk_id=0, pad_id=-1, add_dummy_prefix=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "sp.model"))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []  # each merged piece from every split of it into two pieces, in vocab order
    for piece, pid in sorted(vocab.items(), key=lambda kv: kv[1]):
        if len(piece) < 2 or sp.is_byte(pid) or sp.is_control(pid) or sp.is_unknown(pid):
            continue
        splits = sorted((vocab[piece[:k]], vocab[piece[k:]], piece[:k], piece[k:])
                        for k in range(1, len(piece))
                        if piece[:k] in vocab and piece[k:] in vocab)
        merges += [(a, b) for _, _, a, b in splits]
    return LlamaTokenizer(vocab=vocab, merges=merges, bos_token="<s>", eos_token="</s>",
                          unk_token="<unk>", add_bos_token=True, legacy=False,
                          clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer  # the embedded SmolLM2's, converted from its GGUF, shared


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return sentencepiece_tokenizer(tmp_path_factory.mktemp("spm"))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def spelled(texts: TokenTexts, ids: list[int]) -> list[str]:
    """Each token's text at its position in ``ids``."""
    return [texts(t, ids, i) for i, t in enumerate(ids)]


class CountingTokenizer:
    """The real tokenizer, its ``decode`` calls counted."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.decodes = 0

    def decode(self, ids, **kwargs):
        self.decodes += 1
        return self.tok.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_own_texts_are_decoded_once_per_id(tok):
    """A token's own text is its decode alone, special tokens by name (as vLLM's
    ``decoded_token``), kept per id; one that ends in U+FFFD (part of a character) is ""
    with no tokens before it, as vLLM's correction gives it when nothing completes it."""
    texts = TokenTexts(tok)
    hello = encode(tok, " Hello")
    assert len(hello) == 1 and texts(hello[0]) == " Hello"
    assert texts(tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
    ids = list(range(0, len(tok), 97))
    decoded = [tok.decode([i], skip_special_tokens=False) for i in ids]
    want = ["" if d.endswith("\ufffd") else d for d in decoded]
    assert want != decoded  # some of them hold part of a character
    assert [texts(i) for i in ids] == want
    assert len(texts) == len(set(ids) | {hello[0], tok.convert_tokens_to_ids("<|im_end|>")})
    assert [texts(i) for i in ids[::-1]] == want[::-1]


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_tokens_of_a_split_character_spell_the_text(tok, text):
    """Byte-level BPE splits an emoji or a CJK character over tokens that each decode to
    U+FFFD alone. Read at its position, a token that only starts a character is "" and the
    one that completes it the whole character, with what the starting ones held before it
    (vLLM's ``LogprobsProcessor._correct_decoded_token``), so the texts spell the text."""
    ids = encode(tok, text)
    texts = TokenTexts(tok)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    assert "".join(spelled(texts, ids)) == text
    if text == "Party 🎉 time":
        assert tok.convert_ids_to_tokens(ids) == ["Part", "y", "ĠðŁ", "İ", "ī", "Ġtime"]
        assert spelled(texts, ids) == ["Part", "y", "", "", " 🎉", " time"]


def test_an_alternative_gets_its_own_share_at_the_position(tok):
    """Alternatives at one position are read after the sequence's tokens, each on its own
    (vLLM: the same context for the sampled token and each top token): after "ĠðŁ", "İ"
    (a space and 🎉's first bytes F0 9F 8E), the byte 0x80 completes " 🎀", a token that
    starts a character completes nothing (""), and a whole token is its own text."""
    ids = encode(tok, "Party 🎉")
    end = len(ids) - 1  # the position of "ī", which completes 🎉
    texts = TokenTexts(tok)
    byte_80 = tok.convert_tokens_to_ids("Ģ")  # byte-level BPE's character for 0x80
    assert tok.decode([byte_80]) == "\ufffd"
    assert texts(byte_80, ids, end) == " 🎀"  # the space came with "ĠðŁ"
    assert texts(ids[end], ids, end) == " 🎉"
    assert texts(ids[2], ids, end) == ""  # "ĠðŁ" again: a space and a character's start
    assert texts(encode(tok, " time")[0], ids, end) == " time"


def test_contextual_decodes_are_only_for_texts_ending_in_u_fffd(tok):
    """The common case costs nothing new: a token whose own text is whole is decoded once,
    whatever its positions; only a text ending in U+FFFD is decoded again, per position."""
    counting = CountingTokenizer(tok)
    texts = TokenTexts(counting)
    ids = encode(tok, "Party 🎉 time, party time")
    whole = [i for i in ids if not tok.decode([i]).endswith("\ufffd")]
    for i, t in enumerate(ids):
        if t in whole:
            texts(t, ids, i)
    assert counting.decodes == len(set(whole))
    texts(whole[0], ids, len(ids) - 1)
    assert counting.decodes == len(set(whole))
    before = counting.decodes
    assert texts(ids[4], ids, 4) == " 🎉"
    assert counting.decodes > before


def test_byte_level_tokenizers_have_no_leading_space_marker(tok):
    assert leading_space_marker(tok) is None


def test_sentencepiece_tokens_keep_their_leading_space(spm):
    """SentencePiece's decoder drops a text's first space, so ``decode(["▁It"])`` is "It";
    the text puts back a space for each leading "▁" of the piece (vLLM's
    ``convert_ids_list_to_tokens``, restoring them from ``convert_ids_to_tokens``), so "▁and"
    and "and" read differently (a completions ``top_logprobs`` dict keeps both) and the
    texts of a prompt's tokens spell it, a byte-fallback character's bytes in its last."""
    texts = TokenTexts(spm)
    assert leading_space_marker(spm) == "▁"
    with_space, without = spm.convert_tokens_to_ids(["▁and", "and"])
    assert spm.decode([with_space]) == spm.decode([without]) == "and"
    assert (texts(with_space), texts(without)) == (" and", "and")
    assert texts(spm.convert_tokens_to_ids("▁")) == " "
    assert texts(spm.bos_token_id) == "<s>"
    ids = spm.encode("It is 🦀🦀 ∑≠ ok")
    assert spm.convert_ids_to_tokens(ids)[:8] == ["<s>", "▁It", "▁is", "▁", "<0xF0>",
                                                  "<0x9F>", "<0xA6>", "<0x80>"]
    assert spelled(texts, ids)[:8] == ["<s>", " It", " is", " ", "", "", "", "🦀"]
    assert "".join(spelled(texts, ids)) == "<s> It is 🦀🦀 ∑≠ ok"


def test_legacy_sentencepiece_layout_has_its_marker_in_the_decoder(spm):
    """Llama-2's and Mistral's legacy ``tokenizer.json`` has no pre-tokenizer (the
    normalizer writes the "▁"s); the marker is what its decoder replaces by a space."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = tokenizers.Tokenizer.from_str(spm.backend_tokenizer.to_str())
    backend.pre_tokenizer = None
    backend.normalizer = tokenizers.normalizers.Sequence(
        [tokenizers.normalizers.Prepend("▁"), tokenizers.normalizers.Replace(" ", "▁")])
    legacy = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                     eos_token="</s>", unk_token="<unk>")
    assert leading_space_marker(legacy) == "▁"
    ids = legacy.encode("It is")
    assert [legacy.decode([i]) for i in ids] == ["<s>", "It", "is"]
    assert spelled(TokenTexts(legacy), ids) == ["<s>", " It", " is"]


def test_sampled_logprob_texts_are_read_after_the_sequence_output(tok):
    """``token_logprobs``: the sampled token and each alternative read at the newest
    position after the sequence's output tokens (not its prompt, as vLLM's sample
    logprobs), so the sampled tokens' texts spell the output."""
    ids = encode(tok, " 🎉 time")  # "ĠðŁ", "İ", "ī", "Ġtime"
    byte_80 = tok.convert_tokens_to_ids("Ģ")
    seq = Sequence(0, "r", 0, encode(tok, "Party"), SamplingParams(logprobs=1))
    texts = TokenTexts(tok)
    got = []
    for t in ids:
        seq.output_token_ids.append(t)
        result = SamplerOutput([t], logprobs=[-0.5], top_logprobs=[[(byte_80, -1.0)]])
        (entry,) = token_logprobs(seq, 0, result, texts)
        assert entry.token_id == t
        got.append((entry.text, entry.top[0][1]))
    assert got == [("", ""), ("", ""), (" 🎉", " 🎀"), (" time", "")]
