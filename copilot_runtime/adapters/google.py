"""Google Gemini, on the Gemini API or Vertex AI, with the official `google-genai` SDK.

Two ways to send a request, one behaviour, as for OpenAI. With an API key (the Gemini API),
the adapter by default sends `streamGenerateContent` itself over the small keep-alive client
of `_http1`, with the URL, headers, timeout and retry policy the SDK would use (a test proves
the request is the SDK's, byte for byte once parsed), and parses the SSE answer here: the SDK
validates every request into its pydantic types and builds a response model per chunk, which
cost about fifteen times the CPU of an OpenAI chat. A ready `client=` (Vertex AI, custom
credentials), `transport="sdk"` or an HTTP proxy in the environment (the own client
connects directly) sends through the SDK; its chunks go through the same parser.

What Gemini refuses is repaired on the way out: tool parameter schemas are converted to the
OpenAPI subset it accepts (`to_gemini_schema`, each rule tested), every function call gets a
function response in the next turn, a turn of responses holds nothing else (a tool
result's attachments, and a user's next message, go in a user turn after it), arguments and
responses are always objects, system and developer messages go to `system_instruction`.
Gemini 3 signs its function calls (`thought_signature`) and refuses a history that drops
the signature; the adapter remembers the signatures of the calls it streamed, by thread (and
its owner) and call (`KeptForThreads`, dropped when the thread is deleted), and puts them
back; a call whose signature it does not hold (streamed by another worker or before a
restart) goes with the signature Google documents for history it did not sign, which skips
the check.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
import json
import math
import os
import random
import re
import sys
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import orjson
import structlog
from ag_ui.core import (
    AssistantMessage,
    DeveloperMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
)

from copilot_runtime._exceptions import (
    ConfigurationError,
    ContentFilteredError,
    JSONTooDeepError,
    UpstreamConnectionError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeoutError,
    upstream_said,
)
from copilot_runtime._held import by_events, event_stream
from copilot_runtime._limits import check_json_text
from copilot_runtime.adapters import _direct, _http1
from copilot_runtime.adapters._common import (
    GEMINI_FAILED_REASONS,
    GEMINI_FINISH_REASONS,
    OPENING_TURN,
    KeptForThreads,
    OwnedThread,
    after,
    arguments_object,
    by_call_id,
    request_thread,
    text_of,
    tool_schema,
    usage,
)
from copilot_runtime.adapters._idle import DEFAULT_TIMEOUT, IdleBound, read_timeout, wait_bound
from copilot_runtime.adapters._sse import event_data, line_at
from copilot_runtime.adapters.base import (
    ChatDelta,
    ChatRequest,
    ReasoningDelta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
)
from copilot_runtime.messages import (
    attachment_source,
    media_type,
    paired_tool_calls,
    tool_media_after_results,
    unsupported_attachment,
)

if TYPE_CHECKING:
    import aiohttp
    from google import genai

__all__ = ["GeminiStreamParser", "GoogleGenAIAdapter", "rest_body", "to_gemini_contents",
           "to_gemini_schema"]

_SIGNATURES_KEPT = 4096
#: Keeps a call's thought signature (the call's id and name, the signature, its arguments).
_KeepSignature = Callable[[str, str, bytes, str], None]
#: Google's documented stand-in signature for a function call whose own is unknown: the API
#: then skips its validation (written in the URL-safe alphabet, as the SDK writes bytes).
_UNSIGNED_TEXT = "skip_thought_signature_validator"
_UNSIGNED = base64.urlsafe_b64decode(_UNSIGNED_TEXT)
_DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com/"
# The SDK's defaults (google.genai._api_client): API version, and the retry policy of
# `HttpRetryOptions`: these statuses and transport failures, exponential waits from 1 s
# (doubling, plus up to 1 s of jitter, at most 60 s).
_DEFAULT_API_VERSION = "v1"
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_RETRY_INITIAL = 1.0
_RETRY_MAX = 60.0
#: What the SDK raises for a streamed frame it could not read (its UnknownApiResponseError,
#: a UnicodeDecodeError and pydantic's ValidationError are ValueErrors; a frame of another
#: JSON type fails its code with a TypeError or an AttributeError; RecursionError: nesting).
_UNREADABLE = (ValueError, TypeError, AttributeError, RecursionError)
_FAILURES = _direct.Failures(
    "Gemini", "Gemini request timed out", "Could not reach the Gemini API",
    "The Gemini API closed the connection without answering",
    "The Gemini API sent a malformed HTTP answer",
    "The Gemini stream broke off before the answer was complete")


class GoogleGenAIAdapter:
    """Gemini with streaming text and function calls.

    `client` may be a ready `google.genai.Client` (for Vertex AI:
    ``genai.Client(vertexai=True, project=..., location=...)``); otherwise one is made for the
    Gemini API with `api_key` (or `GOOGLE_API_KEY` / `GEMINI_API_KEY`). `thinking` is
    Gemini's thinking config (``{"include_thoughts": True}`` streams its thought summaries).
    `transport="sdk"` sends through the SDK even when the adapter could send itself, as an
    HTTP proxy in the environment does (the SDK route needs the `google` extra).
    `timeout` (seconds, 120 by default) bounds each wait for the answer; a ready `client=`
    given no `timeout` keeps its own `HttpOptions` timeout.

    `max_retry_wait` (seconds, 60 by default) bounds the waits between retries: a provider
    that asks for a longer wait (a Retry-After, or its error's `RetryInfo`), or waits that
    would add up to more, end the run at once with its error (HTTP 429 or 5xx), which says
    when to try again. Through the SDK the waits are the SDK's own.
    """

    provider = "google"

    def __init__(
        self,
        *,
        model: str = "gemini-2.5-flash",
        api_key: str | None = None,
        base_url: str | None = None,
        client: genai.Client | None = None,
        timeout: float | None = None,
        max_retries: int = 2,
        max_retry_wait: float = _direct.DEFAULT_MAX_RETRY_WAIT,
        thinking: dict[str, Any] | None = None,
        transport: Literal["auto", "direct", "sdk"] = "auto",
    ) -> None:
        self.model = model
        self.thinking = thinking
        self._client = client
        #: Whether it makes its client (and closes it), or was given one: the application
        #: owns what it gave, and closes it (a module-level adapter serves each new runtime).
        self._owns_client = client is None
        self._session: aiohttp.ClientSession | None = None
        self._api_key = (api_key or os.environ.get("GOOGLE_API_KEY")
                         or os.environ.get("GEMINI_API_KEY"))
        self._base_url = base_url
        self._timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self._wait_bound = wait_bound(timeout,
                                      None if client is None else _client_timeout(client))
        self._max_retries = max_retries
        self._max_retry_wait = _direct.check_max_retry_wait("GoogleGenAIAdapter",
                                                           max_retry_wait)
        # a call → Gemini's thought signature of that call, for the calls streamed lately
        self._signatures: KeptForThreads[bytes] = KeptForThreads(_SIGNATURES_KEPT)
        if client is None and not self._api_key:
            raise ConfigurationError(
                "GoogleGenAIAdapter needs api_key (or GOOGLE_API_KEY / GEMINI_API_KEY)")
        if transport not in ("auto", "direct", "sdk"):
            raise ConfigurationError("transport must be 'auto', 'direct' or 'sdk'")
        if transport == "direct" and client is not None:
            raise ConfigurationError("transport='direct' sends without the SDK: pass the "
                                     "settings, not a client")
        self._direct: _DirectRoute | None = None
        if client is None and (transport == "direct" or (
                transport == "auto" and not _direct.proxy_in_environment())):
            self._direct = _DirectRoute(self)
        else:
            # The own route needs no SDK; this one does: said now, not as every run's error.
            try:
                import google.genai  # noqa: F401
            except ImportError:
                raise ConfigurationError(
                    "GoogleGenAIAdapter sends through the google-genai SDK here (a client=, "
                    "transport='sdk' or an HTTP proxy in the environment), which needs the "
                    "'google' extra: pip install 'copilot-runtime[google]'") from None

    @property
    def transport(self) -> str:
        """How requests are sent: "direct" (this package's client) or "sdk"."""
        return "direct" if self._direct is not None else "sdk"

    @property
    def client(self) -> genai.Client:
        import aiohttp
        from google import genai
        from google.genai import types as genai_types

        if self._client is None:
            # Always given, `max_retries=0` too: without retry options the SDK retries a
            # refused or reset connection once by itself, after sleeping 1 to 10 s.
            retry = genai_types.HttpRetryOptions(attempts=self._max_retries + 1)
            # Our own aiohttp session: the SDK's default one subclasses ClientSession, which
            # aiohttp deprecates (a warning on every first request). Made inside the loop.
            # trust_env: HTTP(S)_PROXY and NO_PROXY, as the other adapters' SDK clients do.
            self._session = aiohttp.ClientSession(trust_env=True,
                                                  response_class=_error_body_tolerant())
            # No `timeout`: the SDK makes it aiohttp's bound on the whole request, which cut
            # off an answer streaming for longer. The adapter's timeout bounds each wait
            # instead (`_stream_sdk`); the header the SDK derives from it is still sent.
            self._client = genai.Client(api_key=self._api_key, http_options=genai_types.HttpOptions(
                base_url=self._base_url, retry_options=retry, aiohttp_client=self._session,
                headers={"X-Server-Timeout": str(math.ceil(self._timeout))}))
        return self._client

    async def aclose(self) -> None:
        if self._direct is not None and self._direct.close():
            await asyncio.sleep(0)  # the closed sockets are released on the loop's next turn
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None  # made again on its next use
            await client.aio.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def forget_thread(self, thread_id: str) -> None:
        """Drop the signatures kept for a deleted thread: its id may be taken again."""
        self._signatures.forget(thread_id)

    def build_config(self, request: ChatRequest) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(contents, config) of the `generate_content_stream` call for `request`."""
        system, contents = to_gemini_contents(
            request.messages, functools.partial(self._signature_of, request_thread(request)))
        if request.system_prompt:
            system.insert(0, request.system_prompt)
        config: dict[str, Any] = {}
        if system:
            config["system_instruction"] = "\n\n".join(system)
        if request.tools:
            declarations = []
            for tool in request.tools:
                declaration: dict[str, Any] = {"name": _gemini_name(tool.name),
                                               "description": tool.description}
                parameters = _tool_parameters(tool.name, tool.parameters)
                if parameters.get("properties"):
                    declaration["parameters"] = parameters
                declarations.append(declaration)
            config["tools"] = [{"function_declarations": declarations}]
            choice = request.tool_choice
            if choice in ("auto", "none", "required"):
                mode = {"auto": "AUTO", "none": "NONE", "required": "ANY"}[choice]
                config["tool_config"] = {"function_calling_config": {"mode": mode}}
            elif choice:
                config["tool_config"] = {"function_calling_config": {
                    "mode": "ANY", "allowed_function_names": [_gemini_name(choice)]}}
        if self.thinking is not None:
            config["thinking_config"] = self.thinking
        if request.temperature is not None:
            config["temperature"] = request.temperature
        if request.max_tokens is not None:
            # Gemini counts thinking (on by default from 2.5 on) against the output bound:
            # the runtime's own small bound (a guardrail judge's) gets room for it on top.
            config["max_output_tokens"] = request.max_tokens + (
                _THINKING_ROOM if request.runtime_settings else 0)
        if request.stop:
            config["stop_sequences"] = request.stop
        return contents, config

    def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        contents, config = self.build_config(request)
        model = request.model or self.model
        sent = {tool.name: _gemini_name(tool.name) for tool in request.tools or ()}
        renamed = {as_sent: name for name, as_sent in sent.items() if as_sent != name}
        thread = request_thread(request)
        keep = None if thread is None else functools.partial(self._signatures.keep, thread)
        if self._direct is not None:
            return self._stream_direct(self._direct, model, contents, config, renamed, keep)
        return self._stream_sdk(model, contents, config, renamed, keep)

    async def _stream_direct(self, route: _DirectRoute, model: str,
                             contents: list[dict[str, Any]], config: dict[str, Any],
                             renamed: Mapping[str, str], keep: _KeepSignature | None
                             ) -> AsyncIterator[Sequence[ChatDelta]]:
        response = await route.send(model, rest_body(contents, config))
        parser = GeminiStreamParser(keep, secrets=route.secrets, renamed=renamed)
        async for deltas in _direct.stream(response, parser, _FAILURES):
            yield deltas

    async def _stream_sdk(self, model: str, contents: list[dict[str, Any]],
                          config: dict[str, Any], renamed: Mapping[str, str],
                          keep: _KeepSignature | None) -> AsyncIterator[Sequence[ChatDelta]]:
        import aiohttp
        from google.genai import errors as genai_errors

        secrets = (self._api_key,)  # (a ready client's credentials are not a string)
        parser = GeminiStreamParser(keep, secrets=secrets, renamed=renamed)
        try:
            # (bounded for an SDK version that awaits the answer's head here: the SDK's own
            # timeout is not set, see `client`)
            async with asyncio.timeout(self._wait_bound):
                # Plain dicts in the SDK's field names: it validates them into its own types.
                chunks = await self.client.aio.models.generate_content_stream(
                    model=model, contents=cast(Any, contents), config=cast(Any, config))
            # Each wait for a piece bounded here, the first one with the answer's head: the
            # SDK's client alone may wait forever (see _idle).
            pieces = IdleBound(aiter(chunks), self._wait_bound, _FAILURES.silent)

            def read(chunk: Any) -> list[ChatDelta]:
                if parser.done:
                    return []  # (what follows the answer's last chunk)
                out: list[ChatDelta] = []
                parser.chunk(chunk.model_dump(mode="json", by_alias=True, exclude_none=True),
                             out)
                return out

            try:
                while True:
                    try:
                        chunk = await anext(pieces)
                    except StopAsyncIteration:
                        break
                    except _UNREADABLE:
                        # The SDK's own reading of a frame failed: not JSON (malformed, or
                        # cut off by the body's end), not UTF-8, or not of its types' shape.
                        # Its messages quote the frame, the model's output: not passed on.
                        raise UpstreamProtocolError(
                            "The Gemini stream sent a frame that could not be read (malformed "
                            "or cut off)") from None
                    out = read(chunk)
                    if out:
                        yield out
                    if parser.finished:
                        break
                if parser.finished:
                    # The rest, read to the body's end (see _direct.stream), even after the
                    # last chunk: only that releases the SDK's response at once (its
                    # iterators are not closed with it). A silent server is waited for
                    # only briefly; the failed read closes the response.
                    try:
                        out, _ = await _direct.after_finish(pieces, read, None)
                    except _UNREADABLE:
                        raise UpstreamProtocolError(
                            "The Gemini stream sent a frame that could not be read") from None
                    if out:
                        yield out
            finally:
                pieces.close()
            out = parser.finish()
            if out:
                yield out
        except UpstreamError as exc:
            if exc.pending:  # the deltas its read parsed before it, which come first
                pending, exc.pending = exc.pending, ()
                yield pending
            raise
        except genai_errors.APIError as exc:
            said = upstream_said(str(exc.message or exc.status or f"HTTP {exc.code}"), secrets)
            if _answered(exc.response):
                # An error chunk of a streaming answer (the SDK raises it with the chunk's
                # code): worded as the parser words it.
                raise after([], UpstreamError(f"Gemini reported an error mid-stream: {said}"),
                            parser.spent(None)) from None
            raise _direct.status_failure("Gemini", exc.code, said, _direct.unwaited(
                _retry_delay(exc.details), self._max_retry_wait)) from None
        except (TimeoutError, aiohttp.ServerTimeoutError):
            raise UpstreamTimeoutError("Gemini request timed out") from None
        except aiohttp.ClientConnectorError:
            raise UpstreamConnectionError("Could not reach the Gemini API") from None
        except aiohttp.ClientResponseError:
            # aiohttp could not parse the answer's head or its chunked framing
            raise UpstreamProtocolError(_FAILURES.malformed) from None
        except aiohttp.ClientError:
            raise UpstreamConnectionError(
                "The Gemini stream broke off before the answer was complete") from None

    def _signature_of(self, thread: OwnedThread | None, call: ToolCall) -> bytes | None:
        """The thought signature Gemini gave `thread`'s `call`, when this process holds it."""
        return self._signatures.get(thread, call.id, call.function.name,
                                    call.function.arguments)


class _DirectRoute:
    """The SDK's `streamGenerateContent` request for the Gemini API, worked out once."""

    def __init__(self, adapter: GoogleGenAIAdapter) -> None:
        base = adapter._base_url or os.environ.get("GOOGLE_GEMINI_BASE_URL") \
            or _DEFAULT_BASE_URL
        url = urllib.parse.urlsplit(base)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigurationError(
                f"GoogleGenAIAdapter: base_url {base!r} is not an http(s) URL")
        version = os.environ.get("GOOGLE_GENAI_API_VERSION") or _DEFAULT_API_VERSION
        if version == "beta":
            version = "v1beta"
        default_port = 443 if url.scheme == "https" else 80
        port = url.port or default_port
        host = url.hostname if ":" not in url.hostname else f"[{url.hostname}]"
        self.prefix = f"{url.path.rstrip('/')}/{version}/"
        self.timeout = adapter._timeout
        self.attempts = adapter._max_retries + 1
        self.max_retry_wait = adapter._max_retry_wait
        self.pool = _http1.HTTPPool(url.scheme, url.hostname, port,
                                    connect_timeout=adapter._timeout)
        key = (adapter._api_key or "").strip()
        label = f"google-genai-sdk/{_sdk_version()} gl-python/{sys.version.split()[0]}"
        headers = {"Host": host + (f":{port}" if port != default_port else ""),
                   "Content-Type": "application/json", "x-goog-api-key": key,
                   "User-Agent": label, "x-goog-api-client": label,
                   "X-Server-Timeout": str(math.ceil(adapter._timeout)), "Accept": "*/*",
                   "Accept-Encoding": "gzip, deflate"}
        for name, value in headers.items():
            if any(c in value for c in "\r\n\0"):
                raise ConfigurationError(f"GoogleGenAIAdapter: header {name!r} is not valid")
        self.headers = "".join(f"{n}: {v}\r\n" for n, v in headers.items()).encode("latin-1")
        #: The credentials its requests carry.
        self.secrets = _direct.credentials(self.headers)

    def close(self) -> bool:
        return self.pool.close()

    async def send(self, model: str, body: bytes) -> _http1.Response:
        """The answer's head, after the SDK's retries; an `UpstreamError` when it failed."""
        if not model or any(bad in model for bad in ("..", "?", "&", "#")):
            # The name goes into the URL's path: never let it reach another endpoint.
            raise UpstreamError(f"{model!r} is not a Gemini model name", status=400)
        if not model.startswith(("models/", "tunedModels/")):  # as the SDK names them
            model = f"models/{model}"
        path = urllib.parse.quote(f"{self.prefix}{model}:streamGenerateContent", safe="/:")
        head = f"POST {path}?alt=sse HTTP/1.1\r\n".encode("latin-1") + self.headers
        return await _direct.send(self.pool, head, b"", body, read_timeout=self.timeout,
                                  max_retries=self.attempts - 1,
                                  max_wait=self.max_retry_wait, failures=_FAILURES,
                                  policy=_GeminiRetries())


class _GeminiRetries:
    """The SDK's `HttpRetryOptions` policy: its statuses and transport failures, waits of
    tenacity's `wait_exponential_jitter` with the SDK's defaults, no attempt header."""

    counts_attempts = False
    retries_silence = False

    def status_error(self, status: int, text: bytes) -> str:
        return _error_text(text, status)

    def retry_after(self, response: _http1.Response) -> float | None:
        return 0.0 if response.status in _RETRY_STATUSES else None

    def asked_wait(self, response: _http1.Response, text: bytes) -> float | None:
        # (The SDK waits its own back-off whatever the answer asks; this says when to come
        # back in the error, and gives up at once on a wait past the adapter's bound.)
        try:
            body = orjson.loads(text)
        except orjson.JSONDecodeError:
            body = None
        return _direct.retry_after_seconds(response.header) or _retry_delay(body)

    def backoff(self, attempt: int) -> float:
        return min(_RETRY_INITIAL * 2.0 ** attempt + random.random(), _RETRY_MAX)


@functools.cache
def _error_body_tolerant() -> type[aiohttp.ClientResponse]:
    """aiohttp's answer, but an error answer's body that is not JSON (a proxy's page labelled
    JSON, a cut body) reads as `{}`: the SDK, reading it, raised the decoder's error (taken
    for an unreadable frame: the status lost, never retried); now it raises its error of
    the status, retried as the status says."""
    import aiohttp

    class ErrorBodyTolerant(aiohttp.ClientResponse):
        async def json(self, **options: Any) -> Any:
            if self.status < 400:
                return await super().json(**options)
            try:
                return await super().json(**options)
            except ValueError:  # (JSONDecodeError, UnicodeDecodeError)
                return {}

    return ErrorBodyTolerant


def _client_timeout(client: genai.Client) -> float | None:
    """A ready client's `HttpOptions.timeout` (milliseconds), in seconds."""
    # (the SDK keeps its options on its private API client; none: read as no timeout)
    options = getattr(getattr(client, "_api_client", None), "_http_options", None)
    milliseconds = read_timeout(getattr(options, "timeout", None))
    return None if milliseconds is None else milliseconds / 1000


def _sdk_version() -> str:
    # The version the SDK reports, from its distribution's metadata (no import).
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("google-genai")
    except PackageNotFoundError:  # pragma: no cover - the extra installs it
        return "unknown"


def _retry_delay(body: object) -> float | None:
    """The `retryDelay` ("37s") of an error body's `google.rpc.RetryInfo`, in seconds."""
    error = body.get("error", body) if isinstance(body, dict) else None
    details = error.get("details") if isinstance(error, dict) else None
    for detail in details if isinstance(details, list) else ():
        if isinstance(detail, dict) and str(detail.get("@type", "")).endswith(
                "google.rpc.RetryInfo"):
            delay = detail.get("retryDelay")
            if isinstance(delay, str) and delay.endswith("s"):
                try:
                    return float(delay[:-1])
                except ValueError:
                    return None
    return None


def _answered(response: Any) -> bool:
    """Whether the SDK's response (aiohttp's or httpx's) had a 2xx status."""
    status = getattr(response, "status", None)
    if not isinstance(status, int):
        status = getattr(response, "status_code", None)
    return isinstance(status, int) and 200 <= status < 300


def _error_text(text: bytes, status: int) -> str:
    """What the SDK's `APIError` says for this error body: its message, else its status."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        return f"HTTP {status}"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        for key in ("message", "status"):
            if isinstance(error.get(key), str) and error[key]:
                return str(error[key])
    return f"HTTP {status}"


class GeminiStreamParser:
    """`streamGenerateContent` SSE frames (raw bytes, or the SDK's chunks as REST JSON) to
    `ChatDelta`s: text, thought summaries, function calls, then usage and the finish."""

    __slots__ = ("_held", "_meta", "_remember", "_renamed", "calls", "done", "finished",
                 "reason", "secrets")

    def __init__(self, remember: _KeepSignature | None = None, *,
                 secrets: Sequence[str | None] = (),
                 renamed: Mapping[str, str] | None = None) -> None:
        self._held = event_stream("The Gemini stream", UpstreamProtocolError)
        #: The tools' names as sent (`_gemini_name`) → as they are, for the calls' names.
        self._renamed = renamed or {}
        #: The credentials the request carried: an error event echoing one loses it.
        self.secrets = secrets
        self._remember = remember
        self._meta: dict[str, Any] = {}
        self.calls = 0
        #: The candidate's finish reason, once a chunk gave it.
        self.reason: str | None = None
        #: The stream has no end marker: set by the chunk with the finish reason when it
        #: carries the usage too (Gemini's last chunk does), else by `finish`.
        self.done = False
        #: The finish reason came: the rest of the body is waited for only briefly (some
        #: servers keep it open).
        self.finished = False

    def feed(self, data: bytes) -> list[ChatDelta]:
        buffer = self._held.take(data)
        if buffer is None:
            return []
        end = buffer.rfind(b"\n")
        if end < 0:
            self._held.hold(buffer)
            return []
        self._held.hold(buffer[end + 1 :])
        out: list[ChatDelta] = []
        lines = buffer[:end].split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators (\r\n\r\n or \n\n) and comments
            try:
                chunk = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                # Its event may go on over several `data:` lines: read from here event by event
                return self._by_event(lines[line_at(lines, line):], out)
            if not isinstance(chunk, dict):
                raise after(out, UpstreamProtocolError(
                    "The Gemini stream sent an unexpected frame"))
            self.chunk(chunk, out)
            if self.done:
                break  # (the answer's last chunk: nothing follows its end)
        return out

    def _by_event(self, lines: list[bytes], out: list[ChatDelta]) -> list[ChatDelta]:
        """`out` and the chunks of the events `lines` end, each one's `data:` lines joined as
        the SSE spec joins them (the rare stream that splits a chunk over several lines); an
        event not ended yet is held with what follows it, read again with the next read."""
        chunks, rest = event_data(lines, ended=False)
        if rest:
            self._held.hold(b"\n".join(rest) + b"\n" + self._held.rest())
            by_events(self._held)  # (else each line that follows would read it all again)
        for data in chunks:
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                # (what this read parsed before it goes out first, as if the reads split here)
                raise after(out, UpstreamProtocolError(
                    "The Gemini stream sent malformed JSON")) from None
            if not isinstance(chunk, dict):
                raise after(out, UpstreamProtocolError(
                    "The Gemini stream sent an unexpected frame"))
            self.chunk(chunk, out)
            if self.done:
                break
        return out

    def chunk(self, chunk: dict[str, Any], out: list[ChatDelta]) -> None:
        error = chunk.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else None
            said = upstream_said(str(message or error), self.secrets)
            raise after(out, UpstreamError(f"Gemini reported an error mid-stream: {said}"),
                        self.spent(None))
        meta = chunk.get("usageMetadata")
        if isinstance(meta, dict):
            # counts of another type are left out rather than failing a finished answer
            self._meta = {k: v for k, v in meta.items()
                          if isinstance(v, int) and not isinstance(v, bool)}
        candidates = chunk.get("candidates")
        if candidates:
            try:
                self._candidate(candidates[0], out)
            except (AttributeError, TypeError, KeyError, IndexError, ValueError):
                # ValueError: binascii.Error of a thought signature that is not base64
                raise after(out, UpstreamProtocolError(
                    "The Gemini stream sent a chunk of an unexpected shape")) from None
        feedback = chunk.get("promptFeedback")
        if isinstance(feedback, dict) and feedback.get("blockReason"):
            raise ContentFilteredError(
                f"Gemini blocked the prompt: {upstream_said(str(feedback['blockReason']))}")
        if self.finished and isinstance(meta, dict) and not self.done:
            out.extend(self.finish())  # the last chunk: nothing else is waited for

    def _candidate(self, candidate: dict[str, Any], out: list[ChatDelta]) -> None:
        for part in (candidate.get("content") or {}).get("parts") or ():
            call = part.get("functionCall")
            if call is not None:
                if not isinstance(call.get("id") or "", str) or not isinstance(
                        call.get("name") or "", str):
                    raise TypeError("a function call's id or name is not a string")
                call_id = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
                name = call.get("name") or ""
                name = self._renamed.get(name, name)
                arguments = orjson.dumps(call.get("args") or {}).decode()
                signature = part.get("thoughtSignature")
                if signature and self._remember is not None:
                    self._remember(call_id, name, _signature_bytes(signature), arguments)
                out.append(ToolCallDelta(self.calls, call_id, name, arguments))
                self.calls += 1
            elif part.get("text"):
                if not isinstance(part["text"], str):
                    raise TypeError("a text part that is not a string")
                out.append(ReasoningDelta(part["text"]) if part.get("thought")
                           else TextDelta(part["text"]))
        reason = candidate.get("finishReason")
        if reason is not None:
            failed = GEMINI_FAILED_REASONS.get(reason)
            if failed is not None:
                raise after(out, UpstreamError(f"{failed} ({reason})"),
                            self.spent(str(reason).lower()))
            self.reason = GEMINI_FINISH_REASONS.get(reason, str(reason).lower())
            self.finished = True

    def finish(self) -> list[ChatDelta]:
        """The answer's end, once the stream has ended (nothing when it has already)."""
        if self.done:
            return []
        if self.reason is None:
            raise UpstreamConnectionError(
                "The Gemini stream ended before the answer was complete")
        self.done = True
        finish = "tool_calls" if self.calls and self.reason == "stop" else self.reason
        return [StreamEnd(finish, self._usage())]

    def _usage(self) -> dict[str, Any]:
        meta = self._meta
        return usage(meta.get("promptTokenCount"), meta.get("candidatesTokenCount"),
                     reasoning_tokens=meta.get("thoughtsTokenCount"))

    def spent(self, reason: str | None) -> StreamEnd | None:
        """What the stream said of its tokens before an error (None: nothing yet)."""
        return StreamEnd(reason, self._usage()) if self._meta else None


def rest_body(contents: list[dict[str, Any]], config: dict[str, Any]) -> bytes:
    """The JSON body the SDK sends for `generate_content_stream(contents, config)`, with the
    contents and config `build_config` makes (the REST API's camelCase names)."""
    body: dict[str, Any] = {"contents": [
        {"parts": [_rest_part(p) for p in turn["parts"]], "role": turn["role"]}
        for turn in contents]}
    if "system_instruction" in config:
        body["systemInstruction"] = {"parts": [{"text": config["system_instruction"]}],
                                     "role": "user"}
    if "tools" in config:
        body["tools"] = [{"functionDeclarations": t["function_declarations"]}
                         for t in config["tools"]]
    if "tool_config" in config:
        calling = config["tool_config"]["function_calling_config"]
        rest: dict[str, Any] = {"mode": calling["mode"]}
        if "allowed_function_names" in calling:
            rest["allowedFunctionNames"] = calling["allowed_function_names"]
        body["toolConfig"] = {"functionCallingConfig": rest}
    generation: dict[str, Any] = {}
    for ours, theirs in (("temperature", "temperature"), ("max_output_tokens",
                         "maxOutputTokens"), ("stop_sequences", "stopSequences")):
        if config.get(ours) is not None:
            generation[theirs] = config[ours]
    if config.get("thinking_config") is not None:
        # the SDK writes the thinking config with its own (snake_case) field names
        generation["thinkingConfig"] = {_THINKING_FIELDS.get(k, k): v
                                        for k, v in config["thinking_config"].items()}
    if config:  # the SDK sends a generation config, empty or not, whenever it has a config
        body["generationConfig"] = generation
    return orjson.dumps(body)


_THINKING_FIELDS = {"includeThoughts": "include_thoughts", "thinkingBudget": "thinking_budget",
                    "thinkingLevel": "thinking_level"}


def _rest_part(part: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in part.items():
        if key == "function_call":
            out["functionCall"] = value
        elif key == "function_response":
            out["functionResponse"] = value
        elif key == "thought_signature":
            out["thoughtSignature"] = (_UNSIGNED_TEXT if value == _UNSIGNED
                                       else base64.b64encode(value).decode())
        elif key == "inline_data":  # the SDK keeps the inner names as they are
            out["inlineData"] = {"data": base64.b64encode(value["data"]).decode(),
                                 "mime_type": value["mime_type"]}
        elif key == "file_data":
            out["fileData"] = value
        else:
            out[key] = value
    return out


# ---- history ---------------------------------------------------------------------------------


#: A function name Gemini takes: its API refuses one that starts with a digit (400 "Must
#: start with a letter or an underscore"), as an MCP tool of a server named by its address
#: is (`127_0_0_1__add`).
_GEMINI_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9_.\-]")


def _gemini_name(name: str) -> str:
    """`name` as declared to Gemini: itself when Gemini takes it, else a name it takes,
    the same each time (the history's calls are renamed alike), the name's characters kept
    where they may be, and a digest of it so that two names cannot become one."""
    if _GEMINI_NAME.fullmatch(name):
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"_{_NOT_IN_NAMES.sub('_', name)[:54]}_{digest}"


def to_gemini_contents(
        messages: Sequence[Message],
        signatures: Mapping[str, bytes] | Callable[[ToolCall], bytes | None] | None = None,
) -> tuple[list[str], list[dict[str, Any]]]:
    """AG-UI history → (system texts, Gemini contents), repaired as the module says.

    `signatures` maps a call id (or looks up a call) to its thought signature; the first call
    of an answer whose signature is unknown gets Google's stand-in.
    """
    signature_of = signatures if callable(signatures) else by_call_id(signatures or {})
    system: list[str] = []
    turns: list[tuple[str, list[dict[str, Any]]]] = []
    names: dict[str, str] = {}  # call id → function name, for the responses
    for message in tool_media_after_results(paired_tool_calls(messages)):
        if isinstance(message, UserMessage):
            _append(turns, "user", _user_parts(message.content))
        elif isinstance(message, AssistantMessage):
            parts: list[dict[str, Any]] = []
            text = text_of(message.content)
            if text:
                parts.append({"text": text})
            for i, call in enumerate(message.tool_calls or ()):
                names[call.id] = _gemini_name(call.function.name)
                part: dict[str, Any] = {"function_call": {
                    "name": names[call.id],
                    "args": arguments_object(call.function.arguments)}}
                # Gemini 3 signs (and checks) the first call of each answer only
                signature = signature_of(call) or (None if i else _UNSIGNED)
                if signature:
                    part["thought_signature"] = signature
                parts.append(part)
            _append(turns, "model", parts)
        elif isinstance(message, ToolMessage):
            content = text_of(message.content) or ""
            response = _response_object(content)
            if message.error:  # (a result that is its error, as a lost one's, says it once)
                response = {"error": message.error} if content == message.error else \
                    {"error": message.error, **response}
            _append(turns, "user", [{"function_response": {
                "name": names.get(message.tool_call_id, ""), "response": response}}])
        elif isinstance(message, SystemMessage | DeveloperMessage):
            text = text_of(message.content)
            if text:
                system.append(text)
    if not turns:
        turns.append(("user", [{"text": OPENING_TURN}]))
    return system, [{"role": role, "parts": parts} for role, parts in turns]


def _response_object(content: str) -> dict[str, Any]:
    try:
        value = check_json_text(content, "A tool result")  # (too deep: kept as its text)
    except (orjson.JSONDecodeError, JSONTooDeepError):
        return {"output": content}
    return value if isinstance(value, dict) else {"output": content}


def _append(turns: list[tuple[str, list[dict[str, Any]]]], role: str,
            parts: list[dict[str, Any]]) -> None:
    """Add `parts` to the last turn if it is `role`'s, else as a turn of their own; a turn
    of function responses holds nothing else (Gemini refuses one holding text or data
    beside them with a 400), so what follows the responses is a user turn after it."""
    if not parts:
        return
    if turns and turns[-1][0] == role and _answers(turns[-1][1]) == _answers(parts):
        turns[-1][1].extend(parts)
    else:
        turns.append((role, parts))


def _answers(parts: list[dict[str, Any]]) -> bool:
    return any("function_response" in part for part in parts)


def _user_parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content}] if content else []
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = getattr(part, "type", None)
        if kind == "text":
            if part.text:
                parts.append({"text": part.text})
        elif kind in ("image", "audio", "video", "document"):
            source = attachment_source("The Gemini API", part)
            mime = media_type(source) or _DEFAULT_MIME[kind]
            if source.type == "data":
                try:
                    data = base64.b64decode(source.value, validate=True)
                except (binascii.Error, ValueError):
                    raise unsupported_attachment(
                        "The Gemini API", part, "its data is not base64") from None
                parts.append({"inline_data": {"mime_type": mime, "data": data}})
            elif source.type in ("url", "file"):
                parts.append({"file_data": {"file_uri": source.value, "mime_type": mime}})
    return parts


_DEFAULT_MIME = {"image": "image/png", "audio": "audio/wav", "video": "video/mp4",
                 "document": "application/pdf"}


# ---- tool schemas ----------------------------------------------------------------------------

_log = structlog.get_logger("copilot_runtime.adapters.google")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


#: The keywords kept as they are, each when its value is of the type Gemini takes (another
#: one, valid or not in JSON Schema, made the SDK or the API refuse the whole request).
_KEPT: dict[str, Callable[[Any], bool]] = {
    "description": lambda v: isinstance(v, str), "title": lambda v: isinstance(v, str),
    "pattern": lambda v: isinstance(v, str), "nullable": lambda v: isinstance(v, bool),
    "minItems": _is_count, "maxItems": _is_count, "minLength": _is_count,
    "maxLength": _is_count, "minProperties": _is_count, "maxProperties": _is_count,
    "minimum": _is_number, "maximum": _is_number,
    "default": lambda _: True, "example": lambda _: True}
_FORMATS = {"STRING": {"enum", "date-time"}, "NUMBER": {"float", "double"},
            "INTEGER": {"int32", "int64"}}
_TYPES = {"string": "STRING", "number": "NUMBER", "integer": "INTEGER", "boolean": "BOOLEAN",
          "array": "ARRAY", "object": "OBJECT"}
_MAX_DEPTH = 32
#: Keywords that only constrain strings, or only numbers: a typeless schema with one of
#: them is of that type.
_STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern"})
_NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                              "multipleOf"})
#: How deep arrays nest in the schema of "any JSON value" (the subset has no recursion).
_ANY_ARRAY_DEPTH = 2


