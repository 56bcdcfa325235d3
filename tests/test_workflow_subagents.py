"""What the workflows' sub-agents (orchestrator steps, wrapped agents, review-loop
specialists and routers) may do besides answer: ask a person (a LangGraph `interrupt`), ask
for an approval, send events the client must not get whole, or linger after their result."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command, interrupt

from copilot_runtime.workflows.existing import wrap_existing_agent
from copilot_runtime.workflows.orchestrator import Orchestrator, Step
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
