"""What each provider's request carries of a history the built-in agent cannot send as it is:
one with no conversation turn left (only UI state, or a user message of no parts), and a
tool result with attachments. Each case is run over AG-UI against the provider's mock, and
the request the mock received is checked.

Before: Chat Completions (OpenAIAdapter, and LangChain's ChatOpenAI) was sent an empty
`messages` array or a user message of `content: []`, both refused by the real API with a
400; and a tool result's image was dropped on every provider without a word."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from copilot_runtime import (
    AnthropicAdapter,
    CopilotRuntime,
    GoogleGenAIAdapter,
    LangChainAdapter,
    OpenAIAdapter,
)
from copilot_runtime.testing import MockAnthropicServer, MockGeminiServer, MockOpenAIServer
from tests.conftest import ServeRuntime, run_input, text_of, types

pytestmark = pytest.mark.timeout(30)

PROVIDERS = ["openai", "langchain", "anthropic", "gemini"]
PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJ"
       "RU5ErkJggg==")
IMAGE = {"type": "image", "source": {"type": "data", "value": PNG, "mimeType": "image/png"}}


@contextlib.asynccontextmanager
async def provider_runtime(provider: str) -> AsyncIterator[tuple[CopilotRuntime,
                                                                 list[dict[str, Any]]]]:
    """A runtime on `provider`'s mock (LangChain: ChatOpenAI on the OpenAI mock), with the
    list of the requests the mock is sent."""
    mock: MockOpenAIServer | MockAnthropicServer | MockGeminiServer
    async with contextlib.AsyncExitStack() as stack:
        adapter: Any
        if provider == "anthropic":
            mock = await stack.enter_async_context(MockAnthropicServer(chunks=1))
            adapter = AnthropicAdapter(base_url=mock.base_url, api_key="k", max_retries=0)
        elif provider == "gemini":
            mock = await stack.enter_async_context(MockGeminiServer(chunks=1))
            adapter = GoogleGenAIAdapter(base_url=mock.base_url, api_key="k", max_retries=0)
        else:
            mock = await stack.enter_async_context(MockOpenAIServer(chunks=1))
            adapter = OpenAIAdapter(base_url=mock.base_url, api_key="k", max_retries=0)
            if provider == "langchain":
                from langchain_openai import ChatOpenAI

                # (its own client: langchain-openai caches a default one per base URL)
                client = await stack.enter_async_context(httpx.AsyncClient())
                adapter = LangChainAdapter(ChatOpenAI(
                    model="gpt-4o", api_key="k",  # type: ignore[arg-type]
                    base_url=mock.base_url, max_retries=0, http_async_client=client))
        yield CopilotRuntime(service_adapter=adapter), mock.requests


def history(thread: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = run_input("", thread=thread)
    body["messages"] = messages
    return body


def turns(provider: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's conversation, each turn as `{"role", "content"}` (Gemini's parts as
    the content), system messages left out."""
    if provider == "gemini":
        return [{"role": c["role"], "content": c["parts"]} for c in request["contents"]]
    return [{"role": m["role"], "content": m.get("content"),
             **({"tool_call_id": m["tool_call_id"]} if "tool_call_id" in m else {})}
            for m in request["messages"] if m["role"] != "system"]


def opening_turn(provider: str) -> dict[str, Any]:
    if provider == "anthropic":
        return {"role": "user", "content": [{"type": "text", "text": "Begin."}]}
    if provider == "gemini":
        return {"role": "user", "content": [{"text": "Begin."}]}
    return {"role": "user", "content": "Begin."}


# ---- a history of no turn -----------------------------------------------------------------------


NO_TURN: dict[str, list[dict[str, Any]]] = {
    "reasoning-only": [{"id": "r1", "role": "reasoning", "content": "thinking",
                        "encryptedValue": "enc"}],
    "activity-only": [{"id": "x1", "role": "activity", "activityType": "progress",
                       "content": {"pct": 1}}],
    "user-of-no-parts": [{"id": "u1", "role": "user", "content": []}],
    "system-and-user-of-no-parts": [{"id": "s1", "role": "system", "content": "Be brief."},
                                    {"id": "u1", "role": "user", "content": []}],
}


@pytest.mark.parametrize("case", list(NO_TURN))
@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_history_of_no_turn_gets_the_opening_turn(
        serve_runtime: ServeRuntime, provider: str, case: str) -> None:
    async with provider_runtime(provider) as (runtime, requests), \
            serve_runtime(runtime) as served:
        events = await served.run(history(f"t-{provider}-{case}", NO_TURN[case]))
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert turns(provider, requests[-1]) == [opening_turn(provider)]
    assert text_of(events) == "echo: Begin."


@pytest.mark.parametrize("provider", ["openai", "langchain"])
async def test_a_user_message_of_no_parts_is_left_out(
        serve_runtime: ServeRuntime, provider: str) -> None:
    async with provider_runtime(provider) as (runtime, requests), \
            serve_runtime(runtime) as served:
        events = await served.run(history(f"t-{provider}-no-parts", [
            {"id": "u1", "role": "user", "content": "hello"},
            {"id": "u2", "role": "user", "content": []}]))
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert turns(provider, requests[-1]) == [{"role": "user", "content": "hello"}]


