"""A misbehaving LLM provider cannot break the AG-UI stream, the thread, or the next run.

A raw loopback upstream answers each request with a script of bytes, pauses and a TCP reset
(OpenAI Chat Completions, Anthropic Messages and Gemini SSE wire formats), and the runtime is
served by uvicorn. Covered: fields of the wrong type (a number where text belongs), chunks of
an unexpected shape, token counts that are strings, bytes that are not UTF-8, a thought
signature that is not base64, interleaved parallel tool calls, a tool call whose name comes in
a later delta (also through LangChain's ChatOpenAI), CRLF-framed SSE, a reset of a body
delimited by the connection's close, reasoning (thinking, a call's arguments before its name)
streamed without end to a client not shown it, Mistral's `content` as a list of chunks, and a
frontend tool's call whose arguments are not JSON after a normal end.
Every client stream must pass `verify_events`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest

from copilot_runtime import CopilotRuntime, OpenAIAdapter
from copilot_runtime._exceptions import UpstreamProtocolError
from copilot_runtime._held import MAX_UPSTREAM_EVENT_BYTES as MAX_EVENT_BYTES
from copilot_runtime.adapters import ServiceAdapter
from copilot_runtime.adapters.anthropic import AnthropicAdapter, AnthropicStreamParser
from copilot_runtime.adapters.base import ChatDelta, TextDelta
from copilot_runtime.adapters.google import GeminiStreamParser, GoogleGenAIAdapter
from copilot_runtime.adapters.openai import ChatCompletionsStreamParser
from copilot_runtime.testing import verify_events
from tests.conftest import RawServer, Served, ServeRuntime, parse_sse, run_input, text_of, types
from tests.gql.wire import user_turn
from tests.test_hardening import assert_clean

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 30
RESET = "reset"  # a step of a script: end the connection with a TCP RST
HANG = "hang"  # a step of a script: send nothing more until the client hangs up
Step = bytes | float | str  # bytes are written, a float is a pause in seconds, RESET or HANG

SET_COLOR = {"name": "setColor", "description": "Sets the colour",
             "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}
PROVIDER_WORDS = {"openai": "OpenAI", "anthropic": "Anthropic", "google": "Gemini"}


# ---- a scripted upstream ---------------------------------------------------------------------


class ScriptedUpstream(RawServer):
    """Answers request N with script N (the last one again after that), then closes."""

    def __init__(self, *scripts: list[Step]) -> None:
        super().__init__()
        self.scripts = scripts
        self.requests: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            self.requests.append(head + await reader.readexactly(length))
            for step in self.scripts[min(len(self.requests), len(self.scripts)) - 1]:
                if isinstance(step, bytes):
                    writer.write(step)
                    await writer.drain()
                elif isinstance(step, float):
                    await asyncio.sleep(step)
                elif step == HANG:
                    await reader.read()
                else:
                    assert step == RESET
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


#: A 200 answer whose body ends with the connection (no Content-Length, not chunked).
HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Connection: close\r\n\r\n")


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def crlf(script: list[Step]) -> list[Step]:
    """The script with every SSE line ended by CRLF (the HTTP head is already)."""
    return [script[0], *(s.replace(b"\n", b"\r\n") if isinstance(s, bytes) else s
                         for s in script[1:])]


# OpenAI Chat Completions

def oa_text(text: str) -> bytes:
    return sse({"id": "c", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})


def oa_tool(index: int, call_id: str | None = None, name: str | None = None,
            arguments: str | None = None) -> bytes:
    function: dict[str, Any] = {}
    if name is not None:
        function["name"] = name
    if arguments is not None:
        function["arguments"] = arguments
    call: dict[str, Any] = {"index": index, "type": "function", "function": function}
    if call_id is not None:
        call["id"] = call_id
    return sse({"id": "c", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"tool_calls": [call]},
                             "finish_reason": None}]})


def oa_finish(reason: str = "stop") -> bytes:
    return sse({"id": "c", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})


OA_DONE = b"data: [DONE]\n\n"


def oa_answer(text: str) -> list[Step]:
    return [HEAD, oa_text(text), oa_finish(), OA_DONE]


# Anthropic Messages

def an(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\n".encode() + sse(event)


AN_START = an({"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "content": [],
    "usage": {"input_tokens": 3, "output_tokens": 0}}})
AN_OPEN_TEXT = an({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}})


def an_delta(delta: Any, index: Any = 0) -> bytes:
    return an({"type": "content_block_delta", "index": index, "delta": delta})


def an_stop(index: int = 0) -> bytes:
    return an({"type": "content_block_stop", "index": index})


def an_text_block(text: str) -> list[Step]:
    return [AN_OPEN_TEXT, an_delta({"type": "text_delta", "text": text}), an_stop()]


def an_tool_start(index: int, call_id: Any = "toolu_1", name: Any = "setColor") -> bytes:
    return an({"type": "content_block_start", "index": index, "content_block": {
        "type": "tool_use", "id": call_id, "name": name, "input": {}}})


def an_args(index: int, piece: Any) -> bytes:
    return an_delta({"type": "input_json_delta", "partial_json": piece}, index)


def an_end(reason: str = "end_turn") -> list[Step]:
    return [an({"type": "message_delta", "delta": {"stop_reason": reason},
                "usage": {"output_tokens": 2}}), an({"type": "message_stop"})]


def an_answer(text: str) -> list[Step]:
    return [HEAD, AN_START, *an_text_block(text), *an_end()]


# Gemini streamGenerateContent

def gm_parts(*parts: Any, reason: str | None = None, usage: Any = None) -> bytes:
    candidate: dict[str, Any] = {"content": {"parts": list(parts), "role": "model"}}
    if reason is not None:
        candidate["finishReason"] = reason
    chunk: dict[str, Any] = {"candidates": [candidate]}
    if usage is not None:
        chunk["usageMetadata"] = usage
    return sse(chunk)


def gm_call(name: Any = "setColor", call_id: Any = None, signature: str | None = None
            ) -> dict[str, Any]:
    call: dict[str, Any] = {"name": name, "args": {"c": "red"}}
    if call_id is not None:
        call["id"] = call_id
    part: dict[str, Any] = {"functionCall": call}
    if signature is not None:
        part["thoughtSignature"] = signature
    return part


def gm_answer(text: str) -> list[Step]:
    return [HEAD, gm_parts({"text": text}), gm_parts(reason="STOP", usage={
        "promptTokenCount": 3, "candidatesTokenCount": 2})]


ANSWER = {"openai": oa_answer, "anthropic": an_answer, "google": gm_answer}


# ---- the runtime in front of it --------------------------------------------------------------


def make_adapter(provider: str, url: str, transport: str, api_key: str | None = None,
                 **options: Any) -> ServiceAdapter:
    if transport == "langchain":  # LangChain's ChatOpenAI (langchain-openai), OpenAI's wire
        from langchain_openai import ChatOpenAI

        from copilot_runtime import LangChainAdapter

        assert provider == "openai", provider
        return LangChainAdapter(ChatOpenAI(
            model="gpt-4o", base_url=url + "/v1", api_key=api_key or "sk-mock",  # type: ignore[arg-type]
            max_retries=0, timeout=10, stream_usage=True, **options))
    options = {"max_retries": 0, "timeout": 10, "transport": transport, **options}
    if provider == "openai":
        return OpenAIAdapter(base_url=url + "/v1", api_key=api_key or "sk-mock", **options)
    if provider == "anthropic":
        return AnthropicAdapter(base_url=url, api_key=api_key or "sk-mock", **options)
    return GoogleGenAIAdapter(base_url=url, api_key=api_key or "mock-key", **options)


@contextlib.asynccontextmanager
async def hostile(serve_runtime: ServeRuntime, provider: str, *scripts: list[Step],
                  transport: str = "direct", max_run_bytes: int | None = None,
                  **options: Any) -> AsyncIterator[tuple[Served, ScriptedUpstream]]:
    """The runtime served in front of a `ScriptedUpstream`; `options` go to the adapter."""
    async with asyncio.timeout(TIMEOUT_S), ScriptedUpstream(*scripts) as upstream, \
            contextlib.AsyncExitStack() as owned:
        if transport == "langchain":
            # A client of its own, closed here: langchain-openai's default one is cached for
            # the whole process, and a later test's upstream may reuse this one's port.
            options["http_async_client"] = await owned.enter_async_context(httpx.AsyncClient())
        runtime = CopilotRuntime(service_adapter=make_adapter(provider, upstream.url,
                                                              transport, **options),
                                 **({} if max_run_bytes is None else
                                    {"max_run_bytes": max_run_bytes}))
        async with serve_runtime(runtime) as served:
            yield served, upstream


async def run(served: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The client's events of one run, checked: valid AG-UI, nothing internal leaked."""
    response = await served.post("/agent/default/run", body)
    assert response.status == 200, await response.text()
    raw = await response.read()
    assert_clean(raw)
    events = parse_sse(raw)
    verify_events(events)
    return events


