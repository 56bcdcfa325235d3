"""A runtime whose app's lifespan ends and starts again (one module-level app used in two
`with TestClient(app):` blocks, the everyday FastAPI test) serves again, as the first time.

Before, `aclose` left the runtime closed and its store shut while the second start went
ahead and said "complete": on SQLite every request was a 500 ("Cannot operate on a closed
database"), `/ready` said "closing" for good on any store, and the second shutdown returned
at once without stopping the runs still streaming. Now the second start opens again what
the first shutdown closed (store, limits, MCP, approvals, sweeps) and the second shutdown
stops runs as the first did; a runtime whose parts cannot open again (a PostgreSQL store,
a shared coordinator) refuses its second start with a message saying why, which the
lifespan sends as `lifespan.startup.failed`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from copilot_runtime import (
    CopilotRuntime,
    OpenAIAdapter,
    RateLimit,
    create_app,
    mount_runtime,
    thread_store,
)
from copilot_runtime.auth import RequestInfo
from copilot_runtime.testing import MockOpenAIServer, ScriptedAdapter, text_turn
from tests.conftest import parse_sse, run_input, text_of, types
from tests.hitl_support.postgres import postgres_schema

pytestmark = pytest.mark.timeout(60)

Message = dict[str, Any]


def test_a_test_client_used_twice_serves_each_time(tmp_path: Path) -> None:
    """Two `with TestClient(app):` blocks on one app (its runtime over SQLite, rate limited):
    each serves runs and is ready, and the second reads the first one's thread."""
    runtime = CopilotRuntime(
        service_adapter=ScriptedAdapter(text_turn("one"), text_turn("two")),
        thread_store=thread_store(f"sqlite:///{tmp_path / 'threads.db'}"),
        rate_limit=RateLimit(concurrent_runs=2))
    app = FastAPI()
    mount_runtime(app, runtime, "/copilotkit")
    for block, thread in enumerate(("t-1", "t-2")):
        with TestClient(app) as client:
            response = client.post("/copilotkit/agent/default/run",
                                   json=run_input("hi", thread=thread, run=f"r-{block}"))
            assert response.status_code == 200, (block, response.text)
            events = parse_sse(response.content)
            assert types(events)[-1] == "RUN_FINISHED", (block, events[-1])
            assert text_of(events) == ("one", "two")[block]
            ready = client.get("/copilotkit/ready")
            assert (ready.status_code, ready.json()) == (200, {"status": "ready"}), block
            first = client.get("/copilotkit/threads/t-1/messages")
            assert first.status_code == 200, first.text
            assert [m["content"] for m in first.json()["messages"]] == ["hi", "one"]
    assert not runtime.started


async def _lifespan(app: Any) -> tuple[Message, Callable[[], Awaitable[Message]]]:
    """Start `app`'s lifespan: what it answered, and how to shut it down (its answer)."""
    received: asyncio.Queue[Message] = asyncio.Queue()
    sent: asyncio.Queue[Message] = asyncio.Queue()
    await received.put({"type": "lifespan.startup"})
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}},
                                   received.get, sent.put))
    started = await sent.get()

    async def shut_down() -> Message:
        await received.put({"type": "lifespan.shutdown"})
        await task
        return await sent.get()

    if started["type"] != "lifespan.startup.complete":
        await task
    return started, shut_down


async def test_each_shutdown_of_a_lifespan_run_twice_stops_its_runs() -> None:
    """The ASGI lifespan run twice over one app: each start completes and leaves the runtime
    ready, and each shutdown ends the run still streaming at once (RUN_INTERRUPTED); the
    second returned early before, the run streaming on to its end."""
    async with MockOpenAIServer() as llm:
        runtime = CopilotRuntime(service_adapter=OpenAIAdapter(
            model="gpt-4o", api_key="sk-test", base_url=llm.base_url))
        app = create_app(runtime)
        transport = httpx.ASGITransport(app=app)
        for cycle in range(2):
            started, shut_down = await _lifespan(app)
            assert started == {"type": "lifespan.startup.complete"}, cycle
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=30) as client:
                ready = await client.get("/copilotkit/ready")
                assert ready.status_code == 200, (cycle, ready.text)
                run = asyncio.create_task(client.post(
                    "/copilotkit/agent/default/run",
                    content=orjson.dumps(run_input("slow:300 " + "word " * 20,
                                                   thread=f"t-{cycle}")),
                    headers={"Content-Type": "application/json"}))
                await asyncio.sleep(1.0)  # streaming
                began = time.monotonic()
                assert await shut_down() == {"type": "lifespan.shutdown.complete"}
                events = parse_sse((await run).content)
            assert time.monotonic() - began < 2.5, cycle
            assert (types(events)[-1], events[-1].get("code")) == (
                "RUN_ERROR", "RUN_INTERRUPTED"), (cycle, events[-1])
            assert not runtime.started


async def test_a_runtime_whose_store_cannot_open_again_refuses_its_second_start() -> None:
    """A PostgreSQL store's pool cannot open again once closed: the second start is refused,
    the lifespan says why (`lifespan.startup.failed`), not "complete" with a dead store."""
    with postgres_schema() as url:
        runtime = CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("one")),
                                 thread_store=thread_store(url))
        app = create_app(runtime)
        started, shut_down = await _lifespan(app)
        assert started == {"type": "lifespan.startup.complete"}
        assert await shut_down() == {"type": "lifespan.shutdown.complete"}
        started, _ = await _lifespan(app)
        assert started["type"] == "lifespan.startup.failed"
        assert "was closed (aclose) and cannot start again" in started["message"]
        assert "PostgresThreadStore has no reopen()" in started["message"]


async def test_a_runtime_closed_by_hand_starts_again(tmp_path: Path) -> None:
    """`start` after `aclose`, without an app: the SQLite store, the limits and an
    `on_request` hook serve again."""
    seen: list[str] = []

    def on_request(request: RequestInfo) -> None:
        seen.append(request.request_id)

    runtime = CopilotRuntime(
        service_adapter=ScriptedAdapter(text_turn("one"), text_turn("two")),
        thread_store=thread_store(f"sqlite:///{tmp_path / 'threads.db'}"),
        rate_limit=RateLimit(runs_per_minute=10), on_request=on_request)
    app = create_app(runtime)
    for cycle in range(2):
        await runtime.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            response = await client.post(
                "/copilotkit/agent/default/run",
                content=orjson.dumps(run_input("hi", thread=f"t-{cycle}")),
                headers={"Content-Type": "application/json"})
            assert response.status_code == 200, (cycle, response.text)
            assert text_of(parse_sse(response.content)) == ("one", "two")[cycle]
        assert await runtime.unready() == []
        await runtime.aclose()
        assert await runtime.unready() == ["closing"]
    assert len(seen) == 2
