"""What a LangGraph run does with the approval ledger around its graph.

Before the graph runs, a run that resumes (`RunAgentInput.resume`, or the legacy
`forwardedProps.command.resume`) claims the approvals it answers: only interrupts the
checkpoint still waits on can be answered, and only once, before their deadline. The
answer the graph receives is the one the ledger holds: the caller's if it won the claim;
the timeout answer, or the answer stored before a crash, only in the approvals service's
own runs (a client's answer is refused then, never swapped for another). After the
run, each claim is settled against the checkpoint: applied if the graph moved past the
interrupt, reopened if it did not (the run was stopped first). Claims a run cannot go on
with (another of its answers refused, a stop or a shutdown while it claims) are reopened at
once, so no answer is left claimed that no run will send. Interrupts a run ends on
are recorded as pending approvals before the client hears of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import structlog
from ag_ui.core import ResumeEntry, RunAgentInput

from copilot_runtime._exceptions import (
    ApprovalClosedError,
    InvalidRequestError,
    NothingToResumeError,
)
from copilot_runtime._input import RunInput
from copilot_runtime._limits import check_json_text
from copilot_runtime._time import iso_time, parse_time
from copilot_runtime.approvals.decisions import answered_by, parse_decision, timeout_answer
from copilot_runtime.approvals.ledger import Approval, ApprovalStore, Channel
from copilot_runtime.threads.base import id_problem

__all__ = ["Claims", "claim_resume", "record_interrupts", "refuse_unkeepable",
           "sent_by_service"]

_log = structlog.get_logger("copilot_runtime.approvals")

# ag-ui-langgraph's resume value for a cancelled `ResumeEntry`.
_CANCELLED = "__agui_cancelled__"

#: The inputs of the runs the approvals service starts with an answer it decided on (a
#: deadline's timeout) or one the ledger holds already (a resend, an answer it recorded
#: before its run), by identity while they run: no client can send these objects. Only
#: such a run sends a stored answer or a timeout; a client's is refused (see `_claim`).
_service_inputs: dict[int, RunInput] = {}


@contextlib.contextmanager
def sent_by_service(input: RunInput) -> Iterator[None]:
    """Mark `input` as the service's own while its run may claim (see `_service_inputs`)."""
    _service_inputs[id(input)] = input
    try:
        yield
    finally:
        _service_inputs.pop(id(input), None)


def _is_service_input(input: RunInput) -> bool:
    return _service_inputs.get(id(input)) is input


def refuse_unkeepable(answer: Any) -> None:
    """Refuse an answer holding U+0000: no SQL store keeps it (PostgreSQL's text and jsonb
    refuse it), and the graph would take the answer, then fail writing its next checkpoint,
    leaving the approval answered and the thread stuck."""
    stack = [answer]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            found = "\x00" in value
        elif isinstance(value, Mapping):
            found = any(isinstance(key, str) and "\x00" in key for key in value)
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            found = False
            stack.extend(value)
        else:
            found = False
        if found:
            raise InvalidRequestError(
                "An answer cannot hold the character U+0000 (NUL): the checkpoint store "
                "cannot keep it")


@dataclass(slots=True)
class Claims:
    """The run's input as the graph must see it, and the approvals it answers."""

    input: RunInput
    ids: list[str] = field(default_factory=list)

    async def settle(self, store: ApprovalStore, pending_after: set[str], *,
                     unfinished: bool = False) -> None:
        """After the run: an answer whose interrupt still waits did not reach the graph
        (reopened); one the graph took is applied, unless `unfinished`: the run was cut
        short (not stopped by its caller) while the graph was between steps, so its
        answer stays unapplied and recovery sends it again, which carries the graph on
        from the step it stopped at."""
        for approval_id in self.ids:
            if approval_id in pending_after:
                # Told, since the one who answered may not be waiting for the run.
                _log.info("approval reopened: its answer did not reach the graph",
                          approval_id=approval_id)
                await store.settle(approval_id, "reopen")
            elif unfinished:
                _log.info("approval left unapplied: its run was cut short mid-graph",
                          approval_id=approval_id)
            else:
                await store.settle(approval_id, "applied")


