"""The runtime's pending approvals: listed, answered over plain HTTP, timed out, recovered.

`runtime.approvals` is the one `ApprovalService` of a runtime, started and stopped with
it (`CopilotRuntime.start()` / `aclose()`). It looks after every
agent that keeps an approval ledger (`SupportsApprovals`: `LangGraphAgent`). Answering an
approval resumes its graph on the server, as a run of the runtime like any other: it takes
the thread (a busy thread is refused), and its events are stored in the thread's history,
so a client that `connect`s later sees what happened. The run's own claim on the ledger is
what decides a race between two answers; this service checks first only to answer clearly.
A run stopped before its agent started (the service closing just after it reserved the
thread) gives the thread back and claimed nothing: the approval is left as it was. An
answer that does not wait is the exception: its run claims the approval before it drives,
and the caller hears back once the answer is recorded, so a close after that leaves it for
the next start to send, not lost (`_answer_in_background`).

`start()` (idempotent) sends again the answers a crash interrupted, and runs the expiry
timer: when an approval's `expiresAt` passes, the timer claims it in the ledger with a
timeout answer (`decisions.timeout_answer`), then resumes its graph with it. The claim is
what decides between the timers of several servers on one ledger, and an answer racing
them: only its winner begins a run. The service sits below the runtime: it reaches the runtime's
agents and runs through the small `RunHost` interface, which `CopilotRuntime` implements.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import structlog

from copilot_runtime import events as ev
from copilot_runtime._again import worth_logging
from copilot_runtime._exceptions import (
    ApprovalClosedError,
    ApprovalError,
    ApprovalNotFoundError,
    CopilotRuntimeError,
    ServiceUnavailableError,
    ThreadBusyError,
)
from copilot_runtime._input import RunInput, parse_run_input
from copilot_runtime._time import iso_time
from copilot_runtime.approvals.decisions import timeout_answer
from copilot_runtime.approvals.ledger import (
    Approval,
    ApprovalKey,
    ApprovalStatus,
    ApprovalStore,
    SharedApprovalStore,
    SupportsApprovals,
    Viewer,
)
from copilot_runtime.approvals.resume import refuse_unkeepable, sent_by_service
from copilot_runtime.auth import RequestInfo
from copilot_runtime.events import Event
from copilot_runtime.threads.base import SUGGESTION_THREAD_PREFIX, ThreadOwner

__all__ = ["ApprovalService", "HostedRun", "RunHost", "is_runtime_answer"]

_log = structlog.get_logger("copilot_runtime.approvals")

#: How many approvals a page reads from the ledgers at a time, at least (some may be of
#: threads whose owner is not recorded yet, and turn out to be others').
_BATCH = 200
#: How many threads' owners a page looks up at most (a thread-store read each), and on
#: how many approvals it records them: those its ledgers do not record yet. Each is
#: recorded once found, so later pages look up none.
_OWNER_READS = 100
_OWNER_ROWS = 1000
#: How many of a page's owner lookups run at once: one after another, a page of 500 rows
#: waited ~450 ms on PostgreSQL (whose store coalesces summaries read together).
_OWNERS_AT_ONCE = 16
#: How long a thread no owner is found for (its first run not stored yet, on another
#: server, say) is looked up again rather than recorded as nobody's.
_OWNER_GRACE = 600.0
#: The key before every approval: where a first page that found none of the viewer's
#: before its lookups were spent says to go on from.
_START: ApprovalKey = (0.0, "")

#: The inputs of the runs this service starts with an answer of the runtime's own (a
#: deadline's timeout, sent or sent again; an answer a graph took and whose run died,
#: carried on), by identity, while the host starts them: no client can send these objects.
_runtime_answers: dict[int, RunInput] = {}


def is_runtime_answer(input: RunInput) -> bool:
    """Whether `input` is a run's input this service made with an answer of the runtime's
    own: guardrails judge what clients write; a timeout the runtime wrote must not cost a
    judge call (nor be refused, which would leave the approval expired and never applied),
    nor must carrying on a graph that took its answer already."""
    return _runtime_answers.get(id(input)) is input


class HostedRun(Protocol):
    """A run the host has started: driven to its end by whoever holds it, or given back
    (`abandon`, or `async with run:` around what leads to `drive`) if it never is."""

    thread_id: str
    run_id: str
    #: Why it was cut short from outside ("stop": its caller asked), or None.
    cancel_reason: str | None
    #: Why a guardrail refused its input (its agent would only say so), or None.
    refusal: str | None

    async def drive(self, write: Callable[[Sequence[Event]], Awaitable[None]]) -> None: ...

    async def abandon(self) -> None:
        """Give the thread back if the run was never driven (nothing once it was)."""
        ...

    async def __aenter__(self) -> object: ...

    async def __aexit__(self, *exc: object) -> None: ...


class RunHost(Protocol):
    """What the service needs of the runtime that owns it."""

    @property
    def agents(self) -> Mapping[str, object]: ...

    def is_running(self, thread_id: str) -> bool:
        """Whether a run is on the thread now (its checkpoint is in flux)."""
        ...

    async def start_run(self, agent_id: str, input: RunInput,
                        headers: Mapping[str, str] | None = None, *,
                        answering: RequestInfo | None = None) -> HostedRun:
        """`answering` is the request whose answer starts the run, when a person's (its
        access to the approval already checked): the run is done on its caller's behalf."""
        ...


