"""Liveness under a stalled worker and a run that ends while the next one starts.

D1: a worker whose event loop stalls longer than its lease (a GC pause, a swapped-out VM, an
`async` action that calls `time.sleep`) comes back after the recovery sweep of another
worker closed its run as interrupted, and after another run may have started on the thread
at the next positions. Its late writes (a flush of the run's events, then the finished run)
must not reach the thread: before, they reopened the closed run, stored it a second time and
overwrote the sweep's closing events and the next run's events at the same positions, so
every replay of the thread failed `verify_events` and its SSE ids repeated. Checked on each
durable store through its interface (deterministic: the sweep's part is `close_interrupted`),
and end to end with worker processes (SIGSTOP of the worker streaming a run).

D2: a `connect` follower on one worker of a run on another stopped right after the next
run's RUN_STARTED when that run began between the end of the one followed and the delivery
of its end signal: its stream ended in the middle of a run (now it ends with the end of
the run it followed, never reading into the next). Checked in one process, two
runtimes as two workers on one PostgreSQL store and coordinator, the end signal held until
the next run has started. Also: a `connect` arriving while the thread's last run is open with
no lease holder (its worker dead, not swept yet) returned at once in the middle of that run,
instead of waiting for the sweep's RUN_ERROR.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from copilot_runtime import CopilotRuntime, thread_store
from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events
from copilot_runtime._input import parse_run_input
from copilot_runtime._shared_runs import RecoverySweep
from copilot_runtime.coordination import Lease, Signal
from copilot_runtime.events import Event
from copilot_runtime.testing import MockOpenAIServer, ScriptedAdapter, text_turn, verify_events
from copilot_runtime.threads import INTERRUPTED_CODE, DurableThreadStore, StoredRun
from copilot_runtime.threads.base import Positioned
from tests.conftest import poll, run_input
from tests.scale_support.cluster import eventually, started_cluster
from tests.scale_support.services import POSTGRES, postgres_schema
from tests.test_multi_worker import answering, connect, data, read_all, start_run, thread_id

pytestmark = pytest.mark.timeout(60)

# -- D1, store level ---------------------------------------------------------------------

THREAD = "t-live"


def _run_events(run: str, pieces: int, thread: str = THREAD) -> list[Event]:
    """A whole run as its worker streams it: started, one message of `pieces`, finished."""
    return [
        ev.run_started(thread, run, {"threadId": thread, "runId": run, "messages": [
            {"id": f"u-{run}", "role": "user", "content": f"question {run}"}]}),
        ev.text_message_start(f"m-{run}"),
        *[ev.text_message_content(f"m-{run}", f"{run}.{i} ") for i in range(pieces)],
        ev.text_message_end(f"m-{run}"),
        ev.run_finished(thread, run),
    ]


@pytest.fixture(params=["sqlite", "postgresql"])
async def durable(request: pytest.FixtureRequest,
                  tmp_path: Path) -> AsyncIterator[DurableThreadStore]:
    """A fresh durable store: a SQLite file (which the worker processes of one machine
    share) or a PostgreSQL schema of its own."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            made = thread_store(f"sqlite:///{tmp_path}/threads.sqlite3")
        else:
            made = thread_store(stack.enter_context(postgres_schema("live")))
        assert isinstance(made, DurableThreadStore)
        try:
            yield made
        finally:
            await made.aclose()


def _increasing(rows: Sequence[Positioned], after: int) -> list[int]:
    """The positions of `rows` (an `events_after(after)`), checked strictly increasing and
    after `after`: the SSE ids a client gets never repeat nor go back."""
    positions = [p for p, _ in rows if p is not None]
    assert positions == sorted(set(positions)), f"ids repeat or go back: {positions}"
    assert all(p > after for p in positions), (after, positions)
    return positions


