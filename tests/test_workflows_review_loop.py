"""The review loop (`workflows.review_loop`): its six correctness properties (Hypothesis,
100+ examples each) and its error rules.

Every example runs the real LangGraph graph (checkpointed in memory) with recording
specialists, answering each clarification request from a generated script.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from copilot_runtime.approvals.decisions import Decision, parse_decision
from copilot_runtime.workflows.review_loop import ReviewLoop, Router
from copilot_runtime.workflows.specialists import (
    SpecialistRequest,
    finance_specialists,
    keyword_router,
    specialist_prompt,
)

NAMES = ("Invoice", "Closing", "Audit")
PROPERTY = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Recording:
    """A specialist that answers from a script and remembers every request."""

    name: str
    results: list[str] = field(default_factory=list)
    calls: list[SpecialistRequest] = field(default_factory=list)
    fail_on: set[int] = field(default_factory=set)
    description: str = "records its requests"

    async def run(self, request: SpecialistRequest) -> str:
        self.calls.append(request)
        if len(self.calls) in self.fail_on:
            raise RuntimeError("the specialist's backend is down")
        index = len(self.calls) - 1
        return self.results[index] if index < len(self.results) \
            else f"{self.name} result {request.iteration}"


@dataclass
class Trace:
    requests: list[dict[str, Any]]   # every clarification request, in order
    state: dict[str, Any]            # the graph's state at the end
    specialists: dict[str, Recording]
    routed: list[str]                # every task the router saw

    @property
    def calls(self) -> list[tuple[str, SpecialistRequest]]:
        out = [(name, c) for name, s in self.specialists.items() for c in s.calls]
        return sorted(out, key=lambda call: call[1].iteration)


@dataclass
class Slot:
    """A specialist of a compiled graph shared by many runs: it hands each request to the
    recording of the run in progress."""

    name: str
    current: dict[str, Recording]
    description: str = "records its requests"

    async def run(self, request: SpecialistRequest) -> str:
        return await self.current[self.name].run(request)


@dataclass
class SharedGraph:
    """One compiled loop per set of options: compiling costs far more than a run, and
    every run gets a thread of its own, so the examples stay independent."""

    graph: Any
    saver: InMemorySaver
    recordings: dict[str, Recording]
    routers: list[Router]


_graphs: dict[tuple[tuple[str, Any], ...], SharedGraph] = {}


def shared_graph(options: dict[str, Any]) -> SharedGraph:
    key = tuple(sorted(options.items()))
    if key not in _graphs:
        recordings: dict[str, Recording] = {}
        routers: list[Router] = []
        loop = ReviewLoop([Slot(n, recordings) for n in NAMES],
                          router=lambda text, named: routers[0](text, named), **options)
        saver = InMemorySaver()
        _graphs[key] = SharedGraph(loop.compile(saver), saver, recordings, routers)
    return _graphs[key]


def run_loop(task: str, answers: Sequence[Any], *, chosen: str = "Invoice",
             review: bool | None = None, results: Sequence[str] = (),
             fail_on: set[int] | None = None, **options: Any) -> Trace:
    """Run one task through the loop, answering each clarification request in turn."""
    specialists = {n: Recording(n, list(results) if n == chosen else [],
                                fail_on=set(fail_on or ()) if n == chosen else set())
                   for n in NAMES}
    routed: list[str] = []

    def router(text: str, _: Sequence[Any]) -> tuple[str, str]:
        routed.append(text)
        return chosen, "chosen by the test"

    shared = shared_graph(options)
    shared.recordings.clear()
    shared.recordings.update(specialists)
    shared.routers[:] = [router]
    graph = shared.graph
    thread_id = str(uuid.uuid4())
    config = {"configurable": {"thread_id": thread_id}}

    async def go() -> Trace:
        start: dict[str, Any] = {"messages": [HumanMessage(content=task)]}
        if review is not None:
            start["review"] = review
        result = await graph.ainvoke(start, config)
        requests: list[dict[str, Any]] = []
        pending = list(answers)
        while "__interrupt__" in result:
            requests.append(result["__interrupt__"][0].value)
            if not pending:
                break
            result = await graph.ainvoke(Command(resume=pending.pop(0)), config)
        state = (await graph.aget_state(config)).values
        return Trace(requests, dict(state), specialists, routed)

    try:
        return asyncio.run(go())
    finally:
        shared.saver.delete_thread(thread_id)


# -- strategies -------------------------------------------------------------------------

texts = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
tasks = texts.filter(lambda s: bool(s.strip()))
# What people type to ask for a change: anything that is not an approval or refusal word.
feedback = tasks.filter(lambda s: (d := parse_decision(s)) is not None and d.action == "revise")
revisions = feedback.flatmap(lambda text: st.sampled_from([
    text, {"action": "revise", "payload": text}, {"answer": text, "is_approval": False},
    {"approved": False, "answer": text}]).map(lambda answer: (text, answer)))
approvals = st.sampled_from(["OK", "approve", "Yes", {"action": "approve"},
                             {"approved": True}, {"answer": "OK", "is_approval": True},
                             '{"action": "approve"}'])
specialist = st.sampled_from(NAMES)


# -- the six properties ------------------------------------------------------------------

@PROPERTY
@given(task=tasks, chosen=specialist, result=texts)
def test_property_1_every_result_goes_to_review(task: str, chosen: str, result: str) -> None:
    """With review on, a specialist's result is sent for clarification before completing."""
    trace = run_loop(task, [], chosen=chosen, results=[result])
    assert len(trace.requests) == 1
    request = trace.requests[0]
    assert request["type"] == "user_clarification_request"
    assert request["data"]["agent"] == chosen
    assert request["data"]["agent_result"] == result
    assert request["data"]["question"] == "Please approve or provide revision"
    assert trace.state["status"] == "awaiting_review"
    assert len(trace.calls) == 1


