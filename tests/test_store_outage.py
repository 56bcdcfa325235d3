"""A thread store that cannot be reached: PostgreSQL refusing connections, accepting them but
never answering, and coming back. Each request gets a precise 503 (a GraphQL error on the
1.10 protocol) within the store's timeout, never a hang or a stack trace, the server keeps
serving, and the store works again once its server is back."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import psycopg
import pytest

from copilot_runtime import CopilotRuntime, RateLimit, ServiceUnavailableError, coordinator
from copilot_runtime.coordination import LEASE_LOST_CODE, Coordinator
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.threads import PostgresThreadStore
from tests.conftest import GatedAgent, ServeRuntime, free_port, openai_runtime, poll
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, user_turn
from tests.hitl_support.postgres import SERVER

# Imported here, not inside the test: pytest rewrites a test module as it is first imported
# (ast.parse), and CPython 3.11.7's AST conversion keeps its recursion depth in state every
# thread shares, so a parse racing another thread's fails with "AST constructor recursion
# depth mismatch" (seen in a test importing this from its body).
from tests.test_pg_group_commit import _terminate

pytestmark = pytest.mark.timeout(60)

#: The store's timeout in these tests (seconds): connection attempts and reads.
TIMEOUT = 2.0


def _run(thread: str) -> dict[str, Any]:
    return {"threadId": thread, "runId": "r", "messages": [
        {"id": "u1", "role": "user", "content": "hi"}], "tools": [], "context": [],
        "state": {}, "forwardedProps": {}}


def _store(port: int, schema: str = "outage", timeout: float = TIMEOUT) -> PostgresThreadStore:
    return PostgresThreadStore(f"postgresql://postgres@127.0.0.1:{port}/test",
                               schema=schema, timeout=timeout)


@pytest.fixture
def refusing() -> int:
    """A port nothing listens on."""
    return free_port()


@pytest.fixture
def silent() -> Iterator[int]:
    """A port that accepts connections and never answers (a hung server)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


class Flow:
    """A connection through a `Proxy`."""

    silent: bool = False
    #: Its two sockets (to the client, to the server), once both are open.
    sockets: tuple[asyncio.StreamWriter, ...] = ()


class Proxy:
    """A server of this machine (PostgreSQL by default) behind a TCP proxy that can be taken
    down (connections refused, those open cut) and brought back on the same port."""

    def __init__(self, target: int = 5432) -> None:
        self.target = target
        #: Seconds the client's side stays open after the server closed its own.
        self.linger = 0.0
        self.port = free_port()
        self.schema = f"outage_{uuid.uuid4().hex[:10]}"
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()
        self._sockets: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        #: Cleared by `hang`: what either side sends is held, connections stay open.
        self._flowing = asyncio.Event()
        self._flowing.set()

    async def up(self) -> None:
        self._flowing.set()
        if self._server is None:
            self._server = await asyncio.start_server(self._link, "127.0.0.1", self.port)

    def coordinator(self, options: str = "") -> Coordinator:
        """A coordinator on the server behind this proxy, its calls bounded by `TIMEOUT`."""
        url = (f"postgresql://postgres@127.0.0.1:{self.port}/test?schema={self.schema}"
               if self.target == 5432 else
               f"redis://127.0.0.1:{self.port}/0?prefix={self.schema}:")
        made = coordinator(url + options)
        made.timeout = TIMEOUT  # type: ignore[attr-defined]
        return made

    def hang(self) -> None:
        """The server stops answering, without closing or refusing anything."""
        self._flowing.clear()

    async def down(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for link in list(self._links):
            link.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)
        # Connections accepted just before the close start their links only now (they end
        # at once), and closed sockets finish closing at the loop's next turns: else, at the
        # test's end, an unclosed socket's warning failed a test on a loaded machine.
        await asyncio.sleep(0.05)
        await asyncio.gather(*self._links, return_exceptions=True)

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        flow = Flow()
        up_writer: asyncio.StreamWriter | None = None
        try:
            # Accepted as the proxy went down (started after `down` cancelled the links):
            # it would have been a live connection through a proxy that is down.
            if self._server is None:
                return
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
            except OSError:
                return
            await self._pump(flow, reader, writer, up_reader, up_writer)
        finally:
            # Whatever ended it, cancellation by `down` included: a client socket left open
            # here was a connection to nothing, which its client waited on for ever.
            writer.close()
            if up_writer is not None:
                up_writer.close()
            self._links.discard(task)

    async def _pump(self, flow: Flow, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter, up_reader: asyncio.StreamReader,
                    up_writer: asyncio.StreamWriter) -> None:
        self._sockets.append((writer, up_writer))
        flow.sockets = (writer, up_writer)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter,
                       upstream: bool, linger: float = 0.0) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    await self._flowing.wait()
                    if self._passes(flow, data, upstream):
                        sink.write(data)
                        await sink.drain()
            if flow.silent:
                return  # a silenced flow stays open
            await asyncio.sleep(linger)
            sink.close()

        await asyncio.gather(pump(reader, up_writer, True),
                             pump(up_reader, writer, False, self.linger))

    def _passes(self, flow: Flow, data: bytes, upstream: bool) -> bool:
        """Whether `data` goes on (`upstream`: from the client to the server)."""
        return True


