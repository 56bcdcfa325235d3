"""How long an answer to an approval is, as it would be kept: the review loop's, the
orchestrator's and the wrapper's approvals ask again past `MAX_FEEDBACK_CHARS`."""

from __future__ import annotations

from typing import Any

import orjson

from copilot_runtime.approvals.decisions import Decision

__all__ = ["MAX_FEEDBACK_CHARS", "answer_length", "shown", "too_long"]

#: The longest answer a reviewer may give (characters of its text, or of a revision's
#: payload): it is stored in the history and carried into the next prompt. Far more than
#: anyone types, far less than a model's context.
MAX_FEEDBACK_CHARS = 32_000


def answer_length(decision: Decision | None) -> int:
    """How much of `answer` would be stored and carried into prompts, in characters."""
    if decision is None:
        return 0  # only a short echo of it is kept
    if decision.feedback:
        return len(decision.feedback)
    if decision.action == "revise" and decision.payload is not None:
        return len(shown(decision.payload))
    return 0


def too_long(decision: Decision) -> str | None:
    """What a person is told of an answer to an approval (the orchestrator's, the
    wrapper's) too long to keep, or None if it may be kept."""
    length = answer_length(decision)
    if length <= MAX_FEEDBACK_CHARS:
        return None
    return (f"That answer was {length} characters long; answers may be at most "
            f"{MAX_FEEDBACK_CHARS}.")


def shown(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
    except (orjson.JSONEncodeError, TypeError):
        return "(an answer that could not be shown)"
