"""Provider conversions: Anthropic's history repair and stream parser, Gemini's schema subset,
contents and thought signatures, LangChain's stream end, and the EmptyAdapter."""

from __future__ import annotations

import asyncio
import base64
import re
import time
from typing import Any, Literal

import orjson
import pytest
import structlog
from ag_ui.core import (
    AssistantMessage,
    DataSource,
    DeveloperMessage,
    DocumentPart,
    FunctionCall,
    ImagePart,
    SystemMessage,
    TextPart,
    ToolCall,
    ToolMessage,
    UrlSource,
    UserMessage,
)
from google.genai import types as gemini_types
from hypothesis import example, given, settings
from hypothesis import strategies as st

from copilot_runtime import (
    AnthropicAdapter,
    ConfigurationError,
    CopilotRuntime,
    EmptyAdapter,
    GoogleGenAIAdapter,
    InvalidRequestError,
    LangChainAdapter,
    UpstreamError,
)
from copilot_runtime.adapters import (
    ChatRequest,
    EncryptedReasoning,
    ReasoningDelta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
)
from copilot_runtime.adapters.anthropic import (
    AnthropicStreamParser,
    signed_thinking_value,
    to_anthropic_messages,
)
from copilot_runtime.adapters.google import to_gemini_contents, to_gemini_schema
from copilot_runtime.agents import HttpAgent
from copilot_runtime.agents._shared_state import _DELTA_SPEC, _SNAPSHOT_SPEC
from copilot_runtime.testing import MockGeminiServer
from tests.realclient_app import getWeather

TIMEOUT_S = 20


def call(call_id: str, name: str = "f", arguments: str = "{}") -> ToolCall:
    return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))


# ---- Anthropic: history ----------------------------------------------------------------------


def test_anthropic_system_and_developer_go_to_system() -> None:
    system, turns = to_anthropic_messages([
        SystemMessage(id="s", content="be brief"), DeveloperMessage(id="d", content="use tools"),
        UserMessage(id="u", content="hi")])
    assert system == ["be brief", "use tools"]
    assert turns == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def test_anthropic_dangling_tool_use_gets_an_error_result() -> None:
    _, turns = to_anthropic_messages([
        UserMessage(id="u", content="go"),
        AssistantMessage(id="a", content="calling", tool_calls=[call("c1"), call("c2")]),
        ToolMessage(id="t", tool_call_id="c2", content="two"),
        UserMessage(id="u2", content="next")])
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    results = turns[2]["content"]
    assert [(b["type"], b.get("tool_use_id")) for b in results] == [
        ("tool_result", "c1"), ("tool_result", "c2"), ("text", None)]
    assert results[0]["is_error"] is True
    assert results[1]["content"] == "two"
    assert results[2]["text"] == "next"


def test_anthropic_dangling_tool_use_at_the_end_is_answered() -> None:
    _, turns = to_anthropic_messages([
        UserMessage(id="u", content="go"), AssistantMessage(id="a", tool_calls=[call("c1")])])
    assert turns[-1]["role"] == "user"
    assert turns[-1]["content"][0]["tool_use_id"] == "c1"


def test_anthropic_orphan_result_becomes_text() -> None:
    _, turns = to_anthropic_messages([
        UserMessage(id="u", content="go"), ToolMessage(id="t", tool_call_id="zz", content="x")])
    assert turns == [{"role": "user", "content": [
        {"type": "text", "text": "go"},
        {"type": "text", "text": "(Result of tool call zz: x)"}]}]


@pytest.mark.parametrize(("arguments", "expected"), [
    ("", {}), ('{"a": 1}', {"a": 1}), ("[1, 2]", {"value": [1, 2]}), ('"s"', {"value": "s"}),
    ("{broken", {"raw_arguments": "{broken"})])
def test_anthropic_tool_arguments_are_always_objects(arguments: str, expected: Any) -> None:
    _, turns = to_anthropic_messages([
        UserMessage(id="u", content="go"),
        AssistantMessage(id="a", tool_calls=[call("c1", arguments=arguments)]),
        ToolMessage(id="t", tool_call_id="c1", content="ok")])
    assert turns[1]["content"][0]["input"] == expected


def test_anthropic_blank_text_and_errors() -> None:
    _, turns = to_anthropic_messages([
        UserMessage(id="u", content="go"),
        AssistantMessage(id="a", content="  ", tool_calls=[call("c1")]),
        ToolMessage(id="t", tool_call_id="c1", content="", error="boom")])
    assert turns[1]["content"] == [{"type": "tool_use", "id": "c1", "name": "f", "input": {}}]
    assert turns[2]["content"] == [{"type": "tool_result", "tool_use_id": "c1",
                                    "content": "Error: boom", "is_error": True}]


def test_anthropic_multimodal_blocks() -> None:
    _, turns = to_anthropic_messages([UserMessage(id="u", content=[
        TextPart(text="look"),
        ImagePart(source=DataSource(value="aGk=", mime_type="image/jpeg")),
        ImagePart(source=UrlSource(value="https://example.test/a.png")),
        DocumentPart(source=DataSource(value="JVBE", mime_type="application/pdf"))])])
    assert turns[0]["content"][1:] == [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                     "data": "aGk="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.test/a.png"}},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                        "data": "JVBE"}}]


def test_anthropic_request_parameters() -> None:
    adapter = AnthropicAdapter(api_key="k", max_tokens=100)
    tools = [ToolSpec("f", "d", {"properties": {"x": {"type": "string"}}}), ToolSpec("g", "", {})]
    params = adapter.build_params(ChatRequest(
        messages=[UserMessage(id="u", content="hi")], tools=tools, system_prompt="sys",
        temperature=1.7, stop=["END"], tool_choice="required"))
    assert params["max_tokens"] == 100  # always set: the API requires it
    assert params["system"] == "sys"
    assert params["temperature"] == 1.0  # Anthropic's range is 0..1
    assert params["stop_sequences"] == ["END"]
    assert params["tool_choice"] == {"type": "any"}
    assert params["tools"][0]["input_schema"] == {"type": "object",
                                                  "properties": {"x": {"type": "string"}}}
    assert params["tools"][1]["input_schema"] == {"type": "object", "properties": {}}
    named = adapter.build_params(ChatRequest(messages=[], tools=tools, tool_choice="g"))
    assert named["tool_choice"] == {"type": "tool", "name": "g"}
    thinking = AnthropicAdapter(api_key="k", thinking={"type": "enabled", "budget_tokens": 64})
    params = thinking.build_params(ChatRequest(messages=[], temperature=0.3))
    assert "temperature" not in params  # refused by the API with thinking on
    assert params["thinking"]["budget_tokens"] == 64
    assert params["max_tokens"] == 4096  # (room past the budget already)
    # A judge's 100 tokens (or a client's maxTokens) at or under the budget: the API
    # refused max_tokens <= budget_tokens, and a guardrail judge refused everything.
    thinking.thinking = {"type": "enabled", "budget_tokens": 2048}
    for asked in (100, 2048):
        assert thinking.build_params(ChatRequest(messages=[], max_tokens=asked))[
            "max_tokens"] == asked + 2048


def test_anthropic_adaptive_thinking_gives_a_judge_room() -> None:
    # Adaptive thinking has no budget to add: the judge's 100 tokens went to its thinking
    # and the verdict never came (every message refused).
    adapter = AnthropicAdapter(api_key="k", thinking={"type": "adaptive"})
    judge = adapter.build_params(ChatRequest(messages=[], max_tokens=100, temperature=0,
                                             runtime_settings=True))
    assert judge["max_tokens"] == 4100
    assert adapter.build_params(ChatRequest(messages=[], max_tokens=100))["max_tokens"] == 100
    adapter.thinking = {"type": "disabled"}
    assert adapter.build_params(ChatRequest(messages=[], max_tokens=100,
                                            runtime_settings=True))["max_tokens"] == 100


def test_anthropic_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="api_key"):
        AnthropicAdapter()


