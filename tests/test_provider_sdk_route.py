"""The SDK route of the provider adapters (`transport="sdk"`: a proxy in the environment, or a
ready `client=`) ends a broken answer the way the direct route does: an UPSTREAM_* error, on
the AG-UI and the GraphQL protocol alike, and the thread free for the next run.

- A chunked body that turned malformed mid-stream: aiohttp never woke the body reader, so the
  OpenAI and Anthropic runs waited forever (the adapter's timeout never applied) and their
  thread stayed busy; now each wait for the next piece is bounded (`adapters._idle`).
- A malformed answer head through the OpenAI SDK, whose transport passes aiohttp's parse
  error on unmapped: it was AGENT_ERROR, with a stack trace logged.
- A Gemini frame the SDK could not read (not JSON, cut off, not UTF-8, of another shape): it
  was AGENT_ERROR, the logged trace quoting the model's output.
- A Gemini answer streaming for longer than the adapter's timeout: the SDK makes its timeout
  aiohttp's bound on the whole request, so the answer was cut off (UPSTREAM_TIMEOUT); now
  the timeout bounds each wait, as on the direct route.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ag_ui.core import UserMessage
from structlog.testing import capture_logs

from copilot_runtime import OpenAIAdapter
from copilot_runtime._exceptions import UpstreamTimeoutError
from copilot_runtime.adapters._idle import IdleBound, read_timeout
from copilot_runtime.adapters.anthropic import AnthropicAdapter
from copilot_runtime.adapters.base import ChatRequest, TextDelta
from copilot_runtime.adapters.google import GoogleGenAIAdapter
from tests.conftest import ServeRuntime, run_input, text_of
from tests.gql.wire import user_turn
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
    oa_text,
    run,
)

pytestmark = pytest.mark.timeout(60)

#: A stream that should end at once, or after the adapter's 1 s timeout, gets this long.
ENDS_WITHIN_S = 6

CHUNKED_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


FIRST_PIECE = {
    "openai": oa_text("Hello"),
    "anthropic": AN_START + AN_OPEN_TEXT + an_delta({"type": "text_delta", "text": "Hello"}),
    "google": gm_parts({"text": "Hello"}),
}
#: An invalid chunk size after a valid first chunk, then the server closes.
BAD_CHUNK_MID_BODY = b"zz\r\nxx\r\n"


def last(events: list[dict[str, Any]]) -> tuple[str, str]:
    return events[-1]["type"], events[-1].get("code", "")


@pytest.mark.parametrize("provider", ["openai", "anthropic", "google"])
async def test_a_chunked_body_malformed_mid_stream_times_out_and_frees_the_thread(
        serve_runtime: ServeRuntime, provider: str) -> None:
    script: list[Step] = [CHUNKED_HEAD, chunk(FIRST_PIECE[provider]), 0.1, BAD_CHUNK_MID_BODY]
    async with hostile(serve_runtime, provider, script, ANSWER[provider]("all good"),
                       transport="sdk", timeout=1) as (served, _):
        async with asyncio.timeout(ENDS_WITHIN_S):
            events = await run(served, run_input("hi"))
        assert last(events) == ("RUN_ERROR", "UPSTREAM_TIMEOUT"), events[-1]
        assert PROVIDER_WORDS[provider] in events[-1]["message"]
        follow_up = await run(served, run_input("again", run="run-2"))
    assert text_of(follow_up) == "all good"


MALFORMED_HEAD: dict[str, list[Step]] = {
    "bad status line": [b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n"],
    "bad chunk size with the head": [CHUNKED_HEAD + b"zz\r\nxx\r\n"],
}


@pytest.mark.parametrize("case", MALFORMED_HEAD)
@pytest.mark.parametrize("provider", ["openai", "anthropic", "google"])
async def test_a_malformed_answer_head_is_a_protocol_error(
        serve_runtime: ServeRuntime, provider: str, case: str) -> None:
    async with hostile(serve_runtime, provider, MALFORMED_HEAD[case], transport="sdk") \
            as (served, _):
        async with asyncio.timeout(ENDS_WITHIN_S):
            events = await run(served, run_input("hi"))
    assert last(events) == ("RUN_ERROR", "UPSTREAM_PROTOCOL_ERROR"), events[-1]
    said = f"The {PROVIDER_WORDS[provider]} API sent a malformed HTTP answer"
    assert events[-1]["message"] == said


SECRET_WORDS = "Hello there, model output"
GM_CHUNK = gm_parts({"text": SECRET_WORDS})
GZIP_HEAD = HEAD.replace(b"Connection:", b"Content-Encoding: gzip\r\nConnection:")
UNREADABLE_GEMINI: dict[str, list[Step]] = {
    "malformed JSON data line": [HEAD, GM_CHUNK, b"data: {not json\n\n"],
    "body closed mid-line": [HEAD, GM_CHUNK, GM_CHUNK[:40]],
    "gzip body cut short": [GZIP_HEAD, gzip.compress(GM_CHUNK * 50)[:60]],
    "not UTF-8": [HEAD, GM_CHUNK, b'data: {"candidates":[{"content":{"parts":[{"text":"'
                  + SECRET_WORDS.encode() + b'\xff\xfe"}]}}]}\n\n'],
    "a number, not an object": [HEAD, GM_CHUNK, b"data: 5\n\n"],
    "a field of the wrong type": [HEAD, GM_CHUNK, b'data: {"usageMetadata": '
                                  b'{"promptTokenCount": "' + SECRET_WORDS.encode() + b'"}}\n\n'],
}


@pytest.mark.parametrize("case", UNREADABLE_GEMINI)
async def test_a_gemini_frame_the_sdk_cannot_read_is_a_protocol_error(
        serve_runtime: ServeRuntime, case: str) -> None:
    async with hostile(serve_runtime, "google", UNREADABLE_GEMINI[case],
                       ANSWER["google"]("all good"), transport="sdk") as (served, _):
        with capture_logs() as logs:
            async with asyncio.timeout(ENDS_WITHIN_S):
                events = await run(served, run_input("hi"))
        follow_up = await run(served, run_input("again", run="run-2"))
    assert last(events) == ("RUN_ERROR", "UPSTREAM_PROTOCOL_ERROR"), events[-1]
    assert "Gemini" in events[-1]["message"]
    assert SECRET_WORDS not in events[-1]["message"]
    # No crash logged with its trace, whose SDK messages quoted the frame.
    assert not [entry for entry in logs if entry["event"] == "agent failed"], logs
    assert text_of(follow_up) == "all good"


@pytest.mark.parametrize(("provider", "script", "code"), [
    ("openai", [CHUNKED_HEAD, chunk(FIRST_PIECE["openai"]), 0.1, BAD_CHUNK_MID_BODY],
     "UPSTREAM_TIMEOUT"),
    ("openai", MALFORMED_HEAD["bad status line"], "UPSTREAM_PROTOCOL_ERROR"),
    ("google", UNREADABLE_GEMINI["malformed JSON data line"], "UPSTREAM_PROTOCOL_ERROR"),
])
async def test_graphql_reports_the_same_upstream_failures(
        serve_runtime: ServeRuntime, provider: str, script: list[Step], code: str) -> None:
    async with hostile(serve_runtime, provider, script, transport="sdk", timeout=1) \
            as (served, _):
        async with asyncio.timeout(ENDS_WITHIN_S):
            result = await served.generate(user_turn("hi"))
    status = result["status"]
    assert status["code"] == "Failed", status
    assert status["details"]["originalError"]["originalErrorType"] == code, status
    assert PROVIDER_WORDS[provider] in status["details"]["description"], status


# -- the bound itself ----------------------------------------------------------------------


async def _pieces(*waits: float) -> AsyncIterator[int]:
    for number, wait in enumerate(waits):
        await asyncio.sleep(wait)
        yield number


@pytest.mark.timeout(10)
async def test_the_bound_counts_only_the_waits_for_a_piece() -> None:
    """A consumer slow between reads (a client's backpressure) is no silent upstream."""
    pieces = IdleBound(_pieces(0.05, 0.05, 0.05), 0.2, "silent")
    got = []
    try:
        async for number in pieces:
            got.append(number)
            await asyncio.sleep(0.3)
    finally:
        pieces.close()
    assert got == [0, 1, 2]


@pytest.mark.timeout(10)
async def test_the_bound_ends_a_silent_wait() -> None:
    pieces = IdleBound(_pieces(0.0, 5.0), 0.2, "nothing for 0.2 s")
    started = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamTimeoutError, match=r"nothing for 0\.2 s"):
        async for _ in pieces:
            pass
    pieces.close()
    assert asyncio.get_running_loop().time() - started < 2
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # the bound's own cancellation was taken back


