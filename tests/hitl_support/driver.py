"""Runs `tests/js/drive_hitl.mjs` (the real npm clients) and returns what it saw."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

import pytest

from tests.agents_support.processes import REPO_ROOT

JS_DIR = REPO_ROOT / "tests" / "js"
_PACKAGES = ("@copilotkit/core", "@ag-ui/client", "agui-client-1", "zod")


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.fail("the real-client tests need Node.js 20+ on PATH", pytrace=False)
    modules = JS_DIR / "node_modules"
    if not all((modules / p / "package.json").is_file() for p in _PACKAGES):
        done = subprocess.run([shutil.which("npm") or "npm", "ci", "--no-audit", "--no-fund"],
                              cwd=JS_DIR, capture_output=True, text=True, timeout=600,
                              check=False)
        if done.returncode != 0:
            pytest.fail(f"`npm ci` in tests/js failed:\n{done.stderr[-3000:]}", pytrace=False)
    return node


def drive(scenario: str, url: str, **options: Any) -> dict[str, Any]:
    done = subprocess.run(
        [_node(), str(JS_DIR / "drive_hitl.mjs"), scenario, url, json.dumps(options)],
        cwd=JS_DIR, capture_output=True, text=True, timeout=90, check=False,
        env={**os.environ, "COPILOTKIT_TELEMETRY_DISABLED": "true", "DO_NOT_TRACK": "1"})
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    result = json.loads(lines[-1]) if lines else None
    if not isinstance(result, dict) or not result.get("ok"):
        pytest.fail(f"driver `{scenario}` failed: {result}\n{done.stderr[-3000:]}",
                    pytrace=False)
    return result
