"""Threads nobody has used for a while, deleted: `CopilotRuntime(thread_retention_seconds=)`.

Every `every` seconds (the first time at a random moment of the first minute, so that workers
started together do not sweep together) the store is asked for the threads last updated
before the retention, oldest first, a batch at a time, and each is deleted as
`DELETE /threads/{id}` deletes one: what the agents keep of it first, then the store's
records; only if it is still stale once the delete holds it (used again since it was
listed, it stays). A thread with a run on it is left for the next sweep. Every worker
sweeps; deleting a thread twice is harmless (the second finds it gone), so no worker needs to
be chosen.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable

import structlog

from copilot_runtime._exceptions import ServiceUnavailableError, ThreadBusyError

__all__ = ["RetentionSweep"]

_log = structlog.get_logger("copilot_runtime.retention")

#: Threads asked of the store at a time.
_BATCH = 100
#: Deletes failing in a row (the store, or an agent's memory, away) that end a sweep.
_FAILURES = 3


class RetentionSweep:
    def __init__(self, stale: Callable[[float, int], Awaitable[list[str]]],
                 delete: Callable[[str, float], Awaitable[bool]], retention: float,
                 every: float, clock: Callable[[], Awaitable[float]] | None = None) -> None:
        self._stale = stale
        self._delete = delete
        #: The store's time, when it stamps threads by a clock of its own (a database's),
        #: else None: this process's.
        self._clock = clock
        self.retention = retention
        self.every = every
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._forever())

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _forever(self) -> None:
        await asyncio.sleep(random.uniform(0, min(self.every, 60.0)))
        failing = False
        while True:
            try:
                await self.sweep()
                failing = False
            except ServiceUnavailableError as exc:
                if not failing:  # told once per outage
                    _log.warning("thread retention sweep put off: the store cannot be "
                                 "reached", error=exc.message)
                failing = True
            except Exception:
                _log.exception("thread retention sweep failed")
            await asyncio.sleep(self.every)

    async def sweep(self) -> int:
        """Delete the threads last updated more than `retention` seconds ago; how many."""
        # By the clock the store stamps threads with: a worker whose clock is behind or
        # ahead of the one that ran a thread would sweep it early, or late.
        now = time.time() if self._clock is None else await self._clock()
        cutoff = now - self.retention
        deleted = 0
        # Left for the next sweep: busy now, gone meanwhile, or what an agent keeps of it
        # could not be deleted (logged where it failed).
        left: set[str] = set()
        failures = 0
        while True:
            asked = _BATCH + len(left)
            ids = await self._stale(cutoff, asked)
            todo = [thread_id for thread_id in ids if thread_id not in left]
            for thread_id in todo:
                try:
                    # Only if still stale as it is deleted: its owner may have used it
                    # since it was listed (on any worker).
                    if await self._delete(thread_id, cutoff):
                        deleted += 1
                    else:
                        left.add(thread_id)
                    failures = 0
                except ThreadBusyError:
                    left.add(thread_id)
                except ServiceUnavailableError:
                    left.add(thread_id)
                    failures += 1
                    if failures >= _FAILURES:  # the store itself, most likely
                        raise
            if not todo or len(ids) < asked:
                break
        if deleted:
            _log.info("deleted threads unused for longer than the retention",
                      threads=deleted, retention_seconds=self.retention)
        return deleted
