"""The core's event vocabulary: AG-UI events, carried as plain JSON-ready dicts.

Every agent produces AG-UI events and every wire protocol translates them. On the hot path an
event is the dict that goes on the wire (camelCase keys, optional fields omitted), so encoding
one costs a single `orjson.dumps`; the `ag_ui.core` pydantic models are used at the edges
(request validation) and in tests, where their 4 µs per event does not matter.

Agents yield *batches* (lists of events): one batch per upstream read, so a protocol edge can
write a whole batch to the socket at once instead of once per token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import orjson
from ag_ui.core import EventType

__all__ = [
    "Event",
    "EventBatches",
    "EventType",
    "LastBatch",
    "custom",
    "failed_tool_content",
    "messages_snapshot",
    "reasoning_content",
    "reasoning_encrypted_value",
    "reasoning_end",
    "reasoning_start",
    "run_error",
    "run_finished",
    "run_started",
    "runtime_code",
    "runtime_codes",
    "state_delta",
    "state_snapshot",
    "step_finished",
    "step_started",
    "text_message_content",
    "text_message_end",
    "text_message_start",
    "tool_call_args",
    "tool_call_end",
    "tool_call_result",
    "tool_call_start",
]

#: One AG-UI event as it appears on the wire.
Event = dict[str, Any]
#: What agents produce: batches of events, in order.
EventBatches = AsyncIterator[Sequence[Event]]


class LastBatch(list[Event]):
    """A batch its agent yields last, and says so: the run's own closing events can then go
    to the client in the same write (one system call fewer per run)."""

    __slots__ = ()

# Plain strings, not enum members: comparing and serialising them is free.
RUN_STARTED: Final = EventType.RUN_STARTED.value
RUN_FINISHED: Final = EventType.RUN_FINISHED.value
RUN_ERROR: Final = EventType.RUN_ERROR.value
TEXT_MESSAGE_START: Final = EventType.TEXT_MESSAGE_START.value
TEXT_MESSAGE_CONTENT: Final = EventType.TEXT_MESSAGE_CONTENT.value
TEXT_MESSAGE_END: Final = EventType.TEXT_MESSAGE_END.value
TEXT_MESSAGE_CHUNK: Final = EventType.TEXT_MESSAGE_CHUNK.value
TOOL_CALL_START: Final = EventType.TOOL_CALL_START.value
TOOL_CALL_ARGS: Final = EventType.TOOL_CALL_ARGS.value
TOOL_CALL_END: Final = EventType.TOOL_CALL_END.value
TOOL_CALL_CHUNK: Final = EventType.TOOL_CALL_CHUNK.value
TOOL_CALL_RESULT: Final = EventType.TOOL_CALL_RESULT.value
STATE_SNAPSHOT: Final = EventType.STATE_SNAPSHOT.value
STATE_DELTA: Final = EventType.STATE_DELTA.value
MESSAGES_SNAPSHOT: Final = EventType.MESSAGES_SNAPSHOT.value
ACTIVITY_SNAPSHOT: Final = EventType.ACTIVITY_SNAPSHOT.value
ACTIVITY_DELTA: Final = EventType.ACTIVITY_DELTA.value
STEP_STARTED: Final = EventType.STEP_STARTED.value
STEP_FINISHED: Final = EventType.STEP_FINISHED.value
CUSTOM: Final = EventType.CUSTOM.value
REASONING_START: Final = EventType.REASONING_START.value
REASONING_END: Final = EventType.REASONING_END.value
REASONING_MESSAGE_START: Final = EventType.REASONING_MESSAGE_START.value
REASONING_MESSAGE_CONTENT: Final = EventType.REASONING_MESSAGE_CONTENT.value
REASONING_MESSAGE_END: Final = EventType.REASONING_MESSAGE_END.value
REASONING_ENCRYPTED_VALUE: Final = EventType.REASONING_ENCRYPTED_VALUE.value
SUBAGENT_STARTED: Final = EventType.SUBAGENT_STARTED.value
SUBAGENT_FINISHED: Final = EventType.SUBAGENT_FINISHED.value
SUBAGENT_ERROR: Final = EventType.SUBAGENT_ERROR.value

TERMINAL_TYPES: Final = frozenset({RUN_FINISHED, RUN_ERROR})

#: The names of the runtime's CUSTOM events around another agent's part of a run, when a
#: call hands the conversation over to it (`copilot_runtime._server_tools`): what that
#: agent sends between them (its messages snapshots included) is its own.
AGENT_STARTED: Final = "copilot_runtime.agent_started"
AGENT_FINISHED: Final = "copilot_runtime.agent_finished"

#: Event fields whose values are the application's data, kept exactly as they came: a null
#: inside them means something (elsewhere nulls are dropped, as the clients require).
APPLICATION_DATA_KEYS: Final = frozenset({
    "snapshot", "delta", "value", "result", "state", "input", "payload", "event",
    "rawEvent", "content", "patch", "forwardedProps",
})
#: Those of them that may be null themselves (a CUSTOM event's `value`, a STATE_SNAPSHOT's
#: `snapshot`): both clients' schemas take any JSON value there; a null `content`, `result`,
#: `payload` or `rawEvent` one of them refuses, so it is dropped as other nulls are.
NULLABLE_DATA_KEYS: Final = frozenset({"snapshot", "value", "state", "event"})

# Names of CUSTOM events with a meaning across the runtime.
#: A LangGraph interrupt, told the way CopilotKit's interrupt hooks (before AG-UI 1.0) read it.
LEGACY_INTERRUPT: Final = "on_interrupt"
#: The same, from a `copilotkit` SDK remote endpoint that used `copilotkit_interrupt`.
COPILOTKIT_INTERRUPT: Final = "on_copilotkit_interrupt"


def run_started(thread_id: str, run_id: str, input: dict[str, Any] | None = None) -> Event:
    event: Event = {"type": RUN_STARTED, "threadId": thread_id, "runId": run_id}
    if input is not None:
        event["input"] = input
    return event


def run_finished(
    thread_id: str, run_id: str, *, result: Any = None, outcome: dict[str, Any] | None = None
) -> Event:
    event: Event = {"type": RUN_FINISHED, "threadId": thread_id, "runId": run_id}
    if result is not None:
        event["result"] = result
    if outcome is not None:
        event["outcome"] = outcome
    return event


#: The codes the runtime itself ends runs with (`runtime_code`); a remote agent's RUN_ERROR
#: may name any other.
_RUNTIME_CODES: set[str] = set()


def runtime_code(code: str) -> str:
    """`code`, registered as one the runtime itself ends runs with: telemetry's errors metric
    labels a run by it (any other code reads "_OTHER"), wherever the code is defined."""
    _RUNTIME_CODES.add(code)
    return code


def runtime_codes() -> frozenset[str]:
    """The codes registered with `runtime_code` so far."""
    return frozenset(_RUNTIME_CODES)


#: The code of the `RUN_ERROR` that ends a run whose agent raised what the runtime did not
#: expect (its text in the log only).
AGENT_ERROR_CODE: Final = runtime_code("AGENT_ERROR")


def run_error(
    message: str, *, code: str | None = None, thread_id: str | None = None,
    run_id: str | None = None,
) -> Event:
    event: Event = {"type": RUN_ERROR, "message": message}
    if code is not None:
        event["code"] = code
    if thread_id is not None:
        event["threadId"] = thread_id
    if run_id is not None:
        event["runId"] = run_id
    return event


def text_message_start(message_id: str, role: str = "assistant") -> Event:
    return {"type": TEXT_MESSAGE_START, "messageId": message_id, "role": role}


def text_message_content(message_id: str, delta: str) -> Event:
    return {"type": TEXT_MESSAGE_CONTENT, "messageId": message_id, "delta": delta}


def text_message_end(message_id: str) -> Event:
    return {"type": TEXT_MESSAGE_END, "messageId": message_id}


def tool_call_start(
    tool_call_id: str, tool_call_name: str, parent_message_id: str | None = None
) -> Event:
    event: Event = {"type": TOOL_CALL_START, "toolCallId": tool_call_id,
                    "toolCallName": tool_call_name}
    if parent_message_id is not None:
        event["parentMessageId"] = parent_message_id
    return event


def tool_call_args(tool_call_id: str, delta: str) -> Event:
    return {"type": TOOL_CALL_ARGS, "toolCallId": tool_call_id, "delta": delta}


def tool_call_end(tool_call_id: str) -> Event:
    return {"type": TOOL_CALL_END, "toolCallId": tool_call_id}


def tool_call_result(message_id: str, tool_call_id: str, content: str, *,
                     error: str | None = None) -> Event:
    """A tool's result; `error` says the tool failed and why (the `error` of AG-UI's tool
    message), so no consumer has to guess failure from the content."""
    event: Event = {"type": TOOL_CALL_RESULT, "messageId": message_id,
                    "toolCallId": tool_call_id, "content": content, "role": "tool"}
    if error is not None:
        event["error"] = error
    return event


def failed_tool_content(message: str) -> str:
    """What a model reads as the result of a tool that failed."""
    return orjson.dumps({"error": message}).decode()


def messages_snapshot(messages: list[dict[str, Any]]) -> Event:
    return {"type": MESSAGES_SNAPSHOT, "messages": messages}


def state_snapshot(snapshot: Any) -> Event:
    return {"type": STATE_SNAPSHOT, "snapshot": snapshot}


def state_delta(delta: list[dict[str, Any]]) -> Event:
    return {"type": STATE_DELTA, "delta": delta}


def step_started(step_name: str) -> Event:
    return {"type": STEP_STARTED, "stepName": step_name}


def step_finished(step_name: str) -> Event:
    return {"type": STEP_FINISHED, "stepName": step_name}


def reasoning_start(message_id: str) -> list[Event]:
    """The opening of a reasoning span and of its one message."""
    return [{"type": REASONING_START, "messageId": message_id},
            {"type": REASONING_MESSAGE_START, "messageId": message_id, "role": "reasoning"}]


def reasoning_content(message_id: str, delta: str) -> Event:
    return {"type": REASONING_MESSAGE_CONTENT, "messageId": message_id, "delta": delta}


def reasoning_end(message_id: str) -> list[Event]:
    return [{"type": REASONING_MESSAGE_END, "messageId": message_id},
            {"type": REASONING_END, "messageId": message_id}]


def reasoning_encrypted_value(subtype: str, entity_id: str, value: str) -> Event:
    """A model's reasoning as an opaque value the client keeps on the tool call
    (`subtype` "tool-call") or message ("message") `entity_id` and sends back with it."""
    return {"type": REASONING_ENCRYPTED_VALUE, "subtype": subtype, "entityId": entity_id,
            "encryptedValue": value}


def custom(name: str, value: Any) -> Event:
    return {"type": CUSTOM, "name": name, "value": value}