@pytest.fixture(params=[5432])
async def proxy(request: pytest.FixtureRequest) -> AsyncIterator[Proxy]:
    made = Proxy(request.param)
    try:
        yield made
    finally:
        await made.down()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{made.schema}" CASCADE')


def _assert_unavailable(status: int, headers: Any, body: bytes) -> None:
    assert status == 503, body
    assert headers["retry-after"] == "1"
    assert orjson.loads(body) == {"error": "Service unavailable",
                                  "message": "The thread store cannot be reached",
                                  "code": "SERVICE_UNAVAILABLE"}


@pytest.mark.parametrize("server", ["refusing", "silent"])
async def test_a_store_that_cannot_be_reached_answers_503(
        server: str, llm: MockOpenAIServer, serve_runtime: ServeRuntime,
        request: pytest.FixtureRequest) -> None:
    port = request.getfixturevalue(server)
    # Half the file's timeout: a silent server waits it out at start-up and on each of the
    # three requests that try the store, and nothing here answers late whatever the load.
    timeout = TIMEOUT / 2
    runtime = openai_runtime(llm, thread_store=_store(port, timeout=timeout))
    async with serve_runtime(runtime) as served:
        for attempt in range(2):  # the first attempt opens the store; the next tries again
            started = time.monotonic()
            response = await served.post("/agent/default/run", _run(f"t{attempt}"))
            _assert_unavailable(response.status, response.headers, await response.read())
            assert time.monotonic() - started < 3 * timeout + 1
        # Reading threads too; and the server goes on serving what needs no store.
        listed = await served.session.get(served.url + "/threads?agentId=default")
        _assert_unavailable(listed.status, listed.headers, await listed.read())
        info = await served.session.get(served.url + "/info")
        assert info.status == 200
        # The 1.10 protocol: a GraphQL error the client shows as a network error.
        graphql = await served.session.post(
            served.url, data=orjson.dumps({"query": CHAT_DOCUMENT,
                                           "variables": {"data": user_turn("hi")}}),
            headers=CLIENT_HEADERS)
        text = await graphql.read()
        assert b"The thread store cannot be reached" in text
        assert b"NETWORK_ERROR" in text
        assert b"Traceback" not in text
        assert b".py" not in text
    assert not runtime.runs.active


