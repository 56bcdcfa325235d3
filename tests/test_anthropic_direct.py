"""The Anthropic adapter's own HTTP/1.1 route sends what the `anthropic` SDK sends, and fails
alike.

Each case runs through both routes (`transport="direct"`, the default, and `transport="sdk"`)
against the loopback mock, which records bodies and headers: the same body, the same headers
(the key or token, the API version, the SDK's platform and timeout headers, the retry count),
the same retries (429, 529, Retry-After, connection errors) and the same error for each
failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from ag_ui.core import UserMessage

from copilot_runtime import AnthropicAdapter, ConfigurationError, UpstreamError
from copilot_runtime._exceptions import (
    UpstreamConnectionError,
    UpstreamProtocolError,
    UpstreamTimeoutError,
)
from copilot_runtime.adapters import ChatRequest, TextDelta
from copilot_runtime.adapters.base import ToolSpec
from copilot_runtime.testing import MockAnthropicServer
from tests.conftest import free_port, poll
from tests.test_hardening import FaultyLLM

TIMEOUT_S = 30
ROUTES = ("direct", "sdk")


@pytest.fixture
async def mock() -> AsyncIterator[MockAnthropicServer]:
    async with MockAnthropicServer(chunks=4) as server:
        yield server


def adapter(route: str, **options: Any) -> AnthropicAdapter:
    options.setdefault("api_key", "sk-mock")
    options.setdefault("max_retries", 0)
    return AnthropicAdapter(transport=route, **options)  # type: ignore[arg-type]


async def answer(claude: AnthropicAdapter, text: str = "hello",
                 request: ChatRequest | None = None) -> str:
    try:
        async with asyncio.timeout(TIMEOUT_S):
            deltas = [d async for batch in claude.stream(request or ChatRequest(
                messages=[UserMessage(id="u", content=text)])) for d in batch]
    finally:
        await claude.aclose()
    return "".join(d.text for d in deltas if isinstance(d, TextDelta))


async def failure(claude: AnthropicAdapter, text: str = "hello") -> UpstreamError:
    with pytest.raises(UpstreamError) as info:
        await answer(claude, text)
    return info.value


def lowered(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower() != "content-length"}


async def test_default_route_is_direct_and_sdk_is_an_option(
        mock: MockAnthropicServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import anthropic

    assert adapter("auto", base_url=mock.base_url).transport == "direct"
    assert adapter("sdk", base_url=mock.base_url).transport == "sdk"
    client = anthropic.AsyncAnthropic(api_key="k", base_url=mock.base_url,
                                      http_client=anthropic.DefaultAioHttpClient())
    assert AnthropicAdapter(client=client).transport == "sdk"
    with pytest.raises(ConfigurationError, match="transport"):
        adapter("h2")
    with pytest.raises(ConfigurationError, match="without the SDK"):
        AnthropicAdapter(client=client, transport="direct")
    await client.close()
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert adapter("auto", base_url=mock.base_url).transport == "sdk"  # the SDK's proxies


@pytest.mark.parametrize("settings", [
    {"timeout": 30.0},
    {"timeout": 12.5, "max_retries": 3},
])
async def test_same_request_and_headers_as_the_sdk(mock: MockAnthropicServer,
                                                   settings: dict[str, Any]) -> None:
    request = ChatRequest(
        messages=[UserMessage(id="u", content="hello")], system_prompt="Be brief.",
        tools=[ToolSpec("getWeather", "Weather", {"type": "object", "properties": {
            "city": {"type": "string"}}})], temperature=0.2, max_tokens=50, stop=["END"],
        tool_choice="auto")
    for route in ROUTES:
        assert await answer(adapter(route, base_url=mock.base_url, **settings),
                            request=request) == "echo: hello"
    assert mock.requests[0] == mock.requests[1]
    direct, sdk = (lowered(h) for h in mock.headers)
    assert direct == sdk
    assert direct["anthropic-version"]
    assert direct["x-stainless-retry-count"] == "0"


async def test_key_and_base_url_from_the_environment(
        mock: MockAnthropicServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-from-env")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", mock.base_url)
    for route in ROUTES:
        claude = AnthropicAdapter(transport=route, max_retries=0)  # type: ignore[arg-type]
        assert await answer(claude) == "echo: hello"
    direct, sdk = (lowered(h) for h in mock.headers)
    assert direct == sdk
    assert "sk-from-env" in (direct.get("x-api-key") or direct.get("authorization") or "")


@pytest.mark.parametrize("route", ROUTES)
async def test_retries_429_and_529_honouring_retry_after(mock: MockAnthropicServer,
                                                         route: str) -> None:
    mock.statuses = [529, 429]
    mock.retry_after = "0.05"
    assert await answer(adapter(route, base_url=mock.base_url, max_retries=2)) == "echo: hello"
    assert [lowered(h)["x-stainless-retry-count"] for h in mock.headers] == ["0", "1", "2"]


@pytest.mark.parametrize("status", [429, 500, 529])
async def test_retries_run_out_with_the_same_error(mock: MockAnthropicServer,
                                                   status: int) -> None:
    errors = []
    for route in ROUTES:
        mock.statuses = [status, status]
        mock.retry_after = "0"
        errors.append(await failure(adapter(route, base_url=mock.base_url, max_retries=1)))
    assert len(mock.headers) == 4  # two attempts each
    direct, sdk = errors
    assert (type(direct), direct.status, direct.message) == (type(sdk), sdk.status, sdk.message)
    assert direct.message == f"Anthropic request failed with HTTP {status}: mock error {status}"


@pytest.mark.parametrize("status", [400, 401, 404])
async def test_client_errors_are_not_retried(mock: MockAnthropicServer, status: int) -> None:
    errors = [await failure(adapter(route, base_url=mock.base_url, max_retries=2),
                            f"error:{status}") for route in ROUTES]
    assert len(mock.headers) == 2  # one attempt each
    assert errors[0].message == errors[1].message
    assert errors[0].status == errors[1].status == status


async def test_refused_connection_is_the_same_error() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    errors = [await failure(adapter(route, base_url=dead)) for route in ROUTES]
    assert [type(e) for e in errors] == [UpstreamConnectionError] * 2
    assert errors[0].message == errors[1].message == "Could not reach the Anthropic API"


@pytest.mark.parametrize(("mode", "kind", "message", "attempts"), [
    ("close", UpstreamConnectionError, "closed the connection without answering", 2),
    ("cut", UpstreamConnectionError, "broke off before the answer was complete", 1),
    ("stall_first", UpstreamTimeoutError, "Anthropic request timed out", 2),
    ("stall_mid", UpstreamTimeoutError, "Anthropic request timed out", 1),
])
async def test_transport_faults(mode: str, kind: type[UpstreamError], message: str,
                                attempts: int) -> None:
    async with FaultyLLM(mode) as upstream:
        base = upstream.base_url.removesuffix("/v1")
        error = await failure(adapter("direct", base_url=base, timeout=0.5, max_retries=1))
        assert upstream.requests == attempts
    assert type(error) is kind
    assert message in error.message


async def test_a_stream_without_its_end_is_a_protocol_error(mock: MockAnthropicServer) -> None:
    from aiohttp import web

    async def truncated(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'event: message_start\ndata: {"type": "message_start", '
                             b'"message": {"usage": {"input_tokens": 1}}}\n\n')
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/messages", truncated)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        error = await failure(adapter("direct",
                                      base_url=f"http://127.0.0.1:{runner.addresses[0][1]}"))
    finally:
        await runner.cleanup()
    assert type(error) is UpstreamProtocolError
    assert "ended before the answer was complete" in error.message


async def test_connections_are_kept_alive_and_a_stop_cancels_upstream(
        mock: MockAnthropicServer) -> None:
    claude = adapter("direct", base_url=mock.base_url)
    try:
        for _ in range(3):
            async for _ in claude.stream(ChatRequest(messages=[UserMessage(
                    id="u", content="hi")])):
                pass
        route = claude._direct
        assert route is not None
        assert len(route.pool._idle) == 1  # one connection served all three
        stream = claude.stream(ChatRequest(messages=[UserMessage(
            id="u", content="slow:200 a b c d")]))
        await anext(aiter(stream))
        aclose: Callable[[], Awaitable[None]] = stream.aclose  # type: ignore[attr-defined]
        await aclose()
        async for _ in poll():
            if mock.cancelled_streams:
                break
        assert mock.cancelled_streams == 1  # the upstream stream was cancelled
    finally:
        await claude.aclose()


class _SubclassedClient:
    """A client that is not the SDK's own class (as Bedrock's and Vertex's are not): the
    adapter sends through its `messages.create`."""


@pytest.mark.parametrize("route", ["direct", "sdk", "sdk-create"])
async def test_a_file_id_is_sent_with_the_files_beta(mock: MockAnthropicServer,
                                                     route: str) -> None:
    """The Messages API reads a file by id only under the Files API's beta header: without
    it, every attachment given by file id was refused upstream."""
    import anthropic
    from ag_ui.core import DocumentInputContent, FileSource, TextInputContent

    document = UserMessage(id="u", content=[
        TextInputContent(text="summarise it"),
        DocumentInputContent(source=FileSource(value="file-abc123",
                                                           mime_type="application/pdf"))])
    plain = ChatRequest(messages=[UserMessage(id="p", content="hello")])
    for request in (ChatRequest(messages=[document]), plain):
        if route == "direct":
            await answer(adapter("direct", base_url=mock.base_url), request=request)
            continue
        kind: Any = anthropic.AsyncAnthropic if route == "sdk" else type(
            "Subclassed", (anthropic.AsyncAnthropic, _SubclassedClient), {})
        given = kind(api_key="sk-mock", base_url=mock.base_url, max_retries=0,
                     default_headers={"Anthropic-Beta": "prompt-caching-2024-07-31"},
                     http_client=anthropic.DefaultAioHttpClient())
        try:
            await answer(AnthropicAdapter(client=given), request=request)
        finally:
            await given.close()  # the application's: the adapter leaves it open
    with_file, without = (lowered(h).get("anthropic-beta") for h in mock.headers)
    configured = [] if route == "direct" else ["prompt-caching-2024-07-31"]
    assert with_file == ",".join([*configured, "files-api-2025-04-14"])
    assert without == (configured[0] if configured else None)
    assert mock.requests[0]["messages"][0]["content"][1]["source"] == {
        "type": "file", "file_id": "file-abc123"}


def test_the_default_model_is_not_one_the_sdk_calls_deprecated() -> None:
    """claude-sonnet-4-5, the default before, reaches its end of life on 2026-11-30: an app
    that named no model would have stopped answering then."""
    from anthropic._data import DEPRECATED_MODELS

    from copilot_runtime.adapters.anthropic import DEFAULT_MODEL
    from copilot_runtime.adapters.from_env import adapter_from_env

    assert DEFAULT_MODEL not in DEPRECATED_MODELS
    assert AnthropicAdapter(api_key="k").model == DEFAULT_MODEL
    chosen = adapter_from_env({"ANTHROPIC_API_KEY": "k"})
    assert chosen is not None
    assert chosen[0].model == DEFAULT_MODEL  # type: ignore[attr-defined]
