"""The approval service lives and dies with its runtime, however the runtime is served.

A FastAPI app that mounts the runtime (no `create_app` lifespan of ours): the expiry timer
starts with the host app, an approval expires and its graph is resumed with the timeout
answer, and shutdown stops the timer before the checkpointers close (a timer that outlived
them would leave an unclosed connection, which the suite's warnings-as-errors catches).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from fastapi import FastAPI

from copilot_runtime import CopilotRuntime, mount_runtime
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.workflows.accounts import account_review
from tests.conftest import run_input, serve

pytestmark = pytest.mark.timeout(120)


async def eventually(check: Any, what: str, within: float = 30.0) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = await check()
        if found:
            return found
        await asyncio.sleep(0.05)
    pytest.fail(f"{what} within {within:.0f} s", pytrace=False)


async def test_a_mounted_runtime_starts_and_stops_its_approval_timer(tmp_path: Path) -> None:
    saver = checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3")
    runtime = CopilotRuntime(agents={"accounts": account_review(timeout_seconds=1).agent(
        name="accounts", checkpointer=saver)})
    host_events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        host_events.append("host up")
        yield
        host_events.append(f"host down (runtime started: {runtime.started})")

    app = FastAPI(lifespan=lifespan)
    mount_runtime(app, runtime, "/api/copilotkit")
    assert not runtime.started
    async with serve(app) as url, httpx2.AsyncClient(timeout=30) as client:
        # Started with the host, before any request reached the runtime.
        assert runtime.started
        assert runtime.approvals.timer_running
        body = run_input("Review account GLOBEX-002", thread="late", protocolVersion="1.0")
        answer = await client.post(f"{url}/api/copilotkit/agent/accounts/run", json=body)
        assert answer.status_code == 200
        assert '"type":"interrupt"' in answer.text

        async def expired() -> Any:
            listed = (await client.get(f"{url}/api/copilotkit/approvals",
                                       params={"status": "expired"})).json()["approvals"]
            return listed if listed and listed[0]["applied"] else None

        (approval,) = await eventually(expired, "the approval expired and was applied")
        assert approval["answer"]["action"] == "timeout"
        assert approval["answeredBy"] == "runtime"
    # The runtime closed inside the host's lifespan, its timer first.
    assert host_events == ["host up", "host down (runtime started: False)"]
    assert not runtime.approvals.timer_running
