"""Rate limits: how many runs a caller may start per minute, and have going at once.

`CopilotRuntime(rate_limit=RateLimit(runs_per_minute=..., concurrent_runs=...))` counts per
principal, or per client address for anonymous callers. A caller over its limit gets
`RateLimitedError` (HTTP 429 with `Retry-After`) before its run starts; everybody else is
unaffected. Counters live in a `CounterBackend`: in this process by default, or in Redis
(`backend="redis://..."`, the `redis` extra) so that every worker shares them.

Runs per minute are a sliding window (a log of start times), so a caller cannot double its
rate across a minute boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from copilot_runtime._exceptions import (
    ConfigurationError,
    RateLimitedError,
    ServiceUnavailableError,
)
from copilot_runtime._redis_client import DEFAULT_POOL_SIZE, bounded_redis
from copilot_runtime._url_options import pool_size_option, split_options
from copilot_runtime.auth import RequestInfo

__all__ = [
    "CounterBackend",
    "InMemoryCounters",
    "RateLimit",
    "RateLimiter",
    "RedisCounters",
    "limit_key",
]

_WINDOW = 60.0
#: A concurrency slot a crashed worker never gave back frees itself after this long.
_SLOT_TTL = 3600


@runtime_checkable
class CounterBackend(Protocol):
    async def hit(self, key: str, limit: int, window: float) -> float:
        """Count one event in the sliding `window` unless `limit` are in it already: 0.0 if
        counted, else the seconds until one leaves the window."""
        ...

    async def acquire(self, key: str, limit: int) -> bool:
        """Take one of `limit` slots, or False."""
        ...

    async def release(self, key: str) -> None:
        ...

    async def aclose(self) -> None:
        ...


class InMemoryCounters:
    """Counters of this process (each worker counts on its own)."""

    def __init__(self, max_keys: int = 100_000) -> None:
        self._hits: dict[str, deque[float]] = {}
        self._slots: dict[str, int] = {}
        self.max_keys = max_keys

    async def hit(self, key: str, limit: int, window: float) -> float:
        now = time.monotonic()
        log = self._hits.get(key)
        if log is None:
            if len(self._hits) >= self.max_keys:
                self._prune(now, window)
                # Still full of live keys (many callers, or many addresses of one): evict the
                # oldest tenth rather than scan them all again for the next new caller.
                if len(self._hits) >= self.max_keys:
                    for old in list(itertools.islice(self._hits, self.max_keys // 10 or 1)):
                        del self._hits[old]
            log = self._hits[key] = deque()
        while log and log[0] <= now - window:
            log.popleft()
        if len(log) >= limit:
            return log[0] + window - now
        log.append(now)
        return 0.0

    def _prune(self, now: float, window: float) -> None:
        for key in [k for k, log in self._hits.items() if not log or log[-1] <= now - window]:
            del self._hits[key]

    async def acquire(self, key: str, limit: int) -> bool:
        taken = self._slots.get(key, 0)
        if taken >= limit:
            return False
        self._slots[key] = taken + 1
        return True

    async def release(self, key: str) -> None:
        taken = self._slots.get(key, 0) - 1
        if taken > 0:
            self._slots[key] = taken
        else:
            self._slots.pop(key, None)

    async def aclose(self) -> None:
        self._hits.clear()
        self._slots.clear()


# KEYS[1] the log (a sorted set of start times); ARGV: now, window, limit, member.
_HIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1] - ARGV[2])
local count = redis.call('ZCARD', KEYS[1])
if count >= tonumber(ARGV[3]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tostring(oldest[2] + ARGV[2] - ARGV[1])
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4])
redis.call('EXPIRE', KEYS[1], math.ceil(ARGV[2]) + 1)
return '0'
"""
# KEYS[1] the slot counter; ARGV: limit, ttl.
_ACQUIRE = """
local taken = tonumber(redis.call('GET', KEYS[1]) or '0')
if taken >= tonumber(ARGV[1]) then return 0 end
if redis.call('INCR', KEYS[1]) == 1 then
  -- set once per busy period: a slot a dead worker kept frees itself at the latest
  -- `ttl` after the period began, however active its caller stays
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return 1
"""
_RELEASE = """
local taken = tonumber(redis.call('GET', KEYS[1]) or '0')
if taken <= 1 then redis.call('DEL', KEYS[1]) else redis.call('DECR', KEYS[1]) end
return 1
"""


