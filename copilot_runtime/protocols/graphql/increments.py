"""AG-UI event batches → the GraphQL response of `generateCopilotResponse`.

`ResponseEncoder.encode` is handed each batch of the run and returns the bytes to write for
it (one write per batch). Incrementally it writes the 2022 `multipart/mixed` format that the
1.10 client (urql) merges:

* the first part is `{"data": {...}, "hasNext": true}` with the streamed lists empty;
* a message is an item of `messages` (`{"items": [...], "path": [..., "messages", i]}`) as
  soon as it starts; its text or arguments are items of `content`/`arguments`, the pieces of
  one batch in one entry; its deferred `status` is a `{"data", "path"}` patch when it ends;
* the response's deferred `status` comes with the last part, which says `"hasNext": false`.

When the operation selects something that is only known at the end (or the client does not
accept multipart), the whole result is written once, at the end, as a single JSON body.

While a run is silent, `keepalive` gives the bytes that keep the connection busy without
changing the result (proxies cut connections idle for 30-60 s; the 1.10 runtime sends
nothing): an empty part (no headers, no body) between parts, which urql skips without
yielding a result, or a newline before the single JSON body.

Turn semantics follow the 1.10 runtime: a server-side action's result message directly
follows its call. The core streams every tool call of an answer before running the actions,
so message events after a server-side call are held back until its result has been sent;
only after such a call (`answered_later`): a call an agent announces for the page to render
gets no result, and the answer streaming after it was held to the end of the run.
An agent that works in steps answers a call in the step that made it or in a later one (a
graph's tool node), so once another step starts nothing is held for those calls: a
graph-side tool that failed, or a call a graph only announced, gets no result at all, and
the answer that follows must still stream.

An agent's steps and state become agent-state messages (`agent_state`), added to `messages`
as they happen (never held back: they are the live view of the agent), and its interrupts
become `metaEvents` (`meta_events`). The 1.10 client reads only an agent's last agent-state
message (`filterAdjacentAgentStateMessages`), whole, at every part; so a large state is not
repeated: when it has not changed, the agent's last message is updated instead (a `data`
patch with its new id, node and flags, which urql merges into it), and the client sees what
a new message would have shown it. A state under `STATE_REPEATED_BELOW` bytes is repeated,
as the 1.10 runtime did. Streamed, a message the agent's next one supersedes is not kept
(a predicted state makes one per argument piece); the single JSON body lists them all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from copilot_runtime import events as ev
from copilot_runtime._server_tools import AGENT_FINISHED, AGENT_STARTED
from copilot_runtime._time import now_iso as _now
from copilot_runtime.events import Event
from copilot_runtime.protocols.graphql.agent_state import STATE_EVENTS, AgentStates
from copilot_runtime.protocols.graphql.errors import (
    failed_status,
    guardrails_status,
    interrupted_status,
)
from copilot_runtime.protocols.graphql.meta_events import meta_event
from copilot_runtime.protocols.graphql.plan import Field, ObjectPlan, OperationPlan
from copilot_runtime.protocols.graphql.project import Obj, project, project_fields
from copilot_runtime.protocols.graphql.transport import (
    encode_part,
    multipart_end,
    multipart_start,
)

__all__ = ["STATE_REPEATED_BELOW", "ResponseEncoder", "encode_result", "result_message_id",
           "result_message_ids"]

#: States (as JSON) this long or longer are sent again only when they change.
STATE_REPEATED_BELOW = 64 * 1024

_ROLES = frozenset({"assistant", "developer", "system", "tool", "user"})
_SUCCESS: Obj = ("SuccessMessageStatus", {"code": "Success"})
_MESSAGE_EVENTS = frozenset({
    ev.TEXT_MESSAGE_START, ev.TEXT_MESSAGE_CONTENT, ev.TEXT_MESSAGE_END,
    ev.TOOL_CALL_START, ev.TOOL_CALL_ARGS, ev.TOOL_CALL_END,
})
#: A part with neither headers nor body, after the boundary line that ended the last one.
_EMPTY_PART = b"\r\n\r\n\r\n---"
_TEXT_FAILED = "The run failed before this message was complete"
_ARGUMENTS_FAILED = "The run failed before these arguments were complete"
_STOPPED = "The run was stopped before this message was complete"


def encode_result(content: str, error: str | None = None) -> str:
    """A tool result as the 1.10 protocol encodes it: a failed one (the event's `error`) as
    `{"error": {"code", "message"}, "result": ""}`, which the 1.10 client reads."""
    if error is None:
        return content
    return orjson.dumps({"error": {"code": "HANDLER_ERROR", "message": error},
                         "result": ""}).decode()


def result_message_id(call_id: str) -> str:
    """The id a tool call's result goes under in a response (the 1.10 runtime's), whatever
    the id the agent gave it, which the thread keeps it under."""
    return "result-" + call_id


def result_message_ids(events: Sequence[Event]) -> set[str]:
    """The ids the tool results among a run's `events` go under in its response: the
    client's follow-up sends them back, and the thread holds those results already."""
    return {result_message_id(call_id) for event in events
            if event["type"] == ev.TOOL_CALL_RESULT
            and isinstance(call_id := event.get("toolCallId"), str)}


