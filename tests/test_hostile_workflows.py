"""The workflows under hostile use: a review that never ends, a model that breaks off in the
middle of a draft, a client that would skip the review, a router that names specialists that
do not exist, and orchestrator steps that fail, never end or answer megabytes.

Each must end precisely (a message or an AG-UI `RUN_ERROR` naming what went wrong), keep
what it stores bounded, and leave the thread ready for the next run.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.types import Command

from copilot_runtime._input import parse_run_input
from copilot_runtime.adapters.base import ChatDelta, ChatRequest, StreamEnd, TextDelta
from copilot_runtime.agents.base import RunContext
from copilot_runtime.testing import verify_events
from copilot_runtime.workflows.models import AdapterChatModel
from copilot_runtime.workflows.review_loop import HISTORY_ENTRIES, ReviewLoop
from copilot_runtime.workflows.specialists import ModelSpecialist, SpecialistRequest

_SERDE = JsonPlusSerializer()


def stored_size(values: dict[str, Any]) -> int:
    """Bytes the checkpoint serializer writes for a state's values."""
    return sum(len(_SERDE.dumps_typed(value)[1]) for value in values.values())


# -- a review that goes on and on stays bounded ---------------------------------------------

class LongDrafts:
    """A specialist whose every draft is 4000 characters long."""

    name, description = "Invoice", "long drafts"

    def __init__(self) -> None:
        self.requests: list[SpecialistRequest] = []

    async def run(self, request: SpecialistRequest) -> str:
        self.requests.append(request)
        return f"draft {request.iteration} " + "x" * 4000


def test_fifty_revisions_keep_the_checkpoint_bounded() -> None:
    drafts = LongDrafts()
    graph = ReviewLoop([drafts]).compile(InMemorySaver())
    config: Any = {"configurable": {"thread_id": "long"}}
    sizes: dict[int, int] = {}

    async def go() -> dict[str, Any]:
        await graph.ainvoke({"messages": [HumanMessage(content="Prepare the invoice")]},
                            config)
        for revision in range(1, 51):
            await graph.ainvoke(Command(resume={"action": "revise",
                                                "payload": f"change {revision} " + "y" * 300}),
                                config)
            if revision in (20, 50):
                sizes[revision] = stored_size((await graph.aget_state(config)).values)
        return dict((await graph.aget_state(config)).values)

    state = asyncio.run(go())
    # It was 439 kB after 50 revisions and grew by 8.6 kB with each one (every draft was
    # kept twice: in the history and in the chat), copied into every checkpoint. Now a
    # revision adds one line to the chat (the earlier draft's place), nothing else.
    assert sizes[50] - sizes[20] < 30 * 400, sizes
    assert sizes[50] < 100_000, sizes
    assert len(state["history"]) == HISTORY_ENTRIES
    assert state["history_left_out"] == 1 + 51 + 50 - HISTORY_ENTRIES  # routed, drafts, answers
    assert state["draft"].startswith("draft 51 ")
    drafts_in_chat = [m for m in state["messages"]
                      if isinstance(m, AIMessage) and str(m.content).startswith("draft ")]
    assert [str(m.content)[:9] for m in drafts_in_chat] == ["draft 51 "]
    superseded = [m for m in state["messages"] if "superseded" in str(m.content)]
    assert len(superseded) == 50  # the earlier drafts keep their place in the chat
    # The specialist still gets what it needs: the task, the current draft in full, the
    # latest feedback, and the count of what was left out.
    last = drafts.requests[-1]
    assert last.task == "Prepare the invoice"
    assert last.draft == f"draft 50 {'x' * 4000}"
    assert str(last.feedback).startswith("change 50 ")
    assert last.left_out + len(last.history) == 1 + 50 + 50


# -- a model that breaks off in the middle of a draft -----------------------------------------

class BreaksOffOnce:
    """A provider adapter whose first answer breaks off after two pieces of text."""

    provider = "breaks-off"

    def __init__(self) -> None:
        self.calls = 0

    async def aclose(self) -> None:
        return None

    async def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        self.calls += 1
        if self.calls == 1:
            yield [TextDelta("Half of ")]
            yield [TextDelta("a draft")]
            raise ConnectionError("socket to 10.1.2.3 reset")
        yield [TextDelta("A whole draft.")]
        yield [StreamEnd("stop")]


def breaking_loop(**options: Any) -> Any:
    model = AdapterChatModel(adapter=BreaksOffOnce())
    specialist = ModelSpecialist("Invoice", "invoices", "Prepare invoices.", model)
    return ReviewLoop([specialist], **options).agent(name="review",
                                                     checkpointer=InMemorySaver())


async def run_agent(agent: Any, run: str, **fields: Any) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"threadId": "t", "runId": run, "state": {}, "tools": [],
                            "context": [], "forwardedProps": {}, "messages": [],
                            "protocolVersion": "1.0", **fields}
    events = [event async for batch in agent.run(parse_run_input(body), RunContext("review"))
              for event in batch]
    verify_events(events)  # every message started is ended before the run ends
    return events


def texts(events: list[dict[str, Any]]) -> list[str]:
    by_id: dict[str, str] = {}
    for event in events:
        if event["type"] == "TEXT_MESSAGE_CONTENT":
            by_id[event["messageId"]] = by_id.get(event["messageId"], "") + event["delta"]
    return list(by_id.values())


async def test_a_draft_broken_off_is_closed_and_the_person_may_revise() -> None:
    agent = breaking_loop()
    task = [{"id": "u1", "role": "user", "content": "Prepare the invoice"}]
    first = await run_agent(agent, "r1", messages=task)
    # The half draft's message ends where the model broke off, before the step does.
    partial = next(e["messageId"] for e in first if e.get("delta") == "Half of ")
    ends = [i for i, e in enumerate(first) if e["type"] == "TEXT_MESSAGE_END"
            and e["messageId"] == partial]
    step_end = next(i for i, e in enumerate(first) if e["type"] == "STEP_FINISHED"
                    and e["stepName"] == "Invoice")
    assert len(ends) == 1
    assert ends[0] < step_end
    (interrupt,) = first[-1]["outcome"]["interrupts"]
    assert interrupt["message"].startswith("The Invoice specialist failed (ConnectionError).")
    assert "10.1.2.3" not in str(first)
    snapshot = [e for e in first if e["type"] == "STATE_SNAPSHOT"][-1]["snapshot"]
    assert snapshot["draft"] == ""  # nothing half written is kept as the draft
    # The next run takes the answer and drafts again, cleanly.
    second = await run_agent(agent, "r2", resume=[{
        "interruptId": interrupt["id"], "status": "resolved",
        "payload": {"action": "revise", "payload": "try again"}}])
    assert "A whole draft." in texts(second)
    assert second[-1]["outcome"]["interrupts"][0]["message"] == \
        "Please approve or provide revision"


async def test_a_draft_broken_off_without_review_fails_the_task_and_the_thread_goes_on(
        ) -> None:
    agent = breaking_loop(client_may_skip_review=True)
    no_review = {"review": False}
    first = await run_agent(agent, "r1", state=no_review, messages=[
        {"id": "u1", "role": "user", "content": "Prepare the invoice"}])
    assert texts(first)[-1] == ("The task failed: The Invoice specialist failed "
                                "(ConnectionError).")
    second = await run_agent(agent, "r2", state=no_review, messages=[
        {"id": "u1", "role": "user", "content": "Prepare the invoice"},
        {"id": "u2", "role": "user", "content": "Prepare the invoice again"}])
    assert texts(second)[-2:] == [
        "A whole draft.", "Done: the Invoice specialist's result is final (review was off)."]
