"""What a runtime does for runs that other workers drive (shared coordinators only).

`follow` replays a thread from the shared store and then follows its live run wherever it
runs: every progress signal (and, should signals be lost, a slow poll) reads the events
stored after the last position read, until the run ends. `RecoverySweep` closes, through the
store, the runs left open by a worker that died: their lease expired, so nobody renews it.
The sweeper takes the thread's lease while it closes the run, so one worker wins.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Container, Sequence

import structlog

from copilot_runtime._again import worth_logging
from copilot_runtime._exceptions import ServiceUnavailableError
from copilot_runtime.coordination import Coordinator, Signal
from copilot_runtime.threads.base import DurableThreadStore, Positioned, ThreadStore

__all__ = ["RecoverySweep", "follow", "not_again", "replay_stored", "unreached"]

_log = structlog.get_logger("copilot_runtime.runs")
#: Seconds after its expiry that a lease never released (its worker died) is deleted.
_FORGET_AFTER = 3600.0

#: Seconds between reads of the store while no signal comes (a lost signal costs this).
POLL = 1.0
#: Seconds within which a run's worker has written what it streamed (its writes' interval, 0.2
#: s, and the write): a follower waits that long to tell a position it never reached.
_WRITTEN_WITHIN = 2.0
_TERMINAL = ("RUN_FINISHED", "RUN_ERROR")


async def follow(coordinator: Coordinator, store: ThreadStore, thread_id: str, after: int = -1,
                 *, sent: bool = False) -> AsyncGenerator[Sequence[Positioned], None]:
    """The thread's stored events after position `after` (all for -1), then those of its
    live run on any worker, to the run's end; each with its position. `sent`: `after` is
    that of an event read from the store and sent, not the client's."""
    with coordinator.subscribe(thread_id) as signals:
        batch, position = await _read(store, thread_id, after, resumed=not sent)
        # Followed from now on: its worker signals its progress and end to us.
        live = await coordinator.follow(thread_id)
        unsure: _Unsure | None = None
        if not batch and after >= 0:
            if live is None:
                batch = await replay_stored(store, thread_id, after)
                position = _last_position(batch, -1) if batch else position
            else:
                # A live run's events may be ahead of the store: `after` may be one of
                # them, not yet written. Told once the store holds what was sent before.
                unsure = _Unsure(after)
                if await unsure.known(store, thread_id) is False:
                    unsure = None  # a position the store holds: the client saw it all
        end = _RunEnd(live)
        batch, ended = end.cut(batch)
        yield batch  # even empty: the thread could be read (see `RunManager.replay`)
        if ended:
            return
        last: Positioned | None = batch[-1] if batch else None
        deadline: float | None = None
        while True:
            while live is not None:
                signal = await signals.get(POLL)
                if signal is None or (signal.kind == "progress" and (
                        signal.position is None or signal.position > position
                        or unsure is not None)):
                    batch, position = await _read(store, thread_id, position,
                                                  resumed=last is None)
                    if batch:
                        unsure = None
                    elif unsure is not None and (whole := await unsure.known(
                            store, thread_id)) is not None:
                        unsure = None
                        if whole:
                            batch, position = await _read(store, thread_id, -1)
                    if batch:
                        # Its end read from the store ends the stream: its `end` signal
                        # may never come (the coordinator away, or a signal lost).
                        batch, ended = end.cut(batch)
                        last = batch[-1]
                        yield batch
                        if ended:
                            return
                if signal is None:
                    try:
                        live = await coordinator.follow(thread_id)
                    except ServiceUnavailableError:
                        continue  # the coordinator is away: the store still has the events
                    if live != end.run_id:
                        live = None  # another run holds the thread: the one followed ended
                elif signal.kind == "end" and signal.run_id == live:
                    live = None
            # The run's last events were stored before its lease was released.
            if unsure is not None:
                unsure = None  # the thread is at rest: it tells
                batch = await replay_stored(store, thread_id, position)
                position = _last_position(batch, position)
            else:
                batch, position = await _read(store, thread_id, position,
                                              resumed=last is None)
            batch, ended = end.cut(batch, over=True)
            if batch:
                last = batch[-1]
                yield batch
            if ended or last is None or last[1].get("type") in _TERMINAL:
                return
            # The stream stops inside a run: with no run followed yet, the run whose
            # RUN_STARTED was read (a dead worker's: nobody held its lease at connect), or if
            # none was (a resume inside a run), the run live now; else the followed run
            # whose end is not stored yet, or a run whose worker died, closed as
            # interrupted by a sweep or the thread's next run within twice `lease_ttl` or so
            # (waited for, bounded, so the follower gets the RUN_ERROR instead of a stream
            # cut in a message). A run after the one followed is another response's: never
            # streamed in this one.
            if end.run_id is None:
                end.run_id = end.open
            with contextlib.suppress(ServiceUnavailableError):
                live = await coordinator.follow(thread_id)
            if live is not None and end.run_id in (None, live):
                end.run_id = live
                deadline = None
                continue
            live = None
            now = asyncio.get_running_loop().time()
            if deadline is None:
                deadline = now + 2 * coordinator.lease_ttl + 10
            elif now >= deadline:
                return
            await asyncio.sleep(POLL)


