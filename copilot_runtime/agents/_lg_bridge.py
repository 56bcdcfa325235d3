"""ag-ui-langgraph's LangGraph → AG-UI state machine, taught CopilotKit's conventions.

`ag_ui_langgraph.LangGraphAgent` already turns a graph's `astream_events` into AG-UI
events: text and tool-call streaming, steps per node, state and messages snapshots,
interrupts, regeneration, and the frontend's tools in `state["copilotkit"]["actions"]`.
It keeps per-run state on the instance, so `LangGraphAgent` clones it for every run.
What it lacks, and this subclass adds (the same hooks the `copilotkit` SDK's own subclass
overrides):

* the `copilotkit:*` config metadata (`copilotkit:emit-messages`,
  `copilotkit:emit-tool-calls` with its list-of-names form, and
  `copilotkit:emit-intermediate-state`), translated to the keys the base reads;
* the `copilotkit_*` custom events of `copilotkit.langgraph`: manually emitted messages and
  tool calls, intermediate state (merged into the current state, as the SDK documents,
  instead of replacing it), and `copilotkit_exit` as the `Exit` custom event;
* `state["copilotkit"]["context"]`, the other half of the `CopilotKitState` convention;
* `get_schema_keys()` without the config and context schemas: the base reads them through
  LangGraph APIs deprecated in 1.0 (a `DeprecationWarning` per run) and never uses them;
  and from the graph's channels when pydantic cannot describe its state;
* interrupts' payloads and the checkpoint's messages made what the base can convert
  (`_lg_values`): keys that are not text, and message classes it does not know, failed
  every later run of their thread;
* `stream()`, the base's `run()` without its catch-all: the base turns any exception into a
  `RUN_ERROR` carrying `str(exc)`, which can leak internals to the client; the runtime's
  own error policy decides instead;
* answers to several pending interrupts as LangGraph takes them, `{interrupt id: answer}`:
  the base's own map is a sentinel LangGraph does not read, and a single bare answer
  LangGraph refuses while more than one interrupt waits, so the thread stayed stuck;
* one streaming slot per model call: the base keys the message or tool call in flight
  by subagent lane, one lane for all when subagent events are off, so parallel branches
  (`Send` workers, parallel nodes) and calls one node makes at once (`asyncio.gather`,
  `abatch`) streamed into one message and one tool call's arguments;
* the arguments that come in the chunk naming a tool call (a whole call in one chunk:
  Ollama, vLLM, Gemini), which the base drops: they are sent as the call's first
  `TOOL_CALL_ARGS`;
* client input the base crashes on refused as `InvalidRequestError` (a `state.copilotkit`
  that is not an object, a `state.tools` that is not a list of objects, a `nodeName` that
  is not text, tool-call arguments that are JSON but not an object), and
  activity messages (UI state) kept out of the graph's input, where the base fails on
  their role;
* state the client only echoed back kept out of the graph's input: its JSON form
  (`json_safe`) replaced the checkpoint's typed values (a date became a string);
* snapshots that include what an interrupted subgraph said (`_lg_state.graph_values`);
* a new user message while an interrupt waits refused (`ApprovalError`), where the base
  announces the interrupt again and drops the message;
* what nodes write with `get_stream_writer()` (LangGraph's "custom" stream mode) sent as
  the `langgraph_stream_writer` custom event, where the base drops it;
* what a node's `Command(update=...)` writes folded into the state the base snapshots
  mid-run, as it folds a node's dict output; and a key with a reducer (`operator.add`)
  shown as LangGraph reduced it, in the first snapshot after its step ended, where the
  base replaced the key's value with a node's write (`_reduced`);
* a client's tool results as the model is to read them, and its snapshots showing them as
  the client sent them (`_lg_tool_messages`): parts became their Python repr, and an
  `error` an empty result (the snapshot's error the word "error");
* a tool's result message given its id as the tool ends (`_ToolMessageIds`), so its
  `TOOL_CALL_RESULT` names the message the checkpoint keeps;
* the result of a tool whose exception ToolNode caught (`handle_tool_errors`: the error
  ToolMessage it made), sent as a `TOOL_CALL_RESULT` with its `error`: the base sends
  results on `on_tool_end` only, which a raising tool never reaches, so the call had no
  result in the stream, and the stored thread put the error after the answer.

The hooks overridden here are private to ag-ui-langgraph (its version is pinned in
pyproject); tests/test_lg_bridge_contract.py checks their names and signatures against the
installed release, so a bump that moves one fails there, naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Annotated, Any, Final, Literal

import orjson
import pydantic
import structlog
from ag_ui.core import (
    CustomEvent,
    EventType,
    MessagesSnapshotEvent,
    RunAgentInput,
    StateSnapshotEvent,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
)
from ag_ui_langgraph import LangGraphAgent as _BaseBridge  # type: ignore[import-untyped]
from ag_ui_langgraph.agent import dump_json_safe  # type: ignore[import-untyped]
from ag_ui_langgraph.utils import (  # type: ignore[import-untyped]
    camel_to_snake,
    normalize_tool_content,
)
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, RemoveMessage, ToolMessage
from langgraph.channels.binop import BinaryOperatorAggregate
from langgraph.errors import GraphBubbleUp
from langgraph.graph.message import REMOVE_ALL_MESSAGES, add_messages
from langgraph.pregel import Pregel
from langgraph.types import Command, Interrupt, StateSnapshot

from copilot_runtime._exceptions import ApprovalError, InvalidRequestError
from copilot_runtime._time import iso_time, parse_time
from copilot_runtime.agents._lg_config import context_init_keys
from copilot_runtime.agents._lg_events import PLUMBING_STATE_KEYS
from copilot_runtime.agents._lg_shown import is_shown
from copilot_runtime.agents._lg_state import graph_values, schema_keys
from copilot_runtime.agents._lg_tool_messages import for_graph, repaired, to_agui
from copilot_runtime.agents._lg_values import json_safe, json_shown, known_messages

__all__ = ["STREAM_WRITER_EVENT", "CopilotKitLangGraphBridge"]

# CopilotKit's custom event names and the ag-ui-langgraph names that mean the same thing.
_RENAMED_CUSTOM_EVENTS: Final = {
    "copilotkit_manually_emit_message": "manually_emit_message",
    "copilotkit_manually_emit_tool_call": "manually_emit_tool_call",
    "copilotkit_manually_emit_intermediate_state": "manually_emit_state",
}
_EXIT_EVENT: Final = "copilotkit_exit"
# The message roles the base turns into graph input; others (activity) are UI state.
_GRAPH_INPUT_ROLES: Final = frozenset({"user", "assistant", "system", "tool", "developer",
                                       "reasoning"})
# The fields of an interrupt's value the base lifts into AG-UI's Interrupt, and their types.
_LIFTED_FIELDS: Final[dict[str, type | tuple[type, ...]]] = {
    "reason": str, "message": str, "toolCallId": str, "tool_call_id": str,
    "responseSchema": dict, "response_schema": dict, "expiresAt": str, "expires_at": str}
#: The events that carry a node's writes or the graph's state (see `_reduced`).
_CHAIN_EVENTS: Final = frozenset({"on_chain_end", "on_chain_stream"})
#: The custom event carrying what a node wrote with `get_stream_writer()`.
STREAM_WRITER_EVENT: Final = "langgraph_stream_writer"

_log = structlog.get_logger("copilot_runtime.agents")


class CopilotKitLangGraphBridge(_BaseBridge):  # type: ignore[misc]
    """One run's translator; see the module docstring. Use `clone()` per run."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Tool calls whose announcement `copilotkit:emit-tool-calls` withheld: their
        # results are withheld too, or the client would get a result for a call it never saw.
        self._hidden_tool_calls: set[str] = set()
        # Tool calls whose tool raised (`on_tool_error`), by id, with their name and input:
        # ToolNode may catch it and make their result (see `_failed_tool_results`).
        self._failed_tool_calls: dict[str, tuple[str, Any]] = {}
        # The (call id, message id) of each tool result the base announced: a node's retry
        # runs a call its failed try answered again, under the same ids (`_ToolMessageIds`).
        self._answered: set[tuple[str, Any]] = set()
        # The model call (its LangChain run id) of the model event being translated: its
        # streaming slot (see `_current_lane`).
        self._task_lane: str | None = None
        # The root graph's keys with a reducer (none: nothing to do), its state as of the
        # last superstep (its "values"), and which of those keys its nodes wrote since
        # (see `_reduced`).
        self._reducers: frozenset[str] = frozenset()
        self._running: dict[str, Any] | None = None
        self._written: set[str] = set()
        # The base's running state (what its mid-run snapshots show): the dict its
        # `prepare_stream` returned, which it updates in place with each node's output.
        self._base_state: dict[str, Any] | None = None

    # -- entry point -------------------------------------------------------------------

    async def stream(self, input: RunAgentInput) -> AsyncIterator[Any]:
        """The run's AG-UI events (pydantic models); exceptions propagate."""
        forwarded = input.forwarded_props if isinstance(input.forwarded_props, dict) else {}
        _check_client_input(input)
        graph_messages = []
        subagent_messages = []
        for message in input.messages or ():
            if message.role not in _GRAPH_INPUT_ROLES:
                continue  # UI state (an activity message): no model reads it
            if getattr(message, "subagent_run_id", None) is None:
                graph_messages.append(message)
            else:
                subagent_messages.append(message)
        # Read by the base's run set-up (it re-emits them in MESSAGES_SNAPSHOT).
        self._inbound_subagent_messages = subagent_messages
        update: dict[str, Any] = {
            "forwarded_props": {camel_to_snake(k): v for k, v in forwarded.items()}}
        if isinstance(input.state, dict):
            # The base writes the checkpoint's LangChain messages into the state it is
            # given; a copy keeps them out of the client's input, which the runtime echoes
            # in RUN_STARTED and stores as JSON.
            update["state"] = dict(input.state)
        if input.messages:
            update["messages"] = graph_messages
        async for event in self._handle_stream_events(input.model_copy(update=update)):
            if event is not None:  # the base yields None for events it withheld
                yield event

    # -- hooks of the base -------------------------------------------------------------

    async def prepare_stream(self, input: RunAgentInput, agent_state: Any,
                             config: Any) -> Any:
        _refuse_message_while_waiting(input, agent_state, self._collect_interrupts(
            getattr(agent_state, "tasks", None) or ()))
        if self.active_run.get("mode") == "continue" and not await _stopped_at_breakpoint(
                self.graph, agent_state, config):
            # A client's `nodeName` ("continue": its state written as that node's output,
            # then the graph on from there) is honoured only where the graph stopped at a
            # breakpoint its author set. On a new thread, one at rest, or one a disconnect,
            # stop or crash cut off mid-step (LangGraph keeps its `next`), it let any client
            # skip nodes (an approval's interrupt included) and set keys the input schema
            # keeps out of its hands: the run starts as any other.
            self.active_run["mode"] = "start"
            self.active_run["node_name"] = None
        echoed = _echoed_keys(input.state, getattr(agent_state, "values", None))
        if echoed:
            # What the client sent back unchanged is the checkpoint's value in JSON form
            # (a date as text, a set as a list): as graph input it would replace the
            # typed value, and a reducer would add it again. The graph keeps its own.
            input = input.model_copy(update={"state": {
                k: v for k, v in (input.state or {}).items() if k not in echoed}})
        _check_schema_fit(self.graph, input, getattr(agent_state, "values", None))
        prepared = await super().prepare_stream(input=input, agent_state=agent_state,
                                                config=config)
        running = prepared.get("state")
        if isinstance(running, dict) and _rewrites_messages(running.get("messages")):
            # (the graph's input rewrites them; the base's running state shows them)
            prepared["state"] = {**running, "messages": running["messages"][1:]}
        if echoed and isinstance(prepared.get("state"), dict):
            # The base's running state (its snapshots' starting point) still has them. A
            # new dict: on the regeneration path it is the checkpoint's own values.
            prepared["state"] = {**echoed, **prepared["state"]}
        if isinstance(prepared.get("state"), dict):
            self._base_state = prepared["state"]
        if prepared.get("stream") is not None:
            prepared["stream"] = self._translate_metadata(prepared["stream"])
        return prepared

    def get_stream_kwargs(self, input: Any, subgraphs: bool = False,
                          version: Literal["v1", "v2"] = "v2", config: Any = None,
                          context: Any = None, fork: Any = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = super().get_stream_kwargs(
            input=input, subgraphs=subgraphs, version=version, config=config,
            context=context, fork=fork)
        if isinstance(self.graph, Pregel):
            named = _context_keys(self.graph)
            if "context" in kwargs and named is not None:
                # The base passes the whole `configurable` (`thread_id`, LangGraph's own
                # `__pregel_*`) as the run's context; a dataclass or pydantic context
                # class refuses any key it does not name, failing every run. (A TypedDict
                # or dict context takes it all, as it always did.)
                # Always one (if empty, the schema's defaults), as a graph reads it.
                kwargs["context"] = {key: value for key, value in kwargs["context"].items()
                                     if key in named}
            # "custom" adds what nodes write with get_stream_writer() (as the root graph's
            # `on_chain_stream` events); "values" is a compiled graph's default.
            kwargs["stream_mode"] = ["values", "custom"]
            kwargs["config"] = _with_tool_message_ids(kwargs.get("config"))
            self._reducers = frozenset(
                key for key, channel in self.graph.channels.items()
                if isinstance(channel, BinaryOperatorAggregate)
                and key not in PLUMBING_STATE_KEYS)  # (never in a state snapshot)
        return kwargs

    def get_schema_keys(self, config: Any) -> dict[str, list[str]]:
        constant: list[str] = list(self.constant_schema_keys)
        keys = schema_keys(self.graph, config)
        return {"input": [*keys["input"], *constant], "output": [*keys["output"], *constant],
                "config": [], "context": []}

    def langgraph_default_merge_state(self, state: Any, messages: Any,
                                      input: RunAgentInput) -> Any:
        saved = state.get("messages")
        # (the client's tool results as the model is to read them: `_lg_tool_messages`)
        messages = for_graph(messages, input.messages or ())
        merged = super().langgraph_default_merge_state(
            state, _without_answered_results(messages, saved), input)
        if merged.get("messages"):
            merged["messages"] = repaired(merged["messages"], messages)
        placed = _results_in_place(saved, merged.get("messages"))
        if placed is not None and isinstance(self.graph, Pregel) and getattr(
                self.graph.channels.get("messages"), "operator", None) is add_messages:
            # A result for a call the checkpoint went on past (the runtime answered it in
            # the last run, after the graph's later nodes spoke): appended, it would follow
            # those messages, which a model refuses. The conversation is written anew
            # with it after its call (add_messages only appends what it does not know).
            merged["messages"] = [RemoveMessage(id=REMOVE_ALL_MESSAGES), *placed]
        context = [{"description": c.description, "value": c.value}
                   for c in input.context or ()]
        merged["copilotkit"] = {**merged.get("copilotkit", {}), "context": context}
        return merged

    async def _handle_single_event(self, event: Any, state: Any) -> AsyncIterator[Any]:
        self._task_lane = _model_run(event) if not self.emit_subagent_events else None
        try:
            async for out in self._translate_event(event, state):
                yield out
        finally:
            self._task_lane = None

    def _current_lane(self) -> str:
        # A model call's text or tool call streams in its own slot: two branches, or two
        # calls one node makes at once (asyncio.gather, abatch), each get a message (and
        # tool calls) of their own.
        lane: str = self._task_lane or super()._current_lane()
        return lane

    def _record_tool_call_owners(self, message: Any) -> None:
        # Read back when a tool ends, outside the model's call: kept where that looks.
        lane, self._task_lane = self._task_lane, None
        try:
            super()._record_tool_call_owners(message)
        finally:
            self._task_lane = lane

    def _build_command_from_agui_resume(self, entries: list,  # type: ignore[type-arg]
                                        *, open_interrupts: Any = None) -> Any:
        if len(entries) <= 1 and len(open_interrupts or ()) <= 1:
            return super()._build_command_from_agui_resume(
                entries, open_interrupts=open_interrupts)
        # LangGraph refuses a bare answer while several interrupts wait, even for one of
        # them: each answer goes under its interrupt's id; the unanswered keep waiting.
        return Command(resume={
            e.interrupt_id: e.payload if e.status == "resolved"
            else super(CopilotKitLangGraphBridge, self)._build_command_from_agui_resume(
                [e]).resume
            for e in entries})

    async def get_state_and_messages_snapshots(self, config: Any) -> AsyncIterator[Any]:
        # The base reads the parent graph's state only: while a subgraph waits on an
        # interrupt, what it said so far is in its own state, and vanished from the chat.
        values = await graph_values(self.graph, config)
        if not (self.emit_subagent_events and self.active_run is not None
                and self.active_run.get("current_subagent_run_id")):
            # (as the base: a subagent's state is a partial view, not the run's state)
            yield self._dispatch_event(StateSnapshotEvent(
                type=EventType.STATE_SNAPSHOT, snapshot=self.get_state_snapshot(values)))
        messages = to_agui(self._filter_orphan_tool_messages(values.get("messages") or []))
        yield self._dispatch_event(MessagesSnapshotEvent(
            type=EventType.MESSAGES_SNAPSHOT,
            messages=self._merge_subagent_messages(self._translate_snapshot_ids(messages))))

    async def _translate_event(self, event: Any, state: Any) -> AsyncIterator[Any]:
        kind = event.get("event")
        if kind == "on_tool_error":
            data = event.get("data") or {}
            call_id = data.get("tool_call_id")
            if isinstance(call_id, str):
                self._failed_tool_calls[call_id] = (str(event.get("name") or ""),
                                                    data.get("input"))
        elif kind == "on_tool_end":
            answers = {(message.tool_call_id, message.id) for message in _tool_results(
                (event.get("data") or {}).get("output")) if isinstance(message, ToolMessage)}
            if answers and answers <= self._answered:
                return  # (a retry of the node ran a call its failed try answered)
            self._answered |= answers
            # A retry of the node (its RetryPolicy) ran the call again, and it succeeded:
            # the base answers it now; ToolNode's end must not answer it again.
            for call_id, _ in answers:
                self._failed_tool_calls.pop(call_id, None)
        elif kind == "on_chain_end" and self._failed_tool_calls:
            for out in self._failed_tool_results(event):
                yield out
        written = _stream_writer_chunk(event)
        if written is not None:
            yield self._dispatch_event(CustomEvent(
                type=EventType.CUSTOM, name=STREAM_WRITER_EVENT, value=json_safe(written[0])))
            return
        if event.get("event") == "on_custom_event":
            name = event.get("name")
            if name == _EXIT_EVENT:
                yield self._dispatch_event(CustomEvent(type=EventType.CUSTOM, name="Exit",
                                                       value=True))
                return
            renamed = _RENAMED_CUSTOM_EVENTS.get(name)
            if renamed is not None:
                data = event.get("data")
                if renamed == "manually_emit_state" and isinstance(data, dict) \
                        and isinstance(state, dict):
                    data = {**state, **data}
                event = {**event, "name": renamed, "data": data}
                async for out in super()._handle_single_event(event, state):
                    # The translated events stand for the custom event; drop its echo.
                    if not (out is not None and out.type == EventType.CUSTOM
                            and out.name == renamed):
                        yield out
                return
        first_args = _first_chunk_arguments(event)
        async for out in super()._handle_single_event(event, state):
            yield out
            if first_args is not None and out is not None \
                    and out.type == EventType.TOOL_CALL_START:
                # The base announces a call from the chunk that names it and drops the
                # arguments that chunk carries (a whole call in one chunk: Ollama, vLLM,
                # Gemini): they are the call's first piece.
                yield self._dispatch_event(ToolCallArgsEvent(
                    type=EventType.TOOL_CALL_ARGS, tool_call_id=out.tool_call_id,
                    delta=first_args, raw_event=event))

    def _filter_orphan_tool_messages(self, messages: list) -> list:  # type: ignore[type-arg]
        return list(super()._filter_orphan_tool_messages(known_messages(messages)))

    def _interrupts_to_agui(self, lg_interrupts: Any) -> Any:
        out = []
        for safe in _safe_interrupts(lg_interrupts):
            liftable, kept = _liftable(safe)
            for mapped in super()._interrupts_to_agui([liftable]):
                raw = ((mapped.metadata or {}).get("langgraph") or {}).get("raw")
                if kept and isinstance(raw, dict):
                    # The value as the graph gave it, in its own order: what the client
                    # (and the ledger) reads as the question.
                    raw.update(kept)
                    mapped.metadata["langgraph"]["raw"] = {
                        key: raw[key] for key in safe.value if key in raw}
                out.append(mapped)
        return out

    def _prepare_interrupt_tail(self, lg_interrupts: Any) -> list:  # type: ignore[type-arg]
        return list(super()._prepare_interrupt_tail(_safe_interrupts(lg_interrupts)))

    def _dispatch_event(self, event: Any) -> Any:
        if event is not None and event.type == EventType.TOOL_CALL_RESULT \
                and event.tool_call_id in self._hidden_tool_calls:
            return None
        return super()._dispatch_event(event)

    def _failed_tool_results(self, event: Any) -> list[Any]:
        """The results, among what a node returned (`event`, its `on_chain_end`), of tool
        calls whose tool raised: the messages ToolNode made of their errors, announced as
        the base announces a result on `on_tool_end` (the call first, if it never streamed),
        with the AG-UI tool message's `error`."""
        out: list[Any] = []
        for message in _tool_results((event.get("data") or {}).get("output")):
            if not isinstance(message, ToolMessage):
                continue
            failed = self._failed_tool_calls.pop(message.tool_call_id, None)
            if failed is None:
                continue
            call_id = self._resolve_public_tool_call_id(message.tool_call_id)
            streamed: set[Any] = self.active_run["streamed_tool_call_ids"]
            key = self._streamed_call_key(call_id)
            if key not in streamed:
                name, arguments = failed
                out += [
                    ToolCallStartEvent(
                        type=EventType.TOOL_CALL_START, tool_call_id=call_id,
                        tool_call_name=message.name or name,
                        parent_message_id=self._tool_call_owner(message.tool_call_id)),
                    ToolCallArgsEvent(type=EventType.TOOL_CALL_ARGS, tool_call_id=call_id,
                                      delta=dump_json_safe(arguments or {})),
                    ToolCallEndEvent(type=EventType.TOOL_CALL_END, tool_call_id=call_id)]
            streamed.discard(key)
            content = normalize_tool_content(message.content)
            # (`error` is the runtime's field of a failed result: an extra to AG-UI's model.)
            failure: dict[str, Any] = {"error": content} if message.status == "error" else {}
            out.append(ToolCallResultEvent(
                type=EventType.TOOL_CALL_RESULT, tool_call_id=call_id,
                message_id=self._resolve_public_message_id(
                    str(message.id or message.tool_call_id)),
                content=content, role="tool", **failure))
        return [self._dispatch_event(e) for e in out]

    # -- CopilotKit metadata -----------------------------------------------------------

    async def _translate_metadata(self, stream: AsyncIterator[dict[str, Any]]
                                  ) -> AsyncIterator[dict[str, Any]]:
        async for event in stream:
            metadata = event.get("metadata")
            if event.get("event") == "on_chain_end" and metadata \
                    and event.get("name") == metadata.get("langgraph_node") \
                    and self.active_run is not None:
                # Intermediate state lasts until its node ends, as in the SDK.
                self.active_run["manually_emitted_state"] = None
            if metadata and any(key.startswith("copilotkit:") for key in metadata):
                event = {**event, "metadata": self._base_metadata(event, metadata)}
            written = _command_writes(event)
            if written is not None:
                # The base folds only a node's dict output into the state it snapshots
                # mid-run: what a `Command` wrote was missing until the run's end.
                event = {**event, "data": {**event["data"], "output": written}}
            if self._reducers and event.get("event") in _CHAIN_EVENTS:  # (not per token)
                event = self._reduced(event)
            yield event

    def _reduced(self, event: dict[str, Any]) -> dict[str, Any]:
        """`event` without a root node's writes to keys with a reducer, which the base
        would set as they are (`{"items": ["b"]}` on `operator.add`'s key showed `["b"]`
        as the state); and, as a superstep ends, the state LangGraph reduced for those keys
        put in the base's running state, so the next snapshot the base sends anyway (the
        next node's exit, the run's end) shows them. No event is added: a made-up node
        exit brought back a snapshot the base withholds (predicted state), one more per
        step, and a RAW end of the root graph mid-run. The user's reducer is never run
        here: it may have side effects, or change its left value, the graph's own, in
        place."""
        kind = event.get("event")
        if kind == "on_chain_stream":
            values = _root_values(event)
            if values is None:
                return event
            previous, self._running = self._running, values
            changed = set(self._written)
            self._written.clear()
            # Also what no dict output said it wrote (a ToolNode's `Command`s, a
            # subgraph's `Command.PARENT`): a reducer's result is a new object. The first
            # "values" (the input's step) brings the checkpoint's, which the base's state,
            # made of the client's input, lacks.
            changed.update(key for key in self._reducers if key in values and (
                previous is None or key not in previous or values[key] is not previous[key]))
            if self._base_state is not None:
                self._base_state.update(
                    (key, values[key]) for key in changed if key in values)
            return event
        output = (event.get("data") or {}).get("output")
        if kind != "on_chain_end" or not isinstance(output, dict) \
                or not event.get("parent_ids"):
            return event  # (the graph's own end carries its state)
        written = self._reducers.intersection(output)
        if not written:
            return event
        namespace = str((event.get("metadata") or {}).get("langgraph_checkpoint_ns") or "")
        if "|" not in namespace:
            # A node's task, and any chain inside it (the runnable bears the node's name
            # when it is a compiled subgraph, or a `RunnableLambda(name=...)`), carry the
            # write. (A subgraph's node writes to the subgraph's state, not the root's:
            # the base would show that value as the root's.)
            self._written |= written
        kept = {key: value for key, value in output.items() if key not in written}
        return {**event, "data": {**event["data"], "output": kept}}

    def _base_metadata(self, event: dict[str, Any], metadata: dict[str, Any]
                       ) -> dict[str, Any]:
        out = dict(metadata)
        if "copilotkit:emit-messages" in metadata:
            out["emit-messages"] = bool(metadata["copilotkit:emit-messages"])
        if "copilotkit:emit-intermediate-state" in metadata:
            out["predict_state"] = metadata["copilotkit:emit-intermediate-state"]
        wanted = metadata.get("copilotkit:emit-tool-calls")
        if wanted is None or event.get("event") != "on_chat_model_stream":
            return out
        names = None if isinstance(wanted, bool) else (
            {wanted} if isinstance(wanted, str) else set(wanted))
        if names is None:
            out["emit-tool-calls"] = wanted
        for call in _tool_call_chunks(event):
            call_name, call_id = _get(call, "name"), _get(call, "id")
            if not call_name:
                continue  # an argument chunk: it follows whatever its call's start did
            emit = wanted if names is None else call_name in names
            out["emit-tool-calls"] = emit
            if not emit and call_id:
                self._hidden_tool_calls.add(call_id)
        return out


# The namespace of the ids `_ToolMessageIds` derives from a task and a call.
_TOOL_RESULT_IDS = uuid.UUID("5d0e2c8a-3f1b-4a57-9c3e-7b2f6a1d4e90")


class _ToolMessageIds(BaseCallbackHandler):
    """Gives a tool's result messages without an id one as the tool ends.

    ToolNode's ToolMessage has no id until `add_messages` gives it one, after the base
    streamed the result under the tool call's id: the run's MESSAGES_SNAPSHOT then carried
    another id, and a client merging it (ours: `_compaction`) moved the result after the
    answer, a history models refuse. Run inline, before the tool returns its message
    (the object ToolNode passes on, or deep-copies out of a `Command`) and before the
    event stream reads it. A tool that raised never ends: the message ToolNode makes of
    its error gets its id as ToolNode itself ends.

    A node retried (its RetryPolicy, or a node's around the subgraph holding the ToolNode,
    which runs that subgraph's earlier steps again too) runs its calls' tools again: each
    call's result gets the id its first try's got, whichever try ends first (a sibling of
    the failing tool may end after its node failed, even after the retry's own result), so
    the checkpoint keeps the id the client was given, and the bridge sends the result once.
    A ToolNode run is a retry of one that failed, or ran inside a run that failed, when the
    first call it starts is one of that run's (the same id and arguments); a later step's
    calls, whose ids a model may reuse (`call_0` each turn), follow no failure and keep ids
    of their own."""

    run_inline = True

    def __init__(self) -> None:
        super().__init__()
        # The runs (ToolNodes) one of whose tools raised, until they end.
        self._failed_in: set[Any] = set()
        # Each chain run's parent, and the ToolNode runs inside each run (what a failure
        # stopped); per ToolNode run, its calls' arguments by call id and its first try
        # (itself, or the first try of the run it retries); the runs a failure stopped that
        # no retry took yet (in the order they ran), and those a retry took; the ids given,
        # by first try, call id and how many results of that id its run gave before.
        self._parent: dict[Any, Any] = {}
        self._inside: dict[Any, list[Any]] = {}
        self._calls: dict[Any, dict[str, Any]] = {}
        self._first: dict[Any, Any] = {}
        self._stopped: dict[Any, None] = {}
        self._retried: set[Any] = set()
        self._ids: dict[tuple[Any, str, int], str] = {}
        # How many results each run gave each call id (see `_id_for`).
        self._results_given: dict[tuple[Any, str], int] = {}
        # Each ToolNode run's task (its checkpoint namespace): the run resumed after an
        # interrupt runs that task again, under another handler (see `_id_for`).
        self._task: dict[Any, str] = {}

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: Any,
                       parent_run_id: Any = None, **kwargs: Any) -> None:
        if parent_run_id is not None:
            self._parent[run_id] = parent_run_id

    def on_tool_start(self, serialized: Any, input_str: str, *, run_id: Any,
                      parent_run_id: Any = None, inputs: Any = None,
                      tool_call_id: str | None = None, metadata: dict[str, Any] | None = None,
                      **kwargs: Any) -> None:
        if parent_run_id is None or not isinstance(tool_call_id, str):
            return
        calls = self._calls.get(parent_run_id)
        if calls is None:
            calls = self._calls[parent_run_id] = {}
            self._first[parent_run_id] = parent_run_id
            task = (metadata or {}).get("langgraph_checkpoint_ns")
            if isinstance(task, str) and task:
                self._task[parent_run_id] = task
            run: Any = parent_run_id
            for _ in range(1000):  # (a bound: parents recorded by LangChain form no cycle)
                self._inside.setdefault(run, []).append(parent_run_id)
                run = self._parent.get(run)
                if run is None:
                    break
            for stopped in self._stopped:
                earlier = self._calls[stopped]
                if tool_call_id in earlier and earlier[tool_call_id] == inputs:
                    del self._stopped[stopped]
                    self._retried.add(stopped)
                    self._first[parent_run_id] = self._first[stopped]
                    break
        calls[tool_call_id] = inputs

    def on_tool_error(self, error: BaseException, *, run_id: Any, parent_run_id: Any = None,
                      **kwargs: Any) -> None:
        if parent_run_id is not None:
            self._failed_in.add(parent_run_id)

    def on_chain_end(self, outputs: Any, *, run_id: Any, **kwargs: Any) -> None:
        # (only runs still going are looked up: an ended one's entries go)
        self._parent.pop(run_id, None)
        self._inside.pop(run_id, None)
        if self._failed_in and run_id in self._failed_in:
            self._failed_in.discard(run_id)
            self.on_tool_end(outputs, parent_run_id=run_id)

    def on_chain_error(self, error: BaseException, *, run_id: Any, **kwargs: Any) -> None:
        self._failed_in.discard(run_id)
        self._parent.pop(run_id, None)
        inside = self._inside.pop(run_id, ())
        if isinstance(error, GraphBubbleUp):
            return  # an interrupt or a Command to the parent graph: no failure, no retry
        for run in inside:
            if run not in self._stopped and run not in self._retried:
                self._stopped[run] = None

    def on_tool_end(self, output: Any, *, parent_run_id: Any = None, **kwargs: Any) -> None:
        for result in _tool_results(output):
            if isinstance(result, ToolMessage) and not result.id:
                result.id = self._id_for(result.tool_call_id, parent_run_id)
            elif isinstance(result, dict) and result.get("tool_call_id") \
                    and result.get("type", result.get("role")) == "tool" \
                    and not result.get("id"):
                result["id"] = self._id_for(str(result["tool_call_id"]), parent_run_id)

    def _id_for(self, call_id: str, run: Any) -> str:
        if run is None:
            return str(uuid.uuid4())
        first = self._first.get(run, run)
        # A call id this run answered before is another call of that id (a model giving one
        # id to two calls of a message; a node's own loop reusing `call_0` each turn): the
        # same id would have the checkpoint keep one of the two results.
        given_before = self._results_given.get((run, call_id), 0)
        self._results_given[(run, call_id)] = given_before + 1
        key = (first, call_id, given_before)
        given = self._ids.get(key)
        if given is None:
            # Of the first try's task and the call: a ToolNode interrupted (one of its tools
            # asked the user) runs again when the run is resumed, in the same task, and a
            # sibling's result the client was given before keeps its id.
            task = self._task.get(first)
            name = f"{task}\n{call_id}" + (f"\n{given_before}" if given_before else "")
            given = self._ids[key] = str(
                uuid.uuid5(_TOOL_RESULT_IDS, name) if task is not None else uuid.uuid4())
        return given


