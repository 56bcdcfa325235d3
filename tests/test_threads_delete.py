"""Deleting a thread keeps runs off it until the delete is done.

A DELETE checked that no run was on the thread, then had the agents forget it and deleted it
from the store: a run that began in between (here, while an agent forgot slowly) streamed on
a thread deleted under it, with a 200 "deleted" for the caller, and the thread came back with
that run once it ended. Now the delete holds the thread (the lease, under a shared
coordinator) from its check to its end: a run asking meanwhile is busy (409), on every store.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog

from copilot_runtime import (
    BearerTokenAuth,
    CopilotRuntime,
    DemoAdapter,
    ServiceUnavailableError,
    coordinator,
    thread_store,
)
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.threads.sqlite import SQLiteThreadStore
from tests.conftest import ServeRuntime, openai_runtime, run_input
from tests.hitl_support.postgres import postgres_schema
from tests.test_hostile_threads import store_options  # noqa: F401 (fixture)
from tests.test_trust_ownership import call

pytestmark = pytest.mark.timeout(60)


async def test_a_run_asked_for_while_its_thread_is_deleted_is_busy(
        store_options: dict[str, Any], serve_runtime: ServeRuntime) -> None:  # noqa: F811
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), **store_options)
    async with serve_runtime(runtime) as served:
        status, _, _ = await call(served, "POST", "/agent/default/run", None,
                                  run_input("first", thread="t", run="r1"))
        assert status == 200
        forgetting, forgot = asyncio.Event(), asyncio.Event()
        forget = runtime.forget_thread

        async def slow_forget(thread_id: str, *, strict: bool = False) -> None:
            forgetting.set()
            await forgot.wait()
            await forget(thread_id, strict=strict)

        runtime.forget_thread = slow_forget  # type: ignore[method-assign]
        deleting = asyncio.ensure_future(call(served, "DELETE", "/threads/t", None))
        try:
            await asyncio.wait_for(forgetting.wait(), 10)
            status, body, _ = await call(served, "POST", "/agent/default/run", None,
                                         run_input("meanwhile", thread="t", run="r2"))
        finally:
            forgot.set()
        assert status == 409, body
        assert orjson.loads(body)["code"] == "THREAD_BUSY"
        status, body, _ = await deleting
        assert (status, orjson.loads(body)) == (200, {"deleted": True, "id": "t"})
        assert await runtime.store.summary("t") is None
        # Deleted, the thread takes runs again (the delete let go of it).
        status, _, _ = await call(served, "POST", "/agent/default/run", None,
                                  run_input("again", thread="t", run="r3"))
        assert status == 200
        record = await runtime.store.get("t")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r3"]


async def test_a_run_asked_for_on_another_worker_while_the_thread_is_deleted_is_busy(
        serve_runtime: ServeRuntime) -> None:
    """Across workers sharing PostgreSQL: the delete holds the thread's lease."""
    with postgres_schema() as url:
        def runtime() -> CopilotRuntime:
            return CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                                  thread_store=thread_store(url), coordinator=coordinator(url))

        one, two = runtime(), runtime()
        async with serve_runtime(one) as first, serve_runtime(two) as second:
            status, _, _ = await call(first, "POST", "/agent/default/run", None,
                                      run_input("first", thread="t", run="r1"))
            assert status == 200
            forgetting, forgot = asyncio.Event(), asyncio.Event()
            forget = one.forget_thread

            async def slow_forget(thread_id: str, *, strict: bool = False) -> None:
                forgetting.set()
                await forgot.wait()
                await forget(thread_id, strict=strict)

            one.forget_thread = slow_forget  # type: ignore[method-assign]
            deleting = asyncio.ensure_future(call(first, "DELETE", "/threads/t", None))
            try:
                await asyncio.wait_for(forgetting.wait(), 10)
                status, body, _ = await call(second, "POST", "/agent/default/run", None,
                                             run_input("meanwhile", thread="t", run="r2"))
                # Nor is the delete a run another worker could stop.
                stopped = await call(second, "POST", "/agent/default/stop/t", None)
            finally:
                forgot.set()
            assert status == 409, body
            assert (stopped[0], orjson.loads(stopped[1])["stopped"]) == (200, False)
            status, body, _ = await deleting
            assert status == 200, body
            assert await two.store.summary("t") is None
            status, _, _ = await call(second, "POST", "/agent/default/run", None,
                                      run_input("again", thread="t", run="r3"))
            assert status == 200


