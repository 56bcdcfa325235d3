"""Deleting a thread keeps runs off it until the delete is done.

A DELETE checked that no run was on the thread, then had the agents forget it and deleted it
from the store: a run that began in between (here, while an agent forgot slowly) streamed on
a thread deleted under it, with a 200 "deleted" for the caller, and the thread came back with
that run once it ended. Now the delete holds the thread (the lease, under a shared
coordinator) from its check to its end: a run asking meanwhile is busy (409), on every store.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from copilot_runtime import CopilotRuntime, DemoAdapter, coordinator, thread_store
from tests.conftest import ServeRuntime, run_input
from tests.hitl_support.postgres import postgres_schema
from tests.test_hostile_threads import store_options  # noqa: F401 (fixture)
from tests.test_trust_ownership import call

pytestmark = pytest.mark.timeout(60)


async def test_a_run_asked_for_while_its_thread_is_deleted_is_busy(
        store_options: dict[str, Any], serve_runtime: ServeRuntime) -> None:  # noqa: F811
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), **store_options)
    async with serve_runtime(runtime) as served:
        status, _, _ = await call(served, "POST", "/agent/default/run", None,
                                  run_input("first", thread="t", run="r1"))
        assert status == 200
        forgetting, forgot = asyncio.Event(), asyncio.Event()
        forget = runtime.forget_thread

        async def slow_forget(thread_id: str, *, strict: bool = False) -> None:
            forgetting.set()
            await forgot.wait()
            await forget(thread_id, strict=strict)

        runtime.forget_thread = slow_forget  # type: ignore[method-assign]
        deleting = asyncio.ensure_future(call(served, "DELETE", "/threads/t", None))
        try:
            await asyncio.wait_for(forgetting.wait(), 10)
            status, body, _ = await call(served, "POST", "/agent/default/run", None,
                                         run_input("meanwhile", thread="t", run="r2"))
        finally:
            forgot.set()
        assert status == 409, body
        assert orjson.loads(body)["code"] == "THREAD_BUSY"
        status, body, _ = await deleting
        assert (status, orjson.loads(body)) == (200, {"deleted": True, "id": "t"})
        assert await runtime.store.summary("t") is None
        # Deleted, the thread takes runs again (the delete let go of it).
        status, _, _ = await call(served, "POST", "/agent/default/run", None,
                                  run_input("again", thread="t", run="r3"))
        assert status == 200
        record = await runtime.store.get("t")
        assert record is not None
        assert [r.run_id for r in record.runs] == ["r3"]


async def test_a_run_asked_for_on_another_worker_while_the_thread_is_deleted_is_busy(
        serve_runtime: ServeRuntime) -> None:
    """Across workers sharing PostgreSQL: the delete holds the thread's lease."""
    with postgres_schema() as url:
        def runtime() -> CopilotRuntime:
            return CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                                  thread_store=thread_store(url), coordinator=coordinator(url))

        one, two = runtime(), runtime()
        async with serve_runtime(one) as first, serve_runtime(two) as second:
            status, _, _ = await call(first, "POST", "/agent/default/run", None,
                                      run_input("first", thread="t", run="r1"))
            assert status == 200
            forgetting, forgot = asyncio.Event(), asyncio.Event()
            forget = one.forget_thread

            async def slow_forget(thread_id: str, *, strict: bool = False) -> None:
                forgetting.set()
                await forgot.wait()
                await forget(thread_id, strict=strict)

            one.forget_thread = slow_forget  # type: ignore[method-assign]
            deleting = asyncio.ensure_future(call(first, "DELETE", "/threads/t", None))
            try:
                await asyncio.wait_for(forgetting.wait(), 10)
                status, body, _ = await call(second, "POST", "/agent/default/run", None,
                                             run_input("meanwhile", thread="t", run="r2"))
                # Nor is the delete a run another worker could stop.
                stopped = await call(second, "POST", "/agent/default/stop/t", None)
            finally:
                forgot.set()
            assert status == 409, body
            assert (stopped[0], orjson.loads(stopped[1])["stopped"]) == (200, False)
            status, body, _ = await deleting
            assert status == 200, body
            assert await two.store.summary("t") is None
            status, _, _ = await call(second, "POST", "/agent/default/run", None,
                                      run_input("again", thread="t", run="r3"))
            assert status == 200
