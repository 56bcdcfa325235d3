"""Every coordinator keeps the same promises: exclusive leases that are renewed while held,
expire when their worker is gone, and are released only by their holder; signals reach every
worker's subscriptions, and stop signals the stop handler; the callers' concurrency slots in
its counters expire with their worker too. Run against `local`, PostgreSQL and Redis (the
real services of this machine), each test on a schema or prefix of its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from copilot_runtime import ConfigurationError, RateLimit, coordinator
from copilot_runtime._deadline import within
from copilot_runtime._exceptions import RateLimitedError, ServiceUnavailableError
from copilot_runtime.auth import Principal, RequestInfo
from copilot_runtime.coordination import Coordinator, LocalCoordinator, Signal
from copilot_runtime.limits import CounterBackend, RateLimiter
from tests.scale_support.services import POSTGRES, postgres_schema, redis_prefix

pytestmark = pytest.mark.timeout(60)

TTL = 1.0

Pair = tuple[Coordinator, Coordinator]


@pytest.fixture(params=["local", "postgresql", "redis"])
def coordinator_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "local":
        yield "local"
    elif request.param == "postgresql":
        with postgres_schema("coord") as url:
            yield f"{url}&lease_ttl={TTL}"
    else:
        with redis_prefix() as url:
            yield f"{url}&lease_ttl={TTL}"


@pytest.fixture
async def pair(coordinator_url: str) -> AsyncIterator[Pair]:
    """Two workers: two coordinators on the same URL (one, for `local`)."""
    first = coordinator(coordinator_url)
    second = first if not first.shared else coordinator(coordinator_url)
    await asyncio.gather(first.start(), second.start())
    try:
        yield first, second
    finally:
        await first.aclose()
        await second.aclose()


async def eventually(check: Callable[[], object], deadline: float = 10.0) -> Any:
    """Poll an async or sync `check` until it returns something true (returned), failing
    after `deadline` s."""
    end = time.monotonic() + deadline
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > end:
            pytest.fail(f"not true within {deadline} s")
        await asyncio.sleep(0.05)


async def test_a_lease_is_exclusive_until_released(pair: Pair) -> None:
    a, b = pair
    lease = await a.acquire("t1", "r1")
    assert lease is not None
    assert lease.run_id == "r1"
    assert not lease.inherited
    assert await b.acquire("t1", "r2") is None
    assert await a.acquire("t1", "r3") is None
    assert await b.holder("t1") == "r1"
    other = await b.acquire("t2", "r4")  # another thread is free
    assert other is not None
    await a.release(lease)
    assert await b.holder("t1") is None
    again = await b.acquire("t1", "r2")
    assert again is not None
    assert await a.holder("t1") == "r2"
    await b.release(again)
    await b.release(other)


async def test_a_held_lease_is_renewed(pair: Pair) -> None:
    a, b = pair
    lease = await a.acquire("t1", "r1")
    assert lease is not None
    end = time.monotonic() + (2.5 * TTL if a.shared else 0.3)
    while time.monotonic() < end:
        assert await b.acquire("t1", "r2") is None
        assert await b.holder("t1") == "r1"
        await asyncio.sleep(0.2)
    await a.release(lease)


async def test_a_dead_workers_lease_expires(pair: Pair) -> None:
    a, b = pair
    if not a.shared:
        pytest.skip("one process: its leases die with it")
    lease = await a.acquire("t1", "r1")
    assert lease is not None
    started = time.monotonic()
    await a.aclose()  # renewals stop, as when the worker dies
    assert await b.acquire("t1", "r2") is None
    taken = await eventually(lambda: b.acquire("t1", "r2"), deadline=TTL + 5)
    assert time.monotonic() - started >= TTL * 0.8
    assert await b.holder("t1") == "r2"
    assert taken.inherited  # its run may still be open in the store
    await b.release(taken)
    clean = await b.acquire("t1", "r3")
    assert clean is not None
    assert not clean.inherited  # released, not expired
    await b.release(clean)


async def test_only_the_holder_releases(pair: Pair) -> None:
    a, b = pair
    if not a.shared:
        pytest.skip("one process: its leases die with it")
    lease = await a.acquire("t1", "r1")
    assert lease is not None
    await a.aclose()
    await eventually(lambda: b.acquire("t1", "r2"), deadline=TTL + 5)
    third = coordinator(_url_of(a))
    try:
        await third.release(lease)  # the old token: the successor keeps the thread
        assert await b.holder("t1") == "r2"
    finally:
        await third.aclose()


async def test_a_stop_asked_for_a_leases_run_is_known_to_every_worker(pair: Pair) -> None:
    """A worker that is asked to stop a run marks its lease, for the thread's next run on
    any worker to wait for its give-back rather than be refused; the mark names the run,
    and goes with its lease."""
    a, b = pair
    if not a.shared:
        pytest.skip("one process: its runs waited for already")
    asked: Any = b
    assert await asked.holder_stopping("t1") == (None, False)
    lease = await a.acquire("t1", "r1")
    assert lease is not None
    assert await asked.holder_stopping("t1") == ("r1", False)
    await asked.mark_stopping("t1", "r0")  # a run that no longer holds it: nothing
    assert await asked.holder_stopping("t1") == ("r1", False)
    await asked.mark_stopping("t1", "r1")
    assert await asked.holder_stopping("t1") == ("r1", True)
    assert await a.holder_stopping("t1") == ("r1", True)  # type: ignore[attr-defined]
    await a.release(lease)
    assert await asked.holder_stopping("t1") == (None, False)
    again = await b.acquire("t1", "r2")
    assert again is not None
    assert await asked.holder_stopping("t1") == ("r2", False)  # the next run's lease
    await b.release(again)


async def test_a_stop_mark_lives_as_long_as_its_lease(pair: Pair) -> None:
    """Before (Redis): the mark lived `lease_ttl` from the stop, however long its stopped
    run then held the lease (a slow store): the thread's next run was refused early."""
    a, b = pair
    if not a.shared:
        pytest.skip("one process: its runs waited for already")
    asked: Any = b
    lease = await a.acquire("t1", "r1")
    assert lease is not None
    await asked.mark_stopping("t1", "r1")
    await asyncio.sleep(TTL * 2.5)  # renewed meanwhile by its holder
    assert await asked.holder_stopping("t1") == ("r1", True)
    await a.release(lease)