# ---- Anthropic: stream parser ----------------------------------------------------------------


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"event: " + str(e["type"]).encode() + b"\ndata: " + orjson.dumps(e)
                    + b"\n\n" for e in events)


_STREAM = _sse(
    {"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 1}}},
    {"type": "ping"},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking",
                                                                  "thinking": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta",
                                                          "thinking": "hmm"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta",
                                                          "text": "h\u00e9llo \U0001f600"}},
    {"type": "content_block_stop", "index": 1},
    {"type": "content_block_start", "index": 2, "content_block": {
        "type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}},
    {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta",
                                                          "partial_json": '{"a":'}},
    {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta",
                                                          "partial_json": "1}"}},
    {"type": "content_block_stop", "index": 2},
    {"type": "content_block_start", "index": 3, "content_block": {
        "type": "tool_use", "id": "toolu_2", "name": "g", "input": {}}},
    {"type": "content_block_stop", "index": 3},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
     "usage": {"output_tokens": 5}},
    {"type": "message_stop"})


def test_anthropic_parser_handles_frames_split_anywhere() -> None:
    for step in (1, 2, 5, 13, len(_STREAM)):
        parser = AnthropicStreamParser()
        out: list[Any] = []
        for i in range(0, len(_STREAM), step):
            out.extend(parser.feed(_STREAM[i:i + step]))
        assert out == [
            ReasoningDelta("hmm"),
            TextDelta("h\u00e9llo \U0001f600"),
            ToolCallDelta(0, "toolu_1", "f", ""), ToolCallDelta(0, None, None, '{"a":'),
            ToolCallDelta(0, None, None, "1}"),
            ToolCallDelta(1, "toolu_2", "g", ""), ToolCallDelta(1, None, None, "{}"),
            # the answer's thinking, once, for the client to keep on its first call
            EncryptedReasoning(0, signed_thinking_value(parser.thinking)),
            StreamEnd("tool_calls", {"prompt_tokens": 9, "completion_tokens": 5,
                                     "total_tokens": 14})]
        assert parser.done
        assert parser.thinking == [{"type": "thinking", "thinking": "hmm", "signature": ""}]
        assert parser.tool_ids == ["toolu_1", "toolu_2"]


def test_anthropic_parser_errors() -> None:
    with pytest.raises(UpstreamError, match="error mid-stream: Overloaded"):
        AnthropicStreamParser().feed(_sse({"type": "error", "error": {
            "type": "overloaded_error", "message": "Overloaded"}}))
    with pytest.raises(UpstreamError, match="malformed JSON"):
        AnthropicStreamParser().feed(b"data: {nope\n\n")


# ---- Gemini: schemas, one rule each ----------------------------------------------------------


def test_gemini_schema_types_are_upper_case_and_required_is_filtered() -> None:
    assert to_gemini_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                             "required": ["a", "ghost"]}) == {
        "type": "OBJECT", "properties": {"a": {"type": "INTEGER"}}, "required": ["a"]}


def test_gemini_schema_drops_unsupported_keywords() -> None:
    out = to_gemini_schema({
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
        "additionalProperties": False, "properties": {"a": {
            "type": "string", "not": {"const": "x"}, "examples": ["y"], "format": "email"}}})
    assert out == {"type": "OBJECT", "properties": {"a": {"type": "STRING"}}}


def test_gemini_schema_keeps_supported_formats() -> None:
    assert to_gemini_schema({"type": "string", "format": "date-time"})["format"] == "date-time"
    assert to_gemini_schema({"type": "integer", "format": "int64"})["format"] == "int64"
    assert "format" not in to_gemini_schema({"type": "number", "format": "int64"})


def test_gemini_schema_inlines_refs() -> None:
    out = to_gemini_schema({"type": "object", "$defs": {"City": {
        "type": "object", "properties": {"name": {"type": "string"}}}},
        "properties": {"city": {"$ref": "#/$defs/City", "description": "where"}}})
    assert out["properties"]["city"] == {"type": "OBJECT", "description": "where",
                                         "properties": {"name": {"type": "STRING"}}}


def test_gemini_schema_recursive_ref_ends() -> None:
    out = to_gemini_schema({"type": "object", "definitions": {"Node": {
        "type": "object", "properties": {"child": {"$ref": "#/definitions/Node"}}}},
        "properties": {"root": {"$ref": "#/definitions/Node"}}})
    assert out["properties"]["root"]["properties"]["child"] == {"type": "OBJECT"}


