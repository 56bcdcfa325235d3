"""Telemetry, logs and hooks under hostile conditions: secrets in exceptions, unbounded text
from remote agents, hooks that never return, and a span with a status on every path."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import structlog
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from copilot_runtime import (
    BearerTokenAuth,
    CopilotRuntime,
    OpenAIAdapter,
    PatternGuardrail,
    RunInput,
)
from copilot_runtime import events as ev
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.auth import RequestInfo
from copilot_runtime.events import EventBatches
from copilot_runtime.hooks import RunFinished
from copilot_runtime.telemetry import (
    MAX_ATTRIBUTE,
    Telemetry,
    configure_logging,
    redact_secrets,
)
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import GatedAgent, ServeRuntime, run_input, text_of
from tests.gql.wire import CLIENT_DOCUMENT, CLIENT_HEADERS, user_turn
from tests.realclient_app import getWeather

DB_PASSWORD = "hunter2-db-pass"
API_KEY = "AIzaSyA-0123456789abcdefghijk"
BEARER = "c0ffee0123456789abcdef"
TOKEN = "tok-alice-0001"


@pytest.fixture
def traced() -> Iterator[tuple[Telemetry, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    try:
        yield Telemetry(tracer_provider, meter_provider), exporter
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()


def _driver_error() -> RuntimeError:
    """An error as a driver and an HTTP client raise it: its cause names the provider's URL
    with its key, and the error itself the database URL with its password."""
    try:
        try:
            raise OSError(f"connect failed: https://llm.example/v1?key={API_KEY} "
                          f"(Authorization: Bearer {BEARER})")
        except OSError as cause:
            raise RuntimeError(
                f"pool down: postgresql://app:{DB_PASSWORD}@db:5432/app") from cause
    except RuntimeError as exc:
        return exc


def _span_text(span: ReadableSpan) -> str:
    return orjson.dumps([dict(span.attributes or {}), span.status.description,
                         [dict(e.attributes or {}) for e in span.events]]).decode()


def test_exceptions_on_spans_carry_no_secrets(
        traced: tuple[Telemetry, InMemorySpanExporter]) -> None:
    """A failed model call, tool call or request put the exception on its span as the SDK
    records it: the message and the whole stack, chained causes included, so the database
    password, the provider's key and the bearer token reached the trace backend (and the
    request span's status read "RuntimeError: pool down: postgresql://app:<password>@...").
    Now the text is blanked as in logs; the type is kept."""
    telemetry, exporter = traced
    run = telemetry.run_started("default", "t1", "r1", None)
    run.model_call("google", "gemini-pro").end(None, None, _driver_error())
    with pytest.raises(RuntimeError), run.tool_call("lookup"):
        raise _driver_error()
    with pytest.raises(RuntimeError), telemetry.request_span(
            RequestInfo(method="POST", path="/api", headers={}, client=None)):
        raise _driver_error()
    run.end("error", {"code": "UPSTREAM_ERROR"})
    spans = exporter.get_finished_spans()
    assert len(spans) == 4
    for span in spans:
        text = _span_text(span)
        for secret in (DB_PASSWORD, API_KEY, BEARER):
            assert secret not in text, (span.name, secret)
        assert span.status.status_code == StatusCode.ERROR
    failed = [s for s in spans if s.events]
    assert len(failed) == 3
    for span in failed:
        (event,) = span.events
        assert event.attributes is not None
        assert event.attributes["exception.type"] == "RuntimeError"
        assert "pool down: postgresql://[REDACTED]@db" in str(event.attributes["exception.message"])
        assert "OSError: connect failed" in str(event.attributes["exception.stacktrace"])


def test_a_remote_agents_error_code_is_bounded_on_the_run_span(
        traced: tuple[Telemetry, InMemorySpanExporter]) -> None:
    """A remote agent's RUN_ERROR `code` went whole into the run span's `error.type` and
    status: 100,000 characters a run. Now at most `MAX_ATTRIBUTE` (the metric reads _OTHER)."""
    telemetry, exporter = traced
    telemetry.run_started("remote", "t", "r", None).end("error", {"code": "E" * 100_000})
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert len(str(span.attributes["error.type"])) == MAX_ATTRIBUTE
    assert len(span.status.description or "") <= MAX_ATTRIBUTE


def test_logs_blank_url_passwords_holding_at_signs_and_cut_huge_values() -> None:
    """`redis://:p@ss@host` is the password `p@ss` to Redis' URL parser (it splits at the
    last `@`), but logs blanked only `:p` and showed `ss`. And a value of megabytes (a remote
    agent's event type, a path) was written whole into one log line."""
    event = redact_secrets(None, "warning", {
        "event": "x", "backend": "redis://:s3cr3t@pa55@cache:6379/0",
        "said": "could not reach postgresql://app:pa@ss:word@db.example:5432/app now",
        "type": "A" * 1_000_000, "cut_through": "x" * 8180 + f" Bearer {BEARER} " + "y" * 9000})
    assert "pa55" not in event["backend"]
    assert event["backend"] == "redis://[REDACTED]@cache:6379/0"
    assert "ss:word" not in event["said"]
    assert event["said"] == "could not reach postgresql://[REDACTED]@db.example:5432/app now"
    assert len(event["type"]) < 20_000
    assert event["type"].startswith("AAAA")
    assert event["type"].endswith("AAAA")
    assert "characters cut" in event["type"]
    assert "c0ffee" not in event["cut_through"]  # a cut ran through it: blanked all the same


class _Config:
    """An object whose repr names its key, as a client's config does."""

    def __repr__(self) -> str:
        return f"Config(base_url='https://llm.example', api_key='{BEARER}')"


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize("as_json", [True, False])
def test_logs_redact_secrets_in_values_of_any_type_and_never_raise(as_json: bool) -> None:
    """Only strings, bytes, mappings, lists and tuples were redacted: an exception passed as
    a value (`error=exc`), a set, any object was written by its repr after the redaction, a
    database password or an API key in clear; and a mapping with bytes or tuple keys (raw
    ASGI headers) made the log call raise TypeError into its caller. Now every value is
    redacted in the text the renderer writes, and the line is written."""
    out = io.StringIO()
    try:
        configure_logging(json=as_json)
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(out))
        log = structlog.get_logger("t")
        log.warning("x", error=RuntimeError(f"connect to postgresql://app:{DB_PASSWORD}@db/app"),
                    key_error=OSError(f"Incorrect key provided: Bearer {BEARER}"),
                    urls={f"postgresql://app:{DB_PASSWORD}@db/app"}, config=_Config(),
                    odd=_BadRepr(), count=3)
        log.warning("y", headers={b"authorization": f"Token {BEARER}".encode(),
                                  b"accept": b"json"},
                    pairs=[(b"x-api-key", BEARER.encode())], by_tuple={("a", "b"): 1})
    finally:
        structlog.reset_defaults()
    text = out.getvalue()
    assert DB_PASSWORD not in text
    assert BEARER not in text
    assert "RuntimeError" in text  # what failed stays readable
    assert "_BadRepr" in text
    assert "json" in text
    if as_json:
        first, second = (json.loads(line) for line in text.splitlines())
        assert first["count"] == 3
        assert second["headers"] == {"authorization": "[REDACTED]", "accept": "json"}
        assert second["by_tuple"] == {"('a', 'b')": 1}


