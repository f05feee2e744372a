"""The direction of imports (architecture.md): checked in fresh interpreters and by reading source.

kernels/        -> torch, triton only       (never raypaged.*, never ray)
raypaged/core   -> stdlib + config          (never torch, ray, triton)
raypaged/model  -> core, kernels, torch     (never ray)
raypaged/config, raypaged/settings and raypaged/serve/config (the settings) -> never torch
benchmarks/sim  -> core, the serve Router's pure modules (never torch, ray)
only raypaged/serve and raypaged/batch import ray
"""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib, json, pkgutil, sys
pkg = importlib.import_module({pkg!r})
for m in pkgutil.walk_packages(getattr(pkg, "__path__", []), {pkg!r} + "."):
    importlib.import_module(m.name)
print(json.dumps(sorted(sys.modules)))
"""


def modules_loaded_by(pkg: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(pkg=pkg)], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def top(mods):
    return {m.split(".")[0] for m in mods}


def test_core_imports_neither_torch_ray_nor_triton():
    mods = modules_loaded_by("raypaged.core")
    assert not top(mods) & {"torch", "ray", "triton"}


def test_the_fleet_simulator_imports_neither_torch_nor_ray():
    """It runs the serving Router's own code, which must stay importable without Ray."""
    mods = modules_loaded_by("benchmarks.sim")
    assert not top(mods) & {"torch", "ray", "triton"}
    assert {"raypaged.serve.routing", "raypaged.core.scheduler"} <= mods


def test_kernels_import_neither_raypaged_nor_ray():
    mods = modules_loaded_by("raypaged.kernels")
    assert "ray" not in top(mods)
    assert {m for m in mods if m.startswith("raypaged.") and not m.startswith("raypaged.kernels")} == set()


def test_model_does_not_import_ray():
    assert "ray" not in top(modules_loaded_by("raypaged.model"))


@pytest.mark.parametrize("module", ["raypaged.config", "raypaged.settings", "raypaged.serve.config",
                                    "raypaged.batch.options", "raypaged.batch.cli"])
def test_settings_load_without_torch(module):
    """Routers, the controller and `raypaged serve --help` read settings without paying for torch."""
    mods = modules_loaded_by(module)
    assert not top(mods) & {"torch", "triton", "ray"}


def test_a_source_checkout_resolves_raypaged_kernels_and_nothing_else_beside_it():
    probe = ("import importlib.util as u, raypaged.kernels as k; print(k.__file__); "
             "print(u.find_spec('raypaged.benchmarks'), u.find_spec('raypaged.tests'))")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                         text=True, cwd="/", env=env).stdout.split()
    assert out == [str(ROOT / "kernels" / "__init__.py"), "None", "None"]


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", ["raypaged", "kernels"])
def test_only_serve_and_batch_import_ray_anywhere_in_the_source(folder):
    offenders = []
    for path in (ROOT / folder).rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("raypaged/serve/", "raypaged/batch/")):
            continue
        if any(n == "ray" or n.startswith("ray.") for n in imported_names(path)):
            offenders.append(rel)
    assert offenders == []


# A router's request path, in layers: the router<->worker transport, ranking the workers, what a
# lost worker costs a request, one request's stream, the endpoints. Each file imports only
# files before it, so the transport knows no request logic and the rules no stream.
REQUEST_PATH = ["messages", "worker_link", "leg", "routing", "dispatch", "failover",
                "generation", "sse_stream", "frontend"]


@pytest.mark.parametrize("position", range(len(REQUEST_PATH)))
def test_the_router_request_path_imports_only_the_layers_before_it(position):
    path = ROOT / "raypaged" / "serve" / f"{REQUEST_PATH[position]}.py"
    later = {f"raypaged.serve.{m}" for m in REQUEST_PATH[position + 1:]}
    assert imported_names(path) & later == set()


def test_kernels_source_never_imports_raypaged():
    offenders = [p.name for p in (ROOT / "kernels").rglob("*.py")
                 if any(n.split(".")[0] == "raypaged" for n in imported_names(p))]
    assert offenders == []


def test_every_source_package_is_listed_for_installation():
    """A regular (non-editable) install ships only the packages pyproject lists; a new
    subpackage missing there works in development and breaks in every image."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.relative_to(ROOT).parent.parts) for p in (ROOT / "raypaged").rglob("__init__.py")}
    assert on_disk - listed == set()
