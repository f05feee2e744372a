"""`raypaged batch INPUT OUTPUT [engine flags] [batch flags]`.

Exit status: 0 when every row has its line (even if some are error lines: refusals of the row's
own input), 1 when the engines cannot run, 2 when the files are refused (a missing input, the
output is the input, another job holds the output, the input changed since the output answered
it; raypaged.cli.main), 3 when rows are left unanswered after retry_timeout_s of failures that
were not their own, 4 when the output (or the summary) stopped taking writes mid-run (a full
disk), 130 when interrupted (SIGINT/SIGTERM). After 3, 4 or 130, re-run the same command to
finish the rest.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from raypaged.batch.options import BatchOptions
from raypaged.config import EngineArgs
from raypaged.settings import add_cli_args, from_namespace

UNANSWERED = 3
OUTPUT_FAILED = 4
INTERRUPTED = 130


def add_batch_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "batch", help="answer an OpenAI Batch JSONL file with a pool of engines on Ray",
        description="Answer every line of INPUT (OpenAI Batch lines for /v1/completions and "
                    "/v1/chat/completions, or plain {\"prompt\"} / {\"messages\"} rows) into "
                    "OUTPUT, one OpenAI batch output line each. Re-running with the same "
                    "arguments resumes: lines already in OUTPUT are skipped; an input line that "
                    "changed since OUTPUT answered it is refused.")
    p.add_argument("input", help="JSONL input file")
    p.add_argument("output", help="JSONL output file (appended to; created if missing; locked "
                   "while the job runs by OUTPUT.lock)")
    p.add_argument("--summary-json", help="also write the summary to this file as JSON")
    add_cli_args(p, BatchOptions)
    add_cli_args(p, EngineArgs)
    p.set_defaults(func=run_batch_cli)
    return p


def run_batch_cli(ns: argparse.Namespace) -> int:
    from raypaged.batch.engines import FleetFailed
    from raypaged.batch.job import BatchJob, run_job
    from raypaged.batch.output import OutputWriteFailed

    summary_json = ns.summary_json and _writable(Path(ns.summary_json), ns.input, ns.output)
    job = BatchJob(ns.input, ns.output, from_namespace(EngineArgs, ns),
                   from_namespace(BatchOptions, ns))
    try:
        # after ray.init, which installs its own SIGTERM handler: `ray job stop` and kill
        # then take the same way out as Ctrl-C (lines written stay whole, engines stop)
        summary = run_job(job, on_ray=lambda: signal.signal(signal.SIGTERM,
                                                            signal.default_int_handler))
    except KeyboardInterrupt:
        print("raypaged batch: interrupted; the lines written so far are complete: re-run the "
              "same command to finish", file=sys.stderr, flush=True)
        return INTERRUPTED
    except FleetFailed as exc:
        print(f"raypaged batch: the engines cannot run: {exc}", file=sys.stderr)
        return 1
    except OutputWriteFailed as exc:
        print(f"raypaged batch: {exc}; the lines written so far are whole (a torn last one is "
              "cut on the next run): make room and re-run the same command to finish",
              file=sys.stderr, flush=True)
        return OUTPUT_FAILED
    print(summary.report(), flush=True)
    if summary_json:
        try:  # whole or not at all: a new file renamed over the old summary
            target = Path(os.path.realpath(summary_json))  # a link stays a link
            part = target.with_name(target.name + ".part")
            part.write_text(json.dumps(summary.to_json(), indent=1))
            os.replace(part, target)
        except OSError as e:
            print(f"raypaged batch: cannot write the summary {summary_json}: {e.strerror}",
                  file=sys.stderr, flush=True)
            return OUTPUT_FAILED
    if summary.unanswered:
        print(f"raypaged batch: {summary.unanswered:,} rows have no line yet (engines failed "
              f"them for {job.options.retry_timeout_s:.0f} s): re-run the same command to "
              "answer them", file=sys.stderr, flush=True)
        return UNANSWERED
    return 0


def _writable(path: Path, *job_files: str) -> Path:
    """The summary's path, refused now (exit 2, naming it) rather than as a traceback once every
    row is answered, or as the input or output overwritten by it; its directory made if
    missing, as the output's is (OutputFile)."""
    from raypaged.batch.job import cannot_write, same_file

    for other in job_files:
        if same_file(path, Path(other)):  # an output not written yet too
            raise ValueError(f"--summary-json {path} is the file {other}: writing the summary "
                             "would destroy it; give another path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = os.path.lexists(path)  # a link to a missing file is the user's: kept
        open(path, "a").close()
    except OSError as e:
        raise cannot_write("--summary-json", path, e) from None
    if not existed:  # written only once the job has a summary
        path.unlink()
    return path
