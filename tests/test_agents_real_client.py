"""The agent kinds behind our runtime, driven by the real CopilotKit client from npm.

`tests/js/drive_agents.mjs` runs `CopilotKitCore` (`@copilotkit/core`, whose agents are
`@ag-ui/client` HttpAgents) against our server, which serves
`tests/agents_support/realclient_agents_app.py`: two LangGraph graphs in-process and an
`HttpAgent` for the scripted AG-UI server. Every server is a child process on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from copilot_runtime.testing import verify_events
from tests.agents_support.processes import REPO_ROOT, child_process, free_port, mock_llm

JS_DIR = REPO_ROOT / "tests" / "js"
BASE = "/api/copilotkit"


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.fail("the real-client tests need Node.js 20+ on PATH", pytrace=False)
    modules = JS_DIR / "node_modules"
    if not all((modules / p / "package.json").is_file() for p in ("@copilotkit/core", "zod")):
        npm = shutil.which("npm")
        done = subprocess.run([npm or "npm", "ci", "--no-audit", "--no-fund"], cwd=JS_DIR,
                              capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            pytest.fail(f"`npm ci` in tests/js failed:\n{done.stderr[-3000:]}", pytrace=False)
    return node


@pytest.fixture(scope="module")
def runtime_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("agents-real-client")
    remote_port, port = free_port(), free_port()
    with mock_llm(logs) as llm_url, child_process(
            "agui-agent", [sys.executable, "-m", "tests.agents_support.agui_server",
                           "--port", str(remote_port)],
            ready_url=f"http://127.0.0.1:{remote_port}/agent", ready_method="POST",
            log_dir=logs), child_process(
            "runtime", [sys.executable, "-m", "copilot_runtime", "serve",
                        "tests.agents_support.realclient_agents_app:runtime",
                        "--port", str(port), "--path", BASE],
            ready_url=f"http://127.0.0.1:{port}{BASE}/info", log_dir=logs,
            env={"LLM_BASE_URL": llm_url,
                 "REMOTE_AGENT_URL": f"http://127.0.0.1:{remote_port}/agent"}):
        yield f"http://127.0.0.1:{port}{BASE}"


def drive(scenario: str, url: str) -> dict[str, Any]:
    done = subprocess.run([_node(), str(JS_DIR / "drive_agents.mjs"), scenario, url, "{}"],
                          cwd=JS_DIR, capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "COPILOTKIT_TELEMETRY_DISABLED": "true",
                               "DO_NOT_TRACK": "1"})
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    result = json.loads(lines[-1]) if lines else None
    if not isinstance(result, dict) or not result.get("ok"):
        pytest.fail(f"driver `{scenario}` failed: {result}\n{done.stderr[-3000:]}",
                    pytrace=False)
    return result


def roles(messages: list[dict[str, Any]]) -> list[str]:
    return [m["role"] for m in messages]


def test_langgraph_chat_tool_and_shared_state(runtime_url: str) -> None:
    result = drive("langgraph", runtime_url)
    assert {"lg", "planner", "remote"} <= set(result["agents"])
    assert result["coreErrors"] == []

    chat = result["chat"]
    verify_events(chat["events"])
    assert [(m["role"], m.get("content")) for m in chat["messages"]] == [
        ("user", "Hello"), ("assistant", "echo: Hello")]

    tool = result["tool"]
    assert tool["handlerCalls"] == [{"name": "Ada"}]
    assert roles(tool["messages"]) == ["user", "assistant", "tool", "assistant"]
    assert json.loads(tool["messages"][2]["content"]) == {"greeting": "Hello, Ada!"}
    assert tool["messages"][3]["content"] == "echo: " + tool["messages"][2]["content"]

    first, second = result["firstPlan"], result["secondPlan"]
    assert first["state"] == {"items": ["from the browser", "item 2"], "counter": 2,
                              "note": "2 items"}
    assert first["messages"][-1]["content"] == "echo: items=['from the browser', 'item 2']"
    # the browser edited the state between the runs; the graph read the edit
    assert second["state"] == {"items": ["edited in the browser", "item 2"], "counter": 3,
                               "note": "2 items"}
    assert second["messages"][-1]["content"] == \
        "echo: items=['edited in the browser', 'item 2']"


def test_remote_agent_through_the_runtime(runtime_url: str) -> None:
    result = drive("remote", runtime_url)
    chat = result["chat"]
    verify_events(chat["events"])
    assert [(m["role"], m.get("content")) for m in chat["messages"]] == [
        ("user", "Hello"), ("assistant", "remote: Hello")]
    assert chat["state"] == {"runs": 5, "stage": "answering", "lastInput": "Hello",
                             "nothing": None}
    dies = result["dies"]
    assert dies["events"][-1]["type"] == "RUN_ERROR"
    assert dies["events"][-1]["message"] == (
        "Remote agent 'remote' closed the connection before the answer was complete")
    assert [e["message"] for e in dies["errors"]] == [dies["events"][-1]["message"]]
    # the partial answer stays, closed, in the client's history
    assert dies["messages"][-1]["role"] == "assistant"
    partial = dies["messages"][-1]["content"]
    assert partial
    assert "remote: tell me more".startswith(partial)
    assert len(partial) < 20
