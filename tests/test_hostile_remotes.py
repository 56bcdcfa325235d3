"""Misbehaving upstreams cannot break a run, a thread or the client's stream.

A remote AG-UI agent (`HttpAgent`) that sends events of the wrong shape, or nested deeper than
any stage can carry, ends its run with one `RUN_ERROR` (UPSTREAM_ERROR) that says what was
wrong, and the thread stays readable and usable; a remote's own crash report (a stack trace, a
file path, its credentials) never reaches the client, in its message, error code or ids, while
a plain message still does; application data that is null (a CUSTOM's value, a
STATE_SNAPSHOT's snapshot) is relayed as null. The SSE decoder joins a long frame once
(linear, not quadratic) and caps a frame's size. A legacy remote endpoint's JSONL lines of
an unexpected shape, a too deep `/agents/state` answer and a too long line are the remote's
error, said as such. An MCP tool whose input schema is invalid is left out (the
server's other tools stay offered, at start and after `tools/list_changed`), and one whose
schema refers to itself answers the model with a tool error instead of failing the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from mcp.server.mcpserver import Context
from mcp.server.mcpserver import MCPServer as SDKServer
from mcp.types import Tool
from structlog.testing import capture_logs

from copilot_runtime import (
    Action,
    BuiltInAgent,
    CopilotRuntime,
    MCPServer,
    MCPToolset,
    OpenAIAdapter,
    RunContext,
    UpstreamError,
    _held,
)
from copilot_runtime._input import parse_run_input
from copilot_runtime._limits import MAX_JSON_DEPTH
from copilot_runtime.agents import remote_endpoint
from copilot_runtime.agents._http_client import Timeouts
from copilot_runtime.agents._wire import RemoteEventChecker, SSEDecoder
from copilot_runtime.agents.http import HttpAgent
from copilot_runtime.agents.remote_endpoint import (
    CopilotKitRemoteEndpoint,
    RemoteEndpointAgent,
    RetryPolicy,
)
from copilot_runtime.testing import MockOpenAIServer, verify_events
from copilot_runtime.testing.loopback import LoopbackServer, pause
from copilot_runtime.testing.scripted import ScriptedAdapter, text_turn
from tests.conftest import Served, ServeRuntime, run_input, serve, text_of, types
from tests.gql.wire import chat_data, text_message

TIMEOUT_S = 60
Json = dict[str, Any]
# What a remote's own crash report would show, and what the client must never see.
_INTERNALS = ("Traceback", 'File "', ".py")
_TRACEBACK = ('Traceback (most recent call last):\n  File "/srv/agent/app.py", line 12, in run'
              "\n    raise ValueError(\"boom\")\nValueError: boom")


def sse(event: Json) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def raw_sse(text: str) -> bytes:
    """A frame of JSON text as it is (orjson cannot write what nests over 254 levels)."""
    return b"data: " + text.encode() + b"\n\n"


def deep(levels: int) -> str:
    return '{"d":' * levels + "1" + "}" * levels


def leaks(events: list[Json]) -> list[str]:
    blob = orjson.dumps(events).decode()
    return [marker for marker in _INTERNALS if marker in blob]


STARTED: Json = {"type": "RUN_STARTED", "threadId": "T", "runId": "R"}
FINISHED: Json = {"type": "RUN_FINISHED", "threadId": "T", "runId": "R"}
START: Json = {"type": "TEXT_MESSAGE_START", "messageId": "m1", "role": "assistant"}
CONTENT: Json = {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "hello"}
END: Json = {"type": "TEXT_MESSAGE_END", "messageId": "m1"}


def snapshot(messages: Any) -> list[bytes]:
    return [sse(STARTED), sse({"type": "MESSAGES_SNAPSHOT", "messages": messages}), sse(FINISHED)]


_NOT_MESSAGES = "sent MESSAGES_SNAPSHOT whose 'messages' is not a list of messages with string ids"
_TOO_DEEP = f"sent an event nested deeper than {MAX_JSON_DEPTH} levels"
_FINISHED_SCHEMA = "sent RUN_FINISHED that does not match the AG-UI schema "

# name -> (the remote's SSE body, what the client's RUN_ERROR must say after "Remote agent 'name' ")
SHAPES: dict[str, tuple[list[bytes], str]] = {
    "snapshot-of-strings": (snapshot(["garbage", 5]), _NOT_MESSAGES),
    "snapshot-without-id": (snapshot([{"role": "assistant", "content": "x"}]), _NOT_MESSAGES),
    "snapshot-dict": (snapshot({"a": {"id": "x", "role": "user", "content": "x"}}),
                      _NOT_MESSAGES),
    "snapshot-int": (snapshot(7), _NOT_MESSAGES),
    "delta-string": ([sse(STARTED), sse({"type": "STATE_SNAPSHOT", "snapshot": {"a": 1}}),
                      sse({"type": "STATE_DELTA", "delta": "not a patch"}), sse(FINISHED)],
                     "sent STATE_DELTA whose 'delta' is not a JSON Patch"),
    "error-code-int": ([sse(STARTED), sse({"type": "RUN_ERROR", "message": "boom", "code": 500})],
                       "sent RUN_ERROR with a 'code' that is not a string"),
    "step-name-list": ([sse(STARTED), sse({"type": "STEP_STARTED", "stepName": ["a"]}),
                        sse({"type": "STEP_FINISHED", "stepName": ["a"]}), sse(FINISHED)],
                       "sent STEP_STARTED without a string 'stepName'"),
    "step-name-dict": ([sse(STARTED), sse({"type": "STEP_STARTED", "stepName": "plan"}),
                        sse({"type": "STEP_FINISHED", "stepName": {"a": 1}}), sse(FINISHED)],
                       "sent STEP_FINISHED without a string 'stepName'"),
    "deep-state-snapshot": ([sse(STARTED), raw_sse(
        f'{{"type":"STATE_SNAPSHOT","snapshot":{deep(600)}}}'),
        sse(START), sse(CONTENT), sse(END), sse(FINISHED)], _TOO_DEEP),
    "deep-extra-on-start": ([sse(STARTED), raw_sse(
        '{"type":"TEXT_MESSAGE_START","messageId":"m1","role":"assistant",'
        f'"extra":{deep(600)}}}'), sse(CONTENT), sse(END), sse(FINISHED)], _TOO_DEEP),
    "deep-custom": ([sse(STARTED), raw_sse(f'{{"type":"CUSTOM","name":"x","extra":{deep(1000)}}}'),
                     sse(FINISHED)], _TOO_DEEP),
    # What the AG-UI schema refuses (a client's @ag-ui/client too) was relayed and stored:
    "role-banana": ([sse(STARTED), sse({**START, "role": "banana"}), sse(CONTENT), sse(END),
                     sse(FINISHED)], "sent TEXT_MESSAGE_START that does not match the AG-UI "
                                     "schema (role: Input should be"),
    "custom-without-name": ([sse(STARTED), sse({"type": "CUSTOM", "value": 1}), sse(FINISHED)],
                            "sent CUSTOM that does not match the AG-UI schema (name: Field "
                            "required)"),
    "snapshot-without-snapshot": ([sse(STARTED), sse({"type": "STATE_SNAPSHOT"}), sse(FINISHED)],
                                  "sent STATE_SNAPSHOT that does not match the AG-UI schema "
                                  "(snapshot: Field required)"),
    "snapshot-content-int": (snapshot([{"id": "a", "role": "assistant", "content": 5}]),
                             "sent MESSAGES_SNAPSHOT that does not match the AG-UI schema "
                             "(messages.0.assistant.content:"),
    "delta-op-unknown": ([sse(STARTED), sse({"type": "STATE_SNAPSHOT", "snapshot": {"a": 1}}),
                          sse({"type": "STATE_DELTA", "delta": [{"op": "explode"}]}),
                          sse(FINISHED)],
                         "sent STATE_DELTA that does not match the AG-UI schema (delta.0:"),
    "token-timestamp": ([sse(STARTED), sse(START), sse({**CONTENT, "timestamp": "now"}),
                         sse(END), sse(FINISHED)],
                        "sent TEXT_MESSAGE_CONTENT with a 'timestamp' that is not an integer"),
    # The run's own start and end too (their ids are the runtime's): a bad outcome was relayed
    # as a normal end and stored for every replay.
    "outcome-string": ([sse(STARTED), sse({**FINISHED, "outcome": "weird"})],
                       _FINISHED_SCHEMA + "(outcome: Input should be a valid dictionary"),
    "outcome-interrupts-string": (
        [sse(STARTED), sse({**FINISHED, "outcome": {"type": "interrupt", "interrupts": "nope"}})],
        _FINISHED_SCHEMA + "(outcome.interrupt.interrupts: Input should be a valid list)"),
    "outcome-unknown-type": ([sse(STARTED), sse({**FINISHED, "outcome": {"type": "explode"}})],
                             _FINISHED_SCHEMA + "(outcome: Input tag "),
    "interrupt-without-id": (
        [sse(STARTED), sse({**FINISHED, "outcome": {"type": "interrupt",
                                                    "interrupts": [{"reason": "x"}]}})],
        _FINISHED_SCHEMA + "(outcome.interrupt.interrupts.0.id: Field required)"),
    "finished-timestamp-huge": ([sse(STARTED), sse({**FINISHED, "timestamp": 2 ** 60})],
                                _FINISHED_SCHEMA + "(timestamp: Input should be less than"),
    "finished-usage-string": ([sse(STARTED), sse({**FINISHED, "usage": "lots"})],
                              _FINISHED_SCHEMA + "(usage: Input should be a valid list)"),
    "started-parent-run-int": ([sse({**STARTED, "parentRunId": 5}), sse(FINISHED)],
                               "sent RUN_STARTED that does not match the AG-UI schema "
                               "(parentRunId: Input should be a valid string)"),
}

# name -> (HTTP status, the remote's SSE body or its JSON error body)
CRASH_REPORTS: dict[str, tuple[int, list[bytes] | Json]] = {
    "run-error-traceback": (200, [sse(STARTED), sse(
        {"type": "RUN_ERROR", "message": _TRACEBACK, "code": "CRASHED"})]),
    "run-error-path": (200, [sse(STARTED), sse(
        {"type": "RUN_ERROR", "message": "could not read /srv/agent/settings.py",
         "code": "CRASHED"})]),
    "run-error-plain": (200, [sse(STARTED), sse(
        {"type": "RUN_ERROR", "message": "model overloaded", "code": "CRASHED"})]),
    "http-traceback": (502, {"detail": _TRACEBACK}),
    "http-plain": (502, {"detail": "model overloaded"}),
    # Not JSON: the event was quoted raw (a credential, a crash report).
    "bad-json-traceback": (200, [sse(STARTED), raw_sse(
        'Traceback (most recent call last): File "/srv/agent/app.py", line 12, in run')]),
    "bad-json-secret": (200, [sse(STARTED), raw_sse(
        '{"type":"TEXT_MESSAGE_CONTENT","delta":"postgresql://admin:s3cr3tpw@db.internal/x')]),
}


# Application data that is null (the official Python encoder writes `"value": null`; both
# clients take it): relayed and stored as it came, not stripped into a schema error.
_NULL_DATA: list[Json] = [{"type": "CUSTOM", "name": "progress", "value": None},
                          {"type": "STATE_SNAPSHOT", "snapshot": None},
                          {"type": "RAW", "event": None}]
VALID: dict[str, list[bytes]] = {
    "null-data": [sse(STARTED), *map(sse, _NULL_DATA), sse(START), sse(CONTENT), sse(END),
                  sse(FINISHED)],
    # The run's own ids are the runtime's, whatever the remote put there (or left out).
    "own-ids": [sse({"type": "RUN_STARTED", "threadId": 5}),
                sse({"type": "RUN_FINISHED", "runId": ["x"], "result": {"answer": 42},
                     "outcome": {"type": "success"}})],
    # A call started again by its id, before any result: the client continues it; the
    # thread's messages held two calls of that id, each with half the arguments.
    "tool-reopen": [sse(STARTED), *[sse(event) for args in ('{"a"', ":1}") for event in (
        {"type": "TOOL_CALL_START", "toolCallId": "c1", "toolCallName": "f",
         "parentMessageId": "m1"},
        {"type": "TOOL_CALL_ARGS", "toolCallId": "c1", "delta": args},
        {"type": "TOOL_CALL_END", "toolCallId": "c1"})], sse(FINISHED)],
    # Empty deltas (which the 0.0.59 client and the TypeScript runtime take) failed the run.
    "empty-deltas": [sse(STARTED), sse(START), sse({**CONTENT, "delta": ""}), sse(CONTENT),
                     sse(END), sse({"type": "TOOL_CALL_START", "toolCallId": "c1",
                                    "toolCallName": "f", "parentMessageId": "m1"}),
                     sse({"type": "TOOL_CALL_ARGS", "toolCallId": "c1", "delta": ""}),
                     sse({"type": "TOOL_CALL_ARGS", "toolCallId": "c1", "delta": "{}"}),
                     sse({"type": "TOOL_CALL_END", "toolCallId": "c1"}), sse(FINISHED)],
}


class HostileAGUIServer(LoopbackServer):
    """`POST /s/{name}` answers scenario `name` of `SHAPES`, `CRASH_REPORTS` or `VALID` as it
    is, or a well-formed answer ("fine") when the last message says "normal"."""

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/s/{name}", self._agent)

    def url(self, name: str) -> str:
        return f"http://{self.host}:{self.port}/s/{name}"

    async def _agent(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        name = request.match_info["name"]
        status, frames = CRASH_REPORTS.get(name) or (
            200, VALID[name] if name in VALID else SHAPES[name][0])
        if body["messages"][-1].get("content") == "normal":
            thread, run = body["threadId"], body["runId"]
            status, frames = 200, [
                sse({"type": "RUN_STARTED", "threadId": thread, "runId": run}),
                sse({**START, "messageId": f"m-{run}"}),
                sse({**CONTENT, "messageId": f"m-{run}", "delta": "fine"}),
                sse({**END, "messageId": f"m-{run}"}),
                sse({"type": "RUN_FINISHED", "threadId": thread, "runId": run})]
        if isinstance(frames, dict):
            return web.json_response(frames, status=status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for frame in frames:
            await response.write(frame)
        await response.write_eof()
        return response


@pytest.fixture
async def hostile() -> AsyncIterator[HostileAGUIServer]:
    async with HostileAGUIServer() as server:
        yield server


def remote_runtime(server: HostileAGUIServer, names: list[str]) -> CopilotRuntime:
    return CopilotRuntime(agents={
        name: HttpAgent(server.url(name), timeouts=Timeouts(read=10, total=30))
        for name in names})


def one_run_error(events: list[Json]) -> Json:
    """The stream is valid AG-UI and ends with its only terminal event, a RUN_ERROR."""
    verify_events(events)
    terminal = [e for e in events if e["type"] in ("RUN_FINISHED", "RUN_ERROR")]
    assert terminal == [events[-1]], types(events)
    assert events[-1]["type"] == "RUN_ERROR", types(events)
    assert not leaks(events), events[-1]
    return events[-1]


async def get_json(served: Served, path: str) -> Any:
    response = await served.session.get(served.url + path)
    assert response.status == 200, (path, await response.text())
    return await response.json()


# ---- a remote AG-UI agent's events of the wrong shape ---------------------------------------


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", list(SHAPES))
async def test_remote_event_of_a_wrong_shape_fails_the_run_not_the_thread(
        name: str, hostile: HostileAGUIServer, serve_runtime: ServeRuntime) -> None:
    thread = f"t-{name}"
    async with serve_runtime(remote_runtime(hostile, [name])) as served:
        events = await served.run(run_input("hello", thread=thread, run="r1"), agent=name)
        error = one_run_error(events)
        assert error["code"] == "UPSTREAM_ERROR", error
        assert error["message"].startswith(f"Remote agent '{name}' {SHAPES[name][1]}"), error
        # the thread's stored run reads back, whatever the remote sent
        for what in ("messages", "events", "state"):
            await get_json(served, f"/threads/{thread}/{what}")
        follow_up = await served.run(run_input("normal", thread=thread, run="r2"), agent=name)
        messages = orjson.dumps(await get_json(served, f"/threads/{thread}/messages"))
    verify_events(follow_up)
    assert types(follow_up)[-1] == "RUN_FINISHED"
    assert text_of(follow_up) == "fine"
    assert b'"fine"' in messages


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_remotes_null_application_data_is_relayed_and_stored_as_null(
        hostile: HostileAGUIServer, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(remote_runtime(hostile, ["null-data"])) as served:
        events = await served.run(run_input("hello", thread="t-null"), agent="null-data")
        stored = await get_json(served, "/threads/t-null/events")
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert [e for e in events if e["type"] in ("CUSTOM", "STATE_SNAPSHOT", "RAW")] == _NULL_DATA
    for event in _NULL_DATA:
        assert event in stored["events"], stored


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_remotes_run_ids_are_not_held_against_its_run_end(
        hostile: HostileAGUIServer, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(remote_runtime(hostile, ["own-ids"])) as served:
        events = await served.run(run_input("hello", thread="t-ids", run="r-ids"),
                                  agent="own-ids")
        stored = await get_json(served, "/threads/t-ids/events")
    verify_events(events)
    assert events[-1] == {"type": "RUN_FINISHED", "threadId": "t-ids", "runId": "r-ids",
                          "result": {"answer": 42}, "outcome": {"type": "success"}}, events
    assert stored["events"][-1] == events[-1]


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_remotes_empty_deltas_are_dropped_not_its_runs_failure(
        hostile: HostileAGUIServer, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(remote_runtime(hostile, ["empty-deltas"])) as served:
        events = await served.run(run_input("hello", thread="t-empty"), agent="empty-deltas")
        stored = await get_json(served, "/threads/t-empty/messages")
    verify_events(events)  # (which holds a delta to be non-empty, as the 1.50 client does)
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert text_of(events) == "hello"
    assert [e["delta"] for e in events if e["type"] == "TOOL_CALL_ARGS"] == ["{}"]
    assert stored["messages"][-1] == {"id": "m1", "role": "assistant", "content": "hello",
                                      "toolCalls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f",
                                                                  "arguments": "{}"}}]}


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_remotes_call_started_again_is_stored_as_one_call(
        hostile: HostileAGUIServer, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(remote_runtime(hostile, ["tool-reopen"])) as served:
        events = await served.run(run_input("hello", thread="t-reopen"), agent="tool-reopen")
        stored = await get_json(served, "/threads/t-reopen/messages")
    verify_events(events)
    assert stored["messages"][-1] == {"id": "m1", "role": "assistant", "toolCalls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}


# ---- what a remote says about its own failure ------------------------------------------------


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("name", "message"), [
    ("run-error-traceback", "Remote agent 'run-error-traceback' failed (its message is "
                            "withheld: it held a stack trace or a file path)"),
    ("run-error-path", "Remote agent 'run-error-path' failed (its message is withheld: it "
                       "held a stack trace or a file path)"),
    ("http-traceback", "Remote agent 'http-traceback' answered HTTP 502"),
    # controls: a plain message is passed on, as before
    ("run-error-plain", "model overloaded"),
    ("http-plain", "Remote agent 'http-plain' answered HTTP 502: model overloaded"),
    ("bad-json-traceback", "Remote agent 'bad-json-traceback' sent an event that is not valid "
                           "JSON"),
    ("bad-json-secret", "Remote agent 'bad-json-secret' sent an event that is not valid JSON: "
                        """'{"type":"TEXT_MESSAGE_CONTENT","delta":"postgresql://[REDACTED]@db"""
                        """.internal/'"""),  # (its first 80 bytes)
])
async def test_a_remotes_crash_report_is_withheld_a_plain_message_passed_on(
        name: str, message: str, hostile: HostileAGUIServer,
        serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(remote_runtime(hostile, [name])) as served:
        events = await served.run(run_input("hello", thread=f"t-{name}"), agent=name)
    error = one_run_error(events)
    assert error["message"] == message
    assert error["code"] == ("CRASHED" if name.startswith("run-error") else "UPSTREAM_ERROR")
    assert "s3cr3tpw" not in orjson.dumps(events).decode()


# The operator's credentials for a remote (`headers=`), neither of which looks like a key:
# the key as it is, and a token behind its scheme word, which the remote echoes alone.
_KEY, _TOKEN = "svc-4f9a8b7c6d5e", "tk4f9a8b7c6d5e"
_CREDENTIALS = {"X-Api-Key": _KEY, "Authorization": f"Token {_TOKEN}"}


class _Echoing(LoopbackServer):
    """A remote AG-UI agent (`/agui/...`) and a legacy endpoint (`/legacy/...`) that echo the
    credentials they were sent: in an HTTP 401's body (`.../status`), or in the run's own
    error (`.../run`)."""

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{tail:.*}", self._answer)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        said = (f"quota exceeded for key {request.headers['x-api-key']} and token "
                f"{request.headers['authorization'].split()[-1]}")
        if "/status" in request.path:
            return web.json_response({"error": said}, status=401)
        if request.path.startswith("/legacy"):
            return web.Response(body=jsonl({"type": "RunError", "message": said}),
                                content_type="application/x-ndjson")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse({**STARTED, "threadId": body["threadId"],
                                  "runId": body["runId"]}))
        await response.write(sse({"type": "RUN_ERROR", "message": said}))
        await response.write_eof()
        return response


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("name", "message"), [
    ("agui-status", "Remote agent 'agui-status' answered HTTP 401: quota exceeded for key "
                    "[REDACTED] and token [REDACTED]"),
    ("agui-run", "quota exceeded for key [REDACTED] and token [REDACTED]"),
    ("legacy-status", "Remote agent 'legacy-status' answered HTTP 401: quota exceeded for key "
                      "[REDACTED] and token [REDACTED]"),
    ("legacy-run", "quota exceeded for key [REDACTED] and token [REDACTED]"),
])
async def test_a_remote_echoing_the_operators_credentials_does_not_show_them(
        name: str, message: str, serve_runtime: ServeRuntime) -> None:
    """Before: the key `headers=` gave a remote reached the client, and the thread stored
    it, when the remote's error said it (a provider's error has it blanked)."""
    async with _Echoing() as remote:
        base = f"http://{remote.host}:{remote.port}/{name.replace('-', '/')}"
        agent = HttpAgent(base, headers=_CREDENTIALS, timeouts=Timeouts(read=10, total=30)) \
            if name.startswith("agui") else RemoteEndpointAgent(CopilotKitRemoteEndpoint(
                base, headers=_CREDENTIALS, retry=RetryPolicy(retries=0),
                timeouts=Timeouts(read=10, total=30)), name)
        async with serve_runtime(CopilotRuntime(agents={name: agent})) as served:
            events = await served.run(run_input("hello", thread=f"t-{name}"), agent=name)
            stored = orjson.dumps(await get_json(served, f"/threads/t-{name}/events")).decode()
    assert one_run_error(events)["message"] == message
    for secret in (_KEY, _TOKEN):
        assert secret not in orjson.dumps(events).decode() + stored


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("code", "relayed"), [
    (_TRACEBACK, "UPSTREAM_ERROR"), ("/srv/agent/app.py", "UPSTREAM_ERROR"),
    ("sk-live-ABCDEFGHIJKLMNOP", "UPSTREAM_ERROR"), ("x" * 65, "UPSTREAM_ERROR"),
    ("", "UPSTREAM_ERROR"),
    ("RATE_LIMITED", "RATE_LIMITED"), ("agent.quota:exceeded-2", "agent.quota:exceeded-2"),
])
def test_a_remotes_error_code_is_relayed_only_as_a_plain_token(code: str, relayed: str) -> None:
    """Before: the code was relayed as it came (the client's RUN_ERROR, GraphQL's
    `originalErrorType`) while the message beside it was withheld."""
    _, error = RemoteEventChecker("Remote agent 'r'").check([
        STARTED, {"type": "RUN_ERROR", "message": "failed", "code": code}])
    assert error == {"type": "RUN_ERROR", "message": "failed", "code": relayed}