@pytest.mark.timeout(10)
async def test_a_stop_during_a_wait_stays_a_cancellation() -> None:
    pieces = IdleBound(_pieces(5.0), 0.2, "silent")

    async def consume() -> None:
        async for _ in pieces:
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    task.cancel()  # then the bound expires while the cancelled task unwinds: still a stop
    with pytest.raises(asyncio.CancelledError):
        await task
    pieces.close()


# -- a long answer through the Gemini SDK --------------------------------------------------

#: A piece every 0.3 s for 2.4 s: never silent for the 1 s timeout, but longer in all.
LONG_GEMINI_ANSWER: list[Step] = [
    CHUNKED_HEAD,
    *(step for n in range(8) for step in (chunk(gm_parts({"text": f"{n} "})), 0.3)),
    chunk(gm_parts(reason="STOP", usage={"promptTokenCount": 3, "candidatesTokenCount": 8})),
    b"0\r\n\r\n",
]


async def test_a_gemini_answer_longer_than_the_timeout_is_not_cut_through_the_sdk(
        serve_runtime: ServeRuntime) -> None:
    """The SDK gives aiohttp its timeout as the bound on the whole request: an answer that
    streamed for longer than the adapter's timeout was cut off (UPSTREAM_TIMEOUT) though
    the model never fell silent. The timeout bounds each wait, as on the direct route."""
    async with hostile(serve_runtime, "google", LONG_GEMINI_ANSWER, transport="sdk",
                       timeout=1) as (served, _):
        async with asyncio.timeout(ENDS_WITHIN_S):
            events = await run(served, run_input("hi"))
    assert last(events) == ("RUN_FINISHED", ""), events[-1]
    assert text_of(events) == "".join(f"{n} " for n in range(8))


