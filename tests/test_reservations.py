"""A thread reserved for a run that is never driven is given back (issue 14: the server
keeps serving). Between `RunManager.begin` and `ActiveRun.drive` a request can fail or be
cancelled: the response's first send raises or hangs until the task is cancelled, the
GraphQL edge fails while building its encoder, telemetry fails as the run starts. After
each, the thread takes a new run at once, the caller's concurrency slot is free again and,
with a shared coordinator, the lease is released and the run's start, already written, is
closed in the store."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from copilot_runtime import (
    BearerTokenAuth,
    CopilotRuntime,
    RateLimit,
    create_app,
    thread_store,
)
from copilot_runtime.protocols.graphql import handlers as graphql_handlers
from copilot_runtime.testing import ScriptedAdapter, text_turn
from copilot_runtime.threads import INTERRUPTED_CODE
from tests.conftest import ServeRuntime, parse_sse, poll, run_input, types
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, OTHER_CLIENT_HEADERS, user_turn
from tests.scale_support.services import postgres_schema, redis_prefix

pytestmark = pytest.mark.timeout(60)

PATH = "/api/copilotkit"
THREAD = "t-res"
TOKEN = "tok-alice-0001"

OnStart = Callable[[], Awaitable[None]]


def scripted(**options: Any) -> CopilotRuntime:
    return CopilotRuntime(service_adapter=ScriptedAdapter(*[text_turn("hello")] * 20),
                          **options)


async def request(app: Any, path: str, body: Any, headers: dict[str, str] | None = None,
                  on_start: OnStart | None = None) -> tuple[int | None, bytes]:
    """POST `body` to the ASGI `app` in this process; `on_start` runs when the response
    starts (to make that send fail or hang). The client stays until the answer ends."""
    sent: list[dict[str, Any]] = []
    delivered = False
    stay = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        await stay.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and on_start is not None:
            hook = on_start
            await hook()
        sent.append(message)

    raw = {"content-type": "application/json", **(headers or {})}
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
             "query_string": b"", "client": ("127.0.0.1", 5000),
             "headers": [(k.lower().encode(), v.encode()) for k, v in raw.items()]}
    await app(scope, receive, send)
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
    return status, b"".join(m.get("body", b"") for m in sent
                            if m["type"] == "http.response.body")


def agui(thread: str = THREAD, run: str = "r1") -> tuple[str, dict[str, Any]]:
    return f"{PATH}/agent/default/run", run_input("Hi", thread=thread, run=run)


def graphql(thread: str = THREAD) -> tuple[str, dict[str, Any]]:
    return PATH, {"query": CHAT_DOCUMENT,
                  "variables": {"data": user_turn("Hi", thread=thread)}}


async def fails() -> None:
    raise OSError("the connection is gone")


async def assert_runs_again(app: Any, runtime: CopilotRuntime, thread: str = THREAD,
                            headers: dict[str, str] | None = None) -> None:
    """The thread is free in this process now, and a new run on it streams to its end."""
    assert thread not in runtime.runs.active
    path, body = agui(thread, "r-again")
    status, data = await request(app, path, body, headers)
    assert status == 200, data
    assert types(parse_sse(data))[-1] == "RUN_FINISHED"


async def cancelled_at_start(app: Any, path: str, body: Any,
                             headers: dict[str, str] | None = None) -> None:
    """Send the request and cancel its task while the response's first send waits."""
    entered = asyncio.Event()

    async def hang() -> None:
        entered.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(request(app, path, body, headers, on_start=hang))
    async with asyncio.timeout(10):
        await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# -- AG-UI -------------------------------------------------------------------------------


async def test_agui_response_start_fails() -> None:
    runtime = scripted()
    app = create_app(runtime, PATH)
    path, body = agui()
    status, _ = await request(app, path, body, on_start=fails)
    assert status is None  # the 500 could not be sent either
    await assert_runs_again(app, runtime)
    await runtime.aclose()


