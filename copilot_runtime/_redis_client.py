"""A Redis client whose commands share a bounded pool of connections.

redis-py's default pool opens one connection per command in flight and refuses commands
past 100 ("Too many connections"): a burst of requests (each checks its rate limits) or of
stops nears the server's client limit across workers, then fails as if Redis were away.
Here a command waits, at most `wait` seconds, for one of `size` connections instead.

`cannot_serve_now` tells the answers of a server that is there but cannot serve now from a
command's own errors, for every user of Redis (rate limits, the coordinator).
"""

from __future__ import annotations

import inspect
import re
import urllib.parse
from typing import Any

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime._url_options import checked_redis_db

__all__ = ["DEFAULT_POOL_SIZE", "NOT_NOW_CODES", "bounded_redis", "cannot_serve_now",
           "checked_redis_url"]

#: The most connections a client opens, unless its URL says (`pool_size`).
DEFAULT_POOL_SIZE = 10


def bounded_redis(url: str, *, size: int, wait: float, **options: Any) -> Any:
    """A `redis.asyncio.Redis` on `url` holding at most `size` connections (the caller
    imports redis-py first, to say which extra installs it)."""
    import redis.asyncio as aioredis

    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # redis-py before 7: no such notifications, the check is always made
        pass
    else:
        # Off, as they are for a plain Redis server: left "auto", redis-py skips the check
        # that replaces a pooled connection the server closed while idle (a restart, an
        # idle timeout), and the next command on it failed (a run refused 503, Redis well).
        options.setdefault("maint_notifications_config", MaintNotificationsConfig(enabled=False))
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=size, timeout=wait,
                                                    **options)
    return aioredis.Redis.from_pool(pool)


#: What a URL's query may set on redis-py's pool, beside its connections' own options.
_POOL_OPTIONS = ("max_connections", "timeout")


def checked_redis_url(url: str) -> None:
    """Refuse a Redis URL (without the runtime's own options) that redis-py takes but fails
    on at every connection: a port out of range, an option it does not know (`bogus=1`),
    one whose value it cannot read (`socket_timeout=abc`), a path that is no database
    number. Found when the coordinator or the counters are built, a configuration mistake
    (exit code 2), not a TypeError at start-up or a 500 on every run. Nothing is opened."""
    from redis.asyncio.connection import Connection, parse_url

    checked_redis_db(url)
    try:
        port = urllib.parse.urlsplit(url).port
    except ValueError:
        port = 0
    if port == 0:  # 0: redis-py would connect to 6379 without a word
        given = urllib.parse.urlsplit(url).netloc.rpartition("@")[2].rpartition(":")[2]
        raise ConfigurationError(f"a Redis URL's port must be 1-65535, got {given!r}")
    try:
        options = parse_url(url)
    except ValueError as exc:  # "Invalid value for 'socket_timeout' in connection URL."
        raise ConfigurationError(f"cannot read the Redis URL: {exc}") from None
    connection = options.pop("connection_class", Connection)
    known = {name for cls in connection.__mro__ if "__init__" in vars(cls)
             for name in inspect.signature(vars(cls)["__init__"]).parameters}
    for name in options:
        if name not in known and name not in _POOL_OPTIONS:
            raise ConfigurationError(f"{name!r} is not an option of a Redis URL")


#: The error codes of a server that answers but cannot serve now: a replica refusing writes
#: (after a failover), out of memory, a script running too long, a dataset loading, a
#: replica cut from its master, a cluster moving or missing slots, snapshots failing, too
#: few replicas to write to. Each passes; none is the command's fault.
NOT_NOW_CODES = ("READONLY", "OOM", "BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN",
                 "MISCONF", "NOREPLICAS")

#: Where such a code stands in a reply's text: first (redis-py keeps the codes it has no
#: class for), or after ": -" where Redis before 7 wrapped the error of a command a script
#: called in its own "Error running script ..." error.
_NOT_NOW = re.compile(r"(?:\A|: -)(?:" + "|".join(NOT_NOW_CODES) + ") ")
#: What redis-py puts before the reply (the repr of its arguments) of a pipeline's command
#: that failed, after the command (which may hold anything: the reply is read after the last).
_PIPELINE = " of pipeline caused error: ("


def cannot_serve_now(exc: BaseException) -> bool:
    """Whether `exc` is the answer of a Redis server that cannot serve now (see
    `NOT_NOW_CODES`): as unavailable, for a while, as a server that cannot be reached, so a
    503 with Retry-After to a client, and an outage to a loop that retries. A command's own
    error (a script's bug, a wrong type) is not; nor is anything that is not a reply."""
    from redis.exceptions import (
        ClusterDownError,
        OutOfMemoryError,
        ReadOnlyError,
        ResponseError,
        TryAgainError,
    )

    # The codes redis-py has a class for lose their word in the text (MASTERDOWN's class is
    # a ClusterDownError).
    if isinstance(exc, ReadOnlyError | OutOfMemoryError | TryAgainError | ClusterDownError):
        return True
    if not isinstance(exc, ResponseError):
        return False
    text = str(exc)
    _, pipeline, reply = text.rpartition(_PIPELINE)
    return _NOT_NOW.search(reply[1:] if pipeline else text) is not None
