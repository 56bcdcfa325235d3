"""The coordinator of one process: today's behaviour, and the default."""

from __future__ import annotations

from collections.abc import Callable

from copilot_runtime.coordination.base import Lease, Signal, SignalHub, Subscription, new_token
from copilot_runtime.limits import CounterBackend

__all__ = ["LocalCoordinator"]


class LocalCoordinator:
    """Leases and signals within this process. The runtime skips it on a run's path (its own
    table of active runs already keeps one run per thread), so it costs a run nothing."""

    shared = False
    lease_ttl = float("inf")

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._hub = SignalHub()

    async def start(self) -> None:
        return None

    async def acquire(self, thread_id: str, run_id: str) -> Lease | None:
        if thread_id in self._leases:
            return None
        lease = self._leases[thread_id] = Lease(thread_id, run_id, new_token())
        return lease

    async def release(self, lease: Lease) -> None:
        if self._leases.get(lease.thread_id) == lease:
            del self._leases[lease.thread_id]

    async def finish(self, lease: Lease) -> None:
        await self.release(lease)
        self._hub.deliver(Signal("end", lease.thread_id, lease.run_id))

    async def holder(self, thread_id: str) -> str | None:
        lease = self._leases.get(thread_id)
        return lease.run_id if lease is not None else None

    async def follow(self, thread_id: str) -> str | None:
        return await self.holder(thread_id)  # every signal is delivered here anyway

    async def forget_expired(self, older_than: float) -> int:
        return 0  # this process's leases end with their runs

    async def publish(self, signal: Signal) -> None:
        self._hub.deliver(signal)

    def subscribe(self, thread_id: str) -> Subscription:
        return self._hub.subscribe(thread_id)

    def on_stop(self, handler: Callable[[Signal], object]) -> None:
        self._hub.stop_handler = handler

    def counters(self) -> CounterBackend | None:
        return None  # the rate limiter's own, in this process

    async def aclose(self) -> None:
        return None