async def test_agui_cancelled_before_the_stream() -> None:
    runtime = scripted()
    app = create_app(runtime, PATH)
    await cancelled_at_start(app, *agui())
    await assert_runs_again(app, runtime)
    await runtime.aclose()


async def test_agui_concurrency_slot_comes_back() -> None:
    runtime = scripted(auth=BearerTokenAuth({TOKEN: "alice"}),
                       rate_limit=RateLimit(concurrent_runs=1))
    app = create_app(runtime, PATH)
    auth = {"authorization": f"Bearer {TOKEN}"}
    path, body = agui()
    await request(app, path, body, auth, on_start=fails)
    await cancelled_at_start(app, *agui("t-other"), auth)
    # Neither the thread nor alice's only slot is held by the runs never driven.
    await assert_runs_again(app, runtime, headers=auth)
    # A run driven to its end gives its slot back in a task: wait for it, within a budget.
    assert "t-other" not in runtime.runs.active
    async for _ in poll():
        status, data = await request(app, *agui("t-other", "r-again"), auth)
        if status != 429:
            break
    assert status == 200, data
    assert types(parse_sse(data))[-1] == "RUN_FINISHED"
    await runtime.aclose()


class FailingTelemetry:
    """Telemetry whose run span cannot be started (a broken exporter, say)."""

    @contextlib.contextmanager
    def request_span(self, info: Any, status: Any = None) -> Iterator[None]:
        yield

    def run_started(self, *args: Any) -> Any:
        raise RuntimeError("no span today")


async def test_telemetry_failing_as_the_run_starts() -> None:
    runtime = scripted(telemetry=FailingTelemetry(), rate_limit=RateLimit(concurrent_runs=1))
    app = create_app(runtime, PATH)
    path, body = agui()
    status, _ = await request(app, path, body)
    assert status == 500
    assert THREAD not in runtime.runs.active
    runtime.telemetry = None  # the exporter is back
    await assert_runs_again(app, runtime)  # the caller's slot was given back too
    await runtime.aclose()


async def test_a_guardrail_cancelled_gives_the_thread_back() -> None:
    # Already handled before this file: kept so it stays so.
    class Slow:
        async def check(self, messages: Any, principal: Any) -> Any:
            await asyncio.Event().wait()

    runtime = scripted(guardrails=[Slow()])
    app = create_app(runtime, PATH)
    path, body = agui()
    task = asyncio.create_task(request(app, path, body))
    async for _ in poll(10):
        if THREAD in runtime.runs.active:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert THREAD not in runtime.runs.active
    runtime.guardrails = []
    await assert_runs_again(app, runtime)
    await runtime.aclose()


