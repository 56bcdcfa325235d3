"""Ids and text no store can keep as they are: NUL and other control characters, ids longer
than `MAX_ID_LENGTH`. PostgreSQL's text cannot hold NUL, and its index entries cannot hold
long incompressible keys, so before this every such request failed there (a 500, or worse, a
run streamed to its end and then silently not stored) while memory and SQLite took it.

Every store now answers the same: an id that cannot be stored is refused where it names a
thread or run to make (400), is a thread that does not exist where it names one to read
(404), and message ids and text inside a run (which agents make and clients send back) are
kept as far as a store can keep them, so the run is stored and stays readable.

Thread, run and user ids are refused the characters names are too (C1 controls, line and
paragraph separators, bidirectional overrides): every store could keep them, but an id is
shown in logs and thread lists, where they break the line or make it read as another id.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yarl

from copilot_runtime import CopilotRuntime, coordinator, thread_store
from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.threads import MAX_ID_LENGTH, StoredRun
from copilot_runtime.workflows.accounts import account_review
from tests.conftest import Served, ServeRuntime, openai_runtime, parse_sse, run_input, types
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, user_turn
from tests.hitl_support.postgres import postgres_schema

pytestmark = pytest.mark.timeout(60)

# Random enough that PostgreSQL cannot compress it into an index entry (2,704 bytes at most).
_LONG = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(MAX_ID_LENGTH + 1))
BAD_IDS = {"nul": "t\x00x", "newline": "a\nb", "long": _LONG,
           # Storable, but shown in logs and lists: a terminal escape, and an id that reads
           # as another one ("user-\u202eabc" shows as "user-cba").
           "c1": "a\x9b2Jb", "bidi": "user-\u202eabc"}
_PROBLEMS = {"long": f"The id is longer than {MAX_ID_LENGTH} characters",
             "c1": "The id contains a line separator or a character that reorders text",
             "bidi": "The id contains a line separator or a character that reorders text"}


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_schema() as url:
        yield url


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
async def served(request: pytest.FixtureRequest, llm: MockOpenAIServer, tmp_path: Path,
                 serve_runtime: ServeRuntime) -> AsyncIterator[Served]:
    if request.param == "postgresql":
        url = request.getfixturevalue("pg_url")
        options: dict[str, Any] = {"thread_store": thread_store(url),
                                   "coordinator": coordinator(url)}
    elif request.param == "sqlite":
        options = {"thread_store": thread_store(f"sqlite:///{tmp_path / 'threads.db'}")}
    else:
        options = {}
    async with serve_runtime(openai_runtime(llm, **options)) as s:
        yield s


async def _answer(served: Served, method: str, path: str, body: Any = None,
                  headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    data = None if body is None else orjson.dumps(body)
    async with served.session.request(method, served.url + path, data=data, headers={
            "Content-Type": "application/json", **(headers or {})}) as response:
        return response.status, await response.read()


async def _still_serves(served: Served, thread: str) -> None:
    events = await served.run(run_input("still there?", thread=thread, run="after"))
    assert types(events)[-1] == "RUN_FINISHED"


@pytest.mark.parametrize("bad", sorted(BAD_IDS))
async def test_an_id_no_store_can_keep_is_refused_or_not_found(served: Served, bad: str) -> None:
    value = BAD_IDS[bad]
    quoted = urllib.parse.quote(value, safe="")
    for field in ("threadId", "runId", "parentRunId"):
        body = run_input("hi", thread="fine", run="r1", **{field: value})
        for route in ("run", "connect"):
            status, answer = await _answer(served, "POST", f"/agent/default/{route}", body)
            assert status == 400, (field, route, answer)
            details = orjson.loads(orjson.loads(answer)["details"])
            assert details == [{"path": [field], "code": "invalid_id", "message":
                                _PROBLEMS.get(bad, "The id contains a control character")}]
    # Reading, renaming or deleting it: a thread that does not exist.
    reads: list[tuple[str, str, Any]] = [
        ("GET", f"/threads/{quoted}/messages", None), ("GET", f"/threads/{quoted}/events", None),
        ("GET", f"/threads/{quoted}/state", None), ("PATCH", f"/threads/{quoted}", {"name": "x"}),
        ("DELETE", f"/threads/{quoted}", None)]
    for method, path, change in reads:
        status, answer = await _answer(served, method, path, change)
        assert status == 404, (method, path, answer)
        assert orjson.loads(answer)["error"] == "Thread not found"
    # Stopping it: no run there.
    status, answer = await _answer(served, "POST", f"/agent/default/stop/{quoted}")
    assert status in (200, 404), answer
    status, answer = await _answer(served, "POST", "", {
        "method": "agent/stop", "params": {"agentId": "default", "threadId": value}})
    assert status in (200, 404), answer
    # Listing an agent by it: no threads.
    status, answer = await _answer(served, "GET", f"/threads?agentId={quoted}")
    assert (status, orjson.loads(answer)["threads"]) == (200, [])
    # GraphQL: a chat on it is refused, loading it finds nothing.
    status, answer = await _answer(served, "POST", "", {
        "query": "query load($data: LoadAgentStateInput!) { loadAgentState(data: $data) "
                 "{ threadId threadExists } }",
        "variables": {"data": {"threadId": value, "agentName": "default"}}},
        headers=CLIENT_HEADERS)
    assert status == 200, answer
    assert orjson.loads(answer)["data"]["loadAgentState"]["threadExists"] is False
    status, answer = await _answer(served, "POST", "", {
        "query": CHAT_DOCUMENT, "variables": {"data": user_turn("hi", thread=value)}},
        headers=CLIENT_HEADERS)
    assert status == 200, answer
    (error,) = orjson.loads(answer)["errors"]
    # What was wrong, as AG-UI's `details` say it (it said "Invalid request body" alone).
    problem = _PROBLEMS.get(bad, "The id contains a control character")
    assert (error["message"], error["extensions"]["statusCode"]) == (
        f"Invalid request body: threadId: {problem}", 400)
    await _still_serves(served, f"after-{bad}")


@pytest.mark.parametrize("dots", [".", ".."])
async def test_a_dot_segment_is_no_id(served: Served, dots: str) -> None:
    """Before: threads "." and ".." were made by a run, but a client that reads URLs as
    browsers do takes `/threads/%2E%2E/messages` for `/messages`: such a thread could never
    be read, renamed or deleted. Such ids are refused as any id a URL cannot carry."""
    problem = "The id is '.' or '..', which a URL cannot carry as a path segment"
    for field in ("threadId", "runId", "parentRunId"):
        body = run_input("hi", thread="fine", run="r1", **{field: dots})
        for route in ("run", "connect"):
            status, answer = await _answer(served, "POST", f"/agent/default/{route}", body)
            assert status == 400, (field, route, answer)
            assert orjson.loads(orjson.loads(answer)["details"]) == [
                {"path": [field], "code": "invalid_id", "message": problem}]
    status, answer = await _answer(served, "POST", "", {
        "query": CHAT_DOCUMENT, "variables": {"data": user_turn("hi", thread=dots)}},
        headers=CLIENT_HEADERS)
    (error,) = orjson.loads(answer)["errors"]
    assert (error["message"], error["extensions"]["statusCode"]) == (
        f"Invalid request body: threadId: {problem}", 400)
    status, answer = await _answer(served, "GET", "/threads")
    assert not {t["id"] for t in orjson.loads(answer)["threads"]} & {".", ".."}
    for near in ("...", ".a", "a.", "a..b"):  # only the two segments URLs drop
        assert types(await served.run(run_input("hi", thread=near, run="r1")))[-1] \
            == "RUN_FINISHED", near


async def test_an_empty_id_is_no_new_id(served: Served) -> None:
    """Before: a run made thread "", which no route could name (`/threads/` is the list,
    `/stop/` and the envelope's "threadId": "" are refused), so it could never be deleted,
    renamed or stopped. AG-UI refuses it as "." and ".."; the GraphQL edge, as the 1.10
    runtime did, takes an empty threadId for none and starts a new thread."""
    problem = "The id is empty, which a URL cannot carry as a path segment"
    for field in ("threadId", "runId", "parentRunId"):
        body = run_input("hi", thread="fine", run="r1", **{field: ""})
        for route in ("run", "connect"):
            status, answer = await _answer(served, "POST", f"/agent/default/{route}", body)
            assert status == 400, (field, route, answer)
            assert orjson.loads(orjson.loads(answer)["details"]) == [
                {"path": [field], "code": "invalid_id", "message": problem}]
    status, answer = await _answer(served, "GET", "/threads")
    before = {t["id"] for t in orjson.loads(answer)["threads"]}  # (PostgreSQL's are kept)
    status, answer = await _answer(served, "POST", "", {
        "query": CHAT_DOCUMENT, "variables": {"data": user_turn("hi", thread="")}},
        headers=CLIENT_HEADERS)
    assert status == 200, answer
    assert b'"errors"' not in answer, answer
    status, answer = await _answer(served, "GET", "/threads")
    (made,) = {t["id"] for t in orjson.loads(answer)["threads"]} - before
    assert made, made
    status, answer = await _answer(served, "DELETE", f"/threads/{made}")
    assert status == 200, answer


async def test_a_suggestions_thread_prefix_is_no_clients_id(served: Served) -> None:
    """The runtime runs suggestions on threads of this prefix and hides their approvals:
    a client's thread so named had its approvals hidden too."""
    for route in ("run", "connect", "suggest"):
        status, answer = await _answer(served, "POST", f"/agent/default/{route}", run_input(
            "hi", thread="copilot-suggestion-mine", run="r1"))
        assert status == 400, (route, answer)
        assert orjson.loads(orjson.loads(answer)["details"]) == [{
            "path": ["threadId"], "code": "invalid_id", "message": "The id begins with "
            "'copilot-suggestion-', which the runtime keeps for itself"}]
    assert types(await served.run(run_input("hi", thread="my-copilot-suggestion-x",
                                            run="r1")))[-1] == "RUN_FINISHED"


async def test_a_dot_thread_kept_before_stays_reachable(served: Served) -> None:
    """Only a run's new ids are held to it: a thread "." a store kept from before (when runs
    could make one) is listed and paged past, loaded, read and deleted as any other."""
    kept = [ev.run_started(".", "r", {"threadId": ".", "runId": "r", "messages": [
        {"id": "u-dot", "role": "user", "content": "dot"}]}), ev.run_finished(".", "r")]
    store = served.runtime.store
    await store.append_run(".", "default", StoredRun("r", compact_events(kept), time.time(),
                                                       0, 0, 1), [])
    await _still_serves(served, "older")
    await store.append_run(".", "default", StoredRun("r2", compact_events(
        [ev.run_started(".", "r2", {"threadId": ".", "runId": "r2", "messages": []}),
         ev.run_finished(".", "r2")]), time.time() + 1, 0, 0, 1), [])
    status, answer = await _answer(served, "GET", "/threads?limit=1")
    page = orjson.loads(answer)
    assert [t["id"] for t in page["threads"]] == ["."]
    status, answer = await _answer(served, "GET", f"/threads?limit=1&cursor={page['nextCursor']}")
    assert status == 200, answer
    assert [t["id"] for t in orjson.loads(answer)["threads"]] == ["older"]
    status, answer = await _answer(served, "POST", "", {
        "query": "query load($data: LoadAgentStateInput!) { loadAgentState(data: $data) "
                 "{ threadExists } }", "variables": {"data": {"threadId": ".",
                                                             "agentName": "default"}}},
        headers=CLIENT_HEADERS)
    assert orjson.loads(answer)["data"]["loadAgentState"]["threadExists"] is True
    for method, status_wanted in (("GET", 200), ("DELETE", 200), ("GET", 404)):
        url = yarl.URL(served.url + "/threads/%2E" + ("/messages" if method == "GET" else ""),
                       encoded=True)
        async with served.session.request(method, url) as response:
            assert response.status == status_wanted, (method, await response.text())


async def test_control_characters_and_long_ids_inside_a_run_are_stored(served: Served) -> None:
    body = run_input("hi\x00 there\x01", thread="inside", run="r1")
    body["messages"] = [
        {"id": "u\x00nul", "role": "user", "content": "hi\x00 there\x01"},
        {"id": _LONG, "role": "assistant", "content": "an earlier answer"},
        {"id": "u-2", "role": "user", "content": "and\x00 again"}]
    events = await served.run(body)
    assert types(events)[-1] == "RUN_FINISHED"
    status, answer = await _answer(served, "GET", "/threads")
    listed = {t["id"]: t for t in orjson.loads(answer)["threads"]}
    assert listed["inside"]["title"] == "hi there"
    status, answer = await _answer(served, "GET", "/threads/inside/messages")
    assert status == 200, answer
    contents = [m.get("content") for m in orjson.loads(answer)["messages"]]
    assert contents[:3] == ["hi\x00 there\x01", "an earlier answer", "and\x00 again"]
    # The same messages again, and one more: the thread keeps working.
    body["runId"] = "r2"
    body["messages"].append({"id": "u-3", "role": "user", "content": "more"})
    events = await served.run(body)
    assert types(events)[-1] == "RUN_FINISHED"
    status, answer = await _answer(served, "POST", "/agent/default/connect",
                                   run_input("", thread="inside", run="c"))
    replayed = parse_sse(answer)
    assert [e["runId"] for e in replayed if e["type"] == "RUN_STARTED"] == ["r1", "r2"]


async def test_a_name_with_control_characters_is_refused(served: Served) -> None:
    await served.run(run_input("hi", thread="named", run="r1"))
    for name in ("x\x00y", "line\nbreak"):
        status, answer = await _answer(served, "PATCH", "/threads/named", {"name": name})
        assert status == 400, answer
        assert b"control characters" in answer
    status, answer = await _answer(served, "PATCH", "/threads/named", {"name": "fine"})
    assert status == 200, answer


async def test_approval_routes_on_postgres_refuse_what_the_ledger_cannot_keep(
        pg_url: str, serve_runtime: ServeRuntime) -> None:
    saver = checkpointer(pg_url)
    runtime = CopilotRuntime(agents={"accounts": account_review().agent(
        name="accounts", checkpointer=saver)})
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/accounts/run", run_input(
            "Review account GLOBEX-002", thread="review", protocolVersion="1.0"))
        assert b'"type":"interrupt"' in await response.read()
        status, answer = await _answer(served, "GET", "/approvals")
        (approval,) = orjson.loads(answer)["approvals"]
        for value in BAD_IDS.values():
            quoted = urllib.parse.quote(value, safe="")
            for method in ("GET", "POST"):
                status, answer = await _answer(served, method, f"/approvals/{quoted}",
                                               {"action": "approve"})
                assert status == 404, (method, answer)
            for query in ("threadId", "agentId"):
                status, answer = await _answer(served, "GET", f"/approvals?{query}={quoted}")
                assert (status, orjson.loads(answer)) == (
                    200, {"approvals": [], "nextCursor": None})
            status, answer = await _answer(served, "POST", f"/approvals/{approval['id']}",
                                           {"action": "approve", "userId": value})
            assert status == 400, answer
            assert b"userId must be" in answer
        status, answer = await _answer(served, "POST", f"/approvals/{approval['id']}",
                                       {"action": "approve", "userId": "reviewer-1"})
        assert status == 200, answer
        assert orjson.loads(answer)["approval"]["answeredBy"] == "reviewer-1"