def test_gemini_schema_nullable_from_type_list_and_any_of() -> None:
    assert to_gemini_schema({"type": ["string", "null"]}) == {"type": "STRING",
                                                               "nullable": True}
    assert to_gemini_schema({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == {
        "type": "INTEGER", "nullable": True}


def test_gemini_schema_one_of_becomes_any_of() -> None:
    assert to_gemini_schema({"oneOf": [{"type": "string"}, {"type": "integer"}]}) == {
        "anyOf": [{"type": "STRING"}, {"type": "INTEGER"}]}


def test_gemini_schema_all_of_is_merged() -> None:
    out = to_gemini_schema({"allOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"properties": {"b": {"type": "boolean"}}}]})
    assert out == {"type": "OBJECT", "properties": {"a": {"type": "STRING"},
                                                     "b": {"type": "BOOLEAN"}},
                   "required": ["a"]}


def test_gemini_schema_const_and_enums() -> None:
    assert to_gemini_schema({"const": "on"}) == {"type": "STRING", "enum": ["on"]}
    assert to_gemini_schema({"type": "integer", "enum": [1, 2], "description": "n"}) == {
        "type": "INTEGER", "description": "n (one of: 1, 2)"}


def _json_types(schema: dict[str, Any]) -> set[str]:
    return {member["type"] for member in schema["anyOf"]}


ALL_JSON_TYPES = {"STRING", "NUMBER", "INTEGER", "BOOLEAN", "OBJECT", "ARRAY"}


def test_gemini_schema_typeless_is_any_json_value_not_a_string() -> None:
    # Gemini fills arguments to the declared type: a guessed STRING turned 3 into "3".
    out = to_gemini_schema({"type": "object", "properties": {
        "any": {}, "described": {"description": "anything"}}})["properties"]
    assert out["any"]["nullable"] is True
    assert _json_types(out["any"]) == ALL_JSON_TYPES
    assert out["described"]["description"] == "anything"
    assert _json_types(out["described"]) == ALL_JSON_TYPES
    array = next(m for m in out["any"]["anyOf"] if m["type"] == "ARRAY")
    assert _json_types(array["items"]) == ALL_JSON_TYPES
    items = to_gemini_schema({"type": "array"})["items"]
    assert items["nullable"] is True
    assert _json_types(items) == ALL_JSON_TYPES


def test_gemini_schema_typeless_takes_the_type_its_keywords_imply() -> None:
    assert to_gemini_schema({"properties": {"a": {"type": "integer"}}})["type"] == "OBJECT"
    assert to_gemini_schema({"items": {"type": "integer"}}) == {
        "type": "ARRAY", "items": {"type": "INTEGER"}}
    assert to_gemini_schema({"enum": ["a", "b"]}) == {"type": "STRING", "enum": ["a", "b"]}
    assert to_gemini_schema({"maxLength": 3}) == {"type": "STRING", "maxLength": 3}
    assert to_gemini_schema({"minimum": 1}) == {"type": "NUMBER", "minimum": 1}


def test_gemini_state_tools_take_any_json_value() -> None:
    # The built-in agent's state delta: `value` is any JSON (a number, an object, ...).
    delta = to_gemini_schema(_DELTA_SPEC.parameters)["properties"]["delta"]["items"]
    value = delta["properties"]["value"]
    assert "type" not in value
    assert _json_types(value) == ALL_JSON_TYPES
    snapshot = to_gemini_schema(_SNAPSHOT_SPEC.parameters)["properties"]["snapshot"]
    assert snapshot["type"] == "OBJECT"


def test_gemini_schema_exclusive_bounds_and_object_defaults() -> None:
    assert to_gemini_schema({"type": "number", "exclusiveMinimum": 0}) == {
        "type": "NUMBER", "minimum": 0}
    assert to_gemini_schema({"type": "object", "default": {}}) == {"type": "OBJECT"}


async def test_gemini_strict_mock_accepts_a_hostile_schema() -> None:
    schema = {"$schema": "x", "type": "object", "additionalProperties": False,
              "$defs": {"Unit": {"enum": ["c", "f"]}},
              "properties": {"city": {"type": ["string", "null"], "format": "uri"},
                             "unit": {"$ref": "#/$defs/Unit"},
                             "days": {"type": "integer", "enum": [1, 3, 7]},
                             "tags": {"type": "array"},
                             "extra": {"type": "object", "properties": {}}}}
    async with asyncio.timeout(TIMEOUT_S), MockGeminiServer() as server:
        adapter = GoogleGenAIAdapter(api_key="k", base_url=server.base_url, max_retries=0)
        try:
            deltas = [d async for b in adapter.stream(ChatRequest(
                messages=[UserMessage(id="u", content="hi")],
                tools=[ToolSpec("f", "d", schema), ToolSpec("noargs", "d", {"type": "object"})]))
                for d in b]
        finally:
            await adapter.aclose()
    assert isinstance(deltas[-1], StreamEnd)
    declarations = server.requests[0]["tools"][0]["functionDeclarations"]
    assert "parameters" not in declarations[1]  # Gemini refuses empty object parameters
    assert declarations[0]["parameters"]["properties"]["unit"]["enum"] == ["c", "f"]


def test_gemini_schema_takes_boolean_schemas_and_odd_values() -> None:
    """Before: each of these raised out of the conversion (TypeError, AttributeError,
    unhashable list), failing every run of a Gemini agent offered the tool."""
    any_value = to_gemini_schema({"type": "object", "properties": {
        "q": {"$ref": "#/$defs/Any", "description": "q"}}, "$defs": {"Any": True}})
    assert any_value["properties"]["q"]["nullable"] is True
    assert _json_types(any_value["properties"]["q"]) == ALL_JSON_TYPES
    assert any_value["properties"]["q"]["description"] == "q"
    assert to_gemini_schema({  # (in draft-07 `$defs` is no keyword: any value is valid)
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"a": {"type": "string"}}, "$defs": [1]}) == {
        "type": "OBJECT", "properties": {"a": {"type": "STRING"}}}
    never = to_gemini_schema({"type": "object", "required": ["a", "b"], "properties": {
        "a": {"allOf": [{"$ref": "#/$defs/X"}, True, 1]}, "b": False, "c": True},
        "$defs": {"X": False}})
    assert sorted(never["properties"]) == ["a", "c"]  # `b` may never be given
    assert never["required"] == ["a"]
    assert to_gemini_schema({"type": "object", "properties": {"a": {"type": "string"}},
                             "required": [["a"]], "allOf": 1}) == {
        "type": "OBJECT", "properties": {"a": {"type": "STRING"}}}
    assert to_gemini_schema({"type": "string", "description": 5, "title": {},
                             "minLength": "2", "pattern": 7, "nullable": "yes"}) == {
        "type": "STRING"}
    assert to_gemini_schema({"anyOf": [False, {"type": "string"}]}) == {"type": "STRING"}


JSON_KEYS = st.sampled_from([
    "type", "properties", "required", "items", "anyOf", "oneOf", "allOf", "$ref", "$defs",
    "definitions", "enum", "const", "format", "description", "title", "nullable", "default",
    "minimum", "exclusiveMinimum", "minItems", "pattern", "additionalProperties"]) | st.text(
    max_size=3)
JSON_LEAVES = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
               | st.sampled_from(["object", "string", "array", "null", "integer", "#/$defs/a",
                                  "#/definitions/a", "a", "date-time"]) | st.text(max_size=3))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(JSON_KEYS, inner, max_size=5), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
@example({"$ref": "object", "description": False})  # (a $ref's non-text description)
def test_gemini_schema_of_any_json_value_never_raises_and_is_a_gemini_schema(
        parameters: Any) -> None:
    """Any JSON value as a tool's parameters (a frontend's, an MCP server's) converts, to
    something the SDK's schema model takes."""
    out = to_gemini_schema(parameters)
    gemini_types.Schema.model_validate(out)


def _pydantic_union_schema() -> dict[str, Any]:
    """What pydantic writes for a discriminated union as a tool's arguments: a `oneOf` of
    `$ref`s into `$defs`, an OpenAPI `discriminator`."""

    from pydantic import BaseModel, Field, RootModel

    class Email(BaseModel):
        kind: Literal["email"]
        to: str
        subject: str

    class Sms(BaseModel):
        kind: Literal["sms"]
        phone: str

    class Send(RootModel[Email | Sms]):
        root: Email | Sms = Field(discriminator="kind")

    return Send.model_json_schema()


#: Tool schemas whose properties are behind `$ref`s: (the schema, an input it accepts, the
#: properties the flattened one offers, the names it requires).
REF_SCHEMAS: dict[str, tuple[dict[str, Any], dict[str, Any], set[str], list[str]]] = {
    "pydantic union": (_pydantic_union_schema(), {"kind": "sms", "phone": "1"},
                       {"kind", "to", "subject", "phone"}, ["kind"]),
    "allOf with a $ref base": ({
        "$defs": {"Base": {"type": "object", "properties": {"id": {"type": "string"}},
                           "required": ["id"]}},
        "allOf": [{"$ref": "#/$defs/Base"},
                  {"type": "object", "properties": {"note": {"type": "string"}}}]},
        {"id": "x", "note": "n"}, {"id", "note"}, ["id"]),
    "zod's named schema (a top-level $ref)": ({
        "$ref": "#/definitions/Args", "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"Args": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}},
        {"city": "Paris"}, {"city"}, ["city"]),
    "a chain of $refs to an anyOf, one member a JSON pointer": ({
        "$ref": "#/definitions/Args",
        "definitions": {"Args": {"$ref": "#/definitions/Either"}, "Either": {"anyOf": [
            {"$ref": "#/definitions/ByName"}, {"$ref": "#/definitions/Either/x-id"}],
            "x-id": {"type": "object", "properties": {"id": {"type": "integer"}}}},
            "ByName": {"type": "object", "properties": {"name": {"type": "string"}},
                       "required": ["name"]}}},
        {"id": 3}, {"name", "id"}, []),
}


def _declared_names(gemini: dict[str, Any]) -> set[str]:
    """The argument names a Gemini schema declares: its own properties and those of its
    top-level alternatives."""
    names = set(gemini.get("properties") or ())
    for member in gemini.get("anyOf") or ():
        names |= set(member.get("properties") or ())
    return names


@pytest.mark.parametrize("shape", REF_SCHEMAS)
def test_tool_schema_follows_refs_of_members_and_at_the_top(shape: str) -> None:
    """Before: flattening read only the properties written on each member, so a member
    `{"$ref": ...}` added none and a top-level `$ref` was offered as an object of no
    properties: every provider saw a pydantic union or zod's named schema as a tool with no
    arguments, and Gemini, whose own conversion had followed them, lost its arguments too."""
    import jsonschema

    from copilot_runtime.adapters._common import tool_schema
    from copilot_runtime.adapters.google import _tool_parameters

    schema, accepted, offered, required = REF_SCHEMAS[shape]
    before = orjson.loads(orjson.dumps(schema))
    out = tool_schema(schema)
    assert schema == before  # (not changed in place)
    assert out["type"] == "object"
    assert not {"$ref", "anyOf", "oneOf", "allOf", "discriminator"} & out.keys(), out
    assert set(out["properties"]) == offered
    assert out.get("required", []) == required
    checker = jsonschema.validators.validator_for(out)
    checker.check_schema(out)
    checker(out).validate(accepted)
    gemini = _tool_parameters("t", schema)
    assert _declared_names(to_gemini_schema(schema)) <= set(gemini["properties"])
    assert gemini.get("required", []) == required
    gemini_types.Schema.model_validate(gemini)


def test_tool_schema_that_needs_no_flattening_is_passed_as_it_is() -> None:
    from copilot_runtime.adapters._common import tool_schema

    schema = {"type": "object", "$defs": {"City": {"type": "string"}},
              "properties": {"city": {"$ref": "#/$defs/City"},
                             "home": {"anyOf": [{"$ref": "#/$defs/City"}, {"type": "null"}]}},
              "required": ["city"]}
    assert tool_schema(schema) is schema


ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
#: Tool schemas with `$ref`s into what flattening removes (zod-to-json-schema's default
#: `$refStrategy: "root"` writes a reused schema as a path to its first place): (the
#: schema, an input it accepts, one it refuses).
PATH_REF_SCHEMAS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "into an anyOf member": ({
        "$schema": "http://json-schema.org/draft-07/schema#", "anyOf": [
            {"type": "object", "properties": {"home": ADDRESS, "name": {"type": "string"}},
             "required": ["home", "name"]},
            {"type": "object", "properties": {
                "work": {"$ref": "#/anyOf/0/properties/home"}, "company": {"type": "string"}},
             "required": ["work"]}]},
        {"work": {"city": "Paris"}}, {"work": {"city": 1}}),
    "into an allOf member": ({"allOf": [
        {"type": "object", "properties": {"a": {"type": "string", "minLength": 2}}},
        {"properties": {"b": {"$ref": "#/allOf/0/properties/a"}}}]},
        {"a": "xx", "b": "yy"}, {"b": "y"}),
    "to the root, recursively": ({"anyOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}},
         "required": ["children"]}]},
        {"children": [{"a": "x"}, {"children": []}]}, {"children": [{"a": 1}]}),
    "into a property two members declare apart": ({
        "type": "object", "properties": {
            "x": {"type": "object", "properties": {"y": {"type": "string"}}},
            "z": {"$ref": "#/properties/x/properties/y"}},
        "anyOf": [{"properties": {"x": {"type": "integer"}}}, {"required": ["z"]}]},
        {"z": "s"}, {"z": 5}),
}


