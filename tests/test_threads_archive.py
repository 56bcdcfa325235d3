"""What `@copilotkit/core`'s thread store sends to rename, archive and unarchive a thread, and
its list with and without archived threads, on every store.

Before: the client's rename (`PATCH threads/{id}` with `{"agentId", "name"}`) was a 400, as
was its unarchive (`{"agentId", "archived": false}`), and its archive (`POST
threads/{id}/archive`) a 404, while `/info` advertised thread mutations; no store kept an
archived flag, and every listed thread said `"archived": false`.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import httpx
import orjson
import pytest
from structlog.testing import capture_logs

from copilot_runtime import BearerTokenAuth, CopilotRuntime, DemoAdapter, create_app
from copilot_runtime.threads import InMemoryThreadStore, ThreadRecord
from copilot_runtime.threads.sqlite import SQLiteThreadStore
from tests import test_threads_resume as resume
from tests.conftest import GatedAgent, Served, ServeRuntime, run_input
from tests.test_trust_ownership import call

pytestmark = pytest.mark.timeout(60)

#: A runtime served on each store (memory, SQLite, PostgreSQL), as the resume tests have it.
store_url = resume.store_url
served = resume.served


async def answer(served: Served, method: str, path: str, body: Any = None
                 ) -> tuple[int, Any]:
    status, raw, _ = await call(served, method, path, None, body)
    return status, orjson.loads(raw)


async def listed(served: Served, query: str = "") -> list[tuple[str, bool]]:
    """(id, archived) of every thread listed with `query`, a page of one at a time (the
    keyset cursor walked to its end)."""
    seen: list[tuple[str, bool]] = []
    cursor = None
    while True:
        page = f"/threads?limit=1{query}" + (f"&cursor={cursor}" if cursor else "")
        status, body = await answer(served, "GET", page)
        assert status == 200, body
        seen += [(t["id"], t["archived"]) for t in body["threads"]]
        cursor = body["nextCursor"]
        if cursor is None:
            return seen


async def test_the_clients_rename_is_accepted(served: Served) -> None:
    await resume.run_ids(served, "t", "hello", "r1")
    assert await answer(served, "PATCH", "/threads/t", {"agentId": "default",
                                                        "name": "My trip"}) == (
        200, {"id": "t", "name": "My trip"})
    _, body = await answer(served, "GET", "/threads?agentId=default")
    assert [(t["id"], t["name"], t["archived"]) for t in body["threads"]] == [
        ("t", "My trip", False)]


async def test_archive_unarchive_and_the_lists(served: Served) -> None:
    for thread in ("t1", "t2", "t3", "t4"):
        await resume.run_ids(served, thread, "hello", "r1")
    assert await answer(served, "POST", "/threads/t2/archive", {"agentId": "default"}) == (
        200, {"id": "t2", "archived": True})
    assert await answer(served, "POST", "/threads/t3/archive", {}) == (
        200, {"id": "t3", "archived": True})
    # Archived threads are left out of the list unless asked for, pages walked exactly.
    assert await listed(served, "&agentId=default") == [("t4", False), ("t1", False)]
    assert await listed(served, "&includeArchived=false") == [("t4", False), ("t1", False)]
    assert await listed(served, "&agentId=default&includeArchived=true") == [
        ("t4", False), ("t3", True), ("t2", True), ("t1", False)]
    # Archived, a thread is still read.
    assert (await answer(served, "GET", "/threads/t2/messages"))[0] == 200
    assert await answer(served, "PATCH", "/threads/t2", {"agentId": "default",
                                                         "archived": False}) == (
        200, {"id": "t2", "archived": False})
    assert await answer(served, "PATCH", "/threads/t3", {"name": "Old", "archived": True}) == (
        200, {"id": "t3", "name": "Old", "archived": True})
    assert await listed(served, "&includeArchived=true") == [
        ("t4", False), ("t3", True), ("t2", False), ("t1", False)]
    assert await listed(served) == [("t4", False), ("t2", False), ("t1", False)]
    _, body = await answer(served, "GET", "/threads?includeArchived=true")
    assert [(t["id"], t["name"]) for t in body["threads"]][1] == ("t3", "Old")


async def test_wrong_bodies_and_another_agents_thread(served: Served) -> None:
    await resume.run_ids(served, "t", "hello", "r1")
    for body in ({"agentId": 5, "name": "x"}, {"agentId": "default"}, {}, {"archived": "yes"},
                 {"archived": None}, {"archived": 1}, {"name": "x", "extra": 1}, [],
                 {"agentId": None, "name": "x"}):
        status, error = await answer(served, "PATCH", "/threads/t", body)
        assert status == 400, body
        assert "agentId" in error["error"], body
        assert "archived" in error["error"], body
    for body in ({"agentId": 5}, {"archived": True}, {"name": "x"}, ["default"]):
        status, error = await answer(served, "POST", "/threads/t/archive", body)
        assert status == 400, body
        assert "agentId" in error["error"], body
    for query in ("?includeArchived=yes", "?includeArchived=true&includeArchived=false"):
        assert (await answer(served, "GET", "/threads" + query))[0] == 400, query
    # A thread of another agent is not found, as the agent's list leaves it out.
    missing = await answer(served, "PATCH", "/threads/nope", {"name": "x"})
    assert missing[0] == 404
    for method, path, body in (("PATCH", "/threads/t", {"agentId": "other", "name": "x"}),
                               ("PATCH", "/threads/t", {"agentId": "other",
                                                        "archived": True}),
                               ("POST", "/threads/t/archive", {"agentId": "other"})):
        status, error = await answer(served, method, path, body)
        assert (status, error["code"]) == (404, "THREAD_NOT_FOUND"), (method, body)
    assert await answer(served, "POST", "/threads/nope/archive", {}) == missing
    assert (await answer(served, "GET", "/threads/t/archive"))[0] == 405
    assert await listed(served, "&includeArchived=true") == [("t", False)]


class OwnStore:
    """A store of an application's own, written before stores archived: no `archive`, and a
    `list` without `include_archived`."""

    def __init__(self) -> None:
        self.inner = InMemoryThreadStore()

    def __getattr__(self, name: str) -> Any:
        if name == "archive":
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: Any = None, offset: int = 0, after: Any = None
                   ) -> list[ThreadRecord]:
        return await self.inner.list(agent_id, limit, owner=owner, offset=offset, after=after)


async def test_a_store_without_archive_says_so(serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                             thread_store=OwnStore())  # type: ignore[arg-type]
    async with serve_runtime(runtime) as s:
        await resume.run_ids(s, "t", "hello", "r1")
        status, body = await answer(s, "POST", "/threads/t/archive", {"agentId": "default"})
        assert (status, body["code"]) == (501, "NOT_IMPLEMENTED")
        assert body["message"] == "This runtime's thread store cannot archive threads"
        assert (await answer(s, "PATCH", "/threads/t", {"archived": False}))[0] == 501
        assert await answer(s, "PATCH", "/threads/t", {"agentId": "default", "name": "a"}) == (
            200, {"id": "t", "name": "a"})
        assert await listed(s, "&includeArchived=true") == [("t", False)]
        assert await listed(s) == [("t", False)]


async def test_the_real_clients_thread_store(served: Served) -> None:
    """`@copilotkit/core`'s own thread store renames, archives, unarchives and deletes a
    thread, and lists it as each left it, with and without archived threads."""
    for thread in ("t1", "t2"):
        await resume.run_ids(served, thread, "hello", "r1")
    result = await resume.drive("thread_store", served.url, threadId="t1")
    assert [(m["method"], m["path"], m["body"], m["status"]) for m in result["mutations"]] == [
        ("PATCH", "/threads/t1", {"agentId": "default", "name": "My trip"}, 200),
        ("POST", "/threads/t1/archive", {"agentId": "default"}, 200),
        ("PATCH", "/threads/t1", {"agentId": "default", "archived": False}, 200),
        ("DELETE", "/threads/t1", {"agentId": "default"}, 200)]
    assert result["errors"] == []
    assert result["lists"] == {
        "renamed": [["t2", None, False], ["t1", "My trip", False]],
        "archived": [["t2", None, False]],
        "archivedIncluded": [["t2", None, False], ["t1", "My trip", True]],
        "unarchived": [["t2", None, False], ["t1", "My trip", False]],
        "deleted": [["t2", None, False]],
    }


async def test_the_clients_delete_of_another_agents_thread_is_a_404(served: Served) -> None:
    """`@copilotkit/core` sends `{"agentId"}` with a DELETE as with a PATCH. Before: the
    DELETE never read it, and deleted another agent's thread that PATCH and archive 404."""
    for thread in ("t1", "t2", "t3"):
        await resume.run_ids(served, thread, "hello", "r1")
    status, error = await answer(served, "DELETE", "/threads/t1", {"agentId": "other"})
    assert (status, error["code"]) == (404, "THREAD_NOT_FOUND")
    for body in ({"agentId": 5}, {"agentId": None}, {"name": "x"}, ["default"], "default"):
        status, error = await answer(served, "DELETE", "/threads/t1", body)
        assert status == 400, body
        assert "agentId" in error["error"], body
    response = await served.session.request(
        "DELETE", served.url + "/threads/t1", data=b"{not json",
        headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert await listed(served, "&includeArchived=true") == [
        ("t3", False), ("t2", False), ("t1", False)]
    assert await answer(served, "DELETE", "/threads/t1", {"agentId": "default"}) == (
        200, {"deleted": True, "id": "t1"})
    assert await answer(served, "DELETE", "/threads/t2", {}) == (
        200, {"deleted": True, "id": "t2"})
    assert await answer(served, "DELETE", "/threads/t3") == (200, {"deleted": True, "id": "t3"})
    assert await listed(served, "&includeArchived=true") == []


def test_thread_records_fields_keep_their_positions() -> None:
    """An application's store may build its records by position. Before: `archived` went in
    between `name` and `title`, so such a store's title read as `archived` and its next
    position as the title."""
    assert [f.name for f in fields(ThreadRecord)] == [
        "thread_id", "agent_id", "created_at", "updated_at", "runs", "message_ids", "owner",
        "name", "title", "next_position", "omitted_runs", "open_run", "kept_state", "earlier",
        "archived"]
    record = ThreadRecord("t", "default", 1.0, 2.0, [], set(), None, "Trip", "Plan my trip",
                          49)
    assert (record.title, record.next_position, record.archived) == ("Plan my trip", 49, False)


class PositionalStore:
    """A store of an application's own that builds its records by position, as from a row."""

    def __init__(self) -> None:
        self.inner = InMemoryThreadStore()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: Any = None, offset: int = 0, after: Any = None,
                   include_archived: bool = True) -> list[ThreadRecord]:
        rows = await self.inner.list(agent_id, limit, owner=owner, offset=offset, after=after,
                                     include_archived=include_archived)
        return [ThreadRecord(r.thread_id, r.agent_id, r.created_at, r.updated_at, [], set(),
                             r.owner, r.name, r.title, r.next_position) for r in rows]


