"""The HITL test server as a child process that can be killed with SIGKILL and restarted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import pytest

from tests.agents_support.processes import REPO_ROOT, free_port

BASE = "/api/copilotkit"


class Server:
    """`python -m copilot_runtime serve tests.hitl_support.app:runtime` on a free port."""

    def __init__(self, env: Mapping[str, str], log_dir: Path) -> None:
        self.env = dict(env)
        self.log_dir = log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{BASE}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log: IO[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        self.starts += 1
        self._log = log = (self.log_dir / f"server-{self.starts}.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "copilot_runtime", "serve", "tests.hitl_support.app:runtime",
             "--port", str(self.port), "--path", BASE],
            cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/info", timeout=1):
                    return
            except (urllib.error.URLError, OSError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the HITL server did not start:\n{self.log_tail()}",
                                pytrace=False)
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flushing, exactly like a crash."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._close_log()

    def log_tail(self, lines: int = 40) -> str:
        path = self.log_dir / f"server-{self.starts}.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")


@contextlib.contextmanager
def server(env: Mapping[str, str], log_dir: Path) -> Iterator[Server]:
    running = Server(env, log_dir)
    running.start()
    try:
        yield running
    finally:
        running.stop()


@contextlib.contextmanager
def sqlite_server(where: Path) -> Iterator[tuple[Server, Path]]:
    """A HITL server whose checkpoints and threads are SQLite files in `where` (1.5 s
    approval timeout), and the file its model calls are logged to."""
    calls_file = where / "calls.jsonl"
    with server({"HITL_CHECKPOINTS": f"sqlite:///{where}/checkpoints.sqlite3",
                 "HITL_THREADS": str(where / "threads.sqlite3"),
                 "HITL_CALLS": str(calls_file), "HITL_TIMEOUT": "1.5"}, where) as running:
        yield running, calls_file


def task_for(name: str) -> str:
    """A review task unique to this call, so tests never share a thread's history."""
    return f"Prepare the invoice for {name} {time.monotonic_ns()}"
