"""A stop, then at once the thread's next run (a user who stops an answer and types again):
the new run waits for the stopped one to be stored and begins, on every store, instead of a
409 while a durable store writes the stopped run (its thread stays held until then, so that
the next run reads its head with it)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from copilot_runtime import BearerTokenAuth, CopilotRuntime, _runs
from copilot_runtime.testing import verify_events
from copilot_runtime.threads.base import StoredRun
from copilot_runtime.threads.sqlite import SQLiteThreadStore
from tests.conftest import GatedAgent, ServeRuntime, parse_sse, run_input, text_of, types

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class SlowWrites(SQLiteThreadStore):
    """A durable store whose finished runs take a while to write (a busy database)."""

    takes = 0.5

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         *args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(self.takes)
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


ALICE, BOB = {"Authorization": "Bearer token-alice"}, {"Authorization": "Bearer token-bob"}


def owned_runtime(agent: GatedAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                  ) -> CopilotRuntime:
    # A run longer than the minute its owner is remembered for (`_KnownOwners`): the owner
    # check is the live run's, not the remembered one's.
    monkeypatch.setattr(_runs._KnownOwners, "ttl", 0.1)
    store = SlowWrites(str(tmp_path / "threads.sqlite3"))
    store.takes = 1.5
    return CopilotRuntime(agents={"default": agent}, thread_store=store,
                          auth=BearerTokenAuth({"token-alice": "alice", "token-bob": "bob"}))


async def test_someone_elses_run_after_a_stop_is_refused_at_once(
        serve_runtime: ServeRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: Bob waited as long as Alice's stopped run took to store (then a 404): how long
    said the thread was there; and his reservation meanwhile made Alice's next run a 409."""
    agent = GatedAgent()
    async with serve_runtime(owned_runtime(agent, tmp_path, monkeypatch)) as served:
        first = await served.post("/agent/default/run", run_input("hi", thread="t-alice"),
                                  headers=ALICE)
        await first.content.readuntil(b"\n\n")
        await asyncio.sleep(0.3)  # her owner is no longer remembered: the run is long
        stop = await served.post("/agent/default/stop/t-alice", {"runId": "run-1"},
                                 headers=ALICE)
        assert stop.status == 200
        agent.gate.set()
        began = time.monotonic()
        bob = await served.post("/agent/default/run",
                                run_input("peek", thread="t-alice", run="bob-1"), headers=BOB)
        assert bob.status == 404
        assert time.monotonic() - began < 1.0
        again = await served.post("/agent/default/run",
                                  run_input("once more", thread="t-alice", run="run-2"),
                                  headers=ALICE)
        assert again.status == 200, await again.text()
        assert types(parse_sse(await again.read()))[-1] == "RUN_FINISHED"
        await first.read()
