"""Every thread store behaves the same: memory, SQLite and the real PostgreSQL.

Positions, runs written while they stream, runs closed as interrupted, names, deletion,
pages, owners and migrations are checked against each store through the one interface.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from copilot_runtime import events as ev
from copilot_runtime import thread_store
from copilot_runtime._compaction import compact_events
from copilot_runtime.testing import verify_events
from copilot_runtime.threads import (
    INTERRUPTED_CODE,
    DurableThreadStore,
    InMemoryThreadStore,
    SQLiteThreadStore,
    StoredRun,
    ThreadOwner,
    ThreadStore,
)
from copilot_runtime.threads import base as threads_base
from copilot_runtime.threads import postgres as threads_postgres
from tests.hitl_support.postgres import SERVER, postgres_schema

KINDS = ["memory", "sqlite", "postgresql"]


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_schema() as url:
        yield url


@pytest.fixture(params=KINDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ThreadStore]:
    if request.param == "memory":
        made = thread_store("memory://")
    elif request.param == "sqlite":
        made = thread_store(f"sqlite:///{tmp_path}/threads.sqlite3")
    else:
        schema = f"store_{uuid.uuid4().hex[:10]}"
        made = thread_store(f"{SERVER}?schema={schema}")
    try:
        yield made
    finally:
        await made.aclose()
        if request.param == "postgresql":
            with psycopg.connect(SERVER, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _run(thread: str, run: str, text: str, user: str = "hello there") -> list[ev.Event]:
    return [
        ev.run_started(thread, run, {"threadId": thread, "runId": run, "messages": [
            {"id": f"u-{run}", "role": "user", "content": user}]}),
        ev.text_message_start(f"m-{run}"),
        *[ev.text_message_content(f"m-{run}", piece) for piece in text.split(" ")],
        ev.text_message_end(f"m-{run}"),
        ev.run_finished(thread, run),
    ]


def _stateful(thread: str, run: str, state: dict[str, Any]) -> list[ev.Event]:
    """A run that leaves `state` (a snapshot just before its end)."""
    events = _run(thread, run, "planned it")
    return [*events[:-1], ev.state_snapshot(state), events[-1]]


async def _finish(store: ThreadStore, thread: str, run: str, events: list[ev.Event],
                  first: int, created: float = 1.0, owner: ThreadOwner | None = None) -> None:
    compacted = compact_events(events)
    await store.append_run(thread, "default", StoredRun(
        run, compacted, created, 0, first, first + len(events) - 1),
        [f"u-{run}", f"m-{run}"], owner=owner)


async def _start(store: ThreadStore, thread: str, run: str, started: ev.Event, first: int,
                 created: float, owner: ThreadOwner | None = None) -> None:
    """A run's start, written as the runtime writes it once the run streams."""
    if isinstance(store, DurableThreadStore):
        await store.append_events(thread, "default", run, created, first, [started],
                                  owner=owner)
    else:
        assert isinstance(store, InMemoryThreadStore)
        await store.begin_run(thread, "default", created, first, started, owner=owner)


async def used_at(store: ThreadStore, at: float, *threads: str) -> None:
    """PostgreSQL stamps a thread's use by the database's clock (`updated_at`, see its
    `clock`), whatever time the write carried: set as if that clock had read `at` then.
    The other stores stamp the time the write carried, `at` in these tests."""
    if isinstance(store, threads_postgres.PostgresThreadStore):
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'UPDATE "{store.schema}".threads SET updated_at = %s '
                         "WHERE thread_id = ANY(%s)", (at, list(threads)))


def _durable(store: ThreadStore) -> DurableThreadStore:
    if not isinstance(store, DurableThreadStore):
        pytest.skip("the in-memory store keeps no running runs")
    return store


async def test_finished_runs_and_positions(store: ThreadStore) -> None:
    assert await store.get("t") is None
    assert await store.events_after("t", -1) == []
    one = _run("t", "r1", "a b c")
    await _finish(store, "t", "r1", one, 0)
    two = _run("t", "r2", "d e")
    await _finish(store, "t", "r2", two, len(one), created=2.0)
    record = await store.get("t")
    assert record is not None
    assert [r.run_id for r in record.runs] == ["r1", "r2"]
    assert record.next_position == len(one) + len(two)
    assert record.message_ids >= {"u-r1", "m-r1", "u-r2", "m-r2"}
    assert record.title == "hello there"
    summary = await store.summary("t")
    assert summary is not None
    assert (summary.next_position, summary.message_ids, summary.title) == (
        record.next_position, record.message_ids, record.title)
    assert await store.summary("nope") is None
    assert record.runs[0].first_position == 0
    assert record.runs[0].last_position == len(one) - 1
    everything = await store.events_after("t", -1)
    # Compacted runs: no positions inside, the run's last position on its last event.
    assert [p for p, _ in everything if p is not None] == [len(one) - 1,
                                                          len(one) + len(two) - 1]
    verify_events([e for _, e in everything][:len(compact_events(one))])
    after_first = await store.events_after("t", len(one) - 1)
    assert [e for _, e in after_first] == compact_events(two)
    assert await store.events_after("t", len(one) + len(two) - 1) == []


async def test_a_thread_whose_first_run_had_no_user_message_is_titled_by_a_later_one(
        store: ThreadStore) -> None:
    """The agent spoke first (a client starting it with no messages): the thread takes its
    title from the first later run that carries a user message, and keeps it after."""
    greeting = _run("t", "r1", "hi", user="")
    greeting[0]["input"]["messages"] = []
    await _finish(store, "t", "r1", greeting, 0)
    assert (await store.summary("t")).title == ""  # type: ignore[union-attr]
    asked = _run("t", "r2", "sure", user="Plan my trip")
    if isinstance(store, DurableThreadStore):  # streamed first, as a worker writes it
        await store.append_events("t", "default", "r2", 2.0, len(greeting), asked[:2])
    await _finish(store, "t", "r2", asked, len(greeting), created=2.0)
    await _finish(store, "t", "r3", _run("t", "r3", "ok", user="Something else"),
                  len(greeting) + len(asked), created=3.0)
    assert (await store.summary("t")).title == "Plan my trip"  # type: ignore[union-attr]
    assert [r.title for r in await store.list()] == ["Plan my trip"]


async def test_a_thread_exists_once_its_first_run_starts(store: ThreadStore) -> None:
    """Before: the in-memory store made a thread only when its first run ended, while the
    durable stores have it from the run's start: while that run streamed, lists left it
    out, its messages, state and rename were a 404 and GraphQL said it did not exist, on
    memory alone. Every store has it (agent, owner, title, times) from its first run's
    start now, and a name given meanwhile is kept; a later run's start updates it at once."""
    alice = ThreadOwner("alice", "acme")
    one = _run("t", "r1", "a b c", user="Plan my trip")
    await _start(store, "t", "r1", one[0], 0, 5.0, owner=alice)
    await used_at(store, 5.0, "t")
    for record in (await store.get("t"), await store.summary("t")):
        assert record is not None
        assert (record.agent_id, record.owner, record.title, record.name, record.runs) == (
            "default", alice, "Plan my trip", None, [])
        assert (record.created_at, record.updated_at, record.next_position) == (5.0, 5.0, 1)
        assert record.state is None
    assert [r.thread_id for r in await store.list(owner=alice)] == ["t"]
    assert [r.thread_id for r in await store.list(agent_id="default")] == ["t"]
    assert await store.rename("t", "Trip") is True
    await _finish(store, "t", "r1", one, 0, created=5.0, owner=alice)
    await used_at(store, 5.0, "t")
    record = await store.get("t")
    assert record is not None
    assert (record.name, record.title, record.owner) == ("Trip", "Plan my trip", alice)
    assert ([r.run_id for r in record.runs], record.next_position) == (["r1"], len(one))
    assert (record.created_at, record.updated_at) == (5.0, 5.0)

    await _finish(store, "u", "r1", _run("u", "r1", "x"), 0, created=6.0, owner=alice)
    await used_at(store, 6.0, "u")
    await _start(store, "t", "r2", _run("t", "r2", "d")[0], len(one), 7.0, owner=alice)
    await used_at(store, 7.0, "t")
    assert [(r.thread_id, r.updated_at) for r in await store.list()] == [
        ("t", 7.0), ("u", 6.0)]
    record = await store.summary("t")
    assert record is not None
    assert (record.created_at, record.name, record.next_position) == (5.0, "Trip", len(one) + 1)


