"""Anthropic's Messages API (Claude), also through the SDK's Bedrock and Vertex clients.

The official `anthropic` SDK is the source of the configuration: key or token, base URL and
every header come from its client (`default_headers`). By default the adapter then sends the
pre-encoded request itself over the keep-alive client of `_http1`, with the SDK's retry policy
(`_direct`; a test proves the same request, headers and retries against the mock), and
parses the streamed answer here from the raw bytes: sending through the SDK cost more CPU
than all the rest of a chat, and its iterator builds a pydantic model per event. With
`transport="sdk"` or an HTTP proxy in the environment the SDK sends it (its raw route, same
parser); a Bedrock or Vertex client streams through the SDK's event iterator, since Bedrock
frames its stream in AWS's binary format.

The history is repaired on the way out, because the API refuses what clients routinely send:
every `tool_use` gets a `tool_result` in the very next user turn (a synthetic error result
when the client lost it), a result without its call becomes plain text, tool arguments are
always JSON objects, system and developer messages go to `system`, and turns of one role are
merged.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import os
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Literal, cast

import aiohttp
import anthropic
import httpx2
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
    OwnedThread,
    after,
    arguments_object,
    by_call_id,
    error_body_message,
    find_cause,
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
    EncryptedReasoning,
    ReasoningDelta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
)
from copilot_runtime.messages import (
    attachment_filename,
    attachment_source,
    inline_image_type,
    media_type,
    paired_tool_calls,
    tool_media_after_results,
    unsupported_attachment,
)

__all__ = ["AnthropicAdapter", "AnthropicStreamParser", "to_anthropic_messages"]

#: The model used when none is named (one the SDK does not list as deprecated: see
#: tests/test_anthropic_direct.py).
DEFAULT_MODEL = "claude-sonnet-4-6"

#: The API requires `max_tokens`; this is used when neither the app nor the client set one.
DEFAULT_MAX_TOKENS = 4096
#: The most signed thinking an adapter keeps for the tool loops in flight, in characters of
#: its blocks' strings (counted in answers, 1,024 answers just under the run's bound of
#: unseen thinking each were kept: gigabytes no client was shown).
_THINKING_KEPT_CHARS = 16_000_000
#: Keeps an answer's thinking blocks (its first tool_use's id and name, the blocks).
_KeepThinking = Callable[[str, str | None, list[dict[str, Any]]], None]
#: Tokens adaptive thinking may use on top of the runtime's own `max_tokens` (as the OpenAI
#: and Gemini adapters give reasoning models).
_THINKING_ROOM = 4000
_log = structlog.get_logger("copilot_runtime.adapters.anthropic")
_FAILURES = _direct.Failures(
    "Anthropic", "Anthropic request timed out", "Could not reach the Anthropic API",
    "The Anthropic API closed the connection without answering",
    "The Anthropic API sent a malformed HTTP answer",
    "The Anthropic stream broke off before the answer was complete")
#: Unlike OpenAI's, the SDK waits for any Retry-After.
_RETRIES = _direct.SDKRetries(max_retry_after=None)
_FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls",
                   "max_tokens": "length", "model_context_window_exceeded": "length",
                   "refusal": "content_filter"}
# (`pause_turn` passes as it is: a paused turn is not a finished answer)


class AnthropicAdapter:
    """Claude through the Messages API, streaming text and tool use.

    `client` may be any async client of the SDK: `AsyncAnthropic`, `AsyncAnthropicBedrock`
    or `AsyncAnthropicVertex`. `thinking` is passed through (for example
    ``{"type": "enabled", "budget_tokens": 2048}``). `transport="sdk"` sends through the SDK
    even when the adapter could send itself.

    `max_retry_wait` (seconds, 60 by default) bounds the waits between retries: a provider
    that asks for a longer wait (its Retry-After), or waits that would add up to more, end
    the run at once with its error (HTTP 429, 529 or 5xx), which says when to try again.
    Through the SDK (`transport="sdk"`) a Retry-After past the bound is not waited for
    either; a ready `client=` keeps its own waits.

    `timeout` (seconds, 120 by default) bounds each wait for the answer. A ready `client=`
    given no `timeout` keeps its own read timeout (the SDK's default: 600 s).
    """

    provider = "anthropic"

    def __init__(
        self,
        *,
        model: str = DEFAULT_MODEL,
        api_key: str | None = None,
        base_url: str | None = None,
        client: anthropic.AsyncAnthropic | anthropic.AsyncAnthropicBedrock
        | anthropic.AsyncAnthropicVertex | None = None,
        timeout: float | None = None,
        max_retries: int = 2,
        max_retry_wait: float = _direct.DEFAULT_MAX_RETRY_WAIT,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        thinking: dict[str, Any] | None = None,
        extra_body: dict[str, Any] | None = None,
        transport: Literal["auto", "direct", "sdk"] = "auto",
    ) -> None:
        self.model = model
        self._client = client
        #: Whether it makes its client (and closes it), or was given one: the application
        #: owns what it gave, and closes it (a module-level adapter serves each new runtime).
        self._owns_client = client is None
        self._api_key = api_key or os.environ.get("ANTHROPIC_API_KEY")
        self._base_url = base_url
        self._timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self._wait_bound = wait_bound(
            timeout, None if client is None else read_timeout(getattr(client, "timeout", None)))
        self._max_retries = max_retries
        self._max_retry_wait = _direct.check_max_retry_wait("AnthropicAdapter", max_retry_wait)
        self.max_tokens = max_tokens
        self.thinking = thinking
        self._extra_body = extra_body or {}
        # an answer's first tool_use → its thinking blocks: with thinking on, the API
        # wants them back, signed, before the tool calls when the loop continues
        self._thinking: KeptForThreads[list[dict[str, Any]]] = KeptForThreads(
            _THINKING_KEPT_CHARS, _thinking_chars)
        if client is None and not self._api_key:
            raise ConfigurationError("AnthropicAdapter needs api_key (or ANTHROPIC_API_KEY)")
        if transport not in ("auto", "direct", "sdk"):
            raise ConfigurationError("transport must be 'auto', 'direct' or 'sdk'")
        if transport == "direct" and client is not None:
            raise ConfigurationError("transport='direct' sends without the SDK: pass the "
                                     "settings, not a client")
        #: Whether this adapter sends requests itself (built on first use, from the client).
        self._sends_directly = client is None and (
            transport == "direct" or (transport == "auto"
                                      and not _direct.proxy_in_environment()))
        self._direct: _DirectRoute | None = None

    @property
    def transport(self) -> str:
        """How requests are sent: "direct" (this package's client) or "sdk"."""
        return "direct" if self._sends_directly else "sdk"

    @property
    def client(self) -> Any:
        # Created on first use: its aiohttp session must be made inside the running loop.
        if self._client is None:
            self._client = anthropic.AsyncAnthropic(
                api_key=self._api_key, base_url=self._base_url, timeout=self._timeout,
                max_retries=self._max_retries,
                http_client=anthropic.DefaultAioHttpClient(
                    timeout=self._timeout, event_hooks={"response": [
                        _direct.sdk_wait_bound(self._max_retry_wait)]}))
        return self._client

    async def aclose(self) -> None:
        if self._direct is not None and self._direct.close():
            await asyncio.sleep(0)  # the closed sockets are released on the loop's next turn
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None  # made again on its next use
            await client.close()

    async def forget_thread(self, thread_id: str) -> None:
        """Drop the thinking kept for a deleted thread: its id may be taken again."""
        self._thinking.forget(thread_id)

    def build_params(self, request: ChatRequest) -> dict[str, Any]:
        """The Messages request body for `request` (without `stream`)."""
        thinking_on = self.thinking is not None and self.thinking.get("type") != "disabled"
        system, messages = to_anthropic_messages(
            request.messages, functools.partial(self._thinking_of, request_thread(request)),
            client_thinking=thinking_on)
        if request.system_prompt:
            system.insert(0, request.system_prompt)
        params: dict[str, Any] = {
            "model": request.model or self.model,
            "max_tokens": request.max_tokens or self.max_tokens,
            "messages": messages,
        }
        if system:
            params["system"] = "\n\n".join(system)
        if request.tools:
            params["tools"] = [{"name": t.name, "description": t.description,
                                "input_schema": tool_schema(t.parameters, t.name)}
                               for t in request.tools]
            choice = request.tool_choice
            if choice in ("auto", "none"):
                params["tool_choice"] = {"type": choice}
            elif choice == "required":
                params["tool_choice"] = {"type": "any"}
            elif choice:
                params["tool_choice"] = {"type": "tool", "name": choice}
        if request.temperature is not None:
            # Anthropic's range is 0..1 (OpenAI's 0..2): clamp rather than fail the run.
            params["temperature"] = min(max(float(request.temperature), 0.0), 1.0)
        if request.stop:
            params["stop_sequences"] = request.stop
        if self.thinking is not None and _thinking_allowed(params, self.thinking):
            params["thinking"] = self.thinking
            params.pop("temperature", None)  # extended thinking only runs at the default
            budget = self.thinking.get("budget_tokens")
            if isinstance(budget, int) and params["max_tokens"] <= budget:
                # The API wants room past the thinking budget (else a 400): the answer keeps
                # the room asked for (a guardrail judge's 100 tokens, a client's maxTokens).
                params["max_tokens"] += budget
            elif (not isinstance(budget, int) and request.runtime_settings
                  and request.max_tokens is not None
                  and self.thinking.get("type") != "disabled"):
                # Adaptive thinking has no budget but counts against max_tokens: the runtime's
                # own small bound (a judge's) gets room to think before its answer.
                params["max_tokens"] += _THINKING_ROOM
        return params

    def _thinking_of(self, thread: OwnedThread | None,
                     call: ToolCall) -> list[dict[str, Any]] | None:
        """The signed thinking blocks of `thread`'s answer whose first tool call is `call`,
        when this process still holds them."""
        return self._thinking.get(thread, call.id, call.function.name, call.function.arguments)

    def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        params = {**self.build_params(request), **self._extra_body}
        thread = request_thread(request)
        # (the parser's own list is kept: thinking that follows the call is kept too)
        keep = None if thread is None else functools.partial(self._thinking.keep, thread)
        if self._sends_directly:
            if self._direct is None:
                self._direct = _DirectRoute(self, self.client)
            return self._stream_direct(self._direct, params, keep)
        return self._stream_sdk(params, keep)

    def _betas(self, params: dict[str, Any]) -> str | None:
        """The `anthropic-beta` header `params` needs, with the client's own betas; None
        if they need none beyond those. A file id is read only with the Files API's beta
        (without it the API refuses the request)."""
        if not _uses_files(params.get("messages")):
            return None
        headers = getattr(self.client, "default_headers", {})
        betas = [b.strip() for name, value in headers.items()
                 if name.lower() == "anthropic-beta" for b in str(value).split(",") if b.strip()]
        if FILES_BETA in betas:
            return None
        return ",".join([*betas, FILES_BETA])

    async def _stream_direct(self, route: _DirectRoute, params: dict[str, Any],
                             keep: _KeepThinking | None) -> AsyncIterator[Sequence[ChatDelta]]:
        betas = self._betas(params)
        response = await route.send(orjson.dumps({**params, "stream": True}), betas)
        parser = AnthropicStreamParser(secrets=route.secrets, keep_thinking=keep)
        async for deltas in _direct.stream(response, parser, _FAILURES):
            yield deltas

    async def _stream_sdk(self, params: dict[str, Any], keep: _KeepThinking | None
                          ) -> AsyncIterator[Sequence[ChatDelta]]:
        client = self.client
        # What the request carries: an upstream's words echoing one lose it.
        secrets = (self._api_key,
                   *_direct.header_credentials(getattr(client, "default_headers", {})))
        betas = self._betas(params)
        headers = {"anthropic-beta": betas} if betas else {}
        try:
            parser = AnthropicStreamParser(secrets=secrets, keep_thinking=keep)
            if type(client) is anthropic.AsyncAnthropic:
                # The SDK's raw route: its authentication, retries and errors, our parser.
                response = cast(httpx2.Response, await client.post(
                    "/v1/messages", cast_to=httpx2.Response,
                    content=orjson.dumps({**params, "stream": True}),
                    options={"headers": {"Content-Type": "application/json", **headers}},
                    stream=True, stream_cls=anthropic.AsyncStream[Any]))
                # (the SDK's client alone may wait forever: see _idle)
                pieces = IdleBound(response.aiter_bytes(), self._wait_bound, _FAILURES.silent)
                try:
                    async for data in pieces:
                        deltas = parser.feed(data)
                        if deltas:
                            yield deltas
                        if parser.done:
                            break
                finally:
                    pieces.close()
                    await response.aclose()
            else:
                events = await client.messages.create(**params, stream=True,
                                                      extra_headers=headers or None)
                bounded = IdleBound(aiter(events), self._wait_bound, _FAILURES.silent)
                try:
                    async for event in bounded:
                        deltas = []
                        parser.event(event.model_dump(mode="json"), deltas)
                        if deltas:
                            yield deltas
                        if parser.done:
                            break
                finally:
                    bounded.close()
                    await events.close()
            parser.finish()  # (an end without `message_stop`: as the direct route says it)
        except UpstreamError as exc:
            if exc.pending:  # the deltas its read parsed before it, which come first
                pending, exc.pending = exc.pending, ()
                yield pending
            raise
        except anthropic.APIStatusError as exc:
            # (not `exc.message`: the SDK's repr of the whole error body)
            said = error_body_message(exc.body) or f"Error code: {exc.status_code}"
            if 200 <= exc.status_code < 300:
                # The SDK's event iterator raises an `error` event as a status error of
                # the answer's own status: worded as the parser words it.
                raise UpstreamError("Anthropic reported an error mid-stream: "
                                    f"{upstream_said(said, secrets)}") from None
            raise _direct.status_failure(
                "Anthropic", exc.status_code, upstream_said(said, secrets),
                _direct.unwaited(_direct.retry_after_seconds(exc.response.headers.get),
                                 self._max_retry_wait)) from None
        except anthropic.APIConnectionError as exc:
            refused = find_cause(exc, aiohttp.ClientConnectorError)
            if refused is not None:
                raise UpstreamConnectionError("Could not reach the Anthropic API") from None
            if find_cause(exc, aiohttp.ClientResponseError) is not None:
                # aiohttp could not parse the answer's head or its chunked framing
                raise UpstreamProtocolError(_FAILURES.malformed) from None
            if isinstance(exc, anthropic.APITimeoutError):
                raise UpstreamTimeoutError("Anthropic request timed out") from None
            raise UpstreamConnectionError("Could not reach the Anthropic API") from None
        except anthropic.AnthropicError as exc:
            raise UpstreamError(
                f"Anthropic request failed: {upstream_said(str(exc), secrets)}") from None
        except httpx2.DecodingError:
            raise UpstreamProtocolError(
                "The Anthropic API sent a body that could not be decoded") from None
        except httpx2.TimeoutException:
            raise UpstreamTimeoutError("Anthropic request timed out") from None
        except httpx2.TransportError:
            raise UpstreamConnectionError(
                "The Anthropic stream broke off before the answer was complete") from None


class _DirectRoute:
    """The SDK's Messages request, pre-encoded: URL and headers read from its client once."""

    def __init__(self, adapter: AnthropicAdapter, client: anthropic.AsyncAnthropic) -> None:
        url = urllib.parse.urlsplit(str(client.base_url))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigurationError(
                f"AnthropicAdapter: base_url {str(client.base_url)!r} is not an http(s) URL")
        default_port = 443 if url.scheme == "https" else 80
        port = url.port or default_port
        host = url.hostname if ":" not in url.hostname else f"[{url.hostname}]"
        self.timeout = adapter._timeout
        self.max_retries = adapter._max_retries
        self.max_retry_wait = adapter._max_retry_wait
        self.pool = _http1.HTTPPool(url.scheme, url.hostname, port,
                                    connect_timeout=adapter._timeout)
        # What the SDK's client sends with every request of a `messages.create` call that
        # sets no per-call timeout, in its order; the retry count goes in between.
        head = {"Host": host + (f":{port}" if port != default_port else ""),
                "Accept-Encoding": "gzip, deflate", "Connection": "keep-alive",
                "x-stainless-timeout": "NOT_GIVEN"}
        tail = {"x-stainless-read-timeout": str(adapter._timeout), **client.default_headers}
        for name, value in [*head.items(), *tail.items()]:
            if not isinstance(value, str) or any(c in name + value for c in "\r\n\0"):
                raise ConfigurationError(f"AnthropicAdapter: header {name!r} is not valid")
        path = url.path.rstrip("/") + "/v1/messages"
        self.head = (f"POST {path} HTTP/1.1\r\n"
                     + "".join(f"{n}: {v}\r\n" for n, v in head.items())).encode("latin-1")
        self.tail = "".join(f"{n}: {v}\r\n" for n, v in tail.items()).encode("latin-1")
        #: The credentials its requests carry (custom headers' too).
        self.secrets = _direct.credentials(self.tail)

    def close(self) -> bool:
        return self.pool.close()

    async def send(self, body: bytes, betas: str | None = None) -> _http1.Response:
        """The answer to `body`; `betas`: the request's `anthropic-beta` header, in place of
        the client's."""
        tail = self.tail
        if betas is not None:
            tail = b"".join(line for line in tail.splitlines(keepends=True)
                            if not line.lower().startswith(b"anthropic-beta:"))
            tail += f"anthropic-beta: {betas}\r\n".encode("latin-1")
        return await _direct.send(
            self.pool, self.head, tail, body, read_timeout=self.timeout,
            max_retries=self.max_retries, max_wait=self.max_retry_wait, failures=_FAILURES,
            policy=_RETRIES)


#: The beta under which the Messages API reads files by id (`source.type = "file"`).
FILES_BETA = "files-api-2025-04-14"


def _uses_files(blocks: Any) -> bool:
    """Whether one of `blocks` (messages, or their content blocks: a tool result's
    too) names a file by id."""
    for block in blocks if isinstance(blocks, list) else ():
        if not isinstance(block, dict):
            continue
        source = block.get("source")
        if (isinstance(source, dict) and source.get("type") == "file") \
                or _uses_files(block.get("content")):
            return True
    return False


def _thinking_allowed(params: dict[str, Any], thinking: Any) -> bool:
    """Whether the request `params` may be sent with `thinking` on. The API refuses manual
    thinking (`enabled`; adaptive takes it) with a forced tool choice, and, with thinking
    on, a tool loop whose turn does not start with its signed thinking (lost: another
    worker's, a restarted process's, an evicted one). A tool loop is one assistant turn:
    its first assistant message (after the last user message that is not only tool
    results) is the one that must start so; later rounds of the loop carry no thinking."""
    manual = isinstance(thinking, dict) and thinking.get("type") == "enabled"
    if manual and (params.get("tool_choice") or {}).get("type") in ("any", "tool"):
        _log.debug("anthropic_thinking_off", reason="the tool choice forces a tool")
        return False
    messages = params["messages"]
    start = 0
    for index in range(len(messages) - 1, -1, -1):
        turn = messages[index]
        if turn["role"] == "user" and not (isinstance(turn["content"], list) and all(
                b.get("type") == "tool_result" for b in turn["content"])):
            start = index + 1
            break
    for turn in messages[start:]:
        if turn["role"] == "assistant":
            content = turn["content"]
            if any(b.get("type") == "tool_use" for b in content) and content[0].get(
                    "type") not in ("thinking", "redacted_thinking"):
                _log.debug("anthropic_thinking_off",
                           reason="the tool calls' signed thinking is not known here")
                return False
            break
    return True


class AnthropicStreamParser:
    """Incremental parser of a Messages SSE stream into `ChatDelta`s.

    Fed raw bytes as they arrive; only events whose frame ended are decoded. Blocks are
    numbered by the API (`index`); tool-use blocks are renumbered 0, 1, ... as call indexes.
    """

    __slots__ = ("_args_seen", "_calls", "_held", "_held_most", "_keep_thinking", "_kept_as",
                 "_open_thinking", "_thinking_size", "done", "extra_usage", "finish_reason",
                 "finished", "input_tokens", "output_tokens", "secrets", "thinking",
                 "tool_ids")

    def __init__(self, *, secrets: Sequence[str | None] = (),
                 keep_thinking: _KeepThinking | None = None,
                 ) -> None:
        self._held = event_stream("The Anthropic stream", UpstreamProtocolError)
        #: The credentials the request carried: an error event echoing one loses it.
        self.secrets = secrets
        #: The answer's thinking blocks, whole and signed, and its tool_use ids.
        self.thinking: list[dict[str, Any]] = []
        self.tool_ids: list[str] = []
        #: Told (first tool_use's id and name, thinking blocks) as the first call starts: a
        #: run stopped during the call must not lose the blocks its next request has to send
        #: back.
        self._keep_thinking = keep_thinking
        #: The call (id, name) the answer's thinking was kept for, once it was.
        self._kept_as: tuple[str, str | None] | None = None
        self._open_thinking: dict[int, tuple[list[str], list[str]]] = {}
        #: The length of the thinking (and signatures) held: no event counts them against
        #: the run's bound when the client is not shown reasoning.
        self._thinking_size = 0
        self._held_most = HELD_BOUND.get()
        self._calls: dict[int, int] = {}
        self._args_seen: set[int] = set()
        self.done = False
        #: As `done`: `message_stop` ends the answer, nothing follows it.
        self.finished = False
        self.finish_reason: str | None = None
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.extra_usage: dict[str, Any] = {}

    def feed(self, data: bytes) -> list[ChatDelta]:
        block = self._held.events(data)
        if block is None:
            return []
        out: list[ChatDelta] = []
        lines = block.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # `event:` lines repeat the JSON's own `type`
            try:
                event = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                # Its event may go on over several `data:` lines: read from here event by event
                return self._by_event(lines[line_at(lines, line):], out)
            if not isinstance(event, dict):
                raise after(out, UpstreamProtocolError(
                    "The Anthropic stream sent an unexpected frame"))
            self.event(event, out)
            if self.done:
                break
        return out

    def _by_event(self, lines: list[bytes], out: list[ChatDelta]) -> list[ChatDelta]:
        """`out` and the events of `lines`, each one's `data:` lines joined as the SSE spec
        joins them: the rare stream that splits an event's JSON over several lines."""
        for data in event_data(lines, ended=True)[0]:
            try:
                event = orjson.loads(data)
            except orjson.JSONDecodeError:
                # (what this read parsed before it goes out first, as if the reads split here)
                raise after(out, UpstreamProtocolError(
                    "The Anthropic stream sent malformed JSON")) from None
            if not isinstance(event, dict):
                raise after(out, UpstreamProtocolError(
                    "The Anthropic stream sent an unexpected frame"))
            self.event(event, out)
            if self.done:
                break
        return out

    def finish(self) -> list[ChatDelta]:
        """Nothing more, once the body has ended; an error when it ended before
        `message_stop`."""
        if not self.done:
            raise UpstreamProtocolError(
                "The Anthropic stream ended before the answer was complete")
        return []

    def event(self, event: dict[str, Any], out: list[ChatDelta]) -> None:
        """One decoded event; a field of the wrong type is an `UpstreamProtocolError`."""
        try:
            self._event(event, out)
        except (AttributeError, TypeError, KeyError, ValueError):
            raise after(out, UpstreamProtocolError(
                "The Anthropic stream sent an event of an unexpected shape")) from None

    def _event(self, event: dict[str, Any], out: list[ChatDelta]) -> None:
        kind = event.get("type")
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            delta_kind = delta.get("type")
            if delta_kind == "text_delta":
                if _text(delta.get("text")):
                    out.append(TextDelta(delta["text"]))
            elif delta_kind == "input_json_delta":
                index = event.get("index", 0)
                call = self._calls.get(index)
                if call is not None and _text(delta.get("partial_json")):
                    self._args_seen.add(index)
                    out.append(ToolCallDelta(call, None, None, delta["partial_json"]))
            elif delta_kind == "thinking_delta":
                text = _text(delta.get("thinking"))
                open_block = self._open_thinking.get(event.get("index", 0))
                if text and open_block is not None:
                    open_block[0].append(text)
                    self._thinking_size += len(text)  # (the hot path: the add, inline)
                    if self._thinking_size > self._held_most:
                        raise after(out, HeldTooLarge("thinking", self._held_most))
                    out.append(ReasoningDelta(text))
            elif delta_kind == "signature_delta":
                open_block = self._open_thinking.get(event.get("index", 0))
                if open_block is not None and _text(delta.get("signature")):
                    open_block[1].append(delta["signature"])
                    self._held_thinking(len(delta["signature"]), out)
        elif kind == "content_block_start":
            block = event.get("content_block") or {}
            index = event.get("index", 0)
            if block.get("type") == "text":
                if _text(block.get("text")):
                    out.append(TextDelta(block["text"]))
            elif block.get("type") == "thinking":
                said, signed = block.get("thinking") or "", block.get("signature") or ""
                self._open_thinking[index] = ([said], [signed])
                self._held_thinking(len(said) + len(signed), out)
            elif block.get("type") == "redacted_thinking":
                data = block.get("data")
                self.thinking.append({"type": "redacted_thinking", "data": data})
                self._held_thinking(len(data) if isinstance(data, str) else 0, out)
            elif block.get("type") == "tool_use":
                _text(block.get("id")), _text(block.get("name"))
                if block.get("id"):
                    self.tool_ids.append(block["id"])
                    if (len(self.tool_ids) == 1 and self.thinking
                            and self._keep_thinking is not None):
                        self._kept_as = (block["id"], block.get("name"))
                        # A copy: kept as it is now (the store weighs it as it keeps it),
                        # kept again whole as the answer ends.
                        self._keep_thinking(*self._kept_as, list(self.thinking))
                call = self._calls[index] = len(self._calls)
                out.append(ToolCallDelta(call, block.get("id"), block.get("name"), ""))
                if block.get("input"):
                    self._args_seen.add(index)
                    out.append(ToolCallDelta(call, None, None,
                                             orjson.dumps(block["input"]).decode()))
        elif kind == "content_block_stop":
            index = event.get("index", 0)
            thinking = self._open_thinking.pop(index, None)
            if thinking is not None:
                self.thinking.append({"type": "thinking", "thinking": "".join(thinking[0]),
                                      "signature": "".join(thinking[1])})
            call = self._calls.get(index)
            if call is not None and index not in self._args_seen:
                self._args_seen.add(index)
                out.append(ToolCallDelta(call, None, None, "{}"))  # a call without input
        elif kind == "message_start":
            self._usage((event.get("message") or {}).get("usage"))
        elif kind == "message_delta":
            reason = (event.get("delta") or {}).get("stop_reason")
            if reason:
                self.finish_reason = _FINISH_REASONS.get(reason, reason)
            self._usage(event.get("usage"))
        elif kind == "message_stop":
            self.done = self.finished = True
            if self._kept_as is not None and self._keep_thinking is not None:
                # Kept again, whole: thinking may follow the first call (interleaved).
                self._keep_thinking(*self._kept_as, list(self.thinking))
            if self.thinking and self.tool_ids:
                # Once per answer, for the client to send back on its first call: the loop's
                # next request may land on a worker whose `keep_thinking` never saw it.
                out.append(EncryptedReasoning(0, signed_thinking_value(self.thinking)))
            out.append(StreamEnd(self.finish_reason, usage(
                self.input_tokens, self.output_tokens, **self.extra_usage)))
        elif kind == "error":
            error = event.get("error") or {}
            message = error.get("message") if isinstance(error, dict) else str(error)
            spent = None if self.input_tokens is None else StreamEnd(
                self.finish_reason, usage(self.input_tokens, self.output_tokens,
                                          **self.extra_usage))
            raise after(out, UpstreamError("Anthropic reported an error mid-stream: "
                                           f"{upstream_said(str(message), self.secrets)}"),
                        spent)
        # `ping` and unknown future events are ignored

    def _held_thinking(self, size: int, out: list[ChatDelta]) -> None:
        """`size` more characters of thinking held: past the run's bound, the run ends."""
        self._thinking_size += size
        if self._thinking_size > self._held_most:
            raise after(out, HeldTooLarge("thinking", self._held_most))

    def _usage(self, data: Any) -> None:
        """Token counts; one of another type is left out rather than failing the answer."""
        if not isinstance(data, dict):
            return
        for key in ("input_tokens", "output_tokens"):
            if _count(data.get(key)):
                setattr(self, key, data[key])
        for key in ("cache_creation_input_tokens", "cache_read_input_tokens"):
            if _count(data.get(key)) and data[key]:
                self.extra_usage[key] = data[key]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: Any) -> str | None:
    """A string field of a streamed event, or None when absent; any other type is refused."""
    if value is None or isinstance(value, str):
        return value
    raise TypeError("not a string")


def to_anthropic_messages(
        messages: Sequence[Message],
        thinking: Mapping[str, list[dict[str, Any]]]
        | Callable[[ToolCall], list[dict[str, Any]] | None] | None = None,
        *, client_thinking: bool = False,
) -> tuple[list[str], list[dict[str, Any]]]:
    """AG-UI history → (system texts, Messages turns), repaired as the module says.

    `thinking` maps the first tool_use id of an answer (or looks up its first call) to that
    answer's thinking blocks, which are put back in front of its tool calls. With
    `client_thinking`, an answer it has none for takes them from its first call's
    `encryptedValue` (`signed_thinking_value`), when that holds nothing but thinking blocks.
    """
    thinking_of = thinking if callable(thinking) else by_call_id(thinking or {})
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    # (a failed result's attachments: after all the results, in the same user message)
    for message in tool_media_after_results(paired_tool_calls(messages), failed_only=True):
        if isinstance(message, UserMessage):
            _append(turns, "user", _user_blocks(message.content))
        elif isinstance(message, AssistantMessage):
            blocks: list[dict[str, Any]] = []
            if message.tool_calls:
                first = message.tool_calls[0]
                kept = thinking_of(first)
                if kept is None and client_thinking and first.encrypted_value is not None:
                    kept = thinking_from_value(first.encrypted_value)
                blocks.extend(kept or ())
            text = text_of(message.content)
            if text and not text.isspace():  # the API refuses blank text blocks
                blocks.append({"type": "text", "text": text})
            for call in message.tool_calls or ():
                blocks.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                               "input": arguments_object(call.function.arguments)})
            if blocks:
                _append(turns, "assistant", blocks)
        elif isinstance(message, ToolMessage):
            _append(turns, "user", [_tool_result(message)])
        elif isinstance(message, SystemMessage | DeveloperMessage):
            text = text_of(message.content)
            if text:
                system.append(text)
        # activity and reasoning messages are UI state, not model input
    if not turns:
        turns.append({"role": "user", "content": [{"type": "text", "text": OPENING_TURN}]})
    return system, turns


