"""Hooks get the right data and never break a stream; spans and metrics are captured with
the OpenTelemetry SDK's in-memory exporters; logs redact secrets."""

from __future__ import annotations

import ast
import asyncio
import importlib
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import copilot_runtime
from copilot_runtime import (
    BearerTokenAuth,
    CopilotRuntime,
    CopilotRuntimeError,
    OpenAIAdapter,
    RequestError,
    RequestRejectedError,  # public: the README's way for a hook to refuse (403)
)
from copilot_runtime.adapters.anthropic import AnthropicAdapter
from copilot_runtime.adapters.base import (
    ChatDelta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    configured_model,
)
from copilot_runtime.adapters.google import GoogleGenAIAdapter
from copilot_runtime.adapters.langchain import LangChainAdapter
from copilot_runtime.auth import RequestInfo
from copilot_runtime.hooks import ErrorInfo, RunFinished
from copilot_runtime.telemetry import Telemetry, configure_logging, redact_secrets
from copilot_runtime.testing import MockOpenAIServer, ScriptedAdapter
from tests.conftest import ServeRuntime, parse_sse, run_input, text_of, types
from tests.realclient_app import getWeather

TOKEN = "tok-alice-0001"


async def wait_for(condition: Any, what: str) -> None:
    for _ in range(300):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_hooks(serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    finished: list[RunFinished] = []
    errors: list[ErrorInfo] = []
    seen: list[RequestInfo] = []

    async def on_request(request: RequestInfo) -> Mapping[str, Any] | None:
        seen.append(request)
        if request.headers.get("x-block"):
            raise RequestRejectedError("Blocked by policy")
        return {"plan": "pro"}

    async def on_run_finished(run: RunFinished) -> None:
        finished.append(run)

    async def on_error(error: ErrorInfo) -> None:
        errors.append(error)

    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0),
        actions=[getWeather], auth=BearerTokenAuth({TOKEN: "alice"}), on_request=on_request,
        on_run_finished=on_run_finished, on_error=on_error)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    async with serve_runtime(runtime) as served:
        response = await served.session.post(
            served.url + "/agent/default/run", headers=headers,
            data=orjson.dumps(run_input('call:getWeather {"city":"Paris"}', thread="h1")))
        events = parse_sse(await response.read())
        assert types(events)[-1] == "RUN_FINISHED"
        await wait_for(lambda: finished, "on_run_finished")
        (run,) = finished
        assert (run.agent_id, run.thread_id, run.run_id, run.outcome) == (
            "default", "h1", "run-1", "finished")
        assert run.principal is not None
        assert run.principal.id == "alice"
        assert run.annotations == {"plan": "pro"}
        assert [m["role"] for m in run.new_messages] == ["user", "assistant", "tool",
                                                         "assistant"]
        assert run.usage["input_tokens"] > 0
        assert run.usage["output_tokens"] > 0
        assert run.duration > 0
        assert seen[0].principal is not None
        assert seen[0].principal.id == "alice"

        response = await served.session.post(
            served.url + "/agent/default/run", headers=headers,
            data=orjson.dumps(run_input("error:500", thread="h2")))
        assert parse_sse(await response.read())[-1]["type"] == "RUN_ERROR"
        await wait_for(lambda: errors and len(finished) == 2, "on_error")
        assert (errors[0].thread_id, errors[0].code) == ("h2", "UPSTREAM_ERROR")
        assert errors[0].request_id == seen[-1].request_id
        assert finished[-1].outcome == "error"

        response = await served.session.get(served.url + "/threads",
                                            headers={**headers, "X-Block": "1"})
        assert response.status == 403
        assert (await response.json())["message"] == "Blocked by policy"


async def test_failing_hooks_are_logged_and_never_break_a_stream(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """The hooks after a run: what they raise is logged. (A failing `on_request` refuses
    its request: tests/test_hostile_trust.py.)"""
    async def broken(_: Any) -> Any:
        raise RuntimeError("hook bug")

    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0),
        on_run_finished=broken, on_error=broken)
    async with serve_runtime(runtime) as served:
        with structlog.testing.capture_logs() as logs:
            assert text_of(await served.run(run_input("Hi"))) == "echo: Hi"
            events = await served.run(run_input("error:500", thread="t2"))
            assert events[-1]["type"] == "RUN_ERROR"
            await wait_for(lambda: sum("hook failed" in e["event"] for e in logs) >= 3,
                           "the hook failures in the log")
        assert {e["event"] for e in logs if "hook" in e["event"]} == {
            "on_run_finished hook failed", "on_error hook failed"}
    assert issubclass(RequestRejectedError, RequestError)