async def test_a_gemini_head_that_never_comes_still_times_out_through_the_sdk(
        serve_runtime: ServeRuntime) -> None:
    """Regression guard, passes on the old code too: with the SDK's bound on the whole
    request gone, the wait for the answer's head is still bounded (by IdleBound)."""
    silent_s = 3.0  # (the 1 s bound took 2 s on a loaded machine)
    async with hostile(serve_runtime, "google", [silent_s], ANSWER["google"]("all good"),
                       transport="sdk", timeout=1) as (served, upstream):
        started = asyncio.get_running_loop().time()
        async with asyncio.timeout(ENDS_WITHIN_S):
            events = await run(served, run_input("hi"))
        assert asyncio.get_running_loop().time() - started < silent_s
        follow_up = await run(served, run_input("again", run="run-2"))
        # the silent connection's handler ends before the upstream does (nothing left open)
        await asyncio.sleep(max(0.0, started + silent_s + 0.2
                                - asyncio.get_running_loop().time()))
    assert last(events) == ("RUN_ERROR", "UPSTREAM_TIMEOUT"), events[-1]
    assert events[-1]["message"] == "Gemini request timed out"
    assert text_of(follow_up) == "all good"
    assert len(upstream.requests) == 2  # a silent head is not retried, as before



# ---- a ready client= keeps its own read timeout ------------------------------------------------


