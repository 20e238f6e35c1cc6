"""``tpserve memory``: a running server's memory report (``GET /memory``) as a table on
stdout and a PNG; HTTP only, like ``tpserve loadtest``."""

from tpserve.loadtest.memory.report import add_memory_arguments, memory_main

__all__ = ["add_memory_arguments", "memory_main"]
