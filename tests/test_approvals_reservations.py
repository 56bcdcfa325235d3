"""A run that resumes an approval gives its thread back when it is cancelled before it
drives, and the decision it carried is not lost.

The approval service reserves the thread (`start_run`) and drives the run in a task of its
own. A task cancelled before its first step (the service closing just after an answer, the
timer's resend or its timeout) never runs its code: the run is given back all the same. Its
agent never ran, so it claimed nothing: an answer over HTTP leaves the approval pending (to
be answered again), a stored answer stays stored and is sent at the next start. An answer
that does not wait is recorded by its run before the caller hears back: closed after that,
it is sent at the next start (of this process or of a new one on the same database). A run
cancelled while it claims puts back what it claimed. After each, the thread takes a new
run at once and the approval's answer reaches the graph.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import orjson
import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt
from structlog.testing import capture_logs
from typing_extensions import TypedDict

from copilot_runtime import CopilotRuntime, create_app, thread_store
from copilot_runtime._exceptions import ApprovalClosedError
from copilot_runtime._input import parse_run_input
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.approvals import Approval, ApprovalStore, MemoryApprovalStore
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.events import Event
from copilot_runtime.threads import INTERRUPTED_CODE
from tests.conftest import poll, run_input, types
from tests.hitl_support.postgres import postgres_schema as hitl_postgres_schema
from tests.scale_support.services import postgres_schema, redis_prefix

pytestmark = pytest.mark.timeout(60)

PATH = "/api/copilotkit"
THREAD = "t-approve"


class State(TypedDict, total=False):
    answer: Any


def ask(state: State) -> dict[str, Any]:
    return {"answer": interrupt({"message": "ok?"})}


class GatedClaims(MemoryApprovalStore):
    """A ledger whose claims, once `gated` is set, are made but answer only when `gate`
    opens (a database that committed, its reply still on the way)."""

    def __init__(self) -> None:
        super().__init__()
        self.gated = False
        self.claiming = asyncio.Event()
        self.gate = asyncio.Event()

    async def claim(self, approval_id: str, status: Literal["answered", "expired"],
                    answer: Any, answered_by: str | None, at: float) -> Approval | None:
        claimed = await super().claim(approval_id, status, answer, answered_by, at)
        if self.gated:
            self.claiming.set()
            await self.gate.wait()
        return claimed


def approving_runtime(ledger: MemoryApprovalStore | None = None,
                      **options: Any) -> CopilotRuntime:
    builder: StateGraph[State] = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    return CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph,
                                                       approvals=ledger)}, **options)


async def drive(runtime: CopilotRuntime, body: dict[str, Any]) -> list[Event]:
    run = await runtime.start_run("lg", parse_run_input(body))
    events: list[Event] = []

    async def write(batch: Any) -> None:
        events.extend(batch)

    async with run:
        await run.drive(write)
    return events


async def interrupted(runtime: CopilotRuntime) -> Approval:
    """A run of the graph that stops at its question: the approval it left pending."""
    events = await drive(runtime, run_input("Go", thread=THREAD, protocolVersion="1.0"))
    assert events[-1]["outcome"]["type"] == "interrupt"
    (approval,) = await runtime.approvals.list()
    return approval


def on_reserve(runtime: CopilotRuntime) -> asyncio.Event:
    """Set as soon as the approval service has reserved a thread: the test task wakes up
    before the task that should drive the run takes its first step."""
    reserved = asyncio.Event()
    start_run: Callable[..., Awaitable[Any]] = runtime.start_run

    async def reserving(*args: Any, **kwargs: Any) -> Any:
        run = await start_run(*args, **kwargs)
        reserved.set()
        return run

    runtime.start_run = reserving  # type: ignore[method-assign]
    return reserved


async def closed_once_reserved(runtime: CopilotRuntime, reserved: asyncio.Event) -> None:
    """Close the approval service just after it reserved a thread for a run."""
    async with asyncio.timeout(10):
        await reserved.wait()
    assert runtime.approvals._runs, "the run's task was made"
    await runtime.approvals.aclose()


async def assert_applied(runtime: CopilotRuntime, approval_id: str, answer: Any) -> None:
    """The thread is free, and the approval's answer is the one the graph got."""
    assert THREAD not in runtime.runs.active
    settled, _, agent = await runtime.approvals.get(approval_id)
    assert settled.applied
    assert settled.answer == answer
    assert isinstance(agent, LangGraphAgent)
    state = await agent.graph.aget_state({"configurable": {"thread_id": THREAD}})
    assert state.values["answer"] == answer
    assert await agent.pending_interrupt_ids(THREAD) == set()


