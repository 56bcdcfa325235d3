"""Where threads live between runs: the interface every store implements.

A thread is the runs made on it (each kept as its compacted events) plus the ids of the
messages it has seen. Every event of a thread has a *position*: an integer that increases
through the thread, given by the runtime as the run streams (the SSE `id:` of `run` and
`connect`). A finished run keeps the positions of its first and last event; its compacted
events have no positions of their own in between.

Durable stores (SQLite, PostgreSQL) also keep a running run's events, written in batches
while it streams (`append_events`), so another worker can follow the run and nothing that
was streamed is lost if its worker dies: `open_runs` lists the runs left open and
`close_interrupted` ends one with what had been streamed, the events that close what was
left open, and a `RUN_ERROR` coded `RUN_INTERRUPTED`. Those raw events are kept for
`raw_retention` seconds after their run ends, so a client that resumes with
`Last-Event-ID` in the middle of a run gets exactly the rest of it; after that window a
resume inside that run replays it whole.

`events_after(thread_id, position)` is what `connect` reads: the events after `position`
(all of them for -1) as pairs (position, event); events inside a compacted run have the
position None and the run's last event has its last position. A run refused over its
approval answer (`refused_answer`) is left out, unless `position` falls inside it: its
positions are kept, so later ids go on past them. A run stored before positions existed
(-1) is in a whole-thread replay (-1) alone (`ends_after`).
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import orjson

from copilot_runtime import events as ev
from copilot_runtime._compaction import events_to_messages, handed_over
from copilot_runtime._exceptions import APPROVAL_REFUSAL_CODES
from copilot_runtime.event_order import RunEventOrder
from copilot_runtime.events import Event

__all__ = [
    "CONTROL_CHARACTERS",
    "DELETED_RETENTION",
    "INTERRUPTED_CODE",
    "JUDGED_MARK_PREFIX",
    "MAX_ID_LENGTH",
    "MAX_REPLAY_BYTES",
    "NOT_IN_NAMES",
    "REFUSED_MARK_PREFIX",
    "REPLAY_OMITTED",
    "DurableThreadStore",
    "EarlierRuns",
    "ListPosition",
    "Positioned",
    "StoredRun",
    "ThreadOwner",
    "ThreadRecord",
    "ThreadStore",
    "earlier_messages",
    "ends_after",
    "id_problem",
    "interrupted_tail",
    "newest_within",
    "omission",
    "positioned_runs",
    "refused_answer",
    "state_of_unkept",
    "state_snapshot",
    "storable_ids",
    "title_of",
    "with_omission",
]

#: The code of the `RUN_ERROR` that ends a run whose worker stopped before it did.
INTERRUPTED_CODE = ev.runtime_code("RUN_INTERRUPTED")
_INTERRUPTED_MESSAGE = "The run was interrupted: the server driving it stopped"
#: The name of the CUSTOM event that says a replay left runs out (`omission`).
REPLAY_OMITTED = "copilot_runtime.replay_omitted"
#: Longest thread title, in characters.
_TITLE_LENGTH = 80
#: The longest id (of a thread, a run or a message) a store keeps, in characters. Every
#: store must hold every id it accepts: PostgreSQL indexes two ids in one entry, at most
#: 2,704 bytes, and a character takes up to 4.
MAX_ID_LENGTH = 256
#: The start of the thread ids a chat suggestion's agent runs on when it keeps threads in
#: this process (`RunManager.begin_unstored`): nobody's, so no approval on one is served.
SUGGESTION_THREAD_PREFIX = "copilot-suggestion-"
# What a string that encodes as UTF-8 never holds: half of a UTF-16 pair, alone (a Python
# string keeps what a JSON escape such as "\ud800" says). No store can write it.
_LONE_SURROGATES = re.compile(r"[\ud800-\udfff]")
#: What no id, title or name holds (PostgreSQL's text cannot even hold NUL; no store, a
#: lone surrogate).
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")
#: What no title or name holds either: C1 control characters ("\x85" breaks a line, "\x9b"
#: starts a terminal escape), line and paragraph separators, and the bidirectional
#: embeddings, overrides and isolates that make a name read as other text ("Trojan Source").
NOT_IN_NAMES = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")

#: An event and its position in the thread (None inside a compacted run).
Positioned = tuple[int | None, Event]
#: A thread's place in a list of threads: its updated time and its id.
ListPosition = tuple[float, str]


@dataclass(frozen=True, slots=True)
class ThreadOwner:
    """Who started a thread: a principal id, within a tenant when there are tenants.

    Set when the thread's first run is stored and never changed. A thread without an owner
    was started with no authentication configured.
    """

    principal_id: str
    tenant: str | None = None


@dataclass(slots=True)
class StoredRun:
    run_id: str
    events: list[Event]
    created_at: float
    #: The events' size as encoded JSON, when the writer measured it (0: not measured).
    size: int = 0
    #: Positions in the thread of the run's first and last streamed event (-1: unknown).
    first_position: int = -1
    last_position: int = -1


@dataclass(slots=True)
class ThreadRecord:
    thread_id: str
    agent_id: str
    created_at: float
    updated_at: float
    runs: list[StoredRun] = field(default_factory=list)
    message_ids: set[str] = field(default_factory=set)
    owner: ThreadOwner | None = None
    #: A name given with `rename`, or None.
    name: str | None = None
    #: The first user message's text, shortened: what a list of threads shows.
    title: str = ""
    #: The position the thread's next event gets.
    next_position: int = 0
    #: How many of its oldest finished runs a bounded read (`get(max_bytes=)`) left out.
    omitted_runs: int = 0
    #: A run of the thread opened and not closed yet (its events written as it streams), as
    #: `summary` of a durable store reads it; None otherwise.
    open_run: str | None = None
    #: The state the thread's last finished run that had one left, as the store keeps it
    #: with the thread: what `state` answers when that run is not among `runs` (a bounded
    #: read left it out, the memory store evicted it). None: no run had one, the thread was
    #: stored before stores kept it, or `get` read it in `runs` (it need not read it twice).
    kept_state: Any = None
    #: When a bounded read left runs out: a MESSAGES_SNAPSHOT of the thread's messages as
    #: they stood at the end of the last run left out (`earlier_messages`), which goes before
    #: `runs` so that the messages read keep the thread's order; None otherwise.
    earlier: Event | None = None
    #: Whether `archive` put the thread away: lists leave it out unless asked for it. (Last:
    #: a store of an application's own may build its records by position.)
    archived: bool = False

    @property
    def state(self) -> Any:
        """The thread's state after its last run that had one, or None."""
        for run in reversed(self.runs):
            snapshot = state_snapshot(run.events)
            if snapshot is not None:
                return snapshot.get("snapshot")
        return self.kept_state


