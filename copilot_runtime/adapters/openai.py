"""OpenAI Chat Completions, and every server that speaks it (Ollama, vLLM, LM Studio, Groq).

Two ways to send a request, one behaviour. By default the adapter sends the pre-encoded
request itself over a small keep-alive HTTP/1.1 client (`_http1`), with the headers, timeout,
retries and error messages of the official `openai` SDK (a test proves each against the
mock); the SDK is then never imported, which saves an idle worker ~28 MB with httpx2 and
aiohttp, and each chat about half of its CPU. When the configuration needs what only the SDK
does (a ready `client=` such as `AsyncAzureOpenAI`, an HTTP proxy from the environment,
`OPENAI_CUSTOM_HEADERS`), or with `transport="sdk"`, the SDK sends it. Either way the
streamed answer is parsed here, from the raw bytes: the SDK's own stream iterator builds a
pydantic model per chunk (about 50 µs each).
"""

from __future__ import annotations

import asyncio
import functools
import os
import platform
import re
import sys
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import msgspec
import orjson
import structlog

from copilot_runtime._exceptions import (
    ConfigurationError,
    UpstreamConnectionError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeoutError,
    upstream_said,
)
from copilot_runtime._held import event_stream
from copilot_runtime._limits import HELD_BOUND, HeldTooLarge
from copilot_runtime.adapters import _direct, _http1
from copilot_runtime.adapters._common import (
    OPENING_TURN,
    KeptForThreads,
    after,
    request_thread,
    tool_schema,
)
from copilot_runtime.adapters._idle import DEFAULT_TIMEOUT, IdleBound, read_timeout, wait_bound
from copilot_runtime.adapters._sse import event_data
from copilot_runtime.adapters.base import (
    ChatDelta,
    ChatRequest,
    ReasoningDelta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
)
from copilot_runtime.messages import to_openai

if TYPE_CHECKING:
    import openai

__all__ = ["OpenAIAdapter", "is_reasoning_model"]

_log = structlog.get_logger("copilot_runtime.adapters.openai")

_E = TypeVar("_E", bound=BaseException)

_DEFAULT_BASE_URL = "https://api.openai.com/v1"
# OpenAI's model names: the o series (o1, o3-mini, o4-mini-2025-04-16) and the GPT versions.
_O_SERIES = re.compile(r"o\d+(?:-.*)?", re.S)
_GPT_VERSION = re.compile(r"gpt-(?P<major>\d+)(?:\.(?P<minor>\d+))?(?:-(?P<variant>.*))?", re.S)


#: The roles of a conversation's turns: a request with none gets the opening one.
_TURN_ROLES = frozenset({"user", "assistant", "tool"})


def is_reasoning_model(model: str) -> bool:
    """Whether OpenAI runs `model` as a reasoning model, which refuses `max_tokens` and
    sampling settings: the o series and GPT-5 on, but a major version's chat model
    (`gpt-5-chat-latest`). Other names (other servers' models, fine-tunes, `openai/o3`
    behind a proxy that translates itself) are not."""
    if _O_SERIES.fullmatch(model):
        return True
    version = _GPT_VERSION.fullmatch(model)
    if version is None or int(version["major"]) < 5:
        return False
    return version["minor"] is not None or not (version["variant"] or "").startswith("chat")


# The reasoning models that take `stop`: o1 itself and o3-mini. OpenAI's API reference says
# o3 and o4-mini refuse it; o1-mini, o1-preview and the GPT-5 family do too.
_TAKES_STOP = re.compile(r"o1(?:-\d{4}-\d\d-\d\d)?|o3-mini(?:-.*)?", re.S)
#: Tokens a reasoning model may reason for on top of the runtime's own `max_tokens` (they
#: count against `max_completion_tokens`; a guardrail judge's 100 would leave no answer).
_REASONING_ROOM = 4000


def _samples_without_reasoning(model: str) -> bool:
    """Whether `model` takes `temperature` when told not to reason (`reasoning_effort`
    "none"): GPT-5.1 and later do, GPT-5 and the o series never."""
    version = _GPT_VERSION.fullmatch(model)
    return version is not None and (int(version["major"]), int(version["minor"] or 0)) >= (5, 1)


# The SDK gives up rather than wait for a Retry-After above two minutes (see _direct).
_MAX_RETRY_AFTER = 120.0
#: How long the SDK route reads on for the body's end once the answer is complete.
BODY_END_WAIT = 0.25


