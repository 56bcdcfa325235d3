"""Rate limits: how many runs a caller may start per minute, and have going at once.

`CopilotRuntime(rate_limit=RateLimit(runs_per_minute=..., concurrent_runs=...))` counts per
principal, or per client address for anonymous callers. A caller over its limit gets
`RateLimitedError` (HTTP 429 with `Retry-After`) before its run starts; everybody else is
unaffected. Counters live in a `CounterBackend`: in this process by default, or in Redis
(`backend="redis://..."`, the `redis` extra) so that every worker shares them.

Runs per minute are a sliding window (a log of start times), so a caller cannot double its
rate across a minute boundary. Only runs that start count: a request refused once counted
(a busy thread, another caller's thread, a store away) gives its hit back. A concurrency
slot is held by a token, one per run, that expires `slot_ttl` seconds after its last
renewal on a shared backend: the limiter renews the slots of this process's live runs, so a
slot whose worker died frees itself within seconds, and a slot whose `acquire` failed
half-way can be given back by its token alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import time
import uuid
from collections import deque
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import structlog

from copilot_runtime._exceptions import (
    ConfigurationError,
    RateLimitedError,
    ServiceUnavailableError,
)
from copilot_runtime._redis_client import (
    DEFAULT_POOL_SIZE,
    bounded_redis,
    cannot_serve_now,
    checked_redis_url,
)
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

_log = structlog.get_logger("copilot_runtime.limits")

_WINDOW = 60.0
#: Seconds a shared backend's concurrency slot outlives its last renewal, as a coordinator's
#: `lease_ttl`: a dead worker's slots free themselves within this long.
DEFAULT_SLOT_TTL = 10.0


@runtime_checkable
class CounterBackend(Protocol):
    #: Seconds a slot lives past its acquisition or last renewal (a dead worker's slots free
    #: themselves after this long); None: a slot lives until released (this process's own).
    slot_ttl: float | None

    async def hit(self, key: str, limit: int, window: float, token: str | None = None
                  ) -> float:
        """Count one event, named `token`, in the sliding `window` unless `limit` are in it
        already: 0.0 if counted, else the seconds until one leaves the window."""
        ...

    async def unhit(self, key: str, token: str) -> None:
        """Forget the event `token` counted (nothing happens if it is not counted)."""
        ...

    async def acquire(self, key: str, limit: int, token: str) -> bool:
        """Hold one of `limit` slots of `key` as `token` (for `slot_ttl`), or False."""
        ...

    async def renew(self, holds: Sequence[tuple[str, str]]) -> set[str]:
        """Extend each (key, token) hold by `slot_ttl`; the tokens no longer held."""
        ...

    async def release(self, key: str, token: str) -> None:
        """Give back `token`'s slot (nothing happens if it is not held)."""
        ...

    async def aclose(self) -> None:
        ...


