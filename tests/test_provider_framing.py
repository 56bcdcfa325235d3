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
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from ag_ui.core import UserMessage

from copilot_runtime._exceptions import UpstreamError, UpstreamProtocolError
from copilot_runtime._held import HeldBytes
from copilot_runtime.adapters.anthropic import AnthropicStreamParser
from copilot_runtime.adapters.base import ChatRequest, TextDelta
from copilot_runtime.adapters.google import GeminiStreamParser
from copilot_runtime.adapters.openai import ChatCompletionsStreamParser
from tests.conftest import ServeRuntime, run_input, text_of, types
from tests.test_hostile_providers import (
    AN_OPEN_TEXT,
    AN_START,
    ANSWER,
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


# ---- legal SSE framing ------------------------------------------------------------------------


def several_data_lines(step: Step) -> Step:
    """Each event's JSON split over two `data:` lines, after its first comma."""
    if not isinstance(step, bytes):
        return step
    lines = []
    for line in step.split(b"\n"):
        comma = line.find(b",")
        if line.startswith(b"data: {") and comma >= 0:
            line = line[:comma + 1] + b"\ndata: " + line[comma + 1:]
        lines.append(line)
    return b"\n".join(lines)


def bare_cr(step: Step) -> Step:
    return step.replace(b"\r\n", b"\n").replace(b"\n", b"\r") if isinstance(step, bytes) else step


def bare_cr_split(body: list[Step]) -> list[Step]:
    """Bare "\\r" line ends, the first of them the last byte of the first read."""
    first, *rest = (bare_cr(step) for step in body)
    assert isinstance(first, bytes)
    at = first.index(b"\r") + 1
    return [first[:at], 0.05, first[at:], *rest]


BOM = b"\xef\xbb\xbf"
FRAMINGS: dict[str, Callable[[list[Step]], list[Step]]] = {
    "several_data_lines": lambda body: [several_data_lines(step) for step in body],
    "byte_order_mark": lambda body: [BOM + body[0], *body[1:]],  # type: ignore[operator]
    "byte_order_mark_split": lambda body: [BOM[:2], 0.05, BOM[2:], *body],
    "bare_cr": lambda body: [bare_cr(step) for step in body],
    "bare_cr_split": bare_cr_split,
}


@pytest.mark.parametrize("provider", ["openai", "anthropic", "google"])
@pytest.mark.parametrize("framing", FRAMINGS)
async def test_legal_sse_framing_is_an_answer(serve_runtime: ServeRuntime, provider: str,
                                              framing: str) -> None:
    head, *body = ANSWER[provider]("hello there")
    script = [head, *FRAMINGS[framing](body)]
    async with hostile(serve_runtime, provider, script) as (served, _):
        events = await run(served, run_input("hi"))
    assert types(events)[-1] == "RUN_FINISHED", events
    assert text_of(events) == "hello there"


def test_an_event_over_several_lines_split_between_reads_is_read_whole() -> None:
    """Gemini's parser reads line by line: the event's second `data:` line comes later."""
    frame = several_data_lines(gm_parts({"text": "hello there"}))
    assert isinstance(frame, bytes)
    frame = frame.replace(b"\n", b"\r\n")
    second = frame.index(b"\r\ndata:") + 2
    parser = GeminiStreamParser()
    deltas = [*parser.feed(frame[:second]), *parser.feed(frame[second:])]
    assert [d.text for d in deltas if isinstance(d, TextDelta)] == ["hello there"]


@pytest.mark.parametrize("provider", sorted(PARSERS))
@pytest.mark.parametrize("line_end", [b"\n", b"\r\n"])
def test_a_plain_stream_reads_on_as_before_after_its_start(provider: str,
                                                           line_end: bytes) -> None:
    """The start's checks (a byte-order mark, bare "\\r" line ends) end with the first line
    end: every read after it takes the path it took before them."""
    parser = PARSERS[provider]()
    parser.feed(GOOD[provider].replace(b"\r\n", b"\n").replace(b"\n", line_end))
    assert type(parser._held) is HeldBytes


def test_lines_that_never_end_their_event_cost_their_length_once() -> None:
    """`data:` lines never ended by a blank line, after one that is not JSON alone: Gemini's
    parser, which reads line by line, held them as an event still to come and would read all
    it held again with each line (quadratic: 99 s for 16 MiB); now once."""
    parser = GeminiStreamParser()
    body = b"data: x\n" * (4 * 2**20 // 8)
    deadline = time.process_time() + 0.5
    for start in range(0, len(body), 65536):
        assert parser.feed(body[start:start + 65536]) == []
        assert time.process_time() < deadline, f"still reading at byte {start}"
