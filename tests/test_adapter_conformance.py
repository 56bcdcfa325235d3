"""One behaviour for every LLM adapter: the same tests, run against each provider's real SDK
talking to the loopback mock of that provider's wire format.

openai: `OpenAIAdapter` on `MockOpenAIServer`; anthropic: `AnthropicAdapter` on
`MockAnthropicServer`; google: `GoogleGenAIAdapter` on `MockGeminiServer`; each also as
NAME-sdk, sending through the provider's SDK instead of the adapter's own HTTP client;
langchain: `LangChainAdapter(ChatOpenAI(...))` (langchain-openai) on `MockOpenAIServer`.

Each case: plain text with usage, one and two tool calls, the server-side tool loop and a
frontend tool through the runtime, the `forwardedProps` model settings (mapped into the
provider's request, or refused with a clear error), an image in the user's message, and the
upstream failures (401, 429, 5xx, a cut stream, a timeout, a refused connection), which must
be the same `UpstreamError`s, with the same message shape, as OpenAI's.
"""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from ag_ui.core import (
    AssistantMessage,
    DataSource,
    FunctionCall,
    ImagePart,
    TextPart,
    ToolCall,
    ToolMessage,
    UserMessage,
)

from copilot_runtime import CopilotRuntime, UpstreamError, UpstreamTimeoutError
from copilot_runtime._exceptions import UpstreamConnectionError
from copilot_runtime.adapters import (
    ChatRequest,
    ServiceAdapter,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
)
from copilot_runtime.testing import MockAnthropicServer, MockGeminiServer, MockOpenAIServer
from tests.conftest import ServeRuntime, run_input, text_of, types
from tests.realclient_app import getWeather