def _local_refs(node: Any) -> list[str]:
    if isinstance(node, list):
        return [r for v in node for r in _local_refs(v)]
    if not isinstance(node, dict):
        return []
    own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
    return own + [r for k, v in node.items() if k not in ("enum", "const")
                  for r in _local_refs(v)]


def _points_somewhere(root: Any, ref: str) -> bool:
    node = root
    for token in ref.lstrip("#").split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return False
    return True


@pytest.mark.parametrize("shape", PATH_REF_SCHEMAS)
def test_tool_schema_keeps_no_ref_into_what_it_flattened(shape: str) -> None:
    """Before: flattening removed the `anyOf`/`allOf` (or widened the property) a `$ref`
    pointed into and kept the `$ref`: OpenAI and Anthropic were sent a schema with a
    reference to nothing (jsonschema: PointerToNowhere), and refused it. Each such `$ref`
    now names a copy of its old target in the definitions: the flattened schema is valid,
    accepts what the original accepted and refuses what that part refused."""
    import jsonschema

    from copilot_runtime.adapters._common import tool_schema
    from copilot_runtime.adapters.google import _tool_parameters

    schema, accepted, refused = PATH_REF_SCHEMAS[shape]
    before = orjson.loads(orjson.dumps(schema))
    out = tool_schema(schema)
    assert schema == before
    assert not {"anyOf", "oneOf", "allOf"} & out.keys(), out
    assert all(_points_somewhere(out, ref) for ref in _local_refs(out)), out
    checker = jsonschema.validators.validator_for(out)
    checker.check_schema(out)
    for s in (schema, out):
        checker(s).validate(accepted)
        assert not checker(s).is_valid(refused), (s, refused)
    gemini = _tool_parameters("t", schema)
    gemini_types.Schema.model_validate(gemini)
    assert _declared_names(to_gemini_schema(schema)) <= set(gemini["properties"])


def test_gemini_follows_a_path_ref_into_a_flattened_member() -> None:
    """Gemini's conversion finds a definition by the `$ref`'s last segment: a path into an
    `anyOf` member left the argument an object of unknown fields."""
    from copilot_runtime.adapters.google import _tool_parameters

    gemini = _tool_parameters("t", PATH_REF_SCHEMAS["into an anyOf member"][0])
    assert gemini["properties"]["work"] == {"type": "OBJECT", "properties": {
        "city": {"type": "STRING"}}, "required": ["city"]}


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
@example({"$ref": "#", "anyOf": [{"$ref": "#"}], "properties": {"a": {"$ref": "#/anyOf/0"}}})
def test_tool_schema_of_any_json_value_never_raises(parameters: Any) -> None:
    """Any JSON value as a tool's parameters is offered as an object schema (the `$ref`s
    followed and repaired: a loop, a pointer to nothing, a reference to the root too)."""
    from copilot_runtime.adapters._common import tool_schema

    out = tool_schema(parameters)
    assert out["type"] == "object"
    assert not {"$ref", "anyOf", "oneOf", "allOf", "enum", "const", "not"} & out.keys()


def _zod_named(i: int) -> dict[str, Any]:
    """zod-to-json-schema's named schema: a top-level `$ref` into `definitions`."""
    return {"$ref": f"#/definitions/tool{i}", "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {f"tool{i}": {"type": "object", "properties": {
                "f": {"type": "string"},
                "addr": {"type": "object", "properties": {"city": {"type": "string"}}},
                "other": {"$ref": f"#/definitions/tool{i}/properties/addr"}},
                "required": ["f"], "additionalProperties": False}}}


def test_flattened_tool_schema_whose_refs_all_hold_is_not_rebuilt() -> None:
    """Before: every flattened schema was copied node by node to repair its `$ref`s, even
    when each still named what it named (zod's named schema: ~0.1 ms a tool, each request)."""
    from copilot_runtime.adapters._common import tool_schema

    schema = _zod_named(1)
    out = tool_schema(schema)
    declared = schema["definitions"]["tool1"]
    assert out["properties"]["addr"] is declared["properties"]["addr"]
    assert out["definitions"] is schema["definitions"]
    assert out["required"] == ["f"]