class OpenAIAdapter:
    """Chat Completions with streaming, tool calls and usage.

    `base_url` points it at any OpenAI-compatible server; then no key is needed. `client`
    lets a test (or an app with its own settings, or Azure) pass a ready `openai.AsyncOpenAI`,
    which then sends every request. `organization`, `project` and `default_headers` are the
    SDK's options of the same names (and read the same environment variables).
    `transport="sdk"` sends through the SDK even when the adapter could send itself.

    `max_retry_wait` (seconds, 60 by default) bounds the waits between retries: a provider
    that asks for a longer wait (its Retry-After), or waits that would add up to more, end
    the run at once with its error (HTTP 429 or 5xx), which says when to try again.
    Through the SDK (`transport="sdk"`) a Retry-After past the bound is not waited for
    either; a ready `client=` keeps its own waits (up to a minute each).

    `timeout` (seconds, 120 by default) bounds each wait for the answer. A ready `client=`
    given no `timeout` keeps its own read timeout (`AsyncOpenAI(timeout=600)`: 600 s).

    `reasoning_model` says whether the model is one of OpenAI's reasoning models, which take
    a client's maxTokens as `max_completion_tokens` and no `temperature` nor (but o1 and
    o3-mini) `stop` (they are left out, with a warning). By default (None) the model's name
    decides (`is_reasoning_model`): set it for an Azure deployment named otherwise. Every
    other model gets `max_tokens`, the field every OpenAI-compatible server reads (Ollama
    and LM Studio ignore the other).
    """

    provider = "openai"

    def __init__(
        self,
        *,
        model: str = "gpt-4o",
        api_key: str | None = None,
        base_url: str | None = None,
        client: openai.AsyncOpenAI | None = None,
        timeout: float | None = None,
        max_retries: int = 2,
        max_retry_wait: float = _direct.DEFAULT_MAX_RETRY_WAIT,
        extra_body: dict[str, Any] | None = None,
        organization: str | None = None,
        project: str | None = None,
        default_headers: Mapping[str, str] | None = None,
        transport: Literal["auto", "direct", "sdk"] = "auto",
        reasoning_model: bool | None = None,
    ) -> None:
        self.model = model
        self._reasoning_model = reasoning_model
        self._client = client
        #: Whether it makes its client (and closes it), or was given one: the application
        #: owns what it gave, and closes it (a module-level adapter serves each new runtime).
        self._owns_client = client is None
        self._api_key = api_key or os.environ.get("OPENAI_API_KEY")
        self._base_url = base_url
        self._timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self._wait_bound = wait_bound(
            timeout, None if client is None else read_timeout(client.timeout))
        self._max_retries = max_retries
        self._max_retry_wait = _direct.check_max_retry_wait("OpenAIAdapter", max_retry_wait)
        self._extra_body = extra_body or {}
        self._organization = organization or os.environ.get("OPENAI_ORG_ID")
        self._project = project or os.environ.get("OPENAI_PROJECT_ID")
        self._default_headers = dict(default_headers or {})
        # an answer's first tool call → the `reasoning_content` it streamed: DeepSeek's
        # thinking mode wants it back on that assistant message as the tool loop goes on.
        # Bounded by what it holds, not by count: one answer may reason for 30k tokens.
        self._reasoning: KeptForThreads[str] = KeptForThreads(_REASONING_KEPT_CHARS, len)
        if client is None and not self._api_key and not base_url:
            raise ConfigurationError(
                "OpenAIAdapter needs api_key (or OPENAI_API_KEY), or a base_url for an "
                "OpenAI-compatible server")
        if transport not in ("auto", "direct", "sdk"):
            raise ConfigurationError("transport must be 'auto', 'direct' or 'sdk'")
        if transport == "direct" and client is not None:
            raise ConfigurationError("transport='direct' sends without the SDK: pass the "
                                     "settings, not a client")
        self._direct: _DirectRoute | None = None
        if transport == "direct" or (transport == "auto" and _can_send_directly(client)):
            self._direct = _DirectRoute(self)

    @property
    def transport(self) -> str:
        """How requests are sent: "direct" (this package's client) or "sdk"."""
        return "direct" if self._direct is not None else "sdk"

    @property
    def client(self) -> openai.AsyncOpenAI:
        # Created on first use: its aiohttp session must be made inside the running loop.
        if self._client is None:
            import openai

            self._client = openai.AsyncOpenAI(
                api_key=self._api_key or "not-needed",
                base_url=self._base_url,
                organization=self._organization,
                project=self._project,
                default_headers=self._default_headers or None,
                timeout=self._timeout,
                max_retries=self._max_retries,
                http_client=openai.DefaultAioHttpClient(
                    timeout=self._timeout, event_hooks={"response": [
                        _direct.sdk_wait_bound(self._max_retry_wait)]}),
            )
        return self._client

    async def aclose(self) -> None:
        if self._direct is not None and self._direct.close():
            await asyncio.sleep(0)  # the closed sockets are released on the loop's next turn
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None  # made again on its next use
            await client.close()

    async def forget_thread(self, thread_id: str) -> None:
        """Drop the reasoning kept for a deleted thread: its id may be taken again."""
        self._reasoning.forget(thread_id)

    def build_params(self, request: ChatRequest) -> dict[str, Any]:
        """The Chat Completions request body for `request` (without `stream`)."""
        messages: list[dict[str, Any]] = []
        if request.system_prompt:
            messages.append({"role": "system", "content": request.system_prompt})
        messages.extend(to_openai(request.messages))
        if not any(item["role"] in _TURN_ROLES for item in messages):
            # (only UI state, or nothing: the API refuses an empty array with a 400)
            messages.append({"role": "user", "content": OPENING_TURN})
        if self._reasoning and (thread := request_thread(request)) is not None:
            for item in messages:
                if calls := item.get("tool_calls"):
                    function = calls[0]["function"]
                    said = self._reasoning.get(thread, calls[0]["id"], function["name"],
                                               function["arguments"])
                    if said is not None:
                        item["reasoning_content"] = said
        params: dict[str, Any] = {
            "model": request.model or self.model,
            "messages": messages,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            params["tools"] = [
                {"type": "function", "function": {
                    "name": t.name, "description": t.description,
                    "parameters": tool_schema(t.parameters, t.name)}}
                for t in request.tools
            ]
            if request.tool_choice in (None, "auto", "none", "required"):
                if request.tool_choice:
                    params["tool_choice"] = request.tool_choice
            else:
                params["tool_choice"] = {"type": "function",
                                         "function": {"name": request.tool_choice}}
        model = params["model"]
        reasoning = (is_reasoning_model(model) if self._reasoning_model is None
                     else self._reasoning_model)
        # OpenAI refuses these with a 400, which would fail the run over a setting the
        # client cannot know the model ignores; the runtime's own are left out quietly.
        dropped = _log.debug if request.runtime_settings else _log.warning
        if request.temperature is not None:
            if reasoning and not (self._extra_body.get("reasoning_effort") == "none"
                                  and _samples_without_reasoning(model)):
                dropped("temperature not sent to a reasoning model", model=model,
                        temperature=request.temperature)
            else:
                params["temperature"] = request.temperature
        if request.max_tokens is not None:
            if not reasoning:
                params["max_tokens"] = request.max_tokens
            elif request.runtime_settings:
                params["max_completion_tokens"] = request.max_tokens + _REASONING_ROOM
            else:
                params["max_completion_tokens"] = request.max_tokens
        if request.stop:
            # (a name that does not tell, with `reasoning_model=True`, may refuse it too)
            if reasoning and not _TAKES_STOP.fullmatch(model):
                dropped("stop not sent to a reasoning model", model=model, stop=request.stop)
            else:
                params["stop"] = request.stop
        return params

    def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        params = {**self.build_params(request), "stream": True, **self._extra_body}
        body = orjson.dumps(params)
        options = params.get("stream_options")
        # (`extra_body` may have turned the usage chunk off)
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        thread = request_thread(request)
        keep = None if thread is None else functools.partial(self._reasoning.keep, thread)
        if self._direct is not None:
            return self._stream_direct(self._direct, body, usage, keep)
        return self._stream_sdk(body, usage, keep)

    async def _stream_direct(self, route: _DirectRoute, body: bytes, usage: bool,
                             keep: _KeepReasoning | None) -> AsyncIterator[Sequence[ChatDelta]]:
        response = await route.send(body)
        parser = ChatCompletionsStreamParser(secrets=route.secrets, expects_usage=usage,
                                             keep_reasoning=keep)
        async for deltas in _direct.stream(response, parser, route.failures):
            yield deltas

    async def _stream_sdk(self, body: bytes, usage: bool, keep: _KeepReasoning | None
                          ) -> AsyncIterator[Sequence[ChatDelta]]:
        # The SDK's documented route for raw requests (`client.post`) still gives us its
        # authentication, base URL, retries and error types, but skips the per-request walk
        # of its TypedDict annotations: the body is already plain JSON, so it is sent as is.
        import aiohttp
        import httpx2
        import openai

        client = self.client
        # What the request carries: an upstream's words echoing one lose it.
        secrets = (self._api_key, *_direct.header_credentials(client.default_headers))
        try:
            # With `cast_to=Response` the SDK hands back the unread HTTP response.
            response = cast(httpx2.Response, await client.post(
                "/chat/completions", cast_to=httpx2.Response, content=body,
                options={"headers": {"Content-Type": "application/json"}},
                stream=True, stream_cls=openai.AsyncStream[Any]))
            # (the SDK's client alone may wait forever: see _idle)
            pieces = IdleBound(response.aiter_bytes(), self._wait_bound, self._silent())
            try:
                parser = ChatCompletionsStreamParser(secrets=secrets, expects_usage=usage,
                                                     keep_reasoning=keep)
                async for data in pieces:
                    deltas = parser.feed(data)
                    if deltas:
                        yield deltas
                    if parser.finished:
                        break
                silent = False
                if parser.finished and not parser.done:  # (see _direct.stream)
                    deltas, silent = await _direct.after_finish(pieces, parser.feed, parser)
                    if deltas:
                        yield deltas
                if parser.done and not silent:
                    # Read on to the body's end (`[DONE]` and the last chunk follow the usage
                    # at once from a sound server; briefly, so a silent one hardly delays the
                    # run): the SDK's client reuses a connection only once its body was read
                    # whole, else each answer opens a new one.
                    await _direct.after_finish(pieces, parser.feed, None, BODY_END_WAIT)
                deltas = parser.finish()
                if deltas:
                    yield deltas
            finally:
                pieces.close()
                await response.aclose()
        except UpstreamError as exc:
            if exc.pending:  # the deltas its read parsed before it, which come first
                pending, exc.pending = exc.pending, ()
                yield pending
            raise
        except openai.APIStatusError as exc:
            raise _direct.status_failure(
                "OpenAI", exc.status_code, upstream_said(_error_message(exc), secrets),
                _direct.unwaited(_direct.retry_after_seconds(exc.response.headers.get),
                                 self._max_retry_wait)) from None
        except openai.APIConnectionError as exc:
            # Told apart by aiohttp's cause: the SDK reports a server that hung up as a
            # timeout. Messages name what happened, never the transport's internals.
            if _find_cause(exc, aiohttp.ClientConnectorError) is not None:
                raise UpstreamConnectionError(_CONNECT_FAILED) from None
            if _find_cause(exc, aiohttp.ServerDisconnectedError) is not None:
                raise UpstreamConnectionError(_HUNG_UP) from None
            if isinstance(exc, openai.APITimeoutError) or _find_cause(
                    exc, TimeoutError) is not None:
                raise UpstreamTimeoutError(self._silent()) from None
            raise UpstreamConnectionError("Could not reach the OpenAI API") from None
        except openai.OpenAIError as exc:
            raise UpstreamError(
                f"OpenAI request failed: {upstream_said(str(exc), secrets)}") from None
        except httpx2.DecodingError:
            raise UpstreamProtocolError(
                "The OpenAI API sent a body that could not be decoded") from None
        except aiohttp.ClientResponseError:
            # aiohttp could not parse the answer's head or its chunked framing; the SDK's
            # transport passes that on unmapped.
            raise UpstreamProtocolError(_MALFORMED) from None
        except httpx2.TimeoutException:
            raise UpstreamTimeoutError(self._silent()) from None
        except httpx2.TransportError:
            # Raised by the byte stream itself: the connection broke mid-answer.
            raise UpstreamConnectionError(
                "The OpenAI stream broke off before the answer was complete") from None

    def _silent(self) -> str:
        return f"The OpenAI API sent nothing for {self._wait_bound:g} s"


_CONNECT_FAILED = "Could not reach the OpenAI API (connection failed)"
_RETRIES = _direct.SDKRetries(max_retry_after=_MAX_RETRY_AFTER)
_HUNG_UP = "The OpenAI API closed the connection without answering"
_MALFORMED = "The OpenAI API sent a malformed HTTP answer"


def _can_send_directly(client: Any) -> bool:
    """Whether the adapter's own client can send what the SDK would (see the module doc)."""
    if client is not None or os.environ.get("OPENAI_CUSTOM_HEADERS"):
        return False
    return not _direct.proxy_in_environment()


class _DirectRoute:
    """The SDK's request, pre-encoded: URL, headers and retry policy worked out once."""

    def __init__(self, adapter: OpenAIAdapter) -> None:
        base = adapter._base_url or os.environ.get("OPENAI_BASE_URL") or _DEFAULT_BASE_URL
        url = urllib.parse.urlsplit(base)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigurationError(f"OpenAIAdapter: base_url {base!r} is not an http(s) URL")
        default_port = 443 if url.scheme == "https" else 80
        port = url.port or default_port
        host = url.hostname if ":" not in url.hostname else f"[{url.hostname}]"
        path = url.path.rstrip("/") + "/chat/completions"
        if url.query:
            path += "?" + url.query
        self.adapter = adapter
        self.timeout = adapter._timeout
        self.max_retries = adapter._max_retries
        self.max_retry_wait = adapter._max_retry_wait
        self.pool = _http1.HTTPPool(url.scheme, url.hostname, port,
                                    connect_timeout=adapter._timeout)
        headers = sdk_headers(api_key=adapter._api_key or "not-needed",
                              organization=adapter._organization, project=adapter._project,
                              custom=adapter._default_headers, timeout=adapter._timeout)
        lines = [f"POST {path} HTTP/1.1",
                 f"Host: {host}" + (f":{port}" if port != default_port else "")]
        read_timeout = headers.pop("X-Stainless-Read-Timeout", None)
        self.tail = (f"X-Stainless-Read-Timeout: {read_timeout}\r\n".encode("latin-1")
                     if read_timeout is not None else b"")
        for name, value in headers.items():
            if any(c in name + value for c in "\r\n\0") or not name:
                raise ConfigurationError(f"OpenAIAdapter: header {name!r} is not valid")
            lines.append(f"{name}: {value}")
        self.head = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        #: The credentials its requests carry (custom headers' too).
        self.secrets = _direct.credentials(self.head)
        self.failures = _direct.Failures(
            "OpenAI", adapter._silent(), _CONNECT_FAILED, _HUNG_UP,
            _MALFORMED,
            "The OpenAI stream broke off before the answer was complete")

    def close(self) -> bool:
        return self.pool.close()

    async def send(self, body: bytes) -> _http1.Response:
        """The answer's head, after the SDK's retries; an `UpstreamError` when it failed."""
        return await _direct.send(
            self.pool, self.head, self.tail, body, read_timeout=self.timeout,
            max_retries=self.max_retries, max_wait=self.max_retry_wait,
            failures=self.failures, policy=_RETRIES)


def sdk_headers(*, api_key: str, organization: str | None, project: str | None,
                custom: Mapping[str, str], timeout: float) -> dict[str, str]:
    """The headers `openai.AsyncOpenAI` sends with every request, but the per-attempt
    `X-Stainless-Retry-Count` and `Content-Length` (in its order, custom ones last)."""
    version = _sdk_version()
    headers: dict[str, str] = {
        "Accept-Encoding": "gzip, deflate",
        "Connection": "keep-alive",
        "Authorization": f"Bearer {api_key}",
        "Accept": "application/json",
        "Content-Type": "application/json",
        "User-Agent": f"AsyncOpenAI/Python {version}",
        "X-Stainless-Lang": "python",
        "X-Stainless-Package-Version": version,
        "X-Stainless-OS": _platform_name(),
        "X-Stainless-Arch": _architecture(),
        "X-Stainless-Runtime": platform.python_implementation(),
        "X-Stainless-Runtime-Version": platform.python_version(),
        "X-Stainless-Async": "async:asyncio",
    }
    if organization is not None:
        headers["OpenAI-Organization"] = organization
    if project is not None:
        headers["OpenAI-Project"] = project
    lower = {name.lower(): name for name in headers}
    for name, value in custom.items():
        headers.pop(lower.get(name.lower(), name), None)
        headers[name] = value
    if "x-stainless-read-timeout" not in {name.lower() for name in custom}:
        headers["X-Stainless-Read-Timeout"] = str(float(timeout))
    return headers


def _sdk_version() -> str:
    # From the installed distribution's metadata: the version the SDK itself would report,
    # without importing it.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("openai")
    except PackageNotFoundError:  # pragma: no cover - openai is a dependency
        return "unknown"


def _platform_name() -> str:
    system = platform.system().lower()
    names = {"darwin": "MacOS", "windows": "Windows", "linux": "Linux", "freebsd": "FreeBSD",
             "openbsd": "OpenBSD"}
    return names.get(system, f"Other:{system}" if system else "Unknown")


def _architecture() -> str:
    machine = platform.machine().lower()
    if machine in ("arm64", "aarch64"):
        return "arm64"
    if machine in ("arm", "x86_64"):
        return "arm" if machine == "arm" else "x64"
    if sys.maxsize <= 2**32:
        return "x32"
    return f"other:{machine}" if machine else "unknown"


def _error_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, list) and body:  # [{"error": {...}}]: Gemini's OpenAI endpoint
        body = body[0]
    if isinstance(body, dict):
        # (`error` may hold a string, or what is not an error's object at all)
        error = body.get("error")
        for message in (body.get("message"), error.get("message") if isinstance(
                error, dict) else None):
            if isinstance(message, str) and message:
                return message
    return exc.message


