"""Many concurrent streams: how fast each client hears its first event, and what it costs.

    .venv/bin/python -m bench.streams                 1,000 streams started within 1.5 s
    .venv/bin/python -m bench.streams --streams 2000 --spread 2 --delay-ms 50

It starts the mock LLM and our server (`bench.app:runtime`, in-memory store) as bench/run
does, then opens `--streams` AG-UI runs, their starts spread evenly over `--spread` seconds,
each on its own connection. The mock answers in `--chunks` pieces `--delay-ms` apart, so the
streams overlap: with the defaults every stream is still open when the last one starts.
Measured per stream, from sending the request: the first event (`RUN_STARTED`), the first
text, and the end (`RUN_FINISHED`, checked, with the answer's text); for the server: peak RSS
(VmHWM), RSS before and after, and CPU. Results: a JSON file in bench/results/ and a summary
on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from bench.soak import BENCH, ROOT, free_port, percentile, proc_stat, wait_for


def peak_rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def one_stream(session: aiohttp.ClientSession, url: str, delay: float,
                     started: float, text: str) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, started + delay - time.perf_counter()))
    body = {"threadId": f"t-{uuid.uuid4().hex}", "runId": f"r-{uuid.uuid4().hex}",
            "state": {}, "tools": [], "context": [], "forwardedProps": {},
            "messages": [{"id": f"u-{uuid.uuid4().hex}", "role": "user", "content": text}]}
    sent = time.perf_counter()
    first = first_text = None
    raw = bytearray()
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                return {"ok": False, "status": response.status}
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                if first is None:
                    first = now - sent
                raw += chunk
                if first_text is None and b'"TEXT_MESSAGE_CONTENT"' in chunk:
                    first_text = now - sent
    except aiohttp.ClientError as exc:
        return {"ok": False, "error": type(exc).__name__}
    end = time.perf_counter() - sent
    # Each SSE frame is `id: N` and `data: {...}` lines (keep-alive comments have no data).
    frames = [json.loads(line[6:]) for f in bytes(raw).split(b"\n\n")
              for line in f.split(b"\n") if line.startswith(b"data: ")]
    answer = "".join(f.get("delta", "") for f in frames if f["type"] == "TEXT_MESSAGE_CONTENT")
    ok = bool(frames) and frames[0]["type"] == "RUN_STARTED" and (
        frames[-1]["type"] == "RUN_FINISHED") and answer == "echo: " + text
    return {"ok": ok, "first_event": first, "first_text": first_text, "end": end}


async def drive(args: argparse.Namespace, url: str) -> tuple[list[dict[str, Any]], float]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=300)
    text = "stream " + "x" * 100
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter() + 0.2
        step = args.spread / max(1, args.streams - 1)
        results = await asyncio.gather(*(one_stream(session, url, i * step, started, text)
                                         for i in range(args.streams)))
        wall = time.perf_counter() - started
    return list(results), wall


def ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--spread", type=float, default=1.5, help="seconds over which they start")
    parser.add_argument("--chunks", type=int, default=5, help="pieces per answer")
    parser.add_argument("--delay-ms", type=float, default=300, help="between pieces")
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="serve the runtime of this checkout (to compare commits)")
    args = parser.parse_args()
    with contextlib.suppress(ImportError):
        import uvloop  # the client's own loop must not be what is slow

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    scratch = BENCH / ".scratch" / "streams"
    scratch.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        mock_log = stack.enter_context(open(scratch / "mock.log", "wb"))
        server_log = stack.enter_context(open(scratch / "server.log", "wb"))
        try:
            mock_port, port = free_port(), free_port()
            procs.append(subprocess.Popen(
                [args.python, "-m", "copilot_runtime.testing", "--port", str(mock_port),
                 "--chunks", str(args.chunks), "--delay-ms", str(args.delay_ms)],
                cwd=args.root, stdout=mock_log, stderr=subprocess.STDOUT))
            env = {**os.environ, "LLM_BASE_URL": f"http://127.0.0.1:{mock_port}/v1"}
            env.pop("BENCH_STORE", None)
            server = subprocess.Popen(
                [args.python, "-m", "copilot_runtime", "serve", "bench.app:runtime",
                 "--host", "127.0.0.1", "--port", str(port), "--path", "/api/copilotkit"],
                cwd=args.root, env=env, stdout=server_log, stderr=subprocess.STDOUT)
            procs.append(server)
            wait_for(f"http://127.0.0.1:{mock_port}/healthz")
            wait_for(f"http://127.0.0.1:{port}/api/copilotkit/info")
            time.sleep(0.5)
            idle_rss, cpu0 = proc_stat(server.pid)
            results, wall = asyncio.run(drive(
                args, f"http://127.0.0.1:{port}/api/copilotkit/agent/default/run"))
            after_rss, cpu1 = proc_stat(server.pid)
            peak = peak_rss(server.pid)
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
    good = [r for r in results if r["ok"]]
    first = [r["first_event"] for r in good]
    first_text = [r["first_text"] for r in good if r["first_text"] is not None]
    ends = [r["end"] for r in good]
    summary = {
        "streams": args.streams, "spread_s": args.spread, "chunks": args.chunks,
        "delay_ms": args.delay_ms, "ok": len(good), "failed": len(results) - len(good),
        "first_event_ms": {"p50": ms(first, 0.5), "p90": ms(first, 0.9), "p99": ms(first, 0.99),
                           "max": ms(first, 1.0)},
        "first_text_ms": {"p50": ms(first_text, 0.5), "p99": ms(first_text, 0.99)},
        "end_ms": {"p50": ms(ends, 0.5), "p99": ms(ends, 0.99), "max": ms(ends, 1.0)},
        "wall_s": round(wall, 2),
        "server_rss_mb": {"idle": round(idle_rss, 1), "peak": round(peak, 1),
                          "after": round(after_rss, 1)},
        "server_cpu_s": round(cpu1 - cpu0, 2),
        "server_cpu_ms_per_stream": round((cpu1 - cpu0) * 1000 / max(1, len(results)), 2),
        "load_average": os.getloadavg(),
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = BENCH / "results" / f"streams-{stamp}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"written: {out.relative_to(ROOT)}")
    if summary["failed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