def protocol_error(events: list[dict[str, Any]], provider: str) -> None:
    assert types(events)[-1] == "RUN_ERROR", events
    assert events[-1]["code"] == "UPSTREAM_PROTOCOL_ERROR", events[-1]
    assert PROVIDER_WORDS[provider] in events[-1]["message"], events[-1]


def tool_calls(events: list[dict[str, Any]]) -> dict[str, tuple[str, Any]]:
    """Each tool call's name and parsed arguments, by id, as the client assembles them."""
    names = {e["toolCallId"]: e["toolCallName"] for e in events
             if e["type"] == "TOOL_CALL_START"}
    args = {call_id: "".join(e["delta"] for e in events
                             if e["type"] == "TOOL_CALL_ARGS" and e["toolCallId"] == call_id)
            for call_id in names}
    return {call_id: (names[call_id], orjson.loads(args[call_id])) for call_id in names}


def tool_order(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["type"].removeprefix("TOOL_CALL_"), e["toolCallId"]) for e in events
            if e["type"] in ("TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END")]


# ---- A: a number where text belongs ----------------------------------------------------------

NON_STRING: dict[str, tuple[str, list[Step]]] = {
    "anthropic-text_delta": ("anthropic", [
        HEAD, AN_START, AN_OPEN_TEXT, an_delta({"type": "text_delta", "text": 5}), an_stop(),
        *an_end()]),
    "anthropic-partial_json": ("anthropic", [
        HEAD, AN_START, an_tool_start(0), an_args(0, 5), an_stop(), *an_end("tool_use")]),
    "anthropic-tool_id": ("anthropic", [
        HEAD, AN_START, an_tool_start(0, call_id=7), an_args(0, '{"c":"red"}'), an_stop(),
        *an_end("tool_use")]),
    "anthropic-tool_name": ("anthropic", [
        HEAD, AN_START, an_tool_start(0, name=7), an_args(0, '{"c":"red"}'), an_stop(),
        *an_end("tool_use")]),
    "google-text": ("google", [HEAD, gm_parts({"text": 5}), gm_parts(reason="STOP")]),
    "google-call_id": ("google", [HEAD, gm_parts(gm_call(call_id=5), reason="STOP")]),
    "google-call_name": ("google", [HEAD, gm_parts(gm_call(name=5), reason="STOP")]),
}