async def test_list_pages_names_and_delete(store: ThreadStore) -> None:
    alice, bob = ThreadOwner("alice"), ThreadOwner("bob", "acme")
    for index in range(5):
        await _finish(store, f"t{index}", "r", _run(f"t{index}", "r", "x"), 0,
                      created=10.0 + index, owner=alice if index % 2 == 0 else bob)
    assert [r.thread_id for r in await store.list()] == ["t4", "t3", "t2", "t1", "t0"]
    assert [r.thread_id for r in await store.list(limit=2, offset=2)] == ["t2", "t1"]
    assert [r.thread_id for r in await store.list(owner=alice)] == ["t4", "t2", "t0"]
    assert [r.thread_id for r in await store.list(owner=bob)] == ["t3", "t1"]
    assert await store.list(owner=ThreadOwner("bob")) == []
    assert await store.list(agent_id="other") == []
    assert await store.rename("t3", "Plans") is True
    assert await store.rename("nope", "x") is False
    listed = {r.thread_id: r for r in await store.list()}
    assert listed["t3"].name == "Plans"
    assert listed["t2"].name is None
    assert listed["t3"].title == "hello there"
    assert listed["t3"].owner == bob
    assert await store.delete("t3") is True
    assert await store.delete("t3") is False
    assert await store.get("t3") is None
    assert await store.events_after("t3", -1) == []
    assert [r.thread_id for r in await store.list()] == ["t4", "t2", "t1", "t0"]


async def test_a_rename_on_condition_of_its_owner(store: ThreadStore) -> None:
    """Before: `rename` renamed by id alone, so a PATCH whose owner check passed renamed the
    thread another principal began under the id after its owner deleted it. With `owner`,
    only a thread of that owner (tenant included) is renamed, checked as it is; on every
    store."""
    alice, bob = ThreadOwner("alice", "acme"), ThreadOwner("bob")
    await _finish(store, "bobs", "r", _run("bobs", "r", "x"), 0, owner=bob)
    await _finish(store, "nobodys", "r", _run("nobodys", "r", "x"), 0)
    assert await store.rename("bobs", "Mine", owner=alice) is False
    assert await store.rename("bobs", "Mine", owner=ThreadOwner("bob", "acme")) is False
    assert await store.rename("nobodys", "Mine", owner=alice) is False
    assert await store.rename("nope", "Mine", owner=alice) is False
    assert {r.thread_id: r.name for r in await store.list()} == {"bobs": None, "nobodys": None}
    assert await store.rename("bobs", "Plans", owner=bob) is True
    assert await store.rename("nobodys", "Notes") is True  # no condition: any thread
    assert {r.thread_id: r.name for r in await store.list()} == {
        "bobs": "Plans", "nobodys": "Notes"}


async def test_archived_threads_and_the_lists_that_leave_them_out(store: ThreadStore) -> None:
    """Before: no store kept an archived flag, so `@copilotkit/core`'s archive could not be
    served. Every store keeps it now (a run on the thread leaves it archived, a thread made
    again after a delete is not); `list(include_archived=False)` leaves archived threads
    out, its pages exact; `archive(owner=)` changes only a thread of that owner, as
    `rename`."""
    alice, bob = ThreadOwner("alice", "acme"), ThreadOwner("bob")
    for index in range(6):
        await _finish(store, f"t{index}", "r", _run(f"t{index}", "r", "x"), 0,
                      created=10.0 + index, owner=alice if index % 2 == 0 else bob)
    assert await store.archive("t3") is True
    assert await store.archive("nope") is False
    assert await store.archive("t2", owner=bob) is False
    assert await store.archive("t2", owner=ThreadOwner("alice")) is False
    assert await store.archive("t2", owner=alice) is True
    assert await store.archive("t5", True) is True
    for record in (await store.get("t3"), await store.summary("t3")):
        assert record is not None
        assert record.archived is True
    assert (await store.summary("t4")).archived is False  # type: ignore[union-attr]
    assert {r.thread_id: r.archived for r in await store.list()} == {
        "t5": True, "t4": False, "t3": True, "t2": True, "t1": False, "t0": False}
    assert [r.thread_id for r in await store.list(include_archived=False)] == [
        "t4", "t1", "t0"]
    assert [r.thread_id for r in await store.list(owner=alice, include_archived=False)] == [
        "t4", "t0"]
    assert [r.thread_id for r in await store.list(agent_id="default", limit=2, offset=1,
                                                  include_archived=False)] == ["t1", "t0"]
    # A page at a time from the last one's position (the keyset a cursor carries).
    walked: list[str] = []
    after = None
    while page := await store.list(limit=1, after=after, include_archived=False):
        walked.append(page[0].thread_id)
        after = (page[0].updated_at, page[0].thread_id)
    assert walked == ["t4", "t1", "t0"]
    assert await store.archive("t3", False, owner=bob) is True
    await _finish(store, "t5", "r2", _run("t5", "r2", "y"), 6, created=20.0)
    assert [r.thread_id for r in await store.list(include_archived=False)] == [
        "t4", "t3", "t1", "t0"]
    assert [(r.thread_id, r.archived) for r in await store.list(limit=1)] == [("t5", True)]
    assert await store.delete("t2") is True
    await _finish(store, "t2", "r", _run("t2", "r", "z"), await store.first_position("t2"),
                  created=30.0)
    assert (await store.summary("t2")).archived is False  # type: ignore[union-attr]


async def test_stale_threads_oldest_first(store: ThreadStore) -> None:
    """What a retention sweep deletes: the threads last updated before a time, oldest first
    (two updated at once in the order of their ids' code points, as `list` orders them)."""
    for thread, created in (("b", 20.0), ("a", 20.0), ("c", 10.0), ("d", 30.0)):
        await _finish(store, thread, "r", _run(thread, "r", "x"), 0, created=created)
        await used_at(store, created, thread)
    stale = store.stale_threads  # type: ignore[attr-defined]
    assert await stale(25.0) == ["c", "a", "b"]
    assert await stale(25.0, 2) == ["c", "a"]
    assert await stale(10.0) == []
    assert await store.delete("a") is True
    assert await stale(100.0) == ["c", "b", "d"]


async def test_a_delete_on_condition_keeps_a_thread_updated_since(store: ThreadStore) -> None:
    """Before: a retention sweep listed stale threads, then deleted each whatever had
    happened to it since: a thread its owner had used again meanwhile was deleted with its
    new run. `delete(updated_before=)` deletes only a thread still last updated before
    then, checked as the store deletes it; on every store."""
    first = _run("used", "r1", "a")
    await _finish(store, "used", "r1", first, 0, created=20.0)
    await _finish(store, "used", "r2", _run("used", "r2", "b"), len(first), created=40.0)
    await _finish(store, "old", "r1", _run("old", "r1", "c"), 0, created=20.0)
    await _finish(store, "edge", "r1", _run("edge", "r1", "d"), 0, created=25.0)
    for thread, at in (("used", 40.0), ("old", 20.0), ("edge", 25.0)):
        await used_at(store, at, thread)
    assert await store.delete("used", updated_before=25.0) is False
    record = await store.get("used")
    assert record is not None
    assert [r.run_id for r in record.runs] == ["r1", "r2"]
    assert await store.delete("edge", updated_before=25.0) is False  # as stale_threads(25)
    assert await store.delete("nope", updated_before=25.0) is False
    assert await store.delete("old", updated_before=25.0) is True
    assert await store.get("old") is None
    assert await store.first_position("old") == len(first)  # its positions kept, as ever
    assert [r.thread_id for r in await store.list()] == ["used", "edge"]
    assert await store.delete("used", updated_before=41.0) is True


