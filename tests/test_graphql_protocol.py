"""The GraphQL protocol over real HTTP: framing, turns, inputs, queries, errors, dispatch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from copilot_runtime import Agent, RunContext, RunInput, action, thread_store
from copilot_runtime._compaction import events_to_messages
from copilot_runtime.events import (
    EventBatches,
    LastBatch,
    custom,
    text_message_content,
    text_message_end,
    text_message_start,
    tool_call_args,
    tool_call_end,
    tool_call_result,
    tool_call_start,
)
from copilot_runtime.protocols.graphql import documents
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import Served, ServeRuntime, openai_runtime
from tests.gql.wire import (
    CHAT_DOCUMENT,
    CLIENT_HEADERS,
    OTHER_CLIENT_HEADERS,
    call_message,
    chat_data,
    merge,
    parse_multipart,
    result_message,
    text_message,
    user_turn,
)

pytestmark = pytest.mark.asyncio

LOAD_STATE = """query load($data: LoadAgentStateInput!) {
  loadAgentState(data: $data) { threadId threadExists state messages } }"""
AGENTS = "query { availableAgents { agents { name id description } } }"


async def post(served: Served, body: Any, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> aiohttp.ClientResponse:
    data = raw if raw is not None else orjson.dumps(body)
    return await served.session.post(served.url, data=data,
                                     headers=CLIENT_HEADERS if headers is None else headers)


async def generate(served: Served, data: dict[str, Any], properties: Any = None, *,
                   document: str = CHAT_DOCUMENT,
                   headers: dict[str, str] | None = None) -> tuple[Any, list[Any]]:
    """The merged result of a streamed `generateCopilotResponse`, and its payloads."""
    variables: dict[str, Any] = {"data": data}
    if properties is not None:
        variables["properties"] = properties
    response = await post(served, {"query": document, "variables": variables}, headers)
    assert response.status == 200, await response.text()
    assert response.headers["content-type"] == 'multipart/mixed; boundary="-"'
    payloads = parse_multipart(await response.read())
    merged = merge(payloads)
    assert "errors" not in merged
    return merged["data"]["generateCopilotResponse"], payloads


async def query(served: Served, text: str, variables: dict[str, Any] | None = None) -> Any:
    response = await post(served, {"query": text, "variables": variables or {}})
    assert response.status == 200, await response.text()
    return await response.json()


class ScriptAgent(Agent):
    """An agent that yields written batches and remembers what it was given."""

    def __init__(self, *batches: list[dict[str, Any]], fail: Exception | None = None) -> None:
        super().__init__(description="Scripted for the tests")
        self.batches = batches
        self.fail = fail
        self.seen: list[tuple[RunInput, RunContext]] = []

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        self.seen.append((input, context))
        return self._events()

    async def _events(self) -> AsyncIterator[list[dict[str, Any]]]:
        for batch in self.batches:
            yield batch
        if self.fail is not None:
            raise self.fail


# ---- streaming -----------------------------------------------------------------------------


async def test_chat_streams_as_increments(llm: MockOpenAIServer,
                                          serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm)) as served:
        response, payloads = await generate(served, user_turn("Hello, CopilotKit!"))
    first = payloads[0]["data"]["generateCopilotResponse"]
    assert first == {"threadId": "gql-thread", "runId": None, "extensions": None,
                     "messages": [], "metaEvents": []}
    entries = [e for p in payloads[1:] for e in p["incremental"]]
    item = entries[0]
    assert item["path"] == ["generateCopilotResponse", "messages", 0]
    assert item["items"][0]["content"] == []
    pieces = [e for e in entries if e["path"][-2:-1] == ["content"]]
    assert [e["path"][-1] for e in pieces] == [0]  # one upstream read: one entry, 5 items
    assert pieces[0]["items"] == ["echo", ": Hel", "lo, C", "opilo", "tKit!"]
    (message,) = response["messages"]
    assert message["__typename"] == "TextMessageOutput"
    assert message["role"] == "assistant"
    assert message["status"] == {"__typename": "SuccessMessageStatus", "code": "Success"}
    assert response["status"] == {"__typename": "SuccessResponseStatus", "code": "Success"}
    assert "".join(message["content"]) == "echo: Hello, CopilotKit!"


async def test_runtime_version_header(llm: MockOpenAIServer,
                                      serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm)) as served:
        echoed = await post(served, {"query": "{ hello }"},
                            {**CLIENT_HEADERS, "X-CopilotKit-Runtime-Client-GQL-Version": "1.9.3"})
        plain = await post(served, {"query": "{ hello }"},
                           {"Content-Type": "application/json"})
    assert echoed.headers["x-copilotkit-runtime-version"] == "1.9.3"
    assert echoed.headers["content-type"] == "application/graphql-response+json; charset=utf-8"
    assert plain.headers["x-copilotkit-runtime-version"] == "1.10.6"
    assert plain.headers["content-type"] == "application/json; charset=utf-8"


async def test_one_json_result_without_multipart(llm: MockOpenAIServer,
                                                 serve_runtime: ServeRuntime) -> None:
    plain_document = """mutation($data: GenerateCopilotResponseInput!) {
      generateCopilotResponse(data: $data) {
        status { ... on BaseResponseStatus { code } }
        messages { __typename ... on TextMessageOutput { content status { __typename } } }
      } }"""
    async with serve_runtime(openai_runtime(llm)) as served:
        # The client's document, but a client that only takes JSON.
        answer = await post(served, {"query": CHAT_DOCUMENT,
                                     "variables": {"data": user_turn("one")}},
                            {"Content-Type": "application/json", "Accept": "application/json"})
        # A document without @defer/@stream, from a client that takes multipart.
        single = await post(served, {"query": plain_document,
                                     "variables": {"data": user_turn("two", thread="t2")}})
        assert answer.headers["content-type"] == "application/json; charset=utf-8"
        assert single.headers["content-type"].startswith("application/graphql-response+json")
        body, other = await answer.json(), await single.json()
    result = body["data"]["generateCopilotResponse"]
    assert result["status"]["code"] == "Success"
    assert "".join(result["messages"][0]["content"]) == "echo: one"
    assert result["messages"][0]["status"]["code"] == "Success"
    assert other["data"]["generateCopilotResponse"] == {
        "status": {"code": "Success"},
        "messages": [{"__typename": "TextMessageOutput",
                      "content": ["e", "ch", "o:", " t", "wo"],
                      "status": {"__typename": "SuccessMessageStatus"}}]}


async def test_each_document_is_parsed_and_validated_once(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime,
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_parse, real_validate = documents.parse, documents.validate
    monkeypatch.setattr(documents, "parse", lambda *a, **k: calls.append("parse")
                        or real_parse(*a, **k))
    monkeypatch.setattr(documents, "validate", lambda *a, **k: calls.append("validate")
                        or real_validate(*a, **k))
    async with serve_runtime(openai_runtime(llm)) as served:
        for turn in range(3):
            await generate(served, user_turn(f"turn {turn}", thread=f"t{turn}"))
    assert calls == ["parse", "validate"]


async def test_documents_too_big_to_check_cheaply_are_refused_before_validation(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """200 KB of aliases, 200 copies of one field with its selections, or 290 fragments
    spread side by side (graphql-core compares fields of one name, and fragments, pairwise)
    each held the event loop for a quarter of a second to a second and a half while it was
    parsed and validated: every stream of the worker stalled meanwhile. The 1.10 client's
    largest document has 272 tokens, 98 fields and no named fragment."""
    from graphql import get_introspection_query

    validated: list[int] = []
    real_validate = documents.validate
    monkeypatch.setattr(documents, "validate", lambda schema, document, **k: validated.append(
        len(document.loc.source.body)) or real_validate(schema, document, **k))
    field = " availableAgents { agents { name id description } }"  # 5 selections
    selections = ("The document makes more than 300 selections (fields and fragments); at "
                  "most 300 are served")
    cases = {
        "aliases": ("more than 2000 tokens", "GRAPHQL_PARSE_FAILED",
                    "{" + " ".join(f"a{i}: hello" for i in range(16_000)) + "}"),
        "one name": (selections, "GRAPHQL_VALIDATION_FAILED", "{" + field * 200 + "}"),
        "just over": (selections, "GRAPHQL_VALIDATION_FAILED", "{" + field * 60 + " hello }"),
        "fragments": ("The document defines 21 fragments; at most 20 are served",
                      "GRAPHQL_VALIDATION_FAILED",
                      " ".join(f"fragment F{i} on Query {{ hello }}" for i in range(21))
                      + " { " + " ".join(f"...F{i}" for i in range(21)) + " }"),
    }
    async with serve_runtime(openai_runtime(llm)) as served:
        for name, (message, code, document) in cases.items():
            response = await post(served, {"query": document}, OTHER_CLIENT_HEADERS)
            error = (await response.json())["errors"][0]
            assert (response.status, error["extensions"]["code"]) == (400, code), name
            assert message in error["message"], name
        assert validated == []
        # Within the bounds: 300 selections under one name, a tool's whole introspection.
        at_most = await query(served, "{" + field * 60 + "}")
        introspected = await query(served, get_introspection_query(descriptions=True))
    assert at_most["data"]["availableAgents"]["agents"] == []
    assert introspected["data"]["__schema"]["queryType"]["name"] == "Query"
    assert len(validated) == 2


async def test_disconnect_cancels_the_llm_request(llm: MockOpenAIServer,
                                                  serve_runtime: ServeRuntime) -> None:
    runtime = openai_runtime(llm)
    async with serve_runtime(runtime) as served:
        response = await post(served, {"query": CHAT_DOCUMENT, "variables": {
            "data": user_turn("slow:200 take your time")}})
        for _ in range(500):  # until the model is answering
            if llm.active_streams:
                break
            await asyncio.sleep(0.01)
        response.close()
        for _ in range(200):
            if llm.cancelled_streams and not runtime.runs.active:
                break
            await asyncio.sleep(0.01)
    assert llm.cancelled_streams == 1
    assert not runtime.runs.active


async def test_stop_interrupts_the_streaming_message(llm: MockOpenAIServer,
                                                     serve_runtime: ServeRuntime) -> None:
    runtime = openai_runtime(llm)
    async with serve_runtime(runtime) as served:
        response = await post(served, {"query": CHAT_DOCUMENT, "variables": {
            "data": user_turn("slow:100 stop me", thread="t-stop")}})
        body = await response.content.readany()
        while b'"content",0]' not in body:
            body += await response.content.readany()
        assert runtime.stop_run("default", "t-stop")
        body += await response.read()
    result = merge(parse_multipart(body))["data"]["generateCopilotResponse"]
    (message,) = result["messages"]
    assert message["status"]["code"] == "Failed"
    status = result["status"]
    assert status["reason"] == "MESSAGE_STREAM_INTERRUPTED"
    assert status["details"]["messageId"] == message["id"]


# ---- turns and inputs ------------------------------------------------------------------------


async def test_server_action_ends_the_response(llm: MockOpenAIServer,
                                               serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm)) as served:
        result, _ = await generate(served, user_turn('call:getWeather {"city": "Paris"}'))
    assert len(llm.requests) == 1  # the client sends the follow-up, not us
    call, answer = result["messages"]
    assert call["__typename"] == "ActionExecutionMessageOutput"
    assert call["name"] == "getWeather"
    assert json.loads("".join(call["arguments"])) == {"city": "Paris"}
    assert answer["__typename"] == "ResultMessageOutput"
    assert answer["id"] == "result-" + call["id"]
    assert answer["actionExecutionId"] == call["id"]
    assert answer["actionName"] == "getWeather"
    assert json.loads(answer["result"])["temperature"] == 21
    assert call["status"]["code"] == answer["status"]["code"] == "Success"


async def test_failed_action_result_is_encoded_as_in_1_10(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    @action
    def explode(reason: str) -> str:
        """Always fails."""
        raise ValueError(reason)

    async with serve_runtime(openai_runtime(llm, actions=[explode])) as served:
        result, _ = await generate(served, user_turn('call:explode {"reason": "no luck"}'))
    encoded = json.loads(result["messages"][1]["result"])
    assert encoded == {"error": {"code": "HANDLER_ERROR", "message": "ValueError: no luck"},
                       "result": ""}


async def test_messages_reach_the_model_as_the_1_10_runtime_sends_them(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    weather = '{"city":"Paris","temperature":21}'
    data = chat_data([
        text_message("sys", "system", "Be brief."),
        text_message("u1", "user", "weather in Paris and Rome?"),
        call_message("call_a", "getWeather", '{"city":"Paris"}', parent="answer-1"),
        result_message("result-call_a", "call_a", "getWeather", weather),
        call_message("call_b", "getWeather", '{"city":"Rome"}', parent="answer-1"),
        result_message("result-call_b", "call_b", "getWeather", weather),
        result_message("orphan", "call_zzz", "getWeather", "{}"),
        {"id": "state", "createdAt": "2025-01-01T00:00:00Z", "agentStateMessage": {
            "threadId": "t", "agentName": "a", "nodeName": "n", "runId": "r", "active": True,
            "running": False, "role": "assistant", "state": "{}"}},
    ])
    async with serve_runtime(openai_runtime(llm)) as served:
        await generate(served, data)
    sent = llm.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["developer", "user", "assistant", "tool", "tool"]
    assert sent[0]["content"] == "Be brief."
    assert [c["id"] for c in sent[2]["tool_calls"]] == ["call_a", "call_b"]
    assert [m["tool_call_id"] for m in sent[3:]] == ["call_a", "call_b"]


async def test_forwarded_parameters_and_properties(llm: MockOpenAIServer,
                                                   serve_runtime: ServeRuntime) -> None:
    forwarded = {"model": "gpt-test", "temperature": 0.5, "maxTokens": 100.0, "stop": ["STOP"],
                 "toolChoice": "function", "toolChoiceFunctionName": "getWeather"}
    async with serve_runtime(openai_runtime(llm)) as served:
        await generate(served, user_turn("one", forwardedParameters=forwarded))
        tuned = llm.requests[-1]
        # `properties` reach agents, but never change the model's settings.
        await generate(served, user_turn("two", thread="t2"),
                       {"model": "not-this", "temperature": 2, "userId": "u1"})
        plain = llm.requests[-1]
    assert tuned["model"] == "gpt-test"
    assert tuned["temperature"] == 0.5
    assert tuned["max_tokens"] == 100
    assert tuned["stop"] == ["STOP"]
    assert tuned["tool_choice"] == {"type": "function", "function": {"name": "getWeather"}}
    assert plain["model"] == "gpt-4o"
    assert "temperature" not in plain


async def test_frontend_actions_become_tools(llm: MockOpenAIServer,
                                             serve_runtime: ServeRuntime) -> None:
    schema = json.dumps({"type": "object", "properties": {"x": {"type": "string"}}})
    actions = [
        {"name": "shown", "description": "on", "jsonSchema": schema, "available": "enabled"},
        {"name": "hidden", "description": "off", "jsonSchema": schema, "available": "disabled"},
        {"name": "remote", "description": "elsewhere", "jsonSchema": schema,
         "available": "remote"},
        {"name": "broken", "description": "bad schema", "jsonSchema": "{nope"},
    ]
    async with serve_runtime(openai_runtime(llm)) as served:
        result, _ = await generate(served, user_turn('call:shown {"x": "1"}', actions=actions))
    tools = {t["function"]["name"]: t["function"] for t in llm.requests[-1]["tools"]}
    assert set(tools) == {"getWeather", "shown", "broken"}
    assert tools["shown"]["parameters"] == json.loads(schema)
    assert tools["broken"]["parameters"] == {"type": "object", "properties": {}}
    (call,) = result["messages"]  # a frontend action: streamed, not run
    assert call["name"] == "shown"


async def test_remote_actions_are_offered_to_agents_only(llm: MockOpenAIServer,
                                                         serve_runtime: ServeRuntime) -> None:
    """`available: "remote"` is "only available to the agent": an agent gets it (that of a
    session, or a runtime's own `default` that is not the service adapter's loop); the
    service adapter's loop does not (`test_frontend_actions_become_tools`)."""
    actions = [{"name": name, "description": name, "jsonSchema": '{"type":"object"}',
                "available": available}
               for name, available in (("shown", "enabled"), ("hidden", "disabled"),
                                       ("agentOnly", "remote"))]
    planner = ScriptAgent([text_message_start("m1"), text_message_content("m1", "ok"),
                           text_message_end("m1")])
    own_default = ScriptAgent([text_message_start("m2"), text_message_content("m2", "ok"),
                               text_message_end("m2")])
    async with serve_runtime(openai_runtime(llm, agents={"planner": planner})) as served:
        await generate(served, user_turn("hi", actions=actions,
                                         agentSession={"agentName": "planner"}))
    async with serve_runtime(openai_runtime(llm, actions=[],
                                            agents={"default": own_default})) as served:
        await generate(served, user_turn("hi", thread="t2", actions=actions))
    for agent in (planner, own_default):
        (seen, _), = agent.seen
        names = {tool.name for tool in seen.model.tools}
        assert {"shown", "agentOnly"} <= names, names
        assert "hidden" not in names
    assert not llm.requests


