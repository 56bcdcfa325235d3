"""The review loop refuses to record what did not happen: an approval nobody was asked for
(a timeout it cannot write, a request it cannot build), a "no" taken as a yes under
`on_malformed="approve"`; and it bounds what reviewers' answers and the history carry into
the next prompt."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime.adapters.base import StreamEnd
from copilot_runtime.workflows.models import AdapterChatModel
from copilot_runtime.workflows.review_loop import MAX_FEEDBACK_CHARS, ReviewLoop
from copilot_runtime.workflows.specialists import (
    PROMPT_ENTRY_CHARS,
    PROMPT_HISTORY_ENTRIES,
    ModelSpecialist,
    SpecialistRequest,
    specialist_prompt,
)
from tests.test_workflows_review_loop import Recording, run_loop

BAD_TIMEOUTS = [math.inf, -math.inf, math.nan, -5, 0, 1e300, "60", True]


# -- timeouts: refused at construction, never an approval nobody was asked for ----------

@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
def test_review_loop_refuses_a_timeout_it_cannot_ask_with(timeout: Any) -> None:
    with pytest.raises(ConfigurationError, match="timeout_seconds"):
        ReviewLoop([Recording("Invoice")], timeout_seconds=timeout)


def test_good_timeouts_are_kept() -> None:
    assert ReviewLoop([Recording("Invoice")], timeout_seconds=None).timeout_seconds is None
    assert ReviewLoop([Recording("Invoice")], timeout_seconds=86400).timeout_seconds == 86400
    with pytest.raises(ConfigurationError, match="on_malformed"):
        ReviewLoop([Recording("Invoice")], on_malformed="guess")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="max_feedback_chars"):
        ReviewLoop([Recording("Invoice")], max_feedback_chars=0)


# -- on_malformed="approve": only an answer that says nothing, and said so ---------------

@pytest.mark.parametrize("answer", [
    {"approved": "false"}, '{"approved": "false"}', {"is_approval": "no"},
    {"action": "revise", "payload": ""}, {"action": "revise"}, {"action": "dance"},
    {"answer": {"action": "revise", "payload": "  "}}, False, {"answer": False},
    # Lists and a 0 were not looked into, so "no" in them was approved.
    ["reject"], ["no"], {"answer": ["no"]}, 0, [{"action": "reject"}],
], ids=repr)
def test_approve_on_malformed_still_asks_again_when_the_answer_names_a_choice(
        answer: Any) -> None:
    trace = run_loop("Prepare the invoice", [answer, "OK"], on_malformed="approve")
    assert len(trace.requests) == 2
    assert trace.requests[1]["message"].startswith("That answer was neither an approval")
    assert trace.state["status"] == "completed"
    assert trace.state["messages"][-1].content.startswith("Approved: ")


@pytest.mark.parametrize("answer", [{"what": "?"}, 42, [1, 2], ""], ids=repr)
def test_approve_on_malformed_says_why_it_approved(answer: Any) -> None:
    trace = run_loop("Prepare the invoice", [answer], on_malformed="approve")
    assert len(trace.requests) == 1
    assert trace.state["status"] == "completed"
    assert trace.state["messages"][-1].content == (
        "Approved because the answer was not understood (on_malformed='approve'): the "
        "Invoice specialist's result is final.")
    entry = trace.state["history"][-1]
    assert entry["malformed"] is True
    assert entry["user_feedback"].startswith("approved (answer not understood")


def test_a_real_approval_after_a_malformed_one_is_a_plain_approval() -> None:
    trace = run_loop("Prepare the invoice", ["change it", {"what": "?"}],
                     on_malformed="approve")
    assert trace.state["messages"][-1].content.startswith("Approved because")
    trace = run_loop("Prepare the invoice", ["OK"], on_malformed="approve")
    assert trace.state["messages"][-1].content.startswith("Approved: ")


# -- bounds ------------------------------------------------------------------------------

@pytest.mark.parametrize("answer", [
    {"action": "revise", "payload": "x" * (MAX_FEEDBACK_CHARS + 1)},
    "y" * (MAX_FEEDBACK_CHARS + 1),
    {"action": "reject", "reason": "z" * (MAX_FEEDBACK_CHARS + 1)},
    {"action": "revise", "payload": {"notes": "w" * MAX_FEEDBACK_CHARS}},
], ids=["revise", "text", "reject reason", "dict payload"])
def test_an_oversized_answer_is_asked_again_and_not_kept(answer: Any) -> None:
    trace = run_loop("Prepare the invoice", [answer, "OK"])
    assert len(trace.requests) == 2
    assert trace.requests[1]["message"].startswith("That answer was 320")
    assert "characters long" in trace.requests[1]["message"]
    assert f"at most {MAX_FEEDBACK_CHARS}" in trace.requests[1]["message"]
    assert len(trace.calls) == 1  # nothing ran with it
    assert max(len(str(e)) for e in trace.state["history"]) < 500
    assert trace.state["status"] == "completed"


def test_the_feedback_limit_is_configurable() -> None:
    trace = run_loop("Prepare the invoice", ["make it shorter please", "OK"],
                     max_feedback_chars=10)
    assert "at most 10" in trace.requests[1]["message"]
    trace = run_loop("Prepare the invoice", ["shorter", "OK"], max_feedback_chars=10)
    assert len(trace.calls) == 2


def test_a_long_revision_loop_keeps_the_prompt_bounded() -> None:
    history = tuple({"iteration": i, "agent": "Invoice", "result": f"draft {i} " + "d" * 9000}
                    for i in range(1, 51))
    prompt = specialist_prompt(SpecialistRequest("Prepare the invoice", 51, history,
                                                 "shorter"))
    assert len(prompt) < PROMPT_HISTORY_ENTRIES * (PROMPT_ENTRY_CHARS + 100) + 200
    assert f"({50 - PROMPT_HISTORY_ENTRIES} earlier entries left out)" in prompt
    assert "draft 50 " in prompt
    assert "draft 1 " not in prompt
    assert "(cut: 9009 characters in all)" in prompt
    assert prompt.startswith("Task: Prepare the invoice\n")
    assert prompt.endswith("Revision requested: shorter")


# -- an empty model answer, and a task cut off mid-specialist -------------------------------

class SaysNothing:
    """A provider adapter whose answer has no text at all."""

    provider = "silent"

    async def stream(self, request: Any) -> AsyncIterator[Sequence[Any]]:
        yield [StreamEnd("stop")]


def test_an_empty_model_answer_goes_to_review_as_answered_nothing() -> None:
    model = AdapterChatModel(adapter=SaysNothing())
    invoice = ModelSpecialist("Invoice", "invoices", "Prepare invoices.", model)
    graph = ReviewLoop([invoice]).compile(InMemorySaver())
    config: Any = {"configurable": {"thread_id": "empty"}}

    async def go() -> Any:
        # Streamed, as the runtime runs graphs: LangChain then reads the model's stream,
        # and a stream with no chunk at all was "No generations found in stream".
        async for _ in graph.astream_events(
                {"messages": [HumanMessage(content="Prepare the invoice")]}, config,
                version="v2"):
            pass
        return await graph.aget_state(config)

    snapshot = asyncio.run(go())
    result = snapshot.values
    request = snapshot.interrupts[0].value
    assert request["message"].startswith(
        "The Invoice specialist answered nothing. Revise the task to try again")
    assert result["history"][-1]["error"] == "The Invoice specialist answered nothing"


class Slow:
    """A specialist whose first run hangs until it is cancelled."""

    name, description = "Invoice", "slow"

    def __init__(self) -> None:
        self.calls: list[SpecialistRequest] = []
        self.started = asyncio.Event()

    async def run(self, request: SpecialistRequest) -> str:
        self.calls.append(request)
        if len(self.calls) == 1:
            self.started.set()
            await asyncio.sleep(60)
        return f"draft {request.iteration}"


def test_a_task_cut_off_mid_specialist_carries_on_with_the_same_plan() -> None:
    slow = Slow()
    routed: list[str] = []

    def router(task: str, _: Sequence[Any]) -> tuple[str, str]:
        routed.append(task)
        return "Invoice", "chosen"

    graph = ReviewLoop([slow], router=router).compile(InMemorySaver())
    config: Any = {"configurable": {"thread_id": "cut"}}
    start = {"messages": [HumanMessage(content="Prepare the invoice", id="u1")]}

    async def go() -> dict[str, Any]:
        first = asyncio.create_task(graph.ainvoke(start, config))
        await asyncio.wait_for(slow.started.wait(), 30)
        plan = (await graph.aget_state(config)).values["plan_id"]
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        result = await graph.ainvoke(start, config)  # run again, no new message
        assert result["plan_id"] == plan
        return dict(result)

    result = asyncio.run(go())
    assert routed == ["Prepare the invoice"]  # planned once
    planner_said = [m for m in result["messages"] if str(m.content).startswith("Planner:")]
    assert len(planner_said) == 1
    assert [c.iteration for c in slow.calls] == [1, 1]
    assert result["__interrupt__"][0].value["data"]["agent_result"] == "draft 1"
    # A new message with the same words is a new task, planned again.
    again = asyncio.run(graph.ainvoke(
        {"messages": [HumanMessage(content="Prepare the invoice", id="u2")]}, config))
    assert len(routed) == 2
    assert again["plan_id"] != result["plan_id"]


def test_the_client_skips_review_only_when_the_loop_allows_it() -> None:
    # The default: the review the loop's author set up holds, whatever the client sends.
    trace = run_loop("Prepare the invoice", [], review=False)
    assert len(trace.requests) == 1
    assert trace.state["status"] == "awaiting_review"
    trace = run_loop("Prepare the invoice", [], review=False, client_may_skip_review=True)
    assert trace.requests == []
    assert trace.state["status"] == "completed"
