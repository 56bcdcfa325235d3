"""One run's events in the order clients accept, kept once in the core (`event_order`).

Whatever an agent yields (chunks, missing ends, empty deltas, its own RUN_STARTED, events
after its end), the run that reaches the edges and the thread store verifies; and the
strict checker names what a broken stream did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copilot_runtime import Agent, CopilotRuntime, RunContext, RunInput
from copilot_runtime import events as ev
from copilot_runtime.event_order import OrderChecker, RunEventOrder
from copilot_runtime.events import EventBatches
from copilot_runtime.testing import EventOrderError, verify_events
from tests.conftest import ServeRuntime, run_input, text_of
from tests.test_real_clients import run_client_script

pytestmark = pytest.mark.timeout(120)


@st.composite
def agent_streams(draw: st.DrawFn) -> list[list[dict[str, Any]]]:
    """What an agent might yield: well-formed pieces, chunked pieces, pieces left open."""
    events: list[dict[str, Any]] = []
    for n in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["text", "call", "text_chunks", "call_chunks", "step",
                                     "reasoning", "noise"]))
        deltas = draw(st.lists(st.sampled_from(["", "a", "bc", "{}"]), max_size=3))
        closed = draw(st.booleans())
        if kind == "text":
            events.append(ev.text_message_start(f"m{n}"))
            events += [ev.text_message_content(f"m{n}", d) for d in deltas]
            events += [ev.text_message_end(f"m{n}")] if closed else []
        elif kind == "call":
            events.append(ev.tool_call_start(f"c{n}", "tool"))
            events += [ev.tool_call_args(f"c{n}", d) for d in deltas]
            events += [ev.tool_call_end(f"c{n}")] if closed else []
        elif kind == "text_chunks":
            events.append({"type": ev.TEXT_MESSAGE_CHUNK, "messageId": f"m{n}", "delta": "x"})
            events += [{"type": ev.TEXT_MESSAGE_CHUNK, "delta": d} for d in deltas]
            events += [ev.text_message_end(f"m{n}")] if closed else []
        elif kind == "call_chunks":
            events.append({"type": ev.TOOL_CALL_CHUNK, "toolCallId": f"c{n}",
                           "toolCallName": "tool", "delta": "{"})
            events += [{"type": ev.TOOL_CALL_CHUNK, "delta": d} for d in deltas]
        elif kind == "step":
            events.append(ev.step_started(f"s{n}"))
            events += [ev.step_finished(f"s{n}")] if closed else []
        elif kind == "reasoning":
            events += ev.reasoning_start(f"r{n}")
            events += [ev.reasoning_content(f"r{n}", d) for d in deltas if d]
            ends = ev.reasoning_end(f"r{n}")
            # closed, half closed (the message, not its span), or ended twice
            events += ends if closed else ends[:draw(st.integers(0, 1))]
            events += ends if draw(st.booleans()) else []
        else:
            events.append(ev.run_started("other", "run"))
            events.append(ev.state_snapshot({"n": n}))
    if draw(st.booleans()):
        events.append(ev.run_finished("agent-thread", "agent-run"))
        events.append(ev.text_message_start("late"))  # after the end: dropped
    cuts = sorted(draw(st.sets(st.integers(0, len(events)), max_size=4)))
    return [events[a:b] for a, b in zip([0, *cuts], [*cuts, len(events)], strict=True)]


def run_through_the_core(batches: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    order = RunEventOrder("t", "r")
    out = [ev.run_started("t", "r")]
    for batch in batches:
        out += order.normalize(batch)
    if not order.terminated:  # what the run manager adds when the agent just stops
        out += [*order.closing_events(), ev.run_finished("t", "r")]
    return out


@settings(max_examples=300, deadline=None)
@given(agent_streams())
def test_whatever_an_agent_yields_the_run_verifies(batches: list[list[dict[str, Any]]]) -> None:
    events = run_through_the_core(batches)
    verify_events(events)
    assert not {e["type"] for e in events} & {ev.TEXT_MESSAGE_CHUNK, ev.TOOL_CALL_CHUNK}
    assert events[-1] == ev.run_finished("t", "r")


def test_a_well_formed_batch_is_passed_through_untouched() -> None:
    batch = [ev.text_message_start("m"), ev.text_message_content("m", "hi")]
    assert RunEventOrder("t", "r").normalize(batch) is batch


def test_the_checker_names_the_mistake() -> None:
    checker = OrderChecker()
    assert checker.check(ev.text_message_start("m")) == "before RUN_STARTED"
    assert checker.check(ev.run_started("t", "r")) is None
    assert checker.check(ev.text_message_content("x", "a")) == (
        "for message 'x', which is not open")
    assert checker.check(ev.tool_call_start("c", "f")) is None
    assert checker.check(ev.run_finished("t", "r")) == "while c are still open"
    with pytest.raises(EventOrderError, match=r"TEXT_MESSAGE_END.*which is not open"):
        verify_events([ev.run_started("t", "r"), ev.text_message_end("m")])


def test_an_encrypted_value_of_a_subtype_no_client_knows_is_refused() -> None:
    """AG-UI 1.0's schema takes `tool-call` and `message` alone: a remote agent's other
    subtype passed the runtime's checks and failed the client's."""
    checker = OrderChecker()
    assert checker.check(ev.run_started("t", "r")) is None
    for subtype in ("tool-call", "message"):
        assert checker.check({"type": ev.REASONING_ENCRYPTED_VALUE, "subtype": subtype,
                              "entityId": "c", "encryptedValue": "v"}) is None
    assert checker.check({"type": ev.REASONING_ENCRYPTED_VALUE, "subtype": "foo",
                          "entityId": "c", "encryptedValue": "v"}) == (
        "with a subtype other than 'tool-call' or 'message'")


def test_reasoning_left_open_is_closed_and_the_checker_holds_it_to_the_rules() -> None:
    """A run stopped mid-reasoning ended with its reasoning message and span open: AG-UI
    1.0's client refuses that RUN_FINISHED ("while reasoning messages are still active"),
    and the checker (remote agents, `verify_events`) let reasoning events through unchecked."""
    order = RunEventOrder("t", "r")
    order.normalize([*ev.reasoning_start("x"), ev.reasoning_content("x", "hmm")])
    assert order.closing_events() == [{"type": "REASONING_MESSAGE_END", "messageId": "x"},
                                      {"type": "REASONING_END", "messageId": "x"}]
    checker = OrderChecker()
    checker.check(ev.run_started("t", "r"))
    assert checker.check(ev.reasoning_content("x", "a")) == (
        "for reasoning message 'x', which is not open")
    for event in ev.reasoning_start("x"):
        assert checker.check(event) is None
    assert checker.check(ev.reasoning_start("x")[0]) == (
        "for reasoning span 'x', which is already open")
    assert checker.check(ev.run_finished("t", "r")) == "while x, x are still open"


class ChunkingAgent(Agent):
    """An in-process agent that speaks in chunks (as some LangGraph translators do)."""

    async def run(self, input: RunInput, context: RunContext) -> EventBatches:  # type: ignore[override]
        yield [{"type": ev.TEXT_MESSAGE_CHUNK, "messageId": "answer", "delta": "Hello, "}]
        yield [{"type": ev.TEXT_MESSAGE_CHUNK, "delta": "chunks"},
               {"type": ev.TOOL_CALL_CHUNK, "toolCallId": "c1", "toolCallName": "show",
                "parentMessageId": "answer", "delta": '{"a":1}'}]


async def test_chunks_of_an_in_process_agent_reach_clients_and_the_store_expanded(
        serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={"chunky": ChunkingAgent()})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hi", thread="t-chunks"), agent="chunky")
        verify_events(events)
        assert text_of(events) == "Hello, chunks"
        messages = await (await served.session.get(
            served.url + "/threads/t-chunks/messages")).json()
    answer = next(m for m in messages["messages"] if m["id"] == "answer")
    assert answer["content"] == "Hello, chunks"
    assert answer["toolCalls"][0]["function"] == {"name": "show", "arguments": '{"a":1}'}


def _subagent_run() -> list[dict[str, Any]]:
    """What a remote agent may stream: a subagent with a step, a message, a tool call and
    reasoning of its own, and the parent's own text around it."""
    sub = {"subagentRunId": "s1"}
    return [
        ev.text_message_start("p"), ev.text_message_content("p", "parent says"),
        ev.text_message_end("p"),
        {"type": "SUBAGENT_STARTED", "subagentRunId": "s1", "name": "helper"},
        {**ev.step_started("work"), **sub},
        *({**e, **sub} for e in ev.reasoning_start("x")),
        {**ev.reasoning_content("x", "hmm"), **sub},
        *({**e, **sub} for e in ev.reasoning_end("x")),
        {**ev.text_message_start("m"), **sub}, {**ev.text_message_content("m", "sub says"), **sub},
        {**ev.text_message_end("m"), **sub},
        {**ev.tool_call_start("c", "lookup", "m"), **sub},
        {**ev.tool_call_args("c", "{}"), **sub}, {**ev.tool_call_end("c"), **sub},
        {**ev.step_finished("work"), **sub},
        {"type": "SUBAGENT_FINISHED", "subagentRunId": "s1"},
    ]


