"""The default thread store: a dict in this process bounded by count and bytes (lost on restart)."""

from __future__ import annotations

import builtins
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Iterable

import orjson
import structlog

from copilot_runtime.events import Event
from copilot_runtime.threads.base import (
    MAX_REPLAY_BYTES,
    ListPosition,
    Positioned,
    StoredRun,
    ThreadOwner,
    ThreadRecord,
    earlier_messages,
    ends_after,
    newest_within,
    positioned_runs,
    state_snapshot,
    title_of,
)

__all__ = ["DEFAULT_MAX_BYTES", "InMemoryThreadStore"]

_log = structlog.get_logger("copilot_runtime.threads")

#: Seconds between two reports of evicted threads.
_REPORT_EVERY = 60.0
#: The default budget of the whole store, counted as the runs' encoded JSON.
DEFAULT_MAX_BYTES = 128 * 1024 * 1024


class InMemoryThreadStore:
    """Keeps up to `max_threads` threads and `max_bytes` of runs, evicting the least recently
    used thread first (and logging it: the first eviction at once, then a count at most
    once a minute).

    A thread deleted or evicted leaves the position its next event would have got (see
    `ThreadStore.first_position`), for up to `max_tombstones` ids, the oldest forgotten first.

    Sizes are the runs' encoded JSON (measured by the runtime when it stores a run); Python
    holds them in more memory than that, so `max_bytes` is a budget, not a ceiling: up to
    about 3x for long text holding a character beyond Latin-1 (a curly quote, a dash), which
    CPython keeps at 2 bytes a character, plus the UTF-8 copy encoding leaves on it.
    A single thread over the budget loses its oldest runs instead.
    """

    def __init__(self, max_threads: int = 10_000, max_runs_per_thread: int = 200,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_threads = max_threads
        self.max_runs_per_thread = max_runs_per_thread
        self.max_bytes = max_bytes
        self.bytes = 0
        self._threads: OrderedDict[str, ThreadRecord] = OrderedDict()
        self._sizes: dict[str, int] = {}
        #: Where the positions of threads deleted or evicted had got to, by id.
        self._tombstones: OrderedDict[str, int] = OrderedDict()
        self.max_tombstones = 10 * max_threads
        self._evicted = self._evicted_bytes = 0
        self._reported = -_REPORT_EVERY
        #: What `events_after` reads of a thread's finished runs (`MAX_REPLAY_BYTES`).
        self.replay_bytes = MAX_REPLAY_BYTES

    async def get(self, thread_id: str, *, max_bytes: int | None = None
                  ) -> ThreadRecord | None:
        record = self._threads.get(thread_id)
        if record is not None:
            self._threads.move_to_end(thread_id)
            kept = newest_within([r.size for r in reversed(record.runs)], max_bytes)
            if kept < len(record.runs):
                omitted = record.runs[:-kept]
                record = dataclasses.replace(record, runs=record.runs[-kept:],
                                             omitted_runs=len(omitted),
                                             earlier=_earlier(omitted, max_bytes))
        return record

    async def summary(self, thread_id: str) -> ThreadRecord | None:
        return self._threads.get(thread_id)

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         message_ids: Iterable[str], *, owner: ThreadOwner | None = None
                         ) -> None:
        if not run.size:
            run.size = _size(run.events)
        record = self._thread(thread_id, agent_id, run.created_at, run.events, owner)
        record.runs.append(run)
        snapshot = state_snapshot(run.events)
        if snapshot is not None:  # kept past the run's eviction, and a bounded read's
            record.kept_state = snapshot.get("snapshot")
        self._grow(thread_id, run.size)
        if len(record.runs) > self.max_runs_per_thread:
            dropped = record.runs[: -self.max_runs_per_thread]
            del record.runs[: -self.max_runs_per_thread]
            self._grow(thread_id, -sum(r.size for r in dropped))
        if run.last_position >= 0:
            record.next_position = max(record.next_position, run.last_position + 1)
        record.message_ids.update(message_ids)
        self._evict(thread_id)

    async def begin_run(self, thread_id: str, agent_id: str, created_at: float,
                        first_position: int, started: Event, *,
                        owner: ThreadOwner | None = None) -> None:
        """A run starts streaming on the thread, its start `started` at `first_position`: the
        thread exists from now on (listed, read, renamed while its first run streams), as
        the durable stores write it when the run's first events are, and `owner` is
        recorded if this creates it. `append_run` stores the run at its end."""
        record = self._thread(thread_id, agent_id, created_at, [started], owner)
        record.next_position = max(record.next_position, first_position + 1)
        self._evict(thread_id)

    def _thread(self, thread_id: str, agent_id: str, created_at: float,
                events: list[Event], owner: ThreadOwner | None) -> ThreadRecord:
        """The thread a run started at `created_at` goes to, made if new, marked as used."""
        record = self._threads.get(thread_id)
        if record is None:
            record = ThreadRecord(thread_id, agent_id, created_at, created_at,
                                  owner=owner, title=title_of(events))
            self._threads[thread_id] = record
            self._sizes[thread_id] = 0
            self._tombstones.pop(thread_id, None)  # the record carries its positions now
            return record
        self._threads.move_to_end(thread_id)
        if not record.title:  # its first runs had no user message (the agent spoke first)
            record.title = title_of(events)
        # The latest start, as the SQL stores keep it: a clock stepped back between two runs
        # made the thread older (listed lower, stale to retention sooner) here alone.
        record.updated_at = max(record.updated_at, created_at)
        return record

    def _report(self, thread_id: str, size: int) -> None:
        """Say that threads were evicted: the first at once, then at most once a minute with
        how many (a log line per eviction cost a busy store several per cent of a chat)."""
        self._evicted += 1
        self._evicted_bytes += size
        now = time.monotonic()
        if now - self._reported < _REPORT_EVERY:
            return
        _log.info("threads evicted from memory", threads=self._evicted,
                  bytes=self._evicted_bytes, last_thread_id=thread_id,
                  store_bytes=self.bytes, store_threads=len(self._threads))
        self._reported = now
        self._evicted = self._evicted_bytes = 0

    def _grow(self, thread_id: str, size: int) -> None:
        self._sizes[thread_id] += size
        self.bytes += size

    def _evict(self, keep: str) -> None:
        while len(self._threads) > self.max_threads or (
                self.bytes > self.max_bytes and len(self._threads) > 1):
            thread_id, record = self._threads.popitem(last=False)
            self._bury(record)
            size = self._sizes.pop(thread_id)
            self.bytes -= size
            self._report(thread_id, size)
        record = self._threads[keep]
        while self.bytes > self.max_bytes and len(record.runs) > 1:
            run = record.runs.pop(0)
            self._grow(keep, -run.size)
            _log.info("run evicted from memory", thread_id=keep, run_id=run.run_id,
                      bytes=run.size, store_bytes=self.bytes)

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: ThreadOwner | None = None, offset: int = 0,
                   after: ListPosition | None = None, include_archived: bool = True
                   ) -> list[ThreadRecord]:
        records = sorted(self._threads.values(), key=lambda r: (r.updated_at, r.thread_id),
                         reverse=True)
        return [r for r in records if (agent_id is None or r.agent_id == agent_id)
                and (owner is None or r.owner == owner)
                and (include_archived or not r.archived)
                and (after is None or (r.updated_at, r.thread_id) < after)
                ][offset:offset + limit]

    async def stale_threads(self, before: float, limit: int = 100) -> builtins.list[str]:
        """The ids of the threads last updated before `before` (epoch seconds), the oldest
        first, at most `limit` (what a retention sweep deletes)."""
        stale = sorted((r.updated_at, r.thread_id) for r in self._threads.values()
                       if r.updated_at < before)
        return [thread_id for _, thread_id in stale[:limit]]

    async def events_after(self, thread_id: str, position: int
                           ) -> builtins.list[Positioned]:
        record = self._threads.get(thread_id)
        if record is None:
            return []
        runs = [r for r in record.runs if r.events and ends_after(r.last_position, position)]
        kept = newest_within([r.size for r in reversed(runs)], self.replay_bytes)
        omitted = runs[:len(runs) - kept]
        # (a resume's client holds the thread's messages before its position already)
        earlier = _earlier(omitted, self.replay_bytes) if omitted and position < 0 else None
        return positioned_runs(runs[len(runs) - kept:], position, len(omitted), earlier)

    async def rename(self, thread_id: str, name: str | None, *,
                     owner: ThreadOwner | None = None) -> bool:
        record = self._threads.get(thread_id)
        if record is None or (owner is not None and record.owner != owner):
            return False
        record.name = name
        return True

    async def archive(self, thread_id: str, archived: bool = True, *,
                      owner: ThreadOwner | None = None) -> bool:
        record = self._threads.get(thread_id)
        if record is None or (owner is not None and record.owner != owner):
            return False
        record.archived = archived
        return True

    async def delete(self, thread_id: str, *, updated_before: float | None = None,
                     next_position: int | None = None) -> bool:
        record = self._threads.get(thread_id)
        if record is None or (updated_before is not None
                              and record.updated_at >= updated_before) or (
                next_position is not None and record.next_position != next_position):
            return False
        del self._threads[thread_id]
        self._bury(record)
        self.bytes -= self._sizes.pop(thread_id)
        return True

    async def first_position(self, thread_id: str) -> int:
        return self._tombstones.get(thread_id, 0)

    def _bury(self, record: ThreadRecord) -> None:
        """Keep how far a thread gone from the store had got."""
        thread_id = record.thread_id
        self._tombstones[thread_id] = max(record.next_position,
                                          self._tombstones.get(thread_id, 0))
        self._tombstones.move_to_end(thread_id)
        while len(self._tombstones) > self.max_tombstones:
            self._tombstones.popitem(last=False)

    async def aclose(self) -> None:
        self._threads.clear()
        self._sizes.clear()
        self._tombstones.clear()
        self.bytes = 0

    def reopen(self) -> None:
        """Nothing to open again after `aclose`: the store is empty, as a new one is."""


def _earlier(omitted: list[StoredRun], max_bytes: int | None) -> Event | None:
    """`earlier_messages` of the runs left out, read back as far as `max_bytes` of them
    (at least the last), as the durable stores read them."""
    newest = omitted[len(omitted) - newest_within([r.size for r in reversed(omitted)],
                                                  max_bytes):]
    return earlier_messages((r.events for r in reversed(newest)), max_bytes)


def _size(events: list[Event]) -> int:
    try:
        return len(orjson.dumps(events))
    except (orjson.JSONEncodeError, TypeError):
        return len(repr(events))  # what JSON cannot carry (the runtime never stores such)
