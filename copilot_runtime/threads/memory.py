"""The default thread store: a bounded dict in this process (lost on restart)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from copilot_runtime.threads.base import StoredRun, ThreadOwner, ThreadRecord

__all__ = ["InMemoryThreadStore"]


class InMemoryThreadStore:
    """Keeps up to `max_threads` threads, evicting the least recently used."""

    def __init__(self, max_threads: int = 10_000, max_runs_per_thread: int = 200) -> None:
        self.max_threads = max_threads
        self.max_runs_per_thread = max_runs_per_thread
        self._threads: OrderedDict[str, ThreadRecord] = OrderedDict()

    async def get(self, thread_id: str) -> ThreadRecord | None:
        record = self._threads.get(thread_id)
        if record is not None:
            self._threads.move_to_end(thread_id)
        return record

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         message_ids: Iterable[str], *, owner: ThreadOwner | None = None
                         ) -> None:
        record = self._threads.get(thread_id)
        if record is None:
            record = ThreadRecord(thread_id, agent_id, run.created_at, run.created_at,
                                  owner=owner)
            self._threads[thread_id] = record
            while len(self._threads) > self.max_threads:
                self._threads.popitem(last=False)
        else:
            self._threads.move_to_end(thread_id)
        record.runs.append(run)
        del record.runs[: -self.max_runs_per_thread]
        record.updated_at = run.created_at
        record.message_ids.update(message_ids)

    async def list(self, agent_id: str | None = None, limit: int = 100, *,
                   owner: ThreadOwner | None = None) -> list[ThreadRecord]:
        records = sorted(self._threads.values(), key=lambda r: r.updated_at, reverse=True)
        return [r for r in records if (agent_id is None or r.agent_id == agent_id)
                and (owner is None or r.owner == owner)][:limit]

    async def aclose(self) -> None:
        self._threads.clear()
