"""How many PostgreSQL connections each part of the runtime holds, and how an operator tells
them apart: every part names itself in `pg_stat_activity` (unless its URL names it), and
`pool_size` in its URL bounds its pool, whatever the load."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
import pytest

from copilot_runtime import (
    ConfigurationError,
    ServiceUnavailableError,
    checkpointer,
    coordinator,
    thread_store,
)
from copilot_runtime._pg_lane import with_session_defaults
from copilot_runtime.threads import PostgresThreadStore, StoredRun
from tests.hitl_support.postgres import SERVER, postgres_schema

pytestmark = pytest.mark.timeout(60)


def test_session_defaults_are_added_unless_given() -> None:
    url = with_session_defaults("postgresql://u@h:5432/db?sslmode=disable",
                                connect_timeout=10, application_name="copilot-runtime threads")
    assert url == ("postgresql://u@h:5432/db?sslmode=disable&connect_timeout=10"
                   "&application_name=copilot-runtime%20threads&keepalives_idle=30"
                   "&keepalives_interval=10&keepalives_count=3&tcp_user_timeout=60000")
    assert psycopg.conninfo.conninfo_to_dict(url)["application_name"] == \
        "copilot-runtime threads"
    given = ("postgresql://u@h/db?application_name=billing&connect_timeout=3"
             "&keepalives_idle=5&keepalives_interval=1&keepalives_count=9&tcp_user_timeout=0")
    assert with_session_defaults(given, connect_timeout=10, application_name="x") == given
    pairs = with_session_defaults("host=h dbname=db application_name=mine keepalives=0",
                                  connect_timeout=0.5, application_name="x")
    assert psycopg.conninfo.conninfo_to_dict(pairs) == {
        "host": "h", "dbname": "db", "application_name": "mine", "connect_timeout": "2",
        "keepalives": "0", "keepalives_idle": "30", "keepalives_interval": "10",
        "keepalives_count": "3", "tcp_user_timeout": "60000"}


@pytest.mark.parametrize(("option", "expected"), [
    ("sslmode=bogus", "sslmode must be one of disable, allow, prefer, require, verify-ca, "
                      "verify-full, got 'bogus'"),
    ("sslmode=DISABLE", "sslmode must be one of .*, got 'DISABLE'"),
    ("gssencmode=bogus", "gssencmode must be one of disable, prefer, require, got 'bogus'"),
    ("target_session_attrs=bogus", "target_session_attrs must be one of any, read-write, "
                                   "read-only, primary, standby, prefer-standby, got 'bogus'"),
    ("channel_binding=", "channel_binding must be one of disable, prefer, require, got ''"),
    ("keepalives=abc", "keepalives must be a whole number, got 'abc'"),
    ("keepalives_idle=1.5", "keepalives_idle must be a whole number of seconds, got '1.5'"),
    ("tcp_user_timeout=abc", "tcp_user_timeout must be a whole number of milliseconds, "
                             "got 'abc'"),
    ("keepalives_count=2147483648", "keepalives_count must be a whole number, "
                                    "got '2147483648'"),
])
def test_an_option_value_libpq_cannot_read_is_refused_at_once(option: str,
                                                              expected: str) -> None:
    """Before: only the names, the port and connect_timeout were checked: the store, the
    coordinator and the checkpointer were built, the runtime started, and every request
    was a 503 for ever (libpq refusing the value at each connection attempt)."""
    for make in (thread_store, coordinator, checkpointer):
        with pytest.raises(ConfigurationError, match=expected):
            make(f"{SERVER}?schema=s&{option}")


def test_option_values_libpq_reads_are_taken() -> None:
    """Spaces around a whole number and a sign are libpq's too; the last of an option given
    twice is the one read."""
    given = ("?schema=s&sslmode=require&sslmode=disable&keepalives=%201%20"
             "&connect_timeout=%2B3&target_session_attrs=prefer-standby&tcp_user_timeout=0")
    thread_store(SERVER + given)
    coordinator(SERVER + given)
    checkpointer(SERVER + given)


@pytest.mark.parametrize("size", ["0", "101", "ten", ""])
def test_a_pool_size_out_of_bounds_is_refused_at_once(size: str) -> None:
    message = "pool_size must be a whole number from 1 to 100"
    with pytest.raises(ConfigurationError, match=message):
        thread_store(f"{SERVER}?schema=s&pool_size={size}")
    with pytest.raises(ConfigurationError, match=message):
        coordinator(f"{SERVER}?schema=s&pool_size={size}")
    with pytest.raises(ConfigurationError, match=message):
        checkpointer(f"{SERVER}?schema=s&pool_size={size}")


def test_pool_size_and_schema_never_reach_the_driver() -> None:
    store = thread_store(f"{SERVER}?schema=mine&pool_size=3&sslmode=disable")
    assert isinstance(store, PostgresThreadStore)
    assert store.schema == "mine"
    assert store._pool.max_size == 3
    options = psycopg.conninfo.conninfo_to_dict(store.conninfo)
    assert options["sslmode"] == "disable"
    assert "pool_size" not in options
    assert "schema" not in options
    assert thread_store(f"{SERVER}?schema=mine")._pool.max_size == 10  # type: ignore[attr-defined]
    shared = coordinator(f"{SERVER}?schema=mine&pool_size=2&lease_ttl=5")
    assert shared.max_connections == 2  # type: ignore[attr-defined]
    assert coordinator(f"{SERVER}?schema=mine").max_connections == 4  # type: ignore[attr-defined]


async def _most_named(load: Callable[[], Awaitable[None]], name: str) -> int:
    """The most connections named `name` seen while `load` runs, sampled every 5 ms."""
    most = 0
    loaded = asyncio.ensure_future(load())
    async with await psycopg.AsyncConnection.connect(SERVER, autocommit=True) as watcher:
        while not loaded.done():
            row = await (await watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                (name,))).fetchone()
            assert row is not None
            most = max(most, row[0])
            await asyncio.sleep(0.005)
    await loaded
    return most


async def _shown(conn: Any) -> str:
    row = await (await conn.execute("SHOW application_name")).fetchone()
    return str(row[0] if not isinstance(row, dict) else row["application_name"])


@pytest.fixture
async def schema_url() -> AsyncIterator[str]:
    with postgres_schema() as url:
        yield url


async def test_the_thread_store_holds_its_pool_and_three_connections(schema_url: str) -> None:
    name = f"threads-{uuid.uuid4().hex[:8]}"
    store = thread_store(f"{schema_url}&pool_size=2&application_name={name}")
    assert isinstance(store, PostgresThreadStore)
    try:
        async def load() -> None:
            async def chat(i: int) -> None:
                thread = f"t{i}"
                assert await store.summary(thread) is None
                await store.append_run(thread, "default", StoredRun(
                    f"r{i}", [{"type": "RUN_STARTED", "threadId": thread, "runId": f"r{i}"},
                              {"type": "RUN_FINISHED", "threadId": thread, "runId": f"r{i}"}],
                    0.0, 0, 0, 1), [f"m{i}"])
                await store.events_after(thread, -1)
                await store.list(limit=5)
            await asyncio.gather(*(chat(i) for i in range(60)))

        most = await _most_named(load, name)
        # Its pool (2: reads, listing) and its three lanes (heads, finished and running runs).
        assert 3 <= most <= 5, most
        assert len(await store.list(limit=100)) == 60
        async with store._pool.connection() as conn:
            assert await _shown(conn) == name
    finally:
        await store.aclose()
    unnamed = thread_store(schema_url)
    assert isinstance(unnamed, PostgresThreadStore)
    try:
        await unnamed.summary("t0")
        async with unnamed._pool.connection() as conn:
            assert await _shown(conn) == "copilot-runtime threads"
    finally:
        await unnamed.aclose()


async def test_the_coordinator_holds_its_pool_and_three_connections(schema_url: str) -> None:
    name = f"coordinator-{uuid.uuid4().hex[:8]}"
    shared = coordinator(f"{schema_url}&pool_size=1&application_name={name}")
    try:
        async def load() -> None:
            async def run(i: int) -> None:
                lease = await shared.acquire(f"t{i}", f"r{i}")
                assert lease is not None
                await shared.follow(f"t{i}")
                assert await shared.holder(f"t{i}") == f"r{i}"
                await shared.finish(lease)
            await asyncio.gather(*(run(i) for i in range(40)))

        most = await _most_named(load, name)
        # Its pool (1: holders, follows) and its own three (taking, ending, listening).
        assert 3 <= most <= 4, most
    finally:
        await shared.aclose()
    unnamed = coordinator(schema_url)
    try:
        await unnamed.start()
        async with unnamed._pool.connection() as conn:  # type: ignore[attr-defined]
            assert await _shown(conn) == "copilot-runtime coordinator"
    finally:
        await unnamed.aclose()


async def test_the_checkpointer_holds_at_most_its_pool(schema_url: str) -> None:
    name = f"checkpoints-{uuid.uuid4().hex[:8]}"
    saver = checkpointer(f"{schema_url}&pool_size=2&application_name={name}")
    try:
        await saver.aget_tuple({"configurable": {"thread_id": "t", "checkpoint_ns": ""}})

        async def load() -> None:
            await asyncio.gather(*(
                saver.aget_tuple({"configurable": {"thread_id": f"t{i}", "checkpoint_ns": ""}})
                for i in range(40)))
            await asyncio.gather(*(saver.approvals.unapplied() for _ in range(20)))

        most = await _most_named(load, name)
        assert 1 <= most <= 2, most
    finally:
        await saver.aclose()
    unnamed = checkpointer(schema_url)
    try:
        await unnamed.aget_tuple({"configurable": {"thread_id": "t", "checkpoint_ns": ""}})
        with psycopg.connect(SERVER, autocommit=True) as conn:
            names = {r[0] for r in conn.execute(
                "SELECT application_name FROM pg_stat_activity WHERE pid <> pg_backend_pid()")}
        assert "copilot-runtime checkpoints" in names
    finally:
        await unnamed.aclose()


async def test_a_connection_refused_for_lack_of_slots_is_service_unavailable_at_once(
        schema_url: str) -> None:
    """A role allowed two connections: the store's third (its finished runs' lane) is
    refused by the server, and that write fails at once as unavailable; what holds a
    connection still works."""
    role = f"cr_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(SERVER, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 2")
        admin.execute(f"GRANT CREATE ON DATABASE test TO {role}")
    schema = schema_url.split("schema=")[1]
    store = thread_store(f"postgresql://{role}@127.0.0.1:5432/test?schema={schema}_limited"
                         "&pool_size=1")
    try:
        assert await store.summary("t") is None  # the pool's connection and the heads' lane
        started = asyncio.get_running_loop().time()
        with pytest.raises(ServiceUnavailableError):
            await store.append_run("t", "default", StoredRun(
                "r", [{"type": "RUN_STARTED", "threadId": "t", "runId": "r"},
                      {"type": "RUN_FINISHED", "threadId": "t", "runId": "r"}],
                0.0, 0, 0, 1), ["m"])
        assert asyncio.get_running_loop().time() - started < 2.0
        assert await store.events_after("t", -1) == []
    finally:
        await store.aclose()
        with psycopg.connect(SERVER, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}_limited" CASCADE')
            admin.execute(f"REVOKE CREATE ON DATABASE test FROM {role}")
            admin.execute(f"DROP ROLE {role}")


async def test_the_stores_connections_fail_when_packets_stop_getting_through(
        schema_url: str) -> None:
    """Keepalives and a TCP user timeout on the real connections: a server behind a network
    that drops packets fails them within about a minute, not a quarter of an hour."""
    store = thread_store(schema_url)
    assert isinstance(store, PostgresThreadStore)
    try:
        assert await store.summary("t") is None
        async with store._heads as cursor:
            parameters = cursor.connection.info.get_parameters()
        assert {key: parameters.get(key) for key in (
            "keepalives_idle", "keepalives_interval", "keepalives_count", "tcp_user_timeout")
        } == {"keepalives_idle": "30", "keepalives_interval": "10", "keepalives_count": "3",
              "tcp_user_timeout": "60000"}
    finally:
        await store.aclose()
