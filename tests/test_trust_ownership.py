"""Two users on one runtime, over real HTTP: each tries every route and GraphQL operation on
the other's threads and approvals. Someone else's thread answers exactly as a thread that
does not exist, and nothing of it changes. Missing and bad tokens get 401, never 500."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from copilot_runtime import (
    BearerTokenAuth,
    CopilotRuntime,
    OpenAIAdapter,
    Principal,
    SQLiteThreadStore,
)
from copilot_runtime.agents import BuiltInAgent
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.runtime import approval_service
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.threads import ThreadOwner
from copilot_runtime.workflows.review_loop import ReviewLoop
from tests.conftest import Served, ServeRuntime, parse_sse, run_input, text_of, types
from tests.test_hitl_agui import Drafting
from tests.test_trust_hooks_telemetry import wait_for

ALICE, BOB, CAROL, MALLORY = ("tok-alice-0001", "tok-bob-00002", "tok-carol-0003",
                              "tok-mallory-04")
TOKENS = {
    ALICE: "alice",
    BOB: "bob",
    # An approver of alice's tenant-less deployment; mallory has the role in another tenant.
    CAROL: Principal("carol", roles=frozenset({"approver"})),
    MALLORY: Principal("mallory", tenant="other", roles=frozenset({"approver"})),
}


def auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@pytest.fixture
async def two_users(serve_runtime: ServeRuntime, llm: MockOpenAIServer, tmp_path: Path
                    ) -> AsyncIterator[Served]:
    saver = checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3")
    runtime = CopilotRuntime(
        agents={
            "default": BuiltInAgent(OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock",
                                                  max_retries=0)),
            "review": ReviewLoop([Drafting(n) for n in ("Invoice", "Closing", "Audit")]).agent(
                name="review", checkpointer=saver),
        },
        thread_store=SQLiteThreadStore(tmp_path / "threads.sqlite3"),
        auth=BearerTokenAuth(TOKENS), approver_roles={"approver"})
    async with serve_runtime(runtime) as served:
        yield served
        await approval_service(runtime).aclose()


async def call(served: Served, method: str, path: str, token: str | None,
               body: Any = None, headers: dict[str, str] | None = None
               ) -> tuple[int, bytes, dict[str, str]]:
    data = orjson.dumps(body) if body is not None else None
    response = await served.session.request(
        method, served.url + path, data=data,
        headers={"Content-Type": "application/json", **auth(token), **(headers or {})})
    return response.status, await response.read(), dict(response.headers)


async def run_as(served: Served, token: str, thread: str, text: str = "Hello",
                 agent: str = "default", run: str | None = None) -> list[dict[str, Any]]:
    status, body, _ = await call(served, "POST", f"/agent/{agent}/run", token,
                                 run_input(text, thread=thread, run=run or f"{thread}-r"))
    assert status == 200, body
    return parse_sse(body)


async def snapshot(served: Served, thread: str) -> Any:
    record = await served.runtime.store.get(thread)
    return None if record is None else (copy.deepcopy(record.runs), set(record.message_ids),
                                        record.owner)


# -- authentication ----------------------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer nope-nope-nope"}, {"Authorization": "Basic YWxpY2U6eA=="},
    {"Authorization": "Bearer"}, {"Authorization": "Bearer " + ALICE + "x"}])
async def test_missing_and_bad_tokens_get_401(two_users: Served,
                                              headers: dict[str, str]) -> None:
    served = two_users
    for method, path, body in [
            ("GET", "/info", None), ("POST", "/agent/default/run", run_input("hi")),
            ("POST", "/agent/default/connect", run_input("hi")), ("GET", "/threads", None),
            ("GET", "/threads/t/messages", None), ("GET", "/approvals", None),
            ("POST", "/agent/default/stop/t", {}), ("POST", "", {"method": "info"}),
            ("POST", "", {"query": "{ hello }"})]:
        response = await served.session.request(
            method, served.url + path, data=orjson.dumps(body) if body else None,
            headers={"Content-Type": "application/json", **headers})
        assert response.status == 401, (path, await response.text())
        assert response.headers["www-authenticate"].startswith("Bearer")
        payload = await response.json()
        assert payload["error"] == "Unauthorized"
        assert payload["code"] == "AUTHENTICATION_ERROR"
    # The 1.10 GraphQL client gets its own error form, with 200 (it reads no error answer
    # from 400 to 500); a CORS preflight needs no token.
    status, body, headers = await call(served, "POST", "", None, {"query": "{ hello }"},
                                       {"X-CopilotKit-Runtime-Client-GQL-Version": "1.10.6"})
    assert status == 200
    assert {k.lower(): v for k, v in headers.items()}["www-authenticate"].startswith("Bearer")
    extensions = orjson.loads(body)["errors"][0]["extensions"]
    assert (extensions["code"], extensions["statusCode"]) == ("AUTHENTICATION_ERROR", 401)
    preflight = await served.session.options(served.url + "/info", headers={
        "Origin": "http://app", "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "authorization"})
    assert preflight.status == 204
    assert served.runtime.store is not None
    assert await served.runtime.store.list() == []


# -- AG-UI: every route on someone else's thread --------------------------------------------

async def test_every_agui_route_on_anothers_thread_is_404(two_users: Served,
                                                          llm: MockOpenAIServer) -> None:
    served = two_users
    events = await run_as(served, ALICE, "alice-1", "Hello from Alice")
    assert text_of(events) == "echo: Hello from Alice"
    record = await served.runtime.store.get("alice-1")
    assert record is not None
    assert record.owner == ThreadOwner("alice")
    before = await snapshot(served, "alice-1")
    calls = len(llm.requests)

    async def as_both(method: str, path: str, body: Any = None
                      ) -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        """Bob on alice's thread, and bob on a thread that does not exist."""
        status, data, _ = await call(served, method, path, BOB, body)
        other = path.replace("alice-1", "ghost-1")
        other_body = orjson.loads(orjson.dumps(body).replace(b"alice-1", b"ghost-1")) if (
            body is not None) else None
        ghost_status, ghost_data, _ = await call(served, method, other, BOB, other_body)
        return (status, data.replace(b"alice-1", b"ghost-1")), (ghost_status, ghost_data)

    # Reading: the same 404 as for no thread at all.
    for what in ("messages", "events", "state"):
        mine, ghost = await as_both("GET", f"/threads/alice-1/{what}")
        assert mine == ghost
        assert mine[0] == 404
        assert orjson.loads(mine[1])["error"] == "Thread not found"
    # Stop: 404 for both.
    mine, ghost = await as_both("POST", "/agent/default/stop/alice-1", {})
    assert mine == ghost
    assert mine[0] == 404
    # Connect: nothing to replay, as for a thread never run (clients connect to new threads).
    mine, ghost = await as_both("POST", "/agent/default/connect",
                                run_input("", thread="alice-1"))
    assert mine == ghost
    assert mine[0] == 200
    assert parse_sse(mine[1]) == []
    # Run: 404 (a new thread id would start a thread of bob's own).
    status, body, _ = await call(served, "POST", "/agent/default/run", BOB,
                                 run_input("Bob was here", thread="alice-1", run="b1"))
    assert status == 404
    assert orjson.loads(body)["error"] == "Thread not found"
    # The single-route envelope: the same answers.
    for method, extra in [("agent/run", {"body": run_input("x", thread="alice-1")}),
                          ("agent/stop", {}), ("agent/connect",
                                               {"body": run_input("", thread="alice-1")})]:
        status, body, _ = await call(served, "POST", "", BOB, {
            "method": method, "params": {"agentId": "default", "threadId": "alice-1"},
            **extra})
        if method == "agent/connect":
            assert (status, parse_sse(body)) == (200, [])
        else:
            assert status == 404, (method, body)
    # Lists show only one's own threads.
    await run_as(served, BOB, "bob-1", "Hello from Bob")
    status, body, _ = await call(served, "GET", "/threads", BOB)
    assert [t["id"] for t in orjson.loads(body)["threads"]] == ["bob-1"]
    status, body, _ = await call(served, "GET", "/threads?agentId=default", ALICE)
    assert [t["id"] for t in orjson.loads(body)["threads"]] == ["alice-1"]
    # Nothing of alice's changed, and the model saw only bob's own message.
    assert await snapshot(served, "alice-1") == before
    assert len(llm.requests) == calls + 1
    # Alice still has her thread.
    status, body, _ = await call(served, "GET", "/threads/alice-1/messages", ALICE)
    assert status == 200
    assert [m["content"] for m in orjson.loads(body)["messages"]] == [
        "Hello from Alice", "echo: Hello from Alice"]
    status, body, _ = await call(served, "POST", "/agent/default/connect", ALICE,
                                 run_input("", thread="alice-1"))
    assert "RUN_STARTED" in types(parse_sse(body))


