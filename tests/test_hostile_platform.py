"""`LangGraphPlatformAgent` against a scripted platform (`agents_support.fake_platform`):
what a real deployment does rarely, or only when something around it fails.

Before:
- a run stream that closed without its end (a proxy cut it, the server restarted) ended
  with RUN_FINISHED, as did a run the platform timed out or cancelled (`langgraph-api`
  sends no `error` event for those): the client took a half answer for a whole one;
- the platform's HTTP 503 (its storage overloaded or down) was UPSTREAM_ERROR, and a run
  failing with a database connection error "The graph failed ... (OperationalError)",
  where the in-process agent says SERVICE_UNAVAILABLE for its checkpointer's outage;
- NaN and the infinities in a tool call's arguments reached the client as the bare words
  Python writes, which no JSON parser takes (TOOL_CALL_ARGS, and MESSAGES_SNAPSHOT for a
  message the platform stored as a chunk);
- an answer that was not the JSON expected (a proxy's HTML page, an object where a list
  belongs, a message of the wrong shape in the thread's state) failed the run "unexpectedly"
  (AGENT_ERROR) and `loadAgentState` with a 500, and a run stream of another content type
  read as a connection closed early;
- a redirect (HTTP 3xx, which the SDK takes for success) of a thread delete read as done,
  so `DELETE /threads/{id}` answered 200 while the platform kept the thread, and a
  redirected assistant search or run stream failed with a misleading message.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import zlib
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import httpx
import pytest
from starlette.responses import Response
from structlog.testing import capture_logs

from copilot_runtime import CopilotRuntime, UpstreamError
from copilot_runtime._held import MAX_UPSTREAM_EVENT_BYTES
from copilot_runtime.agents import langgraph_platform
from copilot_runtime.agents.langgraph_platform import LangGraphPlatformAgent, finite_json_text
from copilot_runtime.testing import verify_events
from tests.agents_support.fake_platform import (
    RUN_ID,
    FakePlatform,
    frame,
    model_stream,
    tool_call_stream,
)
from tests.conftest import ServeRuntime, parse_sse, run_input, serve

pytestmark = pytest.mark.timeout(30)


async def run_on(fake: FakePlatform, serve_runtime: ServeRuntime) -> list[dict[str, Any]]:
    async with serve(fake.app) as platform:
        runtime = CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
            deployment_url=platform, graph_id="fake")})
        async with serve_runtime(runtime) as served:
            events = await served.run(run_input("hi", thread="t1"), agent="platform")
    verify_events(events)
    return events


def ending(events: list[dict[str, Any]]) -> tuple[str, str | None, str | None]:
    return events[-1]["type"], events[-1].get("code"), events[-1].get("message")


HALF_ANSWER = [frame("events", model_stream("Hel"))]


async def test_a_stream_cut_while_the_run_goes_on_is_an_error(
        serve_runtime: ServeRuntime) -> None:
    fake = FakePlatform(frames=HALF_ANSWER, run_status="running")
    events = await run_on(fake, serve_runtime)
    assert ending(events) == ("RUN_ERROR", "UPSTREAM_CONNECTION_ERROR",
                              "The LangGraph Platform's run stream closed before the run ended")
    # The run left going on unwatched is stopped, as one whose client left.
    assert any(call.endswith(f"/runs/{RUN_ID}/cancel") for call in fake.calls)


@pytest.mark.parametrize(("status", "code", "message"), [
    ("timeout", "UPSTREAM_TIMEOUT", "The graph's run timed out on the LangGraph Platform"),
    ("interrupted", "UPSTREAM_ERROR", "The graph's run was cancelled on the LangGraph "
     "Platform (a cancel, or a newer run on its thread, stopped it)"),
    ("error", "UPSTREAM_ERROR", "The graph failed on the LangGraph Platform"),
])
async def test_a_run_that_ended_without_success_is_an_error(
        serve_runtime: ServeRuntime, status: str, code: str, message: str) -> None:
    events = await run_on(FakePlatform(frames=HALF_ANSWER, run_status=status), serve_runtime)
    assert ending(events) == ("RUN_ERROR", code, message)


async def test_a_finished_run_ends_as_before(serve_runtime: ServeRuntime) -> None:
    """The real platform's way (no end event, the run's status "success"); a server's `end`
    event, which says so itself (no status asked); a server that does not keep its runs
    (404: nothing to tell a cut by, as the SDK's own check has it)."""
    plain = FakePlatform(frames=HALF_ANSWER)
    marked = FakePlatform(frames=[*HALF_ANSWER, frame("end", None)], run_status="running")
    unkept = FakePlatform(frames=HALF_ANSWER, run_status=None)
    for fake in (plain, marked, unkept):
        events = await run_on(fake, serve_runtime)
        assert ending(events) == ("RUN_FINISHED", None, None)
    assert not any("/runs/" + RUN_ID in call for call in marked.calls)


async def test_the_platforms_storage_failing_is_service_unavailable(
        serve_runtime: ServeRuntime) -> None:
    overloaded = await run_on(FakePlatform(fail_with=503), serve_runtime)
    failed = await run_on(FakePlatform(frames=[frame("error", {
        "error": "OperationalError", "message": "An internal error occurred"})],
        run_status="error"), serve_runtime)
    assert ending(overloaded) == ("RUN_ERROR", "SERVICE_UNAVAILABLE", "LangGraph Platform "
                                  "agent 'platform' is unavailable (HTTP 503); try again later")
    assert ending(failed) == ("RUN_ERROR", "SERVICE_UNAVAILABLE", "The LangGraph Platform's "
                              "checkpoint store cannot be used right now; try again later")


async def test_a_failure_echoing_the_operators_key_does_not_show_it(
        serve_runtime: ServeRuntime) -> None:
    """Before: the `api_key` (and `headers=`) the platform was sent reached the client when
    the failure's class named it."""
    key, token = "lsv2-4f9a8b7c6d5e", "tk4f9a8b7c6d5e"
    fake = FakePlatform(frames=[frame("error", {
        "error": f"KeyRevoked {key} {token}", "message": "x"})], run_status="error")
    async with serve(fake.app) as platform:
        runtime = CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
            deployment_url=platform, graph_id="fake", api_key=key,
            headers={"Authorization": f"Token {token}"})})
        async with serve_runtime(runtime) as served:
            events = await served.run(run_input("hi", thread="t1"), agent="platform")
    assert ending(events) == ("RUN_ERROR", "UPSTREAM_ERROR", "The graph failed on the "
                              "LangGraph Platform (KeyRevoked [REDACTED] [REDACTED])")