@pytest.mark.parametrize("late", ["flush", "finish", "both"])
@pytest.mark.parametrize("next_run", [True, False], ids=["next-run", "alone"])
async def test_a_stalled_workers_late_writes_leave_the_swept_run_closed(
        durable: DurableThreadStore, next_run: bool, late: str) -> None:
    """Run r1's worker stalled after writing positions 0..2; the sweep closed r1 as
    interrupted (its closing events at 3 and 4); run r2 started at 5 (`next-run`). Then the
    stalled worker wakes up and writes late: its pending flush of r1's positions 3..5
    and 6..7 (`flush`), its finished r1 (0..7, raw events 3..7: `finish`,
    the flush timer cancelled by the lease's loss), or both. Before, on PostgreSQL, the
    flush reopened r1 (listed by `open_runs` again, so swept again) and overwrote the
    sweep's closing chunk at 3; the finished run was stored as a second r1 (r1 ended twice:
    RUN_ERROR, then RUN_FINISHED after r2) or, past r2's positions, only its raw events
    replaced the sweep's chunk and r2's at 6: replays failed `verify_events`, their ids went
    back, and a resume inside r1 or r2 got the stale run's events."""
    store = durable
    r1 = _run_events("r1", 4)  # positions 0..7 as the stalled worker streamed them
    r2 = _run_events("r2", 3)  # positions 5..11 once r1 was closed at 4
    # r1 on the worker that stalls: its RUN_STARTED, then a flush.
    await store.append_events(THREAD, "default", "r1", 1.0, 0, r1[:1])
    await store.append_events(THREAD, "default", "r1", 1.0, 1, r1[1:3])
    # Its lease expired: another worker's sweep closes it.
    assert await store.close_interrupted(THREAD, "r1") is True
    head = await store.summary(THREAD)
    assert head is not None
    assert head.next_position == 5  # TEXT_MESSAGE_END at 3, RUN_ERROR at 4
    if next_run:
        # r2 starts on another worker at the next position and streams.
        await store.append_events(THREAD, "default", "r2", 2.0, 5, r2[:1])
        await store.append_events(THREAD, "default", "r2", 2.0, 6, r2[1:3])
    # The stalled worker wakes up: its flush of what it streamed meanwhile ...
    flushed = 3
    if late in ("flush", "both"):
        await store.append_events(THREAD, "default", "r1", 1.0, 3, r1[3:6])
        assert (THREAD, "r1") not in await store.open_runs(), "r1 was reopened"
        # ... and the next one, past the positions the sweep wrote (a fence by position
        # alone let it reopen r1 and overwrite r2's chunk at 6).
        await store.append_events(THREAD, "default", "r1", 1.0, 6, r1[6:8])
        flushed = 8
        assert (THREAD, "r1") not in await store.open_runs(), "r1 was reopened"
    # ... and its finished run, with its raw events not flushed yet.
    if late in ("finish", "both"):
        await store.append_run(THREAD, "default", StoredRun(
            "r1", compact_events(r1), 1.0, 0, 0, len(r1) - 1), ["u-r1", "m-r1"],
            raw_first=flushed, raw=r1[flushed:])
    assert await store.open_runs() == ([(THREAD, "r2")] if next_run else [])
    if next_run:
        await store.append_run(THREAD, "default", StoredRun(
            "r2", compact_events(r2), 2.0, 0, 5, 5 + len(r2) - 1), ["u-r2", "m-r2"],
            raw_first=8, raw=r2[3:])
    assert await store.open_runs() == []

    record = await store.get(THREAD)
    assert record is not None
    assert [(r.run_id, r.first_position, r.last_position) for r in record.runs] == \
        [("r1", 0, 4), ("r2", 5, 11)][:2 if next_run else 1]
    swept = record.runs[0].events
    verify_events(swept)
    assert swept[-1]["type"] == "RUN_ERROR"
    assert swept[-1]["code"] == INTERRUPTED_CODE
    assert record.next_position == (12 if next_run else 5)
    if next_run:
        assert record.runs[1].events == compact_events(r2)

    # A replay from the start is valid, with ids that never repeat.
    everything = await store.events_after(THREAD, -1)
    verify_events([e for _, e in everything])
    _increasing(everything, -1)
    assert [e["type"] for _, e in everything if e["type"].startswith("RUN_")] == \
        ["RUN_STARTED", "RUN_ERROR", "RUN_STARTED", "RUN_FINISHED"][:4 if next_run else 2]
    # A client that saw r1 up to 2 gets the sweep's closing events, then r2.
    rest = await store.events_after(THREAD, 2)
    _increasing(rest, 2)
    assert [(p, e["type"]) for p, e in rest[:2]] == [(3, "TEXT_MESSAGE_END"), (4, "RUN_ERROR")]
    assert [e for _, e in rest[2:]] == (compact_events(r2) if next_run else [])
    # One that saw r2 up to any position gets exactly the rest of r2 (intact).
    for seen in range(5, 11 if next_run else 5):
        assert await store.events_after(THREAD, seen) == \
            [(p, r2[p - 5]) for p in range(seen + 1, 12)], f"resumed after {seen}"
    for seen in range(-1, record.next_position):
        # (at or past the sweep's closing events, an id named an event the stalled worker
        # sent and never wrote: its client gets every closing event, `resumed_at`)
        _increasing(await store.events_after(THREAD, seen), 2 if seen in (3, 4) else seen)


# -- D1, worker processes ----------------------------------------------------------------

#: The workers' lease: a stall longer than this lets another worker's sweep close the run.
STALL_TTL = 2.0


