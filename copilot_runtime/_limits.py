"""How deep a request's JSON may nest, and what to do with stored JSON that nests deeper.

orjson reads 1,024 levels but writes only 254, and every later stage re-encodes what a
request carried a few levels deeper than it came (`RUN_STARTED.input` echoes the body one
level down, the thread routes wrap the events two more, a store writes them as one list).
So depth is bounded once, where JSON enters (a body, or JSON text inside a GraphQL
argument), well below what every stage can write: what is accepted can always be streamed,
stored and replayed.

JSON text enters through `decode_json`, which also takes what a JavaScript sender writes
for a string cut inside a character: `JSON.stringify` escapes a lone UTF-16 surrogate
(`"\\ud83d"`), which orjson refuses. Each one is read as U+FFFD, as a Python string
holding a lone surrogate could never be encoded again (not by orjson, a store or an SDK).

Threads stored before this bound (or by an agent that produced something unencodable) are
read through `replayable`, which drops what cannot be encoded instead of failing the read.
"""

from __future__ import annotations

import contextvars
import dataclasses
import gc
import re
from collections.abc import Sequence
from typing import Any

import orjson
import structlog

from copilot_runtime import events as ev
from copilot_runtime._exceptions import JSONTooDeepError, PayloadTooLargeError, UpstreamError
from copilot_runtime.threads.base import ThreadRecord

__all__ = [
    "DEFAULT_MAX_RUN_BYTES",
    "HELD_BOUND",
    "LARGE_JSON",
    "LIVE_RUN_FACTOR",
    "MAX_HELD_BYTES",
    "MAX_JSON_DEPTH",
    "STATE_NOT_STORED",
    "HeldTooLarge",
    "check_json_depth",
    "check_json_text",
    "decode_json",
    "estimated_size",
    "nests_too_deep",
    "readable",
    "replayable",
    "storable",
    "without_lone_surrogates",
]

_log = structlog.get_logger("copilot_runtime.limits")

#: The most containers (objects and arrays) a request's JSON may nest, counting the body.
MAX_JSON_DEPTH = 64
#: JSON text this long (bytes or characters) or longer is decoded with the cyclic garbage
#: collector paused, and a body so long is parsed off the event loop
#: (`_input.parse_json_body_off_loop`): below it, every body is read as it always was.
LARGE_JSON = 256 * 1024
#: The most items a run's input lists together (messages, their content parts and tool
#: calls, tools, context entries): each is validated, and each invalid one costs pydantic
#: a detailed error (an 8 MiB body of 2.8 million `{}` messages held the loop ~40 s).
MAX_INPUT_ITEMS = 20_000
#: The most bytes (as encoded JSON) one run keeps in a thread store.
DEFAULT_MAX_RUN_BYTES = 16 * 1024 * 1024
#: A running run keeps its events (for its followers' replay and its store) up to this many
#: times `max_run_bytes` (as `estimated_size` counts them); past that it is stopped.
LIVE_RUN_FACTOR = 4
#: The most (in characters) a model's answer may hold that no event carries: reasoning a
#: client is not shown, thinking signatures, a tool call's arguments before its name. The
#: bound of a running run counts only the events it sent: without this one, a stream that
#: never ends filled the memory unseen. As much as that bound is by default.
MAX_HELD_BYTES = LIVE_RUN_FACTOR * DEFAULT_MAX_RUN_BYTES
#: That bound for the run being driven: the runtime's bound of a running run (`LIVE_RUN_FACTOR`
#: times its `max_run_bytes`), set around each run (`ActiveRun.drive`); `MAX_HELD_BYTES`
#: outside any.
HELD_BOUND: contextvars.ContextVar[int] = contextvars.ContextVar(
    "copilot_runtime.held_bound", default=MAX_HELD_BYTES)
