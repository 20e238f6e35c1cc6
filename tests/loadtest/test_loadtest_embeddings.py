"""``tpserve loadtest --endpoint embeddings``: against a real ``tpserve serve --runner pooling``
on the tiny Qwen3 embedding checkpoint of tests/server/test_embeddings_server (one server
for the module), where every request must succeed and the input tokens equal what the
server counted; wrong answers against the fake server count as failed; and the flags of
generation are refused with it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.loadtest.fake_openai_server import EMBEDDING_FAULTS, run_fake_server
from tests.loadtest.test_loadtest import PNG_SIGNATURE, parse, run
from tests.server.serverproc import ServerProcess
from tests.server.test_embeddings_server import checkpoint  # noqa: F401 (the fixture)
from tpserve.loadtest.args import GENERATION_PARAMETERS, ConfigError, config_from_args

# What an embeddings result has (vLLM's pooling keys, and ours), and what it must not have.
EMBEDDINGS_KEYS = ("completed", "failed", "duration", "total_input_tokens", "mean_input_tokens",
                   "request_throughput", "total_token_throughput", "mean_e2el_ms",
                   "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms")
GENERATION_KEYS = ("total_output_tokens", "output_throughput", "output_lens",
                   "output_throughput_timeline", "requests_without_usage", "ttfts", "tpots",
                   "itls", *GENERATION_PARAMETERS)


@pytest.fixture(scope="module")
def server(checkpoint):  # noqa: F811 (the imported fixture)
    s = ServerProcess(str(checkpoint[0]), "--runner", "pooling", "--kv-cache-memory", "32MiB",
                      "--max-model-len", "128", "--max-num-batched-tokens", "64",
                      "--served-model-name", "emb", "--check-integrity")
    yield s
    assert s.stop() == 0, s.output()


def assert_embeddings_result(doc: dict, prompts: int, percentiles: str = "99") -> None:
    assert doc["endpoint"] == "embeddings" and doc["percentile_metrics"] == "e2el"
    assert doc["metric_percentiles"] == percentiles
    assert doc["completed"] == prompts and doc["failed"] == 0 and doc["errors"] == []
    for key in (*EMBEDDINGS_KEYS, *(f"p{p}_e2el_ms" for p in percentiles.split(","))):
        assert isinstance(doc[key], (int, float)), key
    bogus = [k for k in doc if k in GENERATION_KEYS or any(
        m in k for m in ("ttft", "tpot", "itl", "output"))]
    assert bogus == [], bogus
    assert doc["total_input_tokens"] == sum(doc["input_lens"])
    assert doc["mean_input_tokens"] == doc["total_input_tokens"] / prompts
    assert doc["request_throughput"] == pytest.approx(prompts / doc["duration"])
    assert doc["total_token_throughput"] == pytest.approx(
        doc["total_input_tokens"] / doc["duration"])
    assert len(doc["e2els"]) == prompts and all(x > 0 for x in doc["e2els"])
    assert doc["mean_e2el_ms"] == pytest.approx(1000 * sum(doc["e2els"]) / prompts)


def test_embeddings_load_test_counts_what_the_server_counts(server, tmp_path):
    """The CLI, as a user runs it: every request succeeds, each prompt has the length
    /tokenize fitted it to, and the input tokens are those the engine took in."""
    before = server.metric("prompt_tokens_total")
    result = tmp_path / "emb.json"
    out = subprocess.run(
        [shutil.which("tpserve"), "loadtest", "--base-url", server.base, "--endpoint",
         "embeddings", "--num-prompts", "10", "--max-concurrency", "4",
         "--random-input-len", "24", "--random-range-ratio", "0.25", "--seed", "1",
         "--metric-percentiles", "50,99", "--no-progress", "--result-file", str(result)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(result.read_text())
    assert_embeddings_result(doc, 10, "50,99")
    assert doc["model"] == "emb" and doc["tokenizer"] == "server /tokenize"
    assert doc["input_lens"] == doc["target_input_lens"]
    assert all(18 <= n <= 30 for n in doc["input_lens"]) and len(set(doc["input_lens"])) > 1
    # and the initial test request, which sends one of the measured prompts
    initial_test_tokens = server.metric("prompt_tokens_total") - before - doc["total_input_tokens"]
    assert initial_test_tokens in doc["input_lens"]
    assert result.with_suffix(".png").read_bytes()[:8] == PNG_SIGNATURE
    rows = {line[:40].strip(): line[40:] for line in out.stdout.splitlines()}
    assert rows["Successful requests:"] == "10" and rows["Failed requests:"] == "0"
    assert rows["Total input tokens:"] == str(doc["total_input_tokens"])
    assert rows["Mean input tokens:"] == f"{doc['mean_input_tokens']:.2f}"
    for row in ("Request throughput (req/s):", "Total token throughput (tok/s):",
                "Mean E2EL (ms):", "Median E2EL (ms):", "P50 E2EL (ms):", "P99 E2EL (ms):"):
        assert float(rows[row]) > 0, row
    assert "End-to-end Latency" in out.stdout
    for word in ("TTFT", "TPOT", "ITL", "generated", "Output token"):
        assert word not in out.stdout, word


def test_embeddings_sweep_with_warmups(server, tmp_path, capsys):
    """Two rates, each after a warm-up that is not measured; the sweep table and plot are of
    E2E latency against request throughput."""
    before = server.metric("prompt_tokens_total")
    path = tmp_path / "sweep.json"
    assert run("--base-url", server.base, "--endpoint", "embeddings", "--num-prompts", "4",
               "--num-warmups", "2", "--sweep-rates", "inf,40", "--random-input-len", "16",
               "--result-file", str(path)) == 0
    doc = json.loads(path.read_text())
    assert [r["request_rate"] for r in doc["results"]] == ["inf", 40]
    for r in doc["results"]:
        assert_embeddings_result(r, 4)
        assert r["input_lens"] == [16] * 4 and "p99_e2el_ms" in r
    # besides the measured requests: 2 warm-ups per rate and one initial test request
    unmeasured_tokens = server.metric("prompt_tokens_total") - before - 2 * 4 * 16
    assert unmeasured_tokens == 2 * 2 * 16 + 16
    out = capsys.readouterr().out
    assert "E2EL p50" in out and "in tok/s" in out and "TTFT" not in out
    assert path.with_suffix(".png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize("fault", ["http", *EMBEDDING_FAULTS])
def test_a_wrong_embeddings_answer_is_a_failed_request(tmp_path, fault):
    expected = {"http": "HTTP 500: injected failure", "empty": "embedding is empty",
                "not_base64": "not valid base64", "odd_bytes": "has 5 bytes",
                "two_items": "expected one item in data, got 2", "nan": "NaN",
                "no_usage": "usage.prompt_tokens is None"}[fault]
    path = tmp_path / "r.json"
    with run_fake_server(fail_every=2, fail_mode=fault) as fake:
        assert run("--base-url", fake.base_url, "--endpoint", "embeddings", "--num-prompts",
                   "6", "--max-concurrency", "1", "--random-input-len", "12",
                   "--result-file", str(path), "--no-plot") == 0
        succeeded_tokens = fake.stats.prompt_tokens
        bodies = fake.stats.bodies
    doc = json.loads(path.read_text())
    assert doc["completed"] == 3 and doc["failed"] == 3
    assert len(doc["errors"]) == 1 and doc["errors"][0]["count"] == 3
    assert expected in doc["errors"][0]["message"], doc["errors"]
    assert doc["total_input_tokens"] == succeeded_tokens == 3 * 12
    assert all(b["encoding_format"] == "base64" and isinstance(b["input"], str)
               and set(b) == {"model", "input", "encoding_format"} for b in bodies)


def test_an_embeddings_request_over_the_timeout_fails(tmp_path):
    path = tmp_path / "r.json"
    with run_fake_server(token_delay=1.0) as fake:
        assert run("--base-url", fake.base_url, "--endpoint", "embeddings", "--num-prompts",
                   "2", "--random-input-len", "8", "--timeout", "0.2",
                   "--result-file", str(path), "--no-plot") == 1
    doc = json.loads(path.read_text())
    assert doc["completed"] == 0 and doc["errors"] == [
        {"message": "timeout after 0.2s", "count": 2}]
    assert doc["total_input_tokens"] == 0 and doc["mean_e2el_ms"] == 0.0


@pytest.mark.parametrize(("flags", "named"), [
    (("--random-output-len", "128"), "--random-output-len"),
    (("--ignore-eos",), "--ignore-eos"),
    (("--temperature", "0"), "--temperature"),
    (("--sharegpt-output-len", "5"), "--sharegpt-output-len"),
    (("--ignore-eos", "--temperature", "0.7"), "--temperature, --ignore-eos"),
])
def test_generation_flags_are_refused_with_embeddings(flags, named, capsys):
    """Refused when given, even with their default values; only their defaults pass."""
    with pytest.raises(ConfigError, match=f"^{named} cannot be used with --endpoint "
                                          "embeddings: an embeddings request generates no "
                                          "tokens$"):
        config_from_args(parse("--endpoint", "embeddings", *flags))
    assert run("--endpoint", "embeddings", *flags) == 2
    assert f"error: {named} cannot be used with --endpoint embeddings" in capsys.readouterr().err
    config_from_args(parse("--endpoint", "completions", *flags))  # fine for generation


def test_percentile_metrics_with_embeddings_are_e2el_only():
    config = config_from_args(parse("--endpoint", "embeddings"))
    assert config.percentile_metrics == ("e2el",) and config.embeddings
    assert not set(GENERATION_PARAMETERS) & set(config.parameters())
    assert config_from_args(parse("--endpoint", "embeddings", "--percentile-metrics",
                                  "e2el")).percentile_metrics == ("e2el",)
    with pytest.raises(ConfigError, match="--percentile-metrics can only be e2el with "
                                          "--endpoint embeddings"):
        config_from_args(parse("--endpoint", "embeddings", "--percentile-metrics", "ttft,e2el"))
    generation = config_from_args(parse())
    assert generation.percentile_metrics == ("ttft", "tpot", "itl")
    assert (generation.random_output_len, generation.temperature) == (128, 0.0)
    assert set(GENERATION_PARAMETERS) <= set(generation.parameters())
