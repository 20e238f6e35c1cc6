"""tpserve loadtest against a fake OpenAI-compatible streaming server (tests/loadtest)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.loadtest.fake_openai_server import CHAT_TEMPLATE_TOKENS, MODEL_ID, run_fake_server
from tpserve.loadtest import add_arguments, main
from tpserve.loadtest.args import ConfigError, config_from_args
from tpserve.loadtest.arrivals import arrival_offsets
from tpserve.loadtest.cli import build_document
from tpserve.loadtest.plot import write_plot
from tpserve.loadtest.session import run_session
from tpserve.loadtest.sse import SSEEvent, iter_events

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REQUIRED_KEYS = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput", "errors",
    "interrupted", "model", "endpoint", "dataset", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "seed", "endpoint_type", "backend", "model_id",
    "tokenizer_id",
    *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std")),
    # the default --percentile-metrics ttft,tpot,itl and --metric-percentiles 99
    "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms",
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*argv, "--no-progress"])


def run(*argv: str) -> int:
    return main(parse(*argv))


def small(server, tmp_path: Path, *extra: str, prompts: int = 8, name: str = "r.json",
          plot: bool = False):
    """Run a small load test; returns (exit status, parsed JSON or None, json path)."""
    path = tmp_path / name
    rc = run("--base-url", server.base_url, "--num-prompts", str(prompts),
             "--random-input-len", "24", "--random-output-len", "6",
             "--result-file", str(path), *extra, *(() if plot else ("--no-plot",)))
    document = json.loads(path.read_text()) if path.exists() else None
    return rc, document, path


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.fail("matplotlib is required for the plot tests: pip install matplotlib "
                    "(part of the project's test extra)")


def assert_valid_png(path: Path) -> None:
    require_matplotlib()
    assert path.is_file(), f"{path} was not written"
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100


@pytest.fixture(scope="module")
def basic_run(tmp_path_factory):
    """One plain run shared by several tests: 20 prompts, at most 4 in flight."""
    tmp = tmp_path_factory.mktemp("basic")
    with run_fake_server(token_delay=0.001) as server:
        rc, document, path = small(server, tmp, "--ignore-eos", "--max-concurrency", "4",
                                   "--random-input-len", "48", "--random-output-len", "12",
                                   prompts=20, plot=True)
    return rc, document, path, server.stats


def test_every_request_completes_and_tokens_match_the_server(basic_run):
    rc, result, _, stats = basic_run
    assert rc == 0
    assert result["completed"] == 20 and result["failed"] == 0
    assert stats.requests == 20
    assert result["total_output_tokens"] == stats.completed_tokens == 20 * 12
    assert result["total_input_tokens"] == stats.prompt_tokens
    assert result["input_lens"] == [48] * 20, "prompts are fitted to the exact length"
    assert result["interrupted"] is False and result["errors"] == []
    assert 1 <= stats.max_in_flight <= 4
    body = stats.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 12 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0  # greedy unless --temperature says otherwise
    assert body["model"] == MODEL_ID and result["model"] == MODEL_ID
    assert len(set(stats.prompts)) == 20, "random prompts are distinct"


def test_result_json_has_the_vllm_keys_and_sane_values(basic_run):
    _, result, _, _ = basic_run
    missing = [k for k in REQUIRED_KEYS if k not in result]
    assert not missing, f"missing keys: {missing}"
    assert result["request_rate"] == "inf" and result["max_concurrency"] == 4
    # vLLM's opening keys: its backend name of the request kind, the model and the
    # tokenizer that counted the prompts (the served model's, through /tokenize)
    assert result["endpoint_type"] == result["backend"] == "openai"
    assert result["model_id"] == result["tokenizer_id"] == MODEL_ID
    assert result["duration"] > 0
    assert result["output_throughput"] == pytest.approx(240 / result["duration"])
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"]
    assert 0 < result["mean_tpot_ms"] and 0 < result["mean_itl_ms"]
    assert result["mean_e2el_ms"] >= result["mean_ttft_ms"]
    assert len(result["itls"]) == 20 and all(len(x) == 11 for x in result["itls"])
    assert "api_key" not in result


def test_png_is_written_beside_the_json(basic_run):
    _, _, path, _ = basic_run
    assert_valid_png(path.with_suffix(".png"))


@pytest.mark.parametrize(("mode", "message"), [
    ("http", "HTTP 500: injected failure"),
    ("stream", "stream error: injected stream error"),
])
def test_failed_requests_are_counted_with_their_error(tmp_path, mode, message):
    with run_fake_server(fail_every=3, fail_mode=mode) as server:
        rc, result, _ = small(server, tmp_path, "--ignore-eos", prompts=9)
    assert rc == 0
    assert result["completed"] == 6 and result["failed"] == 3
    assert result["errors"] == [{"message": message, "count": 3}]
    assert result["total_output_tokens"] == 6 * 6


@pytest.mark.parametrize("model", [(), ("--model", "m")])
def test_an_unreachable_server_stops_the_test_before_the_run(tmp_path, capsys, model):
    """A server that is down is one setup error (exit 2), with or without --model: no
    request is sent, no table printed, nothing written."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "r.json"
    rc = run("--base-url", f"http://127.0.0.1:{port}", *model, "--num-prompts", "3",
             "--random-input-len", "8", "--result-file", str(path), "--no-plot")
    out = capsys.readouterr()
    assert rc == 2 and not path.exists()
    assert "Load Test Result" not in out.out
    assert out.err.count("tpserve loadtest: error:") == 1 and "ConnectError" in out.err