class InMemoryCounters:
    """Counters of this process (each worker counts on its own)."""

    #: Slots die with the process that holds them: nothing to renew.
    slot_ttl: float | None = None

    def __init__(self, max_keys: int = 100_000) -> None:
        #: Each key's hits, oldest first: (when, token).
        self._hits: dict[str, deque[tuple[float, str | None]]] = {}
        self._slots: dict[str, set[str]] = {}
        self.max_keys = max_keys
        #: While full of live keys: when the first of them leaves its window (monotonic).
        self._full_until = 0.0

    async def hit(self, key: str, limit: int, window: float, token: str | None = None
                  ) -> float:
        now = time.monotonic()
        log = self._hits.get(key)
        if log is None:
            if len(self._hits) >= self.max_keys and now >= self._full_until:
                self._prune(now, window)
            if len(self._hits) >= self.max_keys:
                # Full of callers whose windows are live (many callers, or many addresses of
                # one): forgetting any would reset its limit, so every new caller waits for
                # the first window to end (not scanned again before then).
                wait = self._full_until - now
                raise RateLimitedError("Too many callers at once; try again in "
                                       f"{int(wait) + 1} s", int(wait) + 1)
            log = self._hits[key] = deque()
        while log and log[0][0] <= now - window:
            log.popleft()
        if len(log) >= limit:
            return log[0][0] + window - now
        log.append((now, token))
        return 0.0

    async def unhit(self, key: str, token: str) -> None:
        log = self._hits.get(key)
        if log is not None:
            counted = next((entry for entry in log if entry[1] == token), None)
            if counted is not None:
                log.remove(counted)

    def _prune(self, now: float, window: float) -> None:
        """Forget the keys with no hit left in their window; note when the next one ends."""
        for key in [k for k, log in self._hits.items()
                    if not log or log[-1][0] <= now - window]:
            del self._hits[key]
        self._full_until = min((log[-1][0] + window for log in self._hits.values()),
                               default=now)

    async def acquire(self, key: str, limit: int, token: str) -> bool:
        held = self._slots.get(key)
        if held is not None and len(held) >= limit:
            return False
        self._slots.setdefault(key, set()).add(token)
        return True

    async def renew(self, holds: Sequence[tuple[str, str]]) -> set[str]:
        return {token for key, token in holds if token not in self._slots.get(key, ())}

    async def release(self, key: str, token: str) -> None:
        held = self._slots.get(key)
        if held is not None:
            held.discard(token)
            if not held:
                del self._slots[key]

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
#: Redis' clock in milliseconds, as `now` (every worker then measures expiry the same way).
_NOW = """
local clock = redis.call('TIME')
local now = clock[1] * 1000 + math.floor(clock[2] / 1000)
"""
#: The set lasts as long as its longest hold, `ttl` ms from now (never shortened: a worker
#: with a longer ttl may hold a slot in it).
_KEEP = """
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
"""
# KEYS[1] the caller's holds, a sorted set of tokens scored by when each expires (ms);
# ARGV: token, ttl (ms), limit. Expired holds (their workers died) are dropped first.
_ACQUIRE = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], now + ARGV[2], ARGV[1])
""" + _KEEP + "return 1"
# The same keys and ARGV: extended only while it has not expired (it may count as free).
_RENEW = _NOW + """
local expires = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expires or tonumber(expires) <= now then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now + ARGV[2], ARGV[1])
""" + _KEEP + "return 1"


class RedisCounters:
    """Counters in Redis, shared by every worker that uses the same URL and prefix.

    Each check is one Lua script, so concurrent workers cannot both take the last slot. The
    keys start with `prefix`, else with the URL's `prefix` (as on a coordinator's URL,
    `copilot-runtime:` by default) followed by `limits:`.
    """

    def __init__(self, url: str, *, prefix: str | None = None,
                 name: str = "The rate limits' Redis", timeout: float = 5.0,
                 pool_size: int | None = None, slot_ttl: float = DEFAULT_SLOT_TTL) -> None:
        try:
            from redis.exceptions import ConnectionError, TimeoutError
        except ImportError as exc:
            raise ConfigurationError(
                "Redis rate limits need redis-py: pip install 'copilot-runtime[redis]'") from exc
        self.slot_ttl: float | None = slot_ttl
        #: Who cannot be reached, in the 503 a request gets while Redis is away.
        self.name = name
        self._unreachable = (ConnectionError, TimeoutError)
        url, options = split_options(url, ("pool_size", "prefix"))
        checked_redis_url(url)
        if prefix is None:
            # The URL's `prefix` names a deployment's keys as on a coordinator's URL (the
            # same URL there and here shares the counters): they live under its `limits:`.
            prefix = options.get("prefix", "copilot-runtime:") + "limits:"
        self.prefix = prefix
        if pool_size is None:
            pool_size = pool_size_option(options, DEFAULT_POOL_SIZE)
        # Bounded: a request waits on these before its run starts.
        self._redis: Any = bounded_redis(url, size=pool_size, wait=timeout,
                                         socket_connect_timeout=timeout,
                                         socket_timeout=timeout)
        self._hit = self._redis.register_script(_HIT)
        self._acquire = self._redis.register_script(_ACQUIRE)

    async def hit(self, key: str, limit: int, window: float, token: str | None = None
                  ) -> float:
        with self._reachable():
            # Redis' clock, not ours: every worker then measures the window the same way.
            seconds, micros = await self._redis.time()
            now = seconds + micros / 1e6
            member = token if token is not None else f"{now}:{uuid.uuid4().hex[:8]}"
            result = await self._hit(keys=[self.prefix + "rate:" + key],
                                     args=[now, window, limit, member])
        return float(result)

    async def unhit(self, key: str, token: str) -> None:
        with self._reachable():
            await self._redis.zrem(self.prefix + "rate:" + key, token)

    def _holds(self, key: str) -> str:
        # Not the `slots:` counters of earlier releases: workers of both can run during an
        # upgrade, and a sorted set under a counter's name would fail (WRONGTYPE).
        return self.prefix + "holds:" + key

    def _ttl_ms(self) -> int:
        assert self.slot_ttl is not None
        return int(self.slot_ttl * 1000)

    async def acquire(self, key: str, limit: int, token: str) -> bool:
        with self._reachable():
            return bool(await self._acquire(keys=[self._holds(key)],
                                            args=[token, self._ttl_ms(), limit]))

    async def renew(self, holds: Sequence[tuple[str, str]]) -> set[str]:
        with self._reachable():
            # One round trip for every live slot of this process.
            async with self._redis.pipeline(transaction=False) as pipe:
                for key, token in holds:
                    pipe.eval(_RENEW, 1, self._holds(key), token, self._ttl_ms())
                kept = await pipe.execute()
        return {token for (_, token), ok in zip(holds, kept, strict=True) if not ok}

    @contextlib.contextmanager
    def _reachable(self) -> Iterator[None]:
        """The block; Redis' connection failures and timeouts, and the answers of a server
        that cannot serve now, a ServiceUnavailableError (503 and Retry-After)."""
        try:
            yield
        except self._unreachable as exc:
            raise ServiceUnavailableError(f"{self.name} cannot be reached") from exc
        except Exception as exc:
            # A server that answers but cannot serve now (a replica after a failover, out of
            # memory...) is as unavailable as one that cannot be reached; a command's own
            # error (a bug) is not the server's state.
            if not cannot_serve_now(exc):
                raise
            raise ServiceUnavailableError(f"{self.name} cannot serve now") from exc

    async def release(self, key: str, token: str) -> None:
        with self._reachable():
            await self._redis.zrem(self._holds(key), token)

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
    """What a run's start counted for its caller: its concurrency slot, held by `token`
    while the run lives (its limiter renews it) and given back once when the run ends
    (None: no concurrency limit), and its hit of the runs per minute, `hit` (None: no such
    limit), given back only if the run never starts."""

    __slots__ = ("_limiter", "_released", "hit", "key", "token")

    def __init__(self, limiter: RateLimiter, key: str, token: str | None,
                 hit: str | None = None) -> None:
        self._limiter = limiter
        self.key = key
        self.token = token
        self.hit = hit
        self._released = False

    async def give_back(self) -> None:
        """Uncount the run: it was refused after its caller's limits counted it (a busy
        thread, a store away), so neither its slot nor its start counts."""
        hit, self.hit = self.hit, None
        unhit = getattr(self._limiter.backend, "unhit", None)
        if hit is not None and unhit is not None:
            try:
                await unhit(self.key, hit)
            except Exception as exc:  # counted until it leaves the window
                _log.warning("could not give a caller's run start back", key=self.key,
                             error=str(exc) or type(exc).__name__)
        await self.release()

    async def release(self) -> None:
        """Give the slot back (once; nothing happens without one)."""
        if self._released or self.token is None:
            return
        self._released = True
        # Renewed no more: on a shared backend it expires within `slot_ttl` whatever follows.
        self._limiter._live.pop(self.token, None)
        if self._limiter._closed:
            return  # left to expire, as the slots still held at the close are
        backend = self._limiter.backend
        try:
            await backend.release(self.key, self.token)
        except Exception as exc:
            _log.warning("could not give a caller's concurrency slot back; trying again",
                         key=self.key, error=str(exc) or type(exc).__name__,
                         expires_in=backend.slot_ttl)
            _retry_release(backend, self.key, self.token)
            raise

    async def release_quietly(self) -> None:
        """`release`, its failure logged and retried in the background but not raised: for a
        run's end, where nobody is left to hear it."""
        with contextlib.suppress(Exception):
            await self.release()

    def end(self) -> asyncio.Task[None] | None:
        """Give the slot back in a task of its own, as a run's end does (None: nothing to
        give back)."""
        if self._released or self.token is None:
            return None
        return asyncio.get_running_loop().create_task(self.release_quietly())


