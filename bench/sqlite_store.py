"""The SQLite thread store alone: what a chat on a new thread asks of it (`summary` when the
run begins, `append_run` when it ends), at a given concurrency, with this process's CPU per
run (SQLite runs inside it).

    python -m bench.sqlite_store [--runs 3000] [--concurrency 10] [--path FILE] [--flushes]

The payload is bench/pg_store.py's (a bench chat's). The file is made anew first. With
`--flushes`, what a running run writes every 200 ms instead (`append_events`, 12 text deltas
each, `--concurrency` runs streaming), CPU per flush.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from bench.pg_store import _Chat, _one, _payload
from copilot_runtime import events as ev
from copilot_runtime.threads.sqlite import SQLiteThreadStore


def _remove(path: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)


async def flushes(path: str, count: int, concurrency: int) -> None:
    _remove(path)
    store = SQLiteThreadStore(path)
    deltas = [ev.text_message_content("m", f"word{i} ") for i in range(12)]
    try:
        async def stream(thread_id: str, rounds: int, start: int) -> None:
            for k in range(start, start + rounds):
                await store.append_events(thread_id, "default", "r", 1.0, 12 * k, deltas)

        threads = [f"t{i}" for i in range(concurrency)]
        await asyncio.gather(*(stream(t, 20, 0) for t in threads))  # warm-up
        rounds = count // concurrency
        cpu, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(stream(t, rounds, 20) for t in threads))
        done = rounds * concurrency
        wall = time.perf_counter() - start
        print(f"{done / wall:.0f} flushes/s at c={concurrency}; CPU per flush: this process "
              f"{1000 * (time.process_time() - cpu) / done:.3f} ms")
    finally:
        await store.aclose()


async def main(path: str, runs: int, concurrency: int) -> None:
    _remove(path)
    store = SQLiteThreadStore(path)
    try:
        async def worker(chats: list[_Chat]) -> None:
            for chat in chats:
                await _one(store, chat, False)  # type: ignore[arg-type]

        await asyncio.gather(*(worker([_payload() for _ in range(50)])
                               for _ in range(concurrency)))  # warm-up
        work = [[_payload() for _ in range(runs // concurrency)] for _ in range(concurrency)]
        cpu, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker(chats) for chats in work))
        done = runs // concurrency * concurrency
        wall = time.perf_counter() - start
        print(f"{done / wall:.0f} runs/s at c={concurrency}; CPU per run: this process "
              f"{1000 * (time.process_time() - cpu) / done:.3f} ms")
    finally:
        await store.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--flushes", action="store_true")
    parser.add_argument("--path", default=os.path.join(tempfile.gettempdir(),
                                                        "bench_sqlite_store.sqlite3"))
    args = parser.parse_args()
    measured = (flushes if args.flushes else main)(args.path, args.runs, args.concurrency)
    try:
        import uvloop

        uvloop.run(measured)
    except ImportError:
        asyncio.run(measured)
