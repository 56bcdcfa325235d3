"""What the SQL stores share: reading a thread's events after a position from its rows,
closing a run left open, and checking a schema's version."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import orjson

from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events
from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime.events import Event
from copilot_runtime.threads.base import (
    JUDGED_MARK_PREFIX,
    Positioned,
    ends_after,
    interrupted_tail,
    refused_answer,
    storable_ids,
    with_omission,
)

__all__ = ["Chunk", "FirstPositions", "RunRow", "check_schema_version", "closed_run",
           "decoded", "events_after", "message_ids_of", "oldest_reader", "resumed_at"]


def check_schema_version(store: str, version: int, known: int,
                         oldest_reader: int | None = None) -> None:
    """Refuse a store a newer release migrated (a roll-back, or an old worker left behind)
    unless that release said code of this one's schema may still use it (`oldest_reader`,
    see `oldest_reader`): a newer schema may mean something older code would get wrong
    (migration 3 of the PostgreSQL store dropped the foreign keys older releases deleted
    threads through)."""
    if version > known and (oldest_reader is None or oldest_reader > known):
        raise ConfigurationError(
            f"the thread store {store} is at schema version {version}, newer than this "
            f"release knows ({known}): run the release that migrated it, or a newer one")


def oldest_reader(migrations: int, additive: Iterable[int]) -> int:
    """The oldest schema version whose code may still use a store migrated through
    `migrations`: the last of them that is not `additive` (a migration older code cannot
    tell from its absence: a column or an index it never names, with its default), so a
    release can be rolled back across additive migrations."""
    kept = set(additive)
    return max((n for n in range(1, migrations + 1) if n not in kept), default=0)


class FirstPositions:
    """Where the positions of threads a head read found missing go on from (a deleted
    thread's tombstone, else 0), read in the same query as the head: a run's start reads its
    thread's head, then asks this of a new thread, which would otherwise be a second round
    trip for every new thread. Taken once; a few hundred kept at most (heads read by other
    callers are never asked)."""

    most = 512

    def __init__(self) -> None:
        self._known: OrderedDict[str, int] = OrderedDict()

    def note(self, thread_id: str, position: int) -> None:
        self._known[thread_id] = position
        self._known.move_to_end(thread_id)
        if len(self._known) > self.most:
            self._known.popitem(last=False)

    def take(self, thread_id: str) -> int | None:
        return self._known.pop(thread_id, None)


@dataclass(slots=True)
class RunRow:
    run_id: str
    open: bool
    first_position: int
    last_position: int
    events: list[Event]
    #: The position of the first of the closing events a sweep stored (`closed_run`) for
    #: a run its worker left open; None: its worker ended it, or it is open.
    swept_from: int | None = None


@dataclass(slots=True)
class Chunk:
    """Raw events a running run wrote at once: positions first..first+len-1."""

    run_id: str
    first_position: int
    events: list[Event]


def events_after(runs: Sequence[RunRow], chunks: Iterable[Chunk], position: int,
                 omitted: int = 0, earlier: Event | None = None) -> list[Positioned]:
    """`ThreadStore.events_after` from a thread's runs (in order) and the raw chunks kept,
    `omitted` older finished runs after `position` having been left out, whose messages
    are `earlier` (`with_omission`)."""
    ordered = sorted(chunks, key=lambda c: c.first_position)

    def after(kept: list[Chunk], at: int = position) -> list[Positioned]:
        return [(chunk.first_position + offset, event) for chunk in kept
                for offset, event in enumerate(chunk.events)
                if chunk.first_position + offset > at]

    result: list[Positioned] = []
    for index, run in enumerate(runs):
        at = resumed_at(runs[index:], position)
        if run.open:
            result.extend(after(_chunks_of(run, ordered)))
        elif ends_after(run.last_position, at):
            inside = 0 <= run.first_position <= at
            kept = _chunks_of(run, ordered) if inside else []
            if kept:
                result.extend(after(kept, at))  # resumed inside the run: the exact rest
            elif run.events and (inside or not refused_answer(run.events)):
                result.extend((None, event) for event in run.events[:-1])
                result.append((run.last_position if run.last_position >= 0 else None,
                               run.events[-1]))
    return with_omission(result, omitted, earlier)


def resumed_at(runs: Sequence[RunRow], position: int) -> int:
    """Where a client at `position` resumes `runs[0]`: before its closing events if a sweep
    stored them (`swept_from`) at or before `position` and no later run began by then.

    The run's worker died having sent events it never wrote, whose positions the closing
    events took: the client's id names one of those, not what the store holds there, and
    its stream would end without the run's end. It gets them all (ids it may have seen)."""
    run = runs[0]
    if run.swept_from is None or not 0 <= run.swept_from <= position or any(
            0 <= later.first_position <= position for later in runs[1:]):
        return position
    return run.swept_from - 1


def _chunks_of(run: RunRow, ordered: list[Chunk]) -> list[Chunk]:
    """A run's raw chunks: its id's, within its own positions. A client may send a run id
    again in a later run of the thread, whose chunks are not this run's."""
    last = run.last_position if not run.open and run.last_position >= 0 else None
    return [chunk for chunk in ordered
            if chunk.run_id == run.run_id and chunk.first_position >= run.first_position
            and (last is None or chunk.first_position <= last)]


def closed_run(thread_id: str, run_id: str, first_position: int,
               chunks: Iterable[Chunk]) -> tuple[list[Event], int, list[Event], int]:
    """An interrupted run's closing events, the position of the first of them, its
    compacted events and its last position."""
    streamed: list[Event] = []
    next_position = first_position
    # (an earlier run that had the same id left its chunks before this run's first position)
    for chunk in sorted((c for c in chunks if c.first_position >= first_position),
                        key=lambda c: c.first_position):
        streamed.extend(chunk.events)
        next_position = chunk.first_position + len(chunk.events)
    if not streamed:
        streamed = [ev.run_started(thread_id, run_id, {
            "threadId": thread_id, "runId": run_id, "messages": [], "tools": [],
            "context": []})]
    tail = interrupted_tail(streamed, thread_id, run_id)
    return tail, next_position, compact_events(streamed + tail), next_position + len(tail) - 1


def message_ids_of(events: Iterable[Event]) -> set[str]:
    ids: set[str] = set()
    for event in events:
        if event.get("type") == ev.RUN_STARTED:
            for message in (event.get("input") or {}).get("messages") or ():
                if isinstance(message, dict) and isinstance(message.get("id"), str):
                    ids.add(message["id"])
        for key in ("messageId", "parentMessageId"):
            value = event.get(key)
            if isinstance(value, str):
                ids.add(value)
    return {i for i in storable_ids(ids) if not i.startswith(JUDGED_MARK_PREFIX)}


def decoded(blobs: Iterable[bytes]) -> Iterator[list[Event]]:
    """Encoded runs, decoded one by one as they are read (`earlier_messages` stops at the
    first that has a snapshot: those after it are never decoded)."""
    for blob in blobs:
        yield orjson.loads(blob)


def dumps(events: Sequence[Event]) -> bytes:
    return orjson.dumps(events)