async def test_a_delete_while_another_worker_deletes_the_thread_waits_for_it(
        serve_runtime: ServeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a second DELETE that found another worker's delete holding the thread went on
    without holding it: answered "deleted" while the first was still at it, and, slower,
    deleted a run begun on the thread once the first had ended. Now it waits for the first
    (then finds the thread gone: a 404), and is busy (409) if that takes too long."""
    with postgres_schema() as url:
        def runtime() -> CopilotRuntime:
            return CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                                  thread_store=thread_store(url), coordinator=coordinator(url))

        one, two = runtime(), runtime()
        async with serve_runtime(one) as first, serve_runtime(two) as second:
            for thread in ("t", "u"):
                status, _, _ = await call(first, "POST", "/agent/default/run", None,
                                          run_input("first", thread=thread, run="r1"))
                assert status == 200
            forgetting, forgot = asyncio.Event(), asyncio.Event()
            forget = one.forget_thread
            forgotten_by_two: list[str] = []
            forget_two = two.forget_thread

            async def slow_forget(thread_id: str, *, strict: bool = False) -> None:
                forgetting.set()
                await forgot.wait()
                await forget(thread_id, strict=strict)

            async def noted_forget(thread_id: str, *, strict: bool = False) -> None:
                forgotten_by_two.append(thread_id)
                await forget_two(thread_id, strict=strict)

            one.forget_thread = slow_forget  # type: ignore[method-assign]
            two.forget_thread = noted_forget  # type: ignore[method-assign]
            # (its tries a second apart: a run begins between the first delete's end and
            # the waiting one's next try, every time)
            monkeypatch.setattr("copilot_runtime._runs._DELETE_TRIES_EVERY", 1.0)
            deleting = asyncio.ensure_future(call(first, "DELETE", "/threads/t", None))
            try:
                await asyncio.wait_for(forgetting.wait(), 10)
                again = asyncio.ensure_future(call(second, "DELETE", "/threads/t", None))
                await asyncio.sleep(0.5)
                assert not again.done()  # it waits, holding nothing, forgetting nothing
                assert forgotten_by_two == []
            finally:
                forgot.set()
            status, body, _ = await deleting
            assert (status, orjson.loads(body)) == (200, {"deleted": True, "id": "t"})
            # Deleted once, the thread takes runs again, and the delete that waited, which
            # was asked for the thread before, leaves the one begun since alone (before,
            # it deleted it, whoever's it was).
            status, _, _ = await call(first, "POST", "/agent/default/run", None,
                                      run_input("again", thread="t", run="r2"))
            assert status == 200
            status, body, _ = await again
            assert status == 404, body
            record = await two.store.get("t")
            assert record is not None
            assert [r.run_id for r in record.runs] == ["r2"]

            # A delete that holds the thread too long for the wait: busy, nothing deleted.
            monkeypatch.setattr("copilot_runtime._runs.DELETE_WAITS_FOR_DELETE", 0.3)
            forgetting.clear()
            forgot.clear()
            deleting = asyncio.ensure_future(call(first, "DELETE", "/threads/u", None))
            try:
                await asyncio.wait_for(forgetting.wait(), 10)
                status, body, _ = await call(second, "DELETE", "/threads/u", None)
            finally:
                forgot.set()
            assert status == 409, body
            assert orjson.loads(body)["code"] == "THREAD_BUSY"
            assert "u" not in forgotten_by_two
            status, body, _ = await deleting
            assert status == 200, body


@contextlib.contextmanager
def _held(path: Path) -> Iterator[None]:
    """Another connection holds the SQLite file's write lock meanwhile (a backup script's
    transaction)."""
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield
    finally:
        other.execute("ROLLBACK")
        other.close()


async def test_a_sqlite_file_held_by_another_connection_is_a_503_and_nothing_is_forgotten(
        tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    """Another connection holding the SQLite file's write lock (a backup script) held PATCH
    and DELETE 30 s, then answered 500 (`database is locked`, an "unhandled error"), and the
    DELETE had had the agents forget the thread it then kept. Now both answer 503 with
    Retry-After after the store's busy timeout, and the delete forgets nothing until the
    store can write."""
    path = tmp_path / "threads.db"
    store = SQLiteThreadStore(path, busy_timeout=0.2)
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store)
    forgotten: list[str] = []
    forget = runtime.forget_thread

    async def recorded_forget(thread_id: str, *, strict: bool = False) -> None:
        forgotten.append(thread_id)
        await forget(thread_id, strict=strict)

    runtime.forget_thread = recorded_forget  # type: ignore[method-assign]
    async with serve_runtime(runtime) as served:
        status, _, _ = await call(served, "POST", "/agent/default/run", None,
                                  run_input("first", thread="t", run="r1"))
        assert status == 200
        with _held(path):
            started = time.monotonic()
            answers = [await call(served, "PATCH", "/threads/t", None, {"name": "renamed"}),
                       await call(served, "DELETE", "/threads/t", None)]
            elapsed = time.monotonic() - started
        for status, body, headers in answers:
            assert status == 503, body
            assert orjson.loads(body)["code"] == "SERVICE_UNAVAILABLE"
            assert headers["Retry-After"] == "1"
        assert elapsed < 3
        assert forgotten == []
        record = await store.summary("t")
        assert record is not None
        assert record.name is None
        # The file free again, both go through.
        status, _, _ = await call(served, "PATCH", "/threads/t", None, {"name": "renamed"})
        assert status == 200
        status, _, _ = await call(served, "DELETE", "/threads/t", None)
        assert status == 200
        assert forgotten == ["t"]
        assert await store.summary("t") is None


async def test_a_run_ending_while_the_sqlite_file_is_held_is_stored_once_it_is_free(
        tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    """The store's shorter wait for the file gives up no run: one that ends while another
    connection holds the file is written once it is free (with SQLite's wait as short, the
    run was lost: "could not store run")."""
    path = tmp_path / "threads.db"
    store = SQLiteThreadStore(path, busy_timeout=0.2)
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store)
    async with serve_runtime(runtime) as served:
        status, _, _ = await call(served, "POST", "/agent/default/run", None,
                                  run_input("first", thread="t", run="r1"))
        assert status == 200
        with _held(path):
            running = asyncio.ensure_future(call(served, "POST", "/agent/default/run", None,
                                                 run_input("second", thread="t", run="r2")))
            await asyncio.sleep(0.6)  # its writes fail meanwhile
            assert not running.done()
        status, _, _ = await running
        assert status == 200
        record = await store.get("t")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r1", "r2"]


@contextlib.contextmanager
def _unwritable(store: SQLiteThreadStore, how: str) -> Iterator[None]:
    """The store's file cannot be written meanwhile: `"full"`, its disk full (SQLite may add
    no page: SQLITE_FULL), or `"read-only"` (SQLITE_READONLY)."""
    with store._lock:
        if how == "full":
            (pages,) = store._db.execute("PRAGMA page_count").fetchone()
            store._db.execute(f"PRAGMA max_page_count = {pages}")
        else:
            store._db.execute("PRAGMA query_only = ON")
    try:
        yield
    finally:
        with store._lock:
            store._db.execute("PRAGMA max_page_count = 1073741823")
            store._db.execute("PRAGMA query_only = OFF")


@pytest.mark.parametrize("how", ["full", "read-only"])
async def test_a_run_ending_while_the_sqlite_file_cannot_be_written_is_stored_once_it_can(
        tmp_path: Path, serve_runtime: ServeRuntime, how: str) -> None:
    """A full disk (or a file made read-only) dropped the run that ended meanwhile: streamed
    whole, logged "could not store run", never written, and its thread handed to the next
    run, which sent its positions again. Now it is written once the file can be, as a run
    ending while the file is held is, its thread busy until then."""
    store = SQLiteThreadStore(tmp_path / "threads.db", busy_timeout=0.2)
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store)
    failed = asyncio.Event()
    append_run = store.append_run

    async def observed(*args: Any, **kwargs: Any) -> None:
        try:
            await append_run(*args, **kwargs)
        except Exception:
            failed.set()
            raise

    store.append_run = observed  # type: ignore[method-assign]
    async with serve_runtime(runtime) as served:
        status, _, _ = await call(served, "POST", "/agent/default/run", None,
                                  run_input("first", thread="t", run="r1"))
        assert status == 200
        with _unwritable(store, how):
            running = asyncio.ensure_future(call(
                served, "POST", "/agent/default/run", None,
                run_input("x" * 20_000, thread="t", run="r2")))  # pages beyond the file's
            await asyncio.wait_for(failed.wait(), 10)
            status, body, _ = await call(served, "POST", "/agent/default/run", None,
                                         run_input("third", thread="t", run="r3"))
            assert status == 409, body
        status, _, _ = await running
        assert status == 200
        record = await store.get("t")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r1", "r2"]
        assert record.runs[1].first_position == record.runs[0].last_position + 1


async def test_a_delete_while_the_sqlite_file_cannot_be_written_is_a_503(
        tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    """A file that cannot be written (read-only here; a full disk alike) made PATCH and
    DELETE a 500 "unhandled error" without Retry-After; now a 503 with it, the thread
    kept, as for a file another connection holds."""
    store = SQLiteThreadStore(tmp_path / "threads.db", busy_timeout=0.2)
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store)
    async with serve_runtime(runtime) as served:
        status, _, _ = await call(served, "POST", "/agent/default/run", None,
                                  run_input("first", thread="t", run="r1"))
        assert status == 200
        with _unwritable(store, "read-only"):
            answers = [await call(served, "PATCH", "/threads/t", None, {"name": "renamed"}),
                       await call(served, "DELETE", "/threads/t", None)]
        for status, body, headers in answers:
            assert status == 503, body
            assert orjson.loads(body)["code"] == "SERVICE_UNAVAILABLE"
            assert headers["Retry-After"] == "1"
        assert await store.summary("t") is not None
        status, _, _ = await call(served, "DELETE", "/threads/t", None)
        assert status == 200
        assert await store.summary("t") is None


async def test_a_store_away_while_runs_stream_is_logged_now_and_then(
        tmp_path: Path, serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """Every running run writes its events every 200 ms: with the store away, each write
    logged its stack, five lines a second a run. An outage is logged at its 1st, 2nd, 4th,
    8th... failure in a row, without a stack; the run is stored once the store is back."""
    store = SQLiteThreadStore(tmp_path / "threads.db")
    away = True
    append_events = store.append_events

    async def failing(*args: Any, **kwargs: Any) -> None:
        if away:
            raise ServiceUnavailableError("The thread store cannot be reached")
        await append_events(*args, **kwargs)

    store.append_events = failing  # type: ignore[method-assign]
    runtime = openai_runtime(llm, thread_store=store)
    async with serve_runtime(runtime) as served:
        with structlog.testing.capture_logs() as logs:
            events = await served.run(run_input("slow:150 a b c d e f g h", thread="t"))
        away = False
        assert events[-1]["type"] == "RUN_FINISHED"
        record = await store.get("t")
        assert record is not None
        assert len(record.runs) == 1
    told = [e for e in logs if e["event"] == "could not write a running run's events"]
    assert 1 <= len(told) < 5, told
    assert [e["failures_in_a_row"] for e in told] == [1, 2, 4, 8][:len(told)]
    assert all("exc_info" not in e for e in told)


async def test_a_delete_whose_thread_another_user_began_again_since_its_check_is_a_404(
        serve_runtime: ServeRuntime) -> None:
    """Found by review: a DELETE checked the thread's owner, then, held up before it held
    the thread (a slow pool), deleted whatever thread of the id there was once it did: one
    another user had begun after a second delete of the owner's went through. Under the hold
    the thread must still be the caller's."""
    from tests.test_trust_ownership import ALICE, BOB, TOKENS

    with postgres_schema() as url:
        def runtime() -> CopilotRuntime:
            return CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                                  thread_store=thread_store(url), coordinator=coordinator(url),
                                  auth=BearerTokenAuth(TOKENS))

        one, two = runtime(), runtime()
        async with serve_runtime(one) as first, serve_runtime(two) as second:
            status, _, _ = await call(first, "POST", "/agent/default/run", ALICE,
                                      run_input("alice's", thread="t", run="a1"))
            assert status == 200
            checked, go = asyncio.Event(), asyncio.Event()
            delete = two.delete_thread

            async def held_up(thread_id: str, **options: Any) -> bool:
                checked.set()
                await go.wait()
                return await delete(thread_id, **options)

            two.delete_thread = held_up  # type: ignore[method-assign]
            late = asyncio.ensure_future(call(second, "DELETE", "/threads/t", ALICE))
            try:
                await asyncio.wait_for(checked.wait(), 10)  # (past its owner check)
                status, _, _ = await call(first, "DELETE", "/threads/t", ALICE)
                assert status == 200
                status, _, _ = await call(first, "POST", "/agent/default/run", BOB,
                                          run_input("bob's own", thread="t", run="b1"))
                assert status == 200
            finally:
                go.set()
            status, body, _ = await late
            assert status == 404, body
            status, body, _ = await call(first, "GET", "/threads/t/messages", BOB)
            assert status == 200, body


