"""`copilot-runtime demo` serves both workflows, offline, with checkpoints beside its threads."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from copilot_runtime.demo import build_demo_runtime
from tests.agents_support.processes import REPO_ROOT, free_port
from tests.conftest import parse_sse, run_input


def call(url: str, body: Any = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(
        body).encode(), headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
            kind = response.headers.get("content-type", "")
            return response.status, parse_sse(raw) if "event-stream" in kind else json.loads(raw)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_demo_clicks_through_approve_and_revise(tmp_path: Path) -> None:
    port = free_port()
    db = tmp_path / "demo.sqlite3"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}  # no key: offline
    process = subprocess.Popen([sys.executable, "-m", "copilot_runtime", "demo", "--port",
                                str(port), "--db", str(db)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}/copilotkit"
    try:
        for _ in range(300):
            try:
                status, info = call(url + "/info")
                break
            except OSError:
                time.sleep(0.05)
        assert {"default", "review_loop", "account_review"} <= set(info["agents"])
        events = call(url + "/agent/review_loop/run",
                      run_input("Reconcile the ledger for month-end", thread="d1"))[1]
        drafts = [e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT"]
        assert "Closing specialist, draft 1" in "".join(drafts)
        _, listed = call(url + "/approvals?threadId=d1")
        (first,) = listed["approvals"]
        status, revised = call(url + f"/approvals/{first['id']}",
                               {"action": "revise", "payload": "list the accruals"})
        assert (status, revised["run"]["status"]) == (200, "interrupted")
        second = revised["run"]["approvals"][0]
        assert second["value"]["data"]["agent_result"].endswith(
            'Revised as asked: "list the accruals".')
        status, done = call(url + f"/approvals/{second['id']}", {"action": "approve"})
        assert (status, done["run"]["status"]) == (200, "finished")
        _, messages = call(url + "/threads/d1/messages")
        assert messages["messages"][-1]["content"] == (
            "Approved: the Closing specialist's result is final.")
        accounts = call(url + "/agent/account_review/run",
                        run_input("Analyse GLOBEX-002", thread="d2"))[1]
        outcome = [e for e in accounts if e["type"] == "CUSTOM" and e["name"] == "on_interrupt"]
        assert json.loads(outcome[0]["value"])["recommendation"]["account_id"] == "GLOBEX-002"
    finally:
        process.terminate()
        out, err = process.communicate(timeout=20)
    assert b"Traceback" not in err, err
    assert b"workflows: account_review, review_loop" in out
    assert (tmp_path / "demo.checkpoints.sqlite3").exists()  # beside the thread database


def test_the_demo_runtime_in_memory() -> None:
    runtime, _ = build_demo_runtime()
    assert set(runtime.agents) == {"default", "review_loop", "account_review"}
    saver: Any = runtime.agents["review_loop"].graph.checkpointer  # type: ignore[attr-defined]
    assert saver.url == "memory"
    assert saver.approvals is runtime.agents["account_review"].approvals  # type: ignore[attr-defined]