def _tool_results(output: Any) -> list[Any]:
    """The messages a tool or a ToolNode returned: a message, a `Command`'s update, a node's
    `{"messages": [...]}`, or a list of those."""
    if isinstance(output, (list, tuple)):
        return [m for item in output for m in _tool_results(item)]
    if isinstance(output, Command):
        output = output.update
        if isinstance(output, (list, tuple)):
            return list(output)
    if isinstance(output, dict) and "messages" in output:
        messages = output["messages"]
        return list(messages) if isinstance(messages, (list, tuple)) else [messages]
    return [output]


def _with_tool_message_ids(config: Any) -> dict[str, Any]:
    """`config` (a run's RunnableConfig, or None) with `_ToolMessageIds` among the callbacks
    every node and tool of the graph, its subgraphs' included, inherits."""
    out: dict[str, Any] = dict(config or {})
    callbacks = out.get("callbacks")
    if callbacks is None:
        out["callbacks"] = [_ToolMessageIds()]
    elif isinstance(callbacks, list):
        out["callbacks"] = [*callbacks, _ToolMessageIds()]
    else:  # a callback manager: a copy, the caller's stays as it was
        manager = callbacks.copy()
        manager.add_handler(_ToolMessageIds(), inherit=True)
        out["callbacks"] = manager
    return out


