"""`CopilotRuntime(thread_retention_seconds=)`: threads nobody has run for that long are
deleted by a sweep on every worker, as `DELETE /threads/{id}` deletes one (what the agents
keep of them first); a thread with a run on it is left for a later sweep. Before, every
store kept every conversation for ever, whatever the deployment's retention policy said.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from copilot_runtime import (
    ConfigurationError,
    CopilotRuntime,
    InMemoryThreadStore,
    RunInput,
    coordinator,
    thread_store,
)
from copilot_runtime import events as ev
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.events import EventBatches
from tests.conftest import GatedAgent, ServeRuntime, poll, run_input, types
from tests.hitl_support.postgres import postgres_schema
from tests.scale_support.services import POSTGRES, redis_prefix

pytestmark = pytest.mark.timeout(60)

RETENTION = 1.0


class Remembering(Agent):
    """Answers at once, and notes the threads it was asked to forget."""

    def __init__(self) -> None:
        super().__init__()
        self.forgotten: list[str] = []

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input.run_id)

    async def _run(self, run_id: str) -> Any:
        yield [ev.text_message_start(f"m-{run_id}"),
               ev.text_message_content(f"m-{run_id}", "noted"),
               ev.text_message_end(f"m-{run_id}")]

    async def forget_thread(self, thread_id: str) -> None:
        self.forgotten.append(thread_id)


@pytest.mark.parametrize("store", ["memory", "sqlite", "postgresql"])
async def test_threads_past_the_retention_are_deleted_and_busy_ones_kept(
        store: str, serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    agent, gated = Remembering(), GatedAgent()
    with contextlib.ExitStack() as stack:
        options: dict[str, Any] = {}
        if store == "sqlite":
            options["thread_store"] = thread_store(f"sqlite:///{tmp_path / 'threads.db'}")
        elif store == "postgresql":  # deletes take the thread's lease, as on a worker
            url = stack.enter_context(postgres_schema())
            options.update(thread_store=thread_store(url), coordinator=coordinator(url))
        runtime = CopilotRuntime(agents={"remembering": agent, "gated": gated},
                                 thread_retention_seconds=RETENTION, **options)
        runtime.retention_sweep_every = 0.2
        async with serve_runtime(runtime) as served:
            await served.run(run_input("keep this?", thread="old", run="r1"),
                             agent="remembering")
            # A run still going past the retention: its thread is busy, never deleted.
            busy = await served.post("/agent/gated/run", run_input("hi", thread="busy"))
            await busy.content.readline()
            started = time.monotonic()
            async for _ in poll(15, 0.1):
                response = await served.session.get(served.url + "/threads/old/messages")
                await response.read()
                if response.status == 404:
                    break
            assert response.status == 404
            assert time.monotonic() - started < RETENTION + 5
            assert agent.forgotten == ["old"]
            response = await served.session.get(served.url + "/threads")
            listed = [t["id"] for t in (await response.json())["threads"]]
            assert "old" not in listed
            assert not [t for t in listed if t != "busy"]
            # The busy thread's run goes on to its end, and is stored whole.
            gated.gate.set()
            events = [line async for line in busy.content]
            assert any(b"RUN_FINISHED" in line for line in events)
            # A thread used again stays; once left alone past the retention, it goes too.
            events = await served.run(run_input("fresh", thread="new", run="r2"),
                                      agent="remembering")
            assert types(events)[-1] == "RUN_FINISHED"
            response = await served.session.get(served.url + "/threads/new/messages")
            assert response.status == 200
            async for _ in poll(15, 0.1):
                response = await served.session.get(served.url + "/threads")
                if not (await response.json())["threads"]:
                    break
            assert (await response.json())["threads"] == []
        assert sorted(agent.forgotten) == ["busy", "new", "old"]


@pytest.fixture(params=["postgresql", "redis"])
def shared(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(threads URL, coordinator URL) shared by two workers."""
    with postgres_schema() as threads:
        if request.param == "postgresql":
            yield threads, threads
        else:
            with redis_prefix() as coordination:
                yield threads, coordination


async def test_a_thread_used_again_after_a_sweep_listed_it_is_kept(
        shared: tuple[str, str], serve_runtime: ServeRuntime) -> None:
    """Before: a sweep listed a batch of stale threads, then deleted each in turn: a thread
    its owner came back to on another worker meanwhile (a run begun and finished before the
    sweep reached it) was deleted, the new run with it, and its agents' memory of it. Now
    the sweep deletes a thread only if it is still stale once the delete holds it."""
    threads, coordination = shared
    sweeping, other = Remembering(), Remembering()
    one = CopilotRuntime(agents={"remembering": sweeping}, thread_store=thread_store(threads),
                         coordinator=coordinator(coordination), thread_retention_seconds=3600)
    one.retention_sweep_every = 0.2
    two = CopilotRuntime(agents={"remembering": other}, thread_store=thread_store(threads),
                         coordinator=coordinator(coordination))
    listed: list[list[str]] = []
    async with serve_runtime(two) as second:
        for thread in ("old", "used"):
            await second.run(run_input("long ago", thread=thread, run=f"r-{thread}"),
                             agent="remembering")
        with psycopg.connect(POSTGRES, autocommit=True) as conn:  # two days old
            schema = threads.rsplit("schema=", 1)[1]
            conn.execute(f'UPDATE "{schema}".threads SET updated_at = updated_at - 172800')
        stale = one.store.stale_threads  # type: ignore[attr-defined]

        async def listing(before: float, limit: int) -> list[str]:
            ids: list[str] = await stale(before, limit)
            if not listed:  # its owner comes back to it, once listed, on the other worker
                events = await second.run(run_input("I am back", thread="used", run="r-back"),
                                          agent="remembering")
                assert types(events)[-1] == "RUN_FINISHED"
            listed.append(ids)
            return ids

        one.store.stale_threads = listing  # type: ignore[attr-defined]
        async with serve_runtime(one):
            async for _ in poll(30, 0.05):
                if len(listed) >= 2:  # a first sweep ended, a second began
                    break
            await asyncio.sleep(0.1)
        assert sorted(listed[0]) == ["old", "used"]
        response = await second.session.get(second.url + "/threads/used/messages")
        assert response.status == 200, await response.text()
        contents = [m["content"] for m in (await response.json())["messages"]]
        assert contents == ["long ago", "noted", "I am back", "noted"]
        response = await second.session.get(second.url + "/threads/old/messages")
        assert response.status == 404
        assert sweeping.forgotten == ["old"]


