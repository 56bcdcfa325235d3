"""The served process's life: workers that cannot start, a supervisor killed, a shutdown while
runs stream. Each case starts the command line as a process (that is what is tested), on a
small TARGET written for it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import aiohttp
import httpx2
import orjson
import pytest

from copilot_runtime import CopilotRuntime
from copilot_runtime._input import parse_run_input
from copilot_runtime.events import Event
from copilot_runtime.threads.base import INTERRUPTED_CODE
from tests.conftest import GatedAgent, free_port, parse_sse, run_input, wait_for_server
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, merge, parse_multipart, user_turn

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]

#: An agent that streams a word every 50 ms for a minute (`Slow`), and an app of it.
SLOW_AGENT = """
import asyncio
from copilot_runtime import Agent, CopilotRuntime, coordinator, thread_store
from copilot_runtime import events as ev

class Slow(Agent):
    def run(self, input, context):
        return self._run(input.run_id)

    async def _run(self, run_id):
        yield [ev.text_message_start("m-" + run_id)]
        for _ in range(1200):
            yield [ev.text_message_content("m-" + run_id, "word ")]
            await asyncio.sleep(0.05)
        yield [ev.text_message_end("m-" + run_id)]
"""
SLOW_APP = SLOW_AGENT + """
runtime = CopilotRuntime(agents={"default": Slow()})
"""

#: A bare ASGI app: quick to import in each worker.
BARE_APP = """
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})
"""


def _command(tmp_path: Path, *args: str, stderr: int = subprocess.PIPE
             ) -> subprocess.Popen[bytes]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    return subprocess.Popen([sys.executable, "-m", "copilot_runtime", *args], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=stderr)


@pytest.mark.parametrize("source", [
    # Imports in the supervisor, fails in each worker (an environment only they have).
    'import os\nif os.environ.get("COPILOT_RUNTIME_SERVE"):\n    raise RuntimeError("boom")\n'
    + BARE_APP,
    # Imports everywhere; its runtime cannot start (a coordinator that refuses).
    "from copilot_runtime import CopilotRuntime, coordinator\n"
    "from copilot_runtime.threads.sqlite import SQLiteThreadStore\n"
    "app = CopilotRuntime(thread_store=SQLiteThreadStore(':memory:'),\n"
    "                     coordinator=coordinator('redis://127.0.0.1:1/0'))\n",
], ids=["worker-import", "lifespan"])
def test_workers_that_cannot_start_stop_the_command_with_code_3(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]], source: str) -> None:
    (tmp_path / "failing_app.py").write_text(source)
    process = _command(tmp_path, "serve", "failing_app:app", "--workers", "2",
                       "--port", str(free_port()))
    stopped.append(process)
    # Before: exit code 0 (lifespan), or workers started again, and failing, for ever.
    _out, err = process.communicate(timeout=30)
    assert process.returncode == 3, err
    assert b"Traceback" not in err, err
    assert b"error: " in err


def test_workers_die_with_a_killed_supervisor(tmp_path: Path,
                                              stopped: list[subprocess.Popen[bytes]]) -> None:
    (tmp_path / "bare_app.py").write_text(BARE_APP)
    port = free_port()
    process = _command(tmp_path, "serve", "bare_app:app", "--workers", "2", "--port", str(port))
    stopped.append(process)
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    deadline = time.monotonic() + 30
    while len(workers := children.read_text().split()) < 2:
        assert time.monotonic() < deadline, process.communicate(timeout=10)
        time.sleep(0.05)
    wait_for_server(f"http://127.0.0.1:{port}/", process)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=10)
    deadline = time.monotonic() + 10
    # Before: they went on serving the port as orphans.
    while alive := [pid for pid in workers if Path(f"/proc/{pid}").exists()
                    and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]]:
        assert time.monotonic() < deadline, f"workers {alive} outlived their supervisor"
        time.sleep(0.05)
    with pytest.raises(httpx2.TransportError):
        httpx2.get(f"http://127.0.0.1:{port}/", timeout=1)


async def _read_until(response: aiohttp.ClientResponse, marker: bytes) -> bytes:
    body = b""
    while marker not in body:
        body += await response.content.readany()
    return body


async def test_runs_streaming_at_a_shutdown_end_with_their_interruption(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]]) -> None:
    (tmp_path / "slow_app.py").write_text(SLOW_APP)
    port = free_port()
    process = _command(tmp_path, "serve", "slow_app:runtime", "--port", str(port))
    stopped.append(process)
    url = f"http://127.0.0.1:{port}/copilotkit"
    await asyncio.to_thread(wait_for_server, url + "/info", process)
    async with aiohttp.ClientSession() as session:
        agui = await session.post(url + "/agent/default/run", json=run_input("hi", thread="a"))
        graphql = await session.post(url, data=orjson.dumps(
            {"query": CHAT_DOCUMENT, "variables": {"data": user_turn("hi")}}),
            headers=CLIENT_HEADERS)
        agui_head = await _read_until(agui, b"word")
        graphql_head = await _read_until(graphql, b"word")
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # Before: cut when the 5 s grace ran out, without a terminal event nor the end of
        # the body (aiohttp raises ClientPayloadError on a body cut short).
        agui_body = agui_head + await agui.content.read()
        graphql_body = graphql_head + await graphql.content.read()
        ended = time.monotonic() - signalled
    last = parse_sse(agui_body)[-1]
    assert (last["type"], last["code"]) == ("RUN_ERROR", INTERRUPTED_CODE)
    response = merge(parse_multipart(graphql_body))["data"]["generateCopilotResponse"]
    assert response["status"]["code"] == "Failed", response["status"]
    assert ended < 4, f"the streams ended {ended:.1f} s after the signal"
    _out, err = await asyncio.to_thread(process.communicate, timeout=15)
    assert process.returncode == -signal.SIGTERM, err  # uvicorn ends as the signal asks
    assert b"Traceback" not in err, err


async def test_a_run_cut_by_the_server_then_stopped_by_the_close_still_tells_its_end() -> None:
    # The server's grace ran out (it cancels the request), then the runtime's close stops the
    # run again while its end is being stored: the client still hears the end.
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent})
    run = await runtime.start_run("default", parse_run_input(run_input("hi")))
    sent: list[Event] = []
    streaming = asyncio.Event()

    async def write(batch: Sequence[Event]) -> None:
        sent.extend(batch)
        if any(e["type"] == "TEXT_MESSAGE_CONTENT" for e in batch):
            streaming.set()

    task = asyncio.create_task(run.drive(write))
    await streaming.wait()
    task.cancel()
    await asyncio.sleep(0)  # the run is now storing its end
    runtime.runs.stop_all()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (sent[-1]["type"], sent[-1]["code"]) == ("RUN_ERROR", INTERRUPTED_CODE)
    await runtime.aclose()


def test_the_demo_serves_on_when_its_stdout_reader_left(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]]) -> None:
    port = free_port()
    process = _command(tmp_path, "demo", "--port", str(port), "--db", ":memory:",
                       "--checkpoints", "memory")
    stopped.append(process)
    assert process.stdout is not None
    process.stdout.close()  # `demo | head -0`
    # Before: "error: cannot start: [Errno 32] Broken pipe", code 2.
    wait_for_server(f"http://127.0.0.1:{port}/copilotkit/info", process)
    process.terminate()
    _out, err = process.communicate(timeout=15)
    assert b"Broken pipe" not in err, err
    assert b"error" not in err, err


#: A bare app whose lifespan start fails while the file `unreachable` exists beside it (as a
#: runtime's does while its coordinator is away).
FLAKY_START_APP = """
from pathlib import Path

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup" and Path("unreachable").exists():
                Path("refused").touch()  # (the test waits for a start that failed)
                await send({"type": "lifespan.startup.failed", "message": "away"})
                return
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})
"""


def _workers(process: subprocess.Popen[bytes], count: int) -> list[str]:
    """The supervisor's `count` live workers (waited for)."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    deadline = time.monotonic() + 20
    while True:
        live = [pid for pid in children.read_text().split()
                if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
        if len(live) == count:
            return live
        assert process.poll() is None, process.communicate(timeout=10)
        assert time.monotonic() < deadline, f"{len(live)} workers, not {count}"
        time.sleep(0.05)


def _catches_hangup(pid: str) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGHUP - 1)))


