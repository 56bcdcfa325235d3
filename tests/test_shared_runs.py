"""The runtime's part of coordination, in one process with two runtimes as two workers on
one SQLite file and the real PostgreSQL coordinator: a thread busy on one is busy on the
other, a stop on one stops the other's run, and the recovery sweep closes a dead worker's
run exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import copilot_runtime._runs
from copilot_runtime import (
    ConfigurationError,
    CopilotRuntime,
    ThreadBusyError,
    coordinator,
    thread_store,
)
from copilot_runtime import events as ev
from copilot_runtime._exceptions import RateLimitedError
from copilot_runtime._input import parse_run_input
from copilot_runtime._shared_runs import RecoverySweep
from copilot_runtime.events import Event
from copilot_runtime.testing import ScriptedAdapter, text_turn, verify_events
from copilot_runtime.threads import INTERRUPTED_CODE
from copilot_runtime.threads.base import Positioned
from tests.conftest import GatedAgent, poll
from tests.scale_support.cluster import eventually
from tests.scale_support.services import REDIS, postgres_schema, redis_prefix

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def url() -> Iterator[str]:
    with postgres_schema("shared") as base:
        yield f"{base}&lease_ttl=0.6"


@pytest.fixture
async def workers(url: str, tmp_path: Path) -> AsyncIterator[tuple[CopilotRuntime,
                                                                   CopilotRuntime]]:
    """Two runtimes on one SQLite file and the PostgreSQL coordinator."""
    turns = [text_turn("a slow answer " * 3)] * 20
    made = [CopilotRuntime(service_adapter=ScriptedAdapter(*turns),
                           thread_store=thread_store(f"sqlite:///{tmp_path}/threads.db"),
                           coordinator=url) for _ in range(2)]
    for runtime in made:
        await runtime.start()
    yield made[0], made[1]
    for runtime in made:
        await runtime.aclose()


def run_input(thread: str, run: str) -> Any:
    return parse_run_input({"threadId": thread, "runId": run, "messages": [
        {"id": f"{run}-m", "role": "user", "content": "hi"}]})


async def test_busy_and_stop_across_runtimes(workers: Any) -> None:
    a, b = workers
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
    replay = [e async for batch in a.connect("default", "t1") for _, e in batch]
    assert [e["type"] for e in replay].count("RUN_STARTED") == 2


async def _ignore(batch: Any) -> None:
    return None


async def test_the_sweep_closes_a_dead_workers_run_once(workers: Any, url: str) -> None:
    a, b = workers
    store = a.store
    dead = coordinator(url)
    lease = await dead.acquire("t-dead", "r-dead")
    assert lease is not None
    # The dead worker had streamed a run's start and some text.
    await store.append_events("t-dead", "default", "r-dead", time.time(), 0, [
        ev.run_started("t-dead", "r-dead", {}), ev.text_message_start("m1"),
        ev.text_message_content("m1", "half an ans")])
    await dead.aclose()  # the worker dies: nobody renews its lease
    sweeps = [RecoverySweep(a.runs.durable, a.runs.active, a.coordinator),
              RecoverySweep(b.runs.durable, b.runs.active, b.coordinator)]
    assert sum(await asyncio.gather(*(s.sweep() for s in sweeps))) == 0  # not expired yet
    assert await store.open_runs() == [("t-dead", "r-dead")]
    closed: list[int] = []
    async for _ in poll(10, every=0.2):  # past the lease's expiry (later on a busy machine)
        results = await asyncio.gather(*(s.sweep() for s in sweeps))
        closed.extend(r for r in results if r)
        if closed:
            break
    assert closed == [1]  # one worker wins
    assert await store.open_runs() == []
    assert await a.coordinator.holder("t-dead") is None  # the sweeper let go
    replay = [e async for batch in b.connect("default", "t-dead") for _, e in batch]
    assert [e["type"] for e in replay][-2:] == ["TEXT_MESSAGE_END", "RUN_ERROR"]
    assert replay[-1]["code"] == INTERRUPTED_CODE


def test_a_shared_coordinator_needs_shared_threads() -> None:
    with pytest.raises(ConfigurationError, match="thread store every worker can read"):
        CopilotRuntime(coordinator="redis://127.0.0.1:6379/0")
    CopilotRuntime(coordinator="local")  # the default, over the in-memory store


async def test_a_new_run_closes_a_dead_workers_run_first(url: str, tmp_path: Path) -> None:
    # No sweep runs here (the runtime is never started): the new run finds the lease expired
    # unreleased, and closes the dead run before it takes the next positions.
    store = thread_store(f"sqlite:///{tmp_path}/threads.db")
    runtime = CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("fresh")),
                             thread_store=store, coordinator=url)
    dead = coordinator(url)
    try:
        assert await dead.acquire("t-left", "r-dead") is not None
        await store.append_events("t-left", "default", "r-dead", time.time(), 0, [  # type: ignore[attr-defined]
            ev.run_started("t-left", "r-dead", {}), ev.text_message_start("m1"),
            ev.text_message_content("m1", "cut sho")])
        await dead.aclose()
        with pytest.raises(ThreadBusyError):
            await runtime.start_run("default", run_input("t-left", "r-new"))
        run = await eventually(lambda: _start_or_none(runtime, "t-left", "r-new"),
                               deadline=5, what="the lease expired")
        await run.drive(_ignore)
        replay = [(p, e) async for batch in runtime.connect("default", "t-left") for p, e in batch]
        types = [e["type"] for _, e in replay]
        assert types.count("RUN_STARTED") == 2
        assert types[types.index("RUN_ERROR") - 1] == "TEXT_MESSAGE_END"
        assert replay[types.index("RUN_ERROR")][1]["code"] == INTERRUPTED_CODE
        positions = [p for p, _ in replay if p is not None]
        assert positions == sorted(set(positions))
    finally:
        await runtime.aclose()


async def _start_or_none(runtime: CopilotRuntime, thread: str, run: str) -> Any:
    try:
        return await runtime.start_run("default", run_input(thread, run))
    except ThreadBusyError:
        return None


async def test_rate_limits_count_across_workers_through_the_coordinator(
        url: str, tmp_path: Path) -> None:
    from copilot_runtime import RateLimit
    from copilot_runtime.auth import RequestInfo

    made = [CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("hi")),
                           thread_store=thread_store(f"sqlite:///{tmp_path}/threads.db"),
                           coordinator=url, rate_limit=RateLimit(concurrent_runs=1))
            for _ in range(2)]
    request = RequestInfo(method="POST", path="/", headers={}, client="10.0.0.7")
    try:
        assert made[0].limiter is not None
        assert made[1].limiter is not None
        first = await made[0].limiter.acquire(request)
        with pytest.raises(RateLimitedError):  # the same caller, on the other worker
            await made[1].limiter.acquire(request)
        assert first is not None
        await first.release()
        second = await made[1].limiter.acquire(request)
        assert second is not None
        await second.release()
    finally:
        for runtime in made:
            await runtime.aclose()


async def test_the_sweep_clears_a_dead_workers_redis_marker(tmp_path: Path) -> None:
    # Redis remembers that a lease expired unreleased with an `open:` key; once the sweep
    # has closed the dead worker's run, nothing of it is left in Redis.
    import redis.asyncio as aioredis

    with redis_prefix() as base:
        url = f"{base}&lease_ttl=0.6"
        store = thread_store(f"sqlite:///{tmp_path}/threads.db")
        runtime = CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("x")),
                                 thread_store=store, coordinator=url)
        dead = coordinator(url)
        client = aioredis.from_url(REDIS)
        try:
            assert await dead.acquire("t-dead", "r-dead") is not None
            await store.append_events("t-dead", "default", "r-dead", time.time(), 0, [  # type: ignore[attr-defined]
                ev.run_started("t-dead", "r-dead", {})])
            await dead.aclose()
            sweep = RecoverySweep(runtime.runs.durable, runtime.runs.active,
                                  runtime.runs.coordinator)  # type: ignore[arg-type]
            closed = await eventually(sweep.sweep, deadline=5, what="the sweep closed it")
            assert closed == 1
            assert await store.open_runs() == []  # type: ignore[attr-defined]
            prefix = base.split("prefix=")[1]
            assert await client.keys(f"{prefix}*") == []
        finally:
            await client.aclose()
            await runtime.aclose()


@contextlib.asynccontextmanager
async def _two_workers(url: str, tmp_path: Path
                       ) -> AsyncIterator[tuple[CopilotRuntime, CopilotRuntime, asyncio.Event]]:
    """Workers a and b on one SQLite thread store and coordinator `url`; thread `t` holds a
    finished run r1 of a's, and a's next run waits after its first words until the gate
    is set."""
    agents = [GatedAgent(), GatedAgent()]
    made = [CopilotRuntime(agents={"default": agent},
                           thread_store=thread_store(f"sqlite:///{tmp_path}/threads.db"),
                           coordinator=url) for agent in agents]
    try:
        for runtime in made:
            await runtime.start()
        agents[0].gate.set()
        await (await made[0].start_run("default", run_input("t", "r1"))).drive(_ignore)
        agents[0].gate.clear()
        yield made[0], made[1], agents[0].gate
    finally:
        for runtime in made:
            await runtime.aclose()


async def test_an_id_past_the_thread_replays_it_whole_on_every_worker(
        url: str, tmp_path: Path) -> None:
    """Before: `connect` with a `Last-Event-ID` past the thread's positions (an id of
    another thread, or of an older history of this one) while a run was live replayed the
    whole thread on the worker driving the run, but nothing at all on any other: the
    follower waited for events after that id, which never came, and its stream ended empty
    with the run. Both now replay the whole thread, then follow the live run."""
    async with _two_workers(url, tmp_path) as (a, b, gate):
        driving = asyncio.create_task(
            (await a.start_run("default", run_input("t", "r2"))).drive(_ignore))
        got: dict[str, list[Positioned]] = {"driving": [], "following": []}

        async def read(runtime: CopilotRuntime, into: list[Positioned]) -> None:
            async for batch in runtime.connect("default", "t", after=100_000):
                into.extend(batch)

        reading = [asyncio.create_task(read(a, got["driving"])),
                   asyncio.create_task(read(b, got["following"]))]

        def both_replayed() -> bool:
            return all([e["type"] for _, e in rows].count("RUN_STARTED") == 2 and
                       rows[-1][1].get("delta") == "one " for rows in got.values())

        # While the run waits, on both: the first run, and the live one so far.
        await eventually(both_replayed, deadline=10, what="the whole thread replayed")
        gate.set()
        async with asyncio.timeout(10):
            await driving
            await asyncio.gather(*reading)
        assert got["following"] == got["driving"]
        events = [e for _, e in got["following"]]
        verify_events(events)
        assert [e["type"] for e in events].count("RUN_FINISHED") == 2
        positions = [p for p, _ in got["following"] if p is not None]
        assert positions == sorted(set(positions))  # nothing twice


async def test_an_id_of_the_live_run_not_yet_written_resumes_exactly(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the test above must not break: an id the driving worker sent a moment ago, not
    yet in the store, is one of the thread's: another worker resumes after it, once written,
    and does not replay the whole thread."""
    monkeypatch.setattr(copilot_runtime._runs, "FLUSH_INTERVAL", 1.0)  # written late
    async with _two_workers(url, tmp_path) as (a, b, gate):
        run = await a.start_run("default", run_input("t", "r2"))
        driving = asyncio.create_task(run.drive(_ignore))
        await eventually(lambda: any(e.get("delta") == "one " for e in run.events),
                         deadline=5, what="the first words")
        seen = run.first_position + len(run.events) - 1  # streamed, not yet written
        assert (await b.store.summary("t")).next_position <= seen  # type: ignore[union-attr]
        got: list[Positioned] = []

        async def read() -> None:
            async for batch in b.connect("default", "t", after=seen):
                got.extend(batch)

        reading = asyncio.create_task(read())
        await asyncio.sleep(1.5)  # written meanwhile
        gate.set()
        async with asyncio.timeout(10):
            await driving
            await reading
        assert [(p, e["type"]) for p, e in got] == [
            (seen + 1, "TEXT_MESSAGE_CONTENT"), (seen + 2, "TEXT_MESSAGE_END"),
            (seen + 3, "RUN_FINISHED")]