async def test_the_store_works_again_once_its_server_is_back(
        proxy: Proxy, llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """Down when the first request comes (the store cannot even open), then back: the next
    request opens it and its run is stored; down again mid-life, back again."""
    store = _store(proxy.port, proxy.schema)
    runtime = openai_runtime(llm, thread_store=store)
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/default/run", _run("first"))
        _assert_unavailable(response.status, response.headers, await response.read())
        await proxy.up()
        events = await served.run(_run("first"))
        assert events[-1]["type"] == "RUN_FINISHED"
        assert await store.get("first") is not None
        await proxy.down()
        response = await served.post("/agent/default/run", _run("second"))
        _assert_unavailable(response.status, response.headers, await response.read())
        await proxy.up()
        events = await served.run(_run("second"))
        assert events[-1]["type"] == "RUN_FINISHED"
        assert [t.thread_id for t in await store.list()] == ["second", "first"]


async def test_a_store_that_stops_answering_mid_life_answers_503_at_its_timeout(
        proxy: Proxy, llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """Its connections open, the server stops answering (a network that drops packets):
    the run's head read gives up at the store's timeout, not 5 s later (psycopg waits that
    long for the server to cancel the read, unless cancelled again), with a 503."""
    await proxy.up()
    store = _store(proxy.port, proxy.schema)
    runtime = openai_runtime(llm, thread_store=store)
    async with serve_runtime(runtime) as served:
        assert (await served.run(_run("before")))[-1]["type"] == "RUN_FINISHED"
        proxy.hang()
        started = time.monotonic()
        response = await served.post("/agent/default/run", _run("during"))
        _assert_unavailable(response.status, response.headers, await response.read())
        assert time.monotonic() - started < TIMEOUT + 1.5
        await proxy.down()
        await proxy.up()
        assert (await served.run(_run("after")))[-1]["type"] == "RUN_FINISHED"


async def test_a_run_ending_while_the_store_restarts_is_stored_once_it_is_back(
        proxy: Proxy, serve_runtime: ServeRuntime) -> None:
    """The store goes away while a run streams and comes back a second after the run
    ended: the finished run is written once it is back (the client waits for its last
    events meanwhile) instead of being lost with a log line, as it was before."""
    await proxy.up()
    store = _store(proxy.port, proxy.schema)
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=store)
    async with serve_runtime(runtime) as served:
        streaming = asyncio.create_task(served.run(_run("restarted")))
        async for _ in poll(10):
            if "restarted" in runtime.runs.active and \
                    len(runtime.runs.active["restarted"].events) > 1:
                break
        await proxy.down()
        agent.gate.set()  # the run ends while the store is away
        await asyncio.sleep(1.0)
        assert not streaming.done()  # its last events wait for the write
        await proxy.up()
        events = await asyncio.wait_for(streaming, 10)
        assert events[-1]["type"] == "RUN_FINISHED"
        record = await store.get("restarted")
        assert record is not None
        (run,) = record.runs
        assert "".join(e.get("delta", "") for e in run.events) == "one two"


async def test_reads_give_up_after_the_timeout(silent: int) -> None:
    store = _store(silent)
    started = time.monotonic()
    with pytest.raises(ServiceUnavailableError) as raised:
        await store.summary("t")
    assert time.monotonic() - started < 3 * TIMEOUT + 1
    assert isinstance(raised.value.__cause__, psycopg.OperationalError | TimeoutError)
    await store.aclose()


@pytest.mark.parametrize("how", ["down", "hung"])
@pytest.mark.parametrize("proxy", [5432, 6379], ids=["postgresql", "redis"], indirect=True)
async def test_a_coordinator_that_cannot_be_reached_answers_503(
        proxy: Proxy, llm: MockOpenAIServer, serve_runtime: ServeRuntime, how: str) -> None:
    """The coordinator's server (PostgreSQL or Redis) goes away while the runtime serves (the
    thread store's stays): runs are refused with a 503 naming the coordinator, and taken
    again once it is back."""
    await proxy.up()
    store = PostgresThreadStore(SERVER, schema=proxy.schema, timeout=TIMEOUT)
    runtime = openai_runtime(llm, thread_store=store, coordinator=proxy.coordinator())
    async with serve_runtime(runtime) as served:
        events = await served.run(_run("before"))
        assert events[-1]["type"] == "RUN_FINISHED"
        if how == "down":
            await proxy.down()
        else:
            proxy.hang()
        started = time.monotonic()
        response = await served.post("/agent/default/run", _run("during"))
        assert response.status == 503, await response.text()
        assert time.monotonic() - started < 3 * TIMEOUT
        assert response.headers["retry-after"] == "1"
        assert (await response.json())["message"] == "The coordinator cannot be reached"
        assert "during" not in runtime.runs.active
        if how == "hung":
            await proxy.down()
        await proxy.up()
        events = await served.run(_run("after"))
        assert events[-1]["type"] == "RUN_FINISHED"
        assert {t.thread_id for t in await store.list()} == {"before", "after"}


@pytest.mark.parametrize("limit", ["runs_per_minute", "concurrent_runs"])
@pytest.mark.parametrize("proxy", [5432, 6379], ids=["postgresql", "redis"], indirect=True)
async def test_rate_limits_counted_by_a_coordinator_that_cannot_be_reached_answer_503(
        proxy: Proxy, llm: MockOpenAIServer, serve_runtime: ServeRuntime, limit: str) -> None:
    """Rate limits counted in the coordinator's server: while it is down a run is refused
    with the coordinator's 503 (on PostgreSQL a per-minute limit was a 500 before), and
    counted again once it is back."""
    await proxy.up()
    store = PostgresThreadStore(SERVER, schema=proxy.schema, timeout=TIMEOUT)
    runtime = openai_runtime(llm, thread_store=store, coordinator=proxy.coordinator(),
                             rate_limit=RateLimit(**{limit: 100}))
    async with serve_runtime(runtime) as served:
        assert (await served.run(_run("before")))[-1]["type"] == "RUN_FINISHED"
        await proxy.down()
        response = await served.post("/agent/default/run", _run("during"))
        assert response.status == 503, await response.text()
        assert (await response.json())["message"] == "The coordinator cannot be reached"
        await proxy.up()
        async for _ in poll(10):
            response = await served.post("/agent/default/run", _run("after"))
            if response.status == 200:
                break
            assert response.status == 503, await response.text()
        assert b'"RUN_FINISHED"' in await response.read()


@pytest.mark.parametrize("how", ["down", "hung"])
@pytest.mark.parametrize("proxy", [5432, 6379], ids=["postgresql", "redis"], indirect=True)
async def test_a_run_whose_lease_cannot_be_renewed_stops_before_the_lease_expires(
        proxy: Proxy, serve_runtime: ServeRuntime, how: str) -> None:
    """The coordinator goes away (or stops answering) while a run streams: the run's lease
    cannot be renewed, and once it could expire before the next try the run ends (`RUN_ERROR`
    coded `LEASE_LOST`, stored like any run) rather than streaming on while another worker
    may take its thread (before, it streamed on for as long as its agent did)."""
    ttl = 3.0  # given up with half a second (a sixth of it) still to live
    await proxy.up()
    store = PostgresThreadStore(SERVER, schema=proxy.schema, timeout=TIMEOUT)
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=store,
                             coordinator=proxy.coordinator(f"&lease_ttl={ttl}"))
    async with serve_runtime(runtime) as served:
        streaming = asyncio.create_task(served.run(_run("held")))
        async for _ in poll(10):
            if "held" in runtime.runs.active and len(runtime.runs.active["held"].events) > 1:
                break
        if how == "down":
            await proxy.down()
        else:
            proxy.hang()
        cut = time.monotonic()
        events = await asyncio.wait_for(streaming, 10)
        elapsed = time.monotonic() - cut
        assert events[-1]["type"] == "RUN_ERROR", events
        assert events[-1]["code"] == LEASE_LOST_CODE
        assert [e["type"] for e in events[-3:-1]] == ["TEXT_MESSAGE_CONTENT",
                                                       "TEXT_MESSAGE_END"]
        # Before the lease could expire: it was last renewed before the cut, and it is
        # given up with a sixth of its life left. (Measured where the client reads the end,
        # which a loaded machine delays: 3.03 s seen. Before, the run streamed on until its
        # agent ended, here never.)
        assert elapsed < ttl + 0.5, elapsed
        record = await store.get("held")
        assert record is not None
        assert record.runs[-1].events[-1]["code"] == LEASE_LOST_CODE
        # Once the coordinator is back (and the lease it kept has expired) the thread runs.
        if how == "hung":
            await proxy.down()  # what hung is cut: the clients open new connections
        await proxy.up()
        agent.gate.set()
        async for _ in poll(10):
            response = await served.post("/agent/default/run", {**_run("held"), "runId": "r2"})
            if response.status == 200:
                assert b'"RUN_FINISHED"' in await response.read()
                break
            # Busy while the kept lease lives; unavailable while the client's connections,
            # cut by the outage, are opened again.
            assert response.status in (409, 503), await response.text()