class ApprovalService:
    #: How long the timer sleeps when nothing is due, and how soon it retries a busy thread.
    idle_interval = 60.0
    retry_interval = 1.0
    #: Every this many seconds, answers recorded at least `recover_after` seconds ago and
    #: never applied (the server that took them closed or died before their run) are sent
    #: again: another server of the deployment need not wait for a restart to apply them.
    recover_interval = 30.0
    recover_after = 30.0
    #: How often the timer asks a ledger that other processes write to (`SharedApprovalStore`:
    #: SQL) for its earliest deadline: an approval another server added is due that soon.
    poll_interval = 1.0
    #: False where another process runs the expiry timer and the recovery (one of several
    #: servers on one PostgreSQL database, say); answers over HTTP work either way.
    run_timer = True

    def __init__(self, host: RunHost) -> None:
        self.host = host
        self._timer: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._runs: set[asyncio.Task[Any]] = set()
        #: Runs cancelled before they were driven, giving their threads back (see `_resume`).
        self._giving_back: set[asyncio.Future[None]] = set()
        self._expiring: set[str] = set()
        #: Timeouts this timer claimed in the ledger whose run has not begun (a busy thread).
        self._timed_out: dict[str, Approval] = {}
        self._started = False
        self._subscribed: list[ApprovalStore] = []

    # -- what it looks after -----------------------------------------------------------

    def agents(self) -> dict[str, SupportsApprovals]:
        return {agent_id: agent for agent_id, agent in self.host.agents.items()
                if isinstance(agent, SupportsApprovals)}

    def _stores(self) -> list[tuple[ApprovalStore, dict[str, SupportsApprovals]]]:
        """Each ledger once, with the agents (by id) that write to it."""
        out: list[tuple[ApprovalStore, dict[str, SupportsApprovals]]] = []
        for agent_id, agent in self.agents().items():
            for store, owners in out:
                if store is agent.approvals:
                    owners[agent_id] = agent
                    break
            else:
                out.append((agent.approvals, {agent_id: agent}))
        return out

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return  # every request calls this: keep it to one check
        self._started = True
        stores = self._stores()
        if not stores or not self.run_timer:
            return
        self._wakeup = asyncio.Event()
        for store, _ in stores:
            if not any(store is known for known in self._subscribed):
                store.subscribe(self._wake)  # a new approval may be due before the others
                self._subscribed.append(store)
        self._timer = asyncio.create_task(self._run_timer(), name="approval-timer")

    @property
    def timer_running(self) -> bool:
        """Whether the expiry timer (and crash recovery) runs in this process now."""
        return self._timer is not None and not self._timer.done()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def aclose(self) -> None:
        """Stop the timer and the server-side runs still going; a run stopped before it was
        driven has given its thread back when this returns."""
        # Again until none is left: the timer may start a run as it is being cancelled.
        while tasks := [t for t in (self._timer, *self._runs)
                        if t is not None and not t.done()]:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled():
                    task.exception()  # retrieved: closing says nothing of how a run ended
        while self._giving_back:
            await asyncio.wait(set(self._giving_back))  # not cancelled: they are short
        self._timer = None
        self._timed_out.clear()  # claimed in the ledger: the next start sends them
        self._started = False

    # -- reading -----------------------------------------------------------------------

    async def page(self, *, status: ApprovalStatus | None = "pending",
                   agent_id: str | None = None, thread_id: str | None = None,
                   after: ApprovalKey | None = None, limit: int | None = None,
                   viewer: Viewer | None = None,
                   thread_owner: Callable[[str], Awaitable[ThreadOwner | None]] | None = None
                   ) -> tuple[list[Approval], ApprovalKey | None]:
        """The first `limit` approvals after `after` (oldest first, every ledger together),
        and the key the next page starts after (None when none is left). Pending ones are
        checked against their checkpoint; one whose interrupt is gone without an answer
        (the thread was reset) is withdrawn, and left out of a page of pending ones. Asked
        for one thread, its graphs' interrupts missing from the ledger are added first.

        With `viewer`, only the approvals it sees (`Viewer.sees` their thread's owner, which
        `thread_owner` looks up): the ledgers filter by the owners recorded on them, and
        those a listing meets unrecorded are looked up and recorded (`_Owners`: at most
        `_OWNER_READS` threads and `_OWNER_ROWS` approvals a page; it stops at the first
        it could not look up, and the next page goes on from there). The next key is one
        of the viewer's approvals, or the `after` it asked with (`_START` for none), so
        neither says anything of the others; a thread it may not see is listed as one
        that does not exist. What a page returns is checked against the owner its thread
        has now (`thread_owner`, once a thread, `_OWNERS_AT_ONCE` threads at a time), as
        opening an approval by id is: one
        recorded as the viewer's on a thread that is no longer (a store that forgot it)
        is left out, so every approval listed can be opened."""
        owners = None
        if viewer is not None:
            if thread_owner is None:
                raise TypeError("a viewer's page needs thread_owner")
            owners = _Owners(viewer, thread_owner)
        if thread_id is not None:
            if owners is not None and not await owners.sees_thread(thread_id):
                return [], None
            for owner_id, waiting in self.agents().items():
                record = getattr(waiting, "record_waiting", None)  # (a LangGraph agent's)
                if record is not None and agent_id in (None, owner_id):
                    await record(thread_id, owner_id)
        asked_after = after
        found: list[tuple[Approval, ApprovalStore, SupportsApprovals]] = []
        batch, more, cut = None if limit is None else max(limit + 1, _BATCH), True, False
        while more and not cut and (limit is None or len(found) <= limit):
            read, more = await self._read(status, agent_id, thread_id, after, batch, viewer)
            if owners is not None:
                await owners.record(read)
            for approval, store, agents in read:
                if owners is not None and not owners.known(approval):
                    cut = True  # the lookups of this page are spent: the rest next time
                    break
                after = approval.key
                if _of_a_suggestion(approval):
                    continue  # (skipped here, not in the read: what is left is counted there)
                if owners is not None and not owners.sees(approval):
                    continue
                agent = agents.get(approval.agent_id)
                if agent is None:
                    continue  # written by an agent this runtime does not serve
                found.append((approval, store, agent))
                if limit is not None and len(found) > limit:
                    break  # one more than the page: there is a next one
        next_key = None
        if limit is not None and len(found) > limit:
            found = found[:limit]
            next_key = found[-1][0].key
        elif cut:
            next_key = found[-1][0].key if found else asked_after or _START
        out: list[Approval] = []
        if owners is not None:
            await owners.look_up(approval.thread_id for approval, _, _ in found)
        for approval, store, agent in found:
            if owners is not None and not await owners.sees_now(approval):
                continue  # recorded as the viewer's, its thread is not now: it would be a 404
            if approval.status == "pending" and not await self._still_waiting(
                    store, agent, approval):
                # Withdrawn, unless an answer or a timeout claimed it since our read
                # (its run may be on another worker): show what the ledger has now.
                approval = await store.get(approval.id) or replace(
                    approval, status="withdrawn")
                if status is not None and approval.status != status:
                    continue
            out.append(approval)
        return out, next_key

    async def _read(self, status: ApprovalStatus | None, agent_id: str | None,
                    thread_id: str | None, after: ApprovalKey | None, limit: int | None,
                    viewer: Viewer | None = None
                    ) -> tuple[list[tuple[Approval, ApprovalStore,
                                          dict[str, SupportsApprovals]]], bool]:
        """The first `limit` approvals after `after`, every ledger together, and whether
        any is left after them."""
        # `viewer` only when there is one: a ledger written to the protocol before it (an
        # application's own) still serves listings without authentication.
        seen_by: dict[str, Viewer] = {} if viewer is None else {"viewer": viewer}
        found = [(approval, store, owners) for store, owners in self._stores()
                 for approval in await store.find(
                     status=status, thread_id=thread_id, agent_id=agent_id, after=after,
                     limit=None if limit is None else limit + 1, **seen_by)]
        found.sort(key=lambda listed: listed[0].key)
        if limit is None or len(found) <= limit:
            return found, False  # each ledger gave fewer than it was asked: all read
        return found[:limit], True

    async def list(self, *, status: ApprovalStatus | None = "pending",
                   agent_id: str | None = None, thread_id: str | None = None
                   ) -> list[Approval]:
        """Approvals, oldest first (all of them: `page` reads a listing a page at a time)."""
        approvals, _ = await self.page(status=status, agent_id=agent_id, thread_id=thread_id)
        return approvals

    async def _still_waiting(self, store: ApprovalStore, agent: SupportsApprovals,
                             approval: Approval) -> bool:
        if self.host.is_running(approval.thread_id):
            return True  # a run is on it: its checkpoint is in flux, trust the ledger
        if approval.id in await agent.pending_interrupt_ids(approval.thread_id):
            return True
        await store.settle(approval.id, "withdrawn")
        return False

    async def get(self, approval_id: str) -> tuple[Approval, str, SupportsApprovals]:
        for store, owners in self._stores():
            approval = await store.get(approval_id)
            if approval is not None and approval.agent_id in owners \
                    and not _of_a_suggestion(approval):
                return approval, approval.agent_id, owners[approval.agent_id]
        raise ApprovalNotFoundError(approval_id)

    # -- answering ---------------------------------------------------------------------

    async def answer(self, approval_id: str, answer: Mapping[str, Any], *,
                     answered_by: str | None = None, wait: bool = True,
                     headers: Mapping[str, str] | None = None,
                     request: RequestInfo | None = None) -> dict[str, Any]:
        """Answer a pending approval and resume its graph on the server.

        Raises `ApprovalNotFoundError` (404), `ApprovalClosedError` (409 answered or
        withdrawn, 410 expired), `ThreadBusyError` (409), or an `ApprovalError` (422, code
        `GUARDRAILS_VALIDATION_FAILED`, the guardrail's reason as its message) when a
        guardrail refuses the answer: judged before it is recorded, so nothing is, and the
        approval can be answered again. With `wait`, returns once the
        resumed run has ended, with its outcome; otherwise as soon as the answer is
        recorded in the ledger (run status `running`), or with run status `cancelled` if
        the service closed first (the approval as the ledger has it). `request` is the
        answering caller's, whose access to the approval the caller checked: the resumed
        run is theirs for hooks, telemetry and the agent (`RunContext.principal`).
        """
        approval, _, agent = await self.get(approval_id)
        if approval.status != "pending":
            raise ApprovalClosedError(approval)
        refuse_unkeepable(answer)  # before anything is recorded or run
        if approval.expired_at(time.time()):
            self._wake()  # the timer resumes the graph with the timeout answer
            raise ApprovalClosedError(replace(approval, status="expired"))
        if not self.host.is_running(approval.thread_id) and approval.id not in \
                await agent.pending_interrupt_ids(approval.thread_id):
            await agent.approvals.settle(approval.id, "withdrawn")
            # Another answer may have won since our read: say which (409 answered).
            raise ApprovalClosedError(await agent.approvals.get(approval.id)
                                      or replace(approval, status="withdrawn"))
        if not wait:
            return await self._answer_in_background(approval, agent.approvals, dict(answer),
                                                    answered_by or "http", headers, request)
        task = await self._resume(approval, dict(answer), answered_by or "http", headers,
                                  request=request)
        summary: dict[str, Any] = {"threadId": approval.thread_id, "status": "running",
                                   "runId": task.get_name()}
        try:
            summary = await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not task.cancelled() or (current is not None and current.cancelling()):
                raise  # the caller was cancelled: the run goes on without it
            # The service closed first and cancelled the run: what the graph took
            # is settled in the ledger, which the reply below reads.
            summary = {**summary, "status": "cancelled"}
        error = summary.get("error") or {}
        if error.get("code") in ApprovalClosedError.CODES:
            # Another answer won the claim between our check and the run's, or the deadline
            # passed in between: then the run claimed nothing, and the timer answers.
            closed = await agent.approvals.get(approval.id) or approval
            if error.get("code") == "APPROVAL_EXPIRED" and closed.status == "pending":
                self._wake()
                closed = replace(closed, status="expired")
            raise ApprovalClosedError(closed)
        if summary["status"] == "interrupted":
            waiting = await agent.approvals.find(thread_id=approval.thread_id)
            summary["approvals"] = [a.to_json() for a in waiting]
        settled = await agent.approvals.get(approval.id) or approval
        return {"approval": settled.to_json(), "run": summary}

    async def _answer_in_background(self, approval: Approval, store: ApprovalStore,
                                    answer: dict[str, Any], answered_by: str,
                                    headers: Mapping[str, str] | None,
                                    request: RequestInfo | None) -> dict[str, Any]:
        """Record the answer, then resume the graph in the background.

        The run's task claims the approval before it drives, and the caller is answered
        once that claim is in the ledger: a service that closes before the run takes the
        answer leaves it "answered, not applied", and the next start sends it
        (`_recover`). One that closes before the claim leaves the approval pending, to be
        answered again; the reply says which (run status `cancelled`)."""
        recorded: asyncio.Future[Approval | None] = \
            asyncio.get_running_loop().create_future()

        async def record() -> bool:
            # Its guardrail judged the answer since the route's check, maybe past the
            # deadline: the ledger's claim refuses it then (checked here too, for a ledger
            # of an application's own), and the timer sends the timeout.
            now = time.time()
            claimed = None if approval.expired_at(now) else await store.claim(
                approval.id, "answered", answer, answered_by, now)
            recorded.set_result(claimed)
            return claimed is not None

        task = await self._resume(approval, answer, answered_by, headers, first=record,
                                  request=request, resend=True)
        # Not cancelled with the caller: the answer goes on without it.
        steps: set[asyncio.Future[Any]] = {recorded, task}
        await asyncio.wait(steps, return_when=asyncio.FIRST_COMPLETED)
        summary: dict[str, Any] = {"threadId": approval.thread_id, "status": "running",
                                   "runId": task.get_name()}
        if recorded.done():
            claimed = recorded.result()
            if claimed is None:  # another answer won since our check, or the deadline
                raise await self._not_claimed(store, approval)
            return {"approval": claimed.to_json(), "run": summary}
        if not task.cancelled():
            task.result()  # the claim failed: raise why
        # The service closed before the run took its first steps.
        settled = await store.get(approval.id) or approval
        if settled.status == "pending":
            _log.warning("approval answer dropped: the service closed before it was "
                         "recorded; the approval can be answered again",
                         approval_id=approval.id)
        else:  # claimed as the task was cancelled: the ledger kept it
            _log.warning("approval answer recorded but not sent: the service closed; it is "
                         "sent at the next start", approval_id=approval.id)
        return {"approval": settled.to_json(), "run": {**summary, "status": "cancelled"}}

    async def _not_claimed(self, store: ApprovalStore,
                           approval: Approval) -> ApprovalClosedError:
        """Why an answer's claim lost: another answer (or the timeout) won it, or it came
        after the deadline and the approval waits for the timer's timeout (woken)."""
        closed = await store.get(approval.id) or approval
        if closed.status == "pending" and closed.expired_at(time.time()):
            self._wake()
            closed = replace(closed, status="expired")
        return ApprovalClosedError(closed)

    async def _resume(self, approval: Approval, payload: Any, answered_by: str,
                      headers: Mapping[str, str] | None,
                      first: Callable[[], Awaitable[bool]] | None = None, *,
                      own: bool = False, request: RequestInfo | None = None,
                      resend: bool = False) -> asyncio.Task[dict[str, Any]]:
        """Start the run that resumes `approval`'s graph with `payload` (in a task); the
        task awaits `first` before it drives, and gives the run back if that is False.
        `resend`: `payload` is the answer the ledger holds (or `first` records); the run
        sends it, as it does the runtime's `own` timeout, where a client's is refused.

        The host's guardrails judge `payload` as it starts the run, unless it is the
        runtime's `own`; a refused one raises (`_refused`) before `first`: a refused answer
        is never recorded, so it is neither resent for ever nor blocks the next answer."""
        run_id = f"approval-{uuid.uuid4()}"
        body: dict[str, Any] = {
            "threadId": approval.thread_id, "runId": run_id, "messages": [], "state": {},
            "tools": [], "context": [], "forwardedProps": {},
            "resume": [{"interruptId": approval.id, "status": "resolved", "payload": payload,
                        "metadata": {"answeredBy": answered_by}}],
        }
        if approval.channel == "outcome":
            body["protocolVersion"] = "1.0"  # answer in the form its client understood
        input = parse_run_input(body)
        if own:
            _runtime_answers[id(input)] = input
        try:
            run = await self.host.start_run(approval.agent_id, input, headers,
                                            answering=request)
        finally:
            _runtime_answers.pop(id(input), None)
        if run.refusal is not None:
            await run.abandon()  # nothing ran: the thread is given back, the ledger untouched
            raise _refused(run.refusal)
        # No await from here to the task: the run is the task's to drive or give back.
        task = asyncio.create_task(_drive(run, first, service_input=input
                                          if own or resend else None), name=run_id)
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)
        task.add_done_callback(lambda done: self._give_back_if_cancelled(run, done))
        return task

    def _give_back_if_cancelled(self, run: HostedRun, task: asyncio.Task[Any]) -> None:
        """A task cancelled before its first step never runs `_drive` (nor its `async
        with`): give its run back here. The run's agent never ran, so it claimed nothing:
        the ledger still holds the approval as it was (pending, or answered and resent at
        the next start)."""
        if not task.cancelled():
            return
        giving_back = asyncio.ensure_future(run.abandon())  # nothing if it was driven
        self._giving_back.add(giving_back)
        giving_back.add_done_callback(self._giving_back.discard)

    # -- the timer: expiry and recovery ------------------------------------------------

    async def _run_timer(self) -> None:
        assert self._wakeup is not None
        recovered = -math.inf
        failures = {"recover": 0, "expire": 0}  # in a row, for `_failed`
        while True:
            if time.monotonic() - recovered >= self.recover_interval:
                # At start every unapplied answer (this process is new: none of them is
                # under way here); later only those left long enough that the server that
                # took them is not about to send them itself.
                older = 0.0 if recovered == -math.inf else self.recover_after
                recovered = time.monotonic()
                try:
                    await self._recover(older)
                    failures["recover"] = 0
                except Exception as exc:
                    _failed(failures, "recover", "could not recover unapplied approvals", exc)
            self._wakeup.clear()
            try:
                # Read before the scan: a deadline added during it shows as a change.
                seen = await self._shared_deadlines()
                due = await self._expire_due()
                failures["expire"] = 0
            except Exception as exc:
                _failed(failures, "expire", "approval timer failed", exc)
                due, seen = time.time() + self.retry_interval, ()
            delay = self.idle_interval if due is None else max(0.0, due - time.time())
            await self._sleep(min(delay, self.idle_interval, self.recover_interval), seen)

    async def _sleep(self, seconds: float, seen: tuple[float | None, ...]) -> None:
        """Wait `seconds`, or until an approval is added here (`_wake`), or one added
        elsewhere is due sooner: the earliest deadline of a shared ledger changed since it
        was `seen`, to one before then. One that stays (another runtime's, say) is no
        news; asking for it is the cheap read, the scan it brings about the costly one."""
        assert self._wakeup is not None
        wake_at = time.time() + seconds
        while (left := wake_at - time.time()) > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, self.poll_interval) if seen else left):
                    await self._wakeup.wait()
                return
            if not seen:
                continue
            try:
                now = await self._shared_deadlines()
            except Exception:
                return  # the scan fails as well, and is logged (`_failed`)
            if any(new is not None and new != old and new < wake_at
                   for old, new in zip(seen, now, strict=True)):
                return
            seen = now

    async def _shared_deadlines(self) -> tuple[float | None, ...]:
        """The earliest pending deadline of this runtime's agents in each shared ledger."""
        return tuple([await store.next_deadline(owners) for store, owners in self._stores()
                      if isinstance(store, SharedApprovalStore)])

    async def _expire_due(self) -> float | None:
        """Claim the timeouts of expired approvals and resume their graphs with them; the
        next deadline, if any (or soon, to try a busy thread again)."""
        now = time.time()
        next_due: float | None = None
        for store, owners in self._stores():
            for approval in await store.find(status="pending"):
                if approval.expires_at is None or approval.agent_id not in owners \
                        or _of_a_suggestion(approval):
                    continue
                if approval.expires_at > now:
                    next_due = min(next_due or approval.expires_at, approval.expires_at)
                    continue
                if approval.id in self._expiring:
                    continue
                if self.host.is_running(approval.thread_id):
                    # Its run may answer it or reset the thread: claim once it is done.
                    next_due = min(next_due or now, now + self.retry_interval)
                    continue
                if not await self._still_waiting(store, owners[approval.agent_id], approval):
                    continue  # its thread was reset: nothing to time out (now withdrawn)
                # Claimed before any run begins: another server's timer may have read it
                # pending too, and only the one whose claim wins may begin one (a loser's
                # run would find nothing to resume, its start written to the thread).
                claimed = await store.claim(approval.id, "expired", timeout_answer(
                    iso_time(approval.expires_at)), "runtime", time.time())
                if claimed is None:
                    continue  # another timer, or an answer, won
                self._timed_out[claimed.id] = claimed
        for claimed in list(self._timed_out.values()):
            owned = next(((store, owners[claimed.agent_id]) for store, owners
                          in self._stores() if claimed.agent_id in owners), None)
            if owned is None or not await self._send_timeout(*owned, claimed):
                next_due = min(next_due or now, now + self.retry_interval)
        return next_due

    async def _send_timeout(self, store: ApprovalStore, agent: SupportsApprovals,
                            claimed: Approval) -> bool:
        """Resume the graph with a timeout this timer claimed; False to try again (its
        thread is busy). Its claim stays in the ledger meanwhile: if this process dies,
        recovery elsewhere sends it (`_recover`: "expired" is the runtime's own answer)."""
        if claimed.id in self._expiring:
            return True  # its run is under way here
        if not self.host.is_running(claimed.thread_id) and claimed.id not in \
                await agent.pending_interrupt_ids(claimed.thread_id):
            # Checked before the claim; a thread busy since may have been reset.
            current = await store.get(claimed.id)
            if current is None or current.status != "expired" or current.applied:
                self._timed_out.pop(claimed.id, None)
                return True  # sent already (by recovery elsewhere, say)
            if not await agent.parked(claimed.thread_id):
                # It never reached the graph, whose interrupt is gone: withdrawn, as a
                # pending one would have been, not timed out. (Parked: a run that took it
                # was cut short, and resuming carries it on.)
                await store.settle(claimed.id, "reopen")
                await store.settle(claimed.id, "withdrawn")
                self._timed_out.pop(claimed.id, None)
                return True
        if not await self._try_resume(claimed, claimed.answer, "runtime", own=True,
                                      resend=True):
            return False
        self._timed_out.pop(claimed.id, None)
        return True

    async def _try_resume(self, approval: Approval, payload: Any, answered_by: str, *,
                          own: bool = False, resend: bool = False) -> bool:
        """Resume in the background; False when the thread is busy (try again later)."""
        try:
            task = await self._resume(approval, payload, answered_by, None, own=own,
                                      resend=resend)
        except ThreadBusyError:
            return False
        self._expiring.add(approval.id)
        task.add_done_callback(lambda _: self._expiring.discard(approval.id))
        return True

    async def _recover(self, older: float = 0.0) -> None:
        """Send again the answers a crash or a close stopped before they reached the graph
        (those recorded at least `older` seconds ago; one under way elsewhere finds its
        thread busy, and is tried again later)."""
        now = time.time()
        for store, owners in self._stores():
            for approval in await store.unapplied():
                agent = owners.get(approval.agent_id)
                if agent is None or approval.id in self._expiring \
                        or approval.id in self._timed_out:
                    continue
                if older and (approval.answered_at or now) > now - older:
                    continue
                # The answer is sent again if it never reached the graph (its interrupt still
                # waits), or if the graph took it and its run then died between two steps
                # (a crash, a shutdown: nothing else runs the rest, the approved action
                # maybe), which carries the graph on from the step it stopped at.
                if approval.id in await agent.pending_interrupt_ids(approval.thread_id):
                    # A person's answer is judged again: one refused (by guardrails set up
                    # since it was recorded, say) is reopened, to be answered again, not
                    # resent for ever. A timeout ("expired") is the runtime's own.
                    _log.info("resending an approval answer", approval_id=approval.id)
                    try:
                        await self._try_resume(approval, approval.answer,
                                               approval.answered_by or "runtime",
                                               own=approval.status == "expired",
                                               resend=True)
                    except ApprovalError as exc:
                        if exc.code != _REFUSED:
                            raise
                        _log.warning("approval reopened: a guardrail refused its answer",
                                     approval_id=approval.id)
                        await store.settle(approval.id, "reopen")
                elif await agent.parked(approval.thread_id):
                    # The graph took this answer already: carrying it on is the runtime's
                    # doing, not new text of a client's.
                    _log.info("resending an approval answer", approval_id=approval.id)
                    await self._try_resume(approval, approval.answer,
                                           approval.answered_by or "runtime", own=True,
                                           resend=True)
                else:
                    await store.settle(approval.id, "applied")


