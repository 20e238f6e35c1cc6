"""The GGUF tokenizer cache: an entry gives the same tokenizer as converting the file."""

from __future__ import annotations

import os

import pytest

from tests.model.util import save_tokenizer_gguf
from tpserve.model.loader.checkpoint import embedded_model_path
from tpserve.model.loader.gguf_reader import GGUFFile
from tpserve.model.loader.tokenizer_cache import COMPLETE, entry_key, gguf_tokenizer

TEXTS = ["Hello wörld! 你好", "<|im_start|>user\n  two  spaces\tand a tab\n<|im_end|>",
         "def f(x):\n    return x ** 2  # 🙂", ""]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"}]


def test_the_cached_tokenizer_equals_the_converted_one(tmp_path, smollm2_tokenizer):
    path = embedded_model_path()
    direct = smollm2_tokenizer  # AutoTokenizer.from_pretrained(..., gguf_file=...), shared
    first = gguf_tokenizer(path, tmp_path)
    entry = tmp_path / "gguf-tokenizers" / entry_key(path)
    assert (entry / COMPLETE).is_file()
    assert (entry / "tokenizer.json").is_file()
    cached = gguf_tokenizer(path, tmp_path)  # read from the entry
    for tok in (first, cached):
        assert tok.get_vocab() == direct.get_vocab()
        assert tok.all_special_tokens == direct.all_special_tokens
        assert (tok.eos_token_id, tok.bos_token_id) == (direct.eos_token_id,
                                                        direct.bos_token_id)
        for text in TEXTS:
            assert tok(text).input_ids == direct(text).input_ids
        assert (tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
                == direct.apply_chat_template(CHAT, tokenize=False,
                                              add_generation_prompt=True))


def test_an_incomplete_entry_is_never_read(tmp_path, smollm2_tokenizer):
    path = embedded_model_path()
    entry = tmp_path / "gguf-tokenizers" / entry_key(path)
    entry.mkdir(parents=True)
    (entry / "tokenizer.json").write_text("{not json")  # a start that died mid-write
    tok = gguf_tokenizer(path, tmp_path)
    assert tok("Paris").input_ids == smollm2_tokenizer("Paris").input_ids
    assert not (entry / COMPLETE).exists()  # left alone: the rename found it taken


def test_a_changed_file_gets_a_new_key(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    before = entry_key(f)
    os.utime(f, ns=(1, 1))
    assert entry_key(f) != before
    f.write_bytes(b"x" * 11)
    assert entry_key(f) not in (before,)


def test_an_unwritable_cache_still_gives_the_tokenizer(tmp_path):
    blocker = tmp_path / "file-not-folder"
    blocker.write_text("")
    tok = gguf_tokenizer(embedded_model_path(), blocker)  # mkdir under a file fails
    assert tok.eos_token_id is not None
    assert not (blocker / "gguf-tokenizers").exists()


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma_vocabulary() -> dict:
    """A small sentencepiece vocabulary as llama.cpp writes a Gemma file's: <pad> <eos>
    <bos> <unk> <mask> and the turn markers (control), 256 byte tokens, pieces best-first."""
    pieces = ["▁", "e", "t", "a", "o", "h", "l", "r", "s", "n", "i", "d", "w", "H", "W",
              "▁t", "he", "▁the", "ll", "▁H", "▁W", "lo", "llo", "▁Hello", "or", "ld", "▁Wor",
              "▁World", "in", "▁a", "an", "▁and", "▁two", "▁spaces"]
    tokens = (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
              + [f"<0x{i:02X}>" for i in range(256)] + pieces)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 263 + [-float(i) for i in range(len(pieces))],
            "tokenizer.ggml.token_type": [3, 3, 3, 2, 3, 3, 3] + [6] * 256 + [1] * len(pieces),
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": GEMMA_TEMPLATE}


def embedded_vocabulary() -> dict:
    """The embedded SmolLM2 file's tokenizer keys: a GPT-2 style BPE, as Granite's are."""
    r = GGUFFile(embedded_model_path())
    return {k: r.get(k) for k in r.fields if k.startswith("tokenizer.")}


@pytest.mark.parametrize("arch,twin", [("gemma", "gemma2"), ("granite", "llama")])
def test_an_architecture_transformers_has_no_config_for_gets_its_tokenizer(tmp_path, arch,
                                                                            twin):
    """Gemma 1 and Granite GGUF files, which tpserve serves: AutoTokenizer refuses them
    (transformers' GGUF config mapping lacks the architecture), so the tokenizer is built
    from the file's vocabulary alone. It equals AutoTokenizer's for the same keys in a file
    of an architecture transformers maps (Gemma 2's, Llama's); vLLM serves a GGUF file
    with the tokenizer transformers converts from it."""
    from transformers import AutoTokenizer

    vocabulary = gemma_vocabulary() if arch == "gemma" else embedded_vocabulary()
    path = save_tokenizer_gguf(tmp_path / f"{arch}.gguf", arch, vocabulary)
    with pytest.raises(ValueError, match=f"GGUF model with architecture {arch} is not "
                                         "supported yet"):
        AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    twin_path = save_tokenizer_gguf(tmp_path / f"{twin}.gguf", twin, vocabulary)
    direct = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=twin_path.name)
    assert direct.eos_token_id == vocabulary["tokenizer.ggml.eos_token_id"]
    first = gguf_tokenizer(path, tmp_path / "cache")
    assert (tmp_path / "cache" / "gguf-tokenizers" / entry_key(path) / COMPLETE).is_file()
    everything = list(range(len(vocabulary["tokenizer.ggml.tokens"])))
    for tok in (first, gguf_tokenizer(path, tmp_path / "cache")):  # converted, then cached
        assert tok.get_vocab() == direct.get_vocab()
        assert ([tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id]
                == [direct.bos_token_id, direct.eos_token_id, direct.unk_token_id,
                    direct.pad_token_id])
        for text in TEXTS:
            assert tok(text).input_ids == direct(text).input_ids
        # the special tokens a detokenized answer drops (Gemma's <mask> among them,
        # which GemmaTokenizer alone names its mask_token)
        assert (tok.decode(everything, skip_special_tokens=True)
                == direct.decode(everything, skip_special_tokens=True))
        assert (tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
                == direct.apply_chat_template(CHAT, tokenize=False,
                                              add_generation_prompt=True))
