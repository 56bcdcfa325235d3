"""What the shared coordinators have in common: the leases this process holds, renewed in one
batch every third of their time to live, and one task receiving every worker's signals."""

from __future__ import annotations

import asyncio
import os
import socket
import urllib.parse
from collections.abc import Callable

import structlog

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime.coordination.base import Lease, Signal, SignalHub, Subscription

__all__ = ["SharedCoordinator", "split_options"]

_log = structlog.get_logger("copilot_runtime.coordination")

#: A lease's default time to live: a dead worker's thread is free again within this long.
DEFAULT_LEASE_TTL = 10.0
#: The longest wait before retrying a lost connection for signals.
_RETRY = 1.0


def split_options(url: str, names: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """`url` without the query parameters in `names`, and their values."""
    parts = urllib.parse.urlsplit(url)
    kept, options = [], {}
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if key in names:
            options[key] = value
        else:
            kept.append((key, value))
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(kept))), options


def lease_ttl_option(options: dict[str, str], default: float) -> float:
    raw = options.get("lease_ttl")
    if raw is None:
        return default
    try:
        ttl = float(raw)
    except ValueError:
        raise ConfigurationError(f"lease_ttl must be a number of seconds, got {raw!r}") from None
    if not 0.2 <= ttl <= 3600:
        raise ConfigurationError("lease_ttl must be between 0.2 and 3600 seconds")
    return ttl


class SharedCoordinator:
    shared = True

    def __init__(self, lease_ttl: float) -> None:
        self.lease_ttl = lease_ttl
        #: Who this process is, in the lease table (host, pid).
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self._held: dict[str, Lease] = {}
        self._hub = SignalHub()
        self._tasks: list[asyncio.Task[None]] = []
        self._started: asyncio.Future[None] | None = None
        self._closed = False

    # -- what each backend provides ------------------------------------------------------

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

    async def start(self) -> None:
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
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            held = list(self._held.values())
            if not held:
                continue
            try:
                lost = await self._renew(held)
            except Exception as exc:
                _log.warning("could not renew leases", error=str(exc))
                continue
            for thread_id in lost:
                lease = self._held.pop(thread_id, None)
                if lease is not None:
                    # Another worker may start a run on the thread now: stop ours.
                    _log.warning("lease lost; stopping its run", thread_id=thread_id,
                                 run_id=lease.run_id)
                    self._hub.deliver(Signal("stop", thread_id, lease.run_id))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._held.clear()
        if self._started is not None:
            await self._disconnect()

    # -- signals -------------------------------------------------------------------------

    def subscribe(self, thread_id: str) -> Subscription:
        return self._hub.subscribe(thread_id)

    def on_stop(self, handler: Callable[[Signal], object]) -> None:
        self._hub.stop_handler = handler

    def _hold(self, lease: Lease) -> Lease:
        self._held[lease.thread_id] = lease
        return lease

    def _drop(self, lease: Lease) -> None:
        if self._held.get(lease.thread_id) == lease:
            del self._held[lease.thread_id]
