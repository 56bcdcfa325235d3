"""The PostgreSQL thread store on a server that is there but only reads (a standby after a
failover, a demoted primary), and connection URLs that carry libpq `options`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from copilot_runtime import ServiceUnavailableError, thread_store
from copilot_runtime._url_options import split_options
from copilot_runtime.threads import PostgresThreadStore, StoredRun
from tests.hitl_support.postgres import SERVER, standby

TIMEOUT = 3.0


@pytest.fixture
async def schema() -> AsyncIterator[str]:
    name = f"read_only_{uuid.uuid4().hex[:10]}"
    try:
        yield name
    finally:
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def test_options_with_spaces_reach_libpq_as_written() -> None:
    """The runtime's own options are taken out of a URL; the rest is written again with
    spaces as %20, which libpq decodes (a `+` reached the server as a plus)."""
    url, options = split_options(
        "postgresql://u@h:5432/db?schema=s&options=-c%20statement_timeout%3D4321"
        "&application_name=a%20b", ("schema",))
    assert options == {"schema": "s"}
    given = conninfo_to_dict(url)
    assert (given["options"], given["application_name"]) == (
        "-c statement_timeout=4321", "a b")


def _run(run_id: str, first: int) -> StoredRun:
    events = [{"type": "RUN_STARTED", "threadId": "t", "runId": run_id},
              {"type": "RUN_FINISHED", "threadId": "t", "runId": run_id}]
    return StoredRun(run_id, events, time.time(), 0, first, first + 1)


async def test_a_store_started_on_a_read_only_server_cannot_serve_now(schema: str) -> None:
    """Every transaction only reads (the session default of a standby): the store cannot
    make its tables, and each call is a ServiceUnavailableError (a 503, a RUN_ERROR
    SERVICE_UNAVAILABLE), not the driver's error (a 500)."""
    store = thread_store(f"{SERVER}?schema={schema}"
                         "&options=-c%20default_transaction_read_only%3Don")
    assert isinstance(store, PostgresThreadStore)
    store.timeout = TIMEOUT
    try:
        for _ in range(2):  # opening is tried again by the next call
            with pytest.raises(ServiceUnavailableError) as raised:
                await store.summary("t")
            assert raised.value.status == 503
            assert isinstance(raised.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)
    finally:
        await store.aclose()


def _read_only(schema: str, on: bool) -> None:
    """The runs table answers writes as a standby does (or stops to)."""
    standby(schema, "runs", on)


async def test_writes_refused_by_a_read_only_server_cannot_serve_now(schema: str) -> None:
    """A server that turns read-only under an open store (a failover): its writes are
    ServiceUnavailableError, which the run's end retries until the server takes them,
    and the thread is whole once it does."""
    store = PostgresThreadStore(SERVER, schema=schema, timeout=TIMEOUT)
    try:
        await store.append_run("t", "a", _run("r1", 0), ["m1"])
        await asyncio.to_thread(_read_only, schema, True)
        with pytest.raises(ServiceUnavailableError) as raised:
            await store.append_run("t", "a", _run("r2", 2), ["m2"])
        assert isinstance(raised.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)
        record = await store.summary("t")  # reads go on
        assert record is not None
        assert record.message_ids == {"m1"}
        await asyncio.to_thread(_read_only, schema, False)
        await store.append_run("t", "a", _run("r2", 2), ["m2"])
        record = await store.get("t")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r1", "r2"]
    finally:
        await store.aclose()
