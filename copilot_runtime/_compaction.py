"""Folding a run's events into the smallest equivalent sequence, and into messages.

A stored run keeps one START/CONTENT/END per message with the deltas joined, tool-call
arguments joined the same way, and its state changes folded into one `STATE_SNAPSHOT` just
before the run's terminal event, which is what a reconnecting client needs to rebuild the
conversation. `events_to_messages` rebuilds the AG-UI messages of a thread from its runs.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from copilot_runtime import events as ev
from copilot_runtime.events import Event

__all__ = ["MAX_PATCHED_STATE_BYTES", "StateTooLarge", "apply_state_delta", "compact_events",
           "events_to_messages", "handed_over", "patched_state"]


#: The largest state, as JSON, a patch may leave when it is applied here. A patch past it
#: does not apply.
MAX_PATCHED_STATE_BYTES = 64 * 1024 * 1024
#: How much a patch's `copy` operations may add, as JSON, beyond what the state held before
#: it: copies of copies double a state at each operation, so thirty of them, a few hundred
#: bytes, asked for gigabytes and minutes of the server's time.
COPY_ALLOWANCE_BYTES = 1024 * 1024


class StateTooLarge(ValueError):
    """A patch would leave a state larger than it may be."""


def patched_state(state: Any, delta: list[dict[str, Any]], *,
                  max_bytes: int = MAX_PATCHED_STATE_BYTES) -> Any:
    """`state` with the RFC 6902 patch `delta` applied, `state` itself untouched; raises
    `StateTooLarge`, or jsonpatch's errors when the patch does not apply.

    The state is copied once, through orjson (`copy.deepcopy` is some thirty times slower),
    and the operations are applied to that copy one by one; what each one adds is weighed
    (a copy against `COPY_ALLOWANCE_BYTES` too) before it is added, and copied, so the
    patch's own values are never changed by a later operation of it (they are the event's,
    which is sent and stored as it is). A state orjson cannot write (deeper than 255 levels)
    is patched as jsonpatch does, unweighed."""
    import jsonpatch  # only threads with STATE_DELTA need it (and difflib, which it loads)
    import jsonpointer

    if not isinstance(delta, list):
        raise TypeError("a patch is a list of operations")
    try:
        text = orjson.dumps(state)
    except orjson.JSONEncodeError:  # deeper than orjson writes (255 levels), or not JSON
        return jsonpatch.apply_patch(state, delta, in_place=False)
    size, document = len(text), orjson.loads(text)
    copies_left = size + COPY_ALLOWANCE_BYTES
    for operation in delta:
        if not isinstance(operation, dict):
            raise TypeError("a patch operation is an object")
        op = operation.get("op")
        if op == "copy":
            value = jsonpointer.resolve_pointer(document, str(operation.get("from")))
        elif op in ("add", "replace") and "value" in operation:
            value = operation["value"]
        else:
            document = jsonpatch.apply_patch(document, [operation], in_place=True)
            continue
        added = orjson.dumps(value)
        size += len(added)
        if op == "copy":
            copies_left -= len(added)
            if copies_left < 0:
                raise StateTooLarge("the patch copies more than the state holds")
        if size > max_bytes:
            raise StateTooLarge(f"the state would be larger than {max_bytes} bytes of JSON")
        document = _put(document, operation.get("path"), orjson.loads(added),
                        replace=op == "replace")
    return document


def _put(document: Any, path: Any, value: Any, *, replace: bool) -> Any:
    """RFC 6902's `add` (or `replace`) of `value`, taken as it is: jsonpatch's own copies
    it with `copy.deepcopy`, for each operation (a patch moving a large part to and fro
    cost seconds an operation)."""
    import jsonpatch
    import jsonpointer

    if not isinstance(path, str):
        raise jsonpatch.InvalidJsonPatch("an operation's path is a string")
    parent, part = jsonpointer.JsonPointer(path).to_last(document)
    if part is None:
        return value  # the whole document
    if isinstance(parent, list):
        if part == "-" and not replace:
            parent.append(value)
        elif not isinstance(part, int) or not 0 <= part <= len(parent) - replace:
            raise jsonpatch.JsonPatchConflict(f"{path} is outside the list")
        elif replace:
            parent[part] = value
        else:
            parent.insert(part, value)
    elif isinstance(parent, dict):
        if replace and part not in parent:
            raise jsonpatch.JsonPatchConflict(f"{path} is not there to replace")
        parent[part] = value
    else:
        raise jsonpatch.JsonPatchConflict(f"{path} is inside neither an object nor a list")
    return document


def apply_state_delta(state: Any, delta: list[dict[str, Any]]) -> Any:
    """Apply an RFC 6902 patch; a patch that does not apply (or would leave a state past
    `MAX_PATCHED_STATE_BYTES`) leaves the state unchanged: the very same object."""
    import jsonpatch

    try:
        return patched_state(state, delta)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError,
            ValueError, RecursionError, orjson.JSONEncodeError):
        return state  # a string "patch" is parsed as JSON text


def _copied(value: Any) -> Any:
    """A deep copy without recursion limits on what JSON holds (orjson reads 1,024 levels,
    `copy.deepcopy` fails at about 330); what cannot be copied is kept as it is."""
    try:
        return copy.deepcopy(value)
    except RecursionError:
        return value


def compact_events(events: Sequence[Event]) -> list[Event]:
    """A run's events with each message's and tool call's pieces joined into one event, and
    its state changes into one snapshot before its end."""
    out: list[Event | None] = []
    # By id, the slot its pieces go to now; `slots` keeps every one (an id may start again
    # once ended, within a run: a model numbering its calls per answer does).
    text: dict[str, list[str]] = {}
    args: dict[str, list[str]] = {}
    slots: list[tuple[Event, list[str]]] = []
    state: Any = None
    state_seen = False
    started_with: Any = {}  # the state the client sent: what a first delta patches
    for event in events:
        kind = event["type"]
        if kind == ev.TEXT_MESSAGE_CONTENT:
            pieces = text.get(event["messageId"])
            if pieces is None:  # content without a start: keep it as it came
                out.append(event)
            else:
                pieces.append(event["delta"])
        elif kind == ev.TOOL_CALL_ARGS:
            pieces = args.get(event["toolCallId"])
            if pieces is None:
                out.append(event)
            else:
                pieces.append(event["delta"])
        elif kind == ev.TEXT_MESSAGE_START:
            out.append(event)
            slot: Event = {"type": ev.TEXT_MESSAGE_CONTENT, "messageId": event["messageId"]}
            text[event["messageId"]] = pieces = []
            slots.append((slot, pieces))
            out.append(slot)
        elif kind == ev.TOOL_CALL_START:
            out.append(event)
            slot = {"type": ev.TOOL_CALL_ARGS, "toolCallId": event["toolCallId"]}
            args[event["toolCallId"]] = pieces = []
            slots.append((slot, pieces))
            out.append(slot)
        elif kind == ev.STATE_SNAPSHOT:
            state, state_seen = _copied(event.get("snapshot")), True
        elif kind == ev.STATE_DELTA:
            # The client applies a run's first delta to the state it sent with the run.
            state = apply_state_delta(state if state_seen else started_with,
                                      event.get("delta") or [])
            state_seen = True
        elif kind in ev.TERMINAL_TYPES:
            if state_seen:
                out.append(ev.state_snapshot(state))
                state_seen = False
            out.append(event)
        else:
            if kind == ev.RUN_STARTED:
                sent = (event.get("input") or {}).get("state")
                started_with = sent if isinstance(sent, dict | list) else {}
            out.append(event)
    if state_seen:
        out.append(ev.state_snapshot(state))
    for slot, pieces in slots:
        slot["delta"] = "".join(pieces)
    return [e for e in out if e is not None and not (
        e["type"] in (ev.TEXT_MESSAGE_CONTENT, ev.TOOL_CALL_ARGS) and not e.get("delta"))]


def handed_over(depth: int, event: Event) -> int:
    """How many hand-overs deep (`ev.AGENT_STARTED`) a run is after `event`, `depth` before it."""
    if event["type"] == ev.CUSTOM:
        name = event.get("name")
        if name == ev.AGENT_STARTED:
            return depth + 1
        if name == ev.AGENT_FINISHED:
            return max(depth - 1, 0)
    return depth


def events_to_messages(runs: Iterable[Sequence[Event]]) -> list[dict[str, Any]]:
    """The AG-UI messages of a thread: each run's new input messages, then what it produced.

    A messages snapshot of an agent a call handed the conversation over to (between
    `ev.AGENT_STARTED` and `ev.AGENT_FINISHED`) holds that agent's conversation, which has
    neither the call nor its result: its messages are merged in, not taken for the whole."""
    messages: list[dict[str, Any]] = []
    by_id: dict[str, dict[str, Any]] = {}
    # The last call of each id, and the ids whose last call has a result: a call started
    # again before its result is the same call continued (the client finds it by id), one
    # started after its result a new call (a model numbering its calls per answer).
    calls: dict[str, dict[str, Any]] = {}
    answered: set[str] = set()

    def add(message: dict[str, Any]) -> dict[str, Any]:
        existing = by_id.get(message["id"])
        if existing is not None:
            return existing
        by_id[message["id"]] = message
        messages.append(message)
        _index_calls(message, calls, answered)
        return message

    def answer(message_id: str, role: str) -> dict[str, Any]:
        """The message an agent's events fill: a new one, unless the id is of a message it
        can fill (an input message of another role, or whose content is a list of parts,
        does not take an agent's text: a new message of that id follows it, as a client
        applying the stream has it)."""
        existing = by_id.get(message_id)
        if existing is not None and existing.get("role") == role and isinstance(
                existing.get("content", ""), str) and isinstance(
                existing.get("toolCalls", []), list):
            return existing
        message: dict[str, Any] = {"id": message_id, "role": role}
        by_id[message_id] = message
        messages.append(message)
        return message

    for run in runs:
        depth = 0  # (of hand-overs)
        for event in run:
            kind = event["type"]
            if kind == ev.CUSTOM:
                depth = handed_over(depth, event)
            elif kind == ev.RUN_STARTED:
                for message in (event.get("input") or {}).get("messages") or ():
                    if isinstance(message, dict) and "id" in message:
                        add(copy.deepcopy(message))
            elif kind == ev.TEXT_MESSAGE_START or kind == ev.REASONING_MESSAGE_START:
                role = "reasoning" if kind == ev.REASONING_MESSAGE_START else event.get(
                    "role", "assistant")
                answer(event["messageId"], role).setdefault("content", "")
            elif kind == ev.TEXT_MESSAGE_CONTENT or kind == ev.REASONING_MESSAGE_CONTENT:
                target = by_id.get(event["messageId"])
                if target is not None and isinstance(target.get("content") or "", str):
                    target["content"] = (target.get("content") or "") + event["delta"]
            elif kind == ev.TOOL_CALL_START:
                known_call = calls.get(event["toolCallId"])
                if known_call is not None and event["toolCallId"] not in answered:
                    known_call["function"]["name"] = event["toolCallName"]  # (as the client)
                    continue
                parent_id = event.get("parentMessageId") or event["toolCallId"]
                parent = answer(parent_id, "assistant")
                call = {"id": event["toolCallId"], "type": "function",
                        "function": {"name": event["toolCallName"], "arguments": ""}}
                parent.setdefault("toolCalls", []).append(call)
                calls[event["toolCallId"]] = call
                answered.discard(event["toolCallId"])
            elif kind == ev.TOOL_CALL_ARGS:
                target_call = calls.get(event["toolCallId"])
                if target_call is not None:
                    target_call["function"]["arguments"] += event["delta"]
            elif kind == ev.TOOL_CALL_RESULT:
                result = add({"id": event["messageId"], "role": "tool",
                              "toolCallId": event["toolCallId"], "content": event["content"]})
                answered.add(event["toolCallId"])
                if event.get("error") is not None:
                    result["error"] = event["error"]
            elif kind == ev.REASONING_ENCRYPTED_VALUE:
                # Kept on its call or message, as the client keeps it, and sent back so.
                entity, value = event.get("entityId"), event.get("encryptedValue")
                holder = None
                if isinstance(entity, str) and isinstance(value, str):
                    holder = calls.get(entity) if event.get("subtype") == "tool-call" \
                        else by_id.get(entity)
                if holder is not None and holder.get("role") != "activity":
                    holder["encryptedValue"] = value
            elif kind == ev.ACTIVITY_SNAPSHOT:
                activity = {"id": event["messageId"], "role": "activity",
                            "activityType": event.get("activityType"),
                            "content": copy.deepcopy(event.get("content"))}
                existing = by_id.get(event["messageId"])
                if existing is None:
                    add(activity)
                elif event.get("replace", True) is not False:  # (whatever the message was)
                    existing.clear()
                    existing.update(activity)
            elif kind == ev.ACTIVITY_DELTA:
                existing = by_id.get(event["messageId"])
                if existing is not None and existing.get("role") == "activity":
                    existing["content"] = apply_state_delta(existing.get("content") or {},
                                                            event.get("patch") or [])
                    existing["activityType"] = event.get("activityType")
            elif kind == ev.MESSAGES_SNAPSHOT:
                snapshot = event.get("messages")
                if not isinstance(snapshot, list):
                    continue  # not a snapshot a client could have applied
                (_merge_snapshot if depth else _apply_snapshot)(messages, by_id, [
                    copy.deepcopy(m) for m in snapshot
                    if isinstance(m, dict) and isinstance(m.get("id"), str)])
                calls.clear()  # (the calls are the snapshot's now)
                answered.clear()
                for message in messages:
                    _index_calls(message, calls, answered)
    for message in messages:
        if message.get("role") == "assistant" and message.get("content") == "" \
                and message.get("toolCalls"):
            del message["content"]
    return messages


def _index_calls(message: dict[str, Any], calls: dict[str, dict[str, Any]],
                 answered: set[str]) -> None:
    """Note the tool calls `message` holds, or the call it answers (`events_to_messages`)."""
    if message.get("role") == "tool" and isinstance(message.get("toolCallId"), str):
        answered.add(message["toolCallId"])
    tool_calls = message.get("toolCalls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            if isinstance(call, dict) and isinstance(call.get("id"), str) and isinstance(
                    call.get("function"), dict) and isinstance(
                    call["function"].get("arguments"), str):
                calls[call["id"]] = call
                answered.discard(call["id"])


def _apply_snapshot(messages: list[dict[str, Any]], by_id: dict[str, dict[str, Any]],
                    snapshot: list[dict[str, Any]]) -> None:
    """A messages snapshot applied as a client applies it: its messages replace theirs in
    place, new ones follow, and reasoning and activity messages (UI state an agent's
    snapshot may not carry) stay, unless the snapshot has some of that role."""
    kept_roles = {"activity", "reasoning"} - {m.get("role") for m in snapshot}
    incoming = {m["id"]: m for m in snapshot}
    kept = [m if m.get("role") in kept_roles else incoming[m["id"]] for m in messages
            if m.get("role") in kept_roles or m["id"] in incoming]
    ids = {m["id"] for m in kept}
    for message in snapshot:
        if message["id"] not in ids:
            ids.add(message["id"])
            kept.append(message)
    messages[:] = kept
    by_id.clear()
    by_id.update((m["id"], m) for m in kept)


def _merge_snapshot(messages: list[dict[str, Any]], by_id: dict[str, dict[str, Any]],
                    snapshot: list[dict[str, Any]]) -> None:
    """A handed-over agent's messages snapshot merged in: its messages replace theirs in
    place and new ones follow; none is dropped."""
    incoming = {m["id"]: m for m in snapshot}
    messages[:] = [incoming.pop(m["id"], m) for m in messages]
    messages.extend(incoming.values())
    by_id.clear()
    by_id.update((m["id"], m) for m in messages)
