"""`HttpAgent`: a remote AG-UI agent behind our runtime, over real HTTP on both sides."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from copilot_runtime import CopilotRuntime, UpstreamError
from copilot_runtime.agents._http_client import Timeouts
from copilot_runtime.agents._wire import RemoteEventChecker, SSEDecoder
from copilot_runtime.agents.http import HttpAgent
from copilot_runtime.headers import HeaderPolicy, for_aiohttp, forwardable
from copilot_runtime.testing import verify_events
from tests.agents_support.agui_server import ScriptedAGUIServer
from tests.conftest import ServeRuntime, free_port, run_input, text_of, types


@pytest.fixture
async def remote() -> AsyncIterator[ScriptedAGUIServer]:
    async with ScriptedAGUIServer() as server:
        yield server


def runtime_for(agent: HttpAgent) -> CopilotRuntime:
    return CopilotRuntime(agents={"remote": agent})


async def test_remote_run_is_relayed_with_state_and_steps(
        remote: ScriptedAGUIServer, serve_runtime: ServeRuntime) -> None:
    body = run_input("Hello", state={"runs": 2}, tools=[
        {"name": "sayHello", "description": "Say hello", "parameters": {"type": "object"}}])
    async with serve_runtime(runtime_for(HttpAgent(remote.url))) as served:
        events = await served.run(body, agent="remote")
    verify_events(events)
    assert types(events) == [
        "RUN_STARTED", "STEP_STARTED", "STATE_SNAPSHOT", "STATE_DELTA", "TEXT_MESSAGE_START",
        "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT",
        "TEXT_MESSAGE_END", "STEP_FINISHED", "RUN_FINISHED"]
    assert text_of(events) == "remote: Hello"
    # the remote read the state the client sent; a null inside application data survives
    assert events[2]["snapshot"] == {"runs": 3, "stage": "planning", "lastInput": "Hello",
                                     "nothing": None}
    # null optional fields from the remote are dropped, not relayed
    assert "timestamp" not in events[4]
    assert "result" not in events[-1]
    (request,) = remote.requests
    assert request["body"] == body  # the client's RunAgentInput, as it sent it
    assert request["headers"]["accept"] == "text/event-stream"


async def test_connect_replays_a_remote_run(remote: ScriptedAGUIServer,
                                            serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(runtime_for(HttpAgent(remote.url))) as served:
        await served.run(run_input("Hello", thread="t-connect"), agent="remote")
        replay = await served.run(run_input("", thread="t-connect"), agent="remote",
                                  path="/agent/remote/connect")
    verify_events(replay)
    assert text_of(replay) == "remote: Hello"
    assert replay[-2] == {"type": "STATE_SNAPSHOT", "snapshot": {
        "runs": 1, "stage": "answering", "lastInput": "Hello", "nothing": None}}


_CLIENT_HEADERS = {
    "Authorization": "Bearer user-token", "X-Tenant": "acme", "X-Forwarded-For": "10.1.2.3",
    "X-CopilotCloud-Public-Api-Key": "ck_pub_test", "Cookie": "session=abc",
    "X-Api-Key": "from-the-browser",
}


async def test_headers_forwarded_like_the_typescript_runtime(
        remote: ScriptedAGUIServer, serve_runtime: ServeRuntime) -> None:
    agent = HttpAgent(remote.url, headers={"X-Api-Key": "service-key"})
    async with serve_runtime(runtime_for(agent)) as served:
        response = await served.post("/agent/remote/run", run_input("Hi"),
                                      headers=_CLIENT_HEADERS)
        assert response.status == 200
        await response.read()
    sent = remote.requests[0]["headers"]
    assert sent["authorization"] == "Bearer user-token"
    assert sent["x-tenant"] == "acme"
    assert sent["x-api-key"] == "service-key"  # the agent's own headers win
    for name in ("cookie", "x-forwarded-for", "x-copilotcloud-public-api-key"):
        assert name not in sent, name


async def test_header_policy_narrows_what_is_forwarded(
        remote: ScriptedAGUIServer, serve_runtime: ServeRuntime) -> None:
    agent = HttpAgent(remote.url, header_policy=HeaderPolicy(allow=("Authorization",),
                                                             allow_prefixes=()))
    async with serve_runtime(runtime_for(agent)) as served:
        response = await served.post("/agent/remote/run", run_input("Hi"),
                                     headers=_CLIENT_HEADERS)
        await response.read()
    sent = remote.requests[0]["headers"]
    assert sent["authorization"] == "Bearer user-token"
    assert not [name for name in sent if name.startswith("x-")], sent


@pytest.mark.parametrize("forward", [False, True])
async def test_with_auth_the_callers_credentials_stay_here(
        forward: bool, remote: ScriptedAGUIServer, serve_runtime: ServeRuntime) -> None:
    """The bearer token that authenticated the caller to this runtime never reaches a remote
    agent unless the runtime is told to forward credentials (over both protocols' path)."""
    from copilot_runtime import BearerTokenAuth

    runtime = CopilotRuntime(agents={"remote": HttpAgent(remote.url)},
                             auth=BearerTokenAuth({"user-token": "alice"}),
                             forward_credentials=forward)
    headers = {**_CLIENT_HEADERS, "Authorization": "Bearer user-token"}
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/remote/run", run_input("Hi"), headers=headers)
        assert response.status == 200
        await response.read()
    sent = remote.requests[0]["headers"]
    assert sent["x-tenant"] == "acme"
    assert ("authorization" in sent) is forward
    assert "cookie" not in sent  # the policy's own rule, either way


def test_header_policy_rules() -> None:
    incoming = {k.lower(): v for k, v in _CLIENT_HEADERS.items()}
    assert HeaderPolicy().select(incoming) == {
        "authorization": "Bearer user-token", "x-tenant": "acme",
        "x-api-key": "from-the-browser"}
    assert HeaderPolicy(forward_cookies=True).select(incoming)["cookie"] == "session=abc"
    assert HeaderPolicy.none().select(incoming) == {}
    custom = HeaderPolicy(deny=frozenset({"X-Tenant"}))
    assert "x-tenant" not in custom.select(incoming)
    # The deny list was replaced, not the denied prefixes: the proxies' headers stay here.
    assert "x-copilotcloud-public-api-key" in custom.select(incoming)
    assert "x-forwarded-for" not in custom.select(incoming)
    assert "x-forwarded-for" in HeaderPolicy(deny_prefixes=()).select(incoming)
    # hop-by-hop headers never pass, whatever the policy
    assert HeaderPolicy(allow=("host", "content-length")).select(
        {"host": "a", "content-length": "1"}) == {}


#: What proxies in front of the runtime write about the client's hop: a remote agent must see
#: none (before, only x-forwarded-for, -host, -proto and -port were withheld).
_PROXY_HEADERS = {
    "X-Forwarded-For": "10.1.2.3", "X-Forwarded-Client-Cert": "By=spiffe://edge;Hash=ab12",
    "X-Forwarded-Server": "edge-1", "X-Forwarded-Prefix": "/api", "X-Forwarded-Ssl": "on",
    "Forwarded": "for=10.1.2.3;proto=https", "Via": "1.1 edge", "X-Real-IP": "10.1.2.3",
    "X-Envoy-External-Address": "10.1.2.3", "X-Envoy-Expected-Rq-Timeout-Ms": "5",
    "X-Client-IP": "10.1.2.3", "True-Client-IP": "10.1.2.3",
}


async def test_no_header_a_proxy_set_reaches_a_remote_agent(
        remote: ScriptedAGUIServer, serve_runtime: ServeRuntime) -> None:
    widest = HttpAgent(remote.url, header_policy=HeaderPolicy(allow_prefixes=("",)))
    async with serve_runtime(runtime_for(widest)) as served:
        response = await served.post("/agent/remote/run", run_input("Hi"),
                                     headers={**_PROXY_HEADERS, "X-Tenant": "acme"})
        assert response.status == 200
        await response.read()
    sent = remote.requests[0]["headers"]
    assert sent["x-tenant"] == "acme"
    leaked = sorted(name for name in sent if name in {n.lower() for n in _PROXY_HEADERS})
    assert leaked == [], leaked


async def test_a_non_ascii_forwarded_header_reaches_the_remote_byte_for_byte(
        remote: ScriptedAGUIServer, serve_runtime: ServeRuntime) -> None:
    """The client's UTF-8 bytes arrived UTF-8 encoded twice before (`Jos\\xc3\\x83\\xc2\\xa9`)."""
    async with serve_runtime(runtime_for(HttpAgent(remote.url))) as served:
        response = await served.post("/agent/remote/run", run_input("Hi"),
                                     headers={"X-User-Name": "José"})  # (sent as UTF-8)
        assert response.status == 200
        await response.read()
    got = remote.requests[0]["headers"]["x-user-name"]
    assert got.encode("utf-8", "surrogateescape") == "José".encode()


def test_forwarded_header_values_as_aiohttp_sends_them() -> None:
    # `forwardable` reads a byte as one character; aiohttp writes characters as UTF-8.
    (value,) = forwardable([(b"x-user-name", "José".encode())]).values()
    assert value.encode("latin-1") == "José".encode()  # (what other agents rely on)
    assert for_aiohttp({"x-user-name": value}) == {"x-user-name": "José"}
    # Bytes that are not UTF-8 cannot go out unchanged: as before, their characters go.
    assert for_aiohttp({"x-a": "Jos\xe9", "x-b": "plain", "x-c": "€"}) == {
        "x-a": "Jos\xe9", "x-b": "plain", "x-c": "€"}


def test_headers_a_connection_header_names_stay_on_that_connection() -> None:
    raw = [(b"Connection", b"keep-alive, X-Hop-Token"), (b"x-hop-token", b"hop"),
           (b"Proxy-Connection", b"keep-alive"), (b"X-Tenant", b"acme")]
    assert forwardable(raw) == {"x-tenant": "acme"}


async def test_cookie_forwarding_when_asked(remote: ScriptedAGUIServer,
                                           serve_runtime: ServeRuntime) -> None:
    agent = HttpAgent(remote.url, header_policy=HeaderPolicy(forward_cookies=True))
    async with serve_runtime(runtime_for(agent)) as served:
        response = await served.post("/agent/remote/run", run_input("Hi"),
                                     headers=_CLIENT_HEADERS)
        assert response.status == 200
        await response.read()
    sent = remote.requests[0]["headers"]
    assert sent["cookie"] == "session=abc"
    assert "x-forwarded-for" not in sent


def _error(events: list[dict[str, Any]]) -> dict[str, Any]:
    verify_events(events)
    assert events[-1]["type"] == "RUN_ERROR", types(events)
    leaked = orjson.dumps(events[-1]).decode()
    for marker in ("Traceback", ".py", "127.0.0.1", "http://"):
        assert marker not in leaked, events[-1]
    return events[-1]


async def test_remote_that_dies_mid_stream(remote: ScriptedAGUIServer,
                                           serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(runtime_for(HttpAgent(remote.url))) as served:
        events = await served.run(run_input("die:5 tell me a story"), agent="remote")
        after = await served.run(run_input("Hello", thread="t-after"), agent="remote")
    error = _error(events)
    assert error["code"] == "UPSTREAM_ERROR"
    assert error["message"] == ("Remote agent 'remote' closed the connection before the "
                                "answer was complete")
    # what arrived before the cut reached the client, and the open message was closed
    assert "TEXT_MESSAGE_CONTENT" in types(events)
    assert types(events)[-3:] == ["TEXT_MESSAGE_END", "STEP_FINISHED", "RUN_ERROR"]
    verify_events(after)  # the agent keeps working for the next run
    assert text_of(after) == "remote: Hello"


@pytest.mark.parametrize(("text", "message", "code"), [
    ("error:500", "Remote agent 'remote' answered HTTP 500: remote error 500", "UPSTREAM_ERROR"),
    ("error:404", "Remote agent 'remote' answered HTTP 404: remote error 404", "UPSTREAM_ERROR"),
    ("noend", "Remote agent 'remote' closed its stream before the end of the run "
              "(no RUN_FINISHED or RUN_ERROR)", "UPSTREAM_ERROR"),
    ("broken", "Remote agent 'remote' sent TEXT_MESSAGE_CONTENT for message 'ghost', "
               "which is not open", "UPSTREAM_ERROR"),
    ("runerror", "remote agent failed on purpose", "REMOTE_FAILURE"),
])
async def test_failing_remote_is_a_clear_run_error(
        remote: ScriptedAGUIServer, serve_runtime: ServeRuntime,
        text: str, message: str, code: str) -> None:
    async with serve_runtime(runtime_for(HttpAgent(remote.url))) as served:
        error = _error(await served.run(run_input(text), agent="remote"))
    assert (error["message"], error["code"]) == (message, code)


async def test_unreachable_remote(serve_runtime: ServeRuntime) -> None:
    agent = HttpAgent(f"http://127.0.0.1:{free_port()}/agent")
    async with serve_runtime(runtime_for(agent)) as served:
        error = _error(await served.run(run_input("Hi"), agent="remote"))
    assert error["message"] == "Remote agent 'remote' could not be reached (connection failed)"


async def test_silent_remote_times_out(remote: ScriptedAGUIServer,
                                       serve_runtime: ServeRuntime) -> None:
    agent = HttpAgent(remote.url, timeouts=Timeouts(read=0.3))
    async with serve_runtime(runtime_for(agent)) as served:
        started = asyncio.get_running_loop().time()
        error = _error(await served.run(run_input("hang"), agent="remote"))
        elapsed = asyncio.get_running_loop().time() - started
    assert (error["message"], error["code"]) == (
        "Remote agent 'remote' did not answer in time", "UPSTREAM_TIMEOUT")
    assert elapsed < 3


async def test_chunk_events_are_expanded(remote: ScriptedAGUIServer,
                                         serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(runtime_for(HttpAgent(remote.url))) as served:
        events = await served.run(run_input("chunks"), agent="remote")
    verify_events(events)
    assert types(events) == [
        "RUN_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT",
        "TEXT_MESSAGE_END", "TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_ARGS",
        "TOOL_CALL_END", "RUN_FINISHED"]
    assert text_of(events) == "chunked text"
    assert events[5]["toolCallName"] == "lookup"


async def test_stop_closes_the_upstream_connection(remote: ScriptedAGUIServer,
                                                   serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(runtime_for(HttpAgent(remote.url))) as served:
        body = run_input("slow:100 take your time", thread="t-stop")
        response = await served.post("/agent/remote/run", body)
        await response.content.readuntil(b"TEXT_MESSAGE_CONTENT")
        stop = await served.post("/agent/remote/stop/t-stop", {})
        assert (await stop.json())["stopped"] is True
        rest = await response.read()
        for _ in range(100):
            if remote.disconnects:
                break
            await asyncio.sleep(0.01)
    assert remote.disconnects == 1
    assert rest.rstrip().endswith(b'"type":"RUN_FINISHED","threadId":"t-stop","runId":"run-1"}')


def test_sse_decoder_any_split() -> None:
    frames = (b'data: {"type":"A"}\n\n: keep-alive\n\ndata: {"type":\r\ndata: "B"}\r\n\r\n'
              b'event: x\nid: 3\ndata: {"type":"C"}\n\n')
    expected = [b'{"type":"A"}', b'{"type":\n"B"}', b'{"type":"C"}']
    for cut in range(1, len(frames)):
        for second in range(cut, len(frames)):
            decoder = SSEDecoder()
            got = (decoder.feed(frames[:cut]) + decoder.feed(frames[cut:second])
                   + decoder.feed(frames[second:]))
            assert got == expected, (cut, second)
            assert not decoder.pending()


def test_checker_rejects_duplicate_starts_and_nameless_events() -> None:
    checker = RemoteEventChecker("Remote agent 'x'")
    start = {"type": "TOOL_CALL_START", "toolCallId": "c", "toolCallName": "f"}
    with pytest.raises(UpstreamError, match="TOOL_CALL_START for tool call 'c', which is "
                                            "already open"):
        checker.check([start, start])
    with pytest.raises(UpstreamError, match="without a string 'type'"):
        RemoteEventChecker("Remote agent 'x'").check([{"kind": "x"}])
    with pytest.raises(UpstreamError, match="without a string 'messageId'"):
        RemoteEventChecker("Remote agent 'x'").check([{"type": "TEXT_MESSAGE_START"}])
    unknown = RemoteEventChecker("Remote agent 'x'").check([{"type": "FUTURE_EVENT"}])
    assert unknown == []