async def test_plain_function_hooks_work_as_async_ones_do(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """Hooks written as plain functions: before, `on_request`'s annotations were dropped (its
    dict was awaited, which failed and was logged), and a plain `on_run_finished` ran and was
    then reported as failed; a plain hook that raises is logged, as an async one is."""
    finished: list[RunFinished] = []

    def on_request(request: RequestInfo) -> Mapping[str, Any]:
        return {"team": "blue"}

    def on_run_finished(run: RunFinished) -> None:
        finished.append(run)

    def on_error(error: Any) -> None:
        raise RuntimeError("hook bug")

    seen: list[Any] = []
    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0),
        on_request=on_request, on_run_finished=on_run_finished, on_error=on_error)
    original = runtime.hooks.request

    async def spy(info: RequestInfo) -> None:
        await original(info)
        seen.append(dict(info.annotations))

    runtime.hooks.request = spy  # type: ignore[method-assign]
    async with serve_runtime(runtime) as served:
        with structlog.testing.capture_logs() as logs:
            assert text_of(await served.run(run_input("Hi"))) == "echo: Hi"
            await wait_for(lambda: finished, "on_run_finished")
            events = await served.run(run_input("error:500", thread="t2"))
            assert events[-1]["type"] == "RUN_ERROR"
            await wait_for(lambda: any(e["event"] == "on_error hook failed" for e in logs),
                           "the plain on_error's failure in the log")
        assert {e["event"] for e in logs if "hook" in e["event"]} == {"on_error hook failed"}
    assert seen
    assert all(annotations == {"team": "blue"} for annotations in seen)
    assert finished[0].outcome == "finished"