def _find_cause(exc: BaseException, kind: type[_E]) -> _E | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class _Function(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCall(msgspec.Struct):
    index: int = 0
    id: str | None = None
    function: _Function | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    #: What the model says instead of an answer it refuses (structured outputs).
    refusal: str | None = None
    tool_calls: list[_ToolCall] | None = None
    #: The model's reasoning, as DeepSeek (`reasoning_content`) and OpenRouter or vLLM
    #: (`reasoning`) stream it; of any type, so that an unexpected one is skipped, not fatal.
    reasoning_content: Any = None
    reasoning: Any = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    """The fields of a `chat.completion.chunk` the runtime reads (the rest is skipped by the
    decoder, never built); a field of the wrong type fails the decode."""

    choices: list[_Choice] | None = None
    usage: dict[str, Any] | None = None
    error: Any = None


_CHUNKS = msgspec.json.Decoder(list[_Chunk])
_CHUNK = msgspec.json.Decoder(_Chunk)


class _Part(msgspec.Struct):
    """A chunk of a `content` that is a list (Mistral's reasoning models): `text`, or
    `thinking` whose own chunks are text; other kinds (a reference) are left out."""

    type: Any = None
    text: Any = None
    thinking: Any = None


# The chunk's structs again, but `content` a list too: decoded only when a chunk failed the
# plain decode, so that a string's path stays as it was.
class _ListedDelta(_Delta):
    content: str | list[_Part] | None = None  # type: ignore[assignment]


class _ListedChoice(_Choice):
    delta: _ListedDelta | None = None


class _ListedChunk(_Chunk):
    choices: list[_ListedChoice] | None = None  # type: ignore[assignment]


_LISTED_CHUNK = msgspec.json.Decoder(_ListedChunk)


def _listed_chunks(payload: bytes) -> list[_Chunk] | None:
    """The chunks `payload` says when its `content` is a list of chunks (Mistral's
    Magistral, or a model given `reasoning_effort`): its thinking first, as reasoning, then
    its text; None when it does not decode so either.

    The thinking goes as `reasoning` (shown, never sent back): Mistral refuses an assistant
    message that carries `reasoning_content` ("Extra inputs are not permitted").
    """
    try:
        chunk = _LISTED_CHUNK.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
        return None
    thought: list[_Choice] = []
    for choice in chunk.choices or ():
        delta = choice.delta
        if delta is None or not isinstance(delta.content, list):
            continue
        parts = delta.content
        thinking = "".join(_text_of(p.thinking) for p in parts if p.type == "thinking")
        delta.content = "".join(p.text for p in parts if p.type == "text"
                                and isinstance(p.text, str)) or None
        if thinking:
            thought.append(_Choice(choice.index, _Delta(reasoning=thinking)))
    return [_Chunk(choices=thought), chunk] if thought else [chunk]


def _text_of(thinking: Any) -> str:
    """The text of a thinking chunk's `thinking`: its text chunks (or a plain string)."""
    if isinstance(thinking, str):
        return thinking
    if not isinstance(thinking, list):
        return ""
    return "".join(p["text"] for p in thinking if isinstance(p, dict)
                   and p.get("type") == "text" and isinstance(p.get("text"), str))


#: The most `reasoning_content` an adapter keeps for the tool loops in flight, in characters.
_REASONING_KEPT_CHARS = 16_000_000
#: Keeps an answer's `reasoning_content` (its first call's id and name, the reasoning).
_KeepReasoning = Callable[[str, str | None, str], None]
_CUT_SHORT = "The OpenAI stream ended before the answer was complete"
_DATA_LINE = re.compile(rb"^data:(.*)$", re.MULTILINE)


_DONE_EVENT = b"data: [DONE]"
#: OpenAI-compatible servers' own words for OpenAI's finish reasons (Mistral's context window).
_FINISH_REASONS = {"model_length": "length"}


def _plain_chunks(block: bytes) -> list[_Chunk] | None:
    """The chunks of `block` when it is the stream as OpenAI writes it (`data: <json>`
    events and nothing else, `data: [DONE]` last if at all), decoded without a regex pass
    over the block; None for anything else, which `feed` then reads line by line.

    The same chunks as the line-by-line reading: every line is a `data: ` line, and the
    block decodes as one JSON array of their payloads only when no payload is `[DONE]`
    (not JSON), so the stream's first `[DONE]` is its last line.
    """
    if block.endswith(_DONE_EVENT):
        if len(block) == len(_DONE_EVENT):
            return []
        if not block.endswith(b"\n\n" + _DONE_EVENT):
            return None
        block = block[:-len(_DONE_EVENT) - 2]
    if not block.startswith(b"data: "):
        return None
    inner = block[6:].replace(b"\n\ndata: ", b",")
    if b"\n" in inner:  # another kind of line (a comment, `event:`, `data:` unspaced)
        return None
    try:
        return _CHUNKS.decode(b"[" + inner + b"]")
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
        return None  # said as the line-by-line reading says it


def _chunks_before_error(payloads: list[bytes]
                         ) -> tuple[list[_Chunk], UpstreamProtocolError | None]:
    """The chunks of `payloads` (one per event) decoded one by one up to the first that fails,
    and its error: only once a read's decode as one array failed. What came before it then
    goes out first, as it does when the bad one comes in a read of its own."""
    chunks: list[_Chunk] = []
    for payload in payloads:
        try:
            chunks.append(_CHUNK.decode(payload))
        except msgspec.ValidationError:
            listed = _listed_chunks(payload)
            if listed is not None:
                chunks.extend(listed)
                continue
            # A field of the wrong type (`choices` not a list, `delta` not an object).
            return chunks, UpstreamProtocolError(
                "The OpenAI stream sent a chunk that does not match the Chat Completions "
                "format")
        except (msgspec.DecodeError, UnicodeDecodeError):
            # msgspec reports bytes that are not UTF-8 as a UnicodeDecodeError
            return chunks, UpstreamProtocolError("The OpenAI stream sent malformed JSON")
    return chunks, None


def _done_line(block: bytes) -> int:
    """Where the `data: [DONE]` line starts in `block`, or -1.

    Found by substring search, then only that line is checked: a regex anchored at line
    starts would try every position of the block.
    """
    at = block.find(b"[DONE]")
    while at >= 0:
        start = block.rfind(b"\n", 0, at) + 1
        end = block.find(b"\n", at)
        line = block[start:end] if end >= 0 else block[start:]
        if line.startswith(b"data:") and line[5:].strip() == b"[DONE]":
            return start
        at = block.find(b"[DONE]", at + 6)
    return -1


class ChatCompletionsStreamParser:
    """Incremental parser of a Chat Completions SSE stream into `ChatDelta`s.

    Fed raw bytes as they arrive; returns the deltas completed by each read. Only frames
    whose events end within the buffer are decoded, so a JSON object split across reads is
    handled, as is a multi-byte character split across reads. The frames of one read are
    decoded in one call, as one JSON array, into structs of only the fields used: the
    per-chunk cost is what the hot path pays 50 times per answer.

    The answer ends with `data: [DONE]`, or once every choice has its finish reason and the
    usage chunk has come (at once when `expects_usage` is false: the request did not ask
    for it): some servers and proxies send nothing after it, and keep the stream open.
    """

    __slots__ = ("_calls", "_count", "_held", "_held_most", "_keep_reasoning", "_other_choices",
                 "_reasoning_size", "done", "expects_usage", "finish_reason", "finished",
                 "reasoning", "secrets", "usage")

    def __init__(self, *, secrets: Sequence[str | None] = (), expects_usage: bool = True,
                 keep_reasoning: _KeepReasoning | None = None) -> None:
        self._held = event_stream("The OpenAI stream", UpstreamProtocolError)
        #: The credentials the request carried: an error event echoing one loses it.
        self.secrets = secrets
        #: Whether a usage chunk follows the finish reason (`stream_options.include_usage`).
        self.expects_usage = expects_usage
        self.done = False
        #: Every choice has its finish reason: the answer is complete but for its usage.
        self.finished = False
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        #: The provider's tool-call index → (our call index, the call's id); see `_call`.
        self._calls: dict[int, tuple[int, str | None]] = {}
        self._count = 0
        #: The choices other than the first (`n` > 1 in `extra_body`) → whether each ended.
        self._other_choices: dict[int, bool] = {}
        #: The answer's `reasoning_content` pieces, which the server may want back.
        self.reasoning: list[str] = []
        #: Their length: no event counts them against the run's bound when the client is
        #: not shown reasoning.
        self._reasoning_size = 0
        self._held_most = HELD_BOUND.get()
        #: Told (first tool call's id and name, `reasoning`) as that call starts, when there
        #: is any.
        self._keep_reasoning = keep_reasoning

    def feed(self, data: bytes) -> list[ChatDelta]:
        if self.done:
            return []  # (what follows the answer's end: `[DONE]` after the usage chunk)
        block = self._held.events(data)
        if block is None:
            return []
        out: list[ChatDelta] = []
        chunks = _plain_chunks(block)
        if chunks is not None:
            if chunks:
                self._chunks(chunks, out)
            if self.done or block.endswith(_DONE_EVENT):
                self.done = True
                out.append(StreamEnd(self.finish_reason, self.usage))
            return out
        done = _done_line(block)
        if done >= 0:
            self.done = True
            block = block[:done]
        # One regex call, not a loop over lines: comments, `event:` lines and separators
        # are simply not matched.
        payloads = _DATA_LINE.findall(block)
        if payloads:
            try:
                chunks = _CHUNKS.decode(b"[" + b",".join(payloads) + b"]")
            except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
                # Read event by event: an event may have its JSON over several `data:` lines
                chunks, error = _chunks_before_error(
                    event_data(block.split(b"\n"), ended=True)[0])
                self._chunks(chunks, out)
                if error is not None:
                    raise after(out, error) from None
            else:
                self._chunks(chunks, out)
        if self.done:
            out.append(StreamEnd(self.finish_reason, self.usage))
        return out

    def finish(self) -> list[ChatDelta]:
        """What the body's clean end adds: the answer's end when every choice got its
        `finish_reason` though `[DONE]` never came; an error when one is missing (the
        stream was cut short).

        Several OpenAI-compatible servers (older TGI, oobabooga, llama-box, mistral.rs)
        close the stream without `[DONE]`; the official SDKs take that as the end too.
        """
        if self.done:
            return []
        out: list[ChatDelta] = []
        if self._held.held():
            # The last event not ended by a blank line: complete JSON is still a chunk.
            rest = self._held.rest()
            if rest.lstrip().startswith(b"{"):  # no stream at all: one JSON body
                rest = self._whole_body(rest)
            try:
                out.extend(self.feed(rest + b"\n\n"))
            except UpstreamProtocolError:
                raise UpstreamProtocolError(_CUT_SHORT) from None
            if self.done:
                return out
        if self.finish_reason is None or not all(self._other_choices.values()):
            raise UpstreamProtocolError(_CUT_SHORT)
        self.done = True
        out.append(StreamEnd(self.finish_reason, self.usage))
        return out

    def _whole_body(self, body: bytes) -> bytes:
        """A body that is one JSON object, not a stream (a gateway's answer with status 200,
        or a server that ignores `stream: true`): its error raised in its own words, or its
        whole completion as the one chunk that says it; anything else as it is."""
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        if not isinstance(answer, dict):
            return body
        error = answer.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            raise UpstreamError(f"OpenAI answered an error: "
                                f"{upstream_said(str(message), self.secrets)}")
        choices = answer.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(first, dict) or not isinstance(first.get("message"), dict):
            return body
        delta = dict(first["message"])
        if isinstance(delta.get("tool_calls"), list):
            delta["tool_calls"] = [{**call, "index": index} for index, call
                                   in enumerate(delta["tool_calls"]) if isinstance(call, dict)]
        chunk: dict[str, Any] = {"choices": [{"index": 0, "delta": delta,
                                              "finish_reason": first.get("finish_reason")}]}
        if answer.get("usage"):
            chunk["usage"] = answer["usage"]
        return b"data: " + orjson.dumps(chunk)

    def _chunks(self, chunks: list[_Chunk], out: list[ChatDelta]) -> None:
        append = out.append
        make = tuple.__new__  # a NamedTuple without its Python-level __new__: half the cost
        for chunk in chunks:
            if chunk.error:
                error = chunk.error
                message = error.get("message") if isinstance(error, dict) else str(error)
                raise after(out, UpstreamError(
                    "OpenAI reported an error mid-stream: "
                    f"{upstream_said(str(message), self.secrets)}"),
                    StreamEnd(self.finish_reason, self.usage))
            if chunk.usage:
                self.usage = chunk.usage
                if self.finish_reason is not None:
                    self._ended()
            for choice in chunk.choices or ():
                if choice.index:
                    others = self._other_choices
                    others[choice.index] = others.get(choice.index, False) or bool(
                        choice.finish_reason)
                    if choice.finish_reason and self.finish_reason is not None:
                        self._ended()
                    continue
                delta = choice.delta
                if delta is not None:
                    if content := delta.content:
                        append(make(TextDelta, (content,)))
                    elif delta.refusal:  # the user reads it as the answer, as in ChatGPT
                        append(make(TextDelta, (delta.refusal,)))
                    elif delta.reasoning_content or delta.reasoning:  # (never per text piece)
                        self._reasoned(delta, out)
                    if tool_calls := delta.tool_calls:  # (no empty loop per text piece)
                        if self.reasoning and not self._count:
                            self._first_call(tool_calls)
                        for call in tool_calls:
                            function = call.function
                            append(ToolCallDelta(
                                self._call(call.index, call.id), call.id,
                                function.name if function else None,
                                (function.arguments or "") if function else ""))
                if reason := choice.finish_reason:
                    if reason == "error":  # (Mistral's: the generation failed)
                        raise after(out, UpstreamError(
                            'OpenAI ended the answer with an error (finish_reason "error")'),
                            StreamEnd(reason, self.usage))
                    self.finish_reason = _FINISH_REASONS.get(reason, reason)
                    self._ended()

    def _reasoned(self, delta: _Delta, out: list[ChatDelta]) -> None:
        said = delta.reasoning_content
        if isinstance(said, str) and said:
            self.reasoning.append(said)
            self._reasoning_size += len(said)
            if self._reasoning_size > self._held_most:
                raise after(out, HeldTooLarge("reasoning", self._held_most))
        else:
            said = delta.reasoning
        if isinstance(said, str) and said:
            out.append(ReasoningDelta(said))

    def _first_call(self, tool_calls: list[_ToolCall]) -> None:
        """The answer's first call starts, after its `reasoning_content`: kept by id now, as
        a run stopped during the call still sends it back."""
        first = tool_calls[0]
        if first.id and self._keep_reasoning is not None:
            self._keep_reasoning(first.id, first.function.name if first.function else None,
                                 "".join(self.reasoning))

    def _ended(self) -> None:
        """A finish reason or the usage came (after the first choice's finish reason): the
        answer is `finished` once every choice has ended, and `done` when its usage is in
        too (`feed` then adds its end). Never per text piece: the hot path pays nothing."""
        if all(self._other_choices.values()):
            self.finished = True
            if self.usage is not None or not self.expects_usage:
                self.done = True

    def _call(self, index: int, call_id: str | None) -> int:
        """Our index of the call a tool-call piece belongs to. A new id at an index already
        in use starts a new call: Ollama sends index 0 for each of its parallel calls (older
        builds no index), which would merge them into one call with invalid arguments."""
        known = self._calls.get(index)
        if known is None or (call_id and known[1] and call_id != known[1]):
            known = self._calls[index] = (self._count, call_id)
            self._count += 1
        elif call_id and not known[1]:
            self._calls[index] = (known[0], call_id)  # the id came after the first piece
        return known[0]
