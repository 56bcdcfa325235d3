"""Coordination on Redis: leases by `SET NX PX` with a token, signals by pub/sub.

`redis://host:port/N?prefix=P&lease_ttl=SECONDS&pool_size=N` (the `redis` extra;
`pool_size`: the most connections commands use at once, 10 by default, beside the one that
listens for signals; a command waits for a free one rather than opening more). A lease is renewed,
and released, only by the holder of its token (a compare-and-set script), so a worker whose
lease expired cannot extend or delete its successor's.

A run's `progress` and `end` are published only once another worker follows it (`follow`
marks the thread with the run's id, and the scripts that publish them read the mark): every
worker subscribed to the channel receives, and decodes, every message published on it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from copilot_runtime._deadline import within
from copilot_runtime._redis_client import (
    DEFAULT_POOL_SIZE,
    bounded_redis,
    cannot_serve_now,
    checked_redis_url,
)
from copilot_runtime._url_options import (
    lease_ttl_option,
    pool_size_option,
    split_options,
)
from copilot_runtime.coordination._shared import (
    DEFAULT_LEASE_TTL,
    PING_EVERY,
    PONG_WITHIN,
    SharedCoordinator,
)
from copilot_runtime.coordination.base import Lease, Signal
from copilot_runtime.limits import CounterBackend, RedisCounters

__all__ = ["RedisCoordinator"]

#: How long a dead worker's `open:` marker outlives its lease (seconds): the sweep of any
#: live worker closes the run, and removes the marker, within seconds; this bounds what an
#: outage of every worker leaves behind, one key for each thread a dead worker held.
OPEN_TTL = 24 * 3600.0

#: The signal connection's ping after silence, and its answer's bound (tests patch them).
_PING_EVERY = PING_EVERY
_PONG_WITHIN = PONG_WITHIN

#: A lease's value: the holder's 32-character token, then the run id. The marker (KEYS[2])
#: and a stop's mark (KEYS[3]) are renewed with the lease, so they last as long as the
#: lease, then `open_ttl` more.
_RENEW = """
if string.sub(redis.call('GET', KEYS[1]) or '', 1, 32) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
#: KEYS[2] marks a thread whose lease is held or expired unreleased (its worker died);
#: KEYS[3], the run a worker follows on it, and KEYS[4], a stop's mark, are a previous
#: run's: forgotten.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local inherited = redis.call('EXISTS', KEYS[2])
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
  redis.call('DEL', KEYS[3], KEYS[4])
  return 1 + inherited
end
return 0
"""
#: Released by its holder, with a stop's mark (KEYS[4]); its `end` (ARGV[3]) published on
#: ARGV[2] if someone follows the run (ARGV[2] empty: never).
_RELEASE = """
local held = redis.call('GET', KEYS[1]) or ''
if string.sub(held, 1, 32) == ARGV[1] then
  redis.call('DEL', KEYS[2], KEYS[4])
  if redis.call('GET', KEYS[3]) == string.sub(held, 33) then
    redis.call('DEL', KEYS[3])
    if ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
  end
  return redis.call('DEL', KEYS[1])
end
return 0
"""
#: The thread's run (the lease's value after its token) marked as followed, until its lease
#: is released or taken over (or as long as an unreleased lease's marker lasts).
_FOLLOW = """
local held = redis.call('GET', KEYS[1])
if held then
  redis.call('SET', KEYS[2], string.sub(held, 33), 'PX', ARGV[1])
end
return held
"""
#: The run holding the lease (ARGV[1]) marked as being stopped: the mark is the lease's
#: value (its token with the run), so a later lease of the same run id is not marked; it
#: lasts as long as the lease (renewed with it, removed with it, or taken over).
_MARK_STOPPING = """
local held = redis.call('GET', KEYS[1]) or ''
if string.sub(held, 33) == ARGV[1] then
  redis.call('SET', KEYS[2], held, 'PX', ARGV[2])
