"""Prefix-cache block hashes: chained sha256 from a random per-process root.

``h_i = sha256(h_{i-1} || len(tokens_i) || tokens_i || extra_key)`` with ``h_{-1}`` drawn
from ``os.urandom`` when a block manager is built. Token ids are encoded as signed 64-bit
integers (native byte order: a digest never leaves its process) and the parent digest has
a fixed length, so the encoding is
unambiguous. A cryptographic hash over a secret root means that colliding prompts cannot
be built offline (Python's ``hash`` of an int tuple is unseeded); the block manager still
compares the full key on every hit, so even a collision never serves another prefix's K/V.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Callable

BlockHashFn = Callable[[bytes, tuple[int, ...], bytes], bytes]
"""``(parent digest, the block's token ids, extra key) -> digest``."""

ROOT_BYTES = 32


def sha256_block_hash(parent: bytes, tokens: tuple[int, ...], extra_key: bytes = b"") -> bytes:
    """The chained hash of one full block. ``extra_key`` is for anything besides the tokens
    that keeps blocks apart: a request's ``cache_salt`` today (``Sequence.cache_key``);
    later a LoRA id or a multimodal input hash."""
    h = hashlib.sha256(parent)
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    h.update(extra_key)
    return h.digest()


def random_root() -> bytes:
    """A fresh ``h_{-1}``: unpredictable, different in every process."""
    return os.urandom(ROOT_BYTES)
