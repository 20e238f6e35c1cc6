"""Tensor-parallel serving through real server processes: tp 3 answers exactly like tp 1,
so do tp 2 and tp 4 (SmolLM2's 9 query / 3 KV heads zero-padded to 12 / 4; tp 4 sequence
parallel), two torchrun "nodes" answer exactly like tp 1, and a rank that dies mid-request ends every
request with an explicit error and makes the server exit non-zero (never a hang)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.serverproc import SMALL, ServerProcess, new_port, stopped_on_exit, wait_healthy
from tpserve.loadtest.memory.report import format_table
from tpserve.model.fault import FAULT_ENV

SMOL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]
CHATS = ["Name three colours.", "What is 7 times 8?"]
TINY_FLAGS = ("--kv-cache-memory", "16MiB", "--served-model-name", "tiny", "--check-integrity")
# the tiny model's vocabulary is 256 ids: prompts are token-id lists below 256
TOKEN_PROMPTS = [[5, 9, 13, 200], [3, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12], [42]]


def _client(base: str, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                         timeout=timeout)


def _smol_answers(base: str) -> list[str]:
    """Greedy completions and chats of 16 tokens, sent concurrently (batched), then the
    ranks of PROMPTS[0]'s tokens as its echo scores them (vLLM's prompt_logprobs: the LM
    head's rows for every prompt position, through each tp layout's all-gather)."""
    c = _client(base)

    def complete(p: str) -> str:
        return c.completions.create(model=SMOL, prompt=p, max_tokens=16,
                                    temperature=0).choices[0].text

    def chat(m: str) -> str:
        return c.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": m}],
                                         max_tokens=16, temperature=0
                                         ).choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS) + len(CHATS)) as pool:
        futures = [pool.submit(complete, p) for p in PROMPTS]
        futures += [pool.submit(chat, m) for m in CHATS]
        answers = [f.result(timeout=300) for f in futures]
    scored = c.completions.create(model=SMOL, prompt=PROMPTS[0], max_tokens=0, echo=True,
                                  extra_body={"prompt_logprobs": 0}).choices[0]
    ranks = [next(iter(e.values()))["rank"] for e in scored.model_extra["prompt_logprobs"][1:]]
    return answers + [f"ranks {ranks}"]


def _tiny_answers(base: str) -> list[tuple[str, list[str], list[float]]]:
    """Greedy text, token strings and their logprobs of the tiny model (16 tokens each),
    then the second prompt echoed and scored (prompt logprobs: the vocab-parallel head's
    all-gather on every rank for the scored rows)."""
    c = _client(base)
    out = []
    for p in TOKEN_PROMPTS:
        r = c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                 logprobs=1, extra_body={"ignore_eos": True}).choices[0]
        assert r.finish_reason == "length" and len(r.logprobs.tokens) == 16
        out.append((r.text, r.logprobs.tokens, r.logprobs.token_logprobs))
    r = c.completions.create(model="tiny", prompt=TOKEN_PROMPTS[1], max_tokens=0, echo=True,
                             logprobs=2).choices[0]
    assert len(r.logprobs.tokens) == len(TOKEN_PROMPTS[1])
    out.append((r.text, r.logprobs.tokens, r.logprobs.token_logprobs[1:]))
    return out


def _assert_same_tiny_answers(got, want) -> None:
    for (text, tokens, lps), (ref_text, ref_tokens, ref_lps) in zip(got, want, strict=True):
        assert (text, tokens) == (ref_text, ref_tokens)
        assert lps == pytest.approx(ref_lps, abs=1e-4)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def smol_servers(small_server):
    """The module's SmolLM2 servers at tp 1 and tp 3 (both layouts), started together (see
    ServerProcess); the fixtures below wait for theirs. tp 1 is the session's SMALL server
    (tests/conftest.py), shared with test_against_tpserve: a load test of random prompts
    that only reads its own answers."""
    with stopped_on_exit({
        "tp3": ServerProcess(*SMALL, "--tensor-parallel-size", "3", "--no-engine-process",
                             wait=False),
        "tp3-engine-process": ServerProcess(*SMALL, "--tensor-parallel-size", "3",
                                            "--engine-process", wait=False),
    }) as started:
        yield {"tp1": small_server, **started}


@pytest.fixture(scope="module")
def smol_tp1(smol_servers):
    return smol_servers["tp1"].wait_until_healthy()


@pytest.fixture(scope="module")
def tp1_answers(smol_tp1):
    """The tp 1 server's ``_smol_answers``, asked once: what every other tp size and
    layout below must serve exactly."""
    want = _smol_answers(smol_tp1.base)
    assert all(want) and want[0].startswith(" Paris")
    assert want[-1].startswith("ranks [") and want[-1] != "ranks []"
    return want


@pytest.fixture(scope="module")
def smol_tp3(smol_servers):
    s = smol_servers["tp3"].wait_until_healthy()
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def smol_tp3_engine_process(smol_servers):
    s = smol_servers["tp3-engine-process"].wait_until_healthy()
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smollm2_tokenizer) -> str:
    """The tiny random Llama as a sharded Hugging Face folder, with SmolLM2's tokenizer
    (its first 256 ids are the tiny vocabulary) so that it can be served."""
    from tests.model.test_tiny_models import _hf_model
    from tests.model.util import save_hf_folder

    folder = save_hf_folder(_hf_model("llama"), tmp_path_factory.mktemp("tiny-llama"))
    smollm2_tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_reference(tiny_folder):
    """The tp 1 server's answers for ``TOKEN_PROMPTS``."""
    s = ServerProcess(tiny_folder, *TINY_FLAGS)
    try:
        return _tiny_answers(s.base)
    finally:
        assert s.stop() == 0, s.output()


