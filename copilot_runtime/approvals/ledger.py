"""Approvals: the runtime's ledger of the LangGraph interrupts waiting for a person.

The graph's checkpoint is the source of truth for *whether* a graph waits; the ledger adds
what a checkpoint cannot say: which agent and thread an interrupt belongs to (so pending
approvals can be listed across threads), when it expires, and who answered it with what.
An approval's id is the LangGraph interrupt id, which is also the AG-UI `Interrupt.id` a
chat client resumes with, so both channels name the same thing.

Life of an approval::

    pending --answer--> answered --the graph took it--> applied
    pending --deadline passed--> expired --timeout reached the graph--> applied
    pending --the interrupt vanished without an answer--> withdrawn

`claim` is the one compare-and-set from `pending`: whoever wins it decides, a second
answer is refused, and so is an answer once the deadline has passed. An answer is stored
before it is sent to the graph, so one that a crash interrupted is sent again at the next
start (`unapplied`); if the graph did not take it (the run was stopped), `reopen` puts the
approval back to pending.

This module has no LangGraph import: the protocol edges use it whatever is installed.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, runtime_checkable

import structlog

from copilot_runtime._again import worth_logging
from copilot_runtime._time import iso_time
from copilot_runtime.threads.base import ThreadOwner

__all__ = [
    "Approval",
    "ApprovalKey",
    "ApprovalStatus",
    "ApprovalStore",
    "Channel",
    "MemoryApprovalStore",
    "SharedApprovalStore",
    "SupportsApprovals",
    "Viewer",
]

ApprovalStatus = Literal["pending", "answered", "expired", "withdrawn"]
#: How the client that saw the interrupt was told: the AG-UI 1.0 interrupt outcome, or the
#: legacy `on_interrupt` custom event. A run resumed server-side answers in the same form.
Channel = Literal["outcome", "legacy"]
#: Where an approval is in a listing: (created_at, id).
ApprovalKey = tuple[float, str]


@dataclass(slots=True)
class Approval:
    id: str
    thread_id: str
    agent_id: str
    #: The value the graph passed to `interrupt()` (JSON-ready).
    value: Any
    created_at: float
    expires_at: float | None = None
    channel: Channel = "outcome"
    status: ApprovalStatus = "pending"
    #: The resume payload that answered it (a timeout's payload for an expired one).
    answer: Any = None
    answered_by: str | None = None
    answered_at: float | None = None
    #: The answer reached the graph (the run it resumed got past the interrupt).
    applied: bool = False
    #: Whether the thread's owner is recorded (`owner`: None for a thread without one).
    #: A listing looks it up once and records it (`ApprovalStore.record_owner`): a thread's
    #: owner never changes, and its approvals are dropped with it.
    owner_known: bool = False
    owner: ThreadOwner | None = None

    @property
    def key(self) -> ApprovalKey:
        """Its place in a listing: oldest first, ties by id."""
        return self.created_at, self.id

    def expired_at(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def to_json(self) -> dict[str, Any]:
        """The approval as the HTTP routes show it (camelCase, ISO times)."""
        value = self.value
        out: dict[str, Any] = {
            "id": self.id, "threadId": self.thread_id, "agentId": self.agent_id,
            "status": self.status, "value": value, "createdAt": iso_time(self.created_at),
            "expiresAt": iso_time(self.expires_at) if self.expires_at is not None else None,
        }
        if isinstance(value, dict):
            for key in ("reason", "message"):
                if isinstance(value.get(key), str):
                    out[key] = value[key]
        if self.status != "pending":
            out.update(answer=self.answer, answeredBy=self.answered_by,
                       answeredAt=iso_time(self.answered_at) if self.answered_at else None,
                       applied=self.applied)
        return out


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who lists approvals: they see those of the threads `owner` owns and, as an
    `approver` (one of the runtime's approver roles), those of every owned thread of
    its tenant (`_trust.may_approve`, as a filter a ledger can apply)."""

    owner: ThreadOwner
    approver: bool = False

    def sees(self, owner: ThreadOwner | None) -> bool:
        if owner is None:
            return False
        return owner == self.owner or (self.approver and owner.tenant == self.owner.tenant)


