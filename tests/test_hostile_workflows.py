"""The workflows under hostile use: a review that never ends, a model that breaks off in the
middle of a draft, a client that would skip the review or set the loop's own state, a router
that names specialists that do not exist, and orchestrator steps that fail, never end or
answer megabytes.

Each must end precisely (a message or an AG-UI `RUN_ERROR` naming what went wrong), keep
what it stores bounded, and leave the thread ready for the next run.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from ag_ui.core import UserMessage
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.types import Command

from copilot_runtime._exceptions import ConfigurationError, InvalidRequestError
from copilot_runtime._input import parse_run_input
from copilot_runtime.adapters.base import ChatDelta, ChatRequest, StreamEnd, TextDelta
from copilot_runtime.agents._lg_events import channel_for
from copilot_runtime.agents.base import RunContext
from copilot_runtime.testing import verify_events
from copilot_runtime.workflows.existing import (
    MAX_KEPT_EVENTS,
    existing_agent,
    run_existing_agent,
    wrap_existing_agent,
)
from copilot_runtime.workflows.models import AdapterChatModel, OfflineSpecialistAdapter
from copilot_runtime.workflows.orchestrator import ApprovalPolicy, Orchestrator, Step
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
    # It was 444 kB after 50 revisions and grew by 8.6 kB with each one (every draft was
    # kept twice: in the history and in the chat), copied into every checkpoint. Now a
    # revision adds one line to the chat (the earlier draft's place), nothing else.
    assert sizes[50] - sizes[20] < 30 * 400, sizes
    assert sizes[50] < 100_000, sizes
    assert len(state["history"]) == HISTORY_ENTRIES
    assert state["history_left_out"] == 1 + 51 + 50 - HISTORY_ENTRIES  # routed, drafts, answers
    assert state["draft"].startswith("draft 51 ")
    drafts_in_chat = [m for m in state["messages"]
                      if isinstance(m, AIMessage) and str(m.content).startswith("draft ")]
    assert [str(m.content)[:9] for m in drafts_in_chat] == [
        f"draft {n} " for n in range(47, 52)]
    superseded = [m for m in state["messages"] if "superseded" in str(m.content)]
    assert len(superseded) == 46  # the earlier drafts keep their place in the chat
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


async def test_a_langchain_model_behind_the_adapter_streams_each_draft_once() -> None:
    # The inner model inherited the graph's callbacks: every token streamed twice, as two
    # interleaved text messages.
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel

    from copilot_runtime import LangChainAdapter

    inner = GenericFakeChatModel(messages=iter([AIMessage(content="A whole draft.")]))
    model = AdapterChatModel(adapter=LangChainAdapter(inner))
    specialist = ModelSpecialist("Invoice", "invoices", "Prepare invoices.", model)
    agent = ReviewLoop([specialist]).agent(name="review", checkpointer=InMemorySaver())
    events = await run_agent(agent, "r1", messages=[
        {"id": "u1", "role": "user", "content": "Prepare the invoice"}])
    assert texts(events).count("A whole draft.") == 1


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


# -- a router that names specialists that are not there ---------------------------------------

class Drafts:
    def __init__(self, name: str) -> None:
        self.name, self.description = name, f"{name} drafts"

    async def run(self, request: SpecialistRequest) -> str:
        return f"{self.name} draft {request.iteration}"


async def test_a_router_naming_unknown_specialists_fails_each_task_precisely() -> None:
    answers: list[Any] = ["Tax", "Payroll" * 1000, ("Invoice",), RuntimeError("model down"),
                          "Invoice"]

    def model_router(task: str, _: Sequence[Any]) -> tuple[str, str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer if isinstance(answer, tuple) else (answer, "the model said so")

    loop = ReviewLoop([Drafts("Invoice"), Drafts("Audit")], router=model_router)
    agent = loop.agent(name="review", checkpointer=InMemorySaver())
    said: list[str] = []
    history: list[dict[str, Any]] = []
    for run in range(5):
        history.append({"id": f"u{run}", "role": "user", "content": f"task {run}"})
        events = await run_agent(agent, f"r{run}", messages=list(history))
        said.append(texts(events)[-1])
        assert events[-1]["type"] == "RUN_FINISHED"
    assert said[0] == ("The task failed: the planner's router named 'Tax', which is not "
                       "one of this loop's specialists (Invoice, Audit).")
    assert said[1].startswith("The task failed: the planner's router named 'PayrollPayroll")
    assert len(said[1]) < 300  # a name a model made up is echoed short
    assert said[2] == "The task failed: the planner's router did not name a specialist."
    assert said[3] == "The task failed: the planner's router failed (RuntimeError)."
    assert "model down" not in said[3]
    assert said[4] == "Invoice draft 1"  # the thread took the next task as usual


async def test_the_clients_review_switch_holds_for_the_task_it_came_with() -> None:
    agent = ReviewLoop([Drafts("Invoice"), Drafts("Audit")], client_may_skip_review=True
                       ).agent(name="review", checkpointer=InMemorySaver())
    chat: list[dict[str, Any]] = []
    ends: list[str] = []
    for run, switch in enumerate([{"review": False}, {}, {"review": False}]):
        chat.append({"id": f"u{run}", "role": "user", "content": f"audit {run}"})
        events = await run_agent(agent, f"r{run}", messages=list(chat), state=switch)
        ends.append(texts(events)[-1])
        if events[-1].get("outcome"):  # the review this task asked for: approve it
            (asked,) = events[-1]["outcome"]["interrupts"]
            await run_agent(agent, f"r{run}-ok", resume=[{
                "interruptId": asked["id"], "status": "resolved",
                "payload": {"action": "approve"}}])
    # The second task did not send the switch: it is reviewed, as the loop's default says
    # (the first task's switch stayed in the state and kept every later task unreviewed).
    assert ends == ["Done: the Audit specialist's result is final (review was off).",
                    "Audit draft 1",
                    "Done: the Audit specialist's result is final (review was off)."]


# -- a client's state that would set the loop's own keys -------------------------------------

# Each steered the planner into carrying on a plan that never was, with what it said: a
# revision then failed the run (AGENT_ERROR) every time, and the thread took no message.
FORGED = [{"iteration": "abc"}, {"history_left_out": "x"}, {"specialist": ["Invoice"]},
          {"draft_message_ids": 7}]


@pytest.mark.parametrize("where", ["state", "forwardedProps"])
@pytest.mark.parametrize("forged", FORGED, ids=repr)
async def test_a_clients_state_sets_none_of_the_loops_own_keys(
        forged: dict[str, Any], where: str) -> None:
    agent = ReviewLoop([Drafts("Invoice"), Drafts("Audit")]).agent(
        name="review", checkpointer=InMemorySaver())
    task = [{"id": "u1", "role": "user", "content": "Prepare the invoice"}]
    steer = {"task_message_id": "u1", "status": "working", "specialist": "Invoice", **forged}
    first = await run_agent(agent, "r1", messages=task, **{where: steer})
    assert texts(first)[0].startswith("Planner: the Invoice specialist takes this task")
    (asked,) = first[-1]["outcome"]["interrupts"]
    assert asked["metadata"]["langgraph"]["raw"]["data"]["iteration"] == 1
    second = await run_agent(agent, "r2", resume=[{
        "interruptId": asked["id"], "status": "resolved",
        "payload": {"action": "revise", "payload": "shorter"}}])
    assert texts(second) == ["Invoice draft 2"]
    (again,) = second[-1]["outcome"]["interrupts"]
    assert again["metadata"]["langgraph"]["raw"]["data"]["iteration"] == 2


@pytest.mark.parametrize(("kept", "said"), [
    ({"iteration": "abc"}, "its iteration is 'abc', not a count from 1"),
    ({"history_left_out": "x"}, "its history_left_out is 'x', not a count"),
    ({"draft_message_ids": 7}, "its draft_message_ids is 7, not a list of message ids"),
    ({"specialist": ["Invoice"]}, "its specialist ['Invoice'] is not one of this loop's "
                                  "(Invoice, Audit)"),
    ({"specialist": "Tax"}, "its specialist 'Tax' is not one of this loop's (Invoice, Audit)"),
], ids=repr)
def test_a_task_kept_with_values_the_loop_never_writes_stops_precisely(
        kept: dict[str, Any], said: str) -> None:
    graph = ReviewLoop([Drafts("Invoice"), Drafts("Audit")]).compile(InMemorySaver())
    config: Any = {"configurable": {"thread_id": "kept"}}

    async def go() -> tuple[Any, Any]:
        await graph.ainvoke({"messages": [HumanMessage(content="invoice", id="u1")]}, config)
        # What a checkpoint an earlier release wrote may hold (its clients set these keys;
        # a specialist since taken out of the loop), then the person's revision.
        stopped = await graph.ainvoke(Command(update=kept, resume="shorter"), config)
        return stopped, await graph.ainvoke(
            {"messages": [HumanMessage(content="audit", id="u2")]}, config)

    stopped, after = asyncio.run(go())
    assert stopped["status"] == "failed"
    assert stopped["messages"][-1].content == (
        f"The task failed: this task's saved state cannot be carried on ({said}); send "
        "the task again.")
    # The thread takes the next task as usual.
    assert after["__interrupt__"][0].value["data"]["agent_result"] == "Audit draft 1"


# -- orchestrator steps that fail, never finish, or answer megabytes --------------------------

class Misbehaving:
    """An existing agent: answers megabytes, never finishes, or fails, as told; else a
    small summary."""

    def __init__(self, how: str) -> None:
        self.how = how

    async def execute_with_events(self, context: dict[str, Any]
                                  ) -> AsyncIterator[dict[str, Any]]:
        yield {"event": "agent_started", "data": {}}
        if self.how == "huge":
            yield {"event": "tool_result", "data": {"result": "r" * 2_000_000}}
            yield {"event": "agent_completed", "data": {"output": {"blob": "x" * 5_000_000}}}
        elif self.how == "loops":
            while True:
                yield {"event": "agent_stream", "data": {"chunk": "tick"}}
                await asyncio.sleep(0.001)
        elif self.how == "raises":
            raise ConnectionError("upstream at 10.0.0.7 refused")
        elif self.how == "own timeout":  # its backend call timing out, as wait_for does
            await asyncio.wait_for(asyncio.sleep(10), 0.01)
        else:
            yield {"event": "agent_completed", "data": {"output": {"summary": self.how}}}


async def run_steps(*steps: Step, thread: str = "t", run: str = "r1"
                    ) -> tuple[list[dict[str, Any]], Any]:
    agent = Orchestrator(list(steps)).agent(name="o", checkpointer=InMemorySaver())
    events = await run_agent(agent, run, threadId=thread, messages=[
        {"id": "u1", "role": "user", "content": "Review ACME-001"}])
    return events, agent


async def test_a_step_answering_megabytes_fails_precisely_and_sends_little() -> None:
    events, _ = await run_steps(
        Step("scout", Misbehaving("small"), ("account_id",), "snapshot"),
        Step("hoarder", Misbehaving("huge"), ("snapshot",), "blob"))
    assert texts(events)[-1] == ("Stopped: Critical agent hoarder failed (hoarder returned "
                                 "an output of 5000011 bytes; at most 1000000 can be kept).")
    # It was 21 MB: the 2 MB event, then the output in the CUSTOM event, the state's
    # `shared` and its `result`.
    assert sum(len(str(e)) for e in events) < 20_000
    omitted = [e["value"] for e in events if e["type"] == "CUSTOM"
               and e["name"] == "tool_result"]
    assert omitted == [{"agent": "hoarder", "omitted": "a tool_result event of 2000042 "
                        "bytes (events of more than 64000 are not forwarded)"}]
    # Optional, it is logged and the run goes on with what the others found.
    events, _ = await run_steps(
        Step("hoarder", Misbehaving("huge"), ("account_id",), "blob", required=False),
        Step("scout", Misbehaving("small"), ("account_id",), "snapshot"))
    assert texts(events)[-1] == "Completed 1 of 2 steps; no approval needed."


async def test_a_step_that_never_finishes_fails_at_its_timeout() -> None:
    loops = Step("looper", Misbehaving("loops"), ("account_id",), "out", timeout_seconds=0.3)
    events, agent = await run_steps(loops)
    assert texts(events)[-1] == ("Stopped: Critical agent looper failed (looper did not "
                                 "finish within 0.3 seconds).")
    # The thread takes the next run.
    again = await run_agent(agent, "r2", messages=[
        {"id": "u1", "role": "user", "content": "Review ACME-001"},
        {"id": "u2", "role": "user", "content": "Review ACME-001 again"}])
    assert texts(again)[-1].startswith("Stopped: Critical agent looper failed")


@pytest.mark.parametrize("seconds", [None, 300])
async def test_an_agents_own_timeout_is_its_failure_not_the_steps_deadline(
        seconds: float | None) -> None:
    """An agent whose own call timed out was reported as the step's deadline ("did not
    finish within 300 seconds" after 10 ms); without a step timeout the report crashed
    ("scout failed (TypeError)"). Now it fails as any other exception of the agent."""
    with pytest.raises(TimeoutError):
        await run_existing_agent(Misbehaving("own timeout"), "scout", {},
                                 timeout_seconds=seconds)
    events, _ = await run_steps(Step("scout", Misbehaving("own timeout"), ("account_id",),
                                     "snapshot", timeout_seconds=seconds))
    assert texts(events)[-1] == ("Stopped: Critical agent scout failed (scout failed "
                                 "(TimeoutError)).")


def test_step_bounds_are_checked_when_built() -> None:
    for seconds in (0, -1, float("nan"), float("inf"), "5", True):
        with pytest.raises(ConfigurationError, match="timeout_seconds"):
            Step("a", Misbehaving("small"), (), "out", timeout_seconds=seconds)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="max_output_bytes"):
        Step("a", Misbehaving("small"), (), "out", max_output_bytes=0)


async def test_a_wrapped_agent_answering_megabytes_ends_with_its_error() -> None:
    agent = existing_agent(Misbehaving("huge"), name="hoarder", checkpointer=InMemorySaver(),
                           max_output_bytes=100_000)
    events = await run_agent(agent, "r1", messages=[
        {"id": "u1", "role": "user", "content": "go"}])
    assert texts(events)[-1] == ("hoarder: hoarder returned an output of 5000011 bytes; at "
                                 "most 100000 can be kept")
    assert sum(len(str(e)) for e in events) < 20_000


async def test_run_existing_agent_keeps_the_first_events_and_counts_the_rest() -> None:
    class Chatty:
        async def execute_with_events(self, context: dict[str, Any]
                                      ) -> AsyncIterator[dict[str, Any]]:
            for index in range(MAX_KEPT_EVENTS * 3):
                yield {"event": "agent_stream", "data": {"index": index}}
            yield {"event": "agent_completed", "data": {"output": "done"}}

    run = await run_existing_agent(Chatty(), "chatty", {})
    assert run.output == "done"
    assert run.events_seen == MAX_KEPT_EVENTS * 3 + 1
    assert len(run.events) == MAX_KEPT_EVENTS


def test_a_draft_of_megabytes_is_a_specialist_failure() -> None:
    class Hoards:
        name, description = "Invoice", "hoards"

        async def run(self, request: SpecialistRequest) -> str:
            return "y" * (2_000_000 if request.iteration == 1 else 10)

    graph = ReviewLoop([Hoards()]).compile(InMemorySaver())
    config: Any = {"configurable": {"thread_id": "big"}}

    async def go() -> tuple[Any, Any]:
        first = await graph.ainvoke({"messages": [HumanMessage(content="invoice")]}, config)
        second = await graph.ainvoke(Command(resume="shorter"), config)
        return first, second

    first, second = asyncio.run(go())
    request = first["__interrupt__"][0].value
    assert request["message"].startswith("The Invoice specialist answered 2000000 "
                                         "characters; a draft may have at most 1000000.")
    assert stored_size(first) < 10_000
    assert second["__interrupt__"][0].value["data"]["agent_result"] == "y" * 10


def test_an_oversized_approval_answer_is_asked_again_and_not_kept() -> None:
    author = Misbehaving("small")
    graph = Orchestrator([Step("author", author, ("account_id",), "recommendations")],
                         approval=ApprovalPolicy(timeout_seconds=None)).compile(InMemorySaver())
    config: Any = {"configurable": {"thread_id": "big-answer"}}

    async def go() -> tuple[Any, dict[str, Any]]:
        await graph.ainvoke({"messages": [HumanMessage(content="Review ACME-001")]}, config)
        again = await graph.ainvoke(Command(resume={"action": "revise",
                                                    "payload": "w" * 40_000}), config)
        return again, dict((await graph.aget_state(config)).values)

    again, state = asyncio.run(go())
    assert again["__interrupt__"][0].value["message"].startswith(
        "That answer was 40000 characters long; answers may be at most 32000.")
    assert "feedback" not in state["shared"]
    assert stored_size(state) < 10_000


@pytest.mark.parametrize("answer", [None, {"total": 5}, 42, ["a draft"]], ids=repr)
def test_a_specialist_answering_no_text_is_a_specialist_failure(answer: Any) -> None:
    class Answers:
        name, description = "Invoice", "answers anything"

        async def run(self, request: SpecialistRequest) -> Any:
            return answer if request.iteration == 1 else "a draft"

    graph = ReviewLoop([Answers()]).compile(InMemorySaver())
    config: Any = {"configurable": {"thread_id": "odd"}}

    async def go() -> tuple[Any, Any]:
        first = await graph.ainvoke({"messages": [HumanMessage(content="invoice")]}, config)
        return first, await graph.ainvoke(Command(resume="try again"), config)

    first, second = asyncio.run(go())
    assert first["__interrupt__"][0].value["message"].startswith(
        f"The Invoice specialist answered {type(answer).__name__}, not text. Revise")
    assert second["__interrupt__"][0].value["data"]["agent_result"] == "a draft"


# -- a client's context that is not an object, an agent's own CancelledError --------------------

class Records:
    """An existing agent that records each context it gets and says which keys it had; it
    asks for an approval when told to pay."""

    def __init__(self) -> None:
        self.contexts: list[dict[str, Any]] = []

    async def execute_with_events(self, context: dict[str, Any]
                                  ) -> AsyncIterator[dict[str, Any]]:
        self.contexts.append(dict(context))
        if "pay" in str(context.get("user_message")):
            yield {"event": "approval_required", "data": {"transfer": "10 EUR to ACME"}}
        yield {"event": "agent_completed",
               "data": {"output": {"summary": f"keys {sorted(context)}"}}}


def user_says(*words: str) -> list[dict[str, Any]]:
    return [{"id": f"u{index}", "role": "user", "content": text}
            for index, text in enumerate(words)]


@pytest.mark.parametrize("context", ["abc", [["a", "b"]], 5, ["ab"], True], ids=repr)
@pytest.mark.parametrize("where", ["state", "forwardedProps"])
async def test_a_context_that_is_no_object_is_refused_before_it_is_kept(
        context: Any, where: str) -> None:
    """`dict(context)` raised TypeError / ValueError (["ab"] became {"a": "b"}), after the
    graph had kept the value: every later run of the thread failed the same way, until the
    client sent a good one. Now the run is refused as the request it is, nothing is kept,
    and the thread's next run works."""
    recorder = Records()
    agent = existing_agent(recorder, name="wrapped", checkpointer=InMemorySaver())
    given = {"state": {"context": context}} if where == "state" else {
        "forwardedProps": {"context": context}}
    with pytest.raises(InvalidRequestError, match=r"^The wrapped agent's context must be "
                                                  r"a JSON object, not "):
        await run_agent(agent, "r1", messages=user_says("hello"), **given)
    assert recorder.contexts == []
    again = await run_agent(agent, "r2", messages=user_says("hello", "again"))
    assert texts(again)[-1] == "keys ['user_message']"
    good = await run_agent(agent, "r3", state={"context": {"k": 1}},
                           messages=user_says("hello", "again", "with k"))
    assert texts(good)[-1] == "keys ['k', 'user_message']"


