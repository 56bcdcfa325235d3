"""`verify_events`: the ordering rules AG-UI clients enforce, for testing agents.

`@ag-ui/client` fails a run whose events break these rules; checking them in a test finds the
mistake where it is made instead of in a browser.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ag_ui.core import Event as AGUIEvent
from pydantic import TypeAdapter, ValidationError

__all__ = ["EventOrderError", "verify_events"]

_EVENT = TypeAdapter(AGUIEvent)


class EventOrderError(AssertionError):
    """The events would make an AG-UI client fail the run."""


def _null_path(value: Any, path: str = "") -> str | None:
    if value is None:
        return path or "<event>"
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("snapshot", "value", "result", "state", "input", "payload", "delta",
                       "event", "rawEvent"):
                continue  # user data may hold nulls
            found = _null_path(item, f"{path}.{key}" if path else key)
            if found:
                return found
    return None


def verify_events(events: Iterable[dict[str, Any]], *, schema: bool = True) -> None:
    """Raise `EventOrderError` unless `events` form valid runs.

    Checks: RUN_STARTED first; nothing after RUN_FINISHED/RUN_ERROR but a new RUN_STARTED;
    content, args and ends only for open messages and tool calls; no duplicate open starts;
    nothing left open at RUN_FINISHED; no empty text deltas; no null optional fields; and,
    with `schema`, that each event parses as an `ag_ui.core` event.
    """
    running = False
    finished = False
    text: set[str] = set()
    calls: set[str] = set()
    steps: set[str] = set()
    for index, event in enumerate(events):
        kind = event.get("type")
        where = f"event {index} ({kind})"
        if schema:
            try:
                _EVENT.validate_python(event)
            except ValidationError as exc:
                raise EventOrderError(f"{where} does not match the AG-UI schema: {exc}") from None
        null = _null_path(event)
        if null:
            raise EventOrderError(f"{where} has a null field: {null}")
        if kind == "RUN_STARTED":
            if running:
                raise EventOrderError(f"{where}: a run is already started")
            running, finished = True, False
            continue
        if not running:
            raise EventOrderError(
                f"{where}: {'after the run ended' if finished else 'before RUN_STARTED'}")
        if kind == "TEXT_MESSAGE_START":
            if event["messageId"] in text:
                raise EventOrderError(f"{where}: message {event['messageId']} is already open")
            text.add(event["messageId"])
        elif kind == "TEXT_MESSAGE_CONTENT":
            if event["messageId"] not in text:
                raise EventOrderError(f"{where}: message {event['messageId']} is not open")
            if not event.get("delta"):
                raise EventOrderError(f"{where}: empty delta")
        elif kind == "TEXT_MESSAGE_END":
            if event["messageId"] not in text:
                raise EventOrderError(f"{where}: message {event['messageId']} is not open")
            text.discard(event["messageId"])
        elif kind == "TOOL_CALL_START":
            if event["toolCallId"] in calls:
                raise EventOrderError(f"{where}: tool call {event['toolCallId']} already open")
            calls.add(event["toolCallId"])
        elif kind in ("TOOL_CALL_ARGS", "TOOL_CALL_END"):
            if event["toolCallId"] not in calls:
                raise EventOrderError(f"{where}: tool call {event['toolCallId']} is not open")
            if kind == "TOOL_CALL_END":
                calls.discard(event["toolCallId"])
        elif kind == "STEP_STARTED":
            steps.add(event["stepName"])
        elif kind == "STEP_FINISHED":
            if event["stepName"] not in steps:
                raise EventOrderError(f"{where}: step {event['stepName']} is not open")
            steps.discard(event["stepName"])
        elif kind == "RUN_FINISHED":
            if text or calls or steps:
                raise EventOrderError(
                    f"{where}: still open: {sorted(text) + sorted(calls) + sorted(steps)}")
            running, finished = False, True
        elif kind == "RUN_ERROR":
            running, finished = False, True
            text.clear()
            calls.clear()
            steps.clear()
    if running:
        raise EventOrderError("the events end before RUN_FINISHED or RUN_ERROR")
