"""Group commit in the SQLite store: calls asked for while a batch is on the store's thread go
together in the next one (one hop, and one transaction for its writes), each caller returning
once its call committed; a bad run fails only its own caller, a cancelled caller loses nobody's
run, and a thread's runs keep their order. The thread itself does not outlive the store's
use: it ends when idle or when the store is dropped, and comes back on demand."""

from __future__ import annotations

import asyncio
import gc
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events
from copilot_runtime.threads import SQLiteThreadStore, StoredRun
from copilot_runtime.threads._store_thread import StoreThread
from tests.conftest import poll

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteThreadStore]:
    made = SQLiteThreadStore(tmp_path / "threads.sqlite3")
    try:
        yield made
    finally:
        await made.aclose()


@pytest.fixture
def batches(store: SQLiteThreadStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every batch the store's thread runs from now on."""
    sizes: list[int] = []
    run = store._calls._run

    def counted(batch: list[Any]) -> None:
        sizes.append(len(batch))
        run(batch)

    monkeypatch.setattr(store._calls, "_run", counted)
    return sizes


@pytest.fixture
def commits(store: SQLiteThreadStore) -> list[str]:
    """Every transaction the store commits or rolls back from now on."""
    seen: list[str] = []
    store._db.set_trace_callback(
        lambda statement: seen.append(statement)
        if statement in ("COMMIT", "ROLLBACK") else None)
    return seen


def _run(thread: str, run: str, first: int = 0) -> StoredRun:
    events = [ev.run_started(thread, run, {"threadId": thread, "runId": run, "messages": [
                  {"id": f"u-{run}", "role": "user", "content": "hi"}]}),
              ev.text_message_start(f"m-{run}"), ev.text_message_content(f"m-{run}", run),
              ev.text_message_end(f"m-{run}"), ev.run_finished(thread, run)]
    return StoredRun(run, compact_events(events), 1.0, 0, first, first + len(events) - 1)


async def _finish(store: SQLiteThreadStore, thread: str, run: StoredRun,
                  message_ids: list[Any] | None = None) -> None:
    await store.append_run(thread, "default", run, message_ids if message_ids is not None
                           else [f"u-{run.run_id}", f"m-{run.run_id}"])


async def _in_flight(store: SQLiteThreadStore, thread: str, run: StoredRun
                     ) -> asyncio.Future[None]:
    """A run on the store's thread: what is asked for next waits for it."""
    task = asyncio.ensure_future(_finish(store, thread, run))
    await asyncio.sleep(0)
    assert store._calls._busy
    assert not store._calls._queued
    return task


async def test_concurrent_runs_are_batched_in_one_transaction_and_keep_their_order(
        store: SQLiteThreadStore, batches: list[int], commits: list[str]) -> None:
    threads = [f"t{i}" for i in range(20)]
    # Three runs per thread, asked for in order: one batch keeps that order.
    runs = [(t, _run(t, f"{t}-r{n}", 5 * n)) for n in range(3) for t in threads]
    await asyncio.gather(*(_finish(store, t, r) for t, r in runs))
    # The first goes at once; the others queue behind it and go together.
    assert batches == [1, 59]
    assert commits == ["COMMIT", "COMMIT"]
    for t in threads:
        record = await store.get(t)
        assert record is not None
        assert [r.run_id for r in record.runs] == [f"{t}-r0", f"{t}-r1", f"{t}-r2"]
        assert record.next_position == 15
        assert f"m-{t}-r2" in record.message_ids


async def test_a_batch_holds_at_most_64_calls(store: SQLiteThreadStore,
                                              batches: list[int]) -> None:
    first = await _in_flight(store, "big", _run("big", "first"))
    await asyncio.gather(first, *(_finish(store, f"b{i}", _run(f"b{i}", "r"))
                                  for i in range(100)))
    assert batches == [1, 64, 36]
    assert all([await store.get(f"b{i}") is not None for i in range(100)])


async def test_a_lone_call_goes_alone(store: SQLiteThreadStore, batches: list[int],
                                      commits: list[str]) -> None:
    for n in range(3):
        await _finish(store, "lone", _run("lone", f"r{n}", 5 * n))
        assert await store.summary("lone") is not None
    assert batches == [1] * 6
    assert commits == ["COMMIT"] * 3  # reads alone open no transaction


async def test_a_bad_run_fails_only_its_caller(store: SQLiteThreadStore,
                                               batches: list[int], commits: list[str]) -> None:
    good = [(f"g{i}", _run(f"g{i}", f"g{i}-run")) for i in range(8)]
    first = await _in_flight(store, "first", _run("first", "first-run"))
    # Its message ids cannot be stored: it fails once its thread's and run's rows are
    # written, which are undone with it.
    results = await asyncio.gather(first, *(_finish(store, t, r) for t, r in good[:4]),
                                   _finish(store, "bad", _run("bad", "bad-run"), [object()]),
                                   *(_finish(store, t, r) for t, r in good[4:]),
                                   return_exceptions=True)
    assert batches == [1, 9]
    assert commits == ["COMMIT", "COMMIT"]
    assert isinstance(results[5], sqlite3.ProgrammingError)
    assert [r for i, r in enumerate(results) if i != 5] == [None] * 9
    for t, r in [("first", _run("first", "first-run")), *good]:
        record = await store.get(t)
        assert record is not None
        assert [s.run_id for s in record.runs] == [r.run_id]
    assert await store.get("bad") is None
    # The store goes on batching afterwards.
    await asyncio.gather(*(_finish(store, f"after{i}", _run(f"after{i}", "r"))
                           for i in range(3)))
    assert await store.get("after2") is not None


async def test_a_bad_lone_run_is_undone(store: SQLiteThreadStore, commits: list[str]) -> None:
    with pytest.raises(sqlite3.ProgrammingError):
        await _finish(store, "bad", _run("bad", "bad-run"), [object()])
    assert commits == ["ROLLBACK"]
    assert await store.get("bad") is None


async def test_reads_in_a_batch_see_the_writes_before_them(
        store: SQLiteThreadStore, batches: list[int], commits: list[str]) -> None:
    first = await _in_flight(store, "first", _run("first", "r"))
    head_before, _, head_after, bad, listed = await asyncio.gather(
        store.summary("later"), _finish(store, "later", _run("later", "r")),
        store.summary("later"),
        _finish(store, "bad", _run("bad", "r"), [object()]), store.list(),
        return_exceptions=True)
    await first
    assert batches == [1, 5]
    assert commits == ["COMMIT", "COMMIT"]
    assert head_before is None
    assert head_after is not None
    assert not isinstance(head_after, BaseException)
    assert head_after.message_ids == {"u-r", "m-r"}
    assert isinstance(bad, sqlite3.ProgrammingError)
    assert isinstance(listed, list)
    assert sorted(r.thread_id for r in listed) == ["first", "later"]


async def test_a_cancelled_caller_loses_no_run(store: SQLiteThreadStore,
                                               batches: list[int]) -> None:
    tasks = [await _in_flight(store, "c0", _run("c0", "r"))]
    tasks += [asyncio.ensure_future(_finish(store, f"c{i}", _run(f"c{i}", "r")))
              for i in range(1, 6)]
    await asyncio.sleep(0)  # all queued while the first is on the store's thread
    tasks[3].cancel()
    tasks[0].cancel()  # its call is on the thread already: it goes on too
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert isinstance(results[3], asyncio.CancelledError)
    await store._calls.wait_idle()
    assert batches == [1, 5]
    for i in range(6):
        record = await store.get(f"c{i}")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r"]


async def test_closing_runs_what_is_queued(tmp_path: Path) -> None:
    store = SQLiteThreadStore(tmp_path / "threads.sqlite3")
    first = await _in_flight(store, "q0", _run("q0", "r"))
    tasks = [asyncio.ensure_future(_finish(store, f"q{i}", _run(f"q{i}", "r")))
             for i in range(1, 5)]
    await asyncio.sleep(0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await store.aclose()
    assert first.done()
    with sqlite3.connect(tmp_path / "threads.sqlite3") as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone() == (5,)
    conn.close()
    with pytest.raises(sqlite3.ProgrammingError):
        await store.summary("q0")


async def test_running_runs_events_and_finished_runs_commit_together(
        store: SQLiteThreadStore, batches: list[int], commits: list[str]) -> None:
    def streamed(thread: str) -> list[ev.Event]:
        return [ev.run_started(thread, "r", {"threadId": thread, "runId": "r", "messages": [
                    {"id": f"u-{thread}", "role": "user", "content": f"hi {thread}"}]}),
                ev.text_message_start(f"m-{thread}"),
                ev.text_message_content(f"m-{thread}", "so far")]

    first = await _in_flight(store, "done", _run("done", "r"))
    threads = [f"s{i}" for i in range(1, 9)]
    await asyncio.gather(first, *(store.append_events(t, "default", "r", 1.0, 0, streamed(t))
                                  for t in threads),
                         store.append_events("opened", "default", "r", 1.0, 0, []),
                         _finish(store, "done2", _run("done2", "r")))
    assert batches == [1, 10]
    assert commits == ["COMMIT", "COMMIT"]
    assert sorted(await store.open_runs()) == sorted(
        [("opened", "r"), *((t, "r") for t in threads)])
    for t in threads:
        assert [(p, e) for p, e in await store.events_after(t, -1)] == list(
            enumerate(streamed(t)))
        head = await store.summary(t)
        assert head is not None
        assert (head.next_position, head.title) == (3, f"hi {t}")
    assert await store.get("done2") is not None


def test_a_store_outlives_the_event_loop_of_a_call_in_flight(tmp_path: Path) -> None:
    store = SQLiteThreadStore(tmp_path / "threads.sqlite3")

    async def abandon() -> None:
        # The store's thread waits for the lock, so the call is on it when this loop closes.
        task = asyncio.ensure_future(_finish(store, "left", _run("left", "r")))
        await asyncio.sleep(0)
        assert store._calls._busy
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    first = asyncio.new_event_loop()
    with store._lock:
        first.run_until_complete(abandon())
        first.close()

    async def go_on() -> None:
        await _finish(store, "next", _run("next", "r"))
        left, following = await store.get("left"), await store.get("next")
        assert left is not None
        assert following is not None
        await store.aclose()

    second = asyncio.new_event_loop()
    try:
        second.run_until_complete(go_on())
    finally:
        second.close()


def _store_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "sqlite-store"}


async def _ended(threads: set[threading.Thread]) -> list[threading.Thread]:
    """Those of `threads` still alive after a while (none, if they end)."""
    async for _ in poll(10):
        if not any(t.is_alive() for t in threads):
            break
    return [t for t in threads if t.is_alive()]


async def test_stores_dropped_without_closing_leave_no_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StoreThread, "idle_timeout", 60.0)  # not what ends them here
    before = _store_threads()
    for i in range(20):
        store = SQLiteThreadStore(tmp_path / f"dropped{i}.sqlite3")
        await _finish(store, "t", _run("t", "r"))
        assert await store.get("t") is not None
        del store  # never closed
    gc.collect()
    assert await _ended(_store_threads() - before) == []


async def test_an_idle_thread_ends_and_comes_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StoreThread, "idle_timeout", 0.1)
    before = _store_threads()
    stores = [SQLiteThreadStore(tmp_path / f"idle{i}.sqlite3") for i in range(10)]
    for store in stores:  # kept, never closed: as a module's global store would be
        await _finish(store, "t", _run("t", "r1"))
    started = _store_threads() - before
    assert started
    assert await _ended(started) == []
    for store in stores:  # each call after idling starts a thread again
        await _finish(store, "t", _run("t", "r2", first=5))
        record = await store.get("t")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r1", "r2"]
    assert await _ended(_store_threads() - before) == []
    for store in stores:
        await store.aclose()