async def test_agent_session_runs_that_agent(llm: MockOpenAIServer,
                                             serve_runtime: ServeRuntime) -> None:
    agent = ScriptAgent(
        [text_message_start("m1"), text_message_content("m1", "from the agent")],
        [text_message_end("m1"), custom("on_interrupt", {"question": "Approve?"})])
    runtime = openai_runtime(llm, agents={"planner": agent})
    data = user_turn(
        "plan it", agentSession={"agentName": "planner", "nodeName": "start"},
        agentStates=[{"agentName": "planner", "state": '{"step": 1}',
                      "config": '{"streamSubgraphs": true, "depth": 2}'}],
        metaEvents=[{"name": "LangGraphInterruptEvent", "value": "q", "response": "yes"}])
    async with serve_runtime(runtime) as served:
        result, _ = await generate(served, data, {"userId": "u1"})
    assert "".join(result["messages"][0]["content"]) == "from the agent"
    assert result["metaEvents"] == [{"__typename": "LangGraphInterruptEvent",
                                     "type": "MetaEvent", "name": "LangGraphInterruptEvent",
                                     "value": '{"question":"Approve?"}'}]
    (seen, context), = agent.seen
    assert context.agent_id == "planner"
    assert context.follow_up_server_tools is False
    assert seen.model.state == {"step": 1}
    props = seen.model.forwarded_props
    assert props["userId"] == "u1"
    assert props["nodeName"] == "start"
    assert props["command"] == {"resume": "yes", "interruptEvent": "q"}
    assert props["config"] == {"depth": 2}
    assert props["streamSubgraphs"] is True
    assert not llm.requests


