"""Interrupts as the `metaEvents` of a 1.x response.

A LangGraph interrupt reaches the runtime as a custom event: `on_interrupt` from
ag-ui-langgraph (in-process and platform graphs) and from a remote endpoint's LangGraph
agent, `on_copilotkit_interrupt` from a remote endpoint when the graph used the SDK's
`copilotkit_interrupt`. 1.x clients know two meta events:

* `LangGraphInterruptEvent {value}`: `value` is the interrupt's value as a JSON string
  (the client parses it); the client answers with `metaEvents[0].response`;
* `CopilotKitLangGraphInterruptEvent {data: {value, messages}}`: the SDK's own interrupt,
  a question as a message or an action call, which the client adds to the chat.

An in-process graph's `copilotkit_interrupt` arrives as a plain `on_interrupt` whose value
holds the SDK's `__copilotkit_interrupt_value__` and `__copilotkit_messages__` keys; it is
sent as the second kind, as the SDK's own runtime did.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from copilot_runtime import events as ev
from copilot_runtime._exceptions import JSONTooDeepError
from copilot_runtime._limits import check_json_text
from copilot_runtime.protocols.graphql.messages import interrupt_messages
from copilot_runtime.protocols.graphql.project import Obj

__all__ = ["meta_event"]

_PLAIN: Final = frozenset({ev.LEGACY_INTERRUPT, "LangGraphInterruptEvent"})
_COPILOTKIT: Final = frozenset({ev.COPILOTKIT_INTERRUPT, "CopilotKitLangGraphInterruptEvent"})
_VALUE_KEY: Final = "__copilotkit_interrupt_value__"
_MESSAGES_KEY: Final = "__copilotkit_messages__"


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def meta_event(name: Any, value: Any, created_at: str) -> Obj | None:
    """The meta event for the custom event `name`, or None if it is not an interrupt."""
    if name in _PLAIN:
        parsed = value
        if isinstance(value, str) and value.startswith("{"):
            try:
                parsed = check_json_text(value, "An interrupt's value")
            except (orjson.JSONDecodeError, JSONTooDeepError):
                parsed = None  # sent on as text, which any depth can be
        if isinstance(parsed, dict) and _VALUE_KEY in parsed:
            return _copilotkit(parsed[_VALUE_KEY], parsed.get(_MESSAGES_KEY), created_at)
        return ("LangGraphInterruptEvent", {"type": "MetaEvent",
                                            "name": "LangGraphInterruptEvent",
                                            "value": _json_text(value), "response": None})
    if name in _COPILOTKIT and isinstance(value, dict):
        return _copilotkit(value.get("value"), value.get("messages"), created_at)
    return None


def _copilotkit(value: Any, messages: Any, created_at: str) -> Obj:
    data: Obj = ("CopilotKitLangGraphInterruptEventData", {
        "value": _json_text(value), "messages": interrupt_messages(messages, created_at)})
    return ("CopilotKitLangGraphInterruptEvent", {
        "type": "MetaEvent", "name": "CopilotKitLangGraphInterruptEvent", "data": data,
        "response": None})