# -------------------------------------------------------------------------- tp 3 = tp 1
@pytest.mark.parametrize("tp3", ["smol_tp3", "smol_tp3_engine_process"],
                         ids=["in-process", "engine-process"])
def test_tp3_serves_the_same_greedy_text_as_tp1(tp1_answers, tp3, request):
    assert _smol_answers(request.getfixturevalue(tp3).base) == tp1_answers


def test_tp3_streaming_equals_tp1(smol_tp1, smol_tp3):
    def streamed(base: str) -> str:
        chunks = _client(base).completions.create(model=SMOL, prompt=PROMPTS[1], max_tokens=16,
                                                  temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks)

    assert streamed(smol_tp3.base) == streamed(smol_tp1.base) != ""


# ------------------------------------------------------------ nothing listens off loopback
LOOPBACK_IPS = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


@pytest.mark.parametrize("tp3,num_procs", [("smol_tp3", 3), ("smol_tp3_engine_process", 4)],
                         ids=["in-process", "engine-process"])
def test_only_the_http_port_listens_beyond_loopback(tp3, num_procs, request):
    """The rendezvous store and gloo's sockets of a spawned group stay on 127.0.0.1 (torch's
    TCPStore would listen on every interface, unauthenticated, for the server's life)."""
    import psutil

    server = request.getfixturevalue(tp3)
    root = psutil.Process(server.proc.pid)
    ranks = [p for p in [root, *root.children(recursive=True)]
             if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(ranks) == num_procs, [p.cmdline() for p in ranks]  # HTTP, engine?, 2 workers
    listening = {p.pid: [c.laddr for c in p.net_connections("inet")
                         if c.status == psutil.CONN_LISTEN] for p in ranks}
    exposed = [(pid, a) for pid, addrs in listening.items() for a in addrs
               if a.ip not in LOOPBACK_IPS and a.port != server.port]
    assert exposed == [], listening
    # every rank does listen (gloo's pairs), on loopback
    assert all(listening[p.pid] for p in ranks if p.pid != root.pid or num_procs == 3)


# ------------------------------------------------------ tp 2 and 4: zero-padded heads = tp 1
@pytest.mark.parametrize("tp,tp_comm", [(2, "allreduce"), (4, "allgather")])
def test_padded_heads_serve_the_same_greedy_text_as_tp1(tp1_answers, tp, tp_comm):
    """tp 4 also runs sequence parallel (--tp-comm allgather), and tp 2 streams its last
    layers' weights from host memory (--cpu-offload-gb: a rank's layer is 7.3 MiB, 5 of them
    leave the device for the 0.02 GiB asked), so the flags are tested from the command line
    to every rank without another server start-up."""
    # one server at a time (not a module fixture): tp 4 is four processes on two cores
    offload = ("--cpu-offload-gb", "0.02") if tp == 2 else ()
    server = ServerProcess(*SMALL, "--tensor-parallel-size", str(tp), "--tp-comm", tp_comm,
                           "--no-engine-process", *offload, log_level="info")
    try:
        assert _smol_answers(server.base) == tp1_answers
        assert (f"tp {tp}: padding 9 q heads -> 12, 3 KV heads -> 4 (+33% attention FLOPs "
                "and KV cache per rank)") in server.output()
        report = httpx.get(server.base + "/memory", timeout=10).json()
        streamed = report["weights_offloaded"]
        if not offload:
            assert streamed is None
            return
        slot = streamed["slot_bytes"]
        assert streamed == {"layers": [25, 29], "host_bytes": 5 * slot, "slots": 2,
                            "slot_bytes": slot, "pinned": False}
        assert (f"weights offloaded: the last 5 decoder layers (25-29), "
                f"{5 * slot / 2**30:.2f} GiB of host memory, streamed through 2 device "
                f"slots of {slot / 2**20:.1f} MiB each forward") in server.output()
        assert ("weights offloaded to host memory: 0.04 GiB a rank, decoder layers 25-29 "
                "streamed through 2 device slots of 0.007 GiB") in format_table(report)
    finally:
        assert server.stop() == 0, server.output()


# --------------------------------------------------------------------- torchrun, 2 nodes
class TorchrunNodes:
    """``tpserve serve`` at tp 2 as two torchrun "nodes" of one process each, rendezvousing
    over c10d on loopback. Both get the same --port; only rank 0 serves HTTP."""

    def __init__(self, folder: str, logs: Path, timeout: float = 240):
        endpoint = f"127.0.0.1:{new_port()}"
        self.port = new_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
               "--rdzv-id", f"tpserve-test-{self.port}",
               "-m", "tpserve.cli", "serve", folder, "--tensor-parallel-size", "2",
               "--port", str(self.port), "--log-level", "warning", *TINY_FLAGS]
        self.logs = [logs / f"node{i}.log" for i in range(2)]
        self.procs: list[subprocess.Popen] = []
        self._workers: set[int] = set()
        for log in self.logs:
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))

        def exited() -> str | None:
            if all(p.poll() is None for p in self.procs):
                return None
            return f"a torchrun node exited: {self.returncodes()}\n{self.output()}"

        try:
            wait_healthy(self.base, exited, timeout)
        except BaseException:
            self.kill()
            raise

    def returncodes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def output(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')}"
                         for log in self.logs if log.exists())

    def worker_pids(self) -> dict[int, int]:
        """RANK -> pid of the tpserve process each (live) torchrun agent started."""
        ranks = {}
        for p in self.procs:
            with contextlib.suppress(OSError):  # the agent or its worker is gone
                children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
                for child in children:
                    env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                    rank = [e[5:] for e in env if e.startswith(b"RANK=")]
                    if rank:
                        ranks[int(rank[0])] = int(child)
        self._workers.update(ranks.values())
        return ranks

    def wait(self, timeout: float) -> list[int | None]:
        """Exit statuses, None for a node still running after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        return self.returncodes()

    def kill(self) -> None:
        """Kills whatever is left of both nodes: the workers (torchrun starts each in its own
        session, so they would outlive a killed agent), then the agents."""
        self.worker_pids()
        for pid in self._workers:
            with contextlib.suppress(OSError):  # gone already
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if str(self.port).encode() in cmdline:  # still our worker, not a reused pid
                    os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.mark.slow
def test_torchrun_two_nodes_serve_like_tp1(tiny_folder, tiny_reference, tmp_path):
    nodes = TorchrunNodes(tiny_folder, tmp_path)
    try:
        _assert_same_tiny_answers(_tiny_answers(nodes.base), tiny_reference)
        pids = nodes.worker_pids()
        assert sorted(pids) == [0, 1]
        # A clean stop: SIGTERM to the serving process (rank 0). It tells rank 1 to shut
        # down, both exit 0, and so both torchrun agents exit 0. (SIGTERM to rank 0's
        # torchrun agent instead makes that agent exit 1 by torchrun's own design.)
        os.kill(pids[0], signal.SIGTERM)
        assert nodes.wait(timeout=60) == [0, 0], nodes.output()
    finally:
        nodes.kill()


# -------------------------------------------------------------------------- worker death
FAULT_STEP = 60  # rank 1 fails at its 60th step: both requests below are running by then


def _health_status(base: str) -> int | None:
    """/health's status, or None when nothing answers any more (the process is gone)."""
    try:
        return httpx.get(base + "/health", timeout=10).status_code
    except httpx.TimeoutException:
        raise
    except httpx.TransportError:
        return None