def test_a_failing_initial_test_request_stops_the_test(tmp_path, capsys):
    """vLLM's "initial test run": the first prompt is sent once (max_tokens 1) before the
    run; when it fails, the test stops with its error and exit 2."""
    with run_fake_server(initial_test=False, fail_every=1) as server:
        rc, result, _ = small(server, tmp_path)
        assert server.stats.requests == 1 and server.stats.bodies[0]["max_tokens"] == 1
    assert rc == 2 and result is None
    assert "initial test request failed: HTTP 500: injected failure" in capsys.readouterr().err


def test_the_initial_test_request_sends_the_first_prompt_once(tmp_path):
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--ignore-eos", prompts=3)
        probe = server.stats.initial_test_body
        assert probe is not None and probe["max_tokens"] == 1
        assert probe["prompt"] in server.stats.prompts and server.stats.requests == 3
    assert rc == 0 and result["completed"] == 3


def test_a_request_over_the_timeout_fails(tmp_path):
    with run_fake_server(token_delay=0.05) as server:
        rc, result, _ = small(server, tmp_path, "--timeout", "0.3",
                              "--random-output-len", "40", prompts=2)
    assert rc == 1
    assert result["errors"] == [{"message": "timeout after 0.3s", "count": 2}]


def test_request_rate_with_burstiness_sends_every_prompt(tmp_path):
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--request-rate", "200", "--burstiness", "0.5",
                              "--seed", "3", prompts=15)
    assert rc == 0 and server.stats.requests == 15 and result["completed"] == 15
    assert result["request_rate"] == 200.0 and result["burstiness"] == 0.5


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_gaps_are_gamma_with_mean_one_over_rate(burstiness):
    offsets = arrival_offsets(20001, rate=10.0, burstiness=burstiness, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and len(offsets) == 20001
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.08)
    assert arrival_offsets(4, float("inf"), 1.0, 0) == [0.0] * 4
    assert arrival_offsets(5, 10.0, burstiness, 7) == arrival_offsets(5, 10.0, burstiness, 7)


def test_sweep_writes_one_result_per_rate(tmp_path):
    with run_fake_server() as server:
        rc, document, path = small(server, tmp_path, "--sweep-rates", "100,inf", prompts=5,
                                       plot=True)
        assert server.stats.requests == 10
        first_rate, second_rate = server.stats.prompts[:5], server.stats.prompts[5:]
    assert rc == 0
    assert document["sweep_rates"] == [100.0, "inf"]
    assert [r["request_rate"] for r in document["results"]] == [100.0, "inf"]
    assert all(r["completed"] == 5 for r in document["results"])
    assert not set(first_rate) & set(second_rate), "each rate gets fresh prompts"
    assert_valid_png(path.with_suffix(".png"))


