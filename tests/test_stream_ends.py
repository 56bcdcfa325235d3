"""Every started stream ends: an agent whose stream fails to close still gives the client
its run's end.

A custom agent whose stream's close raised (its `aclose`, or its generator's `finally`,
after its last event or after a stop) cut the client's stream without RUN_FINISHED or
RUN_ERROR (the run was stored with an INTERRUPTED end, and the exception reached the
server).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from copilot_runtime import Agent, CopilotRuntime, RunContext, RunInput
from copilot_runtime import events as ev
from copilot_runtime._input import parse_run_input
from copilot_runtime.events import Event, EventBatches
from copilot_runtime.testing import verify_events
from tests.conftest import Served, ServeRuntime, run_input, types
from tests.gql.wire import (
    CLIENT_DOCUMENT,
    CLIENT_HEADERS,
    chat_data,
    merge,
    parse_multipart,
    text_message,
)

pytestmark = pytest.mark.timeout(30)

Json = dict[str, Any]
_INTERNALS = ("Traceback", 'File "', ".py")


class _Batches:
    """An agent's stream as a plain async iterator whose `aclose` raises."""

    def __init__(self, batches: list[list[Event]], fail_with: Exception | None) -> None:
        self.batches = list(batches)
        self.fail_with = fail_with

    def __aiter__(self) -> _Batches:
        return self

    async def __anext__(self) -> list[Event]:
        if not self.batches:
            if self.fail_with is not None:
                raise self.fail_with
            raise StopAsyncIteration
        return self.batches.pop(0)

    async def aclose(self) -> None:
        raise RuntimeError("could not close /srv/app/agent.py")


def _said(message: str) -> list[Event]:
    return [ev.text_message_start("m1"), ev.text_message_content("m1", message),
            ev.text_message_end("m1")]


class ClosesBadly(Agent):
    """Says something, then ends (`how`); closing its stream then raises."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        if self.how == "iterator":
            return _Batches([_said("hi")], None)
        if self.how == "iterator-failing":
            return _Batches([_said("hi")], ValueError("upstream said no"))
        return self._generator(input)

    async def _generator(self, input: RunInput) -> EventBatches:
        try:
            yield _said("hi")
            yield [ev.run_finished(input.thread_id, input.run_id)]
            yield _said("never read")
        finally:
            raise RuntimeError("cleanup failed in /srv/app/agent.py")


AGENT_KINDS = ["iterator", "iterator-failing", "own-end"]


async def graphql_turn(served: Served, agent: str, thread: str) -> Json:
    data = chat_data([text_message("sys", "system", "Be brief."),
                      text_message(f"{thread}-u", "user", "go")],
                     thread=thread, agentSession={"agentName": agent})
    response = await served.session.post(served.url, data=orjson.dumps(
        {"query": CLIENT_DOCUMENT, "variables": {"data": data}}), headers=CLIENT_HEADERS)
    assert response.status == 200, await response.text()
    merged = merge(parse_multipart(await response.read()))
    result: Json = merged["data"]["generateCopilotResponse"]
    return result


async def stored_events(served: Served, thread: str) -> list[Json]:
    response = await served.session.get(f"{served.url}/threads/{thread}/events")
    assert response.status == 200, await response.text()
    events: list[Json] = (await response.json())["events"]
    return events


@pytest.mark.parametrize("how", AGENT_KINDS)
async def test_an_agent_whose_close_raises_still_ends_its_agui_stream(
        serve_runtime: ServeRuntime, how: str) -> None:
    runtime = CopilotRuntime(agents={"closes": ClosesBadly(how)})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread=f"t-{how}"), agent="closes")
        verify_events(events)
        end = events[-1]
        stored = await stored_events(served, f"t-{how}")
        again = await served.run(run_input("again", thread=f"t-{how}", run="run-2"),
                                 agent="closes")
    if how == "own-end":
        assert end["type"] == "RUN_FINISHED", end
    else:
        assert end["type"] == "RUN_ERROR", end
        assert end["code"] == "AGENT_ERROR"
        assert not any(s in end["message"] for s in _INTERNALS)
    assert stored[-1]["type"] == end["type"]
    assert types(again)[-1] in ("RUN_FINISHED", "RUN_ERROR")  # the thread was given back


@pytest.mark.parametrize("how", AGENT_KINDS)
async def test_an_agent_whose_close_raises_still_ends_its_graphql_response(
        serve_runtime: ServeRuntime, how: str) -> None:
    runtime = CopilotRuntime(agents={"closes": ClosesBadly(how)})
    async with serve_runtime(runtime) as served:
        response = await graphql_turn(served, "closes", f"g-{how}")
        stored = await stored_events(served, f"g-{how}")
        again = await graphql_turn(served, "closes", f"g-{how}")
    status = response["status"]
    if how == "own-end":
        assert status["code"] == "Success", status
        assert stored[-1]["type"] == "RUN_FINISHED"
    else:
        assert status["code"] == "Failed", status
        assert not any(s in str(status) for s in _INTERNALS)
        assert stored[-1]["type"] == "RUN_ERROR"
    assert again["status"]["code"] in ("Success", "Failed")


class StuckAfterSaying(Agent):
    """Says something, then waits (`where`: at its yield, or in an await) until stopped;
    its `finally` raises."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run()

    async def _run(self) -> EventBatches:
        try:
            yield _said("hi")
            await asyncio.sleep(60)
        finally:
            raise RuntimeError("cleanup failed in /srv/app/agent.py")


@pytest.mark.parametrize("where", ["at-yield", "in-await"])
async def test_a_stopped_agent_whose_close_raises_still_ends_as_a_stop(where: str) -> None:
    runtime = CopilotRuntime(agents={"stuck": StuckAfterSaying(where)})
    written: list[Event] = []
    in_write = asyncio.Event()
    release = asyncio.Event()

    async def write(batch: Sequence[Event]) -> None:
        written.extend(batch)
        if where == "at-yield" and any(e["type"] == "TEXT_MESSAGE_START" for e in batch):
            in_write.set()
            await release.wait()  # a client slow to read: the agent waits at its yield
        elif any(e["type"] == "TEXT_MESSAGE_END" for e in batch):
            in_write.set()

    try:
        run = await runtime.start_run("stuck", parse_run_input(run_input("go", thread="t-s")))
        driving = asyncio.ensure_future(run.drive(write))
        async with asyncio.timeout(10):
            await in_write.wait()
            await asyncio.sleep(0.05)
            assert runtime.stop_run("stuck", "t-s")
            await driving
        assert not driving.cancelled()
        assert written[-1]["type"] == "RUN_FINISHED", written[-1]
        assert not runtime.is_running("t-s")
        stored = await runtime.store.get("t-s")
        assert stored is not None
        assert stored.runs[-1].events[-1]["type"] == "RUN_FINISHED"
    finally:
        release.set()
        await runtime.aclose()