@pytest.mark.parametrize("proxy", [5432, 6379], ids=["postgresql", "redis"], indirect=True)
async def test_a_lease_ended_while_its_coordinator_is_away_is_given_back_once_it_is_back(
        proxy: Proxy, serve_runtime: ServeRuntime) -> None:
    """A run ends during a coordinator blip: its end does not wait for the release, and the
    lease is given back as soon as the coordinator is back, so the thread takes its next run
    then, not once the lease expired (10 s later, every run on it refused as busy)."""
    await proxy.up()
    store = PostgresThreadStore(SERVER, schema=proxy.schema, timeout=TIMEOUT)
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=store,
                             coordinator=proxy.coordinator())
    async with serve_runtime(runtime) as served:
        streaming = asyncio.create_task(served.run(_run("blip")))
        async for _ in poll(10):
            if "blip" in runtime.runs.active and len(runtime.runs.active["blip"].events) > 1:
                break
        await proxy.down()
        agent.gate.set()
        events = await asyncio.wait_for(streaming, 10)
        assert events[-1]["type"] == "RUN_FINISHED"
        await asyncio.sleep(0.5)
        await proxy.up()
        back = time.monotonic()
        async for _ in poll(8):
            response = await served.post("/agent/default/run", {**_run("blip"), "runId": "r2"})
            # Busy until the lease is given back; unavailable while the client's connections,
            # cut by the outage, are opened again (Redis: seen as a flaky 503 here).
            if response.status not in (409, 503):
                break
        assert response.status == 200, await response.text()
        assert time.monotonic() - back < 5
        assert b'"RUN_FINISHED"' in await response.read()