async def test_a_thread_running_since_is_kept_by_a_delete_on_condition(store: ThreadStore
                                                                      ) -> None:
    """A thread whose new run is streaming (written as it streams) was updated by it."""
    first = _run("t", "r1", "a")
    await _finish(store, "t", "r1", first, 0, created=20.0)
    await used_at(store, 20.0, "t")
    await _start(store, "t", "r2", _run("t", "r2", "b")[0], len(first), 40.0)
    assert await store.delete("t", updated_before=25.0) is False
    summary = await store.summary("t")
    assert summary is not None
    assert summary.updated_at >= 40.0  # (PostgreSQL: its clock's time, now)


async def test_a_delete_on_condition_of_its_position_keeps_a_thread_written_since(
        store: ThreadStore) -> None:
    """Found with several workers: a delete whose hold on the thread lapsed (its worker
    stalled, its statement held up) still deleted it, with the run another worker had begun
    and finished on it since. `delete(next_position=)` deletes only a thread whose next
    position is still the one the delete read under its hold; on every store."""
    first = _run("t", "r1", "a")
    await _finish(store, "t", "r1", first, 0)
    read = await store.summary("t")
    assert read is not None
    assert read.next_position == len(first)
    second = _run("t", "r2", "b")
    await _finish(store, "t", "r2", second, len(first), created=2.0)
    assert await store.delete("t", next_position=len(first)) is False
    record = await store.get("t")
    assert record is not None
    assert [r.run_id for r in record.runs] == ["r1", "r2"]
    assert await store.delete("nope", next_position=0) is False
    assert await store.delete("t", next_position=len(first) + len(second)) is True
    assert await store.get("t") is None
    assert await store.first_position("t") == len(first) + len(second)


async def test_a_clock_stepped_back_never_makes_a_thread_older(store: ThreadStore) -> None:
    """Before: a run that started after the clock stepped back set the in-memory store's
    `updated_at` to its older start, while SQLite and PostgreSQL keep the latest: the thread
    was listed below the threads updated between the two runs, and stale to retention too
    early, on memory alone. Every store keeps the latest now. (PostgreSQL reads no
    worker's clock: `test_postgres_stamps_threads_by_its_own_clock`.)"""
    if isinstance(store, threads_postgres.PostgresThreadStore):
        pytest.skip("PostgreSQL stamps threads by its own clock")
    one = _run("t", "r1", "a")
    await _finish(store, "t", "r1", one, 0, created=30.0)
    await _finish(store, "u", "r1", _run("u", "r1", "b"), 0, created=20.0)
    await _finish(store, "t", "r2", _run("t", "r2", "c"), len(one), created=10.0)
    listed = await store.list()
    assert [(r.thread_id, r.updated_at) for r in listed] == [("t", 30.0), ("u", 20.0)]
    summary = await store.summary("t")
    assert summary is not None
    assert summary.updated_at == 30.0
    assert await store.stale_threads(25.0) == ["u"]  # type: ignore[attr-defined]


async def test_a_deleted_threads_positions_never_go_back(store: ThreadStore) -> None:
    """Before: a thread made again with a deleted one's id started its positions at 0 again,
    so a client still holding an event id of the old thread (`Last-Event-ID` 120) got
    nothing of the new one's first 120 events when it connected. Now the store keeps how far
    a deleted thread had got, and a new thread of that id starts there."""
    assert await store.first_position("t") == 0
    one = _run("t", "r1", "a b c")
    await _finish(store, "t", "r1", one, 0)
    assert await store.delete("t") is True
    assert await store.get("t") is None
    assert await store.first_position("t") == len(one)
    assert await store.first_position("other") == 0
    # The thread made again goes on from there; deleted again, from its own end.
    two = _run("t", "r2", "d")
    await _finish(store, "t", "r2", two, len(one), created=2.0)
    record = await store.get("t")
    assert record is not None
    assert ([r.run_id for r in record.runs], record.next_position) == (
        ["r2"], len(one) + len(two))
    assert await store.events_after("t", len(one) - 1) != []
    assert await store.delete("t") is True
    assert await store.first_position("t") == len(one) + len(two)
    # A delete of a thread that is not there changes nothing.
    assert await store.delete("t") is False
    assert await store.first_position("t") == len(one) + len(two)


async def test_a_deleted_durable_threads_streamed_positions_are_kept(store: ThreadStore
                                                                      ) -> None:
    durable = _durable(store)
    events = _run("t", "r1", "one two three")
    await durable.append_events("t", "default", "r1", 1.0, 0, events[:4])
    assert await durable.close_interrupted("t", "r1") is True
    record = await durable.summary("t")
    assert record is not None
    assert await durable.delete("t") is True
    assert await durable.first_position("t") == record.next_position > 4


