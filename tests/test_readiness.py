"""`GET {base}/health` and `GET {base}/ready`: what a load balancer probes to choose workers.

`health` says the process serves; `ready` says whether this worker can serve a chat now: a
503 naming what cannot (its PostgreSQL thread store, its shared coordinator, or the runtime
closing) while any of it does not answer within `ready_timeout`, 200 once it does again.
Before, a balancer could probe only `/info`, which needs credentials once `auth` is set (every
worker then looked down) and said nothing of the store or coordinator (a worker cut off from
PostgreSQL kept taking chats and answering each with a 503).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import psycopg
import pytest

from copilot_runtime import BearerTokenAuth, CopilotRuntime
from copilot_runtime.auth import RequestInfo
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.threads import InMemoryThreadStore
from tests.conftest import Served, ServeRuntime, openai_runtime
from tests.hitl_support.postgres import SERVER
from tests.test_store_outage import TIMEOUT, Flow, Proxy, _store

pytestmark = pytest.mark.timeout(60)

#: The probes' bound in these tests (seconds).
READY_TIMEOUT = 1.0


async def _get(session: Any, url: str, method: str = "GET") -> tuple[int, Any, Any]:
    async with session.request(method, url) as response:
        body = await response.read()
        return response.status, response.headers, orjson.loads(body) if body else None


async def _answer(session: Any, url: str) -> tuple[int, Any]:
    status, _, body = await _get(session, url)
    return status, body


async def _until(session: Any, url: str, ready: bool, seconds: float = 10
                 ) -> tuple[int, Any]:
    """The probe's answer once it is (or, `ready` False, is no longer) 200, or the last."""
    for _ in range(int(seconds / 0.1)):
        answered = await _answer(session, url)
        if (answered[0] == 200) == ready:
            break
        await asyncio.sleep(0.1)
    return answered


async def _each_outage(served: Served, proxy: Proxy, unavailable: list[str]) -> None:
    """The server behind `proxy` down, then hung: `ready` names what cannot serve within
    its bound while `health` still answers, and is 200 again once the server is back."""
    url = served.url + "/ready"
    for outage in ("down", "hang"):
        if outage == "down":
            await proxy.down()
        else:
            proxy.hang()
        started = time.monotonic()
        status, headers, body = await _get(served.session, url)
        took = time.monotonic() - started
        assert (status, body) == (503, {"status": "unavailable", "unavailable": unavailable})
        assert headers["retry-after"] == "1"
        assert took < READY_TIMEOUT + TIMEOUT, took  # never held past the probe's bound
        # Liveness is not readiness: the process itself serves.
        assert await _answer(served.session, served.url + "/health") == (200, {"status": "ok"})
        await proxy.up()
        # The pools reconnect on their own.
        assert await _until(served.session, url, True) == (200, {"status": "ready"})


