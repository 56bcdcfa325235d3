"""ruff and mypy --strict are part of the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests import background

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_ruff() -> None:
    result = _run("ruff", "check", "copilot_runtime", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict() -> None:
    result = background.result("mypy", timeout=600)  # started with the session
    assert result.returncode == 0, result.stdout + result.stderr