def test_tool_schema_is_flattened_once_per_schema() -> None:
    """Before: each adapter flattened every tool's schema again for each model request and
    each step of a tool loop (50 flattened tools: ~20 ms of blocked event loop a request).
    The same schema (a server action's object, or a frontend tool sent again) is flattened
    once; one needing nothing is still returned as it is."""
    from copilot_runtime.adapters._common import tool_schema

    first = tool_schema(_zod_named(2))
    again = _zod_named(2)
    assert tool_schema(again) is first
    assert tool_schema(_self_union(5)) is tool_schema(_self_union(5))
    plain = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert tool_schema(plain) is plain
    assert tool_schema(_zod_named(3)) is not first


def _self_union(b: int) -> dict[str, Any]:
    """The reviewer's shape: `X = anyOf[$ref X * (b-1), {object}]`, ~500 bytes at b=16."""
    return {"$defs": {"X": {"anyOf": [{"$ref": "#/$defs/X"}] * (b - 1) + [
        {"type": "object", "properties": {"q": {"type": "string"}}}]}}, "$ref": "#/$defs/X"}


@pytest.mark.parametrize("b", [12, 16, 20, 30])
def test_self_referencing_union_is_flattened_in_a_few_milliseconds(b: int) -> None:
    """Before: each member `$ref X` was followed and flattened again down to the depth limit
    (~b^5 resolves): 4 s of blocked event loop at b=16, 41 s at b=25, from a 500-byte
    frontend tool. A `$ref` to what is already being flattened adds nothing now."""
    from copilot_runtime.adapters._common import tool_schema

    schema = _self_union(b)
    started = time.perf_counter()
    out = tool_schema(schema)
    assert time.perf_counter() - started < 0.05
    assert out["properties"] == {"q": {"type": "string"}}
    assert len(orjson.dumps(out)) < 1000


def test_tool_schema_too_costly_to_flatten_is_offered_open(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A union of references without a cycle (each level `b` differently annotated `$ref`s to
    the next) still costs b^depth: past a fixed budget of work the tool is offered as an open
    object with its description, and a warning said once for that tool."""
    from collections import OrderedDict

    from copilot_runtime.adapters import _common
    from copilot_runtime.adapters._common import tool_schema

    monkeypatch.setattr(_common, "_cache", OrderedDict())  # (said once per process)
    monkeypatch.setattr(_common, "_warned", set())
    b, levels = 30, 5
    defs = {f"L{i}": {"anyOf": [{"$ref": f"#/$defs/L{i + 1}", "title": str(j)}
                                for j in range(b)]} for i in range(levels)}
    defs[f"L{levels}"] = {"type": "object", "properties": {"q": {"type": "string"}}}
    schema = {"description": "Deep.", "$defs": defs, "$ref": "#/$defs/L0"}
    with structlog.testing.capture_logs() as logs:
        started = time.perf_counter()
        for _ in range(3):
            out = tool_schema(orjson.loads(orjson.dumps(schema)), "deep")
        assert time.perf_counter() - started < 1.0
    assert out == {"type": "object", "properties": {}, "description": "Deep."}
    assert [e["tool"] for e in logs if e["log_level"] == "warning"] == ["deep"]


_REF = st.builds(lambda i: {"$ref": f"#/$defs/D{i}"}, st.integers(0, 3)) | st.just({"$ref": "#"})
_OBJECT = st.builds(lambda name, req: {"type": "object", "properties": {name: {"type": "string"}},
                                        **({"required": [name]} if req else {})},
                    st.sampled_from("abcd"), st.booleans())
_MEMBERS = st.lists(_REF | _OBJECT, min_size=1, max_size=24)
_COMBINED = st.builds(lambda key, members: {key: members},
                      st.sampled_from(["anyOf", "oneOf", "allOf"]), _MEMBERS)


@settings(max_examples=150, deadline=None)
@given(st.lists(_COMBINED, min_size=4, max_size=4), _COMBINED)
def test_recursive_tool_schemas_are_flattened_in_bounded_time(
        defs: list[dict[str, Any]], top: dict[str, Any]) -> None:
    """Small schemas of unions, intersections and references to each other and to the root
    (cycles of any length, members repeated) are flattened within a bounded time."""
    from copilot_runtime.adapters._common import tool_schema

    schema = {**top, "$defs": {f"D{i}": d for i, d in enumerate(defs)}}
    started = time.perf_counter()
    out = tool_schema(schema)
    assert time.perf_counter() - started < 0.25
    assert out["type"] == "object"
    assert not {"$ref", "anyOf", "oneOf", "allOf"} & out.keys()
    assert len(orjson.dumps(out)) < 200_000


def test_gemini_tool_whose_schema_cannot_be_converted_costs_only_that_tool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Were a schema to break the conversion still, that tool is offered with open
    parameters and a warning; the run and the other tools go on."""
    import copilot_runtime.adapters.google as google

    convert = google._convert

    def breaks_on_odd(schema: Any, *rest: Any) -> dict[str, Any]:
        if isinstance(schema, dict) and "odd" in schema:
            raise TypeError("odd")
        return convert(schema, *rest)

    monkeypatch.setattr(google, "_convert", breaks_on_odd)
    adapter = GoogleGenAIAdapter(api_key="k", max_retries=0)
    fine = {"type": "object", "properties": {"a": {"type": "string"}}}
    with structlog.testing.capture_logs() as logs:
        _, config = adapter.build_config(ChatRequest(
            messages=[UserMessage(id="u", content="hi")],
            tools=[ToolSpec("odd", "d", {"odd": 1}), ToolSpec("fine", "d", fine)]))
    declarations = config["tools"][0]["function_declarations"]
    assert declarations == [{"name": "odd", "description": "d"}, {
        "name": "fine", "description": "d",
        "parameters": {"type": "OBJECT", "properties": {"a": {"type": "STRING"}}}}]
    assert [(e["event"], e["tool"]) for e in logs if e["log_level"] == "warning"] == [
        ("tool schema not converted for Gemini", "odd")]


def test_gemini_gives_the_runtimes_own_output_bound_room_to_think() -> None:
    """Gemini counts its thinking (on by default from 2.5 on) against maxOutputTokens: a
    guardrail judge's 100 tokens went to thinking, the answer came back empty, and the judge
    refused everything. A client's maxTokens is sent as given."""
    adapter = GoogleGenAIAdapter(api_key="k", max_retries=0)
    messages = [UserMessage(id="u", content="hi")]
    _, judge = adapter.build_config(ChatRequest(messages=messages, max_tokens=100,
                                                runtime_settings=True))
    _, client = adapter.build_config(ChatRequest(messages=messages, max_tokens=100))
    assert judge["max_output_tokens"] == 4100
    assert client["max_output_tokens"] == 100


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80), st.text(max_size=80))
def test_gemini_names_are_names_gemini_takes_and_stay_apart(first: str, second: str) -> None:
    from copilot_runtime.adapters.google import _gemini_name

    taken = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")
    assert taken.fullmatch(_gemini_name(first))
    assert _gemini_name(first) == _gemini_name(first)
    if taken.fullmatch(first):
        assert _gemini_name(first) == first
    if first != second:
        assert _gemini_name(first) != _gemini_name(second)
    assert _gemini_name("127_0_0_1__add").startswith("_127_0_0_1__add_")


# ---- Gemini: contents and signatures ---------------------------------------------------------