class _Owners:
    """What a `viewer`'s page sees. The owners of the threads it meets with none recorded on
    their ledgers are looked up (at most `_OWNER_READS` threads, for `_OWNER_ROWS`
    approvals) and recorded, so no later page looks them up again."""

    def __init__(self, viewer: Viewer,
                 lookup: Callable[[str], Awaitable[ThreadOwner | None]]) -> None:
        self.viewer = viewer
        self._lookup = lookup
        self._found: dict[str, ThreadOwner | None] = {}
        self._met: set[str] = set()  # the approvals whose owner it found

    async def sees_thread(self, thread_id: str) -> bool:
        return self.viewer.sees(await self._owner_now(thread_id))

    async def sees_now(self, approval: Approval) -> bool:
        """Whether the viewer sees the owner its thread has now (not the one recorded):
        what the routes of one approval decide by."""
        return self.viewer.sees(await self._owner_now(approval.thread_id))

    async def _owner_now(self, thread_id: str) -> ThreadOwner | None:
        if thread_id not in self._found:
            self._found[thread_id] = await self._lookup(thread_id)
        return self._found[thread_id]

    async def look_up(self, thread_ids: Iterable[str]) -> None:
        """Find the owners of `thread_ids` not found yet, `_OWNERS_AT_ONCE` at a time (the
        lookup `_owner_now` would make, once a thread)."""
        wanted = [t for t in dict.fromkeys(thread_ids) if t not in self._found]
        if len(wanted) < 2:
            return  # (`_owner_now` looks it up)
        bound = asyncio.Semaphore(_OWNERS_AT_ONCE)

        async def owner(thread_id: str) -> ThreadOwner | None:
            async with bound:
                return await self._lookup(thread_id)

        # Every lookup ends before this returns (none left running), and a failure is
        # raised as a lookup one after another raised it.
        found = await asyncio.gather(*map(owner, wanted), return_exceptions=True)
        for thread_id, result in zip(wanted, found, strict=True):
            if isinstance(result, BaseException):
                raise result
            self._found[thread_id] = result

    async def record(self, read: Sequence[tuple[Approval, ApprovalStore, object]]) -> None:
        """Look up the owners of `read`'s threads that have none recorded, oldest first,
        while lookups are left; record each on its ledger."""
        now = time.time()
        await self.look_up(self._unrecorded(read))
        recording: list[tuple[ApprovalStore, ThreadOwner | None, list[str]]] = []
        for approval, store, _ in read:
            thread_id = approval.thread_id
            if approval.owner_known or len(self._met) >= _OWNER_ROWS:
                continue
            if thread_id not in self._found and len(self._found) >= _OWNER_READS:
                continue
            owner = await self._owner_now(thread_id)
            self._met.add(approval.id)
            if owner is None and approval.created_at > now - _OWNER_GRACE:
                continue  # maybe not stored yet: nobody's for now, looked up next time
            for known_store, known_owner, ids in recording:
                if known_store is store and known_owner == owner:
                    ids.append(approval.id)
                    break
            else:
                recording.append((store, owner, [approval.id]))
        for store, owner, ids in recording:
            await store.record_owner(ids, owner)

    def _unrecorded(self, read: Sequence[tuple[Approval, ApprovalStore, object]]
                    ) -> list[str]:
        """The threads `record` looks up for `read`, within the same bounds (found
        together first: `look_up`)."""
        wanted: dict[str, None] = {}
        met = len(self._met)
        for approval, _, _ in read:
            thread_id = approval.thread_id
            if approval.owner_known or met >= _OWNER_ROWS:
                continue
            if thread_id not in self._found and thread_id not in wanted:
                if len(self._found) + len(wanted) >= _OWNER_READS:
                    continue
                wanted[thread_id] = None
            met += 1
        return list(wanted)

    def known(self, approval: Approval) -> bool:
        """Whether its owner is known: recorded, or found by this page."""
        return approval.owner_known or approval.id in self._met

    def sees(self, approval: Approval) -> bool:
        return self.viewer.sees(approval.owner if approval.owner_known
                                else self._found[approval.thread_id])


