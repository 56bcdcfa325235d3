"""Helpers the provider adapters share: AG-UI content access and upstream error causes."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson

from copilot_runtime._exceptions import JSONTooDeepError, UpstreamError
from copilot_runtime._limits import check_json_text
from copilot_runtime.adapters.base import ChatDelta

_E = TypeVar("_E", bound=BaseException)

#: The user turn sent for a history with none (a run started with no messages, or only a
#: system one: `runAgent()` on load): Anthropic and Gemini refuse a request without any,
#: where OpenAI answers from the system prompt alone; so do they now.
OPENING_TURN = "Begin."

def find_cause(exc: BaseException, kind: type[_E]) -> _E | None:
    """The first exception of `kind` in the cause/context chain of `exc`."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def after(deltas: list[ChatDelta], error: UpstreamError) -> UpstreamError:
    """`error`, carrying the `deltas` its read parsed before it: the adapter's route delivers
    them first (`UpstreamError.pending`), whatever the TCP reads were."""
    error.pending = deltas
    return error


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
    broken JSON; the value is kept, wrapped, so the model still sees what it sent. JSON
    nested deeper than a request may be is kept as its text (decoded, no request could
    carry it: every later run of the thread failed).
    """
    if not arguments.strip():
        return {}
    try:
        value = check_json_text(arguments, "Tool-call arguments")
    except (orjson.JSONDecodeError, JSONTooDeepError):
        return {"raw_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def error_body_message(body: Any) -> str | None:
    """The human message of a provider's JSON error body (`{"error": {"message": ...}}`
    shapes), as it is: pass it on through `upstream_said`."""
    if isinstance(body, dict):
        message = body.get("message")
        error = body.get("error")
        if not isinstance(message, str) and isinstance(error, dict):
            message = error.get("message")
        if isinstance(message, str) and message:
            return message
    return None


def usage(prompt: int | None, completion: int | None, **extra: Any) -> dict[str, Any]:
    """Token usage in one shape for every provider (the OpenAI names, which clients know)."""
    prompt, completion = prompt or 0, completion or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, **{k: v for k, v in extra.items() if v}}
