"""A thread store in PostgreSQL: every worker of a deployment reads and writes the same threads.

Async `psycopg` 3 with its connection pool. The tables live in one schema (`public` unless
the URL names another with `?schema=`), created if missing, so several applications or test
runs share a database. The schema is versioned; migrations run when the store opens, under
a transaction-level advisory lock, so workers that start together migrate it once.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import time
from collections.abc import Iterable, Sequence
from typing import Any

import orjson
from psycopg import AsyncConnection, sql
from psycopg_pool import AsyncConnectionPool

from copilot_runtime.events import Event
from copilot_runtime.threads._rows import (
    Chunk,
    RunRow,
    closed_run,
    events_after,
    message_ids_of,
)
from copilot_runtime.threads.base import (
    Positioned,
    StoredRun,
    ThreadOwner,
    ThreadRecord,
    title_of,
)

__all__ = ["PostgresThreadStore"]

_MIGRATIONS: tuple[str, ...] = (
    # 1: threads, their runs (open while they stream), raw events, message ids.
    """
    CREATE TABLE threads (
        thread_id TEXT PRIMARY KEY,
        agent_id TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        owner_id TEXT,
        tenant TEXT,
        name TEXT,
        title TEXT NOT NULL DEFAULT '',
        next_position BIGINT NOT NULL DEFAULT 0
    );
    CREATE INDEX threads_by_updated ON threads (updated_at DESC, thread_id DESC);
    CREATE INDEX threads_by_agent ON threads (agent_id, updated_at DESC);
    CREATE INDEX threads_by_owner ON threads (owner_id, tenant, updated_at DESC);
    CREATE TABLE runs (
        thread_id TEXT NOT NULL REFERENCES threads (thread_id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        run_id TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        events BYTEA NOT NULL,
        open BOOLEAN NOT NULL DEFAULT FALSE,
        first_position BIGINT NOT NULL DEFAULT -1,
        last_position BIGINT NOT NULL DEFAULT -1,
        ended_at DOUBLE PRECISION,
        PRIMARY KEY (thread_id, seq)
    );
    CREATE INDEX runs_open ON runs (open) WHERE open;
    CREATE TABLE run_events (
        thread_id TEXT NOT NULL REFERENCES threads (thread_id) ON DELETE CASCADE,
        first_position BIGINT NOT NULL,
        last_position BIGINT NOT NULL,
        run_id TEXT NOT NULL,
        events BYTEA NOT NULL,
        PRIMARY KEY (thread_id, first_position)
    );
    CREATE TABLE message_ids (
        thread_id TEXT NOT NULL REFERENCES threads (thread_id) ON DELETE CASCADE,
        message_id TEXT NOT NULL,
        PRIMARY KEY (thread_id, message_id)
    );
    """,
    # 2: events compressed with lz4 rather than pglz, where the server has it (14+, built
    # with lz4): a run's raw events (several KB) are compressed as they are stored, and pglz
    # took a good part of PostgreSQL's CPU per run. Only values written from now on change.
    """
    DO $$
    BEGIN
        EXECUTE 'ALTER TABLE runs ALTER COLUMN events SET COMPRESSION lz4';
        EXECUTE 'ALTER TABLE run_events ALTER COLUMN events SET COMPRESSION lz4';
    EXCEPTION WHEN OTHERS THEN
        NULL;
    END $$;
    """,
)

#: Seconds between deletions of the raw events whose retention ended.
_PRUNE_EVERY = 30.0
_UPSERT_THREAD = (
    "INSERT INTO threads (thread_id, agent_id, created_at, updated_at, owner_id, tenant, title, "
    "next_position) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (thread_id) DO UPDATE "
    "SET updated_at = GREATEST(threads.updated_at, excluded.updated_at), next_position = "
    "GREATEST(threads.next_position, excluded.next_position)")
#: A finished run: the thread created or touched, the run that its first events opened closed
#: (or a new row when none were written while it ran), its last raw events, its message ids.
_FINISH_RUN = b"""
WITH p AS (
    SELECT %b::text AS thread, %b::text AS run, %b::float8 AS created, %b::float8 AS now,
           %b::bigint AS first, %b::bigint AS last, %b::bytea AS events,
           %b::bigint AS raw_first, %b::bigint AS raw_last, %b::bytea AS raw
), thread AS (
    INSERT INTO threads (thread_id, agent_id, created_at, updated_at, owner_id, tenant, title,
                         next_position)
    SELECT p.thread, %b, p.created, p.created, %b, %b, %b, p.last + 1 FROM p
    ON CONFLICT (thread_id) DO UPDATE SET
        updated_at = GREATEST(threads.updated_at, excluded.updated_at),
        next_position = GREATEST(threads.next_position, excluded.next_position)
), closed AS (
    UPDATE runs SET events = p.events, open = FALSE, last_position = p.last, ended_at = p.now
    FROM p WHERE runs.thread_id = p.thread AND runs.run_id = p.run AND runs.open
    RETURNING 1
), added AS (
    INSERT INTO runs (thread_id, seq, run_id, created_at, events, first_position,
                      last_position, ended_at)
    SELECT p.thread, COALESCE((SELECT MAX(seq) FROM runs WHERE thread_id = p.thread), 0) + 1,
           p.run, p.created, p.events, p.first, p.last, p.now
    FROM p WHERE NOT EXISTS (SELECT 1 FROM closed)
), chunk AS (
    INSERT INTO run_events (thread_id, first_position, last_position, run_id, events)
    SELECT p.thread, p.raw_first, p.raw_last, p.run, p.raw FROM p WHERE p.raw_first IS NOT NULL
    ON CONFLICT (thread_id, first_position) DO UPDATE SET events = excluded.events,
        last_position = excluded.last_position
)
INSERT INTO message_ids (thread_id, message_id)
SELECT p.thread, unnest(%b::text[]) FROM p
ON CONFLICT DO NOTHING
"""
_INSERT_CHUNK = (
    "INSERT INTO run_events (thread_id, first_position, last_position, run_id, events) "
    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (thread_id, first_position) DO UPDATE SET "
    "events = excluded.events, last_position = excluded.last_position")
#: At most this many finished runs are written in one transaction.
_MAX_BATCH = 32
#: A queued finished run: `_FINISH_RUN`'s parameters and what its caller awaits.
_Pending = tuple[tuple[Any, ...], "asyncio.Future[None]"]
_THREAD_COLUMNS = ("agent_id, created_at, updated_at, owner_id, tenant, name, title, "
                   "next_position")


class PostgresThreadStore:
    #: Seconds a finished run's raw events are kept, for exact `Last-Event-ID` resumes.
    raw_retention = 600.0

    def __init__(self, conninfo: str, *, schema: str = "public", min_size: int = 1,
                 max_size: int = 10, raw_retention: float | None = None) -> None:
        self.conninfo = conninfo
        self.schema = schema
        if raw_retention is not None:
            self.raw_retention = raw_retention
        self._pool = AsyncConnectionPool(conninfo, min_size=min_size, max_size=max_size,
                                         open=False, kwargs={"autocommit": True},
                                         configure=self._configure)
        self._opened: asyncio.Task[None] | None = None
        self._pruned = 0.0
        self._queued: builtins.list[_Pending] = []
        self._writer: asyncio.Future[None] | None = None
        self._writing = False  # a write of finished runs is in flight
        self._idle = asyncio.Event()  # set while none is
        self._idle.set()

    async def _configure(self, conn: AsyncConnection[Any]) -> None:
        await conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))

    async def open(self) -> None:
        """Connect and migrate (idempotent; every method opens the store on first use)."""
        if self._opened is None:
            self._opened = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opened)

    async def _open(self) -> None:
        async with await AsyncConnection.connect(self.conninfo, autocommit=True) as conn, \
                conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))",
                                   ("copilot_runtime.threads:" + self.schema,))
                await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                    sql.Identifier(self.schema)))
                await conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(
                    sql.Identifier(self.schema)))
                await conn.execute(
                    "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                row = await (await conn.execute("SELECT version FROM schema_version")
                             ).fetchone()
                version = row[0] if row else 0
                for number, migration in enumerate(_MIGRATIONS, start=1):
                    if number > version:
                        await conn.execute(migration.encode())
                if row is None:
                    await conn.execute("INSERT INTO schema_version VALUES (%s)",
                                       (len(_MIGRATIONS),))
                elif version < len(_MIGRATIONS):
                    await conn.execute("UPDATE schema_version SET version = %s",
                                       (len(_MIGRATIONS),))
        await self._pool.open()

    async def schema_version(self) -> int:
        await self.open()
        async with self._pool.connection() as conn:
            row = await (await conn.execute("SELECT version FROM schema_version")).fetchone()
        return int(row[0]) if row else 0

    # -- reading -----------------------------------------------------------------------

    async def get(self, thread_id: str) -> ThreadRecord | None:
        await self.open()
        async with self._pool.connection() as conn, conn.pipeline():
            # Three queries, one round trip.
            thread = await conn.execute(
                f"SELECT {_THREAD_COLUMNS} FROM threads WHERE thread_id = %s", (thread_id,))
            runs = await conn.execute(
                "SELECT run_id, created_at, events, first_position, last_position FROM runs "
                "WHERE thread_id = %s AND NOT open ORDER BY seq", (thread_id,))
            ids = await conn.execute(
                "SELECT message_id FROM message_ids WHERE thread_id = %s", (thread_id,))
            row = await thread.fetchone()
            if row is None:
                return None
            record = _record(thread_id, row)
            for run_id, created_at, events, first, last in await runs.fetchall():
                record.runs.append(StoredRun(run_id, orjson.loads(events), created_at,
                                             len(events), first, last))
            record.message_ids = {m for (m,) in await ids.fetchall()}
        return record

    async def summary(self, thread_id: str) -> ThreadRecord | None:
        await self.open()
        async with self._pool.connection() as conn:
            row = await (await conn.execute(
                f"SELECT {_THREAD_COLUMNS}, ARRAY(SELECT message_id FROM message_ids m "
                "WHERE m.thread_id = t.thread_id) FROM threads t WHERE thread_id = %s",
                (thread_id,), prepare=True)).fetchone()
        if row is None:
            return None
        record = _record(thread_id, row[:-1])
        record.message_ids = set(row[-1])
        return record

    async def events_after(self, thread_id: str, position: int) -> list[Positioned]:
        await self.open()
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT run_id, open, first_position, last_position, "
                "CASE WHEN open OR (last_position >= 0 AND last_position <= %s) THEN NULL "
                "ELSE events END FROM runs WHERE thread_id = %s AND (open OR last_position < 0 "
                "OR last_position > %s) ORDER BY seq", (position, thread_id, position))
            runs = [RunRow(run_id, is_open, first, last,
                           orjson.loads(events) if events is not None else [])
                    for run_id, is_open, first, last, events in await cursor.fetchall()]
            chunks = await _chunks(conn, thread_id, position)
        return events_after(runs, chunks, position)

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: ThreadOwner | None = None, offset: int = 0
                   ) -> builtins.list[ThreadRecord]:
        await self.open()
        where: builtins.list[str] = []
        args: builtins.list[Any] = []
        if agent_id is not None:
            where.append("agent_id = %s")
            args.append(agent_id)
        if owner is not None:
            where.append("owner_id = %s AND tenant IS NOT DISTINCT FROM %s")
            args.extend((owner.principal_id, owner.tenant))
        query = (f"SELECT thread_id, {_THREAD_COLUMNS} FROM threads "
                 + ("WHERE " + " AND ".join(where) + " " if where else "")
                 + "ORDER BY updated_at DESC, thread_id DESC LIMIT %s OFFSET %s")
        async with self._pool.connection() as conn:
            rows = await (await conn.execute(query.encode(), (*args, limit, offset))
                          ).fetchall()
        return [_record(row[0], row[1:]) for row in rows]

    async def open_runs(self) -> builtins.list[tuple[str, str]]:
        await self.open()
        async with self._pool.connection() as conn:
            rows = await (await conn.execute(
                "SELECT thread_id, run_id FROM runs WHERE open ORDER BY created_at")).fetchall()
        return [(t, r) for t, r in rows]

    # -- writing -----------------------------------------------------------------------

    async def append_events(self, thread_id: str, agent_id: str, run_id: str,
                            created_at: float, first_position: int, events: Sequence[Event],
                            *, owner: ThreadOwner | None = None) -> None:
        await self.open()
        async with self._pool.connection() as conn, conn.transaction():
            await self._append_events(conn, thread_id, agent_id, run_id, created_at,
                                      first_position, events, owner)

    async def _append_events(self, conn: AsyncConnection[Any], thread_id: str, agent_id: str,
                             run_id: str, created_at: float, first_position: int,
                             events: Sequence[Event], owner: ThreadOwner | None) -> None:
        await _thread(conn, thread_id, agent_id, created_at, owner, events)
        if await _open_seq(conn, thread_id, run_id) is None:
            await conn.execute(
                "INSERT INTO runs (thread_id, seq, run_id, created_at, events, open, "
                "first_position) SELECT %s, COALESCE(MAX(seq), 0) + 1, %s, %s, '\\x5b5d', "
                "TRUE, %s FROM runs WHERE thread_id = %s",
                (thread_id, run_id, created_at, first_position, thread_id))
        if events:
            last = first_position + len(events) - 1
            await conn.execute(
                "INSERT INTO run_events (thread_id, first_position, last_position, run_id, "
                "events) VALUES (%s, %s, %s, %s, %s) ON CONFLICT (thread_id, first_position) "
                "DO UPDATE SET events = excluded.events, last_position = "
                "excluded.last_position",
                (thread_id, first_position, last, run_id, orjson.dumps(events)))
            await _advance(conn, thread_id, last)

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         message_ids: Iterable[str], *, owner: ThreadOwner | None = None,
                         raw_first: int = -1, raw: Sequence[Event] = ()) -> None:
        await self.open()
        has_raw = bool(raw) and raw_first >= 0
        params: tuple[Any, ...] = (
            thread_id, run.run_id, run.created_at, time.time(), run.first_position,
            run.last_position, orjson.dumps(run.events),
            raw_first if has_raw else None, raw_first + len(raw) - 1 if has_raw else None,
            orjson.dumps(raw) if has_raw else None,
            agent_id, owner.principal_id if owner else None,
            owner.tenant if owner else None, title_of(run.events), list(message_ids))
        if not self._writing:
            # Nothing in flight: this run is written at once, by its caller.
            self._writing = True
            self._idle.clear()
            try:
                async with self._pool.connection() as conn:
                    # One statement (its parts are applied together, or not at all).
                    await conn.execute(_FINISH_RUN, params, prepare=True)
                    await self._prune(conn)
            finally:
                self._drain()
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append((params, done))
        # Returns once the transaction holding this run committed. A caller cancelled here
        # leaves its run queued: it is written with the others all the same.
        await done

    def _drain(self) -> None:
        """The write in flight is over: the runs queued meanwhile are written next, by a
        task of their own (so that no caller's cancellation can stop their write)."""
        if self._queued:
            self._writer = asyncio.ensure_future(self._write_queued())
        else:
            self._writing = False
            self._idle.set()

    async def _write_queued(self) -> None:
        """Group commit: runs that finished while a write was in flight are written together,
        one transaction and one round trip, as soon as it completes (a lone run at once)."""
        batch: builtins.list[_Pending] = []
        try:
            while self._queued:
                batch = self._queued[:_MAX_BATCH]
                del self._queued[:_MAX_BATCH]
                await self._write_batch(batch)
                batch = []
        except BaseException as e:  # cancelled with the loop, or a bug: no caller waits forever
            for _, done in batch + self._queued:
                if done.done():
                    continue
                if isinstance(e, asyncio.CancelledError):
                    done.cancel()
                else:
                    done.set_exception(e)
            self._queued.clear()
            raise
        finally:
            self._writer = None
            self._writing = False
            self._idle.set()

    async def _write_batch(self, batch: builtins.list[_Pending]) -> None:
        if len(batch) > 1:
            # Runs of one thread keep their order (their seq); threads are locked in one
            # order, so batches of several workers do not deadlock each other.
            batch.sort(key=lambda pending: str(pending[0][0]))
            try:
                async with self._pool.connection() as conn:
                    try:
                        async with conn.pipeline(), conn.transaction():
                            for params, _ in batch:
                                await conn.execute(_FINISH_RUN, params, prepare=True)
                    except Exception as e:
                        if conn.broken:
                            # The commit may or may not have happened: writing the runs
                            # again could store them twice, so each caller gets the error.
                            _settle(batch, e)
                            return
                    else:
                        _settle(batch, None)
                        await self._prune(conn)
                        return
            except Exception as e:  # no connection
                _settle(batch, e)
                return
            # The server rolled the batch back: each run alone, so that one bad run fails
            # only its own caller.
        for pending in batch:
            try:
                async with self._pool.connection() as conn:
                    # One statement (its parts are applied together, or not at all).
                    await conn.execute(_FINISH_RUN, pending[0], prepare=True)
                    _settle([pending], None)
                    await self._prune(conn)
            except Exception as e:
                _settle([pending], e)

    async def _prune(self, conn: AsyncConnection[Any]) -> None:
        now = time.time()
        if now - self._pruned > _PRUNE_EVERY:
            self._pruned = now
            # The runs are committed already: a failed prune is only retried later.
            with contextlib.suppress(Exception):
                await conn.execute(
                    "DELETE FROM run_events e USING runs r WHERE r.thread_id = e.thread_id "
                    "AND r.run_id = e.run_id AND NOT r.open AND r.ended_at < %s",
                    (now - self.raw_retention,))

    async def close_interrupted(self, thread_id: str, run_id: str) -> bool:
        await self.open()
        async with self._pool.connection() as conn, conn.transaction():
            row = await (await conn.execute(
                "SELECT seq, first_position FROM runs WHERE thread_id = %s AND run_id = %s "
                "AND open FOR UPDATE", (thread_id, run_id))).fetchone()
            if row is None:
                return False
            seq, first = row
            chunks = await _chunks(conn, thread_id, -1, run_id)
            tail, tail_first, compacted, last = closed_run(thread_id, run_id, first, chunks)
            if tail:
                await conn.execute(
                    "INSERT INTO run_events (thread_id, first_position, last_position, run_id, "
                    "events) VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (thread_id, tail_first, last, run_id, orjson.dumps(tail)))
            await conn.execute(
                "UPDATE runs SET events = %s, open = FALSE, last_position = %s, ended_at = %s "
                "WHERE thread_id = %s AND seq = %s",
                (orjson.dumps(compacted), last, time.time(), thread_id, seq))
            await _advance(conn, thread_id, last)
            ids = [(thread_id, m) for m in message_ids_of(compacted)]
            if ids:
                async with conn.cursor() as cursor:
                    await cursor.executemany(
                        "INSERT INTO message_ids (thread_id, message_id) VALUES (%s, %s) "
                        "ON CONFLICT DO NOTHING", ids)
        return True

    async def rename(self, thread_id: str, name: str | None) -> bool:
        await self.open()
        async with self._pool.connection() as conn:
            cursor = await conn.execute("UPDATE threads SET name = %s WHERE thread_id = %s",
                                        (name, thread_id))
            return cursor.rowcount > 0

    async def delete(self, thread_id: str) -> bool:
        await self.open()
        async with self._pool.connection() as conn:
            cursor = await conn.execute("DELETE FROM threads WHERE thread_id = %s",
                                        (thread_id,))
            return cursor.rowcount > 0

    async def aclose(self) -> None:
        await self._idle.wait()  # the runs finished or queued are written first
        if self._opened is not None:
            await self._pool.close()


async def _thread(conn: AsyncConnection[Any], thread_id: str, agent_id: str,
                  created_at: float, owner: ThreadOwner | None,
                  events: Sequence[Event]) -> None:
    await conn.execute(
        "INSERT INTO threads (thread_id, agent_id, created_at, updated_at, owner_id, tenant, "
        "title) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (thread_id) DO UPDATE SET "
        "updated_at = GREATEST(threads.updated_at, excluded.updated_at)",
        (thread_id, agent_id, created_at, created_at, owner.principal_id if owner else None,
         owner.tenant if owner else None, title_of(events)))


async def _open_seq(conn: AsyncConnection[Any], thread_id: str, run_id: str) -> int | None:
    row = await (await conn.execute(
        "SELECT seq FROM runs WHERE thread_id = %s AND run_id = %s AND open",
        (thread_id, run_id))).fetchone()
    return None if row is None else int(row[0])


async def _advance(conn: AsyncConnection[Any], thread_id: str, last_position: int) -> None:
    await conn.execute("UPDATE threads SET next_position = GREATEST(next_position, %s) "
                       "WHERE thread_id = %s", (last_position + 1, thread_id))


async def _chunks(conn: AsyncConnection[Any], thread_id: str, position: int,
                  run_id: str | None = None) -> builtins.list[Chunk]:
    query = ("SELECT run_id, first_position, events FROM run_events WHERE thread_id = %s "
             "AND last_position > %s")
    args: builtins.list[Any] = [thread_id, position]
    if run_id is not None:
        query += " AND run_id = %s"
        args.append(run_id)
    rows = await (await conn.execute(query.encode(), args)).fetchall()
    return [Chunk(r, first, orjson.loads(events)) for r, first, events in rows]


def _settle(batch: Sequence[_Pending], error: BaseException | None) -> None:
    """Wake the callers of these runs (a cancelled caller is no longer waiting)."""
    for _, done in batch:
        if done.done():
            continue
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)


def _record(thread_id: str, row: Sequence[Any]) -> ThreadRecord:
    agent_id, created_at, updated_at, owner_id, tenant, name, title, next_position = row
    return ThreadRecord(thread_id, agent_id, created_at, updated_at,
                        owner=ThreadOwner(owner_id, tenant) if owner_id is not None else None,
                        name=name, title=title or "", next_position=next_position)
