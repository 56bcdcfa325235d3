"""The message conversions of `copilot_runtime.messages`, round-tripped.

Conversations are generated (user turns, assistant answers with and without text and tool
calls, the tool results that answer them) and sent through each pair of conversions that
should give them back unchanged.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from ag_ui.core import RunAgentInput
from hypothesis import example, given, settings
from hypothesis import strategies as st

from copilot_runtime.messages import (
    MISSING_RESULT,
    from_graphql_inputs,
    from_json_representation,
    paired_tool_calls,
    text_of,
    to_json_representation,
    to_legacy,
    to_openai,
)
from copilot_runtime.testing.mock_openai import _refusal

pytestmark = pytest.mark.timeout(120)

_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """AG-UI messages (JSON form) with unique ids, every tool call answered once."""
    counter = iter(range(10_000))

    def new_id(kind: str) -> str:
        return f"{kind}-{next(counter)}"

    out: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 4))):
        out.append({"id": new_id("u"), "role": "user", "content": draw(_text)})
        answer: dict[str, Any] = {"id": new_id("a"), "role": "assistant"}
        text = draw(_text)
        calls = [{"id": new_id("c"), "type": "function", "function": {
                     "name": draw(st.sampled_from(["get_weather", "roll", "lookup"])),
                     "arguments": orjson.dumps(draw(st.dictionaries(
                         _text, _json_value, max_size=3))).decode()}}
                 for _ in range(draw(st.integers(0, 2)))]
        if text or not calls:
            answer["content"] = text
        if calls:
            answer["toolCalls"] = calls
        out.append(answer)
        out.extend({"id": new_id("r"), "role": "tool", "toolCallId": call["id"],
                    "content": draw(_text)} for call in calls)
    return out


def to_graphql_inputs(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What react-core 1.10 sends for a conversation (the inverse under test)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            out.append({"id": message["id"], "resultMessage": {
                "actionExecutionId": message["toolCallId"], "actionName": "",
                "result": message["content"]}})
            continue
        if "content" in message:
            out.append({"id": message["id"], "textMessage": {
                "role": message["role"], "content": message["content"]}})
        for call in message.get("toolCalls", ()):
            out.append({"id": call["id"], "actionExecutionMessage": {
                "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                "parentMessageId": message["id"]}})
    return out


@settings(max_examples=150, deadline=None)
@given(conversations())
def test_json_representation_round_trips(messages: list[dict[str, Any]]) -> None:
    assert from_json_representation(to_json_representation(messages)) == messages


@settings(max_examples=150, deadline=None)
@given(conversations())
def test_graphql_inputs_round_trip(messages: list[dict[str, Any]]) -> None:
    assert from_graphql_inputs(to_graphql_inputs(messages)) == messages


@settings(max_examples=150, deadline=None)
@given(conversations())
def test_legacy_form_reads_back(messages: list[dict[str, Any]]) -> None:
    legacy = to_legacy(messages)
    assert {item["type"] for item in legacy} <= {"TextMessage", "ActionExecutionMessage",
                                                 "ResultMessage"}
    # The remote endpoint answers `/agents/state` in the JSON representation, which the
    # typed form extends: reading it back gives the conversation, less the assistant
    # messages that said nothing (the typed form has no empty message).
    said = [m for m in messages if m["role"] != "assistant" or m.get("content")
            or m.get("toolCalls")]
    assert from_json_representation(legacy) == said


@settings(max_examples=100, deadline=None)
@given(conversations())
def test_openai_form_keeps_roles_text_and_calls(messages: list[dict[str, Any]]) -> None:
    models = RunAgentInput.model_validate({
        "threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [],
        "forwardedProps": {}, "messages": messages}).messages
    openai = to_openai(models)
    assert [m["role"] for m in openai] == [m["role"] for m in messages]
    for ours, theirs in zip(messages, openai, strict=True):
        if ours["role"] == "tool":
            assert theirs == {"role": "tool", "tool_call_id": ours["toolCallId"],
                              "content": ours["content"]}
        elif ours["role"] == "assistant":
            assert theirs["content"] == ours.get("content", "" if "toolCalls" not in ours
                                                 else None)
            assert theirs.get("tool_calls", []) == ours.get("toolCalls", [])
        else:
            assert theirs == {"role": "user", "content": ours["content"]}


def models_of(messages: list[dict[str, Any]]) -> Any:
    return RunAgentInput.model_validate({
        "threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [],
        "forwardedProps": {}, "messages": messages}).messages


@st.composite
def broken_conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Conversations whose clients lost, moved or made up tool results (what the
    TypeScript runtime's users report OpenAI refusing with a 400)."""
    messages = draw(conversations())
    results = [m for m in messages if m["role"] == "tool"]
    for result in results:
        fate = draw(st.sampled_from(["kept", "lost", "moved", "doubled"]))
        if fate != "kept":
            messages.remove(result)
        if fate in ("moved", "doubled"):
            messages.insert(draw(st.integers(0, len(messages))), result)
        if fate == "doubled":
            messages.append({**result, "id": result["id"] + "-again"})
    for n in range(draw(st.integers(0, 2))):
        messages.insert(draw(st.integers(0, len(messages))), {
            "id": f"stray-{n}", "role": "tool", "toolCallId": f"unknown-{n}", "content": "x"})
    if draw(st.booleans()):
        messages.insert(draw(st.integers(0, len(messages))), {
            "id": "act", "role": "activity", "activityType": "card", "content": {}})
    return messages


