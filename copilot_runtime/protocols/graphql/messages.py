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
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from copilot_runtime._exceptions import JSONTooDeepError
from copilot_runtime._limits import check_json_text
from copilot_runtime.protocols.graphql.project import Obj

__all__ = ["interrupt_messages", "to_copilotkit_messages"]

_HIDDEN_ROLES = frozenset({"system", "developer"})
_SUCCESS: Obj = ("SuccessMessageStatus", {"code": "Success"})


def to_copilotkit_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """AG-UI messages → the JSON form react-core 1.10 loads (it sniffs the keys).

    System and developer messages are left out: the 1.10 client rebuilds its system prompt
    for every request, so a loaded one would be sent twice.
    """
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    answered: set[str] = set()
    for message in messages:
        role = message.get("role")
        message_id = message.get("id")
        if role in _HIDDEN_ROLES or not isinstance(message_id, str):
            continue
        if role == "tool":
            call_id = message.get("toolCallId")
            if not isinstance(call_id, str) or call_id in answered:
                continue  # the same result stored twice (by the run and by the follow-up)
            answered.add(call_id)
            out.append({"id": message_id, "actionExecutionId": call_id,
                        "actionName": names.get(call_id, ""),
                        "result": _text(message.get("content"))})
            continue
        content = _text(message.get("content"))
        calls = message.get("toolCalls") or ()
        if role in ("user", "assistant") and (content or not calls):
            item: dict[str, Any] = {"id": message_id, "role": role, "content": content}
            if role == "assistant":
                item["parentMessageId"] = message_id
            out.append(item)
        for call in calls:
            function = call.get("function") or {}
            names[call["id"]] = function.get("name", "")
            try:
                arguments = check_json_text(function.get("arguments") or "{}", "Arguments")
            except (orjson.JSONDecodeError, JSONTooDeepError):
                arguments = {}
            out.append({"id": call["id"], "name": function.get("name", ""),
                        "arguments": arguments, "parentMessageId": message_id})
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _from_langchain(item: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A serialized LangChain message in the JSON representation (human and AI only: an
    interrupt asks the user something, it never carries tool results)."""
    kind, message_id = item.get("type"), item.get("id")
    text = _text(item.get("content"))
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
                    "content": [_text(item.get("content"))],
                    "role": role if role in ("user", "assistant", "system") else "assistant",
                    "parentMessageId": parent if isinstance(parent, str) else None,
                    "status": _SUCCESS}))
    return outputs
