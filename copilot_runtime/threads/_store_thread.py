"""A SQLite store's calls, run on a thread of its own, in batches: what is asked for while a
batch is on the thread goes together in the next one, as soon as it is back (a lone call goes
at once).

One batch is one hop to the thread and back (a hop costs more CPU than a small query), and
a batch with writes in it is one transaction (one commit). Each write runs in a savepoint of
its own, so a bad one is undone alone and fails only its own caller; each caller returns
once the transaction holding its call committed. A caller cancelled while it waits leaves its
call queued, and it is run all the same. Calls run in the order they were asked for, so a
thread's runs keep theirs; a read in a batch with writes sees the writes queued before it,
and returns only once they committed.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

__all__ = ["Call", "StoreThread"]

_T = TypeVar("_T")


class Call(Generic[_T]):
    """`fn(*args)` on the store's thread; `write`: it changes the database."""

    __slots__ = ("args", "done", "error", "fn", "result", "write")

    def __init__(self, fn: Callable[..., _T], args: tuple[Any, ...], write: bool) -> None:
        self.fn = fn
        self.args = args
        self.write = write
        self.result: _T | None = None
        self.error: BaseException | None = None
        self.done: asyncio.Future[_T] | None = None


class StoreThread:
    def __init__(self, db: sqlite3.Connection, lock: threading.Lock, *,
                 max_batch: int = 64) -> None:
        self._db = db
        self._lock = lock
        self._max_batch = max_batch
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        self._queued: list[Call[Any]] = []
        self._busy = False  # a batch is on the thread
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it was sent from
        self._idle: list[asyncio.Future[None]] = []  # what waits until none is
        self._closed = False

    async def submit(self, call: Call[_T]) -> _T:
        if self._closed:
            raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_T] = loop.create_future()
        call.done = done
        self._queued.append(call)
        if not self._busy_on(loop):
            self._start(loop)
        # A caller cancelled here leaves its call queued: it is run all the same.
        return await done

    async def wait_idle(self) -> None:
        """Until everything asked for so far has run."""
        while self._busy_on(asyncio.get_running_loop()):
            idle = asyncio.get_running_loop().create_future()
            self._idle.append(idle)
            await idle

    async def aclose(self) -> None:
        """Once everything asked for so far has run, stop the thread."""
        await self.wait_idle()
        self._closed = True
        self._executor.shutdown(wait=False)

    def _busy_on(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether a batch is on the thread, and will be back on a loop that still runs."""
        if self._busy and self._loop is not loop and self._loop is not None \
                and self._loop.is_closed():
            # Sent from a loop closed since (a store outlives an event loop in tests and
            # under some servers): its return will never be seen. The thread runs batches
            # one after the other, so the next one can go.
            self._busy = False
            self._idle = [idle for idle in self._idle if not idle.get_loop().is_closed()]
        return self._busy

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = self._queued[:self._max_batch]
        del self._queued[:self._max_batch]
        self._busy = True
        self._loop = loop
        try:
            hop = loop.run_in_executor(self._executor, self._run, batch)
        except BaseException as e:  # the executor is shut down
            self._busy = False
            _settle(batch, e)
            raise
        hop.add_done_callback(lambda hop: self._back(loop, batch, hop))

    def _back(self, loop: asyncio.AbstractEventLoop, batch: list[Call[Any]],
              hop: asyncio.Future[None]) -> None:
        """The batch is back from the thread: wake its callers, send the next one."""
        error = (asyncio.CancelledError() if hop.cancelled() else hop.exception())
        _settle(batch, error)
        if self._queued:
            self._start(loop)
            return
        self._busy = False
        for idle in self._idle:
            if not idle.done():
                idle.set_result(None)
        self._idle.clear()

    # -- on the store's thread ------------------------------------------------------------

    def _run(self, batch: list[Call[Any]]) -> None:
        with self._lock:
            if not any(call.write for call in batch):
                for call in batch:
                    _apply(call)
                return
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                if len(batch) == 1:
                    call = batch[0]
                    call.result = call.fn(*call.args)  # its error undoes the transaction
                else:
                    for call in batch:
                        if call.write:
                            self._savepoint(call)
                        else:
                            _apply(call)
                            if not db.in_transaction:  # SQLite gave up the transaction
                                raise call.error or sqlite3.OperationalError("rolled back")
                db.execute("COMMIT")
            except BaseException as e:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                # Nothing of the batch committed: whoever did not fail on its own fails so.
                for call in batch:
                    if call.error is None:
                        call.error = e
                if not isinstance(e, Exception):
                    raise

    def _savepoint(self, call: Call[Any]) -> None:
        db = self._db
        db.execute("SAVEPOINT call")
        try:
            call.result = call.fn(*call.args)
        except Exception as e:
            call.error = e
            if not db.in_transaction:  # SQLite rolled back the whole transaction
                raise
            db.execute("ROLLBACK TO call")
        db.execute("RELEASE call")


def _apply(call: Call[Any]) -> None:
    try:
        call.result = call.fn(*call.args)
    except Exception as e:
        call.error = e


def _settle(batch: list[Call[Any]], error: BaseException | None) -> None:
    """Wake the callers of these calls (a cancelled caller is no longer waiting)."""
    for call in batch:
        done = call.done
        if done is None or done.done() or done.get_loop().is_closed():
            continue
        failed = call.error or error
        if isinstance(failed, asyncio.CancelledError):  # the loop is going away
            done.cancel()
        elif failed is not None:
            done.set_exception(failed)
        else:
            done.set_result(call.result)