async def test_a_session_the_server_ends_is_left_before_its_connection_closes(
        proxy: Proxy) -> None:
    """A server ending a session (an administrator, a shutdown) sends its reason, then closes
    the connection: a statement sent in between would wait for an answer that never comes.
    Here the connection's close is held back: the reason alone must do."""
    proxy.linger = 30.0
    await proxy.up()
    # The store's own deadline is what a hang would run into; it is set well above the
    # time a new connection takes on a loaded 2-core machine (over 2 s seen in CI), and
    # well below the 30 s the close is held back.
    store = _store(proxy.port, proxy.schema, timeout=8.0)
    try:
        assert await store.summary("t") is None
        async with store._heads as cursor:
            await cursor.execute("SELECT pg_backend_pid()")
            row = await cursor.fetchone()
        assert row is not None
        await asyncio.to_thread(_terminate, row[0])
        started = time.monotonic()
        assert await store.summary("t") is None
        # Well under the 30 s the close is held back.
        assert time.monotonic() - started < 10.0
    finally:
        await store.aclose()


# -- a run's end while its store is away for longer than its client waits ------------------

def _text(events: list[dict[str, Any]]) -> str:
    return "".join(e.get("delta", "") for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")


async def _replayed(served: Any, thread: str) -> list[dict[str, Any]]:
    from copilot_runtime.testing import verify_events
    from tests.conftest import parse_sse

    response = await served.post("/agent/default/connect", _run(thread))
    assert response.status == 200, await response.read()
    events = parse_sse(await response.read())
    verify_events(events)  # a replay a client can read
    return events


@pytest.mark.parametrize("outage", ["hangs", "down"])
async def test_a_run_ending_during_a_long_store_outage_ends_for_its_client_and_is_stored_later(
        proxy: Proxy, serve_runtime: ServeRuntime, monkeypatch: pytest.MonkeyPatch,
        outage: str) -> None:
    """The store stops answering (`hangs`: connections open, nothing comes back) or goes
    away (`down`) while a run streams, for longer than a client waits for a run's end: the
    client gets the whole answer and the run's end after `STORE_RETRY_FOR`; the thread stays
    busy (409) until the run is written, which happens once the store is back; then the
    thread reads whole and takes its next run. Before the fix, `hangs` held the client's
    stream (and the thread) for the whole outage, and `down` gave the write up after 10 s:
    the run stayed open in the store for good, its messages missing and every replay of
    the thread invalid."""
    from copilot_runtime import _runs

    retry_for = 0.5  # how long the client waits for the run's write
    monkeypatch.setattr(_runs, "STORE_RETRY_FOR", retry_for)
    await proxy.up()
    store = _store(proxy.port, proxy.schema)
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=store)
    async with serve_runtime(runtime) as served:
        streaming = asyncio.create_task(served.run(_run("long")))
        async for _ in poll(10):
            if "long" in runtime.runs.active and runtime.runs.active["long"]._flushed > 1:
                break
        assert runtime.runs.active["long"]._flushed > 1  # part of it written as it went
        if outage == "hangs":
            proxy.hang()
        else:
            await proxy.down()
        started = time.monotonic()
        agent.gate.set()
        events = await asyncio.wait_for(streaming, 10)
        assert time.monotonic() - started < retry_for + 2.0
        assert events[-1]["type"] == "RUN_FINISHED"
        assert _text(events) == "one two"
        await asyncio.sleep(1.5 * retry_for)  # longer than the client waited
        busy = await served.post("/agent/default/run", _run("long"))
        assert busy.status == 409, await busy.read()
        await proxy.down()
        await proxy.up()
        async for _ in poll(20):
            if "long" not in runtime.runs.active:
                break
        assert "long" not in runtime.runs.active, "the thread is still busy"
        assert await store.open_runs() == []
        record = await store.get("long")
        assert record is not None
        (run,) = record.runs
        assert _text(run.events) == "one two"
        replay = await _replayed(served, "long")
        assert _text(replay) == "one two"
        assert replay[-1]["type"] == "RUN_FINISHED"
        agent.gate.set()
        again = await served.run({**_run("long"), "runId": "r2"})
        assert again[-1]["type"] == "RUN_FINISHED"


