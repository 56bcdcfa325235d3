"""Logs and spans at their edges: an upstream's failure naming the request's credentials,
an upstream's terminal controls on a console, an unexpected 500, and a run stopped or left
while the model streams."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from copilot_runtime import CopilotRuntime, HttpAgent, OpenAIAdapter, RunInput
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.auth import RequestInfo
from copilot_runtime.events import EventBatches
from copilot_runtime.telemetry import Telemetry, configure_logging
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import RawServer, ServeRuntime, run_input

pytestmark = pytest.mark.timeout(30)

UPSTREAM_KEY = "f3a9c0de55aa41b7b2c9e8d7c6b5a401"


@pytest.fixture
def traced() -> Iterator[tuple[Telemetry, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        yield Telemetry(tracer_provider, MeterProvider(metric_readers=[])), exporter
    finally:
        tracer_provider.shutdown()


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """What `configure_logging` writes (processors and renderer included), for the test to
    configure and read."""
    out = io.StringIO()
    try:
        yield out
    finally:
        structlog.reset_defaults()


class MalformedAnswer(RawServer):
    """Answers with a header line aiohttp cannot parse: a `ClientResponseError`."""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Bad Header Without Colon\r\n\r\n")
        await writer.drain()
        writer.close()


async def test_a_remote_agents_credential_headers_stay_out_of_the_log(
        serve_runtime: ServeRuntime) -> None:
    """An upstream's malformed answer raises a `ClientResponseError`, whose repr holds every
    header of the request: the "remote call failed" warning logged the operator's key under
    a name no pattern knows (Azure's `Ocp-Apim-Subscription-Key`, `X-Functions-Key`). Now
    the warning keeps the error's type, status and message, never the request's headers."""
    async with MalformedAnswer() as upstream:
        agent = HttpAgent(upstream.url + "/run", headers={
            "Ocp-Apim-Subscription-Key": UPSTREAM_KEY, "X-Functions-Key": UPSTREAM_KEY})
        async with serve_runtime(CopilotRuntime(agents={"remote": agent})) as served:
            with structlog.testing.capture_logs() as logs:
                events = await served.run(run_input("Hi"), agent="remote")
    assert events[-1]["type"] == "RUN_ERROR"
    assert UPSTREAM_KEY not in json.dumps(events)
    (failed,) = [e for e in logs if e["event"] == "remote call failed"]
    assert failed["error"].startswith("ClientResponseError(status=400, message=")
    assert UPSTREAM_KEY not in repr(logs)


class ControlsInRepr:
    """An object whose own repr carries a terminal control sequence."""

    def __repr__(self) -> str:
        return "<obj \x1b[2J>"


def test_console_logs_escape_terminal_controls_in_every_value(log_lines: io.StringIO) -> None:
    """Only the message and an exception's text were escaped: a remote agent's unknown event
    type (`type=...`, a string the console renderer writes unquoted) retitled the window and
    cleared the screen. Now every value is: strings, and objects whose repr holds
    controls."""
    configure_logging(json=False)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(log_lines))
    structlog.get_logger("t").warning(
        "dropping events of an unknown type", type="\x1b]0;pwned\x07\x1b[2J\x1b[1A",
        quoted="a b\x1b[1Ac", obj=ControlsInRepr(), count=3)
    line = log_lines.getvalue()
    for raw in ("\x1b]0;", "\x07", "\x1b[2J", "\x1b[1A"):
        assert raw not in line, raw
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[1A" in line
    assert "<obj \\\\x1b[2J>" in line  # escaped, then quoted by the renderer
    assert "count" in line  # the other values
    assert "\x1b[" in line  # the renderer's colours


class BrokenCapabilities(Agent):
    """`/info` asks for its capabilities, which fail as a bug does."""

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        raise NotImplementedError

    def capabilities(self) -> Any:
        raise RuntimeError("capabilities lookup failed")


async def test_an_unexpected_500_is_logged_with_its_request_id_and_its_span_says_500(
        traced: tuple[Telemetry, InMemorySpanExporter], serve_runtime: ServeRuntime,
        log_lines: io.StringIO) -> None:
    """The "unhandled error" line (the only place its stack is) was written after the
    request's log context was left: no `request_id`, so the `X-Request-ID` a client reports
    led nowhere. And the request span ended before the 500 was sent: ERROR, but without
    `http.response.status_code`. Now the 500 is answered and logged inside both."""
    telemetry, exporter = traced
    configure_logging(json=True)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(log_lines))
    seen: list[str] = []

    def on_request(request: RequestInfo) -> None:
        seen.append(request.request_id)

    for runtime, request_id in (
            (CopilotRuntime(agents={"b": BrokenCapabilities()}, telemetry=telemetry),
             "req-traced-1"),
            (CopilotRuntime(agents={"b": BrokenCapabilities()}, on_request=on_request),
             "req-untraced-2")):
        async with serve_runtime(runtime) as served, served.session.get(
                served.url + "/info", headers={"X-Request-ID": request_id}) as response:
            assert response.status == 500
            assert response.headers["x-request-id"] == request_id
            assert (await response.json())["error"] == "internal_error"
    assert seen == ["req-untraced-2"]
    lines = [json.loads(line) for line in log_lines.getvalue().splitlines()]
    assert [(e["request_id"], "capabilities lookup failed" in e["exception"])
            for e in lines if e["event"] == "unhandled error"] == [
        ("req-traced-1", True), ("req-untraced-2", True)]
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "copilotkit.request"]
    attributes = dict(span.attributes or {})
    assert attributes["copilotkit.request_id"] == "req-traced-1"
    assert attributes["http.response.status_code"] == 500
    assert span.status.status_code == StatusCode.ERROR
    (event,) = span.events
    assert dict(event.attributes or {})["exception.type"] == "RuntimeError"


def test_a_model_call_ended_by_a_cancellation_is_no_failure(
        traced: tuple[Telemetry, InMemorySpanExporter]) -> None:
    """A model span ended by a cancellation (a stop) or a closed stream (a client that
    left) read ERROR "CancelledError" with a stack, while the run said stopped and a tool
    span cut the same way stays UNSET. Now it stays UNSET; a failure is still an error."""
    telemetry, exporter = traced
    run = telemetry.run_started("default", "t", "r", None)
    run.model_call("openai", "m").end(None, None, asyncio.CancelledError())
    run.model_call("openai", "m").end(None, None, GeneratorExit())
    run.model_call("openai", "m").end(None, None, ConnectionError("provider down"))
    spans = [s for s in exporter.get_finished_spans() if s.name == "chat m"]
    assert [(s.status.status_code, len(s.events)) for s in spans] == [
        (StatusCode.UNSET, 0), (StatusCode.UNSET, 0), (StatusCode.ERROR, 1)]


async def test_a_stop_mid_stream_leaves_the_model_span_without_error(
        traced: tuple[Telemetry, InMemorySpanExporter], serve_runtime: ServeRuntime,
        llm: MockOpenAIServer) -> None:
    """The same through the built-in agent: a user's stop while the model streams."""
    telemetry, exporter = traced
    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0),
        telemetry=telemetry)
    async with serve_runtime(runtime) as served:
        streaming = await served.post("/agent/default/run",
                                      run_input("slow:200 hello there friend", thread="s"))
        while b"TEXT_MESSAGE_CONTENT" not in await streaming.content.readline():
            pass
        stopped = await served.post("/agent/default/stop/s", {})
        assert stopped.status == 200
        await streaming.read()
    spans = exporter.get_finished_spans()
    (run,) = [s for s in spans if s.name == "copilotkit.run"]
    assert dict(run.attributes or {})["copilotkit.outcome"] == "stopped"
    (chat,) = [s for s in spans if s.name.startswith("chat ")]
    assert (chat.status.status_code, chat.events) == (StatusCode.UNSET, ())
