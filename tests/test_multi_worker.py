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
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import run_input
from tests.scale_support.cluster import Cluster, eventually, make_cluster, sse_frames
from tests.scale_support.services import postgres_schema, redis_prefix

pytestmark = pytest.mark.timeout(120)

#: Leases expire this long after their worker dies (short, for the test).
TTL = 1.5


@pytest.fixture(params=["postgresql", "redis"])
def urls(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(threads URL, coordinator URL)."""
    with postgres_schema("scale") as threads:
        if request.param == "postgresql":
            yield threads, f"{threads}&lease_ttl={TTL}"
        else:
            with redis_prefix() as coordination:
                yield threads, f"{coordination}&lease_ttl={TTL}"


@pytest.fixture
async def llm() -> AsyncIterator[MockOpenAIServer]:
    async with MockOpenAIServer(chunks=10) as server:
        yield server


@pytest.fixture
async def cluster(urls: tuple[str, str], llm: MockOpenAIServer,
                  tmp_path: Path) -> AsyncIterator[Cluster]:
    threads, coordination = urls
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        cluster = make_cluster(3, tmp_path, session, llm_url=llm.base_url, threads=threads,
                               coordinator=coordination)
        try:
            await cluster.start()
            yield cluster
        finally:
            cluster.close()


def thread_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


async def start_run(cluster: Cluster, worker_index: int, thread: str, run: str,
                    text: str) -> aiohttp.ClientResponse:
    response = await cluster.post(cluster.workers[worker_index], "/agent/default/run",
                                  run_input(text, thread=thread, run=run))
    assert response.status == 200, await response.text()
    return response


async def read_all(response: aiohttp.ClientResponse) -> list[tuple[str | None, dict[str, Any]]]:
    return sse_frames(await response.read())


async def test_a_busy_thread_is_busy_on_every_worker(cluster: Cluster,
                                                     llm: MockOpenAIServer) -> None:
    thread = thread_id()
    running = await start_run(cluster, 0, thread, "r1", "slow:150 hello")
    await eventually(lambda: llm.active_streams, what="the run's upstream request")
    for index in (0, 1, 2):
        second = await cluster.post(cluster.workers[index], "/agent/default/run",
                                    run_input("again", thread=thread, run=f"r2-{index}"))
        assert second.status == 409, await second.text()
        assert "already has an active run" in await second.text()
    events = [e for _, e in await read_all(running)]
    assert events[-1]["type"] == "RUN_FINISHED"
    # The thread is free again, on any worker.
    again = await start_run(cluster, 2, thread, "r3", "hi")
    assert [e for _, e in await read_all(again)][-1]["type"] == "RUN_FINISHED"


async def test_stop_on_one_worker_ends_the_run_on_another(cluster: Cluster,
                                                          llm: MockOpenAIServer) -> None:
    thread = thread_id()
    running = await start_run(cluster, 0, thread, "r1", "slow:300 a long answer")
    await eventually(lambda: llm.active_streams, what="the run's upstream request")
    cancelled = llm.cancelled_streams
    asked = time.monotonic()
    stop = await cluster.post(cluster.workers[1], f"/agent/default/stop/{thread}", {})
    assert stop.status == 200
    assert (await stop.json())["stopped"] is True
    frames = await read_all(running)
    ended = time.monotonic()
    assert ended - asked < 1.0 + 0.5  # within 1 s (+ reading the last bytes on a loaded box)
    assert frames[-1][1]["type"] == "RUN_FINISHED"
    await eventually(lambda: llm.cancelled_streams > cancelled, deadline=5,
                     what="the upstream request cancelled")
    # Nothing to stop any more, wherever asked.
    again = await cluster.post(cluster.workers[2], f"/agent/default/stop/{thread}", {})
    assert (await again.json())["stopped"] is False
