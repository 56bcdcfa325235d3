"""Soak and scale: many runs over many threads with a durable store, sampled as it goes.

    .venv/bin/python bench/soak.py                     100,000 runs over 10,000 threads, SQLite
    .venv/bin/python bench/soak.py --runs 20000 --threads 2000 --sample 2000   a shorter one
    .venv/bin/python bench/soak.py --store postgresql://127.0.0.1/test         another store

It starts the mock LLM and our server (`bench.app:runtime`, with `BENCH_STORE` set to the
store) as bench/run does, then sends `--runs` AG-UI runs from `--concurrency` closed-loop
workers. Run *i* goes to thread *i mod threads*, so each thread grows by one user message and
one answer per pass and the server reads (and replays into `seen` ids) an ever longer thread
from the store; every request carries the thread's whole history, as a browser does. Every
`--sample` runs it records the server's RSS (VmRSS) and CPU, the latency percentiles of the
runs of that window, and the store's size on disk. Every response is checked: RUN_STARTED
first, RUN_FINISHED last, the answer `echo: <message>`.

Output: a JSON file in bench/results/, a Markdown table on stdout, and a PNG plot (`--plot`,
default docs/soak.png; needs matplotlib, a bench-only dependency: `pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
_MESSAGE_ID = re.compile(rb'"type":"TEXT_MESSAGE_START","messageId":"([^"]+)"')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def proc_stat(pid: int) -> tuple[float, float]:
    """(RSS in MB, CPU seconds used) of a process."""
    rss = 0.0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return rss, (int(fields[11]) + int(fields[12])) / ticks


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


@dataclass
class Thread:
    id: str
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Window:
    latencies: list[float] = field(default_factory=list)
    first_event: list[float] = field(default_factory=list)
    failures: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_run(session: aiohttp.ClientSession, url: str, thread: Thread, n: int,
                  window: Window) -> None:
    text = f"soak message {n} " + "x" * 60
    user = {"id": f"u-{uuid.uuid4().hex}", "role": "user", "content": text}
    body = {"threadId": thread.id, "runId": f"r-{uuid.uuid4().hex}", "state": {}, "tools": [],
            "context": [], "forwardedProps": {}, "messages": [*thread.messages, user]}
    started = time.perf_counter()
    first: float | None = None
    chunks: list[bytes] = []
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                window.failures += 1
                await response.read()
                return
            async for chunk in response.content.iter_any():
                if first is None:
                    first = time.perf_counter() - started
                chunks.append(chunk)
    except aiohttp.ClientError:
        window.failures += 1
        return
    elapsed = time.perf_counter() - started
    raw = b"".join(chunks)
    # Each SSE frame is `id: N` and `data: {...}` lines.
    frames = [line[6:] for f in raw.split(b"\n\n") for line in f.split(b"\n")
              if line.startswith(b"data: ")]
    match = _MESSAGE_ID.search(raw)
    ok = (frames and b'"RUN_STARTED"' in frames[0][:40] and b'"RUN_FINISHED"' in frames[-1][:40]
          and match is not None)
    if ok:
        deltas = [json.loads(f)["delta"] for f in frames if b'"TEXT_MESSAGE_CONTENT"' in f[:60]]
        ok = "".join(deltas) == "echo: " + text
    if not ok or match is None:
        window.failures += 1
        return
    thread.messages.append(user)
    thread.messages.append({"id": match.group(1).decode(), "role": "assistant",
                            "content": "echo: " + text})
    window.latencies.append(elapsed * 1000)
    window.first_event.append((first or elapsed) * 1000)


async def drive(args: argparse.Namespace, url: str, server_pid: int,
                store_path: Path | None) -> list[dict[str, Any]]:
    threads = [Thread(f"soak-{uuid.uuid4().hex[:12]}-{i}") for i in range(args.threads)]
    samples: list[dict[str, Any]] = []
    window = Window()
    next_run = 0
    done = 0
    lock = asyncio.Lock()
    rss0, cpu0 = proc_stat(server_pid)
    samples.append({"runs": 0, "rss_mb": round(rss0, 1)})
    last_cpu, last_time, last_busy = cpu0, time.perf_counter(), machine_busy()
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=120)

    async def sample() -> None:
        nonlocal window, last_cpu, last_time, last_busy
        rss, cpu = proc_stat(server_pid)
        now, busy = time.perf_counter(), machine_busy()
        runs = len(window.latencies) + window.failures
        db = sum(p.stat().st_size for p in store_path.parent.glob(store_path.name + "*")) \
            if store_path is not None else 0
        cores = os.cpu_count() or 1
        machine = (busy[0] - last_busy[0]) / max(1, busy[1] - last_busy[1]) * cores
        entry = {
            "runs": done, "rss_mb": round(rss, 1),
            "p50_ms": round(percentile(window.latencies, 0.50), 2),
            "p99_ms": round(percentile(window.latencies, 0.99), 2),
            "first_event_p99_ms": round(percentile(window.first_event, 0.99), 2),
            "runs_per_s": round(runs / (now - last_time), 1),
            "server_cpu_ms_per_run": round((cpu - last_cpu) * 1000 / max(1, runs), 3),
            "machine_busy_cores": round(machine, 2),
            "failures": window.failures, "store_mb": round(db / 2**20, 1),
        }
        samples.append(entry)
        print(json.dumps(entry), flush=True)
        window, last_cpu, last_time, last_busy = Window(), cpu, now, busy

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_run, done
        while True:
            n = next_run
            if n >= args.runs:
                return
            next_run += 1
            await one_run(session, url, threads[n % args.threads], n, window)
            done += 1
            if done % args.sample == 0:
                async with lock:
                    await sample()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    if done % args.sample:
        await sample()
    return samples


def wait_for(url: str, seconds: float = 30) -> None:
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=1).read()
            return
        time.sleep(0.1)
    raise SystemExit(f"soak: {url} did not answer")


def plot(samples: list[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("soak: matplotlib is not installed; no plot (pip install matplotlib)")
        return False
    runs = [s["runs"] / 1000 for s in samples if "p99_ms" in s]
    fig, (top, bottom, cpu) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    top.plot([s["runs"] / 1000 for s in samples], [s["rss_mb"] for s in samples], marker="o")
    top.set_ylabel("server RSS (MB)")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    bottom.plot(runs, [s["p99_ms"] for s in samples if "p99_ms" in s], marker="o",
                label="p99 run latency")
    bottom.plot(runs, [s["p50_ms"] for s in samples if "p50_ms" in s], marker=".",
                label="p50 run latency")
    bottom.set_ylabel("latency (ms)")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    bottom.legend()
    cpu.plot(runs, [s["server_cpu_ms_per_run"] for s in samples if "p99_ms" in s], marker="o",
             label="server CPU per run (ms)")
    cpu.plot(runs, [s["machine_busy_cores"] for s in samples if "p99_ms" in s], marker=".",
             label="whole machine busy (cores of 2)")
    cpu.set_xlabel("runs (thousands)")
    cpu.set_ylim(bottom=0)
    cpu.grid(alpha=0.3)
    cpu.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def table(samples: list[dict[str, Any]]) -> str:
    lines = ["| runs | RSS (MB) | p50 / p99 (ms) | first event p99 (ms) | runs/s | server CPU "
             "per run (ms) | machine busy (cores) | store (MB) | failures |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in samples:
        if "p99_ms" not in s:
            lines.append(f"| {s['runs']:,} | {s['rss_mb']} | | | | | | | |")
            continue
        lines.append(
            f"| {s['runs']:,} | {s['rss_mb']} | {s['p50_ms']} / {s['p99_ms']} | "
            f"{s['first_event_p99_ms']} | {s['runs_per_s']} | {s['server_cpu_ms_per_run']} | "
            f"{s['machine_busy_cores']} | {s['store_mb']} | {s['failures']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=10_000)
    parser.add_argument("--sample", type=int, default=10_000, help="runs per sample")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--store", default="sqlite",
                        help="sqlite (a fresh file in bench/.scratch), sqlite:PATH, "
                             "or a postgresql:// URL")
    parser.add_argument("--chunks", type=int, default=50, help="pieces per mock answer")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "soak.png")
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    args = parser.parse_args()

    scratch = BENCH / ".scratch" / "soak"
    scratch.mkdir(parents=True, exist_ok=True)
    store_path: Path | None = None
    store = args.store
    if store == "sqlite":
        store_path = scratch / f"threads-{os.getpid()}.db"
        store = str(store_path)
    elif store.startswith("sqlite:"):
        store_path = Path(store.removeprefix("sqlite:"))
    started: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as logs:
        mock_log = logs.enter_context(open(scratch / "mock.log", "wb"))
        server_log = logs.enter_context(open(scratch / "server.log", "wb"))
        samples, wall, began = run(args, scratch, store, store_path, started, mock_log,
                                   server_log)
    report(args, samples, wall, began, store_path)


def run(args: argparse.Namespace, scratch: Path, store: str, store_path: Path | None,
        started: list[subprocess.Popen[bytes]], mock_log: Any,
        server_log: Any) -> tuple[list[dict[str, Any]], float, float]:
    try:
        mock_port, server_port = free_port(), free_port()
        started.append(subprocess.Popen(
            [args.python, "-m", "copilot_runtime.testing", "--port", str(mock_port),
             "--chunks", str(args.chunks), "--delay-ms", "0"], cwd=ROOT,
            stdout=mock_log, stderr=subprocess.STDOUT))
        env = {**os.environ, "LLM_BASE_URL": f"http://127.0.0.1:{mock_port}/v1",
               "BENCH_STORE": store}
        server = subprocess.Popen(
            [args.python, "-m", "copilot_runtime", "serve", "bench.app:runtime",
             "--host", "127.0.0.1", "--port", str(server_port), "--path", "/api/copilotkit"],
            cwd=ROOT, env=env, stdout=server_log,
            stderr=subprocess.STDOUT)
        started.append(server)
        wait_for(f"http://127.0.0.1:{mock_port}/healthz")
        wait_for(f"http://127.0.0.1:{server_port}/api/copilotkit/info")
        url = f"http://127.0.0.1:{server_port}/api/copilotkit/agent/default/run"
        began = time.time()
        samples = asyncio.run(drive(args, url, server.pid, store_path))
        wall = time.time() - began
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        if args.store == "sqlite" and store_path is not None:
            for path in store_path.parent.glob(store_path.name + "*"):
                path.unlink()
    return samples, wall, began


def report(args: argparse.Namespace, samples: list[dict[str, Any]], wall: float,
           began: float, store_path: Path | None) -> None:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(began))
    total_failures = sum(s.get("failures", 0) for s in samples)
    result = {"stamp": stamp, "runs": args.runs, "threads": args.threads,
              "concurrency": args.concurrency, "store": args.store.split("@")[-1],
              "chunks": args.chunks, "wall_s": round(wall, 1), "failures": total_failures,
              "mean_runs_per_s": round(args.runs / wall, 1), "samples": samples}
    out = BENCH / "results" / f"soak-{stamp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    store_name = "SQLite" if store_path is not None else args.store.split("://")[0]
    title = (f"soak {stamp}: {args.runs:,} runs over {args.threads:,} threads, {store_name} "
             f"store, {args.concurrency} workers")
    print(table(samples))
    print(f"\n{args.runs:,} runs in {wall:.0f} s ({args.runs / wall:.0f} runs/s), "
          f"{total_failures} failures; {out.relative_to(ROOT)}")
    if args.plot and plot(samples, args.plot, title):
        print(f"plot: {args.plot}")
    sys.exit(1 if total_failures else 0)


if __name__ == "__main__":
    main()
