"""The shared coordinator loses its state, or its signal connection, while runs are live.

A coordinator's state can vanish under running workers: Redis restarted without
persistence, failed over, or restored; PostgreSQL's lease rows deleted or restored. A
worker learns that its lease is gone only at its next renewal (every third of `lease_ttl`),
and a worker's signal connection (LISTEN, SUBSCRIBE) can be cut, or silently stop
forwarding, while another worker signals it. Two runtimes in this process act as two
workers on one PostgreSQL thread store (a schema of their own), coordinated by PostgreSQL
(the same schema) or Redis (a key prefix of their own). What used to break:

- D1: once the coordinator's keys or lease rows had vanished, another worker took a second
  run on a thread whose run still streamed (a fresh lease, not inherited): two runs at once
  at overlapping positions. Now refused (THREAD_BUSY) while the store holds a run open; the
  first run ends LEASE_LOST at its worker's next renewal, and then the thread is free.
- D2: the recovery sweep took "open in the store, no lease holder" for a dead worker and
  closed that live run as interrupted (then stored it again, several times). Now an open
  run without a holder is closed only once it stayed so for a lease's life.
- D3: a `stop` sent from another worker while the driving worker's signal connection was
  being opened again was lost for good; now it is sent again while the run holds its thread.
- D4 (Redis): a pub/sub connection that stopped forwarding without closing (a NAT or a
  firewall forgetting an idle flow) was never noticed, so every later stop was lost; now the
  listener pings it after `_PING_EVERY` seconds of silence and opens it again.
- D5 (PostgreSQL store): raw events' end stamps and their pruning used each worker's clock,
  so a worker whose clock ran ahead deleted every worker's raw events (a worker behind had
  its own pruned early): exact `Last-Event-ID` resumes replayed whole runs. Now the
  database's clock.

Each test is timed so that it fails on the code before these fixes (cd69280) and takes a
few seconds after them: `lease_ttl` is short, the Redis ping intervals are patched down,
and the lease loss is staged right after a renewal, so that no renewal lands in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis

from copilot_runtime import CopilotRuntime, ThreadBusyError, coordinator, thread_store
from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events
from copilot_runtime._input import parse_run_input
from copilot_runtime._runs import ActiveRun
from copilot_runtime._shared_runs import RecoverySweep
from copilot_runtime.adapters.base import ChatDelta, ChatRequest, StreamEnd, TextDelta
from copilot_runtime.coordination import LEASE_LOST_CODE, Lease
from copilot_runtime.events import Event
from copilot_runtime.testing import ScriptedAdapter, text_turn, verify_events
from copilot_runtime.threads import INTERRUPTED_CODE, DurableThreadStore, StoredRun
from copilot_runtime.threads.base import Positioned
from tests.conftest import poll
from tests.scale_support.cluster import eventually
from tests.scale_support.services import POSTGRES, REDIS, postgres_schema, redis_prefix
from tests.test_hostile_liveness import _run_events
from tests.test_store_outage import Flow, Proxy

pytestmark = pytest.mark.timeout(60)
#: The longest a test's body may wait (seconds), well inside its time limit: a wait that never
#: ends fails there, in the event loop, and the workers and proxies are still closed (the time
#: limit's signal left their sockets open for the later tests of the process to trip on).
BODY_WITHIN = 30.0

#: The workers' lease (seconds): renewed every second, so a lost lease is noticed fast.
TTL = 3.0
THREAD = "t-state"
#: Seconds the first run would stream if nothing stopped it: longer than any wait below.
STREAMS_FOR = 20.0


class Trickle:
    """A model that answers slowly: a piece of text every `every` seconds, `pieces` of
    them (a run that streams until something stops it)."""

    provider = "trickle"

    def __init__(self, pieces: int = int(STREAMS_FOR / 0.05), every: float = 0.05) -> None:
        self.pieces = pieces
        self.every = every

    async def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        for index in range(self.pieces):
            await asyncio.sleep(self.every)
            yield [TextDelta(f"{index} ")]
        yield [StreamEnd("stop")]

    async def aclose(self) -> None:
        return None


def _input(thread: str, run: str) -> Any:
    return parse_run_input({"threadId": thread, "runId": run, "messages": [
        {"id": f"{run}-u", "role": "user", "content": f"question {run}"}]})


@dataclass
class Workers:
    """Two runtimes as two workers: `a` streams the first run, `b` is the other worker."""

    kind: str
    a: CopilotRuntime
    b: CopilotRuntime
    #: The threads' (and PostgreSQL coordinator's) schema.
    schema: str
    #: The Redis key prefix (Redis only).
    prefix: str

    async def wipe(self) -> None:
        """The coordinator loses every lease it held (and Redis its `open:` markers): a
        restart without persistence, a failover, a restore."""
        if self.kind == "redis":
            client = aioredis.from_url(REDIS)
            try:
                keys = [key async for key in client.scan_iter(match=f"{self.prefix}*")]
                assert keys, "no lease to lose"
                await client.delete(*keys)
            finally:
                await client.aclose()
        else:
            async with await psycopg.AsyncConnection.connect(POSTGRES, autocommit=True) as conn:
                cursor = await conn.execute(f'DELETE FROM "{self.schema}".run_leases')
                assert cursor.rowcount > 0, "no lease to lose"

    def renewals(self, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
        """Set after each renewal of `a`'s leases (cleared by the caller): a lease lost just
        after one is noticed by `a` only a third of `TTL` later."""
        renewed = asyncio.Event()
        held = self.a.coordinator
        renew: Callable[[list[Lease]], Awaitable[set[str]]] = held._renew  # type: ignore[attr-defined]

        async def renew_and_say(leases: list[Lease]) -> set[str]:
            try:
                return await renew(leases)
            finally:
                renewed.set()

        monkeypatch.setattr(held, "_renew", renew_and_say)
        return renewed


@contextlib.asynccontextmanager
async def workers(kind: str, *, ttl: float = TTL,
                  a_url: Callable[[str], str] = lambda url: url) -> AsyncIterator[Workers]:
    """Workers a and b on a fresh PostgreSQL schema, coordinated by `kind` (`a_url` makes
    the coordinator URL of `a` from the shared one)."""
    with contextlib.ExitStack() as stack:
        threads = stack.enter_context(postgres_schema("stateloss"))
        schema = threads.split("schema=")[1]
        prefix = ""
        if kind == "redis":
            base = stack.enter_context(redis_prefix())
            prefix = base.split("prefix=")[1]
        else:
            base = threads
        shared = f"{base}&lease_ttl={ttl}"
        a = CopilotRuntime(service_adapter=Trickle(), thread_store=thread_store(threads),
                           coordinator=a_url(shared))
        b = CopilotRuntime(service_adapter=ScriptedAdapter(
            *[text_turn("an ", "answer ", "from B")] * 4), thread_store=thread_store(threads),
            coordinator=shared)
        async with contextlib.AsyncExitStack() as closing:
            # Each closed whatever the other's closing raised: a runtime left open kept its
            # Redis and PostgreSQL sockets past the test (and its schema from being dropped).
            closing.push_async_callback(b.aclose)
            closing.push_async_callback(a.aclose)
            await a.start()
            await b.start()
            yield Workers(kind, a, b, schema, prefix)


@dataclass
class Streaming:
    """A run driven in a task, with what its client got."""

    run: ActiveRun
    sent: list[Event]
    task: asyncio.Task[None]

    async def ended(self, within: float = 10.0) -> list[Event]:
        async with asyncio.timeout(within):
            await self.task
        return self.sent


async def streaming(runtime: CopilotRuntime, thread: str, run_id: str) -> Streaming:
    """Run `run_id` started on `runtime` and streaming (some text sent already)."""
    run = await runtime.start_run("default", _input(thread, run_id))
    sent: list[Event] = []

    async def write(batch: Sequence[Event]) -> None:
        sent.extend(batch)

    driven = Streaming(run, sent, asyncio.create_task(run.drive(write)))
    await eventually(lambda: sum(e["type"] == "TEXT_MESSAGE_CONTENT" for e in sent) >= 3,
                     deadline=5, what=f"{run_id} streaming")
    return driven


async def _ignore(batch: Sequence[Event]) -> None:
    return None


async def replay(runtime: CopilotRuntime, thread: str) -> list[Positioned]:
    """The thread from its start, as a client reloading it gets it, checked: valid, and
    with ids (positions) that never repeat nor go back."""
    rows = [row async for batch in runtime.connect("default", thread) for row in batch]
    verify_events([e for _, e in rows])
    positions = [p for p, _ in rows if p is not None]
    assert positions == sorted(set(positions)), f"ids repeat or go back: {positions}"
    return rows


def ends(rows: Sequence[Positioned]) -> list[tuple[str, str | None]]:
    """Each run's start and end in a replay: (type, run id or error code)."""
    return [(e["type"], e.get("runId") if e["type"] == "RUN_STARTED" else e.get("code"))
            for _, e in rows if e["type"] in ("RUN_STARTED", "RUN_FINISHED", "RUN_ERROR")]


