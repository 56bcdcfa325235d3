"""Compatibility with the real CopilotKit client libraries from npm.

Each test runs ``tests/js/drive.mjs`` (Node) with one scenario. The driver uses ``CopilotKitCore``
from ``@copilotkit/core`` 1.75.0, ``HttpAgent`` from ``@ag-ui/client`` 0.0.59 and, under the npm
alias ``agui-client-1``, ``HttpAgent`` from ``@ag-ui/client`` 1.0.0, and prints one JSON line with
what the client observed: its messages after the run, the AG-UI events it received, the errors it
reported and every HTTP exchange it made.

A session fixture installs the pinned packages (``npm ci`` in tests/js, once), starts the loopback
mock LLM (``python -m copilot_runtime.testing``) and our server
(``python -m copilot_runtime serve tests.realclient_app:runtime``) on free ports, and stops both at
the end. ``tests/realclient_app.py`` defines the runtime: agent ``default`` is the built-in LLM
agent on the mock, with the server-side action ``getWeather(city)``.

To point the tests at a server that is already running (for instance the TypeScript reference
runtime), set ``COPILOT_REALCLIENT_URL`` to its base URL, and ``COPILOT_REALCLIENT_SINGLE_URL`` to
its single-route endpoint when that is a different URL.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
JS_DIR = REPO_ROOT / "tests" / "js"
DRIVER = JS_DIR / "drive.mjs"
BASE_PATH = "/api/copilotkit"
APP_SPEC = "tests.realclient_app:runtime"

DRIVER_TIMEOUT_S = 40.0
STARTUP_TIMEOUT_S = 30.0
NPM_TIMEOUT_S = 600.0

HELLO_CHAT = [("user", "Hello"), ("assistant", "echo: Hello")]
WEATHER = {"city": "Paris", "temperature": 21, "unit": "celsius", "conditions": "sunny"}
_MOCK_READY = re.compile(r"mock OpenAI listening on (http://\S+)")

Json = dict[str, Any]


# ---- processes ----------------------------------------------------------------------------------


def _free_port() -> int:
    """A TCP port nothing listens on right now (bind to port 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _executable(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is not on PATH: the real-client tests need Node.js >= 20 and npm",
                    pytrace=False)
    return found


def _ensure_node_modules() -> None:
    """``npm ci`` in tests/js when the packages are missing (the lockfile pins every version)."""
    modules = JS_DIR / "node_modules"
    if all((modules / p / "package.json").is_file()
           for p in ("@copilotkit/core", "@ag-ui/client", "agui-client-1", "zod")):
        return
    npm = _executable("npm")
    try:
        proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=JS_DIR,
                              capture_output=True, text=True, timeout=NPM_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`npm ci` in {JS_DIR} did not finish within {NPM_TIMEOUT_S:.0f} s",
                    pytrace=False)
    if proc.returncode != 0:
        output = "\n".join(line for line in (proc.stderr + proc.stdout).splitlines()
                           if line.strip() and "Unknown user config" not in line)
        pytest.fail(f"`npm ci` in {JS_DIR} failed with exit code {proc.returncode}, so the real "
                    f"client packages are not installed (npm needs its registry once, and "
                    f"package-lock.json must match package.json).\n"
                    f"--- npm output ---\n{output[:4000]}", pytrace=False)


