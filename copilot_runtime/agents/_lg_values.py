"""A graph's Python values (its state, an interrupt's payload, its messages) as the wire and
the stores carry them.

ag-ui-langgraph's `make_json_safe`, written for tool-call payloads, leaves out every key
named "config" or "runtime" at any depth (a state echoed back by the client then loses them
in the checkpoint too), keeps keys that are not strings (an int key made a whole snapshot
unencodable, a tuple key failed the run, or in an interrupt every later run of its thread),
and writes dates, decimals and bytes as their Python `repr`. `json_safe` keeps every key,
as text, and gives each value the form a JavaScript client can use. And its message
converter refuses LangChain message classes it does not know (a `ChatMessage` with a
custom role), which failed every run of a thread whose checkpoint held one:
`known_messages` maps them onto the four it knows first.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import decimal
import enum
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

__all__ = ["Unordered", "json_order", "json_safe", "json_shown", "known_messages"]

# Deeper than this a value is cut (what the limits let through is far shallower).
_MAX_DEPTH = 200
_INT64_MIN, _UINT64_END = -(2 ** 63), 2 ** 64


def json_safe(value: Any) -> Any:
    """A fresh copy of `value` made of JSON's types only, which the caller may keep.

    Plain JSON (the usual state) takes one encode and decode in C; anything else is
    converted: keys become their JSON text (1 → "1", None → "null"), integers beyond 64
    bits their digits, dates ISO 8601, decimals their text, bytes base64, enums their value,
    sets a list sorted by each item's JSON (their own order is the process's hash order:
    another process showed the same set otherwise), dataclasses and pydantic models their
    fields, other objects their public attributes, a cycle "<recursive>". NaN and the
    infinities become null, as `JSON.stringify` has it.
    """
    try:
        return orjson.loads(orjson.dumps(value))
    except TypeError:  # (orjson.JSONEncodeError is one)
        return orjson.loads(orjson.dumps(_converted(value, 0, set())))


class Unordered(list[Any]):
    """A set's items in `json_shown`: shown sorted, but their order means nothing (a client
    may hold them in the order an earlier process showed them)."""


def json_shown(value: Any) -> Any:
    """`json_safe(value)` with each set's items an `Unordered` list (and NaN or an infinity
    left as it is, where `json_safe` has null): what a client's echo is compared with
    (`_lg_shown`)."""
    try:
        return orjson.loads(orjson.dumps(value))
    except TypeError:  # (what orjson cannot encode, a set among it: `_converted` as is)
        return _converted(value, 0, set())


def _converted(value: Any, depth: int, path: set[int]) -> Any:
    if value is None or isinstance(value, str | bool | float):
        return value
    if isinstance(value, int):
        return value if _INT64_MIN <= value < _UINT64_END else str(value)
    if depth > _MAX_DEPTH:
        return "<too deep>"
    if isinstance(value, enum.Enum):
        return _converted(value.value, depth + 1, path)
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID | decimal.Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if id(value) in path:
        return "<recursive>"
    path.add(id(value))
    try:
        if isinstance(value, Mapping):
            return {_key(key): _converted(item, depth + 1, path) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [_converted(item, depth + 1, path) for item in value]
        if isinstance(value, set | frozenset):  # (in an order every process agrees on)
            items = [_converted(item, depth + 1, path) for item in value]
            return Unordered(sorted(items, key=json_order))
        return _converted(_fields(value), depth + 1, path)
    finally:
        path.discard(id(value))


def json_order(value: Any) -> bytes:
    """The key that sorts a set's JSON items as `json_safe` does."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _fields(value: Any) -> Any:
    """An object's data: a dataclass's fields, a pydantic model's dump, else its public
    attributes (or its type's name, when it has none)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        try:
            return dump()
        except Exception:  # a model that cannot dump itself: its attributes
            pass
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return {k: v for k, v in attributes.items() if isinstance(k, str) and not k.startswith("_")}
    return f"<{type(value).__name__}>"


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool):
        return orjson.dumps(key).decode()
    if isinstance(key, int | float):
        return str(key)
    if isinstance(key, enum.Enum):
        return _key(key.value)
    return str(key)


def known_messages(messages: Iterable[Any]) -> list[Any]:
    """`messages` with each of a LangChain class the converter does not know replaced by the
    one it stands for: a `ChatMessage` by its role (an unknown role is the assistant's), a
    `FunctionMessage` by a tool result; what is no message at all is left out. And text in
    several blocks joined into its first (`joined_text`)."""
    out: list[Any] = []
    for message in messages:
        if isinstance(message, AIMessage | SystemMessage | ToolMessage):
            out.append(joined_text(message))
        elif isinstance(message, HumanMessage):
            out.append(message)
        elif isinstance(message, FunctionMessage):
            out.append(ToolMessage(content=message.content, tool_call_id=message.name,
                                   id=message.id, name=message.name))
        elif isinstance(message, ChatMessage):
            role = message.role.lower()
            kind: type[BaseMessage] = (HumanMessage if role in ("user", "human") else
                                       SystemMessage if role in ("system", "developer") else
                                       AIMessage)
            out.append(kind(content=message.content, id=message.id, name=message.name))
    return out


def joined_text(message: BaseMessage) -> BaseMessage:
    """`message`, or a copy whose text blocks are joined into its first one (other blocks
    kept in place): the converter reads only the first text block, and an answer in several
    (langchain-anthropic's shape for cited text, Gemini's parts) was cut to it."""
    content = message.content
    if not isinstance(content, list):
        return message
    at = [i for i, block in enumerate(content) if isinstance(block, dict)
          and block.get("type") == "text" and isinstance(block.get("text"), str)]
    if len(at) < 2:
        return message
    first = content[at[0]]
    assert isinstance(first, dict)  # (as `at` says)
    whole = {**first, "text": "".join(content[i]["text"] for i in at)}  # type: ignore[index]
    blocks = [whole if i == at[0] else block for i, block in enumerate(content)
              if i == at[0] or i not in at]
    return message.model_copy(update={"content": blocks})
