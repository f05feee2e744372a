"""Workers that outlive their controller: named, detached, adopted by the next controller.

A Ray actor dies with the actor that created it, so workers created by the controller would die
with it and every request would wait for new ones to load their models. A serving application's
workers are therefore detached actors with a deterministic name:

    namespace "raypaged-workers", name "<app>:worker-<i>:<fingerprint>"

and a (re)started controller creates them with `get_if_exists`: a live worker of that name is
adopted as it is (same process, same KV cache, no model load), a missing one is created. The
fingerprint is a hash of everything the worker was built from (engine settings, resources, queue
bound), so a worker from an earlier deployment with another configuration never matches: the
controller kills every worker of its application whose name it does not expect.

Nothing owns a detached actor, so each worker watches its application and exits (without a
restart) once Serve no longer lists it: `serve.delete`, `serve.shutdown` and `raypaged serve`'s
exit leave no worker behind, whoever deleted the application and however its controller died.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from typing import Callable

import ray

logger = logging.getLogger(__name__)

WORKER_NAMESPACE = "raypaged-workers"
# How often a worker asks Serve whether its application still exists: how long a deleted
# application's workers may linger.
APP_CHECK_S = 2.0


def fingerprint(spec: dict) -> str:
    """A short, stable hash of a worker's construction arguments (JSON-able values)."""
    text = json.dumps(spec, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def worker_name(app_name: str, index: int, spec_hash: str) -> str:
    return f"{app_name}:worker-{index}:{spec_hash}"


def named_workers(app_name: str) -> list[str]:
    """Names of the application's live (or restarting) detached workers."""
    prefix = f"{app_name}:worker-"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == WORKER_NAMESPACE and a["name"].startswith(prefix))


def kill_workers(names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(ValueError):  # gone meanwhile
            ray.kill(ray.get_actor(name, namespace=WORKER_NAMESPACE), no_restart=True)


def application_gone(app_name: str) -> bool | None:
    """True once Serve no longer lists the application, or Serve itself is shut down; None when
    Serve cannot be asked right now (its controller restarting): decide nothing."""
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        # by name each time: serve.status() alone would keep asking a shut-down controller
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return True
    try:
        return app_name not in serve.status().applications
    except Exception as exc:  # noqa: BLE001 - any failure to ask is "don't know"
        logger.warning("could not ask Serve about application %r: %r", app_name, exc)
        return None


def wait_until_gone(gone: Callable[[], bool | None], period_s: float,
                    sleep: Callable[[float], None] = time.sleep) -> None:
    """Returns once `gone()` says True at two checks in a row, `period_s` apart (a None answer
    neither counts nor resets). Two, because an application deleted and deployed again with the
    same configuration in between (a quick redeploy, a test fixture) has adopted this worker by
    then, and is listed again at the second check."""
    missing = 0
    while missing < 2:
        sleep(period_s)
        answer = gone()
        if answer is not None:
            missing = missing + 1 if answer else 0


def watch_application(app_name: str) -> None:
    """From inside a worker actor: exit for good (no restart) once the application is gone."""
    def run() -> None:
        wait_until_gone(lambda: application_gone(app_name), APP_CHECK_S)
        logger.info("application %r is gone: worker exits", app_name)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    threading.Thread(target=run, name="raypaged-app-watch", daemon=True).start()