async def test_a_stop_mark_goes_with_its_lease(pair: Pair) -> None:
    """Before (Redis): the mark outlived its lease, and a later lease of the same run id (a
    client's choice), never stopped, inherited it."""
    a, b = pair
    if not a.shared:
        pytest.skip("one process: its runs waited for already")
    asked: Any = b
    lease = await a.acquire("t1", "r1")
    assert lease is not None
    await asked.mark_stopping("t1", "r1")
    await a.release(lease)
    again = await a.acquire("t1", "r1")  # the same run id, anew
    assert again is not None
    assert await asked.holder_stopping("t1") == ("r1", False)
    await a.release(again)


def _url_of(coordinator_: Coordinator) -> str:
    url = getattr(coordinator_, "url", None)
    if url is not None:  # Redis
        return f"{url}{'&' if '?' in url else '?'}prefix={coordinator_.prefix}"  # type: ignore[attr-defined]
    conninfo: str = coordinator_.conninfo  # type: ignore[attr-defined]
    return f"{conninfo}{'&' if '?' in conninfo else '?'}schema={coordinator_.schema}"  # type: ignore[attr-defined]


async def test_signals_reach_every_workers_subscriptions(pair: Pair) -> None:
    a, b = pair
    assert await a.acquire("t1", "r1") is not None
    assert await b.follow("t1") == "r1"
    with b.subscribe("t1") as mine, b.subscribe("t2") as other, a.subscribe("t1") as own:
        sent = Signal("progress", "t1", "r1", 42)
        await a.publish(sent)
        assert await mine.get(5) == sent
        assert await own.get(5) == sent  # the sender's own workers hear it too
        await a.publish(Signal("end", "t1", "r1"))
        end = await mine.get(5)
        assert end is not None
        assert end.kind == "end"
        assert await other.get(0.2) is None
    assert await mine.get(0.05) is None  # closed: no more


async def test_stop_reaches_the_stop_handler_fast(pair: Pair) -> None:
    a, b = pair
    stops: list[tuple[Signal, float]] = []
    b.on_stop(lambda signal: stops.append((signal, time.monotonic())))
    sent = time.monotonic()
    await a.publish(Signal("stop", "t1", "r1"))
    await eventually(lambda: stops, deadline=5)
    signal, at = stops[0]
    assert (signal.kind, signal.thread_id, signal.run_id) == ("stop", "t1", "r1")
    assert at - sent < 1.0