_UNUSABLE = "LangGraph Platform agent 'platform' answered with something unusable"


@pytest.mark.parametrize(("fake", "message"), [
    (FakePlatform(unusable="search"), f"{_UNUSABLE} (its assistants or their schemas)"),
    (FakePlatform(unusable="search-object"), f"{_UNUSABLE} (its assistants or their schemas)"),
    (FakePlatform(unusable="state"), f"{_UNUSABLE} (its thread's state)"),
    (FakePlatform(values={"messages": [{"type": "ai", "content": "x", "id": "m1",
                                        "tool_calls": "not a list"}]}),
     f"{_UNUSABLE} (its thread's state)"),
    (FakePlatform(unusable="stream"), "LangGraph Platform agent 'platform' answered its run "
                                      "with content type 'text/html', not an event stream"),
])
async def test_an_answer_that_is_not_the_json_expected_is_an_upstream_error(
        serve_runtime: ServeRuntime, fake: FakePlatform, message: str) -> None:
    """Before: "Agent 'platform' failed unexpectedly" (AGENT_ERROR), or for the stream
    UPSTREAM_CONNECTION_ERROR "closed the connection before its answer was complete"."""
    events = await run_on(fake, serve_runtime)
    assert ending(events) == ("RUN_ERROR", "UPSTREAM_ERROR", message)


_REDIRECT = ("LangGraph Platform answered HTTP {}: a redirect, not followed (it would take "
             "the request's credentials along): configure the URL it points to")


@pytest.mark.parametrize("status", [301, 307, 308])
@pytest.mark.parametrize("route", ["search", "stream"])
async def test_a_redirect_is_an_upstream_error(
        serve_runtime: ServeRuntime, route: str, status: int) -> None:
    """Before: the SDK raises only from HTTP 400, so a redirected assistant search failed
    as "something unusable" and a redirected run stream as another content type."""
    fake = FakePlatform(frames=[frame("events", model_stream("hello"))],
                        redirect=(route, status))
    events = await run_on(fake, serve_runtime)
    assert ending(events) == ("RUN_ERROR", "UPSTREAM_ERROR",
                              "The " + _REDIRECT.format(status))
    assert not any("elsewhere" in call for call in fake.calls)


async def test_a_redirected_cancel_of_a_cut_run_still_says_the_stream_was_cut(
        serve_runtime: ServeRuntime) -> None:
    fake = FakePlatform(frames=HALF_ANSWER, run_status="running", redirect=("cancel", 307))
    events = await run_on(fake, serve_runtime)
    assert ending(events) == ("RUN_ERROR", "UPSTREAM_CONNECTION_ERROR",
                              "The LangGraph Platform's run stream closed before the run ended")
    assert any(call.endswith(f"/runs/{RUN_ID}/cancel") for call in fake.calls)


@pytest.mark.parametrize("answer", [301, 307, 308, 500])
async def test_a_thread_delete_the_platform_did_not_do_keeps_the_thread(
        serve_runtime: ServeRuntime, answer: int) -> None:
    """Before: a 3xx to the platform's thread delete read as done, and `DELETE /threads/{id}`
    answered 200 {"deleted": true} while the platform kept the conversation."""
    fake = FakePlatform(frames=[frame("events", model_stream("hello"))])
    async with serve(fake.app) as platform:
        runtime = CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
            deployment_url=platform, graph_id="fake")})
        async with serve_runtime(runtime) as served:
            events = await served.run(run_input("hi", thread="t1"), agent="platform")
            assert ending(events) == ("RUN_FINISHED", None, None)
            if answer >= 400:
                fake.fail_with = answer
            else:
                fake.redirect = ("delete", answer)
            response = await served.session.delete(f"{served.url}/threads/t1")
            assert response.status == 503, await response.text()
            fake.fail_with, fake.redirect = None, None
            kept = await served.session.get(f"{served.url}/threads/t1/events")
            assert kept.status == 200, await kept.text()
    assert fake.calls[-1].startswith("DELETE /threads/"), fake.calls