#: What a token adds to its text as JSON: its keys, type name, a short id and punctuation.
_EVENT_OVERHEAD = 64
#: The keys of a token event (`type`, its id, `delta`); one with more is weighed whole.
_TOKEN_KEYS = 3
#: ASCII: one character beyond Latin-1 makes CPython hold a whole string at 2 bytes each.
_TRUNCATED = "...[truncated]"
#: The shortest length a cut leaves a string (shorter ones are never cut).
_MIN_CUT = 256
#: The one key of the state a stored run has in place of one too large to store (its value
#: tells how many bytes it took): what a replay, and the thread's state, then show.
STATE_NOT_STORED = "copilot_runtime.state_not_stored"


class HeldTooLarge(UpstreamError):
    """A model's answer held more than `MAX_HELD_BYTES` that no event carries: the run ends
    as one whose events passed the bound of a running run does."""

    code = PayloadTooLargeError.code

    def __init__(self, what: str, bound: int) -> None:
        super().__init__(f"The run was stopped: the model's {what} passed {bound} "
                         "bytes, the most a running run keeps")


# The run-level events whose identity fields a client needs even when their payload is lost.
_KEEP_FIELDS = {
    "RUN_STARTED": ("type", "threadId", "runId", "parentRunId", "timestamp"),
    "RUN_FINISHED": ("type", "threadId", "runId", "timestamp"),
    "RUN_ERROR": ("type", "message", "code", "timestamp"),
}


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if `value` nests more than `limit` containers deep (iterative: no recursion)."""
    if not isinstance(value, dict | list):
        return False
    # Two stacks, not one of (container, depth) pairs: a pair is an object the collector
    # counts, and millions of them set off full collections (each ~0.5 s, holding the GIL
    # in a thread too) over a body of millions of containers; small ints are shared.
    containers: list[Any] = [value]
    depths = [1]
    while containers:
        container = containers.pop()
        depth = depths.pop()
        if depth > limit:
            return True
        for child in container.values() if isinstance(container, dict) else container:
            if isinstance(child, dict | list):
                containers.append(child)
                depths.append(depth + 1)
    return False


def nests_too_deep(data: Any, text: bytes | str) -> bool:
    """True if `data` (decoded from `text`) nests deeper than `MAX_JSON_DEPTH`.

    A text with fewer opening brackets than the limit cannot nest deeper (the common
    case, decided at C speed); only the rest is walked.
    """
    if isinstance(text, str):
        count = text.count("{") + text.count("[")
    else:
        count = text.count(b"{") + text.count(b"[")
    return count > MAX_JSON_DEPTH and too_deep(data)


def check_json_depth(data: Any, text: bytes | str, what: str = "The request body") -> None:
    """Raise `JSONTooDeepError` if `data` (decoded from `text`) nests too deep."""
    if nests_too_deep(data, text):
        raise JSONTooDeepError(what, MAX_JSON_DEPTH)


# Any escaped surrogate: a cheap test of whether a failed text is worth the slow path.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# With escaped backslashes set aside, every backslash left starts an escape: a high half
# not followed by a low one is lone, and then so is a low half not right after a high one.
_LONE_HIGH = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")
# (Each pattern starts with its literal backslash, which the regex engine scans for fast.)
_LONE_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                       rb"(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})")
# Stands for an escaped backslash while the halves are matched. A raw NUL is never valid
# JSON, so a text holding one is refused as it is, never rewritten.
_SET_ASIDE = b"\x00\x00"


def without_lone_surrogates(text: bytes | str) -> bytes | None:
    """`text` with each escaped lone surrogate written as `\\ufffd` (the same length, so
    error positions hold); None when there is nothing to rewrite. (Also for JSON another
    reader refuses over one: pydantic's, an MCP server's answer.) Linear: a few passes of
    the regex engine and `bytes.replace`, whatever the text."""
    if isinstance(text, str):
        try:
            text = text.encode()
        except UnicodeEncodeError:  # holds a surrogate itself, not escaped: refused as is
            return None
    if _SURROGATE_ESCAPE.search(text) is None or _SET_ASIDE[:1] in text:
        return None
    # `replace` pairs backslashes from the left, as a JSON reader does: in `\\\\ud83d`
    # the first two are one backslash and "ud83d" is plain text.
    text = text.replace(b"\\\\", _SET_ASIDE)
    text = _LONE_HIGH.sub(rb"\\ufffd", text)
    text = _LONE_LOW.sub(rb"\\ufffd", text)
    return text.replace(_SET_ASIDE, b"\\\\")


#: What UTF-8 bytes may start with, and Fetch's `Request.json()` (the TypeScript runtime's)
#: drops as it decodes them; orjson refuses it. (A `str` was decoded already: kept.)
_BYTE_ORDER_MARK = b"\xef\xbb\xbf"


def decode_json(text: bytes | str) -> Any:
    """`orjson.loads(text)`, skipping one leading UTF-8 byte order mark and reading each
    escaped lone surrogate as U+FFFD.

    orjson runs first; only text it refuses that holds an escaped surrogate is rewritten
    and read by orjson again: its own bounds, and its refusal of raw invalid UTF-8, stay.
    Raises `orjson.JSONDecodeError` for malformed text, like `orjson.loads`.
    """
    if isinstance(text, bytes) and text.startswith(_BYTE_ORDER_MARK):
        text = text[3:]  # (rare: the copy is fine)
    try:
        return _loads(text)
    except orjson.JSONDecodeError:
        rewritten = without_lone_surrogates(text)
        if rewritten is None:
            raise
    return _loads(rewritten)


def _loads(text: bytes | str) -> Any:
    if len(text) < LARGE_JSON or not gc.isenabled():
        return orjson.loads(text)
    # Each container orjson makes counts towards a collection, which then walks all made
    # so far: 8 MiB of `[],` (2.8 million lists) took ~3 s, ~0.6 s with the collector off.
    # orjson holds the GIL throughout, so no other code runs meanwhile; the lists are
    # collected as any others once it is back on.
    gc.disable()
    try:
        return orjson.loads(text)
    finally:
        gc.enable()


def check_json_text(text: str | bytes, what: str) -> Any:
    """Decode JSON text found inside a request, holding it to the same depth bound.

    Raises `orjson.JSONDecodeError` for malformed text, like `orjson.loads`.
    """
    value = decode_json(text)
    check_json_depth(value, text, what)
    return value


def replayable(events: Sequence[Any]) -> list[Any]:
    """`events` as they can be encoded: an event that cannot be is reduced or left out.

    A run-level event keeps its identity (a client needs every run's start and end); any
    other unencodable event (a state snapshot, a custom value) is dropped and logged.
    Costs one encoding of the list when everything is fine.
    """
    try:
        orjson.dumps(events)
    except (orjson.JSONEncodeError, TypeError):
        pass
    else:
        return list(events)
    out: list[Any] = []
    for event in events:
        try:
            orjson.dumps(event)
        except (orjson.JSONEncodeError, TypeError):
            kind = event.get("type") if isinstance(event, dict) else None
            keep = _KEEP_FIELDS.get(kind) if isinstance(kind, str) else None
            _log.warning("dropped an event that cannot be encoded", type=kind,
                         reduced=keep is not None)
            if keep is not None:
                out.append(_reduced(event))
        else:
            out.append(event)
    return out


def readable(record: ThreadRecord) -> ThreadRecord:
    """`record` with every run `replayable`, and without a kept state that cannot be
    encoded: the same object when nothing needed fixing."""
    try:
        orjson.dumps([[run.events for run in record.runs], record.kept_state])
    except (orjson.JSONEncodeError, TypeError):
        pass
    else:
        return record
    _log.warning("thread holds events that cannot be encoded", thread_id=record.thread_id)
    runs = [dataclasses.replace(run, events=replayable(run.events)) for run in record.runs]
    try:
        orjson.dumps(record.kept_state)
    except (orjson.JSONEncodeError, TypeError):
        return dataclasses.replace(record, runs=runs, kept_state=None)
    return dataclasses.replace(record, runs=runs)


def estimated_size(events: Sequence[dict[str, Any]]) -> int:
    """About how many bytes `events` take as JSON, cheaply: a token (text, a tool call's
    arguments, reasoning) counts its `delta`'s length, at a few tens of nanoseconds, as
    thousands come a second; any other event its strings' lengths, and the encoded size of
    what it holds in a container (a snapshot, a patch, a CUSTOM's value)."""
    size = len(events) * _EVENT_OVERHEAD
    for event in events:
        delta = event.get("delta")
        # A token has its type, an id and its delta; one with more (a remote's `rawEvent`)
        # is weighed whole, or its extras would be kept unweighed.
        if delta.__class__ is str and len(event) <= _TOKEN_KEYS:
            size += len(delta)
        else:
            size += _values_size(event)
    return size


def _values_size(event: dict[str, Any]) -> int:
    size = 0
    for value in event.values():
        kind = value.__class__
        if kind is str:
            size += len(value)
        elif kind is dict or kind is list:
            size += _encoded_size(value)
    return size


def _encoded_size(value: Any) -> int:
    try:
        return len(orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS))
    except TypeError:  # (orjson.JSONEncodeError) dropped from the stream and the store
        return 0


def storable(events: list[Any], max_bytes: int) -> tuple[list[Any], int]:
    """A run's events as a store may keep them, and their size as encoded JSON.

    What cannot be encoded is reduced (`replayable`); a run over `max_bytes` is cut
    (`_cut`): what the thread shows (its messages) is kept. Either way the run stays
    replayable, and a cut is logged. Costs one encoding when the run is fine; a cut costs a
    few more, and Python walks of what is left: a caller on the event loop runs this in a
    thread when the run may be large.
    """
    try:
        size = len(orjson.dumps(events))
    except (orjson.JSONEncodeError, TypeError):
        events = replayable(events)
        size = len(orjson.dumps(events))
    if size <= max_bytes:
        return events, size
    cut, stored = _cut(events, max_bytes)
    _log.warning("run over the byte limit stored cut", bytes=size, stored=stored,
                 limit=max_bytes)
    return cut, stored


class _Sized:
    """A run's events, each with its encoded size: a change re-encodes one event only."""

    def __init__(self, events: list[Any]) -> None:
        self.events: list[Any] = list(events)
        self.sizes = [len(orjson.dumps(event)) for event in self.events]
        # The list's: its brackets and commas are one byte an event, and one.
        self.total = sum(self.sizes) + len(self.sizes) + 1

    def set(self, index: int, event: Any) -> None:
        """Put `event` (None: no event, left out at the end) in place of the one at `index`."""
        # An event counts its size and its comma; a slot left empty counts neither (an
        # event put back into one adds both).
        before = 0 if self.events[index] is None else self.sizes[index] + 1
        self.events[index] = event
        self.sizes[index] = 0 if event is None else len(orjson.dumps(event))
        self.total += (0 if event is None else self.sizes[index] + 1) - before


def _cut(events: list[Any], max_bytes: int) -> tuple[list[Any], int]:
    """`events` (encodable, over `max_bytes`) brought under it, the bulk first, the thread's
    messages last: the state the client sent with the run (`RUN_STARTED.input.state`, which
    the thread never shows), then its state snapshots and deltas (each replaced by a
    snapshot of `STATE_NOT_STORED`, the largest first), then its events that carry no
    message (the largest first, a step's start and end together, as many as it takes), then
    its longest strings (never an id or a name), cut to one length measured to cover what
    is still over, the smallest of those events put back if a little more cut makes room;
    then, the largest first, as many of its activity messages as the cut needs gone. Only
    if all that is not enough, its run-level events alone (`_cut_strings_to_fit`)."""
    run = _Sized(events)
    for index, event in enumerate(run.events):
        if run.total <= max_bytes:
            return run.events, run.total
        if isinstance(event, dict) and event.get("type") == "RUN_STARTED" \
                and isinstance(event.get("input"), dict) and event["input"].get("state"):
            run.set(index, {**event, "input": {**event["input"], "state": {}}})
    for index in _largest_first(run, _STATE_TYPES):
        if run.total <= max_bytes:
            return run.events, run.total
        run.set(index, _state_not_stored(run.sizes[index]))
    dropped: list[list[tuple[int, Any, int]]] = []  # each unit's (index, event, size)
    for unit in _droppable(run):
        if run.total <= max_bytes:
            return [e for e in run.events if e is not None], run.total
        dropped.append([(index, run.events[index], run.sizes[index]) for index in unit])
        for index in unit:
            run.set(index, None)
    return _cut_strings_to_fit(run, max_bytes, events, dropped)


def _cut_strings_to_fit(run: _Sized, max_bytes: int, events: list[Any],
                        dropped: list[list[tuple[int, Any, int]]]) -> tuple[list[Any], int]:
    """The rest of `_cut`, its events that carry no message gone (`dropped`, the largest
    first): strings cut to one length, after dropping as few activity messages (the largest
    first) as that needs; then the smallest of `dropped` are put back (a step, a progress
    event) as far as there is room, or cutting strings a little more makes room.

    Whether strings cut to `_MIN_CUT` can fit the run, and with how many activities gone,
    is counted from what each event's strings save, found in one walk of the run (a walk
    for each activity tried took minutes over a run of many messages and activities)."""
    if run.total <= max_bytes:
        return [e for e in run.events if e is not None], run.total
    savings = [sum(_saved(string, _MIN_CUT) for string in _long_strings_of(event))
               for event in run.events]
    excess, can_save = run.total - max_bytes, sum(savings)
    activities = _activities(run)
    going = 0
    while can_save < excess:
        if going == len(activities):
            kept = [_reduced(e) for e in events
                    if isinstance(e, dict) and e.get("type") in _KEEP_FIELDS]
            return kept, len(orjson.dumps(kept))
        excess -= sum(run.sizes[i] + 1 for i in activities[going])
        can_save -= sum(savings[i] for i in activities[going])
        going += 1
    for unit in activities[:going]:
        for index in unit:
            run.set(index, None)
    # Put back into what the cut has to spare: with an activity gone, only the room its
    # going left (an event is not kept at a message's cost); else what cutting strings
    # further saves, never more than a share of the bound.
    spare = -excess if going else min(can_save - max(excess, 0),
                                      max_bytes // _PUT_BACK_SHARE)
    back: list[tuple[int, Any, int]] = []
    room = 0
    for unit in reversed(dropped):
        size = sum(size + 1 for _, _, size in unit)
        if room + size > spare:
            break
        room += size
        back += unit
    if not _strings_cut_to_fit(run, max_bytes - room):
        kept = [_reduced(e) for e in events
                if isinstance(e, dict) and e.get("type") in _KEEP_FIELDS]
        return kept, len(orjson.dumps(kept))
    for index, event, _ in back:
        run.set(index, event)
    return [e for e in run.events if e is not None], run.total


#: The events a cut dropped it puts back take at most this share of the bound from the
#: strings it cuts: an answer is not cut to its first characters to keep a large event.
_PUT_BACK_SHARE = 16

#: The events holding a run's state.
_STATE_TYPES = frozenset({"STATE_SNAPSHOT", "STATE_DELTA"})
#: The events a cut never drops: the run-level ones, those that carry a message (activities
#: only as a last resort), the run's state (its marker once cut), the bounds of a subagent's
#: part (the events between them name it), and the encrypted reasoning a message carries.
_KEPT_TYPES = frozenset({
    "RUN_STARTED", "RUN_FINISHED", "RUN_ERROR", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT",
    "TEXT_MESSAGE_END", "TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END",
    "TOOL_CALL_RESULT", "REASONING_MESSAGE_START", "REASONING_MESSAGE_CONTENT",
    "REASONING_MESSAGE_END", "REASONING_START", "REASONING_END", "MESSAGES_SNAPSHOT",
    "REASONING_ENCRYPTED_VALUE", "ACTIVITY_SNAPSHOT", "ACTIVITY_DELTA", "SUBAGENT_STARTED",
    "SUBAGENT_FINISHED", "SUBAGENT_ERROR", *_STATE_TYPES,
})
#: The CUSTOM events a cut keeps: without a hand-over's start, the handed-over agent's
#: messages snapshot reads as the whole conversation (`_compaction.events_to_messages`);
#: without an interrupt's, a client reading the thread has no question to answer.
_KEPT_CUSTOM = frozenset({ev.AGENT_STARTED, ev.AGENT_FINISHED, ev.LEGACY_INTERRUPT,
                          ev.COPILOTKIT_INTERRUPT})


def _largest_first(run: _Sized, types: frozenset[str]) -> list[int]:
    """The indexes of the events of `types`, largest first."""
    return sorted((i for i, e in enumerate(run.events)
                   if isinstance(e, dict) and e.get("type") in types),
                  key=lambda i: -run.sizes[i])


def _droppable(run: _Sized) -> list[list[int]]:
    """The events a cut may drop, as units dropped whole (a step's start with its end: the
    order checks refuse one without the other), the largest first."""
    units: list[list[int]] = []
    steps: dict[tuple[Any, Any], list[int]] = {}  # the steps open, by name and subagent
    for index, event in enumerate(run.events):
        if not isinstance(event, dict):
            continue
        kind = event.get("type")
        if kind == "STEP_STARTED" or kind == "STEP_FINISHED":
            key = (event.get("stepName"), event.get("subagentRunId"))
            if kind == "STEP_STARTED":
                steps.setdefault(key, []).append(index)
            elif steps.get(key):
                units.append([steps[key].pop(), index])
            # (an end without its start is kept: it is not this cut's to mend)
        elif kind not in _KEPT_TYPES and not (
                kind == "CUSTOM" and event.get("name") in _KEPT_CUSTOM):
            units.append([index])
    # A start never ended (a RUN_ERROR closes it) goes alone.
    units += [[index] for starts in steps.values() for index in starts]
    return sorted(units, key=lambda unit: -sum(run.sizes[i] for i in unit))


def _activities(run: _Sized) -> list[list[int]]:
    """The run's activity messages (each one's snapshots and deltas), the largest first."""
    by_id: dict[Any, list[int]] = {}
    for index, event in enumerate(run.events):
        if isinstance(event, dict) and event.get("type") in ("ACTIVITY_SNAPSHOT",
                                                              "ACTIVITY_DELTA"):
            by_id.setdefault(event.get("messageId"), []).append(index)
    return sorted(by_id.values(), key=lambda unit: -sum(run.sizes[i] for i in unit))


def _state_not_stored(size: int) -> dict[str, Any]:
    return {"type": "STATE_SNAPSHOT", "snapshot": {STATE_NOT_STORED: {"bytes": size}}}


def _strings_cut_to_fit(run: _Sized, max_bytes: int) -> bool:
    """Cut `run`'s long strings to the longest length that brings it under `max_bytes`;
    False (nothing cut) if even `_MIN_CUT` would not."""
    if run.total <= max_bytes:
        return True
    length = _cut_length(run.events, run.total - max_bytes)
    if length is None:
        return False
    for limit in (length, _MIN_CUT):
        for index, event in enumerate(run.events):
            cut = _cut_strings(event, limit)
            if cut is not event:
                run.set(index, cut)
        # (measured, the first length fits; the shortest is the cut's last word all the same)
        if run.total <= max_bytes:
            return True
    return False


def _cut_length(events: list[Any], excess: int) -> int | None:
    """The longest length to cut strings to that saves `excess` bytes, or None if cutting
    them to `_MIN_CUT` would not. What a cut keeps of a string is measured, not guessed from
    its average bytes a character: a head of 3-byte characters or of 6-byte escapes keeps
    far more than a string's average says."""
    strings = [string for event in events for string in _long_strings_of(event)]
    if not strings:
        return None

    def saved(length: int) -> int:
        # Monotone in `length`, so bisected.
        return sum(_saved(string, length) for string in strings)

    if saved(_MIN_CUT) < excess:
        return None
    low, high = _MIN_CUT, max(size for size, _, _ in strings)  # saved(low) >= excess
    while high - low > 1:
        middle = (low + high) // 2
        if saved(middle) >= excess:
            low = middle
        else:
            high = middle
    return low


#: A string a cut may shorten: its length, its encoded size and itself (None when each of
#: its characters is one byte encoded: any head's size is then its length).
_String = tuple[int, int, str | None]


def _saved(string: _String, length: int) -> int:
    """What cutting `string` to `length` saves, exactly (never less than 0: each character
    is at least a byte); nothing when it is no longer than the cut and its mark."""
    size, encoded, text = string
    if size <= length + _MARK:
        return 0
    kept = length + 2 if text is None else len(orjson.dumps(text[:length]))
    return encoded - kept - _MARK


#: What the mark a cut string ends with adds: one no longer than its cut plus the mark is
#: left whole (cut, it would grow).
_MARK = len(_TRUNCATED)


def _long_strings_of(value: Any) -> list[_String]:
    out: list[_String] = []
    _long_strings(value, out)
    return out


def _long_strings(value: Any, out: list[_String]) -> None:
    """Each string of `value` a cut may shorten (`_String`), into `out`."""
    if isinstance(value, str):
        if len(value) > _MIN_CUT + _MARK:
            encoded = len(orjson.dumps(value))
            plain = encoded == len(value) + 2  # (a wider character, or an escape, adds bytes)
            out.append((len(value), encoded, None if plain else value))
    elif isinstance(value, dict):
        for key, item in value.items():
            if not _names(key, item):
                _long_strings(item, out)
    elif isinstance(value, list):
        for item in value:
            _long_strings(item, out)


def _names(key: Any, value: Any) -> bool:
    """Whether `value`, under `key`, names something (a message, a tool call, a run, a step):
    never cut, as two ids cut to one common head would merge what they name. A string
    alone, under an id's key (`id`, `...Id`, `..._id`: not `grid` or `valid`, whose data
    was kept whole) or a name's."""
    return isinstance(key, str) and isinstance(value, str) and (
        key == "id" or key.endswith(("Id", "_id")) or key in _NAME_KEYS)


#: Keys, besides ids, whose values name what other events refer to.
_NAME_KEYS = frozenset({"name", "stepName", "toolCallName", "activityType", "type", "role"})


def _reduced(event: dict[str, Any]) -> dict[str, Any]:
    return {k: event[k] for k in _KEEP_FIELDS[event["type"]] if k in event}


def _cut_strings(value: Any, limit: int) -> Any:
    """`value` with each string longer than `limit` and the mark cut to `limit`: the same
    object when none is (nothing of it is copied)."""
    if isinstance(value, str):
        return value if len(value) <= limit + _MARK else value[:limit] + _TRUNCATED
    if isinstance(value, dict):
        items = {k: v if _names(k, v) else _cut_strings(v, limit) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if isinstance(value, list):
        cut = [_cut_strings(v, limit) for v in value]
        return value if all(c is v for c, v in zip(cut, value, strict=True)) else cut
    return value
