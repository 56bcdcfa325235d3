"""The AG-UI protocol of CopilotKit 1.50+: multi-route REST and the single-route envelope.

Routes, relative to the runtime's base path (matched on their last segments, as the
TypeScript router does):

    GET  info                         RuntimeInfo
    POST agent/{agentId}/run          RunAgentInput in, AG-UI events out (SSE)
    POST agent/{agentId}/suggest      a chat suggestion's run: as `run`, but kept out of the
                                      thread (not stored, not holding it, its agent on a
                                      throwaway thread); its client leaving stops it
    POST agent/{agentId}/connect      the thread's runs replayed (compacted), then the live run
    POST agent/{agentId}/stop/{id}    stop the thread's active run
    GET  threads[?agentId=&limit=&cursor=&includeArchived=]   threads, newest first, a page
                                      at a time (archived ones only with includeArchived=true)
    GET  threads/{id}/messages|events|state
    PATCH threads/{id} {"agentId"?, "name"?, "archived"?}   rename, (un)archive
    POST threads/{id}/archive {"agentId"?}, DELETE threads/{id}   archive, forget
    POST transcribe                   audio (multipart `audio`, or JSON base64) → its text
    GET  approvals, GET|POST approvals/{id}   pending approvals (see `approvals`)
    POST (the base path)              {method, params, body}: the same operations in one route

Error bodies match the TypeScript runtime's where it has one; where it leaves the client
hanging (a second run on a busy thread) we answer 409 instead.
"""

from __future__ import annotations

import functools
import math
import re
import urllib.parse
from typing import Any

from copilot_runtime import _trust
from copilot_runtime._compaction import events_to_messages
from copilot_runtime._exceptions import (
    ClientDisconnected,
    InvalidRequestError,
    RequestError,
    ThreadBusyError,
    ThreadNotFoundError,
)
from copilot_runtime._input import parse_json_body_off_loop, parse_run_input
from copilot_runtime._limits import readable
from copilot_runtime._thread_reads import read_thread
from copilot_runtime._time import iso_time
from copilot_runtime.protocols.agui.approvals import ApprovalRoutes, approval_route
from copilot_runtime.protocols.agui.transcribe import serve_transcription
from copilot_runtime.protocols.http import (
    Request,
    from_cursor,
    leaving_seen,
    read_body,
    send_error,
    send_json,
    send_method_not_allowed,
    stream_events,
    stream_run,
    to_cursor,
)
from copilot_runtime.runtime import CopilotRuntime
from copilot_runtime.threads.base import (
    MAX_REPLAY_BYTES,
    NOT_IN_NAMES,
    ListPosition,
    ThreadRecord,
    id_problem,
    refused_answer,
    with_omission,
)

__all__ = ["AGUIProtocol"]

_THREAD_ENDPOINTS = {"list": True, "inspect": True, "mutations": True,
                     "realtimeMetadata": False}
_NO_THREAD_ENDPOINTS = dict.fromkeys(_THREAD_ENDPOINTS, False)
#: Threads per page of `GET threads` (`limit` may ask for up to `_MAX_PAGE`).
_PAGE = 100
_MAX_PAGE = 500
_MAX_NAME = 200
_INTEGER = re.compile(r"-?[0-9]{1,19}")
_ENVELOPE_METHODS = ("info", "agent/run", "agent/suggest", "agent/connect", "agent/stop",
                     "transcribe")


