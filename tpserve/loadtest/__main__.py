"""``python -m tpserve.loadtest``: the same as ``tpserve loadtest``."""

import argparse
import sys

from tpserve.loadtest import add_arguments, main


def run() -> int:
    parser = argparse.ArgumentParser(
        prog="tpserve loadtest",
        description="Load-test an OpenAI-compatible server with streamed completions or chat "
                    "requests, or embeddings requests.",
    )
    add_arguments(parser)
    return main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(run())
