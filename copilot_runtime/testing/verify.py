"""`verify_events`: the ordering rules AG-UI clients enforce, for testing agents.

`@ag-ui/client` fails a run whose events break these rules; checking them in a test finds the
mistake where it is made instead of in a browser.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ag_ui.core import Event as AGUIEvent
from pydantic import TypeAdapter, ValidationError

from copilot_runtime.event_order import OrderChecker
from copilot_runtime.events import APPLICATION_DATA_KEYS, NULLABLE_DATA_KEYS

__all__ = ["EventOrderError", "verify_events"]

_EVENT = TypeAdapter(AGUIEvent)


class EventOrderError(AssertionError):
    """The events would make an AG-UI client fail the run."""


#: Where any JSON goes: the application's data, and the records the schemas leave open
#: (an interrupt's `metadata` and `responseSchema`).
_FREE_FORM = APPLICATION_DATA_KEYS | {"metadata", "responseSchema"}


def _null_path(value: Any, path: str = "") -> str | None:
    if value is None:
        return path or "<event>"
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if key in _FREE_FORM:
                # The application's data may hold nulls, and be null only where a client's
                # schema takes it (a CUSTOM value, say; never a message's content).
                if item is None and key not in NULLABLE_DATA_KEYS:
                    return where
                continue
            found = _null_path(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for item in value:
            found = _null_path(item, path)
            if found:
                return found
    return None


def verify_events(events: Iterable[dict[str, Any]], *, schema: bool = True) -> None:
    """Raise `EventOrderError` unless `events` form valid runs.

    Checks the runtime's own order rules (`copilot_runtime.event_order`): RUN_STARTED first;
    nothing after RUN_FINISHED/RUN_ERROR but a new RUN_STARTED; content, args and ends only
    for open messages and tool calls; no duplicate open starts; nothing left open at
    RUN_FINISHED; no empty text deltas. Also: no null optional fields; and, with `schema`,
    that each event parses as an `ag_ui.core` event.
    """
    order = OrderChecker()
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
        problem = order.check(event)
        if problem is not None:
            raise EventOrderError(f"{where} {problem}")
    if order.running:
        raise EventOrderError("the events end before RUN_FINISHED or RUN_ERROR")
