"""Coordination on PostgreSQL: leases in a table, signals by LISTEN/NOTIFY.

A run's `progress` and `end` are only notified once another worker follows it (a flag on its
lease): a notification is delivered to, and decoded by, every listening worker, and
PostgreSQL serializes the commits that notify; a run nobody follows needs none.

`postgresql://user@host:port/db?schema=NAME&lease_ttl=SECONDS&pool_size=N` (needs psycopg 3
and psycopg_pool, in the `postgres` extra; `pool_size`: the most pooled connections, 4 by
default, beside the three of its own). The lease table lives in `schema` (created if
missing), beside the thread store's tables when both use the same URL. Expiry is decided by
the database's clock, so workers' clocks need not agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

from copilot_runtime._deadline import within
from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime._url_options import (
    lease_ttl_option,
    pool_size_option,
    schema_option,
    split_options,
)
from copilot_runtime.coordination._pg_counters import PostgresCounters, migrate
from copilot_runtime.coordination._shared import (
    DEFAULT_LEASE_TTL,
    PING_EVERY,
    PONG_WITHIN,
    SharedCoordinator,
)
from copilot_runtime.coordination.base import Lease, Signal
from copilot_runtime.limits import CounterBackend

__all__ = ["PostgresCoordinator"]

_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,40}")
#: NOTIFY payloads must stay under 8000 bytes; a longer signal is not sent (followers poll).
_MAX_PAYLOAD = 7900
#: The LISTEN connection's query after silence, and its answer's bound (as Redis's ping).
_PING_EVERY = PING_EVERY
_PONG_WITHIN = PONG_WITHIN
#: The lease table's columns added since its first release, and their types. `stopped_run`:
#: the run a stop was asked for (on any worker), named so that a worker of the previous
#: release taking the lease over never inherits the mark.
_ADDED_COLUMNS = {"followed": "boolean NOT NULL DEFAULT false", "stopped_run": "text"}


class PostgresCoordinator(SharedCoordinator):
    def __init__(self, url: str, *, schema: str | None = None,
                 lease_ttl: float | None = None, max_connections: int | None = None) -> None:
        try:
            import psycopg
            import psycopg_pool  # noqa: F401
        except ImportError as exc:
            raise ImportError("the PostgreSQL coordinator needs psycopg and psycopg_pool: pip "
                              "install 'copilot-runtime[postgres]'", name=exc.name) from exc
        conninfo, options = split_options(url, ("schema", "lease_ttl", "pool_size"))
        self.unreachable = (psycopg.OperationalError, psycopg.InterfaceError)
        #: A standby (after a failover, or a primary demoted) answers every write, LISTEN and
        #: NOTIFY "cannot execute ... in a read-only transaction" (or "during recovery"):
        #: the server is there but cannot serve now.
        self._read_only = psycopg.errors.ReadOnlySqlTransaction
        from copilot_runtime._pg_lane import with_session_defaults

        conninfo = with_session_defaults(conninfo, connect_timeout=5,
                                         application_name="copilot-runtime coordinator")
        super().__init__(lease_ttl if lease_ttl is not None
                         else lease_ttl_option(options, DEFAULT_LEASE_TTL))
        self.schema = schema or schema_option(options) or "copilot_runtime"
        if not _SCHEMA.fullmatch(self.schema):
            raise ConfigurationError(f"schema must be a lower-case SQL name, got "
                                     f"{self.schema!r}")
        self.conninfo = conninfo
        self.channel = f"copilot_runtime_{self.schema}"
        self.table = f'"{self.schema}".run_leases'
        self.max_connections = max_connections if max_connections is not None \
            else pool_size_option(options, 4)
        self._pool: Any = None
        # Leases taken, and leases given back with signals sent, go one statement at a time
        # (their batchers') over a connection of their own each: no check-out from the pool.
        self._taking: Any = None
        self._ending: Any = None

    def _cannot_serve_now(self, exc: BaseException) -> bool:
        return isinstance(exc, self._read_only)

    async def _connect(self) -> None:
        from psycopg_pool import AsyncConnectionPool

        from copilot_runtime._pg_lane import check_alive

        # One attempt first: a server that cannot be reached fails the start within the 5 s
        # of an attempt, with its reason (the pool tried for 15 s, logging each attempt).
        await (await self._connect_one()).close()
        # A check-out waits at most as long as a connection attempt (the pool's default,
        # 30 s, held a request that long while the server was down).
        pool = AsyncConnectionPool(self.conninfo, min_size=1, max_size=self.max_connections,
                                   kwargs={"autocommit": True}, open=False, timeout=5.0,
                                   configure=_configure, check=check_alive,
                                   # psycopg_pool backs off 1, 2, 4, 8, 16 s...: after a
                                   # long outage its next attempt came up to the outage's
                                   # length after the server was back. Given up within
                                   # seconds, the next check-out starts again at 1 s.
                                   reconnect_timeout=5.0)
        try:
            await pool.open(wait=True, timeout=15)
        except BaseException:
            await pool.close()  # else it keeps trying to connect, for nobody
            raise
        self._pool = pool
        from copilot_runtime._pg_lane import Lane, create_schema

        self._taking, self._ending = Lane(self._connect_one), Lane(self._connect_one)
        async with pool.connection() as conn, conn.transaction():
            # Workers starting together take turns creating the schema and the table.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))",
                               (f"copilot_runtime.coordination.{self.schema}",))
            await create_schema(conn, self.schema)
            await conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self.table} (thread_id text PRIMARY KEY, "
                "run_id text NOT NULL, token text NOT NULL, worker text NOT NULL, "
                "expires_at timestamptz NOT NULL, followed boolean NOT NULL DEFAULT false, "
                "stopped_run text)")
            # A table made before runs could be followed, or marked as being stopped, gets
            # the columns (altered only then: ALTER TABLE locks out the running workers'
            # leases while it waits).
            found = {row[0] for row in await (await conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass "
                "AND attname IN ('followed', 'stopped_run') AND NOT attisdropped",
                (self.table,))).fetchall()}
            for column, kind in _ADDED_COLUMNS.items():
                if column not in found:
                    await conn.execute(f"ALTER TABLE {self.table} ADD COLUMN {column} {kind}")
            await migrate(conn, self.schema)

    async def _listen(self, ready: asyncio.Future[None]) -> None:
        import psycopg

        conn = await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True)
        try:
            await conn.execute(f'LISTEN "{self.channel}"')
            if not ready.done():
                ready.set_result(None)
            loop = asyncio.get_running_loop()
            heard = loop.time()
            while True:
                async for notify in conn.notifies(
                        timeout=max(heard + _PING_EVERY - loop.time(), 0.0)):
                    heard = loop.time()
                    signal = Signal.decode(notify.payload)
                    if signal is not None:
                        self._hub.deliver(signal)
                if loop.time() - heard >= _PING_EVERY:
                    await _answers(conn)
                    heard = loop.time()
        finally:
            await conn.close()

    async def _renew(self, leases: list[Lease]) -> set[str]:
        rows = await self._fetch(
            f"UPDATE {self.table} SET expires_at = now() + make_interval(secs => %s) "
            "WHERE (thread_id, token) IN (SELECT * FROM unnest(%b::text[], %b::text[])) "
            "RETURNING thread_id",
            (self.lease_ttl, [x.thread_id for x in leases], [x.token for x in leases]))
        kept = {row[0] for row in rows}
        return {x.thread_id for x in leases} - kept

    async def _connect_one(self) -> Any:
        import psycopg

        conn = await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True)
        await _configure(conn)
        return conn

    async def _disconnect(self) -> None:
        for lane in (self._taking, self._ending):
            if lane is not None:
                await lane.aclose()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _fetch(self, query: str, params: tuple[Any, ...] | dict[str, Any]
                     ) -> list[tuple[Any, ...]]:
        async with self._reachable():
            await self.start()
            async with self._pool.connection() as conn:
                return await _rows(conn.cursor(), query, params)

    async def _fetch_on(self, lane: Any, query: str, params: tuple[Any, ...]
                        ) -> list[tuple[Any, ...]]:
        async with self._reachable(), lane as cursor:
            return await _rows(cursor, query, params)

    async def _acquire_many(self, asked: list[tuple[str, str, str]]) -> list[Lease | None]:
        first: dict[str, tuple[str, str, str]] = {}
        for item in asked:
            first.setdefault(item[0], item)  # a thread asked for twice: only one can win
        rows = await self._fetch_on(
            self._taking,
            f"INSERT INTO {self.table} AS held (thread_id, run_id, token, worker, expires_at) "
            "SELECT t, r, k, %s, now() + make_interval(secs => %s) "
            "FROM unnest(%b::text[], %b::text[], %b::text[]) AS u(t, r, k) "
            "ON CONFLICT (thread_id) DO UPDATE SET run_id = excluded.run_id, "
            "token = excluded.token, worker = excluded.worker, "
            "expires_at = excluded.expires_at, followed = false, stopped_run = NULL "
            "WHERE held.expires_at < now() "
            # xmax is set on a row the statement updated: an expired lease, never released.
            "RETURNING token, xmax <> 0",
            (self.worker, self.lease_ttl, [t for t, _, _ in first.values()],
             [r for _, r, _ in first.values()], [k for _, _, k in first.values()]))
        won = {token: bool(expired) for token, expired in rows}
        return [Lease(thread, run, token, won[token]) if token in won else None
                for thread, run, token in asked]

    async def release(self, lease: Lease) -> None:
        self._drop(lease)
        await self._fetch(f"DELETE FROM {self.table} WHERE thread_id = %s AND token = %s",
                          (lease.thread_id, lease.token))

    async def _finish_many(self, leases: list[Lease]) -> list[None]:
        # Released in one statement, which notifies the end of the runs someone follows (the
        # flag read from the row it deletes: a follower marking it meanwhile is waited for).
        await self._fetch_on(
            self._ending, "WITH ended AS (SELECT * FROM unnest(%b::text[], %b::text[], %b::text[]) "
            f"AS e(thread_id, token, signal)), gone AS (DELETE FROM {self.table} l "
            "USING ended WHERE l.thread_id = ended.thread_id AND l.token = ended.token "
            "RETURNING l.thread_id, l.followed) "
            "SELECT pg_notify(%s, ended.signal) FROM ended JOIN gone "
            "ON gone.thread_id = ended.thread_id WHERE gone.followed",
            ([x.thread_id for x in leases], [x.token for x in leases],
             [Signal("end", x.thread_id, x.run_id).encode().decode() for x in leases],
             self.channel))
        return [None] * len(leases)

    async def mark_stopping(self, thread_id: str, run_id: str) -> None:
        await self._fetch(
            f"UPDATE {self.table} SET stopped_run = run_id WHERE thread_id = %s "
            "AND run_id = %s AND expires_at >= now()", (thread_id, run_id))

    async def holder_stopping(self, thread_id: str) -> tuple[str | None, bool]:
        rows = await self._fetch(
            f"SELECT run_id, stopped_run IS NOT DISTINCT FROM run_id FROM {self.table} "
            "WHERE thread_id = %s AND expires_at >= now()", (thread_id,))
        return (str(rows[0][0]), bool(rows[0][1])) if rows else (None, False)

    async def ping(self) -> None:
        """One round trip to the server, and the signal connection open (a readiness
        probe)."""
        await self._fetch("SELECT 1", ())
        self._deaf()

    async def holder(self, thread_id: str) -> str | None:
        rows = await self._fetch(
            f"SELECT run_id FROM {self.table} WHERE thread_id = %s AND expires_at >= now()",
            (thread_id,))
        return str(rows[0][0]) if rows else None

    async def follow(self, thread_id: str) -> str | None:
        # Marked once (a follower polls this): rows already marked are only read.
        rows = await self._fetch(
            f"WITH marked AS (UPDATE {self.table} SET followed = true WHERE thread_id = %(t)s "
            "AND expires_at >= now() AND NOT followed RETURNING run_id) "
            "SELECT run_id FROM marked UNION ALL "
            f"SELECT run_id FROM {self.table} WHERE thread_id = %(t)s "
            "AND expires_at >= now() AND followed", {"t": thread_id})
        if not rows:
            # Another follower marking the row at the same moment: this statement's UPDATE
            # waited for it and then skipped the row (already followed), while its SELECT
            # still read the snapshot from before (not followed yet). Read it again.
            rows = await self._fetch(
                f"SELECT run_id FROM {self.table} WHERE thread_id = %s "
                "AND expires_at >= now()", (thread_id,))
        return str(rows[0][0]) if rows else None

    async def forget_expired(self, older_than: float) -> int:
        rows = await self._fetch(
            f"WITH gone AS (DELETE FROM {self.table} WHERE expires_at < now() - "
            "make_interval(secs => %s) RETURNING 1) SELECT count(*) FROM gone", (older_than,))
        return int(rows[0][0]) if rows else 0

    def counters(self) -> CounterBackend:
        return PostgresCounters(self.schema, self._fetch, self._transaction, self.lease_ttl)

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Any]:
        async with self._reachable():
            await self.start()
            async with self._pool.connection() as conn, conn.transaction():
                yield conn

    async def _publish_many(self, signals: list[Signal]) -> list[None]:
        # A signal too long for NOTIFY is not sent (followers poll the store). A run's
        # progress goes only to followers (its thread is given; other signals always go).
        sent = [(p.decode(), s.thread_id if s.kind == "progress" else None)
                for s, p in ((s, s.encode()) for s in signals) if len(p) <= _MAX_PAYLOAD]
        await self._fetch_on(
            self._ending, "SELECT pg_notify(%s, s.signal) FROM unnest(%b::text[], %b::text[]) "
            "AS s(signal, thread_id) WHERE s.thread_id IS NULL OR EXISTS "
            f"(SELECT 1 FROM {self.table} l WHERE l.thread_id = s.thread_id AND l.followed)",
            (self.channel, [p for p, _ in sent], [t for _, t in sent]))
        return [None] * len(signals)


async def _answers(conn: Any) -> None:
    """A LISTEN connection that heard nothing for a while answers a query in time, or is
    lost: one a NAT or a firewall dropped without a word fails nothing while it only waits
    for notifications, and every signal (stops) went missing."""
    try:
        async with within(_PONG_WITHIN):
            await conn.execute("SELECT 1")
    except TimeoutError:
        raise ConnectionError("the signal connection stopped answering") from None


async def _rows(cursor: Any, query: str, params: tuple[Any, ...] | dict[str, Any]
                ) -> list[tuple[Any, ...]]:
    # Prepared: the same few statements, for every run. Arrays go in binary (%b): psycopg's
    # text form escapes each element with a regular expression.
    await cursor.execute(query, params, prepare=True)
    if cursor.description is None:
        return []
    rows: list[tuple[Any, ...]] = await cursor.fetchall()
    return rows


async def _configure(conn: Any) -> None:
    # A lease statement touches a row or a few: never worth compiling (JIT), whatever a
    # plan's estimates say once the lease table is full of dead rows.
    await conn.execute("SET jit = off")