@pytest.mark.timeout(TIMEOUT_S)
def test_an_order_error_quotes_the_remotes_ids_bounded() -> None:
    """Before: the runtime's own error quoted the offending id whole (a 200 KB RUN_ERROR),
    a stack trace or a key in it included."""
    checker = RemoteEventChecker("Remote agent 'r'")
    with pytest.raises(UpstreamError) as long:
        checker.check([STARTED, {**END, "messageId": "sk-live-ABCDEFGHIJKLMNOP " + "x" * 200_000}])
    assert long.value.message.startswith("Remote agent 'r' sent TEXT_MESSAGE_END for message "
                                         "'[REDACTED] xxx")
    assert len(long.value.message) < 330
    with pytest.raises(UpstreamError) as traced:
        RemoteEventChecker("Remote agent 'r'").check([STARTED, {**END, "messageId": _TRACEBACK}])
    assert traced.value.message == ("Remote agent 'r' sent TEXT_MESSAGE_END out of order (its "
                                    "ids are withheld: they held a stack trace or a file path)")


class _Elsewhere(LoopbackServer):
    """Another origin: what it was sent is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, str]] = []

    def routes(self, app: web.Application) -> None:
        async def record(request: web.Request) -> web.Response:
            self.seen.append(dict(request.headers))
            await request.read()
            return web.json_response({"agents": [], "actions": []})

        app.router.add_route("*", "/{tail:.*}", record)


class _Redirecting(LoopbackServer):
    """Answers every request 307 to `target`."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def routes(self, app: web.Application) -> None:
        async def redirect(request: web.Request) -> web.Response:
            await request.read()
            raise web.HTTPTemporaryRedirect(self.target)

        app.router.add_route("*", "/{tail:.*}", redirect)


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_redirect_is_not_followed_with_the_requests_credentials(
        serve_runtime: ServeRuntime) -> None:
    """aiohttp followed a remote's redirect to any origin with the request's headers (the
    operator's `headers=` credentials, the client's forwarded `x-*` ones; it drops only
    `Authorization`): a remote AG-UI agent's run and a legacy endpoint's discovery sent them
    to whoever the redirect named. A redirect is the remote's error now, followed nowhere."""
    async with _Elsewhere() as elsewhere, _Redirecting(
            f"http://localhost:{elsewhere.port}/steal") as redirecting:
        agent = HttpAgent(f"http://{redirecting.host}:{redirecting.port}/agent",
                          headers={"x-api-key": "OPERATOR-SECRET"},
                          timeouts=Timeouts(read=10, total=30))
        async with serve_runtime(CopilotRuntime(agents={"remote": agent})) as served:
            events = await served.run(run_input("hello"), agent="remote")
        error = one_run_error(events)
        assert error["code"] == "UPSTREAM_ERROR"
        assert error["message"].startswith(
            "Remote agent 'remote' answered HTTP 307: a redirect, not followed"), error
        endpoint = CopilotKitRemoteEndpoint(
            f"http://{redirecting.host}:{redirecting.port}/copilotkit",
            headers={"x-api-key": "OPERATOR-SECRET"})
        try:
            with pytest.raises(UpstreamError, match="HTTP 307: a redirect, not followed"):
                await endpoint.discover()
        finally:
            await endpoint.aclose()
        assert elsewhere.seen == []


