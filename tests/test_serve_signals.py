"""`copilot-runtime serve` at a shutdown, seen from its clients: streams that follow a run
another server drives, and a thread store away while runs end. Each case starts the command
line as a process, on a small TARGET written for it."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import termios
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
import redis

from copilot_runtime import thread_store
from copilot_runtime.threads.base import INTERRUPTED_CODE
from tests.conftest import free_port, parse_sse, run_input, wait_for_server
from tests.test_cli_lifecycle import BARE_APP, SLOW_AGENT
from tests.test_store_outage import Proxy

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"

#: An agent that streams a word every 50 ms for a minute, its threads in `THREADS`,
#: coordinated through `COORDINATOR` (both filled in).
SLOW_APP = SLOW_AGENT + """
runtime = CopilotRuntime(agents={"default": Slow()}, thread_store=thread_store(THREADS),
                         coordinator=coordinator(COORDINATOR))
"""


@contextlib.contextmanager
def _services() -> Iterator[tuple[str, str]]:
    """(threads URL, coordinator URL): a fresh schema and key prefix, gone at the end."""
    name = f"fc_{uuid.uuid4().hex[:10]}"
    client = redis.Redis.from_url(REDIS)
    try:
        yield f"{POSTGRES}?schema={name}", f"{REDIS}?prefix={name}:&lease_ttl=2"
    finally:
        with psycopg.connect(POSTGRES, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        if keys := list(client.scan_iter(match=f"{name}:*")):
            client.delete(*keys)
        client.close()


def _serve(tmp_path: Path, target: str, port: int, *options: str,
           **popen: Any) -> subprocess.Popen[bytes]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    popen = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen([sys.executable, "-m", "copilot_runtime", "serve", target,
                             "--port", str(port), *options], cwd=tmp_path, env=env, **popen)


async def _read_until(response: aiohttp.ClientResponse, marker: bytes, count: int = 1) -> bytes:
    body = b""
    while body.count(marker) < count:
        body += await response.content.readany()
    return body


async def test_a_stream_following_a_run_of_another_server_ends_at_once_at_shutdown(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]]) -> None:
    with _services() as (threads, coordination):
        (tmp_path / "shared_app.py").write_text(
            f"THREADS = {threads!r}\nCOORDINATOR = {coordination!r}\n" + SLOW_APP)
        ports = free_port(), free_port()
        driver, follower = (_serve(tmp_path, "shared_app:runtime", port) for port in ports)
        stopped.extend((driver, follower))
        urls = [f"http://127.0.0.1:{port}/copilotkit" for port in ports]
        for url, process in zip(urls, (driver, follower), strict=True):
            await asyncio.to_thread(wait_for_server, url + "/info", process)
        async with aiohttp.ClientSession() as session:
            run = await session.post(urls[0] + "/agent/default/run",
                                     json=run_input("hi", thread="t"))
            await _read_until(run, b"word", 3)
            connect = await session.post(urls[1] + "/agent/default/connect",
                                         json=run_input("", thread="t"))
            head = await _read_until(connect, b"word", 3)
            follower.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # Before: it streamed on until the 5 s grace, then was cut mid-event (aiohttp
            # raises ClientPayloadError on a body cut short), a traceback logged.
            body = head + await connect.content.read()
            ended = time.monotonic() - signalled
            assert ended < 3, f"the follower's stream ended {ended:.1f} s after the signal"
            # The run goes on at the other server: no end is made up for it here.
            assert all(event["type"] not in ("RUN_FINISHED", "RUN_ERROR")
                       for event in parse_sse(body)), body[-300:]
            _out, err = await asyncio.to_thread(follower.communicate, timeout=15)
            assert follower.returncode == -signal.SIGTERM, err
            assert b"Traceback" not in err, err
            assert b"word" in await run.content.readany()  # still driven
            run.close()


async def test_runs_streaming_at_a_shutdown_while_their_store_is_away_end_at_once(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]]) -> None:
    proxy = Proxy(5432)
    proxy.schema = f"fc_{uuid.uuid4().hex[:10]}"
    await proxy.up()
    try:
        threads = f"postgresql://postgres@127.0.0.1:{proxy.port}/test?schema={proxy.schema}"
        (tmp_path / "away_app.py").write_text(
            f"THREADS = {threads!r}\nCOORDINATOR = 'local'\n" + SLOW_APP)
        port = free_port()
        process = _serve(tmp_path, "away_app:runtime", port)
        stopped.append(process)
        url = f"http://127.0.0.1:{port}/copilotkit"
        await asyncio.to_thread(wait_for_server, url + "/info", process)
        async with aiohttp.ClientSession() as session:
            runs = [await session.post(url + "/agent/default/run",
                                       json=run_input("hi", thread=f"t{i}")) for i in range(2)]
            heads = [await _read_until(run, b"word", 3) for run in runs]
            await proxy.down()
            await asyncio.sleep(0.3)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # Before: each end waited 10 s for the store, past the 5 s grace: the streams
            # were cut then, without their RUN_ERROR, each with a traceback.
            for head, run in zip(heads, runs, strict=True):
                last = parse_sse(head + await run.content.read())[-1]
                assert (last["type"], last["code"]) == ("RUN_ERROR", INTERRUPTED_CODE)
            ended = time.monotonic() - signalled
            assert ended < 3, f"the streams ended {ended:.1f} s after the signal"
        _out, err = await asyncio.to_thread(process.communicate, timeout=15)
        exited = time.monotonic() - signalled
        # Before: twice the grace (the drain's 5 s after the streams' 5 s).
        assert exited < 8, f"the process exited {exited:.1f} s after the signal"
        assert process.returncode == -signal.SIGTERM, err
        assert b"Traceback" not in err, err
    finally:
        await proxy.down()
        with psycopg.connect(POSTGRES, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{proxy.schema}" CASCADE')


async def test_a_hangup_shuts_the_server_down_as_sigterm_does(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]]) -> None:
    (tmp_path / "alone_app.py").write_text(
        "THREADS = 'memory://'\nCOORDINATOR = 'local'\n" + SLOW_APP)
    port = free_port()
    process = _serve(tmp_path, "alone_app:runtime", port)
    stopped.append(process)
    url = f"http://127.0.0.1:{port}/copilotkit"
    await asyncio.to_thread(wait_for_server, url + "/info", process)
    async with aiohttp.ClientSession() as session:
        run = await session.post(url + "/agent/default/run", json=run_input("hi", thread="t"))
        head = await _read_until(run, b"word", 3)
        process.send_signal(signal.SIGHUP)
        # Before: the process died of it at once, the stream cut without its end.
        last = parse_sse(head + await run.content.read())[-1]
    assert (last["type"], last["code"]) == ("RUN_ERROR", INTERRUPTED_CODE)
    _out, err = await asyncio.to_thread(process.communicate, timeout=15)
    assert process.returncode == -signal.SIGHUP, err
    assert b"Traceback" not in err, err


def _live(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()
            and b"zombie" not in Path(f"/proc/{pid}/status").read_bytes()]


def _descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children] + [
        grandchild for child in children for grandchild in _descendants(int(child))]


async def test_a_hangup_to_the_process_group_of_workers_ends_their_streams_and_restarts_them(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]]) -> None:
    (tmp_path / "alone_app.py").write_text(
        "THREADS = 'memory://'\nCOORDINATOR = 'local'\n" + SLOW_APP)
    port = free_port()
    # No terminal (as a service): its own process group, to which the SIGHUP is sent.
    process = _serve(tmp_path, "alone_app:runtime", port, "--workers", "2",
                     start_new_session=True)
    stopped.append(process)
    url = f"http://127.0.0.1:{port}/copilotkit"
    await asyncio.to_thread(wait_for_server, url + "/info", process)
    async with aiohttp.ClientSession() as session:
        run = await session.post(url + "/agent/default/run", json=run_input("hi", thread="t"))
        head = await _read_until(run, b"word", 3)
        os.killpg(process.pid, signal.SIGHUP)
        # Before: each worker died of it at once, the stream cut mid-event without its end
        # (aiohttp raises ClientPayloadError).
        last = parse_sse(head + await run.content.read())[-1]
        assert (last["type"], last["code"]) == ("RUN_ERROR", INTERRUPTED_CODE)
    # Without a terminal lost, the supervisor restarts the workers, as uvicorn does.
    await asyncio.to_thread(wait_for_server, url + "/info", process)
    async with aiohttp.ClientSession() as session:
        second = await session.post(url + "/agent/default/run",
                                    json=run_input("hi", thread="t2", run="r2"))
        assert second.status == 200
        await _read_until(second, b"word", 1)
        process.send_signal(signal.SIGTERM)
        last = parse_sse(await second.content.read())[-1]
        assert (last["type"], last["code"]) == ("RUN_ERROR", INTERRUPTED_CODE)
    _out, err = await asyncio.to_thread(process.communicate, timeout=15)
    assert process.returncode == 0, err
    assert b"Traceback" not in err, err
    assert b"resource_tracker" not in err, err  # it no longer dies of the hangup


def _on_its_own_terminal(terminal: int) -> None:
    """In the child: lead a session whose controlling terminal is `terminal` (its stdin)."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    os.close(terminal)


