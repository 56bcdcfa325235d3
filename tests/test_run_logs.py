"""What a run writes to the runtime's log. Before, a model provider's failure (a revoked key,
a 429, a 5xx, a refused connection, a stream cut mid-answer) ended the run with RUN_ERROR and
left no line at any level; and the lines written during a run (an action's, a hook's, a
guardrail's failure) carried the request id only, not the run's ids the docs promised. Now a
failed run is logged once (ERROR when the runtime's own credentials are refused, WARNING for
the provider's other failures, INFO for what the client caused), and every line written
during a run names its agent, thread and run.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from copilot_runtime import CopilotRuntime, HttpAgent, OpenAIAdapter, action
from copilot_runtime.auth import Principal
from copilot_runtime.guardrails import Messages, Verdict
from copilot_runtime.telemetry import configure_logging
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import (
    GatedAgent,
    ServeRuntime,
    free_port,
    parse_sse,
    poll,
    run_input,
)

pytestmark = pytest.mark.timeout(30)

API_KEY = "sk-live-0123456789abcdefXYZ"


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """The JSON lines `configure_logging` writes, its processors (bound ids) included."""
    out = io.StringIO()
    configure_logging(json=True)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(out))
    try:
        yield out
    finally:
        structlog.reset_defaults()


def _lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def _loud(out: io.StringIO) -> list[dict[str, Any]]:
    return [line for line in _lines(out) if line["level"] in ("warning", "error", "critical")]


async def _run(runtime: CopilotRuntime, serve_runtime: ServeRuntime, text: str,
               thread: str, run: str, **extra: Any) -> dict[str, Any]:
    """The run's last event, once its answer ended."""
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/default/run",
                                     run_input(text, thread=thread, run=run, **extra))
        events = parse_sse(await response.read())
    return events[-1]


_CREDENTIALS = "run failed: the provider refused the runtime's credentials"


@pytest.mark.parametrize(("text", "event", "level", "status", "code"), [
    ("error:401", _CREDENTIALS, "error", 401, "UPSTREAM_ERROR"),
    ("error:403", _CREDENTIALS, "error", 403, "UPSTREAM_ERROR"),
    ("error:429", "run failed", "warning", 429, "UPSTREAM_ERROR"),
    ("error:500", "run failed", "warning", 500, "UPSTREAM_ERROR"),
    ("breaks:2 hi there", "run failed", "warning", None, "UPSTREAM_CONNECTION_ERROR"),
])
async def test_a_provider_failure_is_logged_once_with_the_runs_ids(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime, log_lines: io.StringIO,
        text: str, event: str, level: str, status: int | None, code: str) -> None:
    runtime = CopilotRuntime(service_adapter=OpenAIAdapter(
        base_url=llm.base_url, api_key=API_KEY, max_retries=0))
    last = await _run(runtime, serve_runtime, text, "thread-p", "run-p")
    assert (last["type"], last["code"]) == ("RUN_ERROR", code)
    (line,) = _loud(log_lines)
    assert (line["event"], line["level"]) == (event, level)
    assert (line["code"], line.get("status")) == (code, status)
    assert (line["agent"], line["provider"]) == ("default", "openai")
    assert (line["thread_id"], line["run_id"]) == ("thread-p", "run-p")
    assert line["error"] == last["message"]
    assert API_KEY not in log_lines.getvalue()


async def test_a_provider_that_cannot_be_reached_is_logged_once(
        serve_runtime: ServeRuntime, log_lines: io.StringIO) -> None:
    runtime = CopilotRuntime(service_adapter=OpenAIAdapter(
        base_url=f"http://127.0.0.1:{free_port()}/v1", api_key=API_KEY, max_retries=0))
    last = await _run(runtime, serve_runtime, "hello", "thread-c", "run-c")
    assert last["code"] == "UPSTREAM_CONNECTION_ERROR"
    (line,) = _loud(log_lines)
    assert (line["event"], line["level"], line["code"]) == (
        "run failed", "warning", "UPSTREAM_CONNECTION_ERROR")
    assert (line["thread_id"], line["run_id"]) == ("thread-c", "run-c")
    assert API_KEY not in log_lines.getvalue()


