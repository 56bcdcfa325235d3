"""A worker's own run waiting for its lease is the thread's run, for `connect` and `stop`.

Under a shared coordinator `RunManager.begin` reserves the thread in this process, then asks
for its lease (after this worker's previous run on the thread gave its own back). No other
run holds the thread against it: a `connect` meanwhile follows it to its end, and a `stop`
stops it. Before, a `connect` read the store and ended (empty, or at the previous run), and a
`stop` while the previous run's lease was still on its way back signalled that ended run,
answered "stopped" and stopped nothing. One runtime on a SQLite store and the real
PostgreSQL or Redis coordinator; its lease request (or give-back) is held by an event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest

from copilot_runtime import CopilotRuntime, thread_store
from copilot_runtime._input import parse_run_input
from copilot_runtime.testing import verify_events
from copilot_runtime.threads.base import Positioned
from tests.conftest import GatedAgent
from tests.scale_support.cluster import eventually
from tests.scale_support.services import postgres_schema, redis_prefix

pytestmark = pytest.mark.timeout(60)

THREAD = "t-own"


class Held:
    """A coordinator call of the worker (`name`), each held until `go` is set (`asking`
    says one waits)."""

    def __init__(self, runtime: CopilotRuntime, name: str,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        coordinator = runtime.runs.coordinator
        assert coordinator is not None
        self.asking, self.go = asyncio.Event(), asyncio.Event()
        call = getattr(coordinator, name)

        async def held(*args: Any) -> Any:
            self.asking.set()
            await self.go.wait()
            return await call(*args)

        monkeypatch.setattr(coordinator, name, held)


@pytest.fixture(params=["postgresql", "redis"])
def coordinator_url(request: pytest.FixtureRequest) -> Iterator[str]:
    made = postgres_schema("own") if request.param == "postgresql" else redis_prefix()
    with made as url:
        yield f"{url}&lease_ttl=2"


@pytest.fixture
async def worker(coordinator_url: str, tmp_path: Path
                 ) -> AsyncIterator[tuple[CopilotRuntime, GatedAgent]]:
    """A worker whose runs wait after their first words until its agent's gate is set."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent},
                             thread_store=thread_store(f"sqlite:///{tmp_path}/threads.db"),
                             coordinator=coordinator_url)
    await runtime.start()
    try:
        yield runtime, agent
    finally:
        await runtime.aclose()


def run_input(run: str) -> Any:
    return parse_run_input({"threadId": THREAD, "runId": run, "messages": [
        {"id": f"{run}-m", "role": "user", "content": "hi"}]})


async def _ignore(batch: Any) -> None:
    return None


async def _next_run_waiting_for_the_last(
        runtime: CopilotRuntime, agent: GatedAgent, monkeypatch: pytest.MonkeyPatch
        ) -> tuple[Held, asyncio.Task[None], asyncio.Task[Any]]:
    """Run r0 ended, its lease's give-back held; r1 begun, reserved, waiting for that
    lease (its agent held): the hold, r0's ending and r1's start."""
    agent.gate.set()
    first = await runtime.start_run("default", run_input("r0"))
    held = Held(runtime, "finish", monkeypatch)
    ending = asyncio.create_task(first.drive(_ignore))
    async with asyncio.timeout(10):
        await held.asking.wait()
    agent.gate.clear()
    starting = asyncio.create_task(runtime.start_run("default", run_input("r1")))
    await asyncio.sleep(0.2)  # r1 reserved, waiting for r0's lease
    assert not starting.done()
    return held, ending, starting


async def _next_run_driven(ending: Awaitable[Any], starting: Awaitable[Any],
                           agent: GatedAgent) -> tuple[Any, list[Any]]:
    """The last run ended (its lease given back), the next one begun and driven to its end
    (its agent let go 0.2 s in): that run, and what it wrote."""
    written: list[Any] = []

    async def write(batch: Any) -> None:
        written.extend(batch)

    async with asyncio.timeout(10):
        await ending
        second = await starting
        driving = asyncio.create_task(second.drive(write))
        await asyncio.sleep(0.2)
        agent.gate.set()
        await driving
    return second, written