async def test_a_users_authorization_reaches_the_agent_and_is_never_kept(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """Before: `properties.authorization` (a user's token, for the agent's back end) sat in
    the RUN_STARTED input the thread stored, and every thread route and `connect` served it
    back. The run still gets it; the thread keeps the rest of `properties`."""
    secret = "user-jwt-SECRET-123"
    agent = ScriptAgent([text_message_start("m1"), text_message_content("m1", "ok"),
                         text_message_end("m1")])
    async with serve_runtime(openai_runtime(llm, agents={"planner": agent})) as served:
        await generate(served, user_turn("hi", thread="t-auth",
                                         agentSession={"agentName": "planner"}),
                       {"authorization": secret, "userId": "u1"})
        events = await (await served.session.get(
            f"{served.url}/threads/t-auth/events")).read()
        connect = await served.session.post(served.url + "/agent/planner/connect", json={
            "threadId": "t-auth", "runId": "r2", "messages": [], "tools": [], "context": [],
            "state": {}, "forwardedProps": {}})
        replayed = await connect.read()
    (seen, _), = agent.seen
    assert seen.model.forwarded_props["authorization"] == secret
    started = orjson.loads(events)["events"][0]
    assert started["type"] == "RUN_STARTED"
    assert started["input"]["forwardedProps"]["userId"] == "u1"
    assert "authorization" not in started["input"]["forwardedProps"]
    assert connect.status == 200
    assert b"RUN_STARTED" in replayed
    assert secret.encode() not in events
    assert secret.encode() not in replayed


async def test_unknown_agent_session_and_cloud_without_key(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm)) as served:
        unknown = await post(served, {"query": CHAT_DOCUMENT, "variables": {
            "data": user_turn("hi", agentSession={"agentName": "nope"})}})
        cloud = await post(served, {"query": CHAT_DOCUMENT, "variables": {
            "data": user_turn("hi", thread="t2", cloud={"guardrails": {
                "inputValidationRules": {"allowList": [], "denyList": []}}})}})
        assert unknown.status == cloud.status == 200
        missing, keyless = await unknown.json(), await cloud.json()
    assert missing["data"] is None
    (error,) = missing["errors"]
    assert error["path"] == ["generateCopilotResponse"]
    assert error["locations"] == [{"line": 3, "column": 3}]
    assert "'default'" in error["message"]
    extensions = error["extensions"]
    assert {k: extensions[k] for k in ("code", "statusCode", "visibility", "severity")} == {
        "code": "AGENT_NOT_FOUND", "statusCode": 500, "visibility": "banner",
        "severity": "critical"}
    assert extensions["originalError"] == {"message": error["message"]}
    assert keyless["errors"][0]["extensions"]["code"] == "MISUSE"
    assert not llm.requests


