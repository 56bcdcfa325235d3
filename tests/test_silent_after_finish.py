"""An upstream that goes silent after its answer, the connection left open.

Some OpenAI-compatible servers and proxies send the chunk with `finish_reason` (and the usage
chunk asked for with `stream_options.include_usage`), then neither `data: [DONE]` nor the
body's end: every run waited for the adapter's read timeout and ended with a timeout error,
though the whole answer had arrived (a tool call was never run). Now the finish reason
completes the answer: the usage chunk still to come is waited for only briefly
(`FINISHED_WAIT`), then the run finishes normally and the upstream response is closed.
Gemini (`finishReason` on its last chunk, no end marker) waited for the body's end the same
way; Anthropic's `message_stop` already ended its answer, but the direct route kept the
connection open for ever, waiting for the body's end to reuse it. Both routes of each adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from copilot_runtime import CopilotRuntime, action
from copilot_runtime.adapters._direct import FINISHED_WAIT
from tests.conftest import RawServer, ServeRuntime, run_input, text_of, types
from tests.test_hostile_providers import (
    AN_START,
    an_end,
    an_text_block,
    gm_parts,
    make_adapter,
    oa_finish,
    oa_text,
    oa_tool,
    run,
    sse,
)

pytestmark = pytest.mark.timeout(30)

TRANSPORTS = ["direct", "sdk"]
#: The adapters' read timeout here: a run that waits for it fails the test.
TIMEOUT = 10
USAGE = sse({"id": "c", "object": "chat.completion.chunk", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
#: A keep-alive answer with a chunked body (a server that could send more, and does not).
CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
           b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n")


@action
def look_up_weather(city: str) -> dict[str, str]:
    """The weather in a city."""
    return {"city": city, "sky": "sunny"}


class SilentUpstream(RawServer):
    """Answers request N with events N (the last ones again after that), each an HTTP
    chunk, then sends nothing more and keeps the connection open until the client closes
    it. `silent_since` holds when it went silent (`time.monotonic()`), `closed_after` how
    long after that each client closed."""

    def __init__(self, *answers: list[bytes]) -> None:
        super().__init__()
        self.answers = answers
        self.requests = 0
        self.silent_since = 0.0
        self.closed_after: list[float] = []
        self.closed = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:  # (a keep-alive connection may carry the next request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.requests += 1
                writer.write(CHUNKED)
                for event in self.answers[min(self.requests, len(self.answers)) - 1]:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                silent_since = self.silent_since = time.monotonic()
                # Silent from here: only the client's close (or a next request) ends this.
                if not await reader.read(1):
                    self.closed_after.append(time.monotonic() - silent_since)
                    self.closed.set()
                    break
        writer.close()


async def _run(serve_runtime: ServeRuntime, provider: str, transport: str,
               *answers: list[bytes]) -> tuple[list[dict[str, Any]], float, SilentUpstream]:
    """The run's events, how long it took after the (last) upstream went silent, and the
    upstream, once it has seen every connection closed."""
    async with SilentUpstream(*answers) as upstream:
        runtime = CopilotRuntime(
            service_adapter=make_adapter(provider, upstream.url, transport, timeout=TIMEOUT),
            actions=[look_up_weather])
        async with serve_runtime(runtime) as served:
            events = await run(served, run_input("weather?"))
            # (from the upstream's silence on: not the first use's imports and connection)
            took = time.monotonic() - upstream.silent_since
            # The upstream response is closed: the server sees its client go.
            async with asyncio.timeout(FINISHED_WAIT + 3):
                while len(upstream.closed_after) < upstream.requests:
                    await upstream.closed.wait()
                    upstream.closed.clear()
        return events, took, upstream


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_finish_and_usage_then_silence_finishes_the_run_at_once(
        serve_runtime: ServeRuntime, transport: str) -> None:
    events, took, upstream = await _run(
        serve_runtime, "openai", transport,
        [oa_text("part1 "), oa_text("part2"), oa_finish("stop"), USAGE])
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert text_of(events) == "part1 part2"
    assert took < FINISHED_WAIT, took  # nothing was left to wait for
    assert upstream.closed_after[0] < FINISHED_WAIT + 1, upstream.closed_after


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_usage_that_never_comes_is_waited_for_briefly(
        serve_runtime: ServeRuntime, transport: str) -> None:
    events, took, upstream = await _run(
        serve_runtime, "openai", transport,
        [oa_text("part1 "), oa_text("part2"), oa_finish("stop")])
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert text_of(events) == "part1 part2"
    assert FINISHED_WAIT - 0.2 < took < FINISHED_WAIT + 2, took
    assert upstream.closed_after[0] < FINISHED_WAIT + 1, upstream.closed_after


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_tool_calls_then_silence_are_run(serve_runtime: ServeRuntime,
                                               transport: str) -> None:
    calls = [oa_tool(0, "call_1", "look_up_weather", '{"city":"Oslo"}'),
             oa_finish("tool_calls"), USAGE]
    then = [oa_text("Sunny in Oslo."), oa_finish("stop"), USAGE]
    events, took, upstream = await _run(serve_runtime, "openai", transport, calls, then)
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    (result,) = [e for e in events if e["type"] == "TOOL_CALL_RESULT"]
    assert "sunny" in result["content"]
    assert text_of(events) == "Sunny in Oslo."
    assert upstream.requests == 2
    assert took < FINISHED_WAIT, took


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_anthropic_message_stop_then_silence_finishes_the_run(
        serve_runtime: ServeRuntime, transport: str) -> None:
    events, took, _ = await _run(serve_runtime, "anthropic", transport,
                                 [AN_START, *an_text_block("Hello"), *an_end()])
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert text_of(events) == "Hello"
    assert took < FINISHED_WAIT, took


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_gemini_finish_reason_then_silence_finishes_the_run(
        serve_runtime: ServeRuntime, transport: str) -> None:
    events, took, _ = await _run(serve_runtime, "google", transport, [
        gm_parts({"text": "Hello"}),
        gm_parts(reason="STOP", usage={"promptTokenCount": 3, "candidatesTokenCount": 2})])
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert text_of(events) == "Hello"
    # (through the SDK the rest is still waited for: only its end or a failed read
    # releases the SDK's response)
    assert took < (FINISHED_WAIT if transport == "direct" else FINISHED_WAIT + 2), took


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_gemini_finish_reason_without_usage_then_silence_is_waited_for_briefly(
        serve_runtime: ServeRuntime, transport: str) -> None:
    events, took, _ = await _run(serve_runtime, "google", transport,
                                 [gm_parts({"text": "Hello"}, reason="STOP")])
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert text_of(events) == "Hello"
    assert took < FINISHED_WAIT + 2, took


class PacedUpstream(RawServer):
    """A sound keep-alive upstream that flushes each event apart: the usage chunk, then
    (50 ms later) `[DONE]` and the body's end. `connections` counts the client's."""

    def __init__(self) -> None:
        super().__init__()
        self.connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(CHUNKED)
                for event in (oa_text("hi"), oa_finish("stop"), USAGE, b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    await asyncio.sleep(0.05)
                writer.write(b"0\r\n\r\n")
        writer.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_sound_upstreams_connection_is_reused_after_the_answer(
        serve_runtime: ServeRuntime, transport: str) -> None:
    """The answer is complete at its usage chunk, but the body goes on to `[DONE]`: the
    SDK route closed the response there, so its client dropped the connection and every
    answer opened a new one. It reads on briefly to the body's end now."""
    async with PacedUpstream() as upstream:
        runtime = CopilotRuntime(
            service_adapter=make_adapter("openai", upstream.url, transport, timeout=TIMEOUT))
        async with serve_runtime(runtime) as served:
            for i in range(3):
                events = await run(served, run_input("hi", thread=f"t{i}"))
                assert types(events)[-1] == "RUN_FINISHED", events[-1]
                # (the direct route hands its connection back to drain on its own: the
                # next request would find it still busy, and open another, sooner)
                await asyncio.sleep(0.3)
    assert upstream.connections == 1
