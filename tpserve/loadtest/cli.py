"""``tpserve loadtest``: run the load test, print the summary, write the JSON and the PNG.

Exit status: 0 when some request succeeded, 1 when none did, 2 when the test could not
start (bad flag, server or dataset), 130 when interrupted by Ctrl-C (after writing what
was measured).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import sys
from pathlib import Path

from tpserve.loadtest.args import ConfigError, LoadtestConfig, config_from_args
from tpserve.loadtest.datasets import DatasetError
from tpserve.loadtest.interrupt import sigint_sets
from tpserve.loadtest.metrics import summarize, summarize_embeddings
from tpserve.loadtest.plot import write_plot
from tpserve.loadtest.report import format_summary, format_sweep, write_json
from tpserve.loadtest.result_header import result_header
from tpserve.loadtest.runner import RunRecord
from tpserve.loadtest.session import Session, SetupError, run_session

EXIT_OK, EXIT_NO_SUCCESS, EXIT_SETUP, EXIT_INTERRUPTED = 0, 1, 2, 130


def main(args: argparse.Namespace) -> int:
    """Run ``tpserve loadtest`` with parsed flags; returns the exit status."""
    try:
        config = config_from_args(args)
        if config.result_file is not None:
            _check_writable(config.result_file)
    except ConfigError as e:
        return _fail(str(e))
    try:
        session = asyncio.run(_run(config))
    except (SetupError, DatasetError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print("tpserve loadtest: aborted; nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    return _report(config, session)


async def _run(config: LoadtestConfig) -> Session:
    stop = asyncio.Event()
    with sigint_sets(stop):
        return await run_session(config, stop)


def build_document(config: LoadtestConfig, session: Session) -> dict:
    """The JSON result: one flat result for a single rate, else {"results": [...]}."""
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    header = result_header(config.backend, session.model, session.tokenizer_id,
                           config.metadata)
    common = {"date": date, **header, "model": session.model, "tokenizer": session.tokenizer,
              **config.parameters()}
    results = [{**common, **_summary(config, record)} for record in session.records]
    if not config.sweep:
        return results[0]
    return {
        "date": date,
        "label": config.label,
        "sweep_rates": ["inf" if math.isinf(r) else r for r in config.request_rates],
        "interrupted": session.interrupted,
        "results": results,
    }


def _summary(config: LoadtestConfig, record: RunRecord) -> dict:
    if config.embeddings:
        return summarize_embeddings(record, config.metric_percentiles, config.goodput)
    return summarize(record, config.percentile_metrics, config.metric_percentiles,
                     config.goodput)


def _report(config: LoadtestConfig, session: Session) -> int:
    if not session.records:
        print("tpserve loadtest: interrupted before any run was measured; nothing written",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    document = build_document(config, session)
    results = document.get("results", [document])
    for result in results:
        print(format_summary(result, config.percentile_metrics, config.metric_percentiles))
    if config.sweep:
        print(format_sweep(results))
    if config.result_file is not None:
        write_json(config.result_file, document)
        print(f"Result written to {config.result_file}")
    if config.plot_file is not None and write_plot(document, config.plot_file):
        print(f"Plot written to {config.plot_file}")
    if session.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if any(r["completed"] for r in results) else EXIT_NO_SUCCESS


def _check_writable(path: Path) -> None:
    """Fail before the test rather than lose its results to an unwritable folder."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"result file {path}: cannot create its folder ({e})") from None
    if not os.access(path.parent, os.W_OK):
        raise ConfigError(f"result file {path}: folder {path.parent} is not writable")


def _fail(message: str) -> int:
    print(f"tpserve loadtest: error: {message}", file=sys.stderr)
    return EXIT_SETUP