@runtime_checkable
class ThreadStore(Protocol):
    """Where threads are kept. The built-in stores also have `archive(thread_id, archived=True,
    *, owner=None) -> bool` (False: no such thread; with `owner`, checked as it is changed,
    as `rename`; its runs, name and updated time stay, and a run on it leaves it archived).
    It is optional, not part of the protocol, so that a store of an application's own
    written before it stays one (a durable store of its own without it still is one):
    `CopilotRuntime.archive_thread` answers 501 for such a store. So is `reopen()`, which
    opens a store closed by `aclose` again (the memory and SQLite stores have it): a runtime
    started again after it closed (an app's lifespan run twice) needs its store to have it."""

    async def get(self, thread_id: str, *, max_bytes: int | None = None
                  ) -> ThreadRecord | None:
        """The thread with its finished runs, or None if it never started a run; with
        `max_bytes`, only its newest runs whose stored events fit (at least the last one),
        the others counted in `omitted_runs`."""
        ...

    async def summary(self, thread_id: str) -> ThreadRecord | None:
        """The thread without its runs (its owner, message ids, next position), or None."""
        ...

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         message_ids: Iterable[str], *, owner: ThreadOwner | None = None
                         ) -> None:
        """Record a finished run (compacted) and the message ids it saw or produced; a run
        whose events `append_events` wrote is closed.

        `owner` is recorded only when the run creates the thread.
        """
        ...

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: ThreadOwner | None = None, offset: int = 0,
                   after: ListPosition | None = None, include_archived: bool = True
                   ) -> list[ThreadRecord]:
        """Threads without their runs, newest first (threads updated at the same time: the
        greater id first, ids compared by code point, on every store), optionally only those
        of one agent and of one owner, and without the archived ones; `after`: only those
        listed after that position (a page's last thread's), then `offset` skips that many."""
        ...

    async def events_after(self, thread_id: str, position: int
                           ) -> builtins.list[Positioned]:
        """The thread's events after `position` (-1: all), a running run's included; of its
        finished runs, the newest within `MAX_REPLAY_BYTES` (the built-in stores), and if
        that left some out, the `omission` event after the first replayed run's start; not
        a run `refused_answer` that `position` is not inside. A whole-thread replay (-1)
        that left runs out has the `earlier_messages` of those runs right after the
        omission event."""
        ...

    async def rename(self, thread_id: str, name: str | None, *,
                     owner: ThreadOwner | None = None) -> bool:
        """Give the thread a name (None: none); False if there is no such thread. With
        `owner`, only a thread of that owner, checked as it is renamed (False for another's:
        the owner checked before may have deleted it, and another begun one of its id)."""
        ...

    async def delete(self, thread_id: str, *, updated_before: float | None = None,
                     next_position: int | None = None) -> bool:
        """Forget the thread and everything in it but how far its positions went (see
        `first_position`); False if there was none. With `updated_before` (epoch seconds),
        only a thread last updated before then, checked as it is deleted (a retention
        sweep's: a thread used since it was listed stays); False for another. With
        `next_position`, only a thread whose next position is still that one (the
        delete's read of it: a run written since, by a worker that took the thread once the
        delete's hold lapsed, stays); False for another."""
        ...

    async def first_position(self, thread_id: str) -> int:
        """The position the first event of a thread the store has no record of gets: 0, or,
        for the id of a thread deleted (or evicted) before, the position that thread's next
        event would have got. Positions never go back for an id, so a client still holding
        an event id of the old thread (`Last-Event-ID`) misses nothing of the new one. A
        durable store remembers a deleted thread's for `deleted_retention` seconds (30 days);
        the memory store for its last `max_tombstones` deleted or evicted threads."""
        ...

    async def aclose(self) -> None:
        ...


