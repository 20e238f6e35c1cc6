"""``tpserve soak``: many mixed requests, some cut off by the client; then the server must be idle.

The soak sends ``--num-requests`` requests (after a warm-up) with ``--concurrency`` in
flight: random-word prompts of 1..``--max-prompt-words`` (300) words, max_tokens
1..``--max-tokens`` (64), completions and chat, streamed and whole, some with ``n=2``,
some with stop strings, and a fraction that the client aborts at a random moment (closing
the stream after a random number of events, or cancelling the request task after a random
delay). It then checks that

* every request ended with a full answer (each choice has finish_reason ``stop`` or
  ``length``, usage is sane, a stream ends with ``data: [DONE]``) or with an explicit
  error (HTTP 4xx/5xx in OpenAI's error envelope, or an SSE error event); anything else
  (no answer within ``--request-timeout``, a stream cut short, malformed JSON, a broken
  connection) is a failure;
* within ``--drain-timeout`` of the last request, the server's ``/metrics`` shows no
  running and no waiting request and a free KV pool (``tpserve:kv_cache_usage_perc`` 0);
* ``GET /health`` still answers 200 (a dead engine would turn every request into an
  explicit 503, which alone would pass);
* with ``--server-pid`` (the server's root process), the resident memory (VmRSS) of its
  whole process tree (the HTTP process, the engine process, the tensor-parallel workers)
  grew by less than ``--max-rss-growth-mib`` between the end of the warm-up and the end of
  the soak; the report lists each process and names the one that grew most. GPU memory of
  those processes is reported where NVML can read it (not checked).

Exit status: 0 when every check holds, 1 when one does not, 2 when the soak could not
start (bad flag, server unreachable).

Modules: ``flags`` (flags and ``SoakConfig``), ``plans`` (the request mix), ``outcomes``
(how a request ended), ``sender`` (sending, concurrency), ``server_state`` (``/metrics``
until idle, ``/health``), ``memory`` (the process tree's RSS and GPU memory), ``report``
(counts and summary), ``run`` (the soak and its entry points).
"""

from tpserve.loadtest.soak.flags import SoakConfig, add_soak_arguments, config_from_args
from tpserve.loadtest.soak.memory import read_rss_mib, read_tree
from tpserve.loadtest.soak.outcomes import (
    ABORTED,
    COMPLETED,
    ERRORED,
    FAILED,
    OUTCOMES,
    Outcome,
    StreamCheck,
    check_whole,
    error_outcome,
)
from tpserve.loadtest.soak.plans import (
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_WORDS,
    RequestPlan,
    make_plans,
)
from tpserve.loadtest.soak.report import format_summary, tally
from tpserve.loadtest.soak.run import EXIT_FAILED, EXIT_OK, EXIT_SETUP, main, run_soak, soak_main
from tpserve.loadtest.soak.sender import SoakSender, run_plans
from tpserve.loadtest.soak.server_state import health_status, metric_value, wait_until_idle

__all__ = [
    "ABORTED", "COMPLETED", "ERRORED", "EXIT_FAILED", "EXIT_OK", "EXIT_SETUP", "FAILED",
    "MAX_OUTPUT_TOKENS", "MAX_PROMPT_WORDS", "OUTCOMES", "Outcome", "RequestPlan",
    "SoakConfig", "SoakSender", "StreamCheck", "add_soak_arguments", "check_whole",
    "config_from_args", "error_outcome", "format_summary", "health_status", "main",
    "make_plans", "metric_value", "read_rss_mib", "read_tree", "run_plans", "run_soak",
    "soak_main", "tally", "wait_until_idle",
]
