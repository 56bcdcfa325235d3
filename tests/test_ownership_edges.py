"""Ownership where a thread's record and what agents keep of it part ways: a thread the
in-memory store forgot (evicted, restarted) while its checkpoints live on, a delete whose
agents could not forget the thread, a caller refused again and again on someone else's
thread, an agent handed a run by another, approvals named from another thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from copilot_runtime import (
    BearerTokenAuth,
    CopilotRuntime,
    DemoAdapter,
    OpenAIAdapter,
    SQLiteThreadStore,
    coordinator,
    thread_store,
)
from copilot_runtime import events as ev
from copilot_runtime._exceptions import NothingToResumeError
from copilot_runtime._input import parse_run_input
from copilot_runtime.agents import BuiltInAgent
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.approvals.ledger import Approval
from copilot_runtime.approvals.resume import claim_resume
from copilot_runtime.checkpointers import DurableCheckpointer, checkpointer
from copilot_runtime.events import EventBatches
from copilot_runtime.runtime import approval_service
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.threads import InMemoryThreadStore, ThreadStore
from copilot_runtime.workflows.review_loop import ReviewLoop
from tests.conftest import Served, ServeRuntime, run_input
from tests.hitl_support.postgres import postgres_schema
from tests.test_agui_suggest import suggest_input
from tests.test_hitl_agui import Drafting
from tests.test_trust_ownership import ALICE, BOB, CAROL, TOKENS, call

pytestmark = pytest.mark.timeout(60)

LOAD = ("query($data: LoadAgentStateInput!) { loadAgentState(data: $data) "
        "{ threadId threadExists state } }")
GQL = {"X-CopilotKit-Runtime-Client-GQL-Version": "1.10.6"}


def review_runtime(saver: DurableCheckpointer, store: ThreadStore | None = None,
                   **options: Any) -> CopilotRuntime:
    agent = ReviewLoop([Drafting(n) for n in ("Invoice", "Closing", "Audit")]).agent(
        name="review", checkpointer=saver)
    return CopilotRuntime(agents={"review": agent}, auth=BearerTokenAuth(TOKENS),
                          **({"thread_store": store} if store is not None else {}), **options)


async def state_seen_by(served: Served, token: str, thread: str) -> bytes:
    _, body, _ = await call(served, "POST", "", token, {
        "query": LOAD, "variables": {"data": {"threadId": thread, "agentName": "review"}}},
        GQL)
    return body


async def alices_approval(served: Served, thread: str) -> str:
    status, body, _ = await call(served, "POST", "/agent/review/run", ALICE,
                                 run_input("Prepare the SECRET-ALICE invoice", thread=thread,
                                           run=f"{thread}-r1"))
    assert status == 200, body
    _, body, _ = await call(served, "GET", f"/approvals?threadId={thread}", ALICE)
    (approval,) = orjson.loads(body)["approvals"]
    return str(approval["id"])


async def assert_nothing_of_alices_for_bob(served: Served, thread: str,
                                           approval_id: str) -> None:
    status, body, _ = await call(served, "POST", "/agent/review/run", BOB,
                                 run_input("What was asked before?", thread=thread, run="b1"))
    assert status == 404, body
    assert b"SECRET-ALICE" not in await state_seen_by(served, BOB, thread)
    _, body, _ = await call(served, "GET", "/approvals?status=all", BOB)
    assert orjson.loads(body)["approvals"] == []
    assert (await call(served, "GET", f"/approvals/{approval_id}", BOB))[0] == 404
    status, _, _ = await call(served, "POST", f"/approvals/{approval_id}", BOB,
                              {"action": "reject"})
    assert status == 404


async def test_a_thread_the_store_forgot_is_nobodys_while_its_agent_keeps_it(
        serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    """An in-memory store that evicted a thread (or a restart) forgot its owner while the
    graph's checkpoints and approvals lived on: the next caller to name the thread became
    its owner, read the conversation and answered the first owner's approval."""
    saver = checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3")
    runtime = review_runtime(saver, InMemoryThreadStore(max_threads=2))
    async with serve_runtime(runtime) as served:
        approval_id = await alices_approval(served, "alice-x")
        for other in ("alice-y", "alice-z"):  # the store keeps two: alice-x is evicted
            await call(served, "POST", "/agent/review/run", ALICE,
                       run_input("Hi", thread=other, run=f"{other}-r"))
        assert await runtime.store.summary("alice-x") is None
        await assert_nothing_of_alices_for_bob(served, "alice-x", approval_id)
        await approval_service(runtime).aclose()
    await runtime.aclose()
    # A restart on the default in-memory store, the checkpoints kept.
    restarted = review_runtime(checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3"))
    async with serve_runtime(restarted) as served:
        await assert_nothing_of_alices_for_bob(served, "alice-y", "none")
        status, _, _ = await call(served, "POST", "/agent/review/run", BOB,
                                  run_input("Hi", thread="bob-new", run="b2"))
        assert status == 200  # a thread nobody keeps is still the caller's to start
        await approval_service(restarted).aclose()
    await restarted.aclose()


async def test_every_approval_listed_opens_after_the_store_forgot_its_thread(
        serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    """The ledger (beside durable checkpoints) records the owner of an approval's thread;
    the in-memory store forgets the thread on a restart. The listing filtered by the
    recorded owner and opening one by id by the thread's owner now: after a restart its
    owner and an approver listed an approval whose GET and POST answered 404. A listing
    leaves out what cannot be opened now."""
    saver = checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3")
    runtime = review_runtime(saver, InMemoryThreadStore(), approver_roles={"approver"})
    async with serve_runtime(runtime) as served:
        forgotten = await alices_approval(served, "alice-before")
        await approval_service(runtime).aclose()
    await runtime.aclose()
    restarted = review_runtime(checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3"),
                               InMemoryThreadStore(), approver_roles={"approver"})
    async with serve_runtime(restarted) as served:
        kept = await alices_approval(served, "alice-after")  # this process's store has it
        for token in (ALICE, CAROL, BOB):
            for query in ("", "?status=all", "?threadId=alice-before",
                          "?status=all&limit=1", "?threadId=alice-after"):
                status, body, _ = await call(served, "GET", f"/approvals{query}", token)
                assert status == 200, body
                listed = [a["id"] for a in orjson.loads(body)["approvals"]]
                assert forgotten not in listed, (token, query)
                for approval_id in listed:
                    opened, body, _ = await call(served, "GET", f"/approvals/{approval_id}",
                                                 token)
                    assert opened == 200, (token, query, body)
            _, body, _ = await call(served, "GET", "/approvals", token)
            assert [a["id"] for a in orjson.loads(body)["approvals"]] == (
                [] if token == BOB else [kept])
        assert (await call(served, "GET", f"/approvals/{forgotten}", ALICE))[0] == 404
        await approval_service(restarted).aclose()
    await restarted.aclose()


async def test_a_delete_the_agents_could_not_do_keeps_the_thread(
        serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    """DELETE answered 200 after the checkpoints could not be deleted: the owner's record
    went, the conversation stayed, and the next principal to use the id was handed it."""
    saver = checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3")
    runtime = review_runtime(saver, SQLiteThreadStore(tmp_path / "threads.sqlite3"))
    async with serve_runtime(runtime) as served:
        approval_id = await alices_approval(served, "alice-d")
        original = saver.adelete_thread

        async def outage(thread_id: str) -> None:
            raise ConnectionError("checkpoint store unreachable")

        saver.adelete_thread = outage  # type: ignore[method-assign]
        status, body, headers = await call(served, "DELETE", "/threads/alice-d", ALICE)
        assert status == 503, body
        assert "Retry-After" in headers
        assert b"unreachable" not in body
        await assert_nothing_of_alices_for_bob(served, "alice-d", approval_id)
        record = await runtime.store.summary("alice-d")
        assert record is not None  # still alice's, to delete again
        saver.adelete_thread = original  # type: ignore[method-assign]
        assert (await call(served, "DELETE", "/threads/alice-d", ALICE))[0] == 200
        status, _, _ = await call(served, "POST", "/agent/review/run", BOB,
                                  run_input("Hi", thread="alice-d", run="b3"))
        assert status == 200  # the id is free, and nothing of alice's comes with it
        assert b"SECRET-ALICE" not in await state_seen_by(served, BOB, "alice-d")
        await approval_service(runtime).aclose()


async def test_runs_refused_on_anothers_thread_never_make_it_busy_for_its_owner(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer, tmp_path: Path) -> None:
    """Each refused run reserved the thread while its owner was read: a caller who knew the
    id and asked again and again made most of the owner's own runs 409."""
    runtime = CopilotRuntime(
        agents={"default": BuiltInAgent(OpenAIAdapter(base_url=llm.base_url,
                                                      api_key="sk-mock", max_retries=0))},
        thread_store=SQLiteThreadStore(tmp_path / "threads.sqlite3"),
        auth=BearerTokenAuth(TOKENS))
    async with serve_runtime(runtime) as served:
        assert (await call(served, "POST", "/agent/default/run", ALICE,
                           run_input("Hi", thread="a-idle", run="r0")))[0] == 200
        assert (await call(served, "POST", "/agent/default/run", BOB,
                           run_input("x", thread="a-idle", run="b0")))[0] == 404
        stop = False
        refused: list[int] = []

        async def bob() -> None:
            n = 0
            while not stop:
                n += 1
                status, _, _ = await call(served, "POST", "/agent/default/run", BOB,
                                          run_input("x", thread="a-idle", run=f"b-{n}"))
                refused.append(status)
                await asyncio.sleep(0)

        flooding = [asyncio.create_task(bob()) for _ in range(6)]
        try:
            statuses = [(await call(served, "POST", "/agent/default/run", ALICE,
                                    run_input("Hi", thread="a-idle", run=f"ra{n}")))[0]
                        for n in range(20)]
        finally:
            stop = True
            await asyncio.gather(*flooding)
        assert statuses == [200] * 20
        assert set(refused) == {404}


async def test_a_thread_id_deleted_on_another_worker_is_its_new_owners_on_every_worker(
        serve_runtime: ServeRuntime) -> None:
    """Before: a worker that had read alice's thread remembered her as its owner for a
    minute; alice deleted it on another worker and bob started a thread of the same id,
    which the first worker's thread routes showed him, but his runs there were refused as
    for a thread that does not exist (404) until that minute had passed. A remembered owner
    who refuses a caller is now checked with the store."""
    with postgres_schema() as url:
        def runtime() -> CopilotRuntime:
            return CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                                  thread_store=thread_store(url), coordinator=coordinator(url),
                                  auth=BearerTokenAuth(TOKENS))

        async with serve_runtime(runtime()) as one, serve_runtime(runtime()) as two:
            async def run(served: Served, token: str, run_id: str) -> int:
                status, body, _ = await call(served, "POST", "/agent/default/run", token,
                                             run_input("hi", thread="t", run=run_id))
                if status == 200:
                    assert b"RUN_FINISHED" in body, body
                return status

            assert await run(two, ALICE, "a1") == 200
            assert await run(two, ALICE, "a2") == 200  # `two` knows alice as its owner
            assert await run(two, BOB, "b0") == 404
            status, body, _ = await call(one, "DELETE", "/threads/t", ALICE)
            assert status == 200, body
            assert await run(one, BOB, "b1") == 200  # the id is free: bob's thread now
            status, body, _ = await call(two, "GET", "/threads/t/messages", BOB)
            assert status == 200, body
            status, body, _ = await call(two, "POST", "/agent/default/suggest", BOB,
                                         suggest_input("t"))  # a suggestion's run too
            assert status == 200, body
            assert await run(two, BOB, "b2") == 200
            assert await run(two, ALICE, "a3") == 404
            assert await run(one, ALICE, "a4") == 404
            record = await one.runtime.store.get("t")
            assert record is not None
            assert [r.run_id for r in record.runs] == ["b1", "b2"]


class WhoAsks(Agent):
    """Answers with who its run context says is asking."""

    description = "Says who is asking"

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, dict[str, Any]]] = []

    def run(self, input: Any, context: RunContext) -> EventBatches:
        return self._run(context)

    async def _run(self, context: RunContext) -> EventBatches:
        who = context.principal.id if context.principal is not None else None
        self.seen.append((who, dict(context.annotations)))
        message = f"m-whoami-{len(self.seen)}"
        yield [ev.text_message_start(message),
               ev.text_message_content(message, f"principal={who}"),
               ev.text_message_end(message)]