async def test_a_hook_that_never_returns_is_cancelled_and_logged_once_per_run(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """An async `on_run_finished` waiting on a service that never answers was a task kept
    for the life of the process (holding the run's messages), one more each run. Now it is
    cancelled after `background_timeout` seconds and logged once; the stream ended, the run
    was stored and the server serves on all the while. A hook's own TimeoutError is a
    failure, not a time-out."""
    started: list[str] = []

    async def never_returns(run: RunFinished) -> None:
        started.append(run.thread_id)
        if run.thread_id == "own-timeout":
            raise TimeoutError("the hook's webhook timed out")
        await asyncio.Event().wait()

    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0),
        on_run_finished=never_returns)
    runtime.hooks.background_timeout = 0.3
    async with serve_runtime(runtime) as served:
        with structlog.testing.capture_logs() as logs:
            for thread in ("h1", "h2", "own-timeout"):
                assert text_of(await served.run(run_input("Hi", thread=thread))) == "echo: Hi"
            for _ in range(300):
                if len(started) == 3 and not runtime.hooks._tasks:
                    break
                await asyncio.sleep(0.01)
            assert not runtime.hooks._tasks, "the hook's tasks were never cancelled"
            assert await runtime.store.summary("h1") is not None
            assert text_of(await served.run(run_input("Again", thread="h3"))) == "echo: Again"
        events = [e["event"] for e in logs if "hook" in e["event"]]
        assert events.count("on_run_finished hook timed out: cancelled") == 2
        assert events.count("on_run_finished hook failed") == 1