class AGUIProtocol:
    def __init__(self, runtime: CopilotRuntime, *, max_body_size: int,
                 keepalive: float | None = 15.0) -> None:
        self.runtime = runtime
        self.max_body_size = max_body_size
        self.approvals = ApprovalRoutes(
            runtime.approvals, max_body_size=max_body_size, can_approve=runtime.can_approve,
            thread_owner=functools.partial(_trust.thread_owner, runtime.runs),
            approver_roles=runtime.approver_roles)
        self.keepalive = keepalive

    # -- multi-route -------------------------------------------------------------------

    async def handle(self, request: Request, segments: list[str]) -> bool:
        """Serve a multi-route request; False if `segments` name no AG-UI route."""
        tail = segments[-4:]
        method = request.method
        # The stop route first: `agent/agent/stop/run` stops the thread "run" of the agent
        # "agent" (read the other way, it would run an agent "stop").
        if len(tail) == 4 and tail[0] == "agent" and tail[2] == "stop":
            if method != "POST":
                await send_method_not_allowed(request, b"POST")
                return True
            agent_id = urllib.parse.unquote(tail[1])
            thread_id = urllib.parse.unquote(tail[3])
            await self._guarded(request, self._stop_rest(request, agent_id, thread_id))
            return True
        if len(tail) >= 3 and tail[-3] == "agent" and tail[-1] in ("run", "suggest",
                                                                  "connect"):
            if method != "POST":
                await send_method_not_allowed(request, b"POST")
                return True
            agent_id = urllib.parse.unquote(tail[-2])
            await self._guarded(request, self._run_or_connect(request, agent_id, tail[-1]))
            return True
        # Then the thread routes: a thread may be named like any route word ("info",
        # "threads"), and an agent's routes name threads and agents in their own places.
        threads = _thread_route(segments, method)
        if threads is not None:
            changed, what = threads
            if what == "archive" and changed is not None:
                if method != "POST":
                    await send_method_not_allowed(request, b"POST")
                else:
                    await self._guarded(request, self._change_thread(request, changed,
                                                                     archive=True))
            elif method in ("PATCH", "DELETE") and changed is not None and what is None:
                await self._guarded(request, self._change_thread(request, changed))
            elif method not in ("GET", "HEAD") or (changed is not None and what is None):
                await send_method_not_allowed(
                    request, b"PATCH, DELETE" if what is None and changed else b"GET")
            else:
                await self._guarded(request, self._threads(request, *threads))
            return True
        if segments[-1:] == ["info"]:
            if method not in ("GET", "HEAD"):
                await send_method_not_allowed(request, b"GET")
            else:
                await send_json(request, 200, self.info(single_route=False))
            return True
        approval_id = approval_route(segments)
        if approval_id is not None:
            await self._guarded(request, self.approvals.handle(request, approval_id))
            return True
        if segments[-1:] == ["transcribe"]:
            if method != "POST":
                await send_method_not_allowed(request, b"POST")
            else:
                await self._guarded(request, serve_transcription(
                    request, self.runtime.transcription, self.max_body_size))
            return True
        return False

    def info(self, *, single_route: bool) -> dict[str, Any]:
        info = self.runtime.info()
        info.update({
            "audioFileTranscriptionEnabled": self.runtime.transcription is not None,
            "mode": "sse",
            "threadEndpoints": _NO_THREAD_ENDPOINTS if single_route else _THREAD_ENDPOINTS,
            # `@copilotkit/core` then asks `agent/{id}/suggest` for dynamic suggestions.
            "suggestions": True,
            "a2uiEnabled": False,
            "openGenerativeUIEnabled": False,
            "telemetryDisabled": True,
        })
        if single_route:
            info["singleRoute"] = {"resourceOperations": False,
                                   "threadEndpoints": _THREAD_ENDPOINTS}
        return info

    async def _run_or_connect(self, request: Request, agent_id: str, what: str) -> None:
        self.runtime.agent(agent_id)  # 404 before reading a body we would not use
        body = await read_body(request, self.max_body_size, json=True)
        await self._start(request, agent_id, what, await parse_json_body_off_loop(body))

    async def _start(self, request: Request, agent_id: str, what: str, data: Any) -> None:
        run_input = parse_run_input(data)
        if what == "connect":
            await stream_events(request, self.runtime.connect(
                agent_id, run_input.thread_id, request=request.info,
                after=_last_event_id(request)), keepalive=self.keepalive)
            return
        headers = request.forwardable_headers(credentials=self.runtime.forwards_credentials)
        suggestion = what == "suggest"
        with leaving_seen(request):
            run = await self.runtime.start_run(agent_id, run_input, headers,
                                               request=request.info, unstored=suggestion)
        async with run:  # given back if the stream fails or is cancelled before it drives
            # A client that leaves (a reload, a network change) does not stop a chat's run:
            # it goes on, bounded by `detached_run_seconds`, and a `connect` picks it up. A
            # suggestion's has no one to pick it up (it is not stored): it stops.
            await stream_run(request, run, keepalive=self.keepalive,
                             outlives_client=not suggestion)

    async def _stop_rest(self, request: Request, agent_id: str, thread_id: str) -> None:
        self.runtime.agent(agent_id)
        # JSON even when empty: the empty request is the command (stop whatever runs).
        body = await read_body(request, self.max_body_size, json=True, empty_too=True)
        run_id: str | None = None
        if body.strip():
            try:
                data = await parse_json_body_off_loop(body)
            except InvalidRequestError:
                await send_json(request, 400, {"error": "Invalid stop request"})
                return
            problem = _stop_problem(data)
            if problem is not None:
                await send_json(request, 400, {"error": problem})
                return
            run_id = data.get("runId")
        await self._stop(request, agent_id, thread_id, run_id)

    async def _stop(self, request: Request, agent_id: str, thread_id: str,
                    run_id: str | None) -> None:
        if id_problem(thread_id) is not None or (
                self.runtime.owner_filter(request.info) is not None
                and not await self.runtime.can_see(request.info, thread_id)):
            raise ThreadNotFoundError(thread_id)  # someone else's, or none: the same answer
        if await self.runtime.stop(agent_id, thread_id, run_id, request=request.info):
            await send_json(request, 200, {"stopped": True, "interrupt": {
                "type": "RUN_ERROR", "message": "Run stopped by user", "code": "STOPPED"}})
        else:
            await send_json(request, 200, {
                "stopped": False, "message": f"No active run for thread '{thread_id}'."})

    async def _threads(self, request: Request, thread_id: str | None, what: str | None) -> None:
        store = self.runtime.store
        if thread_id is None:
            query = urllib.parse.parse_qs(request.query.decode("latin-1"))
            agent_ids = query.get("agentId")
            if agent_ids and len(agent_ids) > 1:
                raise InvalidRequestError("'agentId' is given more than once")
            agent_id = agent_ids[0] if agent_ids else None
            offset, after = _list_cursor(query, agent_id)
            limit = _query_int(query, "limit", _PAGE, 1, _MAX_PAGE)
            include_archived = _query_flag(query, "includeArchived")
            records = [] if agent_id is not None and id_problem(agent_id) is not None \
                else await self.runtime.list_threads(
                    agent_id, limit + 1, offset=offset, after=after,
                    owner=self.runtime.owner_filter(request.info),
                    include_archived=include_archived)
            await send_json(request, 200, {"threads": [{
                "id": r.thread_id, "name": r.name, "title": r.title, "agentId": r.agent_id,
                "organizationId": "", "createdById": r.owner.principal_id if r.owner else "",
                "archived": r.archived,
                "createdAt": iso_time(r.created_at), "updatedAt": iso_time(r.updated_at),
            } for r in records[:limit]],
                "nextCursor": _next_cursor(records[limit - 1], agent_id)
                if len(records) > limit else None})
            return
        # An id no store can keep names no thread (and PostgreSQL cannot even look it up);
        # someone else's is not read (its 404 would cost what its size does, and so say
        # that it exists).
        record = None
        if id_problem(thread_id) is None and await self.runtime.can_see(request.info,
                                                                        thread_id):
            # The newest runs a replay reads (the store's `replay_bytes`), the rest counted;
            # a running run as far as it went (`read_thread`).
            record = await read_thread(self.runtime.runs, thread_id, getattr(
                store, "replay_bytes", MAX_REPLAY_BYTES))
        if record is not None:
            record = readable(record)  # a thread stored broken is still read
        owner = self.runtime.owner_filter(request.info)
        # Checked again: its owner may have deleted it and another started one of its id.
        if record is None or (owner is not None and record.owner != owner):
            raise ThreadNotFoundError(thread_id)  # the same 404 body as PATCH and DELETE
        elif what in ("messages", "events"):
            # As `connect` replays it: without the answers refused (the graph still waits),
            # and with the omission and the messages of the runs left out, if any.
            events = [event for _, event in with_omission(
                [(None, e) for r in record.runs if not refused_answer(r.events)
                 for e in r.events], record.omitted_runs, record.earlier)]
            if what == "messages":
                await send_json(request, 200, {"messages": events_to_messages([events]),
                                               "omittedRuns": record.omitted_runs})
            else:
                await send_json(request, 200, {"events": events,
                                               "omittedRuns": record.omitted_runs})
        else:
            await send_json(request, 200, {"state": record.state})

    async def _change_thread(self, request: Request, thread_id: str, *,
                             archive: bool = False) -> None:
        """PATCH `{"name": ..., "archived": ...}` renames a thread and (un)archives it, POST
        `archive` archives it, DELETE forgets it; someone else's thread, one of another agent
        than the body's `agentId`, or a running one (DELETE), is answered as the TypeScript
        runtime answers a missing one."""
        # (a DELETE's body is optional: `@copilotkit/core` sends its `agentId`, curl nothing)
        body = await read_body(request, self.max_body_size, json=True, empty_too=archive)
        owner = self.runtime.owner_filter(request.info)
        if id_problem(thread_id) is not None:
            raise ThreadNotFoundError(thread_id)
        if request.method == "DELETE" and await self.runtime.is_running_anywhere(thread_id) \
                and await self.runtime.can_see(request.info, thread_id):
            # (its body read first: a wrong one is a 400, a run on the thread or not)
            agent_id = await _delete_agent(body)
            if agent_id is not None:
                # (its run's agent, if it runs here: the store may have no record of it yet)
                live = self.runtime.runs.active.get(thread_id)
                stored = await self.runtime.store.summary(thread_id) if live is None else None
                running_agent = live.agent_id if live is not None else \
                    stored.agent_id if stored is not None else None
                if running_agent is not None and agent_id != running_agent:
                    raise ThreadNotFoundError(thread_id)  # another agent's, running or not
            # Busy on every store, its first run's events written yet or not (the in-memory
            # store has no record of a thread before its first run ends).
            raise ThreadBusyError(thread_id)
        if request.method != "DELETE":
            # A thread whose first run this worker drives exists from that run's start: the
            # run writes what it streamed before the store is asked (someone else's: not),
            # once: the archive and rename below find the thread written.
            await self.runtime.runs.write_first_batches(thread_id, owner=owner)
        record = await self.runtime.store.summary(thread_id)
        if record is None or (owner is not None and record.owner != owner):
            raise ThreadNotFoundError(thread_id)
        if request.method == "DELETE":
            # (read once the thread is known to be the caller's: someone else's is a 404,
            # whatever the body)
            agent_id = await _delete_agent(body)
            if agent_id is not None and agent_id != record.agent_id:
                raise ThreadNotFoundError(thread_id)  # as PATCH: the agent's list leaves it out
            # No run begins on it meanwhile (it would bring the thread back once it ended),
            # and what the agents keep of it goes first: a checkpointed graph would
            # otherwise hand the conversation to whoever starts a thread with this id next.
            if not await self.runtime.delete_thread(thread_id, owner=owner):
                raise ThreadNotFoundError(thread_id)  # another request deleted it first
            await send_json(request, 200, {"deleted": True, "id": thread_id})
            return
        data = await parse_json_body_off_loop(body) if body.strip() or not archive else {}
        change = _archive_request(data) if archive else _thread_update(data)
        agent_id = change.pop("agentId", None)
        if agent_id is not None and agent_id != record.agent_id:
            raise ThreadNotFoundError(thread_id)  # as the agent's list leaves it out
        # On condition of its owner: the one checked above may have deleted it since, and
        # another begun one of its id. Archived first: a store that cannot refuses it (501)
        # before the name changes.
        if "archived" in change and not await self.runtime.archive_thread(
                thread_id, change["archived"], owner=owner):
            raise ThreadNotFoundError(thread_id)  # deleted meanwhile
        if "name" in change and not await self.runtime.rename_thread(
                thread_id, change["name"], owner=owner):
            raise ThreadNotFoundError(thread_id)
        await send_json(request, 200, {"id": thread_id, **change})

    # -- single-route envelope ---------------------------------------------------------

    async def envelope(self, request: Request, data: Any) -> None:
        """Serve `{method, params, body}` already decoded from a POST to the base path."""
        await self._guarded(request, self._envelope(request, data), single=True)

    async def _envelope(self, request: Request, data: Any) -> None:
        method = data.get("method") if isinstance(data, dict) else None
        if not isinstance(method, str) or not method:
            await _invalid(request, "Missing method field")
            return
        if method not in _ENVELOPE_METHODS:
            await _invalid(request, f"Unsupported method '{method}'")
            return
        if method == "info":
            await send_json(request, 200, self.info(single_route=True))
            return
        if method == "transcribe":
            await serve_transcription(request, self.runtime.transcription, self.max_body_size,
                                      data.get("body"), single=True)
            return
        params = data.get("params")
        params = params if isinstance(params, dict) else {}
        agent_id = params.get("agentId")
        if not isinstance(agent_id, str) or not agent_id:
            await _invalid(request, "Missing or invalid parameter 'agentId'")
            return
        self.runtime.agent(agent_id)
        if method == "agent/stop":
            thread_id = params.get("threadId")
            if not isinstance(thread_id, str) or not thread_id:
                await _invalid(request, "Missing or invalid parameter 'threadId'")
                return
            body = data.get("body")  # none: stop whatever runs, as an empty REST stop
            problem = None if body is None else _stop_problem(body)
            if problem is not None:
                await send_json(request, 400, {"error": problem})
                return
            await self._stop(request, agent_id, thread_id, body.get("runId") if body else None)
            return
        await self._start(request, agent_id, method.removeprefix("agent/"), data.get("body"))

    # -- errors ------------------------------------------------------------------------

    async def _guarded(self, request: Request, work: Any, *, single: bool = False) -> None:
        """Run a handler, answering a `RequestError` raised before the response started."""
        try:
            await work
        except RequestError as exc:
            await send_error(request, exc)
        except ClientDisconnected:
            return  # the client left while sending its body



