"""A coordinator whose server is there but cannot serve now: a Redis replica answering
READONLY after a failover (or OOM, BUSY, MASTERDOWN, NOREPLICAS...), a PostgreSQL standby
answering "cannot execute ... in a read-only transaction". Before, only a server that could
not be reached was a 503: these were a bare 500 for a run, a connect or a stop. Now each is
a 503 with Retry-After saying the coordinator cannot serve now, the renewal of leases and
the signal listener take it as an outage (tried again, told once), and all works again once
the server serves."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import psycopg
import pytest
from redis.exceptions import (
    ClusterDownError,
    MasterDownError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from structlog.testing import capture_logs

from copilot_runtime import CopilotRuntime, RateLimit, ServiceUnavailableError, coordinator
from copilot_runtime._redis_client import cannot_serve_now
from copilot_runtime.coordination import LEASE_LOST_CODE, Coordinator, Signal
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.threads import PostgresThreadStore
from tests.conftest import GatedAgent, ServeRuntime, openai_runtime, poll
from tests.hitl_support.postgres import SERVER, standby

pytestmark = pytest.mark.timeout(60)

#: The coordinators' timeout in these tests (seconds).
TIMEOUT = 2.0
REDIS_PORT = 6379

#: What a replica, or a primary that cannot write, refuses (a real one answers reads, PING,
#: PUBLISH and SUBSCRIBE): every script the coordinator sends writes.
WRITES = ("EVAL", "EVALSHA", "SET", "DEL", "PEXPIRE", "ZADD", "ZREM")

#: (the error, the commands refused, None: all), as a real Redis 7 answers them.
NOT_NOW = {
    "readonly": (b"READONLY You can't write against a read only replica.", WRITES),
    "oom": (b"OOM command not allowed when used memory > 'maxmemory'.", WRITES),
    "noreplicas": (b"NOREPLICAS Not enough good replicas to write.", WRITES),
    "misconf": (b"MISCONF Redis is configured to save RDB snapshots, but it's currently "
                b"unable to persist to disk.", WRITES),
    "masterdown": (b"MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set "
                   b"to 'no'.", None),
    "busy": (b"BUSY Redis is busy running a script. You can only call SCRIPT KILL or "
             b"SHUTDOWN NOSAVE.", None),
}


async def _command(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """A client's next command: its name (upper case) and its bytes; None once it left."""
    line = await reader.readline()
    if not line:
        return None
    raw, name = [line], b""
    for index in range(int(line[1:-2])):
        size = await reader.readline()
        data = await reader.readexactly(int(size[1:-2]) + 2)
        raw += [size, data]
        if index == 0:
            name = data[:-2].upper()
    return name, b"".join(raw)


async def _reply(reader: asyncio.StreamReader) -> bytes:
    """The server's next reply (RESP2 or 3: redis-py asks for 3 where it can), whole."""
    line = await reader.readuntil(b"\r\n")
    kind = line[:1]
    if kind in (b"$", b"!", b"=") and int(line[1:-2]) >= 0:  # strings: their bytes follow
        return line + await reader.readexactly(int(line[1:-2]) + 2)
    if kind in (b"*", b"~", b">", b"%", b"|"):  # aggregates: their replies follow
        count = int(line[1:-2]) * (2 if kind in (b"%", b"|") else 1)
        parts = [line] + [await _reply(reader) for _ in range(max(count, 0))]
        if kind == b"|":  # attributes precede the reply they describe
            parts.append(await _reply(reader))
        return b"".join(parts)
    return line


