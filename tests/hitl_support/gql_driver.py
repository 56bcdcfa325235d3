"""Runs `tests/gql/drive_hitl.mjs` (the real GraphQL client, runtime-client-gql 1.10.6)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from tests.agents_support.processes import REPO_ROOT
from tests.test_graphql_real_client import _npm_ci

GQL_DIR = REPO_ROOT / "tests" / "gql"
_ENV = {"COPILOTKIT_TELEMETRY_DISABLED": "true", "DO_NOT_TRACK": "1"}


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.fail("the real-client tests need Node.js 20+ on PATH", pytrace=False)
    _npm_ci()
    return node


def _result(scenario: str, stdout: str, stderr: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    result = json.loads(lines[-1]) if lines else None
    if not isinstance(result, dict) or not result.get("ok"):
        pytest.fail(f"driver `{scenario}` failed: {result}\n{stderr[-3000:]}", pytrace=False)
    return result


def drive_gql(scenario: str, url: str, **options: Any) -> dict[str, Any]:
    done = subprocess.run(
        [_node(), str(GQL_DIR / "drive_hitl.mjs"), scenario, url, json.dumps(options)],
        cwd=GQL_DIR, capture_output=True, text=True, timeout=90, check=False,
        env={**os.environ, **_ENV})
    return _result(scenario, done.stdout, done.stderr)


def drive_gql_across(url: str, between: Callable[[dict[str, Any]], None],
                     **options: Any) -> dict[str, Any]:
    """The `restart` scenario: once the driver waits (the page open at the question),
    `between(waiting)` runs (it kills and restarts the server, or waits for a timeout),
    then the driver answers."""
    process = subprocess.Popen(
        [_node(), str(GQL_DIR / "drive_hitl.mjs"), "restart", url, json.dumps(options)],
        cwd=GQL_DIR, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, **_ENV})
    assert process.stdin is not None
    assert process.stdout is not None
    try:
        first = process.stdout.readline()
        waiting = json.loads(first) if first.strip() else None
        if not isinstance(waiting, dict) or not waiting.get("waiting"):
            rest, err = process.communicate(timeout=30)
            pytest.fail(f"driver `restart` did not wait: {first}{rest}\n{err[-3000:]}",
                        pytrace=False)
        between(waiting)
        process.stdin.write("go\n")
        process.stdin.flush()
        rest, err = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    return _result("restart", rest, err)
