"""A model named by its Hugging Face repository id (``meta-llama/Llama-3.1-8B-Instruct``),
as ``vllm serve`` takes it: its config, tokenizer, chat template and safetensors
weights fetched into the Hugging Face cache (``--download-dir`` instead), or found there
(``HF_HUB_OFFLINE=1``), and served from that snapshot folder."""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

logger = logging.getLogger("tpserve")

# what serving needs of a repository: no .bin / .pth / .gguf copies of the weights
SERVED_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(model: str) -> bool:
    """Whether ``model`` names a repository rather than a local path (which wins when it
    exists)."""
    return bool(_REPO_ID.match(model)) and not Path(model).exists()


def fetch_model(repo_id: str, revision: str | None = None,
                download_dir: str | None = None, weights: bool = True,
                token: str | bool | None = None) -> str:
    """The local snapshot folder of ``repo_id`` at ``revision`` (default: main), fetched
    if the cache lacks it (without ``weights``: all but the safetensors, for dummy
    weights of the repository's shape), with ``token`` (``--hf-token``: a token, True for
    the stored one, None for the hub's own choice: ``HF_TOKEN``, else the stored one). FileNotFoundError (exit 2) naming the repository when it
    cannot be had: unknown, gated without a token (``HF_TOKEN``), offline and not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    if not sys.stderr.isatty():
        disable_progress_bars()  # log lines, not bars, off a terminal
    start = time.monotonic()
    logger.info("fetching %s%s from the Hugging Face Hub (or its cache)", repo_id,
                f" at {revision}" if revision else "")
    try:
        patterns = SERVED_FILES if weights else [p for p in SERVED_FILES
                                                  if p != "*.safetensors"]
        folder = snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                   allow_patterns=patterns, token=token)
    except Exception as exc:  # the hub's errors: not found, gated, offline, HTTP
        raise FileNotFoundError(
            f"model not found: {repo_id!r} is not a local path, and the Hugging Face "
            f"repository could not be fetched ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    logger.info("%s: snapshot %s (%.1f s)", repo_id, folder, time.monotonic() - start)
    return folder


def local_folder(path: str, download_dir: str | None = None,
                 token: str | bool | None = None) -> str:
    """``path`` itself, or where it names a repository (``is_repo_id``) its snapshot folder
    in the cache, fetched if missing (``fetch_model``), as vLLM resolves an adapter's
    path."""
    return fetch_model(path, None, download_dir, token=token) if is_repo_id(path) else path