def test_prefix_dataset_shares_the_prefix(tmp_path):
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--dataset", "prefix", "--prefix-len", "20",
                              "--random-input-len", "10", prompts=6)
        prompts = list(server.stats.prompts)
    assert rc == 0 and result["completed"] == 6
    assert result["input_lens"] == [30] * 6
    words = [p.split() for p in prompts]
    assert len({tuple(w[:19]) for w in words}) == 1, "19 words + BOS = the 20-token prefix"
    assert len({tuple(w[19:]) for w in words}) == 6, "the rest differs"


def test_prefix_repetition_shares_out_several_prefixes_in_a_shuffled_order(tmp_path):
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--dataset-name", "prefix-repetition",
                              "--prefix-repetition-prefix-len", "20",
                              "--prefix-repetition-suffix-len", "10",
                              "--prefix-repetition-num-prefixes", "3", prompts=8)
        prompts = list(server.stats.prompts)
    assert rc == 0 and result["completed"] == 8 and result["input_lens"] == [30] * 8
    assert result["num_prefixes"] == 3 and result["prefix_len"] == 20
    heads = [tuple(p.split()[:19]) for p in prompts]
    counts = sorted(heads.count(h) for h in set(heads))
    assert counts == [2, 3, 3]  # 8 prompts over 3 prefixes: 3, 3 and 2
    assert len({tuple(p.split()[19:]) for p in prompts}) == 8, "the rest differs"
    # shuffled, not round-robin: some prefix follows itself or skips the cycle's order
    assert [heads.index(h) for h in heads] != [i % 3 for i in range(8)]


def test_num_prefixes_needs_a_prefix_and_one_keeps_the_old_prompts():
    with pytest.raises(ConfigError, match="--prefix-repetition-num-prefixes needs a prefix"):
        config_from_args(parse("--prefix-repetition-num-prefixes", "2"))
    with pytest.raises(ConfigError, match="must be at least 1"):
        config_from_args(parse("--dataset-name", "prefix-repetition",
                               "--prefix-repetition-num-prefixes", "0"))
    one = config_from_args(parse("--dataset-name", "prefix-repetition",
                                 "--prefix-repetition-num-prefixes", "1"))
    assert one == config_from_args(parse("--dataset-name", "prefix-repetition"))


def test_file_dataset_sends_the_file_prompts(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "one two three", "output_len": 5}\n\n'
                    '{"prompt": "four five"}\n{"prompt": "six"}\n')
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--dataset", "file", "--dataset-path", str(data),
                              "--random-output-len", "7", "--ignore-eos", prompts=4)
        prompts = list(server.stats.prompts)
        max_tokens = [b["max_tokens"] for b in server.stats.bodies]
    assert rc == 0
    assert sorted(prompts) == sorted(["one two three", "four five", "six", "one two three"])
    assert sorted(max_tokens) == [5, 5, 7, 7]
    assert result["total_output_tokens"] == 24
    assert sorted(result["input_lens"]) == [2, 3, 4, 4]


