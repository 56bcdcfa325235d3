"""A client that stops reading a stream, its connection left open, is treated as gone.

uvicorn's `send` waits while the client's socket is full, for as long as the client keeps
the connection open and reads nothing. Before, a run whose client did that waited with it:
the run, its thread (every other run on it 409), its lease and its upstream request were
held until the client closed; a `connect` follower kept its replay in memory as long. Now a
write that waits `SEND_IDLE_SECONDS` counts as a disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from copilot_runtime import CopilotRuntime
from copilot_runtime import events as ev
from copilot_runtime._input import RunInput
from copilot_runtime.agents.base import Agent, EventBatches, RunContext
from copilot_runtime.protocols import http
from tests.conftest import ServeRuntime, poll, run_input, text_of

pytestmark = pytest.mark.timeout(60)

#: What each event carries: a few of them fill any socket's buffers.
CHUNK = "x" * 256 * 1024
#: What a flooded run may hold: a running run keeps four times this before it is stopped,
#: well above these floods (the bound has its own tests).
FLOODED = 1024 * 1024 * 1024


class Flood(Agent):
    """Streams large text deltas (`pause` seconds apart) until `stop` is set or `limit`
    were sent, then ends."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = asyncio.Event()
        self.sent = 0
        self.limit = 400
        self.pause = 0.0

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input.run_id)

    async def _run(self, run_id: str) -> Any:
        message = f"m-{run_id}"
        yield [ev.text_message_start(message)]
        while not self.stop.is_set() and self.sent < self.limit:
            self.sent += 1
            yield [ev.text_message_content(message, CHUNK)]
            await asyncio.sleep(self.pause)
        yield [ev.text_message_content(message, "done"), ev.text_message_end(message)]