async def test_agent_failures_never_show_internals(llm: MockOpenAIServer,
                                                   serve_runtime: ServeRuntime) -> None:
    agent = ScriptAgent(fail=RuntimeError("boom in /srv/app/secret.py line 3"))
    async with serve_runtime(openai_runtime(llm, agents={"crashy": agent})) as served:
        result, payloads = await generate(
            served, user_turn("hi", agentSession={"agentName": "crashy"}))
    status = result["status"]
    assert status["code"] == "Failed"
    assert status["reason"] == "UNKNOWN_ERROR"
    assert status["details"]["originalError"]["code"] == "UNKNOWN"
    wire = orjson.dumps(payloads).decode()
    assert "secret.py" not in wire
    assert "Traceback" not in wire


async def test_llm_errors_are_reported_in_band(llm: MockOpenAIServer,
                                               serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm)) as served:
        failed, _ = await generate(served, user_turn("error:500"))
        broken, _ = await generate(served, user_turn("breaks:2 cut short", thread="t2"))
    assert failed["messages"] == []
    details = failed["status"]["details"]
    assert failed["status"]["reason"] == "UNKNOWN_ERROR"
    assert "500" in details["description"]
    assert details["originalError"]["code"] == "NETWORK_ERROR"
    assert details["originalError"]["extensions"]["visibility"] == "banner"
    (message,) = broken["messages"]
    assert message["content"]  # the text before the break was streamed
    assert message["status"]["code"] == "Failed"
    assert broken["status"]["reason"] == "UNKNOWN_ERROR"