def test_bad_dataset_file_is_a_clear_error(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--dataset", "file", "--dataset-path", str(data))
    assert rc == 2 and result is None
    assert f"{data}:2" in capsys.readouterr().err


@pytest.mark.parametrize("messages", [True, False])
def test_chat_endpoint(tmp_path, messages):
    with run_fake_server(tokenize_messages=messages) as server:
        rc, result, _ = small(server, tmp_path, "--endpoint", "chat", "--ignore-eos", prompts=4)
        body = server.stats.bodies[0]
    assert rc == 0 and result["completed"] == 4 and result["endpoint"] == "chat"
    assert body["messages"][0]["role"] == "user" and "prompt" not in body
    assert result["total_output_tokens"] == 24
    if messages:  # the server tokenizes messages: lengths include the chat template
        assert result["tokenizer"] == "server /tokenize (chat template included)"
        assert result["input_lens"] == [24] * 4
    else:  # only the message text is fitted
        assert result["tokenizer"] == "server /tokenize"
        assert result["input_lens"] == [24 + CHAT_TEMPLATE_TOKENS] * 4


def test_without_ignore_eos_tokens_come_from_usage(tmp_path):
    with run_fake_server(eos_after=3) as server:
        rc, result, _ = small(server, tmp_path, prompts=4)
        assert "ignore_eos" not in server.stats.bodies[0]
    assert rc == 0 and result["output_lens"] == [3] * 4 and result["total_output_tokens"] == 12


def test_without_tokenize_lengths_are_approximated(tmp_path):
    with run_fake_server(tokenize=False) as server:
        rc, result, _ = small(server, tmp_path, prompts=3)
    assert rc == 0 and result["completed"] == 3
    assert result["tokenizer"].startswith("approximate") and result["tokenizer_id"] is None
    assert all(abs(n - 24) <= 1 for n in result["input_lens"])


def test_api_key_flag_and_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with run_fake_server(api_key="sekret") as server:
        rc, _, _ = small(server, tmp_path, prompts=2, name="none.json")
        assert rc == 2 and "401" in capsys.readouterr().err
        rc, result, _ = small(server, tmp_path, "--api-key", "sekret", prompts=2)
        assert rc == 0 and result["completed"] == 2
        monkeypatch.setenv("OPENAI_API_KEY", "sekret")
        rc, result, _ = small(server, tmp_path, prompts=2, name="env.json")
        assert rc == 0 and result["completed"] == 2


def test_warmups_are_sent_but_not_measured(tmp_path):
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--num-warmups", "3", prompts=4)
    assert rc == 0 and server.stats.requests == 7 and result["completed"] == 4


def test_bad_flags_exit_2(tmp_path, capsys):
    assert run("--dataset", "file") == 2
    assert "--dataset-path" in capsys.readouterr().err
    assert run("--random-range-ratio", "1.5") == 2
    (tmp_path / "file").write_text("")
    assert run("--result-file", str(tmp_path / "file" / "r.json")) == 2
    assert "cannot create its folder" in capsys.readouterr().err


def test_cancelling_a_run_keeps_what_was_measured(tmp_path):
    with run_fake_server(token_delay=0.01) as server:
        config = config_from_args(parse(
            "--base-url", server.base_url, "--num-prompts", "40", "--request-rate", "40",
            "--random-input-len", "8", "--random-output-len", "10"))

        async def interrupt_after_some_requests():
            stop = asyncio.Event()

            async def watch():
                while server.stats.requests < 6:
                    await asyncio.sleep(0.01)
                stop.set()

            watcher = asyncio.create_task(watch())
            session = await run_session(config, stop)
            await watcher
            return session

        session = asyncio.run(interrupt_after_some_requests())
    assert session.interrupted
    (record,) = session.records
    assert record.interrupted and record.not_sent > 0
    assert len(record.results) + record.cancelled + record.not_sent == 40
    document = build_document(config, session)
    assert document["interrupted"] is True
    assert document["completed"] + document["cancelled"] + document["not_sent"] == 40
    assert write_plot(document, tmp_path / "partial.png")
    assert_valid_png(tmp_path / "partial.png")


def test_ctrl_c_writes_partial_results(tmp_path):
    path = tmp_path / "partial.json"
    with run_fake_server(token_delay=0.01) as server:
        process = subprocess.Popen(
            [sys.executable, "-m", "tpserve.loadtest", "--base-url", server.base_url,
             "--num-prompts", "200", "--request-rate", "20", "--random-input-len", "8",
             "--random-output-len", "20", "--result-file", str(path), "--no-progress"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            deadline = time.monotonic() + 60
            while server.stats.requests < 5 and process.poll() is None:
                assert time.monotonic() < deadline, "the load test sent no requests"
                time.sleep(0.02)
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=60)
        finally:
            process.kill()
    assert process.returncode == 130, err
    assert "Interrupted" in out
    result = json.loads(path.read_text())
    assert result["interrupted"] is True
    assert result["completed"] + result["failed"] + result["cancelled"] + result["not_sent"] == 200
    assert result["not_sent"] > 0
    assert_valid_png(path.with_suffix(".png"))


def test_missing_matplotlib_skips_only_the_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with run_fake_server() as server:
        rc, result, path = small(server, tmp_path, prompts=2, plot=True)
    assert rc == 0 and result["completed"] == 2
    assert not path.with_suffix(".png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_sse_parser_follows_the_event_stream_rules():
    async def lines():
        for line in [": comment", "data: {\"a\":", "data: 1}", "", "event: error",
                     "data: x", "", "", "data: [DONE]"]:
            yield line

    async def collect():
        return [e async for e in iter_events(lines())]

    assert asyncio.run(collect()) == [
        SSEEvent(data='{"a":\n1}'), SSEEvent(data="x", event="error"), SSEEvent(data="[DONE]"),
    ]


def test_old_and_new_flag_names_parse_to_the_same_config(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "one two three"}\n')
    pairs = [
        (("--dataset", "prefix", "--prefix-len", "20", "--result-file", str(tmp_path / "r.json")),
         ("--dataset-name", "prefix-repetition", "--random-prefix-len", "20", "--save-result",
          "--result-dir", str(tmp_path), "--result-filename", "r.json")),
        (("--dataset", "prefix"), ("--dataset-name", "shared-prefix")),
        (("--dataset", "file", "--dataset-path", str(data)),
         ("--dataset-name", "custom", "--dataset-path", str(data))),
        (("--dataset", "random"), ()),
    ]
    for old, new in pairs:
        assert config_from_args(parse(*old)) == config_from_args(parse(*new)), (old, new)
    config = config_from_args(parse("--dataset-name", "prefix-repetition"))
    assert config.dataset == "prefix-repetition" and config.prefix_len == 256
    config = config_from_args(parse())
    assert config.dataset == "random" and config.prefix_len == 0 and config.result_file is None
    assert config.percentile_metrics == ("ttft", "tpot", "itl")
    assert config.metric_percentiles == (99.0,)


def test_save_result_without_a_name_uses_vllms_pattern(tmp_path):
    with run_fake_server() as server:
        rc = run("--base-url", server.base_url, "--num-prompts", "2", "--random-input-len", "8",
                 "--random-output-len", "3", "--max-concurrency", "2", "--save-result",
                 "--result-dir", str(tmp_path / "out"), "--no-plot")
    assert rc == 0
    [path] = (tmp_path / "out").iterdir()
    assert path.name.startswith("tpserve-infqps-concurrency2-") and path.suffix == ".json"
    assert json.loads(path.read_text())["completed"] == 2


def words(n: int, word: str = "w") -> str:
    return " ".join([word] * n)


def sharegpt_file(path: Path) -> Path:
    """Conversations whose lengths sit on both sides of vLLM's filter (fake server: one token
    per word plus BOS for a prompt, one per word for an answer)."""
    def conv(*turns):
        return {"conversations": [{"from": who, "value": text} for who, text in turns]}

    data = [
        conv(("human", words(5, "a")), ("gpt", words(4))),          # 6 + 4: kept
        conv(("human", words(2, "b")), ("gpt", words(9))),          # prompt 3 < 4: dropped
        conv(("human", words(3, "c")), ("gpt", words(3))),          # answer 3 < 4: dropped
        conv(("human", words(1024, "d")), ("gpt", words(4))),       # prompt 1025 > 1024
        conv(("human", words(1023, "e")), ("gpt", words(1025))),    # 1024 + 1025 > 2048
        conv(("human", words(1023, "f")), ("gpt", words(1024))),    # 1024 + 1024: kept
        conv(("gpt", words(9)), ("human", words(4, "g")), ("gpt", words(6))),  # kept: 5 + 6
        conv(("human", words(8, "h"))),                             # no answer: not a pair
        {"id": "no conversations"},
    ]
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_dataset_filters_like_vllm(tmp_path):
    data = sharegpt_file(tmp_path / "sharegpt.json")
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--dataset-name", "sharegpt", "--dataset-path",
                              str(data), "--ignore-eos", prompts=3)
        prompts = sorted(p.split()[0] for p in server.stats.prompts)
        max_tokens = sorted(b["max_tokens"] for b in server.stats.bodies)
    assert rc == 0 and result["completed"] == 3
    assert prompts == ["a", "f", "g"]
    assert max_tokens == [4, 6, 1024]
    assert sorted(result["input_lens"]) == [5, 6, 1024]


def test_sharegpt_output_len_replaces_the_answer_length(tmp_path):
    data = sharegpt_file(tmp_path / "sharegpt.json")
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--dataset-name", "sharegpt", "--dataset-path",
                              str(data), "--sharegpt-output-len", "10", "--ignore-eos",
                              prompts=7)
        prompts = sorted(p.split()[0] for p in server.stats.prompts)
        max_tokens = [b["max_tokens"] for b in server.stats.bodies]
    assert rc == 0 and result["completed"] == 7
    # the answer is not checked; c (4 + 10) and e (1024 + 10) now pass; 5 kept, 2 repeated
    assert sorted(set(prompts)) == ["a", "c", "e", "f", "g"]
    assert len(prompts) == 7 and max_tokens == [10] * 7


def test_sharegpt_file_without_usable_pairs_is_a_clear_error(tmp_path, capsys):
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([{"conversations": [{"from": "human", "value": "a b"},
                                                   {"from": "gpt", "value": "c d e f"}]}]))
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--dataset-name", "sharegpt",
                              "--dataset-path", str(data))
    assert rc == 2 and result is None
    assert "no conversation passes the ShareGPT length filter" in capsys.readouterr().err


