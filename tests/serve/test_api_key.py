"""An API key that is set but empty is refused wherever a key enters (the flag, the environment,
a Serve config's args, the HTTP app), never taken as "no auth"."""
from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import warnings

import pytest

from raypaged.serve.api_key import resolve_api_key
from raypaged.serve.config import ServeArgs, ServeOptions
from local_fleet import LocalFleet, local_app
from serve_testing import ROOT


@pytest.mark.parametrize("configured, env, key", [
    (None, {}, None),
    (None, {"RAYPAGED_API_KEY": "k"}, "k"),
    ("k", {"RAYPAGED_API_KEY": "other"}, "k"),
    ("k", {"RAYPAGED_API_KEY": ""}, "k"),  # the argument wins; the environment is not read
])
def test_the_key_comes_from_the_arguments_else_the_environment(configured, env, key):
    assert resolve_api_key(configured, env) == key


@pytest.mark.parametrize("configured, env, source", [
    ("", {}, "api_key"),
    ("  ", {"RAYPAGED_API_KEY": "k"}, "api_key"),
    (None, {"RAYPAGED_API_KEY": ""}, "RAYPAGED_API_KEY"),
    (None, {"RAYPAGED_API_KEY": "\n"}, "RAYPAGED_API_KEY"),
])
def test_a_key_set_but_empty_is_refused_naming_where_it_came_from(configured, env, source):
    with pytest.raises(ValueError, match=f"{source} is set but empty.*give a non-empty key"):
        resolve_api_key(configured, env)


def test_a_serve_config_with_an_empty_key_is_refused():
    with pytest.raises(ValueError, match="api_key is set but empty"):
        ServeArgs(api_key="").split()


def test_the_http_app_refuses_an_empty_key():
    fleet = LocalFleet()
    try:
        with pytest.raises(ValueError, match="api_key is set but empty"):
            local_app(fleet, api_key="")
    finally:
        fleet.shutdown()


def test_the_router_refuses_an_empty_key_from_its_environment(monkeypatch):
    # The Helm chart's path: no key in the args, RAYPAGED_API_KEY from a Secret that is empty.
    from raypaged.serve.app import OpenAIRouter

    monkeypatch.setenv("RAYPAGED_API_KEY", "")
    router = object.__new__(OpenAIRouter)
    with pytest.raises(ValueError, match="RAYPAGED_API_KEY is set but empty"):
        asyncio.run(OpenAIRouter.__init__(router, ServeOptions(app_name="t")))
    assert not hasattr(router, "fleet")  # refused before it joined the fleet
    with warnings.catch_warnings():  # its async __del__, never awaited for a half-built router
        warnings.simplefilter("ignore", RuntimeWarning)
        del router
        gc.collect()


@pytest.mark.parametrize("flag, env", [(["--api-key", ""], {}), ([], {"RAYPAGED_API_KEY": ""})])
def test_raypaged_serve_refuses_an_empty_key_before_ray_starts(flag, env):
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from raypaged.cli import main; sys.exit(main())",
         "serve", *flag],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**{k: v for k, v in os.environ.items() if k != "RAYPAGED_API_KEY"}, **env})
    assert run.returncode == 2, run.stderr
    assert "is set but empty" in run.stderr and "Started a local Ray" not in run.stderr
