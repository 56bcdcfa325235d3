"""The OpenAI adapter: request building, the stream parser, and upstream failures."""

from __future__ import annotations

import functools
from typing import Any, Literal

import orjson
import pytest
from ag_ui.core import AssistantMessage, FunctionCall, ToolCall, ToolMessage, UserMessage
from aiohttp import web

from copilot_runtime import (
    ConfigurationError,
    OpenAIAdapter,
    UpstreamError,
    UpstreamProtocolError,
)
from copilot_runtime.adapters import (
    ChatRequest,
    ReasoningDelta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
)
from copilot_runtime.adapters import openai as openai_module
from copilot_runtime.adapters.openai import ChatCompletionsStreamParser
from copilot_runtime.testing import MockOpenAIServer

pytestmark = pytest.mark.timeout(30)


def _frame(body: str) -> bytes:
    return f"data: {body}\n\n".encode()


def test_parser_handles_frames_split_anywhere() -> None:
    stream = (
        _frame('{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}')
        + _frame('{"choices":[{"index":0,"delta":{"content":"h\\u00e9llo \\ud83d\\ude00"}}]}')
        + _frame('{"choices":[{"index":0,"delta":{"content":"caf\u00e9 \U0001f600"}}]}')
        + _frame('{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}')
        + _frame('{"choices":[],"usage":{"total_tokens":3}}')
        + b"data: [DONE]\n\n"
    )
    for step in (1, 2, 3, 7, len(stream)):
        parser = ChatCompletionsStreamParser()
        out = []
        for i in range(0, len(stream), step):
            out.extend(parser.feed(stream[i:i + step]))
        assert out == [TextDelta("h\u00e9llo \U0001f600"), TextDelta("caf\u00e9 \U0001f600"),
                       StreamEnd("stop", {"total_tokens": 3})]
        assert parser.done


_ANSWER_WITHOUT_DONE = (
    _frame('{"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"}}]}')
    + _frame('{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'))
_USAGE = _frame('{"choices":[],"usage":{"total_tokens":3}}')


@pytest.mark.parametrize(("stream", "usage"), [
    (_ANSWER_WITHOUT_DONE, None),
    (_ANSWER_WITHOUT_DONE + _USAGE, {"total_tokens": 3}),
    # the last event not ended by a blank line
    (_ANSWER_WITHOUT_DONE + _USAGE[:-1], {"total_tokens": 3}),
])
def test_a_clean_end_after_the_finish_reason_ends_the_answer_without_done(
        stream: bytes, usage: dict[str, int] | None) -> None:
    """Servers that never send `[DONE]` (older TGI, oobabooga, llama-box): their answer
    was an UPSTREAM_PROTOCOL_ERROR though the finish reason had come. (A whole usage chunk
    after it ends the answer at once, see below.)"""
    for step in (1, 5, len(stream)):
        parser = ChatCompletionsStreamParser()
        out = []
        for i in range(0, len(stream), step):
            out.extend(parser.feed(stream[i:i + step]))
        assert parser.finished
        assert parser.done == stream.endswith(_USAGE)
        out.extend(parser.finish())
        assert out == [TextDelta("hi"), StreamEnd("stop", usage)]
        assert parser.done


@pytest.mark.parametrize("split", [1, 7, None])
def test_the_usage_after_the_finish_reason_ends_the_answer(split: int | None) -> None:
    """Servers and proxies that send nothing after the usage chunk and keep the stream
    open: the answer ends with it (what follows, `[DONE]` or nothing, is not needed); without
    `include_usage` it ends with the finish reason."""
    stream = _ANSWER_WITHOUT_DONE + _USAGE + b"data: [DONE]\n\n"
    parser = ChatCompletionsStreamParser()
    out = []
    for i in range(0, len(stream), split or len(stream)):
        out.extend(parser.feed(stream[i:i + (split or len(stream))]))
        if parser.done:
            break
    assert out == [TextDelta("hi"), StreamEnd("stop", {"total_tokens": 3})]
    assert parser.feed(b"data: [DONE]\n\n") == []
    assert parser.finish() == []

    parser = ChatCompletionsStreamParser(expects_usage=False)
    assert parser.feed(_ANSWER_WITHOUT_DONE) == [TextDelta("hi"), StreamEnd("stop", None)]
    assert parser.done


def test_the_finish_reason_alone_waits_for_the_usage() -> None:
    parser = ChatCompletionsStreamParser()
    assert parser.feed(_ANSWER_WITHOUT_DONE) == [TextDelta("hi")]
    assert parser.finished
    assert not parser.done
    # n=2: finished only once every choice has its finish reason
    parser = ChatCompletionsStreamParser(expects_usage=False)
    parser.feed(_frame('{"choices":[{"index":1,"delta":{"content":"x"}}]}')
                + _ANSWER_WITHOUT_DONE)
    assert not parser.finished
    assert parser.feed(_frame('{"choices":[{"index":1,"delta":{},"finish_reason":"stop"}]}')
                       ) == [StreamEnd("stop", None)]