class BrokenProcessor(SpanProcessor):
    """An application's span processor with a bug: it raises on every span."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        raise RuntimeError("processor bug on start")

    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("processor bug on end")


async def test_a_broken_span_processor_loses_spans_not_runs(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """The SDK passes a processor's exception on to whoever starts or ends the span: every
    request was answered 500 (its span's start raised); raising on end only, a good answer
    ended in RUN_ERROR AGENT_ERROR (the model call's span) and `on_run_finished` never ran
    (the run's span ended before it). Now the runs end as they would, the hook runs, and
    the failure is logged once, not per span."""
    finished: list[RunFinished] = []
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BrokenProcessor())
    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0),
        on_run_finished=finished.append,
        telemetry=Telemetry(tracer_provider, MeterProvider(metric_readers=[])))
    async with serve_runtime(runtime) as served:
        with structlog.testing.capture_logs() as logs:
            assert text_of(await served.run(run_input("Hi", thread="p1"))) == "echo: Hi"
            failed = await served.run(run_input("error:500", thread="p2"))
            assert failed[-1]["code"] == "UPSTREAM_ERROR"
            assert text_of(await served.run(run_input("Hi", thread="p3"))) == "echo: Hi"
            for _ in range(300):
                if len(finished) == 3:
                    break
                await asyncio.sleep(0.01)
        assert [run.outcome for run in finished] == ["finished", "error", "finished"]
        assert [e["event"] for e in logs if e["log_level"] in ("error", "critical")] == [
            "telemetry failed: spans or metrics lost, serving goes on"]


def test_console_logs_escape_terminal_controls() -> None:
    """On a terminal (`configure_logging(json=False)`, the CLI's choice for a TTY) an
    exception's text was written as it was: a client's or a model's text in it could retitle
    the window (OSC), clear the screen or rewrite the line (CR). Now control characters
    read `\\xNN`; the renderer's own colours stay."""
    out = io.StringIO()
    try:
        configure_logging(json=False)
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(out))
        try:
            raise ValueError("bad city \x1b]0;owned\x07\x1b[2J\rfake")
        except ValueError:
            structlog.get_logger("t").exception("action failed", action="weather")
    finally:
        structlog.reset_defaults()
    line = out.getvalue()
    assert "\x1b]0;" not in line
    assert "\x07" not in line
    assert "\r" not in line
    assert "\\x1b]0;owned\\x07\\x1b[2J\\x0dfake" in line
    assert "\x1b[" in line  # the console renderer's colours


class OpenSpans(SpanProcessor):
    """The spans started and not yet ended."""

    def __init__(self) -> None:
        self.open: dict[int, str] = {}

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.open[span.context.span_id] = span.name

    def on_end(self, span: ReadableSpan) -> None:
        assert span.context is not None
        self.open.pop(span.context.span_id, None)


async def test_every_span_ends_with_a_status_on_every_path(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """Spans on the paths an operator watches: an answer, an upstream failure, a guardrail's
    refusal, 401, 404, 409, 503 from a failing `on_request`, a client that leaves
    mid-stream, `stop`, `connect`, GraphQL, and a tool that fails. All ended; but a request
    span said nothing of its answer: a 503 (a policy down) or a 429 looked like a 200, and a
    failed tool's span had no status. Now each request span carries
    `http.response.status_code`, and a 5xx or a failed tool the ERROR status."""
    exporter, open_spans = InMemorySpanExporter(), OpenSpans()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer_provider.add_span_processor(open_spans)

    def on_request(request: RequestInfo) -> None:
        if request.headers.get("x-policy") == "down":
            raise ConnectionError("policy service down")

    gated = GatedAgent()
    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0),
        actions=[getWeather], agents={"gated": gated}, auth=BearerTokenAuth({TOKEN: "alice"}),
        guardrails=[PatternGuardrail(deny=[r"forbidden"])], on_request=on_request,
        telemetry=Telemetry(tracer_provider, MeterProvider(metric_readers=[])),
        detached_run_seconds=0)  # the client that leaves stops its run: "disconnected"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        async with serve_runtime(runtime) as served:
            async def status(path: str, body: Any, headers: dict[str, str] = auth) -> int:
                response = await served.post(path, body, headers=headers)
                await response.read()
                return response.status

            assert await status("/agent/default/run", run_input("Hi", thread="a")) == 200
            assert await status("/agent/default/run", run_input("error:500", thread="b")) == 200
            assert await status("/agent/default/run", run_input("forbidden", thread="c")) == 200
            assert await status("/agent/default/run", run_input(  # a tool's failure
                'call:getWeather {"town":"Paris"}', thread="t")) == 200
            assert await status("/agent/default/run", run_input("Hi", thread="d"), {}) == 401
            assert await status("/agent/nope/run", run_input("Hi", thread="e")) == 404
            assert await status("/agent/default/run", run_input("Hi", thread="f"),
                                {**auth, "X-Policy": "down"}) == 503
            left = await served.post("/agent/gated/run", run_input("Hi", thread="g"),
                                     headers=auth)
            await left.content.readline()
            assert await status("/agent/gated/run", run_input("Hi", thread="g", run="r2")) == 409
            left.close()  # the client leaves mid-stream
            stopped = await served.post("/agent/gated/run", run_input("Hi", thread="h"),
                                        headers=auth)
            await stopped.content.readline()
            assert await status("/agent/gated/stop/h", {}) == 200
            await stopped.read()
            assert await status("/agent/gated/connect", run_input("Hi", thread="h")) == 200
            response = await served.session.post(served.url, data=orjson.dumps(
                {"query": CLIENT_DOCUMENT, "variables": {"data": user_turn("Hi", thread="q")}}),
                headers={**CLIENT_HEADERS, **auth})
            await response.read()
            assert response.status == 200
            for _ in range(300):
                if not open_spans.open:
                    break
                await asyncio.sleep(0.01)
    finally:
        tracer_provider.shutdown()
    assert open_spans.open == {}
    spans = exporter.get_finished_spans()
    requests = [s for s in spans if s.name == "copilotkit.request"]
    answered = [(s.attributes or {}).get("http.response.status_code") for s in requests]
    assert sorted(a for a in answered if a is not None) == sorted(
        [200, 200, 200, 200, 401, 404, 503, 200, 409, 200, 200, 200, 200])
    for span in requests:
        failed = (span.attributes or {}).get("http.response.status_code") == 503
        assert (span.status.status_code == StatusCode.ERROR) == failed, span.attributes
    outcomes = sorted(str((s.attributes or {})["copilotkit.outcome"]) for s in spans
                      if s.name == "copilotkit.run")
    assert outcomes == ["disconnected", "error", "finished", "finished", "finished", "refused",
                        "stopped"]
    (tool,) = [s for s in spans if s.name == "execute_tool getWeather"]
    assert tool.status.status_code == StatusCode.ERROR


class _Crashing(Agent):
    """Fails as a driver does, its error naming a database URL with its password."""

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run()

    async def _run(self) -> Any:
        yield [ev.text_message_start("m"), ev.text_message_content("m", "so far ")]
        raise _driver_error()


async def test_an_agents_exception_is_on_its_run_span_without_secrets(
        traced: tuple[Telemetry, InMemorySpanExporter], serve_runtime: ServeRuntime,
        llm: MockOpenAIServer) -> None:
    """An agent that raised ended its run with AGENT_ERROR on the span, and the exception
    only in the log: a trace said that the run failed, never why. Now the exception is on
    the run's span (type, message and stack), blanked as in logs; the client still reads
    only that the agent failed."""
    telemetry, exporter = traced
    runtime = CopilotRuntime(agents={"crashing": _Crashing()}, telemetry=telemetry)
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("Hi", thread="x"), agent="crashing")
    assert events[-1]["type"] == "RUN_ERROR"
    assert events[-1]["message"] == "Agent 'crashing' failed unexpectedly"
    assert "pool down" not in orjson.dumps(events).decode()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "copilotkit.run"]
    assert span.status.status_code == StatusCode.ERROR
    assert (span.attributes or {})["error.type"] == "AGENT_ERROR"
    (event,) = span.events
    attributes = dict(event.attributes or {})
    assert attributes["exception.type"] == "RuntimeError"
    assert "pool down: postgresql://[REDACTED]@db" in str(attributes["exception.message"])
    assert "OSError: connect failed" in str(attributes["exception.stacktrace"])
    for secret in (DB_PASSWORD, API_KEY, BEARER):
        assert secret not in _span_text(span)