@pytest.fixture
async def llm() -> AsyncIterator[MockOpenAIServer]:
    async with MockOpenAIServer(chunks=40) as server:
        yield server


async def _sql(schema: str, query: str, *args: Any) -> list[tuple[Any, ...]]:
    """`query`'s rows in the threads' `schema`."""
    async with await psycopg.AsyncConnection.connect(POSTGRES, autocommit=True) as conn:
        await conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        return await (await conn.execute(query.encode(), args)).fetchall()


async def test_a_worker_stopped_past_its_lease_does_not_rewrite_the_thread(
        llm: MockOpenAIServer, tmp_path: Path) -> None:
    """Worker A streams r1 and is frozen (SIGSTOP) past its lease; B's sweep closes r1 as
    interrupted and r2 starts on B; A is resumed (SIGCONT) while r2 streams. Before, A's late
    writes stored r1 a second time over r2's positions: the thread had three runs (r1, r2,
    r1), and the replay on every worker failed `verify_events` ("TEXT_MESSAGE_CONTENT after
    the run ended") with ids that went back."""
    with postgres_schema("live") as threads:
        schema = threads.split("schema=")[1]
        async with started_cluster(2, tmp_path, llm_url=llm.base_url, threads=threads,
                                   coordinator=f"{threads}&lease_ttl={STALL_TTL}",
                                   auth=False) as cluster:
            stalled = cluster.workers[0]
            process = stalled.process
            assert process is not None
            thread = thread_id()
            first = await start_run(cluster, 0, thread, "r1", "slow:150 the answer A streams")
            head1 = await answering(first)
            await asyncio.sleep(0.5)  # A has flushed some of the answer
            process.send_signal(signal.SIGSTOP)
            try:
                await eventually(lambda: _sql(schema, "SELECT run_id FROM runs WHERE "
                                              "thread_id = %s AND NOT open", thread),
                                 deadline=STALL_TTL + 8, what="r1 closed by B's sweep")
                # (the sweep closes r1 under a lease of its own, given back just after:
                # a run asked for in between is busy, on a loaded machine seen once)
                async for _ in poll(5, 0.1):
                    second = await cluster.post(cluster.workers[1], "/agent/default/run",
                                                run_input("slow:50 the answer B streams",
                                                          thread=thread, run="r2"))
                    if second.status != 409:
                        break
                    second.release()
                assert second.status == 200, await second.text()
                head2 = await answering(second)
            finally:
                process.send_signal(signal.SIGCONT)
            # A's client gets the end of r1 once A's writes are done (stored before sent).
            async with asyncio.timeout(20):
                frames1, frames2 = await asyncio.gather(read_all(first, head1),
                                                        read_all(second, head2))
            assert data(frames2)[-1]["type"] == "RUN_FINISHED"
            assert data(frames1)[-1]["type"] in ("RUN_FINISHED", "RUN_ERROR")
            for index in (0, 1):
                frames = await connect(cluster, index, thread)
                events = data(frames)
                verify_events(events)
                ids = [int(i) for i, _ in frames if i is not None]
                assert ids == sorted(set(ids)), f"ids repeat or go back: {ids}"
                assert [(e["type"], e.get("code")) for e in events
                        if e["type"] in ("RUN_FINISHED", "RUN_ERROR")] == \
                    [("RUN_ERROR", INTERRUPTED_CODE), ("RUN_FINISHED", None)]
            # Each run stored once.
            rows = await _sql(schema, "SELECT run_id, open FROM runs WHERE thread_id = %s "
                              "ORDER BY seq", thread)
            assert rows == [("r1", False), ("r2", False)], rows


# -- D2, followers -----------------------------------------------------------------------


@pytest.fixture
def shared() -> Iterator[tuple[str, str]]:
    """(threads URL, coordinator URL) on a PostgreSQL schema of their own."""
    with postgres_schema("live") as threads:
        yield threads, f"{threads}&lease_ttl=5"


@pytest.fixture
def shared_short_lease() -> Iterator[tuple[str, str]]:
    """`shared` with a 2 s lease: a run without holder is swept once it stayed so for one."""
    with postgres_schema("live") as threads:
        yield threads, f"{threads}&lease_ttl=2"


def _input(thread: str, run: str) -> Any:
    return parse_run_input({"threadId": thread, "runId": run, "messages": [
        {"id": f"{run}-u", "role": "user", "content": "hi"}]})


async def _ignore(batch: Sequence[Event]) -> None:
    return None


async def _collect(stream: AsyncIterator[Sequence[Positioned]], into: list[Event]) -> None:
    async for batch in stream:
        into.extend(e for _, e in batch)


