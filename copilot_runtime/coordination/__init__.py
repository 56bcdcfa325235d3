"""Coordination of the workers that serve one deployment: one run per thread across all of
them, and signals (progress, end, stop) between them.

`coordinator(url)` picks one by URL:

    local                                   this process alone (the default)
    postgresql://user@host:port/db?schema=S leases in a table, LISTEN/NOTIFY (`postgres` extra)
    redis://host:port/N?prefix=P            SET NX PX leases, pub/sub (`redis` extra)

Shared coordinators take `lease_ttl=SECONDS` too (default 10): how long after its worker
dies a thread's run still blocks the thread.
"""

from __future__ import annotations

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime._url_options import redacted_url
from copilot_runtime.coordination.base import (
    LEASE_LOST_CODE,
    Coordinator,
    Lease,
    Signal,
    Subscription,
)
from copilot_runtime.coordination.local import LocalCoordinator

__all__ = ["LEASE_LOST_CODE", "Coordinator", "Lease", "LocalCoordinator", "Signal",
           "Subscription", "coordinator"]


def coordinator(url: str | None = None) -> Coordinator:
    """The coordinator `url` names (None, empty or `local`: this process alone); spaces
    around it are not part of it."""
    url = (url or "").strip()
    if url in ("", "local", "local://"):
        return LocalCoordinator()
    scheme = url.partition("://")[0].lower()
    if scheme in ("postgresql", "postgres"):
        from copilot_runtime.coordination.postgres import PostgresCoordinator

        return PostgresCoordinator(url)
    if scheme in ("redis", "rediss", "unix"):
        from copilot_runtime.coordination.redis import RedisCoordinator

        return RedisCoordinator(url)
    raise ConfigurationError(f"Unknown coordinator URL {redacted_url(url)!r}: use 'local', "
                             "'postgresql://...' or 'redis://...'")
