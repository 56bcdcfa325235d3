"""Approvals whose answer races another worker's read, and resumes that say who answered.

Several workers share one approval ledger: a list, an expiry timer or an answer on one of
them may read an approval as pending while another worker's run claims and applies it, then
find its interrupt gone from the checkpoint and withdraw it. Settling is therefore a
compare-and-set, like claiming. Over AG-UI, who answered is the authenticated caller (as over
HTTP), not what the resume's metadata claims.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TypedDict

import orjson
import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from copilot_runtime import CopilotRuntime, coordinator, thread_store
from copilot_runtime._exceptions import (
    ApprovalClosedError,
    ApprovalError,
    ApprovalNotFoundError,
    InvalidRequestError,
)
from copilot_runtime._input import parse_run_input
from copilot_runtime._time import iso_time
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.approvals import ApprovalStore
from copilot_runtime.approvals.decisions import parse_decision
from copilot_runtime.approvals.ledger import Approval, MemoryApprovalStore, Viewer
from copilot_runtime.approvals.resume import claim_resume
from copilot_runtime.checkpointers import DurableCheckpointer, checkpointer
from copilot_runtime.guardrails import Verdict
from copilot_runtime.protocols.http import to_cursor
from copilot_runtime.threads.base import ThreadOwner
from tests.conftest import ServeRuntime, poll, run_input, types
from tests.hitl_support.postgres import postgres_schema
from tests.test_approval_recovery import THREAD as THREAD_PAY
from tests.test_approval_recovery import Payments, agent_of, asked, paying_runtime
from tests.test_approvals_reservations import (
    THREAD,
    State,
    approving_runtime,
    assert_applied,
    drive,
    interrupted,
    resume_body,
)

pytestmark = pytest.mark.timeout(60)

KINDS = ["memory", "sqlite", "postgresql"]


@pytest.fixture(params=KINDS)
def checkpoints_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "postgresql":
        with postgres_schema() as url:
            yield url
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'checkpoints.sqlite3'}"
    else:
        yield "memory"


@pytest.fixture
async def ledger(checkpoints_url: str) -> AsyncIterator[ApprovalStore]:
    saver: DurableCheckpointer = checkpointer(checkpoints_url)
    try:
        yield saver.approvals
    finally:
        await saver.aclose()


def pending(approval_id: str, thread: str = "t") -> Approval:
    return Approval(approval_id, thread, "flow", {"question": "Approve?"}, time.time())


async def test_an_answer_that_won_is_never_withdrawn_or_reopened(ledger: ApprovalStore) -> None:
    """A worker that read an approval as pending, then found its interrupt gone (another
    worker's run had claimed and applied the answer), withdrew it: the ledger ended
    `withdrawn, applied` and a second answer got 409 APPROVAL_WITHDRAWN. "withdrawn" now
    changes only a pending approval, "reopen" only an answered one not yet applied."""
    await ledger.add([pending("a1"), pending("a2"), pending("a3")])
    claimed = await ledger.claim("a1", "answered", {"action": "approve"}, "bob", time.time())
    assert claimed is not None
    await ledger.settle("a1", "applied")
    await ledger.settle("a1", "withdrawn")  # the stale reader's settle
    await ledger.settle("a1", "reopen")
    after = await ledger.get("a1")
    assert after is not None
    assert (after.status, after.applied, after.answered_by) == ("answered", True, "bob")

    # A pending one is withdrawn; an answered one not applied can still be reopened.
    await ledger.settle("a2", "withdrawn")
    withdrawn = await ledger.get("a2")
    assert withdrawn is not None
    assert withdrawn.status == "withdrawn"
    assert await ledger.claim("a3", "expired", {"action": "timeout"}, None, time.time())
    await ledger.settle("a3", "reopen")
    reopened = await ledger.get("a3")
    assert reopened is not None
    assert (reopened.status, reopened.answer) == ("pending", None)


def resume_input(interrupt_id: str, metadata: dict[str, Any]) -> Any:
    return parse_run_input({
        "threadId": "t", "runId": "r2", "messages": [], "tools": [], "context": [],
        "state": {}, "forwardedProps": {},
        "resume": [{"interruptId": interrupt_id, "status": "resolved",
                    "payload": {"action": "approve"}, "metadata": metadata}]})


async def test_a_resume_records_the_caller_not_its_own_claim(ledger: ApprovalStore) -> None:
    """With `auth`, an AG-UI resume whose metadata said `answeredBy: "cfo"` was recorded as
    the cfo's answer (over HTTP the principal is recorded, whatever the body says). Without
    a principal the claim is kept only if the ledger can keep it (a NUL byte failed the run
    on PostgreSQL)."""
    await ledger.add([pending("i1"), pending("i2")])
    await claim_resume(ledger, agent_id="flow", input=resume_input("i1", {"answeredBy": "cfo"}),
                       pending={"i1"}, channel="outcome", principal_id="bob")
    answered = await ledger.get("i1")
    assert answered is not None
    assert (answered.status, answered.answered_by) == ("answered", "bob")
    await claim_resume(ledger, agent_id="flow",
                       input=resume_input("i2", {"answeredBy": "eve\x00"}),
                       pending={"i2"}, channel="outcome")
    second = await ledger.get("i2")
    assert second is not None
    assert second.answered_by == "chat"


async def test_a_bare_answer_to_several_interrupts_records_the_caller(
        ledger: ApprovalStore) -> None:
    """The legacy resume (`forwardedProps.command.resume`) names no interrupt: with several
    pending it is recorded for each, and was recorded as "chat" whoever the caller was."""
    await ledger.add([pending("i1"), pending("i2")])
    legacy = parse_run_input({
        "threadId": "t", "runId": "r2", "messages": [], "tools": [], "context": [],
        "state": {}, "forwardedProps": {"command": {"resume": "approve"}}})
    await claim_resume(ledger, agent_id="flow", input=legacy, pending={"i1", "i2"},
                       channel="outcome", principal_id="bob")
    for approval_id in ("i1", "i2"):
        answered = await ledger.get(approval_id)
        assert answered is not None
        assert (answered.status, answered.answered_by) == ("answered", "bob")


FORGED_APPROVERS = [
    {"action": "approve", "userId": "cfo"}, {"action": "approve", "by": "cfo"},
    {"approved": True, "user": "cfo"}, {"answer": {"action": "approve", "userId": "cfo"}},
    '{"action": "approve", "by": "cfo"}', ' {"decision": "reject", "userId": "cfo"}']


async def _answered_three_ways(payload: Any) -> tuple[MemoryApprovalStore, list[Any]]:
    """`payload` answered by "bob" as a resume entry (i1), in the legacy form with one
    interrupt pending (i2) and with several (i3, i4): the ledger, and what each sent on."""
    ledger = MemoryApprovalStore()
    await ledger.add([pending("i1"), pending("i2"), pending("i3"), pending("i4")])
    entry = parse_run_input({
        "threadId": "t", "runId": "r2", "messages": [], "tools": [], "context": [],
        "state": {}, "forwardedProps": {},
        "resume": [{"interruptId": "i1", "status": "resolved", "payload": payload}]})
    claims = await claim_resume(ledger, agent_id="flow", input=entry, pending={"i1"},
                                channel="outcome", principal_id="bob")
    sent: list[Any] = [(claims.input.model.resume or [])[0].payload]

    def legacy(run: str) -> Any:
        return parse_run_input({
            "threadId": "t", "runId": run, "messages": [], "tools": [], "context": [],
            "state": {}, "forwardedProps": {"command": {"resume": payload}}})

    claims = await claim_resume(ledger, agent_id="flow", input=legacy("r3"), pending={"i2"},
                                channel="outcome", principal_id="bob")
    sent.append((claims.input.model.resume or [])[0].payload)
    claims = await claim_resume(ledger, agent_id="flow", input=legacy("r4"),
                                pending={"i3", "i4"}, channel="outcome", principal_id="bob")
    sent.append((claims.input.model.forwarded_props or {})["command"]["resume"])
    return ledger, sent


@pytest.mark.parametrize("payload", FORGED_APPROVERS, ids=repr)
async def test_an_authenticated_answer_names_its_caller_as_the_approver(payload: Any) -> None:
    """With `auth`, a chat resume saying `userId: "cfo"` was recorded in the ledger as the
    caller's, but the graph got it unchanged: the workflows recorded the cfo as the one
    who approved (`approved_by`, the review history's `by`). Over HTTP the caller is named
    whatever the body says; now on every path: a resume entry, the legacy form with one
    interrupt pending, and with several."""
    ledger, sent = await _answered_three_ways(payload)
    for answer in sent:
        decided = parse_decision(answer)
        assert decided is not None
        assert decided.by == "bob", answer
        assert "cfo" not in str(answer)
    for approval_id in ("i1", "i2", "i3", "i4"):
        answered = await ledger.get(approval_id)
        assert answered is not None
        decided = parse_decision(answered.answer)
        assert decided is not None
        assert (answered.answered_by, decided.by) == ("bob", "bob")


FORM_ANSWERS = [
    {"user": "alice@example.com", "role": "admin"}, {"by": "2026-12-01", "amount": 100},
    {"text": '{"port": 8080}'}, '{"port": 8080}']


@pytest.mark.parametrize("payload", FORM_ANSWERS, ids=repr)
async def test_an_authenticated_answer_that_is_no_decision_reaches_the_graph_unchanged(
        payload: Any) -> None:
    """Every authenticated answer was rewritten as an approval: a form's `user` became the
    caller, its `by` date was lost, JSON text got a `userId`. Only a decision names the
    caller; anything else is the graph's own data, sent as it came (the ledger still says
    who answered)."""
    ledger, sent = await _answered_three_ways(payload)
    # The legacy form's JSON text is decoded for the one interrupt it answers.
    decoded = orjson.loads(payload) if isinstance(payload, str) else payload
    assert sent == [payload, decoded, payload]
    for approval_id in ("i1", "i2", "i3", "i4"):
        answered = await ledger.get(approval_id)
        assert answered is not None
        assert answered.answered_by == "bob"


async def test_an_unauthenticated_answer_is_sent_as_it_came() -> None:
    """Without a principal nobody is known to have answered: the answer's own word stays."""
    ledger = MemoryApprovalStore()
    await ledger.add([pending("i1")])
    entry = parse_run_input({
        "threadId": "t", "runId": "r2", "messages": [], "tools": [], "context": [],
        "state": {}, "forwardedProps": {},
        "resume": [{"interruptId": "i1", "status": "resolved",
                    "payload": {"action": "approve", "by": "cfo"}}]})
    claims = await claim_resume(ledger, agent_id="flow", input=entry, pending={"i1"},
                                channel="outcome")
    assert (claims.input.model.resume or [])[0].payload == {"action": "approve", "by": "cfo"}


@pytest.mark.parametrize("answer", ["null", " null ", None, "{}", {}], ids=repr)
async def test_a_legacy_answer_of_null_text_is_no_answer(answer: Any) -> None:
    """The legacy answer `"null"` (what `JSON.stringify(null)` gives, GraphQL's
    `metaEvents[].response` too) was decoded after the rule that drops empty answers, so
    LangGraph got None and failed the run (AGENT_ERROR, a traceback in the log). It is no
    answer, as `{}` already was: the question is asked again and the approval waits."""
    runtime = approving_runtime()
    approval = await interrupted(runtime)
    events = await drive(runtime, run_input(
        "", thread=THREAD, run="r-null", messages=[], protocolVersion="1.0",
        forwardedProps={"command": {"resume": answer}}))
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert events[-1]["outcome"]["type"] == "interrupt"
    still, _, _ = await runtime.approvals.get(approval.id)
    assert (still.status, still.answer) == ("pending", None)
    events = await drive(runtime, resume_body("r-real", (approval.id, {"action": "approve"})))
    assert types(events)[-1] == "RUN_FINISHED"
    await assert_applied(runtime, approval.id, {"action": "approve"})
    await runtime.aclose()


async def test_an_interrupt_id_no_ledger_can_keep_is_a_precise_error(
        ledger: ApprovalStore) -> None:
    """A NUL byte in a resume's `interruptId` was looked up (PostgreSQL refuses NUL in text:
    the run failed with AGENT_ERROR and a stack in the log), and a 100,000-character id was
    echoed whole in the error."""
    for bad in ("i\x00d", "x" * 100_000):
        with pytest.raises(ApprovalError) as caught:
            await claim_resume(ledger, agent_id="flow", input=resume_input(bad, {}),
                               pending=set(), channel="outcome")
        assert caught.value.code == "INTERRUPT_NOT_PENDING"
        assert len(caught.value.message) < 200
        assert "\x00" not in caught.value.message


@pytest.mark.parametrize("payload", [
    {"action": "timeout"}, {"decision": "expired", "reason": "too late"},
    {"answer": {"status": "timed_out"}}, '{"action": "Timeout"}'])
async def test_a_client_cannot_answer_timeout(ledger: ApprovalStore, payload: Any) -> None:
    """`timeout` is the runtime's answer once a deadline passed. Over AG-UI a client could
    send it (the HTTP route allows only approve, reject and revise), taking the workflow's
    no-answer path before the deadline, recorded as answered by the client."""
    await ledger.add([pending("i1")])
    forged = parse_run_input({
        "threadId": "t", "runId": "r2", "messages": [], "tools": [], "context": [],
        "state": {}, "forwardedProps": {},
        "resume": [{"interruptId": "i1", "status": "resolved", "payload": payload}]})
    with pytest.raises(InvalidRequestError) as caught:
        await claim_resume(ledger, agent_id="flow", input=forged, pending={"i1"},
                           channel="outcome")
    assert "timeout" in caught.value.message
    untouched = await ledger.get("i1")
    assert untouched is not None
    assert (untouched.status, untouched.answer) == ("pending", None)
    # The legacy form (`forwardedProps.command.resume`) is held to the same rule.
    legacy = parse_run_input({
        "threadId": "t", "runId": "r3", "messages": [], "tools": [], "context": [],
        "state": {}, "forwardedProps": {"command": {"resume": payload}}})
    with pytest.raises(InvalidRequestError):
        await claim_resume(ledger, agent_id="flow", input=legacy, pending={"i1"},
                           channel="outcome")
    # Words typed into a chat are never a timeout: "expired" is what to change.
    await claim_resume(ledger, agent_id="flow", input=resume_input("i1", {}),
                       pending={"i1"}, channel="outcome")
    answered = await ledger.get("i1")
    assert answered is not None
    assert answered.status == "answered"


async def test_a_forged_timeout_over_agui_is_a_run_error_and_the_approval_waits() -> None:
    runtime = approving_runtime()
    approval = await interrupted(runtime)
    events = await drive(runtime, resume_body("r-forged", (approval.id, {"action": "timeout"})))
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"]
    assert events[-1]["code"] == "INVALID_REQUEST"
    assert "deadline" in events[-1]["message"]
    still, _, _ = await runtime.approvals.get(approval.id)
    assert still.status == "pending"
    events = await drive(runtime, resume_body("r-real", (approval.id, {"action": "approve"})))
    assert types(events)[-1] == "RUN_FINISHED"
    await assert_applied(runtime, approval.id, {"action": "approve"})
    await runtime.aclose()


class SlowSaver(InMemorySaver):
    """Checkpoints that take a moment to store, the end of each write logged."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    async def aput(self, config: Any, checkpoint: Any, metadata: Any,
                   new_versions: Any) -> Any:
        await asyncio.sleep(0.1)
        stored = await super().aput(config, checkpoint, metadata, new_versions)
        self.log.append("stored")
        return stored


def approving_graph(log: list[str]) -> Any:
    """`ask` interrupts for an approval; `act` is the approved action (a payment, a mail)."""
    class State(TypedDict, total=False):
        approved: bool

    def ask(state: State) -> State:
        return {"approved": bool(interrupt({"question": "Pay the invoice?"}))}

    def act(state: State) -> State:
        log.append("act")
        return {}

    builder = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_node("act", act)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "act")
    builder.add_edge("act", END)
    return builder.compile(checkpointer=SlowSaver(log))


@pytest.mark.parametrize(("durability", "stored_first"), [("sync", True), ("async", False)])
async def test_the_answered_step_is_stored_before_the_approved_action_runs(
        serve_runtime: ServeRuntime, durability: str, stored_first: bool) -> None:
    """By default the checkpoint that says the interrupt was answered is stored before the
    approved action runs. LangGraph's own default ("async") stored it while the action ran:
    a worker killed then left the interrupt pending with the action done, and recovery sent
    the answer again (the prober's repro: 20 of 20 answers applied twice)."""
    log: list[str] = []
    options: dict[str, Any] = {} if durability == "sync" else {"durability": durability}
    runtime = CopilotRuntime(agents={"pay": LangGraphAgent(
        name="pay", graph=approving_graph(log), **options)})
    async with serve_runtime(runtime) as served:
        asked = await served.run(run_input("pay it", thread="t", run="r1",
                                           protocolVersion="1.0"), agent="pay")
        (question,) = asked[-1]["outcome"]["interrupts"]
        log.clear()
        answered = await served.run(run_input("", thread="t", run="r2", protocolVersion="1.0",
                                              resume=[{"interruptId": question["id"],
                                                       "status": "resolved",
                                                       "payload": True}]), agent="pay")
    assert answered[-1]["type"] == "RUN_FINISHED"
    assert "act" in log
    assert (log[0] == "stored") is stored_first, log


# -- listings a page at a time -------------------------------------------------------------------


def answered(approval_id: str, at: float, thread: str = "t") -> Approval:
    return Approval(approval_id, thread, "lg", {"question": "Approve?"}, at, status="answered",
                    answer={"action": "approve", "payload": "x" * 1000}, answered_at=at)


async def test_a_ledger_lists_a_page_after_a_key(ledger: ApprovalStore) -> None:
    """Every ledger reads a listing a page at a time, oldest first, ties by id, the
    page after a key holding only what follows it (the HTTP listing read every approval
    ever made, each with its answer, on every request)."""
    now = time.time()
    made = [answered(f"a{n}", now + n // 2) for n in range(7)] + [pending("p1")]
    await ledger.add(made[::-1])
    everything = [a.id for a in await ledger.find(status=None)]
    assert everything == sorted(everything, key=lambda i: next(
        a.key for a in made if a.id == i))
    answered_ids = [i for i in everything if i != "p1"]
    for status, expected in ((None, everything), ("answered", answered_ids)):
        pages: list[list[str]] = []
        listed: list[str] = []
        after = None
        while True:
            page = await ledger.find(status=status, after=after, limit=3)
            if not page:
                break
            pages.append([a.id for a in page])
            listed += pages[-1]
            after = page[-1].key
        assert [len(p) for p in pages] == [3] * (len(expected) // 3) + (
            [len(expected) % 3] if len(expected) % 3 else [])
        assert listed == expected


async def test_the_approvals_route_lists_a_page_at_a_time(serve_runtime: ServeRuntime) -> None:
    """`GET /approvals` answered every approval the ledger ever had, each with its answer, in
    one body (47 MB for 15 answers of 3 MB). It answers 100 a page now (`limit` up to 500),
    `nextCursor` naming where the next page starts."""
    from copilot_runtime.approvals import MemoryApprovalStore

    store = MemoryApprovalStore()
    now = time.time()
    await store.add([answered(f"a{n:03}", now + n % 50) for n in range(150)])
    runtime = approving_runtime(store)
    expected = [a.id for a in await store.find(status=None)]
    async with serve_runtime(runtime) as served:
        async def listing(query: str) -> tuple[int, Any]:
            response = await served.session.get(f"{served.url}/approvals?{query}")
            return response.status, await response.json()

        status, first = await listing("status=all")
        assert status == 200
        assert len(first["approvals"]) == 100
        status, rest = await listing(f"status=all&cursor={first['nextCursor']}")
        assert rest["nextCursor"] is None
        assert [a["id"] for a in first["approvals"] + rest["approvals"]] == expected
        seen, cursor = [], ""
        while cursor is not None:
            status, page = await listing(f"status=answered&limit=40{cursor}")
            assert status == 200
            assert len(page["approvals"]) <= 40
            seen += [a["id"] for a in page["approvals"]]
            cursor = page["nextCursor"] and f"&cursor={page['nextCursor']}"
        assert seen == expected
        for query in ("limit=0", "limit=501", "limit=x", "cursor=%21", "cursor=WzFd",
                      "limit=2&limit=3", "cursor=bm90IGpzb24"):
            status, refused = await listing(query)
            assert (query, status) == (query, 400), refused


async def test_a_page_is_filled_with_what_its_caller_may_see(ledger: ApprovalStore) -> None:
    """A page was cut from the ledger first and filtered after: a caller whose approvals
    lay beyond others' got an empty page and a cursor naming someone else's approval. The
    ledgers are read on, each thread's owner looked up once and recorded on its approvals,
    and the next page starts after the caller's own last one."""
    now = time.time() - 3600
    mine = {230, 231, 460}
    await ledger.add([answered(f"a{n:03}", now + n, f"bob-{n}" if n in mine else f"al-{n % 3}")
                      for n in range(500)])
    service = approving_runtime(ledger).approvals  # type: ignore[arg-type]
    asked: list[str] = []

    async def thread_owner(thread_id: str) -> ThreadOwner:
        asked.append(thread_id)
        return ThreadOwner(thread_id.partition("-")[0])

    def page(viewer: Viewer, **options: Any) -> Any:
        return service.page(status=None, viewer=viewer, thread_owner=thread_owner, **options)

    bob = Viewer(ThreadOwner("bob"))
    first, after = await page(bob, limit=2)
    assert [a.id for a in first] == ["a230", "a231"]
    assert after == first[-1].key
    assert sorted(asked) == ["al-0", "al-1", "al-2", "bob-230", "bob-231", "bob-460"]
    rest, after = await page(bob, after=after, limit=2)
    assert ([a.id for a in rest], after) == (["a460"], None)
    assert await page(bob, thread_id="al-0") == ([], None)
    asked.clear()
    # Recorded: the ledger filters, and only the owners of the threads a page returns are
    # looked up again (what opening each one checks), none of the others'.
    assert [a.id for a in (await page(bob, limit=5))[0]] == ["a230", "a231", "a460"]
    assert await page(Viewer(ThreadOwner("dave")), limit=1) == ([], None)
    carol = Viewer(ThreadOwner("carol"), approver=True)
    assert [a.id for a in (await page(carol, limit=3))[0]] == ["a000", "a001", "a002"]
    assert asked == ["bob-230", "bob-231", "bob-460", "al-0", "al-1", "al-2"]


async def test_a_page_looks_up_a_bounded_number_of_owners(ledger: ApprovalStore) -> None:
    """A caller who may see none of the approvals made every `GET /approvals?limit=1` read
    the whole ledger and look up the owner of each of its threads (10,000 thread-store
    reads a request for 10,000 approvals of others'). A page looks up at most
    `_OWNER_READS` owners, records them on the ledger, and its cursor names none of the
    others' approvals: a listing pages through once, and costs no lookup after but those
    of the threads it returns (what opening each one checks)."""
    from copilot_runtime.approvals import service as approval_service

    now = time.time() - 3600
    others = 3 * approval_service._OWNER_READS + 7
    await ledger.add([answered(f"a{n:04}", now + n, f"al-{n}") for n in range(others)]
                     + [answered("b0", now + others, "bob-0")])
    service = approving_runtime(ledger).approvals  # type: ignore[arg-type]
    asked: list[str] = []

    async def thread_owner(thread_id: str) -> ThreadOwner | None:
        asked.append(thread_id)
        return None if thread_id == "al-5" else ThreadOwner(thread_id.partition("-")[0])

    bob, listed, cursors, after = Viewer(ThreadOwner("bob")), [], [], None
    for _ in range(10):
        asked.clear()
        approvals, after = await service.page(status=None, limit=1, after=after, viewer=bob,
                                              thread_owner=thread_owner)
        assert len(asked) <= approval_service._OWNER_READS
        listed += [a.id for a in approvals]
        cursors.append(after)
        if after is None:
            break
    assert listed == ["b0"]
    assert len(cursors) == 4  # 308 owners, 100 a page
    assert cursors[-1] is None
    mine = (now + others, "b0")
    assert all(key in (None, approval_service._START, mine) for key in cursors)
    asked.clear()
    assert await service.page(status=None, limit=1, viewer=bob, thread_owner=thread_owner) \
        == ([(await ledger.get("b0"))], None)
    assert asked == ["bob-0"]
    ownerless = await ledger.get("a0005")
    assert ownerless is not None
    assert (ownerless.owner_known, ownerless.owner) == (True, None)


async def test_a_page_looks_up_its_threads_owners_together(ledger: ApprovalStore) -> None:
    """What a page returns is checked against its thread's owner now (as opening one by id
    is): the lookups went one after another, one a row (500 rows: ~450 ms on PostgreSQL).
    Each thread is looked up once a page, several at a time (within a bound), both to
    record owners the ledger lacks and to check what a page returns."""
    from copilot_runtime.approvals import service as approval_service

    now = time.time() - 3600
    threads = 35
    await ledger.add([answered(f"a{n:03}", now + n, f"carol-{n % threads}")
                      for n in range(3 * threads)])
    service = approving_runtime(ledger).approvals  # type: ignore[arg-type]
    asked: list[str] = []
    running, most = 0, 0

    async def thread_owner(thread_id: str) -> ThreadOwner:
        nonlocal running, most
        asked.append(thread_id)
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1
        return ThreadOwner(thread_id.partition("-")[0])

    carol = Viewer(ThreadOwner("carol"))
    for recorded in (False, True):  # (the first page records the owners on the ledger)
        asked.clear()
        most = 0
        listed, after = await service.page(status=None, limit=500, viewer=carol,
                                           thread_owner=thread_owner)
        assert (len(listed), after) == (3 * threads, None), recorded
        assert sorted(asked) == sorted(f"carol-{n}" for n in range(threads)), recorded
        assert most > 1, recorded
        assert most == min(threads, approval_service._OWNERS_AT_ONCE), recorded
    assert all(a.owner_known for a in await ledger.find(status=None))


def test_a_viewer_sees_what_it_may_approve() -> None:
    """The ledgers' filter (`Viewer`) says what `_trust.may_approve` says."""
    from copilot_runtime._trust import may_approve
    from copilot_runtime.auth import Principal, owner_of

    owners = [None, ThreadOwner("ann"), ThreadOwner("ann", "t1"), ThreadOwner("bo", "t1"),
              ThreadOwner("bo")]
    for principal in (Principal("ann"), Principal("ann", "t1"), Principal("cy", "t1", {"ok"}),
                      Principal("cy", None, {"ok"}), Principal("cy", "t2", {"ok"})):
        viewer = Viewer(owner_of(principal), bool({"ok"} & principal.roles))
        for owner in owners:
            assert viewer.sees(owner) == may_approve(principal, frozenset({"ok"}), owner), \
                (principal, owner)


async def test_an_earlier_ledger_gets_its_owner_columns(tmp_path: Path) -> None:
    """A SQLite ledger an earlier release made has no owner columns: they are added, its
    rows' owners unknown until a listing records them."""
    import sqlite3

    from copilot_runtime.approvals.sql import SQLiteApprovalStore

    path = tmp_path / "old.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(
            "CREATE TABLE copilot_approvals (id TEXT PRIMARY KEY, thread_id TEXT NOT NULL, "
            "agent_id TEXT NOT NULL, value TEXT NOT NULL, created_at REAL NOT NULL, "
            "expires_at REAL, channel TEXT NOT NULL, status TEXT NOT NULL, answer TEXT, "
            "answered_by TEXT, answered_at REAL, applied INTEGER NOT NULL DEFAULT 0)")
        conn.execute("INSERT INTO copilot_approvals VALUES ('old', 't', 'lg', '{}', 1.0, "
                     "NULL, 'outcome', 'pending', NULL, NULL, NULL, 0)")
        conn.commit()

    async def ready() -> None:
        return None

    ledger = SQLiteApprovalStore(str(path), ready)
    try:
        viewer = Viewer(ThreadOwner("ann"))
        [old] = await ledger.find(viewer=viewer)
        assert (old.id, old.owner_known) == ("old", False)
        await ledger.record_owner(["old"], ThreadOwner("bo"))
        assert await ledger.find(viewer=viewer) == []
        recorded = await ledger.get("old")
        assert recorded is not None
        assert recorded.owner == ThreadOwner("bo")
    finally:
        await ledger.aclose()


# -- deadlines of approvals another worker asked for ---------------------------------------------


@pytest.mark.parametrize("both_time", [False, True])
async def test_an_approval_asked_on_another_worker_times_out_at_its_deadline(
        both_time: bool) -> None:
    """Two workers sharing PostgreSQL (threads, coordination, checkpoints and ledger); the
    one that asked runs no timer (as the README advised for several servers), or both run
    one. A timer heard only of the approvals added in its own process, and of the others at
    its next idle wake: the timeout came up to 30 s late (the prober's repro: 26-30 s after
    a 5 s deadline). It asks the ledger each second now; with two timers at the same
    deadline the thread's lease lets one resume the graph, and the timeout is applied once."""
    with postgres_schema() as url:
        asking_payments, timing_payments = Payments(), Payments()
        asking_payments.gate.set()
        timing_payments.gate.set()
        asking = paying_runtime(url, asking_payments, expires_in=2.0,
                                thread_store=thread_store(url), coordinator=coordinator(url))
        asking.approvals.run_timer = both_time
        timing = paying_runtime(url, timing_payments, thread_store=thread_store(url),
                                coordinator=coordinator(url))
        try:
            await timing.start()  # its timer idle: nothing is pending yet
            await asking.start()
            approval = await asked(asking)
            assert approval.expires_at is not None
            async for _ in poll(15):
                settled = await agent_of(timing).approvals.get(approval.id)
                if settled is not None and settled.applied and not (
                        asking.runs.active or timing.runs.active):
                    break
            assert settled is not None
            assert (settled.status, settled.applied) == ("expired", True)
            assert settled.answered_at is not None
            assert settled.answered_at - approval.expires_at < 5.0  # not 30 s
            assert [answer["action"] for answer in asking_payments.done
                    + timing_payments.done] == ["timeout"]  # once, by either worker
            if not both_time:
                assert timing_payments.done
            record = await timing.store.get(THREAD_PAY)
            assert record is not None
            # The question's run, then one timeout's: the other timer's try left nothing.
            assert [r.run_id.startswith("approval-") for r in record.runs] == [False, True]
        finally:
            await asking.aclose()
            await timing.aclose()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_two_timers_that_both_read_an_approval_pending_time_it_out_once(
        kind: str, tmp_path: Path) -> None:
    """Two servers' timers on one ledger reach an approval at its deadline and both read it
    pending. The winner resumed the graph with the timeout; the loser, having read "pending"
    before the winner acted, began its own run once the winner's had ended: its start was
    written to the thread, it found nothing to resume, and an extra closed run stayed in the
    thread's history (a flaky CI failure of the test above). A timer now claims the timeout
    in the ledger (pending -> expired) before it begins a run: the loser's claim fails, and
    it begins none. Driven by hand: the loser is held at its first step after its reads."""
    with contextlib.ExitStack() as stack:
        if kind == "postgresql":
            url = threads_url = stack.enter_context(postgres_schema())
        else:
            url = f"sqlite:///{tmp_path / 'checkpoints.sqlite3'}"
            threads_url = f"sqlite:///{tmp_path / 'threads.sqlite3'}"
        losing_payments, winning_payments = Payments(), Payments()
        losing_payments.gate.set()
        winning_payments.gate.set()
        losing = paying_runtime(url, losing_payments, expires_in=0.2,
                                thread_store=thread_store(threads_url))
        winning = paying_runtime(url, winning_payments, thread_store=thread_store(threads_url))
        for runtime in (losing, winning):
            runtime.approvals.run_timer = False  # driven by hand below
        read, release = asyncio.Event(), asyncio.Event()

        def held(step: Any) -> Any:
            async def wait_then(*args: Any, **kwargs: Any) -> Any:
                if not read.is_set():  # the first step after its reads: a claim or a run
                    read.set()
                    await release.wait()
                return await step(*args, **kwargs)
            return wait_then

        try:
            approval = await asked(losing)
            assert approval.expires_at is not None
            await asyncio.sleep(max(0.0, approval.expires_at - time.time()) + 0.05)
            ledger = agent_of(losing).approvals
            ledger.claim = held(ledger.claim)  # type: ignore[method-assign]
            losing.start_run = held(losing.start_run)  # type: ignore[method-assign]
            loser = asyncio.create_task(losing.approvals._expire_due())
            await asyncio.wait_for(read.wait(), 10)  # it read the approval pending

            await winning.approvals._expire_due()
            await asyncio.gather(*winning.approvals._runs)
            won = await ledger.get(approval.id)
            assert won is not None
            assert (won.status, won.applied) == ("expired", True)

            release.set()
            await asyncio.wait_for(loser, 10)
            await asyncio.gather(*losing.approvals._runs)
            assert [answer["action"] for answer in losing_payments.done
                    + winning_payments.done] == ["timeout"]
            record = await winning.store.get(THREAD_PAY)
            assert record is not None
            # The question's run, then the timeout's: the loser began none.
            assert [r.run_id.startswith("approval-") for r in record.runs] == [False, True]
        finally:
            release.set()
            await losing.aclose()
            await winning.aclose()


@pytest.mark.parametrize("then", ["free", "reset"])
async def test_a_timeout_claimed_on_a_busy_thread_is_sent_once_or_withdrawn(
        then: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The timer claims a timeout before its run begins; a thread busy on another server
    then (a lease this process cannot see) keeps the claim, and the timer tries again: the
    graph gets the timeout once the thread is free, or, if the thread was reset meanwhile,
    the approval is withdrawn (as a pending one is), not left timed out and never sent."""
    from copilot_runtime._exceptions import ThreadBusyError

    ledger = MemoryApprovalStore()
    runtime = approving_runtime(ledger)
    runtime.approvals.run_timer = False  # driven by hand below
    try:
        approval = await interrupted(runtime)
        ledger._items[approval.id].expires_at = time.time() - 1
        start_run = runtime.start_run
        busy = True

        async def start_unless_busy(agent_id: str, input: Any, *args: Any,
                                    **kwargs: Any) -> Any:
            if busy:
                raise ThreadBusyError(input.model.thread_id)
            return await start_run(agent_id, input, *args, **kwargs)

        monkeypatch.setattr(runtime, "start_run", start_unless_busy)
        due = await runtime.approvals._expire_due()
        assert due is not None
        assert due <= time.time() + runtime.approvals.retry_interval  # tried again soon
        claimed = await ledger.get(approval.id)
        assert claimed is not None
        assert (claimed.status, claimed.applied) == ("expired", False)
        busy = False
        if then == "reset":
            agent = runtime.agents["lg"]
            assert isinstance(agent, LangGraphAgent)
            await agent.graph.checkpointer.adelete_thread(THREAD)  # type: ignore[union-attr]
        assert await runtime.approvals._expire_due() is None
        await asyncio.gather(*runtime.approvals._runs)
        settled = await ledger.get(approval.id)
        assert settled is not None
        record = await runtime.store.get(THREAD)
        assert record is not None
        timeouts = [r for r in record.runs if r.run_id.startswith("approval-")]
        if then == "reset":
            assert (settled.status, timeouts) == ("withdrawn", [])
        else:
            assert len(timeouts) == 1
            await assert_applied(runtime, approval.id, claimed.answer)
        assert not runtime.approvals._timed_out
    finally:
        await runtime.aclose()


async def test_the_timer_asks_a_shared_ledger_for_its_earliest_deadline_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking each second is cheap: one indexed row, not a read of every pending approval
    (`find`, the scan), which runs only when a deadline is due or new."""
    with postgres_schema() as url:
        payments = Payments()
        runtime = paying_runtime(url, payments)
        runtime.approvals.poll_interval = 0.05
        ledger = agent_of(runtime).approvals
        far = time.time() + 3600
        await ledger.add([Approval(f"a-{i}", f"t-{i}", "lg", {"message": "ok?"}, far,
                                   expires_at=far + i) for i in range(500)])
        scans, asked_for = 0, 0
        find, next_deadline = ledger.find, ledger.next_deadline  # type: ignore[attr-defined]

        async def counted_find(**options: Any) -> list[Approval]:
            nonlocal scans
            scans += 1
            return await find(**options)

        async def counted_next_deadline(agent_ids: Any) -> float | None:
            nonlocal asked_for
            asked_for += 1
            return await next_deadline(agent_ids)

        monkeypatch.setattr(ledger, "find", counted_find)
        monkeypatch.setattr(ledger, "next_deadline", counted_next_deadline)
        try:
            await runtime.start()
            async for _ in poll(15):
                if asked_for >= 20:
                    break
            assert asked_for >= 20
            assert scans == 1  # at start; the deadlines asked for since did not change
        finally:
            await runtime.aclose()


class _EarlierLedger:
    """A ledger written to the protocol before viewers: its `find` takes no `viewer`."""

    def __init__(self, inner: MemoryApprovalStore) -> None:
        self._inner = inner

    async def find(self, *, status: Any = "pending", agent_id: str | None = None,
                   thread_id: str | None = None, after: Any = None,
                   limit: int | None = None) -> Any:
        return await self._inner.find(status=status, agent_id=agent_id, thread_id=thread_id,
                                      after=after, limit=limit)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_a_ledger_of_the_earlier_protocol_still_lists_without_a_viewer() -> None:
    """Listings without authentication pass no `viewer`: an application's own ledger,
    written before the viewers, failed every `GET /approvals` with a TypeError."""
    inner = MemoryApprovalStore()
    now = time.time() - 60
    await inner.add([answered("a1", now, "t-1"), answered("a2", now + 1, "t-2")])
    service = approving_runtime(_EarlierLedger(inner)).approvals  # type: ignore[arg-type]
    approvals, after = await service.page(status=None, limit=5)
    assert ([a.id for a in approvals], after) == (["a1", "a2"], None)


async def test_the_ledger_refuses_an_answer_claimed_past_the_deadline(
        ledger: ApprovalStore) -> None:
    """A claim for "answered" is the compare-and-set that decides an answer, so it is what
    holds the deadline: every path that records an answer (a resume, an HTTP answer that
    does not wait) goes through it. Before the fix a claim landing after `expiresAt` (a
    slow guardrail judge in between) was recorded, and the graph took it."""
    now = time.time()
    await ledger.add([Approval("late", "t", "flow", {}, now, now + 10),
                      Approval("in-time", "t", "flow", {}, now, now + 10),
                      Approval("open", "t", "flow", {}, now)])
    for at in (now + 10, now + 11):  # at the deadline is past it, as `expired_at` says
        assert await ledger.claim("late", "answered", {"action": "approve"}, "ann",
                                  at) is None
    still = await ledger.get("late")
    assert still is not None
    assert (still.status, still.answer) == ("pending", None)
    # The timeout is what the deadline leaves; answers in time, or without one, stand.
    assert await ledger.claim("late", "expired", {"action": "timeout"}, "runtime", now + 11)
    assert await ledger.claim("in-time", "answered", {"action": "approve"}, "ann", now + 9)
    assert await ledger.claim("open", "answered", {"action": "approve"}, "ann", now + 1e6)


class _SlowJudge:
    """A guardrail whose judge takes until after a deadline (a model's call, say)."""

    def __init__(self) -> None:
        self.until = 0.0

    async def check(self, messages: Any, principal: Any) -> Verdict:
        await asyncio.sleep(max(0.0, self.until - time.time()))
        return Verdict(True)


def _ask_by_deadline(state: State) -> dict[str, Any]:
    return {"answer": interrupt({"message": "Pay?",
                                 "expiresAt": iso_time(time.time() + 0.5)})}


async def test_an_answer_that_does_not_wait_is_refused_once_its_deadline_passed() -> None:
    """An HTTP answer with `"wait": false` sent before the deadline and recorded after it
    (its guardrail judged it meanwhile) was accepted, and the graph took it instead of
    the timeout; `"wait": true` was refused. Both are 410 now, and the timer answers."""
    judge = _SlowJudge()
    builder: StateGraph[State] = StateGraph(State)
    builder.add_node("ask", _ask_by_deadline)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    agent = LangGraphAgent(name="lg", graph=builder.compile(checkpointer=InMemorySaver()))
    runtime = CopilotRuntime(agents={"lg": agent}, guardrails=[judge])
    try:
        approval = await interrupted(runtime)
        assert approval.expires_at is not None
        judge.until = approval.expires_at + 0.2
        with pytest.raises(ApprovalClosedError) as caught:
            await runtime.approvals.answer(approval.id, {"action": "approve"},
                                           answered_by="ann", wait=False)
        assert (caught.value.status, caught.value.code) == (410, "APPROVAL_EXPIRED")
        async for _ in poll(10):
            if not runtime.is_running(THREAD):
                break
        left, _, _ = await runtime.approvals.get(approval.id)
        assert (left.status, left.answer) == ("pending", None)
        assert await agent.pending_interrupt_ids(THREAD) == {approval.id}
        await runtime.approvals.start()  # the timer sends the timeout
        async for _ in poll(10):
            timed_out, _, _ = await runtime.approvals.get(approval.id)
            if timed_out.applied and not runtime.is_running(THREAD):
                break
        assert (timed_out.status, timed_out.applied) == ("expired", True), timed_out
        state = await agent.graph.aget_state({"configurable": {"thread_id": THREAD}})
        assert state.values["answer"]["action"] == "timeout"
    finally:
        await runtime.aclose()


async def test_a_cursor_no_ledger_can_look_up_is_refused(
        ledger: ApprovalStore, serve_runtime: ServeRuntime) -> None:
    """A listing's cursor whose id held NUL was sent to the ledger: PostgreSQL refuses NUL
    in text, a 500 (SQLite answered 200). Its id is checked as the threads listing checks
    its cursor's: a 400."""
    runtime = approving_runtime(ledger)  # type: ignore[arg-type]
    async with serve_runtime(runtime) as served:
        for bad in ("a\x00b", "a\u202eb", "x" * 300):
            response = await served.session.get(
                f"{served.url}/approvals?status=all&cursor={to_cursor([0, bad])}")
            body = await response.json()
            assert (response.status, body) == (
                400, {"error": "'cursor' must be a nextCursor this server gave"})
        response = await served.session.get(  # the first page's own key is no problem
            f"{served.url}/approvals?status=all&cursor={to_cursor([0, ''])}")
        assert response.status == 200


async def test_a_resume_that_names_an_interrupt_twice_is_refused() -> None:
    """A resume listing one interruptId twice claimed the first entry, failed the second's
    claim, put the first back, and ended with APPROVAL_ALREADY_ANSWERED: nothing was
    answered. It is INVALID_REQUEST now, before anything is claimed."""
    runtime = approving_runtime()
    approval = await interrupted(runtime)
    events = await drive(runtime, resume_body(
        "r-twice", (approval.id, {"action": "approve"}), (approval.id, {"action": "reject"})))
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"]
    assert events[-1]["code"] == "INVALID_REQUEST", events[-1]
    assert "more than once" in events[-1]["message"]
    still, _, _ = await runtime.approvals.get(approval.id)
    assert (still.status, still.answer) == ("pending", None)
    events = await drive(runtime, resume_body("r-once", (approval.id, {"action": "approve"})))
    await assert_applied(runtime, approval.id, {"action": "approve"})


async def test_the_memory_ledger_keeps_a_bounded_number_of_settled_approvals() -> None:
    """The in-memory ledger kept every approval for the life of the process (~1 KB an
    interrupt, answered, expired or withdrawn long ago). Settled ones are kept among the
    latest `max_settled` (10,000 by default); live ones (pending, answered and not yet
    applied) are never dropped for settled ones."""
    store = MemoryApprovalStore()
    assert (store.max_settled, store.max_live) == (10_000, 10_000)
    now = time.time()
    await store.add([pending("live"), answered("unapplied", now)])
    for n in range(10_050):
        await store.add([pending(f"a{n}")])
        assert await store.claim(f"a{n}", "answered", {"action": "approve"}, "http", now)
        await store.settle(f"a{n}", "applied")
    assert len(store._items) == 10_002
    assert await store.get("a49") is None  # the oldest settled went first
    recent = await store.get("a10049")
    assert recent is not None
    assert (recent.status, recent.applied) == ("answered", True)
    assert await store.claim("a10049", "answered", {}, "http", now) is None  # still refused
    assert [a.id for a in await store.find()] == ["live"]
    assert [a.id for a in await store.unapplied()] == ["unapplied"]
    # Withdrawn is settled too; a thread's delete forgets its approvals from both orders.
    await store.add([pending("gone", thread="t2")])
    await store.settle("gone", "withdrawn")
    assert await store.get("a50") is None
    assert await store.get("gone") is not None
    await store.forget_thread("t2")
    await store.forget_thread("t")
    assert (store._items, store._live, store._settled) == ({}, {}, {})


async def test_the_memory_ledger_drops_settled_approvals_after_a_while() -> None:
    store = MemoryApprovalStore(settled_seconds=0.05)
    await store.add([pending("old"), pending("waits")])
    await store.settle("old", "withdrawn")
    await asyncio.sleep(0.1)
    await store.add([pending("new")])
    assert await store.get("old") is None
    assert {a.id for a in await store.find()} == {"waits", "new"}  # pending: no deadline here


async def test_the_memory_ledger_drops_the_oldest_live_approval_past_its_bound() -> None:
    """Pending approvals are obligations, but bounded too: past `max_live` the oldest goes
    (its graph still waits: a resume or a listing of its thread records it again)."""
    store = MemoryApprovalStore(max_live=2)
    await store.add([pending("p1"), pending("p2")])
    await store.add([pending("p3")])
    assert [a.id for a in await store.find()] == ["p2", "p3"]
    await store.add([pending("p1")])  # recorded again, as `record_waiting` does
    assert [a.id for a in await store.find()] == ["p3", "p1"]


async def test_an_answer_to_a_recently_settled_approval_is_still_refused_as_answered() -> None:
    """Through the service: a second answer to an approval the ledger still keeps is a
    409 saying it was answered; one past the bound is a 404, as one never asked."""
    ledger = MemoryApprovalStore(max_settled=1)
    runtime = approving_runtime(ledger)
    first = await interrupted(runtime)
    assert (await runtime.approvals.answer(first.id, {"action": "approve"}))[
        "run"]["status"] == "finished"
    with pytest.raises(ApprovalClosedError) as closed:
        await runtime.approvals.answer(first.id, {"action": "approve"})
    assert closed.value.code == "APPROVAL_ALREADY_ANSWERED"
    # The thread's next question, answered, pushes the first out of the ledger.
    second = await interrupted(runtime)
    await runtime.approvals.answer(second.id, {"action": "reject"})
    with pytest.raises(ApprovalNotFoundError):
        await runtime.approvals.answer(first.id, {"action": "approve"})
    with pytest.raises(ApprovalClosedError):
        await runtime.approvals.answer(second.id, {"action": "approve"})
    await runtime.aclose()


def test_only_what_names_the_approver_is_the_caller() -> None:
    """Before: every `user`/`by` key of a decision was replaced, an object of the graph's
    own included, and every nested `answer`/`feedback`/`text` rewritten (a review)."""
    from copilot_runtime.approvals.decisions import answered_by

    profile = {"id": 7, "email": "bob@example.com"}
    assert answered_by({"approved": True, "user": profile}, "alice") == {
        "approved": True, "user": profile, "userId": "alice"}
    assert answered_by({"action": "approve", "userId": "bob", "by": {"deadline": "d"}},
                       "alice") == {"action": "approve", "userId": "alice",
                                    "by": {"deadline": "d"}}
    assert answered_by({"action": "approve", "by": "bob", "text": '{"by": "x"}'},
                       "alice") == {"action": "approve", "by": "alice", "userId": "alice",
                                    "text": '{"by": "x"}'}
