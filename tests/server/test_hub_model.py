"""``tpserve serve org/name``: a model named by its Hugging Face repository id is served
from its snapshot in the Hugging Face cache (here a cache this test writes, in the hub's
own layout, read with ``HF_HUB_OFFLINE=1``: this machine has no network, so the fetch
itself is huggingface_hub's ``snapshot_download`` on a cache hit), under the repository
id as its name; an id that cannot be had stops the start with exit 2. ``--tokenizer`` takes a repository
id the same way, and ``--hf-overrides`` changes the served model's config."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.serverproc import ServerProcess

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def cache(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A Hugging Face cache holding ``tpserve-test/tiny-llama`` at main: the tiny random
    Llama with SmolLM2's tokenizer."""
    from tests.model.test_tiny_models import _hf_model
    from tests.model.util import save_hf_folder

    root = tmp_path_factory.mktemp("hf-cache")
    repo = root / "models--tpserve-test--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    save_hf_folder(_hf_model("llama"), snapshot)
    smollm2_tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    # a tokenizer-only repository: SmolLM2's tokenizer with a chat template of its own
    repo = root / "models--tpserve-test--tokenizer"
    snapshot = repo / "snapshots" / COMMIT
    smollm2_tokenizer.save_pretrained(snapshot)
    (snapshot / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((snapshot / "tokenizer_config.json").read_text())
    config["chat_template"] = "<<{{ messages[0]['content'] }}>>"
    (snapshot / "tokenizer_config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root


def test_a_repository_id_is_served_from_the_cache_under_its_name(cache):
    s = ServerProcess("tpserve-test/tiny-llama", "--download-dir", str(cache),
                      "--hf-token", "hf_unused",  # vLLM's flag, for gated repositories
                      "--max-model-len", "256", "--no-engine-process",
                      "--override-generation-config",
                      '{"temperature": 0, "max_new_tokens": 5}',
                      env={"HF_HUB_OFFLINE": "1"}, log_level="info")
    try:
        client = s.client()
        (card,) = client.models.list().data
        assert card.id == "tpserve-test/tiny-llama"
        # the overridden defaults: greedy, 5 tokens when a request leaves max_tokens out
        assert card.model_extra["default_sampling_params"] == {"temperature": 0,
                                                               "max_tokens": 5}
        r = client.completions.create(model="tpserve-test/tiny-llama", prompt=[17, 42, 99])
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
        assert ("default sampling parameters (no " in s.output()
                and "generation_config.json, with --override-generation-config): "
                    "temperature=0, max_tokens=5" in s.output()), s.output()
        assert f"tpserve-test/tiny-llama: snapshot {cache}" in s.output()
    finally:
        assert s.stop() == 0, s.output()


def test_a_repository_that_cannot_be_had_stops_the_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tpserve.cli", "serve", "tpserve-test/missing",
                          "--download-dir", str(tmp_path), "--port", "0"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("tpserve: error: model not found: 'tpserve-test/missing' is not a "
                           "local path, and the Hugging Face repository could not be fetched "
                           "(LocalEntryNotFoundError"), last


def test_a_local_folder_of_that_name_wins(cache, tmp_path, monkeypatch):
    """``org/name`` that exists as a relative folder is that folder (no hub lookup)."""
    from tpserve.model.loader.hub import is_repo_id

    monkeypatch.chdir(tmp_path)
    assert is_repo_id("tpserve-test/tiny-llama")
    shutil.copytree(cache / "models--tpserve-test--tiny-llama" / "snapshots" / COMMIT,
                    tmp_path / "tpserve-test" / "tiny-llama")
    assert not is_repo_id("tpserve-test/tiny-llama")
    assert not is_repo_id("/abs/path") and not is_repo_id("a/b/c") and not is_repo_id("x.gguf")


def test_a_taken_port_stops_the_start_before_the_fetch(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "tpserve.cli", "serve",
                              "tpserve-test/missing", "--download-dir", str(tmp_path),
                              "--port", str(port)],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"tpserve: error: port {port} on 127.0.0.1 is already in use; stop what listens "
        "there or choose another --port")
    assert "fetching" not in out.stderr


def test_tokenizer_repository_and_hf_overrides(cache, tmp_path, smollm2_tokenizer):
    """A bare folder (weights and config.json, no tokenizer) served with ``--tokenizer``
    naming a tokenizer repository (its chat template renders the chat prompt) and
    ``--hf-overrides`` shortening the model's context (256 in config.json)."""
    import httpx

    from tests.model.test_tiny_models import _hf_model
    from tests.model.util import save_hf_folder

    folder = save_hf_folder(_hf_model("llama"), tmp_path / "bare")
    s = ServerProcess(str(folder), "--tokenizer", "tpserve-test/tokenizer",
                      "--download-dir", str(cache), "--no-engine-process",
                      "--hf-overrides", '{"max_position_embeddings": 128}',
                      env={"HF_HUB_OFFLINE": "1"}, log_level="info")
    try:
        r = httpx.post(s.base + "/tokenize", timeout=30,
                       json={"messages": [{"role": "user", "content": "hello there"}]})
        assert r.status_code == 200, r.text
        want = smollm2_tokenizer("<<hello there>>", add_special_tokens=False).input_ids
        assert r.json()["tokens"] == want
        assert r.json()["max_model_len"] == 128
        (card,) = s.client().models.list().data
        assert card.model_extra["max_model_len"] == 128
    finally:
        assert s.stop() == 0, s.output()


def test_tokenizer_flag_errors(tmp_path):
    for args, last in [
            (["--tokenizer", str(tmp_path)],
             f"tpserve: error: --tokenizer: {tmp_path} is not a tokenizer folder (it has no "
             "tokenizer_config.json)"),
            (["--tokenizer-revision", "v1"],
             "tpserve: error: --tokenizer-revision needs a repository id as --tokenizer"),
            (["--hf-overrides", "[1]"],
             "tpserve: error: --hf-overrides must be a JSON object of config.json keys, got "
             "list: '[1]'")]:
        out = subprocess.run([sys.executable, "-m", "tpserve.cli", "serve", "smollm2-135m",
                              "--load-format", "dummy", "--port", "0", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines()[-1] == last