async def test_a_delete_whose_hold_lapsed_leaves_a_run_another_worker_began_since(
        serve_runtime: ServeRuntime) -> None:
    """Found with several workers: a DELETE whose statement was held up (its worker cut off
    from PostgreSQL and from the coordinator) past its lease went on once the partition
    healed, and deleted the run another worker had begun and finished on the thread
    meanwhile, answering 200 "deleted". Now the store deletes only the thread as the delete
    read it under its hold, and a delete whose hold lapsed is busy (409)."""
    from tests.conftest import poll

    with postgres_schema() as url:
        def runtime() -> CopilotRuntime:
            return CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                                  thread_store=thread_store(url),
                                  coordinator=coordinator(f"{url}&lease_ttl=1.5"))

        one, two = runtime(), runtime()
        async with serve_runtime(one) as first, serve_runtime(two) as second:
            status, _, _ = await call(second, "POST", "/agent/default/run", None,
                                      run_input("first", thread="t", run="r1"))
            assert status == 200
            reached, go = asyncio.Event(), asyncio.Event()
            delete = one.store.delete

            async def held_up(thread_id: str, **conditions: Any) -> bool:
                reached.set()
                await go.wait()
                return await delete(thread_id, **conditions)

            shared = one.runs.coordinator
            assert shared is not None
            renew = shared._renew  # type: ignore[attr-defined]

            async def cut_off(leases: Any) -> set[str]:
                await asyncio.Event().wait()
                raise AssertionError("never")

            one.store.delete = held_up  # type: ignore[method-assign]
            deleting = asyncio.ensure_future(call(first, "DELETE", "/threads/t", None))
            try:
                await asyncio.wait_for(reached.wait(), 10)
                shared._renew = cut_off  # type: ignore[attr-defined]
                async for _ in poll(15, 0.2):  # busy until the delete's lease expires
                    status, body, _ = await call(second, "POST", "/agent/default/run", None,
                                                 run_input("meanwhile", thread="t", run="r2"))
                    if status != 409:
                        break
                assert status == 200, body
            finally:
                shared._renew = renew  # type: ignore[attr-defined]
                go.set()
            status, body, _ = await deleting
            assert status == 409, body
            assert orjson.loads(body)["code"] == "THREAD_BUSY"
            record = await two.store.get("t")
            assert record is not None
            assert [r.run_id for r in record.runs] == ["r1", "r2"]