def test_gemini_contents_function_responses() -> None:
    system, contents = to_gemini_contents([
        SystemMessage(id="s", content="sys"), UserMessage(id="u", content="go"),
        AssistantMessage(id="a", tool_calls=[call("c1", "f", '{"x":1}'), call("c2", "g", "7")]),
        ToolMessage(id="t1", tool_call_id="c1", content='{"ok":true}'),
        ToolMessage(id="t2", tool_call_id="c2", content="plain", error="bad")])
    assert system == ["sys"]
    assert contents[1] == {"role": "model", "parts": [
        {"function_call": {"name": "f", "args": {"x": 1}}, "thought_signature": base64.
         urlsafe_b64decode("skip_thought_signature_validator")},  # (its own is not known)
        {"function_call": {"name": "g", "args": {"value": 7}}}]}
    assert contents[2] == {"role": "user", "parts": [
        {"function_response": {"name": "f", "response": {"ok": True}}},
        {"function_response": {"name": "g", "response": {"error": "bad", "output": "plain"}}}]}


def test_gemini_contents_missing_response_is_filled() -> None:
    _, contents = to_gemini_contents([
        UserMessage(id="u", content="go"), AssistantMessage(id="a", tool_calls=[call("c1")]),
        UserMessage(id="u2", content="again")])
    assert contents[2]["parts"][0]["function_response"]["response"]["error"]
    # (a turn of function responses holds nothing else: Gemini refuses it with a 400)
    assert contents[3] == {"role": "user", "parts": [{"text": "again"}]}


def test_gemini_inline_data_is_decoded() -> None:
    _, contents = to_gemini_contents([UserMessage(id="u", content=[
        ImagePart(source=DataSource(value="aGk=", mime_type="image/png"))])])
    assert contents[0]["parts"] == [{"inline_data": {"mime_type": "image/png", "data": b"hi"}}]
    # (data that is not base64 fails the run: tests/test_attachments.py)


async def test_gemini_thought_signature_comes_back() -> None:
    # The mock signs the call, as Gemini 3 does, and refuses a replay without the signature.
    tools = [ToolSpec("getWeather", "w", {"type": "object", "properties": {
        "city": {"type": "string"}}})]
    async with asyncio.timeout(TIMEOUT_S), MockGeminiServer(sign_calls=True) as server:
        adapter = GoogleGenAIAdapter(api_key="k", base_url=server.base_url, max_retries=0)
        try:
            first = [d async for b in adapter.stream(ChatRequest(
                messages=[UserMessage(id="u", content='call:getWeather {"city":"Rome"}')],
                tools=tools, thread_id="t")) for d in b]
            (head,) = [d for d in first if isinstance(d, ToolCallDelta)]
            assert head.id is not None
            follow = [d async for b in adapter.stream(ChatRequest(messages=[
                UserMessage(id="u", content='call:getWeather {"city":"Rome"}'),
                AssistantMessage(id="a", tool_calls=[call(head.id, "getWeather",
                                                          head.arguments)]),
                ToolMessage(id="t", tool_call_id=head.id, content='{"t":21}')],
                tools=tools, thread_id="t")) for d in b]
        finally:
            await adapter.aclose()
    assert "".join(d.text for d in follow if isinstance(d, TextDelta)) == 'echo: {"t":21}'
    replayed = server.requests[1]["contents"][1]["parts"][0]
    assert replayed["thoughtSignature"] not in ("", "skip_thought_signature_validator")


# ---- LangChain and Empty ---------------------------------------------------------------------


async def test_langchain_stream_without_terminal_event_ends_cleanly() -> None:
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    model = GenericFakeChatModel(messages=iter([AIMessage(content="one two three")]))
    adapter = LangChainAdapter(model)
    async with asyncio.timeout(TIMEOUT_S):
        deltas = [d async for b in adapter.stream(ChatRequest(
            messages=[UserMessage(id="u", content="hi")], system_prompt="sys")) for d in b]
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "one two three"
    assert deltas[-1] == StreamEnd("stop", None)


