"""Helpers the provider adapters share: AG-UI content access and upstream error causes."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson

from copilot_runtime._exceptions import UpstreamProtocolError, quoted

_E = TypeVar("_E", bound=BaseException)

#: The largest event a provider's stream may send (far beyond any real one).
MAX_EVENT_BYTES = 16 * 1024 * 1024
#: An unfinished event longer than this is kept as its reads, joined once it can end.
_LONG_EVENT_BYTES = 64 * 1024


class HeldBytes:
    """What a stream parser holds between reads: the start of an unfinished event.

    `take(data)` gives it back followed by `data`; `hold(rest)` keeps what follows the last
    complete event. An event still arriving past 64 KiB is kept as its reads and joined only
    when a read could end it (joining at every read costs the square of its length); one
    over `MAX_EVENT_BYTES` is the upstream's error.
    """

    __slots__ = ("_head", "_parts", "_size", "_what")

    def __init__(self, what: str) -> None:
        self._what = what
        self._head = b""
        self._parts: list[bytes] | None = None  # the reads of a long event
        self._size = 0

    def take(self, data: bytes) -> bytes | None:
        """What is held followed by `data`, or None while a long event is still arriving."""
        parts = self._parts
        if parts is None:
            return self._head + data if self._head else data
        parts.append(data)
        self._grow(len(data))
        if b"\n" not in data:
            return None
        self._parts = None
        return b"".join(parts)

    def hold(self, rest: bytes) -> None:
        if len(rest) <= _LONG_EVENT_BYTES:
            self._head = rest
        else:
            self._head, self._parts, self._size = b"", [rest], 0
            self._grow(len(rest))

    def _grow(self, size: int) -> None:
        self._size += size
        if self._size > MAX_EVENT_BYTES:
            raise UpstreamProtocolError(
                f"{self._what} sent an event larger than {MAX_EVENT_BYTES} bytes")


def find_cause(exc: BaseException, kind: type[_E]) -> _E | None:
    """The first exception of `kind` in the cause/context chain of `exc`."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def cause_text(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    return str(cause) if cause is not None and str(cause) else str(exc)


def text_of(content: Any) -> str | None:
    """The text of an AG-UI message's content (a string, or parts of which the text ones count)."""
    if content is None or isinstance(content, str):
        return content
    parts = [getattr(p, "text", None) for p in content]
    return "".join(p for p in parts if p)


def arguments_object(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as an object, which Anthropic and Gemini insist on.

    Models (and clients replaying history) sometimes send an empty string, a non-object or
    broken JSON; the value is kept, wrapped, so the model still sees what it sent.
    """
    if not arguments.strip():
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {"raw_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def error_body_message(body: Any, fallback: str) -> str:
    """The human message of a provider's JSON error body (`{"error": {"message": ...}}` shapes)."""
    if isinstance(body, dict):
        message = body.get("message")
        error = body.get("error")
        if not isinstance(message, str) and isinstance(error, dict):
            message = error.get("message")
        if isinstance(message, str) and message:
            return quoted(message, 500) or fallback
    return fallback


def usage(prompt: int | None, completion: int | None, **extra: Any) -> dict[str, Any]:
    """Token usage in one shape for every provider (the OpenAI names, which clients know)."""
    prompt, completion = prompt or 0, completion or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, **{k: v for k, v in extra.items() if v}}