def in_memory_telemetry() -> tuple[InMemorySpanExporter, InMemoryMetricReader,
                                   TracerProvider, MeterProvider]:
    """Spans and metrics kept in memory: their exporter, reader and providers."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    return exporter, reader, tracer_provider, MeterProvider(metric_readers=[reader])


async def test_spans_and_metrics(serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    exporter, reader, tracer_provider, meter_provider = in_memory_telemetry()
    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0),
        actions=[getWeather], auth=BearerTokenAuth({TOKEN: "alice"}),
        telemetry=Telemetry(tracer_provider, meter_provider))
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    try:
        async with serve_runtime(runtime) as served:
            response = await served.session.post(
                served.url + "/agent/default/run", headers=headers,
                data=orjson.dumps(run_input('call:getWeather {"city":"Paris"}', thread="s1")))
            assert types(parse_sse(await response.read()))[-1] == "RUN_FINISHED"
            response = await served.session.post(
                served.url + "/agent/default/run", headers=headers,
                data=orjson.dumps(run_input("error:500", thread="s2", run="run-2")))
            await response.read()
            await wait_for(lambda: sum(s.name == "copilotkit.request"
                                       for s in exporter.get_finished_spans()) >= 2,
                           "the request spans")
        spans = exporter.get_finished_spans()
        by_name: dict[str, list[Any]] = {}
        for span in spans:
            by_name.setdefault(span.name, []).append(span)
        request_span = by_name["copilotkit.request"][0]
        assert request_span.kind == SpanKind.SERVER
        assert request_span.attributes["enduser.id"] == "alice"
        ok_run, failed_run = sorted(by_name["copilotkit.run"],
                                    key=lambda s: s.attributes["copilotkit.run_id"])
        assert ok_run.parent.span_id == request_span.context.span_id
        assert ok_run.attributes["copilotkit.thread_id"] == "s1"
        assert ok_run.attributes["copilotkit.outcome"] == "finished"
        assert ok_run.attributes["enduser.id"] == "alice"
        chats = [s for s in spans if s.name.startswith("chat ")
                 and s.parent.span_id == ok_run.context.span_id]
        assert len(chats) == 2  # the tool call, then the answer
        first = chats[0].attributes
        assert first["gen_ai.system"] == "openai"
        assert first["gen_ai.usage.input_tokens"] > 0
        assert first["gen_ai.usage.output_tokens"] > 0
        assert tuple(first["gen_ai.response.finish_reasons"]) == ("tool_calls",)
        (tool,) = by_name["execute_tool getWeather"]
        assert tool.parent.span_id == ok_run.context.span_id
        assert failed_run.status.status_code == StatusCode.ERROR
        assert failed_run.attributes["error.type"] == "UPSTREAM_ERROR"
        failed_chat = next(s for s in spans if s.name.startswith("chat ")
                           and s.parent.span_id == failed_run.context.span_id)
        assert failed_chat.status.status_code == StatusCode.ERROR
        assert failed_chat.events[0].name == "exception"

        metrics = {m.name: m for rm in reader.get_metrics_data().resource_metrics
                   for sm in rm.scope_metrics for m in sm.metrics}
        runs = {p.attributes["copilotkit.outcome"]: p.value
                for p in metrics["copilotkit.runs"].data.data_points}
        assert runs == {"finished": 1, "error": 1}
        (error_point,) = metrics["copilotkit.run.errors"].data.data_points
        assert error_point.attributes["error.type"] == "UPSTREAM_ERROR"
        tokens = {p.attributes["gen_ai.token.type"]: p.sum
                  for p in metrics["gen_ai.client.token.usage"].data.data_points}
        assert tokens["input"] > 0
        assert tokens["output"] > 0
        assert sum(p.count for p in metrics["copilotkit.run.duration"].data.data_points) == 2
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()


#: What a provider billed for an answer that ended the run with an error.
BILLED = {"prompt_tokens": 1200, "completion_tokens": 4096}
_CUT_CALL: list[ChatDelta] = [ToolCallDelta(0, "call_1", "setColor", '{"c": "re')]
#: Answers whose end fails the run (reason, its deltas): a call cut by each abnormal end,
#: nothing said at the token limit, a paused turn.
FAILED_ENDINGS: list[tuple[str, list[ChatDelta]]] = [
    *((reason, [*_CUT_CALL, StreamEnd(reason, BILLED)]) for reason in (
        "length", "content_filter", "refusal", "model_context_window_exceeded", "error")),
    ("length", [StreamEnd("length", BILLED)]),
    ("pause_turn", [TextDelta("Searching"), StreamEnd("pause_turn", BILLED)]),
]


async def test_tokens_of_an_answer_that_fails_the_run_are_recorded(
        serve_runtime: ServeRuntime) -> None:
    """Before: a call cut at the output limit (or by any other abnormal end) raised inside
    the adapter's stream loop, so its chat span had no usage and no finish reason, the token
    metric no points and `on_run_finished` usage {}: billed tokens appeared nowhere. Now
    every answer that fails the run records them, as a finished one does."""
    exporter, reader, tracer_provider, meter_provider = in_memory_telemetry()
    finished: list[RunFinished] = []
    runtime = CopilotRuntime(
        service_adapter=ScriptedAdapter(*([deltas] for _, deltas in FAILED_ENDINGS)),
        telemetry=Telemetry(tracer_provider, meter_provider),
        on_run_finished=finished.append)
    tools = [{"name": "setColor", "description": "Sets the colour.",
              "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}]
    try:
        async with serve_runtime(runtime) as served:
            for n in range(len(FAILED_ENDINGS)):
                events = await served.run(run_input("paint it", run=f"r{n}", tools=tools))
                assert types(events)[-1] == "RUN_ERROR", (n, events)
            await wait_for(lambda: len(finished) == len(FAILED_ENDINGS), "on_run_finished")
        assert [run.usage for run in finished] == [
            {"input_tokens": 1200, "output_tokens": 4096}] * len(FAILED_ENDINGS)
        spans = exporter.get_finished_spans()
        run_ids = {s.context.span_id: s.attributes["copilotkit.run_id"]
                   for s in spans if s.name == "copilotkit.run"}
        chats = {run_ids[s.parent.span_id]: s.attributes for s in spans
                 if s.name.startswith("chat ")}
        for n, (reason, _) in enumerate(FAILED_ENDINGS):
            chat = chats[f"r{n}"]
            assert (chat.get("gen_ai.usage.input_tokens"),
                    chat.get("gen_ai.usage.output_tokens")) == (1200, 4096), (n, chat)
            assert tuple(chat.get("gen_ai.response.finish_reasons", ())) == (reason,), n
        metrics = {m.name: m for rm in reader.get_metrics_data().resource_metrics
                   for sm in rm.scope_metrics for m in sm.metrics}
        tokens = {p.attributes["gen_ai.token.type"]: p.sum
                  for p in metrics["gen_ai.client.token.usage"].data.data_points}
        assert tokens == {"input": 1200 * len(FAILED_ENDINGS),
                          "output": 4096 * len(FAILED_ENDINGS)}
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()


async def test_spans_and_metrics_name_the_model_requested(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """Before: `OpenAIAdapter(model="gpt-4o-mini")` gave `gen_ai.request.model` "default" on
    the span and the metrics (only a client's forwardedProps.model was named). Now the model
    the call asked for: the client's choice, else the adapter's."""
    exporter, reader, tracer_provider, meter_provider = in_memory_telemetry()
    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock",
                                      max_retries=0, model="gpt-4o-mini"),
        telemetry=Telemetry(tracer_provider, meter_provider))
    try:
        async with serve_runtime(runtime) as served:
            await served.run(run_input("Hi", run="r-configured"))
            await served.run(run_input("Hi", run="r-chosen",
                                       forwardedProps={"model": "gpt-4.1"}))
        spans = exporter.get_finished_spans()
        run_ids = {s.context.span_id: s.attributes["copilotkit.run_id"]
                   for s in spans if s.name == "copilotkit.run"}
        chats = {run_ids[s.parent.span_id]: s for s in spans if s.name.startswith("chat ")}
        assert {run: (span.name, span.attributes["gen_ai.request.model"])
                for run, span in chats.items()} == {
            "r-configured": ("chat gpt-4o-mini", "gpt-4o-mini"),
            "r-chosen": ("chat gpt-4.1", "gpt-4.1")}
        metrics = {m.name: m for rm in reader.get_metrics_data().resource_metrics
                   for sm in rm.scope_metrics for m in sm.metrics}
        for name in ("gen_ai.client.token.usage", "gen_ai.client.operation.duration"):
            assert {p.attributes["gen_ai.request.model"]
                    for p in metrics[name].data.data_points} == {"gpt-4o-mini", "gpt-4.1"}
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()


def test_every_adapter_names_its_configured_model() -> None:
    """The model each adapter asks for when the client names none, as telemetry reads it: a
    LangChain model's `model_name` (ChatOpenAI) or `model` (most others)."""
    from langchain_core.language_models import FakeListChatModel
    from langchain_openai import ChatOpenAI

    class Named(FakeListChatModel):
        model: str = "llama3.2"

    adapters = {
        "gpt-4o-mini": OpenAIAdapter(api_key="sk-x", model="gpt-4o-mini"),
        "claude-x": AnthropicAdapter(api_key="sk-x", model="claude-x"),
        "gemini-x": GoogleGenAIAdapter(api_key="k", model="gemini-x"),
        "gpt-4.1": LangChainAdapter(ChatOpenAI(model="gpt-4.1", api_key="sk-x")),  # type: ignore[arg-type]
        "llama3.2": LangChainAdapter(Named(responses=["hi"])),
        None: LangChainAdapter(FakeListChatModel(responses=["hi"])),
    }
    for model, adapter in adapters.items():
        assert configured_model(adapter) == model
    assert configured_model(ScriptedAdapter()) is None


def test_the_errors_metric_labels_only_the_runtimes_own_codes() -> None:
    """A remote agent's RUN_ERROR codes were each a label: 20 runs with a new code each made
    20 series of `copilotkit.run.errors`, for the life of the process. Now they are one
    "_OTHER" series; the runtime's codes keep theirs, and each span its own code."""
    exporter, reader, tracer_provider, meter_provider = in_memory_telemetry()
    telemetry = Telemetry(tracer_provider, meter_provider)
    try:
        codes = [f"E-{i}" for i in range(20)] + [
            "UPSTREAM_ERROR", "CONTENT_FILTERED", "RUN_INTERRUPTED", "APPROVAL_EXPIRED"]
        for i, code in enumerate(codes):
            telemetry.run_started("remote", "t", f"r{i}", None).end("error", {"code": code})
        metrics = {m.name: m for rm in reader.get_metrics_data().resource_metrics
                   for sm in rm.scope_metrics for m in sm.metrics}
        labels = {p.attributes["error.type"]: p.value
                  for p in metrics["copilotkit.run.errors"].data.data_points}
        assert labels == {"_OTHER": 20, "UPSTREAM_ERROR": 1, "CONTENT_FILTERED": 1,
                          "RUN_INTERRUPTED": 1, "APPROVAL_EXPIRED": 1}
        assert sorted(span.attributes["error.type"] for span in exporter.get_finished_spans()
                      ) == sorted(codes)
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()


def _codes_the_package_ends_runs_with() -> set[str]:
    """The `code=` of every `run_error(...)` call in the package, resolved in its module
    (an exception's own `exc.code` aside: the exceptions' codes are checked as a class walk)."""
    package = Path(copilot_runtime.__file__).parent
    codes: set[str] = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        module_name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(
                    node.func, "attr", getattr(node.func, "id", None)) == "run_error"):
                continue
            for keyword in node.keywords:
                if keyword.arg != "code" or (isinstance(keyword.value, ast.Attribute)
                                             and keyword.value.attr == "code"):
                    continue
                namespace = vars(importlib.import_module(module_name))
                codes.add(eval(ast.unparse(keyword.value), dict(namespace)))
    return codes


