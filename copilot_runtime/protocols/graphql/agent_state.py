"""An agent's steps and state as the `AgentStateMessageOutput`s of a 1.x response.

A 1.x client follows an agent through agent-state messages: the last one of a response
decides whether the client stays in the agent's session (`running`) and at which node
(`nodeName`), its `state` becomes the agent's shared state in the page, and a `messages`
list inside that state replaces the chat's history. The 1.10 runtime derived them from an
agent's AG-UI events with a fixed set of rules, which `AgentStates` keeps:

* STEP_STARTED: `nodeName` becomes the step's name and the message is `active`;
  STEP_FINISHED: the same node, not active (the name stays until the next step);
* STATE_SNAPSHOT / STATE_DELTA: the whole state after the change (deltas applied to the
  state so far; a patch that does not apply is dropped), active;
* MESSAGES_SNAPSHOT: the state with the conversation under `messages`, active;
* the arguments of a tool named by a `PredictState` custom event, as they stream: the state
  with the argument (or all arguments) under the configured key, active;
* the end of the run: a last message, not active, with the conversation of the last
  MESSAGES_SNAPSHOT under `messages`;
* `running` is true until the agent sends the custom event `Exit` (`copilotkit_exit`).

Two choices differ from that runtime's bridge, so that the client's next request works with
the agents this runtime serves:

* The last message names the node `__end__` unless the run stopped at an interrupt. The
  client sends the last `nodeName` back, and ag-ui-langgraph (in-process and platform
  graphs) and the `copilotkit` SDK continue a thread *as* that node: named after the
  graph's last node, a finished graph would take the next message as that node's output
  and end without answering. `__end__` is how the SDK itself reported a finished graph.
* The state starts as the client sent it (not empty), so the first message does not wipe
  the page's state; and the last message is sent whenever the run sent any (not only when
  the state is not empty), so the client never keeps a stale `nodeName`.

`state` is sent as a JSON string; `messages` inside it are in the JSON representation the
client loads (`to_json_representation`). That runtime put AG-UI-shaped messages in the
MESSAGES_SNAPSHOT message, which the client would misread were it the last one; the same
JSON representation is used for both here.

Runs that hand over to another agent (`copilot_runtime._server_tools`) mark that agent's
events with the custom events `AGENT_STARTED` and `AGENT_FINISHED`; the encoder keeps one
`AgentStates` per agent, so its messages carry its name.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Final

import orjson
import structlog

from copilot_runtime import events as ev
from copilot_runtime._compaction import apply_state_delta
from copilot_runtime._time import now_iso
from copilot_runtime.events import Event
from copilot_runtime.messages import to_json_representation

__all__ = ["STATE_EVENTS", "AgentStates", "PartialJson"]

_log = structlog.get_logger("copilot_runtime.graphql")

#: The events every one of which makes an agent-state message.
STATE_EVENTS: Final = frozenset({ev.STEP_STARTED, ev.STEP_FINISHED, ev.STATE_SNAPSHOT,
                                 ev.STATE_DELTA, ev.MESSAGES_SNAPSHOT})


class AgentStates:
    """One agent's view during one response; each method returns the fields of the
    agent-state message to add (status excluded), or None when there is none."""

    def __init__(self, agent_name: str, thread_id: str, run_id: str,
                 state: Mapping[str, Any] | None = None) -> None:
        self.agent_name = agent_name
        self.thread_id = thread_id
        self.run_id = run_id
        self.state: dict[str, Any] = {}
        self._set(dict(state or {}))
        self.node = ""
        self.running = True
        #: Whether the agent stopped at an interrupt (then the graph is not at its end).
        self.interrupted = False
        self._sent = False
        self.messages: list[dict[str, Any]] | None = None
        #: `PredictState` entries ({state_key, tool, tool_argument}) of the current step.
        self.predict: list[Mapping[str, Any]] | None = None
        #: The tool name and arguments so far of each predicted call.
        self._arguments: dict[str, tuple[str, PartialJson]] = {}

    # -- events --------------------------------------------------------------------------

    def feed(self, event: Event) -> dict[str, Any] | None:
        """A STEP_*, STATE_* or MESSAGES_SNAPSHOT event."""
        kind = event["type"]
        if kind == ev.STATE_DELTA:
            patched = apply_state_delta(self.state, event.get("delta") or [])
            # (`apply_state_delta` hands back the very same object when the patch fails)
            if patched is self.state or not isinstance(patched, dict):
                return None
            self._set(patched)
            return self._message(active=True)
        if kind == ev.STATE_SNAPSHOT:
            snapshot = event.get("snapshot")
            if isinstance(snapshot, dict):  # the 1.x protocol knows object states only
                self._set(snapshot)
            return self._message(active=True)
        if kind == ev.MESSAGES_SNAPSHOT:
            messages = event.get("messages")
            self.messages = messages if isinstance(messages, list) else []
            return self._message(active=True, with_messages=True)
        # Predictions belong to one step's tool calls.
        self.predict = None
        self._arguments.clear()
        if kind == ev.STEP_STARTED:
            self.node = str(event.get("stepName") or "")
            return self._message(active=True)
        return self._message(active=False)  # STEP_FINISHED

    def custom(self, name: Any, value: Any) -> None:
        if name == "Exit":
            self.running = False
        elif name == "PredictState":
            entries = value if isinstance(value, list) else [value]
            self.predict = [e for e in entries if _usable_rule(e)] or None

    def call_started(self, call_id: str, name: str) -> None:
        """Only called while `predict` is set."""
        assert self.predict is not None
        if any(entry.get("tool") == name for entry in self.predict):
            self._arguments[call_id] = (name, PartialJson())

    def call_arguments(self, call_id: str, delta: str) -> dict[str, Any] | None:
        """Only called while `predict` is set: the state the arguments so far predict."""
        entry = self._arguments.get(call_id)
        if entry is None or self.predict is None:
            return None
        name, reader = entry
        arguments = reader.add(delta)
        if not isinstance(arguments, dict):
            return None
        changed: dict[str, Any] = {}
        for rule in self.predict:
            key, argument = rule.get("state_key"), rule.get("tool_argument")
            if rule.get("tool") != name or not isinstance(key, str):
                continue
            if not argument:
                changed[key] = arguments
            elif argument in arguments:
                changed[key] = arguments[argument]
        if not changed:
            return None
        self._set({**self.state, **changed})
        return self._message(active=True)

    def finish(self) -> dict[str, Any] | None:
        if not (self._sent or self.state or self.messages is not None):
            return None
        if not self.interrupted:
            self.node = "__end__"
        return self._message(active=False, with_messages=self.messages is not None)

    # -- messages ------------------------------------------------------------------------

    def _set(self, state: dict[str, Any]) -> None:
        self.state = {k: v for k, v in state.items() if k != "messages"} \
            if "messages" in state else state

    def _message(self, *, active: bool, with_messages: bool = False) -> dict[str, Any]:
        self._sent = True
        state: Mapping[str, Any] = self.state
        if with_messages and self.messages is not None:
            state = {**state, "messages": to_json_representation(self.messages)}
        return {"id": f"ck-{uuid.uuid4()}", "createdAt": now_iso(), "threadId": self.thread_id,
                "agentName": self.agent_name, "nodeName": self.node, "runId": self.run_id,
                "active": active, "role": "assistant", "running": self.running,
                "state": orjson.dumps(state, option=orjson.OPT_NON_STR_KEYS).decode()}


def _usable_rule(entry: Any) -> bool:
    """Whether `entry` is a PredictState rule the arguments can be read by: its
    `tool_argument` names one (text), or is absent for all of them. Another is warned of and
    ignored: it failed the encoding of the run's batch (a list is no key)."""
    if not isinstance(entry, Mapping):
        return False
    argument = entry.get("tool_argument")
    if argument is None or isinstance(argument, str):
        return True
    _log.warning("ignored a PredictState rule whose tool_argument is not a string",
                 state_key=entry.get("state_key"), tool=entry.get("tool"),
                 tool_argument_type=type(argument).__name__)
    return False