#: What starts the opaque value an answer's thinking travels in through the client; the
#: blocks follow as base64url JSON (opaque to clients, which only keep and return it).
_SIGNED_PREFIX = "anthropic-thinking.1:"
#: The longest such value read back: a 128k-token thinking budget is well under it.
_MOST_SIGNED_CHARS = 4 * 1024 * 1024
_MOST_SIGNED_BLOCKS = 256
_THINKING_FIELDS = {"thinking": ("type", "thinking", "signature"),
                    "redacted_thinking": ("type", "data")}


def signed_thinking_value(blocks: Sequence[dict[str, Any]]) -> str:
    """An answer's thinking blocks as the opaque string its client keeps on its first call."""
    return _SIGNED_PREFIX + base64.urlsafe_b64encode(orjson.dumps(blocks)).decode()


def thinking_from_value(value: Any) -> list[dict[str, Any]] | None:
    """The thinking blocks of a value `signed_thinking_value` made, rebuilt from their own
    fields alone; None (said at debug level) for anything else: the client is trusted to
    forward only what Anthropic signed, which the API verifies."""
    read = _signed_blocks(value)
    if isinstance(read, str):
        _log.debug("anthropic_thinking_ignored", reason=read)
        return None
    return read


def _signed_blocks(value: Any) -> list[dict[str, Any]] | str:
    """`thinking_from_value`'s blocks, or why there are none."""
    if not isinstance(value, str) or not value.startswith(_SIGNED_PREFIX):
        return "the encryptedValue is not this adapter's"
    if len(value) > _MOST_SIGNED_CHARS:
        return "the encryptedValue is too long"
    try:
        decoded = orjson.loads(base64.b64decode(value[len(_SIGNED_PREFIX):], altchars=b"-_",
                                                validate=True))
    except (binascii.Error, ValueError):  # (orjson's decode error is a ValueError)
        return "the encryptedValue is not base64url JSON"
    if not isinstance(decoded, list) or not 0 < len(decoded) <= _MOST_SIGNED_BLOCKS:
        return "the encryptedValue is not a list of blocks"
    blocks: list[dict[str, Any]] = []
    for block in decoded:
        kind = block.get("type") if isinstance(block, dict) else None
        fields = _THINKING_FIELDS.get(kind) if isinstance(kind, str) else None
        if fields is None or set(block) != set(fields) or not all(
                isinstance(block[f], str) for f in fields) or not block[fields[-1]]:
            return "the encryptedValue holds a block that is not a signed thinking block"
        blocks.append({f: block[f] for f in fields})
    return blocks