class RedisFront:
    """This machine's Redis behind a loopback server that can answer commands as a server
    that cannot serve now does, with an error instead of passing them on. A connection that
    subscribed passes everything from then on (a replica keeps serving its pub/sub)."""

    def __init__(self) -> None:
        self.prefix = f"not-now-{uuid.uuid4().hex[:10]}:"
        self.error: bytes | None = None
        self.refused: frozenset[bytes] | None = None
        #: How many commands were answered with `error`.
        self.answered = 0
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()
        #: Both ends of each connection open: closed, they end its link (a link cancelled
        #: instead upsets asyncio's own callback on Python 3.11).
        self._writers: set[asyncio.StreamWriter] = set()
        self.url = ""

    def refuse(self, error: bytes, commands: Iterable[str] | None = None) -> None:
        """Answer `commands` (None: every command) with `error` from now on."""
        self.error = error
        self.refused = None if commands is None else frozenset(c.encode() for c in commands)

    def serve(self) -> None:
        self.error = None

    def coordinator(self, options: str = "") -> Coordinator:
        made = coordinator(f"{self.url}?prefix={self.prefix}{options}")
        made.timeout = TIMEOUT  # type: ignore[attr-defined]
        return made

    async def cut(self) -> None:
        """Close every connection open (its clients open new ones)."""
        for writer in list(self._writers):
            writer.close()
        await asyncio.gather(*self._links, return_exceptions=True)

    async def __aenter__(self) -> RedisFront:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self.cut()
        await self._server.wait_closed()
        import redis.asyncio as aioredis

        async with aioredis.Redis(port=REDIS_PORT) as redis:
            keys = [k async for k in redis.scan_iter(match=self.prefix + "*")]
            if keys:
                await redis.delete(*keys)

    def _refuses(self, name: bytes) -> bool:
        return self.error is not None and (self.refused is None or name in self.refused)

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", REDIS_PORT)
        self._writers |= {writer, up_writer}
        try:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while (command := await _command(reader)) is not None:
                    name, raw = command
                    if self._refuses(name):
                        assert self.error is not None
                        self.answered += 1
                        writer.write(b"-" + self.error + b"\r\n")
                        await writer.drain()
                        continue
                    up_writer.write(raw)
                    await up_writer.drain()
                    if name.endswith(b"SUBSCRIBE"):
                        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
                        return
                    writer.write(await _reply(up_reader))
                    await writer.drain()
        finally:
            writer.close()
            up_writer.close()
            self._writers -= {writer, up_writer}
            self._links.discard(task)


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    sink.close()


@pytest.fixture
async def front() -> AsyncIterator[RedisFront]:
    async with RedisFront() as made:
        yield made


def _run(thread: str, run: str = "r") -> dict[str, Any]:
    return {"threadId": thread, "runId": run, "messages": [
        {"id": "u1", "role": "user", "content": "hi"}], "tools": [], "context": [],
        "state": {}, "forwardedProps": {}}


async def _assert_not_now(response: Any) -> None:
    assert response.status == 503, await response.text()
    assert response.headers["retry-after"] == "1"
    assert await response.json() == {"error": "Service unavailable",
                                      "message": "The coordinator cannot serve now",
                                      "code": "SERVICE_UNAVAILABLE"}


@pytest.fixture
async def schema() -> AsyncIterator[str]:
    name = f"not_now_{uuid.uuid4().hex[:10]}"
    try:
        yield name
    finally:
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


# -- Redis ---------------------------------------------------------------------------------


@pytest.mark.parametrize("state", list(NOT_NOW))
async def test_runs_connects_and_stops_get_a_503_while_redis_cannot_serve(
        front: RedisFront, schema: str, llm: MockOpenAIServer, serve_runtime: ServeRuntime,
        state: str) -> None:
    error, commands = NOT_NOW[state]
    store = PostgresThreadStore(SERVER, schema=schema, timeout=TIMEOUT)
    runtime = openai_runtime(llm, thread_store=store, coordinator=front.coordinator())
    async with serve_runtime(runtime) as served:
        assert (await served.run(_run("before")))[-1]["type"] == "RUN_FINISHED"
        front.refuse(error, commands)
        await _assert_not_now(await served.post("/agent/default/run", _run("during")))
        assert "during" not in runtime.runs.active
        await _assert_not_now(await served.post("/agent/default/connect", _run("before")))
        if commands is None:  # a replica reads (and publishes): a stop needs nothing more
            await _assert_not_now(await served.post("/agent/default/stop/before", {}))
        assert front.answered >= 2
        front.serve()
        assert (await served.run(_run("after")))[-1]["type"] == "RUN_FINISHED"
        assert {t.thread_id for t in await store.list()} == {"before", "after"}