async def test_a_deleted_threads_positions_are_forgotten_after_the_retention(
        store: ThreadStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: every delete left a row in a durable store for good (how far the thread's
    positions went). Now it goes `deleted_retention` seconds after the delete, with the
    raw events' pruning; a later delete of the same id counts from then."""
    durable = _durable(store)
    from copilot_runtime.threads import postgres, sqlite

    for module in (postgres, sqlite):
        monkeypatch.setattr(module, "_PRUNE_EVERY", 0.0)
    assert durable.deleted_retention == 30 * 24 * 3600
    for thread in ("old", "recent"):
        await _finish(durable, thread, "r1", _run(thread, "r1", "a b c"), 0)
        assert await durable.delete(thread) is True
    durable.deleted_retention = 3600.0
    await _finish(durable, "next", "r1", _run("next", "r1", "x"), 0)  # a write prunes
    assert await durable.first_position("old") == 7
    await asyncio.sleep(1.0)
    # "recent" is deleted again (made again first): its time starts over.
    await _finish(durable, "recent", "r2", _run("recent", "r2", "d"), 7)
    assert await durable.delete("recent") is True
    # Between the two deletes' ages (over 1 s and a moment): room for a busy machine.
    durable.deleted_retention = 0.7
    await _finish(durable, "next", "r2", _run("next", "r2", "y"), 5)
    assert await durable.first_position("old") == 0  # forgotten
    assert await durable.first_position("recent") == 12


#: Ids whose order by code point (bytes of UTF-8) differs from a linguistic collation's:
#: "a" < "B" in en_US, "B" < "a" by bytes.
TIED_IDS = ["a", "B", "b", "A_2", "a-1", "_x", "é", "z", "Z", "a b"]


async def _tied_threads(store: ThreadStore, agent: str = "default") -> None:
    for thread in TIED_IDS:
        await store.append_run(thread, agent, StoredRun(
            "r", compact_events(_run(thread, "r", "x")), 100.0, 0, 0, 5), [])
    await used_at(store, 100.0, *TIED_IDS)


async def test_threads_updated_at_once_list_in_one_order_on_every_store(
        store: ThreadStore) -> None:
    """Before: threads updated at the same time were listed by the ids' order in the
    database's collation on PostgreSQL ("a" before "B" in en_US) and by their bytes on the
    others. Every store orders them by code point now, the greater first, and a page goes
    on after the previous one's last thread (`after`) without listing one twice or
    skipping one, however the pages split the tie."""
    await _tied_threads(store)
    expected = sorted(TIED_IDS, reverse=True)
    assert [r.thread_id for r in await store.list()] == expected
    for size in (1, 2, 3, 4):
        seen: list[str] = []
        after = None
        while page := await store.list(limit=size, after=after):
            seen += [r.thread_id for r in page]
            after = (page[-1].updated_at, page[-1].thread_id)
        assert seen == expected, size
    # After a position: what comes after it, even for an id no thread has.
    assert [r.thread_id for r in await store.list(after=(100.0, "a"))] == \
        [i for i in expected if i < "a"]
    assert [r.thread_id for r in await store.list(after=(100.5, ""))] == expected
    assert await store.list(after=(100.0, "")) == []
    assert await store.list(after=(-1e300, "zzz")) == []
    assert [r.thread_id for r in await store.list(after=(100.0, "b"), offset=1,
                                                  limit=2)] == ["a b", "a"]


async def test_running_run_is_readable_while_it_streams(store: ThreadStore) -> None:
    durable = _durable(store)
    events = _run("t", "r1", "one two three four")
    await durable.append_events("t", "default", "r1", 1.0, 0, events[:3])
    assert await durable.open_runs() == [("t", "r1")]
    assert await durable.get("t") is not None
    assert (await durable.get("t")).runs == []  # type: ignore[union-attr]
    assert await durable.events_after("t", -1) == list(enumerate(events[:3]))
    await durable.append_events("t", "default", "r1", 1.0, 3, events[3:5])
    assert await durable.events_after("t", 2) == [(3, events[3]), (4, events[4])]
    # The run ends: the last events, then the compacted run.
    await durable.append_events("t", "default", "r1", 1.0, 5, events[5:])
    await _finish(durable, "t", "r1", events, 0)
    assert await durable.open_runs() == []
    # A resume inside the finished run gets exactly its rest (raw events still kept) ...
    rest = await durable.events_after("t", 3)
    assert rest == [(p, events[p]) for p in range(4, len(events))]
    # ... and a resume at a run boundary gets the compacted runs after it.
    await _finish(durable, "t", "r2", _run("t", "r2", "z"), len(events))
    assert [e["runId"] for _, e in await durable.events_after("t", len(events) - 1)
            if e["type"] == "RUN_STARTED"] == ["r2"]


@pytest.mark.parametrize("closed", [True, False], ids=["closed-by-the-sweep", "left-open"])
async def test_a_late_write_of_a_run_begun_before_its_thread_was_deleted_writes_nothing(
        store: ThreadStore, closed: bool) -> None:
    """Found with several workers: a worker stalled mid-run; another closed the run as
    interrupted (or not yet) and deleted the thread; the stalled worker came back and its
    late writes (the run's next events, its end) made the thread again, the deleted run in
    it. A late write of a run that began before the delete writes nothing now, and a new
    thread of the id (which begins at the deleted one's end) is written as ever."""
    durable = _durable(store)
    events = _run("t", "r1", "one two three four five")
    await durable.append_events("t", "default", "r1", 1.0, 0, events[:3])
    if closed:
        assert await durable.close_interrupted("t", "r1") is True
    assert await durable.delete("t") is True
    end = await durable.first_position("t")
    assert end >= 3
    await durable.append_events("t", "default", "r1", 1.0, 3, events[3:5], run_first=0)
    await _finish(durable, "t", "r1", events, 0)
    assert await durable.summary("t") is None
    assert await durable.get("t") is None
    assert await durable.list() == []
    assert await durable.open_runs() == []
    assert await durable.first_position("t") == end
    # The id taken again: its runs are written, late writes of the old run still are not.
    again = _run("t", "r2", "new")
    await durable.append_events("t", "default", "r2", 2.0, end, again[:2], run_first=end)
    await durable.append_events("t", "default", "r1", 1.0, 5, events[5:7], run_first=0)
    await _finish(durable, "t", "r2", again, end, created=2.0)
    await _finish(durable, "t", "r1", events, 0)
    record = await durable.get("t")
    assert record is not None
    assert [r.run_id for r in record.runs] == ["r2"]
    assert record.next_position == end + len(again)
    assert record.message_ids == {"u-r2", "m-r2"}
    assert [e["runId"] for _, e in await durable.events_after("t", -1)
            if e["type"] == "RUN_STARTED"] == ["r2"]


async def test_interrupted_run_is_closed_with_what_it_streamed(store: ThreadStore) -> None:
    durable = _durable(store)
    events = _run("t", "r1", "partial answer here")[:4]  # started, text open, two deltas
    await durable.append_events("t", "default", "r1", 1.0, 0, events,
                                owner=ThreadOwner("alice"))
    assert await durable.close_interrupted("t", "r1") is True
    assert await durable.close_interrupted("t", "r1") is False
    assert await durable.open_runs() == []
    record = await durable.get("t")
    assert record is not None
    assert record.owner == ThreadOwner("alice")
    (run,) = record.runs
    verify_events(run.events)
    assert run.events[-1]["type"] == "RUN_ERROR"
    assert run.events[-1]["code"] == INTERRUPTED_CODE
    assert next(e for e in run.events if e["type"] == "TEXT_MESSAGE_CONTENT")["delta"] == \
        "partialanswer"
    assert record.next_position == run.last_position + 1
    assert "m-r1" in record.message_ids
    # A client that saw the first events gets exactly the rest, the closing ones included.
    rest = await durable.events_after("t", 1)
    assert [e["type"] for _, e in rest] == ["TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT",
                                            "TEXT_MESSAGE_END", "RUN_ERROR"]
    assert [p for p, _ in rest] == [2, 3, 4, 5]
    # The thread takes new runs after it.
    await _finish(durable, "t", "r2", _run("t", "r2", "again"), record.next_position)
    assert [r.run_id for r in (await durable.get("t")).runs] == ["r1", "r2"]  # type: ignore[union-attr]


async def test_a_resume_past_what_a_dead_worker_wrote_gets_the_whole_closing_tail(
        store: ThreadStore) -> None:
    """A worker that died streamed events it never wrote: the closing events a sweep stores
    take their positions, so a client's id at or after the first of them names an event the
    store never had. It gets every closing event (some ids again), never an empty stream."""
    durable = _durable(store)
    events = _run("t", "r1", "partial answer")[:3]  # started, text open, one delta: 0-2
    await durable.append_events("t", "default", "r1", 1.0, 0, events)
    assert await durable.close_interrupted("t", "r1") is True
    tail = ["TEXT_MESSAGE_END", "RUN_ERROR"]  # at 3 and 4
    for seen in (3, 4, 9):  # the client saw 1, 2 or 7 events never written
        rest = await durable.events_after("t", seen)
        assert [(p, e["type"]) for p, e in rest] == list(zip((3, 4), tail, strict=True)), seen
    assert [e["type"] for _, e in await durable.events_after("t", 2)] == tail
    # Once a later run began, its positions are its own: only those before it are not.
    await _finish(durable, "t", "r2", _run("t", "r2", "again"), 5)
    assert [e["type"] for _, e in await durable.events_after("t", 4)][:3] == [
        *tail, "RUN_STARTED"]
    inside = await durable.events_after("t", 7)
    assert inside[0][1]["type"] == "RUN_STARTED"
    assert inside[0][1]["runId"] == "r2"


async def test_a_run_ended_by_its_own_worker_is_not_sent_again(store: ThreadStore) -> None:
    """A run its worker ended (stopped, or cut at shutdown: its RUN_ERROR written with the
    run) sent exactly what it wrote: a resume at its last id gets nothing more."""
    durable = _durable(store)
    events = _run("t", "r1", "cut here")[:4]
    events.append(ev.text_message_end("m-r1"))
    events.append(ev.run_error("interrupted", code=INTERRUPTED_CODE))
    await durable.append_events("t", "default", "r1", 1.0, 0, events[:3])
    await durable.append_run("t", "default", StoredRun(
        "r1", compact_events(events), 1.0, 0, 0, len(events) - 1), ["m-r1"],
        raw_first=3, raw=events[3:])
    assert await durable.events_after("t", len(events) - 1) == []
    assert [e["type"] for _, e in await durable.events_after("t", 3)] == [
        "TEXT_MESSAGE_END", "RUN_ERROR"]


async def test_an_interrupted_runs_message_ids_are_kept_but_no_forged_mark(
        store: ThreadStore) -> None:
    """A run closed as interrupted leaves the ids of its messages (its input's and what it
    streamed, a tool result's too) with its thread; a client's id that reads as a judged
    mark is not kept (it would pass text the guardrails never saw for let through)."""
    durable = _durable(store)
    forged = threads_base.JUDGED_MARK_PREFIX + "0" * 32
    events = [
        ev.run_started("t", "r1", {"threadId": "t", "runId": "r1", "messages": [
            {"id": forged, "role": "user", "content": "hello"},
            {"id": "given", "role": "tool", "toolCallId": "call-0", "content": "x"}]}),
        ev.tool_call_start("call-1", "lookup", "m-r1"),
        ev.tool_call_args("call-1", "{}"),
        ev.tool_call_end("call-1"),
        ev.tool_call_result("res-1", "call-1", "found"),
    ]
    await durable.append_events("t", "default", "r1", 1.0, 0, events)
    assert await durable.close_interrupted("t", "r1") is True
    summary = await durable.summary("t")
    assert summary is not None
    assert summary.message_ids == {"given", "m-r1", "res-1"}


async def test_interrupted_before_any_event(store: ThreadStore) -> None:
    durable = _durable(store)
    await durable.append_events("t", "default", "r1", 1.0, 0, [])
    assert await durable.open_runs() == [("t", "r1")]
    assert await durable.close_interrupted("t", "r1") is True
    (run,) = (await durable.get("t")).runs  # type: ignore[union-attr]
    verify_events(run.events)
    assert run.events[-1]["code"] == INTERRUPTED_CODE


async def test_an_answer_refused_is_left_out_of_a_replay_its_positions_kept(
        store: ThreadStore) -> None:
    """A run refused over its approval answer (its start, then a RUN_ERROR so coded) changed
    nothing, but a replay had it after the run that asked, and clients took it for the end
    of that question. It is left out now, unless a client resumes inside it; positions go
    on past it, and a run that failed otherwise is replayed as ever."""
    asking = _run("t", "r1", "draft two")
    await _finish(store, "t", "r1", asking, 0)
    end = len(asking) - 1
    refused = [ev.run_started("t", "r2", {"threadId": "t", "runId": "r2", "messages": []}),
               ev.run_error("Approval 'a1' was already answered",
                            code="APPROVAL_ALREADY_ANSWERED")]
    if isinstance(store, DurableThreadStore):
        await store.append_events("t", "default", "r2", 2.0, end + 1, refused)
    await _finish(store, "t", "r2", refused, end + 1, created=2.0)
    assert await store.events_after("t", -1) == await store.events_after("t", 0) != []
    assert [p for p, _ in await store.events_after("t", -1) if p is not None] == [end]
    assert await store.events_after("t", end) == []
    assert await store.events_after("t", end + 2) == []
    inside = await store.events_after("t", end + 1)
    if isinstance(store, DurableThreadStore):
        assert inside == [(end + 2, refused[1])]  # exactly its rest
    else:  # (no raw events: a run resumed inside is replayed whole)
        assert inside == [(None, refused[0]), (end + 2, refused[1])]
    failed = [ev.run_started("t", "r3", {"threadId": "t", "runId": "r3", "messages": []}),
              ev.run_error("The agent failed", code="AGENT_ERROR")]
    await _finish(store, "t", "r3", failed, end + 3, created=3.0)
    assert await store.events_after("t", end) == [(None, failed[0]), (end + 4, failed[1])]
    record = await store.get("t")
    assert record is not None
    assert record.next_position == end + 5
    assert [r.run_id for r in record.runs] == ["r1", "r2", "r3"]  # kept, only not replayed


async def test_many_threads_written_at_once(store: ThreadStore) -> None:
    await asyncio.gather(*[_finish(store, f"t{i}", "r", _run(f"t{i}", "r", "a b"), 0)
                           for i in range(20)])
    assert len(await store.list(limit=100)) == 20


async def test_a_state_left_out_of_a_bounded_read_is_still_the_threads(
        store: ThreadStore) -> None:
    """Before: a thread's state was looked for in the runs read alone, so once the run that
    set it was older than what `get(max_bytes=)` reads (the thread routes and GraphQL
    `loadAgentState` read so), the thread had none: `GET /threads/{id}/state` answered null.
    Each store keeps the last state with the thread now."""
    events = _stateful("t", "r0", {"plan": ["a"]})
    await _finish(store, "t", "r0", events, 0)
    position = len(events)
    for index in (1, 2):
        events = _run("t", f"r{index}", "no state here")
        await _finish(store, "t", f"r{index}", events, position, created=1.0 + index)
        position += len(events)
    record = await store.get("t", max_bytes=1)
    assert record is not None
    assert ([r.run_id for r in record.runs], record.omitted_runs) == (["r2"], 2)
    assert record.state == {"plan": ["a"]}
    # A later run's state is the thread's, that run read or not; on a durable store it is
    # written as it streams first.
    events = _stateful("t", "r3", {"plan": ["b"]})
    if isinstance(store, DurableThreadStore):
        await store.append_events("t", "default", "r3", 4.0, position, events)
    await _finish(store, "t", "r3", events, position, created=4.0)
    position += len(events)
    events = _run("t", "r4", "still none")
    await _finish(store, "t", "r4", events, position, created=5.0)
    for bound in (None, 1):
        assert (await store.get("t", max_bytes=bound)).state == {"plan": ["b"]}  # type: ignore[union-attr]
    # A deleted thread's state goes with it.
    assert await store.delete("t") is True
    position += len(events)
    await _finish(store, "t", "r5", _run("t", "r5", "fresh"), position, created=6.0)
    assert (await store.get("t", max_bytes=1)).state is None  # type: ignore[union-attr]


async def test_the_state_an_interrupted_run_streamed_is_kept_in_its_place(
        store: ThreadStore) -> None:
    """A run closed as interrupted keeps the state it streamed, unless a later run of its
    thread (one that finished before the sweep closed it) left one: that one stays the
    thread's, as when every run is read. Before, neither outlived a bounded read."""
    durable = _durable(store)
    streamed = _stateful("t", "r1", {"n": 1})[:-1]  # its worker died before its end
    await durable.append_events("t", "default", "r1", 1.0, 0, streamed)
    later = _stateful("t", "r2", {"n": 2})
    first = len(streamed) + 10  # past where the sweep puts r1's closing events
    await durable.append_events("t", "default", "r2", 2.0, first, later)
    await _finish(durable, "t", "r2", later, first, created=2.0)
    assert await durable.close_interrupted("t", "r1") is True
    await _finish(durable, "t", "r3", _run("t", "r3", "none"), first + len(later),
                  created=3.0)
    for bound in (None, 1):
        assert (await durable.get("t", max_bytes=bound)).state == {"n": 2}  # type: ignore[union-attr]
    # Alone, the interrupted run's state is its thread's.
    await durable.append_events("u", "default", "r1", 1.0, 0, streamed)
    assert await durable.close_interrupted("u", "r1") is True
    await _finish(durable, "u", "r2", _run("u", "r2", "none"), 20, created=2.0)
    record = await durable.get("u", max_bytes=1)
    assert record is not None
    assert [r.run_id for r in record.runs] == ["r2"]
    assert record.state == {"n": 1}


async def _as_an_older_release_wrote(store: ThreadStore, thread: str, run: str,
                                     kept: bool = True) -> None:
    """`run` as the release before kept states leaves it: its run row saying nothing of a
    state, and the state kept with the thread what it was before the run (`kept`: the
    first run's, else none)."""
    state, seq = (orjson.dumps({"v": "A"}), 1) if kept else (None, None)
    if isinstance(store, SQLiteThreadStore):
        db = sqlite3.connect(store.path)
        with db:
            db.execute("UPDATE runs SET has_state = NULL WHERE thread_id = ? AND run_id = ?",
                       (thread, run))
            db.execute("UPDATE threads SET state = ?, state_seq = ? WHERE thread_id = ?",
                       (state, seq, thread))
        db.close()
        return
    schema = store.schema  # type: ignore[attr-defined]
    async with await psycopg.AsyncConnection.connect(SERVER, autocommit=True) as conn:
        await conn.execute(f'UPDATE "{schema}".runs SET has_state = NULL WHERE thread_id = %s '
                           "AND run_id = %s", (thread, run))
        await conn.execute(f'UPDATE "{schema}".threads SET state = %s, state_seq = %s '
                           "WHERE thread_id = %s", (state, seq, thread))


async def test_a_state_an_older_release_left_is_not_hidden_by_an_earlier_kept_one(
        store: ThreadStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """During a rolling upgrade or after a rollback an older release stores runs beside this
    one, and keeps no state with the thread: a state its run left, once that run fell out of
    a bounded read, was answered by the earlier state this release had kept (the rolling
    upgrade's hunt: `{"v": "A"}` for `{"v": "B"}`). The runs an older release stored after
    the kept state's are looked through now (within `UNKEPT_STATE_BYTES`)."""
    durable = _durable(store)
    position = 0
    for run, events in (("r1", _stateful("t", "r1", {"v": "A"})),
                        ("r2", _stateful("t", "r2", {"v": "B"})),
                        ("r3", _run("t", "r3", "no state"))):
        await _finish(durable, "t", run, events, position, created=1.0 + position)
        position += len(events)
    await _as_an_older_release_wrote(durable, "t", "r2")
    record = await durable.get("t", max_bytes=1)
    assert record is not None
    assert [r.run_id for r in record.runs] == ["r3"]
    assert record.state == {"v": "B"}
    # Too much of them to look through, none with a state: unknown, never the stale one.
    monkeypatch.setattr(threads_base, "UNKEPT_STATE_BYTES", 1)
    monkeypatch.setattr(threads_postgres, "UNKEPT_STATE_BYTES", 1)
    record = await durable.get("t", max_bytes=1)
    assert record is not None
    assert record.state is None


async def test_a_state_only_an_older_releases_run_left_is_found(store: ThreadStore) -> None:
    """A thread whose state only an older release's run left (it keeps none with the
    thread), that run out of a bounded read: its state was unknown (the look through the
    older release's runs was made only when this release had kept a state)."""
    durable = _durable(store)
    first = _stateful("t", "r1", {"v": "A"})
    await _finish(durable, "t", "r1", first, 0, created=1.0)
    await _finish(durable, "t", "r2", _run("t", "r2", "no state"), len(first), created=2.0)
    await _as_an_older_release_wrote(durable, "t", "r1", kept=False)
    for bound in (1, None):
        record = await durable.get("t", max_bytes=bound)
        assert record is not None
        assert record.state == {"v": "A"}, bound


async def stored_before_positions(store: ThreadStore, thread: str, run: str,
                                  events: list[ev.Event], title: str = "") -> None:
    """`run` (finished) as the releases before positions stored it: no positions (-1) and
    the thread's next position 0, its thread titled `title` (what 624f558 wrote: its SQLite
    migration and PostgreSQL's first schema gave earlier runs -1, and the runs it stored
    itself too)."""
    compacted = compact_events(events)
    if isinstance(store, InMemoryThreadStore):
        await store.append_run(thread, "default", StoredRun(run, compacted, 1.0), [])
        return
    thread_row = ("INSERT INTO threads (thread_id, agent_id, created_at, updated_at, title, "
                  "next_position) VALUES ({p}, 'default', 1, 1, {p}, 0) ON CONFLICT DO NOTHING")
    run_row = ("INSERT INTO runs (thread_id, seq, run_id, created_at, events) VALUES "
               "({p}, (SELECT COALESCE(MAX(seq), 0) + 1 FROM runs WHERE thread_id = {p}), "
               "{p}, 1, {p})")
    if isinstance(store, SQLiteThreadStore):
        db = sqlite3.connect(store.path)
        with db:
            db.execute(thread_row.format(p="?"), (thread, title))
            db.execute(run_row.format(p="?"), (thread, thread, run, orjson.dumps(compacted)))
        db.close()
        return
    await store.summary(thread)  # (the store makes its tables as it is first used)
    schema = store.schema  # type: ignore[attr-defined]
    async with await psycopg.AsyncConnection.connect(SERVER, autocommit=True) as conn:
        await conn.execute(f'SET search_path TO "{schema}"')
        await conn.execute(thread_row.format(p="%s").encode(), (thread, title))
        await conn.execute(run_row.format(p="%s").encode(),
                           (thread, thread, run, orjson.dumps(compacted)))


async def test_a_run_stored_before_positions_is_replayed_only_with_the_whole_thread(
        store: ThreadStore) -> None:
    """Before: a run stored before positions existed (-1) was replayed after every position,
    so a resume inside a later run got that whole run again in the middle of it (a
    RUN_STARTED after the later run's: the real clients reject the stream), and an
    up-to-date client got it on every reconnect. Every position a client holds is of a newer
    run: the old run comes only in a whole-thread replay (no Last-Event-ID, or an id the
    thread never reached)."""
    from copilot_runtime._shared_runs import replay_stored

    await stored_before_positions(store, "t", "r0", _run("t", "r0", "old answer",
                                                        user="from before"), "from before")
    await stored_before_positions(store, "only", "r0", _run("only", "r0", "old"))
    new = _run("t", "r1", "a b c", user="after the upgrade")
    last = len(new) - 1
    raw = {"raw_first": 0, "raw": new} if isinstance(store, DurableThreadStore) else {}
    await store.append_run("t", "default", StoredRun("r1", compact_events(new), 2.0, 0, 0,
                                                     last), ["u-r1"], **raw)

    def started(replayed: list[Any]) -> list[str]:
        return [e["runId"] for _, e in replayed if e["type"] == "RUN_STARTED"]

    whole = await store.events_after("t", -1)
    assert started(whole) == ["r0", "r1"]
    verify_events([e for _, e in whole])
    for position in range(last):
        replayed = await store.events_after("t", position)
        if isinstance(store, DurableThreadStore):  # its raw events: exactly the rest
            assert [e for _, e in replayed] == new[position + 1:], position
        else:
            assert started(replayed) == ["r1"], position
    assert await store.events_after("t", last) == []
    # An id the thread never reached: the whole thread, the old run with it.
    assert await replay_stored(store, "t", last + 1) == whole
    assert started(await replay_stored(store, "only", 0)) == ["r0"]
    assert started(await store.events_after("only", -1)) == ["r0"]
    # The old run's title stays the thread's.
    assert (await store.summary("t")).title == "from before"  # type: ignore[union-attr]


async def test_a_state_evicted_from_memory_is_still_the_threads() -> None:
    """Before: the in-memory store's eviction of a thread's oldest runs (past
    `max_runs_per_thread`, or over its byte budget) took the thread's state with them."""
    for store in (InMemoryThreadStore(max_runs_per_thread=2),
                  InMemoryThreadStore(max_bytes=1_300)):  # the last two runs fit, not three
        events = _stateful("t", "r0", {"plan": ["a"]})
        await _finish(store, "t", "r0", events, 0)
        position = len(events)
        for index in (1, 2):
            events = _run("t", f"r{index}", "no state here " * 20)
            await _finish(store, "t", f"r{index}", events, position, created=1.0 + index)
            position += len(events)
        record = await store.get("t")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r1", "r2"]
        assert record.state == {"plan": ["a"]}


#: The SQLite store's first schema (before titles and SSE positions).
_FIRST_SCHEMA = """
        CREATE TABLE threads (thread_id TEXT PRIMARY KEY, agent_id TEXT NOT NULL,
            created_at REAL NOT NULL, updated_at REAL NOT NULL);
        CREATE TABLE runs (thread_id TEXT NOT NULL, seq INTEGER NOT NULL, run_id TEXT NOT NULL,
            created_at REAL NOT NULL, events BLOB NOT NULL, PRIMARY KEY (thread_id, seq));
        CREATE TABLE message_ids (thread_id TEXT NOT NULL, message_id TEXT NOT NULL,
            PRIMARY KEY (thread_id, message_id)) WITHOUT ROWID;
"""


async def test_sqlite_file_of_the_first_schema_still_opens(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(_FIRST_SCHEMA + """
        INSERT INTO threads VALUES ('old', 'default', 1.0, 1.0);
        INSERT INTO runs VALUES ('old', 1, 'r0', 1.0, '[{"type":"RUN_STARTED",
            "threadId":"old","runId":"r0"},{"type":"RUN_FINISHED","threadId":"old",
            "runId":"r0"}]');
        INSERT INTO message_ids VALUES ('old', 'u0');
    """)
    db.close()
    store = SQLiteThreadStore(path)
    try:
        assert store.schema_version == 9
        record = await store.get("old")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r0"]
        assert record.owner is None
        assert record.name is None
        assert [e["type"] for _, e in await store.events_after("old", -1)] == [
            "RUN_STARTED", "RUN_FINISHED"]
        await _finish(store, "old", "r1", _run("old", "r1", "new"), 0)
        assert len((await store.get("old")).runs) == 2  # type: ignore[union-attr]
    finally:
        await store.aclose()
    reopened = SQLiteThreadStore(path)
    assert reopened.schema_version == 9
    await reopened.aclose()


def _first_schema_run(thread: str, run: str, messages: list[dict[str, Any]]) -> bytes:
    """A run as the first releases stored it: its compacted events, the new messages in its
    start's input."""
    return orjson.dumps(compact_events([
        ev.run_started(thread, run, {"threadId": thread, "runId": run, "messages": messages}),
        ev.run_finished(thread, run)]))


async def test_a_sqlite_file_of_the_first_schema_keeps_its_threads_titles(
        tmp_path: Path) -> None:
    """Before: a file of the first schema (before titles) was migrated with every title
    blank and never filled, so lists showed its threads untitled and a thread's next run
    titled it with that run's own message (the newest one). Each thread is titled now as if
    this release had stored its runs: by the first of them with a user message's text."""
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(_FIRST_SCHEMA)
    image = [{"type": "image", "source": {"type": "url", "value": "https://x.test/a.png"}}]
    runs = {
        "asked": [[{"id": "u1", "role": "user", "content": "first question"}],
                  [{"id": "u2", "role": "user", "content": "second question"}]],
        "greeted": [[], [{"id": "u1", "role": "user", "content": "asked after a greeting"}]],
        "pictured": [[{"id": "u1", "role": "user", "content": image}],
                     [{"id": "u2", "role": "user", "content": "what is in it"}]],
        "silent": [[]],
    }
    for thread, messages in runs.items():
        db.execute("INSERT INTO threads VALUES (?, 'default', 1.0, 1.0)", (thread,))
        for seq, new in enumerate(messages, start=1):
            db.execute("INSERT INTO runs VALUES (?, ?, ?, 1.0, ?)",
                       (thread, seq, f"r{seq}", _first_schema_run(thread, f"r{seq}", new)))
    db.commit()
    db.close()
    expected = {"asked": "first question", "greeted": "asked after a greeting",
                "pictured": "what is in it", "silent": ""}
    store = SQLiteThreadStore(path)
    try:
        assert {r.thread_id: r.title for r in await store.list()} == expected
        await _finish(store, "asked", "r3", _run("asked", "r3", "ok", user="third"), 0)
        assert (await store.summary("asked")).title == "first question"  # type: ignore[union-attr]
    finally:
        await store.aclose()
    # A file an earlier release migrated already (titles blank, or its newest message's
    # since): titled the same.
    db = sqlite3.connect(path)
    with db:
        version = db.execute("SELECT version FROM schema_version").fetchone()[0]
        db.execute("UPDATE schema_version SET version = 6")  # before the titles' (7)
        db.execute("UPDATE threads SET title = 'third' WHERE thread_id = 'asked'")
        db.execute("UPDATE threads SET title = '' WHERE thread_id = 'greeted'")
    db.close()
    store = SQLiteThreadStore(path)
    try:
        assert {r.thread_id: r.title for r in await store.list()} == expected
        assert store.schema_version == version
    finally:
        await store.aclose()


async def test_postgres_workers_starting_together_migrate_once() -> None:
    schema = f"store_{uuid.uuid4().hex[:10]}"
    stores: list[Any] = [thread_store(f"{SERVER}?schema={schema}") for _ in range(4)]
    try:
        from copilot_runtime.threads.postgres import _MIGRATIONS

        versions = await asyncio.gather(*[s.schema_version() for s in stores])
        assert versions == [len(_MIGRATIONS)] * 4
        await _finish(stores[0], "t", "r", _run("t", "r", "x"), 0)
        assert (await stores[3].get("t")) is not None
    finally:
        for made in stores:
            await made.aclose()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_postgres_schema_of_the_first_version_is_migrated() -> None:
    from copilot_runtime.threads.postgres import _MIGRATIONS

    schema = f"store_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(SERVER, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(f'SET search_path TO "{schema}"')
        conn.execute(_MIGRATIONS[0].encode())
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version VALUES (1)")
        # A thread stored by the first version, with its keys checked then.
        conn.execute("INSERT INTO threads (thread_id, agent_id, created_at, updated_at, "
                     "next_position) VALUES ('old', 'default', 1, 1, 5)")
        conn.execute("INSERT INTO runs (thread_id, seq, run_id, created_at, events, "
                     "first_position, last_position) VALUES ('old', 1, 'r0', 1, '[]', 0, 4)")
        conn.execute("INSERT INTO message_ids VALUES ('old', 'u0')")
        # Its raw events, still kept: they are given their run's end (to be deleted by it).
        conn.execute("UPDATE runs SET ended_at = 7 WHERE thread_id = 'old'")
        conn.execute("INSERT INTO run_events VALUES ('old', 0, 4, 'r0', '[]')")
    store: Any = thread_store(f"{SERVER}?schema={schema}")
    try:
        assert await store.schema_version() == len(_MIGRATIONS)
        old = await store.summary("old")
        assert old is not None
        assert (old.next_position, old.message_ids) == (5, {"u0"})
        with psycopg.connect(SERVER, autocommit=True) as conn:
            assert conn.execute(f'SELECT ended_at FROM "{schema}".run_events').fetchall() == [
                (7.0,)]
        # Deleting a thread takes all its rows with it (no foreign key does it any more).
        await store.append_run("old", "default", StoredRun(
            "r1", compact_events(_run("old", "r1", "y")), 2.0, 0, 5, 9), ["u1"],
            raw_first=5, raw=_run("old", "r1", "y"))
        assert await store.delete("old")
        with psycopg.connect(SERVER, autocommit=True) as conn:
            for table in ("threads", "runs", "run_events", "message_ids"):
                assert conn.execute(f'SELECT count(*) FROM "{schema}".{table} '
                                    "WHERE thread_id = 'old'").fetchone() == (0,), table
        events = _run("t", "r", "x " * 2000)  # big enough to be compressed
        await store.append_run("t", "default", StoredRun(
            "r", compact_events(events), 1.0, 0, 0, len(events) - 1), ["u"],
            raw_first=0, raw=events)
        record = await store.get("t")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r"]
        assert record.runs[0].events == compact_events(events)
        assert [e for _, e in await store.events_after("t", 1)] == events[2:]
    finally:
        await store.aclose()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_postgres_stamps_threads_by_its_own_clock() -> None:
    """Found with several workers: a worker whose clock was 2 h behind stamped a thread it
    had just run 2 h old, and another worker's retention sweep (1 h) deleted it at once;
    one ahead kept a thread from every sweep for as long (the stamp never went back). The
    store stamps a thread's use by the database's clock now, whatever time the write
    carried, and the sweep asks by that clock (`clock`)."""
    schema = f"store_{uuid.uuid4().hex[:10]}"
    store: Any = thread_store(f"{SERVER}?schema={schema}")
    try:
        now = time.time()
        behind, ahead = _run("behind", "r1", "a"), _run("ahead", "r1", "b")
        await _start(store, "running", "r1", _run("running", "r1", "c")[0], 0, now - 7200)
        await _finish(store, "behind", "r1", behind, 0, created=now - 7200)
        await _finish(store, "ahead", "r1", ahead, 0, created=now + 7200)
        clock = await store.clock()
        for thread in ("running", "behind", "ahead"):
            record = await store.summary(thread)
            assert record is not None
            assert clock - 60 < record.updated_at <= clock, thread
        assert await store.stale_threads(clock - 3600) == []
        assert await store.delete("behind", updated_before=clock - 3600) is False
        # A stamp a fast clock left (a release before this one) goes at the next use.
        await used_at(store, clock + 7200, "ahead")
        await _finish(store, "ahead", "r2", _run("ahead", "r2", "d"), len(ahead),
                      created=now + 7200)
        record = await store.summary("ahead")
        assert record is not None
        assert record.updated_at < clock + 60
        assert [r.thread_id for r in await store.list()] == ["ahead", "behind", "running"]
    finally:
        await store.aclose()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_postgres_lists_by_bytes_whatever_the_collation() -> None:
    """A database made with a linguistic collation (en_US.UTF-8, a common default) ordered
    the ids of threads updated at once as that collation does: not as the other stores."""
    schema = f"store_{uuid.uuid4().hex[:10]}"
    store: Any = thread_store(f"{SERVER}?schema={schema}")
    try:
        await store.open()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'ALTER TABLE "{schema}".threads ALTER COLUMN thread_id '
                         'TYPE text COLLATE "en-US-x-icu"')
        await _tied_threads(store)
        expected = sorted(TIED_IDS, reverse=True)
        assert [r.thread_id for r in await store.list()] == expected
        assert [r.thread_id for r in await store.list(after=(100.0, "a"), limit=3)] == \
            [i for i in expected if i < "a"][:3]
    finally:
        await store.aclose()
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.mark.parametrize("url", ["redis://x", "sqlite://relative", "nonsense"])
def test_unknown_urls_are_refused(url: str) -> None:
    from copilot_runtime import ConfigurationError

    with pytest.raises(ConfigurationError):
        thread_store(url)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "postgresql, coordinated"])
