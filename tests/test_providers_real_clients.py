"""The real CopilotKit clients of both generations, chatting through each provider adapter,
and through MCP tools.

The same runtime as the other real-client tests (`tests/realclient_app.py`: the built-in agent
with `getWeather`), but with `LLM_PROVIDER` naming the adapter and the loopback mock of that
provider's wire format behind it, so the provider's real SDK runs end to end. In the
`openai-mcp` case the adapter is OpenAI's and `getWeather` is a tool of a real MCP server
(built with the SDK, a stdio child of the runtime), so the clients see an MCP tool's call and
result exactly as the TypeScript runtime's for its own action.

* GraphQL, `@copilotkit/runtime-client-gql` 1.10.6: every chat case of `tests/gql/drive.mjs`
  must give the client exactly what the TypeScript runtime 1.10.6 gave it on OpenAI
  (`tests/gql/expected/cases.json`, normalized as in `test_graphql_real_client.py`; for
  Gemini, which sends a call's arguments whole, the argument pieces are compared joined).
* AG-UI, `@copilotkit/core` 1.75 and `@ag-ui/client`: chat, the server-side tool loop, a
  frontend tool with the client's follow-up run, a stop mid-stream, an upstream failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.test_graphql_real_client import (
    _REFUSED,
    CHAT_CASES,
    EXPECTED,
    GQL_DIR,
    _answers,
    _Child,
    _npm_ci,
    normalized,
)
from tests.test_real_clients import (
    BASE_PATH,
    HELLO_CHAT,
    WEATHER,
    RealClientEnv,
    _child_env,
    _ensure_node_modules,
    _executable,
    _free_port,
    _info_answers,
    _Process,
    assert_one_complete_run,
    event_types,
    roles,
    run_requests,
    streamed_text,
    thread_id,
    user_and_assistant,
)

PROVIDERS = ["anthropic", "google", "openai-mcp"]
_MOCKS = {"anthropic": "copilot_runtime.testing.mock_anthropic",
          "google": "copilot_runtime.testing.mock_gemini",
          "openai-mcp": "copilot_runtime.testing"}
_READY = re.compile(r"mock \w+ listening on (http://\S+)")

Json = dict[str, Any]
#: Gemini sends a function call's arguments whole, not in pieces as OpenAI and Anthropic do.
_WHOLE_ARGUMENTS = {"google"}


def _joined_arguments(value: Any) -> Any:
    """The result with each action execution's streamed argument pieces joined into one."""
    if isinstance(value, list):
        return [_joined_arguments(v) for v in value]
    if not isinstance(value, dict):
        return value
    return {k: ["".join(v)] if k == "arguments" and isinstance(v, list)
            else _joined_arguments(v) for k, v in value.items()}


def _provider_env(provider: str) -> dict[str, str]:
    if provider == "openai-mcp":
        return {"LLM_PROVIDER": "openai", "MCP_WEATHER": "1"}
    return {"LLM_PROVIDER": provider}


def _mock_command(provider: str) -> list[str]:
    return [sys.executable, "-m", _MOCKS[provider], "--port", str(_free_port()),
            "--chunks", "5"]


# ---- GraphQL, 1.10.6 --------------------------------------------------------------------------


