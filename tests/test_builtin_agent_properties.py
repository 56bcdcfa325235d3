"""Property-based tests of the built-in agent over arbitrary model streams."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from copilot_runtime import CopilotRuntime, action
from copilot_runtime._compaction import compact_events, events_to_messages
from copilot_runtime._input import parse_run_input
from copilot_runtime.adapters import ChatDelta, StreamEnd, TextDelta, ToolCallDelta
from copilot_runtime.events import Event
from copilot_runtime.testing import ScriptedAdapter, text_turn, verify_events
from tests.conftest import run_input


@action
def echo_tool(value: str) -> dict[str, str]:
    """Return the value."""
    return {"value": value}


def _batches(pieces: list[ChatDelta], cuts: list[int]) -> list[list[ChatDelta]]:
    """`pieces` grouped into batches at arbitrary points, as upstream reads would be."""
    out: list[list[ChatDelta]] = []
    start = 0
    for cut in sorted(set(cuts)):
        if start < cut <= len(pieces):
            out.append(pieces[start:cut])
            start = cut
    out.append(pieces[start:])
    return [b for b in out if b]


texts = st.lists(st.text(min_size=1, max_size=8), min_size=0, max_size=12)
values = st.text(max_size=10)


async def _run(adapter: ScriptedAdapter) -> list[Event]:
    runtime = CopilotRuntime(service_adapter=adapter, actions=[echo_tool])
    out: list[Event] = []

    async def write(batch: Sequence[Event]) -> None:
        out.extend(batch)

    run = await runtime.start_run("default", parse_run_input(run_input("go")))
    await run.drive(write)
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts, calls=st.lists(values, max_size=3), cuts=st.lists(st.integers(0, 20)),
       arg_cuts=st.lists(st.integers(1, 6), max_size=3))
async def test_any_stream_gives_valid_events_and_a_faithful_history(
        text: list[str], calls: list[str], cuts: list[int], arg_cuts: list[int]) -> None:
    pieces: list[ChatDelta] = [TextDelta(t) for t in text]
    for index, value in enumerate(calls):
        arguments = orjson.dumps({"value": value}).decode()
        bounds = sorted({c for c in arg_cuts if c < len(arguments)})
        parts = [arguments[a:b] for a, b in zip([0, *bounds], [*bounds, len(arguments)],
                                                strict=True)]
        pieces.append(ToolCallDelta(index, f"c{index}", "echo_tool", parts[0]))
        pieces.extend(ToolCallDelta(index, None, None, p) for p in parts[1:])
    pieces.append(StreamEnd("tool_calls" if calls else "stop"))
    adapter = ScriptedAdapter(_batches(pieces, cuts), text_turn("done"))
    events = await _run(adapter)

    verify_events(events)
    verify_events(compact_events(events))
    assert events[-1]["type"] == "RUN_FINISHED"
    messages = events_to_messages([compact_events(events)])
    if not text and not calls:
        assert [m["role"] for m in messages] == ["user"]  # the model said nothing
        return
    assistant = messages[1]
    assert assistant.get("content", "") == "".join(text)
    results = [m for m in messages if m["role"] == "tool"]
    assert [orjson.loads(m["content"]) for m in results] == [{"value": v} for v in calls]
    if calls:
        assert [c["function"]["arguments"] for c in assistant["toolCalls"]] == [
            orjson.dumps({"value": v}).decode() for v in calls]
        # the model saw every result, and answered
        assert messages[-1]["content"] == "done"
        assert len(adapter.requests) == 2
    else:
        assert len(adapter.requests) == 1


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=0, max_size=40), cuts=st.lists(st.integers(0, 200)))
def test_stream_parser_is_independent_of_read_boundaries(data: bytes, cuts: list[int]) -> None:
    from copilot_runtime.adapters.openai import ChatCompletionsStreamParser

    text = data.decode("utf-8", "replace")
    frames = b"".join(
        b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": ch}}]})
        + b"\n\n" for ch in text) + b"data: [DONE]\n\n"
    parser = ChatCompletionsStreamParser()
    out: list[Any] = []
    start = 0
    for cut in sorted(set(c for c in cuts if c < len(frames))):
        out.extend(parser.feed(frames[start:cut]))
        start = cut
    out.extend(parser.feed(frames[start:]))
    assert "".join(d.text for d in out if isinstance(d, TextDelta)) == text
    assert parser.done


async def test_a_call_whose_id_is_taken_gets_a_fresh_one() -> None:
    """Two parallel calls with one id (an OpenAI-compatible server's), and a call reusing an
    id of the history the run was given: each ran, but the model's next request carried the
    first result for each call of the id (the others lost), and the thread kept several
    calls under one id. Now a call whose id is taken gets a fresh one, in the events, the
    history sent back to the model and the thread alike."""
    from copilot_runtime.messages import to_openai

    history: list[dict[str, Any]] = [
        {"id": "u0", "role": "user", "content": "before"},
        {"id": "a0", "role": "assistant", "toolCalls": [{
            "id": "call_old", "type": "function",
            "function": {"name": "echo_tool", "arguments": '{"value": "old"}'}}]},
        {"id": "t0", "role": "tool", "toolCallId": "call_old", "content": '{"value": "old"}'},
        {"id": "u1", "role": "user", "content": "go"}]
    answer: list[ChatDelta] = [
        ToolCallDelta(0, "call_dup", "echo_tool", '{"value": "a"}'),
        ToolCallDelta(1, "call_dup", "echo_tool", '{"value": "b"}'),
        ToolCallDelta(2, "call_old", "echo_tool", '{"value": "c"}'), StreamEnd("tool_calls")]
    adapter = ScriptedAdapter([answer], text_turn("done"))
    runtime = CopilotRuntime(service_adapter=adapter, actions=[echo_tool])
    events: list[Event] = []

    async def write(batch: Sequence[Event]) -> None:
        events.extend(batch)

    run = await runtime.start_run("default", parse_run_input(run_input("go", messages=history)))
    await run.drive(write)

    verify_events(events)
    ids = [e["toolCallId"] for e in events if e["type"] == "TOOL_CALL_START"]
    assert ids[0] == "call_dup"  # the first keeps its id
    assert len(set(ids)) == 3
    assert "call_old" not in ids
    assert all(i.startswith("call_") for i in ids)
    results = {e["toolCallId"]: orjson.loads(e["content"]) for e in events
               if e["type"] == "TOOL_CALL_RESULT"}
    assert results == {ids[0]: {"value": "a"}, ids[1]: {"value": "b"}, ids[2]: {"value": "c"}}
    sent = to_openai(adapter.requests[1].messages)
    assert [[c["id"] for c in m.get("tool_calls", ())] for m in sent if m["role"] == "assistant"
            ] == [["call_old"], ids]
    assert [(m["tool_call_id"], orjson.loads(m["content"])) for m in sent
            if m["role"] == "tool"] == [("call_old", {"value": "old"}), *results.items()]
    stored = events_to_messages([compact_events(events)])
    assert [[c["id"] for c in m["toolCalls"]] for m in stored if m.get("toolCalls")] == [
        ["call_old"], ids]
