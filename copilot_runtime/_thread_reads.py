"""A thread as its reads show it (GraphQL `loadAgentState`, AG-UI `GET threads/{id}/...`):
its finished runs, then its running run as far as it went.

A read while a run goes on shows that run as a finished one would be shown, cut where it is
now: its input's new messages (its `RUN_STARTED`), what it has streamed so far compacted
(a message's text so far, the state its deltas made so far), and no end. Where it comes
from: the run's events in this process when it runs here (any store), else, with a shared
coordinator, what its worker has written to the shared store so far (in batches, about
every 200 ms, `ActiveRun._flush`). Once the store holds the run finished, it is read from
there alone, so its messages never show twice. Another worker's written events are read
only when the thread's record says some were written after its last finished run, and kept
only when the thread is still the one read (not deleted and begun again, maybe by another
owner, meanwhile). An agent that keeps its threads itself (`load_state`) has the running
run's messages this worker holds added after its own (`running_messages`).

Before, reads built the thread from its finished runs only: a thread read mid-run had none
of that run's messages, and a 1.10 client, which reads a thread once when it opens it,
showed it without them and sent its next message without that history.
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from typing import Any

from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events, events_to_messages
from copilot_runtime._limits import LARGE_JSON, estimated_size
from copilot_runtime._runs import ActiveRun, RunManager
from copilot_runtime.events import Event
from copilot_runtime.threads.base import REPLAY_OMITTED, StoredRun, ThreadOwner, ThreadRecord

__all__ = ["read_thread", "running_messages"]

#: Events past which a running run read is compacted off the event loop, however small.
_MANY_EVENTS = 1024


async def read_thread(runs: RunManager, thread_id: str, max_bytes: int | None, *,
                      again: bool = True) -> ThreadRecord | None:
    """`store.get(thread_id, max_bytes=)` with the thread's running run, if any, as its last
    run (compacted as far as it went); None for no thread, running or stored."""
    # Taken before the store is read: a run that ends meanwhile is then either in the
    # record (and left out here) or still in memory, never in neither.
    live = _readable(runs.active.get(thread_id))
    record = await runs.store.get(thread_id, max_bytes=max_bytes)
    runs_read = record.runs if record is not None else []
    # A run is known by where it starts (positions are never given twice in a thread; run
    # ids may be), or for one stored before positions (-1), by its id.
    starts = {run.first_position for run in runs_read if run.first_position >= 0}
    ids = {run.run_id for run in runs_read if run.first_position < 0}
    if live is not None:
        if live.first_position in starts or not live.events:
            return record
        if runs.active.get(thread_id) is not live and again:
            # It ended while the store was read: stored before it left (unless its store
            # failed: then no read has it), so read again (the thread may also have been
            # deleted since, and begun again by another principal, whose record the first
            # read may be: the run is not theirs).
            return await read_thread(runs, thread_id, max_bytes, again=False)
        if record is not None and record.owner != live.owner:
            return record  # (the same, should it happen during the read again)
        if record is None:  # its first run, in a store that keeps only finished runs
            record = ThreadRecord(thread_id, live.agent_id, live.created_at,
                                  live.created_at, owner=live.owner)
        return _with(record, [StoredRun(live.run_id, await _compacted_live(live),
                                        live.created_at, first_position=live.first_position)])
    if runs.coordinator is None or runs.durable is None or record is None:
        # (with the local coordinator, every run of the thread runs in this process)
        return record
    # Another worker's run: the events its worker wrote so far, after the runs read. None
    # written (the thread's next position is right after its last run's), as for every
    # idle thread, costs no look.
    after = max((run.last_position for run in record.runs), default=-1)
    if record.next_position <= after + 1:
        return record
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
    if not running:
        return record
    # The events were read after the record, by another query: the thread may have been
    # deleted meanwhile and another (anyone's) begun with its id, whose events come after
    # `after` too (positions never go back). Theirs only if the thread is still the one read.
    now = await runs.store.summary(thread_id)
    if now is None or (now.owner, now.created_at) != (record.owner, record.created_at):
        return record
    return _with(record, running)


async def running_messages(runs: RunManager, thread_id: str, agent_id: str,
                           owner: ThreadOwner | None) -> list[dict[str, Any]]:
    """The messages so far of the thread's run of `agent_id` running in this process for
    `owner` (None: anyone), as a thread read shows them; none if there is no such run."""
    live = _readable(runs.active.get(thread_id))
    if live is None or live.agent_id != agent_id or (owner is not None
                                                     and live.owner != owner):
        return []
    return events_to_messages([await _compacted_live(live)])


def _readable(live: ActiveRun | None) -> ActiveRun | None:
    # (not a reservation whose owner is not checked yet, nor a suggestion's run)
    return None if live is None or not live.confirmed or live.unstored else live


#: The last compaction of each running run read, with how many of its events it holds: a
#: run's events are only ever added to, so a read with none new since is that one's (a
#: client polling a thread while its run waits, on a tool say, compacted it all each time).
_last_compacted: weakref.WeakKeyDictionary[ActiveRun, tuple[int, list[Event]]] = \
    weakref.WeakKeyDictionary()


async def _compacted_live(live: ActiveRun) -> list[Event]:
    count = len(live.events)
    kept = _last_compacted.get(live)
    if kept is not None and kept[0] == count:
        return kept[1]
    # (a copy: the run goes on adding to its list while a thread may compact this one; its
    # size it keeps count of, not weighed again here)
    compacted = await _compacted(live.events[:count], live.large())
    _last_compacted[live] = (count, compacted)
    return compacted


async def _compacted(events: list[Event], large: bool | None = None) -> list[Event]:
    # A large run's compaction copies its state, and a long one's goes through each of its
    # events (60,000 tokens: some 30 ms): in a thread, as a run's store's is.
    if len(events) >= _MANY_EVENTS or (
            large if large is not None else estimated_size(events) >= LARGE_JSON):
        return await asyncio.to_thread(compact_events, events)
    return compact_events(events)


def _with(record: ThreadRecord, running: list[StoredRun]) -> ThreadRecord:
    # A copy: the in-memory store hands out the record it keeps.
    return dataclasses.replace(record, runs=[*record.runs, *running])