async def stored_runs(runtime: CopilotRuntime, thread: str) -> list[tuple[str, int, int]]:
    record = await runtime.store.get(thread)
    assert record is not None
    return [(r.run_id, r.first_position, r.last_position) for r in record.runs]


COORDINATORS = ["postgresql", "redis"]

# -- D1: a second run over a live run -------------------------------------------------------


@pytest.mark.parametrize("kind", COORDINATORS)
async def test_no_second_run_while_the_first_streams_after_the_coordinator_lost_its_state(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run r1 streams on worker A; the coordinator loses its leases (A learns it at its next
    renewal, up to a third of `lease_ttl` later). Before, worker B took run r2 on the thread
    at once (a fresh lease: nothing said the thread was busy), so two runs streamed on it
    at overlapping positions, and followers and resumes got the two mixed. Now B is refused
    (THREAD_BUSY) until r1 has ended, LEASE_LOST; r2 then follows r1 in the thread."""
    async with workers(kind) as w:
        renewed = w.renewals(monkeypatch)
        first = await streaming(w.a, THREAD, "r1")
        with pytest.raises(ThreadBusyError):  # the coordinator knows r1 holds the thread
            await w.b.start_run("default", _input(THREAD, "r2"))
        renewed.clear()
        await renewed.wait()
        await w.wipe()
        second: ActiveRun | None = None
        refused = 0
        async for _ in poll(TTL + 5, every=0.05):
            try:
                second = await w.b.start_run("default", _input(THREAD, "r2"))
            except ThreadBusyError:
                refused += 1
                continue
            break
        assert second is not None, "the thread never became free again"
        async with second:
            assert first.run.terminated, \
                f"r2 began on B while r1 still streamed on A (refused {refused} times)"
            assert refused > 0
            sent = await first.ended()
            assert (sent[-1]["type"], sent[-1].get("code")) == ("RUN_ERROR", LEASE_LOST_CODE)
            await second.drive(_ignore)
        rows = await replay(w.b, THREAD)
        assert ends(rows) == [("RUN_STARTED", "r1"), ("RUN_ERROR", LEASE_LOST_CODE),
                              ("RUN_STARTED", "r2"), ("RUN_FINISHED", None)]
        (r1, first_at, last1), (r2, first2, _) = await stored_runs(w.b, THREAD)
        assert (r1, r2, first_at) == ("r1", "r2", 0)
        assert first2 == last1 + 1, "the runs' positions overlap"


@pytest.mark.parametrize("kind", COORDINATORS)
async def test_a_worker_that_stalled_past_its_lease_sends_nothing_more(kind: str) -> None:
    """Worker A stalls longer than `lease_ttl` while r1 streams (a blocked event loop, a
    paused machine), so another worker may take the thread meanwhile. Before, A woke and
    went on streaming r1 (text the thread never kept, at positions of the other worker's
    run) until a renewal's answer said the lease was gone, or for good where nobody took it.
    Now r1 stops at its first batch after the stall, LEASE_LOST, and the thread is free."""
    ttl = 1.0
    async with workers(kind, ttl=ttl) as w:
        first = await streaming(w.a, THREAD, "r1")
        before = len(first.sent)
        time.sleep(ttl + 0.3)  # noqa: ASYNC251 - the stall itself: the whole loop stops
        sent = await first.ended()
        assert [e["type"] for e in sent[before:]] == ["TEXT_MESSAGE_END", "RUN_ERROR"], \
            sent[before:]
        assert sent[-1].get("code") == LEASE_LOST_CODE
        second: ActiveRun | None = None
        async for _ in poll(ttl + 5, every=0.05):
            with contextlib.suppress(ThreadBusyError):
                second = await w.b.start_run("default", _input(THREAD, "r2"))
                break
        assert second is not None, "the thread never became free again"
        async with second:
            await second.drive(_ignore)
        rows = await replay(w.b, THREAD)
        assert [end for end in ends(rows) if end[0] != "RUN_ERROR"] == [
            ("RUN_STARTED", "r1"), ("RUN_STARTED", "r2"), ("RUN_FINISHED", None)]


# -- D2: the sweep and a live run without a holder -------------------------------------------


@pytest.mark.parametrize("kind", COORDINATORS)
async def test_the_sweep_leaves_a_live_run_whose_lease_vanished(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run r1 streams on worker A when the coordinator loses its leases. Before, worker B's
    recovery sweep found r1 open in the store with no lease holder and closed it at once as
    interrupted, while A streamed on: A's later writes reopened it, so the thread held r1
    two or three times (RUN_INTERRUPTED, then LEASE_LOST), each with the answer again. Now
    the sweep leaves it: A ends it LEASE_LOST at its next renewal, and it is stored once."""
    async with workers(kind) as w:
        renewed = w.renewals(monkeypatch)
        first = await streaming(w.a, THREAD, "r1")
        sweep = RecoverySweep(w.b.runs.durable, w.b.runs.active, w.b.coordinator)
        assert await sweep.sweep() == 0  # r1's lease is held
        renewed.clear()
        await renewed.wait()
        await w.wipe()
        swept: list[int] = []
        async for _ in poll(TTL + 5, every=0.05):
            swept.append(await sweep.sweep())
            if first.task.done():
                break
        assert sum(swept) == 0, f"the sweep closed r1 while it streamed on A: {swept}"
        sent = await first.ended()
        assert (sent[-1]["type"], sent[-1].get("code")) == ("RUN_ERROR", LEASE_LOST_CODE)
        assert await sweep.sweep() == 0
        store = w.b.runs.durable
        assert store is not None
        assert await store.open_runs() == []
        assert [r for r, _, _ in await stored_runs(w.b, THREAD)] == ["r1"]
        rows = await replay(w.b, THREAD)
        assert ends(rows) == [("RUN_STARTED", "r1"), ("RUN_ERROR", LEASE_LOST_CODE)]
        # Stored as its client got it: every piece of text once, in order.
        text = [e["delta"] for e in sent if e["type"] == "TEXT_MESSAGE_CONTENT"]
        assert "".join(e["delta"] for _, e in rows if e["type"] == "TEXT_MESSAGE_CONTENT") \
            == "".join(text)


@pytest.mark.parametrize("kind", COORDINATORS)
async def test_a_run_without_a_holder_is_swept_only_after_a_lease_s_life(kind: str) -> None:
    """A run open in the store with no lease holder, and none coming back (its worker died
    with the coordinator's state). Before, the first sweep closed it; now it is closed only
    once no holder showed up for `lease_ttl` (a live worker has ended it by then), and then
    as interrupted."""
    ttl = 1.0
    with contextlib.ExitStack() as stack:
        threads = stack.enter_context(postgres_schema("stateloss"))
        base = stack.enter_context(redis_prefix()) if kind == "redis" else threads
        store = thread_store(threads)
        assert isinstance(store, DurableThreadStore)
        held = coordinator(f"{base}&lease_ttl={ttl}")
        try:
            await store.append_events(THREAD, "default", "r-left", time.time(), 0, [
                ev.run_started(THREAD, "r-left", {"threadId": THREAD, "runId": "r-left",
                                                  "messages": []}),
                ev.text_message_start("m-left"), ev.text_message_content("m-left", "half")])
            sweep = RecoverySweep(store, set(), held)
            loop = asyncio.get_running_loop()
            found = loop.time()
            closed = 0
            async for _ in poll(ttl + 5, every=0.1):
                closed = await sweep.sweep()
                if closed:
                    break
            assert closed == 1
            assert loop.time() - found >= ttl, "closed before a lease's life without holder"
            assert await store.open_runs() == []
            rows = await store.events_after(THREAD, -1)
            verify_events([e for _, e in rows])
            assert (rows[-1][1]["type"], rows[-1][1].get("code")) == \
                ("RUN_ERROR", INTERRUPTED_CODE)
        finally:
            await held.aclose()
            await store.aclose()


# -- D3: a stop while the signal connection reopens ------------------------------------------


def _named(name: str) -> Callable[[str], str]:
    return lambda url: f"{url}&client_name={name}"


async def _drop_signal_connections(w: Workers, name: str) -> None:
    """End worker A's signal connection from the server's side (and, on PostgreSQL, every
    LISTEN session of this schema's channel: B's too, which B's stop does not use); return
    once the server has let go of it, so nothing sent from now on reaches it."""
    if w.kind == "redis":
        client = aioredis.from_url(REDIS, decode_responses=True)
        try:
            ids = [c["id"] for c in await client.client_list()
                   if c["name"] == name and int(c["sub"]) > 0]
            assert len(ids) == 1, ids
            await client.client_kill_filter(_id=ids[0])
            await eventually(lambda: _gone(client, ids[0]), deadline=5,
                             what="the subscriber connection killed")
        finally:
            await client.aclose()
        return
    listen = f'LISTEN "copilot_runtime_{w.schema}"'
    async with await psycopg.AsyncConnection.connect(POSTGRES, autocommit=True) as conn:
        rows = await (await conn.execute(
            "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
            "application_name = 'copilot-runtime coordinator' AND query = %s",
            (listen,))).fetchall()
        assert len(rows) == 2, rows  # A's and B's
        assert all(ok for _, ok in rows), rows
        pids = [pid for pid, _ in rows]

        async def gone() -> bool:
            left = await (await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)",
                (pids,))).fetchone()
            return left is not None and left[0] == 0

        await eventually(gone, deadline=5, what="the LISTEN sessions ended")