@runtime_checkable
class DurableThreadStore(ThreadStore, Protocol):
    """A store other processes can read, that keeps running runs' events as they stream."""

    #: Seconds a finished run's raw events are kept for exact resumes.
    raw_retention: float
    #: Seconds how far a deleted thread's positions went is remembered (`first_position`).
    deleted_retention: float

    async def append_events(self, thread_id: str, agent_id: str, run_id: str,
                            created_at: float, first_position: int, events: Sequence[Event],
                            *, owner: ThreadOwner | None = None,
                            run_first: int | None = None) -> None:
        """Write a running run's next events, the first at `first_position`; the first call
        opens the run (and creates the thread for `owner`). `run_first`, the position of
        the run's first event: a late write (its worker stalled) of a run that began before
        its thread was deleted writes nothing, as `append_run` of such a run."""
        ...

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         message_ids: Iterable[str], *, owner: ThreadOwner | None = None,
                         raw_first: int = -1, raw: Sequence[Event] = ()) -> None:
        """`ThreadStore.append_run`, with the run's raw events not written yet (the first at
        `raw_first`) written in the same transaction."""
        ...

    async def open_runs(self) -> builtins.list[tuple[str, str]]:
        """(thread id, run id) of every run opened and never closed."""
        ...

    async def close_interrupted(self, thread_id: str, run_id: str) -> bool:
        """Close an open run with what it had streamed, marked as interrupted; False if it
        was not open (another worker closed it first)."""
        ...


