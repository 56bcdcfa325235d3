"""ag-ui-langgraph's pydantic events as the runtime's wire dicts, and its state as deltas.

The bridge yields `ag_ui.core` models; the runtime carries plain camelCase dicts without
null fields. Content and argument deltas (most of a run) are built by hand; the rest go
through `model_dump`, except application data (snapshots, custom values, results), which
keep their nulls and every key (`_lg_values.json_safe`).

State snapshots leave out what is plumbing rather than application state: `messages`
(they travel as message events and `MESSAGES_SNAPSHOT`), and the frontend's tools and
context the bridge copies into `tools`, `copilotkit` and `ag-ui`. After the first snapshot
of a run, a changed state goes out as an RFC 6902 `STATE_DELTA` when that is smaller, and
an unchanged one not at all.

Interrupts: the bridge ends an interrupted run with both of its forms, the `on_interrupt`
custom event and the AG-UI 1.0 interrupt outcome on `RUN_FINISHED`; `filter_interrupt_event`
keeps the one the client understands (see `agents.langgraph` for how that is decided).
"""

from __future__ import annotations

from typing import Any, Final, Literal

from ag_ui.core import BaseEvent

from copilot_runtime import events as ev
from copilot_runtime.agents._lg_values import json_safe
from copilot_runtime.agents._wire import StateDeltaEncoder
from copilot_runtime.events import Event

__all__ = ["PLUMBING_STATE_KEYS", "InterruptChannel", "WireEncoder", "channel_for",
           "filter_interrupt_event"]

InterruptChannel = Literal["outcome", "legacy", "both"]

#: State keys that never reach the client in snapshots (see the module docstring).
PLUMBING_STATE_KEYS: Final = frozenset({"messages", "tools", "copilotkit", "ag-ui"})
# The application-data fields (`events.APPLICATION_DATA_KEYS`) that the translator's event
# models type as `Any`: dumped by `json_safe`, nulls included, not by pydantic.
# Their Python and wire names are the same word.
_ANY_DATA_FIELDS: Final = ev.APPLICATION_DATA_KEYS & {"snapshot", "delta", "value", "event",
                                                      "result"}


class WireEncoder:
    """Encodes one run's events; holds the last state sent, for deltas."""

    def __init__(self, *, state_deltas: bool = True) -> None:
        self._states = StateDeltaEncoder(deltas=state_deltas)
        #: The last state sent, as sent (JSON-ready), or None before any.
        self.state: Any = None

    def encode(self, event: BaseEvent) -> Event | None:
        kind: str = event.type.value
        if kind == ev.TEXT_MESSAGE_CONTENT:
            return ev.text_message_content(event.message_id, event.delta)  # type: ignore[attr-defined]
        if kind == ev.TOOL_CALL_ARGS:
            return ev.tool_call_args(event.tool_call_id, event.delta)  # type: ignore[attr-defined]
        if kind == ev.STATE_SNAPSHOT:
            snapshot = getattr(event, "snapshot", None)
            if isinstance(snapshot, dict):
                snapshot = {k: v for k, v in snapshot.items() if k not in PLUMBING_STATE_KEYS}
            self.state = json_safe(snapshot)
            return self._states.encode(self.state)
        return _dump(event)


def _dump(event: BaseEvent) -> Event:
    fields = type(event).model_fields
    data_fields = [name for name in _ANY_DATA_FIELDS if name in fields]
    out: Event = event.model_dump(mode="json", by_alias=True, exclude_none=True,
                                  exclude={"raw_event", *data_fields})
    for name in data_fields:
        value = getattr(event, name)
        if value is not None:
            out[name] = json_safe(value)
    return out


def channel_for(mode: str, protocol_version: str | None) -> InterruptChannel:
    """How to tell a client about interrupts: by `mode`, or for "auto" by its version.

    `@ag-ui/client` 1.0 declares `protocolVersion` ("1.0") and understands the outcome;
    0.0.x clients declare nothing and get the custom event.
    """
    if mode == "outcome":
        return "outcome"
    if mode == "legacy":
        return "legacy"
    if mode == "both":
        return "both"
    major = (protocol_version or "").split(".", 1)[0]
    # 1 or more, read without int(): "²" is a digit to str.isdigit, and int() refuses it
    # (and more than 4,300 digits).
    return "outcome" if major.isascii() and major.isdigit() and major.strip("0") else "legacy"


def filter_interrupt_event(event: Event, channel: InterruptChannel) -> Event | None:
    """`event` without the interrupt form `channel` leaves out (None to drop it)."""
    kind = event["type"]
    if kind == ev.CUSTOM and channel == "outcome" \
            and event.get("name") == ev.LEGACY_INTERRUPT:
        return None
    if kind == ev.RUN_FINISHED and channel == "legacy" and "outcome" in event:
        return {k: v for k, v in event.items() if k != "outcome"}
    return event
