"""Tracing, metrics and logs (the `otel` extra: the OpenTelemetry API only).

`CopilotRuntime(telemetry=Telemetry())` uses the global tracer and meter providers (or the
ones given): the application picks the SDK and the exporters. It records

* a span per HTTP request (`copilotkit.request`) and, inside it, per run
  (`copilotkit.run`: agent, thread, run, principal id, outcome);
* under a run, a span per model call with the GenAI semantic conventions
  (`chat {model}`: `gen_ai.system`, `gen_ai.request.model`, `gen_ai.usage.input_tokens`,
  `gen_ai.usage.output_tokens`, `gen_ai.response.finish_reasons`) and per server-side tool
  call (`execute_tool {name}`);
* exceptions on the spans (never in answers to clients);
* metrics: `copilotkit.runs` and `copilotkit.run.errors` (counters),
  `copilotkit.run.duration` (seconds), `gen_ai.client.token.usage` and
  `gen_ai.client.operation.duration`.

Without `telemetry` none of this code runs. `configure_logging` makes the runtime's
structlog logs JSON (or console) lines with secrets redacted.
"""

from __future__ import annotations

import asyncio
import re
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

import structlog

from copilot_runtime._exceptions import (
    SECRET_KEYS,
    SECRET_VALUES,
    ApprovalClosedError,
    ConfigurationError,
    CopilotRuntimeError,
)
from copilot_runtime._version import __version__
from copilot_runtime.auth import RequestInfo
from copilot_runtime.events import runtime_codes

__all__ = ["ModelCall", "RunTelemetry", "Telemetry", "configure_logging", "escape_controls",
           "redact_secrets", "scrub"]

#: Distinct model names spans and metrics keep (a client may choose the model).
MAX_MODELS = 64
#: The longest value of a client-given span attribute (a path, a model name, an error code).
MAX_ATTRIBUTE = 256
#: The longest exception message and stack a span event keeps.
MAX_EXCEPTION_TEXT = 16 * 1024
#: Seconds between two log lines saying that telemetry failed.
FAILURE_LOG_INTERVAL = 60.0

_log = structlog.get_logger("copilot_runtime.telemetry")


