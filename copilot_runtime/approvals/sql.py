"""The approval ledger in SQL: SQLite (aiosqlite) or PostgreSQL (psycopg), beside the checkpoints.

One table, `<prefix>approvals`. Its `owner_id` and `owner_tenant` are the owner of each
approval's thread once a listing has looked it up (`owner_id` '' for a thread without one,
NULL until then: rows of an earlier release's, which gets the columns added). The
compare-and-set of `claim` is a single conditional `UPDATE ... WHERE status = 'pending'`
(and, for an answer, the deadline not passed), so it holds across processes sharing the
database, not only within one event loop. Values and answers are stored as JSON text.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, Literal

import orjson

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime._sqlite_outage import sqlite_outages
from copilot_runtime.approvals.ledger import (
    Approval,
    ApprovalKey,
    ApprovalStatus,
    Viewer,
    _Listeners,
)
from copilot_runtime.threads.base import ThreadOwner

__all__ = ["PostgresApprovalStore", "SQLiteApprovalStore"]

_COLUMNS = ("id, thread_id, agent_id, value, created_at, expires_at, channel, status, "
            "answer, answered_by, answered_at, applied, owner_id, owner_tenant")
#: The columns an earlier release's table lacks, added at open.
_ADDED = ("owner_id", "owner_tenant")
#: The `owner_id` of an approval whose thread has no owner (no principal's id is empty).
_NOBODY = ""
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UNREACHABLE = "The approval store cannot be reached"


def check_identifier(name: str) -> str:
    """Table prefixes and schema names go into SQL text, so only plain identifiers pass."""
    if not _IDENTIFIER.match(name):
        raise ConfigurationError(f"{name!r} is not a plain SQL identifier")
    return name


def _reachable(seconds: float) -> contextlib.AbstractAsyncContextManager[None]:
    from copilot_runtime._pg_lane import reachable  # the postgres extra: PostgreSQL only

    return reachable(seconds, _UNREACHABLE)


class _SQLApprovalStore(_Listeners, abc.ABC):
    #: The SQL type of the `applied` flag and of times differ per database.
    _FLOAT = "DOUBLE PRECISION"
    _BOOL = "BOOLEAN"
    #: How `unapplied` and `next_deadline` name their indexes where the planner would not
    #: take them by itself.
    _BY_UNAPPLIED = _BY_DEADLINE = ""

    def __init__(self, prefix: str = "copilot_") -> None:
        super().__init__()
        self.table = check_identifier(prefix) + "approvals"

    # -- the backend: statements with `?` placeholders ---------------------------------

    @abc.abstractmethod
    async def _execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run a statement, return the number of rows it changed."""

    @abc.abstractmethod
    async def _fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        ...

    def _schema(self) -> list[str]:
        t = self.table
        return [
            f"CREATE TABLE IF NOT EXISTS {t} (id TEXT PRIMARY KEY, thread_id TEXT NOT NULL, "
            f"agent_id TEXT NOT NULL, value TEXT NOT NULL, created_at {self._FLOAT} NOT NULL, "
            f"expires_at {self._FLOAT}, channel TEXT NOT NULL, status TEXT NOT NULL, "
            f"answer TEXT, answered_by TEXT, answered_at {self._FLOAT}, "
            f"applied {self._BOOL} NOT NULL DEFAULT FALSE, owner_id TEXT, owner_tenant TEXT)",
            f"CREATE INDEX IF NOT EXISTS {t}_by_status ON {t} (status, created_at)",
            # What recovery, and every LangGraph run (`LangGraphAgent._carrying_on`), reads:
            # the few answers not applied yet, never the whole history.
            f"CREATE INDEX IF NOT EXISTS {t}_unapplied ON {t} (created_at) "
            "WHERE status IN ('answered', 'expired') AND NOT applied",
            f"CREATE INDEX IF NOT EXISTS {t}_by_thread ON {t} (thread_id)",
            # What every expiry timer asks each second (`next_deadline`): the pending
            # approvals with a deadline, not the whole history.
            f"CREATE INDEX IF NOT EXISTS {t}_deadlines ON {t} (expires_at) "
            "WHERE status = 'pending' AND expires_at IS NOT NULL",
        ]

    def _owner_index(self) -> str:
        # A viewer's listing (`find(viewer=)`): the rows of a tenant, of an owner in it, and
        # those whose owner is not recorded (both NULL). After the columns are added.
        t = self.table
        return (f"CREATE INDEX IF NOT EXISTS {t}_by_owner ON {t} "
                "(owner_tenant, owner_id, created_at)")

    # -- the store ---------------------------------------------------------------------

    async def add(self, approvals: Sequence[Approval]) -> None:
        added = 0
        for a in approvals:
            added += await self._execute(
                f"INSERT INTO {self.table} ({_COLUMNS}) VALUES ({', '.join('?' * 14)}) "
                "ON CONFLICT (id) DO NOTHING",
                (a.id, a.thread_id, a.agent_id, _dump(a.value), a.created_at, a.expires_at,
                 a.channel, a.status, _dump(a.answer) if a.answer is not None else None,
                 a.answered_by, a.answered_at, a.applied, *_owner_columns(a.owner_known, a.owner)))
        if added:
            self._notify()

    async def get(self, approval_id: str) -> Approval | None:
        rows = await self._fetch(f"SELECT {_COLUMNS} FROM {self.table} WHERE id = ?",
                                 (approval_id,))
        return _row(rows[0]) if rows else None

    async def find(self, *, status: ApprovalStatus | None = "pending",
                   thread_id: str | None = None, agent_id: str | None = None,
                   after: ApprovalKey | None = None, limit: int | None = None,
                   viewer: Viewer | None = None) -> list[Approval]:
        where: list[str] = []
        params: list[Any] = []
        for column, value in (("status", status), ("thread_id", thread_id),
                              ("agent_id", agent_id)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if after is not None:
            where.append("(created_at > ? OR (created_at = ? AND id > ?))")
            params.extend((after[0], after[0], after[1]))
        if viewer is not None:
            seen, seen_params = _seen_by(viewer)
            where.append(seen)
            params.extend(seen_params)
        condition = f" WHERE {' AND '.join(where)}" if where else ""
        bound = ""
        if limit is not None:
            bound = " LIMIT ?"
            params.append(limit)
        rows = await self._fetch(
            f"SELECT {_COLUMNS} FROM {self.table}{condition} ORDER BY created_at, id{bound}",
            params)
        return [_row(r) for r in rows]

    async def record_owner(self, approval_ids: Collection[str],
                           owner: ThreadOwner | None) -> None:
        if not approval_ids:
            return
        await self._execute(
            f"UPDATE {self.table} SET owner_id = ?, owner_tenant = ? WHERE owner_id IS NULL "
            f"AND id IN ({', '.join('?' * len(approval_ids))})",
            (*_owner_columns(True, owner),
             *sorted(approval_ids)))

    async def claim(self, approval_id: str, status: Literal["answered", "expired"],
                    answer: Any, answered_by: str | None, at: float) -> Approval | None:
        params: list[Any] = [status, _dump(answer), answered_by, at, approval_id]
        in_time = ""
        if status == "answered":  # in the same statement: no answer slips past the deadline
            in_time = " AND (expires_at IS NULL OR expires_at > ?)"
            params.append(at)
        changed = await self._execute(
            f"UPDATE {self.table} SET status = ?, answer = ?, answered_by = ?, "
            f"answered_at = ?, applied = FALSE WHERE id = ? AND status = 'pending'{in_time}",
            params)
        return await self.get(approval_id) if changed else None

    async def settle(self, approval_id: str, outcome: Literal["applied", "reopen",
                                                              "withdrawn"]) -> None:
        if outcome == "applied":
            await self._execute(f"UPDATE {self.table} SET applied = TRUE WHERE id = ?",
                                (approval_id,))
        elif outcome == "withdrawn":
            # Only a pending approval can be withdrawn: a caller that read it pending and
            # then found its interrupt gone may have raced an answer (or a timeout) that
            # another run, here or on another worker, has just claimed and applied.
            await self._execute(f"UPDATE {self.table} SET status = 'withdrawn' "
                                "WHERE id = ? AND status = 'pending'", (approval_id,))
        else:
            if await self._execute(
                    f"UPDATE {self.table} SET status = 'pending', answer = NULL, "
                    "answered_by = NULL, answered_at = NULL, applied = FALSE "
                    "WHERE id = ? AND status IN ('answered', 'expired') AND NOT applied",
                    (approval_id,)):
                self._notify()

    async def unapplied(self) -> list[Approval]:
        rows = await self._fetch(
            f"SELECT {_COLUMNS} FROM {self.table}{self._BY_UNAPPLIED.format(self.table)} "
            "WHERE status IN ('answered', 'expired') AND NOT applied ORDER BY created_at, id")
        return [_row(r) for r in rows]

    async def next_deadline(self, agent_ids: Collection[str]) -> float | None:
        if not agent_ids:
            return None
        rows = await self._fetch(
            f"SELECT expires_at FROM {self.table}{self._BY_DEADLINE.format(self.table)} "
            "WHERE status = 'pending' AND expires_at IS NOT NULL "
            f"AND agent_id IN ({', '.join('?' * len(agent_ids))}) ORDER BY expires_at LIMIT 1",
            sorted(agent_ids))
        return float(rows[0][0]) if rows else None

    async def forget_thread(self, thread_id: str) -> None:
        """Drop the approvals of a deleted thread (its checkpoints are gone with it)."""
        await self._execute(f"DELETE FROM {self.table} WHERE thread_id = ?", (thread_id,))


class SQLiteApprovalStore(_SQLApprovalStore):
    """The ledger in a SQLite file, on its own aiosqlite connection (the checkpointer's
    connection keeps its own transactions, which these statements must not join).

    `ready` opens the checkpointer first: its set-up switches the file to WAL, which must
    not race with another connection's statements.
    """

    _FLOAT = "REAL"
    # Without statistics (no ANALYZE) SQLite scans every answered approval by status.
    _BY_UNAPPLIED = " INDEXED BY {}_unapplied"
    _BY_DEADLINE = " INDEXED BY {}_deadlines"
    _BOOL = "INTEGER"

    def __init__(self, path: str, ready: Callable[[], Awaitable[Any]],
                 prefix: str = "copilot_") -> None:
        super().__init__(prefix)
        self.path = path
        self._ready = ready
        self._conn: Any = None
        self._lock: asyncio.Lock | None = None

    async def _connection(self) -> Any:
        if self._conn is not None:
            return self._conn
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one connection, however many callers arrive at once
            if self._conn is None:
                import aiosqlite

                await self._ready()
                # Autocommit: each statement is its own transaction, so `claim` is atomic.
                conn = await aiosqlite.connect(self.path, isolation_level=None, timeout=30)
                try:
                    for statement in self._schema():
                        await conn.execute(statement.replace("DEFAULT FALSE", "DEFAULT 0"))
                    await self._add_columns(conn)
                    await conn.execute(self._owner_index())
                except BaseException:
                    await asyncio.shield(conn.close())  # never leave a connection open
                    raise
                self._conn = conn
        return self._conn

    async def _add_columns(self, conn: Any) -> None:
        """Add what an earlier release's table lacks (NULL in its rows)."""
        import sqlite3

        async with conn.execute(f"PRAGMA table_info({self.table})") as cursor:
            present = {row[1] for row in await cursor.fetchall()}
        for column in _ADDED:
            if column not in present:
                try:
                    await conn.execute(f"ALTER TABLE {self.table} ADD COLUMN {column} TEXT")
                except sqlite3.OperationalError as exc:
                    if "duplicate column" not in str(exc):
                        raise  # (another process opening the file added it first)

    async def _execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        # A file held past the wait, or that cannot be written (a full disk): a 503, as the
        # thread store's, not a 500.
        async with sqlite_outages("The approval store"):
            conn = await self._connection()
            cursor = await conn.execute(sql, tuple(params))
            count: int = cursor.rowcount
            await cursor.close()
            return count

    async def _fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        async with sqlite_outages("The approval store"):
            conn = await self._connection()
            async with conn.execute(sql, tuple(params)) as cursor:
                return [tuple(row) for row in await cursor.fetchall()]

    async def aclose(self) -> None:
        lock, self._lock = self._lock, None  # a reopened store may live in another event loop
        await _settled(lock)
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.close()


class PostgresApprovalStore(_SQLApprovalStore):
    """The ledger in PostgreSQL, on the checkpointer's connection pool (autocommit)."""

    #: Seconds a statement waits for the pool and the server (the checkpointer whose pool
    #: it shares sets it to its own `timeout`).
    timeout = 10.0

    def __init__(self, pool: Callable[[], Awaitable[Any]], prefix: str = "copilot_") -> None:
        super().__init__(prefix)
        self._pool = pool
        self._ready = False

    async def _open(self) -> Any:
        pool = await self._pool()
        if not self._ready:
            async with pool.connection() as conn, conn.transaction():
                # Servers starting together take turns: CREATE ... IF NOT EXISTS run at once
                # from two connections fails one of them. Per schema (the pool's search
                # path): ledgers of other schemas have nothing to wait for.
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s || "
                                   "coalesce(current_schema(), '')))",
                                   (f"copilot_runtime.approvals:{self.table}:",))
                for statement in self._schema():
                    await conn.execute(statement)
                for column in _ADDED:
                    # Altered only when missing: ALTER TABLE waits for, and then holds up,
                    # every statement of the other servers on the table.
                    found = await (await conn.execute(
                        "SELECT 1 FROM pg_attribute WHERE attrelid = %s::regclass "
                        "AND attname = %s AND NOT attisdropped", (self.table, column))
                    ).fetchone()
                    if found is None:
                        await conn.execute(f"ALTER TABLE {self.table} ADD COLUMN {column} TEXT")
                await conn.execute(self._owner_index())
            self._ready = True
        return pool

    async def _execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        async with _reachable(self.timeout):
            pool = await self._open()
            async with pool.connection() as conn:
                cursor = await conn.execute(sql.replace("?", "%s"), tuple(params))
                count: int = cursor.rowcount
                return count

    async def _fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        async with _reachable(self.timeout):
            pool = await self._open()
            async with pool.connection() as conn:
                cursor = await conn.execute(sql.replace("?", "%s"), tuple(params))
                rows = await cursor.fetchall()
        # The pool hands out dict rows (the checkpointer needs them); keep column order.
        return [tuple(r.values()) if isinstance(r, dict) else tuple(r) for r in rows]

    async def aclose(self) -> None:
        return None  # the pool belongs to the checkpointer, which closes it