async def test_a_store_building_records_by_position_lists_them(
        serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                             thread_store=PositionalStore())  # type: ignore[arg-type]
    async with serve_runtime(runtime) as s:
        await resume.run_ids(s, "t", "Plan my trip", "r1")
        _, body = await answer(s, "GET", "/threads")
        assert [(t["id"], t["title"], t["archived"]) for t in body["threads"]] == [
            ("t", "Plan my trip", False)]


class ArchiveWithOldList(OwnStore):
    """A store of an application's own given `archive`, its `list` still without
    `include_archived`: it could not leave its archived threads out of a list."""

    async def archive(self, thread_id: str, archived: bool = True, *,
                      owner: Any = None) -> bool:
        return await self.inner.archive(thread_id, archived, owner=owner)


async def test_a_store_that_archives_but_cannot_list_without_runs_and_is_warned_of() -> None:
    """Before: accepted silently, its archived threads in every default list; then refused
    at construction, which stopped a wrapper (its `archive` showing through `__getattr__`)
    that ran before archives existed (a review)."""
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                             thread_store=ArchiveWithOldList())  # type: ignore[arg-type]
    with capture_logs() as logs:
        await runtime.start()
    await runtime.aclose()
    assert [log["fix"] for log in logs if "include_archived" in log.get("fix", "")] == [
        "give its list() an include_archived keyword (README)"]