async def test_rate_limits_counted_by_a_redis_coordinator_that_cannot_serve_get_a_503(
        front: RedisFront, schema: str, llm: MockOpenAIServer,
        serve_runtime: ServeRuntime) -> None:
    """The counters a coordinator lends speak of it, whichever refuses first."""
    store = PostgresThreadStore(SERVER, schema=schema, timeout=TIMEOUT)
    runtime = openai_runtime(llm, thread_store=store, coordinator=front.coordinator(),
                             rate_limit=RateLimit(concurrent_runs=5, runs_per_minute=100))
    async with serve_runtime(runtime) as served:
        assert (await served.run(_run("before")))[-1]["type"] == "RUN_FINISHED"
        front.refuse(*NOT_NOW["readonly"])
        await _assert_not_now(await served.post("/agent/default/run", _run("during")))
        front.serve()
        assert (await served.run(_run("after")))[-1]["type"] == "RUN_FINISHED"


async def test_a_run_whose_lease_redis_cannot_renew_stops_and_the_outage_is_told_once(
        front: RedisFront, schema: str, serve_runtime: ServeRuntime) -> None:
    """A failover leaves the coordinator on a replica while a run streams: its lease cannot
    be renewed, so the run ends (LEASE_LOST) before the lease could expire, as it does when
    Redis is away; the failed renewals are one warning, not one a try."""
    ttl = 1.5
    store = PostgresThreadStore(SERVER, schema=schema, timeout=TIMEOUT)
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=store,
                             coordinator=front.coordinator(f"&lease_ttl={ttl}"))
    async with serve_runtime(runtime) as served:
        streaming = asyncio.create_task(served.run(_run("held")))
        async for _ in poll(10):
            if "held" in runtime.runs.active and len(runtime.runs.active["held"].events) > 1:
                break
        with capture_logs() as logs:
            front.refuse(*NOT_NOW["readonly"])
            events = await asyncio.wait_for(streaming, 10)
            assert events[-1]["type"] == "RUN_ERROR", events
            assert events[-1]["code"] == LEASE_LOST_CODE
            # Another try or two, each failing, then the lease is let go.
            await asyncio.sleep(2 * ttl / 3 + 0.2)
            front.serve()
            agent.gate.set()
            async for _ in poll(10):
                response = await served.post("/agent/default/run", _run("held", "r2"))
                if response.status == 200:
                    assert b'"RUN_FINISHED"' in await response.read()
                    break
                assert response.status == 409, await response.text()
        renewals = [x for x in logs if x["event"].startswith("could not renew leases")]
        assert len(renewals) == 1, logs
        assert renewals[0]["unavailable"] == "The coordinator cannot serve now"
        # The lease given back at the run's end waits for the server (it was a traceback).
        assert not any(x.get("exc_info") for x in logs), logs


async def test_the_signal_listener_takes_a_redis_that_cannot_serve_as_an_outage(
        front: RedisFront) -> None:
    """The signal connection is lost while Redis answers every command BUSY: it is opened
    again every second, told once (not once a second), and signals flow once it serves."""
    coordinator_ = front.coordinator()
    try:
        await coordinator_.start()
        with capture_logs() as logs:
            front.refuse(*NOT_NOW["busy"])
            await front.cut()
            await asyncio.sleep(3.5)  # three tries or more, each refused
            front.serve()
            with coordinator_.subscribe("t") as signals:
                async for _ in poll(10):
                    with contextlib.suppress(ServiceUnavailableError):
                        await coordinator_.publish(Signal("stop", "t", "r"))
                    if await signals.get(0.2) is not None:
                        break
        lost = [x for x in logs if x["event"].startswith("coordinator lost its signal")]
        assert len(lost) == 1, logs
        assert any(x["event"] == "coordinator's signal connection is back" for x in logs), logs
        assert front.answered >= 3
    finally:
        await coordinator_.aclose()


