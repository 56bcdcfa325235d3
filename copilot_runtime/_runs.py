"""Runs in flight: one per thread, with their envelope, their listeners and their end.

A run is driven by the request that started it, in that request's task: the agent's batches
go straight to the writer with no queue or extra task in between. `stop` and a client
disconnect (at once on GraphQL; on AG-UI once the run outlived its client by
`detached_run_seconds`, see `ActiveRun.detach`) cancel that task; `ActiveRun.drive` catches
the cancellation, closes the agent (which cancels its upstream request), closes what was
left open and ends the run the way the TypeScript runtime does (a plain `RUN_FINISHED`
after a stop). Every run, however it ended, is compacted into the thread store, so
`connect` can replay it.

A run is reserved (`RunManager.begin`) before it is driven; whoever reserved it and does not
drive it (a failure or a cancellation in between) gives it back with `ActiveRun.abandon`, or
by driving it inside `async with run:`, so its thread never stays busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from functools import partial
from typing import Any

import structlog

from copilot_runtime import events as ev
from copilot_runtime._again import worth_logging
from copilot_runtime._compaction import compact_events
from copilot_runtime._deadline import within
from copilot_runtime._exceptions import (
    ClientDisconnected,
    ContentFilteredError,
    CopilotRuntimeError,
    InvalidRequestError,
    PayloadTooLargeError,
    RequestError,
    ServiceUnavailableError,
    ThreadBusyError,
    ThreadNotFoundError,
    UpstreamError,
    cancelled_itself,
)
from copilot_runtime._input import RunInput
from copilot_runtime._limits import (
    DEFAULT_MAX_RUN_BYTES,
    HELD_BOUND,
    LARGE_JSON,
    LIVE_RUN_FACTOR,
    estimated_size,
    replayable,
    storable,
)
from copilot_runtime._shared_runs import follow, not_again, replay_stored, unreached
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.coordination import LEASE_LOST_CODE, Coordinator, Lease, Signal
from copilot_runtime.event_order import RunEventOrder
from copilot_runtime.events import Event, EventBatches, LastBatch
from copilot_runtime.threads.base import (
    INTERRUPTED_CODE,
    JUDGED_MARK_PREFIX,
    SUGGESTION_THREAD_PREFIX,
    DurableThreadStore,
    Positioned,
    StoredRun,
    ThreadOwner,
    ThreadRecord,
    ThreadStore,
    storable_ids,
)
from copilot_runtime.threads.memory import InMemoryThreadStore

__all__ = ["DETACHED_RUN_SECONDS", "ActiveRun", "DeleteHold", "RunManager"]

_log = structlog.get_logger("copilot_runtime.runs")

Writer = Callable[[Sequence[Event]], Awaitable[None]]
#: A run's events as listeners get them: the position of the first, and the events.
Published = tuple[int, Sequence[Event]]
#: Seconds between writes of a running run's events to a durable store.
FLUSH_INTERVAL = 0.2
#: Seconds a list, rename or archive waits for a new thread's ending run to be stored (its
#: write of the running events is waited for whole: one attempt, which fails at once when
#: the store cannot write); a store that keeps failing holds the answer no longer, which
#: then comes without the thread.
FIRST_WRITE_WAIT = 0.5
#: Seconds a run's end (its client) waits for its write while its durable store is away
#: or does not answer; the write goes on in the background until the store is back.
STORE_RETRY_FOR = 10.0
#: What `STORE_RETRY_FOR` is once shutdown began: the clients are told within the server's
#: grace period (5 s), and the write is given up on at the end of the drain (the next start
#: closes the run as interrupted).
SHUTDOWN_STORE_WAIT = 1.0
#: Seconds a suggestion's end (its client) waits for its agent to forget its throwaway
#: thread; the forget goes on in the background, bounded as a store's write is.
FORGET_WAIT = 1.5
#: Seconds a run's end waits for its lease to be given back (then left to the background).
GIVE_BACK_WAIT = 0.5
#: Seconds the next run on a thread waits for this worker to store a stopped run or give its
#: last run's lease back (then it asks the coordinator as any run does: busy while held).
NEXT_RUN_WAITS_FOR_GIVE_BACK = 5.0
#: Seconds between a waiting next run's asks for the lease of a run being stopped on another
#: worker (then twice as long each time, up to `_GIVE_BACK_ASKED_MOST`).
_GIVE_BACK_ASKED_EVERY = 0.02
_GIVE_BACK_ASKED_MOST = 0.25
#: Seconds a second run on a thread whose run is driven here waits for the coordinator to
#: say whether that run is being stopped elsewhere (then it is busy, as before), and a stop
#: for its mark once its signal went out: neither a 409 nor a stop waits on a coordinator
#: that does not answer.
_GLANCE = 0.5
#: Seconds before a `stop` signal is sent again while the stopped run holds its thread
#: (then twice as long each time, up to 2 s).
_STOP_AGAIN = 0.5
_SHUTDOWN_MESSAGE = "The run was interrupted: the server driving it shut down"
#: Seconds a run goes on by default once its client left (`ActiveRun.detach`).
DETACHED_RUN_SECONDS = 60.0
_CUT_MESSAGE = "The run was interrupted: it stopped before its end"
#: The code of the `RUN_ERROR` that ends a run cut at its `max_run_seconds`.
RUN_TIMEOUT_CODE = ev.runtime_code("RUN_TIMEOUT")
_LEASE_LOST_MESSAGE = ("The run was stopped: this server could not keep its hold on the "
                       "thread, which another server may now take")
_INPUT_KEYS = ("threadId", "runId", "parentRunId", "state", "messages", "tools", "context",
               "forwardedProps", "resume")
#: `forwardedProps` entries the agent gets but the thread never keeps: a user's token (the
#: 1.x `properties.authorization`) stored in RUN_STARTED was served to every later reader.
_UNKEPT_PROPS = frozenset({"authorization"})


#: The task of a request whose run is being begun, and what returns once its client left
#: (`client_watched`).
_client_leaves: contextvars.ContextVar[
    tuple[asyncio.Task[Any] | None, Callable[[], Awaitable[None]]] | None] = \
    contextvars.ContextVar("client_leaves", default=None)


@contextlib.contextmanager
def client_watched(leaves: Callable[[], Awaitable[None]]) -> Iterator[None]:
    """Around a protocol edge's `start_run`: awaited, `leaves()` returns once the request's
    client has left. Watched only while the run waits for a stopped one to give its thread
    back: a client gone meanwhile gets no run (`ClientDisconnected`), which would start for
    nobody and make its retry busy. Only in this task: the tasks it starts meanwhile copy
    the context, and are not the request's."""
    token = _client_leaves.set((asyncio.current_task(), leaves))
    try:
        yield
    finally:
        _client_leaves.reset(token)


