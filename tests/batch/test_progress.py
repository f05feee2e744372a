"""Progress log lines (what `ray job logs` shows), the summary, and the exit status when the job
cannot start: no Ray, no engine."""
from __future__ import annotations

import json

from raypaged.batch import progress as progress_module
from raypaged.batch.progress import BatchSummary, Progress
from raypaged.cli import main

USAGE = {"prompt_tokens": 100, "completion_tokens": 10,
         "prompt_tokens_details": {"cached_tokens": 75}}


def test_a_plain_line_every_interval_with_rows_failures_tok_s_and_eta(monkeypatch, capsys):
    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    p = Progress(input_bytes=1000, interval_s=5.0, tty=False)
    for end, skipped in ((100, True), (200, True), (300, False), (400, False)):
        p.row_read(end, skipped)
    now[0] += 2.0
    p.row_done(True, USAGE)        # 2 s in: before the interval, no line
    assert capsys.readouterr().out == ""
    now[0] += 3.0
    p.row_done(False)              # 5 s in: 4 rows of ~10 done (4 read in 40% of the bytes),
    assert capsys.readouterr().out == (  # 2 answered now in 5 s: 6 more take 15 s
        "raypaged batch: 4 rows done of ~10, 1 failed, 2.0 output tok/s, ETA 0m15s\n")
    p.unanswered += 1
    summary = p.finish(startup_s=7.0)
    assert summary == BatchSummary(rows=4, skipped=2, completed=1, failed=1, prompt_tokens=100,
                                   completion_tokens=10, cached_tokens=75, wall_s=5.0,
                                   startup_s=7.0, unanswered=1)
    assert "unanswered       1 (not written: re-run to retry them)" in summary.report()
    assert (summary.output_tokens_per_s, summary.prefix_hit_rate) == (2.0, 0.75)
    assert "prefix cache hit 75.0% of prompt tokens (75 cached)" in summary.report()


def test_a_missing_input_exits_2_before_ray_starts(tmp_path, capsys):
    assert main(["batch", str(tmp_path / "missing.jsonl"), str(tmp_path / "out.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: input file {tmp_path / 'missing.jsonl'} does not exist\n"
    assert not (tmp_path / "out.jsonl").exists()


def test_a_summary_json_in_a_missing_directory_is_written_and_keeps_the_exit_status(
        tmp_path, monkeypatch, capsys):
    from raypaged.batch import job as api
    summary = BatchSummary(rows=2, skipped=0, completed=1, failed=0, prompt_tokens=4,
                           completion_tokens=2, cached_tokens=0, wall_s=1.0, unanswered=1)
    monkeypatch.setattr(api, "run_job", lambda job, on_ray: summary)  # no Ray: the job's end
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    report = tmp_path / "reports" / "summary.json"
    assert main(["batch", str(inp), str(tmp_path / "out.jsonl"), "--summary-json",
                 str(report)]) == 3  # one row unanswered: re-run, as the output's directory
    assert json.loads(report.read_text()) == summary.to_json()
