"""A graph that took an approval's answer and whose run died between two steps is carried on.

With "sync" durability the step that took the answer is stored before the approved action
runs. A worker killed after that (or shut down, or whose client left) leaves the checkpoint
with steps to run and no interrupt waiting. Recovery read "no interrupt" as "the answer was
applied", marked it so, and nothing ran the rest of the graph: the approved action never
ran, while the approval said it had (the prober's repro: 7 of 7). Recovery now resends the
stored answer, which carries the graph on from the step it stopped at; a `stop` of the
thread, the caller's choice, is not carried on, and its answer says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from copilot_runtime import CopilotRuntime, ServiceUnavailableError
from copilot_runtime._time import iso_time
from copilot_runtime.agents import langgraph
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.approvals import Approval
from copilot_runtime.checkpointers import checkpointer
from tests.conftest import poll, run_input
from tests.hitl_support.postgres import postgres_schema
from tests.test_approvals_reservations import drive

pytestmark = pytest.mark.timeout(60)

THREAD = "t-pay"
ANSWER = {"action": "approve", "userId": "ann"}


class State(TypedDict, total=False):
    answer: Any
    paid: bool


@dataclass
class Payments:
    """The approved action's side of things: when it starts, and what it completed."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    done: list[Any] = field(default_factory=list)


def paying_runtime(url: str, payments: Payments, expires_in: float | None = None,
                   **options: Any) -> CopilotRuntime:
    """ask (an interrupt) -> pay (the approved action, held by `payments.gate`) -> END;
    `options` are the runtime's."""

    def ask(state: State) -> dict[str, Any]:
        question: dict[str, Any] = {"message": "Pay the invoice?"}
        if expires_in is not None:
            question["expiresAt"] = iso_time(time.time() + expires_in)
        return {"answer": interrupt(question)}

    async def pay(state: State) -> dict[str, Any]:
        payments.started.set()
        await payments.gate.wait()
        payments.done.append(state["answer"])
        return {"paid": True}

    builder: StateGraph[State] = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_node("pay", pay)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "pay")
    builder.add_edge("pay", END)
    graph = builder.compile(checkpointer=checkpointer(url))
    return CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)}, **options)


@pytest.fixture(params=["sqlite", "postgresql"])
def checkpoints_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "postgresql":
        with postgres_schema() as url:
            yield url
    else:
        yield f"sqlite:///{tmp_path}/cp.db"


def agent_of(runtime: CopilotRuntime) -> LangGraphAgent:
    agent = runtime.agents["lg"]
    assert isinstance(agent, LangGraphAgent)
    return agent


async def driven(runtime: CopilotRuntime, text: str, run_id: str = "run-1") -> list[Any]:
    """The events of a chat run on the thread, driven to its end."""
    return await drive(runtime, run_input(text, thread=THREAD, run=run_id,
                                          protocolVersion="1.0"))


async def asked(runtime: CopilotRuntime) -> Approval:
    """A run that stops at the question: the approval it left pending."""
    events = await driven(runtime, "Pay it")
    assert events[-1]["outcome"]["type"] == "interrupt"
    (approval,) = await runtime.approvals.list()
    return approval


async def killed_in_pay(url: str) -> Approval:
    """What a SIGKILL of the worker carrying out an approved payment leaves: the answer
    recorded (not applied), the step that took it stored, `pay` cut off in its middle."""
    payments = Payments()
    runtime = paying_runtime(url, payments)
    try:
        approval = await asked(runtime)
        agent = agent_of(runtime)
        assert await agent.approvals.claim(approval.id, "answered", ANSWER, "ann",
                                           time.time())
        # The graph takes the answer as the killed worker's run did; it dies in `pay`.
        resumed = asyncio.create_task(agent.graph.ainvoke(
            Command(resume={approval.id: ANSWER}), agent._graph_config(THREAD)))
        async with asyncio.timeout(10):
            await payments.started.wait()
        resumed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await resumed
        await parked_at_pay(runtime)
    finally:
        await runtime.aclose()
    assert payments.done == []
    return approval