async def test_a_redirected_thread_delete_says_so() -> None:
    async with serve(FakePlatform(redirect=("delete", 308)).app) as platform:
        agent = LangGraphPlatformAgent(deployment_url=platform, graph_id="fake")
        try:
            with pytest.raises(UpstreamError) as caught:
                await agent.forget_thread("t1")
        finally:
            await agent.aclose()
    assert caught.value.message == "The " + _REDIRECT.format(308)


async def load_state_error(fake: Any) -> UpstreamError:
    """The error `load_state` of an agent on `fake` raises (it must raise one)."""
    async with serve(fake.app) as platform:
        agent = LangGraphPlatformAgent(deployment_url=platform, graph_id="fake")
        try:
            with pytest.raises(UpstreamError) as caught:
                await agent.load_state("t1")
        finally:
            await agent.aclose()
    return caught.value


@pytest.mark.parametrize("fake", [
    FakePlatform(unusable="state"),
    FakePlatform(values={"messages": [{"type": "ai", "content": "x", "id": "m1",
                                       "tool_calls": "not a list"}]})])
async def test_a_thread_state_that_is_not_the_json_expected_is_an_upstream_error(
        fake: FakePlatform) -> None:
    """Before: the GraphQL `loadAgentState` answered UNKNOWN, 500."""
    assert (await load_state_error(fake)).message == (
        "The LangGraph Platform's graph 'fake' answered with something unusable (its "
        "thread's state)")


async def test_a_bare_nan_in_an_event_is_an_upstream_error(
        serve_runtime: ServeRuntime) -> None:
    """Outside a string, where the SDK's parser refuses it: a precise error, as before."""
    fake = FakePlatform(frames=[b'event: events\r\ndata: {"event": "x", "n": NaN}\r\n\r\n'])
    events = await run_on(fake, serve_runtime)
    assert ending(events) == ("RUN_ERROR", "UPSTREAM_ERROR",
                              "The LangGraph Platform sent an event that is not JSON")


async def test_non_finite_tool_call_arguments_reach_the_client_as_json(
        serve_runtime: ServeRuntime) -> None:
    # Split where a scanner of one piece at a time would miss them.
    pieces = ['{"x": Na', 'N, "s": "NaN \\" Infinity", "y": -', 'Infinity, "z": -1.5, ',
              '"w": Infinity}']
    stored = {"type": "AIMessageChunk", "id": "ai-0", "content": "", "tool_call_chunks": [
        {"type": "tool_call_chunk", "index": 0, "id": "c0", "name": "t",
         "args": '{"a": NaN, "b": [Infinity]}'}]}
    fake = FakePlatform(
        frames=[frame("events", tool_call_stream("", name="t", call_id="c1")),
                *(frame("events", tool_call_stream(piece)) for piece in pieces)],
        values={"messages": [{"type": "human", "id": "run-1-u", "content": "hi"}, stored]})
    events = await run_on(fake, serve_runtime)
    streamed = "".join(e["delta"] for e in events if e["type"] == "TOOL_CALL_ARGS")
    assert json.loads(streamed) == {"x": None, "s": 'NaN " Infinity', "y": None, "z": -1.5,
                                    "w": None}
    (snapshot,) = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"]
    (call,) = snapshot["messages"][1]["toolCalls"]
    assert json.loads(call["function"]["arguments"]) == {"a": None, "b": [None]}


def test_finite_json_text_at_every_split() -> None:
    text = '{"a": NaN, "b": "x\\\\", "c": [-Infinity, Infinity, -2], "d": "Infinity"}'
    expected = {"a": None, "b": "x\\", "c": [None, None, -2], "d": "Infinity"}
    assert json.loads(finite_json_text(text)) == expected
    for cut in itertools.combinations(range(1, len(text)), 2):
        pieces = text[:cut[0]], text[cut[0]:cut[1]], text[cut[1]:]
        assert json.loads(finite_json_text(*pieces)) == expected, pieces


OPERATOR = {"X-Tenant": "tenant-a", "Authorization": "Bearer operator-token"}
CLIENT = {"x-api-key": "CLIENT-KEY", "X-TENANT": "tenant-of-client",
          "authorization": "Bearer client-token", "x-trace": "trace-1"}


def saw_only_the_operators(fake: FakePlatform) -> None:
    assert fake.headers
    for seen in fake.headers:
        assert (seen["x-api-key"], seen["x-tenant"], seen["authorization"]) == (
            "OPERATOR-KEY", "tenant-a", "Bearer operator-token")
        assert seen["x-trace"] == "trace-1"  # (a name the operator did not set is forwarded)