async def claim_resume(store: ApprovalStore, *, agent_id: str, input: RunInput,
                       pending: set[str], channel: Channel,
                       values: Mapping[str, Any] | None = None,
                       principal_id: str | None = None, parked: bool = False) -> Claims:
    """Claim the approvals `input` answers; raise an `ApprovalError` when it may not.

    `parked`: the graph waits on no interrupt but has steps left (a run that took an
    answer was cut short): an entry for an approval answered and not applied carries it on
    with the stored answer.

    All or nothing: if it raises, or is cancelled, after winning some claims (one entry of
    several refused, a stop or a shutdown in between), those go back to pending, since no
    run will take their answers; the caller settles only the claims it was returned."""
    won: list[str] = []
    try:
        return await _claim_all(store, agent_id=agent_id, input=input, pending=pending,
                                channel=channel, values=values, won=won,
                                principal_id=principal_id, parked=parked,
                                by_service=_is_service_input(input))
    except BaseException:
        if won:  # shielded: a second cancellation must not leave them claimed either
            await asyncio.shield(_reopen(store, won))
        raise


async def _reopen(store: ApprovalStore, approval_ids: list[str]) -> None:
    for approval_id in approval_ids:
        try:
            await store.settle(approval_id, "reopen")
        except Exception:
            # Left answered, not applied: the next start sends that answer (`unapplied`).
            _log.exception("could not reopen an approval", approval_id=approval_id)


async def _claim_all(store: ApprovalStore, *, agent_id: str, input: RunInput,
                     pending: set[str], channel: Channel, values: Mapping[str, Any] | None,
                     won: list[str], principal_id: str | None = None,
                     parked: bool = False, by_service: bool = False) -> Claims:
    model = input.model
    _refuse_repeated(model.resume or ())
    # LangGraph cannot resume with None (it fails) or {} (it takes it for an empty map of
    # answers): such an entry is no answer, and the graph asks its question again.
    entries = [e for e in model.resume or ()
               if e.status == "cancelled" or e.payload not in (None, {})]
    if len(entries) != len(model.resume or ()):
        input = input.replace(resume=entries or None)
        model = input.model
    sent = _legacy_command(model)
    # Decoded before the rule above: the text "null" (`JSON.stringify(null)`) or "{}" is
    # no answer either.
    command = _json_or_text(sent)
    if sent is not None and command in (None, {}):
        command = None
        input = input.replace(forwarded_props={
            k: v for k, v in (model.forwarded_props or {}).items() if k != "command"})
        model = input.model
    if not entries and command is None:
        return Claims(input)
    if not entries:
        if not pending:
            raise NothingToResumeError(
                f"Thread '{model.thread_id}' is not waiting for an answer: there is nothing "
                "to resume")
        if len(pending) > 1:
            command = sent  # as the graph gets it, from forwardedProps
            if principal_id:  # who answered is the caller, not whom the answer names
                command = answered_by(sent, principal_id)
                props = dict(model.forwarded_props or {})
                props["command"] = {**props["command"], "resume": command}
                input = input.replace(forwarded_props=props)
                model = input.model
            # Which interrupt a bare answer is for is LangGraph's call; record it for all.
            for approval_id in sorted(pending):
                await _claim(store, approval_id, command, principal_id or "chat", now=time.time(),
                             agent_id=agent_id, thread_id=model.thread_id, channel=channel,
                             value=(values or {}).get(approval_id), won=won,
                             by_service=by_service)
            return Claims(input, sorted(pending))
        # The legacy form names no interrupt: it answers the one the thread waits on. As a
        # standard entry the bridge takes its documented path (and logs no deprecation).
        entries = [ResumeEntry(interrupt_id=next(iter(pending)), status="resolved",
                               payload=command)]
        input = input.replace(forwarded_props={
            k: v for k, v in (model.forwarded_props or {}).items() if k != "command"})
        model = input.model
    now = time.time()
    answers: dict[str, Any] = {}
    for entry in entries:
        if entry.interrupt_id not in pending:
            taken = await _taken_unfinished(store, entry.interrupt_id, model.thread_id) \
                if parked else None
            if taken is None:
                raise await _not_pending(store, entry.interrupt_id, model.thread_id)
            answers[entry.interrupt_id] = taken.answer  # the graph took it: the same one
            continue
        given = entry.payload if entry.status == "resolved" else {
            _CANCELLED: True, "interrupt_id": entry.interrupt_id}
        # Who answered: the caller when authenticated (as over HTTP, whatever the client
        # says); else the entry's own word, if it is something the ledger can keep.
        by = principal_id or (entry.metadata or {}).get("answeredBy")
        if not isinstance(by, str) or not by or id_problem(by) is not None:
            by = "chat"
        if principal_id and entry.status == "resolved":
            # The graph reads who approved from the answer: it is the caller there too.
            given = answered_by(given, principal_id)
        answers[entry.interrupt_id] = await _claim(
            store, entry.interrupt_id, given, by,
            now=now, agent_id=agent_id, thread_id=model.thread_id, channel=channel,
            value=(values or {}).get(entry.interrupt_id), won=won, by_service=by_service)
    resume = [entry.model_copy(update={"payload": answers[entry.interrupt_id],
                                       "status": "resolved"}) for entry in entries]
    return Claims(input.replace(resume=resume), list(answers))


