"""What every coordinator offers: leases on threads, and signals between workers.

A run holds its thread's lease while it lives, so no other worker starts a run there; the
coordinator renews the leases this process holds until they are released, so a lease of a
worker that died expires after `lease_ttl` seconds. Signals are small (a thread, a run, a
position): `progress` says a run's events up to a position are in the thread store, `end`
that the run is over, `stop` asks the worker that drives the run to stop it. Events
themselves are never signalled; followers read them from the shared thread store.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import orjson

from copilot_runtime.events import runtime_code
from copilot_runtime.limits import CounterBackend

__all__ = ["LEASE_LOST_CODE", "Coordinator", "Lease", "Signal", "SignalHub", "Subscription",
           "new_token"]

#: The code of the `RUN_ERROR` that ends a run whose worker could not keep its thread's
#: lease (the coordinator unreachable for the lease's life, or the lease taken over).
LEASE_LOST_CODE = runtime_code("LEASE_LOST")

#: `lost` never crosses workers: this process could not keep a thread's lease, so it stops
#: the thread's run before another worker may start one.
SignalKind = Literal["progress", "end", "stop", "lost"]


@dataclass(frozen=True, slots=True)
class Lease:
    """A thread held for one run; `token` proves who holds it."""

    thread_id: str
    run_id: str
    token: str
    #: Whether the thread's previous lease expired instead of being released: its run's
    #: worker died, and the run may still be open in the thread store.
    inherited: bool = False


@dataclass(frozen=True, slots=True)
class Signal:
    kind: SignalKind
    thread_id: str
    run_id: str | None = None
    #: `progress`: the thread position up to which the run's events are stored.
    position: int | None = None
    #: `stop`: for the thread's run, whichever it is (a stop naming no run); the one named
    #: may have ended, its lease on its way back, the thread's next run waiting for it.
    whole: bool = False

    def encode(self) -> bytes:
        raw: dict[str, object] = {"k": self.kind, "t": self.thread_id, "r": self.run_id,
                                  "p": self.position}
        if self.whole:  # only then: a worker of the previous version decodes it as before
            raw["w"] = True
        return orjson.dumps(raw)

    @classmethod
    def decode(cls, data: bytes | str) -> Signal | None:
        """The signal in `data`, or None for anything that is not one."""
        try:
            raw = orjson.loads(data)
            kind, thread_id = raw["k"], raw["t"]
            run_id, position, whole = raw.get("r"), raw.get("p"), raw.get("w", False)
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return None
        if kind not in ("progress", "end", "stop") or not isinstance(thread_id, str) or (
                run_id is not None and not isinstance(run_id, str)) or (
                position is not None and not isinstance(position, int)) or (
                not isinstance(whole, bool)):
            return None
        return cls(kind, thread_id, run_id, position, whole)


def new_token() -> str:
    return uuid.uuid4().hex


class Subscription:
    """The signals of one thread that reach this process, from now until `close`."""

    def __init__(self, hub: SignalHub, thread_id: str) -> None:
        self.hub = hub
        self.thread_id = thread_id
        self.queue: asyncio.Queue[Signal] = asyncio.Queue()

    async def get(self, wait: float) -> Signal | None:
        """The next signal, or None after `wait` seconds without one."""
        try:
            async with asyncio.timeout(wait):
                return await self.queue.get()
        except TimeoutError:
            return None

    def close(self) -> None:
        self.hub.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SignalHub:
    """Hands the signals this process receives to its subscriptions and its stop handler."""

    def __init__(self) -> None:
        self._subscriptions: dict[str, set[Subscription]] = {}
        self.stop_handler: Callable[[Signal], object] | None = None

    def subscribe(self, thread_id: str) -> Subscription:
        subscription = Subscription(self, thread_id)
        self._subscriptions.setdefault(thread_id, set()).add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        found = self._subscriptions.get(subscription.thread_id)
        if found is not None:
            found.discard(subscription)
            if not found:
                del self._subscriptions[subscription.thread_id]

    def deliver(self, signal: Signal) -> None:
        if signal.kind in ("stop", "lost") and self.stop_handler is not None:
            self.stop_handler(signal)
        for subscription in self._subscriptions.get(signal.thread_id, ()):
            subscription.queue.put_nowait(signal)


@runtime_checkable
class Coordinator(Protocol):
    """Leases and signals shared by the workers of one deployment."""

    #: Whether other processes take part (False: this process alone, the default).
    shared: bool
    #: Seconds a lease outlives its last renewal (how long a dead worker's run blocks).
    lease_ttl: float

    async def start(self) -> None:
        """Connect and begin receiving signals and renewing leases (idempotent)."""
        ...

    async def acquire(self, thread_id: str, run_id: str) -> Lease | None:
        """The thread's lease for `run_id`, or None while another run holds it."""
        ...

    async def release(self, lease: Lease) -> None:
        """Give the lease back (nothing happens if it was lost meanwhile)."""
        ...

    async def finish(self, lease: Lease) -> None:
        """Release `lease` and signal `end` for its run (one round trip where possible)."""
        ...

    async def holder(self, thread_id: str) -> str | None:
        """The run id holding the thread's lease now, or None."""
        ...

    async def follow(self, thread_id: str) -> str | None:
        """`holder`, and from now on the `progress` and `end` signals of the run holding the
        thread reach this process's subscriptions. A coordinator may send a run's signals
        only once someone follows it (`stop` signals are always sent)."""
        ...

    async def forget_expired(self, older_than: float) -> int:
        """Delete leases that expired more than `older_than` seconds ago and were never
        released (their workers died); how many. A no-op where leases expire by themselves."""
        ...

    async def publish(self, signal: Signal) -> None:
        """Send `signal` to every worker, this one included."""
        ...

    def subscribe(self, thread_id: str) -> Subscription:
        """Receive the thread's signals from now on (until the subscription is closed)."""
        ...

    def on_stop(self, handler: Callable[[Signal], object]) -> None:
        """Call `handler` with every `stop` signal this process receives."""
        ...

    def counters(self) -> CounterBackend | None:
        """Rate-limit counters every worker shares (None: this process's own)."""
        ...

    async def aclose(self) -> None:
        """Stop renewing and listening. Leases still held are left to expire."""
        ...
