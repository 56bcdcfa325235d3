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

The thread is a daemon started on demand: idle for `idle_timeout` seconds, it ends, and the
next call starts another; the store's `release()` ends it at once (a store closed, or
garbage-collected). A store dropped without `aclose()` so leaves no thread behind. At the
process's exit, each thread is let finish the batch it runs (as a daemon it would be cut
short there, its transaction rolled back).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable
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


#: A batch for the thread: its calls, and the loop and future to tell when it is done.
_Hop = tuple[list[Call[Any]], asyncio.AbstractEventLoop, asyncio.Future[None]]

#: The threads there now, each with what it takes batches from (for the exit).
_running: dict[threading.Thread, queue.SimpleQueue[_Hop | None]] = {}
#: Seconds the exit waits for a thread's batch (longer than a batch waits for the file: the
#: store's `busy_timeout`, 5 s by default).
_EXIT_WAIT = 35.0


@atexit.register
def _let_batches_finish() -> None:
    for hops in list(_running.values()):
        hops.put(None)  # after the batch sent before: it runs first
    for worker in list(_running):
        worker.join(_EXIT_WAIT)


class StoreThread:
    #: Seconds the thread waits for work before it ends (the next call starts a new one).
    idle_timeout = 10.0

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock, *,
                 max_batch: int = 64) -> None:
        self._db = db
        self._lock = lock
        self._max_batch = max_batch
        self._hops: queue.SimpleQueue[_Hop | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._worker_lock = threading.Lock()  # whether a thread is there to take a hop
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
        self.release()

    def release(self) -> None:
        """End the thread once it has run what it was sent, not once it has idled (the
        store is closed, or gone); a call after this starts another."""
        self._hops.put(None)

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
        if self._closed:  # pragma: no cover - aclose waits for the calls asked for
            self._busy = False
            error = sqlite3.ProgrammingError("Cannot operate on a closed database.")
            _settle(batch, error)
            raise error
        hop: asyncio.Future[None] = loop.create_future()
        self._hops.put((batch, loop, hop))
        with self._worker_lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="sqlite-store",
                                                daemon=True)
                _running[self._worker] = self._hops
                self._worker.start()
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

    def _serve(self) -> None:
        """Run batches until idle for `idle_timeout` seconds, or released."""
        try:
            self._serve_batches()
        finally:
            _running.pop(threading.current_thread(), None)

    def _serve_batches(self) -> None:
        while True:
            try:
                hop = self._hops.get(timeout=self.idle_timeout)
            except queue.Empty:
                with self._worker_lock:
                    if self._hops.empty():  # else a hop came just now: it is ours
                        self._worker = None
                        return
                continue
            if hop is None:  # released
                with self._worker_lock:
                    self._worker = None
                return
            self._take(*hop)
            # Not kept while idle: the batch's calls hold the store, which may be dropped.
            del hop

    def _take(self, batch: list[Call[Any]], loop: asyncio.AbstractEventLoop,
              done: asyncio.Future[None]) -> None:
        error: BaseException | None = None
        try:
            self._run(batch)
        except BaseException as e:
            error = e
        with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits
            loop.call_soon_threadsafe(_finish, done, error)

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


def _finish(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


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