def test_a_run_cut_anywhere_is_closed_as_both_real_clients_require() -> None:
    """A run stopped (or cut by its remote) inside a subagent was closed with a step end
    charged to the parent agent and its subagent never finished: both real clients refused
    the run, and every `connect` of its thread after it. Cut after each of its events, the
    run the core closes passes the checkers of @ag-ui/client 0.0.59 and 1.0.0."""
    events = _subagent_run()
    streams = []
    for cut in range(len(events) + 1):
        order = RunEventOrder("t", "r")
        out = [ev.run_started("t", "r"), *order.normalize(events[:cut])]
        streams.append([*out, *order.closing_events(), ev.run_finished("t", "r")])
        verify_events(streams[-1])  # ours agrees
    verdicts = run_client_script("verify_events.mjs", streams)
    refused = [(cut, verdict) for cut, verdict in enumerate(verdicts)
               if verdict["0.0.59"] or verdict["1.0.0"]]
    assert refused == []
    with pytest.raises(EventOrderError, match=r"STEP_FINISHED.*'work', which is not open"):
        verify_events([ev.run_started("t", "r"), *events[:5], ev.step_finished("work")])


def test_verify_refuses_a_null_where_clients_refuse_one() -> None:
    """Null application data passes only where both clients' schemas take it (a CUSTOM
    value, a state snapshot); a null message `content` they refuse, so `verify_events`
    does too, schema check or not (it let any null under an application-data key pass)."""
    run = [ev.run_started("t", "r")]
    end = [ev.run_finished("t", "r")]
    verify_events([*run, {"type": "CUSTOM", "name": "n", "value": None},
                   {"type": "STATE_SNAPSHOT", "snapshot": None}, *end], schema=False)
    snapshot = {"type": "MESSAGES_SNAPSHOT",
                "messages": [{"id": "m", "role": "user", "content": None}]}
    with pytest.raises(EventOrderError, match=r"null field: messages.content"):
        verify_events([*run, snapshot, *end], schema=False)