@pytest.fixture
def send_idle(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(http, "SEND_IDLE_SECONDS", 1.0)
    return 1.0


@contextlib.asynccontextmanager
async def unread_request(url: str, path: str, body: dict[str, Any]) -> AsyncIterator[None]:
    """POST `body` and never read the answer, the connection left open."""
    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (parts.hostname, parts.port))
    data = orjson.dumps(body)
    head = (f"POST {parts.path}{path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    await loop.sock_sendall(sock, head.encode() + data)
    try:
        yield
    finally:
        sock.close()


async def test_a_run_whose_client_stops_reading_ends_as_on_a_disconnect(
        serve_runtime: ServeRuntime, send_idle: float) -> None:
    """The run stops once a write has waited `SEND_IDLE_SECONDS`, is stored as a
    disconnected run is, and the thread takes its next run; before, it stayed busy (409)
    until the client closed."""
    agent = Flood()
    # Stopped at once when its client counts as gone (0); one that outlives its client:
    # tests/test_detached_runs.py.
    runtime = CopilotRuntime(agents={"default": agent}, max_run_bytes=FLOODED,
                             detached_run_seconds=0)
    async with serve_runtime(runtime) as served, unread_request(
            served.url, "/agent/default/run", run_input("flood", thread="unread")):
        async for _ in poll(15):
            if agent.sent and "unread" not in runtime.runs.active:
                break
        assert "unread" not in runtime.runs.active, "the run still holds its thread"
        assert 0 < agent.sent < 400  # stopped, not run to its end
        record = await runtime.store.get("unread")
        assert record is not None
        (stored,) = record.runs
        assert stored.events[-1]["type"] == "RUN_FINISHED"
        agent.stop.set()
        events = await served.run(run_input("again", thread="unread", run="run-2"))
        assert text_of(events) == "done"


async def test_a_follower_that_stops_reading_is_let_go(
        serve_runtime: ServeRuntime, send_idle: float) -> None:
    """A `connect` whose client stops reading while it follows a live run is ended (its
    replay freed); the run goes on, and a reading client still follows it to its end."""
    agent = Flood()
    runtime = CopilotRuntime(agents={"default": agent}, max_run_bytes=FLOODED)
    async with serve_runtime(runtime) as served:
        running = asyncio.create_task(served.run(run_input("flood", thread="followed")))
        agent.limit = 10_000
        async for _ in poll(10):
            if agent.sent > 40:  # a replay larger than any socket's buffers
                break
        agent.pause = 0.05  # then a slow stream while the follower is watched
        live = runtime.runs.active["followed"]
        async with unread_request(served.url, "/agent/default/connect",
                                  run_input("", thread="followed", run="c")):
            async for _ in poll(5):
                if live.listeners:
                    break
            assert live.listeners, "the follower never subscribed"
            async for _ in poll(15):
                if not live.listeners:
                    break
            assert not live.listeners, "the follower that reads nothing is still held"
            assert "followed" in runtime.runs.active  # the run itself goes on
        agent.stop.set()
        events = await asyncio.wait_for(running, 20)
        assert events[-1]["type"] == "RUN_FINISHED"


async def test_large_answers_to_clients_that_read_nothing_are_bounded_together(
        serve_runtime: ServeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each `connect` (or thread read) answered the whole thread in one write, so every
    client that read nothing held a copy until it counted as gone: fifty of a 26 MB thread
    held 1.3 GB. Large answers now go in pieces and count against `LARGE_ANSWERS_BYTES`
    together: past it a new one is a 503 (Retry-After) before it starts, and room comes
    back when a client that held it is gone."""
    monkeypatch.setattr(http, "LARGE_ANSWERS_BYTES", 41 * len(CHUNK))
    monkeypatch.setattr(http, "SEND_IDLE_SECONDS", 2.0)
    agent = Flood()
    agent.limit = 40  # a thread of 10 MB: more than any socket's buffers take
    runtime = CopilotRuntime(agents={"default": agent}, max_run_bytes=FLOODED)
    async with serve_runtime(runtime) as served:
        await served.run(run_input("big", thread="big"))
        replay = run_input("", thread="big", run="c")
        async with unread_request(served.url, "/agent/default/connect", replay):
            async for _ in poll(5):
                if http._LargeAnswers.held:
                    break
            assert http._LargeAnswers.held > 40 * len(CHUNK)
            for method, path, body in [("POST", "/agent/default/connect", replay),
                                       ("GET", "/threads/big/events", None)]:
                response = await served.session.request(
                    method, served.url + path, data=orjson.dumps(body) if body else None,
                    headers={"Content-Type": "application/json"})
                assert response.status == 503, await response.text()
                assert response.headers["Retry-After"] == "1"
                assert "large answers" in (await response.json())["message"]
            async for _ in poll(10):  # the client reading nothing counts as gone
                if not http._LargeAnswers.held:
                    break
        assert http._LargeAnswers.held == 0
        events = await served.run(replay, path="/agent/default/connect")
        assert text_of(events) == CHUNK * 40 + "done"


async def test_a_large_graphql_answer_without_room_is_a_503(
        serve_runtime: ServeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without room among the large answers, GraphQL's `loadAgentState` answered 500 (the
    refusal escaped its handler, an "unhandled error" logged) where the AG-UI routes answer
    503; it is a 503 with Retry-After in GraphQL's error form now."""
    agent = Flood()
    agent.limit = 2  # a thread of 512 KB
    runtime = CopilotRuntime(agents={"default": agent}, max_run_bytes=FLOODED)
    async with serve_runtime(runtime) as served:
        await served.run(run_input("big", thread="big"))
        monkeypatch.setattr(http._LargeAnswers, "held", http.LARGE_ANSWERS_BYTES)
        response = await served.session.post(served.url, data=orjson.dumps({
            "query": "query($data: LoadAgentStateInput!) { loadAgentState(data: $data) "
                     "{ threadId threadExists state messages } }",
            "variables": {"data": {"threadId": "big", "agentName": "default"}}}),
            headers={"Content-Type": "application/json"})
        assert response.status == 503, await response.text()
        assert response.headers["Retry-After"] == "1"
        (error,) = (await response.json())["errors"]
        assert (error["extensions"]["code"], error["extensions"]["runtimeCode"]) == (
            "NETWORK_ERROR", "SERVICE_UNAVAILABLE")


async def test_a_stream_whose_large_batch_finds_no_room_ends_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's later large batch (a follower that fell behind) waits for room among the
    large answers; none coming within `SEND_IDLE_SECONDS`, the stream ends there, its
    response ended (the client resumes with `Last-Event-ID`), nothing of the batch sent
    and the room it never took not given back."""
    monkeypatch.setattr(http, "SEND_IDLE_SECONDS", 0.2)
    monkeypatch.setattr(http._LargeAnswers, "held", http.LARGE_ANSWERS_BYTES)
    sent: list[dict[str, Any]] = []
    waiting = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await waiting.wait()  # the client neither sends nor leaves
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def batches() -> Any:
        yield [(0, ev.run_started("t", "r"))]
        yield [(1, ev.text_message_start("m")), (2, ev.text_message_content("m", CHUNK * 2))]

    scope = {"type": "http", "method": "POST", "headers": [], "query_string": b""}
    request = http.Request(scope, receive, send, "/agent/default/connect", [])
    await asyncio.wait_for(http.stream_events(request, batches()), 10)
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert b"RUN_STARTED" in bodies[0]["body"]
    assert not any(CHUNK.encode() in m["body"] for m in bodies)
    assert bodies[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert http._LargeAnswers.held == http.LARGE_ANSWERS_BYTES
