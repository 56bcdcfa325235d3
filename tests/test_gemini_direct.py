"""The Gemini adapter's own HTTP/1.1 route sends what the `google-genai` SDK sends, and fails
alike.

Each request goes through both routes (`transport="direct"`, the default with an API key,
and `transport="sdk"`) against the loopback mock, which records bodies, paths and headers;
they must match once parsed. Then the retries, the failures a raw server can produce
(malformed frames, an error frame, a stream without its finish, a cut, a stall), and a stop
that must cancel the upstream request.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from ag_ui.core import (
    AssistantMessage,
    DataSource,
    DocumentPart,
    FunctionCall,
    ImagePart,
    SystemMessage,
    TextPart,
    ToolCall,
    ToolMessage,
    UrlSource,
    UserMessage,
)
from aiohttp import web

from copilot_runtime import ConfigurationError, GoogleGenAIAdapter, UpstreamError
from copilot_runtime._exceptions import (
    ContentFilteredError,
    UpstreamConnectionError,
    UpstreamProtocolError,
    UpstreamTimeoutError,
)
from copilot_runtime.adapters import ChatRequest, ReasoningDelta, TextDelta, ToolCallDelta
from copilot_runtime.adapters.base import StreamEnd, ToolSpec
from copilot_runtime.testing import MockGeminiServer
from tests.conftest import free_port, poll
from tests.test_hardening import FaultyLLM

TIMEOUT_S = 30
ROUTES = ("direct", "sdk")
WEATHER = ToolSpec("getWeather", "The weather in a city", {
    "type": "object", "additionalProperties": False,
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1},
                   "units": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city"]})


@pytest.fixture
async def mock() -> AsyncIterator[MockGeminiServer]:
    async with MockGeminiServer(chunks=4) as server:
        yield server


def adapter(route: str, **options: Any) -> GoogleGenAIAdapter:
    options.setdefault("api_key", "mock-key")
    options.setdefault("max_retries", 0)
    return GoogleGenAIAdapter(transport=route, **options)  # type: ignore[arg-type]


async def deltas(gemini: GoogleGenAIAdapter, request: ChatRequest) -> list[Any]:
    async with asyncio.timeout(TIMEOUT_S):
        return [d async for batch in gemini.stream(request) for d in batch]


async def failure(gemini: GoogleGenAIAdapter, text: str = "hello") -> UpstreamError:
    try:
        with pytest.raises(UpstreamError) as info:
            await deltas(gemini, ChatRequest(messages=[UserMessage(id="u", content=text)]))
    finally:
        await gemini.aclose()
    return info.value


def user(text: str) -> UserMessage:
    return UserMessage(id="u", content=text)


async def test_default_route_is_direct_and_sdk_is_an_option(mock: MockGeminiServer) -> None:
    import aiohttp
    from google import genai

    assert GoogleGenAIAdapter(api_key="k", base_url=mock.base_url).transport == "direct"
    assert adapter("sdk", base_url=mock.base_url).transport == "sdk"
    session = aiohttp.ClientSession()
    client = genai.Client(api_key="k", http_options={"base_url": mock.base_url,
                                                     "aiohttp_client": session})
    ready = GoogleGenAIAdapter(client=client)
    assert ready.transport == "sdk"  # Vertex AI and custom credentials: the SDK's route
    found = await deltas(ready, ChatRequest(messages=[user("hi")]))
    assert "".join(d.text for d in found if isinstance(d, TextDelta)) == "echo: hi"
    await client.aio.aclose()
    await session.close()
    with pytest.raises(ConfigurationError, match="transport"):
        adapter("h2")
    with pytest.raises(ConfigurationError, match="without the SDK"):
        GoogleGenAIAdapter(client=client, transport="direct")
    with pytest.raises(ConfigurationError, match="http"):
        GoogleGenAIAdapter(api_key="k", base_url="ftp://example")


async def test_an_http_proxy_in_the_environment_is_used(
        mock: MockGeminiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind a proxy the own route (which connects directly) gives way to the SDK's, whose
    session honours the proxy: Gemini was unreachable behind one, with no word why."""
    seen: list[bytes] = []

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readline()
        seen.append(head)
        target = head.split()[1].decode()  # absolute form: http://host:port/path
        host, port = target.split("/")[2].split(":")
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        up_writer.write(head)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}")
    gemini = GoogleGenAIAdapter(api_key="k", base_url=mock.base_url, max_retries=0)
    try:
        assert gemini.transport == "sdk"
        found = await deltas(gemini, ChatRequest(messages=[user("hi")]))
        assert "".join(d.text for d in found if isinstance(d, TextDelta)) == "echo: hi"
    finally:
        await gemini.aclose()
        proxy.close()
        await proxy.wait_closed()
    assert len(seen) == 1, seen
    assert seen[0].startswith(f"POST {mock.base_url}".encode()), seen
    assert adapter("direct", base_url=mock.base_url).transport == "direct"  # asked for