@PROPERTY
@given(task=tasks, chosen=specialist, script=st.lists(revisions, max_size=6))
def test_property_2_context_is_preserved(task: str, chosen: str,
                                         script: list[tuple[str, Any]]) -> None:
    """Through every loop the original task stays, and the history holds every step."""
    trace = run_loop(task, [answer for _, answer in script] + ["OK"], chosen=chosen)
    assert trace.state["task"] == task.strip()
    history = trace.state["history"]
    assert history[0] == {"iteration": 1, "agent": "Planner",
                          "result": f"Routed to {chosen}: chosen by the test"}
    assert [e["user_feedback"] for e in history if e["agent"] == "HITL"][:-1] == \
        [text.strip() for text, _ in script]
    for name, call in trace.calls:
        assert name == chosen
        assert call.task == task.strip()
        # the full history so far: exactly what the state held when the call was made
        assert list(call.history) == history[:len(call.history)]
        assert call.history[-1]["agent"] in ("Planner", "HITL")
        assert specialist_prompt(call).startswith(f"Task: {task.strip()}\n")


@PROPERTY
@given(task=tasks, script=st.lists(revisions, max_size=5), approval=approvals)
def test_property_3_approval_completes(task: str, script: list[tuple[str, Any]],
                                       approval: Any) -> None:
    """An approval marks the task completed, with no further specialist run."""
    trace = run_loop(task, [answer for _, answer in script] + [approval])
    assert trace.state["status"] == "completed"
    assert len(trace.calls) == len(script) + 1
    assert len(trace.requests) == len(script) + 1
    assert trace.state["history"][-1]["user_feedback"] == "approve"
    last = trace.state["messages"][-1]
    assert isinstance(last, AIMessage)
    assert last.content == "Approved: the Invoice specialist's result is final."


@PROPERTY
@given(task=tasks, chosen=specialist, script=st.lists(revisions, min_size=1, max_size=5))
def test_property_4_revision_goes_straight_back(task: str, chosen: str,
                                               script: list[tuple[str, Any]]) -> None:
    """A revision returns to the same specialist, without the planner, with its context."""
    trace = run_loop(task, [answer for _, answer in script], chosen=chosen)
    assert trace.routed == [task.strip()]  # the planner routed once, never again
    calls = trace.calls
    assert len(calls) == len(script) + 1
    for (text, _), (name, call) in zip(script, calls[1:], strict=True):
        assert name == chosen
        assert call.feedback == text.strip()
        assert call.history[-1] == {"iteration": call.iteration - 1, "agent": "HITL",
                                    "user_feedback": text.strip()}
        assert call.history[-2]["agent"] == chosen  # the draft that was revised
    assert [r["data"]["iteration"] for r in trace.requests] == list(range(1, len(script) + 2))
    assert trace.state["status"] == "awaiting_review"


