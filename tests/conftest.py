"""Shared fixtures: the loopback mock LLM, and runtimes served by a real uvicorn server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Self

import aiohttp
import httpx2
import orjson
import pytest
import uvicorn
from hypothesis import settings

from copilot_runtime import CopilotRuntime, OpenAIAdapter, RunInput, create_app
from copilot_runtime import events as ev
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.events import EventBatches
from copilot_runtime.testing import MockOpenAIServer
from tests import background
from tests.realclient_app import getWeather

# Property tests draw the same examples on every run, so a suite that passed once passes
# again (CI lands on it); HYPOTHESIS_PROFILE=explore draws new ones on each run.
settings.register_profile("suite", derandomize=True, database=None)
settings.register_profile("explore", database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


@contextlib.contextmanager
def _no_signals_captured(self: uvicorn.Server) -> Iterator[None]:
    yield


# The servers a test starts in this process take no signals: each set uvicorn's SIGINT and
# SIGTERM handlers and put back the ones it found when it ended, so servers that overlap and
# end out of order left one behind. A process forked later inherited it and ignored SIGTERM
# (a supervisor's test then waited for ever on a worker it had stopped).
uvicorn.Server.capture_signals = _no_signals_captured  # type: ignore[method-assign]


@pytest.fixture
async def llm() -> AsyncIterator[MockOpenAIServer]:
    async with MockOpenAIServer(chunks=5) as server:
        yield server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Served:
    url: str
    runtime: CopilotRuntime
    session: aiohttp.ClientSession

    async def post(self, path: str, body: Any = None, *, raw: bytes | None = None,
                   headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        data = raw if raw is not None else orjson.dumps(body)
        return await self.session.post(
            self.url + path, data=data,
            headers={"Content-Type": "application/json", **(headers or {})})

    async def generate(self, data: dict[str, Any], properties: dict[str, Any] | None = None
                       ) -> dict[str, Any]:
        """`generateCopilotResponse` as the 1.10 client sends it: its result, its parts merged
        (an answer with GraphQL errors fails the test)."""
        from tests.gql.wire import CLIENT_DOCUMENT, CLIENT_HEADERS, merge, parse_multipart

        variables: dict[str, Any] = {"data": data}
        if properties is not None:
            variables["properties"] = properties
        response = await self.session.post(self.url, data=orjson.dumps(
            {"query": CLIENT_DOCUMENT, "variables": variables}), headers=CLIENT_HEADERS)
        assert response.status == 200, await response.text()
        merged = merge(parse_multipart(await response.read()))
        assert "errors" not in merged
        result: dict[str, Any] = merged["data"]["generateCopilotResponse"]
        return result

    async def run(self, body: dict[str, Any], agent: str = "default",
                  path: str | None = None) -> list[dict[str, Any]]:
        response = await self.post(f"/agent/{agent}/run" if path is None else path, body)
        assert response.status == 200, await response.text()
        assert response.headers["content-type"] == "text/event-stream"
        return parse_sse(await response.read())


def parse_sse(data: bytes) -> list[dict[str, Any]]:
    return [event for _, event in parse_sse_ids(data)]


def parse_sse_ids(data: bytes) -> list[tuple[int | None, dict[str, Any]]]:
    """The events of an SSE body, each with its `id:` as an int (None without one)."""
    events: list[tuple[int | None, dict[str, Any]]] = []
    for frame in data.split(b"\n\n"):
        event_id: int | None = None
        if frame.startswith(b"id: "):
            line, _, frame = frame.partition(b"\n")
            event_id = int(line[4:])
            assert frame.startswith(b"data: "), f"an id without data {line!r}"
        if frame.startswith(b"data: "):
            events.append((event_id, orjson.loads(frame[6:])))
        elif frame.startswith(b":"):
            continue  # an SSE comment (keep-alive)
        else:
            assert not frame.strip(), f"unexpected SSE frame {frame!r}"
    return events


@contextlib.asynccontextmanager
async def uvicorn_serving(app: Any, **options: Any
                          ) -> AsyncIterator[tuple[uvicorn.Server, int]]:
    """`app` served by uvicorn in this loop (`options`: its `Config`'s), and its port."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on",
                            **{"log_level": "warning", **options})
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
        if task.done():
            task.result()
    try:
        yield server, port
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    async with uvicorn_serving(app) as (_, port):
        yield f"http://127.0.0.1:{port}"


ServeRuntime = Callable[..., contextlib.AbstractAsyncContextManager[Served]]


@pytest.fixture
def serve_runtime() -> ServeRuntime:
    @contextlib.asynccontextmanager
    async def make(runtime: CopilotRuntime, path: str = "/api/copilotkit",
                   **options: Any) -> AsyncIterator[Served]:
        async with serve(create_app(runtime, path, **options)) as url, \
                aiohttp.ClientSession() as session:
            yield Served(url + path, runtime, session)

    return make


def openai_runtime(llm: MockOpenAIServer, **options: Any) -> CopilotRuntime:
    options.setdefault("actions", [getWeather])
    return CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0),
        **options)