def _refuse_message_while_waiting(input: RunAgentInput, agent_state: Any,
                                  interrupts: Any) -> None:
    """Raise if `input` brings a new user message (after the last one the checkpoint
    holds) while the graph waits on an interrupt: the graph cannot take the message before
    the answer, and ag-ui-langgraph would drop it, announcing the interrupt again, or, with
    the answer in the same request, resuming with the answer alone (the message lost, the
    run a success)."""
    if not interrupts:
        return
    command = (input.forwarded_props or {}).get("command")
    answering = bool(input.resume) or (
        isinstance(command, dict) and command.get("resume") is not None)
    values = getattr(agent_state, "values", None)
    known = {getattr(m, "id", None)
             for m in (values.get("messages") or () if isinstance(values, Mapping) else ())}
    sent = list(input.messages or ())
    # New: after the last message the checkpoint knows. Those before it that it lacks are
    # ones the graph removed (`RemoveMessage`: trimmed, summarised), which clients that
    # send their whole chat (the 1.10 client does, with every answer) still hold.
    last_known = max((i for i, m in enumerate(sent) if m.id in known), default=-1)
    new = [m for m in sent[last_known + 1:] if m.role == "user" and m.id not in known]
    if new:
        if answering:
            if not any(_says_something(m.content) for m in new):
                return  # (clients send an empty user message with an answer: nothing is lost)
            raise ApprovalError(
                f"Thread '{input.thread_id}' takes the answer alone: send the new message "
                "after it (the answer and the message were not sent to the agent)")
        raise ApprovalError(
            f"Thread '{input.thread_id}' waits for an answer to {len(interrupts)} pending "
            "interrupt(s): answer first, then send the message (it was not sent to the "
            "agent)")


