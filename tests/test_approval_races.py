"""Answers that lose a race, and answers no store can keep, are refused precisely.

* An answer that passed the deadline check, whose run then claimed after the deadline, was
  swapped for the timeout: HTTP 200 showing the approval `expired`, an AG-UI RUN_FINISHED.
  It is 410 / RUN_ERROR APPROVAL_EXPIRED now, the approval left for the timer.
* A client's answer to an approval answered already (its run under way in a process with no
  shared coordinator) resumed the graph again with the stored answer: the approved action
  ran twice, the second answer silently dropped. It is APPROVAL_ALREADY_ANSWERED now; only
  the service's own runs (recovery) send a stored answer.
* An answer holding U+0000: the graph took it, then PostgreSQL refused the next checkpoint,
  reported as SERVICE_UNAVAILABLE, the approval settled `applied` and stuck. It is refused
  before it is recorded (400 / RUN_ERROR INVALID_REQUEST), the approval still answerable;
  a chat message the checkpoint store cannot keep is INVALID_REQUEST, not an outage.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Annotated, Any

import psycopg
import pytest
from langchain_core.messages import AnyMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import interrupt
from typing_extensions import TypedDict

from copilot_runtime import CopilotRuntime
from copilot_runtime._exceptions import ApprovalClosedError, InvalidRequestError
from copilot_runtime._time import iso_time
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.approvals import resume
from copilot_runtime.approvals.ledger import Approval
from copilot_runtime.checkpointers import checkpointer
from tests.conftest import poll, run_input
from tests.hitl_support.postgres import SERVER
from tests.test_approvals_reservations import drive

pytestmark = pytest.mark.timeout(30)

THREAD = "t-race"


class State(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    answer: Any
    note: str


@contextlib.contextmanager
def fa_schema() -> Iterator[str]:
    schema = f"fa_{uuid.uuid4().hex[:12]}"
    try:
        yield f"{SERVER}?schema={schema}"
    finally:
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@contextlib.asynccontextmanager
async def running(runtime: CopilotRuntime) -> AsyncIterator[CopilotRuntime]:
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.aclose()


def deciding_runtime(saver: Any, taken: list[Any], *, expires_at: float | None = None
                     ) -> CopilotRuntime:
    """A graph that asks once and records the answer it took (its `answer`, a string
    channel too: PostgreSQL keeps a string's value in the checkpoint's jsonb)."""

    def ask(state: State) -> dict[str, Any]:
        question: dict[str, Any] = {"message": "Pay the invoice?"}
        if expires_at is not None:
            question["expiresAt"] = iso_time(expires_at)
        answer = interrupt(question)
        taken.append(answer)
        return {"answer": answer, "note": str(answer)}

    builder: StateGraph[State] = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
        name="lg", graph=builder.compile(checkpointer=saver))})
    runtime.approvals.run_timer = False  # each test decides when anything is resent
    return runtime


async def ask_once(runtime: CopilotRuntime) -> Approval:
    events = await drive(runtime, run_input("Pay", thread=THREAD, protocolVersion="1.0"))
    assert events[-1]["outcome"]["type"] == "interrupt"
    (approval,) = await runtime.approvals.list(thread_id=THREAD)
    return approval


def resume_body(approval_id: str, payload: Any, run: str = "run-2") -> dict[str, Any]:
    body = run_input("", thread=THREAD, run=run, protocolVersion="1.0")
    body["messages"] = []
    body["resume"] = [{"interruptId": approval_id, "status": "resolved", "payload": payload}]
    return body


def deadline_passes_before_the_claim(monkeypatch: pytest.MonkeyPatch, deadline: float) -> None:
    """The run's claim reads the clock after the deadline; the answer's own check before
    it (the answer sent a few milliseconds before `expiresAt`)."""
    monkeypatch.setattr(resume, "time", SimpleNamespace(time=lambda: deadline + 0.01))


async def test_an_http_answer_the_deadline_overtakes_is_410_not_a_swapped_200(
        monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[Any] = []
    deadline = time.time() + 60
    runtime = deciding_runtime(InMemorySaver(), taken, expires_at=deadline)
    async with running(runtime):
        approval = await ask_once(runtime)
        deadline_passes_before_the_claim(monkeypatch, deadline)
        with pytest.raises(ApprovalClosedError) as refused:
            await runtime.approvals.answer(approval.id, {"action": "approve"},
                                           answered_by="alice")
        assert (refused.value.status, refused.value.code) == (410, "APPROVAL_EXPIRED")
        assert taken == []  # neither the answer nor a timeout in its place
        left = await runtime.approvals.list(thread_id=THREAD)
        assert [a.status for a in left] == ["pending"]  # the timer's to time out


async def test_an_agui_resume_the_deadline_overtakes_is_a_run_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[Any] = []
    deadline = time.time() + 60
    runtime = deciding_runtime(InMemorySaver(), taken, expires_at=deadline)
    async with running(runtime):
        approval = await ask_once(runtime)
        deadline_passes_before_the_claim(monkeypatch, deadline)
        events = await drive(runtime, resume_body(approval.id, {"action": "approve"}))
        assert (events[-1]["type"], events[-1]["code"]) == ("RUN_ERROR", "APPROVAL_EXPIRED")
        assert taken == []


async def test_a_second_client_answer_is_refused_while_the_first_is_being_taken() -> None:
    """Worker A claimed the approval and its run is taking it (no shared coordinator tells
    worker B the thread is busy, and the checkpoint still shows the interrupt): B's reject
    was swapped for A's approve and the graph ran it a second time."""
    taken: list[Any] = []
    runtime = deciding_runtime(InMemorySaver(), taken)
    async with running(runtime):
        approval = await ask_once(runtime)
        ledger = runtime.agents["lg"].approvals  # type: ignore[attr-defined]
        # A's claim, its run still on the way to the graph.
        assert await ledger.claim(approval.id, "answered", {"action": "approve"}, "alice",
                                  time.time())
        events = await drive(runtime, resume_body(approval.id, {"action": "reject"}))
        assert (events[-1]["type"], events[-1]["code"]) == (
            "RUN_ERROR", "APPROVAL_ALREADY_ANSWERED")
        assert "alice" in events[-1]["message"]
        assert taken == []
        # Recovery still sends the stored answer when A's run never does.
        await runtime.approvals._recover()
        async for _ in poll():
            settled = await ledger.get(approval.id)
            if settled is not None and settled.applied:
                break
        assert taken == [{"action": "approve"}]
        assert settled is not None
        assert (settled.status, settled.applied, settled.answered_by) == (
            "answered", True, "alice")