def _any_value(array_depth: int) -> dict[str, Any]:
    """Gemini's schema for any JSON value: each type as an `anyOf` alternative, arrays of
    any values nested `array_depth` deep."""
    members: list[dict[str, Any]] = [{"type": t} for t in ("STRING", "NUMBER", "INTEGER",
                                                           "BOOLEAN", "OBJECT")]
    if array_depth > 0:
        members.append({"type": "ARRAY", "items": _any_value(array_depth - 1)})
    return {"anyOf": members, "nullable": True}


def _tool_parameters(name: str, parameters: Any) -> dict[str, Any]:
    """`to_gemini_schema` of a tool's parameters; open ones (none declared) when the
    conversion fails, so a schema it cannot take costs that tool's arguments, not the run."""
    try:
        # (flattened first: a top-level anyOf left Gemini no properties, so no arguments)
        return to_gemini_schema(tool_schema(parameters, name))
    except (TypeError, ValueError, AttributeError, KeyError, RecursionError):
        _log.warning("tool schema not converted for Gemini", tool=name, exc_info=True)
        return {"type": "OBJECT"}


#: Output tokens added to a bound the runtime sets itself, for the model's thinking.
_THINKING_ROOM = 4000


def to_gemini_schema(schema: Any) -> dict[str, Any]:
    """A JSON Schema as the OpenAPI subset Gemini's function declarations accept.

    `$ref`s are inlined (a recursive one ends as a plain object), `oneOf` becomes `anyOf`,
    `allOf` is merged, a `null` alternative becomes `nullable`, `const` becomes a one-value
    `enum`, enums of non-strings move into the description, unsupported formats and keywords
    (`additionalProperties`, `$schema`, `not`, `if`, ...) are dropped, `required` keeps only
    declared properties, an array gets `items`, a typeless schema the type its keywords
    imply, or else an `anyOf` of every JSON type (never a guessed STRING: Gemini would send
    every value as a string). A boolean schema: `true` is any value; `false` (no value) is
    dropped where it can be (a property, an alternative), else any value too.
    """
    if not isinstance(schema, dict):
        return {"type": "OBJECT"}
    definitions: dict[str, Any] = {}
    for keyword in ("definitions", "$defs"):  # (either may be no keyword: any value)
        if isinstance(schema.get(keyword), dict):
            definitions.update(schema[keyword])
    return _convert(schema, definitions, 0, frozenset())


