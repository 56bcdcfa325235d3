"""Durable checkpointers from a URL, and the approval ledger beside them."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime.approvals.ledger import Approval, ApprovalStore
from copilot_runtime.checkpointers import DEFAULT_URL, DurableCheckpointer, checkpointer
from tests.hitl_support.postgres import SERVER, postgres_schema


class State(TypedDict, total=False):
    asked: int
    answer: Any


def ask(state: State) -> dict[str, Any]:
    return {"answer": interrupt({"message": "ok?"}), "asked": state.get("asked", 0) + 1}


def graph(saver: Any) -> Any:
    builder: StateGraph[State] = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


CONFIG: Any = {"configurable": {"thread_id": "t1"}}
ROOT = Path(__file__).resolve().parent.parent


# -- URLs -----------------------------------------------------------------------------

def test_url_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    def kind(url: str | None) -> str:
        return type(checkpointer(url)._backend).__name__

    assert kind("memory") == kind(":memory:") == kind("sqlite:///:memory:") == "_MemoryBackend"
    assert checkpointer("sqlite:///data/cp.sqlite3")._backend.path == "data/cp.sqlite3"  # type: ignore[attr-defined]
    assert checkpointer("sqlite:////var/cp.sqlite3")._backend.path == "/var/cp.sqlite3"  # type: ignore[attr-defined]
    assert checkpointer("local.db")._backend.path == "local.db"  # type: ignore[attr-defined]
    postgres = checkpointer("postgres://app:s3cret@db:5432/main?schema=hitl&sslmode=disable")
    assert postgres.url == "postgres://app:***@db:5432/main?schema=hitl&sslmode=disable"
    backend: Any = postgres._backend
    assert backend.schema == "hitl"
    assert backend.conninfo == "postgresql://app:s3cret@db:5432/main?sslmode=disable"
    monkeypatch.delenv("COPILOT_RUNTIME_CHECKPOINTS", raising=False)
    assert checkpointer().url == DEFAULT_URL
    monkeypatch.setenv("COPILOT_RUNTIME_CHECKPOINTS", "memory")
    assert kind(None) == "_MemoryBackend"
    for bad in ("sqlite://relative", "redis://localhost:6379"):
        with pytest.raises(ConfigurationError):
            checkpointer(bad)
    with pytest.raises(ConfigurationError, match="plain SQL identifier"):
        checkpointer("postgresql://db/x?schema=a;drop")


def test_a_postgresql_url_without_the_postgres_extra_says_which_extra() -> None:
    """With `[langgraph]` alone, `checkpointer("postgresql://...")` was built, then every
    run failed AGENT_ERROR and `GET /approvals` answered 500, each time a traceback of
    `ModuleNotFoundError: psycopg`. It is refused at once now, as `thread_store()` does."""
    script = (
        "import sys\n"
        "for name in ('psycopg', 'psycopg_pool', 'langgraph.checkpoint.postgres'):\n"
        "    sys.modules[name] = None  # what the langgraph extra alone leaves out\n"
        "from copilot_runtime.checkpointers import checkpointer\n"
        "checkpointer('postgresql://postgres@127.0.0.1:5432/test?schema=x')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("copilot_runtime._exceptions.ConfigurationError: "), done.stderr
    assert "pip install 'copilot-runtime[postgres]'" in last, last
    assert "ModuleNotFoundError" not in done.stderr, done.stderr


# -- durability -----------------------------------------------------------------------

async def interrupted_then_reopened(url: str) -> None:
    first = checkpointer(url)
    await graph(first).ainvoke({}, CONFIG)
    approval = Approval("a1", "t1", "agent", {"message": "ok?"}, time.time(), time.time() + 60)
    await first.approvals.add([approval])
    await first.aclose()  # what a restart leaves: the database, nothing in memory

    second = checkpointer(url)
    resumed = graph(second)
    state = await resumed.aget_state(CONFIG)
    assert [i.value for i in state.interrupts] == [{"message": "ok?"}]
    found = await second.approvals.get("a1")
    assert found is not None
    assert found.status == "pending"
    assert found.expires_at == pytest.approx(approval.expires_at)
    assert await resumed.ainvoke(Command(resume="yes"), CONFIG) == {"asked": 1,
                                                                     "answer": "yes"}
    await second.aclose()


async def test_sqlite_keeps_interrupts_and_approvals(tmp_path: Path) -> None:
    await interrupted_then_reopened(f"sqlite:///{tmp_path}/nested/cp.sqlite3")


async def test_postgres_workers_starting_together_all_open() -> None:
    """Servers starting together on a new schema: CREATE SCHEMA IF NOT EXISTS, LangGraph's
    migrations and the ledger's tables, run at once, failed all but one of them (a duplicate
    key in the catalogs: the failed run answered AGENT_ERROR). They take turns now, without
    deadlocking on the migrations' CREATE INDEX CONCURRENTLY."""
    with postgres_schema() as url:
        savers = [checkpointer(url) for _ in range(4)]
        try:
            async with asyncio.timeout(60):
                await asyncio.gather(*(s.approvals.find() for s in savers),
                                     *(graph(s).ainvoke({}, CONFIG) for s in savers[:2]))
        finally:
            for made in savers:
                await made.aclose()