# ---- a tool result's attachments ----------------------------------------------------------------


def calls(*call_ids: str) -> dict[str, Any]:
    return {"id": "a1", "role": "assistant", "toolCalls": [
        {"id": call_id, "type": "function",
         "function": {"name": "screenshot", "arguments": "{}"}} for call_id in call_ids]}


def result(call_id: str, *parts: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"t-{call_id}", "role": "tool", "toolCallId": call_id, "content": [
        {"type": "text", "text": f"shot {call_id}"}, *parts]}


ASKED = {"id": "u1", "role": "user", "content": "take screenshots"}
FOLLOW_UP = {"id": "u2", "role": "user", "content": "what is on them?"}


def sent_tool_turns(provider: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    """The turns after the assistant's tool calls."""
    sent = turns(provider, request)
    return sent[2:]


async def test_a_tool_results_image_goes_in_a_user_turn_after_the_results_on_openai(
        serve_runtime: ServeRuntime) -> None:
    """Chat Completions' tool messages take text only: the image follows the results of
    the call's answer (the second call's result still right after the first's)."""
    async with provider_runtime("openai") as (runtime, requests), \
            serve_runtime(runtime) as served:
        events = await served.run(history("t-tool-image-openai", [
            ASKED, calls("c1", "c2"), result("c1", IMAGE), result("c2"), FOLLOW_UP]))
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert sent_tool_turns("openai", requests[-1]) == [
        {"role": "tool", "tool_call_id": "c1", "content": "shot c1"},
        {"role": "tool", "tool_call_id": "c2", "content": "shot c2"},
        {"role": "user", "content": [
            {"type": "text", "text": "(Attachments of the result of tool call screenshot "
                                     "(c1):)"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]},
        {"role": "user", "content": "what is on them?"}]


async def test_a_tool_results_image_goes_in_a_user_turn_after_the_results_on_langchain(
        serve_runtime: ServeRuntime) -> None:
    async with provider_runtime("langchain") as (runtime, requests), \
            serve_runtime(runtime) as served:
        events = await served.run(history("t-tool-image-lc", [
            ASKED, calls("c1", "c2"), result("c1", IMAGE), result("c2"), FOLLOW_UP]))
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    sent = sent_tool_turns("langchain", requests[-1])
    assert [(turn["role"], turn.get("tool_call_id")) for turn in sent] == [
        ("tool", "c1"), ("tool", "c2"), ("user", None), ("user", None)]
    assert sent[0]["content"] == "shot c1"
    said, image = sent[2]["content"]
    assert said == {"type": "text",
                    "text": "(Attachments of the result of tool call screenshot (c1):)"}
    assert image["type"] == "image_url"
    assert image["image_url"]["url"] == f"data:image/png;base64,{PNG}"


async def test_a_tool_results_image_goes_in_its_tool_result_on_anthropic(
        serve_runtime: ServeRuntime) -> None:
    """The Messages API takes image blocks in a `tool_result`."""
    async with provider_runtime("anthropic") as (runtime, requests), \
            serve_runtime(runtime) as served:
        events = await served.run(history("t-tool-image-anthropic", [
            ASKED, calls("c1", "c2"), result("c1", IMAGE), result("c2"), FOLLOW_UP]))
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert sent_tool_turns("anthropic", requests[-1]) == [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "c1", "content": [
            {"type": "text", "text": "shot c1"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}}]},
        {"type": "tool_result", "tool_use_id": "c2", "content": "shot c2"},
        {"type": "text", "text": "what is on them?"}]}]


async def test_a_tool_results_image_follows_the_function_responses_on_gemini(
        serve_runtime: ServeRuntime) -> None:
    """Gemini refuses (400 INVALID_ARGUMENT) a turn of function responses holding any other
    part: the image, and the user's next message, were merged into it. Each is a user turn
    of its own after the responses now (the mock refuses the merged shape, as the API does)."""
    async with provider_runtime("gemini") as (runtime, requests), \
            serve_runtime(runtime) as served:
        events = await served.run(history("t-tool-image-gemini", [
            ASKED, calls("c1", "c2"), result("c1", IMAGE), result("c2", IMAGE), FOLLOW_UP]))
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert sent_tool_turns("gemini", requests[-1]) == [
        {"role": "user", "content": [
            {"functionResponse": {"name": "screenshot", "response": {"output": "shot c1"}}},
            {"functionResponse": {"name": "screenshot", "response": {"output": "shot c2"}}}]},
        {"role": "user", "content": [
            {"text": "(Attachments of the result of tool call screenshot (c1):)"},
            {"inlineData": {"data": PNG, "mime_type": "image/png"}},
            {"text": "(Attachments of the result of tool call screenshot (c2):)"},
            {"inlineData": {"data": PNG, "mime_type": "image/png"}},
            {"text": "what is on them?"}]}]