# ---- the SSE decoder -------------------------------------------------------------------------


_STREAM = (b'data: {"type":"A"}\r\n\r\n: keep-alive\r\n\r\ndata: {"type":\r\ndata: "B"}\r\r'
           b'event: x\nid: 3\ndata: {"type":"C"}\n\ndata: {"type":"D"}\r\n\r\n')
_PAYLOADS = [b'{"type":"A"}', b'{"type":\n"B"}', b'{"type":"C"}', b'{"type":"D"}']


def feed_all(decoder: SSEDecoder, reads: list[bytes]) -> list[bytes]:
    payloads: list[bytes] = []
    for read in reads:
        payloads += decoder.feed(read)
    return payloads


def in_reads(data: bytes, size: int = 65536) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


@pytest.mark.timeout(TIMEOUT_S)
def test_a_remotes_unknown_events_are_logged_a_few_times_a_run() -> None:
    """A remote agent sending thousands of events of types no protocol knows wrote a log
    line for each: now each type once, at most five types a run, then one line saying the
    rest go unlogged; the events are still dropped and the run goes on."""
    checker = RemoteEventChecker("remote agent 'r'")
    unknown = [{"type": f"X_{i % 12}", "n": i} for i in range(3000)]
    with capture_logs() as logs:
        kept = checker.check([STARTED, *unknown, START, CONTENT])
    assert [e["type"] for e in kept] == ["RUN_STARTED", "TEXT_MESSAGE_START",
                                         "TEXT_MESSAGE_CONTENT"]
    assert [(e["event"], e.get("type")) for e in logs] == [
        *(("dropping events of an unknown type", f"X_{i}") for i in range(5)),
        ("dropping events of more unknown types; not logging them in this run", None)]
    # The next run logs again.
    with capture_logs() as logs:
        RemoteEventChecker("remote agent 'r'").check([STARTED, {"type": "X_0"}])
    assert len(logs) == 1