async def test_workers_whose_terminal_closes_end_their_streams_and_exit(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]]) -> None:
    with _services() as (threads, coordination):
        (tmp_path / "shared_app.py").write_text(
            f"THREADS = {threads!r}\nCOORDINATOR = {coordination!r}\n" + SLOW_APP)
        await _close_terminal_while_streaming(tmp_path, stopped)
        store = thread_store(threads)
        try:
            record = await store.get("t")
        finally:
            await store.aclose()
        # Before: the worker died with the run open, its end never stored.
        assert record is not None
        assert record.runs[-1].events[-1]["code"] == INTERRUPTED_CODE


async def _close_terminal_while_streaming(tmp_path: Path,
                                          stopped: list[subprocess.Popen[bytes]]) -> None:
    port = free_port()
    terminal, line = os.openpty()
    try:
        process = _serve(tmp_path, "shared_app:runtime", port, "--workers", "2", stdin=line,
                         stdout=line, stderr=line,
                         preexec_fn=lambda: _on_its_own_terminal(terminal))
    finally:
        os.close(line)
    stopped.append(process)
    os.set_blocking(terminal, False)
    url = f"http://127.0.0.1:{port}/copilotkit"
    try:
        await asyncio.to_thread(wait_for_server, url + "/info", process)
        async with aiohttp.ClientSession() as session:
            run = await session.post(url + "/agent/default/run",
                                     json=run_input("hi", thread="t"))
            head = await _read_until(run, b"word", 3)
            with contextlib.suppress(BlockingIOError):
                while os.read(terminal, 65536):  # what it wrote there, read as a terminal does
                    pass
            group = [*_descendants(process.pid), process.pid]
            # The terminal closes: the system takes it from its session and hangs up its
            # leader; a shell there passes the SIGHUP on to its job's whole process group.
            os.close(terminal)
            terminal = -1
            os.killpg(process.pid, signal.SIGHUP)
            # Before: the supervisor restarted the workers, for no one; writing to the lost
            # terminal as it started one failed, and it stayed, with that worker, for ever.
            last = parse_sse(head + await run.content.read())[-1]
        assert (last["type"], last["code"]) == ("RUN_ERROR", INTERRUPTED_CODE)
        returncode = await asyncio.to_thread(process.wait, timeout=15)
        assert returncode == -signal.SIGHUP
        deadline = time.monotonic() + 10
        while left := _live(group):
            assert time.monotonic() < deadline, f"processes {left} outlived the terminal"
            await asyncio.sleep(0.05)
    finally:
        if terminal >= 0:
            os.close(terminal)


