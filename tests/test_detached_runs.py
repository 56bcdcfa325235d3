"""An AG-UI run outlives its client: a reload, a proxy's timeout or a network change mid-answer
does not cut the answer. The run goes on (its writes to the gone client dropped), stored as
always, so a `connect` picks it up where the client left off, for at most
`detached_run_seconds`; then it is stopped as a disconnect stopped it before (its upstream
request cancelled, its end stored). A `stop` still stops it at once; GraphQL's disconnect is
its stop button, and stays one. Served by real uvicorn, as clients reach it."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import aiohttp
import orjson
import pytest
import uvicorn

from copilot_runtime import ConfigurationError, CopilotRuntime, _serving, create_app
from copilot_runtime import events as ev
from copilot_runtime._input import RunInput, parse_run_input
from copilot_runtime.agents.base import Agent, EventBatches, RunContext
from copilot_runtime.protocols import http
from copilot_runtime.testing import MockOpenAIServer, verify_events
from copilot_runtime.threads.base import INTERRUPTED_CODE
from tests.conftest import (
    GatedAgent,
    ServeRuntime,
    free_port,
    openai_runtime,
    parse_sse,
    parse_sse_ids,
    poll,
    run_input,
    text_of,
    types,
    uvicorn_serving,
)
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, user_turn

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

RUN = "/agent/default/run"
CONNECT = "/agent/default/connect"


def envelope(method: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"method": method, "params": {"agentId": "default"}, "body": body}


async def until_text(response: aiohttp.ClientResponse) -> bytes:
    """Read a run's stream until its answer has begun; the bytes read."""
    received = b""
    async with asyncio.timeout(10):
        while b"TEXT_MESSAGE_CONTENT" not in received:
            received += await response.content.readany()
    return received


async def until(condition: Any, what: str, within: float = 10.0) -> None:
    async for _ in poll(within, every=0.01):
        if condition():
            return
    raise AssertionError(f"{what}: not within {within} s")


def detached(runtime: CopilotRuntime, thread: str) -> bool:
    run = runtime.runs.active.get(thread)
    return run is not None and run.detached


async def leave(response: aiohttp.ClientResponse, runtime: CopilotRuntime,
                thread: str) -> bytes:
    """The client leaves once the answer has begun (a reload); the run goes on without it.
    The bytes it had read."""
    seen = await until_text(response)
    response.close()
    await until(lambda: detached(runtime, thread), "the run was not detached")
    return seen


@pytest.mark.parametrize("route", ["multi-route", "envelope"])
async def test_a_run_whose_client_leaves_goes_on_and_connect_replays_it_whole(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime, route: str) -> None:
    """The client leaves after the first words; the run and its upstream request go on to
    the end (nothing cancelled), and a later `connect` replays the whole answer."""
    async with serve_runtime(openai_runtime(llm)) as served:
        body = run_input("slow:60 finish without me", thread="t-reload")
        response = await (served.post(RUN, body) if route == "multi-route"
                          else served.post("", envelope("agent/run", body)))
        await leave(response, served.runtime, "t-reload")
        assert llm.active_streams == 1
        assert llm.cancelled_streams == 0
        await until(lambda: "t-reload" not in served.runtime.runs.active, "the run never ended")
        assert llm.cancelled_streams == 0
        replay = await served.run(run_input("", thread="t-reload"), path=CONNECT)
    verify_events(replay)
    assert text_of(replay) == "echo: slow:60 finish without me"
    assert types(replay)[-1] == "RUN_FINISHED"