class _Leaving:
    """The client of a run being begun, watched for leaving from the run's first wait on
    (`client_watched`) until `close`."""

    __slots__ = ("_watch",)

    def __init__(self) -> None:
        self._watch: asyncio.Future[None] | None = None

    async def wait(self, waited: asyncio.Future[Any] | None, seconds: float) -> None:
        """Wait for `waited` (None: for nothing) at most `seconds`; `ClientDisconnected`
        once the client left, before or meanwhile."""
        self.check()
        watch = self._watch
        said = _client_leaves.get()
        if watch is None and said is not None and said[0] is asyncio.current_task():
            watch = self._watch = asyncio.ensure_future(said[1]())
        if waited is None or not waited.done():
            either = [f for f in (waited, watch) if f is not None and not f.done()]
            if either:
                await asyncio.wait(either, timeout=seconds,
                                   return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(seconds)
        self.check()

    def check(self) -> None:
        """`ClientDisconnected` if the client left (as far as it was watched)."""
        watch = self._watch
        if watch is not None and watch.done() and not watch.cancelled() and \
                watch.exception() is None:
            raise ClientDisconnected

    def close(self) -> None:
        watch = self._watch
        if watch is not None:
            if watch.done() and not watch.cancelled():
                watch.exception()  # (a server's failed receive: not logged as unretrieved)
            watch.cancel()


class _RunTooLarge(CopilotRuntimeError):
    """A run's events passed what a running run may keep (`RunManager.max_live_bytes`)."""

    code = PayloadTooLargeError.code
    logged = True  # (by `ActiveRun._keep`, with the bound)

    def __init__(self, limit: int) -> None:
        super().__init__(f"The run was stopped: its events passed {limit} bytes, the most a "
                         f"running run keeps ({LIVE_RUN_FACTOR} times max_run_bytes)")


class Follower:
    """Where a listener of a live run is in the run's events. It reads them from the run
    itself when woken: a listener that does not keep up (its client reads slowly, or not at
    all) costs the same few bytes however far behind it falls, and gets all it missed in one
    batch; before, each kept its own queue of every batch published since."""

    __slots__ = ("_more", "ended", "position", "run")

    def __init__(self, run: ActiveRun) -> None:
        self.run = run
        #: How many of the run's events were handed out.
        self.position = len(run.events)
        self.ended = False
        self._more = asyncio.Event()

    def wake(self) -> None:
        self._more.set()

    def put_nowait(self, _: None) -> None:
        """The run ended: once what is left is read, `get` says so (None)."""
        self.ended = True
        self._more.set()

    async def get(self) -> Published | None:
        """The events published since the last call (waiting for some), or None at the end."""
        while True:
            events = self.run.events
            if self.position < len(events):
                first = self.position
                self.position = len(events)
                self._more.clear()
                return self.run.first_position + first, events[first:]
            if self.ended:
                return None
            self._more.clear()
            await self._more.wait()


class ActiveRun:
    def __init__(self, manager: RunManager, agent_id: str, agent: Agent, input: RunInput,
                 context: RunContext, seen_message_ids: set[str]) -> None:
        self.manager = manager
        self.agent_id = agent_id
        self.agent = agent
        self.input = input
        self.context = context
        self.thread_id = input.thread_id
        self.run_id = input.run_id
        self.events: list[Event] = []
        #: About how many bytes the agent's events take (`estimated_size`), bounded.
        self._kept_bytes = 0
        #: The estimated size of the run's start (its input), once weighed (`large`).
        self._start_bytes: int | None = None
        self.listeners: list[Follower] = []
        #: The position in the thread of the run's first event (its RUN_STARTED).
        self.first_position = 0
        self._flushed = 0
        #: Whether the store had no record of the thread when the run began (`begin`): until
        #: the run writes, the store has no thread, which exists from the run's start.
        self.new_thread = False
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Task[None] | None = None
        self.task: asyncio.Task[Any] | None = None
        #: True once a GeneratorExit goes through `drive`: its task may not suspend again.
        self._closing = False
        self.cancel_reason: str | None = None
        #: The run's events kept in the order clients accept, whatever the agent yields.
        self.order = RunEventOrder(self.thread_id, self.run_id)
        self._seen = seen_message_ids
        self._finished = False
        self.created_at = time.time()
        #: The thread's owner (None: started without authentication).
        self.owner: ThreadOwner | None = None
        #: False while `begin` has not yet checked the thread's stored owner: until then
        #: `owner` is only who asks, and must not be taken as the thread's owner.
        self.confirmed = False
        #: Called once when the run has ended and been stored (hooks, telemetry).
        self.on_end: Callable[[ActiveRun], None] | None = None
        #: Called once as the run gives its thread back: starts giving back what it holds of
        #: its caller's limits (a concurrency slot), the future the run's end waits for.
        self.give_slot_back: Callable[[], asyncio.Future[None] | None] | None = None
        #: Why a guardrail refused the run's input (its agent was not called), or None.
        self.refusal: str | None = None
        #: Ids kept with the thread's message ids when the run is stored (what its
        #: guardrails let through).
        self.extra_ids: set[str] = set()
        #: The marks of what the run's agent wrote, kept with the thread's message ids
        #: (what its guardrails need not judge when a client sends it back), if wanted.
        self.output_marks: Callable[[list[Event]], set[str]] | None = None
        #: The ids its protocol gave the run's messages on the wire where they are not the
        #: thread's (GraphQL's `result-<call id>`), kept with the thread's message ids: a
        #: client sends them back as history, and such a message is not new.
        self.wire_ids: Callable[[list[Event]], set[str]] | None = None
        self.compacted: list[Event] = []
        #: The agent's `LastBatch`, normalized but not yet published (see `_stream`).
        self._held: list[Event] = []
        self._started_event: Event | None = None
        #: The thread's lease across workers (shared coordinators only).
        self.lease: Lease | None = None
        #: Awaited once if the run is given back without being driven (`abandon`).
        self.on_abandon: Callable[[ActiveRun], Awaitable[None]] | None = None
        #: Called if the run is cancelled before it is driven (what is deciding whether it
        #: may run, its guardrails say, need not finish).
        self.on_cancel: Callable[[], object] | None = None
        self._driven = False
        #: Whether its client left while it goes on (see `detach`).
        self.detached = False
        self._detached_bound: asyncio.TimerHandle | None = None
        #: Set once the thread is given back here (made when a next run waits for it).
        self._released: asyncio.Future[None] | None = None
        #: A run kept out of its thread (`RunManager.begin_unstored`): not stored, and not
        #: holding the thread.
        self.unstored = False
        #: What the agent runs on: `input`, but for a suggestion's run, whose agent runs on
        #: a throwaway thread (see `begin_unstored`).
        self.agent_input = input
        #: The agent that forgets the throwaway thread of a suggestion's run at its end.
        self.forgetter: Agent | None = None
        self._agent_asked = False

    @property
    def terminated(self) -> bool:
        """Whether the run's terminal event has been produced."""
        return self.order.terminated

    # -- control -----------------------------------------------------------------------

    def cancel(self, reason: str) -> bool:
        """Stop the run from outside (`"stop"`), because its client left (`"disconnect"`) or
        because this process could not keep the thread's lease (`"lost"`: it ends with a
        `RUN_ERROR` coded `LEASE_LOST`, as another worker may take the thread), or because it
        ran past the runtime's `max_run_seconds` (`"timeout"`: a `RUN_ERROR` coded
        `RUN_TIMEOUT`; never once its end was produced, which is being stored).

        A run reserved but not driven yet is stopped as soon as `drive` begins: its stream
        still starts and ends as a stop's does, and its agent is never asked."""
        if self._finished or self.cancel_reason or (
                self.task is not None and self.task.done()) or (
                reason == "timeout" and self.order.terminated):
            return False
        self.cancel_reason = reason
        self.context.cut_reason = reason
        if reason == "lost":
            # Not given back: given up already, and its server may not answer (the run's
            # end would wait for it).
            self.lease = None
        elif reason in ("stop", "disconnect") and self.lease is not None:
            # Marked, in the background (a stop's answer is not held by it): the thread's
            # next run on another worker waits for this one's end, not refused as busy. A
            # 1.10 client's stop is its leaving. (A stop asked on another worker marked it
            # already: marked again here, harmless.)
            self.manager._adopt(self.manager._mark_stopping_everywhere(
                self.thread_id, self.run_id))
        if self.task is not None:
            self.task.cancel()
        elif self.on_cancel is not None:
            self.on_cancel()
        return True

    def released(self) -> asyncio.Future[None]:
        """Done once this process no longer holds the thread for the run."""
        if self._released is None:
            self._released = asyncio.get_running_loop().create_future()
            if self.manager.active.get(self.thread_id) is not self:
                self._released.set_result(None)
        return self._released

    def detach(self) -> None:
        """Its client left before its end: the run goes on without it (its events published
        and stored as always, so a `connect` follows it to its end), for at most the
        manager's `detached_run_seconds` (None: to its end), then it is stopped as a
        disconnect stops it. A bound of 0 stops it at once (`cancel("disconnect")`)."""
        bound = self.manager.detached_run_seconds
        if bound == 0:
            self.cancel("disconnect")
            return
        if self.detached or self._finished or self.cancel_reason is not None:
            return
        self.detached = True
        _log.info("run goes on without its client", thread_id=self.thread_id,
                  run_id=self.run_id, for_seconds=bound)
        if bound is not None:
            self._detached_bound = asyncio.get_running_loop().call_later(
                bound, self.cancel, "disconnect")

    def subscribe(self) -> tuple[list[Event], Follower]:
        """The events so far and a follower of the ones to come (None at the end)."""
        follower = Follower(self)
        if self._finished:
            follower.put_nowait(None)
        else:
            self.listeners.append(follower)
        return list(self.events), follower

    def unsubscribe(self, follower: Follower) -> None:
        if follower in self.listeners:
            self.listeners.remove(follower)

    # -- a reservation never driven ----------------------------------------------------

    async def abandon(self) -> None:
        """Give the thread back if the run was reserved but never driven: free it in this
        process at once, then close the run's start already written and release its lease
        (shared coordinators) and call `on_abandon`. Nothing once `drive` has begun."""
        if self._driven or self._finished:
            return
        self._finished = True
        self.manager._release(self)
        for queue in self.listeners:
            queue.put_nowait(None)
        self.listeners.clear()
        if self.lease is None and self.on_abandon is None:
            return
        # In a task of its own: a second cancellation of the caller does not stop it.
        await asyncio.shield(self.manager._adopt(self.manager._give_back(self)))

    async def __aenter__(self) -> ActiveRun:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.abandon()

    # -- driving -----------------------------------------------------------------------

    def log_context(self) -> contextlib.AbstractContextManager[None]:
        """The run's ids bound to every log line written inside (and in the tasks started
        there: actions, hooks, its store's write)."""
        return _LogContext(agent=self.agent_id, thread_id=self.thread_id, run_id=self.run_id)

    async def drive(self, write: Writer) -> None:
        """Run the agent to its end, handing each batch to `write`."""
        # Once per run, around all of it: a detached run goes on in this same task.
        held = HELD_BOUND.set(self.manager.max_live_bytes)
        try:
            with self.log_context():
                await self._drive(write)
        finally:
            HELD_BOUND.reset(held)

    async def _drive(self, write: Writer) -> None:
        if self._finished:
            raise RuntimeError("the run's thread was given back: it cannot be driven")
        self._driven = True
        self.task = asyncio.current_task()
        if self.cancel_reason is not None and self.task is not None:
            self.task.cancel()  # stopped before it was driven (see `cancel`)
        limit = self.manager.max_run_seconds
        # Cut as a stop is (its upstream requests cancelled, its stream ended), with an error.
        deadline = None if limit is None else \
            asyncio.get_running_loop().call_later(limit, self.cancel, "timeout")
        stream = self._stream()
        try:
            async for batch in stream:
                if self.order.terminated:
                    # Stored before the client hears the end: whoever has the whole answer
                    # can count on the run being in the thread (a crash just after included).
                    await self._finish()
                await write(batch)
        except asyncio.CancelledError:
            reason = self.cancel_reason
            # Cancelled from outside (the server cut its request): the cancellation goes on
            # once the run is closed. Cancelled by `cancel`, the run ends as the request's
            # answer does, its stream complete.
            cut = reason is None or self.task is None
            if not cut and self.task is not None:
                self.task.uncancel()
            try:
                await stream.aclose()
            except Exception:  # (see the `finally`): the run still gets its end
                _log.exception("could not close a run's stream", run_id=self.run_id)
            tail, self._held = self._held + self.order.closing_events(), []
            if not self.order.terminated:
                if reason in (None, "shutdown"):
                    # Stored closed, like a run whose worker died: never a run without
                    # its end (every later replay of the thread would break clients).
                    tail.append(ev.run_error(_SHUTDOWN_MESSAGE, code=INTERRUPTED_CODE))
                elif reason == "lost":
                    tail.append(ev.run_error(_LEASE_LOST_MESSAGE, code=LEASE_LOST_CODE))
                elif reason == "timeout":
                    tail.append(ev.run_error(
                        f"The run did not finish within {limit:g} seconds",
                        code=RUN_TIMEOUT_CODE))
                else:
                    tail.append(ev.run_finished(self.thread_id, self.run_id))
                if tail[-1]["type"] == ev.RUN_ERROR:
                    self._run_cut(tail[-1])
                self.order.terminated = True
            self._publish(tail)
            if cut or reason == "shutdown":
                # In a task of its own, which `RunManager.drain` waits for: a cancellation
                # (again: the server's grace ran out, then the runtime's close stops its
                # runs) does not cut the store's write or the lease's release.
                try:
                    await asyncio.shield(self.manager._adopt(self._finish()))
                except asyncio.CancelledError:
                    cut = True
                with contextlib.suppress(Exception):
                    await write(tail)  # the client, if it is still there, hears the end
                if cut:
                    raise
                return
            await self._finish()
            if reason != "disconnect":
                await write(tail)
        except GeneratorExit:
            # (thrown in by an agent's task): the run is stored below, without a suspension
            self._closing = True
            raise
        finally:
            if deadline is not None:
                deadline.cancel()
            if self._detached_bound is not None:
                self._detached_bound.cancel()
            try:
                await stream.aclose()
            except Exception:
                # (an async generator a GeneratorExit went through stays "running", and its
                # close raises): the run is stored and its thread given back all the same.
                _log.exception("could not close a run's stream", run_id=self.run_id)
            finally:
                await self._finish()

    async def _stream(self) -> AsyncGenerator[Sequence[Event], None]:
        first = [self.started_event()]
        self._publish(first)
        memory = self.manager.memory
        if memory is not None and not self.unstored:
            # The thread exists from its first run's start, as on a durable store (whose
            # first write of the run's events makes it).
            await memory.begin_run(self.thread_id, self.agent_id, self.created_at,
                                   self.first_position, first[0], owner=self.owner)
        yield first
        # Let runs that arrived together write their RUN_STARTED before this one's agent
        # spends the loop on building its upstream request.
        await asyncio.sleep(0)
        iterator: EventBatches | None = None
        tail: list[Event]
        at_yield = False  # (a GeneratorExit there is `drive` closing this stream)
        closed = True
        try:
            # Inside the `try`: an agent whose `run` raises before it returns its stream
            # fails as one whose stream raises (before, the stream was cut without its end).
            self._agent_asked = True
            iterator = self.agent.run(self.agent_input, self.context)
            async for batch in iterator:
                out = self.order.normalize(batch)
                self._keep(out)
                if isinstance(batch, LastBatch) and not self.order.terminated:
                    # Held back to go out with the run's closing events, in one write.
                    self._held.extend(out)
                    continue
                if self._held:  # an agent that said "last" too early: keep the order
                    out, self._held = [*self._held, *out], []
                if out:
                    if self.lease is not None:
                        await self._still_held(self.lease)
                    self._publish(out)
                    at_yield = True
                    yield out
                    at_yield = False
                if self.order.terminated:
                    return
        except CopilotRuntimeError as exc:
            self._run_failed(exc)
            tail = self.order.closing_events()
            tail.append(ev.run_error(exc.message, code=exc.code))
        except BaseException as exc:
            # Whatever the agent raises is its failure (a GeneratorExit, a library's own
            # BaseException, a CancelledError of its own cut the stream without its end),
            # but the run's own cancellation and `drive` closing the stream.
            if at_yield or (isinstance(exc, asyncio.CancelledError) and not cancelled_itself()):
                raise
            self._agent_failed(exc)
            if not cancelled_itself():
                # The run is being cut (a stop, a disconnect, a timeout) and the agent's
                # cleanup raised in its cancellation's place: the cut goes on, and ends the
                # run as it would have (a stop is still a stop).
                raise asyncio.CancelledError from None
            tail = self.order.closing_events()
            tail.append(self._agent_error())
        else:
            tail = self.order.closing_events()
            tail.append(ev.run_finished(self.thread_id, self.run_id))
        finally:
            if iterator is not None:
                closed = await self._close_agent(iterator)
        if not closed and tail[-1]["type"] == ev.RUN_FINISHED:
            tail[-1] = self._agent_error()  # its stream ended, but could not be closed
        if self.lease is not None:
            await self._still_held(self.lease)
        self.order.terminated = True
        tail, self._held = self._held + tail, []
        self._publish(tail)
        yield tail

    async def _close_agent(self, iterator: EventBatches) -> bool:
        """Close the agent's stream (its upstream request with it); False if that failed.

        A close that raises (a generator's `finally`, an iterator's own `aclose`) is the
        agent's failure, logged (before, it went through `drive` to the server, and the
        client's stream was cut without its end)."""
        aclose = getattr(iterator, "aclose", None)
        if aclose is None:
            return True
        try:
            await aclose()
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and not cancelled_itself():
                raise  # the run's own cancellation, landing in the close
            self._agent_failed(exc, "agent's stream failed to close")
            return False
        return True

    def _agent_failed(self, exc: BaseException, what: str = "agent failed") -> None:
        # The stack goes to the log (and the run's span); the client gets a message
        # without internals (`_agent_error`).
        _log.error(what, agent=self.agent_id, thread_id=self.thread_id, run_id=self.run_id,
                   exc_info=exc)
        if self.context.telemetry is not None:
            self.context.telemetry.agent_failed(exc)

    def _run_failed(self, exc: CopilotRuntimeError) -> None:
        """Log once why the run ends with `exc`'s RUN_ERROR: its message is what the client
        reads (no secrets, no internals). ERROR when the provider refused the runtime's own
        credentials, INFO for what the client caused, WARNING for any other failure."""
        if exc.logged:
            return
        status = getattr(exc, "status", None)
        fields: dict[str, Any] = {"agent": self.agent_id, "thread_id": self.thread_id,
                                  "run_id": self.run_id, "code": exc.code,
                                  "error": exc.message}
        if isinstance(status, int):
            fields["status"] = status
        provider = getattr(getattr(self.agent, "adapter", None), "provider", None)
        if isinstance(provider, str):
            fields["provider"] = provider
        if (isinstance(exc, RequestError) and exc.status < 500) or isinstance(
                exc, ContentFilteredError):
            _log.info("run refused", **fields)
        elif isinstance(exc, UpstreamError) and status in (401, 403) and provider is not None:
            # (A remote agent's 401 may be the client's forwarded credentials: a WARNING.)
            _log.error("run failed: the provider refused the runtime's credentials", **fields)
        else:
            _log.warning("run failed", **fields)

    def _run_cut(self, end: Event) -> None:
        """Log once that the runtime cut the run (its time bound, its lease lost, shutdown)
        with `end`, its RUN_ERROR: not the client's doing, and an operator's to see, as a
        provider's failure is (`_run_failed`)."""
        _log.warning("run failed", agent=self.agent_id, thread_id=self.thread_id,
                     run_id=self.run_id, code=end["code"], error=end["message"])

    def _agent_error(self) -> Event:
        return ev.run_error(f"Agent '{self.agent_id}' failed unexpectedly",
                            code=ev.AGENT_ERROR_CODE)

    def _keep(self, batch: Sequence[Event]) -> None:
        """Count `batch` against what a running run may keep: the events of one that never
        ends (a remote streaming without end) would fill the memory (its followers' replay
        and its store need them all)."""
        self._kept_bytes += estimated_size(batch)
        limit = self.manager.max_live_bytes
        if self._kept_bytes > limit:
            _log.warning("run stopped: its events passed the bound of a running run",
                         agent=self.agent_id, thread_id=self.thread_id, run_id=self.run_id,
                         limit=limit)
            raise _RunTooLarge(limit)

    async def _still_held(self, lease: Lease) -> None:
        """Stop the run here (cancelled, `"lost"`) if its lease may have expired while this
        process stalled: another worker may run on the thread now, so not a word more."""
        lapsed = self.manager.lapsed
        if lapsed is not None and lapsed(lease):
            self.cancel("lost")
            await asyncio.sleep(0)  # (the cancellation lands here)

    @property
    def seen_message_ids(self) -> Collection[str]:
        """The ids of the messages the thread held when the run began."""
        return self._seen

    def started_event(self) -> Event:
        """The run's `RUN_STARTED` (made once: a shared run writes it before it streams)."""
        if self._started_event is None:
            self._started_event = ev.run_started(self.thread_id, self.run_id,
                                                 self._input_echo())
        return self._started_event

    def batch_position(self, batch: Sequence[Event]) -> int:
        """The position of the first event of `batch`, the run's latest batch."""
        return self.first_position + len(self.events) - len(batch)

    def _publish(self, batch: Sequence[Event]) -> None:
        self.events.extend(batch)
        for follower in self.listeners:
            follower.wake()
        if self.manager.durable is not None and self._flush_timer is None \
                and self._flushing is None and not self._finished and not self.unstored:
            self._flush_timer = asyncio.get_running_loop().call_later(
                FLUSH_INTERVAL, self._start_flush)

    # -- writing as the run goes (durable stores) --------------------------------------

    def _start_flush(self) -> None:
        self._flush_timer = None
        if not self._finished:
            self._flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        """Write the events streamed since the last write, so another worker can follow
        the run and a crash loses nothing already sent."""
        store = self.manager.durable
        assert store is not None
        start, events = self._flushed, self.events[self._flushed:]
        # The run's start position fences a late write (this process stalled) of a thread
        # deleted meanwhile: it writes nothing (a store of an application's own may not
        # take it).
        fence: dict[str, Any] = {"run_first": self.first_position} \
            if self.manager.durable_fences else {}
        try:
            try:
                await store.append_events(self.thread_id, self.agent_id, self.run_id,
                                          self.created_at, self.first_position + start,
                                          events, owner=self.owner, **fence)
            except TypeError:  # orjson.JSONEncodeError: an event JSON cannot carry
                await store.append_events(self.thread_id, self.agent_id, self.run_id,
                                          self.created_at, self.first_position + start,
                                          _encodable(events), owner=self.owner, **fence)
            self._flushed = start + len(events)
            self.manager.flushed(self, self.first_position + self._flushed - 1)
            self.manager.unflushed = 0
        except ServiceUnavailableError as exc:
            # An outage, tried again every 200 ms by every running run: told now and then.
            self.manager.unflushed += 1
            if worth_logging(self.manager.unflushed):
                _log.warning("could not write a running run's events", thread_id=self.thread_id,
                             run_id=self.run_id, error=exc.message,
                             failures_in_a_row=self.manager.unflushed)
        except Exception:
            _log.exception("could not write a running run's events",
                           thread_id=self.thread_id, run_id=self.run_id)
        finally:
            self._flushing = None
        if len(self.events) > self._flushed and not self._finished:
            self._flush_timer = asyncio.get_running_loop().call_later(
                FLUSH_INTERVAL, self._start_flush)

    async def write_first_batch(self) -> bool:
        """Write what the run streamed now if its thread is new to the store and none of it
        is written yet: the write its timer makes within `FLUSH_INTERVAL`, asked for by a
        list, rename or archive of its thread, which exists from the run's start. Only such
        a request costs the write sooner; a run's own path is as it was. The write is waited
        for (one attempt: a store that cannot write fails it at once), an ending run's store
        at most `FIRST_WRITE_WAIT`; True if the store has the run's thread now."""
        if not self.new_thread or self._flushed or not self.events or self.unstored \
                or not self.confirmed or self.manager.durable is None:
            return False
        if self._finished:
            # Ending: its whole run is being written, which makes the thread. Not waited for
            # longer: a store that cannot write keeps it pending for as long as it is away.
            stored = self.released()
            await asyncio.wait((stored,), timeout=FIRST_WRITE_WAIT)
            return stored.done()
        writing = self._flushing
        if writing is None:
            if self._flush_timer is not None:
                self._flush_timer.cancel()
                self._flush_timer = None
            writing = self._flushing = asyncio.ensure_future(self._flush())
        # Whole: under load a write may take longer than any bound, and the thread would be
        # answered missing (`wait` does not cut it when the request leaves: it goes on).
        await asyncio.wait((writing,))
        return self._flushed > 0

    def _input_echo(self) -> dict[str, Any]:
        """The run's input as RUN_STARTED carries it: only the messages new to the thread."""
        raw = self.input.raw
        echo: dict[str, Any] = {}
        for key in _INPUT_KEYS:
            if key == "messages":
                unkept = self.input.transient
                echo[key] = [m for m in raw.get("messages") or ()
                             if not (isinstance(m, dict) and (
                                 m.get("id") in self._seen or m.get("id") in unkept))]
            elif key == "forwardedProps" and isinstance(raw.get(key), dict):
                echo[key] = {k: v for k, v in raw[key].items() if k not in _UNKEPT_PROPS}
            elif key in raw and raw[key] is not None:
                echo[key] = raw[key]
            elif key in ("tools", "context"):
                echo[key] = []
        return echo

    async def _finish(self) -> None:
        if self._finished:
            return
        if self.events and not self.order.terminated:
            # Cut before its end (its writer raised): never stored, nor followed, without
            # one (every later replay of the thread would break clients).
            tail, self._held = self._held + self.order.closing_events(), []
            tail.append(ev.run_error(_CUT_MESSAGE, code=INTERRUPTED_CODE))
            self.order.terminated = True
            self._publish(tail)
        self._finished = True
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        for queue in self.listeners:
            queue.put_nowait(None)
        self.listeners.clear()
        if self.unstored:  # nothing to write, no thread to give back
            try:
                # Compacted all the same, once: its end's observers read its messages.
                self.compacted = (await self._storable(on_loop=self._closing))[0]
                if self.forgetter is not None and self._agent_asked:
                    # Before the client hears the end, as a chat's run is stored first; in a
                    # task of its own (a cancellation does not cut it), waited for briefly:
                    # a slow checkpointer delays no suggestion, nor a shutdown.
                    forgetting = self.manager._adopt_forget(
                        self._forget_throwaway(self.forgetter))
                    await self.manager._wait_ending(forgetting, FORGET_WAIT)
            finally:
                self.manager._release(self)
                slot = self._slot_on_its_way()
                self._ended()
            if slot is not None:
                await asyncio.wait((slot,), timeout=GIVE_BACK_WAIT)
            return
        if self.manager.durable is None:  # in this process: nothing to wait for
            if not self.large():
                try:
                    await self._store_and_give_back(on_loop=self._closing)
                finally:
                    self._ended()
                return
            if self._closing:
                # No suspension here, and no cut on the loop (seconds of a large run's, every
                # stream and probe of the worker held): stored in a task of its own, whose
                # thread's next run waits for it (its client may hear the end first).
                stored = self.manager._adopt(self._store_and_give_back())
                stored.add_done_callback(partial(_stored, self))
                self.manager._note_giving_back(self.thread_id, stored)
                return
            # Cut in a thread, in a task of its own: a cancellation meanwhile (a hand-over,
            # drain, shutdown) does not lose the run, and `drain` waits for it.
            stored = self.manager._adopt(self._store_and_give_back())
            stored.add_done_callback(partial(_stored, self))
            await asyncio.shield(stored)
            return
        # In a task of its own, waited for at most `STORE_RETRY_FOR`: a store that is away,
        # or does not answer, must not hold the run's end (and its client) longer. The write
        # goes on until the store is back, and the thread is given back only then (a write
        # given up on could still commit after a next run had read the thread's head).
        stored = self.manager._adopt(self._store_and_give_back())
        stored.add_done_callback(partial(_stored, self))
        await self.manager._wait_ending(stored, STORE_RETRY_FOR)
        if not stored.done():
            _log.warning("run not stored yet: written once its store is back, its thread "
                         "busy until then", thread_id=self.thread_id, run_id=self.run_id)

    def _slot_on_its_way(self) -> asyncio.Future[None] | None:
        """Start giving the caller's slot back (once): its release, or None."""
        give, self.give_slot_back = self.give_slot_back, None
        if give is None:
            return None
        try:
            with self.log_context():
                return give()
        except Exception:
            _log.exception("could not give a caller's slot back", run_id=self.run_id)
            return None

    async def _forget_throwaway(self, agent: Agent) -> None:
        """Have the agent forget the throwaway thread it ran a suggestion on (a graph's
        checkpoints, the approvals an interrupt filed), for as long as a store's write is
        waited for: no approval of it is served meanwhile (the thread is nobody's)."""
        try:
            await asyncio.wait_for(agent.forget_thread(self.agent_input.thread_id),
                                   STORE_RETRY_FOR)
        except NotImplementedError:
            pass  # a checkpointer that cannot delete (LangGraph's base): its approvals went
        except Exception as exc:
            _log.warning("an agent could not forget a suggestion's thread",
                         agent=self.agent_id, thread_id=self.agent_input.thread_id,
                         error=repr(exc))

    def _ended(self, _: object = None) -> None:
        self._slot_on_its_way()  # (given back with the thread already, on every path)
        if self.on_end is not None:
            try:
                with self.log_context():  # (also called back outside `drive`)
                    self.on_end(self)
            except BaseException:
                # A plain call, so nothing it raises (a `CancelledError` of its own
                # included) is this task's cancellation: logged, and the run ends.
                _log.exception("run end observer failed", run_id=self.run_id)

    async def _store_and_give_back(self, *, on_loop: bool = False) -> None:
        try:
            if self._flushing is not None:
                await asyncio.shield(self._flushing)
            await self._store(on_loop=on_loop)
        finally:
            # The thread is given back only once its run is stored: a run begun on it
            # meanwhile would read its head without this run, and a `connect` would miss it
            # (until then it replays the run from memory).
            self.manager._release(self)
            # The thread and the caller's slot, given back together under one deadline, in
            # the background (`drain` waits for them): the run's end waits for its store,
            # not for a coordinator or limits backend that stops answering; ones that answer
            # have both back before the client hears the end (its next run, a tool's result
            # sent at once, may go to another worker).
            slot = self._slot_on_its_way()
            giving = None
            if self.lease is not None:
                giving = self.manager._adopt(self.manager.let_go(self.lease))
                self.manager._note_giving_back(self.thread_id, giving)
            waited = [f for f in (giving, slot) if f is not None and not f.done()]
            if waited:
                await asyncio.wait(waited, timeout=GIVE_BACK_WAIT)

    def large(self) -> bool:
        """Whether the run is large enough to be compacted (and cut) in a thread."""
        if self._start_bytes is None:  # (weighed once: asked twice as every run ends)
            self._start_bytes = estimated_size(self.events[:1])
        return self._kept_bytes + self._start_bytes >= LARGE_JSON

    async def _storable(self, *, on_loop: bool = False) -> tuple[list[Event], int]:
        """The run's events as its store keeps them (`storable`): never what cannot be
        replayed, nor more than a run's byte bound. A large run's in a thread: its
        compaction copies its state, and one over the bound is walked to be cut (seconds on
        the event loop, where every stream and probe of the worker waited for it); but
        `on_loop` (the drive closing on a GeneratorExit, where no suspension may be)."""
        def compacted() -> tuple[list[Event], int]:
            return storable(compact_events(self.events), self.manager.max_run_bytes)

        # Most runs are small: compacted here, with no thread's hop nor suspension.
        if on_loop or not self.large():
            return compacted()
        return await asyncio.to_thread(compacted)

    async def _store(self, *, on_loop: bool = False) -> None:
        try:
            compacted, size = await self._storable(on_loop=on_loop)
            self.compacted = compacted
            ids = {m["id"] for m in self.input.raw.get("messages") or ()
                   if isinstance(m, dict) and isinstance(m.get("id"), str)
                   and m["id"] not in self.input.transient}
            # Only those the stored run carries (or the thread had): a message cut out of a
            # run too large to store, marked seen, was never stored by the next run either.
            ids &= _input_message_ids(compacted) | self._seen
            for event in compacted:
                for key in ("messageId", "parentMessageId"):
                    value = event.get(key)
                    if isinstance(value, str):
                        ids.add(value)
            # Marks are the runtime's alone: a client's (or an agent's) id that reads as
            # one would make text the guardrails never saw pass for let through.
            ids = {i for i in ids if not i.startswith(JUDGED_MARK_PREFIX)} | self.extra_ids
            if self.output_marks is not None:
                ids |= self.output_marks(compacted)
            if self.wire_ids is not None:
                ids |= self.wire_ids(compacted)
            # The thread holds the ids it had when the run began: a client sends the whole
            # history with each message, and writing all its ids again cost a durable store
            # a conflicting insert per message per run.
            ids = storable_ids(ids.difference(self._seen))
            stored = StoredRun(self.run_id, compacted, self.created_at, size,
                               self.first_position,
                               self.first_position + len(self.events) - 1)
            durable = self.manager.durable
            if durable is not None:
                # The unwritten rest of the raw events too, for exact resumes.
                raw = self.events[self._flushed:]

                def write() -> Awaitable[None]:
                    return durable.append_run(
                        self.thread_id, self.agent_id, stored, ids, owner=self.owner,
                        raw_first=self.first_position + self._flushed, raw=raw)

                try:
                    try:
                        await write()
                    except TypeError:  # orjson.JSONEncodeError: a raw event JSON cannot carry
                        raw = _encodable(raw)
                        await write()
                except ServiceUnavailableError:
                    # A store restarting or failing over: written once it is back (the
                    # client waits for the run's last events up to `STORE_RETRY_FOR`; a
                    # write that committed before its connection broke is not repeated:
                    # the store's write is idempotent). Given up on only by shutdown's
                    # drain: the next start's recovery then closes the run.
                    await asyncio.shield(self.manager._adopt(_retried(write, math.inf)))
            else:
                await self.manager.store.append_run(self.thread_id, self.agent_id, stored, ids,
                                                    owner=self.owner)
        except Exception:
            _log.exception("could not store run", thread_id=self.thread_id, run_id=self.run_id)
            # Its events went out with their positions: the thread's next run here starts
            # after them, though the store's head is behind (see `_UnstoredEnds`).
            self.manager._unstored.note(self.thread_id,
                                        self.first_position + len(self.events))


def store_clock(store: Any) -> Callable[[], Awaitable[float]] | None:
    """The clock a store stamps its threads by, when it has one of its own (PostgreSQL's:
    `clock()`, a coroutine function); None: this process's `time.time`."""
    clock = getattr(store, "clock", None)
    return clock if inspect.iscoroutinefunction(clock) else None


def _input_message_ids(events: Sequence[Event]) -> set[str]:
    """The ids of the input messages a run's `RUN_STARTED` (in `events`) carries."""
    for event in events:
        if event.get("type") == ev.RUN_STARTED:
            run_input = event.get("input")
            messages = run_input.get("messages") if isinstance(run_input, dict) else None
            return {m["id"] for m in messages or () if isinstance(m, dict)
                    and isinstance(m.get("id"), str)}
    return set()


def _before_run(stored: list[Positioned], run_id: str, first_position: int | None
                ) -> list[Positioned]:
    """What `stored` (a store's `events_after`) holds before the run `run_id`, which began at
    `first_position` (None: not known yet): durable stores have its events written so far,
    and any store has it whole once it ended (it is live until the store has it). The live
    run is the thread's newest, so its stored events are a tail of `stored`; a run id the
    thread used before (clients may send one again) marks nothing."""
    if first_position is not None:
        # Each earlier run ends with an event that has its position (a compacted run's
        # others have none): the live run's events are what follows the last of those.
        for index in range(len(stored) - 1, -1, -1):
            position = stored[index][0]
            if position is not None and position < first_position:
                return stored[:index + 1]
        # None before it: what comes before the live run's start are runs stored before
        # positions existed (none of their events has one), in a whole-thread replay.
        first_positioned = next((index for index, (position, _) in enumerate(stored)
                                 if position is not None), None)
        if first_positioned is None:
            return stored  # (the live run has nothing stored yet)
        for index in range(first_positioned, -1, -1):
            if stored[index][1].get("type") == ev.RUN_STARTED:
                return stored[:index]
        return []
    for index in range(len(stored) - 1, -1, -1):
        event = stored[index][1]
        if event.get("type") == ev.RUN_STARTED:
            return stored[:index] if event.get("runId") == run_id else stored
    return stored


class _LogContext(contextlib.AbstractContextManager[None]):
    """Log fields bound for a block, then set back as they were: structlog's own
    `bound_contextvars` copies the whole context to save them (twice the cost, per run)."""

    __slots__ = ("_fields", "_tokens")

    def __init__(self, **fields: Any) -> None:
        self._fields = fields
        self._tokens: Mapping[str, contextvars.Token[Any]] = {}

    def __enter__(self) -> None:
        self._tokens = structlog.contextvars.bind_contextvars(**self._fields)

    def __exit__(self, *_: object) -> None:
        structlog.contextvars.reset_contextvars(**self._tokens)


def _stored(run: ActiveRun, _: object) -> None:
    run._ended()


def _answers_interrupt(input: RunInput) -> bool:
    """Whether `input` resumes an interrupt (AG-UI's `resume`, or the older clients'
    `forwardedProps.command.resume`)."""
    props = input.model.forwarded_props
    command = props.get("command") if isinstance(props, dict) else None
    return bool(input.model.resume) or (
        isinstance(command, dict) and command.get("resume") is not None)


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def _encodable(events: Sequence[Event]) -> list[Event]:
    """`events` one for one (their positions are kept), each as a store can encode it: one
    that cannot be is reduced as `replayable` reduces it, or replaced by a marker."""
    out: list[Event] = []
    for event in events:
        kept = replayable([event])
        out.append(kept[0] if kept else ev.custom("copilot_runtime.dropped", None))
    return out


async def _retried(call: Callable[[], Awaitable[None]], seconds: float) -> None:
    """`call` again, backing off, while its server cannot be reached (ServiceUnavailableError),
    until it succeeds or `seconds` passed (then its last error)."""
    deadline = time.monotonic() + seconds
    pause = 0.25
    while True:
        await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        try:
            await call()
        except ServiceUnavailableError:
            if time.monotonic() >= deadline:
                raise
            pause = min(pause * 2, 2.0)
        else:
            return


#: How the lease a delete holds on its thread is named (a run id no client sends).
_DELETE = "copilot_runtime.delete:"
#: Seconds a delete waits for another delete of its thread (any worker's) to give the
#: thread's lease back; still held then, the thread is busy (409).
DELETE_WAITS_FOR_DELETE = 10.0
#: Seconds between a waiting delete's tries at the lease.
_DELETE_TRIES_EVERY = 0.05


class RunManager:
    """The runs active in this process, at most one per thread."""

    def __init__(self, store: ThreadStore, max_run_bytes: int = DEFAULT_MAX_RUN_BYTES,
                 coordinator: Coordinator | None = None,
                 max_run_seconds: float | None = None,
                 detached_run_seconds: float | None = DETACHED_RUN_SECONDS) -> None:
        self.store = store
        self.max_run_bytes = max_run_bytes
        #: About how many bytes of events a running run may keep before it is stopped.
        self.max_live_bytes = LIVE_RUN_FACTOR * max_run_bytes
        #: Seconds a run may be driven before it is cut (`RUN_TIMEOUT_CODE`); None: no limit.
        self.max_run_seconds = max_run_seconds
        #: Seconds a run may go on once its client left (`ActiveRun.detach`); 0: stopped
        #: at once; None: to its end.
        self.detached_run_seconds = detached_run_seconds
        self.active: dict[str, ActiveRun] = {}
        #: Runs kept out of their threads (`begin_unstored`), driven in this process.
        self.unstored: set[ActiveRun] = set()
        #: Threads being deleted here (how many deletes of each): a run asking for one is
        #: busy until the deletes are done.
        self._deleting: dict[str, int] = {}
        #: Threads whose run ended here while it is still being stored (a run closing on a
        #: GeneratorExit) or its lease given back: the next run on one waits for that (its
        #: client heard the end and asks at once).
        self._giving_back: dict[str, asyncio.Future[None]] = {}
        #: The run whose lease of each thread is on its way back to the coordinator (shared
        #: coordinators): ended here, though the coordinator still names it the holder.
        self._letting_go: dict[str, str] = {}
        #: The store when it keeps running runs' events (written as runs go), else None.
        self.durable: DurableThreadStore | None = \
            store if isinstance(store, DurableThreadStore) else None
        #: Whether `durable.append_events` takes `run_first` (the built-in stores do).
        self.durable_fences = self.durable is not None and "run_first" in \
            inspect.signature(self.durable.append_events).parameters
        #: The store when it is the in-memory one (told when a run starts), else None.
        self.memory: InMemoryThreadStore | None = \
            store if isinstance(store, InMemoryThreadStore) else None
        #: Called with a run and the last position written to the store, after each write.
        self.on_flushed: Callable[[ActiveRun, int], None] | None = None
        #: The coordinator other workers share, or None (this process alone: no cost).
        self.coordinator = coordinator if coordinator is not None and coordinator.shared \
            else None
        if self.coordinator is not None:
            self.coordinator.on_stop(self._stop_signalled)
            self.on_flushed = self._progressed
        #: Whether a run's lease may have expired in a stall (`SharedCoordinator.lapsed`;
        #: a coordinator of one's own may offer it too), checked before each batch goes out.
        self.lapsed: Callable[[Lease], bool] | None = getattr(self.coordinator, "lapsed", None)
        #: Marking a run's lease as being stopped, and asking for the thread's holder and
        #: whether it is (`SharedCoordinator`; without them a run stopped on another worker
        #: makes its thread busy until it gave its lease back).
        self._mark_stopping: Callable[[str, str], Awaitable[None]] | None = getattr(
            self.coordinator, "mark_stopping", None)
        self._holder_stopping: Callable[[str], Awaitable[tuple[str | None, bool]]] | None = \
            getattr(self.coordinator, "holder_stopping", None)
        #: Work that outlives the call that started it (see `_adopt`).
        self._background: set[asyncio.Future[None]] = set()
        #: When `stop_all` was first called (`time.monotonic()`), or None.
        self.stopping_since: float | None = None
        #: What wakes each run waiting for its end to be stored (see `ActiveRun._finish`).
        self._ending: set[asyncio.Future[None]] = set()
        #: Suggestions' throwaway threads being forgotten (see `_adopt_forget`).
        self._forgetting: set[asyncio.Future[None]] = set()
        #: One future a stream following a run another worker drives, done at `stop_all`.
        self._following: set[asyncio.Future[None]] = set()
        #: Whether `recover` closed the runs a previous process left open (this process
        #: alone): until it did (its store was away at start-up), runs and replays try again.
        self.recovered = self.durable is None or self.coordinator is not None
        self._owners = _KnownOwners()
        self._unstored = _UnstoredEnds()
        #: Progress signals that failed in a row (see `_signal_progress`).
        self._unsignalled = 0
        #: Writes of running runs' events that failed in a row (an outage; see `_flush`).
        self.unflushed = 0

    async def begin(self, agent_id: str, agent: Agent, input: RunInput,
                    context: RunContext, owner: ThreadOwner | None = None,
                    remembered: Callable[[str], Awaitable[bool]] | None = None
                    ) -> ActiveRun:
        """Reserve the thread for a run. With `owner`, a thread someone else owns, running
        or stored, does not exist (`ThreadNotFoundError`); a new thread becomes `owner`'s.
        `remembered(thread_id)` says whether an agent still keeps a thread the store has no
        record of (an evicted in-memory thread, one from before a restart): its owner is
        unknown, so it becomes nobody's (`ThreadNotFoundError`). A run that waits for a
        stopped one to give the thread back starts nothing if its client leaves meanwhile
        (`ClientDisconnected`; its edge says how to see it: `client_watched`)."""
        leaving = _Leaving()
        try:
            return await self._begin(agent_id, agent, input, context, owner, remembered,
                                     leaving)
        finally:
            leaving.close()

    async def _begin(self, agent_id: str, agent: Agent, input: RunInput,
                     context: RunContext, owner: ThreadOwner | None,
                     remembered: Callable[[str], Awaitable[bool]] | None,
                     leaving: _Leaving) -> ActiveRun:
        thread_id = input.thread_id
        if owner is not None and await self._refuses(thread_id, owner):
            # Refused before anything is reserved: a reservation (or a lease) of a caller
            # then refused makes the thread busy for its owner meanwhile, so anyone who knew
            # its id could keep it busy by asking again and again.
            raise ThreadNotFoundError(thread_id)
        running = self.active.get(thread_id)
        if running is not None and running.confirmed:
            if owner is not None and running.owner != owner:
                # Not the caller's: refused at once, as a thread that does not exist is (a
                # wait would say how long its store takes, and its reservation after the
                # wait would make the owner's own next run busy).
                raise ThreadNotFoundError(thread_id)
            if running.cancel_reason is None and await self._stop_asked_elsewhere(running):
                running.cancel("stop")  # its signal is on its way: stopped as it would be
            if running.cancel_reason is not None:
                # Stopped (or its client gone) and ending: it holds the thread until its end
                # is stored. A user who stops an answer and types again waits for that, not
                # a 409.
                await leaving.wait(running.released(), NEXT_RUN_WAITS_FOR_GIVE_BACK)
        giving = self._giving_back.get(thread_id)
        if giving is not None and thread_id in self.active:
            # The thread's last run here ended but is still being stored (see
            # `ActiveRun._finish`): its client's next run waits for it, not refused as busy.
            await leaving.wait(giving, NEXT_RUN_WAITS_FOR_GIVE_BACK)
        if thread_id in self._deleting:
            raise ThreadBusyError(thread_id)
        running = self.active.get(thread_id)
        if running is not None:
            # A reservation not yet confirmed names only who asked: busy for everyone.
            if owner is not None and running.confirmed and running.owner != owner:
                raise ThreadNotFoundError(thread_id)
            raise ThreadBusyError(thread_id)
        # Reserve the thread before the first await, so a concurrent request sees it busy.
        placeholder = ActiveRun(self, agent_id, agent, input, context, set())
        placeholder.owner = owner
        self.active[thread_id] = placeholder
        if self.coordinator is not None:
            return await self._begin_shared(placeholder, owner, remembered, leaving)
        try:
            if not self.recovered:
                await self.recover()
            record = await self.store.summary(thread_id)
            await self._check_owner(thread_id, record, owner, remembered)
            if record is None:  # a new thread: positions go on from a deleted one's
                placeholder.first_position = await self.store.first_position(thread_id)
                placeholder.new_thread = True
        except BaseException:
            self._withdraw(placeholder)
            raise
        if record is not None:
            placeholder._seen = record.message_ids
            placeholder.owner = record.owner
            placeholder.first_position = record.next_position
        placeholder.first_position = self._unstored.first_position(
            thread_id, placeholder.first_position)
        placeholder.confirmed = True
        return placeholder

    async def begin_unstored(self, agent_id: str, agent: Agent, input: RunInput,
                             context: RunContext, owner: ThreadOwner | None = None,
                             remembered: Callable[[str], Awaitable[bool]] | None = None
                             ) -> ActiveRun:
        """Prepare a run kept out of its thread (a chat suggestion's): driven and bounded
        as any run, but not stored, not replayed by `connect`, and not holding the thread (a
        chat's run on it goes on, and another may start). With `owner`, a thread someone
        else owns does not exist (`ThreadNotFoundError`), as for `begin`.

        Its agent runs on a throwaway thread, forgotten at the run's end: an agent that keeps
        threads (a graph's checkpoints) would otherwise take the suggestion's prompt and
        answer into the chat's, or know a new id the store does not, which makes it
        nobody's. Its events still name the caller's thread."""
        thread_id = input.thread_id
        if owner is not None:
            running = self.active.get(thread_id)
            if running is not None and running.confirmed and running.owner != owner:
                raise ThreadNotFoundError(thread_id)
            if await self._refuses(thread_id, owner):
                raise ThreadNotFoundError(thread_id)
            await self._check_owner(thread_id, await self.store.summary(thread_id), owner,
                                    remembered)
        if _answers_interrupt(input):
            raise InvalidRequestError("A suggestion cannot answer an interrupt: send the "
                                      "answer on the chat's run")
        run = ActiveRun(self, agent_id, agent, input, context, set())
        if agent.keeps_threads_here:
            # An agent whose threads live upstream gets the thread sent (the client sends a
            # fresh id per suggestion), as on the TypeScript runtime: a throwaway id there
            # would be a thread nobody deletes.
            run.agent_input = input.replace(
                thread_id=f"{SUGGESTION_THREAD_PREFIX}{uuid.uuid4().hex}")
            run.forgetter = agent
        run.unstored = True
        run.owner = owner
        run.confirmed = True
        self.unstored.add(run)
        return run

    async def _refuses(self, thread_id: str, owner: ThreadOwner) -> bool:
        """Whether the thread is known to be someone else's: the owner remembered for it,
        if the store still agrees. The thread may have been deleted on another worker since
        it was remembered, and its id taken by `owner`."""
        if not self._owners.refuses(thread_id, owner):
            return False
        record = await self.store.summary(thread_id)
        if record is None:
            self._owners.forget(thread_id)
            return False
        self._owners.note(thread_id, record.owner)
        return record.owner != owner

    async def _check_owner(self, thread_id: str, record: ThreadRecord | None,
                           owner: ThreadOwner | None,
                           remembered: Callable[[str], Awaitable[bool]] | None) -> None:
        """Refuse (`ThreadNotFoundError`) a caller who does not own the thread."""
        if record is not None:
            self._owners.note(thread_id, record.owner)
            if owner is not None and record.owner != owner:
                raise ThreadNotFoundError(thread_id)
        elif owner is not None and remembered is not None and await remembered(thread_id):
            raise ThreadNotFoundError(thread_id)

    async def running_anywhere(self, thread_id: str) -> bool:
        """Whether a run is on the thread now, on any worker (a delete holding it is not)."""
        if thread_id in self.active:
            return True
        if self.coordinator is None:
            return False
        holder = await self.coordinator.holder(thread_id)
        return holder is not None and not holder.startswith(_DELETE)

    @contextlib.asynccontextmanager
    async def held_for_delete(self, thread_id: str) -> AsyncIterator[DeleteHold]:
        """Keep runs off the thread while it is deleted (its check that no run is on it, its
        agents' memory, its store): `ThreadBusyError` if a run is on it on any worker, and a
        run asking for it meanwhile, here or (through its lease) on another worker, is busy.
        Under a shared coordinator, another delete of the thread (any worker's) is waited
        for, at most `DELETE_WAITS_FOR_DELETE` seconds (busy after), and this one then finds
        it gone (a 404); without one, deletes of a thread go on together, runs kept off
        until the last one ends. Yields the hold (`DeleteHold`)."""
        if thread_id in self.active:
            raise ThreadBusyError(thread_id)
        self._deleting[thread_id] = self._deleting.get(thread_id, 0) + 1
        coordinator = self.coordinator
        lease: Lease | None = None
        waited_since: float | None = None
        try:
            if coordinator is not None:
                lease, waited_since = await self._lease_for_delete(coordinator, thread_id)
            yield DeleteHold(thread_id, waited_since, lease, self.lapsed)
        finally:
            left = self._deleting.pop(thread_id) - 1
            if left:
                self._deleting[thread_id] = left
            if lease is not None and coordinator is not None:
                await coordinator.release(lease)

    async def _lease_for_delete(self, coordinator: Coordinator, thread_id: str
                                ) -> tuple[Lease, float | None]:
        """The thread's lease, for a delete, and when it began waiting for another delete's
        (None: it did not). Never gone on without it: once another delete let go of the
        thread, a run may begin on it, which this delete would then delete under the run."""
        name = f"{_DELETE}{uuid.uuid4()}"
        deadline = time.monotonic() + DELETE_WAITS_FOR_DELETE
        waited_since: float | None = None
        clock = store_clock(self.store)
        while True:
            # Read before asking (by the clock the store stamps threads with: compared with
            # their updated time): a thread begun after the other delete let go was begun
            # after this.
            began = time.time() if clock is None else await clock()
            lease = await coordinator.acquire(thread_id, name)
            if lease is not None:
                return lease, waited_since
            if waited_since is None:
                waited_since = began
            holder = await coordinator.holder(thread_id)
            if holder is not None and not holder.startswith(_DELETE):
                raise ThreadBusyError(thread_id)
            if time.monotonic() >= deadline:
                raise ThreadBusyError(thread_id)
            await asyncio.sleep(_DELETE_TRIES_EVERY)

    def forget_owner(self, thread_id: str) -> None:
        """The thread is deleted: its id may become someone else's."""
        self._owners.forget(thread_id)

    def _withdraw(self, placeholder: ActiveRun) -> None:
        """A reservation `begin` refused: free the thread and end its followers' streams."""
        if self.active.get(placeholder.thread_id) is placeholder:
            del self.active[placeholder.thread_id]
        placeholder._finished = True
        for queue in placeholder.listeners:
            queue.put_nowait(None)
        placeholder.listeners.clear()

    async def _begin_shared(self, placeholder: ActiveRun, owner: ThreadOwner | None,
                            remembered: Callable[[str], Awaitable[bool]] | None,
                            leaving: _Leaving) -> ActiveRun:
        """`begin` across workers: the thread's lease first, then what the store says (read
        under the lease, so no run ends in between)."""
        coordinator = self.coordinator
        assert coordinator is not None
        thread_id = placeholder.thread_id
        lease: Lease | None = None
        try:
            giving = self._giving_back.get(thread_id)
            if giving is not None:
                # This worker's last run on the thread ended but its lease is still on its
                # way back (a slow coordinator): its client's next run (a tool's result,
                # sent at once) waits for it rather than being refused as busy.
                await leaving.wait(giving, NEXT_RUN_WAITS_FOR_GIVE_BACK)
            lease = await coordinator.acquire(thread_id, placeholder.run_id)
            record = await self.store.summary(thread_id)
            await self._check_owner(thread_id, record, owner, remembered)
            if lease is None:  # a run on another worker has the thread
                lease = await self._lease_after_stop(placeholder, leaving)
                leaving.check()  # gone as the lease came: given back, nothing started
                # Read again under the lease: the stopped run is stored now.
                record = await self.store.summary(thread_id)
                await self._check_owner(thread_id, record, owner, remembered)
            if lease.inherited and record is not None and self.durable is not None:
                # A dead worker's run the sweep may not have closed yet: close it first.
                await self._close_left_open(self.durable, thread_id)
                record = await self.store.summary(thread_id)
            elif record is not None and record.open_run is not None:
                # A fresh lease over a run still open: the coordinator lost what it held (a
                # restart without persistence, a failover, a restore), and that run may still
                # stream on its worker, which notices only at its next renewal. Busy until
                # that worker stops it (LEASE_LOST) or the sweep closes it.
                raise ThreadBusyError(thread_id)
            if record is not None:
                placeholder._seen = record.message_ids
                placeholder.owner = record.owner
                placeholder.first_position = record.next_position
            else:  # a new thread: positions go on from a deleted one's
                placeholder.first_position = await self.store.first_position(thread_id)
            placeholder.first_position = self._unstored.first_position(
                thread_id, placeholder.first_position)
            if self.durable is not None:
                # The run's start, written before it streams: every worker sees the thread
                # (and its owner) at once, and can follow the run from its first event.
                await self.durable.append_events(
                    thread_id, placeholder.agent_id, placeholder.run_id,
                    placeholder.created_at, placeholder.first_position,
                    [placeholder.started_event()], owner=placeholder.owner)
                placeholder._flushed = 1
        except BaseException:
            self._withdraw(placeholder)
            if lease is not None:
                await coordinator.release(lease)
            raise
        placeholder.lease = lease
        placeholder.confirmed = True
        return placeholder

    async def _lease_after_stop(self, placeholder: ActiveRun, leaving: _Leaving) -> Lease:
        """The thread's lease once the run holding it gives it back, if a stop was asked
        for that run (on any worker): the next run waits for it, as on the worker that
        drives it (`begin`), at most `NEXT_RUN_WAITS_FOR_GIVE_BACK` seconds. A run that
        goes on (or takes longer) makes the thread busy (`ThreadBusyError`) at once; a
        client that leaves meanwhile, `ClientDisconnected`."""
        coordinator, holder_stopping = self.coordinator, self._holder_stopping
        assert coordinator is not None
        thread_id = placeholder.thread_id
        deadline = time.monotonic() + NEXT_RUN_WAITS_FOR_GIVE_BACK
        pause = _GIVE_BACK_ASKED_EVERY
        # Asked again and again (its end is signalled only to the run's followers); a thread
        # found free (given back since) is asked for once more.
        while holder_stopping is not None and time.monotonic() < deadline:
            holder, stopping = await holder_stopping(thread_id)
            if holder is not None and not stopping:
                break  # a run that goes on
            await leaving.wait(None, pause)
            pause = min(pause * 2, _GIVE_BACK_ASKED_MOST)
            lease = await coordinator.acquire(thread_id, placeholder.run_id)
            if lease is not None:
                return lease
        raise ThreadBusyError(thread_id)

    async def _stop_asked_elsewhere(self, run: ActiveRun) -> bool:
        """Whether another worker marked `run`, driven here, as being stopped (its stop
        signal not here yet), as far as the coordinator says within `_GLANCE`."""
        if run.lease is None or self._holder_stopping is None:
            return False
        try:
            async with within(_GLANCE):
                return await self._holder_stopping(run.thread_id) == (run.run_id, True)
        except (ServiceUnavailableError, TimeoutError):
            return False  # busy, as it is

    async def _mark_stopping_everywhere(self, thread_id: str, run_id: str) -> None:
        """Mark the lease of the run a stop was asked for here: the thread's next run waits
        for it on any worker, even before the driving worker heard the stop."""
        if self._mark_stopping is None:
            return
        try:
            await self._mark_stopping(thread_id, run_id)
        except Exception as exc:
            # Only the next run on another worker needs it: busy until the give-back then.
            _log.warning("could not mark a run as being stopped", thread_id=thread_id,
                         run_id=run_id, error=str(exc))

    async def _close_left_open(self, durable: DurableThreadStore, thread_id: str) -> None:
        for open_thread, run_id in await durable.open_runs():
            if open_thread == thread_id and await durable.close_interrupted(thread_id, run_id):
                _log.warning("closed a run its worker left open", thread_id=thread_id,
                             run_id=run_id)

    async def let_go(self, lease: Lease) -> None:
        """Release a finished run's lease and tell followers on other workers it ended."""
        coordinator = self.coordinator
        if coordinator is None:
            return
        self._letting_go[lease.thread_id] = lease.run_id
        try:
            await coordinator.finish(lease)
        except ServiceUnavailableError:
            # Given back once the coordinator is back, while the lease lives (a next run on
            # the thread would be refused as busy until it expired); the run's end does not
            # wait for it. Giving back twice is harmless: the lease goes with its token.
            self._adopt(self._finish_later(coordinator, lease))
        except Exception:
            # The lease expires by itself; followers poll the store.
            _log.exception("could not release a lease", thread_id=lease.thread_id)
        finally:
            if self._letting_go.get(lease.thread_id) == lease.run_id:
                del self._letting_go[lease.thread_id]

    async def _finish_later(self, coordinator: Coordinator, lease: Lease) -> None:
        try:
            await _retried(lambda: coordinator.finish(lease), coordinator.lease_ttl)
        except Exception:
            _log.warning("could not release a lease; it expires by itself",
                         thread_id=lease.thread_id)

    async def drain(self, seconds: float) -> None:
        """Let the work left in the background (writes and releases tried again, signals)
        end within `seconds` of the shutdown's start (`stop_all`); then cancel the rest."""
        if self.stopping_since is not None:  # the server's grace, not twice it
            seconds = max(0.0, seconds - (time.monotonic() - self.stopping_since))
        deadline = time.monotonic() + seconds
        # Work can start more (a run stored, then its lease given back): waited for too.
        while pending := {task for task in self._background if not task.done()}:
            _, late = await asyncio.wait(pending,
                                         timeout=max(0.0, deadline - time.monotonic()))
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def _note_giving_back(self, thread_id: str, giving: asyncio.Future[None]) -> None:
        self._giving_back[thread_id] = giving

        def done(_: object) -> None:
            if self._giving_back.get(thread_id) is giving:
                del self._giving_back[thread_id]

        giving.add_done_callback(done)

    def _adopt(self, work: Awaitable[None]) -> asyncio.Future[None]:
        """`work` in a task of its own, held until it ends."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _adopt_forget(self, work: Awaitable[None]) -> asyncio.Future[None]:
        """`work` (a suggestion's throwaway thread forgotten) adopted, and given up on
        `SHUTDOWN_STORE_WAIT` after shutdown begins: a shutdown waits no longer for it."""
        task = self._adopt(work)
        self._forgetting.add(task)
        task.add_done_callback(self._forgetting.discard)
        if self.stopping_since is not None:
            asyncio.get_running_loop().call_later(SHUTDOWN_STORE_WAIT, task.cancel)
        return task

    async def _wait_ending(self, work: asyncio.Future[None], seconds: float) -> None:
        """Wait for `work` (what a run's end waits for) at most `seconds`, or
        `SHUTDOWN_STORE_WAIT` once shutdown began (from its start for one waiting already)."""
        # Woken by whichever comes first, the work or the deadline (what `asyncio.wait`
        # does, with fewer futures and callbacks: this is once per run).
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        work.add_done_callback(lambda _: _wake(woken))
        stopping = self.stopping_since is not None
        timer = loop.call_later(SHUTDOWN_STORE_WAIT if stopping else seconds, _wake, woken)
        self._ending.add(woken)
        try:
            await woken
        finally:
            timer.cancel()
            self._ending.discard(woken)

    def _progressed(self, run: ActiveRun, position: int) -> None:
        """After each batched write of a run's events: tell followers on other workers."""
        self._adopt(self._signal_progress(run, position))

    async def _signal_progress(self, run: ActiveRun, position: int) -> None:
        assert self.coordinator is not None
        try:
            await self.coordinator.publish(
                Signal("progress", run.thread_id, run.run_id, position))
        except Exception as exc:
            # Followers poll the store meanwhile; an outage is told now and then, not at
            # every batch of every run.
            self._unsignalled += 1
            if worth_logging(self._unsignalled):
                _log.warning("could not signal progress", thread_id=run.thread_id,
                             error=str(exc), failures_in_a_row=self._unsignalled)
        else:
            self._unsignalled = 0

    async def stop_anywhere(self, thread_id: str, run_id: str | None = None) -> bool:
        """Stop the thread's run, here or on the worker that drives it."""
        if self.stop(thread_id, run_id):
            return True
        if self.coordinator is None:
            return False
        reserved = self.active.get(thread_id)
        if reserved is not None and reserved.confirmed:
            return False  # the thread's run is this worker's, stopped or ended already
        # Looked at on both sides of the holder's answer: the give-back may end meanwhile.
        ended_here = self._letting_go.get(thread_id)
        holder = await self.coordinator.holder(thread_id)
        if reserved is not None and run_id is None and holder in (
                None, reserved.run_id, ended_here, self._letting_go.get(thread_id)):
            # No other run holds the thread (at most this worker's last one, ended, its
            # lease on its way back): the reservation waiting for its lease (or its store
            # read) is the thread's run to be, stopped as it starts.
            return reserved.cancel("stop")
        if holder is None or holder.startswith(_DELETE) or (
                run_id is not None and holder != run_id):
            return False  # (a delete holding the thread is no run)
        whole = run_id is None
        # Marked as the signal goes out, not before (a coordinator that does not answer
        # would hold the stop twice as long), and waited for at most `_GLANCE` more: the
        # thread's next run may come as soon as the stop is answered.
        marking = self._adopt(self._mark_stopping_everywhere(thread_id, holder))
        await self.coordinator.publish(Signal("stop", thread_id, holder, whole=whole))
        await asyncio.wait((marking,), timeout=_GLANCE)
        # A signal is not kept: one sent while the driving worker's signal connection was
        # being opened again is lost. Sent again while the run still holds the thread.
        self._adopt(self._stop_again(thread_id, holder, whole))
        return True

    async def _stop_again(self, thread_id: str, run_id: str, whole: bool) -> None:
        coordinator = self.coordinator
        assert coordinator is not None
        # Long enough for a worker to notice a signal connection dropped without a word
        # and open it again (a Redis worker pings after 10 s of silence, waits 5 s for the
        # answer, then connects again), whatever the lease's life.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(coordinator.lease_ttl, 10) + 15
        pause = _STOP_AGAIN
        while loop.time() < deadline:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)
            try:
                if await coordinator.holder(thread_id) != run_id:
                    return
                await coordinator.publish(Signal("stop", thread_id, run_id, whole=whole))
            except Exception:
                return

    def _stop_signalled(self, signal: Signal) -> None:
        reason = "lost" if signal.kind == "lost" else "stop"
        if self.stop(signal.thread_id, signal.run_id, reason) or reason != "stop":
            return
        reserved = self.active.get(signal.thread_id)
        if signal.whole and reserved is not None and not reserved.confirmed and \
                self._letting_go.get(signal.thread_id) == signal.run_id:
            # A stop of the thread signalled to the run that ended here, its lease on its way
            # back (the coordinator still names it the holder): it is the thread's next
            # run's, waiting for the lease. A stop naming the ended run stops nothing.
            reserved.cancel(reason)

    def flushed(self, run: ActiveRun, position: int) -> None:
        if self.on_flushed is not None:
            try:
                self.on_flushed(run, position)
            except Exception:
                _log.exception("flush observer failed", run_id=run.run_id)

    def unwritten(self, thread_id: str, owner: ThreadOwner | None) -> bool:
        """Whether a run driven here on `thread_id` (of `owner`, with one) began a thread new
        to the store and has written none of it yet (`write_first_batches`)."""
        run = self.active.get(thread_id)
        return self.durable is not None and run is not None and run.new_thread \
            and not run._flushed and (owner is None or run.owner == owner)

    async def write_first_batches(self, thread_id: str | None = None, *,
                                  owner: ThreadOwner | None = None,
                                  agent_id: str | None = None) -> bool:
        """Have the runs driven here on `thread_id` (None: on any thread; with `owner` or
        `agent_id`, only that owner's or agent's) of threads new to the store, whose events
        are not written yet, write them now (`ActiveRun.write_first_batch`): the store then
        has their threads, which a list, rename or archive is about to ask it for. True if
        it has one it had not. Runs on other workers wrote their start before they streamed
        (`_begin_shared`)."""
        if self.durable is None:
            return False
        candidates = self.active.values() if thread_id is None else \
            [run] if (run := self.active.get(thread_id)) is not None else []
        unwritten = [run.write_first_batch() for run in candidates
                     if run.new_thread and not run._flushed
                     and (owner is None or run.owner == owner)
                     and (agent_id is None or run.agent_id == agent_id)]
        return any(await asyncio.gather(*unwritten))

    async def recover(self) -> int:
        """Close the runs a previous process left open in a durable store, as interrupted
        (for one process alone: with several workers, the coordinator's sweep does it)."""
        if self.durable is None:
            return 0
        closed = 0
        for thread_id, run_id in await self.durable.open_runs():
            running = self.active.get(thread_id)
            # A reservation not yet confirmed has written nothing: the open run is not its.
            if (running is None or not running.confirmed) and \
                    await self.durable.close_interrupted(thread_id, run_id):
                _log.warning("closed a run left open by a previous process",
                             thread_id=thread_id, run_id=run_id)
                closed += 1
        self.recovered = True
        return closed

    def stop_all(self) -> list[asyncio.Task[Any]]:
        """Stop every run, as its server shuts down: each ends with a RUN_ERROR coded
        `INTERRUPTED_CODE`, stored, its lease released. The tasks still driving them.
        Streams following a run another worker drives end too, without an end event (the
        run goes on there): the client resumes on another server with `Last-Event-ID`."""
        for following in self._following:
            if not following.done():
                following.set_result(None)
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
            # Runs already waiting for a store that is away wait no longer than those to come.
            loop = asyncio.get_running_loop()
            for woken in self._ending:
                loop.call_later(SHUTDOWN_STORE_WAIT, _wake, woken)
            for forgetting in self._forgetting:
                loop.call_later(SHUTDOWN_STORE_WAIT, forgetting.cancel)
        running = [*self.active.values(), *self.unstored]
        for run in running:
            run.cancel("shutdown")
        return [r.task for r in running if r.task is not None and not r.task.done()]

    def reopen(self) -> None:
        """Serve as before `stop_all` (its runtime started again after `aclose`): a run's end
        waits for its write `STORE_RETRY_FOR` again, and the next shutdown's grace is whole."""
        self.stopping_since = None

    def stop(self, thread_id: str, run_id: str | None = None, reason: str = "stop") -> bool:
        """Stop the thread's run in this process; with `run_id`, only that run (a reservation
        of that id too, whether or not its lease is held yet)."""
        run = self.active.get(thread_id) if run_id is not None else self._run_here(thread_id)
        if run is None or (run_id is not None and run.run_id != run_id):
            return False
        return run.cancel(reason)

    def _run_here(self, thread_id: str) -> ActiveRun | None:
        """The thread's run if this process has it. Under a shared coordinator a reservation
        is not one until `begin` confirmed it: another worker's run may hold the thread,
        and the reservation is then refused (busy)."""
        run = self.active.get(thread_id)
        if run is not None and self.coordinator is not None and not run.confirmed:
            return None
        return run

    async def replay(self, thread_id: str, after: int = -1
                     ) -> AsyncIterator[Sequence[Positioned]]:
        """A thread's events after position `after` (all for -1): its stored runs, then the
        live run if there is one, to its end. The first batch comes as soon as the thread
        was read, even empty: a store that cannot be read fails before anything is sent."""
        if self.coordinator is not None and thread_id not in self.active:
            async for followed in self._follow(self.coordinator, thread_id, after):
                yield followed
            return
        if not self.recovered:
            await self.recover()
        live = self.active.get(thread_id)
        if live is None:
            yield await replay_stored(self.store, thread_id, after)
            return
        # The runs before the live one as the store replays them (bounded, and saying what
        # it left out), then the live run from memory.
        shared = self.coordinator is not None
        confirmed = live.confirmed
        stored = await self.store.events_after(thread_id, after)
        if shared and not confirmed and live.confirmed:
            # The lease came during the read, which may predate the end of the run that
            # held it; a lease is given back only once its run is stored: read again.
            stored = await self.store.events_after(thread_id, after)
        so_far, queue = live.subscribe()
        # A reservation not yet confirmed: the first batch is the store as it was, and runs
        # may end there (another worker's, or a dead one's closed) before its lease is held
        # (with no shared coordinator no other run writes to the thread meanwhile).
        unconfirmed = shared and not live.confirmed
        try:
            start = live.first_position
            # A reservation not yet confirmed does not know where it starts (its thread's
            # head is being read): only its own RUN_STARTED marks where it begins.
            known = start if live.confirmed else None
            if known is not None and unreached(after, start + len(so_far)):
                after = -1  # an id of some other history: the whole thread
                stored = await self.store.events_after(thread_id, after)
            out = _before_run(stored, live.run_id, known)
            out.extend((start + i, e) for i, e in enumerate(so_far) if start + i > after)
            # Where the stream is in the thread, should the reservation be refused (None:
            # nothing sent, the client's position).
            reached = max((p for p, _ in out if p is not None), default=None)
            yield out
            while (item := await queue.get()) is not None:
                if unconfirmed and live.confirmed:
                    unconfirmed = False
                    if gap := await self._stored_before(live, reached, after):
                        yield gap
                first, batch = item
                if first + len(batch) - 1 > after:
                    yield [(first + i, e) for i, e in enumerate(batch) if first + i > after]
        finally:
            live.unsubscribe(queue)
        if unconfirmed and live.confirmed:
            if gap := await self._stored_before(live, reached, after):
                yield gap
            return
        if self.coordinator is None or live.confirmed or self.stopping_since is not None:
            return
        # A reservation of this worker refused (another worker's run holds the thread): it
        # sent nothing, and the stream goes on with the thread's run wherever it runs.
        async for followed in self._follow(self.coordinator, thread_id,
                                           after if reached is None else reached,
                                           sent=reached is not None):
            if followed:
                yield followed

    async def _stored_before(self, run: ActiveRun, reached: int | None, after: int
                             ) -> list[Positioned]:
        """The events stored after position `reached` (None: the client's, `after`) that
        come before `run` (confirmed): what was written while it waited for its lease, not
        yet sent to its follower."""
        stored = await self.store.events_after(run.thread_id,
                                               after if reached is None else reached)
        if reached is not None:
            stored = not_again(stored, reached)
        return _before_run(stored, run.run_id, run.first_position)

    async def _follow(self, coordinator: Coordinator, thread_id: str, after: int, *,
                      sent: bool = False) -> AsyncIterator[Sequence[Positioned]]:
        """`follow`, ended by `stop_all`: a follower waits for a signal, or a poll, that a
        shutdown must not wait for (it was cut at the end of the grace, mid-event)."""
        stopped: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._following.add(stopped)
        followed = follow(coordinator, self.store, thread_id, after, sent=sent)
        step: asyncio.Future[Sequence[Positioned]] | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(followed))
                await asyncio.wait((step, stopped), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    return
                try:
                    batch = step.result()
                except StopAsyncIteration:
                    return
                step = None
                yield batch
        finally:
            self._following.discard(stopped)
            if step is not None and not step.done():
                step.cancel()
                await asyncio.wait((step,))
            await followed.aclose()

    def _release(self, run: ActiveRun) -> None:
        self.unstored.discard(run)
        if self.active.get(run.thread_id) is run:
            del self.active[run.thread_id]
        if run._released is not None and not run._released.done():
            run._released.set_result(None)

    async def _give_back(self, run: ActiveRun) -> None:
        """What `ActiveRun.abandon` leaves to be awaited: the store, the lease, observers."""
        lease = run.lease
        if lease is not None:
            try:
                if self.durable is not None and run._flushed:
                    # Its RUN_STARTED is in the shared store: close it, so the thread reads
                    # as every other worker's runs do.
                    await self.durable.close_interrupted(run.thread_id, run.run_id)
            except Exception:
                _log.exception("could not close a run never driven", run_id=run.run_id)
            await self.let_go(lease)
        if run.on_abandon is not None:
            try:
                await run.on_abandon(run)
            except Exception:
                _log.exception("run abandon observer failed", run_id=run.run_id)


@dataclass(slots=True)
class DeleteHold:
    """A delete's hold on its thread (`RunManager.held_for_delete`)."""

    thread_id: str
    #: When the delete began waiting for another (epoch seconds), or None: a thread of the
    #: id updated since is not the one it was asked to delete (a run began on the id
    #: between the two deletes).
    waited_since: float | None
    lease: Lease | None = None
    lapsed: Callable[[Lease], bool] | None = None

    def check(self) -> None:
        """`ThreadBusyError` if the delete's lease may have expired (this process stalled,
        or lost its coordinator): another worker may have run on the thread since, so the
        delete must not go on as if it still held it."""
        if self.lease is not None and self.lapsed is not None and self.lapsed(self.lease):
            raise ThreadBusyError(self.thread_id)


class _UnstoredEnds:
    """Where the positions of threads whose run could not be stored go on from, in this
    process: the store's head is behind the positions that run sent, and a next run starting
    there would send them again (a client resuming after one of them skipped the next run's
    events, and a later close of the unstored run wrote over them). The thread is given
    back all the same: a failure other than an outage (`ServiceUnavailableError`, tried again
    until written) is no passing one, and tried again for ever it would hold the thread for
    good. Another worker, or the next start, knows only the store's head."""

    #: Threads remembered at most, the oldest forgotten first.
    most = 10_000

    def __init__(self) -> None:
        self._next: OrderedDict[str, int] = OrderedDict()

    def note(self, thread_id: str, next_position: int) -> None:
        self._next[thread_id] = max(next_position, self._next.get(thread_id, 0))
        self._next.move_to_end(thread_id)
        if len(self._next) > self.most:
            self._next.popitem(last=False)

    def first_position(self, thread_id: str, stored: int) -> int:
        """The first position of the thread's next run, whose store's head is `stored`."""
        floor = self._next.get(thread_id)
        if floor is None:
            return stored
        if stored >= floor:  # a later run was stored past it
            del self._next[thread_id]
            return stored
        return floor


class _KnownOwners:
    """The owners of threads read lately, so that a caller who does not own a thread is
    refused before its run reserves it. A thread's owner never changes while it exists; a
    thread deleted on another worker, its id then taken by someone else, may be remembered
    here as the first owner's for at most `ttl` seconds more: a refusal is checked with the
    store (`RunManager._refuses`)."""

    ttl = 60.0
    most = 10_000

    def __init__(self) -> None:
        self._known: OrderedDict[str, tuple[ThreadOwner | None, float]] = OrderedDict()

    def refuses(self, thread_id: str, owner: ThreadOwner) -> bool:
        known = self._known.get(thread_id)
        if known is None:
            return False
        if time.monotonic() - known[1] > self.ttl:
            del self._known[thread_id]
            return False
        return known[0] != owner

    def note(self, thread_id: str, owner: ThreadOwner | None) -> None:
        self._known[thread_id] = (owner, time.monotonic())
        self._known.move_to_end(thread_id)
        if len(self._known) > self.most:
            self._known.popitem(last=False)

    def forget(self, thread_id: str) -> None:
        self._known.pop(thread_id, None)