async def test_the_operators_key_and_headers_win_over_the_clients(
        serve_runtime: ServeRuntime) -> None:
    """Before: a client's forwarded `x-api-key`, `Authorization` and `X-Tenant` replaced the
    operator's (`api_key=`, `headers=`) in every request of a run, and of `load_state`."""
    fake = FakePlatform(frames=HALF_ANSWER)
    async with serve(fake.app) as platform:
        agent = LangGraphPlatformAgent(deployment_url=platform, graph_id="fake",
                                       api_key="OPERATOR-KEY", headers=OPERATOR)
        async with serve_runtime(CopilotRuntime(agents={"platform": agent})) as served:
            response = await served.post("/agent/platform/run",
                                         run_input("hi", thread="t1"), headers=CLIENT)
            assert response.status == 200
            assert parse_sse(await response.read())[-1]["type"] == "RUN_FINISHED"
            saw_only_the_operators(fake)
            fake.headers.clear()
            await agent.load_state("t1", headers=CLIENT)
            saw_only_the_operators(fake)


async def test_a_failure_echoing_the_operators_key_does_not_log_it(
        serve_runtime: ServeRuntime) -> None:
    """Before: the platform's `error` event was logged whole, as it came: the `api_key` and
    `headers=` values it echoed (blanked for the client) and all of a megabyte message."""
    key, token = "lsv2-SECRETKEY-4f9a8b7c6d5e", "TOKEN-SECRET-9z8y7x"
    fake = FakePlatform(frames=[frame("error", {
        "error": "AuthError", "message": f"key {key} / Token {token} revoked " + "x" * 10**6})],
        run_status="error")
    async with serve(fake.app) as platform:
        runtime = CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
            deployment_url=platform, graph_id="fake", api_key=key,
            headers={"Authorization": f"Token {token}"})})
        async with serve_runtime(runtime) as served:
            with capture_logs() as logs:
                events = await served.run(run_input("hi", thread="t1"), agent="platform")
    assert ending(events)[:2] == ("RUN_ERROR", "UPSTREAM_ERROR")
    (failed,) = [line for line in logs if line["event"] == "LangGraph Platform run failed"]
    assert key not in str(logs)
    assert token not in str(logs)
    assert "AuthError" in failed["error"]
    assert len(failed["error"]) <= 1000


_HUGE = MAX_UPSTREAM_EVENT_BYTES + 1024


