"""A LangGraph agent's PostgreSQL checkpointer going away: connections cut (the server
restarts, refuses) or held open without an answer (a hung server, a network dropping
packets). A run streaming then ends with `RUN_ERROR` `SERVICE_UNAVAILABLE` within the
checkpointer's timeout, the approval routes answer 503 with `Retry-After`, never a 500 or a
wait as long as the outage, and the same runtime serves both again once the server is back."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import orjson
import psycopg
import pytest
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from copilot_runtime import CopilotRuntime, ServiceUnavailableError
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.approvals import Approval
from copilot_runtime.approvals.sql import SQLiteApprovalStore
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.testing import verify_events
from tests.conftest import Served, ServeRuntime, parse_sse, run_input
from tests.hitl_support.postgres import SERVER
from tests.test_store_outage import Proxy

pytestmark = pytest.mark.timeout(60)

#: The checkpointer's timeout in these tests (seconds): longer than psycopg's first delay
#: before reconnecting (about 1 s), so a request right after the server is back waits for
#: that, not fails.
TIMEOUT = 2.0
#: What an answer may take beyond it: LangGraph writing the failed step, a loaded machine.
SLACK = 3.0


class State(TypedDict, total=False):
    worked: bool
    approved: bool


@dataclass
class Gate:
    """Where the graph's `work` step waits, so the outage starts mid-run."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)
    open: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Setup:
    served: Served
    proxy: Proxy
    gate: Gate

    async def outage(self, kind: str) -> None:
        if kind == "hang":
            self.proxy.hang()
        else:
            await self.proxy.down()

    async def back(self) -> None:
        await self.proxy.down()  # what a held connection sent is dropped with it
        await self.proxy.up()