@pytest.mark.parametrize("stream", [
    _frame('{"choices":[{"index":0,"delta":{"content":"hi"}}]}'),  # no finish reason
    _frame('{"choices":[{"index":0,"delta":{"content":"hi"}}]}') + _USAGE,
    _ANSWER_WITHOUT_DONE + _USAGE[:20],  # cut inside the last chunk
    # n=2: the second choice never ended
    _frame('{"choices":[{"index":1,"delta":{"content":"other"}}]}') + _ANSWER_WITHOUT_DONE,
])
def test_an_end_before_every_finish_reason_is_still_cut_short(stream: bytes) -> None:
    parser = ChatCompletionsStreamParser()
    parser.feed(stream)
    with pytest.raises(UpstreamProtocolError, match="ended before the answer was complete"):
        parser.finish()
    assert not parser.done


def test_done_after_the_finish_reason_still_ends_the_answer_once() -> None:
    parser = ChatCompletionsStreamParser()
    out = parser.feed(_frame('{"choices":[{"index":1,"delta":{},"finish_reason":"stop"}]}')
                      + _ANSWER_WITHOUT_DONE + b"data: [DONE]\n\n")
    assert out == [TextDelta("hi"), StreamEnd("stop", None)]
    assert parser.finish() == []


def test_parser_tool_calls_and_comments() -> None:
    parser = ChatCompletionsStreamParser()
    out = parser.feed(
        b": keep-alive\n\n"
        + _frame('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1",'
                 '"function":{"name":"f","arguments":""}}]}}]}')
        + _frame('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,'
                 '"function":{"arguments":"{}"}}]}}]}'))
    assert out == [ToolCallDelta(0, "c1", "f", ""), ToolCallDelta(0, None, None, "{}")]


def test_parser_errors() -> None:
    with pytest.raises(UpstreamError, match="malformed JSON"):
        ChatCompletionsStreamParser().feed(b"data: {nope\n\n")
    with pytest.raises(UpstreamError, match="error mid-stream: overloaded"):
        ChatCompletionsStreamParser().feed(_frame('{"error":{"message":"overloaded"}}'))


def test_request_building() -> None:
    adapter = OpenAIAdapter(base_url="http://127.0.0.1:1/v1")
    params = adapter.build_params(ChatRequest(
        messages=[UserMessage(id="u", content="hi"),
                  AssistantMessage(id="a", tool_calls=[ToolCall(
                      id="c", function=FunctionCall(name="f", arguments="{}"))]),
                  ToolMessage(id="t", tool_call_id="c", content="", error="boom")],
        tools=[ToolSpec("f", "does f", {"type": "object"})],
        system_prompt="sys", tool_choice="f", max_tokens=5))
    assert params["messages"][0] == {"role": "system", "content": "sys"}
    assert params["messages"][-1] == {"role": "tool", "tool_call_id": "c",
                                      "content": "Error: boom"}
    assert params["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert params["max_tokens"] == 5
    assert params["model"] == "gpt-4o"


def test_needs_a_key_or_a_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="api_key"):
        OpenAIAdapter()


async def test_stream_against_the_mock(llm: MockOpenAIServer) -> None:
    adapter = OpenAIAdapter(base_url=llm.base_url, max_retries=0)
    try:
        deltas = [d async for batch in adapter.stream(ChatRequest(
            messages=[UserMessage(id="u", content="hello")])) for d in batch]
        assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "echo: hello"
        end = deltas[-1]
        assert isinstance(end, StreamEnd)
        assert end.finish_reason == "stop"
        assert end.usage is not None
        assert end.usage["total_tokens"] > 0
        with pytest.raises(UpstreamError, match="HTTP 429: mock error 429") as info:
            async for _ in adapter.stream(ChatRequest(
                    messages=[UserMessage(id="u", content="error:429")])):
                pass
        assert info.value.status == 429
    finally:
        await adapter.aclose()


# ---- reasoning as OpenAI-compatible servers stream it ----------------------------------------


def test_parser_reads_reasoning_content_and_reasoning() -> None:
    """DeepSeek streams `reasoning_content`, OpenRouter and vLLM `reasoning`: both were
    skipped, so a client saw no REASONING events; a value of another type is skipped."""
    kept: list[tuple[str, str | None, str]] = []
    parser = ChatCompletionsStreamParser(
        keep_reasoning=lambda i, name, r: kept.append((i, name, r)))
    out = parser.feed(
        _frame('{"choices":[{"index":0,"delta":{"content":null,"reasoning_content":"a"}}]}')
        + _frame('{"choices":[{"index":0,"delta":{"reasoning":"b"}}]}')
        + _frame('{"choices":[{"index":0,"delta":{"reasoning":{"odd":1}}}]}')
        + _frame('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1",'
                 '"function":{"name":"f","arguments":"{}"}}]}}]}'))
    assert out == [ReasoningDelta("a"), ReasoningDelta("b"), ToolCallDelta(0, "c1", "f", "{}")]
    assert kept == [("c1", "f", "a")]  # (only `reasoning_content` is asked back)