@runtime_checkable
class ApprovalStore(Protocol):
    """Where approvals live; SQL stores sit in the same database as the checkpoints."""

    async def add(self, approvals: Sequence[Approval]) -> None:
        """Record new pending approvals; ids already known are left as they are."""
        ...

    async def get(self, approval_id: str) -> Approval | None:
        ...

    async def find(self, *, status: ApprovalStatus | None = "pending",
                   thread_id: str | None = None, agent_id: str | None = None,
                   after: ApprovalKey | None = None, limit: int | None = None,
                   viewer: Viewer | None = None) -> list[Approval]:
        """Approvals, oldest first (by `key`): only those after `after`, at most `limit`;
        with `viewer`, only those it sees and those whose owner is not recorded yet."""
        ...

    async def record_owner(self, approval_ids: Collection[str],
                           owner: ThreadOwner | None) -> None:
        """Record the owner of the approvals' thread on those that have none recorded."""
        ...

    async def claim(self, approval_id: str, status: Literal["answered", "expired"],
                    answer: Any, answered_by: str | None, at: float) -> Approval | None:
        """Move a pending approval to `status`; None if it was not pending (someone won)
        or, for "answered", if its deadline had passed by `at` (the timeout is the only
        answer left then: whatever path an answer took to get here, it cannot slip past)."""
        ...

    async def settle(self, approval_id: str, outcome: Literal["applied", "reopen",
                                                              "withdrawn"]) -> None:
        """After the run: the answer was applied, did not take (back to pending), or the
        interrupt is gone without an answer. "withdrawn" changes only a pending approval,
        "reopen" only an answered or expired one not applied (compare-and-set, like
        `claim`: the caller's read may be stale)."""
        ...

    async def unapplied(self) -> list[Approval]:
        """Answered or expired approvals whose answer has not reached the graph yet."""
        ...

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever approvals are added (the expiry timer re-plans)."""
        ...

    async def aclose(self) -> None:
        ...


@runtime_checkable
class SharedApprovalStore(Protocol):
    """A ledger that other processes write to as well (SQL): `subscribe` hears only of the
    approvals added in this one, so the expiry timer asks this for the others' deadlines."""

    async def next_deadline(self, agent_ids: Collection[str]) -> float | None:
        """The earliest `expires_at` of the pending approvals of `agent_ids`, if any."""
        ...


@runtime_checkable
class SupportsApprovals(Protocol):
    """An agent whose runs can stop for an approval (a `LangGraphAgent`)."""

    @property
    def approvals(self) -> ApprovalStore:
        ...

    async def pending_interrupt_ids(self, thread_id: str) -> set[str]:
        """The ids of the interrupts the thread's graph waits on, from its checkpoint."""
        ...

    async def parked(self, thread_id: str) -> bool:
        """Whether the thread's graph has steps left and waits on no interrupt: a run that
        took an answer was cut short, and resuming with that answer carries it on."""
        ...


_log = structlog.get_logger("copilot_runtime.approvals")


class _Listeners:
    def __init__(self) -> None:
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()


def _key(approval: Approval) -> ApprovalKey:
    return approval.key


def _is_settled(approval: Approval) -> bool:
    """Whether `approval` is over: in a state nothing moves it out of (`settle`, `claim`)."""
    return approval.status == "withdrawn" or (
        approval.status in ("answered", "expired") and approval.applied)


