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
from structlog.testing import capture_logs

import copilot_runtime._runs
import copilot_runtime._shared_runs
from copilot_runtime import (
    ConfigurationError,
    CopilotRuntime,
    ThreadBusyError,
    coordinator,
    thread_store,
)
from copilot_runtime import events as ev
from copilot_runtime._exceptions import RateLimitedError, ServiceUnavailableError
from copilot_runtime._input import parse_run_input
from copilot_runtime._shared_runs import RecoverySweep, follow
from copilot_runtime.coordination.base import SignalHub
from copilot_runtime.events import Event
from copilot_runtime.testing import ScriptedAdapter, text_turn, verify_events
from copilot_runtime.threads import INTERRUPTED_CODE
from copilot_runtime.threads.base import Positioned
from tests.conftest import GatedAgent, poll
from tests.scale_support.cluster import eventually
from tests.scale_support.services import REDIS, postgres_schema, redis_prefix
from tests.test_store_outage import Proxy

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
    # The runtimes' own sweeps run too (they may win on a busy machine): counted by the log.
    with capture_logs() as logs:
        async for _ in poll(10, every=0.2):  # past the lease's expiry (later when busy)
            await asyncio.gather(*(s.sweep() for s in sweeps))
            if not await store.open_runs():
                break
        await asyncio.sleep(0.7)  # a second close would come within a sweep's interval
    closes = [e for e in logs if e["event"] == "closed a run its worker left open"]
    assert len(closes) == 1  # one worker wins
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


