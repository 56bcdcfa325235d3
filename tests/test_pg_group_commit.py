"""Group commit of finished runs in the PostgreSQL store: runs that finish while a write is in
flight are written together in one statement, each caller returning once it committed; a bad
run fails only its own caller, and a cancelled caller loses nobody's run. Threads' heads asked
for while a read is in flight are read together in one query, the same way."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from copilot_runtime import ServiceUnavailableError
from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events
from copilot_runtime.threads import StoredRun
from copilot_runtime.threads.postgres import PostgresThreadStore
from tests.hitl_support.postgres import SERVER


@pytest.fixture
async def store() -> AsyncIterator[PostgresThreadStore]:
    schema = f"group_{uuid.uuid4().hex[:10]}"
    made = PostgresThreadStore(SERVER, schema=schema, max_size=4)
    await made.open()
    try:
        yield made
    finally:
        await made.aclose()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _count_batches(writer: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every batch `writer` (a store's group writer) writes from now on."""
    sizes: list[int] = []
    write = writer._write_batch

    async def counted(batch: list[Any]) -> None:
        sizes.append(len(batch))
        await write(batch)

    monkeypatch.setattr(writer, "_write_batch", counted)
    return sizes


@pytest.fixture
def batches(store: PostgresThreadStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every batch of finished runs the store writes."""
    return _count_batches(store._finished, monkeypatch)


async def _in_flight(store: PostgresThreadStore, thread: str, run: StoredRun
                     ) -> asyncio.Future[None]:
    """A run whose write has begun: what finishes next waits for it."""
    task = asyncio.ensure_future(_finish(store, thread, run))
    await asyncio.sleep(0)  # it has begun (its reply takes a round trip, not one loop turn)
    assert store._finished._writing
    assert not store._finished._queued
    return task


def _run(thread: str, run: str, first: int = 0, last: int | None = None) -> StoredRun:
    events = [ev.run_started(thread, run, {"threadId": thread, "runId": run, "messages": [
                  {"id": f"u-{run}", "role": "user", "content": "hi"}]}),
              ev.text_message_start(f"m-{run}"), ev.text_message_content(f"m-{run}", run),
              ev.text_message_end(f"m-{run}"), ev.run_finished(thread, run)]
    return StoredRun(run, compact_events(events), 1.0, 0, first,
                     first + len(events) - 1 if last is None else last)


async def _finish(store: PostgresThreadStore, thread: str, run: StoredRun) -> None:
    await store.append_run(thread, "default", run, [f"u-{run.run_id}", f"m-{run.run_id}"])


async def test_concurrent_runs_are_batched_and_all_stored(
        store: PostgresThreadStore, batches: list[int]) -> None:
    threads = [f"t{i}" for i in range(20)]
    # Three runs per thread, queued in order: a thread's runs keep that order in a batch.
    runs = [(t, _run(t, f"{t}-r{n}", 5 * n)) for n in range(3) for t in threads]
    # The first is written at once; the others queue behind it, batched one run per thread
    # (a thread's later runs wait for the next batch).
    await asyncio.gather(*(_finish(store, t, r) for t, r in runs))
    assert batches == [20, 20, 19]
    for t in threads:
        record = await store.get(t)
        assert record is not None
        assert [r.run_id for r in record.runs] == [f"{t}-r0", f"{t}-r1", f"{t}-r2"]
        assert record.next_position == 15
        assert f"m-{t}-r2" in record.message_ids


async def test_a_batch_holds_at_most_32_runs(store: PostgresThreadStore,
                                             batches: list[int]) -> None:
    first = await _in_flight(store, "big", _run("big", "first"))
    await asyncio.gather(first, *(_finish(store, f"b{i}", _run(f"b{i}", "r")) for i in range(40)))
    assert batches == [32, 8]
    assert all([await store.get(f"b{i}") is not None for i in range(40)])


async def test_a_lone_run_is_written_alone(store: PostgresThreadStore,
                                           batches: list[int]) -> None:
    for n in range(3):
        await _finish(store, "lone", _run("lone", f"r{n}", 5 * n))
    assert batches == []  # each written at once by its caller
    record = await store.get("lone")
    assert record is not None
    assert len(record.runs) == 3


async def test_a_bad_run_fails_only_its_caller(store: PostgresThreadStore,
                                               batches: list[int]) -> None:
    # Its next position overflows a bigint: the server refuses it, and the whole batch.
    bad = _run("bad", "bad-run", 0, 2**63 - 1)
    good = [(f"g{i}", _run(f"g{i}", f"g{i}-run")) for i in range(8)]
    first = await _in_flight(store, "first", _run("first", "first-run"))
    results = await asyncio.gather(first, *(_finish(store, t, r) for t, r in good[:4]),
                                   _finish(store, "bad", bad),
                                   *(_finish(store, t, r) for t, r in good[4:]),
                                   return_exceptions=True)
    assert batches[:1] == [9]
    assert isinstance(results[5], psycopg.errors.NumericValueOutOfRange)
    assert [r for i, r in enumerate(results) if i != 5] == [None] * 9
    for t, r in [("first", _run("first", "first-run")), *good]:
        record = await store.get(t)
        assert record is not None
        assert [s.run_id for s in record.runs] == [r.run_id]
    assert await store.get("bad") is None
    # The store goes on writing batches afterwards.
    await asyncio.gather(*(_finish(store, f"after{i}", _run(f"after{i}", "r"))
                           for i in range(3)))
    assert await store.get("after2") is not None


async def test_each_caller_gets_its_own_error(store: PostgresThreadStore) -> None:
    results = await asyncio.gather(
        await _in_flight(store, "first", _run("first", "first-run")),
        *(_finish(store, f"bad{i}", _run(f"bad{i}", "r", 0, 2**63 - 1)) for i in range(2)),
        return_exceptions=True)
    assert results[0] is None
    assert all(isinstance(e, psycopg.errors.NumericValueOutOfRange) for e in results[1:])
    assert results[1] is not results[2]


async def test_a_cancelled_caller_loses_no_run(store: PostgresThreadStore,
                                               batches: list[int]) -> None:
    tasks = [await _in_flight(store, "c0", _run("c0", "r"))]
    tasks += [asyncio.ensure_future(_finish(store, f"c{i}", _run(f"c{i}", "r")))
              for i in range(1, 6)]
    await asyncio.sleep(0)  # all queued while the first is being written
    tasks[3].cancel()
    tasks[0].cancel()  # its write was in flight: it is abandoned, the queued ones are not
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert isinstance(results[3], asyncio.CancelledError)
    assert batches == [5]
    # A queued run does not depend on its caller still waiting.
    for i in range(1, 6):
        record = await store.get(f"c{i}")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r"]


async def test_closing_writes_what_is_queued(store: PostgresThreadStore) -> None:
    first = await _in_flight(store, "q0", _run("q0", "r"))
    tasks = [asyncio.ensure_future(_finish(store, f"q{i}", _run(f"q{i}", "r")))
             for i in range(1, 5)]
    await asyncio.sleep(0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await store.aclose()
    assert first.done()
    with psycopg.connect(SERVER, autocommit=True) as conn:
        count = conn.execute(f'SELECT count(*) FROM "{store.schema}".runs').fetchone()
    assert count == (5,)


# -- heads read together -------------------------------------------------------------------


@pytest.fixture
def reads(store: PostgresThreadStore, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The thread ids of every query that reads threads' heads."""
    asked: list[list[str]] = []
    read = store._summaries

    async def counted(thread_ids: list[str]) -> dict[str, tuple[Any, ...]]:
        asked.append(sorted(thread_ids))
        return await read(thread_ids)

    monkeypatch.setattr(store, "_summaries", counted)
    return asked


async def test_heads_asked_for_meanwhile_are_read_in_one_query(
        store: PostgresThreadStore, reads: list[list[str]]) -> None:
    for t in ("h1", "h2"):
        await _finish(store, t, _run(t, f"{t}-r"))
    first = asyncio.ensure_future(store.summary("h1"))
    await asyncio.sleep(0)  # its query is in flight
    results = await asyncio.gather(first, store.summary("h2"), store.summary("h2"),
                                   store.summary("missing"), store.summary("h1"))
    assert reads == [["h1"], ["h1", "h2", "missing"]]
    h1, h2, h2_again, missing, h1_again = results
    assert missing is None
    assert h1 is not None
    assert h1_again is not None
    assert h2 is not None
    assert h2_again is not None
    assert (h1.next_position, h1.message_ids) == (5, {"u-h1-r", "m-h1-r"})
    assert h2.message_ids == {"u-h2-r", "m-h2-r"}
    # Each caller gets a record of its own (a run's start keeps and extends its set).
    assert h2 is not h2_again
    assert h2.message_ids is not h2_again.message_ids


async def test_a_cancelled_reader_does_not_stop_the_others(
        store: PostgresThreadStore, reads: list[list[str]]) -> None:
    await _finish(store, "c1", _run("c1", "r"))
    first = asyncio.ensure_future(store.summary("c1"))
    await asyncio.sleep(0)
    waiting = [asyncio.ensure_future(store.summary("c1")) for _ in range(3)]
    await asyncio.sleep(0)
    first.cancel()
    waiting[1].cancel()
    results = await asyncio.gather(first, *waiting, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert isinstance(results[2], asyncio.CancelledError)
    assert all(r is not None and r.thread_id == "c1" for r in (results[1], results[3]))
    assert await store.summary("c1") is not None  # and the store reads on


async def test_a_failed_read_fails_its_callers_only(
        store: PostgresThreadStore, monkeypatch: pytest.MonkeyPatch) -> None:
    await _finish(store, "f1", _run("f1", "r"))
    read = store._summaries
    calls = 0

    async def second_fails(thread_ids: list[str]) -> dict[str, tuple[Any, ...]]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise psycopg.OperationalError("connection lost")
        return await read(thread_ids)

    monkeypatch.setattr(store, "_summaries", second_fails)
    first = asyncio.ensure_future(store.summary("f1"))
    await asyncio.sleep(0)
    results = await asyncio.gather(first, store.summary("f1"), store.summary("x"),
                                   return_exceptions=True)
    assert results[0] is not None
    assert not isinstance(results[0], BaseException)
    for failed in results[1:]:
        assert isinstance(failed, ServiceUnavailableError)
        assert isinstance(failed.__cause__, psycopg.OperationalError)
    assert not store._head_reads._busy
    assert await store.summary("f1") is not None


def _numbered(query: bytes) -> str:
    """`query` with its `%b` placeholders numbered, to PREPARE it by hand."""
    import re

    count = 0

    def next_number(_: re.Match[str]) -> str:
        nonlocal count
        count += 1
        return f"${count}"

    return re.sub("%b", next_number, query.decode())


async def test_plans_made_on_empty_tables_scan_no_table(store: PostgresThreadStore) -> None:
    """The store's statements are planned once per connection, on whatever the tables hold
    then: made on a new deployment's empty tables, a plan that scans a whole table would
    stay the plan as they grow (each run's write slower than the one before)."""
    from copilot_runtime.threads.postgres import _APPEND_EVENTS, _FINISH_RUNS, _SUMMARIES

    async with store._pool.connection() as conn:  # configured as the store's own
        cursor = psycopg.AsyncClientCursor(conn)
        plans = []
        for name, query, args in (
                # (a run that left a state: `{}`)
                ("finish", _FINISH_RUNS, "'{t,r,1,2,0,5,a,NULL,NULL,x,0,5}'::text[], "
                                         "'{\\\\x5b5d,\\\\x5b5d,\\\\x7b7d}'::bytea[], "
                                         "'{t,m}'::text[]"),
                ("heads", _SUMMARIES, "'{t}'::text[], '{t}'::text[]"),
                ("running", _APPEND_EVENTS, "'{t,r,1,0,3,a,NULL,NULL,x}'::text[], "
                                            "'{\\\\x5b5d}'::bytea[]")):
            await cursor.execute(f"PREPARE {name} AS {_numbered(query)}".encode())
            await conn.execute("BEGIN")
            await cursor.execute(f"EXPLAIN EXECUTE {name}({args})".encode())
            plans.append("\n".join(row[0] for row in await cursor.fetchall()))
            await conn.execute("ROLLBACK")
    for plan in plans:
        assert "Seq Scan" not in plan, plan
        assert not _whole_index_scans(plan), plan


def _whole_index_scans(plan: str) -> list[str]:
    """The plan's index scans without an index condition: each reads the whole index (the
    fence of finished runs, planned as an anti-join on empty tables, did, for every batch)."""
    lines = plan.splitlines()
    whole = []
    for number, line in enumerate(lines):
        if "Index Scan using" not in line and "Index Only Scan" not in line:
            continue
        depth = len(line) - len(line.lstrip())
        details = []
        for following in lines[number + 1:]:
            if "->" in following or len(following) - len(following.lstrip()) <= depth:
                break
            details.append(following)
        if not any("Index Cond:" in detail for detail in details):
            whole.append(line.strip())
    return whole


async def _finish_plan(store: PostgresThreadStore, thread: str, run: str,
                       settings: tuple[str, ...] = ()) -> tuple[str, int]:
    """The plan the store's finished-runs statement runs for `thread`'s open run `run`,
    which left a state (rolled back; `settings` made first, for the transaction), and the
    buffers it touched."""
    import re

    from copilot_runtime.threads.postgres import _FINISH_RUNS

    args = (f"'{{{thread},{run},1,2,0,5,a,NULL,NULL,x,6,6}}'::text[], "
            "'{\\\\x5b5d,\\\\x5b5d,\\\\x7b7d}'::bytea[], '{}'::text[]")
    async with store._pool.connection() as conn:  # configured as the store's own
        cursor = psycopg.AsyncClientCursor(conn)
        await cursor.execute(f"PREPARE finish AS {_numbered(_FINISH_RUNS)}".encode())
        await conn.execute("BEGIN")
        for setting in settings:
            await conn.execute(f"SET LOCAL {setting}".encode())
        await cursor.execute(
            f"EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) EXECUTE finish({args})".encode())
        plan = "\n".join(row[0] for row in await cursor.fetchall())
        await conn.execute("ROLLBACK")
        await conn.execute("DEALLOCATE finish")
    # Every node's buffers (those of its children included: counted again, as both runs are),
    # not the planner's (reading the catalogs: as many as it happens to miss in its caches).
    touched = sum(int(n) for n in re.findall(r"shared hit=(\d+)",
                                             plan.split("\nPlanning:")[0]))
    return plan, touched


async def test_finding_an_open_run_costs_the_same_after_thousands_of_runs(
        store: PostgresThreadStore) -> None:
    """A run written while it streamed is looked up by its thread and id when it ends. Each
    such run leaves dead index entries behind until the table is vacuumed (never, here): the
    lookup must not read them all (it read the open-runs index whole: 1 ms per run after
    5,000 runs)."""
    async with store._pool.connection() as conn:
        for table in ("runs", "run_events"):
            await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)".encode())

    async def streamed_then_finished(count: int, prefix: str) -> None:
        for i in range(count):
            thread = f"{prefix}{i}"
            await store.append_events(thread, "default", "r", 1.0, 0, [])
        await asyncio.gather(*(_finish(store, f"{prefix}{i}", _run(f"{prefix}{i}", "r"))
                               for i in range(count)))

    await streamed_then_finished(20, "a")
    await store.append_events("probe", "default", "r", 1.0, 0, [])
    _, before = await _finish_plan(store, "probe", "r")
    await streamed_then_finished(1500, "b")
    for _ in range(40):
        plan, after = await _finish_plan(store, "probe", "r")
        if after < before * 1.5:
            break
        # A snapshot older than the dead entries, held elsewhere in the database (another
        # test's long statement), keeps a scan from marking them dead: it reads them until
        # that snapshot ends. The index on the flag read them all, however long one waited.
        await asyncio.sleep(0.25)
    assert after < before * 1.5, plan  # the index on the flag: 88 -> 241
    for line in plan.splitlines():
        assert not any(word in line for word in ("Bitmap", "Hash Join", "Merge Join",
                                                 "Hash Anti Join", "Seq Scan")), plan
    assert await store.open_runs() == [("probe", "r")]


async def test_the_stores_statements_are_never_compiled(store: PostgresThreadStore) -> None:
    """Planned once for a batch of a thousand runs, the finished-runs statement's estimate
    passes the JIT's threshold once the tables have grown: compiling it took 20-50 ms each
    time (a stop across workers went from 5 to 40 ms)."""
    with psycopg.connect(SERVER, autocommit=True) as conn:
        available = conn.execute("SELECT pg_jit_available()").fetchone()
    if not available or not available[0]:
        pytest.skip("this PostgreSQL has no JIT")
    await store.append_events("probe", "default", "r", 1.0, 0, [])
    # Every plan costs more than these thresholds: compiled, were JIT on.
    plan, _ = await _finish_plan(store, "probe", "r",
                                 ("jit_above_cost = 0", "jit_optimize_above_cost = 0"))
    assert "JIT" not in plan, plan


async def test_raw_events_are_deleted_once_their_retention_ended(
        store: PostgresThreadStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw events (kept for exact resumes) go `raw_retention` seconds after their run ended,
    those written while it streamed included; a running run's stay."""
    from copilot_runtime.threads import postgres

    def streamed(thread: str, texts: list[str]) -> list[ev.Event]:
        return [ev.run_started(thread, "r", {"threadId": thread, "runId": "r"}),
                ev.text_message_start(f"m-{thread}"),
                *(ev.text_message_content(f"m-{thread}", t) for t in texts)]

    # An ended run whose raw events were written in three parts (two as it streamed), a run
    # still streaming, and one closed as interrupted.
    ended = [*streamed("ended", ["a", "b", "c"]), ev.text_message_end("m-ended"),
             ev.run_finished("ended", "r")]
    await store.append_events("ended", "default", "r", 1.0, 0, ended[:3])
    await store.append_events("ended", "default", "r", 1.0, 3, ended[3:5])
    await store.append_run("ended", "default", StoredRun(
        "r", compact_events(ended), 1.0, 0, 0, len(ended) - 1), ["m-ended"],
        raw_first=5, raw=ended[5:])
    await store.append_events("live", "default", "r", 1.0, 0, streamed("live", ["x"]))
    await store.append_events("cut", "default", "r", 1.0, 0, streamed("cut", ["y"]))
    assert await store.close_interrupted("cut", "r")

    async def raw_rows() -> dict[str, int]:
        async with store._pool.connection() as conn:
            rows = await (await conn.execute(
                "SELECT thread_id, count(*) FROM run_events GROUP BY thread_id")).fetchall()
        return dict(rows)

    assert await raw_rows() == {"ended": 3, "live": 1, "cut": 2}
    assert [p for p, _ in await store.events_after("ended", 3)] == [4, 5, 6]
    # Retention over: the next finished run's write deletes them.
    store.raw_retention = 0.0
    monkeypatch.setattr(postgres, "_PRUNE_EVERY", 0.0)
    await _finish(store, "next", _run("next", "r"))
    assert await raw_rows() == {"live": 1}
    # The ended run is still whole, from its compacted form.
    record = await store.get("ended")
    assert record is not None
    assert [e["type"] for e in record.runs[0].events][-1] == "RUN_FINISHED"
    assert await store.events_after("ended", -1)


# -- running runs' events written together -------------------------------------------------


async def test_running_runs_events_asked_for_meanwhile_are_written_together(
        store: PostgresThreadStore, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = _count_batches(store._running, monkeypatch)

    def streamed(thread: str) -> list[ev.Event]:
        return [ev.run_started(thread, "r", {"threadId": thread, "runId": "r", "messages": [
                    {"id": f"u-{thread}", "role": "user", "content": f"hi {thread}"}]}),
                ev.text_message_start(f"m-{thread}"),
                ev.text_message_content(f"m-{thread}", "so far")]

    first = asyncio.ensure_future(store.append_events("s0", "default", "r", 1.0, 0,
                                                      streamed("s0")))
    await asyncio.sleep(0)
    assert store._running._writing
    threads = [f"s{i}" for i in range(1, 9)]
    await asyncio.gather(first, *(store.append_events(t, "default", "r", 1.0, 0, streamed(t))
                                  for t in threads),
                         store.append_events("opened", "default", "r", 1.0, 0, []))
    assert sizes == [9]
    assert sorted(await store.open_runs()) == sorted(
        [("opened", "r"), ("s0", "r"), *((t, "r") for t in threads)])
    for t in ["s0", *threads]:
        assert [(p, e) for p, e in await store.events_after(t, -1)] == list(
            enumerate(streamed(t)))
        head = await store.summary(t)
        assert head is not None
        assert (head.next_position, head.title) == (3, f"hi {t}")
    opened = await store.summary("opened")
    assert opened is not None
    assert opened.next_position == 0
    # The next events of a run go on where it stopped, and its end closes it.
    await store.append_events("s1", "default", "r", 1.0, 3,
                              [ev.text_message_content("m-s1", " and more")])
    assert [p for p, _ in await store.events_after("s1", 1)] == [2, 3]


# -- lanes: a connection of their own ------------------------------------------------------


async def test_a_lane_left_mid_query_starts_clean_next_time(store: PostgresThreadStore) -> None:
    lane = store._heads
    reading = asyncio.ensure_future(_sleep_on(lane))
    await asyncio.sleep(0.2)  # the query is running on the server
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await _finish(store, "after", _run("after", "r"))
    head = await store.summary("after")  # the lane connected again
    assert head is not None
    assert head.next_position == 5


def _terminate(pid: int) -> None:
    """End a server process (as a restart or an administrator does) and wait until it is gone
    and its connection closed (PostgreSQL runs on this machine: its process has exited; it
    leaves `pg_stat_activity` a moment before its socket closes)."""
    with psycopg.connect(SERVER, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    for _ in range(500):
        if not os.path.exists(f"/proc/{pid}"):
            return
        time.sleep(0.01)
    pytest.fail(f"backend {pid} did not end")


async def _backend_of(lane: Any) -> int:
    async with lane as cursor:
        await cursor.execute("SELECT pg_backend_pid()")
        row = await cursor.fetchone()
        assert row is not None
        return int(row[0])


async def test_a_lane_whose_connection_was_killed_connects_again(
        store: PostgresThreadStore) -> None:
    """A connection the server closed while it sat idle (a restart, an administrator) is
    found closed before a statement is sent on it: the call goes on a new connection and
    succeeds, a write included (sent on the dead one, whether it ran could not be told)."""
    await _finish(store, "k", _run("k", "r"))
    assert await store.summary("k") is not None
    killed = await _backend_of(store._heads)
    _terminate(killed)
    assert await store.summary("k") is not None
    assert await _backend_of(store._heads) != killed
    # The writers' lanes too.
    for lane in (store._finished.lane, store._running.lane):
        _terminate(await _backend_of(lane))
    await store.append_events("k3", "default", "r", 1.0, 0, [])
    await _finish(store, "k2", _run("k2", "r"))
    assert await store.summary("k2") is not None
    assert await store.open_runs() == [("k3", "r")]


async def test_a_lane_whose_connection_broke_mid_call_fails_that_call_only(
        store: PostgresThreadStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed while its statement runs: that call fails (503), the next one connects again."""
    await _finish(store, "k", _run("k", "r"))
    pid = await _backend_of(store._heads)

    async def killed_meanwhile(thread_ids: list[str]) -> dict[str, tuple[Any, ...]]:
        async with store._heads as cursor:
            await asyncio.gather(cursor.execute("SELECT pg_sleep(2)"),
                                 asyncio.to_thread(_terminate, pid))
        return {}

    read = store._summaries
    monkeypatch.setattr(store, "_summaries", killed_meanwhile)
    with pytest.raises(ServiceUnavailableError):
        await store.summary("k")
    monkeypatch.setattr(store, "_summaries", read)
    assert await store.summary("k") is not None


async def _sleep_on(lane: Any) -> None:
    async with lane as cursor:
        await cursor.execute("SELECT pg_sleep(5)")


async def test_a_server_without_autovacuum_is_pointed_out() -> None:
    """Every run leaves dead rows; a deployment whose PostgreSQL never vacuums is told so
    when the store opens (this machine's runs without autovacuum)."""
    from structlog.testing import capture_logs

    with psycopg.connect(SERVER, autocommit=True) as conn:
        setting = conn.execute("SHOW autovacuum").fetchone()
    schema = f"group_{uuid.uuid4().hex[:10]}"
    made = PostgresThreadStore(SERVER, schema=schema)
    try:
        with capture_logs() as logs:
            await made.open()
    finally:
        await made.aclose()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    told = [log for log in logs if "autovacuum off" in log["event"]]
    assert len(told) == (1 if setting == ("off",) else 0), logs
    assert all(log["log_level"] == "warning" and log["schema"] == schema for log in told)


def _breaking_once(real: Any, *, committed: bool) -> Any:
    """A write function whose first call loses its connection, after its statement committed
    or before it was sent."""
    calls = 0

    async def write(cursor: Any, batch: list[Any]) -> None:
        nonlocal calls
        calls += 1
        if calls > 1:
            await real(cursor, batch)
            return
        if committed:
            await real(cursor, batch)
        await asyncio.to_thread(_terminate, cursor.connection.info.backend_pid)
        await cursor.execute("SELECT 1")  # the connection is gone: OperationalError

    return write


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "not-sent"])
@pytest.mark.parametrize("opened", [True, False], ids=["opened", "short"])
async def test_a_write_whose_connection_broke_is_sent_again_and_stored_once(
        store: PostgresThreadStore, committed: bool, opened: bool) -> None:
    """Whether a statement whose connection broke had committed cannot be told: it is sent
    again on a new connection, and the run is stored once either way (the statements are
    idempotent), its running writes too."""
    from copilot_runtime.threads import postgres

    run = _run("b", "r")
    if opened:
        store._running._write = _breaking_once(postgres._append_events, committed=committed)
        await store.append_events("b", "default", "r", 1.0, 0, run.events[:2])
        assert await store.open_runs() == [("b", "r")]
    store._finished._write = _breaking_once(postgres._finish_runs, committed=committed)
    await _finish(store, "b", run)
    record = await store.get("b")
    assert record is not None
    assert [r.run_id for r in record.runs] == ["r"]
    assert record.runs[0].events == run.events
    assert record.next_position == run.last_position + 1
    assert await store.open_runs() == []
    # The thread's next run follows it, once.
    await _finish(store, "b", _run("b", "r2", first=record.next_position))
    record = await store.get("b")
    assert record is not None
    assert [r.run_id for r in record.runs] == ["r", "r2"]