@pytest.fixture(scope="module", params=PROVIDERS)
def gql_results(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Json]]:
    provider: str = request.param
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not on PATH: these tests need Node.js >= 20", pytrace=False)
    _npm_ci()
    logs = tmp_path_factory.mktemp(f"gql-{provider}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    children: list[_Child] = []
    try:
        mock = _Child(_mock_command(provider), logs / "mock.log", env)
        children.append(mock)
        mock.wait_for(lambda: _READY.search(mock.text()) is not None, "the mock LLM")
        match = _READY.search(mock.text())
        assert match is not None
        port = _free_port()
        server = _Child([sys.executable, "-m", "copilot_runtime", "serve", "tests.gql.app:app",
                         "--host", "127.0.0.1", "--port", str(port)], logs / "server.log",
                        {**env, "LLM_BASE_URL": match.group(1), **_provider_env(provider)})
        children.append(server)
        url = f"http://127.0.0.1:{port}/copilotkit"
        server.wait_for(lambda: _answers(url), "our runtime")
        proc = subprocess.run([node, str(GQL_DIR / "drive.mjs"), url, ",".join(
            sorted({name.split(".")[0] for name in CHAT_CASES}))], cwd=GQL_DIR,
            capture_output=True, text=True, timeout=90, check=False)
        if proc.returncode != 0 or not proc.stdout.strip():
            pytest.fail(f"drive.mjs failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n"
                        f"--- server log ---\n{server.text()[-3000:]}", pytrace=False)
        results: Json = json.loads(proc.stdout.strip().splitlines()[-1])
        results["_server_log"] = server.text()
        yield provider, results
    finally:
        for child in reversed(children):
            child.stop()


def test_graphql_client_sees_what_the_typescript_runtime_gave(
        gql_results: tuple[str, Json]) -> None:
    provider, results = gql_results
    mismatched = []
    for name in CHAT_CASES:
        mine = results.get(name)
        assert mine is not None, f"{provider}: drive.mjs produced no result for {name}"
        assert "driverError" not in mine, (provider, name, mine["driverError"])
        expected = EXPECTED[name]
        if provider in _WHOLE_ARGUMENTS:
            mine, expected = _joined_arguments(mine), _joined_arguments(expected)
        theirs = normalized(expected)
        if name in _REFUSED:  # (the 1.10 client reads our refusal: tests/test_graphql_real_client)
            theirs = {**theirs, "errors": [{**e, "codes": ["MISUSE"]} for e in theirs["errors"]]}
        if normalized(mine) != theirs:
            mismatched.append(name)
    assert not mismatched, (provider, mismatched,
                            {n: results[n] for n in mismatched[:2]},
                            results["_server_log"][-2000:])
    text = json.dumps({k: v for k, v in results.items() if k != "_server_log"})
    for leak in ("Traceback", ".py", "site-packages"):
        assert leak not in text, (provider, leak)


# ---- AG-UI, @copilotkit/core 1.75 -------------------------------------------------------------


@pytest.fixture(scope="module", params=PROVIDERS)
def agui(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealClientEnv]:
    provider: str = request.param
    node = _executable("node")
    _ensure_node_modules()
    log_dir = tmp_path_factory.mktemp(f"agui-{provider}")
    processes: list[_Process] = []
    try:
        mock = _Process.start("mock LLM", _mock_command(provider), log_dir / "mock.log",
                              _child_env())
        processes.append(mock)
        mock.wait_until(lambda: _READY.search(mock.log_tail()) is not None, "the mock LLM")
        match = _READY.search(mock.log_tail())
        assert match is not None
        port = _free_port()
        server = _Process.start(
            "copilot_runtime server",
            [sys.executable, "-m", "copilot_runtime", "serve", "tests.realclient_app:runtime",
             "--host", "127.0.0.1", "--port", str(port), "--path", BASE_PATH],
            log_dir / "runtime.log",
            _child_env(LLM_BASE_URL=match.group(1), **_provider_env(provider)))
        processes.append(server)
        url = f"http://127.0.0.1:{port}{BASE_PATH}"
        server.wait_until(lambda: _info_answers(url), f"the runtime ({url}/info)")
        yield RealClientEnv(url, url, node, server, processes)
    finally:
        for proc in reversed(processes):
            proc.stop()


def test_agui_chat(agui: RealClientEnv) -> None:
    thread = thread_id("provider-chat")
    result = agui.drive("chat", text="Hello", threadId=thread)
    assert user_and_assistant(result["messages"]) == HELLO_CHAT
    assert_one_complete_run(result["events"], thread)
    assert streamed_text(result["events"]) == "echo: Hello"
    assert result["coreErrors"] == []


def test_agui_server_tool_loop(agui: RealClientEnv) -> None:
    thread = thread_id("provider-server-tool")
    result = agui.drive("chat", text='call:getWeather {"city":"Paris"}', threadId=thread)
    messages = result["messages"]
    assert roles(messages) == ["user", "assistant", "tool", "assistant"], messages
    (call,) = messages[1]["toolCalls"]
    assert call["function"]["name"] == "getWeather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert json.loads(messages[2]["content"]) == WEATHER
    assert messages[3]["content"] == "echo: " + messages[2]["content"]
    assert_one_complete_run(result["events"], thread)
    assert len(run_requests(result, agui)) == 1
    assert result["coreErrors"] == []


def test_agui_frontend_tool_and_follow_up(agui: RealClientEnv) -> None:
    result = agui.drive("frontend_tool", text='call:sayHello {"name":"Ada"}',
                        threadId=thread_id("provider-frontend-tool"))
    assert result["handlerCalls"] == [{"name": "Ada"}]
    messages = result["messages"]
    assert roles(messages) == ["user", "assistant", "tool", "assistant"], messages
    assert messages[3]["content"] == "echo: " + messages[2]["content"]
    assert len(run_requests(result, agui)) == 2
    assert "TOOL_CALL_RESULT" not in event_types(result["events"])
    assert result["coreErrors"] == []


def test_agui_stop_mid_stream(agui: RealClientEnv) -> None:
    thread = thread_id("provider-stop")
    result = agui.drive("stop", text="slow:200 please stop", followUp="Hello again",
                        threadId=thread)
    first = result["firstRun"]
    types = event_types(first["events"])
    assert types[-1] == "RUN_FINISHED", types
    partial = first["messages"][-1]["content"]
    assert partial
    assert "echo: slow:200 please stop".startswith(partial)
    assert len(partial) < len("echo: slow:200 please stop")
    assert user_and_assistant(result["secondRun"]["messages"])[-1] == (
        "assistant", "echo: Hello again")


@pytest.mark.parametrize("status", [401, 429, 500])
def test_agui_upstream_failure_is_a_run_error(agui: RealClientEnv, status: int) -> None:
    result = agui.drive("chat", text=f"error:{status}",
                        threadId=thread_id(f"provider-error-{status}"))
    events = result["events"]
    assert event_types(events)[-1] == "RUN_ERROR", events
    assert f"HTTP {status}" in events[-1]["message"]
    assert events[-1]["code"] == "UPSTREAM_ERROR"
    for marker in ("Traceback", ".py", "site-packages"):
        assert marker not in json.dumps(events[-1])
    assert roles(result["messages"]) == ["user"]
