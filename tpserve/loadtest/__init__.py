"""``tpserve loadtest``: a streaming load generator and report for OpenAI-compatible servers.

Wire it into a CLI with ``add_arguments(subparser)`` and ``main(parsed_args)``.
"""

from tpserve.loadtest.args import add_arguments
from tpserve.loadtest.cli import main

__all__ = ["add_arguments", "main"]