#: What one replay (`events_after`: a `connect`) reads of a thread's finished runs: its
#: newest runs whose stored events fit, at least the last. A store keeps any number of runs
#: of up to 16 MiB each, and a read costs several times its size in memory.
MAX_REPLAY_BYTES = 32 * 1024 * 1024
#: Seconds a durable store remembers how far a deleted thread's positions went (30 days):
#: long past any client still holding one of its event ids, and every delete's row goes.
DELETED_RETENTION = 30 * 24 * 3600.0


def newest_within(sizes: Sequence[int], max_bytes: int | None) -> int:
    """How many of the newest runs (sizes newest first) fit in `max_bytes` (at least one)."""
    if max_bytes is None:
        return len(sizes)
    total = kept = 0
    for size in sizes:
        total += size
        if kept and total > max_bytes:
            break
        kept += 1
    return kept


def state_snapshot(events: Sequence[Event]) -> Event | None:
    """The last `STATE_SNAPSHOT` of a run's events (the state it left), or None."""
    for event in reversed(events):
        if event["type"] == ev.STATE_SNAPSHOT:
            return event
    return None


#: The most bytes of runs an older release stored that a read looks through for a state it
#: left and did not keep with the thread (see `state_of_unkept`).
UNKEPT_STATE_BYTES = 8 * 1024 * 1024


def state_of_unkept(kept: bytes | None, blobs: Iterable[bytes], *,
                    complete: bool = True) -> Any:
    """The thread's state when the runs read hold none: the state kept with the thread
    (`kept`, encoded), unless one of `blobs` (the runs an older release stored after the
    kept state's run and left out of the read, newest first, encoded; `complete`: all of
    them) left a later one, which it does not keep. Past `UNKEPT_STATE_BYTES` of them, or
    without all of them, and none with a state: None (unknown, never a state a later run
    replaced)."""
    looked = 0
    for blob in blobs:
        looked += len(blob)
        if looked > UNKEPT_STATE_BYTES:
            return None
        snapshot = state_snapshot(orjson.loads(blob))
        if snapshot is not None:
            return snapshot.get("snapshot")
    return None if kept is None or not complete else orjson.loads(kept)


def id_problem(value: str, *, new: bool = False) -> str | None:
    """Why `value` cannot be an id every store keeps, or None if it can; `new`: an id a
    run is about to give a thread or run, held to more (one already kept stays reachable)."""
    if len(value) > MAX_ID_LENGTH:
        return f"is longer than {MAX_ID_LENGTH} characters"
    if _LONE_SURROGATES.search(value):
        # Request bodies read one as U+FFFD, but a token's claims (PyJWT's `json`) keep it,
        # and no store's encoder takes it: every read and write of the id would fail.
        return "is not UTF-8 text (it holds a lone surrogate)"
    if CONTROL_CHARACTERS.search(value):
        return "contains a control character"
    if NOT_IN_NAMES.search(value):
        # A thread's or a user's id is shown in logs and lists, like a name: the same
        # characters would break a log line or make the id read as another one.
        return "contains a line separator or a character that reorders text"
    if new and not value:
        # `/threads/` is the list route and `/stop/` no stop: a thread so named could never
        # be renamed, deleted or stopped.
        return "is empty, which a URL cannot carry as a path segment"
    if new and value in (".", ".."):
        # Clients that read URLs as browsers do drop these segments, `%2E` written or not:
        # a thread so named could never be read, renamed or deleted.
        return "is '.' or '..', which a URL cannot carry as a path segment"
    if new and value.startswith(SUGGESTION_THREAD_PREFIX):
        # The runtime's own, for suggestions' throwaway threads, whose approvals are hidden.
        return f"begins with {SUGGESTION_THREAD_PREFIX!r}, which the runtime keeps for itself"
    return None