class RedisCounters:
    """Counters in Redis, shared by every worker that uses the same URL and prefix.

    Each check is one Lua script, so concurrent workers cannot both take the last slot.
    """

    def __init__(self, url: str, *, prefix: str = "copilot-runtime:limits:",
                 name: str = "The rate limits' Redis", timeout: float = 5.0,
                 pool_size: int | None = None) -> None:
        try:
            from redis.exceptions import ConnectionError, TimeoutError
        except ImportError as exc:
            raise ConfigurationError(
                "Redis rate limits need redis-py: pip install 'copilot-runtime[redis]'") from exc
        self.prefix = prefix
        #: Who cannot be reached, in the 503 a request gets while Redis is away.
        self.name = name
        self._unreachable = (ConnectionError, TimeoutError)
        url, options = split_options(url, ("pool_size",))
        if pool_size is None:
            pool_size = pool_size_option(options, DEFAULT_POOL_SIZE)
        # Bounded: a request waits on these before its run starts.
        self._redis: Any = bounded_redis(url, size=pool_size, wait=timeout,
                                         socket_connect_timeout=timeout,
                                         socket_timeout=timeout)
        self._hit = self._redis.register_script(_HIT)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._release = self._redis.register_script(_RELEASE)

    async def hit(self, key: str, limit: int, window: float) -> float:
        with self._reachable():
            # Redis' clock, not ours: every worker then measures the window the same way.
            seconds, micros = await self._redis.time()
            now = seconds + micros / 1e6
            result = await self._hit(keys=[self.prefix + "rate:" + key],
                                     args=[now, window, limit, f"{now}:{uuid.uuid4().hex[:8]}"])
        return float(result)

    async def acquire(self, key: str, limit: int) -> bool:
        with self._reachable():
            return bool(await self._acquire(keys=[self.prefix + "slots:" + key],
                                            args=[limit, _SLOT_TTL]))

    @contextlib.contextmanager
    def _reachable(self) -> Iterator[None]:
        """The block, Redis' connection failures and timeouts a ServiceUnavailableError."""
        try:
            yield
        except self._unreachable as exc:
            raise ServiceUnavailableError(f"{self.name} cannot be reached") from exc

    async def release(self, key: str) -> None:
        with self._reachable():
            await self._release(keys=[self.prefix + "slots:" + key])

    async def aclose(self) -> None:
        await self._redis.aclose()


@dataclass(frozen=True, slots=True)
class RateLimit:
    """Limits per caller. `backend`: None (this process), a `redis://` URL, or any
    `CounterBackend`."""

    runs_per_minute: int | None = None
    concurrent_runs: int | None = None
    backend: CounterBackend | str | None = None

    def __post_init__(self) -> None:
        for name in ("runs_per_minute", "concurrent_runs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"RateLimit.{name} must be a positive integer")
        if self.runs_per_minute is None and self.concurrent_runs is None:
            raise ConfigurationError("RateLimit needs runs_per_minute or concurrent_runs")


def limit_key(request: RequestInfo) -> str:
    principal = request.principal
    if principal is not None:
        # Lengths first: ids and tenants may hold ':', and must not run into each other.
        tenant = principal.tenant
        return (f"p:{len(principal.id)}:{principal.id}" if tenant is None
                else f"t:{len(tenant)}:{tenant}:{principal.id}")
    return f"a:{request.client or 'unknown'}"


class Lease:
    """A caller's concurrency slot, given back once when its run ends."""

    __slots__ = ("_backend", "_key", "_released")

    def __init__(self, backend: CounterBackend, key: str) -> None:
        self._backend = backend
        self._key = key
        self._released = False

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            await self._backend.release(self._key)
        except Exception:
            # The backend is away for a moment: the slot must not stay taken for an hour.
            _retry_release(self._backend, self._key)
            raise


_retrying: set[asyncio.Task[None]] = set()


def _retry_release(backend: CounterBackend, key: str, attempts: int = 30,
                   delay: float = 2.0) -> None:
    """Give `key`'s slot back in the background, trying `attempts` times `delay` apart
    (one task: each failed attempt is not a new one)."""
    async def again() -> None:
        for _ in range(attempts):
            await asyncio.sleep(delay)
            with contextlib.suppress(Exception):
                await backend.release(key)
                return

    with contextlib.suppress(RuntimeError):  # no running loop: nothing to retry with
        task = asyncio.get_running_loop().create_task(again())
        _retrying.add(task)
        task.add_done_callback(_retrying.discard)


class RateLimiter:
    def __init__(self, limit: RateLimit) -> None:
        self.limit = limit
        backend = limit.backend
        if backend is None:
            backend = InMemoryCounters()
        elif isinstance(backend, str):
            if not backend.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigurationError("RateLimit.backend: a redis:// URL or a CounterBackend")
            backend = RedisCounters(backend)
        self.backend: CounterBackend = backend
        self._lock = asyncio.Lock()

    async def acquire(self, request: RequestInfo) -> Lease | None:
        """Count a run start for `request`'s caller; its concurrency lease (None without a
        concurrency limit), or `RateLimitedError`."""
        key = limit_key(request)
        limit = self.limit
        lease: Lease | None = None
        if limit.concurrent_runs is not None:
            if not await self.backend.acquire(key, limit.concurrent_runs):
                raise RateLimitedError(
                    f"Too many runs at once (at most {limit.concurrent_runs}); "
                    "wait for one to finish", 1)
            lease = Lease(self.backend, key)
        if limit.runs_per_minute is not None:
            try:
                wait = await self.backend.hit(key, limit.runs_per_minute, _WINDOW)
            except BaseException:
                if lease is not None:  # the slot taken above goes back with the 503
                    with contextlib.suppress(Exception):
                        await lease.release()
                raise
            if wait > 0:
                if lease is not None:
                    await lease.release()
                raise RateLimitedError(
                    f"Too many runs (at most {limit.runs_per_minute} a minute); "
                    f"try again in {int(wait) + 1} s", int(wait) + 1)
        return lease

    async def aclose(self) -> None:
        await self.backend.aclose()
