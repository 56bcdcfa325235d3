"""The workflows under hostile use: a review that never ends, a model that breaks off in the
middle of a draft, a client that would skip the review, a router that names specialists that
do not exist, and orchestrator steps that fail, never end or answer megabytes.

Each must end precisely (a message or an AG-UI `RUN_ERROR` naming what went wrong), keep
what it stores bounded, and leave the thread ready for the next run.
"""

from __future__ import annotations

import asyncio
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.types import Command

from copilot_runtime.workflows.review_loop import HISTORY_ENTRIES, ReviewLoop
from copilot_runtime.workflows.specialists import SpecialistRequest

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