async def test_an_agent_handed_a_run_acts_for_the_same_caller(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """Over GraphQL an agent session may hand over to another agent (offered as a tool): that
    agent ran without the caller's principal and the hooks' annotations."""
    whoami = WhoAsks()
    runtime = CopilotRuntime(
        agents={"chat": BuiltInAgent(OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock",
                                                   max_retries=0)),
                "whoami": whoami},
        auth=BearerTokenAuth(TOKENS), on_request=lambda request: {"plan": "gold"})
    mutation = ("mutation($data: GenerateCopilotResponseInput!) { generateCopilotResponse("
                "data: $data) { threadId messages { __typename ... on TextMessageOutput "
                "{ content } } } }")
    async with serve_runtime(runtime) as served:
        status, body, _ = await call(served, "POST", "", ALICE, {
            "query": mutation, "variables": {"data": {
                "threadId": "t-handoff", "frontend": {"actions": []},
                "metadata": {"requestType": "Chat"}, "agentSession": {"agentName": "chat"},
                "messages": [{"id": "m1", "createdAt": "2025-01-01T00:00:00.000Z",
                              "textMessage": {"role": "user", "content": "call:whoami {}"}}]}}},
            GQL)
        assert status == 200, body
        assert b"principal=alice" in body
    assert whoami.seen == [("alice", {"plan": "gold"})]


