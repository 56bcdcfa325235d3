"""Where threads live between runs: the interface every store implements.

A thread is the runs made on it (each kept as its compacted events) plus the ids of the
messages it has seen. The runtime writes a run once, when it ends; `connect` and the thread
routes read them back. Stores are async so durable ones (SQLite, PostgreSQL, Redis) fit the
same interface; the in-memory store is the default.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from copilot_runtime.events import Event

__all__ = ["StoredRun", "ThreadOwner", "ThreadRecord", "ThreadStore"]


@dataclass(frozen=True, slots=True)
class ThreadOwner:
    """Who started a thread: a principal id, within a tenant when there are tenants.

    Set when the thread's first run is stored and never changed. A thread without an owner
    was started with no authentication configured.
    """

    principal_id: str
    tenant: str | None = None


@dataclass(slots=True)
class StoredRun:
    run_id: str
    events: list[Event]
    created_at: float
    #: The events' size as encoded JSON, when the writer measured it (0: not measured).
    size: int = 0


@dataclass(slots=True)
class ThreadRecord:
    thread_id: str
    agent_id: str
    created_at: float
    updated_at: float
    runs: list[StoredRun] = field(default_factory=list)
    message_ids: set[str] = field(default_factory=set)
    owner: ThreadOwner | None = None

    @property
    def state(self) -> Any:
        """The thread's state after its last run that had one, or None."""
        for run in reversed(self.runs):
            for event in reversed(run.events):
                if event["type"] == "STATE_SNAPSHOT":
                    return event.get("snapshot")
        return None


@runtime_checkable
class ThreadStore(Protocol):
    async def get(self, thread_id: str) -> ThreadRecord | None:
        """The thread, or None if it never finished a run."""
        ...

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         message_ids: Iterable[str], *, owner: ThreadOwner | None = None
                         ) -> None:
        """Record a finished run and the message ids it saw or produced.

        `owner` is recorded only when the run creates the thread.
        """
        ...

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: ThreadOwner | None = None) -> list[ThreadRecord]:
        """Threads, newest first, optionally only those of one agent and of one owner."""
        ...

    async def aclose(self) -> None:
        ...