TIMEOUT_S = 30
WEATHER_TOOL = ToolSpec("getWeather", "Get the weather", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n-not-really-an-image").decode()


@dataclass
class Harness:
    name: str
    server: Any
    make: Callable[..., ServiceAdapter]
    #: The model settings as the provider's recorded request body carries them.
    settings: Callable[[Any], dict[str, Any]]
    #: The base64 data of the first image in the recorded request, if any.
    image: Callable[[Any], str | None]


def _openai_settings(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": body.get("model"), "temperature": body.get("temperature"),
            "max_tokens": body.get("max_tokens") or body.get("max_completion_tokens"),
            "stop": body.get("stop"),
            "tool": ((body.get("tool_choice") or {}).get("function") or {}).get("name")}


def _openai_image(body: dict[str, Any]) -> str | None:
    for part in body["messages"][-1]["content"]:
        if isinstance(part, dict) and part.get("type") == "image_url":
            return str(part["image_url"]["url"]).split("base64,")[-1]
    return None


def _anthropic_settings(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": body.get("model"), "temperature": body.get("temperature"),
            "max_tokens": body.get("max_tokens"), "stop": body.get("stop_sequences"),
            "tool": (body.get("tool_choice") or {}).get("name")}


def _anthropic_image(body: dict[str, Any]) -> str | None:
    for block in body["messages"][-1]["content"]:
        if block.get("type") == "image":
            return str(block["source"]["data"])
    return None


def _gemini_settings(server: MockGeminiServer) -> dict[str, Any]:
    body, path = server.requests[-1], server.paths[-1]
    generation = body.get("generationConfig") or {}
    names = (((body.get("toolConfig") or {}).get("functionCallingConfig") or {})
             .get("allowedFunctionNames") or [None])
    return {"model": path.split("/models/")[1].split(":")[0],
            "temperature": generation.get("temperature"),
            "max_tokens": generation.get("maxOutputTokens"),
            "stop": generation.get("stopSequences"), "tool": names[0]}


def _gemini_image(server: MockGeminiServer) -> str | None:
    for part in server.requests[-1]["contents"][-1]["parts"]:
        if "inlineData" in part:
            return str(part["inlineData"]["data"])
    return None


@pytest.fixture(params=["openai", "openai-sdk", "anthropic", "anthropic-sdk", "google",
                        "google-sdk", "langchain"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    name: str = request.param
    if name in ("anthropic", "anthropic-sdk"):
        from copilot_runtime import AnthropicAdapter

        anthropic_route = "sdk" if name == "anthropic-sdk" else "direct"
        async with MockAnthropicServer(chunks=4) as server:
            yield Harness(name, server, lambda timeout=10.0, base_url=None: AnthropicAdapter(
                api_key="sk-mock", base_url=base_url or server.base_url, max_retries=0,
                timeout=timeout, transport=anthropic_route),
                lambda s: _anthropic_settings(s.requests[-1]),
                lambda s: _anthropic_image(s.requests[-1]))
    elif name in ("google", "google-sdk"):
        from copilot_runtime import GoogleGenAIAdapter

        gemini_route = "sdk" if name == "google-sdk" else "direct"
        async with MockGeminiServer(chunks=4) as server:
            yield Harness(name, server, lambda timeout=10.0, base_url=None: GoogleGenAIAdapter(
                api_key="mock-key", base_url=base_url or server.base_url, max_retries=0,
                timeout=timeout, transport=gemini_route), _gemini_settings, _gemini_image)
    elif name == "langchain":
        from langchain_openai import ChatOpenAI

        from copilot_runtime import LangChainAdapter

        # Each model gets its own HTTP client: langchain-openai's default one is cached per
        # (base URL, timeout) for the whole process, so closing it would break a later test
        # whose mock happens to reuse this one's port.
        clients: list[httpx.AsyncClient] = []

        def chat_model(timeout: float = 10.0, base_url: str | None = None) -> LangChainAdapter:
            client = httpx.AsyncClient()
            clients.append(client)
            model = ChatOpenAI(model="gpt-4o", api_key="sk-mock",  # type: ignore[arg-type]
                               base_url=base_url or server.base_url, max_retries=0,
                               timeout=timeout, stream_usage=True, http_async_client=client)
            return LangChainAdapter(model)

        async with MockOpenAIServer(chunks=4) as server:
            yield Harness(name, server, chat_model,
                          lambda s: _openai_settings(s.requests[-1]),
                          lambda s: _openai_image(s.requests[-1]))
            # The application owns its model's clients (the adapter leaves them open).
            for client in clients:
                await client.aclose()
    else:
        from copilot_runtime import OpenAIAdapter

        route = "sdk" if name == "openai-sdk" else "direct"
        async with MockOpenAIServer(chunks=4) as server:
            yield Harness(name, server, lambda timeout=10.0, base_url=None: OpenAIAdapter(
                api_key="sk-mock", base_url=base_url or server.base_url, max_retries=0,
                timeout=timeout, transport=route), lambda s: _openai_settings(s.requests[-1]),
                lambda s: _openai_image(s.requests[-1]))


async def collect(adapter: ServiceAdapter, request: ChatRequest) -> list[Any]:
    async with asyncio.timeout(TIMEOUT_S):
        return [d async for batch in adapter.stream(request) for d in batch]


async def answer(harness: Harness, request: ChatRequest, **options: Any) -> list[Any]:
    adapter = harness.make(**options)
    try:
        return await collect(adapter, request)
    finally:
        await adapter.aclose()


def user(text: str) -> UserMessage:
    return UserMessage(id="u1", content=text)


def merged_calls(deltas: list[Any]) -> list[tuple[str, str, Any]]:
    calls: dict[int, list[Any]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            entry = calls.setdefault(d.call_index, [None, None, ""])
            entry[0] = entry[0] or d.id
            entry[1] = entry[1] or d.name
            entry[2] += d.arguments
    return [(i, n, orjson.loads(a)) for i, n, a in calls.values()]


# ---- the model's answer ----------------------------------------------------------------------


async def test_text_and_usage(harness: Harness) -> None:
    deltas = await answer(harness, ChatRequest(messages=[user("hello there")]))
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "echo: hello there"
    end = deltas[-1]
    assert isinstance(end, StreamEnd)
    assert end.finish_reason == "stop"
    assert end.usage is not None
    assert end.usage["prompt_tokens"] > 0
    assert end.usage["completion_tokens"] > 0
    assert end.usage["total_tokens"] == end.usage["prompt_tokens"] + end.usage[
        "completion_tokens"]


async def test_one_tool_call(harness: Harness) -> None:
    deltas = await answer(harness, ChatRequest(
        messages=[user('call:getWeather {"city":"Paris"}')], tools=[WEATHER_TOOL]))
    ((call_id, name, args),) = merged_calls(deltas)
    assert call_id
    assert (name, args) == ("getWeather", {"city": "Paris"})
    assert isinstance(deltas[-1], StreamEnd)
    assert deltas[-1].finish_reason == "tool_calls"


async def test_two_tool_calls_in_one_answer(harness: Harness) -> None:
    deltas = await answer(harness, ChatRequest(
        messages=[user('call:getWeather {"city":"Paris"}\ncall:getWeather {"city":"Rome"}')],
        tools=[WEATHER_TOOL]))
    calls = merged_calls(deltas)
    assert [args for _, _, args in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({call_id for call_id, _, _ in calls}) == 2


async def test_image_reaches_the_model(harness: Harness) -> None:
    message = UserMessage(id="u1", content=[
        TextPart(text="what is this?"),
        ImagePart(source=DataSource(value=PNG, mime_type="image/png"))])
    deltas = await answer(harness, ChatRequest(messages=[message]))
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "echo: what is this?"
    assert harness.image(harness.server) == PNG


async def test_repaired_history_is_accepted(harness: Harness) -> None:
    # A call whose result the client lost, arguments that are not an object, a result
    # without its call: what the TypeScript runtime's users report the providers refusing.
    history = [
        user("first"),
        AssistantMessage(id="a1", tool_calls=[ToolCall(id="call_lost", function=FunctionCall(
            name="getWeather", arguments="[1, 2]"))]),
        ToolMessage(id="t0", tool_call_id="call_unknown", content="stray"),
        UserMessage(id="u2", content="second"),
    ]
    deltas = await answer(harness, ChatRequest(messages=history, tools=[WEATHER_TOOL]))
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)).startswith("echo: ")
    assert isinstance(deltas[-1], StreamEnd)
    # Accepted at once: every mock refuses a history its provider would refuse.
    assert len(harness.server.requests) == 1



async def test_a_history_of_deep_json_text_is_sent(harness: Harness) -> None:
    """Tool-call arguments and a tool result of JSON text nested 300 levels (a request's
    bound does not look inside strings): the Anthropic and Gemini adapters decoded them
    into objects no request body could carry, and every later run of the thread ended
    AGENT_ERROR before a request was sent. Too deep to decode, they go as their text."""
    deep = '{"a":' * 300 + "1" + "}" * 300
    history = [
        user("first"),
        AssistantMessage(id="a1", tool_calls=[ToolCall(id="call_1", function=FunctionCall(
            name="getWeather", arguments=deep))]),
        ToolMessage(id="t1", tool_call_id="call_1", content=deep),
        UserMessage(id="u2", content="second"),
    ]
    deltas = await answer(harness, ChatRequest(messages=history, tools=[WEATHER_TOOL]))
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)).startswith("echo: ")
    assert isinstance(deltas[-1], StreamEnd)
    assert len(harness.server.requests) == 1

# ---- through the runtime ---------------------------------------------------------------------


async def test_server_tool_loop(harness: Harness, serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(service_adapter=harness.make(), actions=[getWeather])
    async with asyncio.timeout(TIMEOUT_S), serve_runtime(runtime) as served:
        events = await served.run(run_input('call:getWeather {"city":"Paris"}'))
    kinds = types(events)
    assert kinds[-1] == "RUN_FINISHED", events
    result = events[kinds.index("TOOL_CALL_RESULT")]
    assert orjson.loads(result["content"])["city"] == "Paris"
    assert text_of(events) == "echo: " + result["content"]


async def test_frontend_tool_then_follow_up(harness: Harness,
                                            serve_runtime: ServeRuntime) -> None:
    tool = {"name": "sayHello", "description": "Greets",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}
    runtime = CopilotRuntime(service_adapter=harness.make())
    async with asyncio.timeout(TIMEOUT_S), serve_runtime(runtime) as served:
        first = await served.run(run_input('call:sayHello {"name":"Ada"}', tools=[tool]))
        kinds = types(first)
        assert kinds[-1] == "RUN_FINISHED", first
        assert "TOOL_CALL_RESULT" not in kinds
        start = first[kinds.index("TOOL_CALL_START")]
        args = "".join(e["delta"] for e in first if e["type"] == "TOOL_CALL_ARGS")
        assert orjson.loads(args) == {"name": "Ada"}
        body = run_input("", run="run-2", tools=[tool])
        body["messages"] = [
            {"id": "u", "role": "user", "content": 'call:sayHello {"name":"Ada"}'},
            {"id": "a", "role": "assistant", "toolCalls": [{
                "id": start["toolCallId"], "type": "function",
                "function": {"name": "sayHello", "arguments": args}}]},
            {"id": "t", "role": "tool", "toolCallId": start["toolCallId"],
             "content": '{"greeting":"Hello, Ada!"}'}]
        second = await served.run(body)
    assert types(second)[-1] == "RUN_FINISHED", second
    assert text_of(second) == 'echo: {"greeting":"Hello, Ada!"}'


def _tool_names(body: dict[str, Any]) -> list[str]:
    """The names of the tools a recorded request offered, in any provider's shape."""
    names: list[str] = []
    for tool in body.get("tools") or ():
        if "function" in tool:
            names.append(tool["function"]["name"])
        elif "functionDeclarations" in tool:
            names += [declaration["name"] for declaration in tool["functionDeclarations"]]
        else:
            names.append(tool["name"])
    return names


async def test_a_frontend_tool_sent_twice_is_offered_once(
        harness: Harness, serve_runtime: ServeRuntime) -> None:
    """A page that registers a tool twice (a component mounted twice) sends its name twice:
    Anthropic refuses a request naming a tool twice ("Tool names must be unique"), so every
    run of such a page failed; the last definition is the one offered, as the client's own
    registry keeps it."""
    tool = {"name": "sayHello", "description": "Greets",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}
    again = {**tool, "description": "Greets warmly"}
    runtime = CopilotRuntime(service_adapter=harness.make(), actions=[getWeather])
    async with asyncio.timeout(TIMEOUT_S), serve_runtime(runtime) as served:
        events = await served.run(run_input('call:sayHello {"name":"Ada"}',
                                            tools=[tool, again]))
    assert types(events)[-1] == "RUN_FINISHED", events
    assert sorted(_tool_names(harness.server.requests[-1])) == ["getWeather", "sayHello"]


def _tool_schemas(body: dict[str, Any]) -> dict[str, Any]:
    """Each offered tool's parameters, in any provider's shape, by name."""
    schemas: dict[str, Any] = {}
    for tool in body.get("tools") or ():
        if "function" in tool:
            schemas[tool["function"]["name"]] = tool["function"].get("parameters")
        elif "functionDeclarations" in tool:
            schemas.update({d["name"]: d.get("parameters") for d in tool["functionDeclarations"]})
        else:
            schemas[tool["name"]] = tool.get("input_schema")
    return schemas


#: Tool schemas MCP servers publish that providers refuse at the top: Anthropic any
#: combinator, OpenAI those, a missing type, `enum`, `const` and `not`.
HOSTILE_TOOLS = [
    {"name": "attach", "description": "Attach a file", "parameters": {
        "type": "object", "anyOf": [
            {"properties": {"content": {"type": "string"}}, "required": ["content"]},
            {"properties": {"source_url": {"type": "string"}}, "required": ["source_url"]}]}},
    {"name": "analyze", "description": "Analyze an image", "parameters": {
        "type": "object", "required": ["prompt"],
        "properties": {"prompt": {"type": "string"}, "imageUrl": {"type": "string"}},
        "oneOf": [{"required": ["imageUrl"]}, {"required": ["imageBase64"]}]}},
    {"name": "merged", "description": "allOf", "parameters": {"allOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"properties": {"b": {"type": "integer"}}, "not": {"required": ["c"]}}]}},
    {"name": "loose", "description": "No type", "parameters": {
        "properties": {"x": {"type": "string"}}}},
    # (pydantic's discriminated union: `$ref`s into `$defs`)
    {"name": "send", "description": "oneOf of $refs", "parameters": {
        "$defs": {"Email": {"type": "object", "required": ["kind", "to"], "properties": {
            "kind": {"const": "email", "type": "string"}, "to": {"type": "string"}}},
                  "Sms": {"type": "object", "required": ["kind", "phone"], "properties": {
            "kind": {"const": "sms", "type": "string"}, "phone": {"type": "string"}}}},
        "oneOf": [{"$ref": "#/$defs/Email"}, {"$ref": "#/$defs/Sms"}],
        "discriminator": {"propertyName": "kind", "mapping": {
            "email": "#/$defs/Email", "sms": "#/$defs/Sms"}}}},
    # (zod-to-json-schema's named schema)
    {"name": "named", "description": "a $ref at the top", "parameters": {
        "$ref": "#/definitions/Args", "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"Args": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}}},
    # (zod-to-json-schema's `$refStrategy: "root"`: a reused schema is a path to its first use)
    {"name": "reuse", "description": "a $ref into an anyOf member", "parameters": {"anyOf": [
        {"type": "object", "properties": {"home": {
            "type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "object", "properties": {"work": {"$ref": "#/anyOf/0/properties/home"}}}]}},
]


def _ref_target(schema: dict[str, Any], ref: str) -> Any:
    """What a local `$ref` names in `schema`, None if nothing."""
    node: Any = schema
    for token in ref.split("/")[1:]:
        node = node.get(token) if isinstance(node, dict) else None
    return node


async def test_tool_schemas_providers_refuse_at_the_top_are_offered_as_objects(
        harness: Harness, serve_runtime: ServeRuntime) -> None:
    """One tool whose schema has a combinator at the top (Notion's MCP tools do) or no
    `type` made the provider refuse every request offering it: every run failed. Each is
    offered as one object schema accepting what it accepted, and the mocks refuse the
    rest as the real APIs do."""
    runtime = CopilotRuntime(service_adapter=harness.make())
    async with asyncio.timeout(TIMEOUT_S), serve_runtime(runtime) as served:
        events = await served.run(run_input('call:attach {"source_url":"https://x.test/a"}',
                                            tools=HOSTILE_TOOLS))
    assert types(events)[-1] == "RUN_FINISHED", events
    args = "".join(e["delta"] for e in events if e["type"] == "TOOL_CALL_ARGS")
    assert orjson.loads(args) == {"source_url": "https://x.test/a"}
    schemas = _tool_schemas(harness.server.requests[-1])
    for name in ("attach", "analyze", "merged", "loose", "send", "named", "reuse"):
        top = schemas[name]
        assert str(top["type"]).lower() == "object", (name, top)
        assert not {"anyOf", "oneOf", "allOf", "not", "$ref"} & top.keys(), (name, top)
    assert set(schemas["attach"]["properties"]) == {"content", "source_url"}
    assert "required" not in schemas["attach"]  # (neither is required by both)
    assert set(schemas["merged"]["properties"]) == {"a", "b"}
    assert schemas["merged"]["required"] == ["a"]
    assert schemas["analyze"]["required"] == ["prompt"]
    # (each member's properties, behind its `$ref`; the top-level `$ref` followed)
    assert set(schemas["send"]["properties"]) == {"kind", "to", "phone"}
    assert schemas["send"]["required"] == ["kind"]
    assert set(schemas["named"]["properties"]) == {"city"}
    assert schemas["named"]["required"] == ["city"]
    # (a `$ref` into the flattened `anyOf` dangled: the real APIs refuse such a schema)
    work = schemas["reuse"]["properties"]["work"]
    work = _ref_target(schemas["reuse"], work["$ref"]) if "$ref" in work else work
    assert isinstance(work, dict), schemas["reuse"]
    assert set(work.get("properties") or ()) == {"city"}, schemas["reuse"]


async def test_the_runtimes_own_settings_never_fail_a_request(harness: Harness) -> None:
    """A guardrail judge's temperature and token bound (`runtime_settings`) are fitted to the
    model or left out: refused, every judgement failed and every message was refused."""
    deltas = await answer(harness, ChatRequest(messages=[user("hello")], temperature=0,
                                               max_tokens=100, runtime_settings=True))
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "echo: hello"
    if harness.name == "langchain":
        # The chat model's own settings apply: a bound forced on it could break a reasoning
        # model (no temperature 0, thinking eating the tokens).
        assert {k: v for k, v in harness.settings(harness.server).items() if v is not None} \
            == {"model": "gpt-4o"}


async def test_forwarded_model_settings_mapped_or_refused(
        harness: Harness, serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(service_adapter=harness.make(), actions=[getWeather])
    props = {"model": "model-x", "temperature": 0.5, "maxTokens": 77, "stop": ["END"],
             "toolChoice": "getWeather"}
    async with asyncio.timeout(TIMEOUT_S), serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", forwardedProps=props))
        if harness.name == "langchain":
            # LangChain cannot switch model, temperature or limit per request: refused clearly
            assert types(events)[-1] == "RUN_ERROR", events
            assert events[-1]["code"] == "INVALID_REQUEST"
            assert "cannot change model, temperature, maxTokens" in events[-1]["message"]
            events = await served.run(run_input("hello", run="run-2", forwardedProps={
                "stop": ["END"], "toolChoice": "getWeather"}))
            assert types(events)[-1] == "RUN_FINISHED", events
            assert harness.settings(harness.server)["stop"] == ["END"]
            assert harness.settings(harness.server)["tool"] == "getWeather"
            return
    assert types(events)[-1] == "RUN_FINISHED", events
    assert harness.settings(harness.server) == {
        "model": "model-x", "temperature": 0.5, "max_tokens": 77, "stop": ["END"],
        "tool": "getWeather"}


#: How each provider's request says "call one of the tools, any" (a `toolConfig` for Gemini).
_ANY_TOOL = {"openai": "required", "anthropic": {"type": "any"},
             "google": {"functionCallingConfig": {"mode": "ANY"}}}


@pytest.mark.parametrize("choice", ["any", "required"])
async def test_tool_choice_any_makes_the_model_call_some_tool(
        harness: Harness, serve_runtime: ServeRuntime, choice: str) -> None:
    """LangChain's "any" and OpenAI's "required" say the same: some tool must be called
    (never a tool named "any")."""
    runtime = CopilotRuntime(service_adapter=harness.make(), actions=[getWeather])
    async with asyncio.timeout(TIMEOUT_S), serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", forwardedProps={"toolChoice": choice}))
    assert types(events)[-1] == "RUN_FINISHED", events
    body = harness.server.requests[-1]
    provider = harness.name.split("-")[0].replace("langchain", "openai")
    sent = body.get("toolConfig") if provider == "google" else body.get("tool_choice")
    assert sent == _ANY_TOOL[provider]


# ---- failures --------------------------------------------------------------------------------

_PROVIDER_WORDS = {"openai": "OpenAI", "openai-sdk": "OpenAI", "anthropic": "Anthropic",
                   "anthropic-sdk": "Anthropic",
                   "google": "Gemini", "google-sdk": "Gemini", "langchain": "LangChain model"}


@pytest.mark.parametrize("status", [401, 429, 500, 503])
async def test_http_failures(harness: Harness, status: int) -> None:
    with pytest.raises(UpstreamError) as info:
        await answer(harness, ChatRequest(messages=[user(f"error:{status}")]))
    assert type(info.value) is UpstreamError
    assert info.value.status == status
    assert info.value.code == "UPSTREAM_ERROR"
    assert re.fullmatch(rf"{_PROVIDER_WORDS[harness.name]} request failed with HTTP "
                        rf"{status}: mock error {status}", info.value.message), info.value.message


async def test_failure_is_a_run_error(harness: Harness, serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(service_adapter=harness.make())
    async with asyncio.timeout(TIMEOUT_S), serve_runtime(runtime) as served:
        events = await served.run(run_input("error:429"))
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"], events
    assert events[-1]["code"] == "UPSTREAM_ERROR"
    assert "HTTP 429" in events[-1]["message"]


async def test_cut_stream(harness: Harness) -> None:
    with pytest.raises(UpstreamError) as info:
        await answer(harness, ChatRequest(messages=[user("breaks:2 a long enough answer")]))
    if harness.name != "langchain":  # a LangChain model's own errors are all it reports
        assert type(info.value) is UpstreamConnectionError
    assert info.value.status is None


async def test_timeout(harness: Harness) -> None:
    with pytest.raises(UpstreamTimeoutError) as info:
        await answer(harness, ChatRequest(messages=[user("slow:3000 too slow")]), timeout=0.5)
    assert info.value.code == "UPSTREAM_TIMEOUT"


async def test_refused_connection(harness: Harness) -> None:
    from tests.conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    if harness.name in ("openai", "openai-sdk", "langchain"):
        dead += "/v1"
    with pytest.raises(UpstreamError) as info:
        await answer(harness, ChatRequest(messages=[user("hello")]), base_url=dead)
    if harness.name != "langchain":
        assert type(info.value) is UpstreamConnectionError
