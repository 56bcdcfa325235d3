"""A thread as its reads show it (GraphQL `loadAgentState`, AG-UI `GET threads/{id}/...`):
its finished runs, then its running run as far as it went.

A read while a run goes on shows that run as a finished one would be shown, cut where it is
now: its input's new messages (its `RUN_STARTED`), what it has streamed so far compacted
(a message's text so far, the state its deltas made so far), and no end. Where it comes
from: the run's events in this process when it runs here (any store), else, with a shared
coordinator, what its worker has written to the shared store so far (in batches, about
every 200 ms, `ActiveRun._flush`). Once the store holds the run finished, it is read from
there alone, so its messages never show twice.

Before, reads built the thread from its finished runs only: a thread read mid-run had none
of that run's messages, and a 1.10 client, which reads a thread once when it opens it,
showed it without them and sent its next message without that history.
"""

from __future__ import annotations

import asyncio
import dataclasses

from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events
from copilot_runtime._limits import LARGE_JSON, estimated_size
from copilot_runtime._runs import RunManager
from copilot_runtime.events import Event
from copilot_runtime.threads.base import REPLAY_OMITTED, StoredRun, ThreadRecord

__all__ = ["read_thread"]


async def read_thread(runs: RunManager, thread_id: str, max_bytes: int | None
                      ) -> ThreadRecord | None:
    """`store.get(thread_id, max_bytes=)` with the thread's running run, if any, as its last
    run (compacted as far as it went); None for no thread, running or stored."""
    # Taken before the store is read: a run that ends meanwhile is then either in the
    # record (and left out here) or still in memory, never in neither.
    live = runs.active.get(thread_id)
    if live is not None and (not live.confirmed or live.unstored):
        live = None  # (a reservation whose owner is not checked yet, a suggestion's run)
    record = await runs.store.get(thread_id, max_bytes=max_bytes)
    runs_read = record.runs if record is not None else []
    # A run is known by where it starts (positions are never given twice in a thread; run
    # ids may be), or for one stored before positions (-1), by its id.
    starts = {run.first_position for run in runs_read if run.first_position >= 0}
    ids = {run.run_id for run in runs_read if run.first_position < 0}
    if live is not None:
        if live.first_position in starts or not live.events:
            return record
        if record is None:  # its first run, in a store that keeps only finished runs
            record = ThreadRecord(thread_id, live.agent_id, live.created_at,
                                  live.created_at, owner=live.owner)
        # (a copy: the run goes on adding to its list while a thread may compact this one)
        compacted = await _compacted(list(live.events))
        return _with(record, [StoredRun(live.run_id, compacted, live.created_at,
                                        first_position=live.first_position)])
    if runs.coordinator is None or runs.durable is None or record is None:
        # (with the local coordinator, every run of the thread runs in this process)
        return record
    # Another worker's run: the events its worker wrote so far, after the runs read.
    after = max((run.last_position for run in record.runs), default=-1)
    written = [(position, event) for position, event in
               await runs.durable.events_after(thread_id, after)
               if not (event.get("type") == ev.CUSTOM and event.get("name") == REPLAY_OMITTED)]
    running: list[StoredRun] = []
    for start in (i for i, (_, event) in enumerate(written)
                  if event.get("type") == ev.RUN_STARTED):
        run_id = written[start][1].get("runId")
        end = next((i for i in range(start + 1, len(written))
                    if written[i][1].get("type") == ev.RUN_STARTED), len(written))
        first = written[start][0]
        if isinstance(run_id, str) and (first not in starts if first is not None
                                        else run_id not in ids):
            compacted = await _compacted([e for _, e in written[start:end]])
            running.append(StoredRun(run_id, compacted, record.updated_at,
                                     first_position=-1 if first is None else first))
    return _with(record, running) if running else record


async def _compacted(events: list[Event]) -> list[Event]:
    # A large run's compaction copies its state: in a thread, as a run's store's is.
    if estimated_size(events) >= LARGE_JSON:
        return await asyncio.to_thread(compact_events, events)
    return compact_events(events)


def _with(record: ThreadRecord, running: list[StoredRun]) -> ThreadRecord:
    # A copy: the in-memory store hands out the record it keeps.
    return dataclasses.replace(record, runs=[*record.runs, *running])

