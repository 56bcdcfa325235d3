"""A run another worker's run makes busy is no run of its thread while it is being refused.

Under a shared coordinator `RunManager.begin` reserves the thread in this process, then asks
for its lease; until the lease is held the reservation is not the thread's run. Before, a
`connect` on that worker followed the reservation (its stream ended, cut mid-message, when
the reservation was refused 409) and a `stop` cancelled it (answering "stopped" while the
other worker's run went on). Two runtimes on one SQLite store and the real PostgreSQL or
Redis coordinator; the refused worker's lease request is held by an event, so the window is
as long as the test wants."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from copilot_runtime import CopilotRuntime, ThreadBusyError, thread_store
from copilot_runtime import events as ev
from copilot_runtime._input import parse_run_input
from copilot_runtime.coordination import Lease
from copilot_runtime.coordination import coordinator as make_coordinator
from copilot_runtime.testing import verify_events
from copilot_runtime.threads.base import Positioned
from tests.conftest import GatedAgent
from tests.scale_support.cluster import eventually
from tests.scale_support.services import postgres_schema, redis_prefix

pytestmark = pytest.mark.timeout(60)

THREAD = "t-refused"


class HeldAcquire:
    """A worker's lease requests, each held until `go` is set (`asking` says one waits)."""

    def __init__(self, runtime: CopilotRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
        coordinator = runtime.runs.coordinator
        assert coordinator is not None
        self.asking, self.go = asyncio.Event(), asyncio.Event()
        acquire = coordinator.acquire

        async def held(thread_id: str, run_id: str) -> Lease | None:
            self.asking.set()
            await self.go.wait()
            return await acquire(thread_id, run_id)

        monkeypatch.setattr(coordinator, "acquire", held)


@pytest.fixture(params=["postgresql", "redis"])
def coordinator_url(request: pytest.FixtureRequest) -> Iterator[str]:
    made = postgres_schema("refused") if request.param == "postgresql" else redis_prefix()
    with made as url:
        yield f"{url}&lease_ttl=2"


@pytest.fixture
async def workers(coordinator_url: str, tmp_path: Path
                  ) -> AsyncIterator[tuple[CopilotRuntime, CopilotRuntime, GatedAgent]]:
    """Workers a and b on one SQLite store and the coordinator; a's runs wait after their
    first words until its agent's gate is set."""
    agents = [GatedAgent(), GatedAgent()]
    made = [CopilotRuntime(agents={"default": agent},
                           thread_store=thread_store(f"sqlite:///{tmp_path}/threads.db"),
                           coordinator=coordinator_url) for agent in agents]
    try:
        for runtime in made:
            await runtime.start()
        yield made[0], made[1], agents[0]
    finally:
        for runtime in made:
            await runtime.aclose()


def run_input(run: str) -> Any:
    return parse_run_input({"threadId": THREAD, "runId": run, "messages": [
        {"id": f"{run}-m", "role": "user", "content": "hi"}]})


async def _ignore(batch: Any) -> None:
    return None


async def _connected(runtime: CopilotRuntime) -> tuple[list[Positioned], asyncio.Task[None]]:
    """A connect to the thread on `runtime`, read on in a task once its first batch came:
    what it got so far (and gets on), and its task."""
    got: list[Positioned] = []
    replayed = asyncio.Event()

    async def read() -> None:
        async for batch in runtime.connect("default", THREAD):
            got.extend(batch)
            replayed.set()

    reading = asyncio.create_task(read())
    async with asyncio.timeout(10):
        await replayed.wait()
    return got, reading


async def _a_runs_while_b_asks(a: CopilotRuntime, b: CopilotRuntime,
                               monkeypatch: pytest.MonkeyPatch
                               ) -> tuple[asyncio.Task[None], HeldAcquire, asyncio.Task[Any]]:
    """Run r1 driven on worker a (its first words stored), and r2 begun on worker b, its
    lease asked for and held (b's agent let go: r2 runs at once once it holds the lease)."""
    b_agent = b.agents["default"]
    assert isinstance(b_agent, GatedAgent)
    b_agent.gate.set()
    driving = asyncio.create_task(
        (await a.start_run("default", run_input("r1"))).drive(_ignore))

    async def first_words_stored() -> bool:
        return any(e.get("delta") == "one " for _, e in await a.store.events_after(THREAD, -1))

    await eventually(first_words_stored, deadline=10, what="a's first words stored")
    held = HeldAcquire(b, monkeypatch)
    starting = asyncio.create_task(b.start_run("default", run_input("r2")))
    async with asyncio.timeout(10):
        await held.asking.wait()
    return driving, held, starting


async def refused(runtime: CopilotRuntime, run: str) -> None:
    with pytest.raises(ThreadBusyError):
        await runtime.start_run("default", run_input(run))


async def test_a_connect_follows_the_other_workers_run_past_a_refused_one(
        workers: tuple[CopilotRuntime, CopilotRuntime, GatedAgent],
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, agent = workers
    driving = asyncio.create_task(
        (await a.start_run("default", run_input("r1"))).drive(_ignore))

    async def first_words_stored() -> bool:
        return any(e.get("delta") == "one " for _, e in await a.store.events_after(THREAD, -1))

    await eventually(first_words_stored, deadline=10, what="a's first words stored")
    held = HeldAcquire(b, monkeypatch)
    refusing = asyncio.create_task(refused(b, "r2"))
    async with asyncio.timeout(10):
        await held.asking.wait()
    got, reading = await _connected(b)
    held.go.set()
    async with asyncio.timeout(10):
        await refusing
    agent.gate.set()
    async with asyncio.timeout(10):
        await driving
        await reading
    events = [e for _, e in got]
    verify_events(events)
    assert [e["type"] for e in events][-2:] == ["TEXT_MESSAGE_END", "RUN_FINISHED"]
    assert events[-1]["runId"] == "r1"
    assert "".join(e.get("delta", "") for e in events) == "one two"


@pytest.mark.parametrize("named", [None, "r1"])
async def test_a_stop_reaches_the_other_workers_run_past_a_refused_one(
        workers: tuple[CopilotRuntime, CopilotRuntime, GatedAgent],
        monkeypatch: pytest.MonkeyPatch, named: str | None) -> None:
    """`named`: the run the stop names (None: the thread's, whichever it is)."""
    a, b, _ = workers
    run = await a.start_run("default", run_input("r1"))
    written: list[Any] = []

    async def write(batch: Any) -> None:
        written.extend(batch)

    driving = asyncio.create_task(run.drive(write))
    held = HeldAcquire(b, monkeypatch)
    starting = asyncio.create_task(b.start_run("default", run_input("r2")))
    async with asyncio.timeout(10):
        await held.asking.wait()
    assert await b.stop("default", THREAD, named) is True
    # The signal reaches the driving worker within 1 s, the second run still waiting.
    await eventually(lambda: run.cancel_reason == "stop", deadline=1.0, what="the stop")
    held.go.set()
    async with asyncio.timeout(10):
        await driving
        # Busy, or the thread's once the stopped run gave it back: not stopped by the stop.
        with contextlib.suppress(ThreadBusyError):
            second = await starting
            assert second.cancel_reason is None
            await second.abandon()
    assert written[-1]["type"] == "RUN_FINISHED"
    assert "two" not in [e.get("delta") for e in written]  # stopped, not at its end


async def test_a_stop_while_the_workers_own_run_waits_for_its_lease_stops_it(
        workers: tuple[CopilotRuntime, CopilotRuntime, GatedAgent],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the tests above must not break: a reservation no other run holds the thread
    against is the thread's run to be, stopped as the stop lands (it starts and ends as a
    stop's run does)."""
    _, b, _ = workers
    held = HeldAcquire(b, monkeypatch)
    starting = asyncio.create_task(b.start_run("default", run_input("r1")))
    async with asyncio.timeout(10):
        await held.asking.wait()
    assert await b.stop("default", THREAD) is True
    held.go.set()
    written: list[Any] = []

    async def write(batch: Any) -> None:
        written.extend(batch)

    async with asyncio.timeout(10):
        await (await starting).drive(write)
    assert [e["type"] for e in written] == ["RUN_STARTED", "RUN_FINISHED"]


async def test_a_connect_gets_the_other_workers_run_whole_before_the_reservations_own(
        workers: tuple[CopilotRuntime, CopilotRuntime, GatedAgent],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The other worker's run ends while the reservation waits for its lease, which it then
    gets: a connect made meanwhile (its first batch the other run's start, from the store)
    gets that run to its end, then the reservation's run. Before, the other run's end
    (written while the reservation waited) was never sent."""
    a, b, agent = workers
    driving, held, starting = await _a_runs_while_b_asks(a, b, monkeypatch)
    got, reading = await _connected(b)
    async with asyncio.timeout(10):
        agent.gate.set()
        await driving  # r1 ended, stored and its lease given back
        held.go.set()
        await (await starting).drive(_ignore)
        await reading
    events = [e for _, e in got]
    verify_events(events)
    assert [(e["type"], e["runId"]) for e in events if e["type"].startswith("RUN_")] == [
        ("RUN_STARTED", "r1"), ("RUN_FINISHED", "r1"),
        ("RUN_STARTED", "r2"), ("RUN_FINISHED", "r2")]
    assert "".join(e.get("delta", "") for e in events) == "one two" * 2
    positions = [p for p, _ in got if p is not None]
    assert positions == sorted(set(positions))


async def test_a_connect_gets_a_dead_workers_run_closed_before_the_reservations_own(
        workers: tuple[CopilotRuntime, CopilotRuntime, GatedAgent],
        monkeypatch: pytest.MonkeyPatch, coordinator_url: str) -> None:
    """As above, the run before the reservation's a dead worker's, left open: it is closed
    (its RUN_ERROR written, as the reservation takes the expired lease or by the sweep)
    while the reservation waits, and the connect gets that end before the new run."""
    a, b, _ = workers
    b_agent = b.agents["default"]
    assert isinstance(b_agent, GatedAgent)
    b_agent.gate.set()
    coordinator, durable = a.runs.coordinator, a.runs.durable
    assert coordinator is not None
    assert durable is not None
    # The dead worker: its lease, left to expire, and its run's first words, never ended.
    dead = make_coordinator(coordinator_url)
    await dead.start()
    assert await dead.acquire(THREAD, "r1") is not None
    await dead.aclose()
    await durable.append_events(THREAD, "default", "r1", time.time(), 0, [
        ev.run_started(THREAD, "r1"), ev.text_message_start("m-r1"),
        ev.text_message_content("m-r1", "one ")])
    held = HeldAcquire(b, monkeypatch)
    starting = asyncio.create_task(b.start_run("default", run_input("r2")))
    async with asyncio.timeout(10):
        await held.asking.wait()
    got, reading = await _connected(b)
    assert [e["type"] for _, e in got][-1] == "TEXT_MESSAGE_CONTENT"

    async def expired() -> bool:
        return await coordinator.holder(THREAD) is None

    await eventually(expired, deadline=10, what="the dead worker's lease expired")
    held.go.set()
    async with asyncio.timeout(10):
        await (await starting).drive(_ignore)
        await reading
    events = [e for _, e in got]
    verify_events(events)
    assert [(e["type"], e.get("runId")) for e in events if e["type"].startswith("RUN_")
            ] == [("RUN_STARTED", "r1"), ("RUN_ERROR", None),
                  ("RUN_STARTED", "r2"), ("RUN_FINISHED", "r2")]


async def test_a_connect_whose_first_read_outlasts_the_other_workers_run_gets_its_end(
        workers: tuple[CopilotRuntime, CopilotRuntime, GatedAgent],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, the connect's first store read slow: it reads the other worker's run in
    the middle, and before it answers that run ends and the reservation gets its lease.
    The connect still gets that run's end before the reservation's run. Before, the
    reservation confirmed by then, the stale read was trusted and the run's end skipped."""
    a, b, agent = workers
    driving, held, starting = await _a_runs_while_b_asks(a, b, monkeypatch)
    store = b.runs.store
    events_after = store.events_after
    read, answer = asyncio.Event(), asyncio.Event()

    async def slow_first_read(thread_id: str, after: int) -> Any:
        stored = await events_after(thread_id, after)
        if not read.is_set():
            read.set()
            await answer.wait()
        return stored

    monkeypatch.setattr(store, "events_after", slow_first_read)
    got: list[Positioned] = []

    async def read_all() -> None:
        async for batch in b.connect("default", THREAD):
            got.extend(batch)

    reading = asyncio.create_task(read_all())
    reserved = b.runs.active[THREAD]
    async with asyncio.timeout(10):
        await read.wait()  # the store as it was: r1 in the middle
        agent.gate.set()
        await driving  # r1 ended, stored and its lease given back
        held.go.set()
        await eventually(lambda: reserved.confirmed, deadline=5, what="r2's lease")
        answer.set()
        await (await starting).drive(_ignore)
        await reading
    events = [e for _, e in got]
    verify_events(events)
    assert [(e["type"], e["runId"]) for e in events if e["type"].startswith("RUN_")] == [
        ("RUN_STARTED", "r1"), ("RUN_FINISHED", "r1"),
        ("RUN_STARTED", "r2"), ("RUN_FINISHED", "r2")]
    assert "".join(e.get("delta", "") for e in events) == "one two" * 2
    positions = [p for p, _ in got if p is not None]
    assert positions == sorted(set(positions))
