"""Long commands a few tests wait on, run one after another from the start of the session.

The legacy remote endpoint's environment (a venv and a pip install), mypy over the package
and the demo's web build (`npm ci`, then the bundler) each take most of a minute of one core,
while the rest of the suite mostly waits on sockets and timers with the machine's other core
idle. Run in the background from the end of collection, in the order their tests come, each
is done, or nearly, when its test asks. Only the jobs of selected tests run; a test whose job
did not run (its file run alone with another selection) runs it then.

Under pytest-xdist every worker starts the chain, and each job runs once for the whole run:
the first worker to take its lock runs it and leaves what it gave in a file of the run's
directory (named by the run's id, which the controlling process removes at the end); the
others wait on the lock and read that file.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

__all__ = ["forget_run", "result", "start", "stop"]

ROOT = Path(__file__).resolve().parent.parent

#: Each job: its command, and the test file waiting on it, in the order they run.
JOBS: dict[str, tuple[list[str], str]] = {
    "legacy": ([sys.executable, "-c", "from tests.agents_support.legacy_env import "
                "legacy_python; legacy_python()"], "tests/test_agents_remote_endpoint.py"),
    "mypy": ([sys.executable, "-m", "mypy", "--strict", "copilot_runtime"],
             "tests/test_code_quality.py"),
    "web": ([str(ROOT / "scripts" / "build_web.sh")], "tests/test_demo_web.py"),
}


Finished = subprocess.CompletedProcess[str]


def _run(args: list[str], chain: _Chain | None = None) -> Finished:
    # Files, not pipes: a pipe nobody reads would fill and stop the command.
    with tempfile.TemporaryFile(mode="w+") as out, tempfile.TemporaryFile(mode="w+") as err:
        process = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=err, text=True)
        if chain is not None:
            chain.running = process
        try:
            code = process.wait()
        finally:
            if chain is not None:
                chain.running = None
        out.seek(0)
        err.seek(0)
        return Finished(args, code, out.read(), err.read())


def _run_dir(run_id: str) -> Path:
    return Path(tempfile.gettempdir()) / f"copilot-runtime-tests-{run_id}"


def _run_once(name: str, chain: _Chain | None = None) -> Finished:
    """Job `name`'s result: run here, or, under pytest-xdist, by whichever worker got to it
    first."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id:
        return _run(JOBS[name][0], chain)
    shared = _run_dir(run_id)
    shared.mkdir(exist_ok=True)
    given = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if given.is_file():
            kept = json.loads(given.read_text())
            return Finished(kept["args"], kept["returncode"], kept["stdout"], kept["stderr"])
        done = _run(JOBS[name][0], chain)
        if chain is None or not chain.stopped:  # (a job killed at the end gave nothing)
            given.write_text(json.dumps({"args": done.args, "returncode": done.returncode,
                                         "stdout": done.stdout, "stderr": done.stderr}))
        return done


def forget_run(run_id: str) -> None:
    """Remove what the workers of the pytest-xdist run `run_id` shared."""
    shutil.rmtree(_run_dir(run_id), ignore_errors=True)


class _Chain(threading.Thread):
    def __init__(self, names: list[str]) -> None:
        super().__init__(name="background jobs", daemon=True)
        self.names = names
        self.done = {name: threading.Event() for name in names}
        self.results: dict[str, Finished] = {}
        self.running: subprocess.Popen[str] | None = None
        self.stopped = False

    def run(self) -> None:
        for name in self.names:
            if self.stopped:
                break
            try:
                self.results[name] = _run_once(name, self)
            except Exception as exc:  # (reported by the test that waits on it)
                self.results[name] = Finished(JOBS[name][0], -1, "",
                                              f"{type(exc).__name__}: {exc}")
            self.done[name].set()


_chain: _Chain | None = None


def start(selected_files: Iterable[str]) -> None:
    """Run, one after another, the jobs of the selected test files."""
    global _chain
    files = set(selected_files)
    names = [name for name, (_, file) in JOBS.items() if file in files]
    if _chain is None and names:
        _chain = _Chain(names)
        _chain.start()


def result(name: str, timeout: float) -> Finished:
    """What the job `name` gave, waited for at most `timeout` seconds (or run now)."""
    chain = _chain
    if chain is None or name not in chain.done:
        return _run_once(name)
    if not chain.done[name].wait(timeout):
        raise TimeoutError(f"the background job {name!r} took longer than {timeout} s")
    return chain.results[name]


def stop() -> None:
    """End the session's jobs (one still running is killed)."""
    chain = _chain
    if chain is not None:
        chain.stopped = True
        running = chain.running
        if running is not None and running.poll() is None:
            running.kill()