@pytest.mark.parametrize("context", ["abc", ["ab"], 5], ids=repr)
async def test_the_bare_wrapper_graph_fails_the_run_of_a_context_that_is_no_object(
        context: Any) -> None:
    """The graph alone (served without `existing_agent`'s check) says so, runs nothing and
    drops the value, so the thread's next run works."""
    recorder = Records()
    graph = wrap_existing_agent(recorder, "wrapped").compile(checkpointer=InMemorySaver())
    config: Any = {"configurable": {"thread_id": "bare"}}
    state = await graph.ainvoke({"messages": [HumanMessage(content="hello")],
                                 "context": context}, config)
    assert state["error"].startswith("The wrapped agent's context must be a JSON object")
    assert state["context"] == {}
    assert recorder.contexts == []
    await graph.ainvoke({"messages": [HumanMessage(content="again")]}, config)
    assert recorder.contexts == [{"user_message": "again"}]


async def cancelled_elsewhere() -> None:
    """Await a future another task cancelled: the awaiting code gets a CancelledError
    though nobody cancelled it."""
    future = asyncio.get_running_loop().create_future()
    future.cancel()
    await future


class CancelledInside:
    """An existing agent, and a specialist, whose own code raises CancelledError."""

    name, description = "Invoice", "cancelled inside"

    async def execute_with_events(self, context: dict[str, Any]
                                  ) -> AsyncIterator[dict[str, Any]]:
        yield {"event": "agent_started", "data": {}}
        await cancelled_elsewhere()
        yield {"event": "agent_completed", "data": {"output": "never"}}

    async def run(self, request: SpecialistRequest) -> str:
        if request.iteration == 1:
            await cancelled_elsewhere()
        return "a draft"


