"""The SQLite thread store alone: what a chat on a new thread asks of it (`summary` when the
run begins, `append_run` when it ends), at a given concurrency, with this process's CPU per
run (SQLite runs inside it).

    python -m bench.sqlite_store [--runs 3000] [--concurrency 10] [--path FILE]

The payload is bench/pg_store.py's (a bench chat's). The file is made anew first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from bench.pg_store import _Chat, _one, _payload
from copilot_runtime.threads.sqlite import SQLiteThreadStore


def _remove(path: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)


async def main(path: str, runs: int, concurrency: int) -> None:
    _remove(path)
    store = SQLiteThreadStore(path)
    try:
        async def worker(chats: list[_Chat]) -> None:
            for chat in chats:
                await _one(store, chat)  # type: ignore[arg-type]

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
    parser.add_argument("--path", default=os.path.join(tempfile.gettempdir(),
                                                        "bench_sqlite_store.sqlite3"))
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(main(args.path, args.runs, args.concurrency))
    except ImportError:
        asyncio.run(main(args.path, args.runs, args.concurrency))
