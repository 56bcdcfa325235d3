"""Stand-ins for the client messages a thread's guardrails refused that are not the user's
words (a tool result, a made-up assistant turn, reasoning, a message's name): sent back
with the chat's history, each is given to the agent as a stand-in that keeps the chat's
structure (a tool result stays paired with its call; one without its call is left out)
and holds none of the refused text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import orjson

from copilot_runtime.threads.base import REFUSED_MARK_PREFIX

__all__ = ["WITHHELD_MARK_PREFIX", "WITHHELD_RESULT", "WITHHELD_TURN", "called_ids",
           "stand_ins", "withheld_mark"]

#: What the agent reads in place of a refused tool result, and of a refused assistant turn
#: that called tools (the runtime's own text: never judged).
WITHHELD_RESULT = "(withheld: the guardrails refused this tool result)"
WITHHELD_TURN = "(withheld: the guardrails refused this message)"
#: The name a withheld call keeps when its own is no tool of the run (it may be the
#: refused text).
_WITHHELD_CALL = "withheld"
#: The roles whose text is judged as the user's words (refused, they are left out: `_trust`).
_USERS_WORDS = frozenset({"user", "system", "developer"})


#: The prefix of every `withheld_mark` (a refused mark's, then a letter no hex digest has).
WITHHELD_MARK_PREFIX = REFUSED_MARK_PREFIX + "w"


def withheld_mark(message: Mapping[str, Any]) -> str:
    """What a thread keeps, among its message ids, of a client message refused for text
    that is not the user's words: a digest of the whole message (any change to it is
    judged again), under the refused marks' prefix and of another digest than
    `_trust.refused_mark`'s."""
    try:
        encoded = orjson.dumps(["withheld", message], default=str,
                               option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except (orjson.JSONEncodeError, TypeError):  # (such input is refused before judging)
        encoded = orjson.dumps(["withheld", repr(message)])
    return WITHHELD_MARK_PREFIX + hashlib.blake2b(encoded, digest_size=16).hexdigest()


def stand_ins(messages: Sequence[Any], seen: Collection[str],
              tool_names: Collection[str]) -> dict[int, dict[str, Any] | None]:
    """For each message of `messages` (but the last: a turn retried is judged, and refused,
    again) whose `withheld_mark` is in `seen`, its stand-in (None: left out)."""
    out: dict[int, dict[str, Any] | None] = {}
    called: set[Any] | None = None
    for index, message in enumerate(messages[:-1]):
        # (a user's own words, without a name, are never withheld: not digested for nothing)
        if isinstance(message, dict) and (message.get("name") or message.get("role") not in
                                          _USERS_WORDS) and withheld_mark(message) in seen:
            if called is None:
                called = called_ids(messages)
            out[index] = _stand_in(message, tool_names, called)
    return out


def called_ids(messages: Sequence[Any]) -> set[Any]:
    """The ids of the tool calls of `messages`' assistant turns."""
    return {call["id"] for message in messages if isinstance(message, dict)
            and message.get("role") == "assistant" and isinstance(message.get("toolCalls"), list)
            for call in message["toolCalls"]
            if isinstance(call, dict) and isinstance(call.get("id"), str)}


def _stand_in(message: Mapping[str, Any], tool_names: Collection[str],
              called: Collection[Any]) -> dict[str, Any] | None:
    role = message.get("role")
    if role == "tool":
        # Without its call, the model would read it quoted as the user's words, the client's
        # call id in the quote (`paired_tool_calls`): there is nothing to keep it paired with.
        if message.get("toolCallId") not in called:
            return None
        return {"id": message.get("id"), "role": "tool",
                "toolCallId": message.get("toolCallId"), "content": WITHHELD_RESULT}
    if role == "assistant":
        calls = [call for call in message.get("toolCalls") or ()
                 if isinstance(call, Mapping)]
        if not calls:  # nothing pairs with it: left out
            return None
        return {"id": message.get("id"), "role": "assistant", "content": WITHHELD_TURN,
                "toolCalls": [_withheld_call(call, tool_names) for call in calls]}
    if role == "reasoning":
        return None
    # Any other message was refused for its name alone (its text is judged as the user's).
    return {key: value for key, value in message.items() if key != "name"}


def _withheld_call(call: Mapping[str, Any], tool_names: Collection[str]) -> dict[str, Any]:
    function = call.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": name if name in tool_names else _WITHHELD_CALL,
                         "arguments": "{}"}}