class _RunEnd:
    """Where the followed run ends in the thread's events as they are read: its
    RUN_FINISHED (which names it), or the RUN_ERROR after its RUN_STARTED."""

    def __init__(self, run_id: str | None) -> None:
        #: The run followed (None: none yet).
        self.run_id = run_id
        #: The run of the last RUN_STARTED read (None: none read, a resume inside a run).
        self.running: str | None = None
        #: `running` while no end was read after its RUN_STARTED (None: none such).
        self.open: str | None = None
        #: A RUN_ERROR of a run begun before the first event read was passed: the followed
        #: run's end, unless its RUN_STARTED comes after it (a resume inside an earlier run).
        self.maybe_ended = False

    def cut(self, batch: list[Positioned], *, over: bool = False
            ) -> tuple[list[Positioned], bool]:
        """`batch` up to the followed run's end, and whether it ended. `over`: the run is
        known to have ended (its events all stored), so an end that `batch` cannot name
        is its end unless its RUN_STARTED comes later in `batch`."""
        if over and self.maybe_ended and not _starts(batch, self.run_id):
            return [], True
        for index, (_, event) in enumerate(batch):
            kind = event.get("type")
            if kind == "RUN_STARTED":
                self.running = self.open = event.get("runId")
                self.maybe_ended = False
            elif kind in _TERMINAL:
                self.open = None
                if self.run_id is None:
                    continue  # no run followed yet: nothing of it to end
                owner = event.get("runId") or self.running
                if owner == self.run_id or (owner is None and over and not _starts(
                        batch[index + 1:], self.run_id)):
                    return batch[:index + 1], True
                self.maybe_ended = owner is None
        return batch, False


def _starts(rows: list[Positioned], run_id: str | None) -> bool:
    """Whether `rows` hold run `run_id`'s RUN_STARTED."""
    return any(e.get("type") == "RUN_STARTED" and e.get("runId") == run_id for _, e in rows)


def unreached(after: int, next_position: int) -> bool:
    """Whether `after`, a client's position (-1: none), names no event of a thread whose
    next position is `next_position`.

    Such an id came from some other history of the thread's id (an in-memory store
    restarted, or one that forgot the thread, or another thread), and following it would
    hide the thread's events up to it, now and in every run to come until the positions pass
    it. The whole thread is replayed instead (ids lower than the client's say so)."""
    return after >= max(next_position, 0)


class _Unsure:
    """A client's position past the stored events of a thread whose run another worker
    drives: perhaps one of the run's events, sent but not yet written.

    The run's worker writes what it streamed every `FLUSH_INTERVAL` (0.2 s), one write after
    the other, each with everything streamed until it began. Once the store's next position
    has grown twice since the first look (taken after the client connected), the second
    write began after that look, so it holds every event the client could have been sent;
    a run that streams nothing more has written it all once the position stays put for
    `_WRITTEN_WITHIN`. A position still past the store's then names no event of the thread."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.seen: list[int] = []  # the store's next positions, each larger than the last
        self.since = 0.0  # when the last of them was first seen (loop time)

    async def known(self, store: ThreadStore, thread_id: str) -> bool | None:
        """True: the position names no event (replay the whole thread); False: the store
        holds it; None: not known yet."""
        record = await store.summary(thread_id)
        next_position = record.next_position if record is not None else 0
        if not unreached(self.after, next_position):
            return False
        now = asyncio.get_running_loop().time()
        if not self.seen or next_position > self.seen[-1]:
            self.seen.append(next_position)
            self.since = now
        return True if len(self.seen) > 2 or now - self.since >= _WRITTEN_WITHIN else None


async def replay_stored(store: ThreadStore, thread_id: str, after: int) -> list[Positioned]:
    """A thread at rest (no run on it) as the store replays it after position `after`: the
    whole thread if `after` is past its positions (see `unreached`)."""
    rows = await store.events_after(thread_id, after)
    if rows or after < 0:
        return rows
    record = await store.summary(thread_id)
    if record is None or not unreached(after, record.next_position):
        return rows
    return await store.events_after(thread_id, -1)


async def _read(store: ThreadStore, thread_id: str, position: int, *, resumed: bool = False
                ) -> tuple[list[Positioned], int]:
    """The events stored after `position`, and the position to read after next. `resumed`:
    `position` is the client's, not that of an event read."""
    rows = await store.events_after(thread_id, position)
    if not resumed:
        rows = not_again(rows, position)
    return rows, _last_position(rows, position)