def test_sse_decoder_gives_the_same_payloads_however_the_reads_split() -> None:
    """(A guard for the rewritten decoder: the old one, which re-joined its buffer at each
    read, split correctly too.) Every split into two and three reads, and byte by byte,
    including a CRLF and a blank line cut between reads."""
    assert SSEDecoder().feed(_STREAM) == _PAYLOADS
    splits: list[tuple[int, ...]] = [(cut,) for cut in range(1, len(_STREAM))] + [
        (cut, second) for cut in range(1, len(_STREAM)) for second in range(cut + 1, len(_STREAM))]
    splits.append(tuple(range(1, len(_STREAM))))
    for cuts in splits:
        decoder = SSEDecoder()
        bounds = [0, *cuts, len(_STREAM)]
        got = feed_all(decoder, [_STREAM[a:b] for a, b in itertools.pairwise(bounds)])
        assert got == _PAYLOADS, cuts
        assert not decoder.pending()
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"type":"A"}\r') == []
    assert decoder.pending()
    assert decoder.feed(b"\n\r\n") == [b'{"type":"A"}']


@pytest.mark.timeout(TIMEOUT_S)
def test_sse_frame_larger_than_the_cap_is_the_remotes_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cap = 1 << 20
    monkeypatch.setattr(_held, "MAX_UPSTREAM_EVENT_BYTES", cap)
    # just under the cap: decoded
    frame = b'data: {"v":"' + b"y" * (cap - 100) + b'"}\n\n'
    assert [len(p) for p in feed_all(SSEDecoder(), in_reads(frame))] == [len(frame) - 8]
    # over it, arriving in reads (and never ending): refused
    with pytest.raises(UpstreamError, match=f"sent an event larger than {cap} bytes"):
        feed_all(SSEDecoder(), in_reads(b"data: " + b"y" * (2 * cap)))
    # in one read, after a complete frame
    with pytest.raises(UpstreamError, match="larger than"):
        SSEDecoder().feed(b'data: {"type":"A"}\n\ndata: ' + b"y" * (cap + 10))


@pytest.mark.timeout(TIMEOUT_S)
def test_sse_decoder_joins_a_long_frame_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 24 MiB frame in 64 KiB reads takes a fraction of a second; joining the buffer at
    every read (the old decoder) took seconds, growing with the square of the size."""
    monkeypatch.setattr(_held, "MAX_UPSTREAM_EVENT_BYTES", 64 << 20)  # (not the subject)
    size, limit = 24 << 20, 1.5
    frame = b'data: {"type":"CUSTOM","name":"x","value":"' + b"y" * size + b'"}\n\n'
    reads = in_reads(frame)
    decoder = SSEDecoder()
    got: list[bytes] = []
    started = time.perf_counter()
    for count, read in enumerate(reads, 1):
        got += decoder.feed(read)
        elapsed = time.perf_counter() - started
        assert elapsed < limit, f"{count} of {len(reads)} reads took {elapsed:.2f}s"
    assert len(got) == 1
    assert len(orjson.loads(got[0])["value"]) == size


def test_sse_decoder_ends_a_line_at_a_lone_cr_at_once() -> None:
    """A CR alone ends a line (the SSE spec allows CR, LF and CRLF): one at the end of a
    read ended nothing until the next read, so a stream of `\\r\\r` frames held its last
    event back (forever while the remote kept its stream open). An LF that opens the next
    read is the end of that CRLF, not a blank line of its own."""
    frames = b"".join(b'data: {"type":"%d"}\r\r' % n for n in range(3))
    assert SSEDecoder().feed(frames) == [b'{"type":"%d"}' % n for n in range(3)]
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"type":"A"}\r') == []
    assert decoder.feed(b"\r") == [b'{"type":"A"}']
    assert decoder.feed(b'\ndata: {"type":"B"}\r') == []  # (the CRLF's LF: no empty line)
    assert decoder.feed(b"\ndata: 2\r\n") == []
    assert decoder.feed(b"\r\n") == [b'{"type":"B"}\n2']
    assert not decoder.pending()


def test_sse_decoder_close_gives_a_last_frame_without_its_blank_line() -> None:
    """A stream that ends `data: {...}\\n` (no blank line after its last frame): the clients
    read that frame at the end of the stream; the decoder dropped it."""
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"type":"A"}\n\ndata: {"type":"B"}\n') == [b'{"type":"A"}']
    assert decoder.close() == [b'{"type":"B"}']
    assert decoder.close() == []
    assert SSEDecoder().close() == []
    lone = SSEDecoder()
    assert lone.feed(b'id: 3\ndata: {"type":"C"}\r') == []
    assert lone.close() == [b'{"type":"C"}']


def test_sse_decoder_skips_one_leading_bom() -> None:
    """A UTF-8 byte order mark before the first frame made its `data:` line unknown: the
    run's first event was lost. One is skipped, even split across reads; a second is not."""
    bom = b"\xef\xbb\xbf"
    assert SSEDecoder().feed(bom + b'data: {"type":"A"}\n\n') == [b'{"type":"A"}']
    decoder = SSEDecoder()
    assert feed_all(decoder, [bom[:1], bom[1:2], bom[2:] + b'data: {"type":"A"}\n\n']) == [
        b'{"type":"A"}']
    assert SSEDecoder().feed(bom + bom + b'data: {"type":"A"}\n\n') == []


def test_the_events_before_a_bad_one_in_a_read_are_passed_on() -> None:
    """The good events decoded from the same read as a bad one were dropped with it: what
    the client saw depended on how the network split the stream. They are returned, and
    the error kept for the caller to raise after them; anything after a terminal event is
    not part of the run, a bad frame included."""
    checker = RemoteEventChecker("Remote agent 'r'")
    good = [orjson.dumps(event) for event in (STARTED, START, CONTENT)]
    assert checker.payloads([*good, b'{"type": BROKEN']) == [STARTED, START, CONTENT]
    assert checker.failure is not None
    assert checker.failure.message.startswith("Remote agent 'r' sent an event that is not "
                                              "valid JSON")
    with pytest.raises(UpstreamError, match="not valid JSON"):
        checker.payloads([orjson.dumps(END)])
    checker = RemoteEventChecker("Remote agent 'r'")
    assert checker.payloads([orjson.dumps(STARTED), orjson.dumps(END)]) == [STARTED]
    assert checker.failure is not None
    assert "TEXT_MESSAGE_END" in checker.failure.message
    checker = RemoteEventChecker("Remote agent 'r'")
    assert checker.payloads([orjson.dumps(STARTED), orjson.dumps(FINISHED), b"{"]) == [
        STARTED, FINISHED]
    assert checker.failure is None


_FRAMES = [sse(STARTED), sse(START), sse(CONTENT), sse(END), sse(FINISHED)]
_QUOTA = b'{"message": "Agent quota exhausted for tenant acme"}'
_BROKEN = b'data: {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "hi", BROKEN\n\n'


class _Wire:
    """One way of writing an answer: its status, content type, the writes (each flushed,
    then a short pause, so each is a read of its own) and how long the stream stays open
    after them."""

    def __init__(self, writes: list[bytes], *, status: int = 200,
                 content_type: str | None = "text/event-stream", open_for: float = 0) -> None:
        self.writes, self.status, self.content_type = writes, status, content_type
        self.open_for = open_for


WIRES: dict[str, _Wire] = {
    "lone-cr-close": _Wire([b"".join(f.replace(b"\n\n", b"\r\r") for f in _FRAMES)]),
    "lone-cr-open": _Wire([b"".join(f.replace(b"\n\n", b"\r\r") for f in _FRAMES)],
                          open_for=10),
    "last-frame-no-blank-line": _Wire([b"".join(_FRAMES)[:-1]]),
    "bom": _Wire([b"\xef\xbb\xbf" + b"".join(_FRAMES[1:])]),
    "mixed-case-type": _Wire([b"".join(_FRAMES)], content_type="Text/Event-Stream"),
    "text-plain-type": _Wire([b"".join(_FRAMES)], content_type="text/plain; charset=utf-8"),
    "no-type": _Wire([b"".join(_FRAMES)], content_type=None),  # (aiohttp: octet-stream)
    "html-page": _Wire([b"<html><body>Sign in</body></html>"],
                       content_type="text/html; charset=utf-8"),
    "protobuf-type": _Wire([b"\x00\x00\x00\x02\x08\x01"],
                           content_type="application/vnd.ag-ui.event+proto"),
    "bad-frame-one-read": _Wire([b"".join(_FRAMES[:3]) + _BROKEN]),
    "bad-frame-own-read": _Wire([*_FRAMES[:3], _BROKEN]),
    "error-body-in-two-reads": _Wire([_QUOTA[:20], _QUOTA[20:]], status=429,
                                     content_type="application/json"),
}


class _WireServer(LoopbackServer):
    """`POST /w/{name}` answers `WIRES[name]` as it is written there."""

    def __init__(self) -> None:
        super().__init__()
        self.left = asyncio.Event()  # the runtime closed the endless stream

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/w/endless", self._endless)
        app.router.add_post("/w/{name}", self._answer)

    def url(self, name: str) -> str:
        return f"http://{self.host}:{self.port}/w/{name}"

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        wire = WIRES[request.match_info["name"]]
        response = web.StreamResponse(status=wire.status, headers={} if wire.content_type
                                      is None else {"Content-Type": wire.content_type})
        await response.prepare(request)
        try:
            for write in wire.writes:
                await response.write(write)
                await asyncio.sleep(0.02)
            if wire.open_for and not await pause(request, wire.open_for):
                return response
            await response.write_eof()
        except ConnectionResetError:  # (the runtime left first: a run it failed)
            pass
        return response


    async def _endless(self, request: web.Request) -> web.StreamResponse:
        """1 KB tokens until the runtime leaves (8 MB at most: endless, next to the bound
        under test), never an end."""
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        tokens = sse({**CONTENT, "delta": "x" * 1000}) * 100
        try:
            await response.write(sse(STARTED) + sse(START))
            for _ in range(80):
                await response.write(tokens)
                await asyncio.sleep(0)
        except ConnectionResetError:
            self.left.set()
        return response