async def applied_in_time(runtime: CopilotRuntime, approval_id: str, answer: Any) -> None:
    """Wait (20 s at most) until the approval is applied and its run is over, then check it."""
    async for _ in poll(20):
        settled, _, _ = await runtime.approvals.get(approval_id)
        if settled.applied and THREAD not in runtime.runs.active:
            break
    await assert_applied(runtime, approval_id, answer)


async def post(app: Any, path: str, body: Any) -> tuple[int | None, Any]:
    """POST `body` to the ASGI `app` in this process."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
             "query_string": b"", "client": ("127.0.0.1", 5000),
             "headers": [(b"content-type", b"application/json")]}
    await app(scope, receive, send)
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
    return status, orjson.loads(b"".join(m.get("body", b"") for m in sent
                                         if m["type"] == "http.response.body"))


# -- an answer over HTTP: the approval stays pending --------------------------------------


@pytest.mark.parametrize("wait", [False, True])
async def test_an_answer_whose_run_is_cancelled_before_it_drives(wait: bool) -> None:
    runtime = approving_runtime()
    approval = await interrupted(runtime)
    reserved = on_reserve(runtime)
    answering = asyncio.create_task(runtime.approvals.answer(
        approval.id, {"action": "approve"}, wait=wait))
    await closed_once_reserved(runtime, reserved)
    async with asyncio.timeout(10):
        result = await answering
    # The run never drove: the answer did not reach the graph, and the ledger says so.
    assert result["run"]["status"] == "cancelled"
    assert result["approval"]["status"] == "pending"
    assert THREAD not in runtime.runs.active
    still, _, agent = await runtime.approvals.get(approval.id)
    assert still.status == "pending"
    assert await agent.pending_interrupt_ids(THREAD) == {approval.id}
    # The same decision, sent again, resumes the graph on the free thread.
    again = await runtime.approvals.answer(approval.id, {"action": "approve"})
    assert again["run"]["status"] == "finished"
    assert again["approval"]["answeredBy"] == "http"
    await assert_applied(runtime, approval.id, {"action": "approve"})
    await runtime.aclose()


@pytest.fixture(params=["postgresql", "redis"])
def coordinator_url(request: pytest.FixtureRequest) -> Iterator[str]:
    made = postgres_schema("appr") if request.param == "postgresql" else redis_prefix()
    with made as url:
        yield f"{url}&lease_ttl=30"


async def test_the_lease_is_released(coordinator_url: str, tmp_path: Path) -> None:
    runtime = approving_runtime(thread_store=thread_store(f"sqlite:///{tmp_path}/t.db"),
                                coordinator=coordinator_url)
    await runtime.start()
    approval = await interrupted(runtime)
    reserved = on_reserve(runtime)
    answering = asyncio.create_task(runtime.approvals.answer(
        approval.id, {"action": "approve"}, wait=False))
    await closed_once_reserved(runtime, reserved)
    async with asyncio.timeout(10):
        assert (await answering)["run"]["status"] == "cancelled"
    coordinator = runtime.runs.coordinator
    durable = runtime.runs.durable
    assert coordinator is not None
    assert durable is not None
    # Released, not left to expire (30 s); the run's start, already written, is closed.
    assert await coordinator.holder(THREAD) is None
    assert await durable.open_runs() == []
    record = await runtime.store.get(THREAD)
    assert record is not None
    assert record.runs[-1].events[-1]["code"] == INTERRUPTED_CODE
    again = await runtime.approvals.answer(approval.id, {"action": "approve"})
    assert again["run"]["status"] == "finished"
    await assert_applied(runtime, approval.id, {"action": "approve"})
    await runtime.aclose()


async def test_the_http_route_when_the_run_is_cancelled_before_it_drives() -> None:
    runtime = approving_runtime()
    app = create_app(runtime, PATH)
    approval = await interrupted(runtime)
    reserved = on_reserve(runtime)
    answering = asyncio.create_task(post(app, f"{PATH}/approvals/{approval.id}",
                                         {"action": "reject", "reason": "no"}))
    await closed_once_reserved(runtime, reserved)
    async with asyncio.timeout(10):
        status, data = await answering
    assert status == 200, data
    assert data["run"]["status"] == "cancelled"
    assert data["approval"]["status"] == "pending"
    assert THREAD not in runtime.runs.active
    status, data = await post(app, f"{PATH}/approvals/{approval.id}",
                              {"action": "reject", "reason": "no"})
    assert status == 200, data
    assert data["run"]["status"] == "finished"
    assert data["approval"]["status"] == "answered"
    await assert_applied(runtime, approval.id, {"action": "reject", "reason": "no"})
    await runtime.aclose()


async def test_the_http_route_without_waiting_when_the_runtime_closes_first() -> None:
    runtime = approving_runtime()
    app = create_app(runtime, PATH)
    approval = await interrupted(runtime)
    reserved = on_reserve(runtime)
    answering = asyncio.create_task(post(app, f"{PATH}/approvals/{approval.id}",
                                         {"action": "approve", "wait": False}))
    await closed_once_reserved(runtime, reserved)
    async with asyncio.timeout(10):
        status, data = await answering
    # Not "202 accepted": nothing was recorded, and the reply says so.
    assert status == 200, data
    assert (data["run"]["status"], data["approval"]["status"]) == ("cancelled", "pending")
    status, data = await post(app, f"{PATH}/approvals/{approval.id}",
                              {"action": "approve", "wait": False})
    assert status == 202, data
    assert data["approval"]["status"] == "answered"
    await applied_in_time(runtime, approval.id, {"action": "approve"})
    await runtime.aclose()


async def test_an_answer_cancelled_while_it_reserves_the_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Already handled by `RunManager.begin`: kept so it stays so (the request that carried
    # the decision is gone before the thread is reserved).
    runtime = approving_runtime()
    approval = await interrupted(runtime)
    reading, gate = asyncio.Event(), asyncio.Event()
    summary = runtime.runs.store.summary

    async def slow_summary(thread_id: str) -> Any:
        reading.set()
        await gate.wait()
        return await summary(thread_id)

    monkeypatch.setattr(runtime.runs.store, "summary", slow_summary)
    answering = asyncio.create_task(runtime.approvals.answer(
        approval.id, {"action": "approve"}))
    async with asyncio.timeout(10):
        await reading.wait()
    assert THREAD in runtime.runs.active
    answering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await answering
    assert THREAD not in runtime.runs.active
    assert not runtime.approvals._runs
    still, _, _ = await runtime.approvals.get(approval.id)
    assert still.status == "pending"
    gate.set()
    again = await runtime.approvals.answer(approval.id, {"action": "approve"})
    assert again["run"]["status"] == "finished"
    await assert_applied(runtime, approval.id, {"action": "approve"})
    await runtime.aclose()


# -- the timer: a stored answer, or a timeout, is sent at the next start -----------------


@pytest.mark.parametrize("why", ["recovered", "expired"])
async def test_the_timers_run_cancelled_before_it_drives(why: str) -> None:
    ledger = MemoryApprovalStore()
    runtime = approving_runtime(ledger)
    approval = await interrupted(runtime)
    if why == "recovered":
        # An answer stored before a crash, which never reached the graph.
        answer: Any = {"action": "approve", "userId": "ann"}
        assert await ledger.claim(approval.id, "answered", answer, "ann", time.time())
    else:
        ledger._items[approval.id].expires_at = time.time() - 1
    reserved = on_reserve(runtime)
    await runtime.approvals.start()
    await closed_once_reserved(runtime, reserved)
    assert THREAD not in runtime.runs.active
    kept = await ledger.get(approval.id)
    assert kept is not None
    assert not kept.applied
    # The timer claims a timeout before its run begins: kept claimed, not applied.
    assert kept.status == ("answered" if why == "recovered" else "expired")
    # The next start sends the decision again; it reaches the graph this time.
    await runtime.approvals.start()
    async for _ in poll(20):
        settled = await ledger.get(approval.id)
        if settled is not None and settled.applied:
            break
    assert settled is not None
    if why == "expired":
        assert settled.status == "expired"
        answer = settled.answer
        assert answer["action"] == "timeout"
    await assert_applied(runtime, approval.id, answer)
    await runtime.aclose()


# -- a chat's resume: claims it could not go on with go back ------------------------------


def resume_body(run: str, *entries: tuple[str, Any]) -> dict[str, Any]:
    return run_input("", thread=THREAD, run=run, messages=[], protocolVersion="1.0", resume=[
        {"interruptId": interrupt_id, "status": "resolved", "payload": payload}
        for interrupt_id, payload in entries])


@pytest.mark.parametrize("how", ["stop", "shutdown"])
async def test_a_run_cancelled_while_it_claims(how: str) -> None:
    ledger = GatedClaims()
    runtime = approving_runtime(ledger)
    approval = await interrupted(runtime)
    ledger.gated = True
    resuming = asyncio.create_task(drive(runtime, resume_body(
        "r-resume", (approval.id, {"action": "approve"}))))
    async with asyncio.timeout(10):
        await ledger.claiming.wait()
    if how == "stop":
        assert runtime.stop_run("lg", THREAD)
    else:
        resuming.cancel()
    ledger.gate.set()  # the claim, made, answers: it must be put back
    async with asyncio.timeout(10):
        if how == "stop":
            events = await resuming
            assert types(events) == ["RUN_STARTED", "RUN_FINISHED"]
        else:
            with pytest.raises(asyncio.CancelledError):
                await resuming
    assert THREAD not in runtime.runs.active
    still = await ledger.get(approval.id)
    assert still is not None
    assert still.status == "pending"
    assert not await ledger.unapplied()  # nothing for the next start to resend
    ledger.gated = False
    again = await runtime.approvals.answer(approval.id, {"action": "approve"})
    assert again["run"]["status"] == "finished"
    await assert_applied(runtime, approval.id, {"action": "approve"})
    await runtime.aclose()


async def test_a_resume_refused_after_a_claim_puts_it_back() -> None:
    runtime = approving_runtime()
    approval = await interrupted(runtime)
    # The first entry is claimed before the second is found to answer nothing.
    events = await drive(runtime, resume_body(
        "r-resume", (approval.id, {"action": "approve"}), ("no-such-interrupt", "yes")))
    assert events[-1]["type"] == "RUN_ERROR"
    assert events[-1]["code"] == "INTERRUPT_NOT_PENDING"
    still, _, _ = await runtime.approvals.get(approval.id)
    assert still.status == "pending"
    events = await drive(runtime, resume_body("r-again", (approval.id, {"action": "approve"})))
    assert types(events)[-1] == "RUN_FINISHED"
    await assert_applied(runtime, approval.id, {"action": "approve"})
    await runtime.aclose()


# -- an answer that does not wait: recorded first, so a close does not lose it -----------


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def checkpoints_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "postgresql":
        with hitl_postgres_schema() as url:
            yield url
    else:
        yield "memory" if request.param == "memory" else f"sqlite:///{tmp_path}/cp.db"


def durable_runtime(url: str) -> CopilotRuntime:
    """The graph on `url`'s checkpoints, its approvals in the ledger beside them."""
    builder: StateGraph[State] = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    graph = builder.compile(checkpointer=checkpointer(url))
    return CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})