#: What begins the marks a thread keeps among its message ids of the text its guardrails let
#: through (`_trust.judged_mark`). The ids clients send and agents make that begin so are
#: not kept: a client could forge a mark. (Older versions' marks began "judged:", among ids
#: clients could send: they are only ids now, and their text is judged again.)
JUDGED_MARK_PREFIX = "judged-v2:"
#: What begins the marks a thread keeps of the client messages its guardrails refused
#: (`_trust.refused_mark`): within `JUDGED_MARK_PREFIX`, so no client id can forge one
#: either, and of another digest, so none passes for text let through.
REFUSED_MARK_PREFIX = JUDGED_MARK_PREFIX + "refused:"


def storable_ids(ids: Iterable[str]) -> set[str]:
    """The message ids of `ids` that every store can keep. Agents make message ids and
    clients send them back, so ids no store can keep are left out rather than refused:
    such a message is only not recognised as already seen."""
    return {i for i in ids if len(i) <= MAX_ID_LENGTH and not CONTROL_CHARACTERS.search(i)}


def title_of(events: Sequence[Event]) -> str:
    """The text of the first user message a run's input carried, shortened."""
    for event in events:
        if event.get("type") != ev.RUN_STARTED:
            continue
        messages = (event.get("input") or {}).get("messages") or ()
        for message in messages:
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, list):
                    content = " ".join(part.get("text", "") for part in content
                                       if isinstance(part, dict)
                                       and isinstance(part.get("text"), str))
                text = " ".join(NOT_IN_NAMES.sub(" ", content).split()) \
                    if isinstance(content, str) else ""
                if text:
                    return text if len(text) <= _TITLE_LENGTH \
                        else text[:_TITLE_LENGTH - 1] + "…"
        break
    return ""


def interrupted_tail(events: Sequence[Event], thread_id: str, run_id: str) -> list[Event]:
    """What closes a run cut off after `events`: the ends of what was left open, then a
    `RUN_ERROR` saying it was interrupted (nothing if it had already ended)."""
    order = RunEventOrder(thread_id, run_id)
    order.normalize(events)
    if order.terminated:
        return []
    tail = order.closing_events()
    tail.append(ev.run_error(_INTERRUPTED_MESSAGE, code=INTERRUPTED_CODE))
    return tail


def refused_answer(events: Sequence[Event]) -> bool:
    """Whether a finished run's (compacted) events are those of an approval answer refused
    before its agent did anything: its start, then a `RUN_ERROR` coded
    `APPROVAL_REFUSAL_CODES` (a stale answer from another tab, a message sent before the
    answer). The graph waits as before, so a replay leaves the run out: a client takes any
    run after an interrupt for its end and would ask nothing, and a message the run carried
    never reached the agent (its sender was told to send it again after the answer)."""
    return (len(events) == 2 and events[0].get("type") == ev.RUN_STARTED
            and events[1].get("type") == ev.RUN_ERROR
            and events[1].get("code") in APPROVAL_REFUSAL_CODES)


def ends_after(last_position: int, position: int) -> bool:
    """Whether a finished run whose last event is at `last_position` is replayed after
    `position` (-1: the whole thread). A run stored before positions existed (-1) only is
    in a whole-thread replay: every position a client can hold is of a later run (a resume
    in one got that run again in the middle of it, which the clients reject)."""
    return last_position > position if last_position >= 0 else position < 0


def positioned_runs(runs: Iterable[StoredRun], position: int, omitted: int = 0,
                    earlier: Event | None = None) -> list[Positioned]:
    """The events of finished runs after `position`, as `events_after` returns them, told
    that `omitted` older runs after `position` were left out, whose messages are `earlier`
    (see `with_omission`).

    A run that `position` falls inside is replayed whole (its raw events are gone)."""
    out: list[Positioned] = []
    for run in runs:
        if not run.events or not ends_after(run.last_position, position):
            continue
        if not 0 <= run.first_position <= position and refused_answer(run.events):
            continue
        out.extend((None, event) for event in run.events[:-1])
        out.append((run.last_position if run.last_position >= 0 else None, run.events[-1]))
    return with_omission(out, omitted, earlier)