async def _stopped_at_breakpoint(graph: Any, snapshot: Any, config: Any) -> bool:
    """Whether the checkpoint `snapshot` (`graph.aget_state(config)`) is where LangGraph
    stopped `graph` at a breakpoint its author compiled in, its own or a subgraph's.

    A graph not compiled here (the platform's) does not say where it breaks: no."""
    if not isinstance(graph, Pregel) or not getattr(snapshot, "next", None):
        return False
    if not (_has_breakpoints(graph) or any(True for _ in graph.get_subgraphs())):
        return False  # (the common case: no checkpoint read)
    return await _breaks_at(graph, graph, await graph.aget_state(config, subgraphs=True))


def _has_breakpoints(graph: Pregel[Any, Any, Any, Any]) -> bool:
    return bool(graph.interrupt_before_nodes or graph.interrupt_after_nodes)


async def _breaks_at(root: Pregel[Any, Any, Any, Any], graph: Pregel[Any, Any, Any, Any],
                    snapshot: StateSnapshot) -> bool:
    """`_stopped_at_breakpoint` for `graph`, `snapshot` its checkpoint (with its subgraphs'),
    read through `root`, which finds a subgraph's checkpoint by its namespace."""
    if _names_breakpoint(graph.interrupt_before_nodes, snapshot.next):
        return True  # before a node of the coming step
    if graph.interrupt_after_nodes and (snapshot.metadata or {}).get("source") == "loop" \
            and snapshot.parent_config is not None:
        # After a step (a "loop" checkpoint is saved by one): its nodes were the parent
        # checkpoint's `next`.
        previous = await root.aget_state(snapshot.parent_config)
        if _names_breakpoint(graph.interrupt_after_nodes, previous.next):
            return True
    subgraphs = dict(graph.get_subgraphs())
    for task in snapshot.tasks:
        inner = subgraphs.get(task.name)
        if isinstance(inner, Pregel) and isinstance(task.state, StateSnapshot) \
                and task.state.next and await _breaks_at(root, inner, task.state):
            return True
    return False