def _dump(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


def _owner_columns(known: bool, owner: ThreadOwner | None) -> tuple[str | None, str | None]:
    """An approval's `owner_id, owner_tenant`: both NULL while its owner is not recorded."""
    if not known:
        return None, None
    if owner is None:
        return _NOBODY, None
    return owner.principal_id, owner.tenant


def _seen_by(viewer: Viewer) -> tuple[str, list[Any]]:
    """The condition of `find(viewer=)`, with its parameters: the rows `viewer` sees (as
    `Viewer.sees`), and those whose owner is not recorded yet."""
    tenant = viewer.owner.tenant
    same_tenant = "owner_tenant IS NULL" if tenant is None else "owner_tenant = ?"
    params: list[Any] = [] if tenant is None else [tenant]
    if viewer.approver:
        owned, params = "owner_id <> ?", [*params, _NOBODY]  # every owned thread of it
    else:
        owned, params = "owner_id = ?", [*params, viewer.owner.principal_id]
    return (f"((owner_tenant IS NULL AND owner_id IS NULL) OR ({same_tenant} AND {owned}))",
            params)


def _row(row: tuple[Any, ...]) -> Approval:
    (id_, thread_id, agent_id, value, created_at, expires_at, channel, status, answer,
     answered_by, answered_at, applied, owner_id, owner_tenant) = row
    return Approval(
        id=id_, thread_id=thread_id, agent_id=agent_id, value=orjson.loads(value),
        created_at=float(created_at),
        expires_at=float(expires_at) if expires_at is not None else None,
        channel=channel, status=status,
        answer=orjson.loads(answer) if answer is not None else None,
        answered_by=answered_by,
        answered_at=float(answered_at) if answered_at is not None else None,
        applied=bool(applied), owner_known=owner_id is not None,
        owner=ThreadOwner(owner_id, owner_tenant) if owner_id else None)


async def _settled(lock: asyncio.Lock | None) -> None:
    """Wait for an opening in flight under `lock` to finish, so what it opened is closed by
    the caller instead of outliving it (a lock of another event loop is not waited for)."""
    if lock is not None and lock.locked():
        with contextlib.suppress(RuntimeError):
            async with lock:
                pass
