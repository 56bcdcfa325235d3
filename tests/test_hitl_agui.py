"""Interrupts on the AG-UI protocol, resuming them, and the approval routes, over real HTTP.

The runtime serves the review loop (with scripted specialists) and the account review
(whose approval expires after a second), checkpointed in a SQLite file.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from copilot_runtime import CopilotRuntime, InMemoryThreadStore, SQLiteThreadStore
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.runtime import approval_service
from copilot_runtime.testing import verify_events
from copilot_runtime.workflows.accounts import account_review
from copilot_runtime.workflows.review_loop import ReviewLoop
from copilot_runtime.workflows.specialists import SpecialistRequest
from tests.conftest import Served, ServeRuntime, parse_sse, parse_sse_ids, poll, run_input, types

V1 = {"protocolVersion": "1.0"}


class Drafting:
    """A specialist whose drafts name their iteration and the revision asked for."""

    def __init__(self, name: str) -> None:
        self.name, self.description = name, f"{name} (scripted)"
        self.calls: list[SpecialistRequest] = []

    async def run(self, request: SpecialistRequest) -> str:
        self.calls.append(request)
        return f"{self.name} draft {request.iteration}" + (
            f" ({request.feedback})" if request.feedback else "")


def build(tmp_path: Path, name: str = "cp", *, threads: str = "sqlite"
          ) -> tuple[CopilotRuntime, list[Drafting]]:
    saver = checkpointer(f"sqlite:///{tmp_path}/{name}.sqlite3")
    specialists = [Drafting(n) for n in ("Invoice", "Closing", "Audit")]
    runtime = CopilotRuntime(
        agents={"review": ReviewLoop(specialists).agent(name="review", checkpointer=saver),
                "accounts": account_review(timeout_seconds=1).agent(
                    name="accounts", checkpointer=saver)},
        # SQLite, not memory: runs must be stored as JSON, with nothing of LangGraph in them.
        thread_store=SQLiteThreadStore(tmp_path / f"{name}-threads.sqlite3")
        if threads == "sqlite" else InMemoryThreadStore())
    return runtime, specialists


@pytest.fixture
async def hitl(serve_runtime: ServeRuntime, tmp_path: Path
               ) -> AsyncIterator[tuple[Served, list[Drafting]]]:
    runtime, specialists = build(tmp_path)
    async with serve_runtime(runtime) as served:
        yield served, specialists
        await approval_service(runtime).aclose()


async def run(served: Served, thread: str, text: str | None = None, agent: str = "review",
              **extra: Any) -> list[dict[str, Any]]:
    body = run_input(text or "", thread=thread, run=f"{thread}-{time.monotonic_ns()}",
                     **extra)
    if text is None:
        body["messages"] = []
    events = await served.run(body, agent=agent)
    verify_events(events)
    return events


def interrupt_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    outcome = events[-1].get("outcome") or {}
    assert outcome.get("type") == "interrupt", events[-1]
    (found,) = outcome["interrupts"]
    return dict(found)


async def get(served: Served, path: str) -> tuple[int, Any]:
    response = await served.session.get(served.url + path)
    return response.status, await response.json()


async def answer(served: Served, approval_id: str, body: Any, *, route: str = "approvals"
                 ) -> tuple[int, Any]:
    response = await served.post(f"/{route}/{approval_id}", body)
    return response.status, await response.json()


# -- how interrupts reach each client generation -------------------------------------------

async def test_a_client_without_protocol_version_gets_the_custom_event(
        hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    events = await run(served, "legacy", "Prepare the invoice for ACME")
    custom = [e for e in events if e["type"] == "CUSTOM" and e["name"] == "on_interrupt"]
    assert len(custom) == 1
    value = json.loads(custom[0]["value"])  # a JSON string, as ag-ui-langgraph sends it
    assert value["type"] == "user_clarification_request"
    assert value["data"]["agent_result"] == "Invoice draft 1"
    assert "outcome" not in events[-1]
    assert types(events)[-2:] == ["CUSTOM", "RUN_FINISHED"]


async def test_a_v1_client_gets_the_interrupt_outcome(
        hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    events = await run(served, "v1", "Prepare the invoice for ACME", **V1)
    assert not [e for e in events if e["type"] == "CUSTOM" and e["name"] == "on_interrupt"]
    interrupt = interrupt_of(events)
    assert interrupt["reason"] == "review"
    assert interrupt["message"] == "Please approve or provide revision"
    assert interrupt["responseSchema"]["required"] == ["action"]
    assert interrupt["metadata"]["langgraph"]["raw"]["data"]["agent"] == "Invoice"
    assert len(interrupt["id"]) >= 16


# -- resuming ----------------------------------------------------------------------------

async def test_resume_entries_then_the_same_answer_again(
        hitl: tuple[Served, list[Drafting]]) -> None:
    served, specialists = hitl
    interrupt = interrupt_of(await run(served, "r1", "Closing of the books", **V1))
    entry = {"interruptId": interrupt["id"], "status": "resolved",
             "payload": {"action": "revise", "payload": "add accruals"}}
    revised = await run(served, "r1", resume=[entry], **V1)
    assert "Closing draft 2 (add accruals)" in [
        e.get("delta") for e in revised if e["type"] == "TEXT_MESSAGE_CONTENT"]
    second = interrupt_of(revised)
    assert second["id"] != interrupt["id"]
    again = await run(served, "r1", resume=[entry], **V1)
    assert again[-1]["type"] == "RUN_ERROR"
    assert again[-1]["code"] == "APPROVAL_ALREADY_ANSWERED"
    assert "already answered by chat" in again[-1]["message"]
    closing = next(s for s in specialists if s.name == "Closing")
    assert [c.iteration for c in closing.calls] == [1, 2]  # the repeat ran nothing


async def test_legacy_resume_in_forwarded_props(hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    asked = await run(served, "r2", "Audit the payroll")
    question = next(e["value"] for e in asked if e.get("name") == "on_interrupt")
    # As CopilotKit's useInterrupt sends it: the client's state, the answer as JSON text and
    # the question it answers (the `on_interrupt` event's value).
    done = await run(served, "r2", state={"review": True, "task": "Audit the payroll"},
                     forwardedProps={"command": {"resume": json.dumps({"approved": True}),
                                                 "interruptEvent": question}})
    assert types(done)[-1] == "RUN_FINISHED"
    assert [e["snapshot"]["status"] for e in done if e["type"] == "STATE_SNAPSHOT"][-1:] == [
        "completed"] or any(e["type"] == "STATE_DELTA" for e in done)
    _, stored = await get(served, "/threads/r2/events")
    assert [e["type"] for e in stored["events"]].count("RUN_STARTED") == 2
    status, body = await get(served, "/approvals?status=answered&threadId=r2")
    assert status == 200
    assert [a["answer"] for a in body["approvals"]] == [{"approved": True}]
    assert body["approvals"][0]["applied"] is True
    assert body["approvals"][0]["answeredBy"] == "chat"


async def test_nothing_to_resume(hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    idle = await run(served, "idle", forwardedProps={"command": {"resume": "OK"}})
    assert idle[-1]["code"] == "INTERRUPT_NOT_PENDING"
    interrupt_of(await run(served, "r3", "Prepare the invoice", **V1))
    wrong = await run(served, "r3", resume=[{"interruptId": "not-it", "status": "resolved",
                                              "payload": "OK"}], **V1)
    assert wrong[-1]["type"] == "RUN_ERROR"
    assert wrong[-1]["message"] == ("Interrupt 'not-it' is not pending on thread 'r3': "
                                    "there is nothing to resume")


async def test_an_empty_answer_asks_again(hitl: tuple[Served, list[Drafting]]) -> None:
    served, specialists = hitl
    first = interrupt_of(await run(served, "r4", "Prepare the invoice", **V1))
    for payload in (None, {}):
        again = await run(served, "r4", resume=[{"interruptId": first["id"],
                                                  "status": "resolved", "payload": payload}],
                          **V1)
        assert interrupt_of(again)["id"] == first["id"]
    assert len(specialists[0].calls) == 1
    _, body = await get(served, "/approvals?threadId=r4")
    assert [a["status"] for a in body["approvals"]] == ["pending"]


async def test_a_new_message_while_waiting_is_refused_and_the_question_waits(
        hitl: tuple[Served, list[Drafting]]) -> None:
    # The graph cannot take a message before the answer: it was dropped while the question
    # was asked again. Refused instead, as @ag-ui/client (0.0.59) itself refuses a run that
    # leaves a pending interrupt unaddressed.
    served, specialists = hitl
    first = interrupt_of(await run(served, "r5", "Prepare the invoice", **V1))
    refused = await run(served, "r5", "hello?", **V1)
    assert (refused[-1]["type"], refused[-1]["code"]) == ("RUN_ERROR", "APPROVAL_ERROR")
    repeated = await run(served, "r5", **V1)  # nothing new: the question is asked again
    assert interrupt_of(repeated)["id"] == first["id"]
    assert len(specialists[0].calls) == 1


# -- answers refused: the thread as its graph has it ----------------------------------------

async def run_ids(served: Served, thread: str, text: str | None = None, **extra: Any
                  ) -> list[tuple[int | None, dict[str, Any]]]:
    body = run_input(text or "", thread=thread, run=f"{thread}-{time.monotonic_ns()}", **V1,
                     **extra)
    if text is None:
        body["messages"] = []
    response = await served.post("/agent/review/run", body)
    assert response.status == 200
    return parse_sse_ids(await response.read())


async def connect_ids(served: Served, thread: str, last_event_id: int | None = None
                      ) -> list[tuple[int | None, dict[str, Any]]]:
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    response = await served.post("/agent/review/connect", run_input("", thread=thread),
                                 headers=headers)
    assert response.status == 200
    return parse_sse_ids(await response.read())


@pytest.mark.parametrize("threads", ["memory", "sqlite"])
async def test_answers_refused_leave_the_thread_asking_what_the_graph_asks(
        serve_runtime: ServeRuntime, tmp_path: Path, threads: str) -> None:
    """Tab A revised draft 1, then tab B approved draft 1: B's run was refused (only its
    start and a RUN_ERROR), and replayed after the run that asked about draft 2, so a client
    loading the thread took it for that question's end and showed no approval while the
    graph waited on it. Such runs are left out of a replay now, their positions kept."""
    runtime, _ = build(tmp_path, threads=threads)
    async with serve_runtime(runtime) as served:
        first = interrupt_of(await run(served, "s1", "Prepare the invoice", **V1))
        entry = {"interruptId": first["id"], "status": "resolved",
                 "payload": {"action": "revise", "payload": "add VAT"}}
        asking = await run_ids(served, "s1", resume=[entry])
        second = interrupt_of([e for _, e in asking])
        refused = [await run_ids(served, "s1", resume=[entry]),  # B's stale answer
                   await run_ids(served, "s1", resume=[
                       {"interruptId": "not-it", "status": "resolved", "payload": "OK"}]),
                   await run_ids(served, "s1", "hello?")]  # a message before the answer
        assert [r[-1][1].get("code") for r in refused] == [
            "APPROVAL_ALREADY_ANSWERED", "INTERRUPT_NOT_PENDING", "APPROVAL_ERROR"]
        assert [types([e for _, e in r]) for r in refused] == 3 * [["RUN_STARTED", "RUN_ERROR"]]

        # A tab that loads the thread is asked about draft 2, as the graph is.
        replayed = await connect_ids(served, "s1")
        verify_events([e for _, e in replayed])
        assert types([e for _, e in replayed]).count("RUN_STARTED") == 2
        assert replayed[-1] == asking[-1]
        assert interrupt_of([e for _, e in replayed])["id"] == second["id"]
        _, stored = await get(served, "/threads/s1/events")
        assert stored["events"][-1] == asking[-1][1]
        _, listed = await get(served, "/threads/s1/messages")
        assert "hello?" not in [m.get("content") for m in listed["messages"]]

        # Positions are kept: resumed past or inside a refused run, exactly what follows.
        assert await connect_ids(served, "s1", asking[-1][0]) == []
        assert await connect_ids(served, "s1", refused[-1][-1][0]) == []
        inside = await connect_ids(served, "s1", refused[0][0][0])
        if threads == "memory":  # (no raw events kept: a run resumed inside comes whole)
            assert [e for _, e in inside] == [e for _, e in refused[0]]
            assert inside[-1] == refused[0][-1]
        else:
            assert inside == refused[0][1:]
        done = await run_ids(served, "s1", resume=[
            {"interruptId": second["id"], "status": "resolved",
             "payload": {"action": "approve"}}])
        assert done[0][0] == refused[-1][-1][0] + 1
        resumed = await connect_ids(served, "s1", asking[-1][0])  # the next run, whole
        assert (resumed[0][1], resumed[-1]) == (done[0][1], done[-1])
        assert types([e for _, e in resumed]).count("RUN_STARTED") == 1
        await approval_service(runtime).aclose()


# -- the approval routes -----------------------------------------------------------------

async def test_list_and_answer_over_http(hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    await run(served, "h1", "Prepare the invoice")  # a legacy client started it
    status, body = await get(served, "/approvals")
    assert status == 200
    (pending,) = [a for a in body["approvals"] if a["threadId"] == "h1"]
    assert pending["agentId"] == "review"
    assert pending["status"] == "pending"
    assert pending["reason"] == "review"
    assert pending["value"]["data"]["agent_result"] == "Invoice draft 1"
    assert (await get(served, f"/approvals/{pending['id']}")) == (200, {"approval": pending})

    status, revised = await answer(served, pending["id"], {
        "action": "revise", "payload": "add VAT", "userId": "ann"})
    assert status == 200
    assert revised["approval"]["status"] == "answered"
    assert revised["approval"]["answeredBy"] == "ann"
    assert revised["approval"]["applied"] is True
    assert revised["run"]["status"] == "interrupted"
    (next_one,) = revised["run"]["approvals"]
    assert next_one["value"]["data"]["agent_result"] == "Invoice draft 2 (add VAT)"

    status, twice = await answer(served, pending["id"], {"action": "approve"})
    assert status == 409
    assert twice["code"] == "APPROVAL_ALREADY_ANSWERED"
    assert twice["error"] == "Approval already answered"
    assert "by ann" in twice["message"]

    status, done = await answer(served, next_one["id"], {"action": "approve"},
                                route="approval")  # the singular alias, approval/{id}
    assert (status, done["run"]["status"]) == (200, "finished")

    # The server-side runs are in the thread's history: a reload shows them.
    response = await served.post("/agent/review/connect", run_input("", thread="h1"))
    replayed = parse_sse(await response.read())
    runs = [e["runId"] for e in replayed if e["type"] == "RUN_STARTED"]
    assert len(runs) == 3
    assert all(r.startswith("approval-") for r in runs[1:])
    assert "on_interrupt" in [e.get("name") for e in replayed]  # in its client's form
    messages = [m.get("content") for m in (await get(served, "/threads/h1/messages"))[1][
        "messages"]]
    assert messages[-2:] == ["Invoice draft 2 (add VAT)",
                             "Approved: the Invoice specialist's result is final."]
    assert messages.count("Invoice draft 1") == 1


async def test_answering_without_waiting(hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    pending = interrupt_of(await run(served, "h2", "Prepare the invoice", **V1))
    status, body = await answer(served, pending["id"], {"action": "reject", "wait": False})
    assert status == 202
    assert body["run"]["status"] == "running"
    async for _ in poll():
        _, listed = await get(served, "/approvals?status=answered&threadId=h2")
        if listed["approvals"] and listed["approvals"][0]["applied"]:
            break
    assert listed["approvals"][0]["answer"] == {"action": "reject"}


@pytest.mark.parametrize(("body", "status", "error"), [
    ({"action": "maybe"}, 400, "Invalid approval answer"),
    ({"action": "revise"}, 400, "Invalid approval answer"),
    ({"action": "approve", "wait": "yes"}, 400, "Invalid approval answer"),
    ([1], 400, "Invalid approval answer"),
])
async def test_bad_answers(hitl: tuple[Served, list[Drafting]], body: Any, status: int,
                           error: str) -> None:
    served, _ = hitl
    pending = interrupt_of(await run(served, "bad", "Prepare the invoice", **V1))
    code, answered = await answer(served, pending["id"], body)
    assert (code, answered["error"]) == (status, error)
    _, listed = await get(served, "/approvals?threadId=bad")
    assert [a["status"] for a in listed["approvals"]] == ["pending"]


async def test_unknown_and_malformed_requests(hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    assert (await answer(served, "nope", {"action": "approve"}))[0] == 404
    status, body = await get(served, "/approvals/nope")
    assert (status, body["code"]) == (404, "APPROVAL_NOT_FOUND")
    assert (await get(served, "/approvals?status=odd"))[0] == 400
    response = await served.post("/approvals/nope", raw=b"{not json")
    assert response.status == 400
    response = await served.session.put(served.url + "/approvals/x")
    assert response.status == 405
    response = await served.post("/approvals", {})
    assert response.status == 405


async def test_an_approval_whose_thread_was_reset_is_withdrawn(
        hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    pending = interrupt_of(await run(served, "gone", "Prepare the invoice", **V1))
    agent: Any = served.runtime.agents["review"]
    await agent.graph.checkpointer.adelete_thread("gone")
    assert (await get(served, "/approvals?threadId=gone"))[1] == {
        "approvals": [], "nextCursor": None}
    status, body = await answer(served, pending["id"], {"action": "approve"})
    assert (status, body["code"]) == (409, "APPROVAL_WITHDRAWN")


async def test_an_approval_times_out(hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    started = await run(served, "late", "Review account GLOBEX-002", agent="accounts", **V1)
    interrupt = interrupt_of(started)
    assert interrupt["reason"] == "approval"
    expires = interrupt["expiresAt"]
    async for _ in poll():  # the timer resumes the graph once the second is up
        _, listed = await get(served, "/approvals?status=expired&threadId=late")
        if listed["approvals"] and listed["approvals"][0]["applied"]:
            break
    (expired,) = listed["approvals"]
    assert expired["expiresAt"] == expires
    assert expired["answer"]["action"] == "timeout"
    assert expired["answeredBy"] == "runtime"
    status, late = await answer(served, interrupt["id"], {"action": "approve"})
    assert (status, late["code"], late["error"]) == (410, "APPROVAL_EXPIRED", "Approval expired")
    # The timeout's run took the answer (applied) and ends, stored, a moment later: until
    # then the thread is busy (a fresh-clone CI's run came in that moment once).
    async for _ in poll():
        if "late" not in served.runtime.runs.active:
            break
    chat = await run(served, "late", agent="accounts", resume=[{
        "interruptId": interrupt["id"], "status": "resolved", "payload": "OK"}], **V1)
    assert chat[-1]["code"] == "APPROVAL_EXPIRED"
    _, messages = await get(served, "/threads/late/messages")
    assert messages["messages"][-1]["content"] == "Completed 3 of 3 steps; approval: timeout."


async def test_a_resume_after_the_deadline_is_refused_and_the_timer_times_it_out(
        hitl: tuple[Served, list[Drafting]]) -> None:
    """A chat answer after the deadline was taken as the timeout, and the run ended
    RUN_FINISHED as if the answer had been: it is APPROVAL_EXPIRED now (as over HTTP, 410),
    and the timeout is the timer's to send."""
    served, _ = hitl
    service = approval_service(served.runtime)
    await service.aclose()
    service.run_timer = False  # no timer: the chat answer comes first
    interrupt = interrupt_of(await run(served, "slow", "Review account ACME-001",
                                       agent="accounts", **V1))
    await asyncio.sleep(1.1)
    done = await run(served, "slow", agent="accounts", resume=[{
        "interruptId": interrupt["id"], "status": "resolved", "payload": "OK"}], **V1)
    assert (done[-1]["type"], done[-1]["code"]) == ("RUN_ERROR", "APPROVAL_EXPIRED")
    await service.aclose()  # forget the start without a timer
    service.run_timer = True
    await service.start()
    async for _ in poll():
        _, listed = await get(served, "/approvals?status=expired&threadId=slow")
        if listed["approvals"] and listed["approvals"][0]["applied"]:
            break
    assert listed["approvals"][0]["answer"]["action"] == "timeout"


