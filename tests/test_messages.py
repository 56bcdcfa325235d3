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
from hypothesis import given, settings
from hypothesis import strategies as st

from copilot_runtime.messages import (
    from_graphql_inputs,
    from_json_representation,
    text_of,
    to_json_representation,
    to_legacy,
    to_openai,
)

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


def test_hidden_and_multimodal_content() -> None:
    system = {"id": "s", "role": "system", "content": "be brief"}
    assert to_json_representation([system]) == []
    assert to_legacy([{"id": "d", "role": "developer", "content": "x"}])[0]["role"] == "system"
    parts = [{"type": "text", "text": "a"}, {"type": "image", "source": {
        "type": "url", "value": "http://x/y.png"}}, {"type": "text", "text": "b"}]
    assert text_of(parts) == "ab"
    assert text_of(None) == ""
    assert text_of(42) == ""
