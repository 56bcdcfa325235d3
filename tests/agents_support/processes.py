"""Servers the agent tests run as child processes: start, wait until ready, stop, reap.

Every process logs to a file; when one does not come up, or dies, the failure shows the
end of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _answers(url: str, method: str) -> bool:
    request = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # it answered, even if not with 2xx
    except OSError:
        return False


@contextlib.contextmanager
def child_process(name: str, cmd: list[str], *, ready_url: str, log_dir: Path,
                  env: Mapping[str, str] | None = None, cwd: Path | None = None,
                  ready_method: str = "GET", timeout: float = 60.0) -> Iterator[None]:
    """Run `cmd` until the `with` block ends; ready when `ready_url` answers."""
    log_path = log_dir / f"{name}.log"
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("wb") as log:
        popen = subprocess.Popen(cmd, cwd=cwd or REPO_ROOT, env=child_env,
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while not _answers(ready_url, ready_method):
                if popen.poll() is not None:
                    pytest.fail(f"{name} exited with code {popen.returncode}:\n"
                                f"{_tail(log_path)}", pytrace=False)
                if time.monotonic() > deadline:
                    pytest.fail(f"{name} did not answer {ready_url} within {timeout:.0f} s:\n"
                                f"{_tail(log_path)}", pytrace=False)
                time.sleep(0.1)
            yield
        finally:
            if popen.poll() is None:
                # The whole session: `langgraph dev` runs its server in a child process.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGTERM)
                try:
                    popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(popen.pid, signal.SIGKILL)
                    popen.wait(timeout=10)


@contextlib.contextmanager
def mock_llm(log_dir: Path) -> Iterator[str]:
    """The loopback mock LLM in its own process; yields its base URL."""
    port = free_port()
    with child_process("mock-llm", [sys.executable, "-m", "copilot_runtime.testing",
                                    "--port", str(port), "--chunks", "5"],
                       ready_url=f"http://127.0.0.1:{port}/healthz", log_dir=log_dir):
        yield f"http://127.0.0.1:{port}/v1"