def not_again(rows: list[Positioned], position: int) -> list[Positioned]:
    """`rows`, read after `position` (that of an event sent), without those at or before it:
    a client resumed among a swept run's closing events was sent them all, which a store
    gives again after the last of them (`resumed_at`, the client's id is not the store's)."""
    sent = max((index + 1 for index, (at, _) in enumerate(rows)
                if at is not None and at <= position), default=0)
    return rows[sent:]


def _last_position(rows: Sequence[Positioned], position: int) -> int:
    """The position of the last of `rows` that has one (`position` if none has)."""
    for row_position, _ in reversed(rows):
        if row_position is not None:
            return row_position
    return position


class RecoverySweep:
    """Every `interval` seconds, close the open runs whose lease expired as interrupted
    (none of `active`, the threads whose runs this process drives)."""

    def __init__(self, store: DurableThreadStore | None, active: Container[str],
                 coordinator: Coordinator, interval: float | None = None) -> None:
        self.store = store
        self.active = active
        self.coordinator = coordinator
        self.interval = interval if interval is not None else min(5.0,
                                                                  coordinator.lease_ttl / 2)
        self._task: asyncio.Task[None] | None = None
        self._forgot = float("-inf")
        #: Open runs found without a lease holder, and when first found so (loop time).
        self._orphans: dict[tuple[str, str], float] = {}

    def start(self) -> None:
        if self._task is None and self.store is not None:
            self._task = asyncio.create_task(self._loop())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        failures = 0  # in a row: an outage is told now and then, not every interval
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sweep()
            except ServiceUnavailableError as exc:
                failures += 1
                if worth_logging(failures):
                    _log.warning("recovery sweep: tried again next time", error=str(exc),
                                 failures_in_a_row=failures)
                continue
            except Exception:
                failures += 1
                if worth_logging(failures):
                    _log.exception("recovery sweep failed", failures_in_a_row=failures)
                continue
            if failures:
                _log.info("recovery sweep works again", failures_in_a_row=failures)
                failures = 0

    async def sweep(self) -> int:
        """Close the runs whose worker is gone; how many this worker closed."""
        store = self.store
        if store is None:
            return 0
        closed = 0
        now = asyncio.get_running_loop().time()
        orphans, self._orphans = self._orphans, {}
        for thread_id, run_id in await store.open_runs():
            if thread_id in self.active or \
                    await self.coordinator.holder(thread_id) is not None:
                continue
            # No holder is not yet a dead worker: a coordinator that lost its state (a
            # restart without persistence, a failover, a restore) has no holder either, while
            # the run's worker streams on until its next renewal. Closed once it stayed so
            # for a lease's life: by then a live worker has stopped it (LEASE_LOST).
            found = self._orphans[(thread_id, run_id)] = orphans.get((thread_id, run_id), now)
            if now - found < self.coordinator.lease_ttl:
                continue
            lease = await self.coordinator.acquire(thread_id, f"recovery:{run_id}")
            if lease is None:
                continue  # another worker is at it, or a new run started
            try:
                if await store.close_interrupted(thread_id, run_id):
                    closed += 1
                    _log.warning("closed a run its worker left open", thread_id=thread_id,
                                 run_id=run_id)
            finally:
                await self.coordinator.release(lease)
            await self.coordinator.publish(Signal("end", thread_id, run_id))
        # Leases of workers that died before their run's start was written have no run for
        # the loop above: long after any sweep would have closed one, they are only clutter.
        now = asyncio.get_running_loop().time()
        if now - self._forgot >= _FORGET_AFTER / 10:
            self._forgot = now
            await self.coordinator.forget_expired(
                max(_FORGET_AFTER, 10 * self.coordinator.lease_ttl))
        return closed