def held_after_claims(ledger: ApprovalStore) -> asyncio.Event:
    """Make `ledger`'s claims wait, once made, for ever: set when one is made."""
    claimed = asyncio.Event()
    claim = ledger.claim

    async def holding(*args: Any) -> Approval | None:
        made = await claim(*args)
        claimed.set()
        await asyncio.Event().wait()
        return made

    ledger.claim = holding  # type: ignore[method-assign]
    return claimed


async def test_an_answer_without_waiting_survives_a_close(checkpoints_url: str) -> None:
    runtime = durable_runtime(checkpoints_url)
    approval = await interrupted(runtime)
    _, _, agent = await runtime.approvals.get(approval.id)
    assert isinstance(agent, LangGraphAgent)
    ledger = agent.approvals
    claimed = held_after_claims(ledger)
    answer = {"action": "approve", "userId": "ann"}
    with capture_logs() as logs:
        answering = asyncio.create_task(runtime.approvals.answer(
            approval.id, answer, answered_by="ann", wait=False))
        async with asyncio.timeout(10):
            await claimed.wait()  # recorded: the run is about to drive
        await runtime.approvals.aclose()
        async with asyncio.timeout(10):
            result = await answering
    assert result["run"]["status"] == "cancelled"
    assert (result["approval"]["status"], result["approval"]["applied"]) == ("answered",
                                                                              False)
    assert any("sent at the next start" in log["event"] for log in logs)
    assert THREAD not in runtime.runs.active
    # What a GET shows: answered by ann, not applied yet; a second answer is refused.
    kept, _, _ = await runtime.approvals.get(approval.id)
    assert (kept.status, kept.answer, kept.answered_by, kept.applied) == (
        "answered", answer, "ann", False)
    with pytest.raises(ApprovalClosedError):
        await runtime.approvals.answer(approval.id, {"action": "reject"})
    if checkpoints_url != "memory":
        # A new process on the same database: its start sends the recorded answer.
        await runtime.aclose()
        runtime = durable_runtime(checkpoints_url)
    else:
        del ledger.claim  # type: ignore[method-assign]  # the instance's, not the class's
    await runtime.start()
    await applied_in_time(runtime, approval.id, answer)
    await runtime.aclose()


