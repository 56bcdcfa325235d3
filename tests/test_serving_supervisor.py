"""The supervisor's reading of a worker that could not start, on a worker process of its own
(no server: the timing of its exit is what is tested)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest

from copilot_runtime import _serving
from tests.conftest import uvicorn_serving

pytestmark = pytest.mark.timeout(30)


def _fail_slowly(conn: Connection) -> None:
    """A worker whose startup failed: its end of the pipe closes first (its finalization),
    then it takes a moment more to exit with the startup-failure code."""
    conn.close()
    time.sleep(1)
    os._exit(_serving.STARTUP_FAILURE)


class _FailingWorker:
    """What the supervisor holds of a worker (uvicorn's `Process`), around a real process."""

    def __init__(self) -> None:
        self.parent_conn, child = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("fork").Process(target=_fail_slowly,
                                                                   args=(child,))
        self.process.start()
        child.close()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def join(self) -> None:
        self.process.join()


def _supervisor(worker: Any) -> Any:
    # (its constructor takes the signals of this process: the test needs none of that)
    supervisor: Any = _serving._Supervisor.__new__(_serving._Supervisor)
    supervisor.processes = [worker]
    supervisor.should_exit = threading.Event()
    supervisor._stopping = threading.Event()
    supervisor._served = True
    supervisor._restart_at = {}
    supervisor._backoff = {}
    supervisor._starting = {worker: time.monotonic() + _serving.WORKER_START_SECONDS}
    supervisor._pinged = set()
    supervisor.config = type("Config", (), {"timeout_worker_healthcheck": 5})()
    supervisor.replaced = []
    supervisor._replace = supervisor.replaced.append
    return supervisor


def test_a_worker_still_exiting_from_a_failed_startup_is_started_again_with_backoff(
        caplog: pytest.LogCaptureFixture) -> None:
    """Its pipe closed before it exited: killed then, its startup failure was read as a
    death and it was started again at once (in a loop, on a loaded machine)."""
    worker = _FailingWorker()
    supervisor = _supervisor(worker)
    with caplog.at_level(logging.INFO, logger="uvicorn.error"):
        supervisor.keep_subprocess_alive()
    assert worker.exitcode == _serving.STARTUP_FAILURE
    assert supervisor.replaced == []
    assert worker in supervisor._restart_at
    assert "failed to start; starting it again" in caplog.text


def _die(conn: Connection) -> None:
    conn.close()
    os._exit(9)


def _hang(conn: Connection) -> None:
    time.sleep(30)  # (never answers the health check's ping)


class _Worker(_FailingWorker):
    def __init__(self, target: Any) -> None:
        self.parent_conn, child = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("fork").Process(target=target, args=(child,))
        self.process.start()
        child.close()


@pytest.mark.parametrize(("target", "said"), [
    (_die, "died (exit code 9): starting another"),
    (_hang, "did not answer its health check in time: killed, starting another")])
def test_a_dead_or_hung_worker_is_a_warning(caplog: pytest.LogCaptureFixture, target: Any,
                                            said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: logged at INFO, as uvicorn does, so at the usual WARNING level a worker that
    died (its runs cut) or hung left no line at all."""
    monkeypatch.setattr(_serving, "WORKER_EXIT_GRACE_SECONDS", 0.5)
    monkeypatch.setattr(_serving, "WORKER_START_SECONDS", 0.5)
    worker = _Worker(target)
    supervisor = _supervisor(worker)
    supervisor.config.timeout_worker_healthcheck = 0.5
    with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
        while not supervisor.replaced:  # (the supervisor looks every half second)
            supervisor.keep_subprocess_alive()
            time.sleep(0.1)
    assert supervisor.replaced == [0]
    assert [(r.levelname, r.getMessage().split("] ", 1)[1]) for r in caplog.records] == \
        [("WARNING", said)]


def _start_slowly_then_hang(conn: Connection) -> None:
    """A worker whose start (imports, the app) takes longer than a health check may, which
    then serves, answering pings, until it hangs."""
    time.sleep(2.0)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        if conn.poll(0.05):
            conn.recv()
            conn.send(True)
    time.sleep(30)


def test_a_worker_slow_to_start_is_waited_for_and_one_that_hangs_later_is_replaced(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a worker that had not answered its first ping within the health check's
    timeout (5 s) was killed as hung; under load every start took longer, so the slot was
    killed and started again for ever, never serving. Once it has answered, the health
    check's timeout applies."""
    monkeypatch.setattr(_serving, "WORKER_EXIT_GRACE_SECONDS", 0.5)
    worker = _Worker(_start_slowly_then_hang)
    supervisor = _supervisor(worker)
    supervisor.config.timeout_worker_healthcheck = 0.5
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
        while time.monotonic() - started < 3.0:
            supervisor.keep_subprocess_alive()
            assert supervisor.replaced == [], caplog.text
            time.sleep(0.2)
        assert supervisor._served
        assert worker not in supervisor._starting
        while not supervisor.replaced:
            supervisor.keep_subprocess_alive()
            assert time.monotonic() - started < 15
            time.sleep(0.2)
    assert "did not answer its health check in time" in caplog.text


def _start_slowly_then_serve(conn: Connection) -> None:
    time.sleep(2.0)
    while True:  # (uvicorn's answering thread: one answer a ping)
        conn.recv()
        conn.send(True)


class _ServingWorker(_Worker):
    def terminate(self) -> None:
        self.process.terminate()


def test_a_restart_waits_for_a_slow_start_without_leaving_answers_behind() -> None:
    """A SIGHUP restart waited for a new worker with uvicorn's wait, which pings once a
    second and leaves the answers it gave up on in the pipe: read later, one a turn, in
    place of the live answer, they hid a hung worker for half a minute. The stopped worker
    is forgotten too."""
    old = _ServingWorker(_start_slowly_then_serve)
    supervisor = _supervisor(old)
    supervisor._started = []
    supervisor.config.timeout_worker_healthcheck = 0.5
    supervisor.keep_subprocess_alive()  # (pings it: it has not answered yet)
    assert old in supervisor._pinged

    def start_worker() -> Any:
        worker = _ServingWorker(_start_slowly_then_serve)
        supervisor._starting[worker] = time.monotonic() + _serving.WORKER_START_SECONDS
        return worker

    supervisor._start_worker = start_worker
    supervisor.restart_all()
    new = supervisor.processes[0]
    try:
        assert new is not old
        assert old.exitcode is not None
        assert old not in supervisor._starting
        assert old not in supervisor._pinged
        assert new not in supervisor._starting
        assert not new.parent_conn.poll(0.5), "answers left in the pipe"
        assert supervisor._healthcheck(new) is True
    finally:
        new.kill()
        new.join()


async def _app(scope: Any, receive: Any, send: Any) -> None:
    while (await receive())["type"] == "lifespan.startup":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def test_servers_of_earlier_tests_leave_no_signal_handler_for_workers_to_inherit(
        ) -> None:
    """Before: two servers of a test ending in the order they started (not the reverse) put
    back each other's handlers, leaving uvicorn's SIGTERM handler in the test process; a
    worker forked later by a test above inherited it, and `terminate()` left it serving (the
    restart's test waited on it until its time limit, once in CI)."""
    first = uvicorn_serving(_app)
    second = uvicorn_serving(_app)
    await first.__aenter__()
    await second.__aenter__()
    await first.__aexit__(None, None, None)
    await second.__aexit__(None, None, None)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
