"""Data parallelism (``--data-parallel-size 2``, ``server/data_parallel.py``) through a real
``tpserve serve`` of the embedded SmolLM2 on the CPU, driven by the real openai client: two
engine processes answer as one engine (greedy text equal to the model's), a burst of
requests is spread over both and requests sent one at a time take turns (vLLM's per-engine
series in /metrics), /memory lists both
replicas' ranks, a beam search runs on one replica, unseeded samples differ across
replicas, vLLM's X-data-parallel-rank header pins a replica, every block goes back to both
pools, and a replica that dies takes the server down with a non-zero exit."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.model.util import greedy_answers
from tests.server.beam_reference import reference
from tests.server.serverproc import SMALL, ServerProcess, snapshot_cli
from tpserve.model.fault import FAULT_ENV

PROMPTS = ["The capital of France is", "def add(a, b):\n    return",
           "Once upon a time, in a small village by the sea,", "1, 2, 3, 4,",
           "The three primary colors are", "To boil an egg, first"]
TOKENS = 12


@pytest.fixture(scope="module")
def server():
    """Replica 1 fails its first level-1 sleep and its first two weight reloads (the test
    hook); nothing else is planted."""
    s = ServerProcess(*SMALL, "--data-parallel-size", "2", "--served-model-name", "smol",
                      "--enable-sleep-mode", env={FAULT_ENV: "1:0:sleep,1:0:reload,1:1:reload"})
    yield s
    assert s.stop() == 0, s.output()


def _per_engine(server, name: str) -> dict[str, float]:
    text = httpx.get(server.base + "/metrics", timeout=10).text
    return {sample.labels["engine"]: sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == f"tpserve:{name}"}


def test_two_replicas_answer_as_one_engine_and_share_a_burst(server, smollm2_path,
                                                             smollm2_tokenizer):
    ids, want = greedy_answers(smollm2_path, smollm2_tokenizer, PROMPTS, TOKENS)
    client = server.client()
    before = _per_engine(server, "generation_tokens_total")
    assert sorted(before) == ["0", "1"]

    def complete(prompt: list[int]) -> str:
        answer = client.completions.create(model="smol", prompt=prompt, max_tokens=TOKENS,
                                           temperature=0)
        assert answer.usage.completion_tokens == TOKENS
        return answer.choices[0].text

    with ThreadPoolExecutor(len(ids)) as pool:  # one burst: both replicas take some
        assert list(pool.map(complete, ids)) == want
    after = _per_engine(server, "generation_tokens_total")
    grew = {e: after[e] - before[e] for e in after}
    assert sum(grew.values()) == len(ids) * TOKENS
    assert all(g >= TOKENS for g in grew.values()), grew
    for prompt in ids[:2]:  # one at a time: idle replicas take turns
        complete(prompt)
    turns = _per_engine(server, "generation_tokens_total")
    assert {e: turns[e] - after[e] for e in turns} == {"0": TOKENS, "1": TOKENS}
    blocks = _per_engine(server, "kv_blocks_total")
    assert blocks["0"] == blocks["1"] > 0
    server.wait_pool_free()  # both pools: the merged usage is 0
    assert all(v == 0 for v in _per_engine(server, "kv_cache_usage_perc").values())

    memory = httpx.get(server.base + "/memory", timeout=30).json()
    assert memory["data_parallel_size"] == 2
    assert [(r["rank"], r["replica"]) for r in memory["ranks"]] == [(0, 0), (1, 1)]
    fresh = httpx.get(server.base + "/memory", params={"fresh": "true"}, timeout=30).json()
    assert [(r["rank"], r["replica"]) for r in fresh["ranks"]] == [(0, 0), (1, 1)]
    # the snapshot of the replica named: each engine answers (no --memory-history on the
    # CPU: its refusal), and a replica that does not exist is refused here
    snaps = [httpx.get(server.base + "/memory/snapshot", params={"replica": r}, timeout=30)
             for r in (0, 1, 2)]
    assert [r.status_code for r in snaps] == [400, 400, 400]
    assert all("--memory-history" in r.json()["error"]["message"] for r in snaps[:2])
    assert "replica 2: this server runs replicas 0..1" in snaps[2].json()["error"]["message"]
    cli = snapshot_cli(server.base, "unused.pickle", "--replica", "2")
    assert cli.returncode == 1 and "replica 2: this server runs replicas 0..1" in cli.stderr


def test_requests_sharing_a_prefix_go_to_the_replica_that_has_it(server, smollm2_tokenizer):
    """Sequential requests sharing 64 prompt tokens (4 KV blocks; ``prefix_affinity``) all
    go to the replica that took the first, and find the prefix in its cache; sent one at a
    time without a shared prefix they would take turns (the first test)."""
    shared = smollm2_tokenizer.encode(" ".join(PROMPTS) * 2)[:64]
    prompts = [shared + smollm2_tokenizer.encode(f" Question {i}: what comes next?")
               for i in range(4)]
    names = ("generation_tokens_total", "prefix_cache_hits_total")
    before = {n: _per_engine(server, n) for n in names}
    client = server.client()
    for prompt in prompts:
        answer = client.completions.create(model="smol", prompt=prompt, max_tokens=TOKENS,
                                           temperature=0)
        assert answer.usage.completion_tokens == TOKENS
    grew = {n: {e: _per_engine(server, n)[e] - before[n][e] for e in ("0", "1")}
            for n in names}
    (busy,) = [e for e in ("0", "1") if grew["generation_tokens_total"][e]]
    idle = "1" if busy == "0" else "0"
    assert grew["generation_tokens_total"][busy] == len(prompts) * TOKENS
    assert grew["prefix_cache_hits_total"][busy] >= (len(prompts) - 1) * len(shared)
    assert grew["prefix_cache_hits_total"][idle] == 0
    server.wait_pool_free()


def test_a_beam_search_runs_on_one_replica_and_finds_its_blocks_cached(server, hf_smollm2):
    """Every step of a beam search goes to one replica (``pinned``): the one that took a
    request of the same prompt just before (prefix affinity), whose prefix cache holds the
    prompt's blocks; the beams are the oracle's."""
    model, tok = hf_smollm2
    ids = tok(" ".join(PROMPTS) * 3).input_ids[::-1]  # several full blocks of 16, unseen
    want = reference(model, ids, 2, 6, {tok.eos_token_id})
    names = ("generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total")
    first = _per_engine(server, "generation_tokens_total")
    server.client().completions.create(model="smol", prompt=ids, max_tokens=1)
    (owner,) = [e for e, v in _per_engine(server, "generation_tokens_total").items()
                if v > first[e]]
    before = {n: _per_engine(server, n) for n in names}
    answer = server.client().completions.create(
        model="smol", prompt=ids, max_tokens=6, n=2,
        extra_body={"use_beam_search": True, "return_token_ids": True})
    assert [c.token_ids for c in answer.choices] == [list(t) for t, _, _ in want]
    grew = {n: {e: _per_engine(server, n)[e] - before[n][e] for e in ("0", "1")}
            for n in names}
    (busy,) = [e for e in ("0", "1") if grew["generation_tokens_total"][e]]
    idle = "1" if busy == "0" else "0"
    assert busy == owner
    assert grew["generation_tokens_total"][busy] == 1 + 2 * 5  # a token a beam and step
    assert grew["prefix_cache_hits_total"][busy] >= 11 * (len(ids) // 16) * 16
    assert all(grew[n][idle] == 0 for n in names), grew
    server.wait_pool_free()


def test_unseeded_samples_differ_across_replicas_and_seeded_ones_do_not(server):
    """Each replica's generator of unseeded requests is seeded with --seed + its index:
    four unseeded requests of one prompt sent one at a time (they take turns) are four
    texts, where replicas seeded alike repeated each other's draws; a request with its
    own seed draws the same on either replica (X-data-parallel-rank)."""
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 24,
            "temperature": 1.0, "ignore_eos": True}
    with httpx.Client(base_url=server.base, timeout=120) as http:
        texts = []
        for _ in range(4):
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert len(set(texts)) == 4, texts
        seeded = [http.post("/v1/completions", json={**body, "seed": 7},
                            headers={"X-data-parallel-rank": rank}) for rank in "01"]
        assert [r.status_code for r in seeded] == [200, 200]
        assert seeded[0].json()["choices"][0]["text"] == seeded[1].json()["choices"][0]["text"]
    server.wait_pool_free()


def test_the_data_parallel_rank_header_pins_the_replica(server):
    """vLLM's X-data-parallel-rank header sends a request (completions, chat, a beam
    search) to that replica, an external router's choice; out of range it is a 400, and a
    value that is no integer is ignored, as vLLM's _get_data_parallel_rank reads it."""
    before = _per_engine(server, "generation_tokens_total")
    # the requests' own series carry the engine label too, as vLLM's
    done = _per_engine(server, "e2e_request_latency_seconds_count")
    pin = {"X-data-parallel-rank": "1"}
    with httpx.Client(base_url=server.base, timeout=120) as http:
        for _ in range(3):
            r = http.post("/v1/completions", headers=pin,
                          json={"model": "smol", "prompt": "Hello there", "max_tokens": 3,
                                "ignore_eos": True})
            assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", headers=pin, json={
            "model": "smol", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        r = http.post("/v1/completions", headers=pin, json={
            "model": "smol", "prompt": "The sea", "max_tokens": 2, "n": 2,
            "use_beam_search": True, "ignore_eos": True})
        assert r.status_code == 200, r.text
        after = _per_engine(server, "generation_tokens_total")
        assert after["0"] == before["0"], (before, after)
        assert after["1"] - before["1"] == 4 * 3 + 1 + 2 * 1, (before, after)
        ended = _per_engine(server, "e2e_request_latency_seconds_count")
        assert (ended["0"] - done["0"], ended["1"] - done["1"]) == (0, 3 + 1 + 2)
        for rank in ("2", "-1"):
            r = http.post("/v1/completions", headers={"X-data-parallel-rank": rank},
                          json={"model": "smol", "prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == \
                f"data_parallel_rank {rank} is out of range [0, 2)."
        r = http.post("/v1/completions", headers={"X-data-parallel-rank": "one"},
                      json={"model": "smol", "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200, r.text
    server.wait_pool_free()


def test_a_sleep_or_reload_that_fails_on_one_replica_is_taken_back_on_the_other(
        server, smollm2_path, smollm2_tokenizer):
    """Replica 1's first sleep fails: replica 0, which slept, wakes to the state the sleep
    found (paused), so the replicas still answer as one. Asleep, replica 1's first reload
    fails: replica 0, whose weights woke from it, puts them back to sleep. A reload is
    refused while the replicas run; paused, replica 1's second reload fails: replica 0
    reads its previous weights again. Each failure is the client's error, and each
    succeeds when tried again."""
    ids, want = greedy_answers(smollm2_path, smollm2_tokenizer, PROMPTS[:2], TOKENS)
    with httpx.Client(base_url=server.base, timeout=120) as http:
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        r = http.post("/sleep", params={"level": 1})
        assert r.status_code == 503 and "injected failure at sleep 0" in r.text, r.text
        assert http.get("/is_paused").json() == {"is_paused": True}
        assert "replica(s) [0] took it back" in server.output()
        r = http.post("/sleep", params={"level": 1})
        # paused, not asleep: this sleep puts both replicas' ranks to sleep
        assert r.status_code == 200 and len(r.json()["ranks"]) == 2, r.text
        r = http.post("/reload_weights")
        assert r.status_code == 400 and "injected failure at reload 0" in r.text, r.text
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert server.output().count("replica(s) [0] took it back") == 2
        assert http.post("/wake_up").json()["is_sleeping"] is False
        assert http.get("/is_paused").json() == {"is_paused": False}
        r = http.post("/reload_weights")  # running: a replica could serve it alone
        assert r.status_code == 400 and "needs every replica paused or asleep" in r.text
        assert http.post("/pause").status_code == 200
        r = http.post("/reload_weights")
        assert r.status_code == 400 and "injected failure at reload 1" in r.text, r.text
        assert server.output().count("replica(s) [0] took it back") == 3
        r = http.post("/reload_weights")
        assert r.status_code == 200 and r.json()["status"] == "reloaded", r.text
        assert http.get("/is_paused").json() == {"is_paused": True}
        assert http.post("/resume").status_code == 200
    client = server.client()
    assert [client.completions.create(model="smol", prompt=p, max_tokens=TOKENS,
                                      temperature=0).choices[0].text for p in ids] == want


def test_a_replica_that_dies_takes_the_server_down():
    s = ServerProcess(*SMALL, "--data-parallel-size", "2")
    try:
        engines = {p.name(): p for p in psutil.Process(s.proc.pid).children(recursive=True)
                   if p.name().startswith("tpserve-engine")}
        assert sorted(engines) == ["tpserve-engine0", "tpserve-engine1"]
        os.kill(engines["tpserve-engine1"].pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while s.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s.proc.returncode == 1, s.output()
        assert "engine 1 process exited unexpectedly" in s.output()
        for p in engines.values():  # replica 0 was shut down with the server
            assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    finally:
        s.stop()


def test_a_replica_that_fails_to_start_stops_the_started_one():
    """Replica 1's runner fails while it is built (the test hook's ``start`` fault on
    rank 1 = replica 1's rank 0); replica 0, started first on the CPU, is shut down and
    the server exits non-zero naming the error."""
    s = ServerProcess(*SMALL, "--data-parallel-size", "2", wait=False,
                      env={"TPSERVE_TEST_FAULT": "1:0:start"})
    seen: dict[str, psutil.Process] = {}
    try:
        root = psutil.Process(s.proc.pid)
        deadline = time.monotonic() + 240
        while s.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                for p in root.children(recursive=True):
                    if p.name().startswith("tpserve-engine"):
                        seen.setdefault(p.name(), p)
            time.sleep(0.1)
        assert s.proc.returncode == 1, s.output()
    finally:
        s.stop()
    assert "injected failure at start-up" in s.output()
    assert "tpserve-engine0" in seen  # it had started
    for p in seen.values():
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
