"""Messages in the shapes of the 1.x protocol that are not streamed one event at a time.

* `to_copilotkit_messages`: AG-UI messages as the JSON representation react-core 1.10
  loads with `loadMessagesFromJsonRepresentation`, which tells items apart by their keys
  (`content` text, `arguments` tool call, `result` tool result). `loadAgentState` answers
  with it, and agent-state messages carry it under `state.messages`.
* `interrupt_messages`: the messages of a CopilotKit-style interrupt (`copilotkit_interrupt`
  in the `copilotkit` SDK) as the `BaseMessageOutput`s of a
  `CopilotKitLangGraphInterruptEvent`. They arrive either in that JSON representation (a
  remote endpoint's `on_copilotkit_interrupt`) or as serialized LangChain messages (the
  interrupt value of an in-process or platform graph).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from copilot_runtime.messages import text_of
from copilot_runtime.protocols.graphql.project import Obj

__all__ = ["interrupt_messages"]

_HIDDEN_ROLES = frozenset({"system", "developer"})
_SUCCESS: Obj = ("SuccessMessageStatus", {"code": "Success"})


def _from_langchain(item: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A serialized LangChain message in the JSON representation (human and AI only: an
    interrupt asks the user something, it never carries tool results)."""
    kind, message_id = item.get("type"), item.get("id")
    text = text_of(item.get("content"))
    if kind == "human":
        return [{"id": message_id, "role": "user", "content": text}]
    if kind not in ("ai", "AIMessageChunk"):
        return []
    out: list[dict[str, Any]] = []
    calls = item.get("tool_calls") or ()
    if text or not calls:
        out.append({"id": message_id, "role": "assistant", "content": text})
    for call in calls:
        if isinstance(call, Mapping):
            out.append({"id": call.get("id"), "name": call.get("name") or "",
                        "arguments": call.get("args") or {}, "parentMessageId": message_id})
    return out


def interrupt_messages(items: Any, created_at: str) -> list[Obj]:
    """The `data.messages` of a `CopilotKitLangGraphInterruptEvent`, all complete."""
    outputs: list[Obj] = []
    for raw in items if isinstance(items, list) else ():
        if not isinstance(raw, Mapping):
            continue
        for item in _from_langchain(raw) if "type" in raw else [raw]:
            # (an AI message made for an interrupt may have no id; the field is required)
            message_id = str(item.get("id") or f"ck-{uuid.uuid4()}")
            parent = item.get("parentMessageId")
            if "arguments" in item:
                arguments = item["arguments"]
                outputs.append(("ActionExecutionMessageOutput", {
                    "id": message_id, "createdAt": created_at,
                    "name": str(item.get("name") or ""),
                    "arguments": [arguments if isinstance(arguments, str)
                                  else orjson.dumps(arguments).decode()],
                    "parentMessageId": parent if isinstance(parent, str) else None,
                    "scope": None, "status": _SUCCESS}))
            elif "content" in item and "role" in item:
                role = item["role"]
                outputs.append(("TextMessageOutput", {
                    "id": message_id, "createdAt": created_at,
                    "content": [text_of(item.get("content"))],
                    "role": role if role in ("user", "assistant", "system") else "assistant",
                    "parentMessageId": parent if isinstance(parent, str) else None,
                    "status": _SUCCESS}))
    return outputs