def test_a_worker_added_by_sigttin_is_one_of_ours(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]]) -> None:
    """SIGTTIN adds a worker; uvicorn's own added a plain one, which a closed terminal's
    SIGHUP killed outright (its streams cut) and which nothing reaped at the end."""
    (tmp_path / "flaky_app.py").write_text(FLAKY_START_APP)
    port = free_port()
    process = _command(tmp_path, "serve", "flaky_app:app", "--workers", "2", "--port", str(port))
    stopped.append(process)
    first = _workers(process, 2)
    wait_for_server(f"http://127.0.0.1:{port}/", process)
    process.send_signal(signal.SIGTTIN)
    added, = set(_workers(process, 3)) - set(first)
    deadline = time.monotonic() + 20
    while not _catches_hangup(added):
        assert time.monotonic() < deadline, "the added worker does not catch SIGHUP"
        time.sleep(0.1)
    assert _catches_hangup(first[0])
    process.send_signal(signal.SIGTERM)
    _out, err = process.communicate(timeout=15)
    assert process.returncode == 0, err


class _StreamRead:
    """What a process writes to a pipe, read as it comes: a test waits for a line in it. The
    pipe is this reader's alone (not the Popen's, which `communicate` reads and closes)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.text = b""
        self._ended = False
        self._grown = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[bytes]) -> None:
        with stream:
            for line in iter(stream.readline, b""):
                with self._grown:
                    self.text += line
                    self._grown.notify_all()
        with self._grown:
            self._ended = True
            self._grown.notify_all()

    def join(self, timeout: float) -> None:
        """Until the pipe's end (the process exited), and it is closed."""
        self._reader.join(timeout)
        assert not self._reader.is_alive(), "the pipe stayed open"

    def wait_for(self, marker: bytes, timeout: float) -> bool:
        """Whether `marker` was written within `timeout` (False at once at the pipe's end)."""
        with self._grown:
            self._grown.wait_for(lambda: marker in self.text or self._ended, timeout)
            return marker in self.text