async def test_reading_anothers_thread_does_not_load_it(
        two_users: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bob's 404 on alice's thread came after the whole thread was read (up to 32 MiB of
    events, each time he asked, and slower than for an unknown id). Its owner is checked
    first now."""
    served = two_users
    await run_as(served, ALICE, "alice-1", "Hello from Alice")
    store = served.runtime.store
    read: list[str] = []
    get = store.get

    async def counted_get(thread_id: str, *args: Any, **kwargs: Any) -> Any:
        read.append(thread_id)
        return await get(thread_id, *args, **kwargs)

    monkeypatch.setattr(store, "get", counted_get)
    for method in ("GET", "HEAD"):
        for what in ("messages", "events", "state"):
            status, _, _ = await call(served, method, f"/threads/alice-1/{what}", BOB)
            assert (method, what, status) == (method, what, 404)
    assert read == []
    status, _, _ = await call(served, "GET", "/threads/alice-1/messages", ALICE)
    assert (status, read) == (200, ["alice-1"])


async def test_a_thread_in_flight_is_private_before_its_first_write(
        two_users: Served) -> None:
    served = two_users
    running = asyncio.create_task(run_as(served, ALICE, "alice-live", "slow:100 a b c d e"))
    for _ in range(200):
        if "alice-live" in served.runtime.runs.active:
            break
        await asyncio.sleep(0.01)
    assert await served.runtime.store.get("alice-live") is None  # not written yet
    status, _, _ = await call(served, "POST", "/agent/default/run", BOB,
                              run_input("mine now", thread="alice-live", run="b2"))
    assert status == 404  # not 409: that would say the thread exists
    status, _, _ = await call(served, "POST", "/agent/default/stop/alice-live", BOB, {})
    assert status == 404
    status, body, _ = await call(served, "POST", "/agent/default/connect", BOB,
                                 run_input("", thread="alice-live"))
    assert (status, parse_sse(body)) == (200, [])
    # Alice's own second run on it is busy (409), and her run was not stopped.
    status, _, _ = await call(served, "POST", "/agent/default/run", ALICE,
                              run_input("again", thread="alice-live", run="a2"))
    assert status == 409
    events = await running
    assert types(events)[-1] == "RUN_FINISHED"
    assert "a b c d e" in text_of(events)


# -- approvals ---------------------------------------------------------------------------

async def test_approvals_are_the_owners_and_the_approvers(two_users: Served) -> None:
    served = two_users
    events = await run_as(served, ALICE, "alice-review", "Prepare the invoice", agent="review")
    assert any(e.get("name") == "on_interrupt" for e in events)
    status, body, _ = await call(served, "GET", "/approvals", ALICE)
    (pending,) = orjson.loads(body)["approvals"]
    approval_id = pending["id"]
    for token in (BOB, MALLORY):  # mallory is an approver, of another tenant
        status, body, _ = await call(served, "GET", "/approvals", token)
        assert (status, orjson.loads(body)["approvals"]) == (200, [])
        status, body, _ = await call(served, "GET", "/approvals?threadId=alice-review", token)
        assert orjson.loads(body)["approvals"] == []
        mine = await call(served, "GET", f"/approvals/{approval_id}", token)
        ghost = await call(served, "GET", "/approvals/no-such-approval", token)
        assert mine[0] == ghost[0] == 404
        assert orjson.loads(mine[1])["code"] == orjson.loads(ghost[1])["code"]
        status, body, _ = await call(served, "POST", f"/approvals/{approval_id}", token,
                                     {"action": "approve"})
        assert status == 404
    status, body, _ = await call(served, "GET", f"/approvals/{approval_id}", ALICE)
    assert orjson.loads(body)["approval"]["status"] == "pending"
    # Carol holds the approver role: she sees it and answers it, as herself.
    status, body, _ = await call(served, "GET", "/approvals", CAROL)
    assert [a["id"] for a in orjson.loads(body)["approvals"]] == [approval_id]
    status, body, _ = await call(served, "POST", f"/approvals/{approval_id}", CAROL,
                                 {"action": "revise", "payload": "add VAT",
                                  "userId": "someone-else"})
    assert status == 200, body
    answered = orjson.loads(body)
    assert answered["approval"]["answeredBy"] == "carol"
    (next_one,) = answered["run"]["approvals"]
    # The owner answers the next one; the resumed runs stay in alice's thread.
    status, body, _ = await call(served, "POST", f"/approvals/{next_one['id']}", ALICE,
                                 {"action": "approve"})
    assert status == 200
    assert orjson.loads(body)["run"]["status"] == "finished"
    record = await served.runtime.store.get("alice-review")
    assert record is not None
    assert record.owner == ThreadOwner("alice")
    assert len(record.runs) == 3
    status, body, _ = await call(served, "GET", "/threads", CAROL)
    assert orjson.loads(body)["threads"] == []  # approving is not owning


async def test_a_page_of_approvals_says_nothing_of_others(two_users: Served) -> None:
    """`GET /approvals` paged first and dropped others' approvals after: bob got an empty
    page whose `nextCursor` named alice's approval (its id and time), his own newer one
    hidden behind it, and `?threadId=` of alice's thread gave a cursor where an unknown
    thread gave none. The page is filled with what the caller may see now."""
    served = two_users
    for thread in ("alice-secret-0", "alice-secret-1"):
        await run_as(served, ALICE, thread, "Prepare the invoice", agent="review")
    status, body, _ = await call(served, "GET", "/approvals?limit=1", BOB)
    assert (status, orjson.loads(body)) == (200, {"approvals": [], "nextCursor": None})
    for thread in ("alice-secret-0", "no-such-thread"):
        status, body, _ = await call(
            served, "GET", f"/approvals?threadId={thread}&status=all&limit=1", BOB)
        assert (status, orjson.loads(body)) == (200, {"approvals": [], "nextCursor": None})
    await run_as(served, BOB, "bob-review", "Prepare the invoice", agent="review")
    status, body, _ = await call(served, "GET", "/approvals?limit=1", BOB)
    page = orjson.loads(body)
    assert [a["threadId"] for a in page["approvals"]] == ["bob-review"]
    assert page["nextCursor"] is None
    # An approver pages through all three, one at a time.
    listed, cursor = [], ""
    while cursor is not None:
        status, body, _ = await call(served, "GET", f"/approvals?limit=1{cursor}", CAROL)
        page = orjson.loads(body)
        listed += [a["threadId"] for a in page["approvals"]]
        cursor = page["nextCursor"] and f"&cursor={page['nextCursor']}"
    assert listed == ["alice-secret-0", "alice-secret-1", "bob-review"]


async def test_a_listing_looks_up_each_threads_owner_once(
        two_users: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `GET /approvals` looked up the owner of each thread in the ledger its caller
    may not see (a thread-store read each: 10,000 for 10,000 approvals of others', on every
    request). The owner is recorded on the ledger the first time: the next listing reads
    none."""
    served = two_users
    for thread in ("alice-0", "alice-1"):
        await run_as(served, ALICE, thread, "Prepare the invoice", agent="review")
    store = served.runtime.store
    reads: list[str] = []
    summary = store.summary

    async def counted(thread_id: str) -> Any:
        reads.append(thread_id)
        return await summary(thread_id)

    monkeypatch.setattr(store, "summary", counted)
    for expected in (["alice-0", "alice-1"], []):
        reads.clear()
        status, body, _ = await call(served, "GET", "/approvals?status=all&limit=1", BOB)
        assert (status, orjson.loads(body)) == (200, {"approvals": [], "nextCursor": None})
        assert sorted(reads) == expected


async def test_a_run_an_answer_starts_is_the_answerers(
        serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    """The answering person's principal and `on_request` annotations are the resumed run's
    (hooks, telemetry and the agent see them), as a run they started would be; the thread
    stays its owner's, and an approver of another tenant still cannot answer."""
    finished: list[Any] = []

    def on_request(info: Any) -> dict[str, Any]:
        return {"asked": info.path.rsplit("/", 1)[-1]}

    runtime = CopilotRuntime(
        agents={"review": ReviewLoop([Drafting(n) for n in ("Invoice", "Closing")]).agent(
            name="review", checkpointer=checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3"))},
        thread_store=SQLiteThreadStore(tmp_path / "threads.sqlite3"),
        auth=BearerTokenAuth(TOKENS), approver_roles={"approver"},
        on_request=on_request, on_run_finished=finished.append)
    async with serve_runtime(runtime) as served:
        await run_as(served, ALICE, "ar", "Prepare the invoice", agent="review")
        status, body, _ = await call(served, "GET", "/approvals", ALICE)
        (first,) = orjson.loads(body)["approvals"]
        status, body, _ = await call(served, "POST", f"/approvals/{first['id']}", MALLORY,
                                     {"action": "approve"})
        assert status == 404
        status, body, _ = await call(served, "POST", f"/approvals/{first['id']}", CAROL,
                                     {"action": "revise", "payload": "add VAT"})
        assert status == 200, body
        (second,) = orjson.loads(body)["run"]["approvals"]
        status, body, _ = await call(served, "POST", f"/approvals/{second['id']}", ALICE,
                                     {"action": "approve", "wait": False})
        assert status == 202, body
        await wait_for(lambda: len(finished) == 3, "the three runs' hooks")
        await approval_service(runtime).aclose()
        record = await runtime.store.get("ar")
    assert record is not None
    assert record.owner == ThreadOwner("alice")
    by_run = [(run.principal.id if run.principal else None, run.annotations.get("asked"),
               run.outcome) for run in finished]
    assert by_run == [
        ("alice", "run", "interrupted"), ("carol", first["id"], "interrupted"),
        ("alice", second["id"], "finished")]


# -- GraphQL ---------------------------------------------------------------------------------

_LOAD = """query($data: LoadAgentStateInput!) {
  loadAgentState(data: $data) { threadId threadExists state messages } }"""
_GENERATE = """mutation($data: GenerateCopilotResponseInput!) {
  generateCopilotResponse(data: $data) {
    threadId runId
    status { ... on BaseResponseStatus { code } ... on FailedResponseStatus { reason details } }
    messages { __typename ... on TextMessageOutput { content role } }
  } }"""
GQL = {"X-CopilotKit-Runtime-Client-GQL-Version": "1.10.6"}


def generate(thread: str, text: str, agent: str | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "threadId": thread, "frontend": {"actions": []}, "metadata": {"requestType": "Chat"},
        "messages": [{"id": f"{thread}-{text}", "createdAt": "2025-01-01T00:00:00.000Z",
                      "textMessage": {"role": "user", "content": text}}]}
    if agent:
        data["agentSession"] = {"agentName": agent}
    return {"query": _GENERATE, "variables": {"data": data}}


async def test_graphql_operations_on_anothers_thread(two_users: Served,
                                                     llm: MockOpenAIServer) -> None:
    served = two_users
    status, body, _ = await call(served, "POST", "", ALICE, generate("alice-gql", "Hi"), GQL)
    assert status == 200, body
    result = orjson.loads(body)["data"]["generateCopilotResponse"]
    assert "".join(result["messages"][-1]["content"]) == "echo: Hi"
    before = await snapshot(served, "alice-gql")
    calls = len(llm.requests)

    for agent in ("default", "review"):
        status, body, _ = await call(served, "POST", "", BOB, {
            "query": _LOAD, "variables": {"data": {"threadId": "alice-gql",
                                                   "agentName": agent}}}, GQL)
        state = orjson.loads(body)["data"]["loadAgentState"]
        assert state == {"threadId": "alice-gql", "threadExists": False, "state": "{}",
                         "messages": "[]"}
    status, body, _ = await call(served, "POST", "", ALICE, {
        "query": _LOAD, "variables": {"data": {"threadId": "alice-gql",
                                               "agentName": "default"}}}, GQL)
    assert orjson.loads(body)["data"]["loadAgentState"]["threadExists"] is True

    status, body, _ = await call(served, "POST", "", BOB, generate("alice-gql", "Bob here"),
                                 GQL)
    assert status == 200
    error = orjson.loads(body)["errors"][0]
    assert error["extensions"]["code"] == "NOT_FOUND"
    assert error["message"] == "Thread 'alice-gql' does not exist"
    assert await snapshot(served, "alice-gql") == before
    assert len(llm.requests) == calls
