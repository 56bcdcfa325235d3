"""A run's start on a new thread asks where its positions go on from (a deleted thread's
tombstone) right after reading its head: the SQL stores read both at once, so a new thread
costs no second round trip (every chat of a new conversation starts one)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn

import psycopg
import pytest

from copilot_runtime.threads import PostgresThreadStore, SQLiteThreadStore, StoredRun
from tests.hitl_support.postgres import SERVER


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "sqlite":
        made: Any = SQLiteThreadStore(str(tmp_path / "threads.sqlite3"))
        try:
            yield made
        finally:
            await made.aclose()
        return
    schema = f"first_{uuid.uuid4().hex[:10]}"
    made = PostgresThreadStore(SERVER, schema=schema)
    try:
        yield made
    finally:
        await made.aclose()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _no_second_read(store: Any) -> None:
    def refused(*_: Any) -> NoReturn:
        raise AssertionError("a second read for a new thread's first position")

    if isinstance(store, PostgresThreadStore):
        store._pool.connection = refused  # type: ignore[method-assign]
    else:
        store._first_position = refused


async def test_a_new_threads_first_position_comes_with_its_head(store: Any) -> None:
    run = StoredRun("r1", [{"type": "RUN_STARTED", "threadId": "gone", "runId": "r1"},
                           {"type": "RUN_FINISHED", "threadId": "gone", "runId": "r1"}],
                    time.time(), 0, 0, 6)
    await store.append_run("gone", "a", run, [])
    assert await store.delete("gone")
    assert await store.summary("kept") is None
    assert await store.summary("gone") is None
    _no_second_read(store)
    assert await store.first_position("gone") == 7
    assert await store.first_position("kept") == 0
