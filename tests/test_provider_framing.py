"""A provider's answer is read the same whatever its legal SSE framing and its TCP reads, and
its error body's message is read whatever the body's shape.

- An error body whose `error` holds a string (`{"error": {"code": 429, "error": "..."}}`)
  crashed the OpenAI SDK route's reading of it (AGENT_ERROR, a stack trace logged); a body
  that is a JSON array (Gemini's OpenAI-compatible endpoint: `[{"error": {...}}]`) lost the
  provider's message on both routes.
- Text before a malformed or misshapen event went out when the two came in separate reads,
  and was lost when they came in one.
- One event over several `data:` lines (joined with "\\n" by the SSE spec), a leading
  byte-order mark (dropped by the spec) and bare "\\r" line ends: malformed JSON, a first
  chunk silently skipped, or an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from ag_ui.core import UserMessage

from copilot_runtime._exceptions import UpstreamError, UpstreamProtocolError
from copilot_runtime.adapters.anthropic import AnthropicStreamParser
from copilot_runtime.adapters.base import ChatRequest, TextDelta
from copilot_runtime.adapters.google import GeminiStreamParser
from copilot_runtime.adapters.openai import ChatCompletionsStreamParser
from tests.conftest import ServeRuntime, run_input, text_of, types
from tests.test_hostile_providers import (
    AN_OPEN_TEXT,
    AN_START,
    HEAD,
    PROVIDER_WORDS,
    ScriptedUpstream,
    Step,
    an_delta,
    gm_parts,
    hostile,
    make_adapter,
    oa_text,
    run,
)

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 30


# ---- an error body of another shape -----------------------------------------------------------


def error_answer(status: bytes, body: Any) -> list[Step]:
    data = orjson.dumps(body)
    return [b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data]


ERROR_BODIES: dict[str, tuple[list[Step], str]] = {
    "error_a_string": (error_answer(b"429 Too Many Requests", {
        "error": {"code": 429, "error": "Rate limit reached"}}),
        "OpenAI request failed with HTTP 429: Error code: 429"),
    "message_empty": (error_answer(b"429 Too Many Requests", {
        "error": {"message": "", "error": "x"}}),
        "OpenAI request failed with HTTP 429: Error code: 429"),
    "a_list": (error_answer(b"400 Bad Request", [{"error": {
        "code": 400, "message": "Invalid function name.", "status": "INVALID_ARGUMENT"}}]),
        "OpenAI request failed with HTTP 400: Invalid function name."),
}


@pytest.mark.parametrize("transport", ["direct", "sdk"])
@pytest.mark.parametrize("case", ERROR_BODIES)
async def test_an_error_body_of_another_shape_is_the_providers_error(
        transport: str, case: str) -> None:
    script, message = ERROR_BODIES[case]
    async with asyncio.timeout(TIMEOUT_S), ScriptedUpstream(script) as upstream:
        adapter = make_adapter("openai", upstream.url, transport)
        try:
            with pytest.raises(UpstreamError) as info:
                async for _ in adapter.stream(ChatRequest(
                        messages=[UserMessage(id="u", content="hi")])):
                    pass
        finally:
            await adapter.aclose()
    assert type(info.value) is UpstreamError
    assert info.value.message == message


# ---- text before a bad event, whatever the reads ---------------------------------------------

GOOD = {
    "openai": oa_text("Hello there"),
    "anthropic": AN_START + AN_OPEN_TEXT + an_delta({"type": "text_delta", "text": "Hello there"}),
    "google": gm_parts({"text": "Hello there"}).replace(b"\n", b"\r\n"),
}
BAD = {
    "malformed": {provider: b"data: {bad\n\n" for provider in GOOD},
    "misshapen": {
        "openai": b'data: {"choices": 5}\n\n',
        "anthropic": b'data: {"type": "content_block_delta", "index": 0, "delta": "oops"}\n\n',
        "google": b'data: {"candidates": [{"content": {"parts": [{"text": 5}]}}]}\n\n',
    },
}
PARSERS: dict[str, Callable[[], Any]] = {
    "openai": ChatCompletionsStreamParser,
    "anthropic": AnthropicStreamParser,
    "google": GeminiStreamParser,
}


def texts_then_error(parser: Any, reads: list[bytes]) -> tuple[list[str], str]:
    """The texts the route delivers (each read's, then those the error carries) and the
    error's message."""
    texts: list[str] = []

    def read_all() -> None:
        for read in reads:
            texts.extend(d.text for d in parser.feed(read) if isinstance(d, TextDelta))

    with pytest.raises(UpstreamProtocolError) as info:
        read_all()
    texts.extend(d.text for d in info.value.pending if isinstance(d, TextDelta))
    return texts, info.value.message


@pytest.mark.parametrize("provider", sorted(GOOD))
@pytest.mark.parametrize("bad", sorted(BAD))
def test_text_before_a_bad_event_goes_out_whatever_the_reads(provider: str, bad: str) -> None:
    good, wrong = GOOD[provider], BAD[bad][provider]
    apart = texts_then_error(PARSERS[provider](), [good, wrong])
    together = texts_then_error(PARSERS[provider](), [good + wrong])
    assert together == apart
    assert together[0] == ["Hello there"]
    assert PROVIDER_WORDS[provider] in together[1]


@pytest.mark.parametrize("provider", sorted(GOOD))
async def test_the_client_gets_the_text_before_a_malformed_event_in_the_same_read(
        serve_runtime: ServeRuntime, provider: str) -> None:
    script: list[Step] = [HEAD, GOOD[provider] + BAD["malformed"][provider]]
    async with hostile(serve_runtime, provider, script) as (served, _):
        events = await run(served, run_input("hi"))
    assert types(events)[-1] == "RUN_ERROR", events
    assert events[-1]["code"] == "UPSTREAM_PROTOCOL_ERROR", events[-1]
    assert text_of(events) == "Hello there"
