"""Workers' allocator: tcmalloc preloaded when installed, glibc with a warning naming the fix when
not, and glibc on request."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from raypaged.serve.allocator import TCMALLOC_SONAME, find_tcmalloc, worker_env_vars
from raypaged.serve.cli import serve_args_from
from raypaged.serve.config import ServeArgs
from test_serve_cli import parse


def test_tcmalloc_is_preloaded_ahead_of_an_existing_preload(tmp_path, monkeypatch):
    (tmp_path / TCMALLOC_SONAME).write_bytes(b"")
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    assert worker_env_vars("tcmalloc", (str(tmp_path / "none"), str(tmp_path))) == {
        "LD_PRELOAD": f"{tmp_path / TCMALLOC_SONAME} /opt/other.so"}


def test_a_missing_tcmalloc_falls_back_to_glibc_with_the_fix(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="raypaged.serve.allocator"):
        assert worker_env_vars("tcmalloc", (str(tmp_path),)) == {}
    assert "apt-get install libtcmalloc-minimal4" in caplog.text
    assert "--worker-allocator system" in caplog.text


def test_system_means_glibc_and_no_preload(tmp_path):
    (tmp_path / TCMALLOC_SONAME).write_bytes(b"")
    assert worker_env_vars("system", (str(tmp_path),)) == {}


def test_an_unknown_allocator_is_refused():
    with pytest.raises(ValueError, match="worker_allocator"):
        ServeArgs(worker_allocator="jemalloc").split()


def test_the_flag_reaches_the_fleet_options():
    assert serve_args_from(parse()).split()[0].worker_allocator == "tcmalloc"
    assert serve_args_from(parse("--worker-allocator", "system")).split()[0].worker_allocator == "system"


@pytest.mark.skipif(find_tcmalloc() is None, reason=f"{TCMALLOC_SONAME} not installed (make tcmalloc)")
def test_served_workers_run_on_tcmalloc(app):
    # The workers' runtime_env preloads it; /proc/<pid>/maps shows what the process mapped.
    pids = [w["pid"] for w in app.fleet()["workers"]]
    assert len(pids) == 2
    assert all("libtcmalloc_minimal" in Path(f"/proc/{pid}/maps").read_text() for pid in pids)
