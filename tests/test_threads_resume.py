"""Resuming a thread (`connect` with `Last-Event-ID`) never hides events silently.

A thread deleted and made again with the same id goes on with the positions where the deleted
one stopped, on every store and across workers sharing PostgreSQL, so an event id a client kept
from the deleted thread never hides the new thread's first events.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from copilot_runtime import CopilotRuntime, DemoAdapter, coordinator, thread_store
from copilot_runtime.testing import verify_events
from copilot_runtime.threads import InMemoryThreadStore
from tests.conftest import Served, ServeRuntime, parse_sse_ids, run_input
from tests.hitl_support.postgres import postgres_schema
from tests.test_trust_ownership import call

pytestmark = pytest.mark.timeout(60)

KINDS = ["memory", "sqlite", "postgresql"]


@pytest.fixture(params=KINDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "postgresql":
        with postgres_schema() as url:
            yield url
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'threads.db'}"
    else:
        yield "memory://"


@contextlib.asynccontextmanager
async def worker(url: str, serve_runtime: ServeRuntime,
                 runtime: CopilotRuntime | None = None) -> AsyncIterator[Served]:
    """A runtime on the store `url` (with a coordinator on PostgreSQL), served."""
    if runtime is None:
        options: dict[str, Any] = {"thread_store": thread_store(url)}
        if url.startswith("postgresql"):
            options["coordinator"] = coordinator(url)
        runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), **options)
    async with serve_runtime(runtime) as served:
        yield served


@pytest.fixture
async def served(store_url: str, serve_runtime: ServeRuntime) -> AsyncIterator[Served]:
    async with worker(store_url, serve_runtime) as s:
        yield s


async def connect(served: Served, thread: str, last_event_id: str | None = None
                  ) -> tuple[int, list[tuple[int | None, dict[str, Any]]]]:
    headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id}
    status, body, _ = await call(served, "POST", "/agent/default/connect", None,
                                 run_input("", thread=thread), headers)
    return status, parse_sse_ids(body) if status == 200 else [orjson.loads(body)]


async def run_ids(served: Served, thread: str, text: str, run: str
                  ) -> list[tuple[int | None, dict[str, Any]]]:
    status, body, _ = await call(served, "POST", "/agent/default/run", None,
                                 run_input(text, thread=thread, run=run))
    assert status == 200, body
    return parse_sse_ids(body)


async def test_a_stale_last_event_id_misses_nothing_of_a_thread_made_again(
        served: Served) -> None:
    """Before: the thread made again started at position 0, so a client that had seen the
    deleted thread's events up to id N (a long answer) and connected with `Last-Event-ID: N`
    got nothing of the new thread's first N+1 events: here, all of its run."""
    old = await run_ids(served, "t", "a long question " * 20, "r1")
    last_seen = max(p for p, _ in old if p is not None)
    status, _, _ = await call(served, "DELETE", "/threads/t", None)
    assert status == 200
    new = await run_ids(served, "t", "short", "r2")
    positions = [p for p, _ in new]
    assert positions[0] == last_seen + 1  # the positions go on
    assert positions == list(range(positions[0], positions[0] + len(new)))
    status, replay = await connect(served, "t", str(last_seen))
    assert status == 200
    events = [e for _, e in replay]
    verify_events(events)
    assert [e["runId"] for e in events if e["type"] == "RUN_STARTED"] == ["r2"]
    assert replay[-1][0] == positions[-1]


async def test_a_thread_deleted_on_one_worker_goes_on_on_another(
        serve_runtime: ServeRuntime) -> None:
    """The same across workers sharing PostgreSQL: the worker that runs the thread made
    again reads how far the thread another worker deleted had got."""
    with postgres_schema() as url:
        async with worker(url, serve_runtime) as one, worker(url, serve_runtime) as two:
            old = await run_ids(one, "t", "a long question " * 20, "r1")
            last_seen = max(p for p, _ in old if p is not None)
            status, _, _ = await call(one, "DELETE", "/threads/t", None)
            assert status == 200
            new = await run_ids(two, "t", "short", "r2")
            assert new[0][0] == last_seen + 1
            for served in (one, two):
                status, replay = await connect(served, "t", str(last_seen))
                assert status == 200
                assert [e["runId"] for _, e in replay if e["type"] == "RUN_STARTED"] == ["r2"]


async def test_a_thread_evicted_from_memory_leaves_its_positions() -> None:
    """The in-memory store forgets its least recently used threads: one of those made
    again goes on from where it was too (a client may still hold its event ids)."""
    from tests import test_store_conformance as conformance

    store = InMemoryThreadStore(max_threads=1)
    events = conformance._run("t", "r1", "a b c")
    await conformance._finish(store, "t", "r1", events, 0)
    await conformance._finish(store, "u", "r1", conformance._run("u", "r1", "x"), 0)
    assert await store.get("t") is None  # evicted
    assert await store.first_position("t") == len(events)
    # At most `max_tombstones` ids are remembered, the oldest forgotten first.
    store.max_tombstones = 1
    await conformance._finish(store, "v", "r1", conformance._run("v", "r1", "x"), 0)
    assert await store.first_position("t") == 0
    assert await store.first_position("u") > 0
