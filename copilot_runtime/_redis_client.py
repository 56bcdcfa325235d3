"""A Redis client whose commands share a bounded pool of connections.

redis-py's default pool opens one connection per command in flight and refuses commands
past 100 ("Too many connections"): a burst of requests (each checks its rate limits) or of
stops nears the server's client limit across workers, then fails as if Redis were away.
Here a command waits, at most `wait` seconds, for one of `size` connections instead.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_POOL_SIZE", "bounded_redis"]

#: The most connections a client opens, unless its URL says (`pool_size`).
DEFAULT_POOL_SIZE = 10


def bounded_redis(url: str, *, size: int, wait: float, **options: Any) -> Any:
    """A `redis.asyncio.Redis` on `url` holding at most `size` connections (the caller
    imports redis-py first, to say which extra installs it)."""
    import redis.asyncio as aioredis

    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=size, timeout=wait,
                                                    **options)
    return aioredis.Redis.from_pool(pool)