@pytest.mark.parametrize("case", NON_STRING)
async def test_a_number_where_text_belongs_is_a_protocol_error(
        serve_runtime: ServeRuntime, case: str) -> None:
    provider, script = NON_STRING[case]
    thread = f"t-{case}"
    async with hostile(serve_runtime, provider, script, ANSWER[provider]("all good")) \
            as (served, _):
        events = await run(served, run_input("hi", thread=thread, tools=[SET_COLOR]))
        protocol_error(events, provider)
        response = await served.session.get(served.url + f"/threads/{thread}/messages")
        assert response.status == 200, await response.text()
        stored = (await response.json())["messages"]
        assert [m["content"] for m in stored if m["role"] == "user"] == ["hi"]
        follow_up = await run(served, run_input("again", thread=thread, run="run-2",
                                                tools=[SET_COLOR]))
    assert types(follow_up)[-1] == "RUN_FINISHED", follow_up
    assert text_of(follow_up) == "all good"


# ---- B: chunks of an unexpected shape --------------------------------------------------------

MALFORMED: dict[str, tuple[str, list[Step]]] = {
    "openai-not_utf8": ("openai", [
        HEAD, oa_text("a"),
        b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe bad"}}]}\n\n',
        oa_finish(), OA_DONE]),
    "anthropic-delta_not_object": ("anthropic", [
        HEAD, AN_START, AN_OPEN_TEXT, an_delta("oops"), an_stop(), *an_end()]),
    "anthropic-content_block_not_object": ("anthropic", [
        HEAD, AN_START, an({"type": "content_block_start", "index": 0, "content_block": [1]}),
        *an_end()]),
    "anthropic-index_a_list": ("anthropic", [
        HEAD, AN_START, an({"type": "content_block_start", "index": [0], "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "setColor", "input": {}}}),
        *an_end("tool_use")]),
    "google-signature_not_base64": ("google", [
        HEAD, gm_parts(gm_call(signature="!!!not base64!!!"), reason="STOP")]),
}


@pytest.mark.parametrize("case", MALFORMED)
async def test_a_malformed_chunk_is_a_protocol_error_not_an_agent_crash(
        serve_runtime: ServeRuntime, case: str) -> None:
    provider, script = MALFORMED[case]
    async with hostile(serve_runtime, provider, script, ANSWER[provider]("all good")) \
            as (served, _):
        events = await run(served, run_input("hi", thread=f"t-{case}", tools=[SET_COLOR]))
        protocol_error(events, provider)
        follow_up = await run(served, run_input("again", thread=f"t-{case}", run="run-2"))
    assert text_of(follow_up) == "all good"


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_body_that_does_not_decompress_is_a_protocol_error(
        serve_runtime: ServeRuntime, provider: str) -> None:
    """Through the SDK's route, whose HTTP client decodes a gzip body as it reads it."""
    script: list[Step] = [HEAD.replace(b"Connection:", b"Content-Encoding: gzip\r\nConnection:"),
                          b"\x1f\x8b\x08\x00garbage, not gzip"]
    async with hostile(serve_runtime, provider, script, ANSWER[provider]("all good"),
                       transport="sdk") as (served, _):
        events = await run(served, run_input("hi"))
        protocol_error(events, provider)
        follow_up = await run(served, run_input("again", run="run-2"))
    assert text_of(follow_up) == "all good"


@pytest.mark.parametrize("provider", ["anthropic", "google"])
async def test_token_counts_that_are_strings_are_ignored(serve_runtime: ServeRuntime,
                                                         provider: str) -> None:
    if provider == "anthropic":
        script: list[Step] = [
            HEAD, an({"type": "message_start", "message": {
                "id": "msg_1", "type": "message", "role": "assistant", "content": [],
                "usage": {"input_tokens": "12", "output_tokens": 0,
                          "cache_read_input_tokens": "4"}}}),
            *an_text_block("the answer"), *an_end()]
    else:
        script = [HEAD, gm_parts({"text": "the answer"}), gm_parts(reason="STOP", usage={
            "promptTokenCount": "3", "candidatesTokenCount": 2})]
    async with hostile(serve_runtime, provider, script) as (served, _):
        events = await run(served, run_input("hi"))
    assert types(events)[-1] == "RUN_FINISHED", events
    assert text_of(events) == "the answer"


# ---- C: parallel tool calls whose argument pieces interleave ---------------------------------

INTERLEAVED: dict[str, list[Step]] = {
    "openai": [HEAD, oa_tool(0, "c1", "setColor", ""), oa_tool(1, "c2", "setColor", ""),
               oa_tool(0, arguments='{"c":'), oa_tool(1, arguments='{"c":'),
               oa_tool(0, arguments='"red"}'), oa_tool(1, arguments='"blue"}'),
               oa_finish("tool_calls"), OA_DONE],
    "anthropic": [HEAD, AN_START, an_tool_start(0, "c1"), an_tool_start(1, "c2"),
                  an_args(0, '{"c":'), an_args(1, '{"c":'), an_args(0, '"red"}'),
                  an_args(1, '"blue"}'), an_stop(0), an_stop(1), *an_end("tool_use")],
}


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_interleaved_parallel_tool_calls_get_all_their_arguments(
        serve_runtime: ServeRuntime, provider: str) -> None:
    async with hostile(serve_runtime, provider, INTERLEAVED[provider]) as (served, upstream):
        events = await run(served, run_input("paint", thread="t-par", tools=[SET_COLOR]))
        stored = await (await served.session.get(
            served.url + "/threads/t-par/messages")).json()
    assert types(events)[-1] == "RUN_FINISHED", events
    assert tool_calls(events) == {"c1": ("setColor", {"c": "red"}),
                                  "c2": ("setColor", {"c": "blue"})}
    order = tool_order(events)
    for call_id in ("c1", "c2"):  # no piece of a call after its end (verify_events too)
        assert order.index(("END", call_id)) > max(
            i for i, step in enumerate(order) if step == ("ARGS", call_id))
    assert "TOOL_CALL_RESULT" not in types(events)  # frontend tools: the client runs them
    assert len(upstream.requests) == 1
    (assistant,) = [m for m in stored["messages"] if m.get("toolCalls")]
    assert {c["id"]: orjson.loads(c["function"]["arguments"])
            for c in assistant["toolCalls"]} == {"c1": {"c": "red"}, "c2": {"c": "blue"}}


@pytest.mark.parametrize("split", [False, True])
async def test_sequential_tool_calls_keep_their_order(serve_runtime: ServeRuntime,
                                                      split: bool) -> None:
    """Regression guard, passes on the old code too: a call whose arguments are complete
    JSON still ends when the next call starts (START, ARGS, END of c1, then of c2)."""
    if split:
        calls = [oa_tool(0, "c1", "setColor", ""), oa_tool(0, arguments='{"c":'),
                 oa_tool(0, arguments='"red"}'), oa_tool(1, "c2", "setColor", ""),
                 oa_tool(1, arguments='{"c":"blue"}')]
    else:
        calls = [oa_tool(0, "c1", "setColor", '{"c":"red"}'),
                 oa_tool(1, "c2", "setColor", '{"c":"blue"}')]
    script: list[Step] = [HEAD, *calls, oa_finish("tool_calls"), OA_DONE]
    async with hostile(serve_runtime, "openai", script) as (served, _):
        events = await run(served, run_input("paint", tools=[SET_COLOR]))
    assert types(events)[-1] == "RUN_FINISHED", events
    order = [step for i, step in enumerate(tool_order(events))
             if i == 0 or step != tool_order(events)[i - 1]]  # ARGS pieces as one
    assert order == [("START", "c1"), ("ARGS", "c1"), ("END", "c1"),
                     ("START", "c2"), ("ARGS", "c2"), ("END", "c2")]
    assert tool_calls(events) == {"c1": ("setColor", {"c": "red"}),
                                  "c2": ("setColor", {"c": "blue"})}


# ---- D: a tool call's name in a later delta --------------------------------------------------


@pytest.mark.parametrize("transport", ["direct", "sdk", "langchain"])
async def test_a_tool_name_in_a_later_delta_calls_that_frontend_tool(
        serve_runtime: ServeRuntime, transport: str) -> None:
    """Before, through LangChain (ChatOpenAI): the name was taken from the call's first
    piece only: announced as toolCallName "", run server-side as "there is no tool named
    ''", the frontend tool never ran. Now the name that comes later is the call's."""
    script: list[Step] = [HEAD, oa_tool(0, "c1"), oa_tool(0, name="setColor"),
                          oa_tool(0, arguments='{"c":"red"}'), oa_finish("tool_calls"), OA_DONE]
    async with hostile(serve_runtime, "openai", script, oa_answer("the model again"),
                       transport=transport) as (served, upstream):
        events = await run(served, run_input("paint", tools=[SET_COLOR]))
    assert types(events)[-1] == "RUN_FINISHED", events
    (start,) = [e for e in events if e["type"] == "TOOL_CALL_START"]
    assert (start["toolCallId"], start["toolCallName"]) == ("c1", "setColor")
    assert tool_calls(events) == {"c1": ("setColor", {"c": "red"})}
    # the client runs its tool: no server-side attempt, no second request to the model
    assert "TOOL_CALL_RESULT" not in types(events)
    assert len(upstream.requests) == 1
    assert text_of(events) == ""


# ---- E: SSE framed with CRLF -----------------------------------------------------------------


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_crlf_framed_sse_is_an_answer(serve_runtime: ServeRuntime, provider: str) -> None:
    async with hostile(serve_runtime, provider, crlf(ANSWER[provider]("hello"))) as (served, _):
        events = await run(served, run_input("hi"))
    assert types(events)[-1] == "RUN_FINISHED", events
    assert text_of(events) == "hello"


async def test_crlf_split_between_reads_is_an_answer(serve_runtime: ServeRuntime) -> None:
    r"""An event's "\r\n\r\n" arriving in two reads ("\r" | "\n\r\n") still ends it."""
    first, second = oa_text("hel").replace(b"\n", b"\r\n"), oa_text("lo").replace(b"\n", b"\r\n")
    script: list[Step] = [HEAD, first[:-3], 0.05, first[-3:] + second[:-1], 0.05, second[-1:],
                          *crlf([HEAD, oa_finish(), OA_DONE])[1:]]
    async with hostile(serve_runtime, "openai", script) as (served, _):
        events = await run(served, run_input("hi"))
    assert types(events)[-1] == "RUN_FINISHED", events
    assert text_of(events) == "hello"


# ---- F: a reset of a body delimited by the connection's close --------------------------------

RESET_MID: dict[str, list[Step]] = {
    "openai": [HEAD, oa_text("a"), 0.1, RESET],
    "anthropic": [HEAD, AN_START, *an_text_block("a"), 0.1, RESET],
}


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_reset_mid_body_is_a_connection_error(serve_runtime: ServeRuntime,
                                                      provider: str) -> None:
    async with hostile(serve_runtime, provider, RESET_MID[provider]) as (served, _):
        events = await run(served, run_input("hi"))
    assert types(events)[-1] == "RUN_ERROR", events
    assert events[-1]["code"] == "UPSTREAM_CONNECTION_ERROR", events[-1]


# -- G: one long event costs its length once, and has a bound ---------------------------------


def _openai_event(text: str) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}) + b"\n\n"