class _DeletesUnconditionally:
    """A thread store of one's own written before `delete` took `updated_before`."""

    def __init__(self) -> None:
        self._inner = InMemoryThreadStore()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def stale_threads(self, before: float, limit: int) -> Any:
        return await self._inner.stale_threads(before, limit)

    async def delete(self, thread_id: str) -> bool:
        return await self._inner.delete(thread_id)


async def test_a_store_whose_delete_takes_no_condition_is_still_swept(
        serve_runtime: ServeRuntime) -> None:
    """Before: the sweep made the agents forget the thread, then the store's delete refused
    `updated_before` (a TypeError that ended the sweep): every sweep the thread lost what
    its agents knew of it, and was kept. The read under the delete's hold is enough."""
    agent = Remembering()
    runtime = CopilotRuntime(agents={"remembering": agent},
                             thread_store=_DeletesUnconditionally(),
                             thread_retention_seconds=RETENTION)
    runtime.retention_sweep_every = 0.2
    async with serve_runtime(runtime) as served:
        await served.run(run_input("keep this?", thread="old", run="r1"), agent="remembering")
        async for _ in poll(15, 0.1):
            response = await served.session.get(served.url + "/threads/old/messages")
            if response.status == 404:
                break
        assert agent.forgotten == ["old"]


class _NoSweeping:
    """A thread store of one's own without `stale_threads`."""

    def __getattr__(self, name: str) -> Any:
        if name == "stale_threads":
            raise AttributeError(name)
        return getattr(InMemoryThreadStore(), name)


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf"), True, "30", 1e300])
def test_a_retention_that_is_not_a_positive_number_of_seconds_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="thread_retention_seconds"):
        CopilotRuntime(agents={}, thread_retention_seconds=bad)


def test_a_store_that_cannot_list_stale_threads_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="stale_threads"):
        CopilotRuntime(agents={}, thread_store=_NoSweeping(),  # type: ignore[arg-type]
                       thread_retention_seconds=86400)


class _Skewed:
    """The `time` module as a worker whose clock is `by` seconds off sees it."""

    def __init__(self, by: float) -> None:
        self.by = by

    def time(self) -> float:
        return time.time() + self.by

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.mark.parametrize("skewed", ["runner-behind", "sweeper-ahead"])
async def test_a_thread_just_used_is_kept_whatever_the_workers_clocks_say(
        skewed: str, serve_runtime: ServeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found with several workers on PostgreSQL: a worker whose clock was 2 h behind ran a
    thread, stamped with its clock, and another worker sweeping threads unused for 1 h
    deleted it at once (as would a sweeping worker whose clock was ahead). The store stamps
    a thread's use by the database's clock now, and the sweep's cutoff is read from it."""
    with postgres_schema() as url:
        sweeping = Remembering()
        one = CopilotRuntime(agents={"remembering": sweeping}, thread_store=thread_store(url),
                             coordinator=coordinator(url), thread_retention_seconds=3600)
        one.retention_sweep_every = 0.2
        two = CopilotRuntime(agents={"remembering": Remembering()},
                             thread_store=thread_store(url), coordinator=coordinator(url))
        if skewed == "runner-behind":  # (the sweeping worker runs nothing)
            monkeypatch.setattr("copilot_runtime._runs.time", _Skewed(-7200))
        else:
            monkeypatch.setattr("copilot_runtime._retention.time", _Skewed(7200))
        sweeps: list[list[str]] = []
        stale = one.store.stale_threads  # type: ignore[attr-defined]

        async def listing(before: float, limit: int) -> list[str]:
            ids: list[str] = await stale(before, limit)
            sweeps.append(ids)
            return ids

        one.store.stale_threads = listing  # type: ignore[attr-defined]
        async with serve_runtime(two) as second:
            events = await second.run(run_input("just now", thread="t", run="r1"),
                                      agent="remembering")
            assert types(events)[-1] == "RUN_FINISHED"
            async with serve_runtime(one):
                async for _ in poll(30, 0.05):
                    if len(sweeps) >= 3:
                        break
            assert sweeps[-1] == []
            response = await second.session.get(second.url + "/threads/t/messages")
            assert response.status == 200, await response.text()
            assert sweeping.forgotten == []