def run_client_script(script: str, payload: Any) -> Any:
    """What tests/js/`script` (a real client's code over JSON on stdin) answers `payload`."""
    node = _executable("node")
    _ensure_node_modules()
    proc = subprocess.run([node, str(JS_DIR / script)], cwd=JS_DIR,
                          input=json.dumps(payload).encode(), capture_output=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    return json.loads(proc.stdout)


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclass
class _Process:
    """A child process logging to a file; ``stop`` terminates and reaps it."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    @classmethod
    def start(cls, name: str, cmd: list[str], log_path: Path, env: dict[str, str]) -> _Process:
        log_file = log_path.open("wb")
        try:
            popen = subprocess.Popen(cmd, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                     stdout=log_file, stderr=subprocess.STDOUT, env=env)
        except BaseException:
            log_file.close()
            raise
        return cls(name, popen, log_path, log_file)

    def log_tail(self) -> str:
        return _tail(self.log_path)

    def wait_until(self, check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            code = self.popen.poll()
            if code is not None:
                pytest.fail(f"{self.name} exited with code {code} before {what} was ready:\n"
                            f"{self.log_tail()}", pytrace=False)
            if check():
                return
            time.sleep(0.05)
        pytest.fail(f"{what} not ready after {STARTUP_TIMEOUT_S:.0f} s:\n{self.log_tail()}",
                    pytrace=False)

    def stop(self) -> None:
        try:
            if self.popen.poll() is None:
                self.popen.send_signal(signal.SIGTERM)
                try:
                    self.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
                    self.popen.wait(timeout=10)
        finally:
            self.log_file.close()


def _info_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/info", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class RealClientEnv:
    """Where the runtime under test listens, and how to drive it with the real clients."""

    url: str
    single_url: str
    node: str
    server: _Process | None = None
    processes: list[_Process] = field(default_factory=list)

    def server_log(self) -> str:
        return self.server.log_tail() if self.server else "(external server: no log)"

    def drive(self, scenario: str, *, url: str | None = None, **options: Any) -> Json:
        """Run one driver scenario; return the JSON line it printed (which must say ok)."""
        cmd = [self.node, str(DRIVER), scenario, url or self.url, json.dumps(options)]
        env = _child_env(COPILOTKIT_TELEMETRY_DISABLED="true", DO_NOT_TRACK="1")
        try:
            proc = subprocess.run(cmd, cwd=JS_DIR, capture_output=True, text=True,
                                  timeout=DRIVER_TIMEOUT_S, env=env, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail(f"driver scenario `{scenario}` hung for {DRIVER_TIMEOUT_S:.0f} s\n"
                        f"--- server log ---\n{self.server_log()}", pytrace=False)
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        result: Any = None
        if lines:
            try:
                result = json.loads(lines[-1])
            except json.JSONDecodeError:
                result = None
        if not isinstance(result, dict):
            pytest.fail(f"driver scenario `{scenario}` printed no result (exit {proc.returncode})"
                        f"\n--- stdout ---\n{proc.stdout[-2000:]}\n--- stderr ---\n"
                        f"{proc.stderr[-4000:]}", pytrace=False)
        if not result.get("ok"):
            pytest.fail(f"driver scenario `{scenario}` failed: {result.get('error')}\n"
                        f"--- client errors ---\n{result.get('coreErrors')}\n"
                        f"--- driver stderr ---\n{proc.stderr[-3000:]}\n"
                        f"--- server log ---\n{self.server_log()}", pytrace=False)
        return result


@pytest.fixture(scope="session")
def rc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealClientEnv]:
    node = _executable("node")
    _ensure_node_modules()
    external = os.environ.get("COPILOT_REALCLIENT_URL")
    if external:
        url = external.rstrip("/")
        single = os.environ.get("COPILOT_REALCLIENT_SINGLE_URL", url).rstrip("/")
        yield RealClientEnv(url, single, node)
        return
    missing = [p for p in ("copilot_runtime/cli.py", "tests/realclient_app.py")
               if not (REPO_ROOT / p).is_file()]
    if missing:
        pytest.fail(f"cannot start the runtime under test: missing {', '.join(missing)}",
                    pytrace=False)
    log_dir = tmp_path_factory.mktemp("realclient")
    processes: list[_Process] = []
    try:
        mock = _Process.start(
            "mock LLM",
            [sys.executable, "-m", "copilot_runtime.testing", "--port", str(_free_port()),
             "--chunks", "5"],
            log_dir / "mock_llm.log", _child_env())
        processes.append(mock)
        found: list[str] = []

        def mock_ready() -> bool:
            match = _MOCK_READY.search(mock.log_tail())
            if match:
                found.append(match.group(1))
            return bool(found)

        mock.wait_until(mock_ready, "the mock LLM")
        port = _free_port()
        server = _Process.start(
            "copilot_runtime server",
            [sys.executable, "-m", "copilot_runtime", "serve", APP_SPEC, "--host", "127.0.0.1",
             "--port", str(port), "--path", BASE_PATH],
            log_dir / "runtime.log", _child_env(LLM_BASE_URL=found[0]))
        processes.append(server)
        url = f"http://127.0.0.1:{port}{BASE_PATH}"
        server.wait_until(lambda: _info_answers(url), f"the runtime ({url}/info)")
        yield RealClientEnv(url, url, node, server, processes)
    finally:
        for proc in reversed(processes):
            proc.stop()


# ---- assertion helpers --------------------------------------------------------------------------


_SESSION = uuid.uuid4().hex[:8]


def thread_id(name: str) -> str:
    """A thread id unique to this test session (an external server may keep older threads)."""
    return f"rc-{name}-{_SESSION}"


def event_types(events: list[Json]) -> list[str]:
    return [str(event.get("type")) for event in events]


def streamed_text(events: list[Json]) -> str:
    return "".join(str(e.get("delta", "")) for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")


def requests_to(result: Json, method: str, url: str) -> list[Json]:
    return [h for h in result["http"] if h["method"] == method and h["url"] == url]


def run_requests(result: Json, env: RealClientEnv) -> list[Json]:
    return requests_to(result, "POST", f"{env.url}/agent/default/run")


def assert_one_complete_run(events: list[Json], thread: str) -> None:
    types = event_types(events)
    assert types[0] == "RUN_STARTED", types
    assert types[-1] == "RUN_FINISHED", types
    assert types.count("RUN_STARTED") == 1, types
    assert types.count("RUN_FINISHED") == 1, types
    assert "RUN_ERROR" not in types, events
    assert events[0]["threadId"] == thread
    assert events[-1]["threadId"] == thread
    assert events[-1]["runId"] == events[0]["runId"]


def roles(messages: list[Json]) -> list[str]:
    return [str(m.get("role")) for m in messages]


def user_and_assistant(messages: list[Json]) -> list[tuple[str, Any]]:
    return [(m["role"], m.get("content")) for m in messages]


# ---- 1. discovery over both transports ----------------------------------------------------------


def test_info_rest_transport(rc: RealClientEnv) -> None:
    result = rc.drive("info", transport="rest")
    assert result["status"] == "connected", result["coreErrors"]
    assert result["transport"] == "rest"
    assert "default" in result["agents"]
    assert result["agentTypes"]["default"] == "ProxiedCopilotRuntimeAgent"
    assert isinstance(result["runtimeVersion"], str)
    assert result["runtimeVersion"]
    (info,) = result["http"]
    assert (info["method"], info["url"], info["status"]) == ("GET", f"{rc.url}/info", 200)
    assert info["contentType"].startswith("application/json")
    assert info["responseBody"]["agents"]["default"]["name"] == "default"
    assert result["coreErrors"] == []


def test_info_single_route_transport(rc: RealClientEnv) -> None:
    result = rc.drive("info", url=rc.single_url, transport="single")
    assert result["status"] == "connected", result["coreErrors"]
    assert result["transport"] == "single"
    assert "default" in result["agents"]
    (info,) = result["http"]
    assert (info["method"], info["url"], info["status"]) == ("POST", rc.single_url, 200)
    assert info["requestBody"] == {"method": "info"}
    assert info["responseBody"]["agents"]["default"]["name"] == "default"
    assert result["coreErrors"] == []


def test_info_auto_transport_settles_on_rest(rc: RealClientEnv) -> None:
    # "auto" (the default of the React provider since 1.55) tries GET {url}/info first
    result = rc.drive("info", transport="auto")
    assert result["status"] == "connected", result["coreErrors"]
    assert result["transport"] == "rest"
    assert "default" in result["agents"]
    assert [(h["method"], h["url"]) for h in result["http"]] == [("GET", f"{rc.url}/info")]
    assert result["coreErrors"] == []


# ---- 2. chat ------------------------------------------------------------------------------------


def test_chat_rest(rc: RealClientEnv) -> None:
    thread = thread_id("chat-rest")
    result = rc.drive("chat", text="Hello", threadId=thread)
    messages = result["messages"]
    assert user_and_assistant(messages) == HELLO_CHAT
    assert_one_complete_run(result["events"], thread)
    types = event_types(result["events"])
    assert types[1] == "TEXT_MESSAGE_START", types
    assert types[-2] == "TEXT_MESSAGE_END", types
    assert streamed_text(result["events"]) == "echo: Hello"
    assert result["events"][1]["messageId"] == messages[1]["id"]
    assert result["coreErrors"] == []
    (run,) = run_requests(result, rc)
    assert run["status"] == 200
    assert run["contentType"].startswith("text/event-stream")


SUGGESTED = [{"title": "Weather", "message": "What is the weather in Paris?",
              "isLoading": False}]
#: The mock LLM calls the forced copilotkitSuggest with this line's arguments.
SUGGEST_LINE = ('call:copilotkitSuggest {"suggestions":[{"title":"Weather",'
                '"message":"What is the weather in Paris?"}]}')


def test_dynamic_suggestions(rc: RealClientEnv) -> None:
    """CopilotKit 1.75's dynamic suggestions: /info says `suggestions`, so the core posts its
    forced-tool run to `agent/default/suggest`; the suggestions arrive, and the chat's thread
    keeps only the chat."""
    thread = thread_id("suggest")
    result = rc.drive("suggestions", threadId=thread, instructions=SUGGEST_LINE)
    assert result["advertised"] is True
    assert result["suggestions"] == SUGGESTED
    assert result["coreErrors"] == []
    suggests = requests_to(result, "POST", f"{rc.url}/agent/default/suggest")
    assert [s["status"] for s in suggests] == [200]
    sent = suggests[0]["requestBody"]
    assert sent["forwardedProps"]["toolChoice"] == {
        "type": "function", "function": {"name": "copilotkitSuggest"}}
    assert sent["threadId"] != thread  # the core's own throwaway id
    assert user_and_assistant(result["messages"]) == HELLO_CHAT
    assert result["after"] == result["before"]
    assert len(run_requests(result, rc)) == 1  # the chat's turn only


def test_dynamic_suggestions_single_route(rc: RealClientEnv) -> None:
    """The single-route client runs its suggestions as a plain `agent/run` (on a throwaway
    thread) with the OpenAI object form of `toolChoice`."""
    result = rc.drive("suggestions", url=rc.single_url, transport="single",
                      threadId=thread_id("suggest-single"), instructions=SUGGEST_LINE)
    assert result["suggestions"] == SUGGESTED
    assert result["coreErrors"] == []
    methods = [h["requestBody"].get("method") for h in requests_to(result, "POST", rc.single_url)
               if isinstance(h["requestBody"], dict)]
    assert methods.count("agent/run") == 2, methods  # the chat's turn, then the suggestion's


def test_chat_single_route(rc: RealClientEnv) -> None:
    thread = thread_id("chat-single")
    result = rc.drive("chat", url=rc.single_url, transport="single", text="Hello",
                      threadId=thread)
    assert user_and_assistant(result["messages"]) == HELLO_CHAT
    assert_one_complete_run(result["events"], thread)
    assert result["coreErrors"] == []
    runs = [h for h in requests_to(result, "POST", rc.single_url)
            if isinstance(h["requestBody"], dict) and h["requestBody"].get("method") == "agent/run"]
    assert len(runs) == 1
    assert runs[0]["requestBody"]["params"] == {"agentId": "default"}
    assert runs[0]["requestBody"]["body"]["threadId"] == thread
    assert runs[0]["contentType"].startswith("text/event-stream")


# ---- 3. server-side action, then the model's answer ---------------------------------------------


def test_server_action_result_and_follow_up_answer(rc: RealClientEnv) -> None:
    thread = thread_id("server-tool")
    result = rc.drive("chat", text='call:getWeather {"city":"Paris"}', threadId=thread)
    messages = result["messages"]
    assert roles(messages) == ["user", "assistant", "tool", "assistant"], messages

    (call,) = messages[1]["toolCalls"]
    assert call["function"]["name"] == "getWeather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    tool = messages[2]
    assert tool["toolCallId"] == call["id"]
    assert '"temperature":21' in tool["content"]
    assert json.loads(tool["content"]) == WEATHER

    assert messages[3]["content"] == "echo: " + tool["content"]

    events = result["events"]
    assert_one_complete_run(events, thread)
    types = event_types(events)
    for expected in ("TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END", "TOOL_CALL_RESULT"):
        assert expected in types, types
    start = events[types.index("TOOL_CALL_START")]
    assert (start["toolCallName"], start["toolCallId"]) == ("getWeather", call["id"])
    tool_result = events[types.index("TOOL_CALL_RESULT")]
    assert tool_result["toolCallId"] == call["id"]
    assert json.loads(tool_result["content"]) == WEATHER
    assert types.index("TOOL_CALL_RESULT") < types.index("TEXT_MESSAGE_START")
    assert streamed_text(events) == messages[3]["content"]
    # the loop runs in the server: one HTTP run, no client follow-up
    assert len(run_requests(result, rc)) == 1
    assert result["coreErrors"] == []


# ---- 4. frontend tool, then the client's follow-up run ------------------------------------------


def test_frontend_tool_handler_and_follow_up_run(rc: RealClientEnv) -> None:
    result = rc.drive("frontend_tool", text='call:sayHello {"name":"Ada"}',
                      threadId=thread_id("frontend-tool"))
    assert result["handlerCalls"] == [{"name": "Ada"}]
    assert result["coreErrors"] == []

    messages = result["messages"]
    assert roles(messages) == ["user", "assistant", "tool", "assistant"], messages
    (call,) = messages[1]["toolCalls"]
    assert call["function"]["name"] == "sayHello"
    tool = messages[2]
    assert tool["toolCallId"] == call["id"]
    assert json.loads(tool["content"]) == {"greeting": "Hello, Ada!"}
    assert messages[3]["content"] == "echo: " + tool["content"]

    # two HTTP runs: the model's tool call, then the follow-up the client started on its own
    first, second = run_requests(result, rc)
    assert [t["name"] for t in first["requestBody"]["tools"]] == ["sayHello"]
    assert first["requestBody"]["tools"][0]["parameters"]["properties"]["name"]["type"] == "string"
    follow_up_messages = second["requestBody"]["messages"]
    assert [m["role"] for m in follow_up_messages] == ["user", "assistant", "tool"]
    assert follow_up_messages[2]["toolCallId"] == call["id"]

    types = event_types(result["events"])
    assert types.count("RUN_STARTED") == 2, types
    assert types.count("RUN_FINISHED") == 2, types
    assert "RUN_ERROR" not in types
    first_run = types[: types.index("RUN_FINISHED") + 1]
    assert "TOOL_CALL_START" in first_run
    assert "TOOL_CALL_END" in first_run
    assert "TOOL_CALL_RESULT" not in types  # the server must not run a frontend tool
    assert streamed_text(result["events"]) == messages[3]["content"]


# ---- 5. connect (reload) ------------------------------------------------------------------------


def test_connect_restores_thread(rc: RealClientEnv) -> None:
    thread = thread_id("connect")
    first = rc.drive("chat", text="Hello", threadId=thread)
    restored = rc.drive("connect", threadId=thread)  # a new process: a fresh CopilotKitCore
    assert user_and_assistant(restored["messages"]) == HELLO_CHAT
    assert [m["id"] for m in restored["messages"]] == [m["id"] for m in first["messages"]]
    assert restored["coreErrors"] == []
    (connect,) = requests_to(restored, "POST", f"{rc.url}/agent/default/connect")
    assert connect["status"] == 200
    assert connect["requestBody"]["threadId"] == thread
    types = event_types(restored["events"])
    assert types, restored
    assert types[0] == "RUN_STARTED", types
    assert types[-1] == "RUN_FINISHED", types


# ---- 6. stop mid-stream -------------------------------------------------------------------------


def test_stop_mid_stream_keeps_partial_text(rc: RealClientEnv) -> None:
    thread = thread_id("stop")
    result = rc.drive("stop", text="slow:200 please stop", followUp="Hello again", threadId=thread)
    first = result["firstRun"]
    full = "echo: slow:200 please stop"

    types = event_types(first["events"])
    assert types[0] == "RUN_STARTED", types
    assert types[-1] == "RUN_FINISHED", types
    assert "RUN_ERROR" not in types
    assert "TEXT_MESSAGE_END" in types  # the open message was closed
    partial = first["messages"][-1]
    assert partial["role"] == "assistant"
    assert partial["content"], first["messages"]
    assert full.startswith(partial["content"]), partial
    assert len(partial["content"]) < len(full), partial
    # ~1.4 s for the whole answer at 200 ms per piece; the stop must cut it short
    assert first["durationMs"] < 1100, first

    (stop,) = requests_to(result, "POST", f"{rc.url}/agent/default/stop/{thread}")
    assert stop["requestBody"] == {"runId": first["events"][0]["runId"]}
    assert stop["status"] == 200
    assert stop["responseBody"]["stopped"] is True

    second = result["secondRun"]
    assert second["coreErrors"] == []
    assert user_and_assistant(second["messages"])[-2:] == [("user", "Hello again"),
                                                          ("assistant", "echo: Hello again")]
    assert_one_complete_run(second["events"], thread)
    assert result["coreErrors"] == []


# ---- 7. errors ----------------------------------------------------------------------------------


def test_unknown_agent(rc: RealClientEnv) -> None:
    result = rc.drive("unknown_agent", agentId="nope")
    raw = result["raw"]
    assert raw["status"] == 404
    assert raw["contentType"].startswith("application/json")
    assert raw["body"]["error"] == "Agent not found"
    assert "nope" in raw["body"]["message"]
    # @ag-ui/client HttpAgent raises "HTTP <status>: <body>"
    assert result["httpAgentError"].startswith("HTTP 404: ")
    assert json.loads(result["httpAgentError"][len("HTTP 404: "):])["error"] == "Agent not found"
    # CopilotKitCore reports it as a failed run and adds no message
    codes = {e["code"] for e in result["coreErrors"]}
    assert "agent_run_failed" in codes, result["coreErrors"]
    assert all("HTTP 404" in e["message"] for e in result["coreErrors"])
    assert result["newMessages"] == []


def test_invalid_run_body_raw_fetch(rc: RealClientEnv) -> None:
    result = rc.drive("raw", requests=[
        {"path": "/agent/default/run", "headers": {"Content-Type": "application/json"},
         "body": "{"},
        {"path": "/agent/default/run", "json": {}},
        {"path": "/agent/default/run", "json": {"threadId": "t", "runId": "r", "tools": [],
                                                "context": [],
                                                "messages": [{"id": "m", "role": "wizard"}]}},
    ])
    for response in result["responses"]:
        assert response["status"] == 400, response
        assert response["contentType"].startswith("application/json")
        assert response["body"]["error"] == "Invalid request body"
        assert response["body"]["details"], response


def test_llm_failure_is_a_run_error_without_internals(rc: RealClientEnv) -> None:
    result = rc.drive("chat", text="error:500", threadId=thread_id("llm-error"))
    events = result["events"]
    types = event_types(events)
    assert types[0] == "RUN_STARTED", types
    assert types[-1] == "RUN_ERROR", types
    assert "RUN_FINISHED" not in types
    message = events[-1]["message"]
    assert isinstance(message, str), events[-1]
    assert "500" in message, events[-1]
    leaked = json.dumps(events[-1])
    for marker in ("Traceback", ".py", 'File "', "site-packages"):
        assert marker not in leaked, events[-1]
    errors = [e for e in result["coreErrors"] if e["code"] == "agent_run_error_event"]
    assert [e["message"] for e in errors] == [message]
    assert roles(result["messages"]) == ["user"]
    (run,) = run_requests(result, rc)
    assert run["status"] == 200
    assert run["contentType"].startswith("text/event-stream")


def test_second_run_on_busy_thread_is_409(rc: RealClientEnv) -> None:
    thread = thread_id("busy")
    result = rc.drive("busy_thread", text="slow:150 keep me busy", threadId=thread)
    raw = result["raw"]
    assert raw["status"] == 409, raw
    assert raw["contentType"].startswith("application/json")
    assert isinstance(raw["body"], dict), raw
    assert isinstance(raw["body"].get("error"), str), raw
    assert str(result["httpAgentError"]).startswith("HTTP 409"), result
    # the run that holds the thread is not disturbed
    first = result["firstRun"]
    assert_one_complete_run(first["events"], thread)
    assert first["messages"][-1]["content"] == "echo: slow:150 keep me busy"


def test_single_route_envelope_errors(rc: RealClientEnv) -> None:
    result = rc.drive("raw", requests=[
        {"url": rc.single_url, "headers": {"Content-Type": "text/plain"}, "body": "hello"},
        {"url": rc.single_url, "json": {}},
        {"url": rc.single_url, "json": {"method": "x"}},
    ])
    not_json, no_method, bad_method = result["responses"]
    assert not_json["status"] == 415, not_json
    assert no_method["status"] == 400, no_method
    assert no_method["body"]["message"] == "Missing method field"
    assert bad_method["status"] == 400, bad_method
    assert bad_method["body"]["message"] == "Unsupported method 'x'"
    for response in result["responses"]:
        assert response["contentType"].startswith("application/json")
        assert response["body"]["error"] == "invalid_request"


# ---- 8. plain AG-UI HttpAgent, including the 1.0 client -----------------------------------------


@pytest.mark.parametrize("client", ["0.0.59", "1.0.0"])
def test_plain_httpagent_chat(rc: RealClientEnv, client: str) -> None:
    thread = thread_id(f"agui-{client}")
    result = rc.drive("agui_chat", client=client, text="Hello", threadId=thread)
    assert result["runError"] is None
    assert user_and_assistant(result["messages"]) == HELLO_CHAT
    assert_one_complete_run(result["events"], thread)
    (run,) = run_requests(result, rc)
    if client == "1.0.0":
        assert run["requestBody"]["protocolVersion"] == "1.0"


def test_agui_1_0_client_input_without_optional_fields(rc: RealClientEnv) -> None:
    thread = thread_id("agui-minimal")
    result = rc.drive("agui_chat", client="1.0.0", omitOptional=True, text="Hello",
                      threadId=thread)
    (run,) = run_requests(result, rc)
    sent = run["requestBody"]
    assert not {"tools", "context", "state", "forwardedProps"} & sent.keys(), sent
    assert run["status"] == 200, run
    assert result["runError"] is None
    assert user_and_assistant(result["messages"]) == HELLO_CHAT
    assert_one_complete_run(result["events"], thread)
