"""The PostgreSQL thread store alone: what a chat on a new thread asks of it (`summary` when
the run begins, `append_run` when it ends), at a given concurrency, with the CPU of this
process and of the PostgreSQL server's processes per run.

    python -m bench.pg_store [--runs 3000] [--concurrency 10] [--url postgresql://...]
                             [--streamed] [--phases 1]

The payload is a bench chat's: a 200-character user message, 50 text deltas, the raw events
(~5.8 KB) and their compacted form (~1.2 KB). PostgreSQL's CPU is read from /proc, so it is
only counted when the server runs on this machine. The schema `bench_pg_store` is emptied
first. Used for docs/benchmarks.md's "Thread stores" section.

`--streamed`: each run writes its first events while it streams (as every run longer than
200 ms does: its row is opened), then finishes. `--phases N` reports the runs in N
consecutive parts, to see whether a run costs more as the runs before it accumulate (dead
rows and index entries stay until the table is vacuumed; the tables' autovacuum setting is
printed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

import psycopg

from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events
from copilot_runtime.threads.base import StoredRun
from copilot_runtime.threads.postgres import PostgresThreadStore

_SCHEMA = "bench_pg_store"


def _chat(thread_id: str, run_id: str) -> list[ev.Event]:
    user = {"id": uuid.uuid4().hex, "role": "user", "content": ("figures " * 25)[:200]}
    message_id = uuid.uuid4().hex
    return [ev.run_started(thread_id, run_id, {"threadId": thread_id, "runId": run_id,
                                               "messages": [user], "tools": [],
                                               "context": []}),
            ev.text_message_start(message_id),
            *[ev.text_message_content(message_id, f"word{i} ") for i in range(50)],
            ev.text_message_end(message_id), ev.run_finished(thread_id, run_id)]


def _postgres_cpu() -> float:
    """Seconds of CPU used by the processes named postgres on this machine."""
    total = 0.0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if "(postgres)" in stat:
            fields = stat.rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


_Chat = tuple[str, StoredRun, set[str], list[ev.Event]]


def _payload() -> _Chat:
    """A chat's arguments, made before the clock starts: only the store is measured."""
    thread_id, run_id = uuid.uuid4().hex, uuid.uuid4().hex
    raw = _chat(thread_id, run_id)
    ids = {raw[0]["input"]["messages"][0]["id"], raw[1]["messageId"]}
    return (thread_id, StoredRun(run_id, compact_events(raw), time.time(), 0, 0, len(raw) - 1),
            ids, raw)


async def _one(store: PostgresThreadStore, chat: _Chat, streamed: bool) -> None:
    thread_id, run, ids, raw = chat
    if await store.summary(thread_id) is not None:
        raise RuntimeError("a new thread exists")
    first = 0
    if streamed:
        first = len(raw) // 2
        await store.append_events(thread_id, "default", run.run_id, run.created_at, 0,
                                  raw[:first])
    await store.append_run(thread_id, "default", run, ids, raw_first=first, raw=raw[first:])


async def main(url: str, runs: int, concurrency: int, streamed: bool = False,
               phases: int = 1) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {_SCHEMA} CASCADE")
    store = PostgresThreadStore(url, schema=_SCHEMA, max_size=concurrency)
    try:
        async def worker(chats: list[_Chat]) -> None:
            for chat in chats:
                await _one(store, chat, streamed)

        await asyncio.gather(*(worker([_payload() for _ in range(50)])
                               for _ in range(concurrency)))  # warm-up
        with psycopg.connect(url, autocommit=True) as conn:
            vacuumed = conn.execute("SHOW autovacuum").fetchone()
        print(f"autovacuum {vacuumed[0] if vacuumed else '?'}; "
              f"{'streamed' if streamed else 'short'} runs")
        each = runs // concurrency // phases
        for phase in range(phases):
            work = [[_payload() for _ in range(each)] for _ in range(concurrency)]
            cpu, pg, start = time.process_time(), _postgres_cpu(), time.perf_counter()
            await asyncio.gather(*(worker(chats) for chats in work))
            done = each * concurrency
            wall = time.perf_counter() - start
            print(f"runs {phase * done + 1}-{(phase + 1) * done}: {done / wall:.0f} runs/s at "
                  f"c={concurrency}; CPU per run: this process "
                  f"{1000 * (time.process_time() - cpu) / done:.3f} ms, PostgreSQL "
                  f"{1000 * (_postgres_cpu() - pg) / done:.3f} ms")
    finally:
        await store.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--url", default=os.environ.get(
        "BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--streamed", action="store_true",
                        help="each run writes its first events while it streams")
    parser.add_argument("--phases", type=int, default=1)
    args = parser.parse_args()
    measured = main(args.url, args.runs, args.concurrency, args.streamed, args.phases)
    try:
        import uvloop

        uvloop.run(measured)
    except ImportError:
        asyncio.run(measured)