def _thread_update(data: Any) -> dict[str, Any]:
    """A PATCH's body, as `@copilotkit/core` sends it (its agent, and a name, an archived
    flag or both), with the name trimmed (blank: no name; what frames a name is not part of
    it); `InvalidRequestError` for anything else."""
    name = data.get("name") if isinstance(data, dict) else None
    if isinstance(name, str):
        name = name.strip() or None
    if not isinstance(data, dict) or set(data) - {"agentId", "name", "archived"} \
            or not ("name" in data or "archived" in data) \
            or ("agentId" in data and not isinstance(data["agentId"], str)) \
            or ("archived" in data and not isinstance(data["archived"], bool)) or not (
                name is None or (isinstance(name, str) and len(name) <= _MAX_NAME
                                 and not NOT_IN_NAMES.search(name))):
        raise InvalidRequestError(
            f"A thread update is {{\"agentId\"?: string, \"name\"?: string of at most "
            f"{_MAX_NAME} characters without control characters, or null, \"archived\"?: "
            "boolean}, with a name or archived")
    return {**data, "name": name} if "name" in data else dict(data)


def _archive_request(data: Any) -> dict[str, Any]:
    """An archive's body (`{"agentId"?: string}`) with `archived` set; `InvalidRequestError`
    for anything else."""
    if not isinstance(data, dict) or set(data) - {"agentId"} or (
            "agentId" in data and not isinstance(data["agentId"], str)):
        raise InvalidRequestError("A thread archive is {\"agentId\"?: string}")
    return {**data, "archived": True}