async def test_connect_follows_a_detached_run_to_its_end(serve_runtime: ServeRuntime) -> None:
    """A `connect` while the run goes on without its client follows it live, to its end."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent})
    async with serve_runtime(runtime) as served:
        response = await served.post(RUN, run_input("hi", thread="t-follow"))
        await leave(response, runtime, "t-follow")
        connect = await served.post(CONNECT, run_input("", thread="t-follow"))
        so_far = b""
        async with asyncio.timeout(10):
            while b"one " not in so_far:
                so_far += await connect.content.readany()
        assert "t-follow" in runtime.runs.active
        agent.gate.set()
        replay = parse_sse(so_far + await connect.read())
    verify_events(replay)
    assert text_of(replay) == "one two"
    assert types(replay)[-1] == "RUN_FINISHED"


async def test_a_resume_after_the_client_left_gets_exactly_the_rest(
        serve_runtime: ServeRuntime) -> None:
    """`connect` with the last `Last-Event-ID` the gone client saw sends only what came
    after it, to the run's end."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent})
    async with serve_runtime(runtime) as served:
        response = await served.post(RUN, run_input("hi", thread="t-resume"))
        seen = parse_sse_ids(await leave(response, runtime, "t-resume"))
        last_id = seen[-1][0]
        assert last_id is not None
        resumed = asyncio.create_task(served.post(
            CONNECT, run_input("", thread="t-resume"),
            headers={"Last-Event-ID": str(last_id)}))
        await until(lambda: runtime.runs.active["t-resume"].listeners, "no follower")
        agent.gate.set()
        rest = parse_sse_ids(await (await resumed).read())
        whole = parse_sse_ids(await (await served.post(
            CONNECT, run_input("", thread="t-resume"))).read())
    assert [i for i, _ in rest] == list(range(last_id + 1, last_id + 1 + len(rest)))
    assert types([e for _, e in rest]) == ["TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END",
                                           "RUN_FINISHED"]
    assert rest[0][1]["delta"] == "two"
    assert text_of([e for _, e in seen + rest]) == text_of([e for _, e in whole]) == "one two"


async def test_a_detached_run_is_stopped_at_its_bound(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """Past `detached_run_seconds` the run is stopped as a disconnect stopped it: its
    upstream request cancelled then (not before), its partial answer stored with its end."""
    runtime = openai_runtime(llm, detached_run_seconds=0.5)
    async with serve_runtime(runtime) as served:
        response = await served.post(RUN, run_input("slow:400 a long answer", thread="t-bound"))
        await leave(response, runtime, "t-bound")
        assert llm.active_streams == 1
        assert llm.cancelled_streams == 0
        await until(lambda: "t-bound" not in runtime.runs.active, "the run was not stopped")
        await until(lambda: llm.cancelled_streams == 1, "the upstream was not cancelled")
        replay = await served.run(run_input("", thread="t-bound"), path=CONNECT)
    verify_events(replay)
    assert types(replay)[-1] == "RUN_FINISHED"
    assert "echo: slow:400 a long answer".startswith(text_of(replay))
    assert text_of(replay) != "echo: slow:400 a long answer"


async def test_a_bound_of_zero_stops_the_run_at_once(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    runtime = openai_runtime(llm, detached_run_seconds=0)
    async with serve_runtime(runtime) as served:
        response = await served.post(RUN, run_input("slow:400 a long answer", thread="t-zero"))
        await until_text(response)
        response.close()
        await until(lambda: "t-zero" not in runtime.runs.active, "the run was not stopped")
        await until(lambda: llm.cancelled_streams == 1, "the upstream was not cancelled")
        replay = await served.run(run_input("", thread="t-zero"), path=CONNECT)
    assert types(replay)[-1] == "RUN_FINISHED"


@pytest.mark.parametrize("route", ["multi-route", "envelope"])
async def test_a_stop_stops_a_detached_run_at_once(serve_runtime: ServeRuntime,
                                                   route: str) -> None:
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, detached_run_seconds=None)
    async with serve_runtime(runtime) as served:
        response = await served.post(RUN, run_input("hi", thread="t-stopped"))
        await leave(response, runtime, "t-stopped")
        busy = await served.post(RUN, run_input("again", thread="t-stopped", run="run-2"))
        assert busy.status == 409  # its thread is busy while it goes on
        if route == "multi-route":
            stop = await served.post("/agent/default/stop/t-stopped", {"runId": "run-1"})
        else:
            stop = await served.post("", {"method": "agent/stop", "params": {
                "agentId": "default", "threadId": "t-stopped"}})
        assert (await stop.json())["stopped"] is True
        await until(lambda: "t-stopped" not in runtime.runs.active, "the run was not stopped")
        replay = await served.run(run_input("", thread="t-stopped"), path=CONNECT)
    verify_events(replay)
    assert text_of(replay) == "one "
    assert types(replay)[-1] == "RUN_FINISHED"


async def test_graphql_disconnect_still_stops_the_run_at_once(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """The 1.10 client's stop button aborts its request: a GraphQL disconnect is a stop,
    whatever `detached_run_seconds`."""
    runtime = openai_runtime(llm, detached_run_seconds=None)
    async with serve_runtime(runtime) as served:
        response = await served.session.post(served.url, data=orjson.dumps(
            {"query": CHAT_DOCUMENT, "variables": {"data": user_turn("slow:300 stop")}}),
            headers=CLIENT_HEADERS)
        await until(lambda: llm.active_streams == 1, "the model never answered")
        response.close()
        await until(lambda: llm.cancelled_streams == 1, "the upstream was not cancelled")
        await until(lambda: not runtime.runs.active, "the run was not stopped")


class _Streaming(Agent):
    """Says a word every `pause` seconds until `stop` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = asyncio.Event()
        self.said = 0

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input.run_id)

    async def _run(self, run_id: str) -> Any:
        message = f"m-{run_id}"
        yield [ev.text_message_start(message)]
        while not self.stop.is_set():
            self.said += 1
            yield [ev.text_message_content(message, "x " * 60_000)]
            await asyncio.sleep(0.02)
        yield [ev.text_message_end(message)]


async def test_a_client_that_stops_reading_is_left_and_the_run_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client counted gone after `SEND_IDLE_SECONDS` (its write stuck, a server that
    cannot abort it) frees the run from that write: it goes on, its writes dropped."""
    monkeypatch.setattr(http, "SEND_IDLE_SECONDS", 0.2)
    agent = _Streaming()
    runtime = CopilotRuntime(agents={"default": agent}, detached_run_seconds=None)
    sent: list[bytes] = []
    stuck = asyncio.Event()
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()  # the client neither sends nor leaves
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))
        if len(sent) == 3:  # the client reads no more
            stuck.set()
            await never.wait()

    scope = {"type": "http", "method": "POST", "headers": [], "query_string": b""}
    request = http.Request(scope, receive, send, RUN, [])
    run = await runtime.start_run("default", _input("t-unread"), {})
    async with run:
        driving = asyncio.create_task(http.stream_run(request, run, outlives_client=True))
        await stuck.wait()
        await until(lambda: run.detached, "the client was not counted gone")
        said = agent.said
        await until(lambda: agent.said > said + 3, "the run did not go on")
        assert len(sent) == 3  # nothing more written to the gone client
        agent.stop.set()
        await asyncio.wait_for(driving, 10)
    record = await runtime.store.get("t-unread")
    assert record is not None
    assert record.runs[-1].events[-1]["type"] == "RUN_FINISHED"
    await runtime.aclose()