async def test_probes_answer_without_credentials_hooks_or_a_store(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    asked: list[str] = []

    def on_request(request: RequestInfo) -> None:
        asked.append(request.path)
        raise ConnectionError("policy service down")

    runtime = openai_runtime(llm, auth=BearerTokenAuth({"tok-alice-0001": "alice"}),
                             on_request=on_request)
    async with serve_runtime(runtime) as served:
        session = served.session
        status, _, _ = await _get(session, served.url + "/info")
        assert status == 401
        async with session.get(served.url + "/info", headers={
                "Authorization": "Bearer tok-alice-0001"}) as response:
            assert response.status == 503  # the hook's service is down
        status, _, body = await _get(session, served.url + "/health")
        assert (status, body) == (200, {"status": "ok"})
        status, headers, body = await _get(session, served.url + "/ready")
        assert (status, body) == (200, {"status": "ready"})
        assert headers["cache-control"] == "no-store"
        status, _, body = await _get(session, served.url + "/ready/", "HEAD")
        assert (status, body) == (200, None)
        status, headers, _ = await _get(session, served.url + "/ready", "POST")
        assert (status, headers["allow"]) == (405, "GET, HEAD")
    assert asked == ["/api/copilotkit/info"]  # the probes never reached it


@pytest.fixture(params=[5432, 6379], ids=["postgresql", "redis"])
async def behind_proxy(request: pytest.FixtureRequest) -> AsyncIterator[Proxy]:
    """PostgreSQL (the store and the coordinator) or Redis (the coordinator; the store then
    on PostgreSQL directly) behind a proxy the test takes down."""
    made = Proxy(request.param)
    try:
        await made.up()
        yield made
    finally:
        await made.down()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{made.schema}" CASCADE')


async def test_ready_names_what_cannot_be_reached_and_recovers(
        behind_proxy: Proxy, llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    proxy = behind_proxy
    on_postgres = proxy.target == 5432
    store = _store(proxy.port if on_postgres else 5432, proxy.schema)
    runtime = openai_runtime(llm, thread_store=store, coordinator=proxy.coordinator())
    runtime.ready_timeout = READY_TIMEOUT
    cut = ["thread_store", "coordinator"] if on_postgres else ["coordinator"]
    async with serve_runtime(runtime) as served:
        assert await _answer(served.session, served.url + "/ready") == (
            200, {"status": "ready"})
        await _each_outage(served, proxy, cut)
    assert await runtime.unready() == ["closing"]


class _DeafProxy(Proxy):
    """A proxy that can cut the coordinator's signal connection (the one that sent LISTEN or
    SUBSCRIBE) and every one opened again for signals, leaving its other connections be."""

    def __init__(self, target: int) -> None:
        super().__init__(target)
        self.refusing = False
        self.signal_flows: list[Flow] = []

    def cut_signals(self) -> None:
        self.refusing = True
        for flow in self.signal_flows:
            for sink in flow.sockets:
                sink.close()

    def _passes(self, flow: Flow, data: bytes, upstream: bool) -> bool:
        if upstream and (b"LISTEN" in data or b"SUBSCRIBE" in data.upper()):
            self.signal_flows.append(flow)
            if self.refusing:
                for sink in flow.sockets:
                    sink.close()
                return False
        return True


@pytest.mark.parametrize("target", [5432, 6379], ids=["postgresql", "redis"])
async def test_a_worker_deaf_to_signals_is_not_ready(
        target: int, llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """The coordinator's pool answered its ping while its signal connection was down (the
    server refused it again and again): the worker stayed ready, took chats, and never heard
    a stop asked on another worker for them, nor told followers elsewhere what they
    streamed."""
    proxy = _DeafProxy(target)
    await proxy.up()
    runtime = openai_runtime(llm, thread_store=_store(5432, proxy.schema),
                             coordinator=proxy.coordinator())
    runtime.ready_timeout = READY_TIMEOUT
    try:
        async with serve_runtime(runtime) as served:
            url = served.url + "/ready"
            assert await _answer(served.session, url) == (200, {"status": "ready"})
            assert proxy.signal_flows
            proxy.cut_signals()
            answered = await _until(served.session, url, False)
            assert answered == (503, {"status": "unavailable", "unavailable": ["coordinator"]})
            await asyncio.sleep(1.5)  # opened again, refused again: still not ready
            assert await _answer(served.session, url) == answered
            proxy.refusing = False
            assert await _until(served.session, url, True) == (200, {"status": "ready"})
    finally:
        await proxy.down()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{proxy.schema}" CASCADE')


async def test_ready_names_an_agents_checkpointer_that_cannot_be_reached(
        serve_runtime: ServeRuntime) -> None:
    """A LangGraph agent's checkpointer on PostgreSQL, the threads in memory: the worker
    answered ready through the whole outage while every run of the agent ended with
    `SERVICE_UNAVAILABLE`. Two agents share the checkpointer: it is pinged once."""
    from langgraph.graph import END, START, MessagesState, StateGraph

    from copilot_runtime.agents.langgraph import LangGraphAgent
    from copilot_runtime.checkpointers import checkpointer

    proxy = Proxy()
    await proxy.up()
    saver = checkpointer(
        f"postgresql://postgres@127.0.0.1:{proxy.port}/test?schema={proxy.schema}")
    saver.timeout = TIMEOUT
    pings = 0
    ping = saver.ping

    async def counted() -> None:
        nonlocal pings
        pings += 1
        await ping()

    saver.ping = counted  # type: ignore[method-assign]
    builder = StateGraph(MessagesState)
    builder.add_node("echo", lambda state: {"messages": []})
    builder.add_edge(START, "echo")
    builder.add_edge("echo", END)
    agents = {name: LangGraphAgent(name=name, graph=builder.compile(checkpointer=saver))
              for name in ("first", "second")}
    runtime = CopilotRuntime(agents=agents)
    runtime.ready_timeout = READY_TIMEOUT
    try:
        async with serve_runtime(runtime) as served:
            url = served.url + "/ready"
            # Its first use migrates a new schema, which may wait for a transaction of a
            # test beside this one (LangGraph builds its indexes CONCURRENTLY): not ready.
            assert await _until(served.session, url, True, 30) == (200, {"status": "ready"})
            before = pings
            assert await _answer(served.session, url) == (200, {"status": "ready"})
            assert pings - before == 1
            await _each_outage(served, proxy, ["checkpointer"])
    finally:
        await proxy.down()
        await saver.aclose()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{proxy.schema}" CASCADE')


class _SlowToPing(InMemoryThreadStore):
    def __init__(self) -> None:
        super().__init__()
        self.pings = 0

    async def ping(self) -> None:
        self.pings += 1
        await asyncio.sleep(3600)


async def test_probes_that_come_together_share_one_check() -> None:
    store = _SlowToPing()
    runtime = CopilotRuntime(agents={}, thread_store=store)
    runtime.ready_timeout = 0.3
    started = time.monotonic()
    answers = await asyncio.gather(*(runtime.unready() for _ in range(50)))
    assert answers == [["thread_store"]] * 50
    assert store.pings == 1
    assert time.monotonic() - started < 2
    assert await runtime.unready() == ["thread_store"]  # the next probe checks again
    assert store.pings == 2
