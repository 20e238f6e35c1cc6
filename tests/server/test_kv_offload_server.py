"""``--kv-offloading-size`` through a real server at tp 2 (gloo), driven by the openai client:
prompts evicted from a pool that holds two of them come back from every rank's host tier
(each rank copies its own KV heads), answer as they did when computed, and the copies
show in /metrics, /memory, ``tpserve memory`` and the start-up log; then a trainer's
checkpoint read in place on both ranks (``/reload_weights``) answers with its own greedy
tokens, the host tier forgotten. (The flags' checks: tests/test_cli.py and
tests/server/engine/test_kv_offload_engine.py.)"""

from __future__ import annotations

import random
import subprocess
import sys

import httpx
import pytest

from tests.model.util import greedy, load
from tests.server.engine.test_sleep_engine import _trained
from tests.server.serverproc import ServerProcess

# the tiny Llama at tp 2: one KV head a rank, 16 x 16 float32 x 2 layers x K, V = 4 KiB a
# block; 80 KiB: 20 blocks a rank (a 100-token prompt and its answer take 7); the tier:
# 0.0005 GiB over two ranks, 65 blocks a rank
FLAGS = ("--tensor-parallel-size", "2", "--kv-cache-memory", "80KiB",
         "--kv-offloading-size", "0.0005", "--served-model-name", "tiny", "--check-integrity",
         "--enable-sleep-mode")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smollm2_tokenizer) -> str:
    from tests.model.test_tiny_models import _hf_model
    from tests.model.util import save_hf_folder

    folder = save_hf_folder(_hf_model("llama"), tmp_path_factory.mktemp("tiny-llama"))
    smollm2_tokenizer.save_pretrained(folder)
    return str(folder)


def _ask(client, prompt: list[int]):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                     logprobs=1, extra_body={"ignore_eos": True})


def test_evicted_prompts_come_back_from_the_host_tier_of_every_rank(tiny_folder, tmp_path,
                                                                   smollm2_tokenizer):
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(100)] for _ in range(6)]
    s = ServerProcess(tiny_folder, *FLAGS, log_level="info")
    try:
        client = s.client()
        first = [_ask(client, p) for p in prompts]
        stored = s.metric("kv_offload_stored_blocks_total")
        assert stored > 0 and s.metric("kv_offload_loaded_blocks_total") == 0
        second = [_ask(client, p) for p in prompts]
        for a, b in zip(first, second, strict=True):
            assert a.usage.prompt_tokens_details.cached_tokens == 0
            assert b.usage.prompt_tokens_details.cached_tokens == 96
            ca, cb = a.choices[0], b.choices[0]
            assert cb.text == ca.text and cb.logprobs.tokens == ca.logprobs.tokens
            assert cb.logprobs.token_logprobs == pytest.approx(ca.logprobs.token_logprobs,
                                                               abs=1e-4)
        # every prompt's blocks had left the pool before it came back (module doc)
        assert s.metric("kv_offload_loaded_blocks_total") == 36
        assert s.metric("kv_offload_blocks_total") == 65
        s.wait_pool_free()
        report = httpx.get(s.base + "/memory", timeout=10).json()
        assert report["host_tier"] == {"blocks": 65, "bytes": 65 * 4096, "tokens": 1040,
                                       "pinned": False}
        cli = subprocess.run([sys.executable, "-m", "tpserve.cli", "memory", "--base-url",
                              s.base, "--png", str(tmp_path / "memory.png")],
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0, cli.stderr
        assert ("host tier of the prefix cache: 0.00 GiB a rank (65 blocks, 1040 tokens)"
                in cli.stdout.splitlines())
        # a trainer's checkpoint read in place by both ranks (--enable-sleep-mode): each
        # answers from its new shards, and no block cached with the old weights is reused
        new = _trained(tiny_folder, tmp_path, "step-1")
        r = httpx.post(s.base + "/reload_weights", json={"path": new}, timeout=120)
        assert r.status_code == 200 and r.json()["status"] == "reloaded", r.text
        model, comm = load(new)
        for p in prompts[:2]:
            again = _ask(client, p)
            assert again.usage.prompt_tokens_details.cached_tokens == 0
            want = smollm2_tokenizer.decode(greedy(model, comm, p, 8), skip_special_tokens=True)
            assert again.choices[0].text == want
    finally:
        assert s.stop() == 0, s.output()
    assert "KV offloading: 65 blocks (1040 tokens) of host memory a rank" in s.output()