async def test_a_request_the_client_got_wrong_logs_no_warning(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime, log_lines: io.StringIO) -> None:
    runtime = CopilotRuntime(service_adapter=OpenAIAdapter(
        base_url=llm.base_url, api_key=API_KEY, max_retries=0))
    last = await _run(runtime, serve_runtime, "hi", "thread-i", "run-i",
                      forwardedProps={"temperature": "hot"})
    assert (last["type"], last["code"]) == ("RUN_ERROR", "INVALID_REQUEST")
    assert _loud(log_lines) == []
    (line,) = [line for line in _lines(log_lines) if line["event"] == "run refused"]
    assert (line["level"], line["code"], line["run_id"]) == ("info", "INVALID_REQUEST", "run-i")


async def test_a_remote_agents_failure_is_logged_once_with_the_runs_ids(
        serve_runtime: ServeRuntime, log_lines: io.StringIO) -> None:
    """The remote call's own line says it (with its URL); the run adds none."""
    runtime = CopilotRuntime(agents={"default": HttpAgent(f"http://127.0.0.1:{free_port()}")})
    last = await _run(runtime, serve_runtime, "hi", "thread-r", "run-r")
    assert last["type"] == "RUN_ERROR"
    (line,) = _loud(log_lines)
    assert line["event"] == "remote call failed"
    assert (line["thread_id"], line["run_id"], line["agent"]) == ("thread-r", "run-r", "default")


@action
def explode(reason: str) -> str:
    """Always fails."""
    raise ValueError(reason)


def failing_hook(_: object) -> None:
    raise RuntimeError("hook bug")


class FailingGuardrail:
    async def check(self, messages: Messages, principal: Principal | None) -> Verdict:
        raise RuntimeError("guard bug")


async def test_every_line_written_during_a_run_names_the_run(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime, log_lines: io.StringIO) -> None:
    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key=API_KEY, max_retries=0),
        actions=[explode], on_run_finished=failing_hook, on_error=failing_hook)
    await _run(runtime, serve_runtime, 'call:explode {"reason":"boom"}', "thread-a", "run-a")
    await _run(runtime, serve_runtime, "error:500", "thread-b", "run-b")
    guarded = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key=API_KEY, max_retries=0),
        guardrails=[FailingGuardrail()])
    await _run(guarded, serve_runtime, "hi", "thread-g", "run-g")
    wanted = {("action failed", "run-a"), ("on_run_finished hook failed", "run-a"),
              ("on_run_finished hook failed", "run-b"), ("on_error hook failed", "run-b"),
              ("run failed", "run-b"), ("guardrail failed", "run-g")}
    async for _ in poll(10):  # the hooks run in tasks of their own, after the answer
        if wanted <= {(line["event"], line.get("run_id")) for line in _lines(log_lines)}:
            break
    lines = _lines(log_lines)
    assert wanted <= {(line["event"], line.get("run_id")) for line in lines}
    for line in lines:
        assert line.get("run_id") in ("run-a", "run-b", "run-g"), line
        assert line.get("thread_id") == f"thread-{line['run_id'][-1]}", line
        assert line["agent"] == "default", line


@pytest.mark.parametrize(("cut", "code"), [
    ("timeout", "RUN_TIMEOUT"), ("lost", "LEASE_LOST"), ("shutdown", "RUN_INTERRUPTED")])
async def test_a_run_the_runtime_cuts_is_logged_once_with_the_runs_ids(
        serve_runtime: ServeRuntime, log_lines: io.StringIO, cut: str, code: str) -> None:
    """Cut by the run-time bound, by its lease's loss or by shutdown, a run ended with a
    RUN_ERROR and left no line: an operator saw runs fail only from the clients."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent},
                             max_run_seconds=0.5 if cut == "timeout" else None)
    async with serve_runtime(runtime) as served:
        answer = asyncio.create_task(served.run(run_input("hi", thread="thread-x", run="run-x")))
        async for _ in poll(10):
            if "thread-x" in runtime.runs.active and runtime.runs.active["thread-x"].events[1:]:
                break
        if cut == "lost":
            assert runtime.runs.stop("thread-x", "run-x", "lost")
        elif cut == "shutdown":
            runtime.runs.stop_all()
        events = await answer
    assert (events[-1]["type"], events[-1]["code"]) == ("RUN_ERROR", code)
    (line,) = _loud(log_lines)
    assert (line["event"], line["level"], line["code"]) == ("run failed", "warning", code)
    assert (line["agent"], line["thread_id"], line["run_id"]) == (
        "default", "thread-x", "run-x")
    assert line["error"] == events[-1]["message"]
