"""Detached workers' naming and exit rule, without Ray."""
from __future__ import annotations

from raypaged.serve.detached_workers import fingerprint, wait_until_gone, worker_name


def test_the_name_tells_apps_indexes_and_configurations_apart():
    a = fingerprint({"engine": {"model": "m", "kv_memory_mb": 64}, "max_queued": 8})
    assert a == fingerprint({"max_queued": 8, "engine": {"kv_memory_mb": 64, "model": "m"}})
    b = fingerprint({"engine": {"model": "m", "kv_memory_mb": 128}, "max_queued": 8})
    assert len(a) == 16 and a != b
    assert worker_name("app", 1, a) == f"app:worker-1:{a}"


def test_a_worker_exits_only_when_its_application_is_missing_twice_in_a_row():
    answers = iter([False, True, False, True, None, True, "unused"])
    sleeps = []
    wait_until_gone(lambda: next(answers), 2.0, sleeps.append)
    assert next(answers) == "unused"  # returned right after the second True in a row
    assert sleeps == [2.0] * 6
