"""The AG-UI protocol over real HTTP: routes, event sequences, errors, stop and connect."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from copilot_runtime import Agent, CopilotRuntime, RunContext, RunInput
from copilot_runtime.events import EventBatches, text_message_content, text_message_start
from copilot_runtime.testing import MockOpenAIServer, verify_events
from tests.conftest import (
    GatedAgent,
    Served,
    ServeRuntime,
    openai_runtime,
    parse_sse,
    run_input,
    text_of,
    types,
)

pytestmark = pytest.mark.asyncio


async def test_info_rest_and_single_route(served: Served) -> None:
    response = await served.session.get(served.url + "/info")
    assert response.status == 200
    info = await response.json()
    assert info["version"] == "1.75.0"
    assert info["agents"]["default"] == {
        "name": "default", "description": "", "className": "BuiltInAgent",
        "capabilities": {"tools": {"supported": True, "clientProvided": True},
                         "transport": {"streaming": True}}}
    assert info["audioFileTranscriptionEnabled"] is False
    assert info["threadEndpoints"]["list"] is True

    single = await (await served.post("", {"method": "info"})).json()
    assert single["agents"] == info["agents"]
    assert single["threadEndpoints"] == dict.fromkeys(info["threadEndpoints"], False)
    assert single["singleRoute"]["threadEndpoints"] == info["threadEndpoints"]


async def test_chat_streams_text_in_order(served: Served, llm: MockOpenAIServer) -> None:
    events = await served.run(run_input("Hello, CopilotKit!"))
    verify_events(events)
    assert types(events) == ["RUN_STARTED", "TEXT_MESSAGE_START", *["TEXT_MESSAGE_CONTENT"] * 5,
                             "TEXT_MESSAGE_END", "RUN_FINISHED"]
    assert text_of(events) == "echo: Hello, CopilotKit!"
    started = events[0]
    assert started["threadId"] == "thread-1"
    assert started["runId"] == "run-1"
    assert list(started["input"]) == ["threadId", "runId", "state", "messages", "tools",
                                      "context", "forwardedProps"]
    assert events[-1] == {"type": "RUN_FINISHED", "threadId": "thread-1", "runId": "run-1"}
    sent = llm.requests[-1]
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == [{"role": "user", "content": "Hello, CopilotKit!"}]


async def test_sse_headers(served: Served) -> None:
    response = await served.post("/agent/default/run", run_input("hi"))
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["access-control-allow-origin"] == "*"
    body = await response.read()
    assert b"event:" not in body
    assert b"null" not in body
    assert "connection" not in response.headers  # (HTTP/1.1 keeps it)


async def test_a_stream_that_closes_its_connection_says_so_once(served: Served) -> None:
    """A client that asked to close its connection got `connection: keep-alive` (the
    stream's own header) and `connection: close` (the server's)."""
    response = await served.post("/agent/default/run", run_input("hi", thread="closing"),
                                 headers={"Connection": "close"})
    await response.read()
    assert response.headers.getall("connection") == ["close"]


async def test_second_turn_echoes_only_new_messages(served: Served) -> None:
    first = await served.run(run_input("one", thread="t2", run="r1"))
    assistant = next(e for e in first if e["type"] == "TEXT_MESSAGE_START")["messageId"]
    history = [{"id": "r1-u", "role": "user", "content": "one"},
               {"id": assistant, "role": "assistant", "content": text_of(first)},
               {"id": "r2-u", "role": "user", "content": "two"}]
    second = await served.run({**run_input("two", thread="t2", run="r2"), "messages": history})
    assert [m["id"] for m in second[0]["input"]["messages"]] == ["r2-u"]
    assert text_of(second) == "echo: two"


async def test_server_action_then_model_answers(served: Served, llm: MockOpenAIServer) -> None:
    events = await served.run(run_input('call:getWeather {"city":"Paris"}'))
    verify_events(events)
    assert types(events)[:2] == ["RUN_STARTED", "TOOL_CALL_START"]
    start = events[1]
    assert start["toolCallName"] == "getWeather"
    assert "parentMessageId" in start
    result = next(e for e in events if e["type"] == "TOOL_CALL_RESULT")
    assert result["toolCallId"] == start["toolCallId"]
    assert result["role"] == "tool"
    assert orjson.loads(result["content"]) == {
        "city": "Paris", "temperature": 21, "unit": "celsius", "conditions": "sunny"}
    # Unlike the TypeScript runtime, the model is called again and answers.
    assert text_of(events) == "echo: " + result["content"]
    assert types(events)[-3:] == ["TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END", "RUN_FINISHED"]
    follow_up = llm.requests[-1]["messages"]
    assert follow_up[-2]["tool_calls"][0]["function"] == {
        "name": "getWeather", "arguments": '{"city":"Paris"}'}
    assert follow_up[-1] == {"role": "tool", "tool_call_id": start["toolCallId"],
                             "content": result["content"]}


async def test_bad_action_arguments_reach_the_model_as_a_tool_error(served: Served) -> None:
    events = await served.run(run_input('call:getWeather {"town":"Paris"}'))
    verify_events(events)
    result = next(e for e in events if e["type"] == "TOOL_CALL_RESULT")
    error = orjson.loads(result["content"])
    assert "city" in error["error"]
    assert "town" in error["error"]
    assert result["error"] == error["error"]  # the failure is a field, not a guess
    assert events[-1]["type"] == "RUN_FINISHED"
    stored = await (await served.session.get(served.url + "/threads/thread-1/messages")).json()
    (tool,) = [m for m in stored["messages"] if m["role"] == "tool"]
    assert tool["error"] == error["error"]


async def test_frontend_tool_ends_the_run(served: Served, llm: MockOpenAIServer) -> None:
    tool = {"name": "sayHello", "description": "Say hello",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                           "required": ["name"]}}
    events = await served.run(run_input('call:sayHello {"name":"Ada"}', tools=[tool]))
    verify_events(events)
    assert types(events) == ["RUN_STARTED", "TOOL_CALL_START", *["TOOL_CALL_ARGS"] * 5,
                             "TOOL_CALL_END", "RUN_FINISHED"]
    declared = [t["function"]["name"] for t in llm.requests[-1]["tools"]]
    assert declared == ["getWeather", "sayHello"]
    assert len(llm.requests) == 1  # the client runs the tool, not us


async def test_two_server_calls_in_one_answer(served: Served) -> None:
    events = await served.run(run_input(
        'call:getWeather {"city":"Paris"}\ncall:getWeather {"city":"Oslo"}'))
    verify_events(events)
    results = [orjson.loads(e["content"])["city"] for e in events
               if e["type"] == "TOOL_CALL_RESULT"]
    assert results == ["Paris", "Oslo"]
    assert types(events).count("TOOL_CALL_START") == 2


async def test_context_and_forwarded_model_settings(served: Served,
                                                    llm: MockOpenAIServer) -> None:
    body = run_input("hi", context=[{"description": "user name", "value": "Ada"}],
                     forwardedProps={"model": "gpt-4o-mini", "temperature": 0.2,
                                     "maxTokens": 50, "stop": "END", "toolChoice": "none"})
    await served.run(body)
    sent = llm.requests[-1]
    assert sent["messages"][0]["role"] == "system"
    assert "- user name: Ada" in sent["messages"][0]["content"]
    assert (sent["model"], sent["temperature"], sent["max_tokens"], sent["stop"],
            sent["tool_choice"]) == ("gpt-4o-mini", 0.2, 50, ["END"], "none")


@pytest.mark.parametrize("choice", [
    "getWeather", {"type": "function", "function": {"name": "getWeather"}}])
async def test_tool_choice_names_a_tool_as_text_or_as_openai_object(
        served: Served, llm: MockOpenAIServer, choice: Any) -> None:
    events = await served.run(run_input("hi", forwardedProps={"toolChoice": choice}))
    verify_events(events)
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert llm.requests[0]["tool_choice"] == {"type": "function",
                                              "function": {"name": "getWeather"}}


@pytest.mark.parametrize("choice", [
    "required", "getWeather", {"type": "function", "function": {"name": "getWeather"}}])
async def test_a_forced_tool_is_forced_on_the_first_step_only(
        served: Served, llm: MockOpenAIServer, choice: Any) -> None:
    # Forced again after its result, an obedient model would call the action on every step.
    events = await served.run(run_input('call:getWeather {"city":"Paris"}',
                                        forwardedProps={"toolChoice": choice}))
    verify_events(events)
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert types(events).count("TOOL_CALL_RESULT") == 1
    assert [r["tool_choice"] for r in llm.requests][1:] == ["auto"]
    assert llm.requests[0]["tool_choice"] in (
        "required", {"type": "function", "function": {"name": "getWeather"}})


@pytest.mark.parametrize(("choice", "problem"), [
    ({"type": "function", "function": {"name": "nowhere"}}, "'nowhere', which is not one"),
    ("nowhere", "'nowhere', which is not one"),
    ({"type": "function", "function": {"name": ""}}, '"auto", "none", "required"'),
    ({"type": "function"}, '"auto", "none", "required"'),
    ({"type": "tool", "name": "getWeather"}, '"auto", "none", "required"'),
    (["getWeather"], '"auto", "none", "required"'),
])
async def test_tool_choice_of_no_tool_or_of_another_form_is_a_run_error(
        served: Served, llm: MockOpenAIServer, choice: Any, problem: str) -> None:
    events = await served.run(run_input("hi", forwardedProps={"toolChoice": choice}))
    verify_events(events)
    assert (events[-1]["type"], events[-1]["code"]) == ("RUN_ERROR", "INVALID_REQUEST")
    assert problem in events[-1]["message"]
    assert llm.requests == []


async def test_bad_forwarded_setting_is_a_run_error(served: Served) -> None:
    events = await served.run(run_input("hi", forwardedProps={"temperature": "hot"}))
    verify_events(events)
    assert events[-1]["type"] == "RUN_ERROR"
    assert "temperature" in events[-1]["message"]


async def test_history_with_all_roles_reaches_the_model(served: Served,
                                                         llm: MockOpenAIServer) -> None:
    messages = [
        {"id": "s", "role": "system", "content": "be brief"},
        {"id": "d", "role": "developer", "content": "dev note"},
        {"id": "u1", "role": "user", "content": "weather?"},
        {"id": "a1", "role": "assistant", "toolCalls": [
            {"id": "c1", "type": "function",
             "function": {"name": "getWeather", "arguments": '{"city":"Rome"}'}}]},
        {"id": "t1", "role": "tool", "toolCallId": "c1", "content": '{"t":1}'},
        {"id": "u2", "role": "user", "content": [{"type": "text", "text": "and now?"}]},
    ]
    await served.run({**run_input("x"), "messages": messages})
    assert llm.requests[-1]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": "dev note"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "getWeather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"t":1}'},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
    ]


async def test_inputs_of_both_client_generations(served: Served, llm: MockOpenAIServer) -> None:
    # @ag-ui/client 1.0 may omit tools and context.
    minimal = {"threadId": "t-min", "runId": "r", "messages": [
        {"id": "u", "role": "user", "content": "minimal"}]}
    assert text_of(await served.run(minimal)) == "echo: minimal"
    # @ag-ui/client 0.0.x sends pre-1.0 binary parts.
    legacy = run_input("x", thread="t-legacy")
    legacy["messages"][0]["content"] = [
        {"type": "text", "text": "look"},
        {"type": "binary", "mimeType": "image/png", "data": "iVBORw0KGgo="}]
    events = await served.run(legacy)
    assert events[-1]["type"] == "RUN_FINISHED"
    assert llm.requests[-1]["messages"][-1]["content"][1] == {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


async def test_step_limit_forces_an_answer(llm: MockOpenAIServer,
                                           serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm, max_steps=1)) as served:
        events = await served.run(run_input('call:getWeather {"city":"Paris"}'))
    verify_events(events)
    assert llm.requests[-1]["tool_choice"] == "none"
    assert "TOOL_CALL_START" not in types(events)
    assert text_of(events).startswith("echo: call:getWeather")


# -- errors -------------------------------------------------------------------------------

async def test_llm_http_error_becomes_run_error(served: Served) -> None:
    events = await served.run(run_input("error:500"))
    verify_events(events)
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"]
    error = events[-1]
    assert error["message"] == "OpenAI request failed with HTTP 500: mock error 500"
    assert error["code"] == "UPSTREAM_ERROR"


async def test_llm_stream_cut_after_text_closes_the_message(served: Served) -> None:
    events = await served.run(run_input("breaks:2 some text"))
    verify_events(events)
    assert types(events)[-2:] == ["TEXT_MESSAGE_END", "RUN_ERROR"]
    assert text_of(events)  # the text that arrived is kept
    assert ".py" not in events[-1]["message"]
    assert "Traceback" not in events[-1]["message"]
    # and the server keeps serving
    assert text_of(await served.run(run_input("still there?", thread="t-after"))) == \
        "echo: still there?"


async def test_unreachable_llm(serve_runtime: ServeRuntime) -> None:
    from copilot_runtime import OpenAIAdapter

    runtime = CopilotRuntime(service_adapter=OpenAIAdapter(
        base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0))
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hi"))
    assert events[-1]["type"] == "RUN_ERROR"
    assert events[-1]["message"].startswith("Could not reach the OpenAI API")


class _CrashingAgent(Agent):
    async def run(self, input: RunInput, context: RunContext) -> EventBatches:  # type: ignore[override]
        yield [text_message_start("m1"), text_message_content("m1", "partial")]
        raise RuntimeError("secret detail in /srv/app/agent.py")


async def test_agent_crash_is_a_clean_run_error(serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(CopilotRuntime(agents={"crash": _CrashingAgent()})) as served:
        events = await served.run(run_input("x"), agent="crash")
        verify_events(events)
        assert types(events) == ["RUN_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT",
                                 "TEXT_MESSAGE_END", "RUN_ERROR"]
        assert events[-1] == {"type": "RUN_ERROR", "code": "AGENT_ERROR",
                              "message": "Agent 'crash' failed unexpectedly"}
        again = await served.run(run_input("x", thread="other"), agent="crash")
        assert again[-1]["type"] == "RUN_ERROR"


async def test_unknown_agent(served: Served) -> None:
    for path in ("/agent/nope/run", "/agent/nope/connect", "/agent/nope/stop/t"):
        response = await served.post(path, run_input("x"))
        assert response.status == 404
        assert await response.json() == {"error": "Agent not found",
                                         "message": "Agent 'nope' does not exist"}


@pytest.mark.parametrize(("raw", "detail"), [
    (b"{not json", "Malformed JSON"),
    (b"", "Request body is empty"),
    (b"[1,2]", "The body must be a JSON object"),
])
async def test_malformed_body(served: Served, raw: bytes, detail: str) -> None:
    response = await served.post("/agent/default/run", raw=raw)
    assert response.status == 400
    body = await response.json()
    assert body["error"] == "Invalid request body"
    assert body["details"].startswith(detail)


async def test_invalid_fields_are_detailed(served: Served) -> None:
    bad = run_input("x")
    bad["messages"][0]["role"] = "wizard"
    del bad["runId"]
    response = await served.post("/agent/default/run", bad)
    assert response.status == 400
    details = orjson.loads((await response.json())["details"])
    paths = [d["path"] for d in details]
    assert ["runId"] in paths
    assert any(p[:2] == ["messages", 0] for p in paths)
    assert all("input" not in d for d in details)


async def test_wrong_types(served: Served) -> None:
    response = await served.post("/agent/default/run", {**run_input("x"), "messages": "hi"})
    assert response.status == 400
    assert "messages" in (await response.json())["details"]


async def test_busy_thread_gets_409(served: Served) -> None:
    slow = asyncio.create_task(served.run(run_input("slow:100 take your time", thread="busy")))
    await asyncio.sleep(0.15)
    response = await served.post("/agent/default/run", run_input("again", thread="busy",
                                                                 run="r2"))
    assert response.status == 409
    body = await response.json()
    assert body["code"] == "THREAD_BUSY"
    assert "busy" in body["message"]
    assert (await slow)[-1]["type"] == "RUN_FINISHED"


async def test_body_limit(llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm), max_body_size=1000) as served:
        response = await served.post("/agent/default/run", run_input("x" * 2000))
        assert response.status == 413
        assert (await response.json())["code"] == "PAYLOAD_TOO_LARGE"
        response = await served.post("", {"method": "info", "pad": "x" * 2000})
        assert response.status == 413
        assert text_of(await served.run(run_input("small"))) == "echo: small"


async def test_cors(served: Served) -> None:
    response = await served.session.options(served.url + "/agent/default/run", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert response.status == 204
    assert response.headers["access-control-allow-origin"] == "*"
    assert response.headers["access-control-allow-headers"] == "content-type,authorization"
    assert "POST" in response.headers["access-control-allow-methods"]


async def test_cors_with_credentials(llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    from copilot_runtime import CORSPolicy

    policy = CORSPolicy(origins=("http://app.example",), allow_credentials=True)
    async with serve_runtime(openai_runtime(llm), cors=policy) as served:
        ok = await served.session.get(served.url + "/info",
                                      headers={"Origin": "http://app.example"})
        assert ok.headers["access-control-allow-origin"] == "http://app.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        other = await served.session.get(served.url + "/info",
                                         headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


async def test_routing_errors(served: Served) -> None:
    get_run = await served.session.get(served.url + "/agent/default/run")
    assert get_run.status == 405
    assert get_run.headers["allow"] == "POST"
    post_info = await served.post("/info", {})
    assert post_info.status == 405
    assert post_info.headers["allow"] == "GET"
    unknown = await served.session.get(served.url + "/nope")
    assert unknown.status == 404
    assert await unknown.json() == {"error": "Not found"}
    outside = await served.session.get(served.url.rsplit("/", 1)[0] + "/elsewhere")
    assert outside.status == 404


@pytest.mark.parametrize(("body", "message"), [
    ({}, "Missing method field"),
    ({"method": "bogus"}, "Unsupported method 'bogus'"),
    ({"method": "agent/run", "params": {}}, "Missing or invalid parameter 'agentId'"),
    ({"method": "agent/stop", "params": {"agentId": "default"}},
     "Missing or invalid parameter 'threadId'"),
])
async def test_envelope_errors(served: Served, body: dict[str, Any], message: str) -> None:
    response = await served.post("", body)
    assert response.status == 400
    assert await response.json() == {"error": "invalid_request", "message": message}


async def test_envelope_content_type_and_json(served: Served) -> None:
    response = await served.session.post(served.url, data=b"x",
                                         headers={"Content-Type": "text/plain"})
    assert response.status == 415
    response = await served.post("", raw=b"{oops")
    assert response.status == 400
    assert (await response.json())["message"] == "Invalid JSON payload"
    response = await served.post("", {"method": "agent/run", "params": {"agentId": "nope"}})
    assert response.status == 404


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/agent/default/run", run_input("hi", thread="plain")),
    ("POST", "/agent/default/connect", run_input("hi", thread="plain")),
    ("POST", "/agent/default/stop/plain", {}),
    ("POST", "/approvals/some-id", {"action": "approve"}),
    ("PATCH", "/threads/plain", {"name": "forged"}),
])
async def test_multi_route_bodies_must_be_json(served: Served, method: str, path: str,
                                               body: Any) -> None:
    """A `text/plain` POST is one a browser sends cross-site without a preflight, with the
    user's cookies when CORS allows credentials: it started runs, stopped them and answered
    approvals (the single route already answered 415). Now a body of these routes is JSON
    by its Content-Type, and a stop says JSON without a body too (an empty form posted
    cross-site stopped the user's run)."""
    response = await served.session.request(method, served.url + path, data=orjson.dumps(body),
                                            headers={"Content-Type": "text/plain"})
    assert response.status == 415, await response.read()
    assert (await response.json())["code"] == "UNSUPPORTED_MEDIA_TYPE"
    assert await served.runtime.store.summary("plain") is None
    for json_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        response = await served.session.request(
            method, served.url + path, data=orjson.dumps(body),
            headers={"Content-Type": json_type})
        assert response.status != 415, await response.read()
        await response.read()
    for headers in ({"Content-Type": "application/x-www-form-urlencoded"}, {}):
        response = await served.session.post(served.url + "/agent/default/stop/plain",
                                             headers=headers)
        assert response.status == 415, await response.read()
    response = await served.session.post(served.url + "/agent/default/stop/plain",
                                         headers={"Content-Type": "application/json"})
    assert response.status == 200


async def test_envelope_run_and_connect(served: Served) -> None:
    events = await served.run({"method": "agent/run", "params": {"agentId": "default"},
                               "body": run_input("single", thread="t-single")}, path="")
    assert text_of(events) == "echo: single"
    replay = await served.run({"method": "agent/connect", "params": {"agentId": "default"},
                               "body": run_input("", thread="t-single")}, path="")
    assert text_of(replay) == "echo: single"


# -- stop, disconnect, connect ------------------------------------------------------------

async def _until(condition: Any, within: float = 2.0) -> None:
    for _ in range(int(within / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def _first_text(response: Any) -> bytes:
    received = b""
    while b"TEXT_MESSAGE_CONTENT" not in received:
        received += await response.content.readany()
    return received


async def test_stop_mid_stream(served: Served, llm: MockOpenAIServer) -> None:
    response = await served.post("/agent/default/run",
                                 run_input("slow:200 please stop me", thread="t-stop"))
    received = await _first_text(response)
    stop = await served.post("/agent/default/stop/t-stop", {"runId": "run-1"})
    assert await stop.json() == {"stopped": True, "interrupt": {
        "type": "RUN_ERROR", "message": "Run stopped by user", "code": "STOPPED"}}
    events = parse_sse(received + await response.read())
    verify_events(events)
    assert types(events)[-2:] == ["TEXT_MESSAGE_END", "RUN_FINISHED"]
    assert text_of(events).startswith("ech")
    await _until(lambda: llm.active_streams == 0)
    assert llm.cancelled_streams == 1  # the upstream request was cancelled
    again = await served.run(run_input("next", thread="t-stop", run="run-2"))
    assert text_of(again) == "echo: next"
    replay = await served.run(run_input("", thread="t-stop"), path="/agent/default/connect")
    verify_events(replay)
    assert types(replay).count("RUN_FINISHED") == 2


async def test_stop_answers(served: Served) -> None:
    idle = await served.post("/agent/default/stop/t-idle", raw=b"")
    assert await idle.json() == {"stopped": False,
                                 "message": "No active run for thread 't-idle'."}
    bad = await served.post("/agent/default/stop/t", {"runId": "r", "extra": 1})
    assert bad.status == 400
    assert await bad.json() == {"error": "Invalid stop request"}
    empty = await served.post("/agent/default/stop/t", {"runId": ""})
    assert empty.status == 400
    assert await empty.json() == {"error": "Invalid runId"}
    single = await served.post("", {"method": "agent/stop",
                                    "params": {"agentId": "default", "threadId": "t-idle"}})
    assert (await single.json())["stopped"] is False


@pytest.mark.parametrize(("body", "error"), [
    ({"runId": 5}, "Invalid runId"),
    ({"runId": ""}, "Invalid runId"),
    ([1], "Invalid stop request"),
    ({"runId": "run-1", "extra": 1}, "Invalid stop request"),
])
async def test_a_malformed_stop_is_refused_by_both_forms(
        served: Served, body: Any, error: str) -> None:
    # The single route stopped the run on these (a malformed runId read as "any run").
    thread = "t-bad-stop"
    response = await served.post("/agent/default/run", run_input("slow:200 keep going",
                                                                 thread=thread))
    received = await _first_text(response)
    multi = await served.post(f"/agent/default/stop/{thread}", body)
    single = await served.post("", {"method": "agent/stop", "body": body,
                                    "params": {"agentId": "default", "threadId": thread}})
    for refused in (multi, single):
        assert (refused.status, await refused.json()) == (400, {"error": error})
    assert thread in served.runtime.runs.active
    stop = await served.post("", {"method": "agent/stop", "body": {"runId": "run-1"},
                                  "params": {"agentId": "default", "threadId": thread}})
    assert (await stop.json())["stopped"] is True
    assert types(parse_sse(received + await response.read()))[-1] == "RUN_FINISHED"


async def test_stop_with_other_run_id_does_nothing(served: Served) -> None:
    task = asyncio.create_task(served.run(run_input("slow:60 long answer", thread="t-x")))
    await asyncio.sleep(0.1)
    other = await served.post("/agent/default/stop/t-x", {"runId": "not-this-one"})
    assert (await other.json())["stopped"] is False
    assert text_of(await task) == "echo: slow:60 long answer"


async def test_disconnect_cancels_the_run(serve_runtime: ServeRuntime,
                                         llm: MockOpenAIServer) -> None:
    """With `detached_run_seconds=0`, a disconnect stops the run at once (by default it goes
    on for a while: tests/test_detached_runs.py)."""
    async with serve_runtime(openai_runtime(llm, detached_run_seconds=0)) as served:
        response = await served.post("/agent/default/run",
                                     run_input("slow:200 nobody listens", thread="t-gone"))
        await _first_text(response)
        assert llm.active_streams == 1
        response.close()
        await _until(lambda: llm.active_streams == 0
                     and "t-gone" not in served.runtime.runs.active)
        assert llm.cancelled_streams == 1
        assert "t-gone" not in served.runtime.runs.active
        # the partial run was kept, and the thread is usable again
        replay = await served.run(run_input("", thread="t-gone"), path="/agent/default/connect")
        verify_events(replay)
        assert text_of(replay).startswith("ech")
        assert text_of(await served.run(run_input("back", thread="t-gone", run="r2"))) == \
            "echo: back"


async def test_connect_replays_compacted_history(served: Served) -> None:
    first = await served.run(run_input("one", thread="t-c", run="r1"))
    await served.run(run_input('call:getWeather {"city":"Oslo"}', thread="t-c", run="r2"))
    replay = await served.run(run_input("", thread="t-c"), path="/agent/default/connect")
    verify_events(replay)
    assert types(replay)[:5] == ["RUN_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT",
                                 "TEXT_MESSAGE_END", "RUN_FINISHED"]
    assert replay[2]["delta"] == text_of(first)
    args = [e for e in replay if e["type"] == "TOOL_CALL_ARGS"]
    assert [a["delta"] for a in args] == ['{"city":"Oslo"}']


async def test_connect_unknown_thread_is_empty(served: Served) -> None:
    response = await served.post("/agent/default/connect", run_input("", thread="never"))
    assert response.status == 200
    assert await response.read() == b""


async def test_connect_while_running_follows_the_live_run(
        serve_runtime: ServeRuntime) -> None:
    """`connect` gets the events so far while the run is provably still running (its agent
    waits at a gate the test holds), then the rest live, to the run's end."""
    agent = GatedAgent()
    async with serve_runtime(CopilotRuntime(agents={"default": agent})) as served:
        running = await served.post("/agent/default/run", run_input("hi", thread="t-live"))
        first = await running.content.readuntil(b"\n\n")  # RUN_STARTED is out: it runs
        connect = await served.post("/agent/default/connect", run_input("", thread="t-live"))
        so_far = b""
        async with asyncio.timeout(20):
            while b"one " not in so_far:
                so_far += await connect.content.readany()
        assert served.runtime.is_running("t-live")
        assert b"RUN_FINISHED" not in so_far
        agent.gate.set()
        replay = parse_sse(so_far + await connect.read())
        original = parse_sse(first + await running.read())
    verify_events(replay)
    assert replay == original
    assert text_of(replay) == "one two"


async def test_thread_routes(served: Served) -> None:
    events = await served.run(run_input("remember me", thread="t-routes"))
    listing = await (await served.session.get(served.url + "/threads?agentId=default")).json()
    assert listing["threads"][0]["id"] == "t-routes"
    assert listing["threads"][0]["createdAt"].endswith("Z")
    messages = await (await served.session.get(
        served.url + "/threads/t-routes/messages")).json()
    assert messages["messages"] == [
        {"id": "run-1-u", "role": "user", "content": "remember me"},
        {"id": events[1]["messageId"], "role": "assistant", "content": "echo: remember me"}]
    thread_events = await (await served.session.get(
        served.url + "/threads/t-routes/events")).json()
    verify_events(thread_events["events"])
    state = await (await served.session.get(served.url + "/threads/t-routes/state")).json()
    assert state == {"state": None}
    missing = await served.session.get(served.url + "/threads/none/messages")
    assert missing.status == 404


async def test_concurrent_runs_on_many_threads(served: Served) -> None:
    results = await asyncio.gather(*(
        served.run(run_input(f"message {i}", thread=f"t-many-{i}")) for i in range(30)))
    for i, events in enumerate(results):
        verify_events(events)
        assert text_of(events) == f"echo: message {i}"


async def test_broken_stream_message(served: Served) -> None:
    events = await served.run(run_input("breaks:1 cut"))
    assert events[-1]["type"] == "RUN_ERROR"
    assert events[-1]["message"].startswith("The OpenAI stream broke off"), events[-1]


async def test_keepalive_comments_during_silence(serve_runtime: ServeRuntime) -> None:
    """While the agent is silent (held at a gate until two keep-alives came, however slow the
    machine), the stream carries SSE comments; the run then ends as usual."""
    agent = GatedAgent()
    async with serve_runtime(CopilotRuntime(agents={"slow": agent}), keepalive=0.1) as served:
        response = await served.post("/agent/slow/run", run_input("x"))
        body = b""
        async with asyncio.timeout(20):
            while body.count(b": keep-alive\n\n") < 2:
                body += await response.content.readany()
        # A `connect` following the silent run gets them too (a proxy would cut it else).
        following = await served.post("/agent/slow/connect", run_input(""))
        followed = b""
        async with asyncio.timeout(20):
            while followed.count(b": keep-alive\n\n") < 2:
                followed += await following.content.readany()
        agent.gate.set()
        body += await response.read()
        followed += await following.read()
    events = parse_sse(body)
    verify_events(events)
    assert text_of(events) == "one two"
    assert parse_sse(followed) == events


class EarlyLastAgent(Agent):
    """Marks a batch `LastBatch` and then yields another: a broken promise the run survives."""

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input.run_id)

    async def _run(self, run_id: str) -> Any:
        from copilot_runtime import events as ev

        message = f"m-{run_id}"
        yield ev.LastBatch([ev.text_message_start(message),
                            ev.text_message_content(message, "one ")])
        yield [ev.text_message_content(message, "two"), ev.text_message_end(message)]


async def test_a_batch_marked_last_too_early_keeps_the_order(
        serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(CopilotRuntime(agents={"default": EarlyLastAgent()})) as served:
        events = await served.run(run_input("hi", thread="t-early-last"))
    verify_events(events)
    assert text_of(events) == "one two"
    assert [e["type"] for e in events] == ["RUN_STARTED", "TEXT_MESSAGE_START",
                                          "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT",
                                          "TEXT_MESSAGE_END", "RUN_FINISHED"]