@pytest.mark.parametrize("error", [
    ReadOnlyError("You can't write against a read only replica."),
    MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
    TryAgainError("Multiple keys request during rehashing of slot"),
    ClusterDownError("The cluster is down"),
    ResponseError("BUSY Redis is busy running a script."),
    ResponseError("Command # 2 (EVAL if x then ... end 3 t ...) of pipeline caused error: "
                  "('NOREPLICAS Not enough good replicas to write.',)"),
    ResponseError("Command # 1 (GET k) of pipeline caused error: (\"MISCONF can't save\",)"),
    ResponseError("Error running script (call to f_0a): @user_script:2: @user_script: 2: "
                  "-READONLY You can't write against a read only replica."),
])
def test_what_says_redis_cannot_serve_now(error: Exception) -> None:
    assert cannot_serve_now(error)


@pytest.mark.parametrize("error", [
    ResponseError("Error running script: attempt to compare nil with number"),
    ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    # A client's thread id inside the command a pipeline echoes is not the server's answer.
    ResponseError("Command # 1 (GET x of pipeline caused error: ('BUSY y) of pipeline caused "
                  "error: ('WRONGTYPE Operation against a key',)"),
    ValueError("BUSY looking elsewhere"),
])
def test_what_does_not_say_redis_cannot_serve_now(error: Exception) -> None:
    assert not cannot_serve_now(error)


# -- PostgreSQL ----------------------------------------------------------------------------


def _read_only(schema: str, on: bool) -> None:
    """The run_leases table answers writes as a standby does (or stops to)."""
    standby(schema, "run_leases", on)


async def test_runs_and_connects_get_a_503_while_postgresql_is_read_only(
        schema: str, llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    store = PostgresThreadStore(SERVER, schema=schema, timeout=TIMEOUT)
    made = coordinator(f"{SERVER}?schema={schema}")
    made.timeout = TIMEOUT  # type: ignore[attr-defined]
    runtime = openai_runtime(llm, thread_store=store, coordinator=made)
    async with serve_runtime(runtime) as served:
        assert (await served.run(_run("before")))[-1]["type"] == "RUN_FINISHED"
        await asyncio.to_thread(_read_only, schema, True)
        await _assert_not_now(await served.post("/agent/default/run", _run("during")))
        assert "during" not in runtime.runs.active
        await _assert_not_now(await served.post("/agent/default/connect", _run("before")))
        await asyncio.to_thread(_read_only, schema, False)
        assert (await served.run(_run("after")))[-1]["type"] == "RUN_FINISHED"


async def test_a_postgresql_coordinator_that_starts_on_a_standby_cannot_serve_now(
        schema: str) -> None:
    """Started on a server where every transaction only reads (as on a standby), the
    coordinator cannot make its tables: each call says it cannot serve now (a 503), not
    a bare error, and it starts once it can."""
    read_only = coordinator(f"{SERVER}?schema={schema}"
                            "&options=-cdefault_transaction_read_only%3Don")
    read_only.timeout = TIMEOUT  # type: ignore[attr-defined]
    try:
        for _ in range(2):  # the start is tried again by the next call
            with pytest.raises(ServiceUnavailableError) as raised:
                await read_only.acquire("t", "r")
            assert (str(raised.value), raised.value.status) == (
                "The coordinator cannot serve now", 503)
            assert isinstance(raised.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)
    finally:
        await read_only.aclose()
    writable = coordinator(f"{SERVER}?schema={schema}")
    try:
        assert await writable.acquire("t", "r") is not None
    finally:
        await writable.aclose()
