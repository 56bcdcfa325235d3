"""Workers that shut down or die under their runs, and a coordinator that cannot be reached,
seen from the other workers of one deployment (worker processes on their own ports sharing
PostgreSQL, coordinated by PostgreSQL or Redis, as in `test_multi_worker`).

A rolling restart (SIGTERM of the worker streaming a run) closes the run as interrupted
(`RUN_ERROR` coded `RUN_INTERRUPTED`), stores it and releases its lease before the worker's
store and coordinator close: every later replay of the thread is valid, the thread takes a
new run at once and the worker exits within its grace period. A follower on another worker
of a run whose worker is killed ends with the recovery sweep's `RUN_ERROR`, not with a stream
cut in the middle of a message. `connect` while the coordinator cannot be reached is a 503
with `Retry-After`, not a 200 whose body is cut. Two followers marking the same PostgreSQL
lease at once both see the live run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest

from copilot_runtime import coordinator
from copilot_runtime._shared_runs import POLL
from copilot_runtime.testing import MockOpenAIServer, verify_events
from copilot_runtime.threads.base import INTERRUPTED_CODE
from tests.conftest import poll, run_input, text_of
from tests.scale_support.cluster import Cluster, eventually, started_cluster
from tests.scale_support.services import POSTGRES, postgres_schema, redis_prefix
from tests.test_multi_worker import (
    TTL,
    answering,
    connect,
    connect_body,
    data,
    read_all,
    start_run,
    thread_id,
)
from tests.test_store_outage import Proxy

#: uvicorn's `timeout_graceful_shutdown` in `copilot_runtime serve`: how long a worker told
#: to stop waits for its open requests before it cancels them.
GRACE = 5.0
#: A lease that outlives the rolling restart tests by far: a thread free again before it
#: could expire was released, not waited out.
LONG_TTL = 30.0
#: The answer of a run these tests cut: 40 pieces, 0.3 s apart (12 s).
LONG_ANSWER = "slow:300 a long answer, cut before its end"

Frames = list[tuple[str | None, dict[str, Any]]]


@pytest.fixture
async def llm() -> AsyncIterator[MockOpenAIServer]:
    """The mock LLM, its answers in 40 pieces (a slow one streams for longer than the
    workers' grace period)."""
    async with MockOpenAIServer(chunks=40) as server:
        yield server


def workers(count: int, logs: Path, llm: MockOpenAIServer, threads: str,
            coordination: str) -> contextlib.AbstractAsyncContextManager[Cluster]:
    """`count` worker processes sharing `threads` and `coordination`, stopped at the end."""
    return started_cluster(count, logs, llm_url=llm.base_url, threads=threads,
                           coordinator=coordination, auth=False)


@contextlib.asynccontextmanager
async def reading(response: aiohttp.ClientResponse, head: bytes = b""
                  ) -> AsyncIterator[asyncio.Task[Frames]]:
    """A task reading a stream to its end; cancelled (and the response closed) if the test
    leaves before it ended."""
    task = asyncio.create_task(read_all(response, head))
    try:
        yield task
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await task
        response.close()


def terminal(events: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """Each run's end in a replay: its type, and its code if it is an error."""
    return [(e["type"], e.get("code")) for e in events
            if e["type"] in ("RUN_FINISHED", "RUN_ERROR")]


@pytest.fixture(params=["postgresql", "redis"])
def long_leases(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(threads URL, coordinator URL): PostgreSQL threads, leases of `LONG_TTL`."""
    with postgres_schema("workers") as threads:
        if request.param == "postgresql":
            yield threads, f"{threads}&lease_ttl={LONG_TTL}"
        else:
            with redis_prefix() as coordination:
                yield threads, f"{coordination}&lease_ttl={LONG_TTL}"


@pytest.mark.timeout(60)
async def test_a_rolling_restart_closes_its_run_as_interrupted_and_frees_the_thread(
        long_leases: tuple[str, str], llm: MockOpenAIServer, tmp_path: Path) -> None:
    """SIGTERM of the worker streaming a run, followed from another worker. Before, uvicorn
    cancelled the run after its grace period and the run was stored closed without any end
    (every later replay failed `verify_events`: "RUN_STARTED while a run is already
    started"), while the shutdown closed the coordinator and the store under the run's
    release: the thread answered 409 until its lease expired and the follower's stream
    stopped in the middle of a message once it had. The worker exits within its grace period
    (the prober saw one take 16 s)."""
    threads, coordination = long_leases
    async with workers(2, tmp_path, llm, threads, coordination) as cluster:
        restarted, other = cluster.workers
        thread = thread_id()
        running = await start_run(cluster, 0, thread, "r1", LONG_ANSWER)
        await answering(running)
        follower = await cluster.post(other, "/agent/default/connect", connect_body(thread))
        assert follower.status == 200, await follower.text()
        async with reading(follower, await answering(follower)) as followed:
            process = restarted.process
            assert process is not None
            process.terminate()
            signalled = time.monotonic()
            try:
                await eventually(lambda: process.poll() is not None, deadline=GRACE + 2,
                                 what="the worker's exit after its grace period")
            finally:
                restarted.kill()
                running.close()
            # The follower on the other worker hears the run's end.
            done, _ = await asyncio.wait({followed}, timeout=5)
            assert done, "the follower on the other worker heard no end of the run"
            events = data(followed.result())
        assert terminal(events) == [("RUN_ERROR", INTERRUPTED_CODE)], events[-3:]
        verify_events(events)
        # The thread takes a new run at once (its lease released, not expired).
        response: aiohttp.ClientResponse | None = None
        async for attempt in poll(3.0, every=0.1):
            response = await cluster.post(other, "/agent/default/run",
                                          run_input("and now", thread=thread,
                                                    run=f"r2-{attempt}"))
            if response.status != 409:
                break
            await response.read()
        assert response is not None
        assert response.status == 200, await response.text()
        assert data(await read_all(response))[-1]["type"] == "RUN_FINISHED"
        assert time.monotonic() - signalled < GRACE + 5 < LONG_TTL
        # Every replay is valid: the cut run ends as interrupted, the next one finished.
        replay = data(await connect(cluster, 1, thread))
        verify_events(replay)
        assert terminal(replay) == [("RUN_ERROR", INTERRUPTED_CODE), ("RUN_FINISHED", None)]
        assert any(e["type"] == "TEXT_MESSAGE_CONTENT" for e in replay)


@pytest.mark.timeout(60)
async def test_a_follower_of_a_killed_workers_run_ends_with_its_interruption(
        llm: MockOpenAIServer, tmp_path: Path) -> None:
    """SIGKILL of the worker streaming a run, followed from another worker. Before, the
    follower stopped as soon as the run's lease expired, and unless a recovery sweep had
    closed the run just before, its 200 ended in the middle of a message with no
    `RUN_FINISHED` or `RUN_ERROR` (a client cannot tell that from a finished stream). The
    sweep's first pass after the lease expired is held back here (its taking of the lease
    waits for the test's lock on the lease's row) until the follower has polled the lease
    more than once: the order that a sweep every 5 s (the default lease) gives most of the
    time."""
    with postgres_schema("workers") as threads:
        async with workers(2, tmp_path, llm, threads, f"{threads}&lease_ttl={TTL}") as cluster:
            killed, other = cluster.workers
            thread = thread_id()
            running = await start_run(cluster, 0, thread, "r1", LONG_ANSWER)
            await answering(running)
            follower = await cluster.post(other, "/agent/default/connect",
                                          connect_body(thread))
            assert follower.status == 200, await follower.text()
            async with reading(follower, await answering(follower)) as followed:
                killed.kill()
                running.close()
                schema = threads.split("schema=")[1]
                async with await psycopg.AsyncConnection.connect(POSTGRES) as conn, \
                        conn.transaction():
                    row = await (await conn.execute(
                        "SELECT extract(epoch FROM expires_at - clock_timestamp()) "
                        f'FROM "{schema}".run_leases WHERE thread_id = %s FOR UPDATE',
                        (thread,))).fetchone()
                    assert row is not None, "the run's lease"
                    # Until the follower has seen the lease expire (it polls it every POLL
                    # seconds, which nothing outside the worker can observe), or has ended.
                    await asyncio.wait({followed}, timeout=max(float(row[0]), 0.0) + 2 * POLL)
                events = data(await asyncio.wait_for(followed, TTL + 10))
    assert events[-1]["type"] == "RUN_ERROR", [e["type"] for e in events[-3:]]
    assert events[-1]["code"] == INTERRUPTED_CODE
    assert any(e["type"] == "TEXT_MESSAGE_CONTENT" for e in events)
    verify_events(events)


def _through(url: str, port: int) -> str:
    """`url` on 127.0.0.1:`port` (the proxy), its user, database and options kept."""
    parts = urllib.parse.urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    return parts._replace(netloc=f"{user}@127.0.0.1:{port}" if user
                          else f"127.0.0.1:{port}").geturl()


@pytest.fixture(params=[5432, 6379], ids=["postgresql", "redis"])
async def proxied(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, Proxy]]:
    """(threads URL, coordinator URL through a proxy, the proxy): PostgreSQL threads reached
    directly, the coordinator (PostgreSQL or Redis) through a proxy that can be cut."""
    proxy = Proxy(request.param)
    await proxy.up()
    try:
        with postgres_schema("workers") as threads:
            if request.param == 5432:
                yield threads, _through(threads, proxy.port), proxy
            else:
                with redis_prefix() as coordination:
                    yield threads, _through(coordination, proxy.port), proxy
    finally:
        await proxy.down()


@pytest.mark.timeout(60)
async def test_connect_while_the_coordinator_is_away_is_a_503(
        proxied: tuple[str, str, Proxy], llm: MockOpenAIServer, tmp_path: Path) -> None:
    """The coordinator's server cannot be reached (its connections cut, new ones refused)
    when a client connects to a stored thread. Before, the 200 and the SSE head were sent
    first and the coordinator's failure came after them: a body cut after 5 s (logged as
    "ASGI callable returned without completing response"), where `run` and `stop` answered
    503 with `Retry-After: 1`."""
    threads, coordination, proxy = proxied
    async with workers(1, tmp_path, llm, threads, coordination) as cluster:
        thread = thread_id()
        await read_all(await start_run(cluster, 0, thread, "r1", "hello"))
        await proxy.down()
        started = time.monotonic()
        response = await cluster.post(cluster.workers[0], "/agent/default/connect",
                                      connect_body(thread))
        assert response.status == 503, response.headers
        assert response.headers["retry-after"] == "1"
        assert await response.json() == {"error": "Service unavailable",
                                         "message": "The coordinator cannot be reached",
                                         "code": "SERVICE_UNAVAILABLE"}
        assert time.monotonic() - started < GRACE + 2
        # Once it is back, the thread is followed again.
        await proxy.up()
        replay: list[dict[str, Any]] = []
        async for _ in poll(10.0, every=0.2):
            response = await cluster.post(cluster.workers[0], "/agent/default/connect",
                                          connect_body(thread))
            if response.status == 200:
                replay = data(await read_all(response))
                break
            assert response.status == 503, await response.text()
            await response.read()
        assert text_of(replay) == "echo: hello"
        assert terminal(replay) == [("RUN_FINISHED", None)]


async def _waiting_for_a_lock(schema: str) -> bool:
    """Whether a statement on `schema`'s tables waits for a row lock."""
    async with await psycopg.AsyncConnection.connect(POSTGRES, autocommit=True) as conn:
        row = await (await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE %s", (f"%{schema}%",))).fetchone()
        return row is not None and row[0] > 0


@pytest.mark.timeout(30)
async def test_two_followers_marking_a_postgresql_lease_at_once_both_see_the_run() -> None:
    """A follower's `follow()` while another follower's marking of the same lease row is not
    committed yet (two tabs, a reconnect storm): its UPDATE waits for the other, then skips
    the row (already marked), while its SELECT reads the snapshot from before (not marked
    yet). Before, it found no live run and that client's `connect` ended at once, the run
    still streaming."""
    with postgres_schema("workers") as url:
        shared = coordinator(f"{url}&lease_ttl={LONG_TTL}")
        await shared.start()
        try:
            lease = await shared.acquire("t-race", "run-1")
            assert lease is not None
            schema = url.split("schema=")[1]
            async with await psycopg.AsyncConnection.connect(POSTGRES) as other:
                # The other follower's marking (the coordinator's own UPDATE), not committed.
                cursor = await other.execute(
                    f'UPDATE "{schema}".run_leases SET followed = true WHERE thread_id = %s '
                    "AND expires_at >= now() AND NOT followed RETURNING run_id", ("t-race",))
                assert await cursor.fetchall() == [("run-1",)]
                following = asyncio.create_task(shared.follow("t-race"))
                try:
                    await eventually(lambda: _waiting_for_a_lock(schema), deadline=10,
                                     what="follow() waiting for the other follower's mark")
                finally:
                    await other.commit()
                assert await asyncio.wait_for(following, 10) == "run-1"
            assert await shared.follow("t-race") == "run-1"
            await shared.release(lease)
            assert await shared.follow("t-race") is None
        finally:
            await shared.aclose()