class Telemetry:
    """Spans and metrics. Whatever the OpenTelemetry SDK or the application's processors and
    exporters raise is logged (at most once a minute) and dropped: a broken telemetry
    pipeline loses spans, never a run, a hook or an answer."""

    def __init__(self, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        try:
            from opentelemetry import context, metrics, trace
        except ImportError as exc:
            raise ConfigurationError(
                "Telemetry needs the OpenTelemetry API: pip install 'copilot-runtime[otel]'"
            ) from exc
        self._trace = trace
        self._context = context
        self.tracer = trace.get_tracer("copilot_runtime", __version__,
                                       tracer_provider=tracer_provider)
        meter = metrics.get_meter("copilot_runtime", __version__, meter_provider=meter_provider)
        self.runs = meter.create_counter("copilotkit.runs", unit="{run}",
                                         description="Runs ended, by agent and outcome")
        self.errors = meter.create_counter("copilotkit.run.errors", unit="{run}",
                                           description="Runs that ended with an error")
        self.duration = meter.create_histogram("copilotkit.run.duration", unit="s",
                                               description="Run duration")
        self.tokens = meter.create_histogram("gen_ai.client.token.usage", unit="{token}",
                                             description="Tokens per model call")
        self.operation = meter.create_histogram("gen_ai.client.operation.duration", unit="s",
                                                description="Model call duration")
        self._models: set[str] = set()
        self._codes = _runtime_codes()
        self._failures = 0
        self._failure_logged = -FAILURE_LOG_INTERVAL

    def failed(self) -> None:
        """Called in an `except` block: the telemetry call that raised is given up. Logged
        with its stack at most once a minute (a broken exporter fails on every span), with
        how many failed since the last such line."""
        self._failures += 1
        now = time.monotonic()
        if now - self._failure_logged >= FAILURE_LOG_INTERVAL:
            self._failure_logged = now
            _log.exception("telemetry failed: spans or metrics lost, serving goes on",
                           failures=self._failures)
            self._failures = 0

    def model_label(self, model: str | None) -> str | None:
        """`model` as spans and metrics name it: a client may choose it, so only the first
        `MAX_MODELS` distinct names of at most `MAX_ATTRIBUTE` characters are kept (each is
        a metric series for the life of the process); the others read "_OTHER"."""
        if model is None or model in self._models:
            return model
        if len(model) > MAX_ATTRIBUTE or len(self._models) >= MAX_MODELS:
            return "_OTHER"
        self._models.add(model)
        return model

    def error_label(self, code: str) -> str:
        """A run error's code as the errors metric labels it: the runtime's own codes, and
        "_OTHER" for any other (a remote agent's RUN_ERROR may carry a new code every run,
        each a metric series for the life of the process; the span keeps the code)."""
        if code not in self._codes:
            # Codes registered (or exceptions defined) by a module imported since.
            self._codes = _runtime_codes()
        return code if code in self._codes else "_OTHER"

    def record_error(self, span: Any, error: BaseException) -> None:
        """`error` on `span` (an `exception` event, and the ERROR status) with the secrets
        in its message and stack blanked: the SDK's own recording keeps the text whole, the
        chained causes' too (a driver's error naming its URL with the password, a provider's
        with the key), and puts the message in the status as well."""
        stack = "".join(traceback.format_exception(error))
        span.record_exception(error, attributes={
            "exception.message": scrub_head(str(error), MAX_EXCEPTION_TEXT),
            # Its tail: the exception raised last.
            "exception.stacktrace": scrub_tail(stack, MAX_EXCEPTION_TEXT)})
        span.set_status(self._trace.StatusCode.ERROR, type(error).__name__)

    def span_failed(self, span: Any, error: BaseException) -> None:
        """`record_error`, or nothing if that raised (logged as `failed` says)."""
        try:
            self.record_error(span, error)
        except Exception:
            self.failed()

    def start_span(self, name: str, **options: Any) -> Any:
        """`tracer.start_span`, or a span that records nothing if that raised."""
        try:
            return self.tracer.start_span(name, **options)
        except Exception:
            self.failed()
            return self._trace.INVALID_SPAN

    @contextmanager
    def current_span(self, span: Any) -> Iterator[Any]:
        """`span` as the current span while the block runs (its children's parent); ended
        after it, with the exception that leaves the block recorded (secrets blanked)."""
        token = self._context.attach(self._trace.set_span_in_context(span))
        try:
            yield span
        except Exception as exc:
            self.span_failed(span, exc)
            raise
        finally:
            self._context.detach(token)
            try:
                span.end()
            except Exception:
                self.failed()

    @contextmanager
    def request_span(self, request: RequestInfo,
                     status: Callable[[], int | None] | None = None) -> Iterator[Any]:
        """The span of an HTTP request; `status` says the answer's status at its end (a 5xx
        sets the ERROR status, as for an exception: a refusal or failure answered in JSON
        raises nothing here)."""
        span = self.start_span(
            "copilotkit.request", kind=self._trace.SpanKind.SERVER,
            attributes={"http.request.method": request.method,
                        "url.path": request.path[:MAX_ATTRIBUTE],
                        "copilotkit.request_id": request.request_id})
        with self.current_span(span):
            try:
                yield span
            finally:
                try:
                    if request.principal is not None:  # known once it is authenticated
                        span.set_attribute("enduser.id", request.principal.id)
                    answered = status() if status is not None else None
                    if answered is not None:
                        span.set_attribute("http.response.status_code", answered)
                        if answered >= 500:
                            span.set_attribute("error.type", str(answered))
                            span.set_status(self._trace.StatusCode.ERROR)
                except Exception:
                    self.failed()

    def run_started(self, agent_id: str, thread_id: str, run_id: str,
                    principal_id: str | None) -> RunTelemetry:
        attributes: dict[str, Any] = {"copilotkit.agent_id": agent_id,
                                      "copilotkit.thread_id": thread_id,
                                      "copilotkit.run_id": run_id}
        if principal_id is not None:
            attributes["enduser.id"] = principal_id
        return RunTelemetry(self, self.start_span("copilotkit.run", attributes=attributes),
                            agent_id)


def _runtime_codes() -> frozenset[str]:
    """Every code the runtime itself ends a run with: its exceptions', and those registered
    with `events.runtime_code` (a run cut, interrupted, its lease lost)."""
    codes = {"RUN_ERROR", *runtime_codes(), *ApprovalClosedError.CODES}
    kinds: list[type[CopilotRuntimeError]] = [CopilotRuntimeError]
    while kinds:
        kind = kinds.pop()
        codes.add(kind.code)
        kinds.extend(kind.__subclasses__())
    return frozenset(codes)


class ModelCall:
    """One model call's span; `end` records what the adapter's stream end said."""

    __slots__ = ("_attributes", "_run", "_started", "span")

    def __init__(self, run: RunTelemetry, provider: str, model: str | None) -> None:
        self._run = run
        self._started = time.monotonic()
        # A client may choose the model (forwardedProps.model): bound its length and the
        # number of distinct values the metrics keep (each one a time series for ever).
        model = run.telemetry.model_label(model)
        self._attributes = {"gen_ai.system": provider, "gen_ai.operation.name": "chat",
                            "gen_ai.request.model": model or "default"}
        self.span = run.telemetry.start_span(
            f"chat {model or provider}", context=run.context,
            kind=run.telemetry._trace.SpanKind.CLIENT, attributes=self._attributes)

    def end(self, finish_reason: str | None, usage: Mapping[str, Any] | None,
            error: BaseException | None = None) -> None:
        try:
            self._end(finish_reason, usage, error)
        except Exception:
            self._run.telemetry.failed()

    def _end(self, finish_reason: str | None, usage: Mapping[str, Any] | None,
             error: BaseException | None) -> None:
        span = self.span
        telemetry = self._run.telemetry
        try:
            if finish_reason:
                span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
            if usage:
                for key, kind in (("prompt_tokens", "input"), ("completion_tokens", "output")):
                    value = usage.get(key)
                    if isinstance(value, int):
                        span.set_attribute(f"gen_ai.usage.{kind}_tokens", value)
                        telemetry.tokens.record(value, {**self._attributes,
                                                        "gen_ai.token.type": kind})
            # A cancellation (a stop, a client that left) or a closed stream is no failure
            # of the call, as for a tool's span: the run's outcome says what happened.
            if error is not None and not isinstance(error, asyncio.CancelledError
                                                    | GeneratorExit):
                telemetry.record_error(span, error)
            telemetry.operation.record(time.monotonic() - self._started, self._attributes)
        finally:
            span.end()  # whatever failed above: a span left open is never exported


class RunTelemetry:
    """The span of one run, and the parent of its model and tool spans."""

    def __init__(self, telemetry: Telemetry, span: Any, agent_id: str) -> None:
        self.telemetry = telemetry
        self.span = span
        self.agent_id = agent_id
        self.context = telemetry._trace.set_span_in_context(span)
        self._started = time.monotonic()

    def model_call(self, provider: str, model: str | None) -> ModelCall:
        return ModelCall(self, provider, model)

    @contextmanager
    def tool_call(self, name: str) -> Iterator[Any]:
        span = self.telemetry.start_span(
            f"execute_tool {name}", context=self.context,
            attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name})
        with self.telemetry.current_span(span):
            yield span

    def tool_failed(self, span: Any) -> None:
        """The tool of `span` answered with an error (the model reads it; nothing raised)."""
        try:
            span.set_attribute("error.type", "tool_error")
            span.set_status(self.telemetry._trace.StatusCode.ERROR, "tool_error")
        except Exception:
            self.telemetry.failed()

    def agent_failed(self, error: BaseException) -> None:
        """The run's agent raised `error` (its client reads only that it failed): the
        exception on the run's span, its secrets blanked, beside the log's stack."""
        try:
            self.telemetry.record_error(self.span, error)
        except Exception:
            self.telemetry.failed()

    def end(self, outcome: str, error: Mapping[str, Any] | None) -> None:
        try:
            self._end(outcome, error)
        except Exception:
            self.telemetry.failed()

    def _end(self, outcome: str, error: Mapping[str, Any] | None) -> None:
        telemetry = self.telemetry
        try:
            attributes = {"copilotkit.agent_id": self.agent_id, "copilotkit.outcome": outcome}
            self.span.set_attribute("copilotkit.outcome", outcome)
            if error is not None:
                # A remote agent's RUN_ERROR names its code: any text, of any length.
                code = str(error.get("code") or "RUN_ERROR")[:MAX_ATTRIBUTE]
                self.span.set_status(telemetry._trace.StatusCode.ERROR, code)
                self.span.set_attribute("error.type", code)
                telemetry.errors.add(1, {**attributes,
                                         "error.type": telemetry.error_label(code)})
            telemetry.runs.add(1, attributes)
            telemetry.duration.record(time.monotonic() - self._started, attributes)
        finally:
            self.span.end()


