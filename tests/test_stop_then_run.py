"""A stop, then at once the thread's next run (a user who stops an answer and types again):
the new run waits for the stopped one to be stored and begins, on every store, instead of a
409 while a durable store writes the stopped run (its thread stays held until then, so that
the next run reads its head with it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from copilot_runtime import CopilotRuntime
from copilot_runtime.testing import verify_events
from copilot_runtime.threads.base import StoredRun
from copilot_runtime.threads.sqlite import SQLiteThreadStore
from tests.conftest import GatedAgent, ServeRuntime, parse_sse, run_input, text_of, types

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class SlowWrites(SQLiteThreadStore):
    """A durable store whose finished runs take a while to write (a busy database)."""

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         *args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(0.5)
        await super().append_run(thread_id, agent_id, run, *args, **kwargs)


async def test_a_run_sent_right_after_a_stop_waits_for_the_stopped_run(
        serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent},
                             thread_store=SlowWrites(str(tmp_path / "threads.sqlite3")))
    async with serve_runtime(runtime) as served:
        first = await served.post("/agent/default/run", run_input("hi", thread="t-again"))
        await first.content.readuntil(b"\n\n")  # RUN_STARTED: it runs
        stop = await served.post("/agent/default/stop/t-again", {"runId": "run-1"})
        assert stop.status == 200
        assert (await stop.json())["stopped"] is True
        agent.gate.set()
        again = await served.post("/agent/default/run",
                                  run_input("once more", thread="t-again", run="run-2"))
        assert again.status == 200, await again.text()
        events = parse_sse(await again.read())
        stopped = parse_sse(await first.read())
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED"
    assert text_of(events) == "one two"
    assert types(stopped)[-1] in {"RUN_FINISHED", "RUN_ERROR"}


async def test_a_run_on_a_thread_whose_run_goes_on_is_still_busy(
        serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    """Only a stopped run is waited for: one still running makes the thread busy (409)."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent},
                             thread_store=SlowWrites(str(tmp_path / "threads.sqlite3")))
    async with serve_runtime(runtime) as served:
        first = await served.post("/agent/default/run", run_input("hi", thread="t-busy"))
        await first.content.readuntil(b"\n\n")
        again = await served.post("/agent/default/run",
                                  run_input("once more", thread="t-busy", run="run-2"))
        assert again.status == 409
        agent.gate.set()
        assert types(parse_sse(await first.read()))[-1] == "RUN_FINISHED"