def _workers_spawned(process: subprocess.Popen[bytes], count: int) -> None:
    """Until the supervisor `process` has `count` workers running Python (not serving yet)."""
    deadline = time.monotonic() + 20
    while True:
        workers = []
        for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    workers.append(pid)
        if len(workers) >= count:
            return
        assert process.poll() is None, process.communicate(timeout=10)
        assert time.monotonic() < deadline, f"{len(workers)} workers, not {count}"
        time.sleep(0.005)


#: Each worker's Python takes 3 s to start (as a loaded machine's imports can), before it
#: could answer the supervisor's health checks.
SLOW_WORKER_START = """
import sys, time
if any("spawn_main" in arg for arg in sys.orig_argv):
    time.sleep(3)
"""


def test_ctrl_c_while_workers_start_stops_them_at_once_without_a_traceback(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]]) -> None:
    (tmp_path / "bare_app.py").write_text(BARE_APP)
    (tmp_path / "sitecustomize.py").write_text(SLOW_WORKER_START)
    # As in a terminal: Ctrl-C reaches the supervisor and every worker (its process group).
    process = _serve(tmp_path, "bare_app:app", free_port(), "--workers", "2",
                     start_new_session=True)
    stopped.append(process)
    try:
        _workers_spawned(process, 2)
        time.sleep(0.8)  # the supervisor checks their health (from 0.5 s on)
        os.killpg(process.pid, signal.SIGINT)
        interrupted = time.monotonic()
        _out, err = process.communicate(timeout=20)
        ended = time.monotonic() - interrupted
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    # Before: each worker printed a KeyboardInterrupt traceback, and the supervisor waited
    # 4-6 s for workers to answer its health check.
    assert b"Traceback" not in err, err
    assert process.returncode == 0, err
    assert ended < 2, f"the command ended {ended:.1f} s after Ctrl-C"
