"""The simulator's tests run on core's own fake runner (tests/core/fake_runner.py)."""
import sys
from pathlib import Path

CORE_TESTS = Path(__file__).resolve().parents[1] / "core"
if str(CORE_TESTS) not in sys.path:
    sys.path.insert(0, str(CORE_TESTS))