async def _delete_agent(body: bytes) -> Any:
    """The agent a DELETE's optional body names (`{"agentId"?: string}`), or None."""
    return _delete_request(await parse_json_body_off_loop(body) if body.strip() else {}
                           ).get("agentId")


def _delete_request(data: Any) -> dict[str, Any]:
    """A delete's body (`{"agentId"?: string}`); `InvalidRequestError` for anything else."""
    if not isinstance(data, dict) or set(data) - {"agentId"} or (
            "agentId" in data and not isinstance(data["agentId"], str)):
        raise InvalidRequestError("A thread delete is {\"agentId\"?: string}")
    return data


def _stop_problem(data: Any) -> str | None:
    """Why a stop request's JSON (REST body, or the envelope's `body`) is refused, as the
    TypeScript runtime's REST refuses it, or None: a malformed runId must not stop any run."""
    if not isinstance(data, dict) or set(data) - {"runId"}:
        return "Invalid stop request"
    run_id = data.get("runId")
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        return "Invalid runId"
    return None


async def _invalid(request: Request, message: str) -> None:
    await send_json(request, 400, {"error": "invalid_request", "message": message})


def _last_event_id(request: Request) -> int:
    """The position a resuming client saw last (`Last-Event-ID`), or -1 for everything."""
    value = request.header("last-event-id")
    if value is None or not value.strip():
        return -1
    position = _integer(value.strip())
    if position is None or position < -1 or position > 2**62:
        raise InvalidRequestError("Last-Event-ID must be an event id this server sent")
    return position


