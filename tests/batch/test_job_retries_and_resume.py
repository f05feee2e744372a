"""Which failures are final, and what a resume re-runs, on a job in this process (the real
frontend over the fake engine, no Ray): a row is written only with its answer or its own
input's refusal; failures that are not its own are retried, and never written, so a re-run
answers them; an input line edited since the output answered it is refused."""
from __future__ import annotations

import asyncio
import errno
import json
import os

import pytest

from batch_inputs import read_output, write_lines
from local_pool import ALWAYS, LocalPool, WorkerUnavailable
from raypaged.batch import BatchOptions, job as api
from raypaged.batch import output as output_module
from raypaged.batch.job import BatchJob, InputChanged
from raypaged.cli import main
from raypaged.serve.errors import APIError

OPTIONS = dict(workers=1, max_inflight=4, prefix_grouping=False)


def plain(prompt: str, **extra) -> str:
    return json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0, **extra})


def run(inp, out, pool: LocalPool | None = None, **options):
    job = BatchJob(inp, out, options=BatchOptions(**{**OPTIONS, **options}))
    pool = pool or LocalPool()

    async def start(serve_args):
        return pool
    job.start_pool = start
    return asyncio.run(job.run())


def by_custom_id(path) -> dict[str, dict]:
    lines = read_output(path)
    ids = [o["custom_id"] for o in lines]
    assert len(ids) == len(set(ids)), f"a row answered twice: {ids}"
    return {o["custom_id"]: o for o in lines}


def test_failures_not_of_the_row_are_retried_until_answered(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [plain(f"row {i}") for i in range(4)]
                      + [plain("row 4", temperature=-1)])  # its own input: final at once
    pool = LocalPool({"row 1": (2, WorkerUnavailable), "row 2": (1, RuntimeError)})
    summary = run(inp, tmp_path / "out.jsonl", pool)
    out = by_custom_id(tmp_path / "out.jsonl")
    assert {cid: o["response"]["status_code"] for cid, o in out.items()} == {
        "line-1": 200, "line-2": 200, "line-3": 200, "line-4": 200, "line-5": 400}
    assert pool.fleet.attempts == {"row 1": 3, "row 2": 2}
    assert (summary.completed, summary.failed, summary.unanswered) == (4, 1, 0)


def test_a_row_failing_past_the_retry_timeout_is_not_written_and_a_rerun_answers_it(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [plain(f"row {i}") for i in range(4)])
    out = tmp_path / "out.jsonl"
    pool = LocalPool({"row 1": (ALWAYS, WorkerUnavailable), "row 3": (ALWAYS, RuntimeError)})
    first = run(inp, out, pool, retry_timeout_s=1.0)
    assert (first.completed, first.failed, first.unanswered) == (2, 0, 2)
    assert sorted(by_custom_id(out)) == ["line-1", "line-3"]  # no 503 / 500 line written
    assert pool.fleet.attempts["row 1"] >= 2  # retried, not given up at once

    second = run(inp, out)  # the engines are well again
    assert (second.rows, second.skipped, second.completed, second.unanswered) == (4, 2, 2, 0)
    answers = by_custom_id(out)
    assert sorted(answers) == ["line-1", "line-2", "line-3", "line-4"]
    assert all(o["response"]["status_code"] == 200 for o in answers.values())


def test_a_row_refused_as_a_suspected_poison_request_is_retried_and_never_written(tmp_path):
    # the failover's 400 once two engines died serving a row (serve/failover.py): an engine lost
    # twice is not the row's own input (docs/batch.md), and the serving memory refuses it again
    # at once, so a final line would never be answered by a re-run
    inp = write_lines(tmp_path / "in.jsonl", [plain(f"row {i}") for i in range(3)])
    out = tmp_path / "out.jsonl"
    pool = LocalPool()
    answer, refused = pool.frontend.completions, {"row 1": 0, "row 2": 0}

    async def completions(body):
        prompt = body["prompt"]
        if prompt == "row 2" or (prompt == "row 1" and refused[prompt] < 2):
            refused[prompt] += 1
            raise APIError(400, "workers w0 and w1 each died or stopped answering while serving "
                           "this request", code="suspected_poison_request")
        return await answer(body)
    pool.frontend.completions = completions
    summary = run(inp, out, pool, retry_timeout_s=2.0)
    assert {cid: o["response"]["status_code"] for cid, o in by_custom_id(out).items()} == {
        "line-1": 200, "line-2": 200}  # row 2: no 400 line, left for a re-run
    assert refused["row 1"] == 2 and refused["row 2"] >= 2
    assert (summary.completed, summary.failed, summary.unanswered) == (2, 0, 1)


