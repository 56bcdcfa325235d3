"""`CopilotRuntime`: the agents, actions and threads that every wire protocol serves."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import structlog

from copilot_runtime import _trust
from copilot_runtime._deadline import within
from copilot_runtime._exceptions import (
    AgentNotFoundError,
    AuthenticationError,
    ConfigurationError,
    ServiceUnavailableError,
    ThreadBusyError,
    UnsupportedOperationError,
)
from copilot_runtime._input import RunInput
from copilot_runtime._limits import DEFAULT_MAX_RUN_BYTES
from copilot_runtime._retention import RetentionSweep
from copilot_runtime._runs import DETACHED_RUN_SECONDS, ActiveRun, RunManager, store_clock
from copilot_runtime._seconds import checked_seconds
from copilot_runtime._shared_runs import RecoverySweep
from copilot_runtime._strings import not_one_string
from copilot_runtime.actions import Action
from copilot_runtime.adapters.base import ServiceAdapter
from copilot_runtime.adapters.empty import EmptyAdapter
from copilot_runtime.adapters.transcription import Transcriber
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.agents.builtin import BuiltInAgent
from copilot_runtime.approvals.service import ApprovalService
from copilot_runtime.auth import Authenticator, Principal, RequestInfo, owner_of
from copilot_runtime.coordination import Coordinator
from copilot_runtime.coordination import coordinator as coordinator_for
from copilot_runtime.guardrails import DEFAULT_GUARDRAIL_TIMEOUT, Guardrail
from copilot_runtime.hooks import (
    DEFAULT_REQUEST_TIMEOUT,
    HookRunner,
    OnError,
    OnRequest,
    OnRunFinished,
    policy_answer,
)
from copilot_runtime.limits import RateLimit, RateLimiter
from copilot_runtime.threads.base import (
    DurableThreadStore,
    ListPosition,
    Positioned,
    ThreadOwner,
    ThreadRecord,
    ThreadStore,
)
from copilot_runtime.threads.memory import InMemoryThreadStore
from copilot_runtime.threads.sqlite import SQLiteThreadStore

__all__ = ["CopilotRuntime", "approval_service"]

#: The CopilotKit runtime version whose protocol this runtime speaks; `/info` reports it.
COMPATIBLE_VERSION = "1.75.0"


_log = structlog.get_logger("copilot_runtime.runtime")
#: Seconds a readiness probe waits for the thread store and the coordinator (each).
READY_TIMEOUT = 2.0
#: Seconds between two sweeps of the threads past `thread_retention_seconds`.
RETENTION_SWEEP_EVERY = 600.0

class CopilotRuntime:
    """The protocol-neutral runtime.

    `agents` maps agent ids to agents. With `service_adapter`, a `BuiltInAgent` over it
    serves as the `default` agent (unless `agents` names one `default` already) with the
    server-side `actions`. `max_run_bytes` bounds what one run keeps in the thread store
    (as encoded JSON; longer strings are cut, and the cut logged); a running run whose
    events pass four times as much is stopped with a `RUN_ERROR` coded `PAYLOAD_TOO_LARGE`
    (an endless upstream would fill the memory). `max_run_seconds` bounds
    how long a run is driven: one still going then is cut as a stop is, and ends with a
    `RUN_ERROR` coded `RUN_TIMEOUT` (None, the default: no bound). An AG-UI run whose
    client leaves before its end (a reload, a lost network, a client that stops reading)
    goes on without it, its events stored as always, so a `connect` (any worker) picks it
    up; `detached_run_seconds` bounds how long it goes on so (default 60), after which it
    is stopped as a stop is: its upstream cancelled, its end stored (0: at once; None: to
    its end, as the TypeScript runtime). Its
    thread stays busy meanwhile (a second run is a 409). A GraphQL (1.10) client's
    disconnect is its stop button: that run is stopped at once. With
    `thread_retention_seconds`, threads whose last run began longer ago are deleted by a
    sweep, as `delete_thread` deletes one (None, the default: kept until deleted).

    Serving many users (all optional; without them nothing is checked or counted):
    `auth` identifies callers and makes threads private to whoever started them;
    `approver_roles` lets principals with one of those roles see and answer the approvals
    of their tenant's threads; `guardrails` check input before any agent runs (one that
    fails, or has not answered within `guardrail_timeout` seconds, refuses); `rate_limit`
    bounds each caller's runs; `on_request`, `on_run_finished` and `on_error` are hooks
    (`copilot_runtime.hooks`; a failing `on_request`, or one slower than
    `on_request_timeout` seconds, refuses its request with 503); `telemetry` traces and
    measures (`copilot_runtime.telemetry`).
    """

    def __init__(
        self,
        *,
        agents: Mapping[str, Agent] | None = None,
        actions: Iterable[Action] = (),
        service_adapter: ServiceAdapter | None = None,
        thread_store: ThreadStore | None = None,
        instructions: str | None = None,
        max_steps: int = 10,
        auth: Authenticator | None = None,
        approver_roles: Iterable[str] = (),
        forward_credentials: bool = False,
        transcription: Transcriber | None = None,
        mcp_servers: Sequence[Any] = (),
        mcp_allowed_urls: Iterable[str] = (),
        guardrails: Iterable[Guardrail] = (),
        rate_limit: RateLimit | None = None,
        on_request: OnRequest | None = None,
        on_run_finished: OnRunFinished | None = None,
        on_error: OnError | None = None,
        on_request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        guardrail_timeout: float | None = DEFAULT_GUARDRAIL_TIMEOUT,
        telemetry: Any = None,
        max_run_bytes: int = DEFAULT_MAX_RUN_BYTES,
        coordinator: Coordinator | str | None = None,
        max_run_seconds: float | None = None,
        thread_retention_seconds: float | None = None,
        detached_run_seconds: float | None = DETACHED_RUN_SECONDS,
    ) -> None:
        self.agents: dict[str, Agent] = dict(agents or {})
        self.actions = list(actions)
        self.service_adapter = service_adapter
        for agent_id, agent in self.agents.items():
            if not agent_id or "/" in agent_id:
                raise ConfigurationError(f"Invalid agent id {agent_id!r}")
            if not isinstance(agent, Agent):
                raise ConfigurationError(f"Agent {agent_id!r} is not an Agent")
        if isinstance(service_adapter, EmptyAdapter):
            if self.actions:
                raise ConfigurationError("actions need a model; EmptyAdapter has none")
        elif service_adapter is not None and "default" not in self.agents:
            self.agents["default"] = BuiltInAgent(
                service_adapter, actions=self.actions, instructions=instructions,
                max_steps=max_steps)
        elif self.actions and service_adapter is None:
            raise ConfigurationError("actions need a service_adapter for the default agent")
        self.store: ThreadStore = thread_store or InMemoryThreadStore()
        #: How the workers serving this runtime share runs (`copilot_runtime.coordination`).
        self.coordinator: Coordinator = coordinator if not isinstance(coordinator, str | None) \
            else coordinator_for(coordinator)
        if self.coordinator.shared and not isinstance(self.store, DurableThreadStore):
            raise ConfigurationError(
                "a shared coordinator needs a thread store every worker can read: pass "
                "thread_store=thread_store('postgresql://...') (the in-memory store is this "
                "process's alone)")
        checked_seconds(max_run_seconds, "max_run_seconds", none_means="no bound")
        if detached_run_seconds != 0 or isinstance(detached_run_seconds, bool):
            checked_seconds(detached_run_seconds, "detached_run_seconds",
                            none_means="runs that go on to their end (0: stopped at once)")
        checked_seconds(thread_retention_seconds, "thread_retention_seconds",
                        none_means="threads kept until deleted")
        if thread_retention_seconds is not None \
                and getattr(self.store, "stale_threads", None) is None:
            raise ConfigurationError(
                "thread_retention_seconds needs a thread store that can list its stale "
                f"threads (stale_threads); {type(self.store).__name__} cannot")
        #: Seconds after its last run a thread is deleted (None: kept for ever).
        self.thread_retention_seconds = thread_retention_seconds
        #: Seconds between two retention sweeps.
        self.retention_sweep_every = RETENTION_SWEEP_EVERY
        self._retention: RetentionSweep | None = None
        self.runs = RunManager(self.store, max_run_bytes, self.coordinator, max_run_seconds,
                               detached_run_seconds)
        self._sweep: RecoverySweep | None = RecoverySweep(
            self.runs.durable, self.runs.active, self.coordinator) \
            if self.coordinator.shared else None
        if auth is not None and not isinstance(auth, Authenticator):
            raise ConfigurationError("auth needs an async authenticate(request) method")
        self.auth = auth
        #: Speech to text for the chat's microphone (`POST transcribe`), or None.
        self.transcription = transcription
        #: The MCP servers whose tools the built-in agents get when the runtime starts.
        self.mcp: Any = None
        self._mcp_offered: list[Action] = []
        #: MCP servers a request may name (the 1.x `properties.mcpServers`); none by default.
        not_one_string(mcp_allowed_urls, "mcp_allowed_urls")
        self.mcp_allowed_urls = frozenset(url.rstrip("/") for url in mcp_allowed_urls)
        if self.mcp_allowed_urls:
            try:
                import copilot_runtime.mcp_tools  # noqa: F401
            except ImportError as exc:
                raise ConfigurationError("mcp_allowed_urls needs the mcp extra: pip install "
                                         f"'copilot-runtime[mcp]' ({exc.name} is missing)"
                                         ) from None
        if mcp_servers:
            from copilot_runtime.mcp_tools import MCPToolset  # the `mcp` extra

            self.mcp = MCPToolset(mcp_servers)
        #: Whether agents see the caller's credential headers (always, without `auth`).
        self.forwards_credentials = auth is None or forward_credentials
        not_one_string(approver_roles, "approver_roles")
        self.approver_roles = frozenset(approver_roles)
        self.guardrails: list[Guardrail] = list(guardrails)
        #: What this process's guardrails let through (and its agents wrote), for the runs
        #: kept out of threads (chat suggestions), which no thread's marks cover.
        self.allowed_marks = _trust.AllowedMarks()
        #: Seconds each guardrail check may take before it refuses (None: no bound).
        self.guardrail_timeout = checked_seconds(guardrail_timeout, "guardrail_timeout",
                                                 none_means="no bound")
        if rate_limit is not None and rate_limit.backend is None:
            # Workers that share runs share their callers' counters too.
            rate_limit = replace(rate_limit, backend=self.coordinator.counters())
        self.limiter = RateLimiter(rate_limit) if rate_limit is not None else None
        # Checked now, as the other bounds: a wrong one ("10") refused every request (503).
        checked_seconds(on_request_timeout, "on_request_timeout", none_means="no bound")
        self.hooks = HookRunner(on_request, on_run_finished, on_error,
                                request_timeout=on_request_timeout)
        #: A `copilot_runtime.telemetry.Telemetry`, or None.
        self.telemetry = telemetry
        #: Whether the edges must describe each request (`RequestInfo`): only then is there
        #: per-request work for identity, hooks, limits or telemetry.
        self.wants_request_info = bool(auth is not None or on_request is not None
                                       or self.limiter is not None or telemetry is not None)
        self._observed = bool(self.limiter is not None or on_run_finished is not None
                              or on_error is not None or telemetry is not None)
        #: The pending approvals of the agents that keep a ledger (LangGraph interrupts).
        self.approvals = ApprovalService(self)
        self._started = False
        self._closed = False
        #: The `aclose` calls under way: a start meanwhile (a probe's, a request's) must not
        #: open again what they are closing.
        self._closing = 0
        #: Set when the start under way ends (None: none is): a close waits for it, or what
        #: the start began after the close (the sweeps) ran on the closed store for ever.
        self._starting: asyncio.Event | None = None
        self._readiness: asyncio.Future[list[str]] | None = None
        #: Gives back this process's hold on a SQLite store's file (`serve_alone`).
        self._alone: Callable[[], None] | None = None
        #: Seconds a readiness probe (`unready`) waits for the store and the coordinator.
        self.ready_timeout = READY_TIMEOUT

    @property
    def observed(self) -> bool:
        """Whether each run's end is observed (limits, hooks or telemetry): only then does a
        run take the longer path that reports it."""
        return self._observed

    @property
    def started(self) -> bool:
        return self._started

    async def start(self) -> None:
        """Start what runs beside the requests: the approvals' expiry timer and recovery.

        Idempotent. The ASGI app calls it at start-up (and, when mounted into a host app,
        from the host's lifespan or its first request); call it yourself when you drive
        the runtime without an app. After `aclose` it starts again as the first time did
        (an app's lifespan run twice), when its thread store can open again (`reopen()`:
        the memory and SQLite stores) and its coordinator is this process's; else it raises
        `ConfigurationError`. While `aclose` runs it does nothing: the runtime is closing,
        and only a start after that reopens; an `aclose` that begins while it starts waits
        for it to end, then closes what it started.
        """
        if self._started or self._closing:
            return
        starting = self._starting = asyncio.Event()
        try:
            await self._start()
        except BaseException:
            # Not started: the next request or probe tries again (each part starts once; an
            # MCP server down at the first request's start was never asked again, and the
            # runtime said ready without its tools or its approvals' timer).
            self._started = False
            raise
        finally:
            self._starting = None
            starting.set()

    async def _start(self) -> None:
        if self._closed:
            self._reopen()
        if not self.coordinator.shared and isinstance(self.store, SQLiteThreadStore) \
                and self._alone is None:
            # Before anything else: this process's start closes, as interrupted, the runs
            # its store holds open (another process's, streaming, included).
            try:
                self._alone = self.store.serve_alone()
            except ConfigurationError as exc:
                raise ConfigurationError(
                    f"{exc.message}: give this runtime a file of its own, or a shared "
                    "coordinator over a PostgreSQL store (README: Many workers, several "
                    "machines)") from None
        self._started = True
        if self.auth is not None and not _takes(self.store.rename, "owner"):
            # (its renames are checked just before: a thread its owner deleted in between,
            # begun again under its id by another principal, is theirs to be renamed)
            _log.warning("thread store renames without the owner's condition",
                         store=type(self.store).__name__,
                         fix="give its rename(thread_id, name) an owner= keyword (README)")
        archive = getattr(self.store, "archive", None)
        if archive is not None and not _takes(self.store.list, "include_archived"):
            # (a store of one's own, or a wrapper whose `archive` shows through: it ran before
            # archives existed, and runs on, its lists showing archived threads too)
            _log.warning("thread store archives threads but its lists cannot leave them out",
                         store=type(self.store).__name__,
                         fix="give its list() an include_archived keyword (README)")
        if self.auth is not None and archive is not None and not _takes(archive, "owner"):
            _log.warning("thread store archives without the owner's condition",  # (as rename)
                         store=type(self.store).__name__,
                         fix="give its archive(thread_id, archived) an owner= keyword (README)")
        if self.coordinator.shared:
            opening = getattr(self.store, "open", None)
            if opening is not None:
                try:
                    await opening()  # (the local path opens it through `recover`)
                except ConfigurationError:
                    raise  # migrated by a newer release: say so now, not in each request
                except Exception:
                    _log.exception("could not open the thread store: requests will try again")
            await self.coordinator.start()
            if self._sweep is not None:
                self._sweep.start()  # other workers' runs are not ours to close at start
        else:
            try:
                # Runs a crash of this process left open in a durable store end as interrupted.
                await self.runs.recover()
            except ConfigurationError:
                raise  # a store this release cannot use (migrated by a newer one): say so now
            except Exception:
                _log.exception("could not close the runs a previous process left open")
        if self.mcp is not None:
            await self._start_mcp()
        await self.approvals.start()
        stale = getattr(self.store, "stale_threads", None)
        if self.thread_retention_seconds is not None and stale is not None \
                and self._retention is None:
            self._retention = RetentionSweep(stale, self._delete_stale,
                                             self.thread_retention_seconds,
                                             self.retention_sweep_every,
                                             store_clock(self.store))
            self._retention.start()

    def _reopen(self) -> None:
        """After `aclose` (an app's lifespan run again: a test client used twice), open
        again what it closed, so that this start is as the first (the agents', the MCP
        sessions' and the limits' connections open again as they are needed; the runs no
        longer shutting down; what the application gave them was never closed). A part
        that cannot open again refuses the start (`ConfigurationError`), before anything
        opens: started, every request failed on the closed store."""
        reopen = getattr(self.store, "reopen", None)
        if self.coordinator.shared or reopen is None:
            cannot = "its shared coordinator" if self.coordinator.shared else \
                f"its thread store ({type(self.store).__name__} has no reopen())"
            raise ConfigurationError(
                f"this CopilotRuntime was closed (aclose) and cannot start again: {cannot} "
                "cannot be opened again; make a new CopilotRuntime for each start of the "
                "app (in its factory, or a test's fixture)")
        reopen()
        self.runs.reopen()
        if self.limiter is not None:
            self.limiter.reopen()
        self._readiness = None  # (a probe's from before: of the closed store)
        self._closed = False

    async def _start_mcp(self) -> None:
        """Connect to the MCP servers and offer their tools as server-side actions; offer
        the new list whenever a server's tools change."""
        await self.mcp.start()
        self._offer_mcp(self.mcp.actions)
        if self._offer_mcp not in self.mcp.on_change:  # (started again after aclose)
            self.mcp.on_change.append(self._offer_mcp)

    def _offer_mcp(self, tools: list[Action]) -> None:
        """Replace the MCP tools offered so far by `tools` (an action of the application
        keeps its name; a tool of the same name is left out). Agents get new dicts, not
        edited ones: a run reading its agent's actions never sees them half-replaced."""
        previous = {id(a) for a in self._mcp_offered}
        own = [a for a in self.actions if id(a) not in previous]
        taken = {a.name for a in own}
        offered = [a for a in tools if a.name not in taken]
        self.actions[:] = [*own, *offered]
        for agent in self.agents.values():
            if isinstance(agent, BuiltInAgent):
                actions = {name: a for name, a in agent.actions.items()
                           if id(a) not in previous}
                for tool in offered:
                    actions.setdefault(tool.name, tool)
                agent.actions = actions
        self._mcp_offered = offered
        _log.info("MCP tools offered", tools=[a.name for a in offered])

    def is_running(self, thread_id: str) -> bool:
        """Whether a run is on the thread now, in this process."""
        return thread_id in self.runs.active

    async def is_running_anywhere(self, thread_id: str) -> bool:
        """Whether a run is on the thread now, on any worker (a delete holding it is not)."""
        return await self.runs.running_anywhere(thread_id)

    async def forget_thread(self, thread_id: str, *, strict: bool = False) -> None:
        """Have every agent forget what it keeps of a deleted thread (a graph's checkpoints):
        the thread id is free again, and may become another principal's. With `strict`, an
        agent that could not forget raises `ServiceUnavailableError` once all were tried
        (the thread must then not be deleted: its id would hand the rest to a new owner)."""
        self.runs.forget_owner(thread_id)
        failed = False
        for agent_id, agent in self.agents.items():
            try:
                await agent.forget_thread(thread_id)
            except Exception:
                failed = True
                _log.exception("an agent could not forget a thread", agent=agent_id,
                               thread_id=thread_id)
        if failed and strict:
            raise ServiceUnavailableError(
                "What an agent keeps of the thread could not be deleted; try again")

    async def delete_thread(self, thread_id: str, *, updated_before: float | None = None,
                            owner: ThreadOwner | None = None) -> bool:
        """Delete a thread, as `DELETE /threads/{id}` does: no run may begin on it meanwhile,
        on any worker; what the agents keep of it goes first (a failure there is a
        `ServiceUnavailableError`, the thread kept), then its records. False: no such
        thread. `ThreadBusyError` while a run is on it. With `updated_before` (epoch
        seconds; a retention sweep's), a thread updated since is kept, its agents' memory
        too (False): the sweep listed it before someone used it again. With `owner`, only a
        thread of that owner (the caller's, checked before): under the hold, the id may name
        a thread another user began since (False)."""
        async with self.runs.held_for_delete(thread_id) as hold:
            # Read under the delete's hold: no run can begin and update it now. After
            # another delete of the id went first, a thread updated since began (or ran)
            # after it: not the one this delete was asked for, whoever's it is.
            record = await self.store.summary(thread_id)
            if record is None or (owner is not None and record.owner != owner):
                if updated_before is not None or hold.waited_since is not None \
                        or owner is not None:
                    return False
            elif (hold.waited_since is not None and record.updated_at >= hold.waited_since) \
                    or (updated_before is not None and record.updated_at >= updated_before):
                return False
            # A store that cannot write now (a SQLite file another connection holds) fails
            # the delete before anything is forgotten: after, the thread would be kept
            # without what its agents knew of it. (The records must go last: gone first,
            # an agent that then failed to forget would hand the thread to its id's next
            # owner.)
            check_writable = getattr(self.store, "check_writable", None)
            if check_writable is not None:
                await check_writable()
            hold.check()  # a hold lost meanwhile: another worker may run on the thread
            await self.forget_thread(thread_id, strict=True)
            if record is None:
                # Nothing stored to delete: a thread stored since came after the hold.
                return False
            # Only the thread as it was read under the hold: if the hold lapsed (this
            # process stalled, its statement held up) a run another worker began since
            # wrote to it, and stays. (A store of an application's own without the
            # conditions: the read above, under the hold, is what keeps it.)
            conditions: dict[str, Any] = {key: value for key, value in (
                ("next_position", record.next_position), ("updated_before", updated_before))
                if value is not None and _takes(self.store.delete, key)}
            try:
                deleted = bool(await self.store.delete(thread_id, **conditions))
            except TypeError as exc:
                if not _refused(exc, conditions):
                    raise
                # A wrapper passing keywords on to a store of one's own without them: what
                # the conditions say, checked here (under the hold) before it is asked again
                # without them; gone already, the call deleted it and failed after.
                now = await self.store.summary(thread_id)
                if now is None:
                    return True
                if now.next_position != record.next_position:
                    raise ThreadBusyError(thread_id) from None
                if updated_before is not None and now.updated_at >= updated_before:
                    return False
                deleted = bool(await self.store.delete(thread_id))
            if not deleted:
                hold.check()  # kept because the hold lapsed: busy, not "no such thread"
                now = await self.store.summary(thread_id) if conditions else None
                if now is not None and now.next_position != record.next_position:
                    # Written since it was read (a stalled worker's late write): still
                    # there, so busy (try again), not "no such thread".
                    raise ThreadBusyError(thread_id)
            return deleted

    async def rename_thread(self, thread_id: str, name: str | None, *,
                            owner: ThreadOwner | None = None) -> bool:
        """Name a thread (None: no name), as `PATCH /threads/{id}` does. False: no such
        thread. With `owner`, only a thread of that owner (the caller's, checked before:
        the id may name a thread another user began since), checked by the store as it
        renames."""
        return await self._changed(self.store.rename, thread_id, name, owner=owner)

    async def archive_thread(self, thread_id: str, archived: bool = True, *,
                             owner: ThreadOwner | None = None) -> bool:
        """Archive a thread (`archived` False: bring it back), as `POST
        /threads/{id}/archive` and `PATCH /threads/{id}` do. False: no such thread. With
        `owner`, as `rename_thread`. `UnsupportedOperationError` for a store of an
        application's own that has no `archive`."""
        archive = getattr(self.store, "archive", None)
        if archive is None:
            raise UnsupportedOperationError("This runtime's thread store cannot archive threads")
        return await self._changed(archive, thread_id, archived, owner=owner)

    async def _changed(self, change: Callable[..., Awaitable[Any]], thread_id: str,
                       *args: Any, owner: ThreadOwner | None) -> bool:
        """`_as_owner`; a thread the store has no record of yet, whose first run this worker
        drives, exists from that run's start: the run writes, then it is changed. Told by
        the run, not by a change that found nothing (the run may end and be stored between
        the two: a rename of a stored thread was refused); asked of it only while it has
        written nothing (the route had it write before reading the thread)."""
        if self.runs.unwritten(thread_id, owner):
            await self.runs.write_first_batches(thread_id, owner=owner)
        return await self._as_owner(change, thread_id, *args, owner=owner)

    async def _as_owner(self, change: Callable[..., Awaitable[Any]], thread_id: str,
                        *args: Any, owner: ThreadOwner | None) -> bool:
        """`change(thread_id, *args)` (a store's rename or archive); with `owner`, only of
        that owner's thread: checked by the store as it changes it, or, a store of an
        application's own without the condition, just before (which leaves the short window
        the condition closes)."""
        if owner is None:
            return bool(await change(thread_id, *args))
        done = await _given(change, thread_id, *args, optional={"owner": owner})
        if done is not _NOT_GIVEN:
            return bool(done)
        record = await self.store.summary(thread_id)
        if record is None or record.owner != owner:
            return False
        return bool(await change(thread_id, *args))

    async def list_threads(self, agent_id: str | None, limit: int, *,
                           owner: ThreadOwner | None, offset: int = 0,
                           after: ListPosition | None = None,
                           include_archived: bool = True) -> list[ThreadRecord]:
        """A page of threads, as `GET /threads` lists them (`ThreadStore.list`); a store of
        an application's own without `archive`, or whose `list` takes no `include_archived`,
        lists all. The threads whose first run this worker drives are listed from that
        run's start (their runs write what they streamed first)."""
        await self.runs.write_first_batches(owner=owner, agent_id=agent_id)
        if include_archived or getattr(self.store, "archive", None) is None:
            return await self.store.list(agent_id, limit, owner=owner, offset=offset,
                                         after=after)
        listed = await _given(self.store.list, agent_id, limit, owner=owner, offset=offset,
                              after=after, optional={"include_archived": False})
        if listed is _NOT_GIVEN:  # (its list cannot leave archived threads out: warned at start)
            listed = await self.store.list(agent_id, limit, owner=owner, offset=offset,
                                           after=after)
        return list(listed)

    async def _delete_stale(self, thread_id: str, updated_before: float) -> bool:
        return await self.delete_thread(thread_id, updated_before=updated_before)

    def agent(self, agent_id: str) -> Agent:
        try:
            return self.agents[agent_id]
        except KeyError:
            raise AgentNotFoundError(agent_id, sorted(self.agents)) from None

    def info(self) -> dict[str, Any]:
        """What `/info` says about the agents."""
        agents: dict[str, Any] = {}
        for agent_id, agent in self.agents.items():
            entry: dict[str, Any] = {"name": agent_id, "description": agent.description,
                                     "className": agent.class_name}
            capabilities = agent.capabilities()
            if capabilities:
                entry["capabilities"] = capabilities
            agents[agent_id] = entry
        return {"version": COMPATIBLE_VERSION, "agents": agents}

    # -- who is asking ------------------------------------------------------------------

    async def identify(self, request: RequestInfo) -> None:
        """Authenticate `request` (setting its principal) and run `on_request`: raises
        `AuthenticationError` (401) or the hook's `RequestError`."""
        if self.auth is not None:
            auth = self.auth
            principal = await policy_answer("the authenticator",
                                            lambda: auth.authenticate(request),
                                            request.request_id)
            if not isinstance(principal, Principal):
                # Fail closed: without a principal nothing would be checked for its owner.
                _log.error("the authenticator returned no Principal: the request is refused "
                           "(raise AuthenticationError for a caller it does not know)",
                           returned=type(principal).__name__)
                raise AuthenticationError()
            request.principal = principal
        await self.hooks.request(request)

    def owner_filter(self, request: RequestInfo | None) -> ThreadOwner | None:
        """The owner whose threads `request` may list (None: all of them)."""
        if request is None or request.principal is None:
            return None
        return owner_of(request.principal)

    async def can_see(self, request: RequestInfo | None, thread_id: str) -> bool:
        """Whether the thread exists for `request`'s caller (always, without auth)."""
        owner = self.owner_filter(request)
        return owner is None or await _trust.thread_owner(self.runs, thread_id) == owner

    async def can_approve(self, request: RequestInfo | None, thread_id: str) -> bool:
        """Whether `request`'s caller may see and answer the thread's approvals: its owner,
        or a principal of the same tenant with one of `approver_roles`."""
        if request is None or request.principal is None:
            return True
        return _trust.may_approve(request.principal, self.approver_roles,
                                  await _trust.thread_owner(self.runs, thread_id))

    # -- runs ----------------------------------------------------------------------------

    async def start_run(self, agent_id: str, input: RunInput,
                        headers: Mapping[str, str] | None = None, *,
                        follow_up_server_tools: bool = True,
                        agent: Agent | None = None,
                        request: RequestInfo | None = None,
                        topics: tuple[Sequence[str], Sequence[str]] | None = None,
                        answering: RequestInfo | None = None,
                        unstored: bool = False) -> ActiveRun:
        """Reserve the thread and prepare a run; drive it with `ActiveRun.drive`. A run
        that may not be driven (something can fail or be cancelled first) is given back with
        `ActiveRun.abandon`, or by `async with run:` around what leads to `drive`.

        `agent` runs in place of the registered one (a protocol edge may wrap it, e.g. to
        offer it tools); the run still belongs to `agent_id`. `request` says who asks (its
        principal must own the thread; its limits apply); `topics` (allowed, denied) are
        the request's own rules for the `TopicGuardrail`. `answering` is the request of a
        person whose approval answer starts the run (`ApprovalService`, which checked their
        access): its principal and annotations are the run's, the thread stays its owner's,
        and its limits do not apply (answers are not run starts). An `unstored` run (a chat
        suggestion's) is checked, limited and observed as any run, but kept out of its
        thread: not stored, and not holding the thread (`RunManager.begin_unstored`).
        """
        registered = self.agent(agent_id)
        context = RunContext(agent_id=agent_id, headers=dict(headers or {}),
                             follow_up_server_tools=follow_up_server_tools)
        if request is None and answering is None and not self.guardrails and \
                topics is None and not self.observed:
            begin = self.runs.begin_unstored if unstored else self.runs.begin
            return await begin(agent_id, agent or registered, input, context)
        return await _trust.start_run(self, agent_id, agent or registered, input, context,
                                      request, topics, registered, answering, unstored)

    def stop_run(self, agent_id: str, thread_id: str, run_id: str | None = None, *,
                 request: RequestInfo | None = None) -> bool:
        self.agent(agent_id)
        owner = self.owner_filter(request)
        if owner is not None:
            running = self.runs.active.get(thread_id)
            if running is None or running.owner != owner:
                return False
        return self.runs.stop(thread_id, run_id)

    async def stop(self, agent_id: str, thread_id: str, run_id: str | None = None, *,
                   request: RequestInfo | None = None) -> bool:
        """`stop_run` on whichever worker drives the thread's run."""
        if self.stop_run(agent_id, thread_id, run_id, request=request):
            return True
        return await self.runs.stop_anywhere(thread_id, run_id)

    def connect(self, agent_id: str, thread_id: str, *, request: RequestInfo | None = None,
                after: int = -1) -> AsyncIterator[Sequence[Positioned]]:
        """The thread's events after position `after` (all for -1), then its live run's, each
        with its position; for a caller who may not see the thread, nothing (what a thread
        that does not exist gives)."""
        self.agent(agent_id)
        owner = self.owner_filter(request)
        if owner is None:
            return self.runs.replay(thread_id, after)
        return _trust.replay_visible(self.runs, owner, thread_id, after)

    async def unready(self) -> list[str]:
        """What keeps this runtime from serving now, for a load balancer's readiness probe:
        `"closing"` once it closes, `"thread_store"`, `"coordinator"` and `"checkpointer"`
        when a store, a shared coordinator or an agent's checkpointer with a `ping()` does
        not answer one within `ready_timeout` seconds. Empty: ready. Probes that come while
        one is checked share its answer (a probe per second from each balancer never queues
        round trips to a server that hangs)."""
        if self._closed or self._closing:
            return ["closing"]
        checking = self._readiness
        if checking is None or checking.done():
            checking = self._readiness = asyncio.ensure_future(self._check_ready())
        return list(await asyncio.shield(checking))

    async def _check_ready(self) -> list[str]:
        timeout = self.ready_timeout
        parts: list[tuple[str, Any]] = [("thread_store", getattr(self.store, "ping", None))]
        if self.coordinator.shared:
            parts.append(("coordinator", getattr(self.coordinator, "ping", None)))
        # Agents' checkpointers (LangGraph's), each once however many agents share it.
        savers = {id(saver): ping for agent in self.agents.values()
                  if (saver := getattr(agent, "checkpointer", None)) is not None
                  and (ping := getattr(saver, "ping", None)) is not None}
        if savers:

            async def checkpointers() -> None:
                await asyncio.gather(*(ping() for ping in savers.values()))

            parts.append(("checkpointer", checkpointers))
        probed = [(name, ping) for name, ping in parts if ping is not None]

        async def answers(ping: Callable[[], Awaitable[None]]) -> bool:
            try:
                # Cancelled again until it ends: psycopg answers a first cancellation by
                # asking a server that hangs to cancel the query (up to its call's bound).
                async with within(timeout):
                    await ping()
            except Exception:  # (TimeoutError included) its log says why, if anything
                return False
            return True

        answered = await asyncio.gather(*(answers(ping) for _, ping in probed))
        return [name for (name, _), ok in zip(probed, answered, strict=True) if not ok]

    async def aclose(self) -> None:
        """Stop the approvals' timer, then active runs; release agents, adapters and the store.

        The approval service stops first: its timer and its runs use the checkpointers the
        agents close. A start under way is waited for first. Closing twice is harmless;
        `start` may open it again, once closed.
        """
        self._started = False
        self._closing += 1
        try:
            if self._starting is not None:
                # A start under way (a first request's, still recovering) ends first: what
                # it starts from here on this close then closes.
                await self._starting.wait()
            await self._close()
        finally:
            self._closing -= 1

    async def _close(self) -> None:
        await self.approvals.aclose()
        if self._retention is not None:
            await self._retention.aclose()
            self._retention = None
        if self._closed:
            return
        self._closed = True
        tasks = self.runs.stop_all()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        await self.hooks.drain()
        if self.transcription is not None:
            await self.transcription.aclose()
        if self.mcp is not None:
            try:
                await self.mcp.aclose()
            except Exception:
                _log.exception("could not close the MCP sessions")
        closed: set[int] = set()
        for agent in self.agents.values():
            if id(agent) not in closed:
                closed.add(id(agent))
                await agent.aclose()
        if self._sweep is not None:
            await self._sweep.aclose()
        await self.runs.drain(5.0)  # runs' writes and releases waiting for their servers
        if self.limiter is not None:
            # Only once every run has ended: a run ending during the drain gives its
            # caller's slot back through the limiter (closed first, a shared backend kept
            # that slot taken for an hour after each restart).
            await _trust.drain_releases(5.0)
            await self.limiter.aclose()
        await self.coordinator.aclose()
        await self.store.aclose()
        if self._alone is not None:
            self._alone()
            self._alone = None


def _takes(method: Callable[..., Any], keyword: str) -> bool:
    """Whether a store's method takes `keyword` (the built-in stores' take each the runtime
    passes; a store an application wrote before they did may not: `delete`'s
    `updated_before`, and the sweep failed on it every time; `rename`'s `owner`)."""
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return keyword in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


#: What `_given` returns for a method that takes none of the keywords.
_NOT_GIVEN: Any = object()


async def _given(method: Callable[..., Awaitable[Any]], *args: Any,
                 optional: dict[str, Any], **kwargs: Any) -> Any:
    """`method(*args, **kwargs)` with the `optional` keywords of this session's stores (the
    built-in stores take each; a store of an application's own written before may take
    none), when its signature takes them (a wrapper taking `**kwargs` too). `_NOT_GIVEN`:
    it takes none, or the store under such a wrapper refused one: the caller then does
    without them, its own way (an owner checked just before; every thread listed)."""
    given = {k: v for k, v in optional.items() if _takes(method, k)}
    if not given:
        return _NOT_GIVEN
    try:
        return await method(*args, **kwargs, **given)
    except TypeError as exc:
        if not _refused(exc, given):
            raise
        return _NOT_GIVEN


def _refused(exc: TypeError, given: Mapping[str, Any]) -> list[str]:
    """The keywords of `given` a call's TypeError says were not taken ("unexpected keyword
    argument 'owner'")."""
    said = str(exc)
    return [k for k in given if f"keyword argument '{k}'" in said] if "unexpected" in said \
        else []


def approval_service(runtime: CopilotRuntime) -> ApprovalService:
    """The runtime's approval service (the same as `runtime.approvals`)."""
    return runtime.approvals