async def _wire_run(name: str, serve_runtime: ServeRuntime) -> list[Json]:
    async with _WireServer() as server, serve_runtime(CopilotRuntime(agents={
            name: HttpAgent(server.url(name), timeouts=Timeouts(read=20, total=30))})) as served:
        return await served.run(run_input("hello", thread=f"t-{name}"), agent=name)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", ["lone-cr-close", "lone-cr-open", "last-frame-no-blank-line",
                                  "bom", "mixed-case-type", "text-plain-type", "no-type"])
async def test_a_remotes_valid_sse_variants_are_relayed_whole(
        name: str, serve_runtime: ServeRuntime) -> None:
    """Each failed or lost events before: lone-CR line ends (the last event held back, the
    run hanging while the stream stayed open), a last frame without its blank line (the run
    failed), a leading BOM (the first event lost), a content type in capitals, another
    content type or none (refused; @ag-ui/client reads SSE under any but protobuf's)."""
    started = time.monotonic()
    events = await _wire_run(name, serve_runtime)
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert text_of(events) == "hello"
    assert time.monotonic() - started < 5  # (not when the remote closes its stream)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("name", "said"), [
    ("protobuf-type", "answered with content type 'application/vnd.ag-ui.event+proto' "
                      "(AG-UI's protobuf encoding), not an event stream"),
    ("html-page", "answered with content type 'text/html; charset=utf-8' and no event")])
async def test_an_answer_that_is_no_event_stream_is_a_precise_error(
        name: str, said: str, serve_runtime: ServeRuntime) -> None:
    """Read as SSE, as @ag-ui/client reads any content type but protobuf's, a page or a
    JSON answer holds no event: its content type says what it was."""
    error = one_run_error(await _wire_run(name, serve_runtime))
    assert error["message"] == f"Remote agent '{name}' {said}", error


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", ["bad-frame-one-read", "bad-frame-own-read"])
async def test_a_bad_frame_fails_the_run_after_the_events_before_it_however_the_reads_split(
        name: str, serve_runtime: ServeRuntime) -> None:
    events = await _wire_run(name, serve_runtime)
    error = one_run_error(events)
    assert error["message"].startswith(f"Remote agent '{name}' sent an event that is not valid "
                                       "JSON"), error
    assert text_of(events) == "hello"


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_remotes_error_body_in_two_reads_keeps_its_message(
        serve_runtime: ServeRuntime) -> None:
    """The body of an HTTP error was read once: a JSON body in two TCP writes lost the
    remote's own message."""
    name = "error-body-in-two-reads"
    error = one_run_error(await _wire_run(name, serve_runtime))
    assert error["message"] == (f"Remote agent '{name}' answered HTTP 429: Agent quota "
                                "exhausted for tenant acme")


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_remote_streaming_without_end_is_stopped_at_the_live_bound(
        serve_runtime: ServeRuntime) -> None:
    """The runtime kept every event of a remote's endless stream: 400 MB of tokens grew it
    by as much. Past four times `max_run_bytes` the run ends (PAYLOAD_TOO_LARGE), the
    remote's request is closed, and the thread is stored and takes the next run."""
    async with _WireServer() as server, serve_runtime(CopilotRuntime(agents={
            "endless": HttpAgent(server.url("endless"), timeouts=Timeouts(read=10, total=30)),
            "fine": HttpAgent(server.url("last-frame-no-blank-line"))},
            max_run_bytes=64 * 1024)) as served:
        events = await served.run(run_input("go", thread="t-endless"), agent="endless")
        error = one_run_error(events)
        assert error["code"] == "PAYLOAD_TOO_LARGE", error
        assert f"passed {4 * 64 * 1024} bytes" in error["message"], error
        await asyncio.wait_for(server.left.wait(), 10)
        stored = await get_json(served, "/threads/t-endless/events")
        assert stored["events"][-1]["code"] == "PAYLOAD_TOO_LARGE"
        after = await served.run(run_input("again", thread="t-endless", run="r2"), agent="fine")
    assert types(after)[-1] == "RUN_FINISHED"


#: More concurrent calls than aiohttp's default pool holds (100 connections).
_CONCURRENT = 105


class _HoldingServer(LoopbackServer):
    """Every call reaches `_held` and waits for `release`: `POST /run` answers RUN_STARTED
    first (a run streaming for a long time), `POST /ck/actions/execute` nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = 0
        self.all_arrived, self.release = asyncio.Event(), asyncio.Event()

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/run", self._run)
        app.router.add_post("/ck/actions/execute", self._action)

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    async def _held(self) -> None:
        self.arrived += 1
        if self.arrived == _CONCURRENT:
            self.all_arrived.set()
        await self.release.wait()

    async def _run(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = {"threadId": body["threadId"], "runId": body["runId"]}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse({"type": "RUN_STARTED", **ids}))
        await self._held()
        await response.write(sse({"type": "RUN_FINISHED", **ids}))
        await response.write_eof()
        return response

    async def _action(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        await self._held()
        return web.json_response({"result": "done"})


async def _all_arrive(server: _HoldingServer, calls: list[Awaitable[Any]]) -> list[Any]:
    """Start `calls` together; each must reach `server` at once (not wait for another's
    connection), then all are let finish."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.all_arrived.wait(), 10)
        at_once = server.arrived
    finally:
        server.release.set()
        done = await asyncio.gather(*tasks, return_exceptions=True)
    assert at_once == len(calls), f"{at_once} of {len(calls)} reached the remote at once"
    return done


@pytest.mark.timeout(TIMEOUT_S)
async def test_concurrent_runs_of_a_remote_agent_are_not_queued_behind_each_other() -> None:
    """Runs past the 100th waited, silently and without bound, for one of the first 100 to
    end: aiohttp's default pool of 100 connections, shared by all runs of the agent."""
    async with _HoldingServer() as server:
        agent = HttpAgent(server.url("/run"))

        async def one(i: int) -> list[Json]:
            body = parse_run_input(run_input("hi", thread=f"t{i}", run=f"r{i}"))
            return [event async for batch in agent.run(body, RunContext("remote"))
                    for event in batch]

        try:
            ran = await _all_arrive(server, [one(i) for i in range(_CONCURRENT)])
        finally:
            await agent.aclose()
    assert [types(events) for events in ran] == [["RUN_STARTED", "RUN_FINISHED"]] * _CONCURRENT


@pytest.mark.timeout(TIMEOUT_S)
async def test_concurrent_calls_to_a_legacy_endpoint_are_not_queued_behind_each_other(
        ) -> None:
    async with _HoldingServer() as server:
        endpoint = CopilotKitRemoteEndpoint(server.url("/ck"))
        try:
            results = await _all_arrive(server, [endpoint.execute_action("act", {})
                                                 for _ in range(_CONCURRENT)])
        finally:
            await endpoint.aclose()
    assert results == ["done"] * _CONCURRENT


# ---- a legacy remote endpoint (CopilotKitRemoteEndpoint) -------------------------------------


def jsonl(*lines: Json) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def model_chunk(metadata: Json | None = None, **chunk: Any) -> Json:
    return {"event": "on_chat_model_stream", "metadata": metadata or {},
            "data": {"chunk": {"id": "m1", "content": "", **chunk}}}