@PROPERTY
@given(task=tasks, chosen=specialist, result=texts)
def test_property_5_review_can_be_switched_off(task: str, chosen: str, result: str) -> None:
    """A task set to skip review completes after the specialist, with no request (where
    the loop lets the client skip it)."""
    trace = run_loop(task, [], chosen=chosen, results=[result], review=False,
                     client_may_skip_review=True)
    assert trace.requests == []
    assert trace.state["status"] == "completed"
    assert len(trace.calls) == 1
    assert trace.state["draft"] == result
    assert trace.state["messages"][-1].content == (
        f"Done: the {chosen} specialist's result is final (review was off).")


@PROPERTY
@given(task=tasks, count=st.integers(min_value=0, max_value=30), approve=st.booleans())
def test_property_6_revisions_are_unlimited(task: str, count: int, approve: bool) -> None:
    """However many revisions come, each is processed and loops back."""
    script: list[Any] = [f"revision {i}" for i in range(count)] + (["OK"] if approve else [])
    trace = run_loop(task, script)
    assert len(trace.calls) == count + 1
    assert [c.iteration for _, c in trace.calls] == list(range(1, count + 2))
    assert [c.feedback for _, c in trace.calls] == [None] + [f"revision {i}"
                                                            for i in range(count)]
    assert trace.state["iteration"] == count + 1
    assert trace.state["status"] == ("completed" if approve else "awaiting_review")


def test_hundreds_of_revisions_hit_no_limit() -> None:
    trace = run_loop("Close March", [f"again {i}" for i in range(250)] + ["OK"])
    assert len(trace.calls) == 251
    assert trace.state["status"] == "completed"


# -- error rules ---------------------------------------------------------------------------

# (None and {} never reach a graph: LangGraph cannot resume with them, so the runtime
# treats them as no answer and asks again; see test_hitl_agui.)
MALFORMED = [42, "", "   ", {"action": "dance"}, {"action": "revise"}, [1, 2], {"x": 1}]


@pytest.mark.parametrize("answer", MALFORMED, ids=repr)
def test_a_malformed_answer_is_asked_again(answer: Any) -> None:
    trace = run_loop("Prepare the invoice", [answer, "OK"])
    assert len(trace.requests) == 2
    assert trace.requests[1]["message"].startswith("That answer was neither an approval")
    assert trace.requests[1]["data"]["agent_result"] == trace.requests[0]["data"]["agent_result"]
    assert len(trace.calls) == 1  # asking again did not re-run the specialist
    assert trace.state["status"] == "completed"
    assert trace.state["history"][-2]["malformed"] is True


def test_approving_malformed_answers_is_an_option() -> None:
    trace = run_loop("Prepare the invoice", [{"what": "?"}], on_malformed="approve")
    assert trace.state["status"] == "completed"
    assert len(trace.requests) == 1


def test_a_failing_specialist_lets_the_person_revise_again() -> None:
    trace = run_loop("Audit the payroll", ["try again please", "OK"], fail_on={1})
    assert "The Invoice specialist failed (RuntimeError)" in trace.requests[0]["message"]
    assert "backend is down" not in str(trace.requests[0])  # no internals to the client
    assert trace.state["history"][1]["error"] == "The Invoice specialist failed (RuntimeError)"
    assert len(trace.calls) == 2
    assert trace.calls[1][1].feedback == "try again please"
    assert trace.state["status"] == "completed"


def test_a_failing_specialist_without_review_fails_the_task() -> None:
    trace = run_loop("Audit the payroll", [], fail_on={1}, review=False,
                     client_may_skip_review=True)
    assert trace.requests == []
    assert trace.state["status"] == "failed"
    assert "failed" in trace.state["messages"][-1].content