def test_signals_survive_their_encoding() -> None:
    for signal in (Signal("progress", "thread ✓", "run", 7),
                   Signal("stop", "t", "r0", whole=True), Signal("stop", "t", "r0")):
        assert Signal.decode(signal.encode()) == signal
    # A stop of the previous version (no "w") is a stop of its run alone; its encoding is
    # unchanged, for workers of the previous version during a deploy.
    assert Signal.decode(b'{"k": "stop", "t": "t", "r": "r0", "p": null}') == Signal(
        "stop", "t", "r0")
    assert b'"w"' not in Signal("stop", "t", "r0").encode()
    for bad in (b"", b"[]", b'{"k": "boom", "t": "x"}', b'{"k": "end", "t": 1}',
                b'{"k": "end", "t": "x", "p": "9"}', b'{"k": "stop", "t": "x", "w": 1}'):
        assert Signal.decode(bad) is None


def test_urls_name_the_coordinator() -> None:
    assert isinstance(coordinator(), LocalCoordinator)
    assert isinstance(coordinator("local"), LocalCoordinator)
    assert not coordinator("local").shared
    with pytest.raises(ConfigurationError, match="Unknown coordinator URL"):
        coordinator("mysql://db")
    with pytest.raises(ConfigurationError, match="lease_ttl"):
        coordinator("redis://127.0.0.1:6379/0?lease_ttl=soon")
    with pytest.raises(ConfigurationError, match="schema"):
        coordinator("postgresql://db/x?schema=a;drop")
    pg = coordinator("postgresql://u@db:5432/x?schema=app&lease_ttl=3&sslmode=disable")
    assert pg.lease_ttl == 3.0
    assert pg.shared
    # A server that does not answer fails a connection attempt within seconds.
    assert pg.conninfo == (  # type: ignore[attr-defined]
        "postgresql://u@db:5432/x?sslmode=disable&connect_timeout=5"
        "&application_name=copilot-runtime%20coordinator&keepalives_idle=30"
        "&keepalives_interval=10&keepalives_count=3&tcp_user_timeout=60000")
    rd = coordinator("redis://h:6379/2?prefix=app:")
    assert rd.lease_ttl == 10.0
    assert rd.prefix == "app:"  # type: ignore[attr-defined]


@pytest.mark.parametrize("limit", [2])
async def test_rate_limits_are_shared_through_the_coordinator(pair: Pair, limit: int) -> None:
    a, b = pair
    first, second = a.counters(), b.counters()
    if first is None or second is None:
        assert not a.shared  # local: the limiter counts in this process
        return
    try:
        assert await first.acquire("k", limit, "run-1")
        assert await second.acquire("k", limit, "run-2")
        assert not await first.acquire("k", limit, "run-3")  # two taken, on two workers
        await second.release("k", "run-2")
        await second.release("k", "run-2")  # by token: once only, whatever is repeated
        assert await first.acquire("k", limit, "run-4")
        assert not await first.acquire("k", limit, "run-5")
        assert await first.hit("h", 2, 60) == 0.0
        assert await second.hit("h", 2, 60) == 0.0
        wait = await first.hit("h", 2, 60)
        assert 0 < wait <= 60
        # A hit given back (its run never started) frees its place, on every worker.
        assert await first.hit("g", 1, 60, token="start-1") == 0.0
        await second.unhit("g", "start-1")
        await second.unhit("g", "start-1")  # by token: once only
        assert await first.hit("g", 1, 60, token="start-2") == 0.0
        assert await second.hit("g", 1, 60, token="start-3") > 0
    finally:
        await first.aclose()
        await second.aclose()


def caller(principal: str) -> RequestInfo:
    return RequestInfo("POST", "/run", {}, "10.0.0.1", principal=Principal(principal))


def shared_counters(pair: Pair) -> tuple[CounterBackend, CounterBackend]:
    """Each worker's counters, whose slots live `TTL`."""
    first, second = pair[0].counters(), pair[1].counters()
    if first is None or second is None:
        pytest.skip("one process: its slots die with it (the limiter counts in it)")
    return first, second


