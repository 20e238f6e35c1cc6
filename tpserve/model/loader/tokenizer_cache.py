"""The tokenizer of a GGUF file, converted once and kept as a Hugging Face tokenizer folder.

transformers builds a GGUF file's tokenizer by parsing the file's vocabulary metadata and
converting it (about 3 s for SmolLM2's 49,152 tokens on a 2-core machine); a saved
``tokenizer.json`` folder loads in about 0.2 s. Every server start reads the tokenizer
twice (the HTTP process and the engine process), so the conversion is done once per file
and kept under the cache folder.

Invariants:
- an entry is keyed by the file's resolved path, size and modification time and by the
  transformers version, so a changed file or a new converter never reuses a stale entry;
- an entry is complete or absent: it is written in a private temporary folder and renamed
  into place, so a concurrent start either sees the whole folder or converts itself;
- the cache is an optimisation only: a folder that cannot be written (read-only home,
  full disk) means converting every time, never a failure.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

COMPLETE = "tpserve-complete"  # written last: a folder without it is never read
# transformers' refusal of a GGUF architecture it has no model config for
_UNSUPPORTED_ARCHITECTURE = re.compile(r"GGUF model with architecture \S+ is not supported yet\.")


def default_cache_root() -> Path:
    """``$TPSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/tpserve``, else ``~/.cache/tpserve``."""
    explicit = os.environ.get("TPSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tpserve"


def entry_key(path: Path) -> str:
    import transformers

    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _convert(path: Path) -> Any:
    """transformers' tokenizer of the GGUF file ``path``. AutoTokenizer first builds a
    model config from the file and refuses an architecture its GGUF config mapping lacks
    (Gemma 1, Granite), although the tokenizer's own conversion reads only the
    vocabulary's metadata; for that refusal alone, the tokenizer is built without a config
    (where both build one: the same vocabulary, token ids, bos/eos/unk/pad and chat
    prompt; a Gemma file's <mask> is then a special token without the ``mask_token``
    name GemmaTokenizer gives it)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as e:
        if not _UNSUPPORTED_ARCHITECTURE.fullmatch(str(e)):
            raise
    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def gguf_tokenizer(path: Path, cache_root: Path | None = None) -> Any:
    """The tokenizer of the GGUF file ``path``: from its cache entry when there is one,
    else converted by transformers (and the entry written, when the cache is writable)."""
    from transformers import AutoTokenizer

    root = default_cache_root() if cache_root is None else cache_root
    entry = root / "gguf-tokenizers" / entry_key(path)
    if (entry / COMPLETE).is_file():
        return AutoTokenizer.from_pretrained(str(entry))
    tokenizer = _convert(path)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        try:
            tokenizer.save_pretrained(str(tmp))
            (tmp / COMPLETE).write_text(str(path.resolve()) + "\n")
            os.rename(tmp, entry)  # atomic; fails if another start got there first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (entry / COMPLETE).is_file():
                raise
    except OSError as e:
        logger.debug("tokenizer cache not written (%s): converting on every start", e)
    return tokenizer
