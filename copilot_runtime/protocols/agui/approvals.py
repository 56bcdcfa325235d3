"""Pending approvals over plain HTTP, for clients that are not a chat (a mail link, a bot).

Routes, relative to the runtime's base path:

    GET  approvals[?status=&agentId=&threadId=&limit=&cursor=]
                                                  {"approvals": [...], "nextCursor"},
                                                  oldest first, 100 a page (`limit` up to
                                                  500), the next page from `cursor` (a
                                                  `nextCursor`; null after the last; a
                                                  page short of `limit`, even empty, may
                                                  have one: it looked up as many thread
                                                  owners as a page may);
                                                  status: pending (default), answered,
                                                  expired, withdrawn or all
    GET  approvals/{id}                           {"approval": {...}}
    POST approvals/{id}   (also approval/{id})    answer it: {"action": "approve" | "reject"
                                                  | "revise", "payload"?, "reason"?,
                                                  "userId"?, "wait"?: true}

An answer resumes the graph on the server; its run goes to the thread's history (`connect`
shows it). With `wait` (the default) the response comes when that run has ended and says
how (`finished`, `interrupted` again, `error`, `stopped` by a `stop` of its thread (what
the graph had done stands, the rest is not carried on), or `cancelled`: the runtime shut
down first, and the approval is as the graph left it, pending if the answer did not reach
it, carried on at the next start if the graph had taken it);
`"wait": false` answers 202 as soon as the answer is recorded (a runtime that stops before
its run takes it sends it at the next start); 200 with run status `cancelled` if the
runtime shut down before it was recorded (the approval shows whether it was).
Answering an approval that is already answered, or withdrawn, is 409; after it expired, 410;
an unknown id, 404; a thread with a run in progress, 409.
"""

from __future__ import annotations

import math
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Final

from copilot_runtime._exceptions import (
    ApprovalError,
    ApprovalNotFoundError,
    InvalidRequestError,
    ThreadBusyError,
)
from copilot_runtime._input import parse_json_body_off_loop
from copilot_runtime.approvals import Approval, ApprovalService, ApprovalStatus
from copilot_runtime.approvals.ledger import ApprovalKey, Viewer
from copilot_runtime.auth import RequestInfo, owner_of
from copilot_runtime.protocols.http import (
    Request,
    from_cursor,
    read_body,
    send_error,
    send_json,
    send_method_not_allowed,
    to_cursor,
)
from copilot_runtime.threads.base import MAX_ID_LENGTH, ThreadOwner, id_problem

__all__ = ["ApprovalRoutes", "approval_route"]

_ACTIONS: Final = ("approve", "reject", "revise")
#: A listing's page: how many approvals by default, and at most.
_PAGE: Final = 100
_MAX_PAGE: Final = 500
_DIGITS = re.compile(r"[0-9]{1,6}")
_STATUSES: Final[dict[str, ApprovalStatus | None]] = {
    "pending": "pending", "answered": "answered", "expired": "expired",
    "withdrawn": "withdrawn", "all": None}


def approval_route(segments: list[str]) -> str | None:
    """The approval id ("" for the list), or None when `segments` name no approval route."""
    if segments[-1:] == ["approvals"]:
        return ""
    if len(segments) >= 2 and segments[-2] in ("approvals", "approval") and segments[-1]:
        return urllib.parse.unquote(segments[-1])
    return None


