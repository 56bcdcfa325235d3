"""Rate-limit counters in the PostgreSQL coordinator's database, shared by every worker: the
`CounterBackend` a runtime's `RateLimit` uses when it names no backend of its own.

Their tables are versioned apart from the thread store's (which may share the schema):
`MIGRATIONS` run when the coordinator connects, under its advisory lock."""

from __future__ import annotations

import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

__all__ = ["MIGRATIONS", "PostgresCounters", "migrate"]

#: Runs a statement on a pooled connection: its rows (the server unreachable: a 503).
Fetch = Callable[[str, tuple[Any, ...] | dict[str, Any]], Awaitable[list[tuple[Any, ...]]]]

MIGRATIONS: tuple[str, ...] = (
    # 1: what releases before versioning made (IF NOT EXISTS: their deployments have it).
    """
    CREATE TABLE IF NOT EXISTS rate_hits (key text NOT NULL, at float8 NOT NULL,
                                          id text PRIMARY KEY);
    CREATE INDEX IF NOT EXISTS rate_hits_key ON rate_hits (key, at);
    CREATE TABLE IF NOT EXISTS rate_slots (key text PRIMARY KEY, taken integer NOT NULL,
                                           expires_at timestamptz NOT NULL);
    """,
    # 2: a concurrency slot is a hold by one run's token, expiring unless renewed: an
    # anonymous count per caller (rate_slots) kept a dead worker's slots for an hour.
    # rate_slots stays while workers of the previous release may still use it.
    """
    CREATE TABLE rate_slot_holds (key text NOT NULL, token text NOT NULL,
                                  expires_at timestamptz NOT NULL, PRIMARY KEY (key, token));
    """,
)


async def migrate(conn: Any, schema: str) -> None:
    """Bring the counters' tables in `schema` up to date (`conn` in a transaction that holds
    the coordinator's lock)."""
    await conn.execute(f'SET LOCAL search_path TO "{schema}"')
    await conn.execute("CREATE TABLE IF NOT EXISTS rate_limits_version (version integer)")
    row = await (await conn.execute("SELECT version FROM rate_limits_version")).fetchone()
    version = row[0] if row else 0
    # A newer release's schema is left as it is: its migrations only ever add.
    for number, migration in enumerate(MIGRATIONS, start=1):
        if number > version:
            await conn.execute(migration.encode())
    if row is None:
        await conn.execute("INSERT INTO rate_limits_version VALUES (%s)", (len(MIGRATIONS),))
    elif version < len(MIGRATIONS):
        await conn.execute("UPDATE rate_limits_version SET version = %s", (len(MIGRATIONS),))


class PostgresCounters:
    """The counters in `schema`, through the coordinator's connections: `fetch` runs one
    statement, `transaction` gives a connection inside a transaction. A slot lives
    `slot_ttl` seconds past its acquisition or last renewal, by the database's clock."""

    def __init__(self, schema: str, fetch: Fetch,
                 transaction: Callable[[], AbstractAsyncContextManager[Any]],
                 slot_ttl: float) -> None:
        self._fetch = fetch
        self._transaction = transaction
        self.slot_ttl: float | None = slot_ttl
        self.hits = f'"{schema}".rate_hits'
        self.holds = f'"{schema}".rate_slot_holds'

    async def hit(self, key: str, limit: int, window: float, token: str | None = None
                  ) -> float:
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
            await conn.execute(f"INSERT INTO {self.hits} (key, at, id) VALUES (%s, %s, %s)",
                               (key, now, token if token is not None else uuid.uuid4().hex))
        return 0.0

    async def unhit(self, key: str, token: str) -> None:
        await self._fetch(f"DELETE FROM {self.hits} WHERE key = %s AND id = %s", (key, token))

    async def acquire(self, key: str, limit: int, token: str) -> bool:
        # Counted under the key's lock (the statement's snapshot is taken once it holds it);
        # the key's expired holds (their workers died) are deleted on the way.
        async with self._transaction() as conn:
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (key,))
            if random.random() < 0.01:  # now and then, every caller's expired holds too
                await conn.execute(
                    f"DELETE FROM {self.holds} WHERE expires_at <= statement_timestamp()")
            cursor = await conn.execute(
                f"WITH gone AS (DELETE FROM {self.holds} WHERE key = %(key)s "
                "AND expires_at <= statement_timestamp()) "
                f"INSERT INTO {self.holds} (key, token, expires_at) SELECT %(key)s, "
                "%(token)s, statement_timestamp() + make_interval(secs => %(ttl)s) "
                f"WHERE (SELECT count(*) FROM {self.holds} WHERE key = %(key)s "
                "AND expires_at > statement_timestamp()) < %(limit)s RETURNING 1",
                {"key": key, "token": token, "ttl": self.slot_ttl, "limit": limit})
            return await cursor.fetchone() is not None

    async def renew(self, holds: Sequence[tuple[str, str]]) -> set[str]:
        # Only holds still live: an expired one may already count as free.
        rows = await self._fetch(
            f"UPDATE {self.holds} SET expires_at = statement_timestamp() + "
            "make_interval(secs => %s) WHERE (key, token) IN (SELECT * FROM "
            "unnest(%b::text[], %b::text[])) AND expires_at > statement_timestamp() "
            "RETURNING token",
            (self.slot_ttl, [k for k, _ in holds], [t for _, t in holds]))
        kept = {row[0] for row in rows}
        return {token for _, token in holds if token not in kept}

    async def release(self, key: str, token: str) -> None:
        await self._fetch(f"DELETE FROM {self.holds} WHERE key = %s AND token = %s",
                          (key, token))

    async def aclose(self) -> None:
        return None  # the coordinator owns the connections