async def parked_at_pay(runtime: CopilotRuntime) -> None:
    state = await agent_of(runtime).graph.aget_state({"configurable": {"thread_id": THREAD}})
    assert state.next == ("pay",)
    assert not any(task.interrupts for task in state.tasks)


async def carried_on(url: str, approval_id: str, *, unapplied_at_start: bool = False
                     ) -> Payments:
    """A new process on the same database: its start carries the graph on, once."""
    payments = Payments()
    payments.gate.set()
    runtime = paying_runtime(url, payments)
    try:
        if unapplied_at_start:
            left = await agent_of(runtime).approvals.get(approval_id)
            assert left is not None
            assert (left.status, left.applied) == ("answered", False)
        await runtime.start()
        async for _ in poll(20):
            settled, _, _ = await runtime.approvals.get(approval_id)
            if settled.applied and THREAD not in runtime.runs.active:
                break
        assert settled.applied, "the approval was never applied"
        state = await agent_of(runtime).graph.aget_state(
            {"configurable": {"thread_id": THREAD}})
        assert state.next == ()
        assert state.values["paid"] is True
        assert payments.done == [ANSWER]  # the approved action ran, once
        assert await runtime.approvals.list() == []  # nothing offered again
    finally:
        await runtime.aclose()
    return payments


async def test_a_graph_whose_worker_died_after_it_took_the_answer_is_carried_on(
        checkpoints_url: str) -> None:
    """What a SIGKILL leaves: the answer recorded (not applied), the step that took it
    stored, the approved action cut off. Before the fix the next start marked the
    approval applied and never ran the action."""
    approval = await killed_in_pay(checkpoints_url)
    await carried_on(checkpoints_url, approval.id)


async def test_a_message_to_a_graph_left_mid_way_carries_it_on_first(
        checkpoints_url: str) -> None:
    """The same state as a SIGKILL leaves, and the user writes again before any recovery
    ran (within `recover_after`): the run carries the graph on with the stored answer. Before,
    the new input started the graph over (LangGraph drops the steps left): the approved
    action never ran, a second approval was asked for the same thing, and the first one was
    then marked applied."""
    approval = await killed_in_pay(checkpoints_url)
    payments = Payments()
    payments.gate.set()
    runtime = paying_runtime(checkpoints_url, payments)  # not started: no recovery runs
    try:
        events = await driven(runtime, "Did it go through?", "r-2")
        assert events[-1]["type"] == "RUN_FINISHED", events[-1]
        assert payments.done == [ANSWER]  # carried on, once
        settled = await agent_of(runtime).approvals.get(approval.id)
        assert settled is not None
        assert settled.applied
        state = await agent_of(runtime).graph.aget_state(
            {"configurable": {"thread_id": THREAD}})
        assert state.values["paid"] is True
        assert [a.id for a in await runtime.approvals.list(thread_id=THREAD, status=None)] \
            == [approval.id]  # no second approval asked for
    finally:
        await runtime.aclose()


async def test_a_graph_whose_run_was_shut_down_mid_action_is_carried_on(
        checkpoints_url: str) -> None:
    """An answer over HTTP's route (not waiting), the runtime shut down while the approved
    action runs: the answer stays unapplied (it was marked applied before the fix), and
    the next start carries the graph on."""
    payments = Payments()
    runtime = paying_runtime(checkpoints_url, payments)
    approval = await asked(runtime)
    result = await runtime.approvals.answer(approval.id, ANSWER, answered_by="ann",
                                            wait=False)
    assert result["run"]["status"] == "running"
    async with asyncio.timeout(10):
        await payments.started.wait()
    await runtime.aclose()
    assert payments.done == []
    await carried_on(checkpoints_url, approval.id, unapplied_at_start=True)