def test_a_failing_review_step_fails_the_task(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: ReviewLoop, state: Any) -> dict[str, Any]:
        raise ValueError("cannot format")

    monkeypatch.setattr(ReviewLoop, "clarification_request", broken)
    trace = run_loop("Prepare the invoice", [])
    assert trace.requests == []
    assert trace.state["status"] == "failed"  # nobody was asked: nothing is approved
    last = trace.state["messages"][-1].content
    assert last == ("The task failed: could not ask for review (ValueError), so nothing "
                    "was approved.")
    assert "cannot format" not in last


@pytest.mark.parametrize(("answer", "status", "text"), [
    ({"action": "reject", "reason": "wrong client"}, "rejected",
     "Rejected (wrong client): the task stops here."),
    ("no", "rejected", "Rejected: the task stops here."),
    ({"action": "timeout"}, "timed_out", "Nobody answered in time"),
    ({"__agui_cancelled__": True, "interrupt_id": "x"}, "rejected", "Rejected (Cancelled"),
])
def test_refusals_end_the_task(answer: Any, status: str, text: str) -> None:
    trace = run_loop("Prepare the invoice", [answer])
    assert trace.state["status"] == status
    assert trace.state["messages"][-1].content.startswith(text)
    assert len(trace.calls) == 1


def test_review_timeout_sets_expires_at() -> None:
    trace = run_loop("Prepare the invoice", [], timeout_seconds=60)
    assert trace.requests[0]["expiresAt"].endswith("Z")


def test_keyword_router() -> None:
    specialists = finance_specialists(model=None)  # type: ignore[arg-type]
    assert keyword_router("Please reconcile the ledger for month-end", specialists)[0] \
        == "Closing"
    assert keyword_router("Send the invoice with VAT", specialists)[0] == "Invoice"
    assert keyword_router("Check SOX controls", specialists)[0] == "Audit"
    name, reason = keyword_router("Write a poem", specialists)
    assert (name, reason) == ("Invoice", "no specialist matched, so the first one takes it")


def test_a_new_task_starts_a_new_history() -> None:
    specialists = [Recording(n) for n in NAMES]
    graph = ReviewLoop(specialists).compile(InMemorySaver())
    config = {"configurable": {"thread_id": "t"}}

    async def go() -> dict[str, Any]:
        await graph.ainvoke({"messages": [HumanMessage(content="invoice one")]}, config)
        await graph.ainvoke(Command(resume="OK"), config)
        await graph.ainvoke({"messages": [HumanMessage(content="audit two")]}, config)
        return (await graph.aget_state(config)).values

    state = asyncio.run(go())
    assert state["task"] == "audit two"
    assert state["specialist"] == "Audit"
    assert [e["agent"] for e in state["history"]] == ["Planner", "Audit"]


@pytest.mark.parametrize(("value", "expected"), [
    ("OK", Decision("approve")),
    ("lgtm.", Decision("approve")),
    ("reject", Decision("reject")),
    ("Nope", Decision("reject")),
    ("No, thanks!", Decision("reject")),
    ("no thank you.", Decision("reject")),
    ("Stop", Decision("reject")),
    ("no thanks to the intro, shorten it", Decision("revise",
                                                    "no thanks to the intro, shorten it")),
    ("make it shorter", Decision("revise", "make it shorter")),
    ({"action": "approve", "userId": "ann", "reason": "fine"}, Decision("approve", "fine",
                                                                         None, "ann")),
    ({"action": "revise", "payload": {"feedback": "net 30"}},
     Decision("revise", "net 30", {"feedback": "net 30"})),
    ({"approved": True}, Decision("approve")),
    ({"approved": False}, Decision("reject")),
    ({"answer": "OK", "is_approval": True}, Decision("approve")),
    ('{"action": "reject"}', Decision("reject")),
    ({"action": "timeout", "reason": "late"}, Decision("timeout", "late")),
    ({"nothing": 1}, None),
    (3.5, None),
])
def test_parse_decision(value: Any, expected: Decision | None) -> None:
    assert parse_decision(value) == expected
