"""A Redis connection the server closed while it sat idle in the pool (a restart, a
failover, an idle timeout, a proxy's reset) is replaced before a command is sent on it.

redis-py 8 leaves "maintenance notifications" on "auto", and then skips the check its pool
makes of a connection it hands out: the next command on each such connection failed, and a
run was refused 503 "The coordinator cannot be reached" with Redis well (a hunt, after
`CLIENT KILL` of one worker's idle connections)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from copilot_runtime import coordinator
from copilot_runtime._redis_client import bounded_redis
from tests.scale_support.services import REDIS, redis_prefix

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


async def _closed_by_the_server(client: aioredis.Redis) -> int:
    """Close, from the server's side, every connection idle in `client`'s pool."""
    killer = aioredis.Redis.from_url(REDIS)
    try:
        killed = 0
        for connection in list(client.connection_pool._available_connections):
            host, port = connection._writer.get_extra_info("sockname")[:2]
            killed += int(await killer.execute_command(
                "CLIENT", "KILL", "ADDR", f"{host}:{port}", "SKIPME", "yes"))
        await asyncio.sleep(0.5)  # (the server's FIN reaches the idle sockets)
        return killed
    finally:
        await killer.aclose()


async def test_a_pooled_connection_the_server_closed_is_replaced() -> None:
    client = bounded_redis(REDIS, size=3, wait=5)
    try:
        await client.ping()
        assert await _closed_by_the_server(client) == 1
        assert await client.execute_command("EVAL", "return 7", 0) == 7
    finally:
        await client.aclose()


async def test_a_coordinators_first_lease_after_its_connections_were_closed() -> None:
    with redis_prefix() as url:
        shared = coordinator(url)
        await shared.start()
        try:
            for thread in ("t-1", "t-2", "t-3"):  # several connections in the pool
                lease = await shared.acquire(thread, "r")
                assert lease is not None
                await shared.release(lease)
            assert await _closed_by_the_server(shared._redis) >= 1  # type: ignore[attr-defined]
            lease = await shared.acquire("t-after", "r")
            assert lease is not None
            await shared.release(lease)
        finally:
            await shared.aclose()