class ApprovalRoutes:
    def __init__(self, service: ApprovalService, *, max_body_size: int,
                 can_approve: Callable[[RequestInfo | None, str], Awaitable[bool]] | None = None,
                 thread_owner: Callable[[str], Awaitable[ThreadOwner | None]] | None = None,
                 approver_roles: frozenset[str] = frozenset()) -> None:
        self.service = service
        self.max_body_size = max_body_size
        #: Whether a caller may see and answer the approvals of a thread (None: everybody).
        self.can_approve = can_approve
        #: A thread's owner, and the roles that see every thread of their tenant: what a
        #: listing filters by (`Viewer`, as `can_approve` decides), none without both.
        self.thread_owner = thread_owner
        self.approver_roles = approver_roles

    async def handle(self, request: Request, approval_id: str) -> None:
        await self.service.start()
        try:
            if not approval_id:
                if request.method in ("GET", "HEAD"):
                    await self._list(request)
                else:
                    await send_method_not_allowed(request, b"GET")
            elif id_problem(approval_id) is not None:
                # No approval has such an id, and a SQL ledger could not even look it up.
                raise ApprovalNotFoundError(approval_id)
            elif request.method in ("GET", "HEAD"):
                approval, _, _ = await self.service.get(approval_id)
                await self._check_access(request, approval)
                await send_json(request, 200, {"approval": approval.to_json()})
            elif request.method == "POST":
                await self._answer(request, approval_id)
            else:
                await send_method_not_allowed(request, b"GET, POST")
        except (ApprovalError, ThreadBusyError) as exc:
            await send_error(request, exc)

    async def _list(self, request: Request) -> None:
        query = urllib.parse.parse_qs(request.query.decode("latin-1"))
        status_name = (query.get("status") or ["pending"])[0]
        if status_name not in _STATUSES:
            await send_json(request, 400, {
                "error": "Invalid status",
                "message": f"status must be one of {', '.join(_STATUSES)}"})
            return
        limit, after = _page_of(query)
        agent_ids, thread_ids = query.get("agentId"), query.get("threadId")
        if any(id_problem(ids[0]) is not None for ids in (agent_ids, thread_ids) if ids):
            # None can be filed under it.
            await send_json(request, 200, {"approvals": [], "nextCursor": None})
            return
        viewer = None
        if self.thread_owner is not None and request.info is not None and (
                request.info.principal is not None):
            principal = request.info.principal
            viewer = Viewer(owner_of(principal), bool(self.approver_roles & principal.roles))
        approvals, next_key = await self.service.page(
            status=_STATUSES[status_name], agent_id=agent_ids[0] if agent_ids else None,
            thread_id=thread_ids[0] if thread_ids else None, after=after, limit=limit,
            viewer=viewer, thread_owner=self.thread_owner)
        await send_json(request, 200, {
            "approvals": [a.to_json() for a in approvals],
            "nextCursor": None if next_key is None else to_cursor(next_key)})

    async def _answer(self, request: Request, approval_id: str) -> None:
        body = await read_body(request, self.max_body_size, json=True)
        data = await parse_json_body_off_loop(body)
        answer, wait = _parse_answer(data)
        approval, _, _ = await self.service.get(approval_id)
        await self._check_access(request, approval)
        user = answer.get("userId")
        if request.info is not None and request.info.principal is not None:
            user = answer["userId"] = request.info.principal.id  # who it is, not who it says
        result = await self.service.answer(
            approval_id, answer, answered_by=user if isinstance(user, str) else None,
            wait=wait, request=request.info)
        accepted = not wait and result["run"]["status"] == "running"
        await send_json(request, 202 if accepted else 200, result)

    async def _check_access(self, request: Request, approval: Approval) -> None:
        """Someone else's approval does not exist for the caller (the same 404)."""
        if self.can_approve is not None and not await self.can_approve(
                request.info, approval.thread_id):
            raise ApprovalNotFoundError(approval.id)


def _page_of(query: dict[str, list[str]]) -> tuple[int, ApprovalKey | None]:
    """The page a listing asks for: how many (`limit`), after which (`cursor`)."""
    limits, cursors = query.get("limit") or [], query.get("cursor") or []
    if len(limits) > 1 or len(cursors) > 1:
        raise InvalidRequestError("'limit' and 'cursor' may each be given once")
    limit = _PAGE
    if limits:
        if not _DIGITS.fullmatch(limits[0]) or not 1 <= int(limits[0]) <= _MAX_PAGE:
            raise InvalidRequestError(f"'limit' must be an integer from 1 to {_MAX_PAGE}")
        limit = int(limits[0])
    if not cursors:
        return limit, None
    bad = InvalidRequestError("'cursor' must be a nextCursor this server gave")
    key = from_cursor(cursors[0], bad.message)
    if not (isinstance(key, list) and len(key) == 2 and isinstance(key[0], int | float)
            and not isinstance(key[0], bool) and math.isfinite(key[0])
            and isinstance(key[1], str) and id_problem(key[1]) is None):
        raise bad  # (an id no ledger keeps: PostgreSQL could not even compare with NUL)
    return limit, (float(key[0]), key[1])


def _parse_answer(data: Any) -> tuple[dict[str, Any], bool]:
    if not isinstance(data, dict):
        raise InvalidRequestError("Invalid approval answer", "The body must be a JSON object")
    action = data.get("action")
    if action not in _ACTIONS:
        raise InvalidRequestError("Invalid approval answer",
                                  f"action must be one of {', '.join(_ACTIONS)}")
    payload, reason = data.get("payload"), data.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise InvalidRequestError("Invalid approval answer", "reason must be a string")
    user = data.get("userId")
    if user is not None and (not isinstance(user, str) or not user
                             or id_problem(user) is not None):
        raise InvalidRequestError("Invalid approval answer", "userId must be a non-empty "
                                  "string without control characters, at most "
                                  f"{MAX_ID_LENGTH} characters long")
    if action == "revise" and not (
            (isinstance(payload, str) and payload.strip()) or isinstance(payload, dict)
            or (reason and reason.strip())):
        raise InvalidRequestError("Invalid approval answer",
                                  "revise needs a payload (what to change)")
    wait = data.get("wait", True)
    if not isinstance(wait, bool):
        raise InvalidRequestError("Invalid approval answer", "wait must be a boolean")
    answer = {k: v for k, v in (("action", action), ("payload", payload), ("reason", reason),
                                ("userId", user)) if v is not None}
    return answer, wait