class _SlowReleases:
    """Two runtimes on one SQLite file and the PostgreSQL coordinator's counters (one slot a
    caller), whose slot releases take `delay` seconds (a busy database)."""

    def __init__(self, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from copilot_runtime import RateLimit

        self.delay = 0.0
        self.made = [CopilotRuntime(service_adapter=ScriptedAdapter(*[text_turn("hi")] * 4),
                                    thread_store=thread_store(f"sqlite:///{tmp_path}/t.db"),
                                    coordinator=url, rate_limit=RateLimit(concurrent_runs=1))
                     for _ in range(2)]
        for runtime in self.made:
            assert runtime.limiter is not None
            counters = runtime.limiter.backend
            monkeypatch.setattr(counters, "release", self._slowed(counters.release))

    def _slowed(self, release: Any) -> Any:
        async def slowly(key: str, token: str) -> None:
            await asyncio.sleep(self.delay)
            await release(key, token)
        return slowly

    async def run_to_its_end(self, runtime: CopilotRuntime, thread: str, request: Any
                             ) -> float:
        """Drive one run of `request`'s caller to its stream's end: how long its end took."""
        run = await runtime.start_run("default", run_input(thread, "r1"), request=request)
        events: list[Event] = []

        async def write(batch: Any) -> None:
            events.extend(batch)
        started = time.monotonic()
        await run.drive(write)
        assert events[-1]["type"] == ev.RUN_FINISHED
        return time.monotonic() - started


async def test_a_callers_slot_is_back_once_its_runs_stream_ended(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a run's end gave its caller's concurrency slot back in a task its stream's end
    did not wait for: a follow-up sent at once (a frontend tool's result) was refused 429
    RATE_LIMITED, on this worker or another, until the release's round trip was over."""
    from copilot_runtime.auth import RequestInfo

    workers = _SlowReleases(url, tmp_path, monkeypatch)
    request = RequestInfo(method="POST", path="/", headers={}, client="10.0.0.8")
    try:
        workers.delay = 0.05
        first, other = workers.made
        await workers.run_to_its_end(first, "slot-1", request)
        follow_up = await other.limiter.acquire(request)  # type: ignore[union-attr]
        await follow_up.release()
    finally:
        for runtime in workers.made:
            await runtime.aclose()


async def test_a_release_slower_than_the_runs_end_is_not_waited_for_by_the_next_run(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release slower than the run's end waits for (`GIVE_BACK_WAIT`): the stream ends at
    that bound, and the caller's next run meanwhile is refused at once, as over its limit
    (before, it waited for the release, unbounded and unaware of its client leaving); once
    the release is done, the caller has its slot."""
    from copilot_runtime.auth import RequestInfo

    workers = _SlowReleases(url, tmp_path, monkeypatch)
    request = RequestInfo(method="POST", path="/", headers={}, client="10.0.0.9")
    try:
        workers.delay = copilot_runtime._runs.GIVE_BACK_WAIT + 0.5
        first = workers.made[0]
        took = await workers.run_to_its_end(first, "slot-2", request)
        assert took < workers.delay, "the stream's end waited for the whole release"
        asked = time.monotonic()
        with pytest.raises(RateLimitedError):
            await first.limiter.acquire(request)  # type: ignore[union-attr]
        assert time.monotonic() - asked < 0.3, "the refusal waited for the release"
        await asyncio.sleep(workers.delay)
        follow_up = await first.limiter.acquire(request)  # type: ignore[union-attr]
        await follow_up.release()
    finally:
        for runtime in workers.made:
            await runtime.aclose()


async def test_a_runs_end_waits_once_for_its_thread_and_its_slot_given_back(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the stream's end waited up to `GIVE_BACK_WAIT` for its thread's lease to be
    given back, only then started giving its caller's slot back, and waited as long again:
    1 s, not 0.5 s, with a coordinator and limits backend both slow to answer."""
    from copilot_runtime.auth import RequestInfo

    workers = _SlowReleases(url, tmp_path, monkeypatch)
    request = RequestInfo(method="POST", path="/", headers={}, client="10.0.0.10")
    first = workers.made[0]
    let_go = first.runs.let_go

    async def slowly(lease: Any) -> None:
        await asyncio.sleep(workers.delay)
        await let_go(lease)
    monkeypatch.setattr(first.runs, "let_go", slowly)
    try:
        wait = copilot_runtime._runs.GIVE_BACK_WAIT
        workers.delay = 2 * wait
        took = await workers.run_to_its_end(first, "slot-3", request)
        assert took < wait + 0.25, f"the stream's end took {took:.2f} s"
        await asyncio.sleep(workers.delay)  # both given back meanwhile, in the background
    finally:
        for runtime in workers.made:
            await runtime.aclose()


@pytest.mark.parametrize("kind", ["postgresql", "redis"])
async def test_a_closed_runtimes_limits_refuse_a_start_as_unavailable(
        kind: str, tmp_path: Path) -> None:
    """Before: a run start counted after `aclose` on the coordinator's counters failed with
    a raw AttributeError (its connections gone: 'NoneType' object has no attribute ...)."""
    from copilot_runtime import RateLimit
    from copilot_runtime.auth import RequestInfo

    request = RequestInfo(method="POST", path="/", headers={}, client="10.0.0.11")
    places = postgres_schema("shared") if kind == "postgresql" else redis_prefix()
    with places as base:
        runtime = CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("hi")),
                                 thread_store=thread_store(f"sqlite:///{tmp_path}/t.db"),
                                 coordinator=base, rate_limit=RateLimit(
                                     concurrent_runs=1, runs_per_minute=5))
        await runtime.start()
        held = await runtime.limiter.acquire(request)  # type: ignore[union-attr]
        await runtime.aclose()
        with pytest.raises(ServiceUnavailableError):
            await runtime.limiter.acquire(request)  # type: ignore[union-attr]
        with pytest.raises(ServiceUnavailableError):
            await runtime.start_run("default", run_input("closed-1", "r1"), request=request)
        with capture_logs() as logs:
            await held.release()  # left to expire, as a slot still held at the close is
        assert not logs, logs


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

        async def written() -> bool:
            summary = await b.store.summary("t")  # type: ignore[union-attr]
            return summary is not None and summary.next_position > seen

        await eventually(written, deadline=5, what="the streamed words written")
        gate.set()
        async with asyncio.timeout(10):
            await driving
            await reading
        assert [(p, e["type"]) for p, e in got] == [
            (seen + 1, "TEXT_MESSAGE_CONTENT"), (seen + 2, "TEXT_MESSAGE_END"),
            (seen + 3, "RUN_FINISHED")]


# -- A follower whose run ended while it missed the `end` signal ------------------------------


class _Thread:
    """A thread store holding one thread's events (what `follow` reads of a store)."""

    def __init__(self) -> None:
        self.rows: list[Positioned] = []

    def add(self, *events: Event) -> None:
        first = len(self.rows)
        self.rows.extend((first + i, e) for i, e in enumerate(events))

    async def events_after(self, thread_id: str, after: int) -> list[Positioned]:
        return [row for row in self.rows if row[0] is not None and row[0] > after]


class _Holders:
    """A coordinator whose signals never come (its signal connection cut), and whose
    `follow` answers what `answer` says (an outage: ServiceUnavailableError)."""

    lease_ttl = 0.6

    def __init__(self, answer: Any) -> None:
        self.hub = SignalHub()
        self.answer = answer

    def subscribe(self, thread_id: str) -> Any:
        return self.hub.subscribe(thread_id)

    async def follow(self, thread_id: str) -> str | None:
        answer: str | None = self.answer()
        return answer


def _run_start(run: str) -> list[Event]:
    return [ev.run_started("t", run), ev.text_message_start(f"m-{run}"),
            ev.text_message_content(f"m-{run}", "words ")]


def _run_end(run: str, error: bool = False) -> list[Event]:
    return [ev.text_message_end(f"m-{run}"),
            ev.run_error("lost", code="LEASE_LOST") if error else ev.run_finished("t", run)]


async def _followed(coordinator: Any, store: _Thread, after: int = -1) -> list[Event]:
    got: list[Event] = []
    async with asyncio.timeout(5):
        async for batch in follow(coordinator, store, "t", after):  # type: ignore[arg-type]
            got.extend(e for _, e in batch)
    return got


@pytest.mark.parametrize("after", [-1, 6], ids=["whole", "inside"])
async def test_a_follower_ends_at_its_runs_end_read_while_the_coordinator_is_away(
        monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """The follower's coordinator stops answering (its `end` signal never comes, each poll
    is a 503) while the run ends on its worker, which stores RUN_FINISHED. Before, the
    follower read and sent RUN_FINISHED but stayed open for the whole outage (then followed
    the thread's next run in the same response); now it ends there."""
    monkeypatch.setattr(copilot_runtime._shared_runs, "POLL", 0.05)
    store = _Thread()
    store.add(*_run_start("r0"), *_run_end("r0"), *_run_start("r1"))
    polls = 0

    def answer() -> str:
        nonlocal polls
        polls += 1
        if polls == 1:
            return "r1"
        if polls == 3:
            store.add(*_run_end("r1"))
        raise ServiceUnavailableError("The coordinator cannot be reached")

    got = await _followed(_Holders(answer), store, after)
    assert got[-1] == ev.run_finished("t", "r1")
    assert [e["type"] for e in got].count("RUN_STARTED") == (2 if after < 0 else 0)


async def test_a_follower_resuming_inside_an_ended_run_follows_the_live_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the two tests around must not break: a resume inside a run that ended (its
    RUN_ERROR names no run) while the next one is live goes on to the live run's end."""
    monkeypatch.setattr(copilot_runtime._shared_runs, "POLL", 0.05)
    store = _Thread()
    store.add(*_run_start("r0"), *_run_end("r0", error=True))
    polls = 0

    def answer() -> str | None:
        nonlocal polls
        polls += 1
        if polls == 3:
            store.add(*_run_start("r1"))
        if polls == 5:
            store.add(*_run_end("r1"))
        return "r1" if polls < 5 else None

    got = await _followed(_Holders(answer), store, after=1)
    assert [e["type"] for e in got] == [
        "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END", "RUN_ERROR", "RUN_STARTED",
        "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END", "RUN_FINISHED"]


@pytest.mark.parametrize("r2_read_whole", [False, True], ids=["r2-running", "r2-finished"])
async def test_a_follower_of_a_dead_workers_run_ends_at_its_interrupted_end(
        monkeypatch: pytest.MonkeyPatch, r2_read_whole: bool) -> None:
    """r1's worker died: r1 is open in the store, its lease expired, so the follower follows
    no run when it connects. Then r2 takes the thread, closing r1 first (a RUN_ERROR that
    names no run). Before, the follower adopted r2 and streamed it after r1's end in the same
    response; now it ends at r1's RUN_ERROR."""
    monkeypatch.setattr(copilot_runtime._shared_runs, "POLL", 0.05)
    store = _Thread()
    store.add(*_run_start("r1"))
    polls = 0

    def answer() -> str | None:
        nonlocal polls
        polls += 1
        if polls == 2:
            store.add(ev.run_error("interrupted", code="RUN_INTERRUPTED"), *_run_start("r2"))
            if r2_read_whole:
                store.add(*_run_end("r2"))
        if polls == 4 and not r2_read_whole:
            store.add(*_run_end("r2"))
        return "r2" if 1 < polls < 4 else None

    got = await _followed(_Holders(answer), store)
    assert [e["type"] for e in got] == [
        "RUN_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "RUN_ERROR"]
    assert got[-1]["code"] == "RUN_INTERRUPTED"


@pytest.mark.parametrize("error", [False, True], ids=["finished", "error"])
async def test_a_follower_ends_with_its_run_when_another_run_holds_the_thread(
        monkeypatch: pytest.MonkeyPatch, error: bool) -> None:
    """The follower's `end` signal is lost, and its next poll finds the thread held by the
    thread's next run, whose start is stored after the followed run's end. Before, the
    follower switched to that run silently: its client got the two runs in one response
    (RUN_ERROR LEASE_LOST, then RUN_STARTED of another run). Now it ends with its run."""
    monkeypatch.setattr(copilot_runtime._shared_runs, "POLL", 0.05)
    store = _Thread()
    store.add(*_run_start("r1"))
    polls = 0

    def answer() -> str:
        nonlocal polls
        polls += 1
        if polls == 2:  # r1 ended, r2 took the thread, before r1's end was read
            store.add(*_run_end("r1", error), *_run_start("r2"))
            return "r2"
        return "r1" if polls == 1 else "r2"

    got = await _followed(_Holders(answer), store)
    assert [e["type"] for e in got][-2:] == ["TEXT_MESSAGE_END",
                                             "RUN_ERROR" if error else "RUN_FINISHED"]
    assert [e.get("runId") for e in got if e["type"] == "RUN_STARTED"] == ["r1"]


async def test_a_follower_cut_off_from_its_coordinator_ends_with_the_run(
        url: str, tmp_path: Path) -> None:
    """The hunt's case end to end: worker b follows a's run, then b's coordinator stops
    answering (its link to PostgreSQL dropped, the store's still there); a's run ends and
    is stored. Before, b's follower sent RUN_FINISHED and then stayed open for as long as
    the outage lasted; now its stream ends there."""
    proxy = Proxy()
    await proxy.up()
    agents = [GatedAgent(), GatedAgent()]
    store_url = f"sqlite:///{tmp_path}/threads.db"
    a = CopilotRuntime(agents={"default": agents[0]}, thread_store=thread_store(store_url),
                       coordinator=url)
    cut_off = coordinator(url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"))
    cut_off.timeout = 0.5  # type: ignore[attr-defined]
    b = CopilotRuntime(agents={"default": agents[1]}, thread_store=thread_store(store_url),
                       coordinator=cut_off)
    try:
        await a.start()
        await b.start()
        driving = asyncio.create_task(
            (await a.start_run("default", run_input("t", "r1"))).drive(_ignore))
        got: list[Event] = []

        async def read() -> None:
            async for batch in b.connect("default", "t"):
                got.extend(e for _, e in batch)

        reading = asyncio.create_task(read())
        await eventually(lambda: any(e.get("delta") == "one " for e in got), deadline=5,
                         what="the follower reading the run")
        proxy.hang()
        agents[0].gate.set()
        async with asyncio.timeout(5):
            await driving
            await reading
        assert [e["type"] for e in got][-2:] == ["TEXT_MESSAGE_END", "RUN_FINISHED"]
    finally:
        await proxy.down()
        for runtime in (a, b):
            await runtime.aclose()
