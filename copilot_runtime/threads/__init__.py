"""Thread storage: the interface, its implementations, and `thread_store(url)`."""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime._url_options import (
    pool_size_option,
    redacted_url,
    schema_option,
    split_options,
)
from copilot_runtime.threads.base import (
    INTERRUPTED_CODE,
    MAX_ID_LENGTH,
    MAX_REPLAY_BYTES,
    DurableThreadStore,
    ListPosition,
    Positioned,
    StoredRun,
    ThreadOwner,
    ThreadRecord,
    ThreadStore,
)
from copilot_runtime.threads.memory import InMemoryThreadStore
from copilot_runtime.threads.sqlite import SQLiteThreadStore

if TYPE_CHECKING:
    from copilot_runtime.threads.postgres import PostgresThreadStore

__all__ = ["INTERRUPTED_CODE", "MAX_ID_LENGTH", "MAX_REPLAY_BYTES", "DurableThreadStore",
           "InMemoryThreadStore", "ListPosition",
           "Positioned",
           "PostgresThreadStore", "SQLiteThreadStore", "StoredRun", "ThreadOwner",
           "ThreadRecord", "ThreadStore", "thread_store"]


def thread_store(url: str) -> ThreadStore:
    """The store `url` names: `memory://`, `sqlite:///relative/path` (or
    `sqlite:////absolute/path`), or `postgresql://user@host:port/db?schema=NAME&pool_size=N`
    (the `postgres` extra; the schema is created if missing, `public` by default; `pool_size`:
    the most pooled connections, 10 by default, beside the three of its own)."""
    scheme, _, rest = url.partition(":")
    scheme = scheme.lower()
    if scheme == "memory":
        return InMemoryThreadStore()
    if scheme == "sqlite":
        if not rest.startswith("///") or len(rest) <= 3:
            raise ConfigurationError(
                "A SQLite thread store URL looks like sqlite:///relative/path or "
                f"sqlite:////absolute/path, got {redacted_url(url)!r}")
        return SQLiteThreadStore(urllib.parse.unquote(rest[3:].split("?", 1)[0]))
    if scheme in ("postgres", "postgresql"):
        conninfo, options = split_options("postgresql:" + rest, ("schema", "pool_size"))
        pool_size = pool_size_option(options, 10)
        schema = schema_option(options) or "public"
        try:
            from copilot_runtime.threads.postgres import PostgresThreadStore
        except ImportError as exc:
            raise ConfigurationError(
                "thread_store('postgresql://...') needs the postgres extra: pip install "
                f"'copilot-runtime[postgres]' ({exc.name} is missing)") from None
        return PostgresThreadStore(conninfo, schema=schema, max_size=pool_size)
    raise ConfigurationError(
        f"Unsupported thread store URL {redacted_url(url)!r}: use memory://, "
        "sqlite:///path or postgresql://user@host:port/db?schema=NAME")


def __getattr__(name: str) -> object:
    if name == "PostgresThreadStore":
        from copilot_runtime.threads.postgres import PostgresThreadStore

        return PostgresThreadStore
    raise AttributeError(name)