def _started(events: list[Event]) -> list[str]:
    return [e["runId"] for e in events if e["type"] == "RUN_STARTED"]


async def test_a_follower_ends_with_its_run_when_the_next_begins_before_the_end_signal(
        shared: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker A finishes r1 and releases the thread, r2 starts on B, and only then does
    A's end signal for r1 reach the follower on B. At first the follower read r1's last
    events with r2's RUN_STARTED and stopped there: its stream ended in the middle of r2
    ("the events end before RUN_FINISHED or RUN_ERROR"); then it followed r2 to its end, two
    runs in one response (a client resuming it took r2 for r1's continuation). Now it ends
    with r1's end, and r2 is the next `connect`'s. (The followers' slow poll, which could
    see r2 holding the thread before the end signal arrives, is made slower so the order is
    the one tested.)"""
    threads, coordination = shared
    monkeypatch.setattr("copilot_runtime._shared_runs.POLL", 10.0)
    a, b = (CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("an ", "answer ", text)),
                           thread_store=thread_store(threads), coordinator=coordination)
            for text in ("from A", "from B"))
    released, deliver = asyncio.Event(), asyncio.Event()
    held = a.coordinator

    async def finish_holding_the_end(lease: Lease) -> None:
        # The lease is released at once, the end signalled only when the test says.
        await held.release(lease)
        released.set()
        await deliver.wait()
        await held.publish(Signal("end", lease.thread_id, lease.run_id))

    monkeypatch.setattr(held, "finish", finish_holding_the_end)
    received: list[Event] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        await a.start()
        await b.start()
        first = await a.start_run("default", _input("t-follow", "r1"))
        tasks.append(asyncio.create_task(_collect(b.connect("default", "t-follow"), received)))
        follower = tasks[-1]
        await eventually(lambda: _started(received) == ["r1"], deadline=5,
                         what="the follower on B in r1")
        tasks.append(asyncio.create_task(first.drive(_ignore)))
        async with asyncio.timeout(5):
            await released.wait()  # r1 is stored and its thread free; its end not signalled
        second = await b.start_run("default", _input("t-follow", "r2"))
        deliver.set()
        async with asyncio.timeout(5):
            await follower
        verify_events(received)
        assert _started(received) == ["r1"]
        assert received[-1]["type"] == "RUN_FINISHED"
        await second.drive(_ignore)
        again: list[Event] = []
        async with asyncio.timeout(5):
            await _collect(b.connect("default", "t-follow"), again)
        assert _started(again) == ["r1", "r2"]
        async with asyncio.timeout(5):
            await tasks[1]
    finally:
        deliver.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await a.aclose()
        await b.aclose()


async def test_connect_to_a_run_left_open_waits_for_the_sweep(
        shared_short_lease: tuple[str, str]) -> None:
    """A run stays open with no lease holder (its worker died, its lease expired) until a
    sweep closes it. Before, a `connect` arriving then found nobody to follow and ended at
    once after the run's events so far, in the middle of a message; now it waits (bounded)
    for the sweep's RUN_ERROR."""
    threads, coordination = shared_short_lease
    runtime = CopilotRuntime(service_adapter=ScriptedAdapter(),
                             thread_store=thread_store(threads), coordinator=coordination)
    received: list[Event] = []
    follower: asyncio.Task[None] | None = None
    try:
        await runtime.start()
        store = runtime.runs.durable
        assert store is not None
        # What the dead worker had written: its run's start and part of an answer.
        await store.append_events("t-dead", "default", "r-dead", time.time(), 0, [
            ev.run_started("t-dead", "r-dead", {"threadId": "t-dead", "runId": "r-dead",
                                                "messages": []}),
            ev.text_message_start("m-dead"),
            ev.text_message_content("m-dead", "half an ans")])
        follower = asyncio.create_task(_collect(runtime.connect("default", "t-dead"),
                                                received))
        await eventually(lambda: len(received) == 3, deadline=5, what="the run so far")
        # Before, the follower had ended by now (it waits for nothing).
        await asyncio.wait({follower}, timeout=0.5)
        # (A sweep closes a run without a holder once it has stayed so for a lease's life:
        # a coordinator that lost its state has no holder either for a live run.)
        sweep = RecoverySweep(store, runtime.runs.active, runtime.coordinator)
        closed = 0
        async for _ in poll(10, every=0.2):
            closed += await sweep.sweep()
            if closed:
                break
        assert closed == 1
        async with asyncio.timeout(10):
            await follower
        verify_events(received)
        assert received[-1]["type"] == "RUN_ERROR"
        assert received[-1]["code"] == INTERRUPTED_CODE
    finally:
        if follower is not None:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
        await runtime.aclose()
