"""`GET threads` a page at a time: cursors that hold when threads change between pages.

A `nextCursor` says where the page ended in the list (the last thread's updated time and id)
rather than how many threads came before it, so threads updated or made between two pages
neither repeat a thread on the next page nor push one out of it; a thread updated between
two pages moves to the top of the list, above the cursor, and is listed again only by a
fresh first page; ties (threads updated at once) are split in one order on every store. A
cursor this server did not make, or made for another agent's list, is a 400.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest

from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events
from copilot_runtime.threads import StoredRun
from tests import test_threads_resume as resume
from tests.conftest import Served
from tests.test_store_conformance import TIED_IDS, used_at
from tests.test_trust_ownership import call

pytestmark = pytest.mark.timeout(60)

#: A runtime served on each store (memory, SQLite, PostgreSQL), as the resume tests have it.
store_url = resume.store_url
served = resume.served


async def store_thread(served: Served, thread: str, at: float, agent: str = "default") -> None:
    events = [ev.run_started(thread, "r", {"threadId": thread, "runId": "r", "messages": [
        {"id": f"u-{thread}", "role": "user", "content": thread}]}),
        ev.run_finished(thread, "r")]
    await served.runtime.store.append_run(thread, agent, StoredRun(
        "r", compact_events(events), at, 0, 0, 1), [])
    await used_at(served.runtime.store, at, thread)


async def page(served: Served, query: str) -> tuple[int, Any]:
    status, body, _ = await call(served, "GET", f"/threads{query}", None)
    return status, orjson.loads(body)


async def test_pages_hold_when_threads_change_between_them(served: Served) -> None:
    """Before: the cursor was an offset, so a thread made (or updated) between two pages
    pushed the list down by one and the next page began with the last thread of the page
    before: listed twice. And PostgreSQL split ties in another order than the others."""
    for thread in TIED_IDS:
        await store_thread(served, thread, 100.0)
    expected = sorted(TIED_IDS, reverse=True)
    status, whole = await page(served, "")
    assert status == 200
    assert [t["id"] for t in whole["threads"]] == expected
    seen: list[str] = []
    cursor = ""
    made = 0
    while True:
        status, got = await page(served, f"?limit=3{cursor}")
        assert status == 200, got
        seen += [t["id"] for t in got["threads"]]
        if got["nextCursor"] is None:
            break
        cursor = f"&cursor={got['nextCursor']}"
        made += 1
        await store_thread(served, f"new-{made}", 200.0 + made)  # between two pages
    assert seen == expected
    status, got = await page(served, "?limit=2")
    assert [t["id"] for t in got["threads"]] == [f"new-{made}", f"new-{made - 1}"]


async def test_a_thread_updated_mid_walk_moves_to_the_top_not_later_in_the_walk(
        served: Served) -> None:
    """What the README promises, and no more: the list is newest first by activity, so a
    thread not listed yet that gets a run between two pages moves above the cursor: a
    fresh first page shows it, not a later page of this walk; one listed already is not
    listed again. (Paging on what never changes would break the order by activity.)"""
    for index in range(5):
        await store_thread(served, f"t{index}", 10.0 + index)
    status, first = await page(served, "?limit=2")
    assert [t["id"] for t in first["threads"]] == ["t4", "t3"]
    for thread, at in (("t1", 20.0), ("t3", 21.0)):  # one not listed yet, one listed
        events = [ev.run_started(thread, "r2", {"threadId": thread, "runId": "r2"}),
                  ev.run_finished(thread, "r2")]
        await served.runtime.store.append_run(thread, "default", StoredRun(
            "r2", compact_events(events), at, 0, 2, 3), [])
    seen, cursor = [], first["nextCursor"]
    while cursor is not None:
        status, got = await page(served, f"?limit=2&cursor={cursor}")
        assert status == 200, got
        seen += [t["id"] for t in got["threads"]]
        cursor = got["nextCursor"]
    assert seen == ["t2", "t0"]
    status, fresh = await page(served, "?limit=2")
    assert [t["id"] for t in fresh["threads"]] == ["t3", "t1"]


async def test_cursors_of_another_list_or_made_up_are_refused(served: Served) -> None:
    for index in range(3):
        await store_thread(served, f"t{index}", 10.0 + index)
        await store_thread(served, f"o{index}", 10.0 + index, agent="other")
    status, first = await page(served, "?limit=1&agentId=default")
    assert status == 200
    assert [t["id"] for t in first["threads"]] == ["t2"]
    cursor = first["nextCursor"]
    status, second = await page(served, f"?limit=1&agentId=default&cursor={cursor}")
    assert [t["id"] for t in second["threads"]] == ["t1"]
    # The cursor of one agent's list, for another's list (or every agent's): a 400.
    for query in (f"?agentId=other&cursor={cursor}", f"?cursor={cursor}"):
        status, body = await page(served, query)
        assert status == 400, query
        assert "another agent" in body["error"]

    def token(value: Any) -> str:
        return base64.urlsafe_b64encode(orjson.dumps(value)).rstrip(b"=").decode()

    garbage = ["abc", "%00", "=", "a" * 5000, "e30", token({}), token([1, "t", None, 4]),
               token(["1", "t", None]), token([True, "t", None]), token([1, 5, None]),
               token([1, "t\u0000", None]), token([1, "x" * 300, None]), token([1, "t", 5]),
               base64.urlsafe_b64encode(b"[1e400,\"t\",null]").rstrip(b"=").decode(),
               "1.5", "1e3", " 1", "0x10", "-1", str(2**31 + 1), "%20"]
    for bad in garbage:
        status, body = await page(served, f"?cursor={bad}")
        assert status == 400, bad
        assert "cursor" in body["error"], bad
    # Made up but well formed: only a place in the list, so what comes after it.
    status, got = await page(served, f"?cursor={token([11.0, 't1', None])}")
    assert status == 200
    assert [t["id"] for t in got["threads"]] == ["o1", "t0", "o0"]
    # An offset, as earlier releases made them, still reads.
    status, got = await page(served, "?cursor=4")
    assert [t["id"] for t in got["threads"]] == ["t0", "o0"]
