"""OpenAI Chat Completions, and every server that speaks it (Ollama, vLLM, LM Studio, Groq).

The official `openai` SDK builds, authenticates and sends the request (on its aiohttp
transport by default). The streamed answer is parsed here, from the raw bytes: the SDK's own
stream iterator builds a pydantic model per chunk (about 50 µs each), which alone would cost
more than the whole TypeScript runtime spends on a request.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar, cast

import aiohttp
import httpx2
import openai
import orjson
from ag_ui.core import (
    AssistantMessage,
    DeveloperMessage,
    Message,
    SystemMessage,
    ToolMessage,
    UserMessage,
)

from copilot_runtime._exceptions import ConfigurationError, UpstreamError, UpstreamTimeoutError
from copilot_runtime.adapters.base import (
    ChatDelta,
    ChatRequest,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
)

__all__ = ["OpenAIAdapter"]

_E = TypeVar("_E", bound=BaseException)


class OpenAIAdapter:
    """Chat Completions with streaming, tool calls and usage.

    `base_url` points it at any OpenAI-compatible server; then no key is needed. `client`
    lets a test (or an app with its own settings) pass a ready `openai.AsyncOpenAI`.
    """

    provider = "openai"

    def __init__(
        self,
        *,
        model: str = "gpt-4o",
        api_key: str | None = None,
        base_url: str | None = None,
        client: openai.AsyncOpenAI | None = None,
        timeout: float = 120.0,
        max_retries: int = 2,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self._client = client
        self._api_key = api_key or os.environ.get("OPENAI_API_KEY")
        self._base_url = base_url
        self._timeout = timeout
        self._max_retries = max_retries
        self._extra_body = extra_body or {}
        if client is None and not self._api_key and not base_url:
            raise ConfigurationError(
                "OpenAIAdapter needs api_key (or OPENAI_API_KEY), or a base_url for an "
                "OpenAI-compatible server")

    @property
    def client(self) -> openai.AsyncOpenAI:
        # Created on first use: its aiohttp session must be made inside the running loop.
        if self._client is None:
            self._client = openai.AsyncOpenAI(
                api_key=self._api_key or "not-needed",
                base_url=self._base_url,
                timeout=self._timeout,
                max_retries=self._max_retries,
                http_client=openai.DefaultAioHttpClient(timeout=self._timeout),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()

    def build_params(self, request: ChatRequest) -> dict[str, Any]:
        """The Chat Completions request body for `request` (without `stream`)."""
        messages: list[dict[str, Any]] = []
        if request.system_prompt:
            messages.append({"role": "system", "content": request.system_prompt})
        messages.extend(to_openai_messages(request.messages))
        params: dict[str, Any] = {
            "model": request.model or self.model,
            "messages": messages,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            params["tools"] = [
                {"type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": t.parameters}}
                for t in request.tools
            ]
            if request.tool_choice in (None, "auto", "none", "required"):
                if request.tool_choice:
                    params["tool_choice"] = request.tool_choice
            else:
                params["tool_choice"] = {"type": "function",
                                         "function": {"name": request.tool_choice}}
        if request.temperature is not None:
            params["temperature"] = request.temperature
        if request.max_tokens is not None:
            params["max_tokens"] = request.max_tokens
        if request.stop:
            params["stop"] = request.stop
        return params

    async def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        # The SDK's documented route for raw requests (`client.post`) still gives us its
        # authentication, base URL, retries and error types, but skips the per-request walk
        # of its TypedDict annotations: the body is already plain JSON, so it is sent as is.
        body = orjson.dumps({**self.build_params(request), "stream": True, **self._extra_body})
        try:
            # With `cast_to=Response` the SDK hands back the unread HTTP response.
            response = cast(httpx2.Response, await self.client.post(
                "/chat/completions", cast_to=httpx2.Response, content=body,
                options={"headers": {"Content-Type": "application/json"}},
                stream=True, stream_cls=openai.AsyncStream[Any]))
            try:
                parser = ChatCompletionsStreamParser()
                async for data in response.aiter_bytes():
                    deltas = parser.feed(data)
                    if deltas:
                        yield deltas
                    if parser.done:
                        break
                if not parser.done:
                    raise UpstreamError(
                        "The OpenAI stream ended before the answer was complete")
            finally:
                await response.aclose()
        except openai.APIStatusError as exc:
            raise UpstreamError(
                f"OpenAI request failed with HTTP {exc.status_code}: {_error_message(exc)}",
                status=exc.status_code) from None
        except openai.APIConnectionError as exc:
            refused = _find_cause(exc, aiohttp.ClientConnectorError)
            if refused is not None:
                raise UpstreamError(f"Could not reach the OpenAI API: {refused}") from None
            if isinstance(exc, openai.APITimeoutError):
                raise UpstreamTimeoutError("OpenAI request timed out") from None
            raise UpstreamError(f"Could not reach the OpenAI API: {_cause(exc)}") from None
        except openai.OpenAIError as exc:
            raise UpstreamError(f"OpenAI request failed: {exc}") from None
        except httpx2.TimeoutException:
            # Raised by the byte stream itself: the answer stalled longer than the timeout.
            raise UpstreamTimeoutError("OpenAI request timed out") from None
        except httpx2.TransportError as exc:
            # Raised by the byte stream itself: the connection broke mid-answer.
            raise UpstreamError(
                f"The OpenAI stream broke off: {exc or type(exc).__name__}") from None


def _error_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        message = body.get("message") or (body.get("error") or {}).get("message")
        if isinstance(message, str):
            return message
    return exc.message


def _find_cause(exc: BaseException, kind: type[_E]) -> _E | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    return str(cause) if cause is not None and str(cause) else str(exc)


class ChatCompletionsStreamParser:
    """Incremental parser of a Chat Completions SSE stream into `ChatDelta`s.

    Fed raw bytes as they arrive; returns the deltas completed by each read. Only frames
    whose events end within the buffer are decoded, so a JSON object split across reads is
    handled, as is a multi-byte character split across reads.
    """

    __slots__ = ("_buffer", "done", "finish_reason", "usage")

    def __init__(self) -> None:
        self._buffer = b""
        self.done = False
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def feed(self, data: bytes) -> list[ChatDelta]:
        buffer = self._buffer + data if self._buffer else data
        end = buffer.rfind(b"\n\n")
        if end < 0:
            self._buffer = buffer
            return []
        self._buffer = buffer[end + 2 :]
        out: list[ChatDelta] = []
        for line in buffer[:end].split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments, `event:` lines, blank separators
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                out.append(StreamEnd(self.finish_reason, self.usage))
                break
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                raise UpstreamError("The OpenAI stream sent malformed JSON") from None
            self._chunk(chunk, out)
        return out

    def _chunk(self, chunk: Any, out: list[ChatDelta]) -> None:
        if not isinstance(chunk, dict):
            raise UpstreamError("The OpenAI stream sent an unexpected frame")
        error = chunk.get("error")
        if error:
            message = error.get("message") if isinstance(error, dict) else str(error)
            raise UpstreamError(f"OpenAI reported an error mid-stream: {message}")
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                out.append(TextDelta(content))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                out.append(ToolCallDelta(call.get("index", 0), call.get("id"),
                                         function.get("name"), function.get("arguments") or ""))
            reason = choice.get("finish_reason")
            if reason:
                self.finish_reason = reason


def to_openai_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """AG-UI history → Chat Completions messages."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, UserMessage):
            out.append({"role": "user", "content": _user_content(message.content)})
        elif isinstance(message, AssistantMessage):
            item: dict[str, Any] = {"role": "assistant", "content": _text(message.content)}
            if message.tool_calls:
                item["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": c.function.arguments}}
                    for c in message.tool_calls
                ]
            if item["content"] is None and "tool_calls" not in item:
                item["content"] = ""
            out.append(item)
        elif isinstance(message, ToolMessage):
            content = _text(message.content) or ""
            if message.error:
                content = content or f"Error: {message.error}"
            out.append({"role": "tool", "tool_call_id": message.tool_call_id,
                        "content": content})
        elif isinstance(message, SystemMessage):
            out.append({"role": "system", "content": _text(message.content) or ""})
        elif isinstance(message, DeveloperMessage):
            out.append({"role": "developer", "content": _text(message.content) or ""})
        # activity and reasoning messages are UI state, not model input
    return out


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = [getattr(p, "text", None) for p in content]
    return "".join(p for p in parts if p)


def _user_content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = getattr(part, "type", None)
        if kind == "text":
            parts.append({"type": "text", "text": part.text})
        elif kind == "image":
            source = part.source
            if source.type == "url":
                url = source.value
            else:
                url = f"data:{source.mime_type or 'image/png'};base64,{source.value}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "document" and getattr(part.source, "type", None) == "data":
            parts.append({"type": "file", "file": {
                "file_data": f"data:{part.source.mime_type or 'application/pdf'};base64,"
                             f"{part.source.value}"}})
        # audio and video have no Chat Completions input form; they are left out
    return parts