def test_every_code_the_runtime_ends_a_run_with_has_its_own_errors_label() -> None:
    """A run cut at `max_run_seconds` ends with RUN_TIMEOUT, which the errors metric counted
    as "_OTHER" (the set of the runtime's codes was a list written by hand, and that code
    was missing from it). Now each module registers the codes it ends runs with, and every
    `run_error(code=...)` in the package (a new one too) is checked to keep its label."""
    codes = _codes_the_package_ends_runs_with()
    assert {"RUN_TIMEOUT", "RUN_INTERRUPTED", "LEASE_LOST", "AGENT_ERROR"} <= codes
    kinds: list[type[CopilotRuntimeError]] = [CopilotRuntimeError]
    while kinds:
        kind = kinds.pop()
        codes.add(kind.code)
        kinds.extend(kind.__subclasses__())
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    telemetry = Telemetry(TracerProvider(), meter_provider)
    try:
        assert {code: telemetry.error_label(code) for code in codes} == {
            code: code for code in codes}
        telemetry.run_started("a", "t", "r", None).end("error", {"code": "RUN_TIMEOUT"})
        metrics = {m.name: m for rm in reader.get_metrics_data().resource_metrics
                   for sm in rm.scope_metrics for m in sm.metrics}
        (point,) = metrics["copilotkit.run.errors"].data.data_points
        assert point.attributes["error.type"] == "RUN_TIMEOUT"
    finally:
        meter_provider.shutdown()