def partial_json(text: str) -> Any:
    """JSON that may be cut short (streamed tool arguments), with what is open closed;
    None when even that does not parse (say, the text stops after a colon)."""
    return PartialJson().add(text)


class PartialJson:
    """A text that arrives in pieces, read after each as `partial_json` reads it whole.

    The scanner's state (an open string, a pending escape, the open brackets) is kept
    between pieces, so each piece is scanned once: re-reading everything at every piece made
    a streamed argument cost quadratic time.
    """

    __slots__ = ("_closers", "_escaped", "_in_string", "_text")

    def __init__(self) -> None:
        self._text = ""
        #: What closes each open bracket, innermost last.
        self._closers: list[str] = []
        self._in_string = False
        self._escaped = False

    def add(self, piece: str) -> Any:
        """The value of the text so far, with `piece` added (see `partial_json`)."""
        self._text += piece
        closers = self._closers
        in_string, escaped = self._in_string, self._escaped
        for char in piece:
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                closers.append("}" if char == "{" else "]")
            elif char in "}]" and closers:
                closers.pop()
        self._in_string, self._escaped = in_string, escaped
        text = self._text
        # Complete JSON closes every string and bracket it opens: with one open, the text
        # as it is cannot parse, and is not tried.
        if not (in_string or closers):
            try:
                return orjson.loads(text)
            except orjson.JSONDecodeError:
                pass
        if escaped:
            text = text[:-1]
        candidate = text + ('"' if in_string else "")
        stripped = candidate.rstrip()
        if stripped.endswith(","):
            candidate = stripped[:-1]
        try:
            return orjson.loads(candidate + "".join(reversed(closers)))
        except orjson.JSONDecodeError:
            return None
