"""A PostgreSQL connection of its own for work done one call at a time (one statement in
flight: a batcher's or a group writer's), kept for its owner's life.

Needs psycopg (the `postgres` extra): imported only by the PostgreSQL store and coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any

import psycopg
from psycopg import AsyncConnection, AsyncCursor, pq, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from copilot_runtime._deadline import within
from copilot_runtime._exceptions import ConfigurationError, ServiceUnavailableError

__all__ = ["Lane", "check_alive", "checked_conninfo", "create_schema", "dropped", "reachable",
           "with_session_defaults"]


@contextlib.asynccontextmanager
async def reachable(seconds: float | None, unreachable: str) -> AsyncIterator[None]:
    """The block, within `seconds` (None: unbounded); a server that cannot be reached, or
    does not answer in time, is a ServiceUnavailableError(`unreachable`): a 503 with
    Retry-After, or a run's RUN_ERROR SERVICE_UNAVAILABLE, never a 500 or a wait as long as
    the outage (a server that stops answering is not noticed by TCP while its host
    acknowledges the packets)."""
    try:
        async with within(seconds) if seconds is not None else contextlib.nullcontext():
            yield
    except (psycopg.OperationalError, psycopg.InterfaceError, TimeoutError,
            psycopg.errors.ReadOnlySqlTransaction) as exc:
        # A read-only server (a standby after a failover, a demoted primary) is there but
        # cannot serve now: the same answer.
        raise ServiceUnavailableError(unreachable) from exc


#: libpq's options whose value is one of these words, as libpq (18) documents them; compared
#: exactly, as libpq compares them (`DISABLE` is refused). An option an older libpq lacks is
#: refused by its name before its value is read.
_WORDS = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "sslcertmode": ("disable", "allow", "require"),
    "sslnegotiation": ("postgres", "direct"),
    "target_session_attrs": ("any", "read-write", "read-only", "primary", "standby",
                             "prefer-standby"),
    "load_balance_hosts": ("disable", "random"),
}
#: libpq's options whose value is a whole number (of these units), which it reads as C's
#: `strtol` does, into an `int`: spaces around it and a sign may be given.
_WHOLE = {"connect_timeout": " of seconds", "keepalives": "", "keepalives_idle": " of seconds",
          "keepalives_interval": " of seconds", "keepalives_count": "",
          "tcp_user_timeout": " of milliseconds"}
_WHOLE_NUMBER = re.compile(r"\s*[+-]?[0-9]+\s*")


def checked_conninfo(conninfo: str) -> dict[str, Any]:
    """`conninfo`'s parameters; a mistake no server could accept (an unknown parameter, a
    port out of range, a value libpq cannot read: `sslmode=bogus`, `keepalives=abc`) is a
    ConfigurationError, found at start-up instead of as a connection failing ever after (a
    503 on every request)."""
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"not a PostgreSQL connection URL: {str(exc).strip()}") from None
    for port in str(given.get("port") or "").split(","):  # one per host
        if port and not (port.isascii() and port.isdigit() and len(port) < 6
                         and 0 < int(port) < 65536):
            raise ConfigurationError(f"PostgreSQL port must be 1-65535, got {port!r}")
    for name, words in _WORDS.items():
        value = given.get(name)
        if value is not None and value not in words:
            raise ConfigurationError(f"{name} must be one of {', '.join(words)}, got {value!r}")
    for name, unit in _WHOLE.items():
        value = given.get(name)
        if value is not None and not (_WHOLE_NUMBER.fullmatch(str(value))
                                      and -2**31 <= int(value) < 2**31):
            raise ConfigurationError(f"{name} must be a whole number{unit}, got {value!r}")
    return given


def with_session_defaults(conninfo: str, *, connect_timeout: float, application_name: str
                          ) -> str:
    """`conninfo` (a URL or key=value pairs) with a `connect_timeout`, an
    `application_name` and TCP keepalives and a user timeout, each unless it has one.

    libpq waits for the operating system's TCP timeouts for a server that does not answer:
    minutes for a connection attempt, a quarter of an hour for a connection whose packets
    stop getting through (a failover, a network partition), during which a run's end waits
    on its write. With these, such a connection fails within about a minute. An operator
    reading `pg_stat_activity` sees which part of the runtime holds each connection. A URL
    stays a URL."""
    given = checked_conninfo(conninfo)
    defaults = {"connect_timeout": str(max(2, round(connect_timeout))),  # libpq's least
                "application_name": application_name,
                "keepalives_idle": "30", "keepalives_interval": "10", "keepalives_count": "3",
                "tcp_user_timeout": "60000"}
    missing = {key: value for key, value in defaults.items() if key not in given}
    if not missing:
        return conninfo
    if "://" in conninfo:
        parts = urllib.parse.urlsplit(conninfo)
        query = f"{parts.query}&" if parts.query else ""
        return urllib.parse.urlunsplit(parts._replace(
            query=query + urllib.parse.urlencode(missing, quote_via=urllib.parse.quote)))
    return make_conninfo(conninfo, **missing)


def dropped(conn: AsyncConnection[Any]) -> bool:
    """Whether the server closed `conn` while it sat idle (it restarted, or an administrator
    ended the session): reads what arrived meanwhile, without waiting. A statement sent on
    such a connection fails, and whether it ran could not be told apart from a connection
    lost while it ran; found before sending, a new connection is made instead."""
    if conn.closed or conn.broken:
        return True
    # A server ending the session sends its reason (a FATAL, which arrives as a notice on an
    # idle connection) and then closes it: either says the connection is gone.
    fatal: list[bool] = []

    def on_notice(diagnostic: psycopg.errors.Diagnostic) -> None:
        if diagnostic.severity_nonlocalized == "FATAL":
            fatal.append(True)

    conn.add_notice_handler(on_notice)
    try:
        conn.pgconn.consume_input()
        conn.pgconn.is_busy()  # parses what arrived: a FATAL reaches `on_notice`
        conn.pgconn.consume_input()
    except psycopg.OperationalError:
        return True
    finally:
        conn.remove_notice_handler(on_notice)
    return bool(fatal) or conn.pgconn.status != pq.ConnStatus.OK


async def check_alive(conn: AsyncConnection[Any]) -> None:
    """A pool's `check`: a dropped connection is replaced as it is taken (no round trip)."""
    if dropped(conn):
        raise psycopg.OperationalError("the server closed the connection")