async def test_a_stop_while_the_approved_action_runs_is_not_carried_on(
        checkpoints_url: str) -> None:
    """A `stop` of the thread is the caller's choice: the answer's run says `stopped` (it
    said `finished`), the approval is applied (the graph took it), and recovery leaves the
    graph where the stop left it."""
    payments = Payments()
    runtime = paying_runtime(checkpoints_url, payments)
    try:
        approval = await asked(runtime)
        answering = asyncio.create_task(runtime.approvals.answer(
            approval.id, ANSWER, answered_by="ann"))
        async with asyncio.timeout(10):
            await payments.started.wait()
        assert runtime.runs.stop(THREAD)
        async with asyncio.timeout(10):
            result = await answering
        assert result["run"]["status"] == "stopped"
        assert result["approval"]["applied"] is True
        await runtime.approvals._recover()
        await asyncio.sleep(0.2)
        assert THREAD not in runtime.runs.active
        assert payments.done == []
        await parked_at_pay(runtime)
    finally:
        payments.gate.set()
        await runtime.aclose()


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgresql"])
async def test_a_deleted_threads_approvals_go_with_it(kind: str, tmp_path: Path) -> None:
    """Deleting a thread deleted its checkpoints and left its approvals in the ledger, for
    ever (a prober's churn: 1,000 threads asked, answered and deleted left 1,000 approvals,
    each listed by `status=all`, to anyone reusing the id too, and scanned at every tick of
    the expiry timer)."""
    with contextlib.ExitStack() as stack:
        url = {"memory": "memory", "sqlite": f"sqlite:///{tmp_path}/cp.db"}.get(kind) or \
            stack.enter_context(postgres_schema())
        payments = Payments()
        payments.gate.set()
        runtime = paying_runtime(url, payments)
        try:
            approval = await asked(runtime)
            kept = await runtime.approvals.list(thread_id=THREAD, status=None)
            assert [a.id for a in kept] == [approval.id]
            await runtime.forget_thread(THREAD)  # what DELETE /threads/{id} does
            assert await runtime.approvals.list(thread_id=THREAD, status=None) == []
            assert await agent_of(runtime).approvals.get(approval.id) is None
        finally:
            await runtime.aclose()


async def test_an_interrupt_the_ledger_missed_is_recorded_listed_and_timed_out(
        checkpoints_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph's interrupt is in its checkpoint before the ledger hears of it: a worker
    that died in between, or a ledger that could not be written then (a failover), left it
    out for good: never listed (`GET /approvals`), its deadline never reached, the thread
    refusing every message until answered by hand. Now a run waits a little for the ledger,
    and the graph's interrupts missing from it are added when the thread's approvals are
    listed, or a message is refused because the graph waits; the deadline then applies."""
    monkeypatch.setattr(langgraph, "_LEDGER_RETRY_SECONDS", 0.01, raising=False)
    payments = Payments()
    payments.gate.set()
    runtime = paying_runtime(checkpoints_url, payments, expires_in=1.0)
    try:
        ledger = agent_of(runtime).approvals
        add = ledger.add

        async def unreachable(approvals: Any) -> None:
            raise ServiceUnavailableError("The approval store cannot be reached")

        monkeypatch.setattr(ledger, "add", unreachable)
        events = await driven(runtime, "Pay it")
        assert events[-1]["type"] == "RUN_ERROR"
        monkeypatch.setattr(ledger, "add", add)  # back
        assert await runtime.approvals.list(status=None) == []
        assert set(await agent_of(runtime).pending_interrupt_ids(THREAD))  # the graph waits
        events = await driven(runtime, "Hello?", run_id="run-2")
        assert (events[-1]["type"], events[-1]["code"]) == ("RUN_ERROR", "APPROVAL_ERROR")
        (recorded,) = await runtime.approvals.list()
        assert recorded.expires_at is not None
        await ledger.forget_thread(THREAD)  # as if that refusal had not recorded it either
        page, _ = await runtime.approvals.page(thread_id=THREAD)
        assert [a.id for a in page] == [recorded.id]
        await runtime.start()  # the timer: the deadline passes, the timeout is applied
        async for _ in poll(20):
            settled = await ledger.get(recorded.id)
            if settled is not None and settled.applied and THREAD not in runtime.runs.active:
                break
        assert settled is not None
        assert (settled.status, settled.applied) == ("expired", True)
        assert [answer["action"] for answer in payments.done] == ["timeout"]
    finally:
        await runtime.aclose()