async def test_client_leaving_right_after_its_body(serve_runtime: ServeRuntime) -> None:
    # Over a real server: the request is sent whole, then the connection closed at once.
    runtime = scripted()
    async with serve_runtime(runtime) as served:
        url = urllib.parse.urlsplit(served.url)
        payload = orjson.dumps(run_input("Hi", thread=THREAD))
        head = (f"POST {url.path}/agent/default/run HTTP/1.1\r\nHost: {url.netloc}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
        with socket.create_connection((url.hostname or "", url.port or 80)) as sock:
            sock.sendall(head.encode() + payload)
        async for _ in poll(10):
            if THREAD not in runtime.runs.active:
                break
        assert THREAD not in runtime.runs.active
        events = await served.run(run_input("Again", thread=THREAD, run="r2"))
        assert types(events)[-1] == "RUN_FINISHED"


# -- GraphQL -----------------------------------------------------------------------------


async def test_graphql_encoder_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = scripted()
    app = create_app(runtime, PATH)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cannot build the response")

    monkeypatch.setattr(graphql_handlers, "ResponseEncoder", broken)
    status, _ = await request(app, *graphql(), OTHER_CLIENT_HEADERS)
    assert status == 500
    await assert_runs_again(app, runtime)
    await runtime.aclose()


async def test_graphql_response_start_fails() -> None:
    runtime = scripted()
    app = create_app(runtime, PATH)
    status, _ = await request(app, *graphql(), CLIENT_HEADERS, on_start=fails)
    assert status is None
    await assert_runs_again(app, runtime)
    await runtime.aclose()


async def test_graphql_cancelled_before_the_stream() -> None:
    runtime = scripted()
    app = create_app(runtime, PATH)
    await cancelled_at_start(app, *graphql(), CLIENT_HEADERS)
    await assert_runs_again(app, runtime)
    await runtime.aclose()


# -- a shared coordinator ----------------------------------------------------------------


@pytest.fixture(params=["postgresql", "redis"])
def coordinator_url(request: pytest.FixtureRequest) -> Iterator[str]:
    made = postgres_schema("reserve") if request.param == "postgresql" else redis_prefix()
    with made as url:
        yield f"{url}&lease_ttl=2"


@pytest.fixture
async def workers(coordinator_url: str, tmp_path: Path
                  ) -> AsyncIterator[tuple[CopilotRuntime, CopilotRuntime]]:
    """Two runtimes sharing a SQLite store and the coordinator."""
    made = [scripted(thread_store=thread_store(f"sqlite:///{tmp_path}/threads.db"),
                     coordinator=coordinator_url) for _ in range(2)]
    for runtime in made:
        await runtime.start()
    yield made[0], made[1]
    for runtime in made:
        await runtime.aclose()


@pytest.mark.parametrize("protocol", ["agui", "graphql"])
@pytest.mark.parametrize("fault", ["fails", "cancelled"])
async def test_the_lease_is_released(workers: tuple[CopilotRuntime, CopilotRuntime],
                                     protocol: str, fault: str) -> None:
    a, b = workers
    app_a, app_b = create_app(a, PATH), create_app(b, PATH)
    path, body = agui() if protocol == "agui" else graphql()
    headers = CLIENT_HEADERS if protocol == "graphql" else None
    if fault == "fails":
        await request(app_a, path, body, headers, on_start=fails)
    else:
        await cancelled_at_start(app_a, path, body, headers)
    assert THREAD not in a.runs.active
    coordinator = a.runs.coordinator
    assert coordinator is not None
    assert await coordinator.holder(THREAD) is None  # released, not left to expire
    # The other worker takes the thread at once; the run that never streamed is closed.
    await assert_runs_again(app_b, b)
    record = await b.store.get(THREAD)
    assert record is not None
    assert len(record.runs) == 2
    first = record.runs[0].events
    assert first[0]["type"] == "RUN_STARTED"
    assert first[-1]["type"] == "RUN_ERROR"
    assert first[-1]["code"] == INTERRUPTED_CODE
    durable = b.runs.durable
    assert durable is not None
    assert await durable.open_runs() == []


async def test_a_stop_before_the_run_is_driven_stops_it() -> None:
    """A stop that lands while the run is reserved but its response not started yet stops
    it: the stream starts and ends as a stop's does, and the model is never asked."""
    adapter = ScriptedAdapter(*[text_turn("hello")] * 3)
    runtime = CopilotRuntime(service_adapter=adapter)
    app = create_app(runtime, PATH)
    entered, go = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        entered.set()
        await go.wait()

    running = asyncio.create_task(request(app, *agui(), on_start=hold))
    async with asyncio.timeout(10):
        await entered.wait()
    status, data = await request(app, f"{PATH}/agent/default/stop/{THREAD}", {})
    assert status == 200
    assert orjson.loads(data)["stopped"] is True
    go.set()
    async with asyncio.timeout(10):
        status, data = await running
    assert status == 200
    assert types(parse_sse(data)) == ["RUN_STARTED", "RUN_FINISHED"]
    assert len(adapter.turns) == 3  # no turn was taken: the model was never asked
    await assert_runs_again(app, runtime)
    await runtime.aclose()
