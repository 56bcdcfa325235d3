"""Group commit for a store's writes: what is asked for while a write is in flight is written
together next, in one statement, as soon as it completes (a lone write goes at once).

Each caller returns once the statement holding its item committed. A statement the server
refuses is written again item by item, so a bad item fails only its own caller; a caller
cancelled while it waits leaves its item queued, and it is written all the same. A statement
whose connection broke (the server restarted, the network failed) may or may not have
committed: it is sent once more on a new connection, so the write functions must be
idempotent (a batch written twice is stored once).

Each writer writes through a `Lane` (`copilot_runtime._pg_lane`): a connection of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import psycopg
from psycopg import AsyncCursor

from copilot_runtime._pg_lane import Lane

__all__ = ["GroupedWriter", "Pending"]


class Pending(Protocol):
    """An item to write: the thread it belongs to, and what its caller awaits."""

    thread_id: str
    done: asyncio.Future[None]


ItemT = TypeVar("ItemT", bound=Pending)
#: Writes a batch (items of distinct threads) in one statement.
Write = Callable[[AsyncCursor[Any], Sequence[ItemT]], Awaitable[None]]
#: What to do on the connection after a batch committed (housekeeping; must not raise).
After = Callable[[AsyncCursor[Any]], Awaitable[None]]


class GroupedWriter(Generic[ItemT]):
    def __init__(self, lane: Lane, write: Write[ItemT], *, max_batch: int = 32,
                 after: After | None = None) -> None:
        self.lane = lane
        self._write = write
        self._max_batch = max_batch
        self._after = after
        self._queued: list[ItemT] = []
        self._writer: asyncio.Future[None] | None = None
        self._writing = False  # a write is in flight
        self._idle = asyncio.Event()  # set while none is
        self._idle.set()

    async def write(self, item: ItemT) -> None:
        if not self._writing:
            # Nothing in flight: this item is written at once, by its caller.
            self._writing = True
            self._idle.clear()
            try:
                await self._written([item])
            finally:
                self._drain()
            return
        self._queued.append(item)
        # A caller cancelled here leaves its item queued: it is written all the same.
        await item.done

    async def wait_idle(self) -> None:
        """Until everything written or queued so far is written."""
        await self._idle.wait()

    def _drain(self) -> None:
        """The write in flight is over: what was queued meanwhile is written next, by a task
        of its own (so that no caller's cancellation can stop its write)."""
        if self._queued:
            self._writer = asyncio.ensure_future(self._write_queued())
        else:
            self._writing = False
            self._idle.set()

    async def _write_queued(self) -> None:
        batch: list[ItemT] = []
        try:
            while self._queued:
                batch = self._next_batch()
                await self._write_batch(batch)
                batch = []
        except BaseException as e:  # cancelled with the loop, or a bug: no caller waits forever
            for item in batch + self._queued:
                if item.done.done():
                    continue
                if isinstance(e, asyncio.CancelledError):
                    item.done.cancel()
                else:
                    item.done.set_exception(e)
            self._queued.clear()
            raise
        finally:
            self._writer = None
            self._writing = False
            self._idle.set()

    def _next_batch(self) -> list[ItemT]:
        """The next batch off the queue, in order: at most `max_batch` items and one per
        thread (a thread's later items wait for the next batch, keeping their order)."""
        batch: list[ItemT] = []
        threads: set[str] = set()
        rest: list[ItemT] = []
        for item in self._queued:
            if len(batch) < self._max_batch and item.thread_id not in threads:
                batch.append(item)
            else:
                rest.append(item)
            threads.add(item.thread_id)  # its later items wait too
        self._queued[:] = rest
        return batch

    async def _written(self, batch: list[ItemT]) -> None:
        """Write `batch` in one statement, and once more on a new connection if its
        connection broke (it may have committed: the write is idempotent). Its callers are
        woken once it committed, then `after` runs."""
        for attempt in (1, 2):
            async with self.lane as cursor:
                try:
                    await self._write(cursor, batch)
                except Exception:
                    if attempt == 1 and cursor.connection.broken:
                        continue  # the lane connects again
                    raise
                _settle(batch, None)
                if self._after is not None:
                    await self._after(cursor)
                return

    async def _write_batch(self, batch: list[ItemT]) -> None:
        if len(batch) > 1:
            # Threads are locked in one order, so batches of several workers do not
            # deadlock each other.
            batch.sort(key=lambda item: item.thread_id)
            try:
                await self._written(batch)
                return
            except Exception as e:
                if not _refused(e):
                    _settle(batch, e)  # no connection: no item to single out
                    return
            # The server refused the statement: each item alone, so that one bad item fails
            # only its own caller.
        for item in batch:
            try:
                await self._written([item])
            except Exception as e:
                _settle([item], e)


def _refused(error: Exception) -> bool:
    """Whether the server refused a statement (its data or its form), rather than the
    connection failing or the server being unable to run it now."""
    return isinstance(error, psycopg.DatabaseError) and not isinstance(
        error, psycopg.OperationalError)


def _settle(batch: Sequence[Pending], error: BaseException | None) -> None:
    """Wake the callers of these items (a cancelled caller is no longer waiting)."""
    for item in batch:
        if item.done.done():
            continue
        if error is None:
            item.done.set_result(None)
        else:
            item.done.set_exception(error)