class _Message:
    __slots__ = ("call_name", "entry", "index", "piece_key", "piece_label", "pieces",
                 "typename", "values")

    def __init__(self, index: int, typename: str, values: dict[str, Any],
                 pieces: list[str] | None) -> None:
        self.index = index
        self.typename = typename
        self.values = values
        self.pieces = pieces
        #: The response key its pieces are streamed under, when they are.
        self.piece_key: str | None = None
        self.piece_label: str | None = None
        #: The last `items` entry written for it, while more pieces may join it.
        self.entry: dict[str, Any] | None = None
        self.call_name = ""


class ResponseEncoder:
    """Translates one run's batches; `encode` is the `stream_run` encoder.

    `agent_name` and `agent_run_id` name the agent in its agent-state messages, and
    `agent_state` is the state the run started from; without a name the run's state events
    make none. `answered_later` names the calls whose results the runtime sends after the
    answer has streamed (None: every call not in `frontend_tools`): what follows one of
    them is held for its result.
    """

    def __init__(self, plan: OperationPlan, *, thread_id: str, run_id: str | None,
                 frontend_tools: frozenset[str], stopped: Callable[[], bool],
                 incremental: bool, agent_name: str | None = None,
                 agent_run_id: str | None = None,
                 agent_state: Mapping[str, Any] | None = None,
                 refusal: str | None = None,
                 answered_later: frozenset[str] | None = None) -> None:
        self.plan = plan
        #: A guardrail's reason for refusing the input: the response fails with it.
        self.refusal = refusal
        self.incremental = incremental and plan.incremental is not None
        self.frontend_tools = frontend_tools
        self.answered_later = answered_later
        self.stopped = stopped
        self.done = False
        self._started = False
        #: The messages by index, in order: all of them while a complete list may still be
        #: sent (see `_agent_message`).
        self._messages: dict[int, _Message] = {}
        self._message_count = 0
        self._meta: list[Obj] = []
        self._texts: dict[str, _Message] = {}
        self._calls: dict[str, _Message] = {}
        self._call_names: dict[str, str] = {}
        self._closing: list[_Message] = []
        self._awaiting: set[str] = set()
        self._held: list[Event] | None = None
        #: Held events are being sent without waiting any longer: calls among them that
        #: end are not waited for either.
        self._releasing = False
        self._failed = False
        self._status: Obj | None = None
        self._root: dict[str, Any] = {"threadId": thread_id, "runId": run_id,
                                      "extensions": None, "status": None}
        root = plan.incremental if self.incremental else None
        self._root_plan = root
        messages = root.streamed.get("messages") if root else None
        meta = root.streamed.get("metaEvents") if root else None
        self._message_field: Field | None = messages
        #: Whether messages are sent once, as they happen: nothing shows them again unless
        #: a deferred fragment selects the whole list.
        self._messages_sent_once = root is not None and not any(
            f.name == "messages" for group in root.deferred for f in group.fields)
        self._meta_field: Field | None = meta
        self._root_key = plan.root_key
        self._thread_id = thread_id
        #: The agents whose events are being translated, innermost last (see `_custom`).
        self._agents: list[AgentStates] = []
        if agent_name is not None:
            self._agents.append(AgentStates(agent_name, thread_id, agent_run_id or run_id or "",
                                            agent_state))
        self._agent: AgentStates | None = self._agents[-1] if self._agents else None
        #: Each agent's last agent-state message, by name: the one the 1.10 client reads.
        self._last_states: dict[str, _Message] = {}

    # -- output ----------------------------------------------------------------------------

    def encode(self, batch: Sequence[Event]) -> bytes:
        if self.done:
            return b""  # the response is complete (a stop after the end writes an empty tail)
        out: list[dict[str, Any]] = []
        self._feed(batch, out)
        self._settle(out)
        if not self.incremental:
            return orjson.dumps({"data": self._data(self._complete_root())}) if (
                self.done) else b""
        head = b""
        if not self._started:
            self._started = True
            head = multipart_start + encode_part({"data": self._data(self._initial_root()),
                                                  "hasNext": True})
        if self.done:
            tail = {"incremental": out, "hasNext": False} if out else {"hasNext": False}
            return head + encode_part(tail) + multipart_end
        if out:
            return head + encode_part({"incremental": out, "hasNext": True})
        return head

    def keepalive(self) -> bytes:
        """What to send after a silence: nothing before the first part (a client reads
        that as the result) or after the end."""
        if self.done:
            return b""
        if not self.incremental:
            return b"\n"  # whitespace before a JSON text is part of it
        return _EMPTY_PART if self._started else b""

    def _data(self, root: dict[str, Any]) -> dict[str, Any]:
        return {key: root if kind == "root" else "Mutation" for kind, key in self.plan.top}

    def _root_values(self) -> dict[str, Any]:
        values = dict(self._root)
        values["messages"] = [(m.typename, m.values) for m in self._messages.values()]
        values["metaEvents"] = list(self._meta)
        return values

    def _initial_root(self) -> dict[str, Any]:
        assert self._root_plan is not None
        return project(self._root_plan, "CopilotResponse", self._root_values(), streaming=True)

    def _complete_root(self) -> dict[str, Any]:
        return project(self.plan.flat, "CopilotResponse", self._root_values())

    # -- events ----------------------------------------------------------------------------

    def _feed(self, batch: Sequence[Event], out: list[dict[str, Any]]) -> None:
        index, count = 0, len(batch)
        while index < count:
            event = batch[index]
            index += 1
            kind = event["type"]
            if self._held is not None and (kind in _MESSAGE_EVENTS or (
                    kind == ev.TOOL_CALL_RESULT
                    and event.get("toolCallId") not in self._call_names)):
                self._held.append(event)
            elif kind == ev.TEXT_MESSAGE_CONTENT:
                message_id = event["messageId"]
                message = self._texts.get(message_id)
                self._piece(message, event["delta"], out)
                if message is None or message.entry is None or message.pieces is None:
                    continue
                entry = message.entry
                if out and out[-1] is entry:
                    # The text pieces that follow go into the same entry (as `_piece` would
                    # put them), taken here in one loop: most of a batch is such a run.
                    pieces, items = message.pieces, entry["items"]
                    while index < count:
                        event = batch[index]
                        if event["type"] != ev.TEXT_MESSAGE_CONTENT or (
                                event["messageId"] != message_id):
                            break
                        index += 1
                        delta = event["delta"]
                        pieces.append(delta)
                        items.append(delta)
            elif kind == ev.TOOL_CALL_ARGS:
                self._piece(self._calls.get(event["toolCallId"]), event["delta"], out)
                agent = self._agent
                if agent is not None and agent.predict is not None:
                    self._agent_message(agent.call_arguments(event["toolCallId"],
                                                             event["delta"]), out)
            elif kind == ev.TEXT_MESSAGE_START:
                self._start_text(event["messageId"], event.get("role"), out)
            elif kind == ev.TEXT_MESSAGE_END:
                self._end(self._texts.pop(event["messageId"], None))
            elif kind == ev.TOOL_CALL_START:
                self._start_call(event, out)
            elif kind == ev.TOOL_CALL_END:
                self._end_call(event["toolCallId"])
            elif kind == ev.TOOL_CALL_RESULT:
                self._result(event, out)
            elif kind in STATE_EVENTS:
                if kind == ev.STEP_STARTED:
                    # A new step: the one that made the awaited calls is over, and whatever
                    # answers them came before it, in the step after, or not at all.
                    self._release(out)
                if self._agent is not None:
                    self._agent_message(self._agent.feed(event), out)
            elif kind == ev.CUSTOM:
                self._custom(event, out)
            elif kind == ev.RUN_ERROR:
                self._release(out)
                self._failed = True
                self._status = ("FailedResponseStatus", failed_status(
                    str(event.get("message") or "The run failed"), event.get("code")))
                self.done = True
            elif kind == ev.RUN_FINISHED:
                self._release(out)
                while self._agents:
                    self._agent_message(self._pop_agent().finish(), out)
                self._finish()
            if self.done:
                return

    def _start_text(self, message_id: str, role: Any, out: list[dict[str, Any]]) -> None:
        pieces: list[str] = []
        values = {"id": message_id, "createdAt": _now(), "content": pieces,
                  "role": role if role in _ROLES else "assistant", "parentMessageId": None}
        self._texts[message_id] = self._add("TextMessageOutput", values, "content", out)

    def _start_call(self, event: Event, out: list[dict[str, Any]]) -> None:
        call_id = event["toolCallId"]
        name = event.get("toolCallName") or ""
        pieces: list[str] = []
        values = {"id": call_id, "createdAt": _now(), "name": name, "arguments": pieces,
                  "parentMessageId": event.get("parentMessageId"), "scope": None}
        message = self._add("ActionExecutionMessageOutput", values, "arguments", out)
        message.call_name = name
        self._calls[call_id] = message
        self._call_names[call_id] = name
        agent = self._agent
        if agent is not None and agent.predict is not None:
            agent.call_started(call_id, name)

    def _end_call(self, call_id: str) -> None:
        message = self._calls.pop(call_id, None)
        self._end(message)
        if message is not None and self._answered_later(message.call_name) and (
                not self._releasing):
            # A server-side action: its result comes next in a 1.10 response.
            self._awaiting.add(call_id)
            if self._held is None:
                self._held = []

    def _answered_later(self, name: str) -> bool:
        if name in self.frontend_tools:
            return False
        return self.answered_later is None or name in self.answered_later

    def _result(self, event: Event, out: list[dict[str, Any]]) -> None:
        call_id = event["toolCallId"]
        values = {"id": result_message_id(call_id), "createdAt": _now(),
                  "result": encode_result(str(event.get("content", "")), event.get("error")),
                  "actionExecutionId": call_id, "actionName": self._call_names.get(call_id, ""),
                  "status": _SUCCESS}
        message = self._add("ResultMessageOutput", values, None, out)
        self._deferred(message, out)
        self._awaiting.discard(call_id)
        if not self._awaiting and self._held is not None:
            held, self._held = self._held, None
            self._feed(held, out)

    def _custom(self, event: Event, out: list[dict[str, Any]]) -> None:
        name, value = event.get("name"), event.get("value")
        if name in (AGENT_STARTED, AGENT_FINISHED):
            if not self._agents:
                return  # not an agent run: nobody to attribute the messages to
            if name == AGENT_FINISHED:
                if len(self._agents) > 1:
                    self._agent_message(self._pop_agent().finish(), out)
                return
            started = value if isinstance(value, dict) else {}
            self._agents.append(AgentStates(str(started.get("agentName") or ""),
                                            self._thread_id, str(started.get("runId") or "")))
            self._agent = self._agents[-1]
            return
        if self._agent is not None:
            self._agent.custom(name, value)
        meta = meta_event(name, value, _now())
        if meta is None:
            return
        if self._agent is not None:
            self._agent.interrupted = True
        index = len(self._meta)
        self._meta.append(meta)
        field = self._meta_field
        if field is not None and field.sub is not None:
            entry: dict[str, Any] = {
                "items": [project(field.sub[meta[0]], meta[0], meta[1])],
                "path": [self._root_key, field.key, index]}
            if field.label:
                entry["label"] = field.label
            out.append(entry)

    def _pop_agent(self) -> AgentStates:
        agent = self._agents.pop()
        self._agent = self._agents[-1] if self._agents else None
        return agent

    def _agent_message(self, values: dict[str, Any] | None, out: list[dict[str, Any]]) -> None:
        """Add an agent-state message: complete when it starts, so its status follows. A
        large state that has not changed updates the agent's last message instead."""
        if values is None:
            return
        values["status"] = _SUCCESS
        name = values["agentName"]
        last = self._last_states.get(name)
        state = values["state"]
        if last is not None and len(state) >= STATE_REPEATED_BELOW and (
                last.values["state"] == state):
            self._update(last, values, out)
            return
        message = self._add("AgentStateMessageOutput", values, None, out)
        self._deferred(message, out)
        self._last_states[name] = message
        if last is not None and self._messages_sent_once:
            # Sent, and never updated again (the new one is): keeping each whole state to
            # the end made a predicted state, one message per argument piece, cost memory
            # quadratic in the argument's length.
            del self._messages[last.index]

    def _update(self, message: _Message, values: dict[str, Any],
                out: list[dict[str, Any]]) -> None:
        """Give `message` the fields of `values` (its state the same) with a `data` patch."""
        changed = {k for k, v in values.items() if message.values.get(k) != v}
        message.values.update(values)
        field = self._message_field
        if field is None or field.sub is None:
            return
        selected = [f for f in field.sub[message.typename].fields if f.name in changed]
        if selected:
            out.append({"data": project_fields(selected, message.typename, message.values),
                        "path": [self._root_key, field.key, message.index]})

    # -- messages --------------------------------------------------------------------------

    def _add(self, typename: str, values: dict[str, Any], pieces_field: str | None,
             out: list[dict[str, Any]]) -> _Message:
        pieces = values[pieces_field] if pieces_field else None
        message = _Message(self._message_count, typename, values, pieces)
        self._message_count += 1
        self._messages[message.index] = message
        field = self._message_field
        if field is not None and field.sub is not None:
            plan = field.sub[typename]
            entry: dict[str, Any] = {
                "items": [project(plan, typename, values, streaming=True)],
                "path": [self._root_key, field.key, message.index]}
            if field.label:
                entry["label"] = field.label
            out.append(entry)
            streamed = plan.streamed.get(pieces_field) if pieces_field else None
            if streamed is not None:
                message.piece_key = streamed.key
                message.piece_label = streamed.label
        return message

    def _piece(self, message: _Message | None, delta: str, out: list[dict[str, Any]]) -> None:
        if message is None or message.pieces is None:
            return
        message.pieces.append(delta)
        key = message.piece_key
        if key is None:
            return
        entry = message.entry
        if entry is not None and out and out[-1] is entry:
            entry["items"].append(delta)  # consecutive pieces of one batch: one entry
            return
        field = self._message_field
        assert field is not None
        entry = {"items": [delta], "path": [self._root_key, field.key, message.index, key,
                                            len(message.pieces) - 1]}
        if message.piece_label:
            entry["label"] = message.piece_label
        message.entry = entry
        out.append(entry)

    def _end(self, message: _Message | None) -> None:
        if message is not None:
            self._closing.append(message)

    def _release(self, out: list[dict[str, Any]]) -> None:
        """Send what was held for results that did not come: at the end, or when the agent
        starts another step."""
        self._awaiting.clear()
        if self._held is not None:
            held, self._held = self._held, None
            self._releasing = True
            try:
                self._feed(held, out)
            finally:
                self._releasing = False

    def _finish(self) -> None:
        cut = self.stopped() and self._closing
        if self.refusal is not None:
            self._status = ("FailedResponseStatus", guardrails_status(self.refusal))
        elif cut:
            self._status = ("FailedResponseStatus", interrupted_status(
                str(self._closing[0].values["id"])))
        else:
            self._status = ("SuccessResponseStatus", {"code": "Success"})
        self.done = True

    def _settle(self, out: list[dict[str, Any]]) -> None:
        """Statuses of the messages that ended in this batch, and the run's at the end."""
        if self.done:
            # The core closes every open message before the end; this is for other agents.
            self._closing.extend(m for m in self._messages.values()
                                 if m.values.get("status") is None
                                 and m not in self._closing)
        interrupted = self.done and self._status is not None and (
            self._status[1].get("reason") == "MESSAGE_STREAM_INTERRUPTED")
        for message in self._closing:
            if self._failed or interrupted:
                reason = _STOPPED if interrupted else (
                    _TEXT_FAILED if message.typename == "TextMessageOutput"
                    else _ARGUMENTS_FAILED)
                message.values["status"] = ("FailedMessageStatus",
                                            {"code": "Failed", "reason": reason})
            else:
                message.values["status"] = _SUCCESS
            message.entry = None
            self._deferred(message, out)
        self._closing.clear()
        if self.done:
            self._root["status"] = self._status
            root = self._root_plan
            if root is not None and root.deferred:
                values = self._root_values()
                for group in root.deferred:
                    entry: dict[str, Any] = {
                        "data": project_fields(group.fields, "CopilotResponse", values),
                        "path": [self._root_key]}
                    if group.label:
                        entry["label"] = group.label
                    out.append(entry)

    def _deferred(self, message: _Message, out: list[dict[str, Any]]) -> None:
        field = self._message_field
        if field is None or field.sub is None:
            return
        plan: ObjectPlan = field.sub[message.typename]
        for group in plan.deferred:
            entry: dict[str, Any] = {
                "data": project_fields(group.fields, message.typename, message.values),
                "path": [self._root_key, field.key, message.index]}
            if group.label:
                entry["label"] = group.label
            out.append(entry)