async def test_an_agents_own_cancelled_error_is_its_failure() -> None:
    """Such a CancelledError went past the failure rules (`except Exception`) and ended the
    run with AGENT_ERROR. Now it is the agent's failure like any other: an optional step
    is logged and the run goes on, a required one stops the run, a specialist's goes to
    review, a wrapped agent's is said in the chat."""
    events, _ = await run_steps(
        Step("flaky", CancelledInside(), ("account_id",), "blob", required=False),
        Step("scout", Misbehaving("small"), ("account_id",), "snapshot"))
    assert texts(events)[-1] == "Completed 1 of 2 steps; no approval needed."
    events, _ = await run_steps(Step("flaky", CancelledInside(), ("account_id",), "blob"))
    assert texts(events)[-1] == ("Stopped: Critical agent flaky failed (flaky failed "
                                 "(CancelledError)).")
    loop = ReviewLoop([CancelledInside()]).agent(name="review", checkpointer=InMemorySaver())
    first = await run_agent(loop, "r1", messages=user_says("Prepare the invoice"))
    (interrupt,) = first[-1]["outcome"]["interrupts"]
    assert interrupt["message"].startswith("The Invoice specialist failed (CancelledError).")
    second = await run_agent(loop, "r2", resume=[{
        "interruptId": interrupt["id"], "status": "resolved",
        "payload": {"action": "revise", "payload": "try again"}}])
    assert "a draft" in texts(second)
    wrapped = existing_agent(CancelledInside(), name="wrapped", checkpointer=InMemorySaver())
    events = await run_agent(wrapped, "r1", messages=user_says("go"))
    assert texts(events)[-1] == "wrapped: wrapped failed (CancelledError)"


