"""Every started stream ends: an agent whose stream fails to close, and an action that
awaits work another task ended, still give the client its run's end.

A custom agent whose stream's close raised (its `aclose`, or its generator's `finally`,
after its last event or after a stop) cut the client's stream without RUN_FINISHED or
RUN_ERROR (the run was stored with an INTERRUPTED end, and the exception reached the
server). An action awaiting a task that raised GeneratorExit, or that another task
cancelled, is the tool's error on both protocols, and a stop still stops one at work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from copilot_runtime import Agent, CopilotRuntime, RunContext, RunInput, action
from copilot_runtime import events as ev
from copilot_runtime._input import parse_run_input
from copilot_runtime.events import Event, EventBatches
from copilot_runtime.testing import ScriptedAdapter, text_turn, tool_turn, verify_events
from tests.conftest import Served, ServeRuntime, poll, run_input, types
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


# ---- actions awaiting work another task ended --------------------------------------------


async def _raises_generator_exit() -> str:
    await asyncio.sleep(0)
    raise GeneratorExit("closed in /srv/app/x.py")


@action
async def awaits_a_closed_task() -> str:
    """Awaits a task that raised GeneratorExit."""
    return await asyncio.ensure_future(_raises_generator_exit())


@action
async def awaits_a_cancelled_task() -> str:
    """Awaits a task another task cancels."""
    lookup = asyncio.ensure_future(asyncio.sleep(30, "late"))
    asyncio.get_running_loop().call_soon(lookup.cancel)
    return await lookup


@action
async def waits_for_a_cancelled_task() -> str:
    """Waits, with a bound, for a task another task cancels."""
    lookup = asyncio.ensure_future(asyncio.sleep(30, "late"))
    asyncio.get_running_loop().call_later(0.01, lookup.cancel)
    return await asyncio.wait_for(lookup, 10)


@action
async def shields_a_cancelled_task() -> str:
    """Shields a task another task cancels."""
    lookup = asyncio.ensure_future(asyncio.sleep(30, "late"))
    asyncio.get_running_loop().call_later(0.01, lookup.cancel)
    return await asyncio.shield(lookup)


@action
async def gathers_a_closed_task() -> str:
    """Gathers a task that raises GeneratorExit."""
    (result,) = await asyncio.gather(_raises_generator_exit())
    return result


@action
async def groups_a_closed_task() -> str:
    """Runs a task group one of whose tasks raises GeneratorExit."""
    async with asyncio.TaskGroup() as group:
        group.create_task(_raises_generator_exit())
        group.create_task(asyncio.sleep(30))
    return "never"


@action
def closes_in_a_thread() -> str:
    """Raises GeneratorExit in its worker thread (a sync handler)."""
    raise GeneratorExit("closed")


AWAITING = [awaits_a_closed_task, awaits_a_cancelled_task, waits_for_a_cancelled_task,
            shields_a_cancelled_task, gathers_a_closed_task, groups_a_closed_task,
            closes_in_a_thread]


@pytest.mark.parametrize("tool", AWAITING, ids=lambda a: a.name)
async def test_an_action_awaiting_an_ended_task_is_a_tool_error_on_agui(
        serve_runtime: ServeRuntime, tool: Any) -> None:
    model = ScriptedAdapter(tool_turn((tool.name, "{}")), text_turn("done"))
    runtime = CopilotRuntime(service_adapter=model, actions=[tool])
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread="t-a"))
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    (result,) = [e for e in events if e["type"] == "TOOL_CALL_RESULT"]
    error = orjson.loads(result["content"])["error"]
    assert not any(s in error for s in _INTERNALS), error


class CallsTool(Agent):
    """Calls `name` (a server-side action the runtime answers), then says it is done."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run()

    async def _run(self) -> EventBatches:
        yield [ev.tool_call_start("c1", self.name, "m0"), ev.tool_call_args("c1", "{}"),
               ev.tool_call_end("c1")]
        yield _said("done")


@pytest.mark.parametrize("tool", AWAITING, ids=lambda a: a.name)
async def test_an_action_awaiting_an_ended_task_is_a_tool_error_on_graphql(
        serve_runtime: ServeRuntime, tool: Any) -> None:
    runtime = CopilotRuntime(agents={"caller": CallsTool(tool.name)}, actions=[tool],
                             service_adapter=ScriptedAdapter())
    async with serve_runtime(runtime) as served:
        response = await graphql_turn(served, "caller", "g-a")
    assert response["status"]["code"] == "Success", response["status"]
    (result,) = [m for m in response["messages"] if m["__typename"] == "ResultMessageOutput"]
    assert "error" in result["result"], result
    assert [m["content"] for m in response["messages"]
            if m["__typename"] == "TextMessageOutput"] == [["done"]]


async def test_a_stop_still_stops_an_action_at_work_and_waits_for_it(
        serve_runtime: ServeRuntime) -> None:
    """A handler runs in a task of its own now: a stop of its run cancels it, and the run
    ends once it has unwound, as when it ran in the run's task; so does a GraphQL client's
    disconnect (its stop button)."""
    working = asyncio.Event()
    unwound: list[str] = []

    @action
    async def works_long() -> str:
        """Works for a minute."""
        working.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # some cleanup of its own
            unwound.append("cancelled")
            raise
        return "worked"

    model = ScriptedAdapter(tool_turn(("works_long", "{}")), tool_turn(("works_long", "{}")))
    runtime = CopilotRuntime(service_adapter=model, actions=[works_long])
    async with serve_runtime(runtime) as served:
        running = asyncio.ensure_future(served.run(run_input("go", thread="t-stop")))
        async with asyncio.timeout(10):
            await working.wait()
            stop = await served.post("/agent/default/stop/t-stop", {})
            assert (await stop.json())["stopped"] is True
            events = await running
        assert unwound == ["cancelled"]
        verify_events(events)
        assert types(events)[-1] == "RUN_FINISHED"
        assert not [e for e in events if e["type"] == "TOOL_CALL_RESULT"]
        working.clear()
        data = chat_data([text_message("sys", "system", "Be brief."),
                          text_message("g-u", "user", "go")], thread="g-stop")
        async with asyncio.timeout(10):
            response = await served.session.post(served.url, data=orjson.dumps(
                {"query": CLIENT_DOCUMENT, "variables": {"data": data}}),
                headers=CLIENT_HEADERS)
            await working.wait()
        response.close()  # the client leaves: its run is stopped
        async for _ in poll(10, 0.02):
            if not runtime.is_running("g-stop"):
                break
        assert not runtime.is_running("g-stop")
        assert unwound == ["cancelled", "cancelled"]
        stored = await stored_events(served, "g-stop")
        assert stored[-1]["type"] == "RUN_FINISHED"