@pytest.mark.parametrize("record", [
    b"event: events\r\ndata: " + b"x" * _HUGE,  # one line, never ended
    b"event: events\n" + b"data: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n" * (_HUGE // 48),
    b": keep-alive\r" + b"\r".join([b"data: x" * 8192] * (_HUGE // 57344 + 1)),  # CR line ends
])
async def test_a_run_stream_record_past_the_bound_is_an_upstream_error(
        serve_runtime: ServeRuntime, record: bytes) -> None:
    """Before: the SDK's decoders held one event's bytes without limit (a 200 MB line grew
    the server by 200 MB before failing as "not JSON"); every other remote reader fails
    past `MAX_UPSTREAM_EVENT_BYTES`."""
    events = await run_on(FakePlatform(frames=[frame("events", model_stream("Hi")), record]),
                          serve_runtime)
    assert [e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT"] == ["Hi"]
    assert ending(events) == ("RUN_ERROR", "UPSTREAM_ERROR", "The LangGraph Platform sent an "
                              f"event larger than {MAX_UPSTREAM_EVENT_BYTES} bytes")


async def test_records_are_bounded_each_wherever_the_reads_split_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The count starts again after each blank line (LF, CRLF or CR line ends), one split
    across two reads included; a record of one byte more fails."""
    monkeypatch.setattr(langgraph_platform, "MAX_UPSTREAM_EVENT_BYTES", 16)

    async def read(*chunks: bytes) -> bytes:
        async def inner() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        body = langgraph_platform._BoundedBody(_Chunks(inner()), events=True)
        return b"".join([chunk async for chunk in body])

    fine = (b"data: 1234", b"\r\n\r\ndata", b": 123456\n", b"\ndata: 12\r", b"\rdata: 1\r",
            b"\n\r\n", b"data: 1234")
    assert await read(*fine) == b"".join(fine)
    with pytest.raises(UpstreamError, match="event larger than 16 bytes"):
        await read(b"data: 1234\n", b"\r\ndata: 1234567890123")


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.chunks:
            yield chunk


async def test_an_answer_past_its_bound_is_an_upstream_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a thread's state (and the assistants, the schemas) was read whole, however
    large."""
    monkeypatch.setattr(langgraph_platform, "MAX_ANSWER_BYTES", 1000)
    fake = FakePlatform(values={"big": "x" * 500})
    async with serve(fake.app) as platform:
        agent = LangGraphPlatformAgent(deployment_url=platform, graph_id="fake")
        try:
            assert (await agent.load_state("t0")).exists  # (a small answer is read)
            fake.values["big"] = "x" * 2000
            with pytest.raises(UpstreamError) as caught:
                await agent.load_state("t1")
        finally:
            await agent.aclose()
    assert caught.value.message == "The LangGraph Platform answered more than 1000 bytes"


def _with_chunk(**fields: Any) -> dict[str, Any]:
    event = model_stream("Hi")
    event["data"]["chunk"].update(fields)
    return event


def _with_call(**fields: Any) -> dict[str, Any]:
    event = tool_call_stream('{"a": 1}', name="t", call_id="c1")
    event["data"]["chunk"]["tool_call_chunks"][0].update(fields)
    return event


_NODE = {"parent_ids": [], "tags": [], "metadata": {"langgraph_node": "chat"}}
WRONG_SHAPES: dict[str, dict[str, Any]] = {
    "langgraph_node-list": {**model_stream("Hi"), "metadata": {"langgraph_node": ["x"]}},
    "tool_call_chunks-string": _with_chunk(tool_call_chunks="abc"),
    "tool_call_chunks-int-item": _with_chunk(tool_call_chunks=[5]),
    "tool-call-name-int": _with_call(name=5),
    "tool-call-id-int": _with_call(id=5),
    "response_metadata-string": _with_chunk(response_metadata="x"),
    "tool-end-message-bad": {"event": "on_tool_end", "name": "t", "run_id": "n2", **_NODE,
                             "data": {"output": {"type": "tool", "content": "r",
                                                 "tool_call_id": 7}}},
    "manual-tool-call-bad": {"event": "on_custom_event",
                             "name": "copilotkit_manually_emit_tool_call", "run_id": "n3",
                             **_NODE, "data": {"name": 5, "args": 7, "id": 3}},
    "emit-tool-calls-int": {**_with_call(), "metadata": {
        "langgraph_node": "chat", "copilotkit:emit-tool-calls": 5}},
}


@pytest.mark.parametrize("event", list(WRONG_SHAPES.values()), ids=list(WRONG_SHAPES))
async def test_an_event_of_a_wrong_shape_is_an_upstream_error(
        serve_runtime: ServeRuntime, event: dict[str, Any]) -> None:
    """Before: AGENT_ERROR "failed unexpectedly", the translator's stack in the log."""
    fake = FakePlatform(frames=[frame("events", model_stream("Hi")), frame("events", event)])
    with capture_logs() as logs:
        events = await run_on(fake, serve_runtime)
    assert ending(events) == ("RUN_ERROR", "UPSTREAM_ERROR", "The LangGraph Platform sent "
                              "an event of an unexpected shape")
    assert not [line for line in logs if "exc_info" in line]


_STATE_UNUSABLE = f"{_UNUSABLE} (its thread's state)"


@pytest.mark.parametrize("state", [
    {"values": [1, 2]}, {"values": "x"}, {"values": {"messages": "x"}},
    {"values": {"messages": {"a": 1}}}, {"metadata": [1]}],
    ids=["values-list", "values-string", "messages-string", "messages-object",
         "metadata-list"])
async def test_a_thread_state_of_a_wrong_shape_is_an_upstream_error(
        serve_runtime: ServeRuntime, state: dict[str, Any]) -> None:
    """Before: AGENT_ERROR "failed unexpectedly" (the run), a 500 (`load_state`)."""
    fake = _StatePlatform(state=state)
    events = await run_on(fake, serve_runtime)
    assert ending(events) == ("RUN_ERROR", "UPSTREAM_ERROR", _STATE_UNUSABLE)
    if "metadata" in state:
        return  # (`load_state` reads only the values)
    assert "answered with something unusable (its thread's state)" in (
        await load_state_error(fake)).message


class _StatePlatform(FakePlatform):
    """Its thread's state with `state`'s fields in place of the usual."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__(frames=HALF_ANSWER)
        self.state = state

    async def _answer(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        if request.url.path.endswith("/state"):
            return JSONResponse({"values": {}, "next": [], "tasks": [], "metadata": {},
                                 "checkpoint": {"checkpoint_id": "c1", "checkpoint_ns": ""},
                                 "created_at": None, **self.state})
        return await super()._answer(request)


def test_an_unusable_answer_echoing_the_key_is_logged_without_it() -> None:
    """An answer's failure (its words may quote the request, the key with it) goes to the
    log blanked of the operator's secrets, as a run's error event does."""
    key = "lsv2_pt_0123456789abcdef"
    with capture_logs() as logs:
        error = langgraph_platform._unusable(
            "The LangGraph Platform", "its thread's state",
            ValueError(f"bad answer to a request with x-api-key: {key}"), (key,))
    assert key not in error.message
    assert logs
    assert key not in repr(logs)
    assert "[REDACTED]" in logs[0]["error"]


def _object(*keys: str) -> dict[str, Any]:
    return {"type": "object", "properties": {key: {} for key in keys}}


async def test_a_loaded_thread_shows_only_the_keys_of_the_graphs_output_schema() -> None:
    """Before: `loadAgentState` showed every key of the thread's values, where the run's
    snapshots show the output schema's only."""
    fake = FakePlatform(values={"messages": [], "answer": "A", "secret": "s3cr3t",
                                "question": "why"},
                        schemas={"graph_id": "fake", "input_schema": _object(
                            "messages", "question"), "output_schema": _object(
                            "messages", "answer"), "state_schema": _object(
                            "messages", "question", "secret", "answer")})
    async with serve(fake.app) as platform:
        agent = LangGraphPlatformAgent(deployment_url=platform, graph_id="fake")
        try:
            loaded = await agent.load_state("t1")
        finally:
            await agent.aclose()
    assert loaded.exists
    assert loaded.state == {"answer": "A"}


async def test_the_clients_config_sets_only_the_configurable_keys_the_assistant_declares(
        serve_runtime: ServeRuntime) -> None:
    """Before: the client's `forwardedProps.config` never reached the platform's run. Now
    the keys its config or context schema declares do (never the thread's address, nor
    the platform's own keys), and a `recursion_limit` only below the agent's own."""
    schemas = {"graph_id": "fake", "input_schema": _object("messages"),
               "output_schema": _object("messages"), "state_schema": _object("messages"),
               "config_schema": _object("model", "thread_id"),
               "context_schema": _object("tone", "langgraph_auth_user")}
    sent = {"configurable": {"model": "m1", "tone": "dry", "user": "u1", "thread_id": "other",
                             "checkpoint_id": "c0", "langgraph_auth_user": "admin"},
            "recursion_limit": 50, "tags": ["client"], "metadata": {"a": 1}}
    fake = FakePlatform(frames=HALF_ANSWER, schemas=schemas)
    async with serve(fake.app) as platform:
        runtime = CopilotRuntime(agents={
            "free": LangGraphPlatformAgent(deployment_url=platform, graph_id="fake"),
            "bound": LangGraphPlatformAgent(deployment_url=platform, graph_id="fake",
                                            config={"recursion_limit": 9})})
        async with serve_runtime(runtime) as served:
            free = await served.run(run_input("hi", thread="t1", forwardedProps={
                "config": sent}), agent="free")
            bound = await served.run(run_input("hi", thread="t2", forwardedProps={
                "config": {**sent, "recursion_limit": 50}}), agent="bound")
            lower = await served.run(run_input("hi", thread="t3", forwardedProps={
                "config": {**sent, "recursion_limit": 3}}), agent="bound")
            refused = await served.run(run_input("hi", thread="t4", forwardedProps={
                "config": {"configurable": "x"}}), agent="free")
    for events in (free, bound, lower):
        assert ending(events)[0] == "RUN_FINISHED", events[-1]
    assert ending(refused)[:2] == ("RUN_ERROR", "INVALID_REQUEST")
    first, second, third = fake.run_bodies
    assert first["config"]["configurable"] == {"model": "m1", "tone": "dry"}
    assert first["config"]["recursion_limit"] == 25  # (LangChain's default, as in-process)
    assert second["config"]["configurable"] == {"model": "m1", "tone": "dry"}
    assert second["config"]["recursion_limit"] == 9
    assert third["config"]["recursion_limit"] == 3
    for body in (first, second, third):
        assert "client" not in json.dumps(body["config"])  # (its tags)
        assert "checkpoint_id" not in body
    assert f"POST /threads/{langgraph_platform.platform_thread_id('t1')}/runs/stream" in \
        fake.calls


async def test_the_clients_config_keeps_to_what_the_operator_left_unset(
        serve_runtime: ServeRuntime) -> None:
    """Before: a client replaced what the agent's or its assistant's config set (the
    Platform lays a run's config over the assistant's), and raised the assistant's
    `recursion_limit` to LangChain's 25. Now those stay the operator's."""
    schemas = {"graph_id": "fake", "input_schema": _object("messages"),
               "output_schema": _object("messages"), "state_schema": _object("messages"),
               "config_schema": _object("model", "tenant", "style"),
               "context_schema": _object("tone")}
    fake = FakePlatform(frames=HALF_ANSWER, schemas=schemas, assistant={
        "config": {"recursion_limit": 5, "configurable": {"model": "operator's"}},
        "context": {"tone": "formal"}})
    sent = {"configurable": {"model": "m1", "tone": "rude", "tenant": "globex",
                             "style": "terse"}, "recursion_limit": 50}
    async with serve(fake.app) as platform:
        runtime = CopilotRuntime(agents={
            "lg": LangGraphPlatformAgent(deployment_url=platform, graph_id="fake", config={
                "configurable": {"tenant": "acme"}}),
            "own": LangGraphPlatformAgent(deployment_url=platform, graph_id="fake",
                                          config={"recursion_limit": 8})})
        async with serve_runtime(runtime) as served:
            first = await served.run(run_input("hi", thread="t1", forwardedProps={
                "config": sent}), agent="lg")
            lower = await served.run(run_input("hi", thread="t2", forwardedProps={
                "config": {"recursion_limit": 3}}), agent="lg")
            own = await served.run(run_input("hi", thread="t3", forwardedProps={
                "config": sent}), agent="own")
    for events in (first, lower, own):
        assert ending(events)[0] == "RUN_FINISHED", events[-1]
    bodies = fake.run_bodies
    assert bodies[0]["config"]["configurable"] == {"tenant": "acme", "style": "terse"}
    assert bodies[0]["config"]["recursion_limit"] == 5
    assert bodies[1]["config"]["recursion_limit"] == 3
    # (the agent's own limit is sent with every run: it is the one that applies)
    assert bodies[2]["config"]["recursion_limit"] == 8


async def test_an_error_event_naming_no_class_is_the_graphs_failure(
        serve_runtime: ServeRuntime) -> None:
    """Before: an `error` field that is an object or a list failed the lookup of the storage
    classes (unhashable): AGENT_ERROR "failed unexpectedly"."""
    for error in ({"type": "ValueError"}, ["ValueError"]):
        fake = FakePlatform(frames=[frame("error", {"error": error, "message": "x"})],
                            run_status="error")
        events = await run_on(fake, serve_runtime)
        assert ending(events) == ("RUN_ERROR", "UPSTREAM_ERROR",
                                  "The graph failed on the LangGraph Platform")


class _ManyAssistants(FakePlatform):
    """A graph with 150 assistants, searched a page at a time (newest first), each also
    found by its id."""

    ids: ClassVar[list[str]] = [f"a0000000-0000-4000-8000-{n:012d}" for n in range(150)]

    async def _answer(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        path = request.url.path
        if path == "/assistants/search":
            body = json.loads(await request.body() or b"{}")
            start, limit = body.get("offset", 0), body.get("limit", 10)
            return JSONResponse([{"assistant_id": a, "graph_id": "fake"}
                                 for a in self.ids[start:start + limit]])
        if path.rstrip("/").rpartition("/")[2] in self.ids and request.method == "GET":
            return JSONResponse({"assistant_id": path.rpartition("/")[2], "graph_id": "fake",
                                 "config": {"configurable": {"model": "m"}}})
        return await super()._answer(request)


async def test_a_configured_assistant_past_the_first_page_is_found(
        serve_runtime: ServeRuntime) -> None:
    """Before: only the search's first page (100) was looked in: "The LangGraph deployment
    has no assistant for graph 'fake'"."""
    fake = _ManyAssistants(frames=HALF_ANSWER)
    async with serve(fake.app) as platform:
        runtime = CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
            deployment_url=platform, graph_id="fake", assistant_id=fake.ids[-1]),
            "other": LangGraphPlatformAgent(deployment_url=platform, graph_id="other",
                                            assistant_id=fake.ids[-1])})
        async with serve_runtime(runtime) as served:
            events = await served.run(run_input("hi", thread="t1"), agent="platform")
            other = await served.run(run_input("hi", thread="t1"), agent="other")
    assert ending(events)[0] == "RUN_FINISHED", events[-1]
    assert f"GET /assistants/{fake.ids[-1]}/schemas" in fake.calls
    # (an assistant of another graph is not this agent's)
    assert ending(other) == ("RUN_ERROR", "UPSTREAM_ERROR",
                             "The LangGraph deployment has no assistant for graph 'other'")


async def test_a_forwarded_header_reaches_the_platform_byte_for_byte() -> None:
    """Before: a value beyond ASCII (a client's UTF-8 `X-User-Name: José`, given to the agent
    as headers.py decodes it, latin-1) failed every call as "answered with something
    unusable", the platform never called."""
    sent = "José".encode().decode("latin-1")  # (how the runtime hands the raw bytes on)
    fake = FakePlatform(values={"messages": []})
    async with serve(fake.app) as platform:
        agent = LangGraphPlatformAgent(deployment_url=platform, graph_id="fake")
        try:
            assert (await agent.load_state("t1", headers={"x-user-name": sent})).exists
        finally:
            await agent.aclose()
    assert fake.headers
    # (Starlette reads header bytes as latin-1: equal text, equal bytes)
    assert {seen["x-user-name"] for seen in fake.headers} == {sent}


class _Gzipping(FakePlatform):
    """Its answers gzipped, though asked for uncompressed ones."""

    async def _answer(self, request: Any) -> Any:
        import gzip

        from starlette.responses import Response

        answer = await super()._answer(request)
        if request.url.path.endswith("/runs/stream"):
            body = b"".join([chunk async for chunk in answer.body_iterator])
        else:
            body = answer.body
        return Response(gzip.compress(body), status_code=answer.status_code,
                        media_type=answer.media_type, headers={"Content-Encoding": "gzip"})


async def test_a_compressed_answer_is_bounded_as_it_expands(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the bound counted the compressed bytes: 80 MiB of state in 82 KB of gzip was
    read whole."""
    monkeypatch.setattr(langgraph_platform, "MAX_ANSWER_BYTES", 10_000)
    fake = _Gzipping(values={"big": "x" * 500})
    async with serve(fake.app) as platform:
        agent = LangGraphPlatformAgent(deployment_url=platform, graph_id="fake")
        try:
            assert (await agent.load_state("t0")).exists  # (a small answer is read)
            fake.values["big"] = "x" * 100_000
            with pytest.raises(UpstreamError) as caught:
                await agent.load_state("t1")
        finally:
            await agent.aclose()
    assert caught.value.message == "The LangGraph Platform answered more than 10000 bytes"


def _raw_deflate(body: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(body) + compressor.flush()


@pytest.mark.parametrize(("encoding", "compress"), [
    ("deflate", _raw_deflate), ("deflate", zlib.compress), ("gzip, identity", gzip.compress),
    ("identity", lambda body: body)])
async def test_an_answer_compressed_as_httpx_reads_it_is_read(encoding: str, compress: Any
                                                               ) -> None:
    """Before: raw deflate (no zlib header, as some servers send it) and an encoding listed
    with identity were refused, where httpx, which decoded them before, read them."""

    class Encoding(FakePlatform):
        async def _answer(self, request: Any) -> Any:
            answer = await super()._answer(request)
            return Response(compress(answer.body), status_code=answer.status_code,
                            media_type=answer.media_type,
                            headers={"Content-Encoding": encoding})

    async with serve(Encoding(values={"messages": []}).app) as platform:
        agent = LangGraphPlatformAgent(deployment_url=platform, graph_id="fake")
        try:
            assert (await agent.load_state("t1")).exists
        finally:
            await agent.aclose()


async def test_a_compressed_run_stream_is_bounded_per_event(
        serve_runtime: ServeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(langgraph_platform, "MAX_UPSTREAM_EVENT_BYTES", 10_000)
    small = await run_on(_Gzipping(frames=[frame("events", model_stream("Hi"))]),
                         serve_runtime)
    big = await run_on(_Gzipping(frames=[frame("events", model_stream("x" * 100_000))]),
                       serve_runtime)
    assert ending(small)[0] == "RUN_FINISHED", small[-1]
    assert ending(big) == ("RUN_ERROR", "UPSTREAM_ERROR",
                           "The LangGraph Platform sent an event larger than 10000 bytes")


async def test_more_than_a_hundred_calls_at_once_reach_the_platform() -> None:
    """Before: httpx's pool of 100 connections held the 101st call back (silently, up to the
    read timeout) until one of the first hundred ended."""
    many = 105
    arrived = asyncio.Event()
    waiting: list[str] = []
    warm = langgraph_platform.platform_thread_id("warm")

    class Slow(FakePlatform):
        async def _answer(self, request: Any) -> Any:
            if request.url.path.endswith("/state") and warm not in request.url.path:
                waiting.append(request.url.path)
                if len(waiting) == many:
                    arrived.set()
                await arrived.wait()
            return await super()._answer(request)

    fake = Slow(values={"messages": []})
    async with serve(fake.app) as platform:
        agent = LangGraphPlatformAgent(deployment_url=platform, graph_id="fake")
        try:
            await agent.load_state("warm")  # (the assistant looked up once, before)
            loaded = await asyncio.wait_for(asyncio.gather(
                *(agent.load_state(f"t{n}") for n in range(many))), 10)
        finally:
            arrived.set()
            await agent.aclose()
    assert all(state.exists for state in loaded)


class _LegacyInterrupt(FakePlatform):
    """A platform on langgraph < 0.4: after the first run its thread waits on an interrupt
    written without an `id` (`value`, `resumable`, `ns`, `when`)."""

    interrupt: ClassVar[dict[str, Any]] = {
        "value": "approve?", "resumable": True, "ns": ["approve:abc"], "when": "during"}

    async def _answer(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        if request.url.path.endswith("/state") and self.run_bodies:
            return JSONResponse({
                "values": {"messages": []}, "next": ["approve"],
                "tasks": [{"id": "task1", "name": "approve", "interrupts": [self.interrupt]}],
                "checkpoint": {"checkpoint_id": "c1", "checkpoint_ns": ""}, "metadata": {},
                "created_at": None})
        return await super()._answer(request)


async def test_an_interrupt_without_an_id_can_be_answered(
        serve_runtime: ServeRuntime) -> None:
    """Before: AGENT_ERROR "failed unexpectedly" (the translator refuses an interrupt without
    an id), the interrupt never shown, and every later run of the thread refused or failed
    again. Now it has the id langgraph < 0.4 knew it by (of its `ns`), and its answer goes
    as that version takes one: a bare `resume`."""
    fake = _LegacyInterrupt(frames=HALF_ANSWER)
    async with serve(fake.app) as platform:
        runtime = CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
            deployment_url=platform, graph_id="fake")})
        async with serve_runtime(runtime) as served:
            asked = await served.run(run_input("hi", thread="t1"), agent="platform")
            (shown,) = [e["value"] for e in asked
                        if e["type"] == "CUSTOM" and e["name"] == "on_interrupt"]
            finished = asked[-1]
            answered = await served.run(run_input(
                "", thread="t1", run="run-2", messages=[], forwardedProps={
                    "command": {"resume": "yes"}}), agent="platform")
            # (the id langgraph 0.2-0.3 gave it: xxh3-128 of its `ns` joined by "|")
            by_id = await served.run(run_input("", thread="t1", run="run-3", messages=[],
                                               resume=[{
                "interruptId": "cf8fecf07cf270a5df8a052372fef65a", "status": "resolved",
                "payload": "no"}]), agent="platform")
    verify_events(asked)
    assert finished["type"] == "RUN_FINISHED", finished
    assert shown == "approve?"
    for events in (answered, by_id):
        assert ending(events)[0] == "RUN_FINISHED", events[-1]
    assert [body["command"] for body in fake.run_bodies[1:]] == [{"resume": "yes"},
                                                                   {"resume": "no"}]