def _refuse_repeated(entries: Iterable[ResumeEntry]) -> None:
    """A resume answers each interrupt once. One listed twice would claim it, fail the
    second claim and put the first back: refused before anything is claimed, as what it
    is, not as an approval answered already (nothing was)."""
    seen: set[str] = set()
    for entry in entries:
        if entry.interrupt_id in seen:
            named = "" if id_problem(entry.interrupt_id) is not None \
                else f" '{entry.interrupt_id}'"
            raise InvalidRequestError(
                f"A resume lists interrupt{named} more than once: answer each once")
        seen.add(entry.interrupt_id)


def _json_or_text(value: Any) -> Any:
    """A legacy resume sent as JSON text is meant as the value it encodes.

    Held to the same depth bound as any JSON in a request (`JSONTooDeepError`, a precise
    RUN_ERROR): what the ledger stores must stay encodable when the approval is listed."""
    if isinstance(value, str):
        try:
            return check_json_text(value, "The resume answer")
        except orjson.JSONDecodeError:
            return value
    return value


async def _claim(store: ApprovalStore, approval_id: str, given: Any, by: str, *, now: float,
                 agent_id: str, thread_id: str, channel: Channel, value: Any,
                 won: list[str], by_service: bool = False) -> Any:
    """The answer the graph gets for `approval_id`; its id goes to `won` if this claimed it
    (not if it was claimed before: that answer, stored, is resent by the service's runs).

    `by_service`: the run is the approvals service's own (`sent_by_service`). A client's
    answer past the deadline, or to an approval claimed already, is refused: sending the
    timeout or the stored answer in its place would tell it its answer was taken."""
    approval = await store.get(approval_id)
    if approval is None:
        # Waiting in the checkpoint but not in the ledger (it was lost, or the interrupt
        # was raised before the ledger existed): record it now so the answer is kept.
        approval = Approval(approval_id, thread_id, agent_id, value, now, channel=channel)
        await store.add([approval])
    if approval.status == "pending":
        now = time.time()  # what the lookup took counts: the ledger checks the deadline
        if approval.expired_at(now):
            if not by_service:
                # Left pending: the expiry timer resumes the graph with the timeout.
                raise ApprovalClosedError(replace(approval, status="expired"))
            answer = timeout_answer(iso_time(approval.expires_at or now))
            claiming = store.claim(approval_id, "expired", answer, "runtime", now)
        else:
            _refuse_forged_timeout(given)
            refuse_unkeepable(given)
            answer = given
            claiming = store.claim(approval_id, "answered", given, by, now)
        claimed = await _to_its_end(claiming, approval_id, won)
        if claimed is None:  # another request won since our read, or the deadline passed
            closed = await store.get(approval_id) or approval
            if closed.status == "pending" and closed.expired_at(time.time()):
                closed = replace(closed, status="expired")  # the timer sends the timeout
            raise ApprovalClosedError(closed)
        return answer
    # Claimed earlier but the graph still waits: that answer has not reached it yet (a
    # crash or a stop in between, or its run is still taking it, maybe in another process
    # that shares no coordinator). The service sends it again (recovery waits first, so a
    # run under way ends before); a client's answer is refused, never swapped for it.
    if approval.status in ("answered", "expired") and by_service:
        return approval.answer
    raise ApprovalClosedError(approval)


