"""A provider's Retry-After is waited for only within the adapter's bound (`max_retry_wait`).

Each provider's SDK retries a 429 or a 5xx, honouring its Retry-After (Anthropic's for any
length, OpenAI's up to two minutes; Gemini's SDK waits its own back-off). A chat user would
sit before a silent, open stream for as long as the provider asks, an hour for
`Retry-After: 3600`. Each adapter now waits at most `max_retry_wait` seconds, in all: past
that the run ends at once with the provider's error (`UPSTREAM_ERROR`, its HTTP status),
whose message says it is rate-limiting or unavailable and when to try again. A stop or a
disconnect during a wait ends it at once, and no further request is sent. Run on the
loopback mocks of each provider's wire format.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ag_ui.core import UserMessage
from aiohttp import web

from copilot_runtime import (
    AnthropicAdapter,
    ConfigurationError,
    CopilotRuntime,
    GoogleGenAIAdapter,
    OpenAIAdapter,
    UpstreamError,
)
from copilot_runtime.adapters import ChatRequest, TextDelta
from copilot_runtime.adapters.base import ServiceAdapter
from copilot_runtime.testing import (
    MockAnthropicServer,
    MockGeminiServer,
    MockOpenAIServer,
    verify_events,
)
from tests.conftest import ServeRuntime, parse_sse, poll, run_input, types

TIMEOUT_S = 10
HOUR = "3600"


class RateLimitedGemini(MockGeminiServer):
    """The Gemini mock, answering its next `limited` requests 429 RESOURCE_EXHAUSTED with
    the API's `RetryInfo` (how Gemini says when to come back: no Retry-After header)."""

    def __init__(self) -> None:
        super().__init__(chunks=4)
        self.limited = 0
        self.retry_delay = HOUR + "s"

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if not self.limited:
            return await super()._generate(request)
        self.limited -= 1
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response({"error": {
            "code": 429, "message": "Resource has been exhausted (e.g. check quota).",
            "status": "RESOURCE_EXHAUSTED", "details": [{
                "@type": "type.googleapis.com/google.rpc.RetryInfo",
                "retryDelay": self.retry_delay}]}}, status=429)


Mock = MockOpenAIServer | MockAnthropicServer | RateLimitedGemini


class Provider:
    """One adapter on its mock, with a way to make the mock refuse the next requests."""

    def __init__(self, name: str, mock: Mock) -> None:
        self.name = name
        self.mock = mock

    def adapter(self, **options: Any) -> ServiceAdapter:
        options.setdefault("max_retries", 2)
        if self.name == "openai":
            return OpenAIAdapter(base_url=self.mock.base_url, api_key="sk-mock", **options)
        if self.name == "anthropic":
            return AnthropicAdapter(base_url=self.mock.base_url, api_key="sk-mock", **options)
        return GoogleGenAIAdapter(base_url=self.mock.base_url, api_key="mock-key", **options)

    def refuse(self, times: int, retry_after: str, status: int = 429) -> None:
        """The next `times` requests are answered `status`, asking for `retry_after` s."""
        if isinstance(self.mock, RateLimitedGemini):
            assert status == 429
            self.mock.limited = times
            self.mock.retry_delay = retry_after + "s"
        else:
            self.mock.statuses = [status] * times
            self.mock.retry_after = retry_after

    @property
    def requests(self) -> int:
        return len(self.mock.headers)

    @property
    def words(self) -> str:
        return {"openai": "OpenAI", "anthropic": "Anthropic", "google": "Gemini"}[self.name]


@pytest.fixture(params=["openai", "anthropic", "google"])
async def provider(request: pytest.FixtureRequest,
                   monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Provider]:
    import copilot_runtime.adapters.google as google

    # Gemini's SDK waits its back-off (from 1 s, plus up to 1 s of jitter) whatever the
    # answer asks: made short so the tests stay fast.
    monkeypatch.setattr(google, "_RETRY_INITIAL", 0.05)
    monkeypatch.setattr(google.random, "random", lambda: 0.0)
    mock: Mock = {"openai": lambda: MockOpenAIServer(chunks=4),
                  "anthropic": lambda: MockAnthropicServer(chunks=4),
                  "google": RateLimitedGemini}[request.param]()
    async with mock:
        yield Provider(request.param, mock)