def _input(thread: str) -> RunInput:
    return parse_run_input(run_input("hi", thread=thread))


async def test_shutdown_ends_a_detached_run_as_interrupted(serve_runtime: ServeRuntime) -> None:
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, detached_run_seconds=None)
    async with serve_runtime(runtime) as served:
        response = await served.post(RUN, run_input("hi", thread="t-shutdown"))
        await leave(response, runtime, "t-shutdown")
        runtime.runs.stop_all()  # what shutdown begins with
        await until(lambda: "t-shutdown" not in runtime.runs.active, "the run goes on")
        record = await runtime.store.get("t-shutdown")
    assert record is not None
    last = record.runs[-1].events[-1]
    assert (last["type"], last["code"]) == ("RUN_ERROR", INTERRUPTED_CODE)


async def test_detached_run_seconds_is_checked() -> None:
    assert CopilotRuntime(detached_run_seconds=0).runs.detached_run_seconds == 0
    assert CopilotRuntime(detached_run_seconds=None).runs.detached_run_seconds is None
    assert CopilotRuntime().runs.detached_run_seconds == 60.0
    for wrong in (-1, float("nan"), True, "60"):
        with pytest.raises(ConfigurationError, match="detached_run_seconds"):
            CopilotRuntime(detached_run_seconds=wrong)  # type: ignore[arg-type]