def _refuse_forged_timeout(given: Any) -> None:
    """A deadline passing is the runtime's word, never a client's: an answer saying
    `timeout` would take the workflow's no-answer path before its deadline (the HTTP route
    allows only approve, reject and revise)."""
    decided = parse_decision(given)
    if decided is not None and decided.action == "timeout":
        raise InvalidRequestError(
            "An answer cannot say 'timeout': only the runtime answers so, once an "
            "approval's deadline has passed")


async def _taken_unfinished(store: ApprovalStore, approval_id: str,
                            thread_id: str) -> Approval | None:
    """The thread's approval, if its answer was recorded and the run that took it never
    finished (another thread's approval is none of this run's business: settled as applied
    by it, its own graph would never be carried on)."""
    if id_problem(approval_id) is not None:
        return None
    approval = await store.get(approval_id)
    if approval is not None and approval.thread_id == thread_id \
            and approval.status in ("answered", "expired") and not approval.applied:
        return approval
    return None


async def _to_its_end(claiming: Awaitable[Approval | None], approval_id: str,
                      won: list[str]) -> Approval | None:
    """Await a claim to its end even if the run is cancelled meanwhile (then cancelled
    after), so one that won is known, and put back."""
    task = asyncio.ensure_future(claiming)
    try:
        claimed = await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # a claim that failed won nothing
            if await task is not None:
                won.append(approval_id)
        raise
    if claimed is not None:
        won.append(approval_id)
    return claimed


async def _not_pending(store: ApprovalStore, approval_id: str,
                       thread_id: str) -> Exception:
    # An id no store can keep (a NUL byte, too long) names no approval: do not look it up
    # (PostgreSQL refuses NUL in text, which failed the run as AGENT_ERROR), nor echo it.
    unkeepable = id_problem(approval_id) is not None
    approval = None if unkeepable else await store.get(approval_id)
    if approval is not None and approval.thread_id != thread_id:
        approval = None  # another thread's (maybe another user's): as if it did not exist
    if approval is not None and approval.status != "pending":
        return ApprovalClosedError(approval)
    if unkeepable:
        return NothingToResumeError(
            f"That interrupt is not pending on thread '{thread_id}': there is nothing to "
            "resume")
    return NothingToResumeError(
        f"Interrupt '{approval_id}' is not pending on thread '{thread_id}': there is "
        "nothing to resume")


def _legacy_command(model: RunAgentInput) -> Any:
    props = model.forwarded_props if isinstance(model.forwarded_props, dict) else {}
    command = props.get("command")
    if isinstance(command, dict):
        return command.get("resume")
    return None


def record_interrupts(interrupts: Iterable[Mapping[str, Any]], *, thread_id: str,
                      agent_id: str, channel: Channel) -> list[Approval]:
    """Approvals for the AG-UI interrupts of a run's interrupt outcome."""
    now = time.time()
    out = []
    for interrupt in interrupts:
        interrupt_id = interrupt.get("id")
        if not isinstance(interrupt_id, str) or not interrupt_id:
            continue
        raw = ((interrupt.get("metadata") or {}).get("langgraph") or {}).get("raw")
        value = raw if raw is not None else {
            k: v for k, v in interrupt.items() if k not in ("id", "metadata")}
        out.append(Approval(interrupt_id, thread_id, agent_id, value, now,
                            parse_time(interrupt.get("expiresAt")), channel=channel))
    return out
