"""A person's answer to an approval request, whichever way it arrived.

Answers come from the approval HTTP route (`{"action": "approve" | "reject" | "revise",
"payload": ..., "reason": ..., "userId": ...}`), from CopilotKit frontends
(`resolve({approved: true})`, a plain string typed into a chat box, the seed's
`{"answer": "OK", "is_approval": true}`), from the AG-UI cancel sentinel, or from the
runtime itself when an approval times out. `parse_decision` reads them all into one
`Decision`, or None when it cannot tell what the person meant: the workflows then ask
again rather than guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from copilot_runtime._limits import decode_json, nests_too_deep

__all__ = ["Action", "Decision", "answered_by", "parse_decision", "timeout_answer"]

Action = Literal["approve", "reject", "revise", "timeout"]

_APPROVE: Final = frozenset({"approve", "approved", "ok", "okay", "yes", "y", "lgtm",
                             "accept", "accepted", "confirm", "confirmed"})
_REJECT: Final = frozenset({"reject", "rejected", "no", "n", "nope", "no thanks", "no thank you",
                            "deny", "denied", "decline", "declined", "cancel", "cancelled",
                            "canceled", "stop", "abort"})
_REVISE: Final = frozenset({"revise", "revision", "edit", "change", "changes"})
_TIMEOUT: Final = frozenset({"timeout", "timed_out", "expired"})
# ag-ui-langgraph's resume value for an AG-UI `ResumeEntry` with status "cancelled".
_CANCELLED_SENTINEL: Final = "__agui_cancelled__"
# The keys naming who answered, in the order `parse_decision` reads them.
_APPROVER_KEYS: Final = ("userId", "by", "user")
# The keys a decision may be nested under (`{"answer": {...}}`).
_NESTED_KEYS: Final = ("answer", "feedback", "text")


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    #: The revision to make (revise), or the reason given (reject, approve, timeout).
    feedback: str | None = None
    #: Structured data that came with the answer (edits, a form's values).
    payload: Any = None
    by: str | None = None


def timeout_answer(expires_at: str | None = None) -> dict[str, Any]:
    """The resume payload the runtime sends when nobody answered in time."""
    reason = "Nobody answered before the deadline" + (f" ({expires_at})" if expires_at else "")
    return {"action": "timeout", "reason": reason}


def parse_decision(value: Any) -> Decision | None:
    """The decision `value` expresses, or None when it is malformed."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                decoded = decode_json(text)  # bounded: no RecursionError on hostile text
            except orjson.JSONDecodeError:
                return _from_text(text)  # not JSON (or deeper than orjson reads): words
            # JSON nested deeper than a request may be is not an answer anyone wrote.
            return None if nests_too_deep(decoded, text) else parse_decision(decoded)
        return _from_text(text)
    if not isinstance(value, dict):
        return None
    if value.get(_CANCELLED_SENTINEL):
        return Decision("reject", "Cancelled by the user")
    by = _text(value.get("userId")) or _text(value.get("by")) or _text(value.get("user"))
    reason = _text(value.get("reason"))
    action = value.get("action", value.get("decision", value.get("status")))
    if isinstance(action, str):
        return _from_action(action.strip().lower(), value, reason, by)
    approved = value.get("approved", value.get("is_approval", value.get("isApproval")))
    answer = value.get("answer", value.get("feedback", value.get("text")))
    if isinstance(approved, bool):
        if approved:
            return Decision("approve", reason, value.get("payload"), by)
        feedback = _text(answer) or reason
        # The seed's shape: not an approval plus a text is a revision; no text, a refusal.
        return Decision("revise", feedback, value.get("payload"), by) if feedback \
            else Decision("reject", None, value.get("payload"), by)
    if answer is not None:
        decided = parse_decision(answer)
        return None if decided is None else Decision(
            decided.action, decided.feedback, decided.payload, by or decided.by)
    return None


def answered_by(value: Any, who: str) -> Any:
    """`value` as `who`'s answer: a decision (what `parse_decision` reads as one), as a JSON
    object or its text, says `userId: who`, as the HTTP route's answers do, and whatever
    else in it names who answered (what `parse_decision` reads as `Decision.by`) names
    `who`. Anything else (a form's answer, pasted JSON) is the graph's own data, where
    `user` or `by` mean something else: returned unchanged."""
    if parse_decision(value) is None:
        return value
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("{"):
            return value  # words: they name nobody
        try:
            decoded = decode_json(text)
        except orjson.JSONDecodeError:
            return value
        if not isinstance(decoded, dict) or nests_too_deep(decoded, text):
            return value
        return orjson.dumps(answered_by(decoded, who)).decode()
    if not isinstance(value, dict) or value.get(_CANCELLED_SENTINEL):
        return value
    # Only what `parse_decision` reads as the approver: a text under one of these keys (an
    # object there is the graph's own data, left as it is).
    named = {key: who for key in _APPROVER_KEYS if isinstance(value.get(key), str)}
    # A decision nested as its `answer` (or `feedback`, `text`: the first there, as
    # `parse_decision` reads it) when this one says nothing else: it names `who` as well.
    nested: dict[str, Any] = {}
    action = value.get("action", value.get("decision", value.get("status")))
    approved = value.get("approved", value.get("is_approval", value.get("isApproval")))
    if not isinstance(action, str) and not isinstance(approved, bool):
        key = next((key for key in _NESTED_KEYS if key in value), None)
        if key is not None:
            nested[key] = answered_by(value[key], who)
    return {**value, **named, **nested, "userId": who}


def _from_action(action: str, value: dict[str, Any], reason: str | None,
                 by: str | None) -> Decision | None:
    payload = value.get("payload")
    if action in _APPROVE:
        return Decision("approve", reason, payload, by)
    if action in _REJECT:
        return Decision("reject", reason, payload, by)
    if action in _TIMEOUT:
        return Decision("timeout", reason, payload, by)
    if action in _REVISE:
        feedback = (_text(payload) or _feedback_in(payload) or _text(value.get("feedback"))
                    or reason)
        if not feedback and not isinstance(payload, dict):
            return None  # a revision that says nothing cannot be carried out
        return Decision("revise", feedback, payload, by)
    return None


def _feedback_in(payload: Any) -> str | None:
    if isinstance(payload, dict):
        for key in ("feedback", "text", "instructions", "answer", "reason"):
            found = _text(payload.get(key))
            if found:
                return found
    return None


def _from_text(text: str) -> Decision | None:
    if not text:
        return None
    # "No, thanks!" and "no  thanks" are one refusal: case, commas, spaces and the final
    # stop aside.
    word = " ".join(text.lower().replace(",", " ").split()).rstrip(".!")
    if word in _APPROVE:
        return Decision("approve")
    if word in _REJECT:
        return Decision("reject")
    return Decision("revise", text)  # any other text is what to change (the seed's rule)


def _text(value: Any) -> str | None:
    return (value.strip() or None) if isinstance(value, str) else None