@pytest.mark.parametrize("stored_run", [False, True])
async def test_a_connect_while_the_workers_run_waits_for_its_lease_follows_it(
        worker: tuple[CopilotRuntime, GatedAgent], monkeypatch: pytest.MonkeyPatch,
        stored_run: bool) -> None:
    """`stored_run`: the thread has a run stored before (else it is a fresh thread)."""
    runtime, agent = worker
    if stored_run:
        agent.gate.set()
        await (await runtime.start_run("default", run_input("r0"))).drive(_ignore)
        agent.gate.clear()
    held = Held(runtime, "acquire", monkeypatch)
    starting = asyncio.create_task(runtime.start_run("default", run_input("r1")))
    async with asyncio.timeout(10):
        await held.asking.wait()
    got: list[Positioned] = []

    async def read() -> None:
        async for batch in runtime.connect("default", THREAD):
            got.extend(batch)

    reading = asyncio.create_task(read())
    await asyncio.sleep(0.2)  # the connect is asked while the lease request waits
    held.go.set()
    async with asyncio.timeout(10):
        driving = asyncio.create_task((await starting).drive(_ignore))
        await asyncio.sleep(0.2)
        agent.gate.set()
        await driving
        await reading
    events = [e for _, e in got]
    verify_events(events)
    runs = [e["runId"] for e in events if e["type"] == "RUN_STARTED"]
    assert runs == (["r0", "r1"] if stored_run else ["r1"])
    assert events[-1]["type"] == "RUN_FINISHED"
    assert events[-1]["runId"] == "r1"
    assert "".join(e.get("delta", "") for e in events) == "one two" * (1 + stored_run)


async def test_a_stop_while_the_last_runs_lease_is_given_back_stops_the_next_run(
        worker: tuple[CopilotRuntime, GatedAgent], monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's next run waits for its previous run's lease to come back (a slow
    coordinator): a stop meanwhile is the next run's, not the ended one's."""
    runtime, agent = worker
    held, ending, starting = await _next_run_waiting_for_the_last(runtime, agent, monkeypatch)
    assert await runtime.stop("default", THREAD) is True
    held.go.set()
    second, written = await _next_run_driven(ending, starting, agent)
    assert second.cancel_reason == "stop"
    assert [e["type"] for e in written] == ["RUN_STARTED", "RUN_FINISHED"]


@pytest.fixture
async def other_worker(coordinator_url: str, tmp_path: Path,
                       worker: tuple[CopilotRuntime, GatedAgent]) -> AsyncIterator[CopilotRuntime]:
    """A second worker on the first one's store and coordinator (its agent never ends a run
    by itself)."""
    runtime = CopilotRuntime(agents={"default": GatedAgent()},
                             thread_store=thread_store(f"sqlite:///{tmp_path}/threads.db"),
                             coordinator=coordinator_url)
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.aclose()


async def test_a_stop_on_another_worker_while_the_last_runs_lease_is_given_back_stops_the_next(
        worker: tuple[CopilotRuntime, GatedAgent], other_worker: CopilotRuntime,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, the stop reaching another worker (behind the same balancer): the coordinator
    names the ended run the holder, the stop is signalled to it, and this worker stops the
    next run in its place. Before, it found no run of that id and stopped nothing."""
    runtime, agent = worker
    held, ending, starting = await _next_run_waiting_for_the_last(runtime, agent, monkeypatch)
    assert await other_worker.stop("default", THREAD) is True
    reserved = runtime.runs.active[THREAD]
    await eventually(lambda: reserved.cancel_reason == "stop", deadline=2.0,
                     what="the stop signalled")
    held.go.set()
    second, written = await _next_run_driven(ending, starting, agent)
    assert second.cancel_reason == "stop"
    assert [e["type"] for e in written] == ["RUN_STARTED", "RUN_FINISHED"]


@pytest.mark.parametrize("here", [True, False])
async def test_a_stop_naming_the_ended_run_while_its_lease_is_given_back_leaves_the_next(
        worker: tuple[CopilotRuntime, GatedAgent], other_worker: CopilotRuntime,
        monkeypatch: pytest.MonkeyPatch, here: bool) -> None:
    """A stop naming r0 (ended, its lease on its way back) is signalled to r0, the holder,
    on this worker (`here`) or another: it is not a stop of the thread, and r1, waiting for
    the lease, runs to its end. Before, any stop signalled to r0 stopped r1."""
    runtime, agent = worker
    held, ending, starting = await _next_run_waiting_for_the_last(runtime, agent, monkeypatch)
    await (runtime if here else other_worker).stop("default", THREAD, "r0")
    await asyncio.sleep(0.3)  # the signal delivered (it comes back to its sender too)
    held.go.set()
    second, written = await _next_run_driven(ending, starting, agent)
    assert second.cancel_reason is None
    verify_events(written)
    assert written[-1]["type"] == "RUN_FINISHED"
    assert "".join(e.get("delta", "") for e in written) == "one two"