async def test_an_answer_without_waiting_is_recorded_when_accepted(
        checkpoints_url: str) -> None:
    runtime = durable_runtime(checkpoints_url)
    approval = await interrupted(runtime)
    result = await runtime.approvals.answer(approval.id, {"action": "approve"}, wait=False)
    assert result["run"]["status"] == "running"
    assert result["approval"]["status"] == "answered"  # in the ledger before the reply
    await applied_in_time(runtime, approval.id, {"action": "approve"})
    await runtime.aclose()


async def test_an_answer_left_by_a_closed_server_is_sent_by_another_one_running(
        checkpoints_url: str) -> None:
    """Two servers on one database: the one that took an answer closes before its run
    drives; the other, up all along, sends it once it has been left long enough (it does
    not wait for a restart). Several servers share PostgreSQL (two on one SQLite file can
    find it locked while the other opens it)."""
    if not checkpoints_url.startswith("postgres"):
        pytest.skip("servers of one deployment share PostgreSQL")
    other = durable_runtime(checkpoints_url)
    other.approvals.recover_interval = other.approvals.recover_after = 0.3
    runtime = durable_runtime(checkpoints_url)
    try:
        await other.start()
        approval = await interrupted(runtime)
        _, _, agent = await runtime.approvals.get(approval.id)
        assert isinstance(agent, LangGraphAgent)
        claimed = held_after_claims(agent.approvals)
        answer = {"action": "approve", "userId": "ann"}
        answering = asyncio.create_task(runtime.approvals.answer(
            approval.id, answer, answered_by="ann", wait=False))
        async with asyncio.timeout(10):
            await claimed.wait()
        await runtime.approvals.aclose()
        async with asyncio.timeout(10):
            assert (await answering)["run"]["status"] == "cancelled"
        await runtime.aclose()
        await applied_in_time(other, approval.id, answer)
    finally:
        await runtime.aclose()
        await other.aclose()
