"""What the runtime rebuilds of a thread (`GET /threads/{id}/messages`, `connect`'s stored
runs, the state) is what the real client holds after applying the same events: each case goes
through `@ag-ui/client`'s own `defaultApplyEvents` (tests/js/apply_events.mjs) and through
`compact_events` and `events_to_messages`. Before the fix the runtime left out reasoning and
activity messages, and a messages snapshot dropped the reasoning messages a client keeps."""

from __future__ import annotations

from typing import Any

import pytest

from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events, events_to_messages
from tests.test_real_clients import run_client_script

pytestmark = pytest.mark.timeout(120)


def _started(run: str, messages: list[dict[str, Any]], state: Any = None) -> ev.Event:
    body: dict[str, Any] = {"threadId": "t", "runId": run, "messages": messages}
    if state is not None:
        body["state"] = state
    return ev.run_started("t", run, body)


def _user(message_id: str, text: str) -> dict[str, Any]:
    return {"id": message_id, "role": "user", "content": text}


def _text(message_id: str, text: str) -> list[ev.Event]:
    return [ev.text_message_start(message_id), ev.text_message_content(message_id, text[:3]),
            ev.text_message_content(message_id, text[3:]), ev.text_message_end(message_id)]


def _reasoning(message_id: str, text: str) -> list[ev.Event]:
    return [*ev.reasoning_start(message_id), ev.reasoning_content(message_id, text),
            *ev.reasoning_end(message_id)]


def _activity(message_id: str, content: Any, replace: bool | None = None) -> ev.Event:
    event: ev.Event = {"type": "ACTIVITY_SNAPSHOT", "messageId": message_id,
                       "activityType": "search", "content": content}
    if replace is not None:
        event["replace"] = replace
    return event


def _call(call_id: str, parent: str, args: str) -> list[ev.Event]:
    return [ev.tool_call_start(call_id, "f", parent), ev.tool_call_args(call_id, args),
            ev.tool_call_end(call_id)]


def _snapshot(messages: list[dict[str, Any]]) -> ev.Event:
    return {"type": "MESSAGES_SNAPSHOT", "messages": messages}


def _done(run: str) -> ev.Event:
    return ev.run_finished("t", run)


CASES: dict[str, tuple[list[list[ev.Event]], Any]] = {
    "reasoning before each answer": ([
        [_started("r1", [_user("u1", "first")]), *_reasoning("x1", "let me think"),
         *_text("a1", "Answer one"), _done("r1")],
        [_started("r2", [_user("u2", "second")]), *_reasoning("x2", "again"),
         *_text("a2", "Answer two"), _done("r2")]], {}),
    "activity made, patched, kept and replaced": ([
        [_started("r1", [_user("u1", "search")]), _activity("s1", {"found": 1}),
         {"type": "ACTIVITY_DELTA", "messageId": "s1", "activityType": "search",
          "patch": [{"op": "replace", "path": "/found", "value": 2}]},
         _activity("s2", {"step": "a"}), _activity("s2", {"step": "b"}, replace=False),
         _activity("s1", {"found": 3}), *_text("a1", "Done searching"), _done("r1")]], {}),
    "a messages snapshot keeps the reasoning it does not carry": ([
        [_started("r1", [_user("u1", "go")]), *_reasoning("x1", "thinking"),
         *_text("a1", "Hello"),
         _snapshot([_user("u1", "go"),
                               {"id": "a1", "role": "assistant", "content": "Hello!"}]),
         _done("r1")]], {}),
    "a messages snapshot with reasoning replaces it": ([
        [_started("r1", [_user("u1", "go")]), *_reasoning("x1", "thinking"),
         *_text("a1", "Hello"),
         _snapshot([_user("u1", "go"),
                               {"id": "x9", "role": "reasoning", "content": "other"},
                               {"id": "a1", "role": "assistant", "content": "Hello"}]),
         _done("r1")]], {}),
    "tool calls, their results, and a delta on the state sent": ([
        [_started("r1", [_user("u1", "weather?")], {"count": 1, "items": ["a"]}),
         ev.tool_call_start("c1", "lookup", "a1"), ev.tool_call_args("c1", '{"q":'),
         ev.tool_call_args("c1", '"Paris"}'), ev.tool_call_end("c1"),
         ev.tool_call_result("t1", "c1", "sunny"),
         ev.state_delta([{"op": "replace", "path": "/count", "value": 2},
                         {"op": "add", "path": "/items/-", "value": "b"}]),
         *_text("a2", "It is sunny"), _done("r1")]], {"count": 1, "items": ["a"]}),
    # A call started again by its id (a remote agent may) is the same call, its arguments
    # continued: the runtime stored two calls of one id, each with half of them.
    "a tool call reopened by its id": ([
        [_started("r1", [_user("u1", "go")]), *_call("c1", "a1", '{"a"'),
         *_call("c1", "a1", ":1}"), _done("r1")]], {}),
    "a tool call reopened in a later run, or from the history sent": ([
        [_started("r1", [_user("u1", "go")]), *_call("c1", "a1", '{"a"'), _done("r1")],
        [_started("r2", [_user("u2", "more"), {"id": "h0", "role": "assistant", "toolCalls": [
            {"id": "h1", "type": "function", "function": {"name": "f", "arguments": "[1,"}}]}]),
         *_call("c1", "a2", ":1}"), *_call("h1", "a3", "2]"), _done("r2")]], {}),
}


def _applied(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case as the real client holds it once it applied its events."""
    result: list[dict[str, Any]] = run_client_script("apply_events.mjs", cases)
    return result


def _state(runs: list[list[ev.Event]]) -> Any:
    snapshots = [e["snapshot"] for run in runs for e in run if e["type"] == "STATE_SNAPSHOT"]
    return snapshots[-1] if snapshots else {}


def test_the_runtime_rebuilds_what_the_client_holds() -> None:
    names = list(CASES)
    compacted = {name: [compact_events(run) for run in CASES[name][0]] for name in names}
    live = _applied([{"events": [e for run in CASES[n][0] for e in run], "state": CASES[n][1]}
                     for n in names])
    # A client that reloads applies the stored (compacted) runs to no state of its own.
    replayed = _applied([{"events": [e for run in compacted[n] for e in run], "state": {}}
                         for n in names])
    for name, held, again in zip(names, live, replayed, strict=True):
        assert events_to_messages(compacted[name]) == held["messages"], name
        assert events_to_messages(CASES[name][0]) == held["messages"], name
        assert again == held, name
        assert _state(compacted[name]) == held["state"], name