def _append(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    if not blocks:
        return
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": blocks})


def _tool_result(message: ToolMessage) -> dict[str, Any]:
    """A tool message as a `tool_result` block: its text, or, with attachments, its parts
    as a user message's blocks (the API takes text, images and documents there; a failed
    result's were moved after the results, as it takes only text with `is_error`)."""
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": message.tool_call_id}
    error = f"Error: {message.error}" if message.error else None
    if not error and isinstance(message.content, list) and any(
            getattr(part, "type", "text") != "text" for part in message.content):
        result["content"] = _user_blocks(message.content)
    else:
        result["content"] = text_of(message.content) or error or ""
    if error:
        result["is_error"] = True
    return result


def _user_blocks(content: Any) -> list[dict[str, Any]]:
    # The API refuses blank text blocks: one kept in the history failed every later request.
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content and not content.isspace() else []
    blocks: list[dict[str, Any]] = []
    for part in content:
        kind = getattr(part, "type", None)
        if kind == "text":
            if part.text and not part.text.isspace():
                blocks.append({"type": "text", "text": part.text})
        elif kind == "image":
            source = attachment_source(_ANTHROPIC, part)
            blocks.append({"type": "image", "source": _source(
                source, "image/png", inline_image_type(_ANTHROPIC, part))})
        elif kind == "document":
            attachment_source(_ANTHROPIC, part)  # (refuses one with no bytes)
            block = {"type": "document", "source": _document_source(part)}
            title = attachment_filename(part, None)
            if title:
                block["title"] = title
            blocks.append(block)
        else:
            raise unsupported_attachment(_ANTHROPIC, part, f"it has no {kind} input")
    return blocks


_ANTHROPIC = "The Anthropic Messages API"


def _document_source(part: Any) -> dict[str, Any]:
    """A document's source as Messages takes one: a PDF inline, by URL (Anthropic fetches
    it, not us) or by file id, or plain text (sent as its text)."""
    source = part.source
    mime = media_type(source)
    if source.type == "file" or mime in ("application/pdf", None):
        return _source(source, "application/pdf")
    if source.type == "data" and mime == "text/plain":
        try:
            text = base64.b64decode(source.value, validate=True).decode()
        except (binascii.Error, ValueError):  # (UnicodeDecodeError is a ValueError)
            raise unsupported_attachment(
                _ANTHROPIC, part, "its data is not base64-encoded UTF-8 text") from None
        return {"type": "text", "media_type": "text/plain", "data": text}
    raise unsupported_attachment(_ANTHROPIC, part, "documents go as PDF (inline, by URL or "
                                 "as a file id) or as inline plain text")


def _source(source: Any, default_mime: str, mime: str | None = None) -> dict[str, Any]:
    if source.type == "data":
        return {"type": "base64", "media_type": mime or media_type(source) or default_mime,
                "data": source.value}
    if source.type == "url":
        return {"type": "url", "url": source.value}
    return {"type": "file", "file_id": source.value}


def _thinking_chars(blocks: list[dict[str, Any]]) -> int:
    """What kept thinking blocks weigh: the characters of their strings."""
    return sum(len(value) for block in blocks for value in block.values()
               if isinstance(value, str))