async def test_a_dead_workers_concurrency_slot_frees_itself(pair: Pair) -> None:
    """Before: a slot was an anonymous count per caller that expired an hour after it was
    taken, so a worker killed mid-run (SIGKILL, OOM) kept its caller at 429 for that hour.
    Now its hold expires within the lease's ttl, while a live worker's holds are renewed."""
    counters = shared_counters(pair)
    dying, living = (RateLimiter(RateLimit(concurrent_runs=1, backend=c)) for c in counters)
    try:
        assert await dying.acquire(caller("alice")) is not None
        assert await living.acquire(caller("bob")) is not None  # held while bob's run lives
        await dying.aclose()  # the worker dies: its slot is neither renewed nor given back
        with pytest.raises(RateLimitedError):
            await living.acquire(caller("alice"))
        started = time.monotonic()
        lease = await eventually(lambda: _acquired(living, "alice"), deadline=TTL * 4)
        assert time.monotonic() - started >= TTL / 2  # expired, not forgotten at once
        await asyncio.sleep(TTL * 2)
        with pytest.raises(RateLimitedError):  # bob's and alice's live slots were renewed
            await living.acquire(caller("bob"))
        with pytest.raises(RateLimitedError):
            await living.acquire(caller("alice"))
        await lease.release()
    finally:
        await living.aclose()


async def _acquired(limiter: RateLimiter, principal: str) -> Any:
    try:
        return await limiter.acquire(caller(principal))
    except RateLimitedError:
        return None