end
return 0
"""
#: The run holding the lease, and 1 if it is marked as being stopped (nothing: no holder).
_HOLDER_STOPPING = """
local held = redis.call('GET', KEYS[1])
if not held then return {} end
return {string.sub(held, 33), redis.call('GET', KEYS[2]) == held and 1 or 0}
"""
#: A run's progress, published only if someone follows that run.
_PROGRESS = """
if redis.call('GET', KEYS[1]) == ARGV[2] then
  return redis.call('PUBLISH', ARGV[1], ARGV[3])
end
return 0
"""


class RedisCoordinator(SharedCoordinator):
    def __init__(self, url: str, *, prefix: str | None = None,
                 lease_ttl: float | None = None) -> None:
        try:
            import redis.asyncio
            import redis.exceptions
        except ImportError as exc:
            raise ImportError("the Redis coordinator needs redis-py: pip install "
                              "'copilot-runtime[redis]'", name=exc.name) from exc
        self.url, options = split_options(url, ("prefix", "lease_ttl", "pool_size"))
        checked_redis_url(self.url)
        self.pool_size = pool_size_option(options, DEFAULT_POOL_SIZE)
        self.unreachable = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        super().__init__(lease_ttl if lease_ttl is not None
                         else lease_ttl_option(options, DEFAULT_LEASE_TTL))
        self.prefix = prefix if prefix is not None else options.get("prefix",
                                                                    "copilot-runtime:")
        self.channel = f"{self.prefix}signals"
        #: Seconds an `open:` marker outlives its lease (`OPEN_TTL`).
        self.open_ttl = OPEN_TTL
        self._redis: Any = None

    def _cannot_serve_now(self, exc: BaseException) -> bool:
        # READONLY from a replica after a failover, OOM, BUSY, MASTERDOWN...: as the limits.
        return cannot_serve_now(exc)

    def _key(self, thread_id: str) -> str:
        return f"{self.prefix}lease:{thread_id}"

    def _open_key(self, thread_id: str) -> str:
        return f"{self.prefix}open:{thread_id}"

    def _followed_key(self, thread_id: str) -> str:
        return f"{self.prefix}followed:{thread_id}"

    def _stopping_key(self, thread_id: str) -> str:
        return f"{self.prefix}stopping:{thread_id}"

    def _stopping_keys(self, thread_id: str) -> list[str]:
        return [self._key(thread_id), self._stopping_key(thread_id)]

    def _keys(self, thread_id: str) -> list[str]:
        return [self._key(thread_id), self._open_key(thread_id), self._followed_key(thread_id),
                self._stopping_key(thread_id)]

    async def _connect(self) -> None:
        # A server that does not answer fails a connection attempt in seconds; one
        # connection more than the commands' for the signal listener.
        self._redis = bounded_redis(self.url, size=self.pool_size + 1, wait=self.timeout,
                                    socket_connect_timeout=5)
        await self._redis.ping()

    async def _listen(self, ready: asyncio.Future[None]) -> None:
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.channel)
            if not ready.done():
                ready.set_result(None)
            loop = asyncio.get_running_loop()
            heard, pinged = loop.time(), None
            while True:
                message = await pubsub.get_message(timeout=_PING_EVERY / 2)
                now = loop.time()
                if message is not None:
                    heard, pinged = now, None
                if pinged is not None and now - pinged > _PONG_WITHIN:
                    # A connection a NAT or a failover dropped without a word: nothing is
                    # written on it, so nothing fails; every signal (stops) went missing.
                    raise ConnectionError("the signal connection stopped answering")
                if pinged is None and now - heard >= _PING_EVERY:
                    await pubsub.ping()
                    pinged = now
                if message is None or message.get("type") != "message":
                    continue
                signal = Signal.decode(message["data"])
                if signal is not None:
                    self._hub.deliver(signal)
        finally:
            await pubsub.aclose()

    def _open_ms(self) -> int:
        return int((self.lease_ttl + self.open_ttl) * 1000)

    async def _renew(self, leases: list[Lease]) -> set[str]:
        ttl_ms = int(self.lease_ttl * 1000)
        results = await self._send([
            _eval(_RENEW, [self._key(lease.thread_id), self._open_key(lease.thread_id),
                           self._stopping_key(lease.thread_id)],
                  [lease.token, ttl_ms, self._open_ms()]) for lease in leases])
        return {lease.thread_id for lease, ok in zip(leases, results, strict=True) if not ok}

    async def _disconnect(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def _acquire_many(self, asked: list[tuple[str, str, str]]) -> list[Lease | None]:
        ttl_ms, open_ms = int(self.lease_ttl * 1000), self._open_ms()
        results = await self._send([
            _eval(_ACQUIRE, self._keys(thread_id), [token + run_id, ttl_ms, open_ms])
            for thread_id, run_id, token in asked])
        return [Lease(thread_id, run_id, token, int(taken) == 2) if taken else None
                for (thread_id, run_id, token), taken in zip(asked, results, strict=True)]

    async def release(self, lease: Lease) -> None:
        self._drop(lease)
        async with self._reachable():  # bounded, as every call: a hung server held its caller
            await self.start()
            await self._send([_eval(_RELEASE, self._keys(lease.thread_id),
                                    [lease.token, "", ""])])

    async def _finish_many(self, leases: list[Lease]) -> list[None]:
        await self._send([
            _eval(_RELEASE, self._keys(lease.thread_id),
                  [lease.token, self.channel,
                   Signal("end", lease.thread_id, lease.run_id).encode()])
            for lease in leases])
        return [None] * len(leases)

    async def follow(self, thread_id: str) -> str | None:
        async with self._reachable():
            await self.start()
            [value] = await self._send([_eval(
                _FOLLOW, [self._key(thread_id), self._followed_key(thread_id)],
                [self._open_ms()])])
        return value[32:].decode() if value else None

    async def mark_stopping(self, thread_id: str, run_id: str) -> None:
        async with self._reachable():
            await self.start()
            await self._send([_eval(_MARK_STOPPING, self._stopping_keys(thread_id),
                                    [run_id, self._open_ms()])])

    async def holder_stopping(self, thread_id: str) -> tuple[str | None, bool]:
        async with self._reachable():
            await self.start()
            [answer] = await self._send([_eval(_HOLDER_STOPPING,
                                               self._stopping_keys(thread_id), [])])
        return (answer[0].decode(), bool(answer[1])) if answer else (None, False)

    async def ping(self) -> None:
        """One round trip to the server, and the signal connection open (a readiness
        probe)."""
        async with self._reachable():
            await self.start()
            await self._redis.ping()
        self._deaf()

    async def holder(self, thread_id: str) -> str | None:
        async with self._reachable():
            await self.start()
            value = await self._redis.get(self._key(thread_id))
        return value[32:].decode() if value else None

    async def forget_expired(self, older_than: float) -> int:
        return 0  # Redis drops an expired lease (and, a day later, its marker) by itself

    def counters(self) -> CounterBackend:
        return RedisCounters(self.url, prefix=f"{self.prefix}limits:",
                             name="The coordinator", pool_size=self.pool_size,
                             slot_ttl=self.lease_ttl)

    async def _publish_many(self, signals: list[Signal]) -> list[None]:
        # A run's progress only to followers of that run; other signals to every worker.
        await self._send([
            _eval(_PROGRESS, [self._followed_key(signal.thread_id)],
                  [self.channel, signal.run_id or "", signal.encode()])
            if signal.kind == "progress" else ("PUBLISH", self.channel, signal.encode())
            for signal in signals])
        return [None] * len(signals)

    async def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """`commands` in one round trip: a lone one as it is (redis-py's pipeline costs
        several times a command's own work), several in a pipeline.

        Bounded here, not only by its callers: calls made while one is in flight go
        together in a task of their own (`Batcher`), where no caller's deadline applies. A
        command on a connection that stopped answering held that task, and with it every
        later call of its kind (each then 503), for as long as the connection lived."""
        async with within(self.timeout):
            if len(commands) == 1:
                return [await self._redis.execute_command(*commands[0])]
            async with self._redis.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                return list(await pipe.execute())


def _eval(script: str, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
    """`script` run on `keys` and `args`, sent as its text (Redis caches it by its hash):
    redis-py checks the registered scripts of a pipeline with a SCRIPT EXISTS round trip
    before each execution (one round trip more per batch), and an EVALSHA of a script the
    server lost (a restart) would fail."""
    return ("EVAL", script, len(keys), *keys, *args)