async def test_runs_left_open_are_closed_once_a_store_away_at_start_up_is_back(
        proxy: Proxy, serve_runtime: ServeRuntime) -> None:
    """A runtime alone (no shared coordinator) closes the runs a crashed process left open
    when it starts; if its store was away then (a host restarting, the application up
    before the database), its first run or replay closes them. Before the fix nothing did
    until the next restart: the thread's replays were invalid (a run without its end,
    then the next run's start) and its messages missing."""
    from copilot_runtime import events as ev

    await proxy.up()
    crashed = _store(proxy.port, proxy.schema)
    started = ev.run_started("left", "r0", {"threadId": "left", "runId": "r0", "messages": [
        {"id": "u0", "role": "user", "content": "before the crash"}]})
    for thread in ("left", "other"):
        await crashed.append_events(thread, "default", "r0", time.time(), 0, [
            {**started, "threadId": thread}, ev.text_message_start("m0"),
            ev.text_message_content("m0", "half an ans")])
    await crashed.aclose()
    await proxy.down()
    store = _store(proxy.port, proxy.schema)
    agent = GatedAgent()
    agent.gate.set()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=store)
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/default/run", _run("left"))
        assert response.status == 503, await response.read()
        await proxy.up()
        replay = await _replayed(served, "other")  # a replay closes them too
        assert [e["type"] for e in replay][-1] == "RUN_ERROR"
        assert replay[-1]["code"] == "RUN_INTERRUPTED"
        assert await store.open_runs() == []
        events = await served.run(_run("left"))
        assert events[-1]["type"] == "RUN_FINISHED"
        replay = await _replayed(served, "left")
        assert [e["type"] for e in replay if e["type"].startswith("RUN_")] == [
            "RUN_STARTED", "RUN_ERROR", "RUN_STARTED", "RUN_FINISHED"]
        messages = await served.session.get(served.url + "/threads/left/messages")
        contents = [m.get("content") for m in (await messages.json())["messages"]]
        assert contents[:2] == ["before the crash", "half an ans"]