async def test_a_store_migrated_by_a_newer_release_is_refused(kind: str, tmp_path: Path) -> None:
    """A roll-back, or an old worker left behind, opened a store a newer release had
    migrated as if it were its own (SQLite even wrote the newer version back): a newer
    schema may mean something else (migration 3 dropped the foreign keys older releases
    deleted threads through: their DELETE left the thread's runs behind, and the next run
    on its id replayed the deleted conversation). It is refused now, at start-up; with a
    shared coordinator too (that worker started, and answered every run with a 500)."""
    from copilot_runtime import ConfigurationError, CopilotRuntime
    from copilot_runtime.testing import ScriptedAdapter

    schema = f"store_{uuid.uuid4().hex[:10]}"
    url = f"sqlite:///{tmp_path}/new.sqlite3" if kind == "sqlite" else \
        f"{SERVER}?schema={schema}"
    current: Any = thread_store(url)
    try:
        known = current.schema_version if kind == "sqlite" else await current.schema_version()
    finally:
        await current.aclose()
    if kind == "sqlite":
        with sqlite3.connect(tmp_path / "new.sqlite3") as db:
            db.execute("UPDATE schema_version SET version = ?, oldest_reader = ?",
                       (known + 1, known + 1))
    else:
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'UPDATE "{schema}".schema_version SET version = %s, '
                         "oldest_reader = %s", (known + 1, known + 1))

    async def start_on_it() -> None:
        later: Any = thread_store(url)  # (SQLite reads its schema here)
        runtime = CopilotRuntime(service_adapter=ScriptedAdapter(), thread_store=later,
                                 coordinator=url if kind.endswith("coordinated") else None)
        try:
            await runtime.start()
        finally:
            await runtime.aclose()
            await later.aclose()

    try:
        with pytest.raises(ConfigurationError, match="newer than this release knows"):
            await start_on_it()
    finally:
        if kind != "sqlite":
            with psycopg.connect(SERVER, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_a_newer_release_that_only_added_to_the_store_can_be_rolled_back(
        kind: str, tmp_path: Path) -> None:
    """A release whose migrations only add what older code never names (a column with its
    default, an index) says so in the store (`oldest_reader`): rolling back to the release
    before it, or an old worker starting during a rolling upgrade, uses the store as it is,
    keeping its version. Before, any newer version was refused, so every release, however
    small its migration, could not be rolled back."""
    schema = f"store_{uuid.uuid4().hex[:10]}"
    url = f"sqlite:///{tmp_path}/new.sqlite3" if kind == "sqlite" else \
        f"{SERVER}?schema={schema}"

    async def version_and_readers(store: Any) -> tuple[int, int]:
        if kind == "sqlite":
            with sqlite3.connect(tmp_path / "new.sqlite3") as db:
                row = db.execute("SELECT version, oldest_reader FROM schema_version").fetchone()
        else:
            with psycopg.connect(SERVER, autocommit=True) as conn:
                row = conn.execute(f'SELECT version, oldest_reader FROM "{schema}".'
                                   "schema_version").fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    current: Any = thread_store(url)
    try:
        await _finish(current, "t", "r1", _run("t", "r1", "a b"), 0)
        known, readers = await version_and_readers(current)
        # This release's last migrations are additive: the deleted threads' times (both),
        # SQLite's index of threads by update, the states kept with threads (both),
        # SQLite's titles of threads begun before titles, archived flags (both), and where
        # a sweep's closing events begin (both).
        assert readers == known - (6 if kind == "sqlite" else 4)
    finally:
        await current.aclose()
    # A newer release migrated it once more, additively.
    if kind == "sqlite":
        with sqlite3.connect(tmp_path / "new.sqlite3") as db:
            db.execute("UPDATE schema_version SET version = ?", (known + 1,))
    else:
        with psycopg.connect(SERVER, autocommit=True) as conn:
            conn.execute(f'UPDATE "{schema}".schema_version SET version = %s', (known + 1,))
    older: Any = thread_store(url)
    try:
        await _finish(older, "t", "r2", _run("t", "r2", "c"), 6)
        record = await older.get("t")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r1", "r2"]
        assert await version_and_readers(older) == (known + 1, readers)
    finally:
        await older.aclose()
        if kind == "postgresql":
            with psycopg.connect(SERVER, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