def test_secrets_are_redacted() -> None:
    event = redact_secrets(None, "info", {
        "event": "calling Bearer abc.def.ghi", "authorization": "Bearer s3cr3t-token",
        "headers": {"Cookie": "session=1", "x-api-key": "k", "accept": "json"},
        "detail": "key sk-abcdefghijklmnop and eyJhbGciOi.eyJzdWIiOiJh.sig in text",
        "count": 3})
    assert event["authorization"] == "[REDACTED]"
    assert event["headers"] == {"Cookie": "[REDACTED]", "x-api-key": "[REDACTED]",
                                "accept": "json"}
    assert "sk-abc" not in event["detail"]
    assert "eyJ" not in event["detail"]
    assert event["event"] == "calling [REDACTED]"
    assert event["count"] == 3


def test_log_redaction_knows_token_keys_token_schemes_and_cookie_headers() -> None:
    """These were logged whole: `*_token` keys (the look-behind spared any `x_token`),
    `Authorization: Token …` (a scheme other than bearer/basic), a header dict's repr, a
    (name, value) header pair, and a `Cookie:` header whose first pair is short."""
    secret = "c0ffee0123456789abcdef"
    event = redact_secrets(None, "info", {
        "event": "x", "access_token": secret, "refresh_token": secret, "client_token": secret,
        "headers": {"access_token": secret}, "pairs": [("authorization", f"Token {secret}")],
        "said": f"sent headers Authorization: Token {secret}",
        "repr": f"{{'authorization': 'Token {secret}'}}",
        "cookie_line": f"Cookie: a=1; sessionid={secret}",
        "input_tokens": 12, "max_token": 100, "token_count": 7})
    assert secret not in orjson.dumps(event).decode()
    assert (event["input_tokens"], event["max_token"], event["token_count"]) == (12, 100, 7)
    assert event["said"] == "sent headers [REDACTED]"