async def test_an_answer_holding_nul_is_refused_and_the_approval_stays_answerable() -> None:
    taken: list[Any] = []
    with fa_schema() as url:
        saver = checkpointer(url)
        runtime = deciding_runtime(saver, taken)
        async with running(runtime):
            approval = await ask_once(runtime)
            with pytest.raises(InvalidRequestError) as refused:
                await runtime.approvals.answer(
                    approval.id, {"action": "revise", "payload": "add the VAT\x00 line"},
                    answered_by="alice")
            assert refused.value.status == 400
            assert "U+0000" in refused.value.message
            events = await drive(runtime, resume_body(
                approval.id, {"action": "revise", "payload": {"line\x00": "VAT"}}))
            assert (events[-1]["type"], events[-1]["code"]) == ("RUN_ERROR", "INVALID_REQUEST")
            assert "U+0000" in events[-1]["message"]
            assert taken == []
            assert [a.status for a in await runtime.approvals.list(thread_id=THREAD)] == [
                "pending"]
            result = await runtime.approvals.answer(approval.id, {"action": "approve"},
                                                    answered_by="alice")
            assert (result["run"]["status"], result["approval"]["applied"]) == (
                "finished", True)
            assert taken == [{"action": "approve"}]


async def test_a_message_the_checkpoint_store_cannot_keep_is_invalid_not_an_outage() -> None:
    """A graph keeping a chat message's text in a string channel: PostgreSQL refuses the
    checkpoint (a data error, SQLSTATE 22P05), which was SERVICE_UNAVAILABLE."""

    def keep(state: State) -> dict[str, Any]:
        return {"note": str(state["messages"][-1].content)}

    builder: StateGraph[State] = StateGraph(State)
    builder.add_node("keep", keep)
    builder.add_edge(START, "keep")
    builder.add_edge("keep", END)
    with fa_schema() as url:
        graph = builder.compile(checkpointer=checkpointer(url))
        runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
        async with running(runtime):
            events = await drive(runtime, run_input("hello\x00there", thread=THREAD))
            assert (events[-1]["type"], events[-1]["code"]) == ("RUN_ERROR", "INVALID_REQUEST")
            assert "U+0000" in events[-1]["message"]
            assert "22P05" not in events[-1]["message"]  # the store's text is not echoed
            events = await drive(runtime, run_input("hello", thread="t-clean", run="run-2"))
            assert events[-1]["type"] == "RUN_FINISHED"