def _anthropic_event(text: str) -> bytes:
    return b"event: content_block_delta\ndata: " + orjson.dumps({
        "type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": text}}) + b"\n\n"


def _gemini_event(text: str) -> bytes:
    return b"data: " + orjson.dumps({"candidates": [{
        "content": {"parts": [{"text": text}], "role": "model"}, "index": 0}]}) + b"\r\n\r\n"


_LONG_EVENTS: dict[str, tuple[Callable[[], Any], Callable[[str], bytes]]] = {
    "openai": (ChatCompletionsStreamParser, _openai_event),
    "anthropic": (AnthropicStreamParser, _anthropic_event),
    "google": (GeminiStreamParser, _gemini_event),
}


def _feed(parser: Any, body: bytes, deadline: float) -> list[ChatDelta]:
    """`body` fed in 64 KiB reads, within `deadline` of this process's CPU time (the other
    test process, on a busy machine, does not count)."""
    out: list[ChatDelta] = []
    for start in range(0, len(body), 65536):
        out.extend(parser.feed(body[start:start + 65536]))
        assert time.process_time() < deadline, f"still reading at byte {start}"
    return out


@pytest.mark.parametrize("provider", sorted(_LONG_EVENTS))
def test_a_long_event_costs_its_length_once(provider: str) -> None:
    """A 15 MiB event in 64 KiB reads: OpenAI's and Anthropic's parsers joined and searched
    everything held at every read (quadratic: 0.87 s here), Gemini's joined it (0.16 s);
    now the reads are joined once (0.12 s)."""
    make, event = _LONG_EVENTS[provider]
    text = "x" * (15 * 2**20)
    deltas = _feed(make(), event("a") + event(text) + event("b"), time.process_time() + 0.45)
    assert [d.text for d in deltas if isinstance(d, TextDelta)] == ["a", text, "b"]


