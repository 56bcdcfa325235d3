"""Calls made while one is in flight are made together next, as one call of a batch function
(a lone call goes at once): one round trip for many callers, without waiting for company."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["Batcher"]

T = TypeVar("T")
R = TypeVar("R")


class Batcher(Generic[T, R]):
    """`await batcher(item)` returns `run([... item ...])`'s result for `item`.

    `run` gets the items of one batch and returns their results in the same order; if it
    raises, every caller of that batch gets the error. A caller cancelled while its item
    waits does not stop the batch; `orphan` is handed the result nobody took (a lease taken
    for a caller that left, to give back); it must not raise.
    """

    def __init__(self, run: Callable[[list[T]], Awaitable[list[R]]], *, max_batch: int = 64,
                 orphan: Callable[[R], Awaitable[None]] | None = None) -> None:
        self._run = run
        self._max_batch = max_batch
        self._orphan = orphan
        self._busy = False
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._task: asyncio.Future[None] | None = None
        self._orphans: set[asyncio.Future[None]] = set()

    async def __call__(self, item: T) -> R:
        if self._busy:
            waiting: asyncio.Future[R] = asyncio.get_running_loop().create_future()
            self._queue.append((item, waiting))
            return await waiting
        self._busy = True
        try:
            return (await self._run([item]))[0]
        finally:
            if self._queue:
                self._task = asyncio.ensure_future(self._drain())
            else:
                self._busy = False

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = self._queue[:self._max_batch]
                del self._queue[:self._max_batch]
                try:
                    results = await self._run([item for item, _ in batch])
                except Exception as e:
                    for _, waiting in batch:
                        if not waiting.done():
                            waiting.set_exception(e)
                    continue
                except BaseException:
                    for _, waiting in batch + self._queue:
                        waiting.cancel()
                    self._queue.clear()
                    raise
                for (_, waiting), result in zip(batch, results, strict=True):
                    if not waiting.done():
                        waiting.set_result(result)
                    elif self._orphan is not None:
                        self._adopt(self._orphan(result))
        finally:
            self._task = None
            self._busy = False

    def _adopt(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)
