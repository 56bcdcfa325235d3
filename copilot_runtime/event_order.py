"""The order of one run's events, kept once, in the core, for every agent and both edges.

AG-UI clients fail a run whose events break their rules (content only inside an open
message, arguments only inside an open tool call, nothing after the run's end, ...), and
agents produce events in several ways: the built-in agent, LangGraph graphs through their
translator, remote AG-UI servers. Two tools keep every run in order:

* `RunEventOrder` is what the runtime applies to each run, whatever its agent: `*_CHUNK`
  events expanded into START/CONTENT/END (as the clients' own `transformChunks` does),
  empty deltas, a second `RUN_STARTED` and anything after the end dropped, and whatever is
  still open closed before the run ends. It repairs; it never fails a run. The wire edges
  and the thread stores see its output only, so none of them handles chunks.
* `OrderChecker` says what is wrong with an event, for the places that must not repair:
  a remote agent that breaks the rules fails its run with a message naming the mistake
  (`agents.http`), and `testing.verify_events` fails a test. An empty content delta is
  said as `EMPTY_DELTA`: the 1.50 client refuses it, so `verify_events` does, but the
  newer clients take it, so a remote's is dropped rather than failing its run.

The common event (a content or argument delta) costs two comparisons in `RunEventOrder`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from copilot_runtime import events as ev
from copilot_runtime._exceptions import ChunkError
from copilot_runtime.events import Event

__all__ = [
    "EMPTY_DELTA",
    "REQUIRED_FIELDS",
    "ChunkState",
    "OrderChecker",
    "RunEventOrder",
    "expand_chunk",
    "expand_chunks",
]

_CHUNKS: Final = frozenset({ev.TEXT_MESSAGE_CHUNK, ev.TOOL_CALL_CHUNK})
_REASONING: Final = frozenset({ev.REASONING_START, ev.REASONING_END, ev.REASONING_MESSAGE_START,
                               ev.REASONING_MESSAGE_CONTENT, ev.REASONING_MESSAGE_END})
_ENCRYPTED_SUBTYPES: Final = frozenset({"tool-call", "message"})
#: What is opened and ended by id: (the attribute of `RunEventOrder` keeping those open,
#: the id's field, the end's type), in the order `closing_events` ends them.
_ENDS: Final = (("_text", "messageId", ev.TEXT_MESSAGE_END),
                ("_calls", "toolCallId", ev.TOOL_CALL_END),
                ("_reasoning", "messageId", ev.REASONING_MESSAGE_END),
                ("_spans", "messageId", ev.REASONING_END))
#: Each of their starts and ends: (attribute, id field, whether it opens).
_TRACKED: Final[dict[str, tuple[str, str, bool]]] = {
    **{start: (attribute, key, True) for start, (attribute, key, _) in zip(
        (ev.TEXT_MESSAGE_START, ev.TOOL_CALL_START, ev.REASONING_MESSAGE_START,
         ev.REASONING_START), _ENDS, strict=True)},
    **{end: (attribute, key, False) for attribute, key, end in _ENDS},
}
# The string fields each tracked event must carry for the order rules to make sense.
REQUIRED_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    ev.TEXT_MESSAGE_START: ("messageId",),
    ev.TEXT_MESSAGE_CONTENT: ("messageId", "delta"),
    ev.TEXT_MESSAGE_END: ("messageId",),
    ev.TOOL_CALL_START: ("toolCallId", "toolCallName"),
    ev.TOOL_CALL_ARGS: ("toolCallId", "delta"),
    ev.TOOL_CALL_END: ("toolCallId",),
    ev.TOOL_CALL_RESULT: ("messageId", "toolCallId", "content"),
    ev.RUN_ERROR: ("message",),
    ev.STEP_STARTED: ("stepName",),
    ev.STEP_FINISHED: ("stepName",),
    ev.REASONING_START: ("messageId",),
    ev.REASONING_END: ("messageId",),
    ev.REASONING_MESSAGE_START: ("messageId",),
    ev.REASONING_MESSAGE_CONTENT: ("messageId", "delta"),
    ev.REASONING_MESSAGE_END: ("messageId",),
    ev.REASONING_ENCRYPTED_VALUE: ("subtype", "entityId", "encryptedValue"),
}


#: What `OrderChecker.check` says of a TEXT_MESSAGE_CONTENT with an empty delta.
EMPTY_DELTA: Final = "with an empty delta"


class ChunkState:
    """Which message and tool call the `*_CHUNK` events of a run are filling."""

    __slots__ = ("call", "text")

    def __init__(self) -> None:
        self.text: str | None = None
        self.call: str | None = None

    def close(self, next_event: Event | None, out: list[Event]) -> None:
        """End a chunked message or call when another kind of event follows it."""
        if self.text is not None:
            if not (next_event is not None and next_event["type"] == ev.TEXT_MESSAGE_END
                    and next_event.get("messageId") == self.text):
                out.append(ev.text_message_end(self.text))
            self.text = None
        if self.call is not None:
            if not (next_event is not None and next_event["type"] == ev.TOOL_CALL_END
                    and next_event.get("toolCallId") == self.call):
                out.append(ev.tool_call_end(self.call))
            self.call = None


def expand_chunk(event: Event, chunks: ChunkState, out: list[Event]) -> None:
    """One `*_CHUNK` event as the START/CONTENT (or ARGS) events it stands for."""
    if event["type"] == ev.TEXT_MESSAGE_CHUNK:
        message_id = event.get("messageId") or chunks.text
        if not isinstance(message_id, str):
            raise ChunkError("a first TEXT_MESSAGE_CHUNK without a messageId")
        if message_id != chunks.text:
            chunks.close(None, out)
            out.append(ev.text_message_start(message_id, event.get("role") or "assistant"))
            chunks.text = message_id
        if event.get("delta"):
            out.append(ev.text_message_content(message_id, event["delta"]))
        return
    call_id = event.get("toolCallId") or chunks.call
    if not isinstance(call_id, str):
        raise ChunkError("a first TOOL_CALL_CHUNK without a toolCallId")
    if call_id != chunks.call:
        chunks.close(None, out)
        name = event.get("toolCallName")
        if not isinstance(name, str):
            raise ChunkError("a first TOOL_CALL_CHUNK without a toolCallName")
        out.append(ev.tool_call_start(call_id, name, event.get("parentMessageId")))
        chunks.call = call_id
    if event.get("delta"):
        out.append(ev.tool_call_args(call_id, event["delta"]))


def expand_chunks(events: Sequence[Event], chunks: ChunkState) -> list[Event]:
    """`events` with their chunks expanded (and chunked messages closed when others follow)."""
    out: list[Event] = []
    for event in events:
        if event["type"] in _CHUNKS:
            expand_chunk(event, chunks, out)
        else:
            chunks.close(event, out)
            out.append(event)
    return out


class RunEventOrder:
    """Keeps one run's events in the order clients accept, repairing what an agent left.

    `normalize(batch)` returns the batch to send (the same list when nothing changes);
    `closing_events()` the ends of whatever is still open, for a run that ends early.
    """

    __slots__ = ("_calls", "_chunks", "_reasoning", "_spans", "_steps", "_subagents", "_text",
                 "run_id", "terminated", "thread_id")

    def __init__(self, thread_id: str, run_id: str) -> None:
        self.thread_id = thread_id
        self.run_id = run_id
        self.terminated = False
        # What is open now, each with the subagent it belongs to (its `subagentRunId`: the
        # 1.0 client refuses an end charged to another agent than its start).
        self._text: dict[str, str | None] = {}
        self._calls: dict[str, str | None] = {}
        #: Steps by (name, subagent): a subagent's step and the parent's may share a name.
        self._steps: dict[tuple[str, str | None], None] = {}
        #: Reasoning messages and reasoning spans (`REASONING_START`).
        self._reasoning: dict[str, str | None] = {}
        self._spans: dict[str, str | None] = {}
        #: Subagents (`SUBAGENT_STARTED`), in the order they started.
        self._subagents: dict[str, None] = {}
        self._chunks = ChunkState()

    def normalize(self, batch: Sequence[Event]) -> Sequence[Event]:
        return self._pass(batch, self._chunks)

    def _pass(self, batch: Sequence[Event], chunks: ChunkState | None) -> Sequence[Event]:
        """`normalize`; without `chunks` for events that came out of the chunk expansion."""
        out: list[Event] | None = None
        for index, event in enumerate(batch):
            kind = event["type"]
            drop = False
            extra: list[Event] | None = None
            if kind == ev.TEXT_MESSAGE_CONTENT or kind == ev.TOOL_CALL_ARGS:
                if chunks is None or (chunks.text is None and chunks.call is None) \
                        or self.terminated:
                    drop = not event.get("delta")
                else:
                    extra, drop = self._expand(event), True
            elif self.terminated:
                drop = True
            elif chunks is not None and (kind in _CHUNKS or chunks.text is not None
                                         or chunks.call is not None):
                extra, drop = self._expand(event), True
            elif (tracked := _TRACKED.get(kind)) is not None:
                opened: dict[str, str | None] = getattr(self, tracked[0])
                if tracked[2]:
                    opened[event[tracked[1]]] = event.get("subagentRunId")
                else:  # an end: of nothing open, dropped
                    drop = opened.pop(event[tracked[1]], 0) == 0
            elif kind == ev.STEP_STARTED:
                self._steps[str(event.get("stepName", "")), event.get("subagentRunId")] = None
            elif kind == ev.STEP_FINISHED:
                self._steps.pop((str(event.get("stepName", "")), event.get("subagentRunId")),
                                None)
            elif kind == ev.SUBAGENT_STARTED:
                self._subagents[str(event.get("subagentRunId"))] = None
            elif kind == ev.SUBAGENT_FINISHED or kind == ev.SUBAGENT_ERROR:
                drop = self._subagents.pop(str(event.get("subagentRunId")), 0) == 0
            elif kind == ev.RUN_STARTED:
                drop = True  # the runtime already sent the run's RUN_STARTED
            elif kind in ev.TERMINAL_TYPES:
                extra = self.closing_events()
                if kind == ev.RUN_FINISHED and (event.get("threadId") != self.thread_id
                                                or event.get("runId") != self.run_id):
                    event = {**event, "threadId": self.thread_id, "runId": self.run_id}
                    out = list(batch[:index]) if out is None else out
                self.terminated = True
            if drop or extra or out is not None:
                if out is None:
                    out = list(batch[:index])
                if extra:
                    out.extend(extra)
                if not drop:
                    out.append(event)
        return batch if out is None else out

    def _expand(self, event: Event) -> list[Event]:
        """A chunk, or the first event after chunks, through the chunk expansion; the
        expanded events pass through `normalize` so they are tracked like any other."""
        expanded: list[Event] = []
        if event["type"] in _CHUNKS:
            try:
                expand_chunk(event, self._chunks, expanded)
            except ChunkError:
                return []  # a chunk that names nothing to fill: nothing a client could show
        else:
            self._chunks.close(event, expanded)
            expanded.append(event)
        return list(self._pass(expanded, None))

    def closing_events(self) -> list[Event]:
        """The ends of what is open, each charged to the subagent its start was, and then
        the subagents themselves, the last started first."""
        tail = [_of({"type": end, key: opened_id}, sub)
                for attribute, key, end in _ENDS
                for opened_id, sub in getattr(self, attribute).items()]
        tail += [_of(ev.step_finished(name), sub) for name, sub in self._steps]
        tail += [{"type": ev.SUBAGENT_FINISHED, "subagentRunId": sub}
                 for sub in reversed(self._subagents)]
        self._text.clear()
        self._calls.clear()
        self._reasoning.clear()
        self._spans.clear()
        self._steps.clear()
        self._subagents.clear()
        self._chunks.text = self._chunks.call = None
        return tail


def _of(event: Event, subagent: str | None) -> Event:
    """`event`, charged to `subagent` (None: the run's own agent)."""
    if subagent is not None:
        event["subagentRunId"] = subagent
    return event


class OrderChecker:
    """The order rules as checks: `check(event)` says what is wrong with it, or None (the
    answer reads after the event's type: "TEXT_MESSAGE_END for message 'm', which is not
    open").

    Chunks must be expanded first (`expand_chunks`). With `run_started_first`, the events
    must start with `RUN_STARTED` (a whole stream, as `verify_events` sees it); without,
    they are the middle of a run (what a remote agent sends after its own start).
    """

    __slots__ = ("_calls", "_reasoning", "_spans", "_steps", "_subagents", "_text", "finished",
                 "running")

    def __init__(self, *, run_started_first: bool = True) -> None:
        self.running = not run_started_first
        self.finished = False
        self._text: set[str] = set()
        self._calls: set[str] = set()
        #: Steps by (name, subagent), as the 1.0 client keeps them.
        self._steps: set[tuple[str, str | None]] = set()
        self._reasoning: set[str] = set()
        self._spans: set[str] = set()
        self._subagents: set[str] = set()

    @property
    def open(self) -> list[str]:
        steps = sorted(name if sub is None else f"{name} (subagent {sub})"
                       for name, sub in self._steps)
        return (sorted(self._text) + sorted(self._calls) + sorted(self._reasoning)
                + sorted(self._spans) + steps + sorted(self._subagents))

    def check(self, event: Event) -> str | None:
        kind = event.get("type")
        for key in REQUIRED_FIELDS.get(str(kind), ()):
            if not isinstance(event.get(key), str):
                return f"without a string '{key}'"
        if kind == ev.RUN_STARTED:
            if self.running:
                return "while a run is already started"
            self.running, self.finished = True, False
            return None
        if not self.running:
            return "after the run ended" if self.finished else "before RUN_STARTED"
        if kind == ev.TEXT_MESSAGE_START:
            if event["messageId"] in self._text:
                return f"for message '{event['messageId']}', which is already open"
            self._text.add(event["messageId"])
        elif kind == ev.TEXT_MESSAGE_CONTENT or kind == ev.TEXT_MESSAGE_END:
            if event["messageId"] not in self._text:
                return f"for message '{event['messageId']}', which is not open"
            if kind == ev.TEXT_MESSAGE_END:
                self._text.discard(event["messageId"])
            elif not event["delta"]:
                return EMPTY_DELTA
        elif kind == ev.TOOL_CALL_START:
            if event["toolCallId"] in self._calls:
                return f"for tool call '{event['toolCallId']}', which is already open"
            self._calls.add(event["toolCallId"])
        elif kind == ev.TOOL_CALL_ARGS or kind == ev.TOOL_CALL_END:
            if event["toolCallId"] not in self._calls:
                return f"for tool call '{event['toolCallId']}', which is not open"
            if kind == ev.TOOL_CALL_END:
                self._calls.discard(event["toolCallId"])
        elif kind in _REASONING:
            return self._reasoned(kind, event["messageId"])
        elif kind == ev.REASONING_ENCRYPTED_VALUE:
            if event["subtype"] not in _ENCRYPTED_SUBTYPES:  # the 1.0 client's schema refuses it
                return "with a subtype other than 'tool-call' or 'message'"
        elif kind == ev.STEP_STARTED:
            self._steps.add((str(event.get("stepName")), event.get("subagentRunId")))
        elif kind == ev.STEP_FINISHED:
            step = (str(event.get("stepName")), event.get("subagentRunId"))
            if step not in self._steps:
                return f"for step '{event.get('stepName')}', which is not open" + (
                    "" if step[1] is None else f" in subagent '{step[1]}'")
            self._steps.discard(step)
        elif kind == ev.SUBAGENT_STARTED:
            subagent = event.get("subagentRunId")
            if not isinstance(subagent, str) or not isinstance(event.get("name"), str):
                return "without a string 'subagentRunId' and 'name'"
            if subagent in self._subagents:
                return f"for subagent '{subagent}', which is already open"
            self._subagents.add(subagent)
        elif kind == ev.SUBAGENT_FINISHED or kind == ev.SUBAGENT_ERROR:
            subagent = event.get("subagentRunId")
            if subagent not in self._subagents:
                return f"for subagent '{subagent}', which is not open"
            self._subagents.discard(str(subagent))
        elif kind == ev.RUN_FINISHED:
            if self.open:
                return f"while {', '.join(self.open)} are still open"
            self.running, self.finished = False, True
        elif kind == ev.RUN_ERROR:
            self.running, self.finished = False, True
            self._text.clear()
            self._calls.clear()
            self._steps.clear()
            self._reasoning.clear()
            self._spans.clear()
            self._subagents.clear()
        return None

    def _reasoned(self, kind: str, message_id: str) -> str | None:
        """A reasoning span's or reasoning message's event (the 1.0 client checks them)."""
        opened = self._spans if kind in (ev.REASONING_START, ev.REASONING_END) \
            else self._reasoning
        what = "reasoning span" if opened is self._spans else "reasoning message"
        if kind in (ev.REASONING_START, ev.REASONING_MESSAGE_START):
            if message_id in opened:
                return f"for {what} '{message_id}', which is already open"
            opened.add(message_id)
        elif message_id not in opened:
            return f"for {what} '{message_id}', which is not open"
        elif kind != ev.REASONING_MESSAGE_CONTENT:
            opened.discard(message_id)
        return None