def test_percentile_flags_choose_the_keys_and_rows(tmp_path, capsys):
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--percentile-metrics", "ttft,e2el",
                              "--metric-percentiles", "50,99", prompts=4)
    assert rc == 0 and result["completed"] == 4
    percentile_keys = {k for k in result if k[0] == "p" and k[1].isdigit() and k.endswith("_ms")}
    assert percentile_keys == {"p50_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "p99_e2el_ms"}
    assert "p99_tpot_ms" not in result
    assert result["p50_ttft_ms"] <= result["p99_ttft_ms"]
    assert result["percentile_metrics"] == "ttft,e2el" and result["metric_percentiles"] == "50,99"
    table = capsys.readouterr().out
    rows = [line.split(":")[0] for line in table.splitlines() if "(ms):" in line]
    assert rows == ["Mean TTFT (ms)", "Median TTFT (ms)", "P50 TTFT (ms)", "P99 TTFT (ms)",
                    "Mean E2EL (ms)", "Median E2EL (ms)", "P50 E2EL (ms)", "P99 E2EL (ms)"]


def test_progress_off_a_terminal_is_lines_not_a_bar():
    """A pipe or a CI log gets a line at most every LINE_EVERY_S seconds and one at the end
    (no carriage returns); ``--no-progress`` writes nothing."""
    import io

    from tpserve.loadtest.runner import LINE_EVERY_S, RunProgress

    now = [0.0]
    out = io.StringIO()
    progress = RunProgress(4, "rate inf", True, stream=out, clock=lambda: now[0])
    for step in (1.0, LINE_EVERY_S, 1.0, 1.0):
        now[0] += step
        progress.update()
    progress.close()
    assert out.getvalue() == ("[loadtest] rate inf: 2/4 requests done, 6.0 s\n"
                              "[loadtest] rate inf: 4/4 requests done, 8.0 s\n")
    quiet = io.StringIO()
    silent = RunProgress(2, None, False, stream=quiet)
    silent.update()
    silent.close()
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", "content"])
def test_chat_times_every_chunk_with_choices_thinking_included(tmp_path, field):
    """Chunks whose delta carries thinking (vLLM's ``reasoning``, or ``reasoning_content``)
    are timed as any token: TTFT at the first, an ITL per later one; the opening chunk
    that only announces the role is not."""
    with run_fake_server(chat_field=field) as server:
        rc, result, _ = small(server, tmp_path, "--endpoint", "chat", "--ignore-eos",
                              prompts=3)
    assert rc == 0 and result["completed"] == 3
    assert [len(x) for x in result["itls"]] == [5, 5, 5]
    assert result["output_lens"] == [6, 6, 6]
    assert all(0 < t <= e for t, e in zip(result["ttfts"], result["e2els"], strict=True))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_without_usage_input_tokens_are_the_fitted_length(tmp_path, endpoint):
    """A stream with no usage chunk: the input tokens are the length /tokenize fitted the
    prompt to, the output tokens the timed chunks."""
    with run_fake_server(include_usage=False) as server:
        rc, result, _ = small(server, tmp_path, "--endpoint", endpoint, "--ignore-eos",
                              prompts=3)
    assert rc == 0 and result["requests_without_usage"] == 3
    assert result["input_lens"] == [24] * 3 and result["total_input_tokens"] == 72
    assert result["output_lens"] == [6] * 3


def test_without_usage_file_prompts_count_as_the_counter_says(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a b c"}\n{"prompt": "d e f g h"}\n')
    with run_fake_server(include_usage=False) as server:
        rc, result, _ = small(server, tmp_path, "--dataset-name", "custom", "--dataset-path",
                              str(data), "--max-concurrency", "1", prompts=2)
    assert rc == 0
    # the fake's /tokenize: one token a word plus BOS
    assert sorted(result["input_lens"]) == [4, 6] and result["total_input_tokens"] == 10


def test_a_stream_without_any_choice_is_a_failed_request(tmp_path):
    with run_fake_server(no_choices=True) as server:
        rc, result, _ = small(server, tmp_path, prompts=2)
    assert rc == 1 and result["completed"] == 0 and result["failed"] == 2
    assert result["errors"] == [
        {"message": "Never received a valid chunk to calculate TTFT", "count": 2}]


@pytest.mark.parametrize(("flags", "endpoint", "key", "backend"), [
    (("--backend", "openai-chat", "--endpoint", "/v1/chat/completions"), "chat", "messages",
     "openai-chat"),
    (("--backend", "openai"), "completions", "prompt", "openai"),
    (("--endpoint", "/v1/completions"), "completions", "prompt", "openai"),
    (("--endpoint", "chat"), "chat", "messages", "openai-chat"),
    (("--backend", "vllm", "--endpoint", "/v1/completions"), "completions", "prompt", "vllm"),
])
def test_vllm_spellings_of_the_request_kind(tmp_path, flags, endpoint, key, backend):
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, *flags, "--disable-tqdm", prompts=1)
        assert key in server.stats.bodies[0]
    assert rc == 0 and result["endpoint"] == endpoint
    assert result["backend"] == result["endpoint_type"] == backend  # as vLLM's result


def test_metadata_pairs_are_keys_of_the_result(tmp_path):
    """vLLM's --metadata KEY=VALUE: split at the first '=', stripped; the run's own keys
    win over a pair of the same name."""
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--metadata", "gpu=H200", " tp = 2 ",
                              "flags=--a=b", "seed=9", prompts=1)
    assert rc == 0
    assert (result["gpu"], result["tp"], result["flags"]) == ("H200", "2", "--a=b")
    assert result["seed"] == 0
    for bad in ("gpu", "=H200"):
        with pytest.raises(ConfigError, match="--metadata items are KEY=VALUE"):
            config_from_args(parse("--metadata", bad))