async def test_postgres_keeps_interrupts_and_approvals() -> None:
    with postgres_schema() as url:
        await interrupted_then_reopened(url)
        schema = url.rsplit("=", 1)[1]
        with psycopg.connect(SERVER) as conn:
            tables = {r[0] for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (schema,))}
        assert {"checkpoints", "checkpoint_writes", "copilot_approvals"} <= tables


def test_a_checkpointer_stays_in_its_loop(tmp_path: Path) -> None:
    saver = checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3")
    asyncio.run(graph(saver).ainvoke({}, CONFIG))
    try:
        with pytest.raises(RuntimeError, match="bound to the event loop"):
            asyncio.run(graph(saver).aget_state(CONFIG))
    finally:
        asyncio.run(saver.aclose())  # aiosqlite's thread answers any loop


def test_copies_share_the_database(tmp_path: Path) -> None:
    saver = checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3")
    clone = copy.copy(saver)  # what LangGraph's allow-list does with a checkpointer
    assert isinstance(clone, DurableCheckpointer)
    assert clone.approvals is saver.approvals

    async def go() -> None:
        await graph(saver).ainvoke({}, CONFIG)
        assert (await graph(clone).aget_state(CONFIG)).interrupts
        await saver.aclose()

    asyncio.run(go())


def test_memory_works_without_a_loop() -> None:
    saver = checkpointer("memory")
    built = graph(saver)
    built.invoke({}, CONFIG)  # the in-memory kind also serves synchronous calls
    assert built.get_state(CONFIG).interrupts


# -- the ledger -----------------------------------------------------------------------

@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ApprovalStore]:
    with _url(request.param, tmp_path) as url:
        saver = checkpointer(url)
        yield saver.approvals
        await saver.aclose()


def _url(kind: str, tmp_path: Path) -> Any:
    import contextlib

    if kind == "postgres":
        return postgres_schema()

    @contextlib.contextmanager
    def fixed() -> Iterator[str]:
        yield "memory" if kind == "memory" else f"sqlite:///{tmp_path}/cp.sqlite3"

    return fixed()