# -- logs ------------------------------------------------------------------------------------

# The same names as a URL's secret query options (`_url_options.redacted_url`).
_SECRET_KEYS = re.compile(SECRET_KEYS, re.IGNORECASE)
# The same pattern as for text passed on to clients (`_exceptions.SECRET_VALUES`).
_SECRET_VALUES = re.compile(SECRET_VALUES)
REDACTED = "[REDACTED]"
#: The longest string a log line keeps of one value: its head and tail, the middle cut
#: (a remote agent's unknown event type, a path, an exception's text may be megabytes).
MAX_LOG_TEXT = 16 * 1024


def scrub(text: str) -> str:
    """`text` with secret-looking values (`SECRET_VALUES`) blanked: for logs and span
    attributes."""
    return _SECRET_VALUES.sub(REDACTED, text)


# Blanking takes about a microsecond a character: only what is kept is blanked, with this
# much more beyond each cut, so that a secret a cut runs through is still found whole.
_CUT_MARGIN = 4096


def scrub_head(text: str, limit: int) -> str:
    """The first `limit` characters of `text`, secrets blanked."""
    if len(text) <= limit:
        return scrub(text)
    return scrub(text[:limit + _CUT_MARGIN])[:limit]


def scrub_tail(text: str, limit: int) -> str:
    """The last `limit` characters of `text`, secrets blanked."""
    if len(text) <= limit:
        return scrub(text)
    return scrub(text[-limit - _CUT_MARGIN:])[-limit:]


