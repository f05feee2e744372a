"""The output file's rules, without Ray or a model: never the input, one writer (a lock), a torn
last line cut, fsync on a clock; the input's: a line over the cap is refused without being read
whole; and the compact per-row tables that keep the driver's memory flat."""
from __future__ import annotations

import io
import json
import os

import pytest

from raypaged.batch import output as output_module
from raypaged.batch.output import AnsweredLines
from raypaged.batch.rows import SKIP_CHUNK, SeenIds, digest_of, read_lines
from raypaged.batch.job import BatchJob
from raypaged.batch.output import OutputBusy, OutputFile, lock_path
from raypaged.batch.rows import read_rows
from raypaged.cli import main


def answer_line(n: int, digest: int) -> str:
    return json.dumps({"id": f"batch_req_{n}_{digest:016x}", "custom_id": f"c{n}",
                       "response": {"status_code": 200}, "error": None}) + "\n"


# -- the input -----------------------------------------------------------------------------
class ReadSizes(io.BytesIO):
    """Records the size of every piece the reader asked for and got."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.largest = 0

    def readline(self, size=-1):
        piece = super().readline(size)
        self.largest = max(self.largest, len(piece))
        return piece


def test_a_line_over_the_cap_is_a_413_row_and_is_never_read_whole():
    cap = 4096
    big = b'{"prompt": "' + b"x" * (5 * SKIP_CHUNK) + b'"}'
    f = ReadSizes(b'{"prompt": "a"}\n' + big + b'\n{"prompt": "b"}\n')
    rows = list(read_rows(f, cap))
    assert [(r.line_no, r.error is None) for r in rows] == [(1, True), (2, False), (3, True)]
    assert rows[1].error.status == 413
    assert rows[1].error.message == (f"line 2: the line is {len(big):,} bytes, over the limit of "
                                     "4,096: shorten it, or raise --max-line-bytes")
    assert rows[1].digest == digest_of(big)  # hashed piece by piece, as if whole
    assert rows[2].body == {"prompt": "b"}
    assert f.largest <= SKIP_CHUNK  # never more than a piece in memory


def test_lines_at_and_just_over_the_cap():
    cap = 1024
    at, over = b"a" * cap, b"b" * (cap + 1)
    lines = list(read_lines(io.BytesIO(at + b"\n" + over + b"\n" + at), cap))
    assert [(ln.line_no, ln.raw is not None, ln.size) for ln in lines] == [
        (1, True, cap), (2, False, cap + 1), (3, True, cap)]
    assert lines[1].digest == digest_of(over)


# -- the compact tables --------------------------------------------------------------------
def test_seen_ids_finds_every_duplicate_across_merges_and_no_false_one(monkeypatch):
    monkeypatch.setattr(SeenIds, "MERGE_EVERY", 64)
    seen = SeenIds()
    assert all(seen.add(f"id-{i}") for i in range(5000))  # 78 merges into the sorted array
    assert not any(seen.add(f"id-{i}") for i in range(0, 5000, 7))  # in the array and the set
    assert seen.add("id-5000")
    assert list(seen._sorted) == sorted(seen._sorted)


def test_answered_lines_take_once_tell_a_changed_line_and_report_what_is_left():
    done = AnsweredLines()
    assert done.add(3, 33) and done.add(100_000, 7) and done.add(1, 11) and done.add(5, 5)
    assert not done.add(3, 34)  # a second line for input line 3
    assert (done.take(3, 33), done.take(3, 33), done.take(2, 1)) == (True, None, None)
    assert done.take(5, 5 + (1 << 32) * 9) is True   # the low 32 bits are compared
    assert done.take(1, 12) is False                 # the line changed
    assert done.count == 1 and list(done.left()) == [100_000]


# -- the output ----------------------------------------------------------------------------
def test_a_torn_last_line_is_cut_and_written_lines_are_known(tmp_path):
    path = tmp_path / "out.jsonl"
    good = answer_line(2, 0xB2) + answer_line(1, 0xB1)
    torn = '{"id": "batch_req_3_00000000000000b3", "cust'
    path.write_text(good + torn)
    out = OutputFile(path)
    assert [out.answered.take(n, 0xB0 + n) for n in (1, 2, 3)] == [True, True, None]
    assert out.cut_bytes == len(torn)
    out.write({"id": "batch_req_3_00000000000000b3", "custom_id": "c3"})
    out.close()
    assert path.read_text() == good + '{"id": "batch_req_3_00000000000000b3", "custom_id": "c3"}\n'


@pytest.mark.parametrize("content", [
    "hello\nworld\n",
    answer_line(1, 1).replace("batch_req_1_0000000000000001", "batch_req_1") + "\n",  # no digest
    answer_line(1, 1) + answer_line(1, 1)])
def test_an_output_that_is_not_ours_is_refused(tmp_path, content):
    path = tmp_path / "out.jsonl"
    path.write_text(content + answer_line(2, 2))
    with pytest.raises(ValueError, match="not written by .*raypaged batch; give a new output path"):
        OutputFile(path)
    assert path.read_text() == content + answer_line(2, 2)


def test_an_output_line_splits_into_lines_nowhere_but_at_its_end(tmp_path):
    """Generated text may hold U+2028, U+2029 or U+0085: Python's str.splitlines() (which many
    JSONL readers use) ends a line at each, so they are written escaped; the text reads back
    the same."""
    text = "a\u2028b\u2029c\x85d\ne"
    out = OutputFile(tmp_path / "out.jsonl")
    out.write({"id": "batch_req_1_00000000000000ab", "custom_id": "c1", "text": text})
    out.close()
    [line] = (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()
    assert json.loads(line)["text"] == text


def test_a_second_writer_of_one_output_is_refused_until_the_first_closes(tmp_path):
    path = tmp_path / "out.jsonl"
    first = OutputFile(path)
    first.write({"id": "batch_req_1_0000000000000001"})
    with pytest.raises(OutputBusy) as refused:
        OutputFile(path)
    assert str(refused.value) == (
        f"{path} is being written by another raypaged batch job (pid {os.getpid()}, lock "
        f"{lock_path(path)}): wait for it to finish, or give another output path")
    first.close()
    OutputFile(path).close()  # free again
    assert path.read_text() == '{"id": "batch_req_1_0000000000000001"}\n'


def test_the_cli_refuses_a_locked_output_before_starting_ray(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    held = OutputFile(out)
    try:
        assert main(["batch", str(inp), str(out)]) == 2
    finally:
        held.close()
    assert "is being written by another raypaged batch job" in capsys.readouterr().err
    assert out.read_text() == ""


@pytest.mark.parametrize("inp,out,message", [
    ("in.jsonl", "in.jsonl/out.jsonl", "error: output {d}/in.jsonl/out.jsonl cannot be written: "
     "{d}/in.jsonl is not a directory: give a path in a writable directory"),
    (".", "out.jsonl", "error: input file {d} is not a regular file"),
])
def test_the_cli_refuses_paths_it_cannot_use_in_one_line_before_starting_ray(tmp_path, capsys,
                                                                         inp, out, message):
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    assert main(["batch", str(tmp_path / inp), str(tmp_path / out)]) == 2
    assert capsys.readouterr().err.strip() == message.format(d=tmp_path)


def test_fsync_runs_on_the_interval_not_per_line_and_at_close(tmp_path, monkeypatch):
    now, synced = [100.0], []
    monkeypatch.setattr(output_module.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(output_module.os, "fsync", lambda fd: synced.append(now[0]))
    out = OutputFile(tmp_path / "out.jsonl", fsync_interval_s=5.0)
    for t in (101, 103, 104.9, 105, 106, 109.9, 110.5):
        now[0] = t
        out.write({"id": "x"})
    assert synced == [105, 110.5]  # at most 5 s of lines are only in the page cache
    now[0] = 111
    out.close()
    assert synced == [105, 110.5, 111]


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link"])
def test_an_output_that_is_the_input_is_refused_and_the_input_kept(tmp_path, how):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    out = {"same path": lambda: inp, "symlink": lambda: (tmp_path / "o").symlink_to(inp) or
           tmp_path / "o", "hard link": lambda: (tmp_path / "o").hardlink_to(inp) or
           tmp_path / "o"}[how]()
    with pytest.raises(ValueError, match=f"the output {out} is the input file {inp}: writing it "
                                         "would destroy the input; give another output path"):
        BatchJob(inp, out)
    assert inp.read_text() == '{"prompt": "x"}\n'
    assert not lock_path(out).exists()


def test_the_resume_table_holds_at_most_8_bytes_per_input_line():
    # docs/batch.md: 4 bytes a row for the resume table (a doubling array: at most twice that)
    for order in ("input order", "last line first"):
        done = AnsweredLines()
        lines = range(1, 100_001) if order == "input order" else range(100_000, 0, -1)
        for n in lines:
            done.add(n, n)
        assert done._slots.itemsize * len(done._slots) <= 8 * 100_001, order
    done = AnsweredLines()
    for n in range(1, 1001):
        done.add(n, n)
    assert len(done._slots) == 1024  # 1001 slots (0 unused) rounded up to a power of two