async def answer(adapter: ServiceAdapter, text: str = "hello") -> str:
    try:
        async with asyncio.timeout(TIMEOUT_S):
            deltas = [d async for batch in adapter.stream(ChatRequest(
                messages=[UserMessage(id="u", content=text)])) for d in batch]
    finally:
        await adapter.aclose()
    return "".join(d.text for d in deltas if isinstance(d, TextDelta))


async def failure(adapter: ServiceAdapter) -> tuple[UpstreamError, float]:
    """The error the adapter ends with, and how long it took."""
    started = time.monotonic()
    with pytest.raises(UpstreamError) as info:
        await answer(adapter)
    return info.value, time.monotonic() - started


async def test_a_retry_after_past_the_bound_is_an_error_at_once(provider: Provider) -> None:
    provider.refuse(3, HOUR)
    error, took = await failure(provider.adapter())  # the default bound: 60 s
    assert took < 1.0
    assert provider.requests == 1  # not tried again
    assert type(error) is UpstreamError
    assert (error.code, error.status) == ("UPSTREAM_ERROR", 429)
    assert error.message.startswith(f"{provider.words} request failed with HTTP 429: ")
    assert error.message.endswith(
        f"({provider.words} is rate-limiting requests: try again in 3600 s)")


async def test_a_retry_after_within_the_bound_is_waited_for(provider: Provider) -> None:
    provider.refuse(1, "1")
    started = time.monotonic()
    # The SDKs' wait (Gemini's: its back-off, made short here), not the bound, sets how long.
    assert await answer(provider.adapter(max_retry_wait=1.5)) == "echo: hello"
    if provider.name != "google":
        assert time.monotonic() - started >= 0.9
    assert provider.requests == 2


async def test_the_waits_add_up_to_no_more_than_the_bound(provider: Provider) -> None:
    if provider.name == "google":
        provider.refuse(5, "0.1")
        adapter = provider.adapter(max_retries=5, max_retry_wait=0.12)  # 0.05, not 0.05 + 0.1
    else:
        provider.refuse(5, "0.25")
        adapter = provider.adapter(max_retries=5, max_retry_wait=0.6)  # two waits, not three
    error, took = await failure(adapter)
    assert provider.requests == (2 if provider.name == "google" else 3)
    assert took < 1.0
    assert error.status == 429
    assert error.message.endswith(
        f"({provider.words} is rate-limiting requests: try again in 1 s)")


async def test_a_back_off_past_the_bound_is_not_waited(provider: Provider) -> None:
    """A provider that asks nothing gets the SDK's back-off, within the bound too."""
    if provider.name == "google":
        provider.refuse(3, "0")
    else:
        provider.refuse(3, "0", status=503)
    error, took = await failure(provider.adapter(max_retry_wait=0.01))
    assert provider.requests == 1
    assert took < 1.0
    assert "try again" not in error.message  # (it did not say when)


async def test_the_bound_is_a_number_of_seconds() -> None:
    for bad in (-1, float("nan"), float("inf"), "60", True):
        for make in (OpenAIAdapter, AnthropicAdapter, GoogleGenAIAdapter):
            with pytest.raises(ConfigurationError, match="max_retry_wait"):
                make(api_key="k", max_retry_wait=bad)  # type: ignore[arg-type]
    assert OpenAIAdapter(api_key="k", max_retry_wait=0)._max_retry_wait == 0.0


@pytest.mark.parametrize(("name", "route"), [("openai", "direct"), ("openai", "sdk"),
                                             ("anthropic", "direct"), ("anthropic", "sdk")])
async def test_the_sdk_route_ends_alike(name: str, route: str) -> None:
    """The SDK route (taken with an HTTP proxy in the environment) holds to the bound too:
    Anthropic's SDK would wait out any Retry-After, an hour here, with the stream open and
    silent; its error says the same as the adapter's own route."""
    mock: MockOpenAIServer | MockAnthropicServer
    async with MockOpenAIServer(chunks=4) if name == "openai" \
            else MockAnthropicServer(chunks=4) as mock:
        mock.statuses, mock.retry_after = [429, 429, 429], HOUR
        error, took = await failure(Provider(name, mock).adapter(transport=route))
        assert len(mock.headers) == 1
        mock.statuses, mock.retry_after = [503], "0.1"
        assert await answer(Provider(name, mock).adapter(transport=route)) == "echo: hello"
        assert len(mock.headers) == 3  # a wait within the bound is the SDK's, as before
    assert took < 1.0
    words = Provider(name, mock).words
    assert error.message == (f"{words} request failed with HTTP 429: mock error 429 "
                             f"({words} is rate-limiting requests: try again in 3600 s)")