@pytest.mark.parametrize("provider", sorted(_LONG_EVENTS))
def test_an_event_over_the_bound_is_a_protocol_error(provider: str) -> None:
    make, event = _LONG_EVENTS[provider]
    with pytest.raises(UpstreamProtocolError, match=f"larger than {MAX_EVENT_BYTES} bytes"):
        _feed(make(), event("x" * MAX_EVENT_BYTES), time.process_time() + 5)


# ---- H: what an answer holds that no event carries has the live run's bound ----------------

#: A piece of reasoning, thinking or arguments: 65 of them pass the bound (64 MiB).
MIB = "x" * 2**20
OVER_HELD_BOUND = 65


def _endless(*steps: bytes) -> list[Step]:
    """`steps`, then a stream that never ends (as far as the run can tell)."""
    return [HEAD, *steps, HANG]


ENDLESS: dict[str, tuple[str, list[Step]]] = {
    "openai-reasoning_content": ("openai", _endless(*[sse({"choices": [{
        "index": 0, "delta": {"reasoning_content": MIB}}]})] * OVER_HELD_BOUND)),
    "anthropic-thinking": ("anthropic", _endless(AN_START, an({
        "type": "content_block_start", "index": 0,
        "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        *[an_delta({"type": "thinking_delta", "thinking": MIB})] * OVER_HELD_BOUND)),
    "anthropic-signature": ("anthropic", _endless(AN_START, an({
        "type": "content_block_start", "index": 0,
        "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        *[an_delta({"type": "signature_delta", "signature": MIB})] * OVER_HELD_BOUND)),
    "openai-call-without-name": ("openai", _endless(
        oa_tool(0, "c1", None, '{"c":"'), *[oa_tool(0, arguments=MIB)] * OVER_HELD_BOUND)),
}


def _stopped_too_large(events: list[dict[str, Any]], bound: int = 64 * 2**20) -> None:
    assert types(events)[-1] == "RUN_ERROR", types(events)
    assert events[-1]["code"] == "PAYLOAD_TOO_LARGE", events[-1]
    assert f"passed {bound} bytes" in events[-1]["message"], events[-1]
    assert not any(e["type"].startswith(("REASONING", "TOOL_CALL")) for e in events), events


@pytest.mark.parametrize("case", ENDLESS)
async def test_an_endless_answer_no_event_carries_is_stopped_at_the_runs_bound(
        serve_runtime: ServeRuntime, case: str) -> None:
    """A client not shown reasoning (no `protocolVersion`) gets no event of it, and a call
    without its name yet sends none: the live run's bound counts only events sent, so the
    parser's reasoning (thinking, signature) or the call's held arguments grew without end
    (1.2 GB streamed: RSS 122 -> 1327 MB). Now they count against the same bound: the run
    ends PAYLOAD_TOO_LARGE as soon as they pass it (before: UPSTREAM_TIMEOUT, the stream's
    silence after 65 MiB, with all of it held)."""
    provider, script = ENDLESS[case]
    async with hostile(serve_runtime, provider, script, timeout=3) as (served, _):
        _stopped_too_large(await run(served, run_input("think")))


@pytest.mark.parametrize("case", ["openai-reasoning_content", "anthropic-thinking",
                                  "openai-call-without-name"])
async def test_what_an_answer_holds_unseen_has_the_runtimes_own_bound(
        serve_runtime: ServeRuntime, case: str) -> None:
    """A runtime of `max_run_bytes=1 MiB` stops a shown run at 4 MiB: one whose client is
    not shown its reasoning was held to a fixed 64 MiB (a review), so the same upstream
    answer passed or failed by the client asking."""
    provider, script = ENDLESS[case]
    async with hostile(serve_runtime, provider, script, timeout=3,
                       max_run_bytes=2**20) as (served, _):
        _stopped_too_large(await run(served, run_input("think")), bound=4 * 2**20)


async def test_endless_reasoning_over_graphql_is_stopped_at_the_runs_bound(
        serve_runtime: ServeRuntime) -> None:
    """The 1.10 GraphQL client is never shown reasoning: the same bound, the same failure."""
    async with hostile(serve_runtime, "openai", ENDLESS["openai-reasoning_content"][1],
                       timeout=3) as (served, _):
        answer = await served.generate(user_turn("think"))
    status = answer["status"]
    assert status["code"] == "Failed", status
    error = status["details"]["originalError"]
    assert error["originalErrorType"] == "PAYLOAD_TOO_LARGE", error
    assert f"passed {64 * 2**20} bytes" in status["details"]["description"], status


# ---- I: Mistral's content as a list of chunks (Magistral, reasoning_effort) ----------------


def _mistral(content: Any, finish: str | None = None) -> bytes:
    return sse({"id": "c", "object": "chat.completion.chunk", "model": "magistral-medium-2509",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": content},
                             "finish_reason": finish}]})


MISTRAL_THINKING = _mistral([{"type": "thinking", "thinking": [
    {"type": "text", "text": "The user "}, {"type": "text", "text": "greets me."}]}])
MISTRAL_ANSWER: list[Step] = [
    HEAD, MISTRAL_THINKING,
    _mistral([{"type": "text", "text": "Hello"},
              {"type": "reference", "reference_ids": [1]}]),  # (a kind not read: left out)
    _mistral(" there!"),  # its plain pieces are strings
    _mistral("", "stop"),
    sse({"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}),
    OA_DONE]


def _reasoning_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "REASONING_MESSAGE_CONTENT")


@pytest.mark.parametrize("transport", ["direct", "sdk"])
@pytest.mark.parametrize("framing", ["lf", "crlf"])
async def test_mistrals_content_chunks_are_its_answer_and_its_reasoning(
        serve_runtime: ServeRuntime, transport: str, framing: str) -> None:
    """Before: `delta.content` had to be a string, and every answer of a Mistral reasoning
    model failed UPSTREAM_PROTOCOL_ERROR. Now its text chunks are the answer, its thinking
    chunks reasoning (for the clients shown it), other kinds of chunk left out."""
    script = crlf(MISTRAL_ANSWER) if framing == "crlf" else MISTRAL_ANSWER
    async with hostile(serve_runtime, "openai", script, transport=transport) as (served, _):
        events = await run(served, run_input("hello", protocolVersion="1.0"))
        unshown = await run(served, run_input("hello", thread="t-old", run="r-old"))
    assert types(events)[-1] == "RUN_FINISHED", events
    assert text_of(events) == "Hello there!"
    assert _reasoning_of(events) == "The user greets me."
    assert types(unshown)[-1] == "RUN_FINISHED", unshown
    assert text_of(unshown) == "Hello there!"
    assert not any(e["type"].startswith("REASONING") for e in unshown)


async def test_mistrals_content_chunks_over_graphql(serve_runtime: ServeRuntime) -> None:
    async with hostile(serve_runtime, "openai", MISTRAL_ANSWER) as (served, _):
        answer = await served.generate(user_turn("hello"))
    assert answer["status"]["code"] == "Success", answer["status"]
    assert [m.get("content") for m in answer["messages"]
            if m["__typename"] == "TextMessageOutput"] == [["Hello", " there!"]]


async def test_mistrals_thinking_is_not_sent_back(serve_runtime: ServeRuntime) -> None:
    """Mistral refuses an assistant message with `reasoning_content` (422 "Extra inputs are
    not permitted"): its thinking is shown, never kept to go back as DeepSeek's is."""
    first: list[Step] = [HEAD, MISTRAL_THINKING, oa_tool(0, "c1", "setColor", '{"c":"red"}'),
                         oa_finish("tool_calls"), OA_DONE]
    async with hostile(serve_runtime, "openai", first, oa_answer("done")) as (served, upstream):
        events = await run(served, run_input("paint", thread="t-m", protocolVersion="1.0",
                                              tools=[SET_COLOR]))
        assert tool_calls(events) == {"c1": ("setColor", {"c": "red"})}
        assert _reasoning_of(events) == "The user greets me."
        follow_up = run_input("", thread="t-m", run="r2", protocolVersion="1.0",
                              tools=[SET_COLOR], messages=[
                                  {"id": "run-1-u", "role": "user", "content": "paint"},
                                  {"id": "a1", "role": "assistant", "toolCalls": [{
                                      "id": "c1", "type": "function", "function": {
                                          "name": "setColor", "arguments": '{"c":"red"}'}}]},
                                  {"id": "r1", "role": "tool", "toolCallId": "c1",
                                   "content": "ok"}])
        assert text_of(await run(served, follow_up)) == "done"
    body = orjson.loads(upstream.requests[1].partition(b"\r\n\r\n")[2])
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
    assert "reasoning_content" not in body["messages"][1]


# ---- J: a frontend tool is never handed arguments that are not JSON ------------------------

BROKEN_ARGUMENTS: dict[str, tuple[str, list[Step]]] = {
    # a small local model's single quotes, ended as every call is
    "openai": ("openai", [HEAD, oa_tool(0, "call_1", "setColor", "{'c': 'red'}"),
                          oa_finish("tool_calls"), OA_DONE]),
    # a tool_use block whose input stops short, yet `stop_reason: tool_use`
    "anthropic": ("anthropic", [HEAD, AN_START, an_tool_start(0), an_args(0, '{"c": "re'),
                                an_stop(0), *an_end("tool_use")]),
}


def _broken_arguments_error(message: str, provider: str) -> None:
    assert "'setColor'" in message, message
    assert "not JSON" in message, message
    assert PROVIDER_WORDS[provider] in message or provider in message, message


@pytest.mark.parametrize("case", BROKEN_ARGUMENTS)
async def test_a_frontend_tools_arguments_that_are_not_json_end_the_run(
        serve_runtime: ServeRuntime, case: str) -> None:
    """Before: RUN_FINISHED, and the client's tool was handed `{'c': 'red'}` (or
    `{"c": "re`), which its JSON.parse throws on. Now the run ends with an UPSTREAM_ERROR
    naming the tool, as a call cut by any other end does."""
    provider, script = BROKEN_ARGUMENTS[case]
    async with hostile(serve_runtime, provider, script) as (served, upstream):
        events = await run(served, run_input("make it red", tools=[SET_COLOR]))
    assert types(events)[-1] == "RUN_ERROR", types(events)
    assert events[-1]["code"] == "UPSTREAM_ERROR", events[-1]
    _broken_arguments_error(events[-1]["message"], provider)
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("case", BROKEN_ARGUMENTS)
async def test_a_frontend_tools_arguments_that_are_not_json_over_graphql(
        serve_runtime: ServeRuntime, case: str) -> None:
    provider, script = BROKEN_ARGUMENTS[case]
    actions = [{"name": "setColor", "description": "Sets the colour",
                "jsonSchema": orjson.dumps(SET_COLOR["parameters"]).decode()}]
    async with hostile(serve_runtime, provider, script) as (served, _):
        answer = await served.generate(user_turn("make it red", actions=actions))
    status = answer["status"]
    assert status["code"] == "Failed", status
    assert status["details"]["originalError"]["originalErrorType"] == "UPSTREAM_ERROR", status
    _broken_arguments_error(status["details"]["description"], provider)


async def test_a_frontend_tool_without_arguments_still_runs(serve_runtime: ServeRuntime) -> None:
    """Regression guard: a call that streamed no arguments at all is an empty object to the
    client, as to an action; only text that is not JSON fails."""
    script: list[Step] = [HEAD, oa_tool(0, "c1", "setColor", ""), oa_finish("tool_calls"),
                          OA_DONE]
    async with hostile(serve_runtime, "openai", script) as (served, _):
        events = await run(served, run_input("paint", tools=[SET_COLOR]))
    assert types(events)[-1] == "RUN_FINISHED", events