def graph(saver: Any, gate: Gate) -> Any:
    """`work` waits for the gate; `ask` interrupts for an approval."""

    async def work(state: State) -> State:
        gate.entered.set()
        await gate.open.wait()
        return {"worked": True}

    def ask(state: State) -> State:
        return {"approved": bool(interrupt({"question": "Pay the invoice?"}))}

    builder = StateGraph(State)
    builder.add_node("work", work)
    builder.add_node("ask", ask)
    builder.add_edge(START, "work")
    builder.add_edge("work", "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


@pytest.fixture
async def setup(serve_runtime: ServeRuntime) -> AsyncIterator[Setup]:
    proxy = Proxy()
    await proxy.up()
    # The schema and its tables made first, without the short timeout: LangGraph's
    # migrations build indexes CONCURRENTLY, which waits for every older snapshot in the
    # database, such as a transaction of a test running beside this one; the first run then
    # failed before any outage began. The saver under test only finds them made.
    migrated = checkpointer(f"postgresql://postgres@127.0.0.1:{proxy.port}/test"
                            f"?schema={proxy.schema}")
    migrated.timeout = 30
    await migrated.aget_tuple({"configurable": {"thread_id": "none", "checkpoint_ns": ""}})
    await migrated.approvals.unapplied()
    await migrated.aclose()
    saver = checkpointer(
        f"postgresql://postgres@127.0.0.1:{proxy.port}/test?schema={proxy.schema}")
    saver.timeout = TIMEOUT
    gate = Gate()
    gate.open.set()
    runtime = CopilotRuntime(agents={"pay": LangGraphAgent(name="pay", graph=graph(saver, gate))})
    try:
        async with serve_runtime(runtime) as served:
            try:
                yield Setup(served, proxy, gate)
            finally:
                await proxy.down()  # nothing waits on a held connection at shutdown
    finally:
        await saver.aclose()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{proxy.schema}" CASCADE')


async def asked(served: Served, thread: str) -> dict[str, Any]:
    """A run of the graph to its question: the interrupt (its id is the approval's)."""
    events = await served.run(run_input("pay it", thread=thread, run=f"{thread}-r",
                                        protocolVersion="1.0"), agent="pay")
    verify_events(events)
    (question,) = events[-1]["outcome"]["interrupts"]
    assert question["metadata"]["langgraph"]["raw"] == {"question": "Pay the invoice?"}
    return dict(question)


def assert_unavailable(status: int, headers: Any, body: bytes, store: str) -> None:
    assert status == 503, body
    assert headers["retry-after"] == "1"
    assert orjson.loads(body) == {"error": "Service unavailable",
                                  "message": f"The {store} store cannot be reached",
                                  "code": "SERVICE_UNAVAILABLE"}


@pytest.mark.parametrize("outage", ["hang", "down"])
async def test_a_run_whose_checkpointer_goes_away_ends_with_service_unavailable(
        setup: Setup, outage: str) -> None:
    """Held: the stream stopped for the whole outage (no bound on a checkpoint write).
    Cut: the run ended as `AGENT_ERROR` "failed unexpectedly", blaming the agent."""
    served, gate = setup.served, setup.gate
    gate.open.clear()
    response = await served.post("/agent/pay/run", run_input("pay it", thread="t1", run="r1"))
    assert response.status == 200
    body = asyncio.ensure_future(response.read())
    await asyncio.wait_for(gate.entered.wait(), 10)
    await setup.outage(outage)
    started = time.monotonic()
    gate.open.set()  # the step ends: LangGraph writes its checkpoint
    raw = await asyncio.wait_for(body, 2 * TIMEOUT + SLACK)
    assert time.monotonic() - started < 2 * TIMEOUT + SLACK
    events = parse_sse(raw)
    verify_events(events)
    assert events[-1]["type"] == "RUN_ERROR"
    assert (events[-1]["code"], events[-1]["message"]) == (
        "SERVICE_UNAVAILABLE", "The checkpoint store cannot be reached")
    assert b"Traceback" not in raw
    assert b".py" not in raw
    assert not served.runtime.runs.active  # the thread takes its next run

    await setup.back()
    await asked(served, "t1")


@pytest.mark.parametrize("outage", ["hang", "down"])
async def test_the_approval_routes_answer_503_while_the_checkpointer_is_away(
        setup: Setup, outage: str) -> None:
    """Cut: 500 `internal_error` (the pool handed out its dead connections, and nothing
    mapped the driver's error). Held: no answer at all for the whole outage."""
    served = setup.served
    question = await asked(served, "t1")
    await setup.outage(outage)
    for method, path, body in (("POST", f"/approvals/{question['id']}", {"action": "approve"}),
                               ("GET", f"/approvals/{question['id']}", None),
                               ("GET", "/approvals", None)):
        started = time.monotonic()
        response = await asyncio.wait_for(served.session.request(
            method, served.url + path, json=body), TIMEOUT + SLACK)
        assert_unavailable(response.status, response.headers, await response.read(),
                           "approval")
        assert time.monotonic() - started < TIMEOUT + SLACK

    await setup.back()
    answered = await served.post(f"/approvals/{question['id']}", {"action": "approve"})
    assert answered.status == 200, await answered.text()
    result = await answered.json()
    assert (result["approval"]["status"], result["run"]["status"]) == ("answered", "finished")


async def test_a_server_restart_between_requests_is_not_seen_by_clients(
        setup: Setup) -> None:
    """Connections the server closed while they sat in the pool were handed out: the next
    answer was a 500 and the next run an `AGENT_ERROR`. They are replaced as taken now."""
    served = setup.served
    question = await asked(served, "t1")
    await setup.back()  # every connection cut, the server accepting new ones at once
    answered = await served.post(f"/approvals/{question['id']}", {"action": "approve"})
    assert answered.status == 200, await answered.text()
    assert (await answered.json())["run"]["status"] == "finished"
    await setup.back()
    await asked(served, "t2")


async def test_a_first_use_whose_server_never_answers_gives_up_at_the_timeout() -> None:
    """A server that accepts connections and never answers: the first use (the
    checkpointer's, the ledger's) waited for libpq's connect timeout, 10 s whatever the
    checkpointer's own; each gives up at the timeout now, and so does closing."""
    # Half the file's timeout: this server never comes back, so no reconnection delay
    # needs to fit in it, and a call that waits for libpq's 10 s still fails the bounds.
    timeout = TIMEOUT / 2
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        saver = checkpointer(
            f"postgresql://postgres@127.0.0.1:{listener.getsockname()[1]}/test")
        saver.timeout = timeout
        try:
            started = time.monotonic()
            with pytest.raises(ServiceUnavailableError, match="cannot be reached"):
                await saver.aget_tuple({"configurable": {"thread_id": "t"}})
            with pytest.raises(ServiceUnavailableError, match="cannot be reached"):
                await saver.approvals.find()
            assert time.monotonic() - started < 2 * timeout + 1
        finally:
            started = time.monotonic()
            await saver.aclose()
            assert time.monotonic() - started < timeout + 1


async def test_a_sqlite_checkpointer_whose_file_cannot_be_written_is_unavailable(
        tmp_path: Path) -> None:
    """A SQLite checkpointer (and its approval ledger) whose file cannot be written (a full
    disk, a read-only file; read-only here) let the driver's OperationalError through: a
    run ended with AGENT_ERROR, blaming its agent, and an approval route answered 500. Now
    it is SERVICE_UNAVAILABLE, as a PostgreSQL checkpointer away is; reads go on."""
    saver = checkpointer(f"sqlite:///{tmp_path / 'checkpoints.db'}")
    ledger = saver.approvals
    assert isinstance(ledger, SQLiteApprovalStore)
    try:
        await ledger.add([Approval("a1", "t", "pay", {}, time.time())])  # both opened
        opened = await saver._target()
        for conn in (opened.conn, ledger._conn):  # type: ignore[attr-defined]
            await conn.execute("PRAGMA query_only = ON")
        with pytest.raises(ServiceUnavailableError, match=r"^The approval store cannot write"):
            await ledger.claim("a1", "answered", {}, None, time.time())
        with pytest.raises(ServiceUnavailableError,
                           match=r"^The checkpoint store cannot write"):
            await saver.aput({"configurable": {"thread_id": "t", "checkpoint_ns": ""}},
                             empty_checkpoint(), {}, {})
        assert [a.status for a in await ledger.find()] == ["pending"]
    finally:
        await saver.aclose()