@pytest.mark.slow
@pytest.mark.parametrize("kind,rank,flags", [
    ("raise", 1, ("--no-engine-process",)), ("exit", 1, ("--no-engine-process",)),
    ("raise", 1, ("--engine-process",)), ("exit", 1, ("--engine-process",)),
    ("exit", 0, ("--engine-process",)),  # the engine process itself dies
], ids=["raise", "exit", "raise-engine-process", "exit-engine-process",
        "engine-process-exits"])
def test_worker_death_fails_requests_and_exits_nonzero(tiny_folder, kind, rank, flags):
    s = ServerProcess(tiny_folder, "--tensor-parallel-size", "2", *TINY_FLAGS, *flags,
                      env={FAULT_ENV: f"{rank}:{FAULT_STEP}:{kind}"})
    try:
        body = {"model": "tiny", "prompt": TOKEN_PROMPTS[0], "max_tokens": 240,
                "temperature": 0, "ignore_eos": True}
        stream = _client(s.base, timeout=60).completions.create(
            stream=True, **{k: v for k, v in body.items() if k != "ignore_eos"},
            extra_body={"ignore_eos": True})
        chunks = iter(stream)
        assert next(chunks).choices[0].text is not None  # the stream is running
        result: dict[str, object] = {}

        def non_streaming() -> None:
            try:
                result["response"] = httpx.post(s.base + "/v1/completions", json=body,
                                                timeout=60)
            except Exception as exc:  # noqa: BLE001 - asserted on below
                result["response"] = exc

        thread = threading.Thread(target=non_streaming)
        thread.start()
        with pytest.raises(openai.APIError) as stream_error:
            for _ in chunks:
                pass
        err = stream_error.value
        # an error event in the stream, not a dropped connection or a timeout
        assert not isinstance(err, openai.APIConnectionError), repr(err)
        assert err.body["type"] in ("service_unavailable", "internal_error"), err.body
        assert "failed" in err.message

        thread.join(timeout=90)
        assert not thread.is_alive()
        r = result["response"]
        assert isinstance(r, httpx.Response), repr(r)
        assert r.status_code >= 500, r.text
        error = r.json()["error"]
        assert error["message"] and error["type"] in ("service_unavailable", "internal_error")

        assert _health_status(s.base) in (503, None)
        # exits by itself, with status 1 (not a hang, not an abort by a signal)
        assert s.proc.wait(timeout=60) == 1, s.output()
        assert "exiting with status 1" in s.output()
    finally:
        s.stop()
