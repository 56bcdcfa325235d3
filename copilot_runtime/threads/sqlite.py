"""A thread store in an embedded SQLite file: threads survive a restart, no server needed.

The standard library's `sqlite3` runs in a worker thread so the event loop never waits on
the disk; a store makes one write transaction per finished run. WAL mode lets readers
(`connect`, the thread routes) proceed while a run is written.
"""

from __future__ import annotations

import asyncio
import builtins
import sqlite3
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import orjson

from copilot_runtime.threads.base import StoredRun, ThreadOwner, ThreadRecord

__all__ = ["SQLiteThreadStore"]

_T = TypeVar("_T")

_SCHEMA = """
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


class SQLiteThreadStore:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
            _add_owner_columns(self._db)

    async def _call(self, fn: Any, *args: Any) -> Any:
        def locked() -> Any:
            with self._lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    async def get(self, thread_id: str) -> ThreadRecord | None:
        result: ThreadRecord | None = await self._call(self._get, thread_id)
        return result

    def _get(self, thread_id: str) -> ThreadRecord | None:
        row = self._db.execute(
            "SELECT agent_id, created_at, updated_at, owner_id, tenant FROM threads "
            "WHERE thread_id = ?", (thread_id,)).fetchone()
        if row is None:
            return None
        record = ThreadRecord(thread_id, row[0], row[1], row[2], owner=_owner(row[3], row[4]))
        for run_id, created_at, events in self._db.execute(
                "SELECT run_id, created_at, events FROM runs WHERE thread_id = ? ORDER BY seq",
                (thread_id,)):
            record.runs.append(StoredRun(run_id, orjson.loads(events), created_at))
        record.message_ids = {m for (m,) in self._db.execute(
            "SELECT message_id FROM message_ids WHERE thread_id = ?", (thread_id,))}
        return record

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         message_ids: Iterable[str], *, owner: ThreadOwner | None = None
                         ) -> None:
        await self._call(self._append, thread_id, agent_id, run, list(message_ids), owner)

    def _append(self, thread_id: str, agent_id: str, run: StoredRun,
                message_ids: list[str], owner: ThreadOwner | None) -> None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(
                "INSERT INTO threads (thread_id, agent_id, created_at, updated_at, owner_id, "
                "tenant) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (thread_id) DO UPDATE SET "
                "updated_at = excluded.updated_at",
                (thread_id, agent_id, run.created_at, run.created_at,
                 owner.principal_id if owner else None, owner.tenant if owner else None))
            (seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM runs WHERE thread_id = ?",
                                (thread_id,)).fetchone()
            db.execute("INSERT INTO runs (thread_id, seq, run_id, created_at, events) "
                       "VALUES (?, ?, ?, ?, ?)",
                       (thread_id, seq, run.run_id, run.created_at, orjson.dumps(run.events)))
            db.executemany("INSERT OR IGNORE INTO message_ids (thread_id, message_id) "
                           "VALUES (?, ?)", [(thread_id, m) for m in message_ids])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: ThreadOwner | None = None) -> list[ThreadRecord]:
        result: list[ThreadRecord] = await self._call(self._list, agent_id, limit, owner)
        return result

    def _list(self, agent_id: str | None, limit: int,
              owner: ThreadOwner | None) -> builtins.list[ThreadRecord]:
        where: builtins.list[str] = []
        args: builtins.list[Any] = []
        if agent_id is not None:
            where.append("agent_id = ?")
            args.append(agent_id)
        if owner is not None:
            where.append("owner_id = ? AND tenant IS ?")
            args.extend((owner.principal_id, owner.tenant))
        rows = self._db.execute(
            "SELECT thread_id, agent_id, created_at, updated_at, owner_id, tenant FROM threads "
            + ("WHERE " + " AND ".join(where) + " " if where else "")
            + "ORDER BY updated_at DESC LIMIT ?", (*args, limit))
        return [ThreadRecord(row[0], row[1], row[2], row[3], owner=_owner(row[4], row[5]))
                for row in rows]

    async def aclose(self) -> None:
        with self._lock:
            self._db.close()


# -- thread owners (issue 11): two nullable columns, added to databases made before them ----

def _add_owner_columns(db: sqlite3.Connection) -> None:
    """Add `owner_id` and `tenant` to a `threads` table that lacks them (rows keep NULL:
    threads started without authentication have no owner)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(threads)")}
    for name in ("owner_id", "tenant"):
        if name not in columns:
            db.execute(f"ALTER TABLE threads ADD COLUMN {name} TEXT")
    db.execute("CREATE INDEX IF NOT EXISTS threads_by_owner ON threads "
               "(owner_id, tenant, updated_at)")


def _owner(owner_id: str | None, tenant: str | None) -> ThreadOwner | None:
    return ThreadOwner(owner_id, tenant) if owner_id is not None else None