def _scrub_for_log(text: str) -> str:
    if len(text) <= MAX_LOG_TEXT:
        return scrub(text)
    half = MAX_LOG_TEXT // 2
    return (f"{scrub_head(text, half)}...[{len(text) - 2 * half} characters cut]..."
            f"{scrub_tail(text, half)}")


def _text_of(value: Any) -> str:
    """`value` as the renderers write what JSON has no form for: its `__structlog__`, else
    its repr (an exception's, a config object's: they may name a password or a key)."""
    try:
        shown = getattr(value, "__structlog__", None)
        return str(shown()) if callable(shown) else repr(value)
    except Exception:  # a repr that raises: the log line is written all the same
        return f"<{type(value).__name__} whose repr failed>"


def _log_key(key: Any) -> Any:
    """A mapping's key as JSON may hold it (a str, a number, a bool or None): bytes (raw
    ASGI headers) decoded, any other key by its text."""
    if key is None or isinstance(key, str | int | float | bool):
        return key
    if isinstance(key, bytes):
        return key.decode("latin-1")
    return _text_of(key)


def _redact(value: Any, depth: int = 0) -> Any:
    """`value` with its secrets blanked, as plain JSON data: what a renderer would write by
    its repr is made text here, before it is blanked, not after."""
    if depth > 8:  # deeper than this: not inspected, so not logged either
        return REDACTED
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return _scrub_for_log(value) if len(value) > 10 else value
    if isinstance(value, bytes):
        return _redact(value.decode("latin-1"), depth)
    if isinstance(value, Mapping):
        redacted: dict[Any, Any] = {}
        for key, item in value.items():
            key = _log_key(key)
            if isinstance(key, str):
                if _SECRET_KEYS.search(key):
                    redacted[key] = REDACTED
                    continue
                key = _redact(key, depth + 1)  # a key may be a URL with its password
            redacted[key] = _redact(item, depth + 1)
        return redacted
    if isinstance(value, list | tuple | set | frozenset):
        if isinstance(value, list | tuple) and len(value) == 2:
            name = _log_key(value[0])
            if isinstance(name, str) and _SECRET_KEYS.search(name):
                return [name, REDACTED]  # a (name, value) pair: a header list's item
        return [_redact(v, depth + 1) for v in value]
    return _redact(_text_of(value), depth)


def redact_secrets(logger: Any, method: str, event: MutableMapping[str, Any]
                   ) -> MutableMapping[str, Any]:
    """A structlog processor: values under secret-looking keys (authorization, cookie,
    api_key, token, ...) and bearer tokens, API keys and JWTs inside strings are replaced;
    a value of any other type is redacted in its text (its repr, as the renderers write it),
    and a mapping's bytes or other keys are made text (JSON has only string keys)."""
    for key in list(event):
        if key != "event" and _SECRET_KEYS.search(key):
            event[key] = REDACTED
            continue
        try:
            event[key] = _redact(event[key])
        except Exception:  # a mapping that cannot be read: a log call never raises
            event[key] = f"<{type(event[key]).__name__} that could not be logged>"
    return event


# Control characters but newline and tab (C0, DEL, C1): a terminal acts on them.
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escaped(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


def escape_controls(logger: Any, method: str, event: MutableMapping[str, Any]
                    ) -> MutableMapping[str, Any]:
    """A structlog processor for logs read on a terminal: control characters in every value
    are written as `\\xNN`, so that text from a client, a model or an upstream cannot move
    the cursor, retitle the window or clear the screen. The console renderer writes a string
    as it is unless it holds a space or a quote, and other values by their `repr` (an
    object's own may hold anything): both are escaped here."""
    for key, value in event.items():
        if value is None or isinstance(value, bool | int | float):
            continue
        if not isinstance(value, str):
            text = repr(value)
            if not _CONTROLS.search(text):
                continue  # written as that repr, which holds nothing to escape
            value = text
        elif not _CONTROLS.search(value):
            continue
        event[key] = _CONTROLS.sub(_escaped, value)
    return event


def configure_logging(*, json: bool = True, level: int | None = None) -> None:
    """Structured logs for the runtime: the request id on every line written for a request,
    the run's `agent`, `thread_id` and `run_id` on those written during a run, secrets
    redacted, one JSON object a line (or readable console lines with `json=False`)."""
    import logging

    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        redact_secrets,
        *([structlog.processors.JSONRenderer()] if json else [
            escape_controls, structlog.dev.ConsoleRenderer()]),
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level or logging.INFO),
        cache_logger_on_first_use=False)