class LosingAnswers:
    """A worker's counters whose server takes a slot, or gives one back, and whose answer
    is lost (a timeout): the call fails with 503 while the slot is taken."""

    def __init__(self, backend: CounterBackend) -> None:
        self.backend = backend
        self.lose_acquire = self.lose_release = False

    async def acquire(self, *args: Any) -> bool:
        await self.backend.acquire(*args)
        if self.lose_acquire:
            raise ServiceUnavailableError("The coordinator cannot be reached")
        return True

    async def release(self, *args: Any) -> None:
        if self.lose_release:
            raise ServiceUnavailableError("The coordinator cannot be reached")
        await self.backend.release(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


async def test_a_slot_whose_acquire_failed_is_not_kept(pair: Pair) -> None:
    """Before: a request whose slot was taken by a coordinator that answered too late got 503
    and the slot stayed taken for an hour. Now it is given back by its token (which frees no
    other run's slot), or else expires unrenewed."""
    counters = shared_counters(pair)
    losing = LosingAnswers(counters[0])
    limiter = RateLimiter(RateLimit(concurrent_runs=2, backend=losing))  # type: ignore[arg-type]
    other = RateLimiter(RateLimit(concurrent_runs=2, backend=counters[1]))
    try:
        held = await other.acquire(caller("alice"))  # another run's, which must stay held
        losing.lose_acquire = True
        with pytest.raises(ServiceUnavailableError):
            await limiter.acquire(caller("alice"))
        lease = await eventually(lambda: _acquired(other, "alice"), deadline=TTL)
        with pytest.raises(RateLimitedError):  # alice's first run still holds its slot
            await other.acquire(caller("alice"))
        assert held is not None
        await held.release()
        await lease.release()
    finally:
        await limiter.aclose()
        await other.aclose()


async def test_a_slot_that_cannot_be_given_back_is_logged_and_expires(pair: Pair) -> None:
    """Before: a release that kept failing (Redis away a minute at a run's end) gave up in
    silence and the caller got 429 for an hour. Now it is logged, and the slot, renewed no
    more, expires within the lease's ttl."""
    counters = shared_counters(pair)
    losing = LosingAnswers(counters[0])
    limiter = RateLimiter(RateLimit(concurrent_runs=1, backend=losing))  # type: ignore[arg-type]
    other = RateLimiter(RateLimit(concurrent_runs=1, backend=counters[1]))
    try:
        lease = await limiter.acquire(caller("alice"))
        assert lease is not None
        losing.lose_release = True
        with capture_logs() as logs, pytest.raises(ServiceUnavailableError):
            await lease.release()
        assert [e for e in logs if e["log_level"] == "warning"
                and "slot back" in e["event"]], logs
        again = await eventually(lambda: _acquired(other, "alice"), deadline=TTL * 4)
        await again.release()
    finally:
        await limiter.aclose()
        await other.aclose()


async def test_the_counters_tables_of_an_older_release_are_migrated() -> None:
    """A schema an older release made (an anonymous count per caller in rate_slots, no
    version) gets the slot holds table, versioned; rate_slots stays for the previous release's
    workers still running during the upgrade; connecting again changes nothing."""
    import psycopg

    with postgres_schema("coord") as url:
        schema = url.rsplit("schema=", 1)[1]
        async with await psycopg.AsyncConnection.connect(POSTGRES, autocommit=True) as conn:
            await conn.execute(f'CREATE SCHEMA "{schema}"')
            await conn.execute(f'CREATE TABLE "{schema}".rate_hits (key text NOT NULL, '
                               "at float8 NOT NULL, id text PRIMARY KEY)")
            await conn.execute(f'CREATE TABLE "{schema}".rate_slots (key text PRIMARY KEY, '
                               "taken integer NOT NULL, expires_at timestamptz NOT NULL)")
            await conn.execute(f'INSERT INTO "{schema}".rate_slots VALUES '
                               "('p:5:alice', 1, now() + interval '1 hour')")
        for _ in range(2):
            worker = coordinator(url)
            try:
                await worker.start()
                counters = worker.counters()
                assert counters is not None
                assert await counters.acquire("p:5:alice", 1, "run-1")
                assert not await counters.acquire("p:5:alice", 1, "run-2")
                await counters.release("p:5:alice", "run-1")
            finally:
                await worker.aclose()
        async with await psycopg.AsyncConnection.connect(POSTGRES, autocommit=True) as conn:
            version = await (await conn.execute(
                f'SELECT version FROM "{schema}".rate_limits_version')).fetchall()
            old = await (await conn.execute(
                f'SELECT key, taken FROM "{schema}".rate_slots')).fetchall()
        assert version == [(2,)]
        assert old == [("p:5:alice", 1)]


async def test_finish_releases_and_signals_the_end(pair: Pair) -> None:
    a, b = pair
    lease = await a.acquire("t1", "r1")
    assert lease is not None
    with b.subscribe("t1") as followers:
        assert await b.follow("t1") == "r1"
        assert await b.follow("t1") == "r1"  # again: still followed
        await a.finish(lease)
        end = await followers.get(5)
    assert end == Signal("end", "t1", "r1")
    assert await b.holder("t1") is None
    again = await b.acquire("t1", "r2")
    assert again is not None
    await b.release(again)


# -- Redis: the `open:` marker that says a lease expired unreleased --------------------------


@pytest.fixture
async def redis_pair() -> AsyncIterator[tuple[Any, Any, Any]]:
    """Two Redis coordinators on one prefix, and a plain client to look at their keys."""
    import redis.asyncio as aioredis

    with redis_prefix() as url:
        made = [coordinator(f"{url}&lease_ttl={TTL}") for _ in range(2)]
        client = aioredis.from_url(url.split("?")[0])
        try:
            yield made[0], made[1], client
        finally:
            for one in made:
                await one.aclose()
            await client.aclose()


async def test_a_dead_workers_open_marker_does_not_stay_forever(
        redis_pair: tuple[Any, Any, Any]) -> None:
    a, b, client = redis_pair
    lease = await a.acquire("t1", "r1")
    assert lease is not None
    marker = f"{a.prefix}open:t1"
    assert await client.exists(marker)
    await asyncio.sleep(TTL * 0.8)
    # While the lease is renewed, the marker lasts at least as long as it.
    assert await client.pttl(marker) > TTL * 1000
    await a.aclose()  # the worker dies before its run wrote anything the sweep could close

    async def expired() -> bool:
        return await b.holder("t1") is None

    await eventually(expired, deadline=TTL + 5)
    # The next run on the thread would learn it inherits; until then the marker waits, but
    # not forever (one for every thread a dead worker had, else).
    ttl = await client.pttl(marker)
    assert 0 < ttl <= (a.lease_ttl + a.open_ttl) * 1000
    taken = await b.acquire("t1", "r2")
    assert taken is not None
    assert taken.inherited
    await b.finish(taken)
    assert not await client.exists(marker)


async def test_a_released_lease_leaves_no_marker(redis_pair: tuple[Any, Any, Any]) -> None:
    a, _, client = redis_pair
    for release in (a.release, a.finish):
        lease = await a.acquire("t1", "r1")
        assert lease is not None
        await release(lease)
        assert not await client.exists(f"{a.prefix}open:t1")
        assert not await client.exists(f"{a.prefix}lease:t1")


async def test_long_expired_leases_are_forgotten(pair: Pair) -> None:
    """A lease its worker never released (it died before its run's start was written, so no
    sweep closes anything for it) is deleted once it has been expired long enough."""
    from copilot_runtime.coordination.postgres import PostgresCoordinator

    a, b = pair
    if not a.shared:
        pytest.skip("one process: its leases die with it")
    lease = await a.acquire("t-dead", "r1")
    assert lease is not None
    live = await b.acquire("t-live", "r2")
    assert live is not None
    await a.aclose()  # renewals stop, as when the worker dies
    await eventually(lambda: _expired(b, "t-dead"), deadline=TTL + 5)
    assert await b.forget_expired(3600) == 0  # expired, but not long enough ago
    on_postgres = isinstance(b, PostgresCoordinator)
    assert await b.forget_expired(0) == (1 if on_postgres else 0)  # Redis expires its own
    assert await b.holder("t-live") == "r2"  # a live lease is never touched
    taken = await b.acquire("t-dead", "r3")
    assert taken is not None
    if on_postgres:
        assert not taken.inherited  # the row is gone: nothing is left to inherit
    await b.release(taken)
    await b.release(live)


async def _expired(coordinator: Any, thread_id: str) -> bool:
    return await coordinator.holder(thread_id) is None


async def test_leases_asked_for_together(pair: Pair) -> None:
    """Many runs starting and ending at once (PostgreSQL takes and gives back the leases asked
    for meanwhile in one statement): each thread has one winner, each finish signals its end."""
    a, b = pair
    threads = [f"many{i}" for i in range(12)]
    subscriptions = [b.subscribe(t) for t in threads]
    asked = await asyncio.gather(*(a.acquire(t, f"{t}-a") for t in threads),
                                 *(b.acquire(t, f"{t}-b") for t in threads))
    for i, t in enumerate(threads):
        won = [lease for lease in (asked[i], asked[len(threads) + i]) if lease is not None]
        assert len(won) == 1, t
        assert await a.holder(t) == won[0].run_id
        assert await b.follow(t) == won[0].run_id
    winners = [lease for lease in asked if lease is not None]
    mine = [lease for lease in winners if lease.run_id.endswith("-a")]
    theirs = [lease for lease in winners if lease.run_id.endswith("-b")]
    await asyncio.gather(*(a.finish(x) for x in mine), *(b.finish(x) for x in theirs))
    for t, subscription in zip(threads, subscriptions, strict=True):
        assert await a.holder(t) is None
        if a.shared:
            signal = await subscription.get(5.0)
            assert signal is not None
            assert (signal.kind, signal.thread_id) == ("end", t)
        subscription.close()


async def test_signals_published_together_arrive_all_in_order(pair: Pair) -> None:
    a, b = pair
    assert await a.acquire("burst", "r") is not None
    assert await b.follow("burst") == "r"
    subscription = b.subscribe("burst")
    await asyncio.gather(*(a.publish(Signal("progress", "burst", "r", n)) for n in range(20)))
    got = [await subscription.get(5.0) for _ in range(20)]
    assert [s.position if s is not None else None for s in got] == list(range(20))
    subscription.close()


async def test_following_a_thread_without_a_run(pair: Pair) -> None:
    a, b = pair
    assert await b.follow("idle") is None
    lease = await a.acquire("idle", "r1")
    assert lease is not None
    assert await b.follow("idle") == "r1"
    await a.release(lease)
    assert await b.follow("idle") is None


async def test_only_the_runs_someone_follows_are_signalled(coordinator_url: str) -> None:
    """A signal reaches, and is decoded by, every worker (and PostgreSQL serializes the
    commits that NOTIFY): a run nobody follows sends none (its progress nor its end); a stop
    always goes, and a lease taken over after it expired is not followed by its old
    followers."""
    if not coordinator_url.startswith(("postgresql", "redis")):
        pytest.skip("the local coordinator signals within its process")
    a, b = coordinator(coordinator_url), coordinator(coordinator_url)
    await asyncio.gather(a.start(), b.start())
    try:
        with b.subscribe("quiet") as quiet, b.subscribe("busy") as busy:
            lease = await a.acquire("quiet", "r1")
            assert lease is not None
            await a.publish(Signal("progress", "quiet", "r1", 3))
            await a.finish(lease)
            assert await quiet.get(0.3) is None
            await a.publish(Signal("stop", "quiet", "r1"))
            stop = await quiet.get(5)
            assert stop is not None
            assert stop.kind == "stop"
            # A followed lease that expires (its worker died) and is taken by a new run.
            dead = coordinator(coordinator_url)
            assert await dead.acquire("busy", "r1") is not None
            assert await b.follow("busy") == "r1"
            await dead.aclose()  # stops renewing: the lease expires
            taken = await eventually(lambda: a.acquire("busy", "r2"), deadline=10)
            await a.publish(Signal("progress", "busy", "r2", 1))
            assert await busy.get(0.3) is None
            await a.finish(taken)
            assert await busy.get(0.3) is None
    finally:
        await a.aclose()
        await b.aclose()


#: Lease tables of earlier releases: before runs could be followed, and before stops were
#: marked (the real upgrade of the last release).
_EARLIER_LEASE_TABLES = {
    "before followers": ("", ""),
    "before stop marks": (", followed boolean NOT NULL DEFAULT false", ", true"),
}


@pytest.mark.parametrize("made_by", _EARLIER_LEASE_TABLES)
async def test_postgresql_lease_table_of_an_earlier_release_gets_its_columns(
        made_by: str) -> None:
    """A deployment's lease table of an earlier release is given the columns it lacks
    (`followed`, `stopped_run`), its lease still held."""
    import psycopg

    columns, values = _EARLIER_LEASE_TABLES[made_by]
    with postgres_schema("coordold") as url:
        schema = url.split("schema=")[1].split("&")[0]
        server = url.split("?")[0]
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            conn.execute(f'CREATE TABLE "{schema}".run_leases (thread_id text PRIMARY KEY, '
                         "run_id text NOT NULL, token text NOT NULL, worker text NOT NULL, "
                         f"expires_at timestamptz NOT NULL{columns})")
            conn.execute(f"INSERT INTO \"{schema}\".run_leases VALUES ('t', 'r0', 'k', 'w', "
                         f"now() + interval '1 hour'{values})")
        made: Any = coordinator(url)
        try:
            assert await made.follow("t") == "r0"
            lease = await made.acquire("t2", "r1")
            assert lease is not None
            assert await made.follow("t2") == "r1"
            assert await made.holder_stopping("t") == ("r0", False)
            await made.mark_stopping("t", "r0")
            assert await made.holder_stopping("t") == ("r0", True)
        finally:
            await made.aclose()


async def test_postgresql_coordinator_statements_are_never_compiled(coordinator_url: str) -> None:
    """Its statements touch a lease or a few; a plan's estimate over a lease table full of
    dead rows must not make PostgreSQL compile them (JIT: tens of ms a statement)."""
    if not coordinator_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only")
    made: Any = coordinator(coordinator_url)
    await made.start()
    try:
        assert await made._fetch("SHOW jit", ()) == [("off",)]
        for lane in (made._taking, made._ending):
            assert await made._fetch_on(lane, "SHOW jit", ()) == [("off",)]
    finally:
        await made.aclose()


async def test_redis_scripts_the_server_lost_are_sent_again() -> None:
    """A Redis server that restarted (or whose scripts were flushed) knows none of the
    coordinator's scripts: they are sent as text, so nothing fails."""
    import redis.asyncio as aioredis

    with redis_prefix() as url:
        a, b = coordinator(url), coordinator(url)
        await asyncio.gather(a.start(), b.start())
        admin = aioredis.from_url(url.split("?")[0])
        try:
            with b.subscribe("t") as signals:
                for run in ("r1", "r2"):
                    await admin.script_flush()
                    lease = await a.acquire("t", run)
                    assert lease is not None
                    assert await b.follow("t") == run
                    await a.publish(Signal("progress", "t", run, 1))
                    await a.finish(lease)
                    kinds = [await signals.get(5), await signals.get(5)]
                    assert [(s.kind, s.run_id) for s in kinds if s is not None] == [
                        ("progress", run), ("end", run)]
                await admin.script_flush()
                lease = await a.acquire("t", "r3")
                assert lease is not None
                await a.release(lease)
                assert await b.holder("t") is None
        finally:
            await admin.aclose()
            await a.aclose()
            await b.aclose()


async def test_redis_commands_share_a_bounded_pool() -> None:
    """redis-py's pool opened a connection per command in flight (41 after 40 releases at
    once, and a "Too many connections" failure past 100): the coordinator's commands now
    wait for one of `pool_size` connections, beside the one that listens for signals."""
    import redis.asyncio as aioredis

    with redis_prefix() as url:
        name = f"pool-{time.monotonic_ns()}"
        made = coordinator(f"{url}&pool_size=3&client_name={name}")
        await made.start()
        admin = aioredis.from_url(url.split("?")[0])
        try:
            leases = await asyncio.gather(*(made.acquire(f"t{i}", "r") for i in range(40)))
            assert all(lease is not None for lease in leases)
            await asyncio.gather(*(made.release(lease) for lease in leases if lease),
                                 *(made.holder(f"t{i}") for i in range(40)))
            assert all([await made.holder(f"t{i}") is None for i in range(40)])
            clients = [c for c in await admin.client_list() if c.get("name") == name]
            assert 2 <= len(clients) <= 4  # the listener, and at most 3 for commands
        finally:
            await admin.aclose()
            await made.aclose()
    with pytest.raises(ConfigurationError, match="pool_size"):
        coordinator("redis://127.0.0.1:6379/0?pool_size=0")


async def test_a_deadline_holds_against_a_block_that_cleans_up_slowly() -> None:
    """`within` is `asyncio.timeout` for a block that, cancelled, takes its time to clean up
    (psycopg asks a hung server to cancel the statement and waits up to 5 s): cancelled
    again, it gives up, and the caller gets its TimeoutError at the deadline."""
    task = asyncio.current_task()
    assert task is not None

    async def slow_to_give_up() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(5)  # interrupted by the second cancellation
            raise

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with within(0.2):
            await slow_to_give_up()
    assert time.monotonic() - started < 1.0
    assert task.cancelling() == 0  # the cancellations it sent are taken back
    async with within(0.2):
        await asyncio.sleep(0.01)  # in time: nothing happens
    await asyncio.sleep(0.3)  # and nothing after the block either

    # A cancellation from outside stays one.
    async def cancelled_from_outside() -> None:
        async with within(5):
            await asyncio.sleep(30)

    outside = asyncio.create_task(cancelled_from_outside())
    await asyncio.sleep(0.05)
    outside.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outside


async def test_close_does_not_wait_for_ever_on_a_task_that_ignores_its_cancellation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A task a client library keeps from ending (a cancellation swallowed in its read)
    held `aclose`, and with it a test's teardown or a server's shutdown, for ever."""
    from copilot_runtime.coordination import _shared

    monkeypatch.setattr(_shared, "CLOSE_TASKS_WITHIN", 0.3)
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                continue  # swallowed, as a buggy read would

    with redis_prefix() as url:
        made = coordinator(url)
        await made.start()
        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0.01)  # inside its sleep, where the cancellation is swallowed
        made._tasks.append(task)  # type: ignore[attr-defined]
        try:
            with capture_logs() as logs:
                async with asyncio.timeout(5):
                    await made.aclose()
            assert any("did not end" in entry["event"] for entry in logs)
        finally:
            release.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_store_a_coordinator_and_a_checkpointer_open_a_new_schema_at_once() -> None:
    """Each takes its own lock to create its tables: two creating the schema together
    failed one of them on the catalog's unique name (a hunt: the coordinator, 10 times in
    10), a worker then refusing to start."""
    from copilot_runtime import checkpointer, thread_store

    for _ in range(5):
        with postgres_schema("fresh") as url:
            store: Any = thread_store(url)
            shared: Any = coordinator(url)
            saver: Any = checkpointer(url)
            try:
                await asyncio.gather(store.open(), shared.start(), saver.ping())
            finally:
                await shared.aclose()
                await store.aclose()
                await saver.aclose()