async def _gone(client: Any, client_id: str) -> bool:
    return all(c["id"] != client_id for c in await client.client_list())


@pytest.mark.parametrize("kind", COORDINATORS)
async def test_a_stop_sent_while_the_signal_connection_reopens_is_not_lost(kind: str) -> None:
    """The server ends worker A's signal connection (pg_terminate_backend of its LISTEN
    session; CLIENT KILL of its pub/sub connection) while A streams r1, and a stop is asked
    on worker B right away, before A listens again (a second later). Before, B answered
    `stopped: true` and the stop was lost: r1 streamed on to its natural end. Now B sends
    it again while r1 holds the thread, and r1 ends within a couple of seconds."""
    name = f"stateloss-a-{uuid.uuid4().hex[:8]}"
    async with workers(kind, a_url=_named(name) if kind == "redis" else lambda u: u) as w:
        first = await streaming(w.a, THREAD, "r1")
        await _drop_signal_connections(w, name)
        asked = time.monotonic()
        assert await w.b.stop("default", THREAD) is True
        await eventually(lambda: first.run.cancel_reason == "stop", deadline=6,
                         what="the stop asked on B reaching A")
        took = time.monotonic() - asked
        sent = await first.ended()
        assert sent[-1]["type"] == "RUN_FINISHED"
        assert took < 6
        assert ends(await replay(w.b, THREAD)) == [("RUN_STARTED", "r1"),
                                                   ("RUN_FINISHED", None)]


