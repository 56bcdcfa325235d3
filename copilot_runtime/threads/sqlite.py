"""A thread store in an embedded SQLite file: threads survive a restart, no server needed.

The standard library's `sqlite3` runs on a thread of the store's own so the event loop never
waits on the disk; calls asked for while others are on that thread go together next, writes
in one transaction (`_store_thread`). WAL mode lets readers (`connect`, the thread routes)
proceed while a run is written, and lets the worker processes of one machine share the file.
A call that cannot have the file (another connection holds its write lock longer than
`busy_timeout`: a backup, a `sqlite3` shell left in a transaction), or cannot write it (a full
disk, an I/O error, a read-only file), is a `ServiceUnavailableError` (503), nothing written.
The schema is versioned; `_MIGRATIONS` run at start-up inside one write transaction, so
processes that open the same new file together migrate it once.
"""

from __future__ import annotations

import builtins
import math
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import orjson

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime._sqlite_outage import sqlite_outages
from copilot_runtime.events import Event
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
from copilot_runtime.threads._store_thread import Call, StoreThread
from copilot_runtime.threads.base import (
    DELETED_RETENTION,
    MAX_REPLAY_BYTES,
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

__all__ = ["SQLiteThreadStore"]

try:
    import fcntl
except ImportError:  # not a POSIX system: files are not held (see `serve_alone`)
    fcntl = None  # type: ignore[assignment]

#: The files held by this process (`serve_alone`): each one's open lock file and how many
#: holders it has here.
_ALONE: dict[str, list[Any]] = {}
_ALONE_LOCK = threading.Lock()


def _nothing() -> None:
    pass

_T = TypeVar("_T")

#: Seconds the start-up's migration waits for the file: processes starting together take
#: turns, and one may be migrating a large file.
_MIGRATE_WAIT = 30.0

#: Version 1: the tables of the first releases (owners added to files made before them).
_V1 = """
CREATE TABLE IF NOT EXISTS threads (
    thread_id TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS threads_by_agent ON threads (agent_id, updated_at);
CREATE TABLE IF NOT EXISTS runs (
    thread_id TEXT NOT NULL REFERENCES threads (thread_id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    run_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    events BLOB NOT NULL,
    PRIMARY KEY (thread_id, seq)
);
CREATE TABLE IF NOT EXISTS message_ids (
    thread_id TEXT NOT NULL REFERENCES threads (thread_id) ON DELETE CASCADE,
    message_id TEXT NOT NULL,
    PRIMARY KEY (thread_id, message_id)
) WITHOUT ROWID;
"""

#: Version 2: names and titles, positions, runs written while they stream.
_V2 = """
ALTER TABLE threads ADD COLUMN name TEXT;
ALTER TABLE threads ADD COLUMN title TEXT NOT NULL DEFAULT '';
ALTER TABLE threads ADD COLUMN next_position INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN open INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN first_position INTEGER NOT NULL DEFAULT -1;
ALTER TABLE runs ADD COLUMN last_position INTEGER NOT NULL DEFAULT -1;
ALTER TABLE runs ADD COLUMN ended_at REAL;
CREATE INDEX runs_open ON runs (open) WHERE open = 1;
CREATE TABLE run_events (
    thread_id TEXT NOT NULL REFERENCES threads (thread_id) ON DELETE CASCADE,
    first_position INTEGER NOT NULL,
    last_position INTEGER NOT NULL,
    run_id TEXT NOT NULL,
    events BLOB NOT NULL,
    PRIMARY KEY (thread_id, first_position)
);
"""


#: Version 3: how far the positions of deleted threads had got (`first_position`).
_V3 = """
CREATE TABLE deleted_threads (
    thread_id TEXT PRIMARY KEY,
    next_position INTEGER NOT NULL
) WITHOUT ROWID
"""


def _v1(db: sqlite3.Connection) -> None:
    for statement in _V1.split(";"):
        if statement.strip():
            db.execute(statement)
    columns = {row[1] for row in db.execute("PRAGMA table_info(threads)")}
    for name in ("owner_id", "tenant"):
        if name not in columns:
            db.execute(f"ALTER TABLE threads ADD COLUMN {name} TEXT")
    db.execute("CREATE INDEX IF NOT EXISTS threads_by_owner ON threads "
               "(owner_id, tenant, updated_at)")


def _v2(db: sqlite3.Connection) -> None:
    for statement in _V2.split(";"):
        if statement.strip():
            db.execute(statement)


def _v3(db: sqlite3.Connection) -> None:
    db.execute(_V3)


def _v4(db: sqlite3.Connection) -> None:
    """When a thread was deleted, so how far its positions went is forgotten once no client
    can still hold one of its event ids (rows of earlier deletes count from now)."""
    db.execute("ALTER TABLE deleted_threads ADD COLUMN deleted_at REAL NOT NULL DEFAULT 0")
    db.execute("UPDATE deleted_threads SET deleted_at = ?", (time.time(),))
    db.execute("CREATE INDEX deleted_threads_by_time ON deleted_threads (deleted_at)")


def _v5(db: sqlite3.Connection) -> None:
    """Threads by when they were updated: the list of every agent's threads (newest first)
    and a retention sweep's stale threads (oldest first) read it instead of sorting the
    whole table."""
    db.execute("CREATE INDEX threads_by_updated ON threads (updated_at, thread_id)")


def _v6(db: sqlite3.Connection) -> None:
    """The state the thread's last finished run that had one left, kept with the thread,
    and that run's `seq`: a read of the newest runs alone (`get(max_bytes=)`) answers it
    however old that run is. Threads stored before keep none until their next such run,
    and an older release (rolled back across this) keeps none for the runs it stores:
    their runs read answer, as before."""
    db.execute("ALTER TABLE threads ADD COLUMN state BLOB")
    db.execute("ALTER TABLE threads ADD COLUMN state_seq INTEGER")
    # Whether a run left a state (NULL: stored by a release that did not say, which keeps
    # none with its thread: a read looks through those, `state_of_unkept`).
    db.execute("ALTER TABLE runs ADD COLUMN has_state INTEGER")


def _v7(db: sqlite3.Connection) -> None:
    """Titles of threads begun before titles existed. `_v2` left every thread of a file of
    the first schema untitled, so a thread's next run titled it with its own message (the
    newest); each is titled from its runs now, as if this release had stored them: by the
    first with a user message's text (`title_of`). Threads with runs stored before positions
    (-1: from before 624f558, or by it) are titled again too: a release since may have
    titled them so."""
    threads = db.execute(
        "SELECT thread_id, title FROM threads t WHERE title = '' OR EXISTS (SELECT 1 FROM "
        "runs r WHERE r.thread_id = t.thread_id AND r.open = 0 AND r.last_position < 0)"
    ).fetchall()
    for thread_id, title in threads:
        found = ""
        # One run read at a time: the first titled one is, most often, the first run.
        for (events,) in db.execute("SELECT events FROM runs WHERE thread_id = ? AND open = 0 "
                                    "ORDER BY seq", (thread_id,)):
            found = title_of(orjson.loads(events))
            if found:
                break
        if found and found != title:
            db.execute("UPDATE threads SET title = ? WHERE thread_id = ?", (found, thread_id))


def _v8(db: sqlite3.Connection) -> None:
    """Whether a thread is archived (`archive`): lists leave it out unless asked for it.
    An older release (rolled back across this) lists every thread, as it did. (Added
    once: a file whose recorded version was set back has it already.)"""
    if "archived" not in {row[1] for row in db.execute("PRAGMA table_info(threads)")}:
        db.execute("ALTER TABLE threads ADD COLUMN archived INTEGER NOT NULL DEFAULT 0")


def _v9(db: sqlite3.Connection) -> None:
    """Where the closing events a sweep stored for a run its worker left open begin
    (`RunRow.swept_from`): a client resuming at or after it saw events never written. An
    older release (rolled back across this) replays such runs as before. (Added once, as
    `_v8`.)"""
    if "swept_from" not in {row[1] for row in db.execute("PRAGMA table_info(runs)")}:
        db.execute("ALTER TABLE runs ADD COLUMN swept_from INTEGER")


#: Seconds between deletions of the raw events whose retention ended.
_PRUNE_EVERY = 30.0

_MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (
    _v1, _v2, _v3, _v4, _v5, _v6, _v7, _v8, _v9)
#: The migrations older releases cannot tell from their absence (see `oldest_reader`).
_ADDITIVE = frozenset({4, 5, 6, 7, 8, 9})


class SQLiteThreadStore:
    #: Seconds a finished run's raw events are kept, for exact `Last-Event-ID` resumes.
    raw_retention = 600.0
    #: Seconds a deleted thread's positions are remembered (see `first_position`).
    deleted_retention = DELETED_RETENTION
    #: What `events_after` reads of a thread's finished runs (`MAX_REPLAY_BYTES`).
    replay_bytes = MAX_REPLAY_BYTES
    #: Seconds a call waits for the file while another connection holds its write lock,
    #: before it is a ServiceUnavailableError (503). A write of another process sharing the
    #: file holds it for milliseconds; longer, it is someone else's transaction (a backup, a
    #: `sqlite3` shell), which may last minutes: a request is answered then, not held 30 s
    #: (SQLite's default here before) for a 500. A run's end is not given up: its write is
    #: tried again until the file is free (`_runs.STORE_RETRY_FOR`).
    busy_timeout = 5.0

    def __init__(self, path: str | Path, *, raw_retention: float | None = None,
                 busy_timeout: float | None = None) -> None:
        self.path = str(path)
        if raw_retention is not None:
            self.raw_retention = raw_retention
        if busy_timeout is not None:
            self.busy_timeout = busy_timeout
        self._lock = threading.Lock()
        self._pruned = 0.0
        self._first_positions = FirstPositions()
        self._open()

    def _open(self) -> None:
        try:
            # Opening too: its directory missing is "unable to open database file".
            self._db = sqlite3.connect(self.path, check_same_thread=False,
                                       isolation_level=None, timeout=_MIGRATE_WAIT)
            try:
                with self._lock:
                    self._db.execute("PRAGMA journal_mode=WAL")
                    self._db.execute("PRAGMA synchronous=NORMAL")
                    self._db.execute("PRAGMA foreign_keys=ON")
                    self._migrate()
                    self._db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
            except BaseException:
                self._db.close()
                raise
        except sqlite3.Error as exc:
            # Which file ("database is locked", "file is not a database": the thread store's,
            # or the checkpoints'?).
            raise type(exc)(f"{exc} ({self.path})") from exc
        self._calls = StoreThread(self._db, self._lock)
        self._file_closed = False
        # Dropped without `aclose()`: its thread ends now rather than once it has idled.
        weakref.finalize(self, self._calls.release)

    def reopen(self) -> None:
        """Open the file again after `aclose` (a runtime started again: an app's lifespan
        run twice, as by a test client used twice); nothing while it is open."""
        if self._file_closed:
            self._open()

    def _migrate(self) -> None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            # The oldest version whose code may use the store (NULL: the version itself).
            if "oldest_reader" not in {c[1] for c in db.execute(
                    "PRAGMA table_info(schema_version)")}:
                db.execute("ALTER TABLE schema_version ADD COLUMN oldest_reader INTEGER")
            row = db.execute("SELECT version, oldest_reader FROM schema_version").fetchone()
            version = row[0] if row else 0
            known = len(_MIGRATIONS)
            check_schema_version(repr(self.path), version, known, row[1] if row else None)
            for number, migration in enumerate(_MIGRATIONS, start=1):
                if number > version:
                    migration(db)
            readers = oldest_reader(known, _ADDITIVE)
            if row is None:
                db.execute("INSERT INTO schema_version VALUES (?, ?)", (known, readers))
            elif version < known:
                # (a newer release's store, open to this one, keeps its version)
                db.execute("UPDATE schema_version SET version = ?, oldest_reader = ?",
                           (known, readers))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    @property
    def schema_version(self) -> int:
        with self._lock:
            (version,) = self._db.execute("SELECT version FROM schema_version").fetchone()
        return int(version)

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the store's thread, with the calls asked for meanwhile."""
        return await self._submit(Call(fn, args, False))

    async def _write(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` in a write transaction on the store's thread, with the writes asked
        for meanwhile (one commit for them all); returns once its transaction committed."""
        return await self._submit(Call(fn, args, True))

    async def _submit(self, call: Call[_T]) -> _T:
        # A file held, or that cannot be written (a full disk): its transaction never began,
        # or was rolled back, nothing of it written; a run's end is tried again until it is.
        async with sqlite_outages("The thread store"):
            return await self._calls.submit(call)

    async def check_writable(self) -> None:
        """Return once a write could be made now (the file's write lock taken and given
        back at once): `ServiceUnavailableError` while another connection holds it. A
        delete asks first, before the thread's agents forget it."""
        await self._write(_nothing)

    # -- reading -----------------------------------------------------------------------

    async def get(self, thread_id: str, *, max_bytes: int | None = None
                  ) -> ThreadRecord | None:
        return await self._call(self._get, thread_id, max_bytes)

    def _get(self, thread_id: str, max_bytes: int | None = None) -> ThreadRecord | None:
        record = self._summary(thread_id)
        if record is None:
            return None
        sizes = self._db.execute("SELECT seq, length(events) FROM runs WHERE thread_id = ? "
                                 "AND open = 0 ORDER BY seq DESC", (thread_id,)).fetchall()
        kept = newest_within([size for _, size in sizes], max_bytes)
        record.omitted_runs = len(sizes) - kept
        oldest = sizes[kept - 1][0] if kept else 0
        for run_id, created_at, events, first, last in self._db.execute(
                "SELECT run_id, created_at, events, first_position, last_position FROM runs "
                "WHERE thread_id = ? AND open = 0 AND seq >= ? ORDER BY seq",
                (thread_id, oldest)):
            record.runs.append(StoredRun(run_id, orjson.loads(events), created_at,
                                         len(events), first, last))
        if record.omitted_runs:
            record.earlier = self._earlier(thread_id, oldest, max_bytes)
        if not any(state_snapshot(run.events) is not None for run in record.runs):
            # The run that left the state was not read (or there is none).
            state, seq = self._db.execute("SELECT state, state_seq FROM threads WHERE "
                                          "thread_id = ?", (thread_id,)).fetchone() or (None, None)
            if seq is not None or record.omitted_runs:
                # (None kept: the state, if any, is one only an older release's runs left)
                after = 0 if seq is None else seq
                before = oldest if kept else sizes[0][0] + 1 if seq is None else seq + 1
                unkept = self._db.execute(
                    "SELECT events FROM runs WHERE thread_id = ? AND open = 0 AND has_state "
                    "IS NULL AND seq > ? AND seq < ? ORDER BY seq DESC",
                    (thread_id, after, before))
                record.kept_state = state_of_unkept(state, (blob for (blob,) in unkept))
        return record

    async def summary(self, thread_id: str) -> ThreadRecord | None:
        return await self._call(self._summary, thread_id)

    def _summary(self, thread_id: str) -> ThreadRecord | None:
        row = self._db.execute(
            "SELECT agent_id, created_at, updated_at, owner_id, tenant, name, title, "
            "next_position, archived FROM threads WHERE thread_id = ?", (thread_id,)).fetchone()
        if row is None:
            # Where a new thread's positions go on from, read now: its run's start asks next.
            self._first_positions.note(thread_id, self._first_position(thread_id))
            return None
        record = _record(thread_id, row)
        record.message_ids = {m for (m,) in self._db.execute(
            "SELECT message_id FROM message_ids WHERE thread_id = ?", (thread_id,))}
        open_run = self._db.execute("SELECT run_id FROM runs WHERE thread_id = ? AND open = 1 "
                                    "LIMIT 1", (thread_id,)).fetchone()
        record.open_run = None if open_run is None else open_run[0]
        return record

    async def events_after(self, thread_id: str, position: int) -> list[Positioned]:
        return await self._call(self._events_after, thread_id, position)

    def _events_after(self, thread_id: str, position: int) -> builtins.list[Positioned]:
        # Of the finished runs, the newest within `replay_bytes` (at least the last): the
        # size of each and of those after it, read without reading the events; and how
        # many finished runs there are after `position`, to count those left out.
        rows = self._db.execute(
            "SELECT run_id, open, first_position, last_position, events, finished, seq, "
            "swept_from, resumed FROM (SELECT seq, run_id, open, first_position, "
            "last_position, events, swept_from, resumed, "
            "CASE WHEN open = 1 THEN 0 ELSE length(events) END AS own, "
            "sum(CASE WHEN open = 1 THEN 0 ELSE length(events) END) "
            "OVER (ORDER BY seq DESC) AS newer, sum(1 - open) OVER () AS finished FROM ("
            # (`resumed_at`)
            "SELECT *, coalesce(swept_from BETWEEN 0 AND :p AND NOT EXISTS (SELECT 1 FROM "
            "runs n WHERE n.thread_id = r.thread_id AND n.seq > r.seq AND n.first_position "
            "BETWEEN 0 AND :p), 0) AS resumed FROM runs r WHERE r.thread_id = :t) "
            # (runs stored before positions, -1: only in a whole-thread replay, `ends_after`)
            "WHERE open = 1 OR :p < 0 OR last_position > :p OR resumed) "
            "WHERE open = 1 OR newer <= :b OR newer = own ORDER BY seq",
            {"t": thread_id, "p": position, "b": self.replay_bytes}).fetchall()
        runs = [RunRow(run_id, bool(is_open), first, last,
                       [] if is_open or (0 <= last <= position and not resumed)
                       else orjson.loads(events), swept)
                for run_id, is_open, first, last, events, _, _, swept, resumed in rows]
        # (a swept run's closing events, for a client resumed among them)
        chunks = self._chunks(thread_id, min(
            (resumed_at(runs[i:], position) for i in range(len(runs))), default=position))
        omitted = rows[0][5] - sum(not run.open for run in runs) if rows else 0
        # (a resume's client holds the thread's messages before its position already)
        first_kept = min((row[6] for row in rows if not row[1]), default=0)
        earlier = self._earlier(thread_id, first_kept, self.replay_bytes) \
            if omitted and position < 0 else None
        return events_after(runs, chunks, position, omitted, earlier)

    def _earlier(self, thread_id: str, before: int, max_bytes: int | None) -> Event | None:
        """`earlier_messages` of the finished runs before the run `before` (seq), read back
        as far as `max_bytes` of them (at least the last)."""
        blobs = self._db.execute(
            "SELECT events FROM (SELECT seq, events, length(events) AS own, "
            "sum(length(events)) OVER (ORDER BY seq DESC) AS newer FROM runs "
            "WHERE thread_id = ? AND open = 0 AND seq < ?) "
            "WHERE ? IS NULL OR newer <= ? OR newer = own ORDER BY seq DESC",
            (thread_id, before, max_bytes, max_bytes))
        return earlier_messages(decoded(blob for (blob,) in blobs), max_bytes)

    def _chunks(self, thread_id: str, position: int,
                run_id: str | None = None) -> builtins.list[Chunk]:
        query = ("SELECT run_id, first_position, events FROM run_events WHERE thread_id = ? "
                 "AND last_position > ?")
        args: builtins.list[Any] = [thread_id, position]
        if run_id is not None:
            query += " AND run_id = ?"
            args.append(run_id)
        return [Chunk(r, first, orjson.loads(events))
                for r, first, events in self._db.execute(query, args)]

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: ThreadOwner | None = None, offset: int = 0,
                   after: ListPosition | None = None, include_archived: bool = True
                   ) -> builtins.list[ThreadRecord]:
        return await self._call(self._list, agent_id, limit, owner, offset, after,
                                include_archived)

    def _list(self, agent_id: str | None, limit: int, owner: ThreadOwner | None,
              offset: int, after: ListPosition | None, include_archived: bool
              ) -> builtins.list[ThreadRecord]:
        # Ids compare as SQLite's BINARY collation does: their UTF-8 bytes, the order of
        # their code points (as the other stores order them).
        where: builtins.list[str] = []
        args: builtins.list[Any] = []
        if after is not None:
            where.append("(updated_at, thread_id) < (?, ?)")
            args.extend(after)
        if agent_id is not None:
            where.append("agent_id = ?")
            args.append(agent_id)
        if owner is not None:
            where.append("owner_id = ? AND tenant IS ?")
            args.extend((owner.principal_id, owner.tenant))
        if not include_archived:
            where.append("archived = 0")
        rows = self._db.execute(
            "SELECT thread_id, agent_id, created_at, updated_at, owner_id, tenant, name, "
            "title, next_position, archived FROM threads "
            + ("WHERE " + " AND ".join(where) + " " if where else "")
            + "ORDER BY updated_at DESC, thread_id DESC LIMIT ? OFFSET ?",
            (*args, limit, offset))
        return [_record(row[0], row[1:]) for row in rows]

    async def stale_threads(self, before: float, limit: int = 100) -> builtins.list[str]:
        """The ids of the threads last updated before `before` (epoch seconds), the oldest
        first, at most `limit` (what a retention sweep deletes)."""
        return await self._call(lambda: [row[0] for row in self._db.execute(
            "SELECT thread_id FROM threads WHERE updated_at < ? "
            "ORDER BY updated_at, thread_id LIMIT ?", (before, limit))])

    async def open_runs(self) -> builtins.list[tuple[str, str]]:
        return await self._call(lambda: [
            (t, r) for t, r in self._db.execute(
                "SELECT thread_id, run_id FROM runs WHERE open = 1 ORDER BY created_at")])

    # -- writing -----------------------------------------------------------------------

    def _thread(self, thread_id: str, agent_id: str, created_at: float,
                owner: ThreadOwner | None, events: Sequence[Event]) -> None:
        self._db.execute(
            "INSERT INTO threads (thread_id, agent_id, created_at, updated_at, owner_id, "
            "tenant, title) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (thread_id) DO UPDATE "
            "SET updated_at = max(threads.updated_at, excluded.updated_at), title = "
            "CASE WHEN threads.title = '' THEN excluded.title ELSE threads.title END",
            (thread_id, agent_id, created_at, created_at,
             owner.principal_id if owner else None, owner.tenant if owner else None,
             title_of(events)))

    def _open_seq(self, thread_id: str, run_id: str) -> int | None:
        row = self._db.execute("SELECT seq FROM runs WHERE thread_id = ? AND run_id = ? "
                               "AND open = 1", (thread_id, run_id)).fetchone()
        return None if row is None else int(row[0])

    def _next_seq(self, thread_id: str) -> int:
        (seq,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM runs "
                                  "WHERE thread_id = ?", (thread_id,)).fetchone()
        return int(seq)

    def _closed(self, thread_id: str, run_id: str, where: str, *values: Any) -> bool:
        """Whether the run is closed already (a sweep closed it while its worker stalled,
        or this write was made before): a late write of it must change nothing, neither
        reopen it nor overwrite the positions a later run took."""
        return self._db.execute(
            f"SELECT 1 FROM runs WHERE thread_id = ? AND run_id = ? AND open = 0 AND {where}",
            (thread_id, run_id, *values)).fetchone() is not None

    def _deleted_since(self, thread_id: str, run_first: int) -> bool:
        """Whether the thread was deleted after the run beginning at `run_first` began
        (workers sharing the file stall too): a late write of it must not bring the thread
        back. A new thread of the id begins at the deleted one's end."""
        return self._db.execute(
            "SELECT 1 FROM deleted_threads WHERE thread_id = ? AND next_position > ?",
            (thread_id, run_first)).fetchone() is not None

    def _keep_state(self, thread_id: str, seq: int, snapshot: Event) -> None:
        """Keep the state a finished run left with its thread, unless a later run (by
        `seq`) left one: a run closed as interrupted after the next one finished."""
        self._db.execute("UPDATE threads SET state = ?, state_seq = ? WHERE thread_id = ? "
                         "AND (state_seq IS NULL OR state_seq <= ?)",
                         (orjson.dumps(snapshot.get("snapshot")), seq, thread_id, seq))

    def _advance(self, thread_id: str, last_position: int) -> None:
        self._db.execute("UPDATE threads SET next_position = max(next_position, ?) "
                         "WHERE thread_id = ?", (last_position + 1, thread_id))

    async def append_events(self, thread_id: str, agent_id: str, run_id: str,
                            created_at: float, first_position: int, events: Sequence[Event],
                            *, owner: ThreadOwner | None = None,
                            run_first: int | None = None) -> None:
        await self._write(self._append_events, thread_id, agent_id, run_id,
                         created_at, first_position, orjson.dumps(events), events, owner,
                         first_position if run_first is None else run_first)

    def _append_events(self, thread_id: str, agent_id: str, run_id: str, created_at: float,
                       first_position: int, blob: bytes, events: Sequence[Event],
                       owner: ThreadOwner | None, run_first: int) -> None:
        # Every late chunk of a run closed meanwhile, not only the first (known by its start).
        if self._closed(thread_id, run_id, "(last_position >= ? OR created_at = ?)",
                        first_position, created_at) or self._deleted_since(thread_id, run_first):
            return
        self._thread(thread_id, agent_id, created_at, owner, events)
        if self._open_seq(thread_id, run_id) is None:
            self._db.execute(
                "INSERT INTO runs (thread_id, seq, run_id, created_at, events, open, "
                "first_position) VALUES (?, ?, ?, ?, x'5b5d', 1, ?)",
                (thread_id, self._next_seq(thread_id), run_id, created_at, first_position))
        if events:
            self._db.execute("INSERT OR REPLACE INTO run_events (thread_id, first_position, "
                             "last_position, run_id, events) VALUES (?, ?, ?, ?, ?)",
                             (thread_id, first_position, first_position + len(events) - 1,
                              run_id, blob))
            self._advance(thread_id, first_position + len(events) - 1)

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         message_ids: Iterable[str], *, owner: ThreadOwner | None = None,
                         raw_first: int = -1, raw: Sequence[Event] = ()) -> None:
        await self._write(self._append, thread_id, agent_id, run,
                         orjson.dumps(run.events), builtins.list(message_ids), owner,
                         raw_first, orjson.dumps(raw) if raw else b"", raw)

    def _append(self, thread_id: str, agent_id: str, run: StoredRun, blob: bytes,
                message_ids: builtins.list[str], owner: ThreadOwner | None,
                raw_first: int, raw_blob: bytes, raw: Sequence[Event]) -> None:
        db = self._db
        if self._closed(thread_id, run.run_id, "first_position = ?", run.first_position) \
                or self._deleted_since(thread_id, run.first_position):
            return
        now = time.time()
        db.execute(
            "INSERT INTO threads (thread_id, agent_id, created_at, updated_at, owner_id, "
            "tenant, title, next_position) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT "
            "(thread_id) DO UPDATE SET updated_at = max(threads.updated_at, "
            "excluded.updated_at), next_position = max(threads.next_position, "
            "excluded.next_position), title = CASE WHEN threads.title = '' "
            "THEN excluded.title ELSE threads.title END",
            (thread_id, agent_id, run.created_at, run.created_at,
             owner.principal_id if owner else None, owner.tenant if owner else None,
             title_of(run.events), run.last_position + 1))
        snapshot = state_snapshot(run.events)
        # The run's place among its thread's runs, for the state it left (`_keep_state`).
        seq = self._open_seq(thread_id, run.run_id) if snapshot is not None else None
        closed = db.execute(
            "UPDATE runs SET events = ?, open = 0, last_position = ?, ended_at = ?, "
            "has_state = ? WHERE thread_id = ? AND run_id = ? AND open = 1",
            (blob, run.last_position, now, snapshot is not None, thread_id,
             run.run_id)).rowcount
        if not closed:  # no events were written while it ran
            seq = self._next_seq(thread_id)
            db.execute("INSERT INTO runs (thread_id, seq, run_id, created_at, events, "
                       "first_position, last_position, ended_at, has_state) VALUES (?, ?, ?, "
                       "?, ?, ?, ?, ?, ?)", (thread_id, seq, run.run_id, run.created_at, blob,
                                             run.first_position, run.last_position, now,
                                             snapshot is not None))
        if snapshot is not None and seq is not None:
            self._keep_state(thread_id, seq, snapshot)
        if raw and raw_first >= 0:
            db.execute("INSERT OR REPLACE INTO run_events (thread_id, first_position, "
                       "last_position, run_id, events) VALUES (?, ?, ?, ?, ?)",
                       (thread_id, raw_first, raw_first + len(raw) - 1, run.run_id, raw_blob))
        db.executemany("INSERT OR IGNORE INTO message_ids (thread_id, message_id) "
                       "VALUES (?, ?)", [(thread_id, m) for m in message_ids])
        if now - self._pruned > _PRUNE_EVERY:
            self._pruned = now
            db.execute("DELETE FROM run_events WHERE EXISTS (SELECT 1 FROM runs r WHERE "
                       "r.thread_id = run_events.thread_id AND r.run_id = run_events.run_id "
                       "AND r.open = 0 AND r.ended_at < ?)", (now - self.raw_retention,))
            db.execute("DELETE FROM deleted_threads WHERE deleted_at < ?",
                       (now - self.deleted_retention,))

    async def close_interrupted(self, thread_id: str, run_id: str) -> bool:
        return await self._write(self._close_interrupted, thread_id, run_id)

    def _close_interrupted(self, thread_id: str, run_id: str) -> bool:
        row = self._db.execute(
            "SELECT seq, first_position, created_at FROM runs WHERE thread_id = ? "
            "AND run_id = ? AND open = 1", (thread_id, run_id)).fetchone()
        if row is None:
            return False
        seq, first, _created = row
        chunks = self._chunks(thread_id, -1, run_id)
        tail, tail_first, compacted, last = closed_run(thread_id, run_id, first, chunks)
        if tail:
            self._db.execute("INSERT OR REPLACE INTO run_events (thread_id, first_position, "
                             "last_position, run_id, events) VALUES (?, ?, ?, ?, ?)",
                             (thread_id, tail_first, last, run_id, orjson.dumps(tail)))
        snapshot = state_snapshot(compacted)
        self._db.execute("UPDATE runs SET events = ?, open = 0, last_position = ?, "
                         "ended_at = ?, has_state = ?, swept_from = ? WHERE thread_id = ? "
                         "AND seq = ?",
                         (orjson.dumps(compacted), last, time.time(), snapshot is not None,
                          tail_first if tail else None, thread_id, seq))
        self._advance(thread_id, last)
        if snapshot is not None:
            self._keep_state(thread_id, seq, snapshot)
        self._db.executemany("INSERT OR IGNORE INTO message_ids (thread_id, message_id) "
                             "VALUES (?, ?)", [(thread_id, m) for m in message_ids_of(compacted)])
        return True

    async def rename(self, thread_id: str, name: str | None, *,
                     owner: ThreadOwner | None = None) -> bool:
        if owner is None:
            return await self._write(lambda: self._db.execute(
                "UPDATE threads SET name = ? WHERE thread_id = ?", (name, thread_id)
            ).rowcount > 0)
        return await self._write(lambda: self._db.execute(
            "UPDATE threads SET name = ? WHERE thread_id = ? AND owner_id = ? AND tenant IS ?",
            (name, thread_id, owner.principal_id, owner.tenant)).rowcount > 0)

    async def archive(self, thread_id: str, archived: bool = True, *,
                      owner: ThreadOwner | None = None) -> bool:
        if owner is None:
            return await self._write(lambda: self._db.execute(
                "UPDATE threads SET archived = ? WHERE thread_id = ?", (archived, thread_id)
            ).rowcount > 0)
        return await self._write(lambda: self._db.execute(
            "UPDATE threads SET archived = ? WHERE thread_id = ? AND owner_id = ? "
            "AND tenant IS ?", (archived, thread_id, owner.principal_id, owner.tenant)
        ).rowcount > 0)

    async def delete(self, thread_id: str, *, updated_before: float | None = None,
                     next_position: int | None = None) -> bool:
        return await self._write(self._delete, thread_id, updated_before, next_position)

    def _delete(self, thread_id: str, updated_before: float | None,
                next_position: int | None) -> bool:
        # (the conditions checked in the write transaction: no run's write comes between)
        before = math.inf if updated_before is None else updated_before
        self._db.execute(
            "INSERT INTO deleted_threads (thread_id, next_position, deleted_at) SELECT "
            "thread_id, next_position, ? FROM threads WHERE thread_id = ? AND updated_at < ? "
            "AND (? IS NULL OR next_position = ?) "
            "ON CONFLICT (thread_id) DO UPDATE SET next_position = "
            "max(deleted_threads.next_position, excluded.next_position), "
            "deleted_at = excluded.deleted_at",
            (time.time(), thread_id, before, next_position, next_position))
        return self._db.execute("DELETE FROM threads WHERE thread_id = ? AND updated_at < ? "
                                "AND (? IS NULL OR next_position = ?)",
                                (thread_id, before, next_position, next_position)
                                ).rowcount > 0

    async def first_position(self, thread_id: str) -> int:
        known = self._first_positions.take(thread_id)
        if known is not None:  # read with the thread's head, just before
            return known
        return await self._call(self._first_position, thread_id)

    def _first_position(self, thread_id: str) -> int:
        row = self._db.execute("SELECT next_position FROM deleted_threads WHERE thread_id = ?",
                               (thread_id,)).fetchone()
        return 0 if row is None else int(row[0])

    def serve_alone(self) -> Callable[[], None]:
        """Hold the file for this process alone, as a runtime whose runs are coordinated in
        its memory needs (a second process would run a thread's runs at once, their events
        stored over each other, and close the first one's runs at its start): an advisory
        lock on `<file>.lock`, which the system gives back when the process ends, however it
        ends. Several holders in this process share it; the returned function gives one
        back. `ConfigurationError` if another process holds it."""
        if self.path == ":memory:" or fcntl is None:  # nothing shared, or no POSIX locks
            return _nothing
        key = str(Path(self.path).resolve())
        with _ALONE_LOCK:
            held = _ALONE.get(key)
            if held is None:
                lock = open(key + ".lock", "a")  # noqa: SIM115 - held while claimed
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    lock.close()
                    raise ConfigurationError(
                        f"another process serves {self.path} with a local coordinator, and "
                        "two would run a thread's runs at once") from None
                held = _ALONE[key] = [lock, 0]
            held[1] += 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            with _ALONE_LOCK:
                if given_back:
                    return
                given_back = True
                held[1] -= 1
                if held[1] == 0 and _ALONE.get(key) is held:
                    del _ALONE[key]
                    held[0].close()  # the lock goes with the file's last descriptor

        return give_back

    async def aclose(self) -> None:
        # What was asked for before is run (and committed) first.
        await self._calls.aclose()
        with self._lock:
            self._db.close()
        self._file_closed = True


def _record(thread_id: str, row: Sequence[Any]) -> ThreadRecord:
    (agent_id, created_at, updated_at, owner_id, tenant, name, title, next_position,
     archived) = row
    return ThreadRecord(thread_id, agent_id, created_at, updated_at,
                        owner=ThreadOwner(owner_id, tenant) if owner_id is not None else None,
                        name=name, title=title or "", next_position=next_position,
                        archived=bool(archived))
