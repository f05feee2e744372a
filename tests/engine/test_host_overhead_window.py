"""benchmarks/host_overhead.py counts only the part of each timed call inside the measured window.

Overlapped, the step executor is inside a step's sampler when the window opens and inside the
next one's when it closes. Counting such a call whole, or not at all, moves a whole sampler
call into or out of `host` (= wall - device - sample): the benchmark once missed the first
one and reported 0.6-2.8 s of host time per step that was sampling."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ runs from the checkout
from benchmarks import host_overhead  # noqa: E402


@pytest.fixture
def spans(monkeypatch):
    spans: list = []
    monkeypatch.setattr(host_overhead, "SPANS", spans)
    return spans


def test_calls_straddling_the_window_count_only_their_part_inside_it(spans):
    # window [10, 20]: a sampler call began before it, one ends after it, one lies inside
    spans += [("sample", 7.0, 12.0), ("sample", 13.0, 16.0), ("sample", 18.0, 25.0),
              ("sample", 1.0, 5.0), ("sample", 21.0, 22.0), ("device", 12.0, 13.0)]
    got = host_overhead.phase_seconds(10.0, 20.0, whole=())
    assert got == {"sample": 2.0 + 3.0 + 2.0, "device": 1.0}


def test_whole_phases_count_every_call_begun_in_the_window(spans):
    # the output stage detokenizes the window's last step after the window closes
    spans += [("detok", 9.0, 9.5), ("detok", 15.0, 16.0), ("detok", 19.5, 21.0)]
    assert host_overhead.phase_seconds(10.0, 20.0, whole=("detok",)) == {"detok": 2.5}