_background: set[asyncio.Task[None]] = set()


def _in_background(work: Coroutine[Any, Any, None]) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no running loop: nothing to do it with
        work.close()
        return
    task = loop.create_task(work)
    _background.add(task)
    task.add_done_callback(_background.discard)


def _retry_release(backend: CounterBackend, key: str, token: str, delay: float = 2.0) -> None:
    """Give `token`'s slot back in the background, every `delay` seconds while it may still
    be held (its `slot_ttl`; a minute for a slot that never expires). One task: each failed
    attempt is not a new one; and a release by token is safe to repeat."""
    lives = backend.slot_ttl if backend.slot_ttl is not None else 60.0

    async def again() -> None:
        for _ in range(max(1, math.ceil(lives / delay))):
            await asyncio.sleep(delay)
            with contextlib.suppress(Exception):
                await backend.release(key, token)
                return
        if backend.slot_ttl is None:
            _log.warning("gave up giving a caller's concurrency slot back: it stays taken",
                         key=key)

    _in_background(again())


async def _quietly_release(backend: CounterBackend, key: str, token: str) -> None:
    with contextlib.suppress(Exception):  # else it expires: nobody renews it
        await backend.release(key, token)


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
        #: The slots this process's live runs hold, by token: renewed together.
        self._live: dict[str, Lease] = {}
        self._renewing: asyncio.Task[None] | None = None
        #: Set by `aclose`: a backend's connections are gone (a coordinator's counters
        #: share its pool), so nothing is asked of it any more.
        self._closed = False

    async def acquire(self, request: RequestInfo) -> Lease:
        """Count a run start for `request`'s caller: what was counted (a concurrency slot,
        released when the run ends; given back whole if the run never starts), or
        `RateLimitedError`."""
        if self._closed:
            raise ServiceUnavailableError("The rate limits are closed (the runtime shut down)")
        key = limit_key(request)
        limit = self.limit
        lease = Lease(self, key, None)
        if limit.concurrent_runs is not None:
            token = uuid.uuid4().hex
            try:
                taken = await self.backend.acquire(key, limit.concurrent_runs, token)
            except BaseException:
                # The answer was lost, maybe not the slot (a timeout after the server took
                # it): given back by its token, which frees nobody else's.
                _in_background(_quietly_release(self.backend, key, token))
                raise
            if not taken:
                # A slot frees when a run ends, any moment (or within `slot_ttl` of its
                # worker's death): worth asking again soon.
                raise RateLimitedError(
                    f"Too many runs at once (at most {limit.concurrent_runs}); "
                    "wait for one to finish", 1)
            lease = self._hold(key, token)
        if limit.runs_per_minute is not None:
            backend = self.backend
            hit = uuid.uuid4().hex
            try:
                # A backend without `unhit` (written for an earlier release) names no hits:
                # its count is not given back.
                wait = await (backend.hit(key, limit.runs_per_minute, _WINDOW, token=hit)
                              if hasattr(backend, "unhit")
                              else backend.hit(key, limit.runs_per_minute, _WINDOW))
            except BaseException:
                # The slot taken above goes back with the 503.
                with contextlib.suppress(Exception):
                    await lease.release()
                raise
            if wait > 0:
                await lease.release()
                raise RateLimitedError(
                    f"Too many runs (at most {limit.runs_per_minute} a minute); "
                    f"try again in {int(wait) + 1} s", int(wait) + 1)
            lease.hit = hit
        return lease

    def _hold(self, key: str, token: str) -> Lease:
        lease = self._live[token] = Lease(self, key, token)
        ttl = self.backend.slot_ttl
        if ttl is not None and (self._renewing is None or self._renewing.done()):
            # A context of its own: its logs are no request's (not the one that started it).
            self._renewing = asyncio.get_running_loop().create_task(
                self._renew(ttl), context=contextvars.Context())
        return lease

    async def _renew(self, ttl: float) -> None:
        """Renew every live slot in one call, every third of `ttl`, until none is left
        (started again with the next slot taken)."""
        while True:
            await asyncio.sleep(ttl / 3)
            held = list(self._live.items())
            if not held:
                return
            try:
                lost = await self.backend.renew([(x.key, token) for token, x in held])
            except Exception as exc:
                # Tried again at the next turn; a slot that expires meanwhile is free.
                _log.warning("could not renew callers' concurrency slots", slots=len(held),
                             error=str(exc) or type(exc).__name__)
                continue
            for token, lease in held:
                if token in lost and self._live.pop(token, None) is not None:
                    # The backend was away longer than `ttl`: its run goes on, uncounted.
                    _log.warning("a caller's concurrency slot expired while its run lives",
                                 key=lease.key)

    def reopen(self) -> None:
        """Count again after `aclose` (its runtime started again): the backend connects
        again as it is asked (the built-in ones do)."""
        self._closed = False

    async def aclose(self) -> None:
        # Slots still held are left to expire, as a coordinator's leases are.
        self._closed = True
        if self._renewing is not None:
            self._renewing.cancel()
            await asyncio.gather(self._renewing, return_exceptions=True)
        self._live.clear()
        await self.backend.aclose()