def test_the_sdk_route_without_the_google_extra_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without google-genai, the SDK route was built and every run failed AGENT_ERROR."""
    monkeypatch.setitem(sys.modules, "google.genai", None)  # import fails as if missing
    assert adapter("direct").transport == "direct"  # the own route needs no SDK
    with pytest.raises(ConfigurationError, match=r"copilot-runtime\[google\]"):
        adapter("sdk")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    with pytest.raises(ConfigurationError, match=r"copilot-runtime\[google\]"):
        GoogleGenAIAdapter(api_key="k")


REQUESTS: dict[str, ChatRequest] = {
    "plain": ChatRequest(messages=[user("hello")]),
    "everything": ChatRequest(
        messages=[SystemMessage(id="s", content="Be brief."), user("weather?"),
                  AssistantMessage(id="a", content="Looking.", tool_calls=[ToolCall(
                      id="c1", function=FunctionCall(name="getWeather",
                                                     arguments='{"city": "Paris"}'))]),
                  ToolMessage(id="t", content='{"sky": "clear"}', tool_call_id="c1"),
                  ToolMessage(id="t2", content="orphan", tool_call_id="c9"),
                  user("and tomorrow?")],
        tools=[WEATHER], system_prompt="You help.", model="gemini-x", temperature=0.4,
        max_tokens=64, stop=["END"], tool_choice="getWeather"),
    "required-tool": ChatRequest(messages=[user("go")], tools=[WEATHER],
                                 tool_choice="required"),
    "media": ChatRequest(messages=[UserMessage(id="u", content=[
        TextPart(text="what is this?"),
        ImagePart(source=DataSource(value="aGVsbG8=", mime_type="image/png")),
        DocumentPart(source=UrlSource(value="gs://bucket/doc.pdf",
                                      mime_type="application/pdf"))])]),
}


@pytest.mark.parametrize("thinking", [None, {"includeThoughts": True, "thinkingBudget": 128}])
@pytest.mark.parametrize("name", list(REQUESTS))
async def test_same_request_as_the_sdk(mock: MockGeminiServer, name: str,
                                       thinking: dict[str, Any] | None) -> None:
    for route in ROUTES:
        gemini = adapter(route, base_url=mock.base_url, timeout=30, thinking=thinking)
        try:
            await deltas(gemini, REQUESTS[name])
        finally:
            await gemini.aclose()
    direct, sdk = mock.requests
    assert direct == sdk
    assert mock.paths[0] == mock.paths[1]
    assert mock.paths[0].endswith(":streamGenerateContent?alt=sse")
    first, second = ({k: v for k, v in h.items() if k != "content-length"}
                     for h in mock.headers)
    assert first == second
    assert first["x-goog-api-key"] == "mock-key"
    assert first["x-server-timeout"] == "30"


def _camel_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {"".join(w.title() if i else w for i, w in enumerate(k.split("_"))):
                _camel_keys(v) for k, v in value.items()}
    return [_camel_keys(v) for v in value] if isinstance(value, list) else value


async def test_any_value_parameters_sent_alike_and_accepted(mock: MockGeminiServer) -> None:
    # A typeless property is any JSON value: an `anyOf` of every type, not a STRING (which
    # made Gemini send 3 as "3"). The SDK writes a schema's fields in snake_case inside
    # `parameters` (`any_of`, which the API reads as well, protobuf's JSON, and so does the
    # mock), so the SDK route's request is compared once spelt alike.
    request = ChatRequest(messages=[user("set it")], tools=[ToolSpec(
        "setValue", "Sets a value", {"type": "object", "properties": {
            "value": {"description": "any JSON"}, "list": {"type": "array"}},
            "required": ["value"]})])
    direct_route = adapter("direct", base_url=mock.base_url, timeout=30)
    sdk_route = adapter("sdk", base_url=mock.base_url, timeout=30)
    try:
        assert await deltas(direct_route, request)
        assert await deltas(sdk_route, request)
    finally:
        await direct_route.aclose()
        await sdk_route.aclose()
    direct, sdk = mock.requests
    assert direct == _camel_keys(sdk)
    value = direct["tools"][0]["functionDeclarations"][0]["parameters"]["properties"]["value"]
    assert {member["type"] for member in value["anyOf"]} == {
        "STRING", "NUMBER", "INTEGER", "BOOLEAN", "OBJECT", "ARRAY"}


async def test_signed_calls_replayed_alike(mock: MockGeminiServer) -> None:
    """Gemini 3 signs its function calls: the next request must carry the signature back."""
    for route in ROUTES:
        gemini = adapter(route, base_url=mock.base_url)
        try:
            found = await deltas(gemini, ChatRequest(
                messages=[user('call:getWeather {"city": "Oslo"}')], tools=[WEATHER],
                thread_id="t"))
            call = next(d for d in found if isinstance(d, ToolCallDelta))
            assert call.name == "getWeather"
            assert orjson.loads(call.arguments) == {"city": "Oslo"}
            assert call.id is not None
            history = [user('call:getWeather {"city": "Oslo"}'), AssistantMessage(
                id="a", tool_calls=[ToolCall(id=call.id, function=FunctionCall(
                    name="getWeather", arguments=call.arguments))]),
                ToolMessage(id="t", content="cold", tool_call_id=call.id)]
            found = await deltas(gemini, ChatRequest(messages=history, tools=[WEATHER],
                                                     thread_id="t"))
            assert "".join(d.text for d in found if isinstance(d, TextDelta)) == "echo: cold"
        finally:
            await gemini.aclose()
    replays = [r for r in mock.requests if len(r["contents"]) == 3]
    assert len(replays) == 2
    # The SDK writes bytes in base64's URL-safe alphabet, the direct route in the standard
    # one (the API reads both): the same signature, compared as bytes.
    signatures = [base64.urlsafe_b64decode(r["contents"][1]["parts"][0].pop("thoughtSignature"))
                  for r in replays]
    assert signatures[0] == signatures[1] == b"\xfb\xff\xbfmock-thought-signature"
    assert replays[0] == replays[1]


#: What Gemini takes as a function's name (its 400 says: "Must start with a letter or an
#: underscore. Must be alphameric (a-z, A-Z, 0-9), underscores (_), dots (.) or dashes (-),
#: with a maximum length of 64").
GEMINI_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")
ADD = ToolSpec("127_0_0_1__add", "Adds", {"type": "object", "properties": {
    "a": {"type": "integer"}}})


async def test_a_tool_name_gemini_refuses_is_sent_renamed_and_comes_back_as_it_was(
        mock: MockGeminiServer) -> None:
    """Before: an MCP tool of a server named by its address (`127_0_0_1__add`) was declared
    as it is, and the real API refused every request offering it (400, "Must start with a
    letter or an underscore")."""
    for route in ROUTES:
        gemini = adapter(route, base_url=mock.base_url)
        try:
            await deltas(gemini, ChatRequest(messages=[user("hi")], tools=[ADD, WEATHER],
                                             tool_choice="127_0_0_1__add"))
            declared = [d["name"] for d in mock.requests[-1]["tools"][0][
                "functionDeclarations"]]
            assert all(GEMINI_NAME.match(name) for name in declared), declared
            assert declared[1] == "getWeather"  # a name Gemini takes is left as it is
            sent = declared[0]
            assert mock.requests[-1]["toolConfig"]["functionCallingConfig"][
                "allowedFunctionNames"] == [sent]
            found = await deltas(gemini, ChatRequest(
                messages=[user(f'call:{sent} {{"a": 1}}')], tools=[ADD, WEATHER]))
            call = next(d for d in found if isinstance(d, ToolCallDelta))
            assert call.name == "127_0_0_1__add"
            history = [user("add"), AssistantMessage(id="a", tool_calls=[ToolCall(
                id=call.id or "c1", function=FunctionCall(
                    name="127_0_0_1__add", arguments=call.arguments))]),
                ToolMessage(id="t", content="2", tool_call_id=call.id or "c1")]
            await deltas(gemini, ChatRequest(messages=history, tools=[ADD, WEATHER]))
            parts = [p for turn in mock.requests[-1]["contents"] for p in turn["parts"]]
            assert [p["functionCall"]["name"] for p in parts if "functionCall" in p] == [sent]
            assert [p["functionResponse"]["name"] for p in parts
                    if "functionResponse" in p] == [sent]
        finally:
            await gemini.aclose()


def test_the_mock_refuses_a_function_name_the_api_refuses() -> None:
    """The mock answers 400 where the real API does, so a name the adapter failed to map
    fails a test instead of passing unnoticed (as `127_0_0_1__add` once did)."""
    from copilot_runtime.testing.mock_gemini import Refused, validate

    def body(name: str) -> dict[str, Any]:
        return {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                "tools": [{"functionDeclarations": [{"name": name}]}]}

    for name in ("add", "_add", "get.weather", "ns:add", "a-b", "a" * 64):
        validate(body(name), set())
    for name in ("127_0_0_1__add", "-add", "add me", "a" * 65, ""):
        with pytest.raises(Refused, match="Invalid function name"):
            validate(body(name), set())


async def test_api_version_from_the_environment(mock: MockGeminiServer,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOOGLE_GENAI_API_VERSION", "beta")
    for route in ROUTES:
        gemini = adapter(route, base_url=mock.base_url)
        try:
            await deltas(gemini, REQUESTS["plain"])
        finally:
            await gemini.aclose()
    assert [p.split("/models/")[0] for p in mock.paths] == ["/v1beta", "/v1beta"]


async def test_retries_5xx_and_429(mock: MockGeminiServer,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import copilot_runtime.adapters.google as google

    monkeypatch.setattr(google, "_RETRY_INITIAL", 0.01)
    monkeypatch.setattr(google.random, "random", lambda: 0.0)
    mock.statuses = [503, 429]
    gemini = adapter("direct", base_url=mock.base_url, max_retries=2)
    try:
        found = await deltas(gemini, REQUESTS["plain"])
    finally:
        await gemini.aclose()
    assert "".join(d.text for d in found if isinstance(d, TextDelta)) == "echo: hello"
    assert len(mock.headers) == 3


async def test_retries_run_out_with_the_same_error(mock: MockGeminiServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import copilot_runtime.adapters.google as google

    # The own route's backoff (1 to 2 s) is not what this test checks.
    monkeypatch.setattr(google, "_RETRY_INITIAL", 0.01)
    monkeypatch.setattr(google.random, "random", lambda: 0.0)
    errors = []
    for route in ROUTES:
        mock.statuses = [503, 503]
        errors.append(await failure(adapter(route, base_url=mock.base_url, max_retries=1)))
    assert len(mock.headers) == 4  # two attempts each
    direct, sdk = errors
    assert (type(direct), direct.status, direct.message) == (type(sdk), sdk.status, sdk.message)
    assert direct.message == "Gemini request failed with HTTP 503: mock error 503"


@pytest.mark.parametrize("status", [400, 401, 404])
async def test_client_errors_are_not_retried(mock: MockGeminiServer, status: int) -> None:
    errors = [await failure(adapter(route, base_url=mock.base_url, max_retries=2),
                            f"error:{status}") for route in ROUTES]
    assert len(mock.headers) == 2  # one attempt each
    assert errors[0].message == errors[1].message
    assert errors[0].status == errors[1].status == status


async def test_refused_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `max_retries=0`, a refused connection is an error at once on both routes: the
    SDK route slept 1 to 10 s and tried again (google-genai's own retry of a connection
    error when it is given no retry options). The sleeps are counted, not timed: a loaded
    machine took nearly 1 s without any."""
    waits: list[float] = []
    sleep = asyncio.sleep

    async def counted(delay: float, *args: Any, **kwargs: Any) -> Any:
        if delay >= 0.5:  # (a retry's wait; the event loop's own are 0)
            waits.append(delay)
        return await sleep(delay, *args, **kwargs)

    monkeypatch.setattr(asyncio, "sleep", counted)
    dead = f"http://127.0.0.1:{free_port()}"
    for route in ROUTES:
        error = await failure(adapter(route, base_url=dead))
        assert type(error) is UpstreamConnectionError
        assert error.message == "Could not reach the Gemini API"
        assert waits == [], route
    await failure(adapter("sdk", base_url=dead, max_retries=1))
    assert waits, "the SDK's retry wait is not seen: this test would miss it"


@pytest.mark.parametrize(("mode", "kind", "message", "attempts"), [
    ("close", UpstreamConnectionError, "closed the connection without answering", 2),
    ("cut", UpstreamConnectionError, "broke off before the answer was complete", 1),
    ("stall_first", UpstreamTimeoutError, "Gemini request timed out", 1),
    ("stall_mid", UpstreamTimeoutError, "Gemini request timed out", 1),
])
async def test_transport_faults(mode: str, kind: type[UpstreamError], message: str,
                                attempts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import copilot_runtime.adapters.google as google

    monkeypatch.setattr(google, "_RETRY_INITIAL", 0.01)
    monkeypatch.setattr(google.random, "random", lambda: 0.0)
    async with FaultyLLM(mode) as upstream:
        error = await failure(adapter("direct", base_url=upstream.base_url, timeout=0.5,
                                      max_retries=1))
        assert upstream.requests == attempts
    assert type(error) is kind
    assert message in error.message
    assert "aiohttp" not in error.message
    assert "Error" not in error.message


def _frames(*chunks: Any) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)


_TEXT = {"candidates": [{"content": {"parts": [{"text": "hi"}], "role": "model"}}]}
_END = {"candidates": [{"content": {"parts": [{"text": "!"}], "role": "model"},
                        "finishReason": "STOP"}],
        "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 2,
                          "thoughtsTokenCount": 1}}


@contextlib.asynccontextmanager
async def raw_server(body: bytes, status: int = 200, content_type: str = "text/event-stream",
                     asked: list[str] | None = None) -> AsyncIterator[str]:
    """A server answering each POST with `body` (its paths noted in `asked`)."""
    async def answer(request: web.Request) -> web.StreamResponse:
        if asked is not None:
            asked.append(request.path)
        response = web.StreamResponse(status=status, headers={"Content-Type": content_type})
        await response.prepare(request)
        await response.write(body)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_lf_framed_stream_with_thoughts_and_usage() -> None:
    thought = {"candidates": [{"content": {"parts": [{"text": "hmm", "thought": True}]}}]}
    async with raw_server(_frames(thought, _TEXT, _END)) as url:
        gemini = adapter("direct", base_url=url)
        try:
            found = await deltas(gemini, REQUESTS["plain"])
        finally:
            await gemini.aclose()
    assert [type(d).__name__ for d in found] == ["ReasoningDelta", "TextDelta", "TextDelta",
                                                 "StreamEnd"]
    assert isinstance(found[0], ReasoningDelta)
    assert found[0].text == "hmm"
    end = found[-1]
    assert isinstance(end, StreamEnd)
    assert end.finish_reason == "stop"
    assert end.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                         "reasoning_tokens": 1}


@pytest.mark.parametrize(("body", "kind", "message"), [
    (b"data: {not json\n\n", UpstreamProtocolError, "malformed JSON"),
    (b"data: [1, 2]\n\n", UpstreamProtocolError, "unexpected frame"),
    (_frames({"candidates": 5}), UpstreamProtocolError, "unexpected shape"),
    (_frames({"candidates": [{"content": {"parts": "text"}}]}), UpstreamProtocolError,
     "unexpected shape"),
    (_frames(_TEXT, {"error": {"code": 503, "message": "overloaded"}}), UpstreamError,
     "error mid-stream: overloaded"),
    (_frames(_TEXT), UpstreamConnectionError, "ended before the answer was complete"),
    (_frames({"promptFeedback": {"blockReason": "SAFETY"}}), ContentFilteredError,
     "blocked the prompt: SAFETY"),
    (_frames({"candidates": [{"finishReason": "MALFORMED_FUNCTION_CALL"}]}), UpstreamError,
     "malformed function call"),
    # These ended as an empty answer that looked finished: the user got nothing, and no why.
    (_frames({"candidates": [{"finishReason": "UNEXPECTED_TOOL_CALL"}]}), UpstreamError,
     "called a tool where none was allowed (UNEXPECTED_TOOL_CALL)"),
    (_frames({"candidates": [{"finishReason": "TOO_MANY_TOOL_CALLS"}]}), UpstreamError,
     "more tools than it may"),
    (_frames({"candidates": [{"finishReason": "MALFORMED_RESPONSE"}]}), UpstreamError,
     "malformed answer"),
    (_frames({"candidates": [{"finishReason": "MISSING_THOUGHT_SIGNATURE"}]}), UpstreamError,
     "thought signature is missing"),
])
async def test_bad_streams_are_precise_errors(body: bytes, kind: type[UpstreamError],
                                              message: str) -> None:
    async with raw_server(body) as url:
        error = await failure(adapter("direct", base_url=url))
    assert type(error) is kind
    assert message in error.message


async def test_an_error_body_that_is_not_json() -> None:
    async with raw_server(b"<html>bad gateway</html>", status=502) as url:
        error = await failure(adapter("direct", base_url=url))
    assert error.status == 502
    assert error.message == "Gemini request failed with HTTP 502: HTTP 502"


@pytest.mark.parametrize(("body", "status", "attempts"), [
    (b"<html><h1>503 Service Temporarily Unavailable</h1></html>", 503, 2),
    (b'{"error": {"message": "upstream overlo', 500, 2),
    (b"", 502, 2),
    (b"{}", 400, 1),
])
async def test_an_error_answer_labelled_json_says_its_status_on_both_routes(
        body: bytes, status: int, attempts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error answer labelled JSON whose body is not (a proxy's page, a cut body) was on
    the SDK route an UPSTREAM_PROTOCOL_ERROR, its status lost and never retried; one with
    no message said "HTTP 400: None". Both routes now say the status, and retry alike."""
    import copilot_runtime.adapters.google as google

    monkeypatch.setattr(google, "_RETRY_INITIAL", 0.01)
    monkeypatch.setattr(google.random, "random", lambda: 0.0)
    for route in ROUTES:
        asked: list[str] = []
        async with raw_server(body, status, "application/json", asked) as url:
            error = await failure(adapter(route, base_url=url, max_retries=1,
                                          max_retry_wait=2))
        assert (route, type(error), error.status, error.message) == (
            route, UpstreamError, status,
            f"Gemini request failed with HTTP {status}: HTTP {status}")
        assert (route, len(asked)) == (route, attempts)


async def test_connections_are_kept_alive_and_a_stop_cancels_upstream(
        mock: MockGeminiServer) -> None:
    gemini = adapter("direct", base_url=mock.base_url)
    route = gemini._direct
    assert route is not None
    try:
        for _ in range(3):
            await deltas(gemini, REQUESTS["plain"])
        assert len(route.pool._idle) == 1  # one connection served all three
        stream = gemini.stream(ChatRequest(messages=[user("slow:200 a b c d")]))
        await anext(aiter(stream))
        aclose: Callable[[], Awaitable[None]] = stream.aclose  # type: ignore[attr-defined]
        await aclose()
        async for _ in poll():
            if mock.cancelled_streams:
                break
        assert mock.cancelled_streams == 1  # the upstream stream was cancelled
    finally:
        await gemini.aclose()


async def test_model_names_as_the_sdk_writes_them(mock: MockGeminiServer) -> None:
    for route in ROUTES:
        gemini = adapter(route, base_url=mock.base_url)
        try:
            for model in ("gemini-x", "models/gemini-y"):
                await deltas(gemini, ChatRequest(messages=[user("hi")], model=model))
        finally:
            await gemini.aclose()
    assert [p.split("/", 2)[2].split(":")[0] for p in mock.paths] == [
        "models/gemini-x", "models/gemini-y"] * 2


@pytest.mark.parametrize("model", ["../../v1/files", "gemini?key=x", "a&b", "x#y"])
async def test_a_model_name_cannot_leave_the_models_path(mock: MockGeminiServer,
                                                        model: str) -> None:
    gemini = adapter("direct", base_url=mock.base_url)
    try:
        with pytest.raises(UpstreamError) as info:
            await deltas(gemini, ChatRequest(messages=[user("hi")], model=model))
    finally:
        await gemini.aclose()
    assert info.value.status == 400
    assert "not a Gemini model name" in info.value.message
    assert mock.paths == []