def test_a_rerun_of_a_finished_job_writes_nothing_and_appended_lines_are_run(tmp_path):
    lines = [plain(f"row {i}") for i in range(3)]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    run(inp, out)
    before = out.read_text()
    again = run(inp, out)
    assert (again.skipped, again.completed, out.read_text()) == (3, 0, before)
    write_lines(inp, lines + [plain("row 3")])
    more = run(inp, out)
    assert (more.skipped, more.completed) == (3, 1)
    assert sorted(by_custom_id(out)) == ["line-1", "line-2", "line-3", "line-4"]


def test_an_input_line_edited_since_it_was_answered_is_refused(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [plain(f"row {i}") for i in range(4)])
    out = tmp_path / "out.jsonl"
    run(inp, out)
    answered = out.read_text()
    # same line numbers, same default custom_ids (line-N): only the bytes tell the edit
    write_lines(inp, [plain("row 0"), plain("row one, edited"), plain("row 2"), plain("row 3")])
    with pytest.raises(InputChanged, match=(
            f"input line 2 of {inp} changed since {out} answered it: the output would mix "
            "answers of two inputs")):
        run(inp, out)
    assert out.read_text() == answered


def test_an_output_answering_lines_the_input_no_longer_has_is_refused(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [plain(f"row {i}") for i in range(4)])
    out = tmp_path / "out.jsonl"
    run(inp, out)
    write_lines(inp, [plain(f"row {i}") for i in range(2)])
    with pytest.raises(InputChanged, match=f"{out} answers 2 input lines that {inp} no longer "
                                           r"has \(line 3, 4\)"):
        run(inp, out)


def test_a_line_over_the_cap_gets_a_413_line_and_the_rest_run(tmp_path):
    long_line = plain("x" * 5000)
    inp = write_lines(tmp_path / "in.jsonl", [plain("row 0"), long_line, plain("row 2")])
    summary = run(inp, tmp_path / "out.jsonl", max_line_bytes=1024)
    out = by_custom_id(tmp_path / "out.jsonl")
    assert [out[f"line-{i}"]["response"]["status_code"] for i in (1, 3)] == [200, 200]
    [long] = [o for o in read_output(tmp_path / "out.jsonl") if o["custom_id"] is None]
    assert long["response"]["status_code"] == 413
    assert long["error"]["message"] == (f"line 2: the line is {len(long_line):,} bytes, over the "
                                        "limit of 1,024: shorten it, or raise --max-line-bytes")
    assert (summary.completed, summary.failed) == (2, 1)