@contextlib.asynccontextmanager
async def ready_client(provider: str, url: str, read_timeout_s: float | None
                       ) -> AsyncIterator[Any]:
    """The app's own SDK client (over aiohttp, as the adapters' own SDK clients are), whose
    read timeout is `read_timeout_s`; closed here, as the app closes it (not the adapter)."""
    made: Any
    if provider == "openai":
        import openai

        made = openai.AsyncOpenAI(
            api_key="sk-mock", base_url=url + "/v1", timeout=read_timeout_s, max_retries=0,
            http_client=openai.DefaultAioHttpClient(timeout=read_timeout_s))
    elif provider == "anthropic":
        import anthropic

        made = anthropic.AsyncAnthropic(
            api_key="sk-mock", base_url=url, timeout=read_timeout_s, max_retries=0,
            http_client=anthropic.DefaultAioHttpClient(timeout=read_timeout_s))
    else:
        import aiohttp
        from google import genai
        from google.genai import types as genai_types

        # (a session of our own: the SDK's default one warns of its deprecated subclassing)
        async with aiohttp.ClientSession() as session:
            yield genai.Client(api_key="mock-key", http_options=genai_types.HttpOptions(
                base_url=url, retry_options=genai_types.HttpRetryOptions(attempts=1),
                aiohttp_client=session,
                timeout=None if read_timeout_s is None else round(read_timeout_s * 1000)))
        return
    try:
        yield made
    finally:
        await made.close()


def adapter_of(provider: str, **options: Any) -> Any:
    return {"openai": OpenAIAdapter, "anthropic": AnthropicAdapter,
            "google": GoogleGenAIAdapter}[provider](**options)


async def answer(adapter: Any) -> list[Any]:
    async with asyncio.timeout(ENDS_WITHIN_S):
        return [d async for batch in adapter.stream(ChatRequest(messages=[
            UserMessage(id="u", content="hi")])) for d in batch]


@pytest.mark.parametrize("provider", ["openai", "anthropic", "google"])
async def test_a_ready_clients_own_read_timeout_bounds_each_wait(provider: str) -> None:
    """A ready client given no adapter timeout: each wait was bounded by the adapter's
    default 120 s, which the app never set; now by the client's own read timeout (here
    1 s, on a body that would leave aiohttp's reader waiting forever). (Gemini's SDK also
    bounds the whole request by its `HttpOptions` timeout: there a regression guard.)"""
    script: list[Step] = [CHUNKED_HEAD, chunk(FIRST_PIECE[provider]), 0.1, BAD_CHUNK_MID_BODY]
    async with ScriptedUpstream(script) as upstream, \
            ready_client(provider, upstream.url, 1.0) as client:
        adapter = adapter_of(provider, client=client)
        try:
            with pytest.raises(UpstreamTimeoutError):
                await answer(adapter)
        finally:
            await adapter.aclose()


@pytest.mark.parametrize("provider", ["openai", "anthropic", "google"])
@pytest.mark.parametrize(("client_s", "adapter_s", "bound_s"), [
    (600.0, None, 600.0),  # the client's own (AsyncOpenAI(timeout=600)), not 120
    # A client without a read timeout (`genai.Client(api_key=...)`, the usual): the
    # adapter's default, not unbounded (a silent upstream held the run for ever).
    (None, None, 120.0),
    (600.0, 5.0, 5.0),     # an explicit adapter timeout still applies
])
async def test_the_wait_bound_of_a_ready_client(
        monkeypatch: pytest.MonkeyPatch, provider: str, client_s: float | None,
        adapter_s: float | None, bound_s: float | None) -> None:
    bounds: list[float | None] = []

    class Recording(IdleBound[Any]):
        def __init__(self, pieces: AsyncIterator[Any], seconds: float | None,
                     silent: str) -> None:
            bounds.append(seconds)
            super().__init__(pieces, seconds, silent)

    monkeypatch.setattr(f"copilot_runtime.adapters.{provider}.IdleBound", Recording)
    async with ScriptedUpstream(ANSWER[provider]("all good")) as upstream, \
            ready_client(provider, upstream.url, client_s) as client:
        options: dict[str, Any] = {} if adapter_s is None else {"timeout": adapter_s}
        adapter = adapter_of(provider, client=client, **options)
        try:
            deltas = await answer(adapter)
        finally:
            await adapter.aclose()
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "all good"
    assert bounds == [bound_s]


def test_read_timeout_of_sdk_settings() -> None:
    import httpx

    assert read_timeout(600) == 600.0
    assert read_timeout(httpx.Timeout(5.0, read=30.0)) == 30.0
    assert read_timeout(httpx.Timeout(None)) is None
    assert read_timeout(None) is None
