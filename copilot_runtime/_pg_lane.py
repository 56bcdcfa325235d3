"""A PostgreSQL connection of its own for work done one call at a time (one statement in
flight: a batcher's or a group writer's), kept for its owner's life.

Needs psycopg (the `postgres` extra): imported only by the PostgreSQL store and coordinator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from psycopg import AsyncConnection, AsyncCursor, pq

__all__ = ["Lane"]


class Lane:
    """A connection of its own, and one cursor on it, for work done one call at a time.

    Checking a connection out of the pool and back, and making a cursor, cost ~0.1 ms of
    CPU per query (psycopg_pool's locks and checks, the cursor's adaptation context): as
    much as the query. The lane connects on first use, and again after its connection broke
    or was left in the middle of a query (a caller cancelled), so the next call starts clean.
    """

    def __init__(self, connect: Callable[[], Awaitable[AsyncConnection[Any]]]) -> None:
        self._connect = connect
        self._conn: AsyncConnection[Any] | None = None
        self._cursor: AsyncCursor[Any] | None = None
        self._lock = asyncio.Lock()  # one call at a time, whatever the callers do

    async def __aenter__(self) -> AsyncCursor[Any]:
        await self._lock.acquire()
        try:
            if self._conn is None or self._conn.closed:
                self._conn = await self._connect()
                self._cursor = self._conn.cursor()
        except BaseException:
            self._lock.release()
            raise
        assert self._cursor is not None
        return self._cursor

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        try:
            conn = self._conn
            if conn is not None and (
                    conn.broken or conn.info.transaction_status != pq.TransactionStatus.IDLE):
                self._conn = self._cursor = None
                await conn.close()
        finally:
            self._lock.release()

    async def aclose(self) -> None:
        async with self._lock:
            if self._conn is not None:
                conn, self._conn, self._cursor = self._conn, None, None
                await conn.close()