# -- D4 (Redis): a pub/sub connection that silently stops forwarding -------------------------


@dataclass(eq=False)
class SilencingProxy(Proxy):
    """A TCP proxy to Redis (or PostgreSQL) whose subscribed connections (those that sent
    SUBSCRIBE, or LISTEN) can be silenced: what either side sends is swallowed, and both
    sockets stay open (no FIN, no RST), as when a NAT or a firewall forgets an idle flow."""

    def __init__(self, target: int = 6379) -> None:
        super().__init__(target)
        #: The connections that subscribed, in order.
        self.subscribed: list[Flow] = []
        self._subscribe = b"SUBSCRIBE" if target == 6379 else b"LISTEN"

    def silence(self) -> int:
        for flow in self.subscribed:
            flow.silent = True
        return len(self.subscribed)

    def _passes(self, flow: Flow, data: bytes, upstream: bool) -> bool:
        if upstream and self._subscribe in data.upper() and flow not in self.subscribed:
            self.subscribed.append(flow)
        return not flow.silent

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        # Their sockets closed, not their tasks cancelled (asyncio logs a handler cancelled).
        for sockets in self._sockets:
            for sink in sockets:
                sink.close()
        if self._links:
            _, late = await asyncio.wait(self._links, timeout=5)
            # A link still pumping (one accepted as the proxy closed, its sockets not yet
            # listed): cancelled, so that its own `finally` closes both of its sockets.
            for link in late:
                link.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


