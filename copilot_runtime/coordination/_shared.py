"""What the shared coordinators have in common: the leases this process holds, renewed in one
batch every third of their time to live, and one task receiving every worker's signals. Leases
taken and given back, and signals published, while a call of their kind is in flight go
together in the next one (one round trip for the runs starting or ending meanwhile)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import structlog

from copilot_runtime._batching import Batcher
from copilot_runtime._exceptions import ServiceUnavailableError
from copilot_runtime.coordination.base import Lease, Signal, SignalHub, Subscription, new_token

__all__ = ["SharedCoordinator"]

_log = structlog.get_logger("copilot_runtime.coordination")

#: A lease's default time to live: a dead worker's thread is free again within this long.
DEFAULT_LEASE_TTL = 10.0
#: The longest wait before retrying a lost connection for signals.
_RETRY = 1.0


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a call given up on may still fail later


class SharedCoordinator:
    shared = True
    #: What the backend's client raises when its server cannot be reached (set by each).
    unreachable: tuple[type[BaseException], ...] = ()

    def __init__(self, lease_ttl: float) -> None:
        self.lease_ttl = lease_ttl
        #: Who this process is, in the lease table (host, pid).
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self._held: dict[str, Lease] = {}
        #: When each held lease was last confirmed (monotonic time its acquisition or last
        #: renewal was sent): the server keeps it at least `lease_ttl` past that.
        self._confirmed: dict[str, float] = {}
        self._hub = SignalHub()
        self._tasks: list[asyncio.Task[None]] = []
        self._given_up: set[asyncio.Task[set[str]]] = set()
        self._started: asyncio.Future[None] | None = None
        self._closed = False
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

    # -- lifecycle -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _reachable(self) -> AsyncIterator[None]:
        """The block, its backend's connection failures a ServiceUnavailableError (503)."""
        try:
            yield
        except self.unreachable as exc:
            raise ServiceUnavailableError("The coordinator cannot be reached") from exc

    async def start(self) -> None:
        started = self._started
        if started is not None and started.done() and not self._closed and (
                started.cancelled() or started.exception() is not None):
            self._started = None  # the server was down: try again
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            try:
                await self._connect()
                ready = asyncio.get_running_loop().create_future()
                self._tasks = [asyncio.create_task(self._listen_forever(ready)),
                               asyncio.create_task(self._renew_forever())]
                await asyncio.wait([ready, self._tasks[0]],
                                   return_when=asyncio.FIRST_COMPLETED)
                self._started.set_result(None)
            except BaseException as exc:
                self._started.set_exception(exc)
                self._started.exception()  # retrieved: later callers re-raise it
                raise
        else:
            await asyncio.shield(self._started)

    async def _listen_forever(self, ready: asyncio.Future[None]) -> None:
        while True:
            try:
                await self._listen(ready)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Signals sent meanwhile are lost; followers poll the store slowly for that.
                _log.warning("coordinator lost its signal connection", error=str(exc))
            if not ready.done():
                ready.set_result(None)
            await asyncio.sleep(_RETRY)

    async def _renew_forever(self) -> None:
        interval = self.lease_ttl / 3
        while True:
            await asyncio.sleep(interval)
            held = list(self._held.values())
            if not held:
                continue
            sent = time.monotonic()
            oldest = min(self._confirmed.get(x.thread_id, sent) for x in held)
            try:
                lost = await self._bounded(self._renew(held),
                                           max(oldest + self.lease_ttl - sent, interval))
            except Exception as exc:
                _log.warning("could not renew leases", error=str(exc) or type(exc).__name__)
                # A lease that may expire before the next try could be taken by another
                # worker meanwhile: its run stops now, whatever the server says later.
                deadline = time.monotonic() + interval
                lost = {x.thread_id for x in held
                        if self._confirmed.get(x.thread_id, sent) + self.lease_ttl <= deadline}
            else:
                for lease in held:
                    if lease.thread_id not in lost and self._held.get(lease.thread_id) == lease:
                        self._confirmed[lease.thread_id] = sent
            for lease in held:
                if lease.thread_id in lost and self._held.get(lease.thread_id) == lease:
                    self._drop(lease)
                    _log.warning("lease lost; stopping its run", thread_id=lease.thread_id,
                                 run_id=lease.run_id)
                    self._hub.deliver(Signal("lost", lease.thread_id, lease.run_id))

    async def _bounded(self, call: Coroutine[Any, Any, set[str]], seconds: float) -> set[str]:
        """`call`'s result, or TimeoutError after `seconds`: a server that stopped answering
        must not hold the renewals past the leases' life. The call is cancelled but not
        waited for (a driver may take seconds more to give up on a hung server)."""
        task = asyncio.ensure_future(call)
        done, _ = await asyncio.wait([task], timeout=seconds)
        if task in done:
            return task.result()
        task.cancel()
        self._given_up.add(task)  # held until it ends: a pending task may not be collected
        task.add_done_callback(self._given_up.discard)
        task.add_done_callback(_retrieved)
        raise TimeoutError

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
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

    def _hold(self, lease: Lease, confirmed: float) -> Lease:
        self._held[lease.thread_id] = lease
        self._confirmed[lease.thread_id] = confirmed
        return lease

    def _drop(self, lease: Lease) -> None:
        if self._held.get(lease.thread_id) == lease:
            del self._held[lease.thread_id]
            self._confirmed.pop(lease.thread_id, None)