#: The code of an answer a guardrail refused (as the GraphQL edge says of a refused run).
_REFUSED = "GUARDRAILS_VALIDATION_FAILED"


def _of_a_suggestion(approval: Approval) -> bool:
    """Whether `approval` was filed on a chat suggestion's throwaway thread: nobody's to
    list, answer or time out (its run's end forgets it; answering it would run the graph
    on, into a stored thread nobody asked for)."""
    return approval.thread_id.startswith(SUGGESTION_THREAD_PREFIX)


def _refused(reason: str) -> ApprovalError:
    """A guardrail refused an answer: 422, with its reason (as a chat shows it)."""
    error = ApprovalError(reason)
    error.status, error.code = 422, _REFUSED
    return error


async def _drive(run: HostedRun, first: Callable[[], Awaitable[bool]] | None = None, *,
                 service_input: RunInput | None = None) -> dict[str, Any]:
    """Drive a server-side run to its end (unless `first` says not to); what became of it.
    `service_input`: the run's input, marked as the service's own while it runs."""
    terminal: list[Event] = []
    legacy_interrupt = False

    async def write(batch: Sequence[Event]) -> None:
        nonlocal legacy_interrupt
        terminal.extend(e for e in batch if e["type"] in ev.TERMINAL_TYPES)
        legacy_interrupt = legacy_interrupt or any(
            e["type"] == ev.CUSTOM and e.get("name") == ev.LEGACY_INTERRUPT for e in batch)

    summary: dict[str, Any] = {"threadId": run.thread_id, "runId": run.run_id}
    try:
        async with run:  # given back if it is cancelled (or refused) before it drives
            if first is not None and not await first():
                return {**summary, "status": "refused"}
            marking = contextlib.nullcontext() if service_input is None \
                else sent_by_service(service_input)
            with marking:
                await run.drive(write)
    except CopilotRuntimeError as exc:  # pragma: no cover - drive turns these into events
        return {**summary, "status": "error", "error": {"message": exc.message,
                                                        "code": exc.code}}
    if run.cancel_reason == "stop":  # it ends as a finished run does: say what happened
        return {**summary, "status": "stopped"}
    last = terminal[-1] if terminal else {}
    if last.get("type") == ev.RUN_ERROR:
        return {**summary, "status": "error",
                "error": {"message": last.get("message"), "code": last.get("code")}}
    outcome = last.get("outcome")
    if legacy_interrupt or (isinstance(outcome, dict) and outcome.get("type") == "interrupt"):
        return {**summary, "status": "interrupted"}
    return {**summary, "status": "finished"}



def _failed(failures: dict[str, int], what: str, message: str, exc: Exception) -> None:
    """Log the timer's `what` failing again, now and then (`worth_logging`: a store away for
    ten minutes was some 27,000 lines), without a stack for a server that cannot be
    reached."""
    failures[what] += 1
    if worth_logging(failures[what]):
        _log.error(message, error=f"{type(exc).__name__}: {exc}",
                   failures_in_a_row=failures[what],
                   exc_info=not isinstance(exc, ServiceUnavailableError))