async def test_ledger(ledger: ApprovalStore) -> None:
    notified: list[int] = []
    ledger.subscribe(lambda: notified.append(1))
    now = time.time()
    first = Approval("a1", "t1", "review", {"q": 1}, now, now + 30, channel="legacy")
    second = Approval("a2", "t2", "orders", {"q": 2}, now + 1)
    await ledger.add([first, second])
    await ledger.add([Approval("a1", "t9", "x", {}, now)])  # known ids are left alone
    assert len(notified) == 1
    assert [a.id for a in await ledger.find()] == ["a1", "a2"]
    assert [a.id for a in await ledger.find(agent_id="orders")] == ["a2"]
    assert [a.id for a in await ledger.find(thread_id="t1")] == ["a1"]
    stored = await ledger.get("a1")
    assert stored == first

    # two answers at once: exactly one wins
    wins = await asyncio.gather(*(ledger.claim("a1", "answered", {"n": n}, f"u{n}", now + 2)
                                  for n in range(5)))
    winners = [w for w in wins if w is not None]
    assert len(winners) == 1
    assert winners[0].status == "answered"
    assert winners[0].applied is False
    assert await ledger.claim("a1", "expired", {}, None, now) is None
    assert [a.id for a in await ledger.unapplied()] == ["a1"]
    await ledger.settle("a1", "applied")
    assert await ledger.unapplied() == []
    assert (await ledger.get("a1")).applied is True  # type: ignore[union-attr]

    assert await ledger.claim("a2", "expired", {"action": "timeout"}, "runtime", now) is not None
    await ledger.settle("a2", "reopen")  # the answer did not take: pending again
    reopened = await ledger.get("a2")
    assert reopened is not None
    assert (reopened.status, reopened.answer, reopened.answered_by) == ("pending", None, None)
    assert len(notified) == 2
    await ledger.settle("a2", "withdrawn")
    assert [a.id for a in await ledger.find(status="withdrawn")] == ["a2"]
    assert [a.id for a in await ledger.find(status=None)] == ["a1", "a2"]
    assert await ledger.get("nope") is None


async def test_ledgers_of_two_schemas_do_not_wait_for_each_other() -> None:
    """The ledger's migration took a lock named by its table alone, the same in every
    schema: an app whose migration stalled mid-transaction (a partition, a hung server)
    held up every other app's ledger in the database, each answering 503 until it ended."""
    from psycopg_pool import AsyncConnectionPool

    from copilot_runtime.approvals.sql import PostgresApprovalStore

    class Stalling:
        """A connection whose transaction stops after its first statement until told."""

        def __init__(self, conn: Any, stalled: asyncio.Event, go: asyncio.Event) -> None:
            self._conn, self._stalled, self._go = conn, stalled, go

        def transaction(self) -> Any:
            return self._conn.transaction()

        async def execute(self, *args: Any) -> Any:
            cursor = await self._conn.execute(*args)
            if not self._stalled.is_set():
                self._stalled.set()
                await self._go.wait()
            return cursor

    with postgres_schema() as first_url, postgres_schema() as second_url:
        pools = [AsyncConnectionPool(SERVER, open=False, kwargs={
            "autocommit": True, "options": f"-c search_path={url.rsplit('=', 1)[1]}"})
            for url in (first_url, second_url)]
        for pool, url in zip(pools, (first_url, second_url), strict=True):
            await pool.open()
            async with pool.connection() as conn:
                await conn.execute(f'CREATE SCHEMA "{url.rsplit("=", 1)[1]}"')
        stalled, go = asyncio.Event(), asyncio.Event()

        class StallingPool:
            @contextlib.asynccontextmanager
            async def connection(self) -> AsyncIterator[Any]:
                async with pools[0].connection() as conn:
                    yield Stalling(conn, stalled, go)

        async def stalling_pool() -> Any:
            return StallingPool()

        async def second_pool() -> Any:
            return pools[1]

        first = PostgresApprovalStore(stalling_pool)
        second = PostgresApprovalStore(second_pool)
        second.timeout = 2
        migrating = asyncio.ensure_future(first.find())
        try:
            await asyncio.wait_for(stalled.wait(), 10)
            assert await asyncio.wait_for(second.find(), 5) == []
            go.set()
            assert await asyncio.wait_for(migrating, 10) == []
        finally:
            go.set()  # its transaction ends, or the schemas could not be dropped
            await asyncio.wait([migrating], timeout=10)
            for pool in pools:
                await pool.close()
