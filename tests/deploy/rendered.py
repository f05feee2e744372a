"""The chart rendered by the real helm, and the parts of it the tests look at."""
from __future__ import annotations

import yaml

from deploy_tools import CHART, VALUES, run

VALUE_SETS = sorted(p.stem for p in VALUES.glob("*.yaml"))


def render(*args: str) -> list[dict]:
    out = run("helm", "template", "rel", str(CHART), "--namespace", "llm", *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_set(name: str, *args: str) -> list[dict]:
    return render("-f", str(VALUES / f"{name}.yaml"), *args)


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


def pod_templates(rayservice: dict) -> dict[str, dict]:
    """role ("head", or the worker group's name) -> the pod template KubeRay creates pods from."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]["template"],
            **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}}


def containers(rayservice: dict) -> list[dict]:
    return [c for pod in pod_templates(rayservice).values() for c in pod["spec"]["containers"]]


def serve_app(rayservice: dict) -> dict:
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    return app
