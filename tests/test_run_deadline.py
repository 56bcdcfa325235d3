"""`CopilotRuntime(max_run_seconds=)`: a run still going after that long is cut as a stop is
(its upstream request cancelled, its open messages closed) and ends with a `RUN_ERROR` coded
`RUN_TIMEOUT`; it is stored so, its thread takes the next run, and the server keeps serving.
Before, nothing bounded a run: an agent that never ended (a tool waiting on a dead service)
kept its thread busy until someone pressed stop, or forever once its client had left.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from copilot_runtime import (
    ConfigurationError,
    CopilotRuntime,
    RunInput,
    coordinator,
    thread_store,
)
from copilot_runtime import events as ev
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.events import EventBatches
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import ServeRuntime, openai_runtime, parse_sse, poll, run_input, types
from tests.gql.wire import user_turn
from tests.hitl_support.postgres import postgres_schema
from tests.test_graphql_protocol import generate

pytestmark = pytest.mark.timeout(60)

#: Long enough for a chat with the mock beside the other test process (0.5 s cut one once
#: in a fresh-clone CI), short enough to wait for.
_LIMIT = 1.5


class StuckOnce(Agent):
    """Says "working", then waits forever on its first run; answers at once afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0
        self.cut = asyncio.Event()

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        self.runs += 1
        return self._run(input.run_id, stuck=self.runs == 1)

    async def _run(self, run_id: str, stuck: bool) -> Any:
        message = f"m-{run_id}"
        yield [ev.text_message_start(message), ev.text_message_content(message, "working")]
        if stuck:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cut.set()
                raise
        yield [ev.text_message_content(message, " done"), ev.text_message_end(message)]


def _timed_out(events: list[dict[str, Any]]) -> None:
    assert types(events) == ["RUN_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT",
                             "TEXT_MESSAGE_END", "RUN_ERROR"], types(events)
    assert events[-1]["code"] == "RUN_TIMEOUT"
    assert events[-1]["message"] == f"The run did not finish within {_LIMIT:g} seconds"


@pytest.mark.parametrize("store", ["memory", "sqlite", "postgresql"])
async def test_a_run_past_the_limit_ends_with_run_timeout_and_its_thread_goes_on(
        store: str, llm: MockOpenAIServer, serve_runtime: ServeRuntime,
        tmp_path: Path) -> None:
    agent = StuckOnce()
    with contextlib.ExitStack() as stack:
        options: dict[str, Any] = {}
        if store == "sqlite":
            options["thread_store"] = thread_store(f"sqlite:///{tmp_path / 'threads.db'}")
        elif store == "postgresql":  # and a shared coordinator: the lease goes back too
            url = stack.enter_context(postgres_schema())
            options.update(thread_store=thread_store(url), coordinator=coordinator(url))
        runtime = openai_runtime(llm, agents={"stuck": agent}, max_run_seconds=_LIMIT,
                                 **options)
        await _times_out_and_goes_on(runtime, agent, serve_runtime)


async def _times_out_and_goes_on(runtime: CopilotRuntime, agent: StuckOnce,
                                 serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(runtime) as served:
        started = time.monotonic()
        events = await served.run(run_input("hi", thread="t", run="r1"), agent="stuck")
        took = time.monotonic() - started
        _timed_out(events)
        assert agent.cut.is_set()  # the agent itself was cancelled, not only its stream
        assert _LIMIT <= took < _LIMIT + 5, took
        # Stored as it ended; the thread is free for the next run, which finishes.
        response = await served.post("/agent/stuck/connect", run_input("", thread="t",
                                                                      run="c"))
        _timed_out(parse_sse(await response.read()))
        events = await served.run(run_input("again", thread="t", run="r2"), agent="stuck")
        assert types(events)[-1] == "RUN_FINISHED"
        # A run shorter than the limit is not touched, and its timer does not outlive it.
        events = await served.run(run_input("hello", thread="other", run="r3"))
        assert types(events)[-1] == "RUN_FINISHED"
        await asyncio.sleep(_LIMIT + 0.2)
        assert not runtime.runs.active


async def test_the_upstream_request_of_a_run_past_the_limit_is_cancelled(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm, max_run_seconds=_LIMIT)) as served:
        # Five pieces 400 ms apart: two seconds, cut at half a second.
        events = await served.run(run_input("slow:400 a long answer", thread="t", run="r1"))
        assert types(events)[-1] == "RUN_ERROR"
        assert events[-1]["code"] == "RUN_TIMEOUT"
        assert "TEXT_MESSAGE_END" in types(events)
        async for _ in poll(10):
            if llm.cancelled_streams:
                break
        assert llm.cancelled_streams == 1
        events = await served.run(run_input("quick", thread="t", run="r2"))
        assert types(events)[-1] == "RUN_FINISHED"


async def test_graphql_clients_see_a_failed_response(llm: MockOpenAIServer,
                                                     serve_runtime: ServeRuntime) -> None:
    agent = StuckOnce()
    runtime = openai_runtime(llm, agents={"stuck": agent}, max_run_seconds=_LIMIT)
    async with serve_runtime(runtime) as served:
        result, payloads = await generate(
            served, user_turn("hi", thread="g", agentSession={"agentName": "stuck"}))
        status = result["status"]
        assert (status["code"], status["reason"]) == ("Failed", "UNKNOWN_ERROR")
        details = status["details"]
        assert details["description"] == f"The run did not finish within {_LIMIT:g} seconds"
        assert details["originalError"]["originalErrorType"] == "RUN_TIMEOUT"
        assert "Traceback" not in orjson.dumps(payloads).decode()
        result, _ = await generate(
            served, user_turn("again", thread="g", agentSession={"agentName": "stuck"}))
        assert result["status"]["code"] == "Success", result["status"]


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, True, "5", 1e300])
def test_a_limit_that_is_not_a_positive_number_of_seconds_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_run_seconds"):
        CopilotRuntime(agents={}, max_run_seconds=bad)
