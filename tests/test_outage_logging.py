"""Background work that meets an outage (the recovery sweep, progress signals) tells it now
and then, without a traceback each time, and tells when it works again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from structlog.testing import capture_logs

from copilot_runtime import ServiceUnavailableError
from copilot_runtime._runs import RunManager
from copilot_runtime._shared_runs import RecoverySweep
from copilot_runtime.coordination import Signal
from copilot_runtime.threads import InMemoryThreadStore


class _Store:
    """A durable store's `open_runs`, away until `back`."""

    def __init__(self) -> None:
        self.back = False
        self.calls = 0
        self.wanted = 0
        self.reached = asyncio.Event()

    async def called(self, times: int) -> None:
        """Once `open_runs` was called `times` more times."""
        self.wanted, self.reached = self.calls + times, asyncio.Event()
        await self.reached.wait()

    async def open_runs(self) -> list[tuple[str, str]]:
        self.calls += 1
        if self.calls >= self.wanted:
            self.reached.set()
        if not self.back:
            raise ServiceUnavailableError("The thread store cannot be reached")
        return []


class _Coordinator:
    shared = True
    lease_ttl = 10.0

    def __init__(self) -> None:
        self.away = True
        self.published: list[Signal] = []

    def on_stop(self, callback: Any) -> None:
        pass

    async def forget_expired(self, seconds: float) -> int:
        return 0

    async def publish(self, signal: Signal) -> None:
        if self.away:
            raise ServiceUnavailableError("The coordinator cannot be reached")
        self.published.append(signal)


def _told(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == event]


async def test_the_sweep_tells_an_outage_now_and_then_and_when_it_ends() -> None:
    store = _Store()
    sweep = RecoverySweep(store, set(), _Coordinator(), interval=0.002)  # type: ignore[arg-type]
    with capture_logs() as logs:
        sweep.start()
        try:
            await store.called(40)
            told = _told(logs, "recovery sweep: tried again next time")
            # the 1st, 2nd, 4th, 8th... failure in a row: a line a doubling, not one a sweep
            assert [e["failures_in_a_row"] for e in told] == \
                [2 ** i for i in range(len(told))]
            assert all(e["log_level"] == "warning" and "exc_info" not in e for e in told)
            assert not _told(logs, "recovery sweep failed")
            store.back = True
            await store.called(3)
        finally:
            await sweep.aclose()
    again = _told(logs, "recovery sweep works again")
    assert len(again) == 1
    assert again[0]["failures_in_a_row"] >= 40


async def test_progress_signals_tell_an_outage_now_and_then() -> None:
    coordinator = _Coordinator()
    manager = RunManager(InMemoryThreadStore(), coordinator=coordinator)  # type: ignore[arg-type]
    run: Any = SimpleNamespace(thread_id="t", run_id="r")
    with capture_logs() as logs:
        for position in range(33):
            await manager._signal_progress(run, position)
        coordinator.away = False
        await manager._signal_progress(run, 33)
        coordinator.away = True
        await manager._signal_progress(run, 34)
    told = _told(logs, "could not signal progress")
    assert [e["failures_in_a_row"] for e in told] == [1, 2, 4, 8, 16, 32, 1]
    assert [s.position for s in coordinator.published] == [33]
