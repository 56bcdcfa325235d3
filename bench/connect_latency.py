"""`connect` latency on a big store: one thread of 200 runs among 10,000 threads.

    .venv/bin/python -m bench.connect_latency [--store URL] [--threads N] [--runs N]
                                              [--requests N]

Fills the store through its own interface (each thread one short run; the measured thread
`--runs` runs of a few hundred bytes of text each), serves a runtime on it on loopback, and
times `POST agent/default/connect` for the big thread (whole replay) and with a
`Last-Event-ID` at its last run boundary (nothing to send), sequentially. Prints p50/p99 in
ms. Default store: a PostgreSQL schema made for the run and dropped after (database `test`
on 127.0.0.1:5432); `--store sqlite:///path` or `memory://` for the others.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import aiohttp
import orjson
import uvicorn

from copilot_runtime import CopilotRuntime, DemoAdapter, create_app, thread_store
from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events
from copilot_runtime.threads import StoredRun, ThreadStore

PG = "postgresql://postgres@127.0.0.1:5432/test"


def _run(thread: str, run: str, first: int) -> StoredRun:
    text = "The quick brown fox jumps over the lazy dog. " * 6
    raw = [ev.run_started(thread, run, {"threadId": thread, "runId": run, "messages": [
        {"id": f"u-{run}", "role": "user", "content": "Tell me about foxes."}]}),
        ev.text_message_start(f"m-{run}"),
        *[ev.text_message_content(f"m-{run}", word + " ") for word in text.split()],
        ev.text_message_end(f"m-{run}"), ev.run_finished(thread, run)]
    compacted = compact_events(raw)
    return StoredRun(run, compacted, time.time(), len(orjson.dumps(compacted)), first,
                     first + len(raw) - 1)


async def _fill(store: ThreadStore, threads: int, runs: int) -> None:
    semaphore = asyncio.Semaphore(8)

    async def one(index: int) -> None:
        async with semaphore:
            run = _run(f"t{index}", "r0", 0)
            await store.append_run(f"t{index}", "default", run, [f"u-r0-{index}"])

    await asyncio.gather(*[one(i) for i in range(threads)])
    position = 0
    for index in range(runs):
        run = _run("big", f"r{index}", position)
        position = run.last_position + 1
        await store.append_run("big", "default", run, [f"u-r{index}", f"m-r{index}"])


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", default=None)
    parser.add_argument("--threads", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    schema = None
    url = args.store
    if url is None:
        schema = f"bench_{uuid.uuid4().hex[:8]}"
        url = f"{PG}?schema={schema}"
    store = thread_store(url)
    started = time.perf_counter()
    await _fill(store, args.threads, args.runs)
    print(f"store {url.split('?')[0]}: filled {args.threads} threads and {args.runs} runs "
          f"in {time.perf_counter() - started:.1f} s")
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store)
    server = uvicorn.Server(uvicorn.Config(create_app(runtime, "/api/copilotkit"),
                                           host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no event for it
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}/api/copilotkit/agent/default/connect"
    body = {"threadId": "big", "runId": "x", "messages": [], "tools": [], "context": [],
            "state": {}, "forwardedProps": {}}
    record = await store.get("big")
    assert record is not None
    boundary = record.runs[-1].first_position - 1
    try:
        async with aiohttp.ClientSession() as session:
            for label, headers in (("whole thread", {}),
                                   ("Last-Event-ID at the last run",
                                    {"Last-Event-ID": str(boundary)})):
                times: list[float] = []
                size = 0
                for _ in range(args.requests):
                    began = time.perf_counter()
                    async with session.post(base, json=body, headers=headers) as response:
                        data = await response.read()
                    times.append((time.perf_counter() - began) * 1000)
                    size = len(data)
                print(f"connect, {label}: p50 {statistics.median(times):.2f} ms, "
                      f"p99 {_pct(times, 0.99):.2f} ms ({size} bytes)")
    finally:
        server.should_exit = True
        await task
        await store.aclose()
        if schema is not None:
            import psycopg

            with psycopg.connect(PG, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


if __name__ == "__main__":
    asyncio.run(main())
