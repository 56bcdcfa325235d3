"""Durable LangGraph checkpointers from one URL, so interrupted graphs survive a restart.

    checkpointer()                                     SQLite, copilot-runtime-checkpoints.sqlite3
    checkpointer("sqlite:///data/checkpoints.sqlite3") SQLite, a path relative to the cwd
    checkpointer("sqlite:////var/lib/app/cp.sqlite3")  SQLite, an absolute path
    checkpointer("postgresql://user@host:5432/db?schema=hitl")   PostgreSQL (schema optional;
                                                                 &pool_size=N: at most N
                                                                 connections, 10 by default)
    checkpointer("memory")                             in this process only (tests, demos)

`checkpointer()` without a URL reads `COPILOT_RUNTIME_CHECKPOINTS`, then falls back to the
SQLite file. The result is a `DurableCheckpointer`: compile graphs with it
(`graph.compile(checkpointer=cp)`) at import time, with no event loop running; it opens its
connection (aiosqlite, or a psycopg pool) on first use inside the server's loop, and stays
bound to that loop. The same database holds the approval ledger (`cp.approvals`), which the
runtime uses to list pending approvals and to resume them after a restart.

SQLite needs `langgraph-checkpoint-sqlite` (the `langgraph` extra), PostgreSQL
`langgraph-checkpoint-postgres` and psycopg (the `postgres` extra).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import copy
import os
import random
import urllib.parse
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import structlog
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
)
from langgraph.checkpoint.memory import InMemorySaver

from copilot_runtime._again import worth_logging
from copilot_runtime._exceptions import ConfigurationError, ServiceUnavailableError
from copilot_runtime._sqlite_outage import sqlite_outages
from copilot_runtime._url_options import (
    pool_size_option,
    redacted_url,
    schema_option,
    split_options,
)
from copilot_runtime.approvals.ledger import ApprovalStore, MemoryApprovalStore
from copilot_runtime.approvals.sql import (
    PostgresApprovalStore,
    SQLiteApprovalStore,
    check_identifier,
)

__all__ = ["DEFAULT_URL", "DurableCheckpointer", "checkpointer"]

_log = structlog.get_logger("copilot_runtime.checkpoints")

DEFAULT_URL = "sqlite:///copilot-runtime-checkpoints.sqlite3"
ENV_VAR = "COPILOT_RUNTIME_CHECKPOINTS"


def checkpointer(url: str | None = None, *, pool_size: int = 10) -> DurableCheckpointer:
    """A checkpointer for `url` (see the module docstring); nothing is opened yet."""
    url = url or os.environ.get(ENV_VAR) or DEFAULT_URL
    scheme, _, rest = url.partition(":")
    scheme = scheme.lower()
    if url in ("memory", ":memory:") or scheme == "memory":
        return DurableCheckpointer(_MemoryBackend(), url)
    if scheme in ("postgres", "postgresql"):
        return DurableCheckpointer(_PostgresBackend(url, pool_size=pool_size), redacted_url(url))
    if scheme == "sqlite":
        if not rest.startswith("///"):
            raise ConfigurationError(
                f"A SQLite checkpoint URL looks like sqlite:///relative/path or "
                f"sqlite:////absolute/path, got {redacted_url(url)!r}")
        path = urllib.parse.unquote(rest[3:].split("?", 1)[0])
    elif "://" in url:
        raise ConfigurationError(
            f"Unsupported checkpoint URL {redacted_url(url)!r}: use sqlite:///..., "
            "postgresql://... or memory")
    else:
        path = url  # a bare file path
    if path in ("", ":memory:"):
        return DurableCheckpointer(_MemoryBackend(), url)
    return DurableCheckpointer(_SQLiteBackend(path), url)


class _Backend(abc.ABC):
    """Opens the real saver once, in the loop that first needs it."""

    #: Seconds a call to the saver waits for its server, where it has one (`bounded`).
    timeout = 10.0
    #: Which store, for the logs (a file, a URL without its password).
    where = "memory"

    def __init__(self) -> None:
        self._saver: BaseCheckpointSaver[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Task[BaseCheckpointSaver[Any]] | None = None
        self._failures = 0  # openings failed in a row
        self.approvals: ApprovalStore = MemoryApprovalStore()

    def bounded(self) -> AbstractAsyncContextManager[None]:
        """Around every call to the saver: nothing for a file or memory."""
        return contextlib.nullcontext()

    async def saver(self) -> BaseCheckpointSaver[Any]:
        loop = asyncio.get_running_loop()
        if self._saver is not None:
            if loop is not self._loop:
                raise RuntimeError(
                    "This checkpointer is bound to the event loop it was first used in; "
                    "create one checkpointer per event loop (per server)")
            return self._saver
        opening = self._opening
        if opening is None or opening.done():  # the first, or the last one failed
            opening = self._opening = loop.create_task(self._opened(loop))
        # Shielded: a caller that stops waiting (its deadline passed, its client left) does
        # not cut the opening short, a migration half done; the next caller waits for it.
        return await asyncio.shield(opening)

    async def _opened(self, loop: asyncio.AbstractEventLoop) -> BaseCheckpointSaver[Any]:
        try:
            saver = await self._open()
        except (ConfigurationError, asyncio.CancelledError):
            raise
        except Exception as exc:
            # A server that refuses, a file that cannot be opened: the client gets
            # the 503 a thread store gives for the same outage, not a 500.
            self._failures += 1
            if worth_logging(self._failures):  # tried again by every caller: not each time
                _log.warning("the checkpoint store cannot be opened", store=self.where,
                             error=str(exc), failures_in_a_row=self._failures)
            raise ServiceUnavailableError("The checkpoint store cannot be reached") from exc
        self._saver, self._loop, self._failures = saver, loop, 0
        return saver

    @abc.abstractmethod
    async def _open(self) -> BaseCheckpointSaver[Any]:
        ...

    async def ping(self) -> None:
        """Opened (a database created, migrated): what a file or memory can tell."""
        await self.saver()

    async def aclose(self) -> None:
        await self.approvals.aclose()
        opening, self._opening = self._opening, None
        if opening is not None and not opening.done() and \
                opening.get_loop() is asyncio.get_running_loop():
            # An opening in flight: let it finish, so its connection is closed here; one
            # that waits on a server which stopped answering is given up on.
            if not (await asyncio.wait([opening], timeout=self.timeout))[0]:
                opening.cancel()
                await asyncio.wait([opening])
            if not opening.cancelled():
                opening.exception()  # retrieved: its callers were told
        self._saver, saver = None, self._saver
        if saver is not None:
            await self._close(saver)

    async def _close(self, saver: BaseCheckpointSaver[Any]) -> None:
        return None


class _MemoryBackend(_Backend):
    def __init__(self) -> None:
        super().__init__()
        self._memory = InMemorySaver()
        self._saver = self._memory  # no connection, no loop: usable at once, from any loop

    async def saver(self) -> BaseCheckpointSaver[Any]:
        return self._memory

    async def _open(self) -> BaseCheckpointSaver[Any]:
        return self._memory


class _SQLiteBackend(_Backend):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = self.where = path
        self.approvals = SQLiteApprovalStore(path, self.saver)

    async def _open(self) -> BaseCheckpointSaver[Any]:
        try:
            import aiosqlite
            from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise ConfigurationError(
                "SQLite checkpoints need langgraph-checkpoint-sqlite: "
                "pip install 'copilot-runtime[langgraph]'") from exc
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # A generous busy timeout: the approval ledger writes to the same file.
        conn = await aiosqlite.connect(self.path, timeout=30)
        saver = AsyncSqliteSaver(conn)
        try:
            await saver.setup()
        except BaseException:
            await asyncio.shield(conn.close())  # never leave a connection open
            raise
        return saver

    def bounded(self) -> AbstractAsyncContextManager[None]:
        # A file held past the wait, or that cannot be written (a full disk): the run ends
        # with SERVICE_UNAVAILABLE, as when a PostgreSQL checkpointer is away.
        return sqlite_outages("The checkpoint store")

    async def _close(self, saver: BaseCheckpointSaver[Any]) -> None:
        await saver.conn.close()  # type: ignore[attr-defined]


class _PostgresBackend(_Backend):
    def __init__(self, url: str, *, pool_size: int) -> None:
        super().__init__()
        conninfo, options = split_options("postgresql:" + url.partition(":")[2],
                                          ("schema", "pool_size"))
        schema = schema_option(options)
        self.schema = check_identifier(schema) if schema else None
        self.conninfo = conninfo
        self.where = redacted_url(url)
        self.pool_size = pool_size_option(options, pool_size)
        # Said here, as thread_store() does: found on first use, each run failed with
        # AGENT_ERROR and each approval route with a 500 (a bare ModuleNotFoundError).
        try:
            import langgraph.checkpoint.postgres.aio  # noqa: F401

            from copilot_runtime._pg_lane import checked_conninfo
        except ImportError as exc:
            raise ConfigurationError(
                "checkpointer('postgresql://...') needs the postgres extra: pip install "
                f"'copilot-runtime[postgres]' ({exc.name} is missing)") from None
        checked_conninfo(conninfo)  # a mistake fails here, not every request after
        self._pool: Any = None
        self.approvals = PostgresApprovalStore(self._open_pool)

    async def _open_pool(self) -> Any:
        await self.saver()
        return self._pool

    async def _open(self) -> BaseCheckpointSaver[Any]:
        try:
            from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
            from psycopg import AsyncConnection
            from psycopg.rows import dict_row
            from psycopg_pool import AsyncConnectionPool
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise ConfigurationError(
                "PostgreSQL checkpoints need langgraph-checkpoint-postgres and psycopg: "
                "pip install 'copilot-runtime[postgres]'") from exc
        from copilot_runtime._pg_lane import check_alive, create_schema, with_session_defaults

        conninfo = with_session_defaults(self.conninfo, connect_timeout=self.timeout,
                                         application_name="copilot-runtime checkpoints")
        kwargs: dict[str, Any] = {"autocommit": True, "prepare_threshold": 0,
                                  "row_factory": dict_row}
        if self.schema:
            # quoted, as CREATE SCHEMA has it: unquoted, PostgreSQL folds capitals
            kwargs["options"] = f'-c search_path="{self.schema}"'
        # As the thread store's pool: a connection the server closed while idle (it
        # restarted) is replaced as it is taken, not handed out to fail; a check-out waits
        # at most `timeout`; reconnecting gives up after `timeout` too, so a server that
        # was away is connected to again at the next check-out once it is back, not at the
        # next step of a backoff that grows for five minutes.
        pool = AsyncConnectionPool(conninfo, open=False, min_size=1,
                                   max_size=self.pool_size, kwargs=kwargs,
                                   check=check_alive, timeout=self.timeout,
                                   reconnect_timeout=self.timeout)
        # Workers starting together take turns (a lock held by this connection until it
        # closes): CREATE SCHEMA IF NOT EXISTS and LangGraph's migrations, run at once from
        # two connections, fail one of them (a duplicate key in the catalogs). The lock is
        # tried, not waited for: a migration's CREATE INDEX CONCURRENTLY waits for every
        # statement under way, a waiting lock request included, which would wait for it.
        async with await AsyncConnection.connect(conninfo, autocommit=True) as conn:
            key = f"copilot_runtime.checkpoints:{self.schema or ''}"
            while True:
                if await _locked(conn, key):
                    break
                await asyncio.sleep(0.05)  # another worker migrates: its turn ends soon
            if self.schema:
                await create_schema(conn, self.schema)
            try:
                await pool.open(wait=True, timeout=30)
                saver = AsyncPostgresSaver(pool)
                await saver.setup()
            except BaseException:
                await pool.close()
                raise
        self._pool = pool
        return saver

    async def ping(self) -> None:
        await self.saver()
        async with self._pool.connection() as conn:
            await conn.execute("SELECT 1")

    def bounded(self) -> AbstractAsyncContextManager[None]:
        # A server that stops answering held a run's stream, or an approval's answer, for
        # as long as it did: the call fails with SERVICE_UNAVAILABLE within `timeout`
        # instead. A write given up on may still commit once the server answers: the next
        # run then starts from that checkpoint, as if the step had been stored in time.
        from copilot_runtime._pg_lane import reachable  # the postgres extra

        return reachable(self.timeout, "The checkpoint store cannot be reached")

    async def _close(self, saver: BaseCheckpointSaver[Any]) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


class DurableCheckpointer(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer that opens its database lazily; see the module docstring.

    It forwards every operation to the real saver (`AsyncSqliteSaver`,
    `AsyncPostgresSaver` or `InMemorySaver`) with its own serializer, so the msgpack
    allow-list LangGraph derives from a graph's state schema (on a shallow copy of this
    object) applies to the real saver too. Synchronous calls work only for the in-memory
    kind: serve graphs with `ainvoke`/`astream`, as the runtime does.

    Every public method of `BaseCheckpointSaver` is forwarded here, or inherited on purpose
    because it only calls the forwarded ones; tests/test_checkpointer_delegation.py checks
    both against the installed langgraph, so a new or changed method fails a test.
    """

    def __init__(self, backend: _Backend, url: str) -> None:
        super().__init__()
        self._backend = backend
        self.url = url
        # (serializer, real saver, the saver to call): rebuilt when either changes.
        self._bound: tuple[Any, Any, BaseCheckpointSaver[Any]] | None = None

    @property
    def approvals(self) -> ApprovalStore:
        """The approval ledger in the same database."""
        return self._backend.approvals

    @property
    def timeout(self) -> float:
        """Seconds a PostgreSQL checkpoint read or write, a check-out of the pool and a
        statement of the approval ledger wait for their server (10 by default): then the
        run ends with RUN_ERROR SERVICE_UNAVAILABLE, an approval route answers 503. Set it
        before the first use: the pool takes it as it opens. Kept by the backend, which
        LangGraph's copies of this object share."""
        return self._backend.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._backend.timeout = seconds
        if isinstance(self._backend.approvals, PostgresApprovalStore):
            self._backend.approvals.timeout = seconds  # the same server, the same pool

    async def ping(self) -> None:
        """Opened, and one round trip to its server if it has one, within `timeout` (a
        readiness probe); ServiceUnavailableError if not."""
        async with self._backend.bounded():
            await self._backend.ping()

    async def aclose(self) -> None:
        """Close the connection (or pool); a later use opens it again."""
        self._bound = None
        await self._backend.aclose()

    async def _target(self) -> BaseCheckpointSaver[Any]:
        saver = await self._backend.saver()
        bound = self._bound
        if bound is not None and bound[0] is self.serde and bound[1] is saver:
            return bound[2]
        target = saver
        if saver.serde is not self.serde:
            target = copy.copy(saver)
            target.serde = self.serde
        self._bound = (self.serde, saver, target)
        return target

    def _sync_target(self) -> BaseCheckpointSaver[Any]:
        saver = self._backend._saver
        if saver is None:
            raise NotImplementedError(
                "DurableCheckpointer is asynchronous: run graphs with ainvoke/astream")
        return saver

    # -- asynchronous API: what LangGraph uses when graphs run with ainvoke/astream ------

    # Each call within the backend's bound (`timeout`, PostgreSQL), opening included, but
    # copying and pruning threads: bulk work whose length grows with the data.

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        async with self._backend.bounded():
            return await (await self._target()).aget_tuple(config)

    async def alist(self, config: RunnableConfig | None, *,
                    filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None,
                    limit: int | None = None) -> AsyncIterator[CheckpointTuple]:
        async with self._backend.bounded():
            target = await self._target()
        items = aiter(target.alist(config, filter=filter, before=before, limit=limit))
        while True:
            async with self._backend.bounded():  # each step: not the caller's time between
                item = await anext(items, None)
            if item is None:
                return
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint,
                   metadata: CheckpointMetadata, new_versions: ChannelVersions
                   ) -> RunnableConfig:
        async with self._backend.bounded():
            return await (await self._target()).aput(config, checkpoint, metadata,
                                                     new_versions)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                          task_id: str, task_path: str = "") -> None:
        async with self._backend.bounded():
            await (await self._target()).aput_writes(config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        async with self._backend.bounded():
            await (await self._target()).adelete_thread(thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        async with self._backend.bounded():
            await (await self._target()).adelete_for_runs(run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await (await self._target()).acopy_thread(source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *,
                     strategy: str = "keep_latest") -> None:
        await (await self._target()).aprune(thread_ids, strategy=strategy)

    async def aget_delta_channel_history(self, *, config: RunnableConfig,
                                         channels: Sequence[str]
                                         ) -> Mapping[str, DeltaChannelHistory]:
        async with self._backend.bounded():
            return await (await self._target()).aget_delta_channel_history(
                config=config, channels=channels)

    def get_next_version(self, current: str | None, channel: None) -> str:
        # The format every bundled saver uses: a zero-padded counter, then a random part.
        if current is None:
            counter = 0
        elif isinstance(current, int):
            counter = current
        else:
            counter = int(str(current).split(".")[0])
        return f"{counter + 1:032}.{random.random():016}"

    # -- synchronous API: the in-memory kind only ----------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self._sync_target().get_tuple(config)

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None, limit: int | None = None
             ) -> Iterator[CheckpointTuple]:
        return self._sync_target().list(config, filter=filter, before=before, limit=limit)

    def put(self, config: RunnableConfig, checkpoint: Checkpoint,
            metadata: CheckpointMetadata, new_versions: ChannelVersions) -> RunnableConfig:
        return self._sync_target().put(config, checkpoint, metadata, new_versions)

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                   task_id: str, task_path: str = "") -> None:
        self._sync_target().put_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        self._sync_target().delete_thread(thread_id)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        self._sync_target().delete_for_runs(run_ids)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self._sync_target().copy_thread(source_thread_id, target_thread_id)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self._sync_target().prune(thread_ids, strategy=strategy)

    def get_delta_channel_history(self, *, config: RunnableConfig, channels: Sequence[str]
                                  ) -> Mapping[str, DeltaChannelHistory]:
        return self._sync_target().get_delta_channel_history(config=config, channels=channels)


async def _locked(conn: Any, key: str) -> bool:
    """Whether `conn` took the session-level advisory lock named `key` (not waiting)."""
    row = await (await conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))",
                                    (key,))).fetchone()
    return bool(row and row[0])
