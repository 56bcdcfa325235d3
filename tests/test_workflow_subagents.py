"""What the workflows' sub-agents (orchestrator steps, wrapped agents, review-loop
specialists and routers) may do besides answer: ask a person (a LangGraph `interrupt`), ask
for an approval, send events the client must not get whole, or linger after their result."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command, interrupt

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime.workflows.existing import run_existing_agent, wrap_existing_agent
from copilot_runtime.workflows.orchestrator import ApprovalPolicy, Orchestrator, Step
from copilot_runtime.workflows.review_loop import ReviewLoop
from copilot_runtime.workflows.specialists import Specialist, SpecialistRequest

Event = dict[str, Any]


async def asked_then_answered(graph: Any, answer: Any, message: str = "Review ACME-001"
                              ) -> tuple[Any, dict[str, Any]]:
    """The first question the graph asks, and its state once `answer` was given to it."""
    config = {"configurable": {"thread_id": "t"}}
    result = await graph.ainvoke({"messages": [HumanMessage(content=message)]}, config)
    asked = result["__interrupt__"][0].value
    await graph.ainvoke(Command(resume=answer), config)
    return asked, dict((await graph.aget_state(config)).values)


# -- a sub-agent's own question reaches the person -------------------------------------------

class AsksFirst:
    """An existing agent that asks a person (LangGraph's `interrupt`) before it answers."""

    async def execute_with_events(self, context: dict[str, Any]) -> AsyncIterator[Event]:
        yield {"event": "agent_started", "data": {}}
        limit = interrupt({"question": "Which credit limit?"})
        yield {"event": "agent_completed", "data": {"output": {"summary": f"limit {limit}"}}}


class AskingSpecialist:
    name, description, keywords = "Invoice", "asks for a due date", ("invoice",)

    async def run(self, request: SpecialistRequest) -> str:
        due = interrupt({"question": "Due date?"})
        return f"invoice due {due}"


def asking_router(task: str, specialists: Sequence[Specialist]) -> tuple[str, str]:
    name = interrupt({"question": "Which specialist?"})
    return str(name), "the person chose"


async def test_an_orchestrator_steps_question_reaches_the_person() -> None:
    """It was a failure of the step ("asks failed (GraphInterrupt)")."""
    graph = Orchestrator([Step("asks", AsksFirst(), ("account_id",), "limit")]).compile(
        InMemorySaver())
    asked, state = await asked_then_answered(graph, "5000")
    assert asked == {"question": "Which credit limit?"}
    assert state["result"]["status"] == "completed"
    assert state["result"]["results"] == {"limit": {"summary": "limit 5000"}}


async def test_a_wrapped_agents_question_reaches_the_person() -> None:
    graph = wrap_existing_agent(AsksFirst(), "asks").compile(checkpointer=InMemorySaver())
    asked, state = await asked_then_answered(graph, "5000")
    assert asked == {"question": "Which credit limit?"}
    assert state["error"] is None
    assert state["agent_outputs"] == {"asks": {"summary": "limit 5000"}}


async def test_a_specialists_and_a_routers_questions_reach_the_person() -> None:
    """The specialist's was sent to review as its failure; the router's failed the task."""
    graph = ReviewLoop([AskingSpecialist()]).compile(InMemorySaver())
    asked, state = await asked_then_answered(graph, "Friday", "Prepare the invoice")
    assert asked == {"question": "Due date?"}
    assert state["draft"] == "invoice due Friday"
    assert state["status"] == "awaiting_review"

    graph = ReviewLoop([AskingSpecialist()], router=asking_router).compile(InMemorySaver())
    asked, state = await asked_then_answered(graph, "Invoice", "Prepare the invoice")
    assert asked == {"question": "Which specialist?"}
    assert state["specialist"] == "Invoice"


# -- a step's approval request is asked, never dropped ---------------------------------------

class Payer:
    """An existing agent whose action needs a person's approval (`approval_required`)."""

    def __init__(self) -> None:
        self.runs = 0

    async def execute_with_events(self, context: dict[str, Any]) -> AsyncIterator[Event]:
        self.runs += 1
        yield {"event": "approval_required", "data": {"action": "wire 50,000 EUR"}}
        yield {"event": "agent_completed", "data": {"output": {"summary": "payment prepared"}}}


async def run_answering(graph: Any, *answers: Any) -> tuple[list[Any], dict[str, Any]]:
    """Start `graph`, answer its questions in turn; what it asked and its final state."""
    config = {"configurable": {"thread_id": "t"}}
    result = await graph.ainvoke({"messages": [HumanMessage(content="Pay ACME-001")]}, config)
    asked, pending = [], list(answers)
    while "__interrupt__" in result and pending:
        asked.append(result["__interrupt__"][0].value)
        result = await graph.ainvoke(Command(resume=pending.pop(0)), config)
    assert "__interrupt__" not in result
    return asked, dict((await graph.aget_state(config)).values)


def chat(state: dict[str, Any]) -> list[str]:
    return [str(m.content) for m in state["messages"]]


async def test_a_steps_approval_request_is_asked_before_the_run_goes_on() -> None:
    """The orchestrator dropped it ("no approval needed"): a payment ran unapproved."""
    payer = Payer()
    graph = Orchestrator([
        Step("payer", payer, ("account_id",), "payment"),
        Step("notifier", Payer(), ("payment",), "notice", approval_timeout_seconds=None),
    ]).compile(InMemorySaver())
    asked, state = await run_answering(graph, "maybe", "approve", {"action": "approve"})
    first, again, second = asked
    assert first["type"] == "approval_required"
    assert (first["agent"], first["data"]) == ("payer", {"action": "wire 50,000 EUR"})
    assert first["timeout_seconds"] == 300
    assert again["message"].startswith("Answer approve or reject.")
    assert second["agent"] == "notifier"
    assert "expiresAt" not in second
    assert payer.runs == 1  # asked, not run again
    result = state["result"]
    assert result["status"] == "completed"
    assert result["results"]["payment"] == {"summary": "payment prepared"}
    assert result["step_approvals"]["payer"]["status"] == "approved"
    assert chat(state)[-1] == ("Completed 2 of 2 steps; payer's approval: approved, "
                               "notifier's approval: approved.")


async def test_a_steps_approval_rejected_fails_the_step() -> None:
    graph = Orchestrator([Step("payer", Payer(), ("account_id",), "payment")]).compile(
        InMemorySaver())
    _, state = await run_answering(graph, {"action": "reject", "reason": "too much"})
    assert state["result"]["status"] == "error"
    assert "payment" not in state["result"]["partial_results"]
    assert chat(state)[-1] == ("Stopped: Critical agent payer failed (payer's approval "
                               "was rejected: too much).")
    # Optional, the run goes on without its output.
    graph = Orchestrator([
        Step("payer", Payer(), ("account_id",), "payment", required=False),
        Step("notifier", AsksFirst(), ("account_id",), "notice"),
    ]).compile(InMemorySaver())
    _, state = await run_answering(graph, {"action": "timeout"}, "ok")
    result = state["result"]
    assert result["status"] == "completed"
    assert result["results"] == {"payment": None, "notice": {"summary": "limit ok"}}
    assert [e["error"] for e in result["errors"]] == [
        "payer's approval timed out"]


async def test_an_approval_asked_again_after_a_failed_revision_says_so() -> None:
    """It asked the same question with the earlier output and no word of the failure."""
    class FailsToRevise:
        async def execute_with_events(self, context: dict[str, Any]
                                      ) -> AsyncIterator[Event]:
            if "feedback" in context:
                yield {"event": "agent_error", "data": {"error_message": "model unavailable"}}
                return
            yield {"event": "agent_completed", "data": {"output": ["raise the limit to 1M"]}}

    graph = Orchestrator(
        [Step("rec", FailsToRevise(), ("account_id",), "recommendations", required=False)],
        approval=ApprovalPolicy(timeout_seconds=None)).compile(InMemorySaver())
    asked, state = await run_answering(
        graph, {"action": "revise", "payload": "at most 100k"}, "approve")
    first, again = asked
    assert first["message"] == "Approve the recommendation?"
    assert again["message"] == ("The revision failed (model unavailable); this is the "
                                "earlier result. Approve the recommendation?")
    assert again["recommendations"] == ["raise the limit to 1M"]
    assert state["result"]["approval"]["status"] == "approved"


def test_a_steps_approval_timeout_is_checked_when_built() -> None:
    for seconds in (0, -1, float("nan"), float("inf"), "5", True):
        with pytest.raises(ConfigurationError, match="'payer': approval_timeout_seconds"):
            Step("payer", Payer(), (), "out", approval_timeout_seconds=seconds)  # type: ignore[arg-type]
    assert Step("payer", Payer(), (), "out", approval_timeout_seconds=None
                ).approval_timeout_seconds is None


# -- what a sub-agent's events may carry to the client ---------------------------------------

class Sends:
    """An existing agent that sends one event, then completes."""

    def __init__(self, event: Event) -> None:
        self.event = event

    async def execute_with_events(self, context: dict[str, Any]) -> AsyncIterator[Event]:
        yield self.event
        yield {"event": "agent_completed", "data": {"output": {"summary": "ok"}}}


async def sent_events(event: Event) -> list[tuple[str, Any]]:
    """The custom events a wrapped agent sending `event` dispatches (name, value), but the
    wrapper's own chat messages."""
    graph = wrap_existing_agent(Sends(event), "s").compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t"}}
    return [(e["name"], e["data"]) async for e in graph.astream_events(
        {"messages": [HumanMessage(content="go")]}, config, version="v2")
        if e["event"] == "on_custom_event"
        and e["name"] != "copilotkit_manually_emit_message"]


def cycle() -> dict[str, Any]:
    loop: dict[str, Any] = {}
    loop["me"] = loop
    return loop


async def test_an_event_json_cannot_measure_is_sent_as_a_notice() -> None:
    """An int past 64 bits or a cycle made the 64 kB bound let megabytes through."""
    for data in ({"id": 2**64, "result": "r" * 100_000}, {"loop": cycle(), "result": "r"}):
        (first, _) = await sent_events({"event": "tool_result", "data": data})
        assert first[0] == "tool_result"
        assert set(first[1]) == {"agent", "omitted"}
        assert len(str(first[1])) < 200
    # A small one with a large int is as it was.
    (first, _) = await sent_events({"event": "tool_result", "data": {"id": 2**64}})
    assert first == ("tool_result", {"agent": "s", "id": 2**64})


async def test_an_events_name_is_bounded() -> None:
    (first, _) = await sent_events({"event": "n" * 3_000_000, "data": {}})
    assert len(first[0]) <= 200
    assert len(str(first[1])) < 400


async def test_an_event_named_as_copilotkits_own_is_renamed() -> None:
    """Dispatched under its name, it was taken for CopilotKit's own (and the run crashed
    with a generic AGENT_ERROR)."""
    for name in ("copilotkit_manually_emit_message", "copilotkit_exit", "on_interrupt",
                 "manually_emit_state", "Exit", "PredictState", "on_copilotkit_interrupt"):
        (first, completed) = await sent_events({"event": name, "data": {"x": 1}})
        assert first == ("agent_event", {"agent": "s", "event": name, "x": 1})
        assert completed[0] == "agent_completed"


# -- an agent's result ends its run ----------------------------------------------------------

async def test_an_agent_is_read_up_to_its_agent_completed() -> None:
    """It was read on: one that went on sending (a heartbeat) never ended, and an error
    after its result failed the step."""
    closed: list[bool] = []

    class Lingers:
        async def execute_with_events(self, context: dict[str, Any]
                                      ) -> AsyncIterator[Event]:
            try:
                yield {"event": "agent_completed", "data": {"output": "done"}}
                yield {"event": "agent_error", "data": {"error_message": "late warning"}}
                while True:
                    await asyncio.sleep(0.01)
                    yield {"event": "agent_stream", "data": {"chunk": "."}}
            finally:
                closed.append(True)

    run = await asyncio.wait_for(run_existing_agent(Lingers(), "l", {}), 5)
    assert (run.output, run.events_seen, closed) == ("done", 1, [True])