async def test_under_serve_an_aborted_client_does_not_stop_the_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `copilot-runtime serve` a client that reads nothing is given up on and its
    connection aborted (`copilot_runtime.abort`); that frees the connection, not the run:
    its request task drives it on, and a `connect` replays it whole."""
    monkeypatch.setattr(http, "SEND_IDLE_SECONDS", 0.5)
    agent = _Streaming()
    runtime = CopilotRuntime(agents={"default": agent}, detached_run_seconds=None)
    async with uvicorn_serving(create_app(runtime, "/api"), log_config=None, ws="none",
                               http=_serving._StopRunsFirst) as (server, port), \
            aiohttp.ClientSession() as session:
        sock = await _unread_run(port, "t-aborted")
        try:
            await until(lambda: detached(runtime, "t-aborted"), "never given up on")
            await until(lambda: not server.server_state.connections, "not aborted")
            said = agent.said
            await until(lambda: agent.said > said + 3, "the run did not go on")
        finally:
            sock.close()
        agent.stop.set()
        await until(lambda: not runtime.runs.active, "the run never ended")
        answer = await session.post(f"http://127.0.0.1:{port}/api{CONNECT}",
                                    json=run_input("", thread="t-aborted"))
        replay = parse_sse(await answer.read())
    verify_events(replay)
    assert types(replay)[-1] == "RUN_FINISHED"
    assert len(text_of(replay)) == agent.said * len("x " * 60_000)


async def _unread_run(port: int, thread: str) -> socket.socket:
    """A run asked for on a connection whose answer is never read, left open."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    body = orjson.dumps(run_input("hi", thread=thread))
    await loop.sock_sendall(sock, (
        f"POST /api{RUN} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    return sock


async def test_a_send_that_raises_once_the_client_left_detaches_the_run() -> None:
    """A server whose `send` raises OSError once the client has gone (the ASGI spec lets
    it): the run goes on, and is stored whole."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, detached_run_seconds=None)
    app = create_app(runtime, "/api")
    writes = 0
    bodies = [{"type": "http.request", "body": orjson.dumps(run_input("hi", thread="t-raise")),
               "more_body": False}]

    async def receive() -> dict[str, Any]:
        if bodies:
            return bodies.pop()
        await asyncio.Event().wait()  # the server says nothing more: its send raises
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        nonlocal writes
        if message["type"] == "http.response.body":
            writes += 1
            if writes >= 2:
                raise OSError("the client has gone")

    scope = {"type": "http", "method": "POST", "path": f"/api{RUN}", "raw_path": b"",
             "query_string": b"", "root_path": "", "headers": [
                 (b"content-type", b"application/json")], "client": ("127.0.0.1", 1)}
    served = asyncio.create_task(app(scope, receive, send))
    await until(lambda: detached(runtime, "t-raise"), "the run was not detached")
    agent.gate.set()
    await asyncio.wait_for(served, 10)
    assert writes == 2  # nothing written after the failed write
    record = await runtime.store.get("t-raise")
    assert record is not None
    assert text_of(record.runs[-1].events) == "one two"
    assert record.runs[-1].events[-1]["type"] == "RUN_FINISHED"
    await runtime.aclose()


async def test_serve_shutdown_ends_a_detached_run_at_once(
        uvicorn_errors: list[logging.LogRecord]) -> None:
    """`copilot-runtime serve`'s shutdown stops a run whose client left (no connection
    holds it) with RUN_INTERRUPTED at once, not when uvicorn's grace runs out."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, detached_run_seconds=None)
    app = create_app(runtime, "/api")
    _serving.serving(runtime)
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), lifespan="on",
                            log_config=None, ws="none", http=_serving._StopRunsFirst,
                            timeout_graceful_shutdown=5)
    server = _serving._Server(config)
    serving = asyncio.create_task(server.serve())
    await until(lambda: server.started, "the server did not start")
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"http://127.0.0.1:{config.port}/api{RUN}",
                                      json=run_input("hi", thread="t-sigterm"))
        await leave(response, runtime, "t-sigterm")
    run = runtime.runs.active["t-sigterm"]
    started = time.monotonic()
    server.should_exit = True  # what SIGTERM does
    await asyncio.wait_for(serving, 10)
    assert time.monotonic() - started < 2.0
    assert not [r for r in uvicorn_errors if r.levelno >= logging.ERROR]
    last = run.compacted[-1]  # as stored
    assert (last["type"], last["code"]) == ("RUN_ERROR", INTERRUPTED_CODE)


@pytest.fixture
def uvicorn_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    caplog.set_level(logging.ERROR, logger="uvicorn.error")
    return caplog.records