def test_vllm_flag_spellings_parse_to_the_same_config(tmp_path):
    vllm = config_from_args(parse("--backend", "openai-embeddings", "--endpoint",
                                  "/v1/embeddings", "--input-len", "32", "--disable-tqdm"))
    ours = config_from_args(parse("--endpoint", "embeddings", "--random-input-len", "32"))
    assert vllm == ours and vllm.progress is False
    lengths = config_from_args(parse("--input-len", "7", "--output-len", "9"))
    assert (lengths.random_input_len, lengths.random_output_len) == (7, 9)
    with pytest.raises(ConfigError, match="--backend openai-chat"):
        config_from_args(parse("--backend", "openai-chat", "--endpoint", "completions"))
    with pytest.raises(SystemExit):
        parse("--endpoint", "/v1/rerank")


def test_goodput_counts_the_requests_within_every_objective(tmp_path, capsys):
    with run_fake_server() as server:
        rc, result, _ = small(server, tmp_path, "--goodput", "e2el:0", prompts=2)
        assert rc == 0 and result["request_goodput"] == 0.0
        assert result["goodput"] == {"e2el": 0.0}
        rc, result, _ = small(server, tmp_path, "--goodput", "ttft:1e9", "tpot:1e9",
                              "e2el:1e9", prompts=2, name="all.json")
    assert rc == 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert "Request goodput (req/s):" in capsys.readouterr().out


def test_without_goodput_the_key_is_null_and_no_row(basic_run, capsys):
    _, result, _, _ = basic_run
    assert result["request_goodput"] is None and result["goodput"] is None


@pytest.mark.parametrize("value", ["ttft", "itl:5", "ttft:x", "e2el:-1"])
def test_bad_goodput_is_a_config_error(value):
    with pytest.raises(ConfigError, match="--goodput"):
        config_from_args(parse("--goodput", value))
