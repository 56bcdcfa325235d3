"""A thread store in PostgreSQL: every worker of a deployment reads and writes the same threads.

Async `psycopg` 3. What every run asks for (its thread's head as it starts, its events as it
streams, the finished run) goes over three connections of the store's own, one statement at
a time, what is asked for meanwhile going together in the next statement; the rest (reading
threads, listing, closing interrupted runs) over psycopg's pool (`min_size`..`max_size`). So
a process holds at most `max_size` + 3 connections. The tables live in one schema (`public`
unless the URL names another with `?schema=`), created if missing, so several applications
or test runs share a database. The schema is versioned; migrations run when the store opens,
under a transaction-level advisory lock, so workers that start together migrate it once.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from psycopg import AsyncConnection, AsyncCursor, errors, sql
from psycopg_pool import AsyncConnectionPool

from copilot_runtime._batching import Batcher
from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime._pg_lane import (
    Lane,
    check_alive,
    create_schema,
    reachable,
    with_session_defaults,
)
from copilot_runtime.events import Event
from copilot_runtime.threads._grouped import GroupedWriter
from copilot_runtime.threads._rows import (
    Chunk,
    FirstPositions,
    RunRow,
    check_schema_version,
    closed_run,
    decoded,
    events_after,
    message_ids_of,
    oldest_reader,
    resumed_at,
)
from copilot_runtime.threads.base import (
    DELETED_RETENTION,
    MAX_REPLAY_BYTES,
    UNKEPT_STATE_BYTES,
    ListPosition,
    Positioned,
    StoredRun,
    ThreadOwner,
    ThreadRecord,
    earlier_messages,
    newest_within,
    state_of_unkept,
    state_snapshot,
    title_of,
)

__all__ = ["PostgresThreadStore"]

_log = structlog.get_logger("copilot_runtime.threads")

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
    # 3: no foreign keys, and the owners' index only over threads that have an owner. A
    # finished run writes its thread's row in the same statement as its own rows, and a
    # thread is deleted with its rows in one statement, so the keys never caught anything;
    # checking them took four lookups and a row lock on the thread per run. Without
    # authentication no thread has an owner, and the index had an entry for each all the same.
    """
    ALTER TABLE runs DROP CONSTRAINT IF EXISTS runs_thread_id_fkey;
    ALTER TABLE run_events DROP CONSTRAINT IF EXISTS run_events_thread_id_fkey;
    ALTER TABLE message_ids DROP CONSTRAINT IF EXISTS message_ids_thread_id_fkey;
    DROP INDEX threads_by_owner;
    CREATE INDEX threads_by_owner ON threads (owner_id, tenant, updated_at DESC)
        WHERE owner_id IS NOT NULL;
    """,
    # 4: the open runs' index keyed by what finds a run (its thread and id). Every lookup of
    # an open run read the index on the flag whole, dead entries included: each run written
    # while it streamed leaves one until the table is vacuumed, so every run's writes grew
    # slower with the runs before it (1 ms each after 5,000 runs). And raw events carry
    # their run's end, so those whose retention ended are found through an index of their
    # own instead of a join with every run ever stored. (Building the index reads `runs`
    # whole while holding off its writes: seconds on a table of millions of runs. Runs that
    # workers of the previous version close during a rolling upgrade keep their raw events
    # unstamped, so never deleted before their thread.)
    """
    DROP INDEX runs_open;
    CREATE INDEX runs_open ON runs (thread_id, run_id) WHERE open;
    ALTER TABLE run_events ADD COLUMN ended_at DOUBLE PRECISION;
    UPDATE run_events e SET ended_at = r.ended_at FROM runs r
        WHERE r.thread_id = e.thread_id AND r.run_id = e.run_id AND NOT r.open;
    CREATE INDEX run_events_ended ON run_events (ended_at) WHERE ended_at IS NOT NULL;
    """,
    # 5: how far the positions of deleted threads had got (`first_position`): a thread
    # made again with a deleted one's id goes on from there.
    """
    CREATE TABLE deleted_threads (
        thread_id TEXT PRIMARY KEY,
        next_position BIGINT NOT NULL
    );
    """,
    # 6: lists of threads order the ids of threads updated at the same time by their bytes
    # (as the other stores do), not by the database's collation, and go on from a page's
    # last thread: each index of the lists ends with the id so ordered. (Building them reads
    # `threads` whole while holding off its writes: seconds on millions of threads.)
    """
    DROP INDEX threads_by_updated;
    CREATE INDEX threads_by_updated ON threads (updated_at DESC, thread_id COLLATE "C" DESC);
    DROP INDEX threads_by_agent;
    CREATE INDEX threads_by_agent ON threads
        (agent_id, updated_at DESC, thread_id COLLATE "C" DESC);
    DROP INDEX threads_by_owner;
    CREATE INDEX threads_by_owner ON threads
        (owner_id, tenant, updated_at DESC, thread_id COLLATE "C" DESC)
        WHERE owner_id IS NOT NULL;
    """,
    # 7: when a thread was deleted, so how far its positions went is forgotten once no
    # client can still hold one of its event ids (`deleted_retention`): every delete left a
    # row for good. (Rows of earlier deletes count from this migration.)
    """
    ALTER TABLE deleted_threads ADD COLUMN deleted_at DOUBLE PRECISION NOT NULL
        DEFAULT extract(epoch FROM now());
    CREATE INDEX deleted_threads_by_time ON deleted_threads (deleted_at);
    """,
    # 8: the state the thread's last finished run that had one left, kept with the thread,
    # and that run's `seq`: a read of the newest runs alone (`get(max_bytes=)`) answers it
    # however old that run is. Threads stored before keep none until their next such run,
    # and an older release (rolled back across this) keeps none for the runs it stores:
    # their runs read answer, as before. (Compressed as the events are, see 2.)
    """
    ALTER TABLE threads ADD COLUMN state BYTEA, ADD COLUMN state_seq INTEGER;
    -- Whether a run left a state (NULL: stored by a release that did not say, which keeps
    -- none with its thread: a read looks through those, `state_of_unkept`).
    ALTER TABLE runs ADD COLUMN has_state BOOLEAN;
    DO $$
    BEGIN
        EXECUTE 'ALTER TABLE threads ALTER COLUMN state SET COMPRESSION lz4';
    EXCEPTION WHEN OTHERS THEN
        NULL;
    END $$;
    """,
    # 9: whether a thread is archived (`archive`): lists leave it out unless asked for it.
    # An older release (rolled back across this) lists every thread, as it did. (A constant
    # default: no table rewrite.)
    """
    ALTER TABLE threads ADD COLUMN IF NOT EXISTS archived BOOLEAN NOT NULL DEFAULT false;
    """,
    # 10: where the closing events a sweep stored for a run its worker left open begin
    # (`RunRow.swept_from`): a client resuming at or after it saw events never written.
    # An older release (rolled back across this) replays such runs as before.
    """
    ALTER TABLE runs ADD COLUMN IF NOT EXISTS swept_from BIGINT;
    """,
)

#: The migrations older releases cannot tell from their absence (see `oldest_reader`).
_ADDITIVE = frozenset({7, 8, 9, 10})

#: Seconds between deletions of the raw events whose retention ended.
_PRUNE_EVERY = 30.0
#: Finished runs, any number of them, one statement (its parts are applied together, or not
#: at all): each run's thread created or touched, the run its first events opened closed (or
#: a new row when none were written while it ran) with the end stamped on its raw events
#: written meanwhile (except the chunk rewritten here), its last raw events and its message
#: ids, and the state it left kept with its thread. Written twice (sent again after its
#: connection broke, having committed), it changes nothing more: the open run is closed
#: already, and a run that was never open is added only while its thread's positions have
#: not passed it.
#: At most one run per thread (a thread's row is written once per statement, and its next
#: run's `seq` reads this one's). The runs come packed in three arrays, twelve texts and
#: three blobs per run (the last empty: no state) and (thread, message id) pairs: psycopg
#: adapts an array parameter in a few microseconds, so eighteen of them cost more than the
#: statement's own work.
_FINISH_RUNS = b"""
WITH a AS (
    SELECT %b::text[] AS t, %b::bytea[] AS b, %b::text[] AS m
), p AS (
    SELECT t[k + 1] AS thread, t[k + 2] AS run, t[k + 3]::float8 AS created,
           t[k + 4]::float8 AS now, t[k + 5]::int8 AS first, t[k + 6]::int8 AS last,
           t[k + 7] AS agent, t[k + 8] AS owner, t[k + 9] AS tenant, t[k + 10] AS title,
           t[k + 11]::int8 AS raw_first, t[k + 12]::int8 AS raw_last,
           b[3 * i + 1] AS events, b[3 * i + 2] AS raw, b[3 * i + 3] AS state,
           -- The place among its thread's runs (`seq`) of a run that left a state: the open
           -- run it closes, else a new one after the last (NULL: it is not written).
           CASE WHEN b[3 * i + 3] <> '' THEN COALESCE(
               (SELECT s.seq FROM runs s WHERE s.thread_id = t[k + 1] AND s.run_id = t[k + 2]
                AND s.open LIMIT 1),
               CASE WHEN NOT EXISTS (SELECT 1 FROM threads h WHERE h.thread_id = t[k + 1]
                                     AND h.next_position > t[k + 6]::int8)
                    THEN (SELECT COALESCE(MAX(s.seq), 0) + 1 FROM runs s
                          WHERE s.thread_id = t[k + 1]) END) END AS state_seq
    FROM a, generate_series(0, cardinality(a.b) / 3 - 1) AS i, LATERAL (SELECT 12 * i AS k) AS o
    -- Fenced: a run already closed (by this write before, or by a sweep that found its
    -- lease expired while its worker stalled) is never written again. OFFSET 0 keeps the
    -- look-up a probe of each run's key: as an anti-join, a plan made on empty tables read
    -- the whole index of runs for every batch (each run slower than the one before).
    WHERE NOT EXISTS (SELECT 1 FROM runs s WHERE s.thread_id = t[k + 1] AND s.run_id = t[k + 2]
                      AND NOT s.open AND s.first_position = t[k + 5]::int8 OFFSET 0)
    -- Nor a run that began before its thread was deleted (the delete removed its row):
    -- the thread stays deleted. A new thread of the id begins at the deleted one's end.
    AND NOT EXISTS (SELECT 1 FROM deleted_threads d WHERE d.thread_id = t[k + 1]
                    AND d.next_position > t[k + 5]::int8 OFFSET 0)
), thread AS (
    INSERT INTO threads (thread_id, agent_id, created_at, updated_at, owner_id, tenant, title,
                         next_position, state, state_seq)
    SELECT p.thread, p.agent, p.created, extract(epoch FROM now()), p.owner, p.tenant,
           p.title, p.last + 1, CASE WHEN p.state_seq IS NOT NULL THEN p.state END,
           p.state_seq
    FROM p
    ON CONFLICT (thread_id) DO UPDATE SET
        -- (the database's clock: see `_APPEND_EVENTS`)
        updated_at = excluded.updated_at,
        next_position = GREATEST(threads.next_position, excluded.next_position),
        title = CASE WHEN threads.title = '' THEN excluded.title ELSE threads.title END,
        -- unless a later run (by `seq`) left one: a run closed after the next one finished
        state = CASE WHEN excluded.state_seq >= COALESCE(threads.state_seq, 0)
                     THEN excluded.state ELSE threads.state END,
        state_seq = GREATEST(threads.state_seq, excluded.state_seq)
), closed AS (
    UPDATE runs SET events = p.events, open = FALSE, last_position = p.last, ended_at = p.now,
                    has_state = octet_length(p.state) > 0
    FROM p WHERE runs.thread_id = p.thread AND runs.run_id = p.run AND runs.open
    RETURNING runs.thread_id, runs.run_id, p.now, p.raw_first
), ended AS (
    UPDATE run_events SET ended_at = extract(epoch FROM now()) FROM closed
    WHERE run_events.thread_id = closed.thread_id AND run_events.run_id = closed.run_id
      AND run_events.first_position IS DISTINCT FROM closed.raw_first
), added AS (
    INSERT INTO runs (thread_id, seq, run_id, created_at, events, first_position,
                      last_position, ended_at, has_state)
    SELECT p.thread, COALESCE((SELECT MAX(seq) FROM runs WHERE thread_id = p.thread), 0) + 1,
           p.run, p.created, p.events, p.first, p.last, p.now, octet_length(p.state) > 0
    FROM p WHERE NOT EXISTS (SELECT 1 FROM closed
                             WHERE closed.thread_id = p.thread AND closed.run_id = p.run)
    AND NOT EXISTS (SELECT 1 FROM threads t
                    WHERE t.thread_id = p.thread AND t.next_position > p.last)
), chunk AS (
    INSERT INTO run_events (thread_id, first_position, last_position, run_id, events, ended_at)
    SELECT p.thread, p.raw_first, p.raw_last, p.run, p.raw, extract(epoch FROM now()) FROM p
    WHERE p.raw_first IS NOT NULL
    ON CONFLICT (thread_id, first_position) DO UPDATE SET events = excluded.events,
        last_position = excluded.last_position, ended_at = excluded.ended_at
)
INSERT INTO message_ids (thread_id, message_id)
SELECT m[2 * i + 1], m[2 * i + 2] FROM a, generate_series(0, cardinality(a.m) / 2 - 1) AS i
-- (of the runs written: a fenced run's ids would be a deleted thread's, read as the next one's)
WHERE EXISTS (SELECT 1 FROM p WHERE p.thread = m[2 * i + 1])
ON CONFLICT DO NOTHING
"""
#: Running runs' next events (a run's first call opens it, and creates its thread), any
#: number of runs, one statement: a run streams for seconds and writes every 200 ms, so this
#: is what a deployment mostly sends. At most one run per thread; packed as `_FINISH_RUNS`,
#: ten texts and one blob per run (no blob, and NULL as the last position: no events).
#: Written twice, it changes nothing more (the run is open already, its events upserted).
_APPEND_EVENTS = b"""
WITH a AS (
    SELECT %b::text[] AS t, %b::bytea[] AS b
), p AS (
    SELECT t[k + 1] AS thread, t[k + 2] AS run, t[k + 3]::float8 AS created,
           t[k + 4]::int8 AS first, t[k + 5]::int8 AS last, t[k + 6] AS agent,
           t[k + 7] AS owner, t[k + 8] AS tenant, t[k + 9] AS title, b[i + 1] AS events
    FROM a, generate_series(0, cardinality(a.b) - 1) AS i, LATERAL (SELECT 10 * i AS k) AS o
    -- Fenced: events of a run closed meanwhile (a sweep found its lease expired while its
    -- worker stalled) neither reopen it nor overwrite the positions a later run took:
    -- every late chunk of it, not only the first (the run is known by its start time).
    WHERE NOT EXISTS (SELECT 1 FROM runs s WHERE s.thread_id = t[k + 1] AND s.run_id = t[k + 2]
                      AND NOT s.open AND (s.last_position >= t[k + 4]::int8
                                          OR s.created_at = t[k + 3]::float8) OFFSET 0)
    -- Nor do those of a run that began (`t[k + 10]`, its first position) before its
    -- thread was deleted bring the thread back.
    AND NOT EXISTS (SELECT 1 FROM deleted_threads d WHERE d.thread_id = t[k + 1]
                    AND d.next_position > t[k + 10]::int8 OFFSET 0)
), thread AS (
    INSERT INTO threads (thread_id, agent_id, created_at, updated_at, owner_id, tenant, title,
                         next_position)
    SELECT p.thread, p.agent, p.created, extract(epoch FROM now()), p.owner, p.tenant,
           p.title, COALESCE(p.last + 1, 0)
    FROM p
    ON CONFLICT (thread_id) DO UPDATE SET
        -- Stamped by the database's clock, as the retention sweep's cutoff (`clock`): a
        -- worker whose clock was behind made a thread just used look stale to the sweep,
        -- and one ahead kept a thread from it (GREATEST kept its stamp) for as long.
        updated_at = excluded.updated_at,
        next_position = GREATEST(threads.next_position, excluded.next_position),
        title = CASE WHEN threads.title = '' THEN excluded.title ELSE threads.title END
), opened AS (
    INSERT INTO runs (thread_id, seq, run_id, created_at, events, open, first_position)
    SELECT p.thread, COALESCE((SELECT MAX(seq) FROM runs WHERE thread_id = p.thread), 0) + 1,
           p.run, p.created, '\\x5b5d', TRUE, p.first
    FROM p WHERE NOT EXISTS (SELECT 1 FROM runs
                             WHERE thread_id = p.thread AND run_id = p.run AND open)
)
INSERT INTO run_events (thread_id, first_position, last_position, run_id, events)
SELECT p.thread, p.first, p.last, p.run, p.events FROM p WHERE p.last IS NOT NULL
ON CONFLICT (thread_id, first_position) DO UPDATE SET events = excluded.events,
    last_position = excluded.last_position
"""
#: At most this many finished runs are written in one statement.
_MAX_BATCH = 32
_THREAD_COLUMNS = ("agent_id, created_at, updated_at, owner_id, tenant, name, title, "
                   "next_position, archived")
#: Threads' heads (their columns and message ids), any number at once.
_SUMMARIES = (f"SELECT thread_id, {_THREAD_COLUMNS}, (SELECT run_id FROM runs r WHERE "
              "r.thread_id = t.thread_id AND r.open LIMIT 1), "
              "ARRAY(SELECT message_id FROM message_ids "
              "m WHERE m.thread_id = t.thread_id) FROM threads t "
              "WHERE thread_id = ANY(%b::text[]) "
              # and where a deleted thread's positions had got to (agent_id NULL: no thread)
              "UNION ALL SELECT thread_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, "
              "next_position, NULL, NULL, NULL FROM deleted_threads d "
              "WHERE thread_id = ANY(%b::text[]) AND NOT EXISTS "
              "(SELECT 1 FROM threads t WHERE t.thread_id = d.thread_id)").encode()


class PostgresThreadStore:
    #: Seconds a finished run's raw events are kept, for exact `Last-Event-ID` resumes.
    raw_retention = 600.0
    #: Seconds a deleted thread's positions are remembered (see `first_position`).
    deleted_retention = DELETED_RETENTION
    #: What `events_after` reads of a thread's finished runs (`MAX_REPLAY_BYTES`).
    replay_bytes = MAX_REPLAY_BYTES

    def __init__(self, conninfo: str, *, schema: str = "public", min_size: int = 1,
                 max_size: int = 10, raw_retention: float | None = None,
                 timeout: float = 10.0) -> None:
        # A server that does not answer fails a connection attempt within `timeout` (libpq
        # waits for the operating system's TCP timeout, minutes, by default), and a read
        # within it too; the caller gets ServiceUnavailableError (503), never a hang.
        conninfo = with_session_defaults(conninfo, connect_timeout=timeout,
                                         application_name="copilot-runtime threads")
        self.conninfo = conninfo
        self.schema = schema
        self.timeout = timeout
        if raw_retention is not None:
            self.raw_retention = raw_retention
        # A pooled connection is checked as it is taken: one the server dropped (it
        # restarted) is replaced instead of failing what it was taken for.
        self._pool = AsyncConnectionPool(conninfo, min_size=min_size, max_size=max_size,
                                         open=False, kwargs={"autocommit": True},
                                         configure=self._configure, timeout=timeout,
                                         check=check_alive,
                                         # see the coordinator's pool: no minutes-long
                                         # backoff once the server is back
                                         reconnect_timeout=timeout)
        self._opened: asyncio.Task[None] | None = None
        self._pruned = 0.0
        # What every run asks for (its thread's head as it starts, its events as it streams,
        # the finished run) goes through three connections of its own, one call at a time;
        # what is asked for while a call is in flight goes together in the next one.
        self._heads = Lane(self._connect)
        self._head_reads: Batcher[str, ThreadRecord | None] = Batcher(self._read_heads)
        self._first_positions = FirstPositions()
        self._finished = GroupedWriter(Lane(self._connect), _finish_runs, max_batch=_MAX_BATCH,
                                       after=self._prune)
        self._running = GroupedWriter(Lane(self._connect), _append_events,
                                      max_batch=_MAX_BATCH)

    async def _connect(self) -> AsyncConnection[Any]:
        conn = await AsyncConnection.connect(self.conninfo, autocommit=True)
        try:
            await self._configure(conn)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _configure(self, conn: AsyncConnection[Any]) -> None:
        await conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
        # The statements are prepared once per connection and planned once (by default
        # PostgreSQL plans them again at each execution whenever a plan for the actual
        # parameters looks cheaper, as it always does for a batch's arrays: reading a head
        # cost twice as much). A plan made once must not depend on how big the tables were
        # then: on the empty tables of a new deployment, scanning a whole table is the
        # cheapest plan, and it would stay the plan as they grow (the finished-runs statement
        # became slower with every run). Every query here has an index for it, so sequential
        # scans are ruled out.
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        # Nor may it read a whole index: a batch of runs looks each of its rows up by key
        # (a nested loop), however few rows the statistics of the day promise a full read
        # would meet; unvacuumed dead entries are never counted.
        await conn.execute("SET enable_seqscan = off")
        await conn.execute("SET enable_bitmapscan = off")
        await conn.execute("SET enable_hashjoin = off")
        await conn.execute("SET enable_mergejoin = off")
        # Nor compiled: a generic plan's estimates (a thousand runs a batch) pass the JIT's
        # threshold once the tables have grown, and compiling took 20-50 ms a statement.
        await conn.execute("SET jit = off")

    async def open(self) -> None:
        """Connect and migrate (idempotent; every method opens the store on first use, and
        tries again after an attempt that failed: the server was down)."""
        if self._opened is None or (self._opened.done() and (
                self._opened.cancelled() or self._opened.exception() is not None)):
            self._opened = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opened)

    @contextlib.asynccontextmanager
    async def _reachable(self, *, bounded: bool = True) -> AsyncIterator[None]:
        """Open the store, then the block: a server that cannot be reached (or, `bounded`,
        does not answer within `timeout`) is a ServiceUnavailableError. Writes are not
        bounded: a write given up on could still commit, after its thread was given back."""
        async with reachable(self.timeout if bounded else None,
                             "The thread store cannot be reached"):
            await self.open()
            yield

    async def _open(self) -> None:
        try:
            await self._create()
        except (errors.ReservedName, errors.InsufficientPrivilege) as exc:
            # Not an outage: the same every time (every request was a 500 with a stack).
            advice = "give ?schema= a name not beginning with pg_" \
                if isinstance(exc, errors.ReservedName) else \
                "grant the user the privilege PostgreSQL names"
            raise ConfigurationError(
                f"the thread store cannot use schema {self.schema!r}: "
                f"{exc.diag.message_primary or type(exc).__name__} ({advice})") from None
        await self._pool.open()

    async def _create(self) -> None:
        """Create the schema and its tables, or migrate them."""
        async with await AsyncConnection.connect(self.conninfo, autocommit=True) as conn, \
                conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))",
                                   ("copilot_runtime.threads:" + self.schema,))
                await create_schema(conn, self.schema)
                await conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(
                    sql.Identifier(self.schema)))
                await conn.execute(
                    "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                # The oldest version whose code may use the store (NULL: the version itself).
                await conn.execute("ALTER TABLE schema_version ADD COLUMN IF NOT EXISTS "
                                   "oldest_reader INTEGER")
                row = await (await conn.execute(
                    "SELECT version, oldest_reader FROM schema_version")).fetchone()
                version = row[0] if row else 0
                known = len(_MIGRATIONS)
                check_schema_version(f"schema {self.schema!r}", version, known,
                                     row[1] if row else None)
                for number, migration in enumerate(_MIGRATIONS, start=1):
                    if number > version:
                        await conn.execute(migration.encode())
                readers = oldest_reader(known, _ADDITIVE)
                if row is None:
                    await conn.execute("INSERT INTO schema_version VALUES (%s, %s)",
                                       (known, readers))
                elif version < known:
                    await conn.execute("UPDATE schema_version SET version = %s, "
                                       "oldest_reader = %s", (known, readers))
                vacuumed = await (await conn.execute("SHOW autovacuum")).fetchone()
        if vacuumed is not None and vacuumed[0] != "on":
            # Every run leaves dead rows (a thread's row updated, an open run closed, raw
            # events deleted): without vacuum the tables and their indexes only grow.
            _log.warning("PostgreSQL runs with autovacuum off: the thread store's tables "
                         "will keep growing unless they are vacuumed", schema=self.schema)

    async def ping(self) -> None:
        """One round trip to the server, on a pooled connection (a readiness probe)."""
        async with self._reachable(), self._pool.connection() as conn:
            await conn.execute("SELECT 1")

    async def schema_version(self) -> int:
        async with self._reachable():
            async with self._pool.connection() as conn:
                row = await (await conn.execute("SELECT version FROM schema_version")).fetchone()
            return int(row[0]) if row else 0

    # -- reading -----------------------------------------------------------------------

    async def get(self, thread_id: str, *, max_bytes: int | None = None
                  ) -> ThreadRecord | None:
        async with self._reachable():
            async with self._pool.connection() as conn:
                async with conn.pipeline():
                    # Three queries, one round trip (octet_length reads a value's header,
                    # not the value).
                    thread = await conn.execute(
                        f"SELECT {_THREAD_COLUMNS}, state_seq IS NOT NULL FROM threads "
                        "WHERE thread_id = %s", (thread_id,))
                    sizes_of = await conn.execute(
                        "SELECT seq, octet_length(events) FROM runs WHERE thread_id = %s "
                        "AND NOT open ORDER BY seq DESC", (thread_id,))
                    ids = await conn.execute(
                        "SELECT message_id FROM message_ids WHERE thread_id = %s", (thread_id,))
                    row = await thread.fetchone()
                    sizes = await sizes_of.fetchall()
                    message_ids = {m for (m,) in await ids.fetchall()}
                if row is None:
                    return None
                record = _record(thread_id, row[:-1])
                record.message_ids = message_ids
                kept = newest_within([size for _, size in sizes], max_bytes)
                record.omitted_runs = len(sizes) - kept
                runs = await conn.execute(
                    "SELECT run_id, created_at, events, first_position, last_position FROM runs "
                    "WHERE thread_id = %s AND NOT open AND seq >= %s ORDER BY seq",
                    (thread_id, sizes[kept - 1][0] if kept else 0))
                for run_id, created_at, events, first, last in await runs.fetchall():
                    record.runs.append(StoredRun(run_id, orjson.loads(events), created_at,
                                                 len(events), first, last))
                if record.omitted_runs:
                    record.earlier = await _earlier(conn, thread_id, sizes[kept - 1][0],
                                                    max_bytes)
                if not row[-1] and record.omitted_runs and not any(
                        state_snapshot(run.events) is not None for run in record.runs):
                    # No state kept: one only an older release's runs left, if any.
                    record.kept_state = await _state_of_unkept(
                        conn, thread_id, None, 0, sizes[kept - 1][0] if kept else
                        sizes[0][0] + 1)
                elif row[-1] and not any(state_snapshot(run.events) is not None
                                         for run in record.runs):
                    # The run that left the state was not read: the state kept with the
                    # thread, unless an older release's run since left one (it keeps none).
                    kept_row = await (await conn.execute(
                        "SELECT state, state_seq FROM threads WHERE thread_id = %s",
                        (thread_id,))).fetchone()
                    if kept_row is not None and kept_row[1] is not None:
                        record.kept_state = await _state_of_unkept(
                            conn, thread_id, kept_row[0], kept_row[1],
                            sizes[kept - 1][0] if kept else kept_row[1] + 1)
            return record

    async def summary(self, thread_id: str) -> ThreadRecord | None:
        async with self._reachable():
            # Asked for while another read is in flight: read with the others asked meanwhile,
            # in one query, as soon as it is back (a run's start reads its thread's head).
            return await self._head_reads(thread_id)

    async def _read_heads(self, thread_ids: builtins.list[str]
                          ) -> builtins.list[ThreadRecord | None]:
        rows = await self._summaries(builtins.list(dict.fromkeys(thread_ids)))
        for thread_id in thread_ids:
            row = rows.get(thread_id)
            if row is None or row[0] is None:  # no thread: where its positions go on from
                self._first_positions.note(thread_id, 0 if row is None else int(row[7]))
                rows.pop(thread_id, None)
        # A record for each caller: a run's start keeps and extends its set of message ids.
        return [_summary(thread_id, rows.get(thread_id)) for thread_id in thread_ids]

    async def _summaries(self, thread_ids: builtins.list[str]
                         ) -> dict[str, tuple[Any, ...]]:
        async with self._heads as cursor:
            await cursor.execute(_SUMMARIES, (thread_ids, thread_ids), prepare=True)
            rows = await cursor.fetchall()
        return {row[0]: row[1:] for row in rows}

    async def events_after(self, thread_id: str, position: int) -> list[Positioned]:
        async with self._reachable():
            async with self._pool.connection() as conn:
                # Of the finished runs, the newest within `replay_bytes` (at least the last):
                # the size of each and of those after it (octet_length reads a value's
                # header, not the value); and how many finished runs there are after
                # `position`, to count those left out.
                cursor = await conn.execute(
                    "SELECT run_id, open, first_position, last_position, "
                    "CASE WHEN open OR (last_position >= 0 AND last_position <= %(p)s "
                    "AND NOT resumed) THEN NULL "
                    "ELSE events END, finished, seq, swept_from FROM (SELECT seq, run_id, open, "
                    "first_position, last_position, events, swept_from, resumed, "
                    "CASE WHEN open THEN 0 ELSE octet_length(events) "
                    "END AS own, sum(CASE WHEN open THEN 0 ELSE octet_length(events) END) "
                    "OVER (ORDER BY seq DESC) AS newer, "
                    "count(*) FILTER (WHERE NOT open) OVER () AS finished "
                    # (runs stored before positions, -1: only in a whole-thread replay,
                    # `ends_after`)
                    "FROM runs, LATERAL (SELECT COALESCE(swept_from BETWEEN 0 AND %(p)s "
                    "AND NOT EXISTS (SELECT 1 FROM runs n WHERE n.thread_id = runs.thread_id "
                    "AND n.seq > runs.seq AND n.first_position BETWEEN 0 AND %(p)s), false) "
                    "AS resumed) AS s "  # (`resumed_at`)
                    "WHERE thread_id = %(t)s AND "
                    "(open OR %(p)s < 0 OR last_position > %(p)s OR resumed)) r "
                    "WHERE open OR newer <= %(b)s OR newer = own ORDER BY seq",
                    {"p": position, "t": thread_id, "b": self.replay_bytes})
                rows = await cursor.fetchall()
                runs = [RunRow(run_id, is_open, first, last,
                               orjson.loads(events) if events is not None else [], swept)
                        for run_id, is_open, first, last, events, _, _, swept in rows]
                # (a swept run's closing events, for a client resumed among them)
                chunks = await _chunks(conn, thread_id, min(
                    (resumed_at(runs[i:], position) for i in range(len(runs))),
                    default=position))
                omitted = rows[0][5] - sum(not run.open for run in runs) if rows else 0
                # (a resume's client holds the thread's messages before its position)
                first_kept = min((row[6] for row in rows if not row[1]), default=0)
                earlier = await _earlier(conn, thread_id, first_kept, self.replay_bytes) \
                    if omitted and position < 0 else None
            return events_after(runs, chunks, position, omitted, earlier)

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: ThreadOwner | None = None, offset: int = 0,
                   after: ListPosition | None = None, include_archived: bool = True
                   ) -> builtins.list[ThreadRecord]:
        async with self._reachable():
            # Ids compare by their bytes ("C"), not by the database's collation: the order
            # of the other stores, whatever the database was made with.
            where: builtins.list[str] = []
            args: builtins.list[Any] = []
            if after is not None:
                where.append('(updated_at, thread_id COLLATE "C") < (%s, %s)')
                args.extend(after)
            if agent_id is not None:
                where.append("agent_id = %s")
                args.append(agent_id)
            if owner is not None:
                where.append("owner_id = %s AND tenant IS NOT DISTINCT FROM %s")
                args.extend((owner.principal_id, owner.tenant))
            if not include_archived:
                where.append("NOT archived")
            query = (f"SELECT thread_id, {_THREAD_COLUMNS} FROM threads "
                     + ("WHERE " + " AND ".join(where) + " " if where else "")
                     + 'ORDER BY updated_at DESC, thread_id COLLATE "C" DESC LIMIT %s OFFSET %s')
            async with self._pool.connection() as conn:
                rows = await (await conn.execute(query.encode(), (*args, limit, offset))
                              ).fetchall()
            return [_record(row[0], row[1:]) for row in rows]

    async def clock(self) -> float:
        """The database's time (epoch seconds): threads' `updated_at` is stamped by it, so
        `stale_threads` and `delete(updated_before=)` are asked in it."""
        async with self._reachable(), self._pool.connection() as conn:
            row = await (await conn.execute("SELECT extract(epoch FROM now())::float8")
                         ).fetchone()
        assert row is not None
        return float(row[0])

    async def stale_threads(self, before: float, limit: int = 100) -> builtins.list[str]:
        """The ids of the threads last updated before `before` (epoch seconds), the oldest
        first, at most `limit` (what a retention sweep deletes; `threads_by_updated`, read
        from its old end)."""
        async with self._reachable(), self._pool.connection() as conn:
            rows = await (await conn.execute(
                'SELECT thread_id FROM threads WHERE updated_at < %s '
                'ORDER BY updated_at, thread_id COLLATE "C" LIMIT %s', (before, limit))
                          ).fetchall()
        return [row[0] for row in rows]

    async def open_runs(self) -> builtins.list[tuple[str, str]]:
        async with self._reachable():
            async with self._pool.connection() as conn:
                rows = await (await conn.execute(
                    "SELECT thread_id, run_id FROM runs WHERE open ORDER BY created_at")).fetchall()
            return [(t, r) for t, r in rows]

    # -- writing -----------------------------------------------------------------------

    async def append_events(self, thread_id: str, agent_id: str, run_id: str,
                            created_at: float, first_position: int, events: Sequence[Event],
                            *, owner: ThreadOwner | None = None,
                            run_first: int | None = None) -> None:
        async with self._reachable(bounded=False):
            await self._running.write(_Running(
                thread_id, run_id, created_at, first_position,
                first_position + len(events) - 1 if events else None,
                orjson.dumps(events) if events else b"", agent_id,
                owner.principal_id if owner else None, owner.tenant if owner else None,
                title_of(events), first_position if run_first is None else run_first))

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         message_ids: Iterable[str], *, owner: ThreadOwner | None = None,
                         raw_first: int = -1, raw: Sequence[Event] = ()) -> None:
        snapshot = state_snapshot(run.events)
        async with self._reachable(bounded=False):
            finished = _Finished(
                thread_id, run.run_id, run.created_at, time.time(), run.first_position,
                run.last_position, orjson.dumps(run.events), agent_id,
                owner.principal_id if owner else None, owner.tenant if owner else None,
                title_of(run.events), raw_first if raw and raw_first >= 0 else -1,
                orjson.dumps(raw) if raw and raw_first >= 0 else b"", len(raw),
                b"" if snapshot is None else orjson.dumps(snapshot.get("snapshot")),
                builtins.list(message_ids))
            # Returns once the statement holding this run committed.
            await self._finished.write(finished)

    async def _prune(self, cursor: AsyncCursor[Any]) -> None:
        now = time.time()
        if now - self._pruned > _PRUNE_EVERY:
            self._pruned = now
            # The runs are committed already: a failed prune is only retried later.
            with contextlib.suppress(Exception):
                # The database's clock, as the stamps: a worker whose clock is ahead
                # deleted every worker's raw events at once (a resume inside a run just
                # ended replayed the whole run again).
                await cursor.execute("DELETE FROM run_events WHERE ended_at < "
                                     "extract(epoch FROM now()) - %s", (self.raw_retention,))
                await cursor.execute("DELETE FROM deleted_threads WHERE deleted_at < "
                                     "extract(epoch FROM now()) - %s",
                                     (self.deleted_retention,))

    async def close_interrupted(self, thread_id: str, run_id: str) -> bool:
        async with self._reachable(bounded=False):
            async with self._pool.connection() as conn, conn.transaction():
                row = await (await conn.execute(
                    "SELECT seq, first_position FROM runs WHERE thread_id = %s AND run_id = %s "
                    "AND open FOR UPDATE", (thread_id, run_id))).fetchone()
                if row is None:
                    return False
                seq, first = row
                chunks = await _chunks(conn, thread_id, -1, run_id)
                tail, tail_first, compacted, last = closed_run(thread_id, run_id, first, chunks)
                now = time.time()
                if tail:
                    await conn.execute(
                        "INSERT INTO run_events (thread_id, first_position, last_position, run_id, "
                        "events) VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                        (thread_id, tail_first, last, run_id, orjson.dumps(tail)))
                await conn.execute(
                    "UPDATE run_events SET ended_at = extract(epoch FROM now()) "
                    "WHERE thread_id = %s AND run_id = %s", (thread_id, run_id))
                snapshot = state_snapshot(compacted)
                await conn.execute(
                    "UPDATE runs SET events = %s, open = FALSE, last_position = %s, ended_at = %s, "
                    "has_state = %s, swept_from = %s WHERE thread_id = %s AND seq = %s",
                    (orjson.dumps(compacted), last, now, snapshot is not None,
                     tail_first if tail else None, thread_id, seq))
                await _advance(conn, thread_id, last)
                if snapshot is not None:  # unless a later run (by `seq`) left one
                    await conn.execute(
                        "UPDATE threads SET state = %s, state_seq = %s WHERE thread_id = %s "
                        "AND (state_seq IS NULL OR state_seq <= %s)",
                        (orjson.dumps(snapshot.get("snapshot")), seq, thread_id, seq))
                ids = [(thread_id, m) for m in message_ids_of(compacted)]
                if ids:
                    async with conn.cursor() as cursor:
                        await cursor.executemany(
                            "INSERT INTO message_ids (thread_id, message_id) VALUES (%s, %s) "
                            "ON CONFLICT DO NOTHING", ids)
            return True

    async def rename(self, thread_id: str, name: str | None, *,
                     owner: ThreadOwner | None = None) -> bool:
        async with self._reachable(bounded=False), self._pool.connection() as conn:
            if owner is None:
                cursor = await conn.execute(
                    "UPDATE threads SET name = %s WHERE thread_id = %s", (name, thread_id))
            else:
                cursor = await conn.execute(
                    "UPDATE threads SET name = %s WHERE thread_id = %s AND owner_id = %s "
                    "AND tenant IS NOT DISTINCT FROM %s",
                    (name, thread_id, owner.principal_id, owner.tenant))
            return cursor.rowcount > 0

    async def archive(self, thread_id: str, archived: bool = True, *,
                      owner: ThreadOwner | None = None) -> bool:
        async with self._reachable(bounded=False), self._pool.connection() as conn:
            if owner is None:
                cursor = await conn.execute(
                    "UPDATE threads SET archived = %s WHERE thread_id = %s",
                    (archived, thread_id))
            else:
                cursor = await conn.execute(
                    "UPDATE threads SET archived = %s WHERE thread_id = %s AND owner_id = %s "
                    "AND tenant IS NOT DISTINCT FROM %s",
                    (archived, thread_id, owner.principal_id, owner.tenant))
            return cursor.rowcount > 0

    async def delete(self, thread_id: str, *, updated_before: float | None = None,
                     next_position: int | None = None) -> bool:
        async with self._reachable(bounded=False), self._pool.connection() as conn:
            # One statement: the thread and its rows go together, or not at all, and how far
            # its positions went stays. Its row is locked as the conditions are checked: a
            # write to it committed meanwhile is waited for and checked again.
            cursor = await conn.execute(
                "WITH target AS (SELECT thread_id, next_position FROM threads "
                "WHERE thread_id = %(t)s AND (%(before)s::float8 IS NULL "
                "OR updated_at < %(before)s::float8) AND (%(next)s::int8 IS NULL "
                "OR next_position = %(next)s::int8) FOR UPDATE), "
                "runs AS (DELETE FROM runs WHERE thread_id IN (SELECT thread_id FROM target)), "
                "events AS (DELETE FROM run_events "
                "WHERE thread_id IN (SELECT thread_id FROM target)), "
                "ids AS (DELETE FROM message_ids "
                "WHERE thread_id IN (SELECT thread_id FROM target)), "
                "kept AS (INSERT INTO deleted_threads (thread_id, next_position) "
                "SELECT thread_id, next_position FROM target "
                "ON CONFLICT (thread_id) DO UPDATE SET next_position = "
                "GREATEST(deleted_threads.next_position, excluded.next_position), "
                "deleted_at = excluded.deleted_at) "
                "DELETE FROM threads WHERE thread_id IN (SELECT thread_id FROM target)",
                {"t": thread_id, "before": updated_before, "next": next_position})
            return cursor.rowcount > 0

    async def first_position(self, thread_id: str) -> int:
        known = self._first_positions.take(thread_id)
        if known is not None:  # read with the thread's head, just before
            return known
        async with self._reachable(), self._pool.connection() as conn:
            row = await (await conn.execute(
                "SELECT next_position FROM deleted_threads WHERE thread_id = %s",
                (thread_id,))).fetchone()
            return 0 if row is None else int(row[0])

    async def aclose(self) -> None:
        # What was finished or streamed, written or queued, is written first.
        await self._finished.wait_idle()
        await self._running.wait_idle()
        for lane in (self._heads, self._finished.lane, self._running.lane):
            await lane.aclose()
        if self._opened is not None:
            await self._pool.close()


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


def _future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


async def _earlier(conn: AsyncConnection[Any], thread_id: str, before: int,
                   max_bytes: int | None) -> Event | None:
    """`earlier_messages` of the finished runs before the run `before` (seq), read back as
    far as `max_bytes` of them (at least the last; sizes from the values' headers)."""
    cursor = await conn.execute(
        "SELECT events FROM (SELECT seq, events, octet_length(events) AS own, "
        "sum(octet_length(events)) OVER (ORDER BY seq DESC) AS newer FROM runs "
        "WHERE thread_id = %s AND NOT open AND seq < %s) r "
        "WHERE %s::bigint IS NULL OR newer <= %s OR newer = own ORDER BY seq DESC",
        (thread_id, before, max_bytes, max_bytes))
    return earlier_messages(decoded(blob for (blob,) in await cursor.fetchall()), max_bytes)


async def _state_of_unkept(conn: AsyncConnection[Any], thread_id: str, kept: bytes | None,
                           kept_seq: int, first_read: int) -> Any:
    """`state_of_unkept` of the runs an older release stored between the kept state's run
    and the first run read: read newest first, within `UNKEPT_STATE_BYTES` (sizes first,
    from the values' headers)."""
    sizes = await (await conn.execute(
        "SELECT seq, octet_length(events) FROM runs WHERE thread_id = %s AND NOT open AND "
        "has_state IS NULL AND seq > %s AND seq < %s ORDER BY seq DESC",
        (thread_id, kept_seq, first_read))).fetchall()
    wanted, total = [], 0
    for seq, size in sizes:
        total += size
        if total > UNKEPT_STATE_BYTES:
            break
        wanted.append(seq)
    blobs = [blob for (blob,) in await (await conn.execute(
        "SELECT events FROM runs WHERE thread_id = %s AND seq = ANY(%s) ORDER BY seq DESC",
        (thread_id, wanted))).fetchall()] if wanted else []
    return state_of_unkept(kept, blobs, complete=len(wanted) == len(sizes))


@dataclass(slots=True)
class _Finished:
    """A finished run on its way to the database, and what its caller awaits."""

    thread_id: str
    run_id: str
    created_at: float
    ended_at: float
    first_position: int
    last_position: int
    events: bytes
    agent_id: str
    owner_id: str | None
    tenant: str | None
    title: str
    raw_first: int  # -1: no raw events left to write
    raw: bytes
    raw_count: int
    state: bytes  # the state the run left (encoded JSON; empty: none)
    message_ids: builtins.list[str]
    done: asyncio.Future[None] = field(default_factory=_future)


@dataclass(slots=True)
class _Running:
    """A running run's next events on their way to the database."""

    thread_id: str
    run_id: str
    created_at: float
    first_position: int
    last_position: int | None  # None: no events (the run is only opened)
    events: bytes
    agent_id: str
    owner_id: str | None
    tenant: str | None
    title: str
    run_first: int  # the position of the run's first event
    done: asyncio.Future[None] = field(default_factory=_future)


async def _append_events(cursor: AsyncCursor[Any], batch: Sequence[_Running]) -> None:
    """Write running runs' next events (runs of distinct threads) in one statement."""
    texts: builtins.list[str | None] = []
    for r in batch:
        texts += (r.thread_id, r.run_id, repr(r.created_at), str(r.first_position),
                  None if r.last_position is None else str(r.last_position), r.agent_id,
                  r.owner_id, r.tenant, r.title, str(r.run_first))
    await cursor.execute(_APPEND_EVENTS, (texts, [r.events for r in batch]), prepare=True)


async def _finish_runs(cursor: AsyncCursor[Any], batch: Sequence[_Finished]) -> None:
    """Write finished runs of distinct threads in one statement."""
    texts: builtins.list[str | None] = []
    blobs: builtins.list[bytes] = []
    ids: builtins.list[str] = []
    for f in batch:
        has_raw = f.raw_first >= 0
        # Numbers travel as text (PostgreSQL casts them back exactly: repr of a float
        # round-trips), so that one array carries them all.
        texts += (f.thread_id, f.run_id, repr(f.created_at), repr(f.ended_at),
                  str(f.first_position), str(f.last_position), f.agent_id, f.owner_id,
                  f.tenant, f.title, str(f.raw_first) if has_raw else None,
                  str(f.raw_first + f.raw_count - 1) if has_raw else None)
        blobs += (f.events, f.raw, f.state)
        for message_id in f.message_ids:
            ids += (f.thread_id, message_id)
    await cursor.execute(_FINISH_RUNS, (texts, blobs, ids), prepare=True)


def _summary(thread_id: str, row: Sequence[Any] | None) -> ThreadRecord | None:
    if row is None:
        return None
    record = _record(thread_id, row[:-2])
    record.open_run = row[-2]
    record.message_ids = set(row[-1])
    return record


def _record(thread_id: str, row: Sequence[Any]) -> ThreadRecord:
    (agent_id, created_at, updated_at, owner_id, tenant, name, title, next_position,
     archived) = row
    return ThreadRecord(thread_id, agent_id, created_at, updated_at,
                        owner=ThreadOwner(owner_id, tenant) if owner_id is not None else None,
                        name=name, title=title or "", next_position=next_position,
                        archived=bool(archived))