@pytest.fixture(params=[6379])
async def silencing(request: pytest.FixtureRequest) -> AsyncIterator[SilencingProxy]:
    proxy = SilencingProxy(request.param)
    await proxy.up()
    try:
        yield proxy
    finally:
        await proxy.aclose()


async def test_a_silently_dropped_pubsub_connection_is_noticed_and_reopened(
        silencing: SilencingProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker A's Redis pub/sub connection stops forwarding anything, both ends open, while
    A streams r1; a stop is asked on worker B. Before, A never noticed (nothing is written on
    a subscribed connection, so nothing fails): that stop, and every later one, was lost and
    r1 streamed on to its end. Now A pings its connection after `_PING_EVERY` seconds of
    silence, takes one whose answer does not come within `_PONG_WITHIN` as dead, and opens
    it again; B's stop, sent again meanwhile, reaches A. (The intervals are patched down
    from 10 s and 5 s; `raising=False`: before the fix they did not exist.)"""
    monkeypatch.setattr("copilot_runtime.coordination.redis._PING_EVERY", 0.5, raising=False)
    monkeypatch.setattr("copilot_runtime.coordination.redis._PONG_WITHIN", 0.5, raising=False)
    through = f"127.0.0.1:{silencing.port}"
    async with workers("redis", a_url=lambda url: url.replace("127.0.0.1:6379", through)
                       ) as w, asyncio.timeout(BODY_WITHIN):
        await eventually(lambda: len(silencing.subscribed) == 1, deadline=5,
                         what="A subscribed through the proxy")
        first = await streaming(w.a, THREAD, "r1")
        assert silencing.silence() == 1
        asked = time.monotonic()
        assert await w.b.stop("default", THREAD) is True
        await eventually(lambda: first.run.cancel_reason == "stop", deadline=8,
                         what="the stop asked on B reaching A")
        took = time.monotonic() - asked
        assert len(silencing.subscribed) == 2, "A did not subscribe again"
        assert not silencing.subscribed[1].silent
        sent = await first.ended()
        assert sent[-1]["type"] == "RUN_FINISHED"
        assert took < 8


@pytest.mark.parametrize("silencing", [5432], indirect=True)
async def test_a_silent_listen_connection_is_noticed_and_reopened(
        silencing: SilencingProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """D4 on PostgreSQL: worker A's LISTEN connection stops forwarding anything, both ends
    open, while A streams r1; a stop is asked on worker B. Before, A never noticed (its
    listener only waited for notifications): it stayed ready, and the stop never reached r1,
    which streamed on to its end. Now a listener that heard nothing for `_PING_EVERY`
    seconds sends a query on its connection; no answer within `_PONG_WITHIN` is a lost
    connection: A is not ready until it listens again, and B's stop, sent again meanwhile,
    reaches A. (The intervals are patched down from 10 s and 5 s, as for Redis.)"""
    monkeypatch.setattr("copilot_runtime.coordination.postgres._PING_EVERY", 0.5,
                        raising=False)
    monkeypatch.setattr("copilot_runtime.coordination.postgres._PONG_WITHIN", 0.5,
                        raising=False)
    through = f"127.0.0.1:{silencing.port}"
    async with workers("postgresql", a_url=lambda url: url.replace(
            "127.0.0.1:5432", through)) as w, asyncio.timeout(BODY_WITHIN):
        await eventually(lambda: len(silencing.subscribed) == 1, deadline=5,
                         what="A listening through the proxy")
        first = await streaming(w.a, THREAD, "r1")
        assert silencing.silence() == 1
        asked = time.monotonic()
        assert await w.b.stop("default", THREAD) is True

        async def deaf() -> bool:
            return "coordinator" in await w.a.unready()

        await eventually(deaf, deadline=4, what="A not ready while deaf")
        await eventually(lambda: first.run.cancel_reason == "stop", deadline=8,
                         what="the stop asked on B reaching A")
        took = time.monotonic() - asked
        assert len(silencing.subscribed) == 2, "A did not listen again"
        assert not silencing.subscribed[1].silent
        sent = await first.ended()
        assert sent[-1]["type"] == "RUN_FINISHED"
        assert took < 8
        assert await w.a.unready() == []


# -- D5 (PostgreSQL store): raw events pruned by a worker's clock ----------------------------


class SkewedClock:
    """The `time` module as the PostgreSQL store's module sees it: its wall clock off by
    `offset` seconds while one store's calls run (the two stores are used in turn)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @contextlib.contextmanager
    def off_by(self, seconds: float) -> Iterator[None]:
        self.offset = seconds
        try:
            yield
        finally:
            self.offset = 0.0


