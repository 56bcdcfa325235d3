"""Deletes across workers and the clocks they compare (reviews of this session's fences):
a delete that waited for another compares a thread's use with the time it began waiting by
the store's clock (PostgreSQL stamps threads by its own); a late write landing under a
delete's hold is a 409, not a 404 for a thread still there; a store's own `clock` that is no
coroutine function is not the retention sweep's."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import copilot_runtime._runs as runs_module
from copilot_runtime import CopilotRuntime, DemoAdapter, ThreadBusyError, coordinator, thread_store
from copilot_runtime.threads.base import StoredRun
from copilot_runtime.threads.memory import InMemoryThreadStore
from tests.hitl_support.postgres import postgres_schema

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "threadId": "t", "runId": "r1", **fields}


class _Ahead:
    """`time` of a worker whose clock is `by` seconds ahead of the database's."""

    def __init__(self, by: float) -> None:
        self.by = by

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def time(self) -> float:
        return time.time() + self.by


@pytest.mark.parametrize("ahead", [0.0, 5.0, -5.0])
async def test_a_delete_that_waited_keeps_a_thread_begun_meanwhile_whatever_the_clocks(
        ahead: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: with the worker 5 s ahead of the database the thread begun between the two
    deletes was deleted (and 5 s behind, an unchanged thread was kept: a 404 for it)."""
    monkeypatch.setattr(runs_module, "time", _Ahead(ahead))
    with postgres_schema() as url:
        runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                                 thread_store=thread_store(url), coordinator=coordinator(url))
        await runtime.start()
        try:
            shared = runtime.runs.coordinator
            assert shared is not None
            other = await shared.acquire("t", f"{runs_module._DELETE}other")
            assert other is not None  # another worker's delete holds the thread
            waiting = asyncio.ensure_future(runtime.delete_thread("t"))
            await asyncio.sleep(0.3)
            began = [event("RUN_STARTED"), event("RUN_FINISHED")]
            await runtime.store.append_run("t", "default",
                                           StoredRun("r1", began, time.time(), 0, 0, 1), [])
            await shared.release(other)
            assert await waiting is False
            assert await runtime.store.summary("t") is not None
        finally:
            await runtime.aclose()


async def test_a_late_write_under_a_deletes_hold_is_busy_not_missing() -> None:
    """Before: the store kept the thread (its position moved) and the delete answered False,
    a 404 for a thread still there."""
    with postgres_schema() as url:
        runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                                 thread_store=thread_store(url), coordinator=coordinator(url))
        await runtime.start()
        store: Any = runtime.store
        try:
            await store.append_events(
                "t", "default", "r1", time.time(), 0,
                [event("RUN_STARTED"), event("TEXT_MESSAGE_START", messageId="m",
                                             role="assistant")], run_first=0)
            forget = runtime.forget_thread

            async def late_write_then_forget(thread_id: str, *, strict: bool = False) -> None:
                # a stalled worker's next chunk, its run begun before any delete
                await store.append_events(
                    "t", "default", "r1", 0.0, 2,
                    [event("TEXT_MESSAGE_CONTENT", messageId="m", delta="late")], run_first=0)
                await forget(thread_id, strict=strict)

            runtime.forget_thread = late_write_then_forget  # type: ignore[method-assign]
            with pytest.raises(ThreadBusyError):
                await runtime.delete_thread("t")
            assert await store.summary("t") is not None
        finally:
            await runtime.aclose()


async def test_a_stores_own_plain_clock_is_not_the_sweeps() -> None:
    """Before: the sweep awaited any `clock` a store had: a plain one failed every sweep."""

    class WithPlainClock(InMemoryThreadStore):
        def clock(self) -> float:
            return time.time()

    store = WithPlainClock()
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store,
                             thread_retention_seconds=1.0)
    await runtime.start()
    try:
        await store.append_run("old", "default", StoredRun("r", [], 1.0, 0, 0, -1), [])
        assert runtime._retention is not None
        assert await runtime._retention.sweep() == 1
        assert await store.summary("old") is None
    finally:
        await runtime.aclose()


class _PassingOn:
    """A store wrapper of an application's own (metrics, logging) passing every keyword on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.deletes: list[dict[str, Any]] = []

    async def delete(self, thread_id: str, **kwargs: Any) -> Any:
        self.deletes.append(kwargs)
        return await self.inner.delete(thread_id, **kwargs)

    async def list(self, *args: Any, **kwargs: Any) -> Any:
        return await self.inner.list(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _OldList(InMemoryThreadStore):
    """A store that archives (the built-in's) but whose `list` was written before."""

    async def list(self, agent_id: str | None = None, limit: int = 100, *,  # type: ignore[override]
                   owner: Any = None, offset: int = 0, after: Any = None) -> Any:
        return await super().list(agent_id, limit, owner=owner, offset=offset, after=after)


async def test_a_wrapper_passing_keywords_on_keeps_the_fence_and_lists() -> None:
    """Before: the delete's condition was given only to a `delete` that named it, so behind
    such a wrapper a late write was deleted with its thread; and a default list through it
    to a `list` without `include_archived` was a 500 (reviews)."""
    store = _PassingOn(InMemoryThreadStore())
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store)  # type: ignore[arg-type]
    await runtime.start()
    try:
        await store.append_run("t", "default", StoredRun("r", [], 1.0, 0, 0, -1), [])
        assert await runtime.delete_thread("t") is True
        assert [sorted(kwargs) for kwargs in store.deletes] == [["next_position"]]
    finally:
        await runtime.aclose()
    old = _PassingOn(_OldList())
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=old)  # type: ignore[arg-type]
    await runtime.start()
    try:
        await old.append_run("t", "default", StoredRun("r", [], 1.0, 0, 0, -1), [])
        listed = await runtime.list_threads(None, 10, owner=None, include_archived=False)
        assert [record.thread_id for record in listed] == ["t"]
    finally:
        await runtime.aclose()


class _AuditedAfter(_PassingOn):
    """A wrapper whose audit hook, called after the store's delete, refuses a keyword."""

    async def delete(self, thread_id: str, **kwargs: Any) -> Any:
        self.deletes.append(kwargs)
        done = await self.inner.delete(thread_id, **kwargs)

        def audit(thread_id: str) -> None:
            pass

        audit(thread_id, **kwargs)  # type: ignore[call-arg]  # raises TypeError
        return done


async def test_a_type_error_after_a_store_deleted_is_not_a_second_delete() -> None:
    """Before: a TypeError naming a keyword, raised inside the store's delete after it
    deleted, was taken for a refused keyword: the delete ran again without its conditions,
    and the answer said no such thread (a review)."""
    store = _AuditedAfter(InMemoryThreadStore())
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store)  # type: ignore[arg-type]
    await runtime.start()
    try:
        await store.append_run("t", "default", StoredRun("r", [], 1.0, 0, 0, -1), [])
        assert await runtime.delete_thread("t") is True
        assert store.deletes == [{"next_position": 0}]
    finally:
        await runtime.aclose()
