"""Rate-limit counters in the PostgreSQL coordinator's database, shared by every worker: the
`CounterBackend` a runtime's `RateLimit` uses when it names no backend of its own."""

from __future__ import annotations

import random
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

__all__ = ["PostgresCounters"]

#: Runs a statement on a pooled connection: its rows (the server unreachable: a 503).
Fetch = Callable[[str, tuple[Any, ...] | dict[str, Any]], Awaitable[list[tuple[Any, ...]]]]

#: A concurrency slot a crashed worker never gave back frees itself after this long.
_SLOT_TTL = 3600


class PostgresCounters:
    """The counters in `schema`, through the coordinator's connections: `fetch` runs one
    statement, `transaction` gives a connection inside a transaction."""

    def __init__(self, schema: str, fetch: Fetch,
                 transaction: Callable[[], AbstractAsyncContextManager[Any]]) -> None:
        self._fetch = fetch
        self._transaction = transaction
        self.hits = f'"{schema}".rate_hits'
        self.slots = f'"{schema}".rate_slots'

    async def hit(self, key: str, limit: int, window: float) -> float:
        # Serialized per key by a transaction lock; measured by the database's clock.
        async with self._transaction() as conn:
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (key,))
            cursor = await conn.execute(
                f"SELECT extract(epoch FROM clock_timestamp())::float8, count(*), "
                f"min(at) FROM {self.hits} WHERE key = %s AND at > "
                f"extract(epoch FROM clock_timestamp()) - %s", (key, window))
            row = await cursor.fetchone()
            assert row is not None
            now, count, oldest = row
            if count >= limit:
                return max(float(oldest) + window - float(now), 0.001)
            await conn.execute(f"DELETE FROM {self.hits} WHERE key = %s AND at <= %s",
                               (key, float(now) - window))
            if random.random() < 0.01:  # now and then, every caller's old rows too
                await conn.execute(f"DELETE FROM {self.hits} WHERE at <= %s",
                                   (float(now) - window,))
                await conn.execute(f"DELETE FROM {self.slots} WHERE taken = 0 "
                                   "OR expires_at < now()")
            await conn.execute(f"INSERT INTO {self.hits} (key, at, id) VALUES (%s, %s, %s)",
                               (key, now, uuid.uuid4().hex))
        return 0.0

    async def acquire(self, key: str, limit: int) -> bool:
        rows = await self._fetch(
            f"INSERT INTO {self.slots} AS s (key, taken, expires_at) VALUES "
            f"(%(key)s, 1, now() + make_interval(secs => %(ttl)s)) ON CONFLICT (key) DO UPDATE "
            f"SET taken = CASE WHEN s.expires_at < now() THEN 1 ELSE s.taken + 1 END, "
            # renewed only when the period starts again (taken back to 0, or expired): a
            # slot a dead worker kept must expire however active its caller stays
            f"expires_at = CASE WHEN s.expires_at < now() OR s.taken = 0 "
            f"THEN excluded.expires_at ELSE s.expires_at END "
            f"WHERE s.expires_at < now() OR s.taken < %(limit)s RETURNING taken",
            {"key": key, "ttl": _SLOT_TTL, "limit": limit})
        return bool(rows)

    async def release(self, key: str) -> None:
        await self._fetch(
            f"UPDATE {self.slots} SET taken = greatest(taken - 1, 0) WHERE key = %s", (key,))

    async def aclose(self) -> None:
        return None  # the coordinator owns the connections