def _names_breakpoint(breakpoints: Any, nodes: Sequence[str]) -> bool:
    """Whether `nodes` include one of `breakpoints` ("*": any node but LangGraph's own)."""
    if breakpoints == "*":
        return any(not node.startswith("__") for node in nodes)
    return any(node in breakpoints for node in nodes)


def _command_writes(event: Mapping[str, Any]) -> dict[str, Any] | None:
    """The state keys a `Command` that ends a chain (`on_chain_end`: a node's) writes to
    its own graph, as the dict a node would return, or None for other events and for a
    `Command` to the parent graph or with an update of another shape (a state object)."""
    if event.get("event") != "on_chain_end":
        return None
    command = (event.get("data") or {}).get("output")
    if not isinstance(command, Command) or command.graph is not None:
        return None
    update = command.update
    if isinstance(update, dict):
        return dict(update)
    if isinstance(update, (list, tuple)) and all(
            isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
            for pair in update):
        return dict(update)
    return None


def _says_something(content: Any) -> bool:
    return bool(content.strip()) if isinstance(content, str) else bool(content)


def _root_values(event: Mapping[str, Any]) -> dict[str, Any] | None:
    """The root graph's state, if `event` carries its "values" (after each superstep)."""
    if event.get("parent_ids"):
        return None
    chunk = (event.get("data") or {}).get("chunk")
    if isinstance(chunk, tuple) and len(chunk) in (2, 3) and chunk[-2] == "values" \
            and (len(chunk) == 2 or chunk[0] == ()) and isinstance(chunk[-1], dict):
        return chunk[-1]
    return None


