"""The runtime's part of coordination, in one process with two runtimes as two workers on
the real PostgreSQL coordinator: a thread busy on one is busy on the other, a stop on one
stops the other's run, and the recovery sweep closes a dead worker's run exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import pytest

from copilot_runtime import (
    ConfigurationError,
    CopilotRuntime,
    InMemoryThreadStore,
    ThreadBusyError,
    coordinator,
)
from copilot_runtime._input import parse_run_input
from copilot_runtime._shared_runs import RecoverySweep
from copilot_runtime.events import Event
from copilot_runtime.testing import ScriptedAdapter, text_turn
from copilot_runtime.threads.base import StoredRun, ThreadOwner, ThreadRecord
from tests.scale_support.cluster import eventually
from tests.scale_support.services import postgres_schema

pytestmark = pytest.mark.timeout(60)


class SharedMemoryStore:
    """Stands in for a store every worker reads: one in-memory store behind two runtimes,
    with the runs a dead worker left open."""

    def __init__(self) -> None:
        self.inner = InMemoryThreadStore()
        self.open: list[tuple[str, str]] = []
        self.closed: list[tuple[str, str]] = []

    async def get(self, thread_id: str) -> ThreadRecord | None:
        return await self.inner.get(thread_id)

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         message_ids: Iterable[str], *, owner: ThreadOwner | None = None
                         ) -> None:
        await self.inner.append_run(thread_id, agent_id, run, message_ids, owner=owner)

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: ThreadOwner | None = None) -> list[ThreadRecord]:
        return await self.inner.list(agent_id, limit, owner=owner)

    async def open_runs(self) -> list[tuple[str, str]]:
        return list(self.open)

    async def close_interrupted(self, thread_id: str, run_id: str) -> bool:
        await asyncio.sleep(0.05)  # a round trip, so two sweepers overlap
        if (thread_id, run_id) not in self.open:
            return False
        self.open.remove((thread_id, run_id))
        self.closed.append((thread_id, run_id))
        return True

    async def events_after(self, thread_id: str, position: int) -> list[tuple[int, Event]]:
        record = await self.inner.get(thread_id)
        stored = [e for run in record.runs for e in run.events] if record else []
        return [(i, e) for i, e in enumerate(stored) if i > position]

    async def aclose(self) -> None:
        return None


@pytest.fixture
def url() -> Iterator[str]:
    with postgres_schema("shared") as base:
        yield f"{base}&lease_ttl=0.6"


@pytest.fixture
async def workers(url: str) -> AsyncIterator[tuple[CopilotRuntime, CopilotRuntime,
                                                   SharedMemoryStore]]:
    store = SharedMemoryStore()
    turns = [text_turn("a slow answer " * 3)] * 20
    made = [CopilotRuntime(service_adapter=ScriptedAdapter(*turns), thread_store=store,  # type: ignore[arg-type]
                           coordinator=url) for _ in range(2)]
    for runtime in made:
        await runtime.start()
    yield made[0], made[1], store
    for runtime in made:
        await runtime.aclose()


def run_input(thread: str, run: str) -> Any:
    return parse_run_input({"threadId": thread, "runId": run, "messages": [
        {"id": f"{run}-m", "role": "user", "content": "hi"}]})


async def test_busy_and_stop_across_runtimes(workers: Any) -> None:
    a, b, _ = workers
    run = await a.start_run("default", run_input("t1", "r1"))
    with pytest.raises(ThreadBusyError):
        await b.start_run("default", run_input("t1", "r2"))
    gate = asyncio.Event()
    written: list[Event] = []

    async def write(batch: Any) -> None:
        written.extend(batch)
        await gate.wait()  # hold the run open until the other worker stops it

    driving = asyncio.create_task(run.drive(write))
    await asyncio.sleep(0.05)
    assert await b.stop("default", "t1") is True
    # The signal reaches the driving worker within 1 s.
    await eventually(lambda: run.cancel_reason == "stop", deadline=1.0, what="the stop")
    gate.set()
    async with asyncio.timeout(5):
        await driving
    assert written[-1]["type"] == "RUN_FINISHED"
    # The thread is free for either worker, and its run replays on the other one.
    again = await b.start_run("default", run_input("t1", "r3"))
    await again.drive(_ignore)
    replay = [e async for batch in a.connect("default", "t1") for e in batch]
    assert [e["type"] for e in replay].count("RUN_STARTED") == 2


async def _ignore(batch: Any) -> None:
    return None


async def test_the_sweep_closes_a_dead_workers_run_once(workers: Any, url: str) -> None:
    a, b, store = workers
    dead = coordinator(url)
    lease = await dead.acquire("t-dead", "r-dead")
    assert lease is not None
    store.open.append(("t-dead", "r-dead"))
    await dead.aclose()  # the worker dies: nobody renews its lease
    sweeps = [RecoverySweep(a.runs, a.coordinator), RecoverySweep(b.runs, b.coordinator)]
    assert sum(await asyncio.gather(*(s.sweep() for s in sweeps))) == 0  # not expired yet
    assert store.open == [("t-dead", "r-dead")]
    await asyncio.sleep(0.8)
    results = await asyncio.gather(*(s.sweep() for s in sweeps))
    assert sorted(results) == [0, 1]  # one worker wins
    assert store.closed == [("t-dead", "r-dead")]
    assert await a.coordinator.holder("t-dead") is None  # the sweeper let go


def test_a_shared_coordinator_needs_shared_threads() -> None:
    with pytest.raises(ConfigurationError, match="thread store every worker can read"):
        CopilotRuntime(coordinator="redis://127.0.0.1:6379/0")
    CopilotRuntime(coordinator="local")  # the default, over the in-memory store
