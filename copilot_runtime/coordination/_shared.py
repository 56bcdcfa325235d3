"""What the shared coordinators have in common: the leases this process holds, renewed in one
batch every third of their time to live, and one task receiving every worker's signals. Leases
taken and given back, and signals published, while a call of their kind is in flight go
together in the next one (one round trip for the runs starting or ending meanwhile)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from copilot_runtime._batching import Batcher
from copilot_runtime._deadline import within
from copilot_runtime._exceptions import ServiceUnavailableError
from copilot_runtime.coordination.base import Lease, Signal, SignalHub, Subscription, new_token

__all__ = ["SharedCoordinator"]


_log = structlog.get_logger("copilot_runtime.coordination")

#: A lease's default time to live: a dead worker's thread is free again within this long.
DEFAULT_LEASE_TTL = 10.0
#: The longest wait before retrying a lost connection for signals.
_RETRY = 1.0
#: Seconds without any message on a signal connection before it is asked to answer, and
#: the most its answer may take before the connection is taken as dead (and opened again):
#: one that a NAT or a firewall dropped without a word fails nothing, and hears nothing.
PING_EVERY = 10.0
PONG_WITHIN = 5.0
#: Seconds `aclose` waits for its cancelled tasks before closing the connections anyway.
CLOSE_TASKS_WITHIN = 5.0
#: The longest a call waits for the coordinator's server by default (one that stopped
#: answering, behind a network that drops packets, would hold it for minutes).
DEFAULT_TIMEOUT = 10.0


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a call given up on may still fail later


def _listening(ready: asyncio.Future[None], failing: bool, _: object) -> None:
    """A signal connection is open (again): the coordinator is ready, the outage over."""
    if not ready.done():
        ready.set_result(None)
    if failing:
        _log.info("coordinator's signal connection is back")


def _told(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class SharedCoordinator:
    shared = True
    #: What the backend's client raises when its server cannot be reached (set by each).
    unreachable: tuple[type[BaseException], ...] = ()

    def __init__(self, lease_ttl: float) -> None:
        self.lease_ttl = lease_ttl
        #: Seconds a call (a lease taken or given back, a signal sent) waits for the server
        #: before it fails as unreachable.
        self.timeout = DEFAULT_TIMEOUT
        #: Who this process is, in the lease table (host, pid).
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self._held: dict[str, Lease] = {}
        #: When each held lease was last confirmed (monotonic time its acquisition or last
        #: renewal was sent): the server keeps it at least `lease_ttl` past that.
        self._confirmed: dict[str, float] = {}
        self._hub = SignalHub()
        self._tasks: list[asyncio.Task[None]] = []
        self._started: asyncio.Future[None] | None = None
        self._closed = False
        #: Whether the signal connection is open now (stops and live runs of other workers
        #: reach this one); told by `ping`, so a worker deaf to them is not ready.
        self._hearing = False
        self._acquiring: Batcher[tuple[str, str, str], Lease | None] = Batcher(
            self._acquire_many, orphan=self._give_back)
        self._finishing: Batcher[Lease, None] = Batcher(self._finish_many)
        self._publishing: Batcher[Signal, None] = Batcher(self._publish_many)

    # -- what each backend provides ------------------------------------------------------

    async def _acquire_many(self, asked: list[tuple[str, str, str]]) -> list[Lease | None]:
        """The lease for each (thread, run, token) asked for, or None: held elsewhere."""
        raise NotImplementedError

    async def _finish_many(self, leases: list[Lease]) -> list[None]:
        """Release `leases` and signal each run's end."""
        raise NotImplementedError

    async def _publish_many(self, signals: list[Signal]) -> list[None]:
        raise NotImplementedError

    async def release(self, lease: Lease) -> None:
        raise NotImplementedError

    async def mark_stopping(self, thread_id: str, run_id: str) -> None:
        """Tell every worker a stop was asked for `run_id`, if it holds the thread's lease
        (before its worker may have heard the stop): the mark goes with the lease."""
        raise NotImplementedError

    async def holder_stopping(self, thread_id: str) -> tuple[str | None, bool]:
        """The run holding the thread's lease (None: the thread is free), and whether a
        stop was asked for it (`mark_stopping`): it gives the thread back soon."""
        raise NotImplementedError

    async def _connect(self) -> None:
        raise NotImplementedError

    async def _listen(self, ready: asyncio.Future[None]) -> None:
        """Receive signals (handing each to `self._hub`) until cancelled; set `ready` once
        listening. Returns when the connection is lost (it is then opened again)."""
        raise NotImplementedError

    async def _renew(self, leases: list[Lease]) -> set[str]:
        """Extend `leases`; the thread ids of those no longer ours."""
        raise NotImplementedError

    async def _disconnect(self) -> None:
        raise NotImplementedError

    def _cannot_serve_now(self, exc: BaseException) -> bool:
        """Whether `exc` is the answer of a server that is there but cannot serve now (a
        replica or a standby after a failover, out of memory...): as unavailable, for a
        while, as one that cannot be reached."""
        return False

    # -- lifecycle -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _reachable(self) -> AsyncIterator[None]:
        """The block, within `timeout`; its backend's connection failures, a server that
        does not answer in time, and one that answers that it cannot serve now, a
        ServiceUnavailableError (503 with Retry-After; before, the last was a bare 500)."""
        try:
            async with within(self.timeout):
                yield
        except Exception as exc:
            reason = self._unavailable(exc)
            if reason is None:
                raise
            raise ServiceUnavailableError(reason) from exc

    def _unavailable(self, exc: BaseException) -> str | None:
        """Why the coordinator is unavailable, if `exc` says it is (None: a failure of its
        own, a bug)."""
        if isinstance(exc, (TimeoutError, *self.unreachable)):
            return "The coordinator cannot be reached"
        if self._cannot_serve_now(exc):
            return "The coordinator cannot serve now"
        return None

    async def start(self) -> None:
        started = self._started
        if started is not None and started.done() and not self._closed and (
                started.cancelled() or started.exception() is not None):
            self._started = None  # the server was down: try again
        if self._started is None:
            # A task of its own: a caller that stops waiting (its timeout) does not cut the
            # connecting short for the others.
            self._started = asyncio.ensure_future(self._start())
            self._started.add_done_callback(_retrieved)
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        await self._connect()
        ready = asyncio.get_running_loop().create_future()
        self._tasks = [asyncio.create_task(self._listen_forever(ready)),
                       asyncio.create_task(self._renew_forever())]
        await asyncio.wait([ready, self._tasks[0]], return_when=asyncio.FIRST_COMPLETED)

    async def _listen_forever(self, ready: asyncio.Future[None]) -> None:
        loop = asyncio.get_running_loop()
        #: No connection was opened since the last was lost: the outage is told once (a
        #: server away, or answering that it cannot serve, fails every attempt, each second).
        failing = False
        while True:
            listening: asyncio.Future[None] = loop.create_future()
            listening.add_done_callback(functools.partial(_listening, ready, failing))
            listening.add_done_callback(self._heard)
            try:
                await self._listen(listening)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._hearing = False
                # Signals sent meanwhile are lost; followers poll the store slowly for that.
                if listening.done() or not failing:
                    _log.warning("coordinator lost its signal connection; opening it again",
                                 error=_told(exc), unavailable=self._unavailable(exc))
                failing = True
            if not ready.done():
                ready.set_result(None)
            await asyncio.sleep(_RETRY)

    def _heard(self, _: object) -> None:
        self._hearing = True

    def _deaf(self) -> None:
        """After a readiness probe's round trip: the signal connection down (lost, not yet
        opened again) is unavailable too; this worker would not hear a stop asked elsewhere
        for its runs, nor tell followers elsewhere what its runs stream."""
        if not self._hearing:
            raise ServiceUnavailableError("The coordinator's signal connection is down")

    async def _renew_forever(self) -> None:
        interval = self.lease_ttl / 3
        margin = min(interval / 2, 1.0)
        failing = False  # the last renewal failed: the outage was told
        while True:
            await asyncio.sleep(interval)
            held = list(self._held.values())
            if not held:
                continue
            sent = time.monotonic()
            oldest = min(self._confirmed.get(x.thread_id, sent) for x in held)
            try:
                # Bounded: given up on a server that stopped answering while the oldest
                # lease still has `margin` to live, so its run stops before it expires.
                async with within(max(oldest + self.lease_ttl - margin - sent, margin)):
                    lost = await self._renew(held)
            except Exception as exc:
                if not failing:
                    _log.warning("could not renew leases; trying again", error=_told(exc),
                                 unavailable=self._unavailable(exc))
                failing = True
                # A lease that may expire before the next try could be taken by another
                # worker meanwhile: its run stops now, whatever the server says later.
                deadline = time.monotonic() + interval
                lost = {x.thread_id for x in held
                        if self._confirmed.get(x.thread_id, sent) + self.lease_ttl <= deadline}
            else:
                if failing:
                    _log.info("leases renewed again")
                failing = False
                for lease in held:
                    if lease.thread_id not in lost and self._held.get(lease.thread_id) == lease:
                        self._confirmed[lease.thread_id] = sent
            for lease in held:
                if lease.thread_id in lost and self._held.get(lease.thread_id) == lease:
                    self._drop(lease)
                    _log.warning("lease lost; stopping its run", thread_id=lease.thread_id,
                                 run_id=lease.run_id)
                    self._hub.deliver(Signal("lost", lease.thread_id, lease.run_id))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started is not None and not self._started.done():
            self._started.cancel()
            await asyncio.gather(self._started, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        # Bounded: a task a client library keeps from ending (a cancellation swallowed in
        # its read) would hold the close, and a shutdown, for ever; closing the connections
        # below ends what it waits on.
        _, stuck = await asyncio.wait(self._tasks, timeout=CLOSE_TASKS_WITHIN) \
            if self._tasks else ((), ())
        if stuck:
            _log.warning("coordinator tasks did not end when cancelled; closing anyway",
                         tasks=len(stuck))
        self._held.clear()
        self._confirmed.clear()
        if self._started is not None:
            await self._disconnect()

    # -- leases --------------------------------------------------------------------------

    async def acquire(self, thread_id: str, run_id: str) -> Lease | None:
        async with self._reachable():
            await self.start()
            asked = time.monotonic()  # sent no sooner: the lease lives at least ttl from here
            lease = await self._acquiring((thread_id, run_id, new_token()))
        return None if lease is None else self._hold(lease, asked)

    async def finish(self, lease: Lease) -> None:
        self._drop(lease)
        async with self._reachable():
            await self.start()
            await self._finishing(lease)

    async def _give_back(self, lease: Lease | None) -> None:
        """A lease taken for a caller that left (cancelled while it waited): released, so
        the thread does not stay busy until it expires."""
        if lease is not None:
            with contextlib.suppress(Exception):  # else it expires: nobody renews it
                await self.release(lease)

    # -- signals -------------------------------------------------------------------------

    async def publish(self, signal: Signal) -> None:
        async with self._reachable():
            await self.start()
            await self._publishing(signal)

    def subscribe(self, thread_id: str) -> Subscription:
        return self._hub.subscribe(thread_id)

    def on_stop(self, handler: Callable[[Signal], object]) -> None:
        self._hub.stop_handler = handler

    def lapsed(self, lease: Lease) -> bool:
        """Whether `lease` may have expired at the server: its last confirmation is more
        than `lease_ttl` old (this process stalled: a blocked loop, a paused machine),
        so another worker may hold the thread now. It is given up here (no longer renewed);
        its run must stop before it sends anything more."""
        confirmed = self._confirmed.get(lease.thread_id)
        if confirmed is None or self._held.get(lease.thread_id) != lease:
            return True
        if time.monotonic() < confirmed + self.lease_ttl:
            return False
        self._drop(lease)
        _log.warning("lease lapsed while this process stalled; stopping its run",
                     thread_id=lease.thread_id, run_id=lease.run_id)
        return True

    def _hold(self, lease: Lease, confirmed: float) -> Lease:
        self._held[lease.thread_id] = lease
        self._confirmed[lease.thread_id] = confirmed
        return lease

    def _drop(self, lease: Lease) -> None:
        if self._held.get(lease.thread_id) == lease:
            del self._held[lease.thread_id]
            self._confirmed.pop(lease.thread_id, None)