async def test_a_users_message_after_function_responses_is_its_own_turn_on_gemini(
        serve_runtime: ServeRuntime) -> None:
    """Without any attachment too: a user's message after the results was merged into the
    turn of function responses, which Gemini refuses."""
    async with provider_runtime("gemini") as (runtime, requests), \
            serve_runtime(runtime) as served:
        events = await served.run(history("t-tool-text-gemini", [
            ASKED, calls("c1"), result("c1"), FOLLOW_UP]))
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert sent_tool_turns("gemini", requests[-1]) == [
        {"role": "user", "content": [
            {"functionResponse": {"name": "screenshot", "response": {"output": "shot c1"}}}]},
        {"role": "user", "content": [{"text": "what is on them?"}]}]


async def test_the_gemini_mock_refuses_function_responses_beside_other_parts() -> None:
    """So that no test can pass on the shape the API refuses."""
    async with MockGeminiServer() as mock, httpx.AsyncClient() as client:
        response = await client.post(
            f"{mock.base_url}/v1beta/models/gemini-2.5-flash:generateContent",
            headers={"x-goog-api-key": "k"}, json={"contents": [
                {"role": "user", "parts": [{"text": "go"}]},
                {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}}]},
                {"role": "user", "parts": [
                    {"functionResponse": {"name": "f", "response": {"output": "ok"}}},
                    {"text": "and then?"}]}]})
    assert response.status_code == 400
    assert response.json()["error"]["status"] == "INVALID_ARGUMENT"


async def test_a_failed_tool_results_image_follows_its_results_on_anthropic(
        serve_runtime: ServeRuntime) -> None:
    """The Messages API takes only text in a `tool_result` with `is_error` (a 400: "all
    content must be type 'text' if 'is_error' is true"): the image went in it. The failed
    result says its error alone now, and the image follows every result of the message."""
    failed = {"id": "t-c1", "role": "tool", "toolCallId": "c1", "content": [IMAGE],
              "error": "timed out"}
    async with provider_runtime("anthropic") as (runtime, requests), \
            serve_runtime(runtime) as served:
        events = await served.run(history("t-tool-error-anthropic", [
            ASKED, calls("c1", "c2"), failed, result("c2"), FOLLOW_UP]))
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert sent_tool_turns("anthropic", requests[-1]) == [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "c1", "content": "Error: timed out",
         "is_error": True},
        {"type": "tool_result", "tool_use_id": "c2", "content": "shot c2"},
        {"type": "text", "text": "(Attachments of the result of tool call screenshot (c1):)"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": PNG}},
        {"type": "text", "text": "what is on them?"}]}]


async def test_the_anthropic_mock_refuses_media_in_a_failed_tool_result() -> None:
    """So that no test can pass on the shape the API refuses."""
    async with MockAnthropicServer() as mock, httpx.AsyncClient() as client:
        response = await client.post(
            f"{mock.base_url}/v1/messages",
            headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
            json={"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "c1", "name": "f", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "c1", "is_error": True,
                     "content": [{"type": "text", "text": "Error: timed out"},
                                 {"type": "image", "source": {
                                     "type": "base64", "media_type": "image/png",
                                     "data": PNG}}]}]}]})
    assert response.status_code == 400
    assert "all content must be type 'text' if 'is_error' is true" in response.json()[
        "error"]["message"]


@pytest.mark.parametrize(("provider", "said"), [
    ("openai", "OpenAI Chat Completions cannot take the video attachment (video/mp4) given "
               "as inline data: it has no video input"),
    ("anthropic", "The Anthropic Messages API cannot take the audio attachment (audio/wav) "
                  "given as inline data: it has no audio input"),
])
async def test_a_tool_results_attachment_its_provider_cannot_take_fails_the_run(
        serve_runtime: ServeRuntime, provider: str, said: str) -> None:
    """Refused as the same attachment in a user message is, not dropped."""
    kind, mime = ("video", "video/mp4") if provider == "openai" else ("audio", "audio/wav")
    part = {"type": kind, "source": {"type": "data", "value": "AAAA", "mimeType": mime}}
    async with provider_runtime(provider) as (runtime, requests), \
            serve_runtime(runtime) as served:
        events = await served.run(history(f"t-tool-refused-{provider}", [
            ASKED, calls("c1"), result("c1", part), FOLLOW_UP]))
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"]
    assert events[-1]["code"] == "UNSUPPORTED_ATTACHMENT"
    assert events[-1]["message"] == said
    assert requests == []


async def test_the_image_of_a_result_no_call_asked_for_is_quoted_with_it(
        serve_runtime: ServeRuntime) -> None:
    """A result whose call the history lost becomes a user message quoting it: its image
    goes with the quote."""
    async with provider_runtime("openai") as (runtime, requests), \
            serve_runtime(runtime) as served:
        events = await served.run(history("t-tool-orphan", [
            ASKED, result("c9", IMAGE), FOLLOW_UP]))
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert turns("openai", requests[-1])[1] == {"role": "user", "content": [
        {"type": "text", "text": "(Result of tool call c9: shot c9)"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}