def test_the_reasoning_kept_for_tool_loops_is_bounded_by_its_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: bounded by count (1,024 answers) and kept as the stream's pieces, one string
    per token: 8,000-token answers held ~0.5 MB each, ~0.5 GB at the bound."""
    monkeypatch.setattr(openai_module, "_REASONING_KEPT_CHARS", 1000)
    adapter = OpenAIAdapter(api_key="k")
    for n in range(10):
        parser = ChatCompletionsStreamParser(
            keep_reasoning=functools.partial(adapter._reasoning.keep, "t"))
        parser.feed(b"".join(
            _frame('{"choices":[{"index":0,"delta":{"reasoning_content":"xxxxxxxxxx"}}]}')
            for _ in range(30)) + _frame(
            f'{{"choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,"id":"c{n}",'
            '"function":{"name":"f","arguments":"{}"}}]}}]}'))
    assert len(adapter._reasoning) == 3  # c7, c8 and c9: 300 characters each
    assert adapter._reasoning.held == 900
    assert adapter._reasoning.get("t", "c9", "f", "{}") == "x" * 300
    assert adapter._reasoning.get("t", "c6", "f", "{}") is None


@pytest.mark.parametrize("transport", ["direct", "sdk"])
async def test_the_tool_loop_sends_deepseeks_reasoning_content_back(
        transport: Literal["direct", "sdk"]) -> None:
    """DeepSeek's thinking mode refuses the tool loop's next request when the assistant
    message of its call lacks the `reasoning_content` the model streamed with it (400
    "Missing reasoning_content field in the assistant message")."""
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        if any(m["role"] == "assistant" and m.get("tool_calls") and "reasoning_content" not in m
               for m in body["messages"]):
            return web.json_response({"error": {"message": "Missing reasoning_content field "
                                                "in the assistant message"}}, status=400)
        deltas = ([{"reasoning_content": "Oslo: "}, {"reasoning_content": "call it."},
                   {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                    "function": {"name": "f", "arguments": "{}"}}]}]
                  if len(bodies) == 1 else [{"content": "Sunny."}])
        reason = "tool_calls" if len(bodies) == 1 else "stop"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for delta in [*deltas, {}]:
            await response.write(_frame(orjson.dumps({"choices": [{
                "index": 0, "delta": delta,
                "finish_reason": None if delta else reason}]}).decode()))
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    adapter = OpenAIAdapter(base_url=f"http://127.0.0.1:{port}/v1", model="deepseek-chat",
                            max_retries=0, transport=transport)
    tools = [ToolSpec("f", "does f", {"type": "object"})]
    history: list[Any] = [UserMessage(id="u", content="weather?")]
    try:
        first = [d async for b in adapter.stream(ChatRequest(messages=history, tools=tools,
                                                             thread_id="t"))
                 for d in b]
        history += [AssistantMessage(id="a", tool_calls=[ToolCall(
                        id="call_0", function=FunctionCall(name="f", arguments="{}"))]),
                    ToolMessage(id="t", tool_call_id="call_0", content="21")]
        second = [d async for b in adapter.stream(ChatRequest(messages=history, tools=tools,
                                                              thread_id="t"))
                  for d in b]
    finally:
        await adapter.aclose()
        await runner.cleanup()
    assert [d.text for d in first if isinstance(d, ReasoningDelta)] == ["Oslo: ", "call it."]
    assert [d.text for d in second if isinstance(d, TextDelta)] == ["Sunny."]
    assert bodies[1]["messages"][1]["reasoning_content"] == "Oslo: call it."


def _whole(body: dict[str, Any]) -> list[Any]:
    parser = ChatCompletionsStreamParser(secrets=["sk-live-0123456789"])
    return [*parser.feed(orjson.dumps(body)), *parser.finish()]


def test_a_json_error_body_instead_of_a_stream_says_the_providers_words() -> None:
    """Before: a gateway's `200 {"error": ...}` (a quota, a key) read "The OpenAI stream ended
    before the answer was complete", the provider's own words lost. Now they are the error,
    keys withheld."""
    with pytest.raises(UpstreamError) as caught:
        _whole({"error": {"message": "Insufficient quota for sk-live-0123456789",
                          "type": "insufficient_quota"}})
    assert caught.value.message.startswith("OpenAI answered an error: Insufficient quota")
    assert "sk-live-0123456789" not in caught.value.message


def test_a_whole_completion_instead_of_a_stream_is_the_answer() -> None:
    """A server that ignores `stream: true` answers one `chat.completion`: before, the answer
    was lost ("the stream ended before the answer was complete"); now it is read."""
    assert _whole({"object": "chat.completion", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": "whole answer"},
        "finish_reason": "stop"}], "usage": {"total_tokens": 3}}) == [
        TextDelta("whole answer"), StreamEnd("stop", {"total_tokens": 3})]
    deltas = _whole({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "getWeather", "arguments": '{"city":"Paris"}'}}]}}]})
    assert [type(d).__name__ for d in deltas] == ["ToolCallDelta", "StreamEnd"]
    assert deltas[0][1:] == ("call_1", "getWeather", '{"city":"Paris"}')
    assert deltas[-1] == StreamEnd("tool_calls", None)