@pytest.fixture
async def served(llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> AsyncIterator[Served]:
    async with serve_runtime(openai_runtime(llm)) as s:
        yield s


def run_input(text: str, thread: str = "thread-1", run: str = "run-1",
              **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "threadId": thread, "runId": run, "tools": [], "context": [], "forwardedProps": {},
        "state": {}, "messages": [{"id": f"{run}-u", "role": "user", "content": text}],
    }
    body.update(extra)
    return body


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")


class RawServer:
    """A loopback TCP server for faults no HTTP server makes: `serve` handles each
    connection, byte by byte as the test wants."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> Self:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        # Python 3.11 leaves the connections open: one a script still held (a hang, a
        # client that never read to its end) was collected in a later test, whose
        # ResourceWarning then failed it.
        for writer in tuple(self._open):
            writer.transport.abort()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            await self.serve(reader, writer)
        finally:
            self._open.discard(writer)
            writer.close()  # (what it wrote is still sent)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class GatedAgent(Agent):
    """Says "one ", waits for `gate`, then says "two" and ends."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input.run_id)

    async def _run(self, run_id: str) -> Any:
        message = f"m-{run_id}"
        yield [ev.text_message_start(message), ev.text_message_content(message, "one ")]
        await self.gate.wait()
        yield [ev.text_message_content(message, "two"), ev.text_message_end(message)]


async def poll(within: float = 30.0, every: float = 0.05) -> AsyncIterator[int]:
    """Yield every `every` seconds until `within` seconds have passed: a polling loop whose
    budget holds on a loaded machine; the assertion after the loop says what never came."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    attempt = 0
    while True:
        yield attempt
        attempt += 1
        if loop.time() >= deadline:
            return
        await asyncio.sleep(every)


# -- the session's end: the system catalogs its schemas bloated, vacuumed ---------------------

#: Catalogs with fewer dead rows are left alone.
VACUUM_FROM = 1000
#: The most seconds the vacuum takes, every catalog together; a catalog another session
#: holds a lock on is skipped after `lock_timeout`.
VACUUM_BUDGET = 60.0


@dataclass
class Vacuumed:
    catalogs: list[str]
    dead_rows: int
    seconds: float
    #: Why nothing was vacuumed (a server away, no psycopg), or None.
    skipped: str | None = None


def vacuum_catalogs(server: str, *, least_dead: int = VACUUM_FROM,
                    budget: float = VACUUM_BUDGET) -> Vacuumed:
    """VACUUM the catalogs (pg_attribute, pg_depend, pg_class, pg_type...) of `server`'s
    database holding `least_dead` dead rows or more, within `budget` seconds; never raises.

    The tests make and drop thousands of schemas, and a server without autovacuum (this
    machine's) keeps every dead row they leave in its catalogs: each later run's DDL and
    catalog lookups then wade through hundreds of thousands. A plain VACUUM (never FULL: it
    would lock the catalogs against every other session) frees them for reuse."""
    started = time.monotonic()
    try:
        import psycopg
        from psycopg import sql
    except ImportError:
        return Vacuumed([], 0, 0.0, "no psycopg")
    done: list[str] = []
    dead = 0
    try:
        with psycopg.connect(server, autocommit=True, connect_timeout=3) as conn:
            conn.execute("SET lock_timeout = '2s'")
            bloated = conn.execute(
                "SELECT relname, n_dead_tup FROM pg_stat_sys_tables WHERE schemaname = "
                "'pg_catalog' AND n_dead_tup >= %s ORDER BY n_dead_tup DESC",
                (least_dead,)).fetchall()
            for name, count in bloated:
                left = budget - (time.monotonic() - started)
                if left <= 0.1:
                    break
                conn.execute("SELECT set_config('statement_timeout', %s, false)",
                             (f"{int(left * 1000)}ms",))
                try:
                    conn.execute(sql.SQL("VACUUM pg_catalog.{}").format(sql.Identifier(name)))
                except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled):
                    continue  # another session's vacuum holds it, or the budget ran out
                done.append(name)
                dead += count
    except (psycopg.Error, OSError) as exc:
        return Vacuumed(done, dead, time.monotonic() - started, type(exc).__name__)
    return Vacuumed(done, dead, time.monotonic() - started)


_VACUUMED = pytest.StashKey[Vacuumed]()


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput") \
            and getattr(config.option, "testrunuid", "") is None:
        # pytest-xdist's controlling process: the run's id, known here so that what its
        # workers share (tests/background.py) is removed at the end.
        config.option.testrunuid = uuid.uuid4().hex


def pytest_collection_finish(session: pytest.Session) -> None:
    # The long commands some tests wait on start now, in the background (tests/background.py).
    background.start(item.nodeid.split("::", 1)[0] for item in session.items)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    background.stop()
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controlling process vacuums once, at the end
    if getattr(session.config.option, "testrunuid", None):
        background.forget_run(session.config.option.testrunuid)
    try:
        from tests.hitl_support.postgres import SERVER
    except ImportError:
        return
    session.config.stash[_VACUUMED] = vacuum_catalogs(SERVER)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    vacuumed = config.stash.get(_VACUUMED, None)
    if vacuumed is not None and vacuumed.catalogs:
        terminalreporter.write_line(
            f"vacuumed PostgreSQL's {', '.join(vacuumed.catalogs)} ({vacuumed.dead_rows} "
            f"dead rows) in {vacuumed.seconds:.2f} s")


@pytest.fixture
def stopped() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Server processes a test starts, killed at its end whatever happened."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)


def wait_for_server(url: str, process: subprocess.Popen[bytes]) -> None:
    """Until `url` answers (the server `process` started), within 30 s."""
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx2.get(url, timeout=1)
            return
        except httpx2.TransportError:
            assert process.poll() is None, process.communicate(timeout=10)
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
