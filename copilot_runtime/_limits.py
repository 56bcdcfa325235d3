"""How deep a request's JSON may nest, and what to do with stored JSON that nests deeper.

orjson reads 1,024 levels but writes only 254, and every later stage re-encodes what a
request carried a few levels deeper than it came (`RUN_STARTED.input` echoes the body one
level down, the thread routes wrap the events two more, a store writes them as one list).
So depth is bounded once, where JSON enters (a body, or JSON text inside a GraphQL
argument), well below what every stage can write: what is accepted can always be streamed,
stored and replayed.

Threads stored before this bound (or by an agent that produced something unencodable) are
read through `replayable`, which drops what cannot be encoded instead of failing the read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import structlog

from copilot_runtime._exceptions import JSONTooDeepError
from copilot_runtime.threads.base import StoredRun, ThreadRecord

__all__ = ["MAX_JSON_DEPTH", "check_json_depth", "check_json_text", "readable", "replayable"]

_log = structlog.get_logger("copilot_runtime.limits")

#: The most containers (objects and arrays) a request's JSON may nest, counting the body.
MAX_JSON_DEPTH = 64

# The run-level events whose identity fields a client needs even when their payload is lost.
_KEEP_FIELDS = {
    "RUN_STARTED": ("type", "threadId", "runId", "parentRunId", "timestamp"),
    "RUN_FINISHED": ("type", "threadId", "runId", "timestamp"),
    "RUN_ERROR": ("type", "message", "code", "timestamp"),
}


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if `value` nests more than `limit` containers deep (iterative: no recursion)."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        container, depth = stack.pop()
        if depth > limit:
            return True
        children = container.values() if isinstance(container, dict) else container
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def check_json_depth(data: Any, text: bytes | str, what: str = "The request body") -> None:
    """Raise `JSONTooDeepError` if `data` (decoded from `text`) nests too deep.

    A text with fewer opening brackets than the limit cannot nest deeper (the common
    case, decided at C speed); only the rest is walked.
    """
    if isinstance(text, str):
        count = text.count("{") + text.count("[")
    else:
        count = text.count(b"{") + text.count(b"[")
    if count > MAX_JSON_DEPTH and too_deep(data):
        raise JSONTooDeepError(what, MAX_JSON_DEPTH)


def check_json_text(text: str | bytes, what: str) -> Any:
    """Decode JSON text found inside a request, holding it to the same depth bound.

    Raises `orjson.JSONDecodeError` for malformed text, like `orjson.loads`.
    """
    value = orjson.loads(text)
    check_json_depth(value, text, what)
    return value


def replayable(events: Sequence[Any]) -> list[Any]:
    """`events` as they can be encoded: an event that cannot be is reduced or left out.

    A run-level event keeps its identity (a client needs every run's start and end); any
    other unencodable event (a state snapshot, a custom value) is dropped and logged.
    Costs one encoding of the list when everything is fine.
    """
    try:
        orjson.dumps(events)
    except (orjson.JSONEncodeError, TypeError):
        pass
    else:
        return list(events)
    out: list[Any] = []
    for event in events:
        try:
            orjson.dumps(event)
        except (orjson.JSONEncodeError, TypeError):
            kind = event.get("type") if isinstance(event, dict) else None
            keep = _KEEP_FIELDS.get(kind) if isinstance(kind, str) else None
            _log.warning("dropped an event that cannot be encoded", type=kind,
                         reduced=keep is not None)
            if keep is not None:
                out.append({k: event[k] for k in keep if k in event})
        else:
            out.append(event)
    return out


def readable(record: ThreadRecord) -> ThreadRecord:
    """`record` with every run `replayable`: the same object when nothing needed fixing."""
    try:
        orjson.dumps([run.events for run in record.runs])
    except (orjson.JSONEncodeError, TypeError):
        pass
    else:
        return record
    _log.warning("thread holds events that cannot be encoded", thread_id=record.thread_id)
    runs = [StoredRun(run.run_id, replayable(run.events), run.created_at)
            for run in record.runs]
    return ThreadRecord(record.thread_id, record.agent_id, record.created_at,
                        record.updated_at, runs, record.message_ids)