class Waits:
    """An existing agent, and a specialist, that wait until cancelled."""

    name, description = "Invoice", "waits"

    def __init__(self) -> None:
        self.started = asyncio.Event()

    async def execute_with_events(self, context: dict[str, Any]
                                  ) -> AsyncIterator[dict[str, Any]]:
        yield {"event": "agent_started", "data": {}}
        self.started.set()
        await asyncio.Event().wait()
        yield {"event": "agent_completed", "data": {"output": "never"}}

    async def run(self, request: SpecialistRequest) -> str:
        self.started.set()
        await asyncio.Event().wait()
        return "never"


@pytest.mark.parametrize("workflow", ["optional step", "specialist", "wrapper"])
async def test_a_cancelled_run_is_still_cancelled(workflow: str) -> None:
    """The run itself being cancelled (a stop, a disconnect) is no failure of the agent: it
    goes on as a cancellation."""
    waits = Waits()
    graph = {
        "optional step": lambda: Orchestrator([Step("w", waits, (), "out", required=False)]
                                              ).compile(InMemorySaver()),
        "specialist": lambda: ReviewLoop([waits]).compile(InMemorySaver()),
        "wrapper": lambda: wrap_existing_agent(waits, "w").compile(
            checkpointer=InMemorySaver()),
    }[workflow]()
    config: Any = {"configurable": {"thread_id": "cut"}}
    task = asyncio.create_task(graph.ainvoke(
        {"messages": [HumanMessage(content="Prepare the invoice")]}, config))
    await asyncio.wait_for(waits.started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def asked_data(interrupt: dict[str, Any]) -> Any:
    """What an approval's question shows the approver (the request's `data`)."""
    return interrupt["metadata"]["langgraph"]["raw"]["data"]


async def test_the_wrappers_approval_data_is_not_the_agents_context_later() -> None:
    """The approval's request was written into the client's `context`: on the thread's
    next run the agent got the earlier approval's data as if the client had sent it. Now
    the wrapper keeps it apart; the agent gets the client's context and the message."""
    recorder = Records()
    agent = existing_agent(recorder, name="w", checkpointer=InMemorySaver())
    first = await run_agent(agent, "r1", state={"context": {"tenant": "t1"}},
                            messages=user_says("pay ACME"))
    (interrupt,) = first[-1]["outcome"]["interrupts"]
    assert asked_data(interrupt) == {"transfer": "10 EUR to ACME"}
    unclear = await run_agent(agent, "r2", resume=[{
        "interruptId": interrupt["id"], "status": "resolved", "payload": "hmm"}])
    (interrupt,) = unclear[-1]["outcome"]["interrupts"]
    assert interrupt["message"] == "Answer approve or reject. Approve this?"
    assert asked_data(interrupt) == {"transfer": "10 EUR to ACME"}
    await run_agent(agent, "r3", resume=[{"interruptId": interrupt["id"],
                                          "status": "resolved",
                                          "payload": {"action": "approve"}}])
    await run_agent(agent, "r4", messages=user_says("pay ACME", "show the balance"))
    assert recorder.contexts == [{"tenant": "t1", "user_message": "pay ACME"},
                                 {"tenant": "t1", "user_message": "show the balance"}]
    state = (await agent.graph.aget_state({"configurable": {"thread_id": "t"}})).values
    assert state["context"] == {"tenant": "t1"}


async def test_the_approval_data_a_thread_kept_in_its_context_is_not_its_agents() -> None:
    """A review: threads of the earlier code kept the approval's data in the client's
    context (and their clients send it back, shown it): every later run gave the agent the
    earlier approval's data. That key is not the agent's, and is dropped from the thread."""
    recorder = Records()
    agent = existing_agent(recorder, name="w", checkpointer=InMemorySaver())
    await run_agent(agent, "r1", state={"context": {
        "tenant": "t1", "approval_data": {"transfer": "10 EUR to ACME"}}},
        messages=user_says("show the balance"))
    assert recorder.contexts == [{"tenant": "t1", "user_message": "show the balance"}]
    state = (await agent.graph.aget_state({"configurable": {"thread_id": "t"}})).values
    assert state["context"] == {"tenant": "t1"}


def test_an_oversized_answer_to_the_wrappers_approval_is_asked_again_and_not_kept() -> None:
    """A reason of any length was kept in the graph's state (7.8 MB: a 62 MB SQLite file).
    Now, as the orchestrator's approvals, one past MAX_FEEDBACK_CHARS is asked again."""
    graph = wrap_existing_agent(Records(), "payer").compile(checkpointer=InMemorySaver())
    config: Any = {"configurable": {"thread_id": "long-reason"}}

    async def go() -> tuple[Any, dict[str, Any], Any]:
        await graph.ainvoke({"messages": [HumanMessage(content="pay")]}, config)
        again = await graph.ainvoke(Command(resume={"action": "reject",
                                                    "reason": "n" * 40_000}), config)
        state = dict((await graph.aget_state(config)).values)
        done = await graph.ainvoke(Command(resume={"action": "reject", "reason": "no"}),
                                   config)
        return again, state, done

    again, state, done = asyncio.run(go())
    assert again["__interrupt__"][0].value["message"] == (
        "That answer was 40000 characters long; answers may be at most 32000. "
        "Approve this?")
    assert state.get("approval_response") is None
    assert stored_size(state) < 10_000
    assert done["approval_response"]["status"] == "rejected"
    assert done["approval_response"]["reason"] == "no"


@pytest.mark.parametrize("iteration", ["²", "٣", "1" * 5000], ids=["superscript", "arabic",
                                                                    "5000 digits"])
async def test_the_offline_demo_model_reads_only_a_plain_iteration(iteration: str) -> None:
    """'Iteration: ²' (isdigit, but no int) in a reviewer's revision crashed the demo's
    offline model; so did 5000 digits (past int()'s limit)."""
    request = ChatRequest(
        messages=[UserMessage(id="u", role="user",
                              content=f"Task: the invoice\nIteration: {iteration}")],
        system_prompt="You are the Invoice specialist.")
    pieces = [delta for batch in [b async for b in OfflineSpecialistAdapter(delay=0).stream(
        request)] for delta in batch if isinstance(delta, TextDelta)]
    assert "draft 1 for \"the invoice\"" in "".join(p.text for p in pieces)


@pytest.mark.parametrize(("version", "channel"), [
    ("1.0", "outcome"), ("2", "outcome"), ("01.0", "outcome"), ("0.0.9", "legacy"),
    ("00", "legacy"), (None, "legacy"), ("", "legacy"), ("².0", "legacy"), ("٣.0", "legacy"),
    ("9" * 5_000, "outcome")])
def test_a_clients_protocol_version_of_any_digits_picks_an_interrupt_channel(
        version: str | None, channel: str) -> None:
    """Before: "²" is a digit to str.isdigit and int() refused it (and 5,000 digits): a
    LangGraph run of such a client failed."""
    assert channel_for("auto", version) == channel