class FullDisk:
    """The output file on a disk with `room` bytes left: a write past it writes what fits (as
    write(2) does) and fails with ENOSPC."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data: bytes) -> int:
        fits = data[:self.room]
        self.f.write(fits)
        self.f.flush()
        self.room -= len(fits)
        if len(fits) < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return len(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_mid_run_exits_4_with_one_line_and_a_rerun_answers_the_rest(
        tmp_path, monkeypatch, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [plain(f"row {i}") for i in range(6)])
    out = tmp_path / "out.jsonl"

    def run_local(job, on_ray):  # the CLI's job on the in-process pool, not on Ray
        async def start(serve_args):
            return LocalPool()
        job.start_pool = start
        return asyncio.run(job.run())
    monkeypatch.setattr(api, "run_job", run_local)
    real_open = open
    room = [1200]  # a few lines and a part of one
    monkeypatch.setattr(output_module, "open", lambda path, mode="r", *a: FullDisk(
        real_open(path, mode, *a), room[0]) if mode == "ab" else real_open(path, mode, *a),
        raising=False)
    argv = ["batch", str(inp), str(out), "--max-inflight=1", "--no-prefix-grouping"]
    assert main(argv) == 4
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"raypaged batch: cannot write the output {out}: No space left on device; the lines "
        "written so far are whole (a torn last one is cut on the next run): make room and "
        "re-run the same command to finish")
    *whole, torn = out.read_bytes().split(b"\n")
    assert len(out.read_bytes()) == 1200 and torn  # whole lines, then one torn, nothing after
    assert 1 <= len(whole) < 6 and all(json.loads(line)["error"] is None for line in whole)
    room[0] = 10 ** 9  # room made
    assert main(argv) == 0
    assert "cut a torn last line" in capsys.readouterr().out
    assert sorted(by_custom_id(out)) == [f"line-{i}" for i in range(1, 7)]


def test_a_summary_json_that_cannot_be_written_is_refused_before_the_job_runs(
        tmp_path, monkeypatch, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [plain("row 0")])
    monkeypatch.setattr(api, "run_job", lambda job, on_ray: pytest.fail("the job ran"))
    argv = ["batch", str(inp), str(tmp_path / "out.jsonl"), "--summary-json"]
    assert main([*argv, str(inp / "summary.json")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --summary-json {inp}/summary.json cannot be written: {inp} is not a "
        "directory: give a path in a writable directory")
    assert main([*argv, str(tmp_path)]) == 2  # a directory
    assert capsys.readouterr().err.strip() == (
        f"error: --summary-json {tmp_path} cannot be written: Is a directory ({tmp_path}): give "
        "a path in a writable directory")
    assert main([*argv, str(inp)]) == 2  # the input: the summary would overwrite it
    assert capsys.readouterr().err.strip() == (
        f"error: --summary-json {inp} is the file {inp}: writing the summary would destroy it; "
        "give another path")
    out = tmp_path / "out.jsonl"
    assert main([*argv, str(out)]) == 2  # the output, not written yet: it would be replaced
    assert capsys.readouterr().err.strip() == (
        f"error: --summary-json {out} is the file {out}: writing the summary would destroy it; "
        "give another path")
    assert not out.exists()
    kept = tmp_path / "old_summary.json"
    kept.write_text("{}")
    monkeypatch.setattr(api, "run_job", lambda job, on_ray: 1 / 0)  # checked, then ran
    with pytest.raises(ZeroDivisionError):
        main([*argv, str(kept)])
    assert kept.read_text() == "{}"


def test_after_a_failed_write_the_output_takes_no_line_even_once_there_is_room(tmp_path,
                                                                              monkeypatch):
    # a whole line after the torn one would leave the torn one mid-file, and the next run
    # would refuse the whole output as not written by raypaged
    real_open, room = open, [30]
    monkeypatch.setattr(output_module, "open", lambda path, mode="r", *a: FullDisk(
        real_open(path, mode, *a), room[0]) if mode == "ab" else real_open(path, mode, *a),
        raising=False)
    out = output_module.OutputFile(tmp_path / "out.jsonl")
    with pytest.raises(output_module.OutputWriteFailed, match="No space left on device"):
        out.write({"id": "batch_req_1_" + "0" * 16, "custom_id": "a"})
    out._file.room = 10 ** 6  # room made
    with pytest.raises(output_module.OutputWriteFailed, match="failed an earlier write"):
        out.write({"id": "batch_req_2_" + "0" * 16, "custom_id": "b"})
    out.close()
    assert len((tmp_path / "out.jsonl").read_bytes()) == 30  # the torn part only
    again = output_module.OutputFile(tmp_path / "out.jsonl")  # the re-run cuts it
    assert (again.cut_bytes, again.answered.count) == (30, 0)
    again.close()