class ArchiveWithoutOwner(PositionalStore):
    """A store of an application's own whose `archive` (and not `rename`) takes no owner."""

    async def archive(self, thread_id: str, archived: bool = True) -> bool:
        return await self.inner.archive(thread_id, archived)


async def test_an_archive_without_the_owners_condition_is_warned_of() -> None:
    """The README says the runtime warns at start of a `rename` or `archive` without `owner=`;
    before, it warned only of `rename`."""
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                             thread_store=ArchiveWithoutOwner(),  # type: ignore[arg-type]
                             auth=BearerTokenAuth({"tok-alice-0001": "alice"}))
    with capture_logs() as logs:
        await runtime.start()
    await runtime.aclose()
    assert [(log["event"], log["fix"]) for log in logs if "owner" in log.get("fix", "")] == [
        ("thread store archives without the owner's condition",
         "give its archive(thread_id, archived) an owner= keyword (README)")]


class OldStore:
    """A store of an application's own written before archives: no `archive`, its `list`
    and `delete` without this session's keywords."""

    def __init__(self) -> None:
        self.inner = InMemoryThreadStore()

    def __getattr__(self, name: str) -> Any:
        if name == "archive":
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: Any = None, offset: int = 0, after: Any = None) -> list[ThreadRecord]:
        return await self.inner.list(agent_id, limit, owner=owner, offset=offset, after=after)

    async def delete(self, thread_id: str, *, updated_before: float | None = None) -> bool:
        return await self.inner.delete(thread_id, updated_before=updated_before)