@pytest.mark.parametrize("deleted_by", ["DELETE", "retention"])
async def test_a_stalled_workers_late_writes_never_bring_a_deleted_thread_back(
        serve_runtime: ServeRuntime, deleted_by: str) -> None:
    """Found with several workers: a worker stalled mid-run (SIGSTOP) past its lease;
    another deleted the thread (200, then 404), or its retention sweep did; the stalled
    worker came back and its late writes (the run's next events, its end, LEASE_LOST) made
    the thread again, the deleted run in it. A late write of a run that began before the
    delete writes nothing now."""
    from tests.conftest import poll

    with postgres_schema() as url:
        def runtime(**options: Any) -> CopilotRuntime:
            return CopilotRuntime(service_adapter=DemoAdapter(delay=0.5),
                                  thread_store=thread_store(url),
                                  coordinator=coordinator(f"{url}&lease_ttl=1.5"), **options)

        one = runtime()
        two = runtime() if deleted_by == "DELETE" else runtime(thread_retention_seconds=1.0)
        two.retention_sweep_every = 0.2
        async with serve_runtime(one) as first, serve_runtime(two) as second:
            running = asyncio.ensure_future(call(
                first, "POST", "/agent/default/run", None,
                run_input("tell me a long story about the sea", thread="t", run="r1")))
            async for _ in poll(10, 0.05):
                record = await two.store.summary("t")
                if record is not None and record.open_run == "r1":
                    break
            # The first worker stalls: its writes held back, its lease no longer renewed.
            go = asyncio.Event()
            store: Any = one.store
            originals = {name: getattr(store, name) for name in ("append_events", "append_run")}

            def held_back(write: Any) -> Any:
                async def late(*args: Any, **options: Any) -> None:
                    await go.wait()
                    await write(*args, **options)
                return late

            for name, write in originals.items():
                setattr(store, name, held_back(write))
            shared = one.runs.coordinator
            assert shared is not None
            renew = shared._renew  # type: ignore[attr-defined]

            async def cut_off(leases: Any) -> set[str]:
                await asyncio.Event().wait()
                raise AssertionError("never")

            shared._renew = cut_off  # type: ignore[attr-defined]
            try:
                async for _ in poll(15, 0.2):  # busy until the run's lease expires
                    if deleted_by == "DELETE":
                        status, body, _ = await call(second, "DELETE", "/threads/t", None)
                        if status != 409:
                            break
                    elif await two.store.summary("t") is None:
                        # (swept once: a thread its late writes brought back must stay)
                        assert two._retention is not None
                        await two._retention.aclose()
                        status, body = 200, b"swept"
                        break
                assert status == 200, body
            finally:
                shared._renew = renew  # type: ignore[attr-defined]
                go.set()
            await asyncio.wait_for(running, 30)
            assert await _written(one)
            status, body, _ = await call(second, "GET", "/threads/t/messages", None)
            assert status == 404, body
            assert "t" not in [r.thread_id for r in await two.store.list()]


async def _written(runtime: CopilotRuntime) -> bool:
    """Once the runtime's runs have ended and their writes are done."""
    from tests.conftest import poll

    async for _ in poll(10, 0.05):
        if not runtime.runs.active:
            await asyncio.sleep(0.5)  # (a last write on its way)
            return True
    return False