@pytest.mark.parametrize("name", ["openai", "anthropic"])
async def test_the_sdk_route_holds_to_a_short_bound(name: str) -> None:
    """OpenAI's SDK waits any Retry-After up to a minute of its own: a bound of one second
    is still one second on its route."""
    mock: MockOpenAIServer | MockAnthropicServer
    async with MockOpenAIServer(chunks=4) if name == "openai" \
            else MockAnthropicServer(chunks=4) as mock:
        mock.statuses, mock.retry_after = [503, 503, 503], "30"
        error, took = await failure(Provider(name, mock).adapter(
            transport="sdk", max_retry_wait=1))
    assert took < 1.0
    assert len(mock.headers) == 1
    assert error.status == 503
    assert error.message.endswith("unavailable: try again in 30 s)")


# ---- a whole run -----------------------------------------------------------------------------

async def test_the_run_ends_with_run_error_and_the_graphql_status_says_why(
        serve_runtime: ServeRuntime) -> None:
    from tests.gql.wire import user_turn
    from tests.test_graphql_protocol import generate

    async with MockAnthropicServer(chunks=4) as mock:
        runtime = CopilotRuntime(service_adapter=AnthropicAdapter(
            base_url=mock.base_url, api_key="sk-mock"))
        async with asyncio.timeout(TIMEOUT_S), serve_runtime(runtime) as served:
            mock.statuses, mock.retry_after = [429] * 3, HOUR
            started = time.monotonic()
            events = await served.run(run_input("hello"))
            took = time.monotonic() - started
            mock.statuses, mock.retry_after = [529] * 3, HOUR
            result, _ = await generate(served, user_turn("hello", thread="gql"))
    verify_events(events)
    assert took < 1.0
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"]
    assert events[-1]["code"] == "UPSTREAM_ERROR"
    assert events[-1]["message"] == (
        "Anthropic request failed with HTTP 429: mock error 429 "
        "(Anthropic is rate-limiting requests: try again in 3600 s)")
    status = result["status"]
    assert status["code"] == "Failed"
    assert status["details"]["description"] == (
        "Anthropic request failed with HTTP 529: mock error 529 "
        "(Anthropic is unavailable: try again in 3600 s)")
    assert status["details"]["originalError"]["code"] == "NETWORK_ERROR"
    assert status["details"]["originalError"]["originalErrorType"] == "UPSTREAM_ERROR"
    assert len(mock.headers) == 2  # one request a run


@pytest.mark.parametrize("how", ["stop", "disconnect"])
async def test_a_stop_or_a_disconnect_ends_the_wait_at_once(
        serve_runtime: ServeRuntime, how: str) -> None:
    async with MockAnthropicServer(chunks=4) as mock:
        # A disconnect stops the run at once (0), as a stop does.
        runtime = CopilotRuntime(service_adapter=AnthropicAdapter(
            base_url=mock.base_url, api_key="sk-mock"), detached_run_seconds=0)
        async with asyncio.timeout(TIMEOUT_S), serve_runtime(runtime) as served:
            mock.statuses, mock.retry_after = [429] * 3, "30"  # within the bound: waited
            response = await served.post("/agent/default/run",
                                         run_input("hello", thread="t-wait"))
            async for _ in poll(every=0.01):
                if mock.headers:
                    break
            await asyncio.sleep(0.1)  # the adapter is in its wait
            started = time.monotonic()
            if how == "stop":
                stop = await served.post("/agent/default/stop/t-wait", {"runId": "run-1"})
                assert (await stop.json())["stopped"] is True
                events = parse_sse(await response.read())
                verify_events(events)
                assert types(events)[0] == "RUN_STARTED"
                assert types(events)[-1] in ("RUN_FINISHED", "RUN_ERROR")
            else:
                response.close()
            async for _ in poll(every=0.01):
                if "t-wait" not in served.runtime.runs.active:
                    break
            assert "t-wait" not in served.runtime.runs.active
            assert time.monotonic() - started < 1.0
            await asyncio.sleep(0.3)
            assert len(mock.headers) == 1  # the wait was not carried on to a retry
