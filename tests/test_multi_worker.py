"""Several worker processes of one deployment, on their own ports, sharing PostgreSQL (threads
and coordination; a variant coordinates through Redis), driven over HTTP as a load balancer
would spread a client's requests: one run per thread wherever a request lands, `connect`
following a run on another worker, `stop` reaching it, a killed worker's run closed as
interrupted, every thread the same after all workers restart, resumed streams."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import psycopg
import pytest
import pytest_asyncio

import copilot_runtime.threads
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import run_input
from tests.scale_support.cluster import Cluster, drive, eventually, sse_frames, started_cluster
from tests.scale_support.services import postgres_schema, redis_prefix

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]

#: Leases expire this long after their worker dies (short, for the test).
TTL = 1.5


#: Whether the PostgreSQL thread store (positions, batched writes) is here; without it the
#: workers share a SQLite file and the tests that need positions are skipped.
POSITIONS = hasattr(copilot_runtime.threads, "thread_store")
needs_positions = pytest.mark.skipif(not POSITIONS, reason="needs the PostgreSQL thread store "
                                     "with positions and batched writes")


@pytest.fixture(scope="module", params=["postgresql", "redis"])
def urls(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(threads URL, coordinator URL)."""
    with postgres_schema("scale") as postgres:
        threads = postgres if POSITIONS else \
            f"sqlite:///{tmp_path_factory.mktemp('threads')}/threads.sqlite3"
        if request.param == "postgresql":
            yield threads, f"{postgres}&lease_ttl={TTL}"
        else:
            with redis_prefix() as coordination:
                yield threads, f"{coordination}&lease_ttl={TTL}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def llm() -> AsyncIterator[MockOpenAIServer]:
    async with MockOpenAIServer(chunks=10) as server:
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(urls: tuple[str, str], llm: MockOpenAIServer,
                  tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    """Three workers (A, B, C) sharing the services; a test that kills or restarts some
    leaves them all running again."""
    threads, coordination = urls
    async with started_cluster(3, tmp_path_factory.mktemp("workers"), llm_url=llm.base_url,
                               threads=threads, coordinator=coordination,
                               auth=POSITIONS) as cluster:
        yield cluster


def only_once(urls: tuple[str, str]) -> None:
    """Skip a test of the store's part with the Redis coordinator: PostgreSQL's covers it."""
    if urls[1].startswith("redis"):
        pytest.skip("the store's part: run with the PostgreSQL coordinator")


def thread_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


async def start_run(cluster: Cluster, worker_index: int, thread: str, run: str,
                    text: str) -> aiohttp.ClientResponse:
    response = await cluster.post(cluster.workers[worker_index], "/agent/default/run",
                                  run_input(text, thread=thread, run=run))
    assert response.status == 200, await response.text()
    return response


async def read_all(response: aiohttp.ClientResponse, head: bytes = b""
                   ) -> list[tuple[str | None, dict[str, Any]]]:
    """The frames of a stream to its end (`head`: what was read of it already)."""
    return sse_frames(head + await response.read())


async def answering(response: aiohttp.ClientResponse) -> bytes:
    """Read a run's stream until its answer has begun (its upstream request is streaming);
    the bytes read."""
    head = b""
    async with asyncio.timeout(20):
        while b"TEXT_MESSAGE_CONTENT" not in head:
            head += await response.content.readuntil(b"\n\n")
    return head


async def test_a_busy_thread_is_busy_on_every_worker(cluster: Cluster,
                                                     llm: MockOpenAIServer) -> None:
    thread = thread_id()
    running = await start_run(cluster, 0, thread, "r1", "slow:150 hello")
    head = await answering(running)
    for index in (0, 1, 2):
        second = await cluster.post(cluster.workers[index], "/agent/default/run",
                                    run_input("again", thread=thread, run=f"r2-{index}"))
        assert second.status == 409, await second.text()
        assert "already has an active run" in await second.text()
    events = [e for _, e in await read_all(running, head)]
    assert events[-1]["type"] == "RUN_FINISHED"
    # The thread is free again, on any worker.
    again = await start_run(cluster, 2, thread, "r3", "hi")
    assert [e for _, e in await read_all(again)][-1]["type"] == "RUN_FINISHED"


async def test_stop_on_one_worker_ends_the_run_on_another(cluster: Cluster,
                                                          llm: MockOpenAIServer) -> None:
    thread = thread_id()
    running = await start_run(cluster, 0, thread, "r1", "slow:300 a long answer")
    head = await answering(running)
    cancelled = llm.cancelled_streams
    asked = time.monotonic()
    stop = await cluster.post(cluster.workers[1], f"/agent/default/stop/{thread}", {})
    assert stop.status == 200
    assert (await stop.json())["stopped"] is True
    frames = await read_all(running, head)
    ended = time.monotonic()
    assert ended - asked < 1.0 + 0.5  # within 1 s (+ reading the last bytes on a loaded box)
    assert frames[-1][1]["type"] == "RUN_FINISHED"
    await eventually(lambda: llm.cancelled_streams > cancelled, deadline=5,
                     what="the upstream request cancelled")
    # Nothing to stop any more, wherever asked.
    again = await cluster.post(cluster.workers[2], f"/agent/default/stop/{thread}", {})
    assert (await again.json())["stopped"] is False


def connect_body(thread: str) -> dict[str, Any]:
    return {"threadId": thread, "runId": f"c-{uuid.uuid4().hex[:6]}", "messages": [],
            "tools": [], "context": [], "state": {}, "forwardedProps": {}}


async def connect(cluster: Cluster, worker_index: int, thread: str,
                  last_event_id: str | None = None) -> list[tuple[str | None, dict[str, Any]]]:
    headers = {"Last-Event-ID": last_event_id} if last_event_id is not None else None
    response = await cluster.post(cluster.workers[worker_index], "/agent/default/connect",
                                  connect_body(thread), headers)
    assert response.status == 200, await response.text()
    return await read_all(response)


def data(frames: list[tuple[str | None, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [event for _, event in frames]


async def stored_events(cluster: Cluster, worker_index: int, thread: str) -> list[Any]:
    async with cluster.session.get(
            f"{cluster.workers[worker_index].url}/threads/{thread}/events") as response:
        if response.status != 200:
            return []
        events: list[Any] = (await response.json())["events"]
        return events


@needs_positions
async def test_connect_on_another_worker_follows_the_run_to_its_end(
        cluster: Cluster, llm: MockOpenAIServer) -> None:
    thread = thread_id()
    first = await start_run(cluster, 2, thread, "r0", "hello")  # a run already stored
    await read_all(first)
    running = await start_run(cluster, 0, thread, "r1", "slow:80 follow me there")
    own = asyncio.create_task(read_all(running, await answering(running)))
    followed = await connect(cluster, 1, thread)
    own_frames = await own
    replay = data(followed)
    # The stored run first, then the live run exactly as its own client saw it (ids too).
    assert followed[-len(own_frames):] == own_frames
    assert replay[0]["type"] == "RUN_STARTED"
    assert replay[-1]["type"] == "RUN_FINISHED"
    assert sum(e["type"] == "RUN_STARTED" for e in replay) == 2
    # Once it is over (compacted), every worker replays the same; threads listed anywhere.
    assert await connect(cluster, 2, thread) == await connect(cluster, 0, thread)
    async with cluster.session.get(cluster.workers[2].url + "/threads") as listing:
        assert thread in [t["id"] for t in (await listing.json())["threads"]]


@needs_positions
async def test_a_killed_workers_run_is_closed_as_interrupted(
        cluster: Cluster, llm: MockOpenAIServer, urls: tuple[str, str]) -> None:
    thread = thread_id()
    running = await start_run(cluster, 0, thread, "r1", "slow:400 a long answer to be cut")
    # Some of the answer has streamed, and is stored.
    await eventually(lambda: _text_written(urls[0], thread), deadline=10,
                     what="part of the answer stored")
    cluster.workers[0].kill()
    killed = time.monotonic()
    running.close()
    busy = await cluster.post(cluster.workers[1], "/agent/default/run",
                              run_input("now?", thread=thread, run="r2"))
    assert busy.status == 409  # the lease outlives its worker for a while
    replay = await eventually(lambda: _interrupted(connect(cluster, 2, thread)),
                              deadline=TTL + 10, what="the run closed as interrupted")
    assert replay[0]["type"] == "RUN_STARTED"
    assert any(e["type"] == "TEXT_MESSAGE_CONTENT" for e in replay)
    accepted = await start_run(cluster, 1, thread, "r3", "and now")
    assert data(await read_all(accepted))[-1]["type"] == "RUN_FINISHED"
    assert time.monotonic() - killed < TTL + 10
    cluster.workers[0].start()
    await cluster.workers[0].ready(cluster.session)


@needs_positions
async def test_a_client_that_saw_what_a_killed_worker_never_wrote_resumes_to_the_runs_end(
        cluster: Cluster, urls: tuple[str, str]) -> None:
    """The killed worker sent events it had not written yet (it writes every 200 ms): the
    closing events the sweep stores take their positions, so the client's Last-Event-ID is
    at or past the first of them. Its resume on another worker ends its run all the same:
    the message left open is ended, then the RUN_ERROR, each once. (Before, an id at the
    RUN_ERROR's position got an empty stream, one before it the RUN_ERROR alone.)"""
    only_once(urls)
    thread = thread_id()
    running = await start_run(cluster, 0, thread, "r1", "slow:400 a long answer to be cut")
    await eventually(lambda: _text_written(urls[0], thread), deadline=10,
                     what="part of the answer stored")
    cluster.workers[0].kill()
    running.close()
    closed = await eventually(lambda: _interrupted(connect(cluster, 1, thread)),
                              deadline=TTL + 10, what="the run closed as interrupted")
    assert [e["type"] for e in closed[-2:]] == ["TEXT_MESSAGE_END", "RUN_ERROR"]
    last = int(next(i for i, _ in reversed(await connect(cluster, 1, thread)) if i))
    # The client saw one, two or five events the store never got (their ids are the closing
    # events' positions, or past the thread's).
    for seen in (last - 1, last, last + 3):
        resumed = await connect(cluster, 1 + seen % 2, thread, last_event_id=str(seen))
        assert [e["type"] for e in data(resumed)] == ["TEXT_MESSAGE_END", "RUN_ERROR"], seen
    cluster.workers[0].start()
    await cluster.workers[0].ready(cluster.session)


async def _text_written(threads: str, thread: str) -> bool:
    """Whether the running run's events written so far hold some of the answer."""
    schema = threads.split("schema=")[1]
    async with await psycopg.AsyncConnection.connect(threads.split("?")[0]) as conn:
        cursor = await conn.execute(
            f'SELECT events FROM "{schema}".run_events WHERE thread_id = %s', (thread,))
        return any(b"TEXT_MESSAGE_CONTENT" in bytes(row[0]) for row in await cursor.fetchall())


async def _interrupted(frames: Any) -> list[dict[str, Any]] | None:
    events = data(await frames)
    if events and events[-1]["type"] in ("RUN_ERROR", "RUN_FINISHED") and any(
            "interrupt" in str(e).lower() for e in events[-2:]):
        return events
    return None


async def test_every_thread_replays_the_same_after_all_workers_restart(
        cluster: Cluster, urls: tuple[str, str]) -> None:
    only_once(urls)
    threads = [thread_id() for _ in range(3)]
    for index, thread in enumerate(threads):
        for run in range(2):
            response = await start_run(cluster, (index + run) % 3, thread, f"r{run}",
                                       f"message {run} of {thread}")
            await read_all(response)
    before = {t: await connect(cluster, i % 3, t) for i, t in enumerate(threads)}
    await cluster.restart()
    for index, thread in enumerate(threads):
        assert await connect(cluster, (index + 1) % 3, thread) == before[thread]


async def test_a_run_whose_client_left_is_followed_to_its_end_on_another_worker(
        cluster: Cluster, llm: MockOpenAIServer) -> None:
    """The client reloads mid-answer and its `connect` lands on another worker: the run went
    on without it on the first (its upstream request not cancelled), and is followed to its
    end there, whole."""
    thread = thread_id()
    cancelled = llm.cancelled_streams
    running = await start_run(cluster, 0, thread, "r1", "slow:80 finish it without me")
    await answering(running)
    running.close()  # the reload
    replay = data(await connect(cluster, 1, thread))
    assert replay[0]["type"] == "RUN_STARTED"
    assert replay[-1]["type"] == "RUN_FINISHED"
    assert "".join(e["delta"] for e in replay if e["type"] == "TEXT_MESSAGE_CONTENT") == \
        "echo: slow:80 finish it without me"
    assert llm.cancelled_streams == cancelled


@needs_positions
async def test_a_resumed_connect_sends_only_what_came_after(
        cluster: Cluster, urls: tuple[str, str]) -> None:
    only_once(urls)
    thread = thread_id()
    await read_all(await start_run(cluster, 2, thread, "r0", "before"))
    running = await start_run(cluster, 0, thread, "r1", "slow:80 resume me elsewhere")
    seen: list[bytes] = []
    while len(seen) < 4:  # the client got this far, then lost its connection
        seen.append(await running.content.readuntil(b"\n\n"))
    own = sse_frames(b"".join(seen) + await running.read())
    last_id = own[3][0]
    assert last_id is not None
    # It resumes on another worker while the run is live on the first: exactly the rest.
    resumed = await connect(cluster, 1, thread, last_event_id=last_id)
    assert resumed == own[4:]
    # And once it has ended (its raw events are kept for resumes), on a third.
    assert await connect(cluster, 2, thread, last_event_id=last_id) == own[4:]


async def test_the_real_client_connects_on_another_worker_mid_run(
        cluster: Cluster, llm: MockOpenAIServer, urls: tuple[str, str]) -> None:
    only_once(urls)
    thread = thread_id()
    running = await start_run(cluster, 0, thread, "r1", "slow:60 Hello")
    own = asyncio.create_task(read_all(running, await answering(running)))
    # CopilotKitCore of @copilotkit/core 1.75 restoring the thread on another worker (as after
    # a page reload): it follows the live run there to its end.
    result = await drive("connect", cluster.workers[1].url, threadId=thread)
    await own
    assert [(m["role"], m.get("content")) for m in result["messages"]] == [
        ("user", "slow:60 Hello"), ("assistant", "echo: slow:60 Hello")]
    assert not result["coreErrors"]


@needs_positions
async def test_threads_stay_their_owners_on_every_worker(cluster: Cluster,
                                                         llm: MockOpenAIServer) -> None:
    thread = thread_id()
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    running = await cluster.post(cluster.workers[0], "/agent/default/run",
                                 run_input("slow:150 mine", thread=thread, run="r1"), alice)
    assert running.status == 200
    own = asyncio.create_task(read_all(running, await answering(running)))
    # For bob the thread does not exist, wherever he asks.
    theirs = await cluster.post(cluster.workers[1], "/agent/default/run",
                                run_input("mine now", thread=thread, run="r2"), bob)
    assert theirs.status == 404
    stop = await cluster.post(cluster.workers[2], f"/agent/default/stop/{thread}", {}, bob)
    assert stop.status == 404
    followed = await cluster.post(cluster.workers[2], "/agent/default/connect",
                                  connect_body(thread), bob)
    assert data(await read_all(followed)) == []
    # Its owner stops it from a third worker.
    stop = await cluster.post(cluster.workers[2], f"/agent/default/stop/{thread}", {}, alice)
    assert (await stop.json())["stopped"] is True
    assert data(await own)[-1]["type"] == "RUN_FINISHED"
