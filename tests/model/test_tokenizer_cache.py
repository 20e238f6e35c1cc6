"""The GGUF tokenizer cache: an entry gives the same tokenizer as converting the file."""

from __future__ import annotations

import os

from tpserve.model.loader.checkpoint import embedded_model_path
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
