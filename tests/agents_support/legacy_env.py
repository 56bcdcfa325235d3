"""`.venv-legacy`: the separate environment of the legacy remote-endpoint test server.

Created on first use (about 20 s with a warm pip cache), re-created when
`legacy-requirements.txt` changes; the stamp file records which version it was made from.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agents_support.processes import REPO_ROOT

REQUIREMENTS = Path(__file__).with_name("legacy-requirements.txt")
VENV = REPO_ROOT / ".venv-legacy"


def legacy_python() -> Path:
    """The legacy environment's interpreter, the environment made first if needed (by one
    process at a time: the session makes it in the background, its test may ask meanwhile)."""
    with open(REPO_ROOT / ".venv-legacy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _made()


def _made() -> Path:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    stamp = VENV / f".installed-{digest}"
    python = VENV / "bin" / "python"
    if stamp.is_file() and python.is_file():
        return python
    shutil.rmtree(VENV, ignore_errors=True)
    steps = [[sys.executable, "-m", "venv", str(VENV)],
             [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              "-r", str(REQUIREMENTS)]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            pytest.fail(f"could not set up {VENV} ({' '.join(step[:3])} ...):\n"
                        f"{(done.stderr or done.stdout)[-3000:]}", pytrace=False)
    stamp.touch()
    return python