def omission(omitted_runs: int) -> Event:
    """What tells a client that a replay (`connect`) left out the `omitted_runs` oldest runs
    it would have had (they did not fit in the store's `replay_bytes`): a CUSTOM event,
    which every AG-UI client takes inside a run and hands to whoever listens for its name."""
    return ev.custom(REPLAY_OMITTED, {"omittedRuns": omitted_runs})


def with_omission(replayed: list[Positioned], omitted_runs: int,
                  earlier: Event | None = None) -> list[Positioned]:
    """`replayed` with `omission` right after its first run's start (before any run started
    the clients refuse every event but a start), when runs were left out, then `earlier`
    (the messages of the runs left out, `earlier_messages`): a client applies a later
    snapshot by keeping the messages it holds in place and adding the others after them, so
    without them first the replayed runs' messages went above the thread's first ones.
    The start's input messages move into that snapshot, after the earlier ones: a client
    adds a start's messages at once, which put them above the earlier ones."""
    if omitted_runs > 0:
        for index, (position, event) in enumerate(replayed):
            if event.get("type") == ev.RUN_STARTED:
                inserted: list[Positioned] = [(None, omission(omitted_runs))]
                if earlier is not None:
                    started, snapshot = _input_after(event, earlier)
                    replayed[index] = (position, started)
                    inserted.append((None, snapshot))
                replayed[index + 1:index + 1] = inserted
                break
    return replayed


def _input_after(started: Event, earlier: Event) -> tuple[Event, Event]:
    """The start `started` without its input messages, and the snapshot `earlier` with
    those of them it does not hold after its own."""
    run_input = started.get("input")
    if not isinstance(run_input, dict) or not isinstance(run_input.get("messages"), list):
        return started, earlier
    messages = list(earlier["messages"])
    held = {m.get("id") for m in messages}
    for message in run_input["messages"]:
        if isinstance(message, dict) and message.get("id") not in held:
            held.add(message.get("id"))
            messages.append(message)
    return ({**started, "input": {**run_input, "messages": []}},
            {**earlier, "messages": messages})


#: A thread's runs left out of a bounded read, the newest first: each one's events, read
#: only as far as `earlier_messages` needs them.
EarlierRuns = Iterable[Sequence[Event]]


def earlier_messages(omitted_newest_first: EarlierRuns, max_bytes: int | None
                     ) -> Event | None:
    """A MESSAGES_SNAPSHOT of a thread's messages as they stood at the end of the last of
    the runs a bounded read left out (`omitted_newest_first`, which the caller bounds by
    what it reads of them), or None when they had none. Their runs are read back only to
    the last MESSAGES_SNAPSHOT (an agent's whole conversation, as LangGraph's are). Past
    `max_bytes` of messages, the newest that fit (at least one), in order."""
    tail: list[Sequence[Event]] = []
    for events in omitted_newest_first:
        if refused_answer(events):
            continue  # as a replay leaves it out
        last_snapshot = _last_snapshot(events)
        if last_snapshot is not None:
            tail.append(events[last_snapshot:])
            break
        tail.append(events)
    messages = events_to_messages(reversed(tail))
    if not messages:
        return None
    kept = newest_within([_encoded_size(m) for m in reversed(messages)], max_bytes)
    return {"type": ev.MESSAGES_SNAPSHOT, "messages": messages[len(messages) - kept:]}


def _last_snapshot(events: Sequence[Event]) -> int | None:
    """Where the run's last messages snapshot of its own is: not one of an agent it handed
    over to (that agent's conversation, which `events_to_messages` merges in). Read from
    the start: a hand-over a RUN_ERROR ended has no end to read back from."""
    found, depth = None, 0
    for index, event in enumerate(events):
        kind = event.get("type")
        if kind == ev.CUSTOM:
            depth = handed_over(depth, event)
        elif kind == ev.MESSAGES_SNAPSHOT and not depth and isinstance(
                event.get("messages"), list):
            found = index
    return found


def _encoded_size(message: Any) -> int:
    try:
        return len(orjson.dumps(message))
    except (orjson.JSONEncodeError, TypeError):
        return len(repr(message))  # (what the runtime never stores)
