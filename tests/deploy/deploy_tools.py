"""The real tools the deploy checks run (installed by tests/deploy/tools/install.sh into .tools/)."""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools"
BIN = TOOLS / "bin"
INSTALL = ROOT / "tests/deploy/tools/install.sh"
CHART = ROOT / "helm/raypaged"
VALUES = Path(__file__).resolve().parent / "values"


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run {INSTALL.relative_to(ROOT)}")
    return str(path)


def run(name: str, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run a tool; with check, a non-zero exit fails with the tool's own output."""
    done = subprocess.run([tool(name), *args], capture_output=True, text=True, timeout=120, **kw)
    if check and done.returncode != 0:
        raise AssertionError(f"{name} {' '.join(args)} exited {done.returncode}:\n"
                             f"{done.stdout}\n{done.stderr}")
    return done


def load_definition():
    """deploy/grafana/dashboard.py, the dashboard's one definition (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("dashboard", ROOT / "deploy/grafana/dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