class Counting:
    """A wrapper that passes every call on (`**kwargs`), counting them."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    async def list(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return await self.inner.list(*args, **kwargs)

    async def delete(self, thread_id: str, **kwargs: Any) -> Any:
        self.calls += 1
        return await self.inner.delete(thread_id, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_wrapper_passing_keywords_on_to_an_old_store_lists_and_deletes() -> None:
    """Before: the runtime took `**kwargs` for taking `include_archived` and `next_position`:
    every default list and every delete was a 500 (a review)."""
    store = Counting(OldStore())
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store)  # type: ignore[arg-type]
    app = create_app(runtime)
    await runtime.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as client:
        ran = await client.post("/copilotkit/agent/default/run",
                                json=run_input("hi", thread="t-old"))
        assert ran.status_code == 200
        listed = await client.get("/copilotkit/threads?agentId=default")
        assert listed.status_code == 200, listed.text
        assert [t["id"] for t in listed.json()["threads"]] == ["t-old"]
        deleted = await client.delete("/copilotkit/threads/t-old")
        assert deleted.status_code == 200, (deleted.text, store.calls)
    await runtime.aclose()
    assert store.calls >= 2


async def test_a_delete_reads_its_body_before_saying_the_thread_is_busy(
        serve_runtime: ServeRuntime, tmp_path: Any) -> None:
    """Before: while a run was on the thread, another agent's delete and a malformed body
    were both 409 (busy); idle, they are 404 and 400, as PATCH answers (a review)."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent},
                             thread_store=SQLiteThreadStore(str(tmp_path / "t.sqlite3")))
    async with serve_runtime(runtime) as served:
        running = await served.post("/agent/default/run", run_input("hi", thread="t-busy"))
        await running.content.readuntil(b"TEXT_MESSAGE_CONTENT")
        other = await call(served, "DELETE", "/threads/t-busy", None, {"agentId": "other"})
        malformed = await call(served, "DELETE", "/threads/t-busy", None, [1])
        mine = await call(served, "DELETE", "/threads/t-busy", None, {"agentId": "default"})
        agent.gate.set()
        await running.read()
    assert (other[0], malformed[0], mine[0]) == (404, 400, 409)