def test_log_redaction_knows_private_key_pwd_access_key_and_auth_keys() -> None:
    """`private_key`, `pwd`, `access_key` and `auth` were logged in clear (no name of
    `SECRET_KEYS` matched them). Now they are redacted, and names that only hold such a
    word (`author`, `auth_method`, `oauth_provider`) keep their values."""
    secret = "c0ffee0123456789abcdef"
    event = redact_secrets(None, "info", {
        "event": "x", "private_key": secret, "pwd": secret, "access_key": secret,
        "auth": secret, "proxy-auth": secret, "settings": {"privateKey": secret},
        "author": "alice", "auth_method": "bearer", "oauth_provider": "github"})
    assert secret not in orjson.dumps(event).decode()
    assert (event["author"], event["auth_method"], event["oauth_provider"]) == (
        "alice", "bearer", "github")


def test_log_redaction_keeps_paths_ids_and_dirs_named_after_keys() -> None:
    """Before: `pwd` and `private_key`/`access_key` anywhere in a name redacted a key file's
    path, an access key's id and a directory (`private_key_path`, `access_key_id`,
    `pwd_dir`). Now those keep their values, while the names that hold the secret itself
    (`db_pwd`, `aws_access_key`, `privateKey`, `private_key_passphrase`, `pwd_value`, a
    review found these logged in clear for a while) stay redacted."""
    secret = "c0ffee0123456789abcdef"
    kept = {"private_key_path": "/keys/k.pem", "access_key_id": "AKIAEXAMPLE",
            "pwd_dir": "/srv/app", "private-key-file": "k.pem", "pwdfile": "p.txt"}
    event = redact_secrets(None, "info", {
        "event": "x", **kept, "db_pwd": secret, "aws_access_key": secret,
        "privateKey": secret, "access_keys": [secret], "private_key_passphrase": secret,
        "private_key_content": secret, "privateKeyBase64": secret, "pwd_value": secret,
        "access_key_value": secret})
    assert secret not in orjson.dumps(event).decode()
    assert {key: event[key] for key in kept} == kept


@pytest.mark.parametrize("as_json", [True])
def test_configure_logging_writes_json(as_json: bool) -> None:
    out = io.StringIO()
    try:
        configure_logging(json=as_json)
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(out))
        structlog.get_logger("t").info("hello", authorization="Bearer x", run_id="r1")
        line = json.loads(out.getvalue())
        assert line["event"] == "hello"
        assert line["authorization"] == "[REDACTED]"
        assert line["run_id"] == "r1"
    finally:
        structlog.reset_defaults()


async def test_hooks_raising_cancelled_error_are_logged_and_never_break_a_stream(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """A hook that raises `CancelledError` of its own (it read the result of a cancelled
    future): it escaped the hook runner, and a plain one's ended the stream after
    RUN_STARTED (GraphQL's body without its closing boundary, a SQLite store's run 10 s
    late). Now it is logged as any failing hook is."""
    def cancelled_future() -> Any:
        future = asyncio.get_running_loop().create_future()
        future.cancel()
        return future.result()

    def plain(_: Any) -> None:
        cancelled_future()

    async def async_one(_: Any) -> None:
        cancelled_future()

    for on_run_finished, on_error in ((plain, plain), (async_one, async_one)):
        runtime = CopilotRuntime(
            service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock",
                                          max_retries=0),
            on_run_finished=on_run_finished, on_error=on_error)
        async with serve_runtime(runtime) as served:
            with structlog.testing.capture_logs() as logs:
                for thread in ("t1", "t1", "t3"):  # the thread is given back each time
                    assert text_of(await served.run(run_input("Hi", thread=thread))) == "echo: Hi"
                events = await served.run(run_input("error:500", thread="t2"))
                assert events[-1]["type"] == "RUN_ERROR"
                await wait_for(lambda: sum("hook failed" in e["event"] for e in logs) >= 5,
                               "the hook failures in the log")
            assert {e["event"] for e in logs if "hook" in e["event"]} == {
                "on_run_finished hook failed", "on_error hook failed"}