async def test_the_clients_instructions_reach_the_model_and_are_not_kept(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """The 1.10 client sends its instructions as a system message of a new id with every
    request: each was kept with the thread, so a thread held one a request (a follow-up
    after a tool call included), and a 1.74 page opening it sent them all back to the
    model. The model gets this request's; the thread keeps none."""
    async with serve_runtime(openai_runtime(llm)) as served:
        history: list[dict[str, Any]] = []
        for n in (1, 2, 3):
            history.append(text_message(f"user-{n}", "user", f"question {n}"))
            result, _ = await generate(served, chat_data(
                [text_message(f"ck-{n}", "system", "Be brief."), *history],
                thread="instructed"))
            history += [text_message(m["id"], "assistant", "".join(m["content"]))
                        for m in result["messages"] if m.get("content")]
        response = await served.session.get(served.url + "/threads/instructed/messages")
        stored = (await response.json())["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"] * 3
    sent = llm.requests[-1]["messages"]
    assert [m["content"] for m in sent if m["role"] in ("system", "developer")] == [
        "Be brief."]


async def _kept_and_replayed(served: Served, thread: str
                             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The thread's messages as `GET /threads/{id}/messages` reads them, and as a client
    applying its `connect` replay has them."""
    response = await served.session.get(f"{served.url}/threads/{thread}/messages")
    assert response.status == 200, await response.text()
    kept: list[dict[str, Any]] = (await response.json())["messages"]
    replay = await served.run({"threadId": thread, "runId": "replay", "messages": [],
                               "tools": [], "context": [], "state": {}, "forwardedProps": {}},
                              path="/agent/default/connect")
    return kept, events_to_messages([replay])


def _tool_messages(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(m["id"], m.get("toolCallId") or m.get("tool_call_id"))
            for m in messages if m["role"] == "tool"]


@pytest.mark.parametrize("store_url", ["memory://", "sqlite:///{tmp}/threads.sqlite3"],
                         ids=["memory", "sqlite"])
async def test_a_server_actions_result_the_client_sends_back_is_kept_once(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime, tmp_path: Path,
        store_url: str) -> None:
    """After a server action, react-core 1.10 follows up with the call and its result under
    the ids the stream gave them: the result's, `result-<call id>`, is not the id the thread
    keeps it under, so the thread kept it again, and a page opening the thread (or a
    `connect` replay) had two results for one call, and sent the model both."""
    store = thread_store(store_url.format(tmp=tmp_path))
    async with serve_runtime(openai_runtime(llm, thread_store=store)) as served:
        history = [text_message("sys-1", "system", "Be brief."),
                   text_message("user-1", "user", 'call:getWeather {"city": "Paris"}')]
        first, _ = await generate(served, chat_data(history, thread="weather"))
        call, answer = first["messages"]
        assert answer["id"] == "result-" + call["id"]
        history += [call_message(call["id"], call["name"], "".join(call["arguments"]),
                                 parent=call["parentMessageId"]),
                    result_message(answer["id"], call["id"], answer["actionName"],
                                   answer["result"])]
        second, _ = await generate(served, chat_data(history, thread="weather"))
        (reply,) = second["messages"]
        history += [text_message(reply["id"], "assistant", "".join(reply["content"])),
                    text_message("user-2", "user", "thanks")]
        await generate(served, chat_data(history, thread="weather"))
        kept, replayed = await _kept_and_replayed(served, "weather")
    (kept_result,) = _tool_messages(kept)
    assert kept_result[1] == call["id"]
    assert _tool_messages(replayed) == [kept_result]
    assert [m["role"] for m in kept] == ["user", "assistant", "tool", "assistant", "user",
                                        "assistant"]
    # The model reads the call's result once in every request after it.
    assert [[m["tool_call_id"] for m in request["messages"] if m["role"] == "tool"]
            for request in llm.requests] == [[], [call["id"]], [call["id"]]]


class _LookupThenTextAgent(Agent):
    """Runs a tool of its own in its first run, its result (under an id of its own making)
    in the batch that ends the run; answers in text after."""

    def __init__(self) -> None:
        super().__init__(description="A custom agent with a server-side tool")
        self.runs = 0

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        self.runs += 1
        return self._events(self.runs)

    async def _events(self, number: int) -> AsyncIterator[list[dict[str, Any]]]:
        if number == 1:
            yield LastBatch([tool_call_start("call-1", "lookup", "asked"),
                             tool_call_args("call-1", "{}"), tool_call_end("call-1"),
                             tool_call_result("agent-result", "call-1", "found")])
        else:
            yield LastBatch([text_message_start(f"text-{number}"),
                             text_message_content(f"text-{number}", "ok"),
                             text_message_end(f"text-{number}")])


async def test_any_agents_result_the_client_sends_back_is_kept_once(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """The response's id for a tool result is kept with the thread however the run's agent
    streamed it (here in the batch that ends the run, stored before the client reads it):
    the follow-up sending it back adds nothing."""
    runtime = openai_runtime(llm, agents={"custom": _LookupThenTextAgent()})
    session = {"agentName": "custom"}
    async with serve_runtime(runtime) as served:
        history = [text_message("user-1", "user", "look it up")]
        first, _ = await generate(served, chat_data(history, thread="looked",
                                                    agentSession=session))
        call, answer = [m for m in first["messages"]
                        if m["__typename"] != "AgentStateMessageOutput"]
        assert answer["id"] == "result-call-1"
        history += [call_message(call["id"], call["name"], "".join(call["arguments"])),
                    result_message(answer["id"], call["id"], "lookup", answer["result"])]
        await generate(served, chat_data(history, thread="looked", agentSession=session))
        kept, _ = await _kept_and_replayed(served, "looked")
    assert _tool_messages(kept) == [("agent-result", "call-1")]


async def test_a_frontend_actions_result_is_kept_once(llm: MockOpenAIServer,
                                                      serve_runtime: ServeRuntime) -> None:
    """The result of a frontend action is the client's: the thread keeps it, once, however
    often the client sends it back."""
    schema = json.dumps({"type": "object", "properties": {"message": {"type": "string"}}})
    actions = [{"name": "notify", "description": "Shows a notification", "jsonSchema": schema,
                "available": "enabled"}]
    async with serve_runtime(openai_runtime(llm)) as served:
        history = [text_message("sys-1", "system", "Be brief."),
                   text_message("user-1", "user", 'call:notify {"message": "hi"}')]
        first, _ = await generate(served, chat_data(history, thread="notified",
                                                    actions=actions))
        (call,) = first["messages"]
        history += [call_message(call["id"], call["name"], "".join(call["arguments"]),
                                 parent=call["parentMessageId"]),
                    result_message("client-result", call["id"], "notify", "shown")]
        second, _ = await generate(served, chat_data(history, thread="notified",
                                                     actions=actions))
        (reply,) = second["messages"]
        history += [text_message(reply["id"], "assistant", "".join(reply["content"])),
                    text_message("user-2", "user", "thanks")]
        await generate(served, chat_data(history, thread="notified", actions=actions))
        kept, replayed = await _kept_and_replayed(served, "notified")
    assert _tool_messages(kept) == _tool_messages(replayed) == [("client-result", call["id"])]
    assert [[m["tool_call_id"] for m in request["messages"] if m["role"] == "tool"]
            for request in llm.requests] == [[], [call["id"]], [call["id"]]]


async def test_busy_thread(llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm)) as served:
        slow = await post(served, {"query": CHAT_DOCUMENT, "variables": {
            "data": user_turn("slow:100 long one", thread="busy")}})
        await slow.content.readany()
        second = await post(served, {"query": CHAT_DOCUMENT, "variables": {
            "data": user_turn("me too", thread="busy")}})
        body = await second.json()
        await slow.read()
    extensions = body["errors"][0]["extensions"]
    # A code of the 1.10 client's own (it fails on any other), ours beside it.
    assert (extensions["code"], extensions["runtimeCode"]) == ("UNKNOWN", "THREAD_BUSY")
    assert extensions["statusCode"] == 409
    assert body["data"] is None


# ---- queries -------------------------------------------------------------------------------


async def test_hello_agents_and_introspection(llm: MockOpenAIServer,
                                              serve_runtime: ServeRuntime) -> None:
    planner = ScriptAgent()
    async with serve_runtime(openai_runtime(llm, agents={"planner": planner})) as served:
        hello = await query(served, "{ hello }")
        agents = await query(served, AGENTS)
        schema = await query(served, "{ __schema { mutationType { name } directives { name } } }")
    async with serve_runtime(openai_runtime(llm)) as served:
        only_default = await query(served, AGENTS)
    assert hello == {"data": {"hello": "Hello World"}}
    # The built-in agent stands for the 1.10 runtime's service adapter, which it never lists.
    assert agents["data"]["availableAgents"]["agents"] == [
        {"name": "planner", "id": "planner", "description": "Scripted for the tests"}]
    assert only_default["data"]["availableAgents"]["agents"] == []
    assert schema["data"]["__schema"]["mutationType"] == {"name": "Mutation"}
    assert {d["name"] for d in schema["data"]["__schema"]["directives"]} == {
        "include", "skip", "deprecated", "specifiedBy", "defer", "stream"}


async def test_load_agent_state(llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm)) as served:
        await generate(served, user_turn('call:getWeather {"city": "Oslo"}', thread="kept"))
        kept = await query(served, LOAD_STATE, {"data": {"threadId": "kept",
                                                         "agentName": "default"}})
        missing = await query(served, LOAD_STATE, {"data": {"threadId": "never",
                                                            "agentName": "default"}})
        unknown = await query(served, LOAD_STATE, {"data": {"threadId": "kept",
                                                            "agentName": "nope"}})
    state = kept["data"]["loadAgentState"]
    assert state["threadId"] == "kept"
    assert state["threadExists"] is True
    assert json.loads(state["state"]) == {}
    user, call, answer = json.loads(state["messages"])  # no system prompt: the client has one
    assert user == {"id": "user-1", "role": "user", "content": 'call:getWeather {"city": "Oslo"}'}
    assert call["name"] == "getWeather"
    assert call["arguments"] == {"city": "Oslo"}
    assert answer["actionExecutionId"] == call["id"]
    assert answer["actionName"] == "getWeather"
    assert json.loads(answer["result"])["city"] == "Oslo"
    assert missing["data"]["loadAgentState"] == {"threadId": "never", "threadExists": False,
                                                 "state": "{}", "messages": "[]"}
    assert unknown["data"] is None
    assert unknown["errors"][0]["extensions"]["code"] == "AGENT_NOT_FOUND"
    assert unknown["errors"][0]["path"] == ["loadAgentState"]


async def test_unexpected_query_failures_are_masked(llm: MockOpenAIServer,
                                                    serve_runtime: ServeRuntime,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = openai_runtime(llm)

    async def broken(thread_id: str) -> None:
        raise OSError("disk error at /var/lib/secret/threads.db")

    monkeypatch.setattr(runtime.store, "get", broken)
    async with serve_runtime(runtime) as served:
        answer = await query(served, LOAD_STATE, {"data": {"threadId": "t",
                                                           "agentName": "default"}})
    assert answer["data"] is None
    assert answer["errors"][0]["extensions"]["code"] == "UNKNOWN"
    assert "secret" not in json.dumps(answer)


class BrokenCounters:
    """A rate-limit backend that fails as no backend should (a bug, a driver's surprise)."""

    async def hit(self, *args: Any) -> float:
        raise RuntimeError("counter store at /var/lib/secret/limits failed")

    async def acquire(self, *args: Any) -> bool:
        raise RuntimeError("counter store at /var/lib/secret/limits failed")

    async def release(self, *args: Any) -> None:
        return None

    async def aclose(self) -> None:
        return None


async def test_a_failure_outside_any_operation_is_a_graphql_error(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """A failure before the operation ran (here, a limiter's backend) answered a GraphQL
    client with the AG-UI form of a 500, which the 1.10 client cannot read."""
    from copilot_runtime import CopilotRuntime, OpenAIAdapter, RateLimit

    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock"),
        rate_limit=RateLimit(runs_per_minute=10, backend=BrokenCounters()))
    async with serve_runtime(runtime) as served:
        response = await post(served, {"query": CHAT_DOCUMENT, "variables": {
            "data": chat_data([text_message("m1", "user", "Hi")])}})
        answer = await response.json()
        # (200: the 1.10 client reads no error answer from 400 to 500)
        assert response.status == 200
        assert answer["data"] is None
        assert answer["errors"][0]["extensions"]["code"] == "UNKNOWN"
        assert answer["errors"][0]["extensions"]["statusCode"] == 500
        assert "secret" not in json.dumps(answer)
        other = await post(served, {"query": CHAT_DOCUMENT, "variables": {
            "data": chat_data([text_message("m2", "user", "Hi")])}}, OTHER_CLIENT_HEADERS)
        assert other.status == 500
        plain = await served.post("/agent/default/run", {
            "threadId": "t", "runId": "r", "messages": [], "tools": [], "context": [],
            "state": {}, "forwardedProps": {}})
        assert plain.status == 500
        assert (await plain.json())["error"] == "internal_error"


# ---- request errors and dispatch -------------------------------------------------------------


async def test_requests_that_cannot_run(llm: MockOpenAIServer,
                                        serve_runtime: ServeRuntime) -> None:
    async def answer(body: Any = None, *, raw: bytes | None = None,
                     headers: dict[str, str] | None = None) -> tuple[int, Any]:
        response = await post(served, body, headers, raw=raw)
        return response.status, await response.json()

    requests: dict[str, dict[str, Any]] = {
        "parse": {"body": {"query": "mutation { generateCopilotResponse( }"}},
        "validation": {"body": {"query": "{ hello nope }"}},
        "coercion": {"body": {"query": CHAT_DOCUMENT, "variables": {
            "data": {**user_turn("hi"), "frontend": None}}}},
        "date": {"body": {"query": CHAT_DOCUMENT, "variables": {"data": chat_data(
            [{**text_message("u", "user", "hi"), "createdAt": "yesterday"}])}}},
        "properties": {"body": {"query": CHAT_DOCUMENT, "variables": {
            "data": user_turn("hi"), "properties": [1]}}},
        "no query": {"body": {"query": ""}},
        "variables": {"body": {"query": "{ hello }", "variables": [1]}},
        "operation": {"body": {"query": "query a { hello } query b { hello }"}},
        "unknown operation": {"body": {"query": "query a { hello }", "operationName": "b"}},
        "bad json": {"raw": b'{"query": "{ hello }", "variables": {'},
    }
    async with serve_runtime(openai_runtime(llm)) as served:
        cases = {name: await answer(**request, headers=OTHER_CLIENT_HEADERS)
                 for name, request in requests.items() if name != "bad json"}
        kit = {name: await answer(**request) for name, request in requests.items()}
        envelope = await answer(raw=b'{"query": ', headers={"Content-Type": "application/json"})
    codes = {name: (status, [e.get("extensions", {}).get("code") for e in body["errors"]])
             for name, (status, body) in cases.items()}
    assert codes == {
        "parse": (400, ["GRAPHQL_PARSE_FAILED"]),
        "validation": (400, ["GRAPHQL_VALIDATION_FAILED"]),
        "coercion": (400, [None]),
        "date": (400, [None]),
        "properties": (400, [None]),
        "no query": (400, ["BAD_REQUEST"]),
        "variables": (400, ["BAD_REQUEST"]),
        "operation": (400, ["BAD_REQUEST"]),
        "unknown operation": (400, ["BAD_REQUEST"]),
    }
    # The 1.10 client gets each with 200 (else it shows "Unknown error occurred"), a code it
    # knows, and what happened beside it.
    assert {name: (status, [(e["extensions"]["code"], e["extensions"].get("runtimeCode"),
                             e["extensions"]["statusCode"]) for e in body["errors"]])
            for name, (status, body) in kit.items()} == {
        name: (200, [("MISUSE", code, 400) for code in codes.get(name, (0, ["BAD_REQUEST"]))[1]])
        for name in requests}
    # Without the GraphQL client's header, a body that is not JSON gets the envelope's answer.
    assert envelope == (400, {"error": "invalid_request", "message": "Invalid JSON payload"})
    assert not llm.requests


async def test_the_graphql_client_reads_every_refusal_in_its_form(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """Before: a request with the 1.10 client's header that was not one `{"query"}` body (a
    batch, an automatic persisted query's hash, a GET without `query`, a body that is not
    JSON) was answered in the AG-UI form, which that client cannot read; an APQ client could
    not tell that it should send the query itself."""
    persisted = {"persistedQuery": {"version": 1, "sha256Hash": "ab" * 32}}

    async def answer(method: str, body: bytes | None = None, *, params: Any = None,
                     headers: dict[str, str] | None = None
                     ) -> tuple[int, str | None, list[str | None], str]:
        response = await served.session.request(method, served.url, data=body, params=params,
                                                headers={**CLIENT_HEADERS, **(headers or {})})
        assert response.headers["x-copilotkit-runtime-version"] == "1.10.6"
        # With 200 (else the client shows "Unknown error occurred"), a code it knows, and
        # the real status and what happened beside it.
        assert response.status == 200
        errors = (await response.json())["errors"]
        assert {error["extensions"]["code"] for error in errors} == {"MISUSE"}
        return (errors[0]["extensions"]["statusCode"], response.headers.get("allow"),
                [error["extensions"]["runtimeCode"] for error in errors], errors[0]["message"])

    async with serve_runtime(openai_runtime(llm)) as served:
        batch = await answer("POST", orjson.dumps([{"query": "{ hello }"}] * 2))
        apq = await answer("POST", orjson.dumps({"extensions": persisted,
                                                  "operationName": "q", "variables": {}}))
        apq_get = await answer("GET", params={"extensions": json.dumps(persisted)})
        no_query = await answer("POST", b"{}")
        scalar = await answer("POST", b"1")
        put = await answer("PUT", orjson.dumps({"query": "{ hello }"}))
        plain = await answer("POST", b"{ hello }", headers={"Content-Type": "application/graphql"})
        # The query with its hash (an APQ client's second try) is served as usual.
        second = await served.session.post(served.url, headers=CLIENT_HEADERS, data=orjson.dumps(
            {"query": "{ hello }", "extensions": persisted}))
        # Without the header, the single-route envelope answers as before.
        envelope = await post(served, [{"query": "{ hello }"}],
                              {"Content-Type": "application/json"})
    async with serve_runtime(openai_runtime(llm), max_body_size=64) as served:
        large = await post(served, {"query": "{ " + "hello " * 20 + "}"})
        assert large.status == 200
        assert (await large.json())["errors"][0]["extensions"]["runtimeCode"] \
            == "PAYLOAD_TOO_LARGE"
        other = await post(served, {"query": "{ " + "hello " * 20 + "}"}, OTHER_CLIENT_HEADERS)
        assert other.status == 413
    assert batch[:3] == (400, None, ["BAD_REQUEST"])
    assert "one operation per request" in batch[3]
    # The message and code Apollo's persisted-query link looks for, to send the query instead.
    assert apq == (400, None, ["PERSISTED_QUERY_NOT_SUPPORTED"], "PersistedQueryNotSupported")
    assert apq_get == (405, "POST", ["PERSISTED_QUERY_NOT_SUPPORTED"],
                       "PersistedQueryNotSupported")
    assert no_query == (400, None, ["BAD_REQUEST"], "The request has no GraphQL query")
    assert scalar[:3] == (400, None, ["BAD_REQUEST"])
    assert put[:3] == (405, "POST", ["BAD_REQUEST"])
    assert plain[:3] == (415, None, ["BAD_REQUEST"])
    assert "application/json" in plain[3]
    assert (second.status, await second.json()) == (200, {"data": {"hello": "Hello World"}})
    assert envelope.status == 400
    assert await envelope.json() == {"error": "invalid_request", "message": "Missing method field"}


async def test_one_base_url_for_both_protocols(llm: MockOpenAIServer,
                                               serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm)) as served:
        session, url = served.session, served.url
        get_query = await session.get(url, params={"query": "{ hello }"},
                                      headers={"Accept": "application/json"})
        get_mutation = await session.get(url, params={
            "query": "mutation { generateCopilotResponse(data: {frontend: {actions: []}, "
                     "messages: [], metadata: {}}) { threadId } }"})
        get_bare = await session.get(url)
        # (before: 405, `Allow: POST`, where GET on the same URL answered)
        head_query = await session.head(url, params={"query": "{ hello }"})
        info = await post(served, {"method": "info"}, {"Content-Type": "application/json"})
        neither = await post(served, {"params": {}}, {"Content-Type": "application/json"})
        preflight = await session.options(url, headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers":
                "content-type,x-copilotkit-runtime-client-gql-version,authorization"})
        assert get_query.status == 200
        assert get_query.headers["content-type"] == "application/json; charset=utf-8"
        assert await get_query.json() == {"data": {"hello": "Hello World"}}
        assert head_query.status == 200
        assert head_query.headers["content-type"] == get_query.headers["content-type"]
        assert await head_query.read() == b""
        assert get_mutation.status == 405
        assert get_mutation.headers["allow"] == "POST"
        assert get_bare.status == 405
        assert info.status == 200
        assert "agents" in await info.json()
        assert neither.status == 400
        assert await neither.json() == {"error": "invalid_request",
                                        "message": "Missing method field"}
        assert preflight.status == 204
        assert preflight.headers["access-control-allow-headers"] == (
            "content-type,x-copilotkit-runtime-client-gql-version,authorization")


async def test_selections_aliases_and_labels(llm: MockOpenAIServer,
                                             serve_runtime: ServeRuntime) -> None:
    document = """
    mutation run($data: GenerateCopilotResponseInput!, $withStatus: Boolean!) {
      kind: __typename
      answer: generateCopilotResponse(data: $data) {
        thread: threadId
        ... on CopilotResponse @defer(label: "end") @include(if: $withStatus) {
          outcome: status { ... on BaseResponseStatus { code } }
        }
        items: messages @stream(label: "messages") {
          kind: __typename
          ... Parts
          ... on BaseMessageOutput @defer(label: "done") { status { __typename } }
        }
      }
    }
    fragment Parts on TextMessageOutput { words: content @stream(label: "words") @skip(if: false) }
    """
    async with serve_runtime(openai_runtime(llm)) as served:
        response = await post(served, {"query": document, "variables": {
            "data": user_turn("aliases"), "withStatus": True}})
        payloads = parse_multipart(await response.read())
        without = await post(served, {"query": document, "variables": {
            "data": user_turn("again", thread="t2"), "withStatus": False}})
        plain = parse_multipart(await without.read())
    data = merge(payloads)["data"]
    assert data["kind"] == "Mutation"
    answer = data["answer"]
    assert answer["thread"] == "gql-thread"
    assert answer["outcome"] == {"code": "Success"}
    (item,) = answer["items"]
    assert item["kind"] == "TextMessageOutput"
    assert "".join(item["words"]) == "echo: aliases"
    assert item["status"] == {"__typename": "SuccessMessageStatus"}
    labels = {e.get("label") for p in payloads[1:] for e in p["incremental"]}
    assert labels == {"end", "messages", "words", "done"}
    assert "outcome" not in merge(plain)["data"]["answer"]