def _resolved(schema: Any, definitions: dict[str, Any]) -> Any:
    """The definition a member `{"$ref": ...}` names (None if none), else the member."""
    if isinstance(schema, dict) and "$ref" in schema:
        return definitions.get(str(schema["$ref"]).rsplit("/", 1)[-1])
    return schema


def _merge_all_of(schema: dict[str, Any], definitions: dict[str, Any]) -> None:
    """`allOf`'s members merged into `schema` (their properties and required added to its
    own; any other keyword where `schema` has none)."""
    members = schema.pop("allOf", None)
    for member in members if isinstance(members, list) else ():
        resolved = _resolved(member, definitions)
        if not isinstance(resolved, dict):
            continue  # (true adds nothing; false, no value at all, has no Gemini form)
        for key, value in resolved.items():
            if key == "properties" and isinstance(value, dict):
                own = schema.get("properties")
                schema["properties"] = {**(own if isinstance(own, dict) else {}), **value}
            elif key == "required" and isinstance(value, list):
                own = schema.get("required")
                schema["required"] = [*(own if isinstance(own, list) else ()), *value]
            else:
                schema.setdefault(key, value)


def _convert(schema: Any, definitions: dict[str, Any], depth: int,
             seen: frozenset[str]) -> dict[str, Any]:
    if isinstance(schema, bool) and depth <= _MAX_DEPTH:
        schema = {}  # any value (false, none, has no Gemini form: see the callers)
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return {"type": "OBJECT"}
    ref = schema.get("$ref")
    if isinstance(ref, str):
        name = ref.rsplit("/", 1)[-1]
        target = definitions.get(name)
        if isinstance(target, bool):
            target = {}
        if not isinstance(target, dict) or name in seen:
            return {"type": "OBJECT", **_text_keys(schema)}
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return _convert(merged, definitions, depth + 1, seen | {name})
    schema = dict(schema)
    _merge_all_of(schema, definitions)
    out: dict[str, Any] = {k: schema[k] for k, fits in _KEPT.items()
                           if k in schema and fits(schema[k])}
    nullable = False
    kind = schema.get("type")
    if isinstance(kind, list):
        nullable = "null" in kind
        kinds = [k for k in kind if k != "null"]
        if len(kinds) == 1:
            kind = kinds[0]
        else:
            kind = None
            schema.setdefault("anyOf", [{"type": k} for k in kinds])
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(alternatives, list):
        nulls = [a for a in alternatives if isinstance(a, dict) and a.get("type") == "null"]
        nullable = nullable or bool(nulls)
        # (false, no value, is an alternative never taken)
        members = [a for a in alternatives if a is not False and a not in nulls]
        converted = [_convert(a, definitions, depth + 1, seen) for a in members]
        if len(converted) == 1:
            out = {**converted[0], **out}
            kind = None
        elif converted:
            out["anyOf"] = converted
    if nullable:
        out["nullable"] = True
    if "const" in schema:
        schema["enum"] = [schema["const"]]
    if kind is None and "anyOf" not in out and "type" not in out:
        kind = ("object" if "properties" in schema else "array" if "items" in schema
                else "string" if "enum" in schema or _STRING_KEYWORDS & schema.keys()
                else "number" if _NUMBER_KEYWORDS & schema.keys() else None)
        if kind is None and not alternatives:
            # Any JSON value: Gemini fills arguments to the declared type, so a guessed
            # STRING would turn 3 into "3" and an object into its JSON text.
            return {**out, **_any_value(_ANY_ARRAY_DEPTH)}
    if isinstance(kind, str) and kind in _TYPES:
        out["type"] = _TYPES[kind]
    gemini_type = out.get("type")
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        if gemini_type == "STRING" and all(isinstance(v, str) for v in enum):
            out["enum"] = enum
        else:
            values = ", ".join(json.dumps(v) for v in enum)  # (orjson: 64-bit ints only)
            out["description"] = (f"{out.get('description', '')} (one of: {values})").strip()
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS.get(str(gemini_type), ()):
        out["format"] = fmt
    if "exclusiveMinimum" in schema and isinstance(schema["exclusiveMinimum"], int | float):
        out.setdefault("minimum", schema["exclusiveMinimum"])
    if "exclusiveMaximum" in schema and isinstance(schema["exclusiveMaximum"], int | float):
        out.setdefault("maximum", schema["exclusiveMaximum"])
    if gemini_type == "OBJECT":
        properties = schema.get("properties")
        if isinstance(properties, dict):
            # (a property whose schema is false may never be given: it is left out)
            properties = {name: value for name, value in properties.items()
                          if value is not False}
        if isinstance(properties, dict) and properties:
            out["properties"] = {name: _convert(value, definitions, depth + 1, seen)
                                 for name, value in properties.items()}
            required = schema.get("required")
            required = [r for r in required if isinstance(r, str) and r in properties] \
                if isinstance(required, list) else []
            if required:
                out["required"] = list(dict.fromkeys(required))
    elif gemini_type == "ARRAY":
        # (no items: any values, see above)
        out["items"] = _convert(schema.get("items", {}), definitions, depth + 1, seen)
    if "default" in out and gemini_type == "OBJECT":
        del out["default"]
    return out


def _text_keys(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: schema[k] for k in ("description", "title") if isinstance(schema.get(k), str)}


#: The SDK route's chunks are dumped to JSON by pydantic, which writes bytes in the URL-safe
#: alphabet ("-", "_"); the API's own JSON uses the standard one ("+", "/").
_URL_SAFE = str.maketrans("-_", "+/")


def _signature_bytes(signature: Any) -> bytes:
    """A thought signature's bytes, from either base64 alphabet; anything else is refused
    (a lenient decode drops what it cannot read, and the call then replays a signature the
    API refuses)."""
    if not isinstance(signature, str):
        raise TypeError("a thought signature that is not a string")
    return base64.b64decode(signature.translate(_URL_SAFE), validate=True)