@pytest.mark.parametrize("code", [LEASE_LOST_CODE, "RUN_INTERRUPTED", "SERVICE_UNAVAILABLE"])
def test_runs_cut_by_an_outage_read_as_network_errors_over_graphql(code: str) -> None:
    """A run cut by a lost lease or a worker's end is as passing as a store away: the 1.10
    client's network error (503), not UNKNOWN (500, critical) as before."""
    from copilot_runtime.protocols.graphql.errors import failed_status

    error = failed_status("The run was interrupted", code)["details"]["originalError"]
    assert (error["code"], error["statusCode"], error["originalErrorType"]) == (
        "NETWORK_ERROR", 503, code)


async def test_a_lease_released_while_redis_hangs_gives_up_at_the_timeout() -> None:
    """Releasing a lease was the one Redis call without the coordinator's bound: with the
    server hung it held its caller (a run refused after taking its lease, a caller that
    left) for as long as the server did."""
    proxy = Proxy(6379)
    await proxy.up()
    held = proxy.coordinator()
    try:
        lease = await held.acquire("t-hung", "r")
        assert lease is not None
        proxy.hang()
        started = time.monotonic()
        with pytest.raises(ServiceUnavailableError):
            await held.release(lease)
        assert time.monotonic() - started < TIMEOUT + 1.5
    finally:
        await proxy.down()
        await held.aclose()



class _Unanswered:
    """A Redis client whose commands are sent and never answered."""

    async def execute_command(self, *args: Any) -> Any:
        await asyncio.Event().wait()

    def pipeline(self, transaction: bool = False) -> Any:
        raise AssertionError("one command at a time here")


@pytest.mark.parametrize("call", ["publish", "acquire", "finish"])
async def test_a_batch_of_redis_calls_is_bounded_by_itself(call: str) -> None:
    """Calls made while one is in flight go together in a task of their own (`Batcher`),
    where no caller's deadline applies, and the Redis coordinator bounded only its callers:
    a batch sent on a connection that stopped answering held that task, and every later call
    of its kind queued behind it (each answered 503), for as long as the connection lived.
    The PostgreSQL coordinator bounds each statement itself; now Redis each batch."""
    from copilot_runtime.coordination.base import Lease, Signal

    made = coordinator("redis://127.0.0.1:6379/0?prefix=unanswered:")
    made.timeout = 0.5  # type: ignore[attr-defined]
    made._redis = _Unanswered()  # type: ignore[attr-defined]
    batch = {"publish": lambda: made._publish_many([Signal("stop", "t", "r")]),  # type: ignore[attr-defined]
             "acquire": lambda: made._acquire_many([("t", "r", "token")]),  # type: ignore[attr-defined]
             "finish": lambda: made._finish_many([Lease("t", "r", "token")])}[call]  # type: ignore[attr-defined]
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(batch(), 5)
    assert time.monotonic() - started < 2