class MemoryApprovalStore(_Listeners):
    """Approvals in this process, for graphs whose checkpoints are in memory too.

    Bounded, as the in-memory thread store is: an approval that is over (withdrawn, or
    answered or expired and applied) is kept for `settled_seconds` and among the latest
    `max_settled`, long enough to say why a second answer is refused and to list it; then
    dropped (an answer to it is a 404). Live ones (pending, or answered and not applied
    yet: recovery sends those) are kept, at most `max_live` of them, the oldest dropped
    first: its graph still waits, and the interrupt is recorded again when its thread is
    listed or answered. Each was kept for the life of the process (~1 KB an interrupt)."""

    def __init__(self, *, max_settled: int = 10_000, settled_seconds: float = 86_400.0,
                 max_live: int = 10_000) -> None:
        super().__init__()
        self.max_settled = max_settled
        self.settled_seconds = settled_seconds
        self.max_live = max_live
        self._items: dict[str, Approval] = {}
        # Both orders are insertion orders, so each bound drops from the front in O(1).
        #: Live ids, oldest added first.
        self._live: dict[str, None] = {}
        #: Settled ids, by when they settled (monotonic: a clock stepped back keeps order).
        self._settled: dict[str, float] = {}
        self._dropped_live = 0  # so far: logged at the 1st, 2nd, 4th... (`worth_logging`)
        self._lock = asyncio.Lock()

    async def add(self, approvals: Sequence[Approval]) -> None:
        added = False
        for approval in approvals:
            if approval.id not in self._items:
                self._items[approval.id] = replace(approval)
                if _is_settled(approval):
                    self._settled[approval.id] = time.monotonic()
                else:
                    self._live[approval.id] = None
                added = True
        if added:
            self._trim()
            self._notify()

    def _now_settled(self, approval: Approval) -> None:
        """`approval` moved to a state it never leaves: it counts as settled from now."""
        if _is_settled(approval) and approval.id in self._live:
            del self._live[approval.id]
            self._settled[approval.id] = time.monotonic()
            self._trim()

    def _trim(self) -> None:
        too_old = time.monotonic() - self.settled_seconds
        settled = self._settled
        while settled and (len(settled) > self.max_settled
                           or next(iter(settled.values())) < too_old):
            del self._items[self._pop_first(settled)]
        if len(self._live) > self.max_live:
            dropped = 0
            while len(self._live) > self.max_live:
                del self._items[self._pop_first(self._live)]
                dropped += 1
            self._dropped_live += dropped
            if worth_logging(self._dropped_live):
                _log.warning("the oldest pending approvals were dropped from the in-memory "
                             "ledger: it keeps max_live of them (their graphs still wait)",
                             max_live=self.max_live, dropped_so_far=self._dropped_live)

    @staticmethod
    def _pop_first(ordered: dict[str, Any]) -> str:
        first = next(iter(ordered))
        del ordered[first]
        return first

    async def get(self, approval_id: str) -> Approval | None:
        found = self._items.get(approval_id)
        return replace(found) if found else None

    async def find(self, *, status: ApprovalStatus | None = "pending",
                   thread_id: str | None = None, agent_id: str | None = None,
                   after: ApprovalKey | None = None, limit: int | None = None,
                   viewer: Viewer | None = None) -> list[Approval]:
        matching = (a for a in self._items.values()
                    if (status is None or a.status == status)
                    and (thread_id is None or a.thread_id == thread_id)
                    and (agent_id is None or a.agent_id == agent_id)
                    and (after is None or a.key > after)
                    and (viewer is None or not a.owner_known or viewer.sees(a.owner)))
        # A page is the `limit` oldest: kept as they come, not every approval sorted.
        found = (sorted(matching, key=_key) if limit is None
                 else heapq.nsmallest(limit, matching, key=_key))
        return [replace(a) for a in found]

    async def record_owner(self, approval_ids: Collection[str],
                           owner: ThreadOwner | None) -> None:
        for approval_id in approval_ids:
            found = self._items.get(approval_id)
            if found is not None and not found.owner_known:
                found.owner_known, found.owner = True, owner

    async def claim(self, approval_id: str, status: Literal["answered", "expired"],
                    answer: Any, answered_by: str | None, at: float) -> Approval | None:
        async with self._lock:
            found = self._items.get(approval_id)
            if found is None or found.status != "pending":
                return None
            if status == "answered" and found.expired_at(at):
                return None
            found.status, found.answer, found.answered_by = status, answer, answered_by
            found.answered_at, found.applied = at, False
            return replace(found)

    async def settle(self, approval_id: str, outcome: Literal["applied", "reopen",
                                                              "withdrawn"]) -> None:
        found = self._items.get(approval_id)
        if found is None:
            return
        if outcome == "applied":
            found.applied = True
            self._now_settled(found)
        elif outcome == "withdrawn":
            if found.status == "pending":  # an answer that won meanwhile stays
                found.status = "withdrawn"
                self._now_settled(found)
        elif found.status in ("answered", "expired") and not found.applied:
            found.status, found.answer, found.answered_by = "pending", None, None
            found.answered_at, found.applied = None, False
            self._notify()

    async def unapplied(self) -> list[Approval]:
        # (only a live one can be: a settled one is applied or withdrawn)
        return [replace(a) for a in map(self._items.__getitem__, self._live)
                if a.status in ("answered", "expired") and not a.applied]

    async def forget_thread(self, thread_id: str) -> None:
        """Drop the approvals of a deleted thread (its checkpoints are gone with it)."""
        for approval_id in [k for k, a in self._items.items() if a.thread_id == thread_id]:
            del self._items[approval_id]
            self._live.pop(approval_id, None)
            self._settled.pop(approval_id, None)

    async def aclose(self) -> None:
        return None