def _integer(text: str) -> int | None:
    """`text` as an integer written in ASCII digits, or None (Python's `int` also reads
    "+2", "1_0" and other scripts' digits, which no client sends for an id or a page)."""
    return int(text) if _INTEGER.fullmatch(text) else None


def _next_cursor(last: ThreadRecord, agent_id: str | None) -> str:
    """The cursor of the page after `last`: where it is in the list (a keyset, so threads
    updated meanwhile neither repeat nor push others out of the pages that follow), and the
    agent the list is of."""
    return to_cursor([last.updated_at, last.thread_id, agent_id])


def _list_cursor(query: dict[str, list[str]], agent_id: str | None
                 ) -> tuple[int, ListPosition | None]:
    """The offset and the list position a `cursor` asks for: one `_next_cursor` made, or an
    offset (what earlier releases gave)."""
    values = query.get("cursor")
    if not values:
        return 0, None
    if len(values) > 1:
        raise InvalidRequestError("'cursor' is given more than once")
    text = values[0]
    if _INTEGER.fullmatch(text):
        return _query_int(query, "cursor", 0, 0, 2**31), None
    bad = InvalidRequestError("'cursor' must be a nextCursor this server gave")
    decoded = from_cursor(text, bad.message)
    if not (isinstance(decoded, list) and len(decoded) == 3
            and isinstance(decoded[0], (int, float)) and not isinstance(decoded[0], bool)
            and math.isfinite(decoded[0])
            and isinstance(decoded[1], str) and id_problem(decoded[1]) is None
            and (decoded[2] is None or isinstance(decoded[2], str))):
        raise bad
    if decoded[2] != agent_id:
        raise InvalidRequestError("'cursor' is of a list of another agent's threads")
    return 0, (float(decoded[0]), decoded[1])