async def test_ready_answers_within_its_bound_when_postgresql_hangs(
        proxy: Proxy, llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """The PostgreSQL store and coordinator stop answering, their own calls bounded far
    later than the probe: `/ready` answers 503 at `ready_timeout`. Bounded by
    `asyncio.timeout`, psycopg took the first cancellation as a request to cancel the query
    at the server, and waited for it until the call's own bound (10 s by default)."""
    await proxy.up()
    store = PostgresThreadStore(f"postgresql://postgres@127.0.0.1:{proxy.port}/test",
                                schema=proxy.schema, timeout=6.0)
    made = proxy.coordinator()
    made.timeout = 6.0  # type: ignore[attr-defined]
    runtime = openai_runtime(llm, thread_store=store, coordinator=made)
    runtime.ready_timeout = 0.5
    async with serve_runtime(runtime) as served:
        assert await runtime.unready() == []
        proxy.hang()
        started = time.monotonic()
        response = await served.session.get(served.url + "/ready")
        took = time.monotonic() - started
        assert response.status == 503
        assert (await response.json())["unavailable"] == ["thread_store", "coordinator"]
        assert took < 1.5, took
        await proxy.down()


@pytest.mark.parametrize("proxy", [5432, 6379], ids=["postgresql", "redis"], indirect=True)
async def test_a_runs_end_does_not_wait_for_a_coordinator_that_stops_answering(
        proxy: Proxy) -> None:
    """The coordinator stops answering as a run ends (its store still answers): the client
    gets the run's end once it is stored, and the lease is given back in the background,
    once the coordinator is back. Before, the end waited for the lease's release (up to the
    coordinator's timeout, 10 s by default), and PostgreSQL then logged "run not stored
    yet" for a run the store had written."""
    from copilot_runtime._input import parse_run_input
    from tests.scale_support.cluster import eventually

    await proxy.up()
    store = PostgresThreadStore(SERVER, schema=proxy.schema, timeout=TIMEOUT)
    made = proxy.coordinator()
    made.timeout = 4.0  # type: ignore[attr-defined]
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=store, coordinator=made)
    await runtime.start()
    try:
        run = await runtime.start_run("default", parse_run_input(_run("t-end")))
        sent: list[dict[str, Any]] = []

        async def write(batch: Any) -> None:
            sent.extend(batch)

        driving = asyncio.create_task(run.drive(write))
        await eventually(lambda: any(e.get("delta") == "one " for e in sent), deadline=5,
                         what="the run streaming")
        proxy.hang()
        started = time.monotonic()
        agent.gate.set()
        async with asyncio.timeout(10):
            await driving
        took = time.monotonic() - started
        assert sent[-1]["type"] == "RUN_FINISHED"
        assert took < 1.5, took
        assert await store.get("t-end") is not None
        await proxy.down()
        await proxy.up()

        async def given_back() -> bool:
            with contextlib.suppress(ServiceUnavailableError):
                return await made.holder("t-end") is None  # type: ignore[attr-defined]
            return False

        await eventually(given_back, deadline=10, what="the lease given back")
    finally:
        await runtime.aclose()


async def test_the_next_run_waits_for_a_slow_give_back_instead_of_being_busy() -> None:
    """A coordinator slow to take a lease back (a loaded server, a network blip): the run's
    client hears its end after at most `GIVE_BACK_WAIT`, and its next run (CopilotKit sends
    a tool's result at once) waits for this worker's give-back instead of a 409."""
    from copilot_runtime import thread_store
    from copilot_runtime._input import parse_run_input
    from tests.scale_support.services import postgres_schema

    with postgres_schema("giveback") as url:
        made = coordinator(url)
        finish = made.finish  # type: ignore[attr-defined]

        async def slow_finish(lease: Any) -> None:
            await asyncio.sleep(0.8)
            await finish(lease)

        made.finish = slow_finish  # type: ignore[attr-defined]
        agent = GatedAgent()
        agent.gate.set()
        runtime = CopilotRuntime(agents={"default": agent}, thread_store=thread_store(url),
                                 coordinator=made)
        await runtime.start()
        try:
            sent: list[dict[str, Any]] = []

            async def write(batch: Any) -> None:
                sent.extend(batch)

            first = await runtime.start_run("default", parse_run_input(_run("t-next")))
            await first.drive(write)
            assert sent[-1]["type"] == "RUN_FINISHED"
            second = _run("t-next") | {"runId": "r2", "messages": [
                {"id": "u1", "role": "user", "content": "hi"},
                {"id": "u2", "role": "user", "content": "again"}]}
            again = await runtime.start_run("default", parse_run_input(second))
            await again.drive(write)
            assert sent[-1]["type"] == "RUN_FINISHED"
        finally:
            await runtime.aclose()