def _stream_writer_chunk(event: Mapping[str, Any]) -> tuple[Any] | None:
    """What a node wrote with `get_stream_writer()`, if `event` carries it (one-tuple):
    the root graph's `on_chain_stream` in the "custom" mode, `(mode, value)`, or
    `(namespace, mode, value)` when subgraphs stream."""
    if event.get("event") != "on_chain_stream" or event.get("parent_ids"):
        return None
    chunk = (event.get("data") or {}).get("chunk")
    if isinstance(chunk, tuple) and len(chunk) in (2, 3) and chunk[-2] == "custom":
        return (chunk[-1],)
    return None


def _safe_interrupts(lg_interrupts: Any) -> list[Any]:
    """Interrupts whose payloads are JSON (`json_safe`): the base encodes them with a
    function that fails on keys that are not text, every run of the thread over again."""
    return [dataclasses.replace(i, value=json_safe(i.value)) if isinstance(i, Interrupt) else i
            for i in lg_interrupts or ()]


def _liftable(interrupt: Any) -> tuple[Any, dict[str, Any]]:
    """`interrupt` without the fields the base would lift into AG-UI's Interrupt that are
    not of the type it gives them (they failed its model: the run ended in error while the
    graph waited on the interrupt, every run of the thread over again), and the original
    values of the fields changed. A deadline in epoch seconds is lifted as its ISO time."""
    value = getattr(interrupt, "value", None)
    if not isinstance(interrupt, Interrupt) or not isinstance(value, dict):
        return interrupt, {}
    kept: dict[str, Any] = {}
    lifted = dict(value)
    for key, kind in _LIFTED_FIELDS.items():
        field = value.get(key)
        if field is None or isinstance(field, kind):
            continue
        if kind is str and key in ("expiresAt", "expires_at"):
            seconds = parse_time(field)
            if seconds is not None:
                lifted[key], kept[key] = iso_time(seconds), field
                continue
        kept[key] = field
        del lifted[key]
        _log.warning("an interrupt's field is not of the type AG-UI gives it: it stays in "
                     "the interrupt's value, not lifted" + (
                         " (the interrupt has no deadline)" if kind is str
                         and key in ("expiresAt", "expires_at") else ""),
                     field=key, interrupt_id=interrupt.id)
    if not kept:
        return interrupt, {}
    return dataclasses.replace(interrupt, value=lifted), kept