class Lane:
    """A connection of its own, and one cursor on it, for work done one call at a time.

    Checking a connection out of the pool and back, and making a cursor, cost ~0.1 ms of
    CPU per query (psycopg_pool's locks and checks, the cursor's adaptation context): as
    much as the query. The lane connects on first use, and again after its connection broke,
    was left in the middle of a query (a caller cancelled) or was dropped by the server while
    idle, so the next call starts clean.
    """

    def __init__(self, connect: Callable[[], Awaitable[AsyncConnection[Any]]]) -> None:
        self._connect = connect
        self._conn: AsyncConnection[Any] | None = None
        self._cursor: AsyncCursor[Any] | None = None
        self._lock = asyncio.Lock()  # one call at a time, whatever the callers do

    async def __aenter__(self) -> AsyncCursor[Any]:
        await self._lock.acquire()
        try:
            if self._conn is not None and dropped(self._conn):
                conn, self._conn, self._cursor = self._conn, None, None
                await conn.close()
            if self._conn is None:
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


async def create_schema(conn: AsyncConnection[Any], schema: str) -> None:
    """`CREATE SCHEMA IF NOT EXISTS schema`, which another process may run at the same moment
    (the thread store, the coordinator and the checkpointer each take their own lock): one
    of the two then fails on the catalog's unique name, the schema made by the other."""
    try:
        async with conn.transaction():  # (a savepoint, inside the caller's transaction)
            await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                sql.Identifier(schema)))
    except psycopg.errors.UniqueViolation:
        pass