async def test_a_resume_naming_another_threads_approval_neither_settles_nor_reveals_it(
        tmp_path: Path) -> None:
    """A run on one's own parked thread that named another thread's approval (answered,
    not yet applied) settled it as applied: that thread's graph was never carried on. And
    the error named its state, who answered it and when."""
    saver = checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3")
    ledger = saver.approvals
    try:
        theirs = Approval("a1" * 16, "alice-t", "review", {"q": "ok?"}, time.time())
        await ledger.add([theirs])
        claimed = await ledger.claim(theirs.id, "answered", {"action": "approve"}, "alice",
                                     time.time())
        assert claimed is not None
        unknown = None
        for approval_id in (theirs.id, "f0" * 16):
            resume = parse_run_input({
                "threadId": "bob-t", "runId": "r", "messages": [], "tools": [],
                "context": [], "state": {}, "forwardedProps": {},
                "resume": [{"interruptId": approval_id, "status": "resolved",
                            "payload": {"action": "approve"}}]})
            with pytest.raises(NothingToResumeError) as caught:
                await claim_resume(ledger, agent_id="review", input=resume, pending=set(),
                                   channel="outcome", parked=True)
            said = caught.value.message.replace(approval_id, "<id>")
            assert "alice" not in said
            unknown = said if unknown is None else unknown
            assert said == unknown  # the same answer as for an id nobody has
        assert [a.id for a in await ledger.unapplied()] == [theirs.id]
    finally:
        await saver.aclose()


@pytest.fixture
async def llm() -> AsyncIterator[MockOpenAIServer]:
    async with MockOpenAIServer(chunks=2) as server:
        yield server