def _model_run(event: Mapping[str, Any]) -> str | None:
    """The model call a model event comes from (its LangChain run id, one per call: per
    `Send` worker, per parallel node, per concurrent call inside one node), or None for
    other events."""
    if not str(event.get("event") or "").startswith("on_chat_model"):
        return None
    run_id = event.get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def _first_chunk_arguments(event: Mapping[str, Any]) -> str | None:
    """The arguments a model's stream chunk carries with the name of the tool call it
    starts (what the base reads as a call's start), or None."""
    if event.get("event") != "on_chat_model_stream":
        return None
    chunks = _tool_call_chunks(event)
    if not chunks or not _get(chunks[0], "name"):
        return None
    args = _get(chunks[0], "args")
    return args if isinstance(args, str) and args else None


def _check_client_input(input: RunAgentInput) -> None:
    """Refuse what the client sent that the base would crash on (as a generic failure,
    its stack logged, on every run of the thread), saying what is wrong."""
    state = input.state
    if isinstance(state, dict) and "copilotkit" in state \
            and not isinstance(state["copilotkit"], dict):
        raise InvalidRequestError("state.copilotkit must be a JSON object (CopilotKit "
                                  "writes the frontend's actions and context into it)")
    if isinstance(state, dict) and state.get("tools") is not None and not (
            isinstance(state["tools"], list)
            and all(isinstance(t, dict) for t in state["tools"])):
        raise InvalidRequestError("state.tools must be a list of JSON objects (the "
                                  "frontend's tools, which the agent's are added to)")
    forwarded = input.forwarded_props if isinstance(input.forwarded_props, dict) else {}
    for key in ("nodeName", "node_name"):
        if forwarded.get(key) is not None and not isinstance(forwarded[key], str):
            raise InvalidRequestError(f"{key} must be a string (the graph node to go on "
                                      "from)")
    for message in input.messages or ():
        for call in getattr(message, "tool_calls", None) or ():
            arguments = call.function.arguments
            if not arguments:
                continue
            try:
                parsed = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                continue  # (the base reads unparseable arguments as none: a stopped stream)
            if not isinstance(parsed, dict):
                raise InvalidRequestError(
                    f"Message '{message.id}': the arguments of tool call '{call.id}' must "
                    "be a JSON object")


def _check_schema_fit(graph: Any, input: RunAgentInput, saved: Any) -> None:
    """Refuse a client's value (its `state`, or a `forwardedProps` entry, which the base
    merges into the graph's input) that the graph's pydantic state schema refuses.

    LangGraph validates a pydantic state only when a node reads it, after it checkpointed
    the input: that run failed, and so did every later one of the thread, each reading it
    back. A TypedDict state is not validated by LangGraph, nor here. A key with a reducer
    is checked as the reducer would leave it."""
    models = _pydantic_schemas(graph)
    if not models:
        return
    channels = getattr(graph, "channels", None) or {}
    saved = saved if isinstance(saved, Mapping) else {}
    forwarded = input.forwarded_props if isinstance(input.forwarded_props, dict) else {}
    given = [("state", key, key, value) for key, value in (input.state or {}).items()]
    given += [("forwardedProps", key, camel_to_snake(key), value)
              for key, value in forwarded.items()]
    for where, named, key, value in given:
        if key == "messages" or not isinstance(key, str):
            continue  # (the base puts the checkpoint's messages and the client's there)
        for model in models:
            field = model.model_fields.get(key)
            if field is None or _reshaped_by_validators(model, key):
                continue
            candidate = value
            reducer = getattr(channels.get(key), "operator", None)
            if callable(reducer) and key not in saved and field.is_required():
                continue  # (what it starts from is the reducer's business)
            try:
                if callable(reducer):
                    current = saved[key] if key in saved else field.get_default(
                        call_default_factory=True)
                    candidate = reducer(current, value)
                _field_adapter(model, key).validate_python(candidate)
            except pydantic.ValidationError as exc:
                reason = exc.errors()[0]["msg"] if exc.errors() else "refused"
                raise InvalidRequestError(
                    f"{where}.{named} does not fit the agent's state schema "
                    f"({model.__name__}.{key}: {reason})") from None
            except Exception:
                raise InvalidRequestError(
                    f"{where}.{named} does not fit the agent's state schema "
                    f"({model.__name__}.{key}: its reducer refuses it)") from None