async def test_an_expired_approval_of_a_reset_thread_is_withdrawn(
        hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    service = approval_service(served.runtime)
    await service.aclose()
    service.run_timer = False
    interrupt_of(await run(served, "reset", "Review account ACME-001", agent="accounts", **V1))
    agent: Any = served.runtime.agents["accounts"]
    await agent.graph.checkpointer.adelete_thread("reset")
    await asyncio.sleep(1.1)
    await service.aclose()  # forget the start without a timer
    service.run_timer = True
    await service.start()
    async for _ in poll():
        _, listed = await get(served, "/approvals?status=withdrawn&threadId=reset")
        if listed["approvals"]:
            break
    assert [a["status"] for a in listed["approvals"]] == ["withdrawn"]
    _, events = await get(served, "/threads/reset/events")
    assert [e["type"] for e in events["events"]].count("RUN_STARTED") == 1  # no timeout run


async def test_an_answer_a_crash_interrupted_is_sent_again(serve_runtime: ServeRuntime,
                                                           tmp_path: Path) -> None:
    first, specialists = build(tmp_path, "crash")
    async with serve_runtime(first) as served:
        pending = interrupt_of(await run(served, "c1", "Prepare the invoice", **V1))
        # What a crash between claiming the answer and running the graph leaves behind:
        store: Any = first.agents["review"].approvals  # type: ignore[attr-defined]
        assert await store.claim(pending["id"], "answered", {"action": "approve"}, "ann",
                                 time.time()) is not None
        await approval_service(first).aclose()
    second, _ = build(tmp_path, "crash")  # the restart, on the same files
    async with serve_runtime(second) as served:
        service = approval_service(second)
        await service.start()
        async for _ in poll():
            approval = await store_of(second).get(pending["id"])
            if approval is not None and approval.applied:
                break
        assert approval is not None
        assert (approval.status, approval.answered_by) == ("answered", "ann")
        agent: Any = second.agents["review"]
        state = await agent.graph.aget_state({"configurable": {"thread_id": "c1"}})
        assert state.values["status"] == "completed"
        assert len(specialists[0].calls) == 1  # nothing was done twice
        await service.aclose()


def store_of(runtime: CopilotRuntime) -> Any:
    return runtime.agents["review"].approvals  # type: ignore[attr-defined]


def test_approval_json_is_plain() -> None:
    from copilot_runtime.approvals.ledger import Approval

    approval = Approval("a", "t", "agent", {"message": "ok?"}, 0.0, 60.0)
    assert orjson.loads(orjson.dumps(approval.to_json())) == {
        "id": "a", "threadId": "t", "agentId": "agent", "status": "pending",
        "value": {"message": "ok?"}, "createdAt": "1970-01-01T00:00:00.000Z",
        "expiresAt": "1970-01-01T00:01:00.000Z", "message": "ok?"}