@settings(max_examples=200, deadline=None)
@given(conversations())
def test_a_paired_history_is_sent_as_it_is(messages: list[dict[str, Any]]) -> None:
    models = models_of(messages)
    assert paired_tool_calls(models) is models
    assert _refusal(to_openai(models)) is None


@settings(max_examples=300, deadline=None)
@given(broken_conversations())
@example([  # results in another order than their calls: as the API takes them
    {"id": "u", "role": "user", "content": ""},
    {"id": "a", "role": "assistant", "toolCalls": [
        {"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for c in ("c1", "c2")]},
    {"id": "r2", "role": "tool", "toolCallId": "c2", "content": "2"},
    {"id": "r1", "role": "tool", "toolCallId": "c1", "content": "1"}])
def test_tool_calls_are_answered_at_once_whatever_the_client_sent(
        messages: list[dict[str, Any]]) -> None:
    """Chat Completions refuses a call not answered by the tool messages right after it,
    and a tool message answering no call just before it: OpenAI (and every model behind
    LangChain's OpenAI client) got such histories as the client sent them, a 400 on every
    later run of the thread. Each call is now answered by its own result (wherever the
    client had it) or by one saying none was recorded; a result no call asked for is a user
    message quoting it."""
    openai = to_openai(models_of(messages))
    assert _refusal(openai) is None, openai
    results = {m["toolCallId"]: m["content"] for m in reversed(messages) if m["role"] == "tool"}
    calls = [c["id"] for m in messages for c in m.get("toolCalls", ())]
    for i, message in enumerate(openai):
        calls_here = [call["id"] for call in message.get("tool_calls") or ()]
        answers = openai[i + 1:i + 1 + len(calls_here)]  # in any order, as the API takes them
        assert sorted(a["tool_call_id"] for a in answers) == sorted(calls_here)
        for answer in answers:
            assert answer["content"] == results.get(answer["tool_call_id"], MISSING_RESULT)
    strays = [m for m in messages if m["role"] == "tool" and m["toolCallId"] not in calls]
    quoted = [m["content"] for m in openai if m["role"] == "user"
              and m["content"].startswith("(Result of tool call unknown-")]
    assert quoted == [f"(Result of tool call {m['toolCallId']}: x)" for m in strays]


def test_hidden_and_multimodal_content() -> None:
    system = {"id": "s", "role": "system", "content": "be brief"}
    assert to_json_representation([system]) == []
    assert to_legacy([{"id": "d", "role": "developer", "content": "x"}])[0]["role"] == "system"
    parts = [{"type": "text", "text": "a"}, {"type": "image", "source": {
        "type": "url", "value": "http://x/y.png"}}, {"type": "text", "text": "b"}]
    assert text_of(parts) == "ab"
    assert text_of(None) == ""
    assert text_of(42) == ""
