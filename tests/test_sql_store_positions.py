"""Positions in the SQL stores.

* A run id sent again in a later run of the same thread (the README's curl does, and so do
  scripted clients): a resume inside the first run gets the rest of the first run, then the
  later run once. The raw events kept for exact resumes were found by run id alone, so the
  later run was replayed twice (raw, then compacted) and an open run replayed an earlier
  one's events as its own.
* A run's start on a new thread asks where its positions go on from (a deleted thread's
  tombstone) right after reading its head: both are read at once, so a new thread costs no
  second round trip (every chat of a new conversation starts one)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn

import psycopg
import pytest

from copilot_runtime.threads import PostgresThreadStore, SQLiteThreadStore, StoredRun
from copilot_runtime.threads._rows import Chunk, RunRow, closed_run, events_after
from tests.hitl_support.postgres import SERVER


def ev(n: int) -> dict[str, Any]:
    return {"type": "CUSTOM", "name": "e", "value": n}


def test_a_resume_inside_the_first_run_gets_the_later_run_once() -> None:
    first = RunRow("r1", False, 0, 3, [ev(0), ev(3)])
    second = RunRow("r1", False, 4, 7, [ev(4), ev(7)])
    chunks = [Chunk("r1", 0, [ev(0), ev(1)]), Chunk("r1", 2, [ev(2), ev(3)]),
              Chunk("r1", 4, [ev(4), ev(5), ev(6), ev(7)])]
    out = events_after([first, second], chunks, 1)
    assert [p for p, _ in out] == [2, 3, None, 7]


def test_an_open_run_with_a_reused_id_streams_only_its_own_events() -> None:
    first = RunRow("r1", False, 0, 1, [ev(0), ev(1)])
    live = RunRow("r1", True, 2, -1, [])
    chunks = [Chunk("r1", 0, [ev(0), ev(1)]), Chunk("r1", 2, [ev(2)])]
    assert [p for p, _ in events_after([first, live], chunks, 0)] == [1, 2]


def test_an_interrupted_run_with_a_reused_id_is_closed_with_its_own_events() -> None:
    earlier = [Chunk("r1", 0, [{"type": "RUN_STARTED", "threadId": "t", "runId": "r1"},
                               {"type": "RUN_FINISHED", "threadId": "t", "runId": "r1"}])]
    mine = [Chunk("r1", 2, [{"type": "RUN_STARTED", "threadId": "t", "runId": "r1"},
                            {"type": "TEXT_MESSAGE_START", "messageId": "m",
                             "role": "assistant"}])]
    tail, first_tail, compacted, last = closed_run("t", "r1", 2, earlier + mine)
    assert first_tail == 4
    assert [e["type"] for e in compacted].count("RUN_STARTED") == 1
    assert last == first_tail + len(tail) - 1


def _run(run_id: str, first: int, count: int) -> tuple[StoredRun, list[dict[str, Any]]]:
    raw: list[dict[str, Any]] = [{"type": "RUN_STARTED", "threadId": "t", "runId": run_id}]
    raw += [ev(first + i) for i in range(1, count - 1)]
    raw.append({"type": "RUN_FINISHED", "threadId": "t", "runId": run_id})
    return StoredRun(run_id, [raw[0], raw[-1]], time.time(), 0, first,
                     first + count - 1), raw


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "sqlite":
        made: Any = SQLiteThreadStore(str(tmp_path / "threads.sqlite3"))
        try:
            yield made
        finally:
            await made.aclose()
        return
    schema = f"positions_{uuid.uuid4().hex[:10]}"
    made = PostgresThreadStore(SERVER, schema=schema)
    try:
        yield made
    finally:
        await made.aclose()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_a_store_replays_a_reused_run_id_once(store: Any) -> None:
    for first in (0, 4):
        stored, raw = _run("r1", first, 4)
        await store.append_run("t", "a", stored, [], raw_first=first, raw=raw)
    out = await store.events_after("t", 1)
    types = [e["type"] for _, e in out]
    assert types.count("RUN_STARTED") == 1, out
    positions = [p for p, _ in out if p is not None]
    assert positions == sorted(set(positions)), out
    assert positions[0] == 2
    assert positions[-1] == 7


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
