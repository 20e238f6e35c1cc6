"""Shared fixtures: the embedded SmolLM2 GGUF, its converted tokenizer and its Hugging Face
reference; the tiny Llama's checkpoint folder; servers of one configuration that several
modules use. And how pytest-xdist (the ``-n 2`` of pyproject's addopts) runs the suite."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated: set before any module imports triton,
    # so every kernel module is built for the CPU interpreter whichever test (or library,
    # such as PEFT) imports it first. The kernel test modules set it too, for a lone run.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tpserve.model.loader.checkpoint import embedded_model_path  # noqa: E402

# ------------------------------------------------------------------------------ xdist
# Modules that share a session-scoped server (below) form one unit of work, so that one
# worker runs them all and starts that server once.
SHARED_SERVER_UNITS = {
    "tests/loadtest/test_against_tpserve.py": "small_server",
    "tests/server/test_tp_serving.py": "small_server",
    "tests/server/test_batching.py": "small_server_8_seqs",
    "tests/server/test_tools_server.py": "small_server_8_seqs",
    "tests/server/test_engine_query.py": "small_server_tp2",
    "tests/server/test_memory_server.py": "small_server_tp2",
    "tests/server/test_sleep_server.py": "small_server_tp2",
}
# The longest units (25 s to 5.5 min each under -n 2 on two cores), longest first: handed
# out before all others, so that the run does not end with one worker busy on one of them
# while the other has nothing left to do; the units left after them take under 25 s each.
# Speed only: a unit not listed just goes out later. Times of a whole run (--durations
# and each unit's first start to last finish), rounded.
LONG_UNITS = (
    "small_server",  # test_tp_serving and test_against_tpserve: 325 s
    "tests/server/test_structured_server.py",  # 170 s
    "tests/model/test_smollm2.py",  # 135 s
    "tests/model/test_triton_fp8_kv.py",  # 115 s
    "tests/server/test_soak.py",  # 115 s
    "tests/server/test_schemathesis.py",  # 100 s
    "tests/model/test_hopper_compile.py",  # 90-130 s on a cold Triton cache (CI's)
    "small_server_8_seqs",  # test_batching and test_tools_server: 95 s
    "tests/server/test_resilience.py",  # 75 s
    "tests/test_cli.py",  # 75 s
    "small_server_tp2",  # test_engine_query, test_memory_server, test_sleep_server: 105 s
    "tests/model/test_triton_kernels.py",  # 70 s
    "tests/server/test_server_e2e.py",  # 50 s
    "tests/server/test_fp8_checkpoint_server.py",  # 45 s
    "tests/server/test_int_checkpoint_server.py",  # 45 s
    "tests/server/test_gguf_integer_server.py",  # 45 s
    "tests/model/test_tokenizer_cache.py",  # 40 s
    "tests/server/test_first_contact.py",  # 40 s
    "tests/model/test_tiny_models.py",  # 40 s
    "tests/server/test_reasoning_server.py",  # 31 s
    "tests/server/test_priority_server.py",  # 31 s
    "tests/server/test_fp8_serving.py",  # 30 s
    "tests/server/test_fp8_kv_server.py",  # 30 s
    "tests/parallel/test_layers.py",  # 30 s
    "tests/server/test_engine_metrics.py",  # 30 s
    "tests/model/test_fp8.py",  # 25 s
    "tests/model/test_sequence_parallel.py",  # 25 s
    "tests/model/test_dummy_weights.py",  # 25 s
    "tests/model/test_fp8_kernels.py",  # 25 s
)


def _cores_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


def pytest_configure(config):
    """Under pytest-xdist each worker gets its share of the cores for torch's intra-op
    threads: two workers of two threads each on two cores spend much of a parallel region
    waiting for a thread the other worker holds (model tests ran up to 4 x slower). A run
    without xdist keeps torch's default.

    The same share goes to every other thread pool, through OMP_NUM_THREADS (unless it is
    set already), which the xdist controller sets before it starts the workers, so that
    they and every process they start inherit it: OpenBLAS's in the workers' numpy (the
    Triton interpreter's dots), read once when numpy loads, and torch's in the servers and
    torchrun "nodes" the tests start (SmolLM2's decode step of 16 sequences took 2.7 x as
    long at two threads as at one while a second process ran the same). Spawned ranks set
    their own counts."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(_cores_per_worker(int(workers)))
        return
    planned = config.getoption("numprocesses", None)  # the controller, before its workers
    if isinstance(planned, int) and planned > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(_cores_per_worker(planned)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (one file is one unit of work, so a module's servers start once),
    with SHARED_SERVER_UNITS' modules together and LONG_UNITS handed out first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_SERVER_UNITS.get(path, path)

        def _assign_work_unit(self, node) -> None:
            for unit in reversed(LONG_UNITS):  # LONG_UNITS[0] ends up first in the queue
                if unit in self.workqueue:
                    self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return Scheduling(config, log)


@pytest.fixture(scope="session")
def smollm2_path():
    return embedded_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    d, name = str(smollm2_path.parent), smollm2_path.name
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return model, smollm2_tokenizer


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """The tiny Llama of ``tests/model/test_tiny_models`` (seeded, float32) as a Hugging Face
    folder, written once per session and shared: read-only (a test that changes a checkpoint
    writes its own copy)."""
    from tests.model.test_tiny_models import _hf_model
    from tests.model.util import save_hf_folder

    return str(save_hf_folder(_hf_model("llama"), tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """The GGUF's tokenizer as transformers converts it from the file (not tpserve's
    tokenizer cache). The conversion takes seconds on two cores, so it is done once per
    session and shared: no test changes a tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


# ------------------------------------------------------------------------ shared servers
# Each is started once per session (its users are one xdist unit: SHARED_SERVER_UNITS),
# without waiting: a module that starts servers of its own starts them all before it waits
# for the first (see tests/server/serverproc.ServerProcess), so users call
# ``wait_until_healthy()``. Every user only sends requests and asserts on its own answers,
# or on metrics as differences, and leaves the server idle, so no test sees another's.
# Stopped (exit 0 asserted) at the end of the session.
def _shared_server(*args: str):
    from tests.server.serverproc import SMALL, ServerProcess

    s = ServerProcess(*SMALL, *args, wait=False)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="session")
def small_server():
    """SMALL alone: test_tp_serving's tp 1 reference and test_against_tpserve's load test."""
    yield from _shared_server()


@pytest.fixture(scope="session")
def small_server_8_seqs():
    """SMALL with --max-num-seqs 8: test_batching and test_tools_server's plain server."""
    yield from _shared_server("--max-num-seqs", "8")


@pytest.fixture(scope="session")
def small_server_tp2():
    """SMALL at --tensor-parallel-size 2 (engine process) with --enable-sleep-mode:
    test_engine_query's queries across the engine process pipe, test_memory_server's
    per-rank report and metrics, test_sleep_server's sleeps (each leaves it awake)."""
    yield from _shared_server("--tensor-parallel-size", "2", "--enable-sleep-mode")