async def test_a_langchain_model_that_takes_no_tools_is_a_configuration_error() -> None:
    """A chat model without `bind_tools` offered tools: a run's error saying so, where
    LangChain's bare NotImplementedError crashed the run as the agent's own failure."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    model = GenericFakeChatModel(messages=iter([AIMessage(content="hi")]))
    request = ChatRequest(messages=[UserMessage(id="u", content="hi")],
                          tools=[ToolSpec("getWeather", "", {"type": "object"})])
    with pytest.raises(ConfigurationError, match="GenericFakeChatModel takes no tools"):
        async for _ in LangChainAdapter(model).stream(request):
            pass


async def test_a_langchain_model_must_call_some_tool_by_langchains_word() -> None:
    """"required" reaches `bind_tools` as LangChain's "any", which every LangChain chat
    model takes for "some tool" (ChatAnthropic takes any other word for a tool's name)."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    chosen: list[Any] = []

    class ToolTaking(GenericFakeChatModel):
        def bind_tools(self, tools: Any, *, tool_choice: Any = None, **_: Any) -> Any:
            chosen.append(tool_choice)
            return self

    model = ToolTaking(messages=iter([AIMessage(content="hi")]))
    request = ChatRequest(messages=[UserMessage(id="u", content="hi")], tool_choice="required",
                          tools=[ToolSpec("getWeather", "", {"type": "object"})])
    async for _ in LangChainAdapter(model).stream(request):
        pass
    assert chosen == ["any"]


async def test_empty_adapter_serves_agents_only() -> None:
    agent = HttpAgent(url="http://127.0.0.1:9/agent")
    runtime = CopilotRuntime(service_adapter=EmptyAdapter(), agents={"remote": agent})
    try:
        assert list(runtime.agents) == ["remote"]
    finally:
        await runtime.aclose()
    with pytest.raises(ConfigurationError, match="EmptyAdapter"):
        CopilotRuntime(service_adapter=EmptyAdapter(), actions=[getWeather])
    with pytest.raises(InvalidRequestError, match="no language model"):
        async for _ in EmptyAdapter().stream(ChatRequest(messages=[])):
            pass


async def test_anthropic_on_vertex_streams_through_the_sdk_iterator() -> None:
    import anthropic

    from copilot_runtime.testing import MockAnthropicServer

    async with asyncio.timeout(TIMEOUT_S), MockAnthropicServer(chunks=3) as server:
        client = anthropic.AsyncAnthropicVertex(
            region="us-east5", project_id="proj", access_token="token",
            base_url=server.base_url + "/v1", max_retries=0)
        adapter = AnthropicAdapter(model="claude-on-vertex", client=client)
        try:
            text = [d async for b in adapter.stream(ChatRequest(
                messages=[UserMessage(id="u", content="hello")])) for d in b]
            calls = [d async for b in adapter.stream(ChatRequest(
                messages=[UserMessage(id="u", content='call:f {"a":1}')],
                tools=[ToolSpec("f", "", {"type": "object"})])) for d in b]
            with pytest.raises(UpstreamError, match="HTTP 429"):
                async for _ in adapter.stream(ChatRequest(
                        messages=[UserMessage(id="u", content="error:429")])):
                    pass
        finally:
            await adapter.aclose()
            await client.close()  # the application's: the adapter leaves it open
    assert "".join(d.text for d in text if isinstance(d, TextDelta)) == "echo: hello"
    assert text[-1].finish_reason == "stop"
    assert "".join(d.arguments for d in calls if isinstance(d, ToolCallDelta)) == '{"a":1}'
    assert server.requests[0]["model"] == "claude-on-vertex"


def test_demo_provider_from_the_environment() -> None:
    from copilot_runtime import OpenAIAdapter
    from copilot_runtime.adapters.from_env import adapter_from_env

    assert adapter_from_env({}) is None
    adapter, line = adapter_from_env({"ANTHROPIC_API_KEY": "k", "ANTHROPIC_MODEL": "c-1"}) or (
        None, "")
    assert isinstance(adapter, AnthropicAdapter)
    assert line == "model c-1 at Anthropic"
    adapter, _ = adapter_from_env({"GEMINI_API_KEY": "k"}) or (None, "")
    assert isinstance(adapter, GoogleGenAIAdapter)
    adapter, _ = adapter_from_env({"OPENAI_API_KEY": "k", "ANTHROPIC_API_KEY": "k"}) or (
        None, "")
    assert isinstance(adapter, OpenAIAdapter)
    adapter, _ = adapter_from_env({"OPENAI_API_KEY": "k", "ANTHROPIC_API_KEY": "k",
                                   "COPILOT_RUNTIME_PROVIDER": "anthropic"}) or (None, "")
    assert isinstance(adapter, AnthropicAdapter)
    with pytest.raises(ConfigurationError, match="COPILOT_RUNTIME_PROVIDER"):
        adapter_from_env({"COPILOT_RUNTIME_PROVIDER": "nope"})


# ---- thinking → REASONING_* for AG-UI 1.0 clients only ---------------------------------------


async def test_anthropic_thinking_streams_as_reasoning_to_new_clients_only(
        serve_runtime: Any) -> None:
    from copilot_runtime.testing import MockAnthropicServer, verify_events
    from tests.conftest import run_input, text_of, types

    async with asyncio.timeout(TIMEOUT_S), MockAnthropicServer(chunks=3) as server:
        runtime = CopilotRuntime(service_adapter=AnthropicAdapter(
            api_key="k", base_url=server.base_url, max_retries=0,
            thinking={"type": "enabled", "budget_tokens": 1024}), actions=[getWeather])
        async with serve_runtime(runtime) as served:
            new = await served.run(run_input("think: hello", protocolVersion="1.0"))
            old = await served.run(run_input("think: hello", run="run-2"))
            # the tool loop goes on with thinking on: the signed block is sent back
            loop = await served.run(run_input('think: call:getWeather {"city":"Oslo"}',
                                              run="run-3", protocolVersion="1.0"))
    kinds = types(new)
    assert kinds[1:6] == ["REASONING_START", "REASONING_MESSAGE_START",
                          "REASONING_MESSAGE_CONTENT", "REASONING_MESSAGE_CONTENT",
                          "REASONING_MESSAGE_CONTENT"], kinds
    assert kinds[6:8] == ["REASONING_MESSAGE_END", "REASONING_END"]
    assert "".join(e["delta"] for e in new if e["type"] == "REASONING_MESSAGE_CONTENT") == \
        "Thinking about: hello"
    assert text_of(new) == "echo: hello"
    verify_events(new)
    assert not [k for k in types(old) if k.startswith("REASONING")]
    assert text_of(old) == "echo: hello"
    assert types(loop)[-1] == "RUN_FINISHED", loop
    assert "TOOL_CALL_RESULT" in types(loop)
    replayed = server.requests[-1]["messages"][1]["content"]
    assert replayed[0]["type"] == "thinking"
    assert replayed[0]["signature"]


# ---- provider memory this process lacks: the thread stays usable ----------------------------

_WEATHER = [ToolSpec("getWeather", "w", {"type": "object", "properties": {
    "city": {"type": "string"}}})]
_THINKING = {"type": "enabled", "budget_tokens": 1024}


def _answered_call(call_id: str, ask: str = 'call:getWeather {"city":"Oslo"}') -> list[Any]:
    """A history whose last answer is a tool call, now answered by the client."""
    return [UserMessage(id="u", content=ask),
            AssistantMessage(id="a", tool_calls=[call(call_id, "getWeather", '{"city":"Oslo"}')]),
            ToolMessage(id="t", tool_call_id=call_id, content='{"t":21}')]


async def _deltas(adapter: Any, request: ChatRequest) -> list[Any]:
    return [d async for b in adapter.stream(request) for d in b]


def _echo(deltas: list[Any]) -> str:
    return "".join(d.text for d in deltas if isinstance(d, TextDelta))


async def test_anthropic_tool_loop_whose_thinking_another_worker_holds_goes_without() -> None:
    """The signed thinking of a tool call lives in the adapter that streamed it: the client's
    tool result reaching another worker (a restart, an evicted entry) was refused with thinking
    on (the assistant turn must start with it), and every later message of the thread too."""
    from copilot_runtime.testing import MockAnthropicServer

    async with asyncio.timeout(TIMEOUT_S), MockAnthropicServer(chunks=3) as server:
        first, other = (AnthropicAdapter(api_key="k", base_url=server.base_url, max_retries=0,
                                         thinking=_THINKING) for _ in range(2))
        try:
            asked = await _deltas(first, ChatRequest(messages=[UserMessage(
                id="u", content='think: call:getWeather {"city":"Oslo"}')], tools=_WEATHER,
                thread_id="t"))
            (head,) = [d for d in asked if isinstance(d, ToolCallDelta) and d.id]
            assert head.id is not None
            history = _answered_call(head.id, 'think: call:getWeather {"city":"Oslo"}')
            elsewhere = await _deltas(other, ChatRequest(messages=history, tools=_WEATHER,
                                                         thread_id="t"))
            here = await _deltas(first, ChatRequest(messages=history, tools=_WEATHER,
                                                    thread_id="t"))
        finally:
            await first.aclose()
            await other.aclose()
    assert _echo(elsewhere) == _echo(here) == 'echo: {"t":21}'
    assert "thinking" not in server.requests[1]  # (thinking is only checked when on)
    assert server.requests[2]["thinking"] == _THINKING  # the worker that holds it sends it
    assert server.requests[2]["messages"][1]["content"][0]["type"] == "thinking"


async def test_anthropic_tool_loop_keeps_thinking_through_its_later_rounds() -> None:
    """A tool loop is one assistant turn: only its first assistant message starts with the
    signed thinking, later rounds carry none. Thinking was turned off from the second round
    on, as if the first round's thinking were unknown."""
    from copilot_runtime.testing import MockAnthropicServer

    async with asyncio.timeout(TIMEOUT_S), MockAnthropicServer(chunks=3) as server:
        adapter = AnthropicAdapter(api_key="k", base_url=server.base_url, max_retries=0,
                                   thinking=_THINKING)
        try:
            asked = await _deltas(adapter, ChatRequest(messages=[UserMessage(
                id="u", content='think: call:getWeather {"city":"Oslo"}')], tools=_WEATHER,
                thread_id="t"))
            (head,) = [d for d in asked if isinstance(d, ToolCallDelta) and d.id]
            assert head.id is not None
            history = [*_answered_call(head.id, 'think: call:getWeather {"city":"Oslo"}'),
                       AssistantMessage(id="a2", tool_calls=[
                           call("c2", "getWeather", '{"city":"Bergen"}')]),
                       ToolMessage(id="t2", tool_call_id="c2", content='{"t":12}')]
            again = await _deltas(adapter, ChatRequest(messages=history, tools=_WEATHER,
                                                       thread_id="t"))
        finally:
            await adapter.aclose()
    assert _echo(again) == 'echo: {"t":12}'
    sent = server.requests[1]
    assert sent["thinking"] == _THINKING
    assert [m["content"][0]["type"] for m in sent["messages"] if m["role"] == "assistant"] \
        == ["thinking", "tool_use"]


def test_anthropic_adaptive_thinking_stays_with_a_forced_tool_choice() -> None:
    """The API refuses a forced tool choice with manual thinking only; adaptive takes it."""
    adapter = AnthropicAdapter(api_key="k", thinking={"type": "adaptive"})
    params = adapter.build_params(ChatRequest(messages=[UserMessage(id="u", content="hi")],
                                              tools=_WEATHER, tool_choice="required"))
    assert params["thinking"] == {"type": "adaptive"}


@pytest.mark.parametrize("choice", ["required", "getWeather"])
async def test_anthropic_forced_tool_choice_goes_without_thinking(choice: str) -> None:
    """The API refuses thinking with a tool choice that forces a tool (chat suggestions,
    GraphQL's toolChoice "function", AG-UI's "required"): the forced call is what is needed."""
    from copilot_runtime.testing import MockAnthropicServer

    async with asyncio.timeout(TIMEOUT_S), MockAnthropicServer(chunks=3) as server:
        adapter = AnthropicAdapter(api_key="k", base_url=server.base_url, max_retries=0,
                                   thinking=_THINKING)
        try:
            forced = await _deltas(adapter, ChatRequest(messages=[UserMessage(
                id="u", content='call:getWeather {"city":"Oslo"}')], tools=_WEATHER,
                tool_choice=choice))
        finally:
            await adapter.aclose()
    assert [d.name for d in forced if isinstance(d, ToolCallDelta) and d.id] == ["getWeather"]
    assert "thinking" not in server.requests[0]
    free = adapter.build_params(ChatRequest(messages=[UserMessage(id="u", content="hi")],
                                            tools=_WEATHER, tool_choice="auto"))
    assert free["thinking"] == _THINKING


@pytest.mark.parametrize("transport", ["direct", "sdk"])
async def test_anthropic_run_stopped_during_a_tool_call_keeps_its_thinking(
        transport: Literal["direct", "sdk"]) -> None:
    """The thinking was recorded only once the answer had streamed to its end: a run stopped
    during its tool call lost it, and the thread's next request went without it."""
    from copilot_runtime.testing import MockAnthropicServer

    async with asyncio.timeout(TIMEOUT_S), MockAnthropicServer(chunks=3) as server:
        adapter = AnthropicAdapter(api_key="k", base_url=server.base_url, max_retries=0,
                                   thinking=_THINKING, transport=transport)
        try:
            stream = adapter.stream(ChatRequest(messages=[UserMessage(
                id="u", content='think: call:getWeather {"city":"Oslo"}')], tools=_WEATHER,
                thread_id="t"))
            head = None
            async for batch in stream:
                head = next((d for d in batch if isinstance(d, ToolCallDelta) and d.id), None)
                if head is not None:
                    break  # the run is stopped here, its call's arguments still streaming
            await stream.aclose()  # type: ignore[attr-defined]
            assert head is not None
            assert head.id is not None
            follow = await _deltas(adapter, ChatRequest(
                messages=_answered_call(head.id), tools=_WEATHER, thread_id="t"))
        finally:
            await adapter.aclose()
    assert _echo(follow) == 'echo: {"t":21}'
    assert server.requests[1]["thinking"] == _THINKING
    replayed = server.requests[1]["messages"][1]["content"][0]
    assert replayed["type"] == "thinking"
    assert replayed["signature"]


@pytest.mark.parametrize("transport", ["direct", "sdk"])
async def test_gemini_call_whose_signature_another_worker_holds_goes_with_the_stand_in(
        transport: Literal["direct", "sdk"]) -> None:
    """Gemini 3 refuses a replayed call without its thought signature, which only the adapter
    that streamed the call held: another worker now sends Google's documented stand-in."""
    async with asyncio.timeout(TIMEOUT_S), MockGeminiServer(sign_calls=True) as server:
        first, other = (GoogleGenAIAdapter(api_key="k", base_url=server.base_url,
                                           max_retries=0, transport=transport)
                        for _ in range(2))
        try:
            asked = await _deltas(first, ChatRequest(messages=[UserMessage(
                id="u", content='call:getWeather {"city":"Oslo"}')], tools=_WEATHER, thread_id="t"))
            (head,) = [d for d in asked if isinstance(d, ToolCallDelta)]
            assert head.id is not None
            follow = await _deltas(other, ChatRequest(messages=_answered_call(head.id),
                                                      tools=_WEATHER, thread_id="t"))
        finally:
            await first.aclose()
            await other.aclose()
    assert _echo(follow) == 'echo: {"t":21}'
    replayed = server.requests[1]["contents"][1]["parts"][0]
    assert replayed["thoughtSignature"] == "skip_thought_signature_validator"


def test_gemini_stand_in_goes_only_on_an_answers_first_unsigned_call() -> None:
    history = [UserMessage(id="u", content="x"),
               AssistantMessage(id="a", tool_calls=[call("c1"), call("c2")]),
               ToolMessage(id="t1", tool_call_id="c1", content="1"),
               ToolMessage(id="t2", tool_call_id="c2", content="2"),
               AssistantMessage(id="b", tool_calls=[call("c3")]),
               ToolMessage(id="t3", tool_call_id="c3", content="3")]
    _, contents = to_gemini_contents(history, {"c3": b"own"})
    first, second = contents[1]["parts"]
    assert first["thought_signature"] == base64.urlsafe_b64decode(
        "skip_thought_signature_validator")
    assert "thought_signature" not in second
    assert contents[3]["parts"][0]["thought_signature"] == b"own"


# ---- histories the APIs refuse as they are ---------------------------------------------------


@pytest.mark.parametrize("history", [[], [SystemMessage(id="s", content="Greet the user.")]],
                         ids=["empty", "system-only"])
@pytest.mark.parametrize("provider", ["anthropic", "gemini"])
async def test_a_run_without_user_messages_gets_an_answer(provider: str,
                                                         history: list[Any]) -> None:
    """`runAgent()` with no messages (or only a system one) is answered by OpenAI from the
    system prompt; Anthropic ("at least one message is required") and Gemini ("contents is
    not specified") refused it: they now get a minimal user turn."""
    from copilot_runtime.testing import MockAnthropicServer

    server: Any = MockAnthropicServer(chunks=3) if provider == "anthropic" else \
        MockGeminiServer(chunks=3)
    async with asyncio.timeout(TIMEOUT_S), server:
        adapter: Any = AnthropicAdapter(api_key="k", base_url=server.base_url, max_retries=0) \
            if provider == "anthropic" else GoogleGenAIAdapter(
                api_key="k", base_url=server.base_url, max_retries=0)
        try:
            answer = await _deltas(adapter, ChatRequest(messages=history))
        finally:
            await adapter.aclose()
    assert _echo(answer) == "echo: Begin."
    assert isinstance(answer[-1], StreamEnd)


@pytest.mark.parametrize("content", [
    "\n", [TextPart(text=" "), ImagePart(source=DataSource(value="aGk=", mime_type="image/png"))]],
    ids=["blank", "blank-beside-an-image"])
async def test_anthropic_blank_user_text_is_left_out(content: Any) -> None:
    """The API refuses text blocks of whitespace only: one in a user turn failed that run and,
    kept in the history, every later run of the thread."""
    from copilot_runtime.testing import MockAnthropicServer

    async with asyncio.timeout(TIMEOUT_S), MockAnthropicServer(chunks=3) as server:
        adapter = AnthropicAdapter(api_key="k", base_url=server.base_url, max_retries=0)
        try:
            answer = await _deltas(adapter, ChatRequest(messages=[
                UserMessage(id="u", content=content),
                AssistantMessage(id="a", content="Hello."),
                UserMessage(id="u2", content="again")]))
        finally:
            await adapter.aclose()
    assert _echo(answer) == "echo: again"
    sent = server.requests[0]["messages"]
    assert not [b for m in sent for b in m["content"]
                if b["type"] == "text" and b["text"].isspace()]