_SHAPE = "sent a line of an unexpected shape"
# name -> (langgraph JSONL lines, what the RUN_ERROR says after "Remote agent 'name' ")
LEGACY: dict[str, tuple[bytes, str]] = {
    "response-metadata-string": (jsonl(model_chunk(response_metadata="stop")), _SHAPE),
    "tool-call-chunk-string": (jsonl(model_chunk(tool_call_chunks=["garbage"])), _SHAPE),
    "tool-call-chunks-int": (jsonl(model_chunk(tool_call_chunks=5)), _SHAPE),
    "emit-tool-calls-int": (jsonl(model_chunk(
        {"copilotkit:emit-tool-calls": 5},
        tool_call_chunks=[{"name": "f", "id": "c1", "args": "{}"}])), _SHAPE),
    "node-name-dict": (jsonl({"event": "on_copilotkit_state_sync", "node_name": {"a": 1},
                              "active": True, "state": {"x": 1}}),
                       "sent STEP_STARTED without a string 'stepName'"),
    "error-traceback": (jsonl(model_chunk(content="hi"), {"event": "error", "data": {
        "error": {"type": 'Traceback File "/srv/x.py"'}}}), "failed"),
    # Said of "The remote agent", unnamed, unlike every other error of a remote.
    "not-json": (b"<html>Please log in</html>\n", "sent a line that is not JSON"),
    "not-an-object": (b"[1, 2]\n", "sent a line that is not a JSON object"),
    # a control: a plain kind of error is still named
    "error-plain": (jsonl(model_chunk(content="hi"), {"event": "error", "data": {
        "error": {"type": "RateLimitError"}}}), "failed (RateLimitError)"),
}
# name -> CopilotKit runtime-event JSONL lines of a run that must succeed
LEGACY_VALID: dict[str, bytes] = {
    "meta-null": jsonl({"type": "MetaEvent", "name": "progress", "value": None},
                       {"type": "TextMessageStart", "messageId": "m"},
                       {"type": "TextMessageContent", "messageId": "m", "content": "done"},
                       {"type": "TextMessageEnd", "messageId": "m"}),
    # An object's arguments were sent as its Python repr ("{'x': 1}").
    "args-object": jsonl({"type": "ActionExecutionStart", "actionExecutionId": "a1",
                          "actionName": "f", "parentMessageId": "m"},
                         {"type": "ActionExecutionArgs", "actionExecutionId": "a1",
                          "args": {"x": 1, "say": "it's"}},
                         {"type": "ActionExecutionEnd", "actionExecutionId": "a1"}),
}
# What a CrewAI flow's `copilotkit_emit_state` sends: the flow's whole state, its raw
# (OpenAI-shaped) messages included, a call without an id and a result without one.
_FLOW_STATE = {"logs": ["searching"], "messages": [
    {"id": "run-1-u", "role": "user", "content": "hello"},
    {"content": None, "role": "assistant", "function_call": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "search", "arguments": '{"q":"x"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "3 results"}]}
_FLOW_CALL = (
    {"type": "ActionExecutionStart", "actionExecutionId": "c1", "actionName": "search",
     "parentMessageId": "chatcmpl-1"},
    {"type": "ActionExecutionArgs", "actionExecutionId": "c1", "args": '{"q":"x"}'},
    {"type": "ActionExecutionEnd", "actionExecutionId": "c1"},
    {"type": "ActionExecutionResult", "actionExecutionId": "c1", "actionName": "search",
     "result": "3 results"},
    {"type": "AgentStateMessage", "threadId": "t", "agentName": "crew", "nodeName": "chat",
     "runId": "x", "active": True, "role": "assistant", "state": orjson.dumps(
         _FLOW_STATE).decode(), "running": True})
LEGACY_VALID["flow-state"] = jsonl(*_FLOW_CALL, {"type": "RunError", "message": "quota"})
# The same flow syncing a conversation in the SDK's JSON representation.
LEGACY_VALID["flow-json-conversation"] = jsonl(*_FLOW_CALL[:4], {
    "type": "AgentStateMessage", "threadId": "t", "agentName": "crew", "nodeName": "chat",
    "runId": "x", "active": False, "role": "assistant", "running": True,
    "state": orjson.dumps({"messages": [
        {"id": "run-1-u", "role": "user", "content": "hello"},
        {"id": "c1", "name": "search", "arguments": {"q": "x"}, "parentMessageId": "chatcmpl-1"},
        {"id": "r-1", "actionExecutionId": "c1", "actionName": "search",
         "result": "3 results"}]}).decode()})
# name -> `langgraph` JSONL lines of a run that must succeed
LEGACY_GRAPHS: dict[str, bytes] = {
    # Each chunk of one call repeating its id and name: the call was started again at each.
    "call-chunks-with-ids": jsonl(
        model_chunk(tool_call_chunks=[{"name": "f", "id": "c1", "args": '{"a"'}]),
        model_chunk(tool_call_chunks=[{"name": "f", "id": "c1", "args": ":1}"}]),
        {"event": "on_chat_model_end", "data": {}, "metadata": {}}),
    # The SDK's run with a server tool: ToolNode's message has no id as the tool ends, the
    # checkpoint gives it one; a node's message the model never streamed precedes the
    # answer. The last sync carries the checkpoint's conversation (its JSON representation).
    "checkpoint-ids": jsonl(
        model_chunk(tool_call_chunks=[{"name": "f", "id": "c1", "args": '{"a":1}'}]),
        {"event": "on_chat_model_end", "data": {}, "metadata": {}},
        {"event": "on_tool_end", "data": {"output": {"lc": 1, "type": "constructor", "kwargs": {
            "content": "ok", "type": "tool", "name": "f", "tool_call_id": "c1"}}}},
        {"event": "on_chat_model_stream", "metadata": {},
         "data": {"chunk": {"id": "m2", "content": "answer"}}},
        {"event": "on_chat_model_end", "data": {}, "metadata": {}},
        {"event": "on_copilotkit_state_sync", "node_name": "__end__", "active": False,
         "state": {"x": 1, "messages": [
             {"role": "user", "content": "hello", "id": "run-1-u"},
             {"id": "c1", "name": "f", "arguments": {"a": 1}, "parentMessageId": "m1"},
             {"actionExecutionId": "c1", "actionName": "f", "result": "ok", "id": "t-9"},
             {"role": "assistant", "content": "from a node", "id": "n1"},
             {"role": "assistant", "content": "answer", "id": "m2"}]}}),
    # None of the client's messages in the checkpoint (a node rewrote the conversation):
    # a node's message, then the streamed answer.
    "rewritten": jsonl(
        {"event": "on_chat_model_stream", "metadata": {},
         "data": {"chunk": {"id": "m2", "content": "answer"}}},
        {"event": "on_chat_model_end", "data": {}, "metadata": {}},
        {"event": "on_copilotkit_state_sync", "node_name": "__end__", "active": False,
         "state": {"messages": [
             {"role": "assistant", "content": "summary", "id": "n0"},
             {"role": "assistant", "content": "answer", "id": "m2"}]}}),
    # The SDK lists the runtime's actions and other agents among the client's: the model
    # calls one, the graph ends, and the last sync's checkpoint knows nothing of the answer.
    **{name: jsonl(
        model_chunk(tool_call_chunks=[{"name": tool, "id": "c1", "args": "{}"}]),
        {"event": "on_chat_model_end", "data": {}, "metadata": {}},
        {"event": "on_copilotkit_state_sync", "node_name": "__end__", "active": False,
         "state": {"messages": [
             {"role": "user", "content": "go", "id": "u1"},
             {"id": "c1", "name": tool, "arguments": {}, "parentMessageId": "m1"}]}})
       for name, tool in (("calls-action", "lookup"), ("calls-agent", "helper"))},
    # Conversations that are none: nothing to show, the run goes on.
    "odd-messages": jsonl(
        {"event": "on_copilotkit_state_sync", "node_name": "a", "active": True,
         "state": {"messages": ["x", 5, {"role": "user", "content": "no id"}]}},
        {"event": "on_copilotkit_state_sync", "node_name": "a", "active": False,
         "state": {"messages": {"not": "a list"}}},
        model_chunk(content="still here")),
}
# One line of a `langgraph` agent holding two tool calls, the second of a wrong shape.
_TWO_CALLS = jsonl(model_chunk(tool_call_chunks=[
    {"name": "f", "id": "c1", "args": '{"a": 1}'}, {"name": "g", "id": 7, "args": "{}"}]))
_PADDING = 256 << 10


class LegacyEndpoint(LoopbackServer):
    """`/e/{name}/agents/execute` answers `LEGACY[name]`; `/e/huge/agents/execute` sends one
    line of 256 KiB in pieces and, a pause later, the rest of a good run;
    `/e/{name}/agents/state` answers a state nested 300 levels."""

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/e/{name}/agents/execute", self._execute)
        app.router.add_post("/e/{name}/agents/state", self._state)

    def url(self, name: str) -> str:
        return f"http://{self.host}:{self.port}/e/{name}"

    async def _execute(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        name = request.match_info["name"]
        if name != "huge":
            body = LEGACY_VALID.get(name) or LEGACY_GRAPHS.get(name) or (
                _TWO_CALLS if name == "two-calls" else LEGACY[name][0])
            return web.Response(body=body, content_type="application/x-ndjson")
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        line = orjson.dumps({"type": "TextMessageStart", "messageId": "m",
                             "padding": "y" * _PADDING})
        for i in range(0, len(line), 16384):  # no newline until the pause is over
            await response.write(line[i:i + 16384])
        if await pause(request, 2.0):  # (ends early once the runtime has hung up)
            await response.write(b"\n" + jsonl(
                {"type": "TextMessageContent", "messageId": "m", "content": "big"},
                {"type": "TextMessageEnd", "messageId": "m"}))
        return response

    async def _state(self, request: web.Request) -> web.Response:
        await request.read()
        body = ('{"threadId":"t1","threadExists":true,"messages":[],"state":'
                f"{deep(300)}}}")
        return web.Response(text=body, content_type="application/json")


@pytest.fixture
async def legacy() -> AsyncIterator[LegacyEndpoint]:
    async with LegacyEndpoint() as server:
        yield server


def legacy_agent(server: LegacyEndpoint, name: str, kind: str = "langgraph") -> RemoteEndpointAgent:
    endpoint = CopilotKitRemoteEndpoint(server.url(name), retry=RetryPolicy(retries=0),
                                        timeouts=Timeouts(read=10, total=30))
    return RemoteEndpointAgent(endpoint, name, kind=kind)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", list(LEGACY))
async def test_legacy_line_of_an_unexpected_shape_is_the_remotes_error(
        name: str, legacy: LegacyEndpoint, serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={name: legacy_agent(legacy, name)})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", thread=f"t-{name}"), agent=name)
        for what in ("messages", "events", "state"):
            await get_json(served, f"/threads/t-{name}/{what}")
    error = one_run_error(events)
    assert (error["code"], error["message"]) == (
        "UPSTREAM_ERROR", f"Remote agent '{name}' {LEGACY[name][1]}")


@pytest.mark.timeout(TIMEOUT_S)
async def test_legacy_meta_event_with_a_null_value_is_relayed_as_null(
        legacy: LegacyEndpoint, serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={"meta-null": legacy_agent(legacy, "meta-null", kind="")})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", thread="t-meta"), agent="meta-null")
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert {"type": "CUSTOM", "name": "progress", "value": None} in events


@pytest.mark.timeout(TIMEOUT_S)
async def test_legacy_object_args_are_sent_as_json(
        legacy: LegacyEndpoint, serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={"args-object": legacy_agent(legacy, "args-object",
                                                                 kind="")})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", thread="t-args"), agent="args-object")
    verify_events(events)
    (args,) = [e["delta"] for e in events if e["type"] == "TOOL_CALL_ARGS"]
    assert orjson.loads(args) == {"x": 1, "say": "it's"}


@pytest.mark.timeout(TIMEOUT_S)
async def test_legacy_graph_call_chunks_repeating_their_id_are_one_call(
        legacy: LegacyEndpoint, serve_runtime: ServeRuntime) -> None:
    name = "call-chunks-with-ids"
    runtime = CopilotRuntime(agents={name: legacy_agent(legacy, name)})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", thread="t-chunks"), agent=name)
        stored = await get_json(served, "/threads/t-chunks/messages")
    verify_events(events)
    assert [(e["type"], e.get("delta")) for e in events if e.get("toolCallId") == "c1"] == [
        ("TOOL_CALL_START", None), ("TOOL_CALL_ARGS", '{"a"'), ("TOOL_CALL_ARGS", ":1}"),
        ("TOOL_CALL_END", None)]
    calls = [c for m in stored["messages"] for c in m.get("toolCalls", ())]
    assert calls == [{"id": "c1", "type": "function",
                      "function": {"name": "f", "arguments": '{"a":1}'}}]


@pytest.mark.timeout(TIMEOUT_S)
async def test_legacy_graph_conversation_reaches_the_client_in_the_checkpoints_order(
        legacy: LegacyEndpoint, serve_runtime: ServeRuntime) -> None:
    """Before: the synced conversation was dropped, so the client sent the tool's result
    back under the id this runtime made up (the SDK appended it after the answer, a history
    its model refused) and never saw the node's message."""
    runtime = CopilotRuntime(agents={n: legacy_agent(legacy, n)
                                     for n in ("checkpoint-ids", "odd-messages")})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", thread="t-ck"), agent="checkpoint-ids")
        stored = await get_json(served, "/threads/t-ck/messages")
        odd = await served.run(run_input("hello", thread="t-odd"), agent="odd-messages")
    for run in (events, odd):
        verify_events(run)
    snapshots = [[m["id"] for m in e["messages"]] for e in events
                 if e["type"] == "MESSAGES_SNAPSHOT"]
    # (first what precedes the messages new to the client, so that merging the whole
    # conversation, new messages after those it holds, keeps this order)
    assert snapshots == [["run-1-u", "m1"], ["run-1-u", "m1", "t-9", "n1", "m2"]]
    assert [(m["id"], m["role"]) for m in stored["messages"]] == [
        ("run-1-u", "user"), ("m1", "assistant"), ("t-9", "tool"), ("n1", "assistant"),
        ("m2", "assistant")]
    assert stored["messages"][1]["toolCalls"][0]["function"] == {
        "name": "f", "arguments": '{"a":1}'}
    assert "MESSAGES_SNAPSHOT" not in types(odd)
    assert text_of(odd) == "still here"


@pytest.mark.timeout(TIMEOUT_S)
async def test_legacy_graph_conversation_new_from_its_start_never_blanks_the_chat(
        legacy: LegacyEndpoint, serve_runtime: ServeRuntime) -> None:
    """Before: with none of the client's messages in it, what preceded the first new one
    was an empty snapshot, and a client applying it held no message for a moment."""
    runtime = CopilotRuntime(agents={"rewritten": legacy_agent(legacy, "rewritten")})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", thread="t-rw"), agent="rewritten")
        stored = await get_json(served, "/threads/t-rw/messages")
    verify_events(events)
    snapshots = [[m["id"] for m in e["messages"]] for e in events
                 if e["type"] == "MESSAGES_SNAPSHOT"]
    assert snapshots == [["n0"], ["n0", "m2"]]
    assert [m["id"] for m in stored["messages"]] == ["n0", "m2"]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", ["flow-state", "flow-json-conversation"])
async def test_legacy_runtime_event_state_messages_make_a_snapshot_only_when_a_conversation(
        name: str, legacy: LegacyEndpoint, serve_runtime: ServeRuntime) -> None:
    """Before: a flow's raw messages (calls and results without ids) became a snapshot
    that wiped the streamed call and result, for good once the flow failed."""
    runtime = CopilotRuntime(agents={name: legacy_agent(legacy, name, kind="crewai")})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", thread=f"t-{name}"), agent=name)
        stored = await get_json(served, f"/threads/t-{name}/messages")
    snapshots = [e["messages"] for e in events if e["type"] == "MESSAGES_SNAPSHOT"]
    held = [(m["id"], m["role"], m.get("content")) for m in stored["messages"]]
    if name == "flow-state":
        assert snapshots == []
        assert held == [("run-1-u", "user", "hello"), ("chatcmpl-1", "assistant", None),
                        ("result-c1", "tool", "3 results")]
        assert types(events)[-1] == "RUN_ERROR"
        assert of_state(events)[-1] == {"logs": ["searching"]}
    else:
        assert [[m["id"] for m in s] for s in snapshots] == [["run-1-u", "chatcmpl-1", "r-1"]]
        assert held == [("run-1-u", "user", "hello"), ("chatcmpl-1", "assistant", None),
                        ("r-1", "tool", "3 results")]


def of_state(events: list[Json]) -> list[Any]:
    return [e["snapshot"] for e in events if e["type"] == "STATE_SNAPSHOT"]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", ["calls-action", "calls-agent"])
async def test_legacy_graph_checkpoint_keeps_what_the_runtime_answered_over_graphql(
        name: str, legacy: LegacyEndpoint, serve_runtime: ServeRuntime) -> None:
    """The runtime answers a call to its action or another agent in the run; before, the
    checkpoint's conversation (which ends at the call) then replaced the 1.10 client's
    history, and the stored thread's, without the answer."""
    helper = BuiltInAgent(ScriptedAdapter(text_turn("helper ", "says 42")), description="helper")
    runtime = CopilotRuntime(agents={"chat": legacy_agent(legacy, name), "helper": helper},
                             actions=[Action("lookup", lambda: {"answer": 42})],
                             service_adapter=ScriptedAdapter())
    async with serve_runtime(runtime) as served:
        response = await served.generate(chat_data(
            [text_message("u1", "user", "go")], thread=f"g-{name}",
            agentSession={"agentName": "chat"}))
        stored = await get_json(served, f"/threads/g-{name}/messages")
    assert response["status"]["code"] == "Success", response["status"]
    final = [orjson.loads(m["state"]) for m in response["messages"]
             if m["__typename"] == "AgentStateMessageOutput"][-1]
    said = [m.get("content") or m.get("result") or m.get("name") for m in final["messages"]]
    answer = [orjson.dumps({"answer": 42}).decode()] if name == "calls-action" else [
        "helper agent started", "helper says 42"]
    assert said == ["go", {"calls-action": "lookup", "calls-agent": "helper"}[name], *answer]
    assert [m.get("content") for m in stored["messages"]][2:] == answer


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("props", ["yes", ["a"], 5])
async def test_legacy_agent_runs_with_forwarded_props_that_are_not_an_object(
        props: Any, legacy: LegacyEndpoint, serve_runtime: ServeRuntime) -> None:
    """Before: AGENT_ERROR "failed unexpectedly" (its interrupt answer was read from them
    as from an object); other agents run with them."""
    runtime = CopilotRuntime(agents={"meta-null": legacy_agent(legacy, "meta-null", kind="")})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", thread="t-props", forwardedProps=props),
                                  agent="meta-null")
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED", events[-1]


@pytest.mark.timeout(TIMEOUT_S)
async def test_legacy_events_before_a_bad_one_of_the_same_line_are_passed_on(
        legacy: LegacyEndpoint, serve_runtime: ServeRuntime) -> None:
    """Before: a line's events were checked all or none: the first of two tool calls in
    one chunk was lost with the second's error (the HttpAgent's reader passes them on)."""
    runtime = CopilotRuntime(agents={"two-calls": legacy_agent(legacy, "two-calls")})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", thread="t-two"), agent="two-calls")
    error = one_run_error(events)
    assert error["message"] == ("Remote agent 'two-calls' sent TOOL_CALL_START without a "
                                "string 'toolCallId'")
    assert [(e["type"], e.get("delta")) for e in events if e.get("toolCallId") == "c1"] == [
        ("TOOL_CALL_START", None), ("TOOL_CALL_ARGS", '{"a": 1}'), ("TOOL_CALL_END", None)]


_LOAD_STATE = """query load($data: LoadAgentStateInput!) {
  loadAgentState(data: $data) { threadId threadExists state messages } }"""


@pytest.mark.timeout(TIMEOUT_S)
async def test_legacy_state_nested_too_deep_is_a_precise_error(
        legacy: LegacyEndpoint, serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={"deep": legacy_agent(legacy, "deep")})
    async with serve_runtime(runtime) as served:
        response = await served.post("", {"query": _LOAD_STATE, "variables": {
            "data": {"threadId": "t1", "agentName": "deep"}}})
        assert response.status == 200
        answer = await response.json()
    (error,) = answer["errors"]
    assert answer["data"] is None
    assert error["message"] == ("Remote agent 'deep' answered with JSON nested deeper than "
                                f"{MAX_JSON_DEPTH} levels")
    assert error["extensions"]["code"] == "NETWORK_ERROR"  # the remote's fault, not UNKNOWN


@pytest.mark.timeout(TIMEOUT_S)
async def test_legacy_line_longer_than_the_cap_fails_the_run(
        monkeypatch: pytest.MonkeyPatch, legacy: LegacyEndpoint,
        serve_runtime: ServeRuntime) -> None:
    cap = 64 << 10
    monkeypatch.setattr(_held, "MAX_UPSTREAM_EVENT_BYTES", cap)
    runtime = CopilotRuntime(agents={"huge": legacy_agent(legacy, "huge", kind="")})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", thread="t-huge"), agent="huge")
    error = one_run_error(events)
    assert (error["code"], error["message"]) == (
        "UPSTREAM_ERROR", f"Remote agent 'huge' sent a line larger than {cap} bytes")


# ---- MCP tools with hostile input schemas ----------------------------------------------------


class SchemaServer(SDKServer):
    """An SDK MCP server that lists the tools named in `schemas` with that input schema."""

    def __init__(self, name: str, schemas: dict[str, Json]) -> None:
        super().__init__(name)
        self.schemas = schemas

    async def list_tools(self) -> list[Tool]:
        return [tool.model_copy(update={"input_schema": self.schemas[tool.name]})
                if tool.name in self.schemas else tool for tool in await super().list_tools()]


_INVALID_SCHEMA: Json = {"type": "object", "properties": 5}  # jsonschema refuses it


def schema_server() -> SchemaServer:
    """`good`; `invalid`, with a schema jsonschema refuses; `selfref`, whose schema refers to
    itself; `add_invalid`, which adds `broken` (refused too) and `later`, and says so."""
    server = SchemaServer("hostile", {"invalid": _INVALID_SCHEMA, "broken": _INVALID_SCHEMA,
                                      "selfref": {"$ref": "#", "type": "object"}})

    @server.tool()
    def good(city: str) -> str:
        """A well-behaved tool."""
        return f"fine in {city}"

    @server.tool()
    def invalid(x: int = 0) -> str:
        """Listed with an invalid schema."""
        return "invalid ran"

    @server.tool()
    def selfref(x: int = 0) -> str:
        """Listed with a schema that refers to itself."""
        return "selfref ran"

    def broken(x: int = 0) -> str:
        """Added later, listed with an invalid schema."""
        return "broken ran"

    def later(word: str) -> str:
        """Added later, well-behaved."""
        return f"later: {word}"

    @server.tool()
    async def add_invalid(ctx: Context) -> str:
        """Add `broken` and `later`, then say the tool list changed."""
        server.add_tool(broken)
        server.add_tool(later)
        await ctx.notify_tools_changed()
        await ctx.request_context.session.send_tool_list_changed()
        return "added"

    return server


def llm_runtime(llm: MockOpenAIServer, toolset: MCPToolset) -> CopilotRuntime:
    return CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="k", max_retries=0),
        actions=toolset.actions)


def tool_result(events: list[Json]) -> str:
    (result,) = [e["content"] for e in events if e["type"] == "TOOL_CALL_RESULT"]
    return str(result)


async def with_toolset(url: str, body: Callable[[MCPToolset], Awaitable[None]]) -> None:
    toolset = MCPToolset([MCPServer(url=url + "/mcp", timeout=10)])
    await toolset.start()
    try:
        await body(toolset)
    finally:
        await toolset.aclose()


@pytest.mark.timeout(TIMEOUT_S)
async def test_mcp_tool_with_an_invalid_schema_is_left_out_at_start(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    async def body(toolset: MCPToolset) -> None:
        assert [a.name for a in toolset.actions] == ["good", "selfref", "add_invalid"]
        async with serve_runtime(llm_runtime(llm, toolset)) as served:
            events = await served.run(run_input('call:good {"city":"Paris"}'))
        verify_events(events)
        assert types(events)[-1] == "RUN_FINISHED"
        assert orjson.loads(tool_result(events)) == {"result": "fine in Paris"}

    async with serve(schema_server().streamable_http_app()) as url:
        with capture_logs() as logs:
            await with_toolset(url, body)
    left_out = [(e["event"], e["tool"]) for e in logs if e["log_level"] == "warning"]
    assert ("MCP tool left out", "invalid") in left_out


@pytest.mark.timeout(TIMEOUT_S)
async def test_mcp_tool_with_an_invalid_schema_is_left_out_after_the_list_changed(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    server = schema_server()
    del server.schemas["invalid"]  # everything is fine at start

    async def body(toolset: MCPToolset) -> None:
        changed = asyncio.Event()
        toolset.on_change.append(lambda _: changed.set())
        by_name = {a.name: a for a in toolset.actions}
        assert list(by_name) == ["good", "invalid", "selfref", "add_invalid"]
        with capture_logs() as logs:
            assert orjson.loads(await by_name["add_invalid"].execute("{}")) == {
                "result": "added"}
            await asyncio.wait_for(changed.wait(), 5)
        assert [a.name for a in toolset.actions] == [
            "good", "invalid", "selfref", "add_invalid", "later"]
        assert ("MCP tool left out", "broken") in [
            (e["event"], e.get("tool")) for e in logs if e["log_level"] == "warning"]
        assert orjson.loads(await by_name["good"].execute('{"city":"Oslo"}')) == {
            "result": "fine in Oslo"}
        async with serve_runtime(llm_runtime(llm, toolset)) as served:
            events = await served.run(run_input('call:later {"word":"hi"}'))
        assert types(events)[-1] == "RUN_FINISHED"
        assert orjson.loads(tool_result(events)) == {"result": "later: hi"}

    async with serve(server.streamable_http_app()) as url:
        await with_toolset(url, body)


@pytest.mark.timeout(TIMEOUT_S)
async def test_mcp_tool_whose_schema_refers_to_itself_answers_the_model_with_an_error(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    server = schema_server()
    del server.schemas["invalid"]

    async def body(toolset: MCPToolset) -> None:
        async with serve_runtime(llm_runtime(llm, toolset)) as served:
            events = await served.run(run_input('call:selfref {"x": 1}'))
            after = await served.run(run_input('call:good {"city":"Rome"}', run="r2"))
        verify_events(events)
        assert types(events)[-1] == "RUN_FINISHED", events[-1]
        result = tool_result(events)
        assert "refers to itself" in orjson.loads(result)["error"]
        assert text_of(events) == "echo: " + result  # the model read it and went on
        assert orjson.loads(tool_result(after)) == {"result": "fine in Rome"}

    async with serve(server.streamable_http_app()) as url:
        await with_toolset(url, body)


# ---- a legacy endpoint's /info of odd shapes ---------------------------------------------------

# name -> (its /info, the actions and agents discovered; None: the endpoint's error)
_INFOS: dict[str, tuple[Json, tuple[list[str], list[str]] | None]] = {
    "actions-an-int": ({"actions": 5, "agents": []}, None),
    "agents-an-int": ({"actions": [], "agents": 7}, None),
    "a-name-no-model-can-call": ({"actions": [{"name": "get weather"}, {"name": "ok"}]},
                                 (["ok"], [])),
    "parameters-an-int": ({"actions": [{"name": "a", "parameters": 5}, {"name": "ok"}]},
                          (["ok"], [])),
    "attributes-an-int": ({"actions": [
        {"name": "a", "parameters": [{"name": "p", "type": "object", "attributes": 3}]},
        {"name": "ok"}]}, (["ok"], [])),
    "a-name-twice": ({"actions": [{"name": "a"}, {"name": "a"}]}, (["a"], [])),
    "an-agent-id-with-a-slash": ({"agents": [{"name": "a/../b"}, {"name": "fine"}]},
                                 ([], ["fine"])),
}


class _InfoEndpoint(LoopbackServer):
    def routes(self, app: web.Application) -> None:
        async def info(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response(_INFOS[request.match_info["name"]][0])

        app.router.add_post("/{name}/info", info)


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_legacy_endpoint_info_of_odd_shapes_is_its_error_or_leaves_out_one_item(
        ) -> None:
    """`discover` raised a bare TypeError for `actions` that are not a list or parameters of
    the wrong shape, and a ConfigurationError for one action name a model cannot call,
    losing the endpoint's other actions; a name twice was offered twice. The first is the
    endpoint's error now; one action or agent the runtime cannot offer is left out."""
    async with _InfoEndpoint() as server:
        for name, (_, expected) in _INFOS.items():
            endpoint = CopilotKitRemoteEndpoint(f"http://{server.host}:{server.port}/{name}")
            try:
                if expected is None:
                    with pytest.raises(UpstreamError, match="that is not a list"):
                        await endpoint.discover()
                    continue
                found = await endpoint.discover()
                assert ([a.name for a in found.actions], list(found.agents)) == expected, name
            finally:
                await endpoint.aclose()


class _HugeAnswers(LoopbackServer):
    """`/{how}/{route}` answers a JSON object of 4 KiB: `streamed` in pieces without a
    length, `declared` with its Content-Length."""

    def routes(self, app: web.Application) -> None:
        async def answer(request: web.Request) -> web.StreamResponse:
            await request.read()
            body = b'{"result": "' + b"y" * 4096 + b'", "threadExists": true}'
            if request.match_info["how"] == "declared":
                return web.Response(body=body, content_type="application/json")
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            for i in range(0, len(body), 512):
                await response.write(body[i:i + 512])
            return response

        app.router.add_post("/{how}/{route:.*}", answer)


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_legacy_endpoints_answer_past_the_bound_is_its_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `/actions/execute`, `/info` and `/agents/state` answers were read whole,
    however large (a 200 MB action result went on to the model and the client)."""
    monkeypatch.setattr(remote_endpoint, "MAX_ANSWER_BYTES", 4000)
    async with _HugeAnswers() as server:
        for how in ("streamed", "declared"):
            endpoint = CopilotKitRemoteEndpoint(f"http://{server.host}:{server.port}/{how}",
                                                retry=RetryPolicy(retries=0))
            try:
                calls: dict[str, Callable[[], Awaitable[Any]]] = {
                    "Remote action 'a'": functools.partial(endpoint.execute_action, "a", {}),
                    "The remote endpoint": endpoint.discover,
                    "Remote agent 'x'": functools.partial(endpoint.agent_state, "x", "t1")}
                for what, call in calls.items():
                    with pytest.raises(UpstreamError) as caught:
                        await call()
                    assert caught.value.message == f"{what} answered more than 4000 bytes"
            finally:
                await endpoint.aclose()
    monkeypatch.setattr(remote_endpoint, "MAX_ANSWER_BYTES", 5000)  # (a control)
    async with _HugeAnswers() as server:
        endpoint = CopilotKitRemoteEndpoint(f"http://{server.host}:{server.port}/streamed")
        try:
            assert await endpoint.execute_action("a", {}) == "y" * 4096
        finally:
            await endpoint.aclose()