def _pydantic_schemas(graph: Any) -> list[type[pydantic.BaseModel]]:
    """The pydantic models among a compiled graph's state schemas (its nodes' included)."""
    schemas = getattr(getattr(graph, "builder", None), "schemas", None)
    return [schema for schema in schemas or () if isinstance(schema, type)
            and issubclass(schema, pydantic.BaseModel)] if isinstance(schemas, dict) else []


@functools.lru_cache(maxsize=1024)
def _reshaped_by_validators(model: type[pydantic.BaseModel], key: str) -> bool:
    """Whether the model's own validators may reshape field `key`'s input before its type
    is checked (a field validator of mode before, wrap or plain; a model validator of mode
    before or wrap): then a value its type alone refuses may be taken, so it is not judged
    here (the graph judges it)."""
    decorators = model.__pydantic_decorators__
    if any(d.info.mode in ("before", "wrap") for d in decorators.model_validators.values()):
        return True
    return any(d.info.mode in ("before", "wrap", "plain")
               and (key in d.info.fields or "*" in d.info.fields)
               for d in decorators.field_validators.values())


@functools.lru_cache(maxsize=1024)
def _field_adapter(model: type[pydantic.BaseModel], key: str) -> pydantic.TypeAdapter[Any]:
    """A validator of `model`'s field `key`, its constraints included (`Field(gt=0)`)."""
    field = model.model_fields[key]
    annotation: Any = field.annotation
    if field.metadata:
        annotation = Annotated[(annotation, *field.metadata)]
    return pydantic.TypeAdapter(annotation)


def _without_answered_results(messages: Sequence[Any], saved: Any) -> list[Any]:
    """The client's `messages` less its tool results for calls the checkpoint (`saved`, its
    LangChain messages) already holds a result for: under another id (a 1.10 client keeps a
    streamed result as `result-<callId>` when no final agent state followed: a failed or
    stopped run), the base took one for a new message and appended it after the
    conversation, a result answering no call, which the model refuses on every later run.
    Placeholders LangGraph wrote for orphan calls stay answerable (the base repairs them)."""
    answered = {m.tool_call_id for m in saved or () if isinstance(m, ToolMessage)
                and not _is_orphan_placeholder(m)}
    if not answered:
        return list(messages)
    known = {m.id for m in saved or ()}
    return [m for m in messages if not (isinstance(m, ToolMessage) and m.id not in known
                                        and m.tool_call_id in answered)]


def _results_in_place(saved: Any, new: Any) -> list[Any] | None:
    """The checkpoint's messages (`saved`) with the base's `new` ones for the graph, each
    tool result for a call of the checkpoint that other messages follow put right after
    that call (and its results); None when no result needs that (all go at the end)."""
    if not saved or not new:
        return None
    saved, new = list(saved), list(new)
    holders = {call.get("id"): index for index, message in enumerate(saved)
               if isinstance(message, AIMessage) for call in message.tool_calls}
    known = {message.id for message in saved}
    misplaced = [m for m in new if isinstance(m, ToolMessage) and m.id not in known
                 and m.tool_call_id in holders and any(
                     not isinstance(later, ToolMessage)
                     for later in saved[holders[m.tool_call_id] + 1:])]
    if not misplaced:
        return None
    replaced = {m.id: m for m in new if m.id in known}  # (the base's repairs, in place)
    placed = [replaced.get(m.id, m) for m in saved]
    for result in misplaced:
        at = next(index for index in range(len(placed) - 1, -1, -1)
                  if isinstance(placed[index], AIMessage) and any(
                      call.get("id") == result.tool_call_id
                      for call in placed[index].tool_calls)) + 1
        while at < len(placed) and isinstance(placed[at], ToolMessage):
            at += 1
        placed.insert(at, result)
    moved = {id(m) for m in misplaced}
    placed.extend(m for m in new if m.id not in known and id(m) not in moved)
    return placed


def _rewrites_messages(messages: Any) -> bool:
    """Whether `messages` is the conversation written anew (`_results_in_place`)."""
    return isinstance(messages, list) and bool(messages) and isinstance(
        messages[0], RemoveMessage) and messages[0].id == REMOVE_ALL_MESSAGES


def _is_orphan_placeholder(message: ToolMessage) -> bool:
    return isinstance(message.content, str) and bool(
        _BaseBridge._ORPHAN_TOOL_MSG_RE.match(message.content))


def _echoed_keys(given: Any, saved: Any) -> dict[str, Any]:
    """The keys of the client's `given` state that hold the checkpoint's `saved` value as
    the client was shown it (`is_shown`): echoed, not written."""
    if not isinstance(given, dict) or not given or not isinstance(saved, Mapping) or not saved:
        return {}
    return {key: value for key, value in given.items()
            if key not in PLUMBING_STATE_KEYS and key in saved and _echoes(saved[key], value)}


def _echoes(saved: Any, given: Any) -> bool:
    """Whether `given` is `saved` as the client was shown it. The same JSON text first (an
    echo mostly is, and orjson compares megabytes in milliseconds, where `is_shown` walks
    each item in Python): it keeps 1 and true apart as well."""
    try:
        if orjson.dumps(json_safe(saved)) == orjson.dumps(given):
            return True
    except (TypeError, orjson.JSONEncodeError):
        pass  # (an integer beyond 64 bits)
    return is_shown(json_shown(saved), given)


def _get(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, dict) else getattr(item, key, None)


def _tool_call_chunks(event: Mapping[str, Any]) -> list[Any]:
    chunk = (event.get("data") or {}).get("chunk")
    chunks = _get(chunk, "tool_call_chunks") if chunk is not None else None
    return list(chunks or ())


#: Each compiled graph's context keys, read once (None: its context takes any key).
_CONTEXT_KEYS: weakref.WeakKeyDictionary[Any, frozenset[str] | None] = \
    weakref.WeakKeyDictionary()


def _context_keys(graph: Any) -> frozenset[str] | None:
    if graph in _CONTEXT_KEYS:
        return _CONTEXT_KEYS[graph]
    keys = _CONTEXT_KEYS[graph] = context_init_keys(graph.context_schema)
    return keys