def test_a_replacement_worker_that_cannot_start_yet_is_started_again_later(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]]) -> None:
    (tmp_path / "flaky_app.py").write_text(FLAKY_START_APP)
    port = free_port()
    read_end, write_end = os.pipe()
    process = _command(tmp_path, "serve", "flaky_app:app", "--workers", "2", "--port", str(port),
                       stderr=write_end)
    os.close(write_end)
    stopped.append(process)
    errors = _StreamRead(os.fdopen(read_end, "rb"))
    first = _workers(process, 2)
    wait_for_server(f"http://127.0.0.1:{port}/", process)
    time.sleep(4)  # the supervisor saw them serve (it checks every 0.5 s; slower loaded)
    (tmp_path / "unreachable").touch()
    os.kill(int(first[0]), signal.SIGKILL)
    deadline = time.monotonic() + 20  # a loaded machine starts a worker slowly
    while not (tmp_path / "refused").exists():
        assert time.monotonic() < deadline, "no replacement tried to start"
        time.sleep(0.1)
    # Its replacement failed to start, and the supervisor said it starts it again (before:
    # every worker stopped, code 3).
    assert errors.wait_for(b"failed to start; starting it again", timeout=20), errors.text
    assert process.poll() is None, errors.text
    assert httpx2.get(f"http://127.0.0.1:{port}/", timeout=2).text == "ok"
    (tmp_path / "unreachable").unlink()
    deadline = time.monotonic() + 10
    while first[0] in (workers := _workers(process, 2)) or first[1] not in workers:
        assert time.monotonic() < deadline, "the dead worker was not replaced"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0, errors.text
    errors.join(timeout=5)
    assert process.stdout is not None
    process.stdout.close()


#: A plain ASGI app that speaks no lifespan (as many do: uvicorn's "auto" serves them).
NO_LIFESPAN_APP = """
async def app(scope, receive, send):
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})
"""


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_asgi_app_without_a_lifespan_is_served(
        tmp_path: Path, stopped: list[subprocess.Popen[bytes]], workers: str) -> None:
    (tmp_path / "plain_app.py").write_text(NO_LIFESPAN_APP)
    port = free_port()
    process = _command(tmp_path, "serve", "plain_app:app", "--port", str(port),
                       "--workers", workers, "--path", "/api")
    stopped.append(process)
    # Before: uvicorn's traceback of the app's assertion, and exit code 3.
    wait_for_server(f"http://127.0.0.1:{port}/", process)
    assert httpx2.get(f"http://127.0.0.1:{port}/", timeout=5).text == "ok"
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=15)
    # One process ends as SIGTERM asks, once shut down; a supervisor exits 0.
    assert process.returncode == (-signal.SIGTERM if workers == "1" else 0), err
    assert b"Traceback" not in err, err
    # Announced as what it is (before: with the runtime's URLs, /api/info and all).
    assert f"serving plain_app:app at http://127.0.0.1:{port}/".encode() in out, out
    assert b"--path applies to a CopilotRuntime only" in out, out
    assert b"curl" not in out, out


def test_serve_with_its_stderr_closed_serves(tmp_path: Path,
                                             stopped: list[subprocess.Popen[bytes]]) -> None:
    (tmp_path / "bare_app.py").write_text(BARE_APP)
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    # `serve ... 2>&-`: the shell closes descriptor 2, then runs the command in its place.
    process = subprocess.Popen(
        ["/bin/sh", "-c", f'exec "{sys.executable}" -m copilot_runtime serve bare_app:app '
                          f'--port {port} 2>&-'],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE)
    stopped.append(process)
    # Before: exit code 1 at once, without a word (it read whether stderr is a terminal).
    wait_for_server(f"http://127.0.0.1:{port}/", process)
    assert httpx2.get(f"http://127.0.0.1:{port}/", timeout=5).text == "ok"
    process.send_signal(signal.SIGTERM)
    out, _err = process.communicate(timeout=15)
    assert process.returncode == -signal.SIGTERM
    assert b"serving bare_app:app at http://" in out
