"""bench/scale.py: what several workers buy, and what coordinating them costs.

    .venv/bin/python -m bench.scale [--seconds 10] [--conc 10] [--threads URL] [--coordinator URL]

Measures, on this machine, against the loopback mock LLM:

1. requests/s and server CPU per request of `copilot-runtime serve --workers 2` against
   `--workers 1`, at concurrency `--conc`, each request a new thread (a short chat); and
   one worker on the same store with the `local` coordinator (what coordinating costs);
2. the time from `stop` on one worker to the end of the run's stream on another (two
   single-process workers sharing the thread store and the coordinator);
3. the time from SIGKILL of the worker streaming a run until another worker accepts a new run
   on the thread (the lease's expiry), and until the killed run is closed as interrupted.

Threads default to PostgreSQL (127.0.0.1:5432, database `test`, a fresh schema dropped at the
end) and so does the coordinator. Prints one JSON object; not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
PATH = "/api/copilotkit"
POSTGRES = os.environ.get("COPILOT_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def body(thread: str, run: str, text: str) -> bytes:
    return orjson.dumps({"threadId": thread, "runId": run, "tools": [], "context": [],
                         "forwardedProps": {}, "state": {},
                         "messages": [{"id": f"{run}-u", "role": "user", "content": text}]})


def cpu_seconds(pid: int) -> float:
    """CPU time of `pid` and its children that are alive (user + system)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for each in pids:
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def start_mock(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "copilot_runtime.testing", "--port",
                             str(port), "--chunks", "20"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Server:
    def __init__(self, env: dict[str, str], workers: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{PATH}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "copilot_runtime", "serve", "bench.scale_app:runtime",
             "--port", str(self.port), "--path", PATH, "--workers", str(workers)],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def ready(self, session: aiohttp.ClientSession) -> None:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                async with session.get(self.url + "/info") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError("server did not start")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(20)


async def load(session: aiohttp.ClientSession, url: str, seconds: float,
               conc: int) -> int:
    done = 0
    end = time.monotonic() + seconds

    async def user() -> None:
        nonlocal done
        while time.monotonic() < end:
            thread = uuid.uuid4().hex
            async with session.post(url + "/agent/default/run", data=body(thread, "r", "hi"),
                                    headers={"Content-Type": "application/json"}) as response:
                await response.read()
                if response.status == 200:
                    done += 1

    await asyncio.gather(*(user() for _ in range(conc)))
    return done


async def throughput(env: dict[str, str], session: aiohttp.ClientSession, workers: int,
                     seconds: float, conc: int) -> dict[str, Any]:
    server = Server(env, workers)
    try:
        await server.ready(session)
        await load(session, server.url, 2, conc)  # warm-up
        cpu = cpu_seconds(server.process.pid)
        started = time.monotonic()
        done = await load(session, server.url, seconds, conc)
        elapsed = time.monotonic() - started
        cpu = cpu_seconds(server.process.pid) - cpu
    finally:
        server.stop()
    return {"workers": workers, "requests": done, "rps": round(done / elapsed, 1),
            "cpu_ms_per_request": round(1000 * cpu / max(done, 1), 2)}


async def stop_latency(env: dict[str, str], session: aiohttp.ClientSession,
                       rounds: int) -> dict[str, Any]:
    a, b = Server(env), Server(env)
    times: list[float] = []
    try:
        await asyncio.gather(a.ready(session), b.ready(session))
        for _ in range(rounds):
            thread = uuid.uuid4().hex
            async with session.post(a.url + "/agent/default/run",
                                    data=body(thread, "r", "slow:200 a long answer"),
                                    headers={"Content-Type": "application/json"}) as running:
                await running.content.readline()  # RUN_STARTED is out: the run is live
                await asyncio.sleep(0.3)
                asked = time.monotonic()
                async with session.post(b.url + f"/agent/default/stop/{thread}",
                                        data=b"{}") as stop:
                    assert (await stop.json())["stopped"], "not stopped"
                await running.read()
                times.append(time.monotonic() - asked)
    finally:
        a.stop()
        b.stop()
    times.sort()
    return {"rounds": rounds, "p50_ms": round(1000 * statistics.median(times), 1),
            "max_ms": round(1000 * times[-1], 1)}


async def lease_expiry(env: dict[str, str], session: aiohttp.ClientSession) -> dict[str, Any]:
    a, b = Server(env), Server(env)
    try:
        await asyncio.gather(a.ready(session), b.ready(session))
        thread = uuid.uuid4().hex
        running = await session.post(a.url + "/agent/default/run",
                                     data=body(thread, "r1", "slow:2000 a long answer"),
                                     headers={"Content-Type": "application/json"})
        await running.content.readline()
        await asyncio.sleep(1.0)
        a.stop(signal.SIGKILL)
        killed = time.monotonic()
        running.close()
        accepted = interrupted = None
        attempt = 0
        while time.monotonic() - killed < 60 and (accepted is None or interrupted is None):
            if interrupted is None:
                async with session.post(b.url + "/agent/default/connect",
                                        data=body(thread, "c", "")) as connect:
                    text = await connect.text()
                    if "INTERRUPTED" in text.upper():
                        interrupted = time.monotonic() - killed
            if accepted is None:
                attempt += 1
                async with session.post(b.url + "/agent/default/run",
                                        data=body(thread, f"r{attempt + 1}", "hi"),
                                        headers={"Content-Type": "application/json"}) as again:
                    await again.read()
                    if again.status == 200:
                        accepted = time.monotonic() - killed
            await asyncio.sleep(0.1)
    finally:
        a.stop()
        b.stop()
    return {"new_run_accepted_s": None if accepted is None else round(accepted, 2),
            "interrupted_in_connect_s": None if interrupted is None else round(interrupted, 2)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--conc", type=int, default=10)
    parser.add_argument("--threads", help="thread store URL (default: a fresh PostgreSQL schema)")
    parser.add_argument("--coordinator", help="coordinator URL (default: the same PostgreSQL)")
    parser.add_argument("--stops", type=int, default=20)
    args = parser.parse_args()
    schema = f"bench_scale_{uuid.uuid4().hex[:8]}"
    threads = args.threads or f"{POSTGRES}?schema={schema}"
    coordination = args.coordinator or threads
    mock_port = free_port()
    mock = start_mock(mock_port)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SCALE_THREADS": threads,
           "SCALE_COORDINATOR": coordination,
           "LLM_BASE_URL": f"http://127.0.0.1:{mock_port}/v1"}
    result: dict[str, Any] = {"threads": threads.split("?")[0] + "?...",
                              "coordinator": coordination.split("?")[0] + "?...",
                              "cores": os.cpu_count(), "loadavg_before": os.getloadavg()[0]}
    try:
        async with aiohttp.ClientSession() as session:
            result["throughput"] = [
                await throughput(env, session, workers, args.seconds, args.conc)
                for workers in (1, 2)]
            # The same store, one worker, no coordination: what coordinating costs a run.
            local = {**env, "SCALE_COORDINATOR": "local"}
            result["throughput_local_coordinator"] = await throughput(
                local, session, 1, args.seconds, args.conc)
            result["stop_across_workers"] = await stop_latency(env, session, args.stops)
            result["lease_expiry_after_sigkill"] = await lease_expiry(env, session)
    finally:
        mock.terminate()
        mock.wait(10)
        if not args.threads:
            import psycopg

            with psycopg.connect(POSTGRES, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    result["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
