"""Memory you can see, through real servers and real clients: /memory and the per-rank
memory metrics at tp 2, a start-up that does not fit refused with the explanation (exit 2,
no traceback), and an out-of-memory step logged with the same kind of explanation."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import httpx

from tests.server.serverproc import SMALL, ServerProcess
from tpserve.model.memory import COMPONENTS

SMOL = "SmolLM2-135M-Instruct"


def _samples(text: str, name: str) -> dict[tuple[str, ...], float]:
    """``tpserve:<name>`` samples by their label values (sorted by label name)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(f"tpserve:{name}{{"):
            head, value = line.rsplit(" ", 1)
            labels = dict(p.split("=", 1) for p in head[head.index("{") + 1:-1].split(","))
            out[tuple(v.strip('"') for k, v in sorted(labels.items()) if k != "model_name")] \
                = float(value)
    return out


def test_memory_report_and_metrics_per_rank_at_tp2(tmp_path, small_server_tp2):
    """On the session's SMALL server at tp 2 (tests/conftest.py), shared with
    test_engine_query, whose memory queries and completion change none of the figures
    asserted here."""
    s = small_server_tp2.wait_until_healthy()
    s.client().completions.create(model=SMOL, prompt="The capital of France is",
                                  max_tokens=4, temperature=0)
    report = httpx.get(s.base + "/memory", timeout=10).json()
    metrics = httpx.get(s.base + "/metrics", timeout=10).text
    png = tmp_path / "memory.png"
    cli = subprocess.run([sys.executable, "-m", "tpserve.cli", "memory", "--base-url",
                          s.base, "--png", str(png)], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0, cli.stderr
    table = cli.stdout.splitlines()
    assert table[:2] == ["memory on cpu (tp 2), GiB",
                         f"{'':<22}{'rank 0':>12}{'rank 1':>12}"]
    kv_gib = report["ranks"][0]["plan"]["kv_pool"] / 2**30
    assert f"{'kv pool':<22}{kv_gib:>12.2f}{kv_gib:>12.2f}" in table
    assert table[-1] == f"plot: {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["tp"] == 2 and report["device"] == "cpu"
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    p0, p1 = (r["plan"] for r in report["ranks"])
    # 192 MiB of 30 layers x K,V x 16 tokens x (3 KV heads: 2 per rank at tp 2) x 64 x 4 B
    per_block = 30 * 2 * 16 * 2 * 64 * 4
    assert p0["num_blocks"] == p1["num_blocks"] == 192 * 2**20 // per_block
    assert p0["kv_pool"] == p1["kv_pool"] == p0["num_blocks"] * per_block
    assert p0["held"] == sum(p0[k] for k in ("weights", "activation_workspace",
                                             "cuda_graphs", "kv_pool"))
    assert report["ranks"][1]["age_s"] >= 0  # gathered from rank 1 at start-up
    assert len(report["history"]["kv_usage"]) >= 1
    by_component = _samples(metrics, "memory_bytes")
    for rank, plan in enumerate((p0, p1)):
        for component in COMPONENTS:
            assert by_component[(component, str(rank))] == float(plan[component])
        for key in ("allocated", "reserved"):  # CPU: no caching allocator
            assert by_component[(key, str(rank))] == 0.0
    assert _samples(metrics, "memory_fragmentation") == {("0",): 0.0, ("1",): 0.0}
    assert _samples(metrics, "allocator_alloc_retries_total") == {("0",): 0.0, ("1",): 0.0}
    assert _samples(metrics, "allocator_ooms_total") == {("0",): 0.0, ("1",): 0.0}
    # vLLM's cache_config_info: the pool's blocks (per rank, as vLLM's num_gpu_blocks)
    info = [ln for ln in metrics.splitlines() if ln.startswith("tpserve:cache_config_info{")]
    assert len(info) == 1 and info[0].endswith(" 1.0"), info
    assert f'num_gpu_blocks="{p0["num_blocks"]}"' in info[0] and 'block_size="16"' in info[0]


def test_a_kv_pool_the_host_cannot_allocate_is_refused_naming_the_flag():
    """--kv-cache-memory past what the process may allocate (here an address-space limit,
    so whatever the host's RAM): the allocator's error is the refusal (exit 2, one message
    naming the flag and the bytes, no traceback), not a crash."""
    def limit() -> None:  # the server itself needs about 3 GB of address space
        resource.setrlimit(resource.RLIMIT_AS, (8 * 10**9, 8 * 10**9))

    proc = subprocess.run(
        [sys.executable, "-m", "tpserve.cli", "serve", "--load-format", "dummy",
         "--kv-cache-memory", "12GiB", "--max-model-len", "1024", "--port", "0",
         "--log-level", "warning"],
        capture_output=True, text=True, timeout=300, preexec_fn=limit,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr[proc.stderr.index("tpserve: error: "):].splitlines()
    assert lines[0].startswith("tpserve: error: the model does not fit on cpu (rank 0): the "
                               "KV pool of 17476 blocks of 16 tokens = 12.00 GiB "
                               "(--kv-cache-memory) could not be allocated"), lines[0]
    assert "you tried to allocate" in lines[1]


def test_a_model_that_does_not_fit_is_refused_with_the_explanation():
    # SmolLM2 on CPU: 30 layers x K,V x 16 tokens x 3 KV heads x 64 x 4 B = 720 KiB a block;
    # 4 MiB hold 5 blocks = 80 tokens, one sequence of 2048 tokens needs 128 (90 MiB)
    proc = subprocess.run(
        [sys.executable, "-m", "tpserve.cli", "serve", "--kv-cache-memory", "4MiB",
         "--max-model-len", "2048", "--port", "0", "--log-level", "warning"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr[proc.stderr.index("tpserve: error: "):].splitlines()
    assert lines[0].startswith("tpserve: error: the model does not fit on cpu (rank 0): ")
    assert lines[0].endswith("leave 4.00 MiB for the KV pool = 5 blocks of 16 tokens, but one "
                             "sequence of --max-model-len 2048 needs 128 blocks (90.00 MiB)")
    assert "  asked for: KV pool 90.00 MiB at least, --kv-cache-memory 4.00 MiB" in lines
    i = lines.index("  any one of these would make it fit:")
    assert lines[i + 1:] == [
        "    --max-model-len 80: the KV pool's 5 blocks hold one sequence of 80 tokens",
        "    --kv-cache-memory 90MiB: 128 blocks = 2048 tokens",
    ]


def test_out_of_memory_step_is_logged_with_the_explanation():
    s = ServerProcess(*SMALL, env={"TPSERVE_TEST_FAULT": "0:3:oom"})
    try:
        r = s.client().completions.create(model=SMOL, prompt="Hello", max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 6
    finally:
        s.stop()
    out = s.output()
    assert ("rank 0: a step ran out of memory on cpu (rank 0): injected out-of-memory "
            "at forward (test hook)") in out
    assert "  asked for ?, free on the device " in out
    assert "  to leave steps more room: --max-num-batched-tokens 256 (half the activation " \
           "workspace of the largest step)" in out