class _CrashingAtOnce(Agent):
    """Checks its input in `run` itself, and fails before it returns its stream."""

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        raise _driver_error()


async def test_an_agent_failing_before_its_stream_ends_its_run_as_any_failure(
        traced: tuple[Telemetry, InMemorySpanExporter], serve_runtime: ServeRuntime) -> None:
    """An agent whose `run` raises before returning its stream: AGENT_ERROR on both
    protocols, the multipart answer closed, the exception on the run's span, and the thread
    takes the next run. Before, the stream was cut after RUN_STARTED (the multipart answer
    left open) and the run counted as finished."""
    telemetry, exporter = traced
    runtime = CopilotRuntime(agents={"default": _CrashingAtOnce()}, telemetry=telemetry)
    async with serve_runtime(runtime) as served:
        for run in ("r1", "r2"):
            events = await served.run(run_input("Hi", thread="x", run=run))
            assert [e["type"] for e in events] == ["RUN_STARTED", "RUN_ERROR"]
            assert (events[-1]["code"], events[-1]["message"]) == (
                "AGENT_ERROR", "Agent 'default' failed unexpectedly")
        answer = await served.generate(user_turn("Hi"))  # its framing checked too
        assert answer["status"]["code"] == "Failed"
        assert "pool down" not in orjson.dumps(answer).decode()
    runs = [s for s in exporter.get_finished_spans() if s.name == "copilotkit.run"]
    assert [(s.attributes or {})["copilotkit.outcome"] for s in runs] == ["error"] * 3
    for span in runs:
        assert span.status.status_code == StatusCode.ERROR
        (event,) = span.events
        assert dict(event.attributes or {})["exception.type"] == "RuntimeError"
        assert DB_PASSWORD not in _span_text(span)