async def _stream_and_finish(store: DurableThreadStore, thread: str, run: str) -> list[Event]:
    """A run written as a worker writes it: flushed twice as it streams, then finished
    with the rest of its raw events (the finish prunes old raw events)."""
    events = _run_events(run, 6, thread)
    await store.append_events(thread, "default", run, time.time(), 0, events[:1])
    await store.append_events(thread, "default", run, time.time(), 1, events[1:5])
    await store.append_run(thread, "default", StoredRun(
        run, compact_events(events), time.time(), 0, 0, len(events) - 1),
        [f"u-{run}", f"m-{run}"], raw_first=5, raw=events[5:])
    return events


@pytest.mark.parametrize("skew", ["pruner-ahead", "writer-behind"])
async def test_raw_events_outlive_a_worker_whose_clock_is_off(
        skew: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stores (two workers) on one schema; one's wall clock is an hour off. Before,
    the raw events' end stamps and the prune's cutoff came from each worker's clock: a
    worker an hour ahead deleted, at its first finished run, the raw events of the run
    another worker had just finished (`pruner-ahead`); a worker an hour behind stamped its
    own in the past, and the other worker's prune deleted them (`writer-behind`). A resume
    inside that run (`Last-Event-ID`) then replayed the whole run again. Now both come from
    the database's clock: the run's exact rest is still there."""
    clock = SkewedClock()
    monkeypatch.setattr("copilot_runtime.threads.postgres.time", clock)
    with postgres_schema("stateloss") as url:
        kept, other = thread_store(url), thread_store(url)
        assert isinstance(kept, DurableThreadStore)
        assert isinstance(other, DurableThreadStore)
        try:
            if skew == "pruner-ahead":
                events = await _stream_and_finish(kept, "t-kept", "r-kept")
                with clock.off_by(3600.0):
                    await _stream_and_finish(other, "t-other", "r-other")
            else:
                with clock.off_by(-3600.0):
                    events = await _stream_and_finish(kept, "t-kept", "r-kept")
                await _stream_and_finish(other, "t-other", "r-other")
            for store in (kept, other):
                for seen in (2, 6):
                    assert await store.events_after("t-kept", seen) == \
                        [(p, events[p]) for p in range(seen + 1, len(events))], \
                        f"the raw events were pruned: a resume after {seen} replays the run"
        finally:
            await kept.aclose()
            await other.aclose()