def _query_flag(query: dict[str, list[str]], name: str) -> bool:
    """A `true` or `false` parameter (absent: false)."""
    values = query.get(name)
    if not values:
        return False
    if len(values) > 1:
        raise InvalidRequestError(f"'{name}' is given more than once")
    if values[0] not in ("true", "false"):
        raise InvalidRequestError(f"'{name}' must be true or false")
    return values[0] == "true"


def _query_int(query: dict[str, list[str]], name: str, default: int, low: int,
               high: int) -> int:
    values = query.get(name)
    if not values:
        return default
    if len(values) > 1:
        raise InvalidRequestError(f"'{name}' is given more than once")
    value = _integer(values[0])
    if value is None:
        raise InvalidRequestError(f"'{name}' must be an integer")
    if not low <= value <= high:
        raise InvalidRequestError(f"'{name}' must be between {low} and {high}")
    return value


def _thread_route(segments: list[str], method: str = "GET"
                  ) -> tuple[str | None, str | None] | None:
    """(thread id or None for the list, what or None), or None: not a thread route.

    The longest reading wins, so a thread may be named like a route word: `threads/threads/
    messages` is thread "threads"'s messages, and PATCH/DELETE `threads/threads` (or
    `threads/info`) change thread "threads" ("info"), not the list (the info route)."""
    if len(segments) >= 3 and segments[-3] == "threads" and segments[-1] in (
            "messages", "events", "state", "archive"):
        return urllib.parse.unquote(segments[-2]), segments[-1]
    if len(segments) >= 2 and segments[-2] == "threads" and (
            segments[-1] != "threads" or method in ("PATCH", "DELETE")):
        return urllib.parse.unquote(segments[-1]), None
    if segments[-1:] == ["threads"]:
        return None, None
    return None
