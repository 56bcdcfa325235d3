"""`CopilotKitRemoteEndpoint` against the real `copilotkit` SDK serving real graphs.

A module fixture makes `.venv-legacy` (copilotkit 0.1.87, see `agents_support/legacy_env`),
then starts the mock LLM and `agents_support/legacy_server.py` in it, as child processes.
The retry policy and header forwarding are tested against a small in-process fake.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from copilot_runtime import Action, BuiltInAgent, CopilotRuntime, OpenAIAdapter, UpstreamError
from copilot_runtime.agents.remote_endpoint import CopilotKitRemoteEndpoint, RetryPolicy
from copilot_runtime.testing import verify_events
from tests import background
from tests.agents_support.legacy_env import legacy_python
from tests.agents_support.processes import REPO_ROOT, child_process, free_port, mock_llm
from tests.conftest import ServeRuntime, run_input, text_of, types
from tests.gql.wire import chat_data, text_message
from tests.test_graphql_agents import history_of, states, texts


@pytest.fixture(scope="module")
def legacy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(remote endpoint URL, mock LLM base URL)."""
    background.result("legacy", timeout=600)  # made in the background from the start
    python = legacy_python()  # (says why, if that failed)
    logs = tmp_path_factory.mktemp("legacy")
    port = free_port()
    with mock_llm(logs) as llm_url, child_process(
            "legacy-server", [str(python), "-m", "tests.agents_support.legacy_server",
                              "--port", str(port)],
            ready_url=f"http://127.0.0.1:{port}/copilotkit/info", ready_method="POST",
            log_dir=logs, env={"LLM_BASE_URL": llm_url, "PYTHONPATH": str(REPO_ROOT)}):
        yield f"http://127.0.0.1:{port}/copilotkit", llm_url


async def legacy_runtime(url: str, llm_url: str) -> tuple[CopilotRuntime, Any]:
    endpoint = CopilotKitRemoteEndpoint(url)
    found = await endpoint.discover()
    default = BuiltInAgent(OpenAIAdapter(base_url=llm_url, api_key="sk-mock", max_retries=0),
                           actions=found.actions)
    return CopilotRuntime(agents={"default": default, **found.agents}), found


def thread() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def of_type(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


async def test_discovery(legacy: tuple[str, str], serve_runtime: ServeRuntime) -> None:
    runtime, found = await legacy_runtime(*legacy)
    assert {name: agent.kind for name, agent in found.agents.items()} == {
        "chat": "langgraph", "planner": "langgraph", "reporter": "langgraph",
        "asking": "langgraph", "scripted": "crewai"}
    add = next(a for a in found.actions if a.name == "add")
    assert add.description == "Add two numbers"
    assert add.parameters == {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "number", "description": "first"},
        "b": {"type": "number", "description": "second"}}}
    async with serve_runtime(runtime) as served:
        info = await (await served.session.get(served.url + "/info")).json()
    assert info["agents"]["chat"]["className"] == "RemoteEndpointAgent"
    assert info["agents"]["chat"]["description"] == "Chats and checks the weather"


async def test_discovered_actions_are_server_actions(legacy: tuple[str, str],
                                                     serve_runtime: ServeRuntime) -> None:
    runtime, _ = await legacy_runtime(*legacy)
    async with serve_runtime(runtime) as served:
        ok = await served.run(run_input('call:add {"a": 2, "b": 3}'))
        failed = await served.run(run_input("call:explode {}", thread=thread()))
    for events in (ok, failed):
        verify_events(events)
    (result,) = of_type(ok, "TOOL_CALL_RESULT")
    assert orjson.loads(result["content"]) == {"sum": 5}
    assert text_of(ok) == "echo: " + result["content"]
    (error,) = of_type(failed, "TOOL_CALL_RESULT")
    message = orjson.loads(error["content"])["error"]
    assert message.startswith("Remote action 'explode' answered HTTP 500"), message


async def test_langgraph_agent_chat_tools_and_follow_up(
        legacy: tuple[str, str], serve_runtime: ServeRuntime) -> None:
    runtime, _ = await legacy_runtime(*legacy)
    say_hello = {"name": "sayHello", "description": "Say hello",
                 "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}
    conversation = thread()
    async with serve_runtime(runtime) as served:
        chat = await served.run(run_input("Hello", thread=thread()), agent="chat")
        weather = await served.run(run_input('call:get_weather {"city":"Paris"}',
                                             thread=thread()), agent="chat")
        first = await served.run(run_input('call:sayHello {"name":"Ada"}', thread=conversation,
                                           tools=[say_hello]), agent="chat")
        (call,) = of_type(first, "TOOL_CALL_START")
        history = [
            {"id": "run-1-u", "role": "user", "content": 'call:sayHello {"name":"Ada"}'},
            {"id": call["parentMessageId"], "role": "assistant", "toolCalls": [
                {"id": call["toolCallId"], "type": "function",
                 "function": {"name": "sayHello", "arguments": '{"name":"Ada"}'}}]},
            {"id": "tool-1", "role": "tool", "toolCallId": call["toolCallId"],
             "content": "hi Ada"}]
        second = await served.run(run_input("", thread=conversation, run="run-2",
                                            tools=[say_hello], messages=history), agent="chat")
        state = await runtime.agents["chat"].endpoint.agent_state("chat", conversation)  # type: ignore[attr-defined]
    for events in (chat, weather, first, second):
        verify_events(events)
    assert text_of(chat) == "echo: Hello"
    assert [e["stepName"] for e in of_type(chat, "STEP_STARTED")] == ["chat"]
    (start,) = of_type(weather, "TOOL_CALL_START")
    (result,) = of_type(weather, "TOOL_CALL_RESULT")
    assert (start["toolCallName"], result["toolCallId"]) == ("get_weather", start["toolCallId"])
    assert json.loads(result["content"])["city"] == "Paris"
    assert text_of(weather) == "echo: " + result["content"]
    assert call["toolCallName"] == "sayHello"
    assert text_of(second) == "echo: hi Ada"
    assert state["threadExists"] is True
    # (the SDK's JSON representation: text has a role, calls a name, results a call id)
    shapes = [m.get("role") or ("call" if "name" in m else "result")
              for m in state["messages"]]
    assert shapes == ["user", "call", "result", "assistant"], state
    assert state["messages"][-1]["content"] == "echo: hi Ada"


async def test_state_sync_and_custom_events(legacy: tuple[str, str],
                                            serve_runtime: ServeRuntime) -> None:
    runtime, _ = await legacy_runtime(*legacy)
    async with serve_runtime(runtime) as served:
        planned = await served.run(run_input("Plan", thread=thread(),
                                             state={"items": ["mine"], "counter": 1}),
                                   agent="planner")
        reported = await served.run(run_input("Go", thread=thread()), agent="reporter")
    for events in (planned, reported):
        verify_events(events)
    assert text_of(planned) == "echo: items=['mine', 'item 2']"
    assert {"plan", "answer"} <= {e["stepName"] for e in of_type(planned, "STEP_STARTED")}
    states = of_type(planned, "STATE_SNAPSHOT")
    assert any(s["snapshot"].get("items") == ["mine", "item 2"] for s in states), states
    assert text_of(reported) == "Halfway there"
    assert {"type": "CUSTOM", "name": "Exit", "value": True} in reported
    first_state = of_type(reported, "STATE_SNAPSHOT")[0]["snapshot"]
    assert first_state.get("progress") in (None, 50)


async def stored(served: Any, conversation: str) -> list[dict[str, Any]]:
    """The thread's messages as the runtime keeps them, checked in order and unrepeated."""
    answer = await (await served.session.get(
        f"{served.url}/threads/{conversation}/messages")).json()
    messages: list[dict[str, Any]] = answer["messages"]
    ids = [m["id"] for m in messages]
    assert len(ids) == len(set(ids)), messages
    return messages


def roles(messages: list[dict[str, Any]]) -> list[str]:
    return ["call" if m.get("toolCalls") else m["role"] for m in messages]


async def test_a_turn_after_a_server_tool_continues_the_checkpoint(
        legacy: tuple[str, str], serve_runtime: ServeRuntime) -> None:
    runtime, _ = await legacy_runtime(*legacy)
    agent = runtime.agents["chat"]
    conversation = thread()
    async with serve_runtime(runtime) as served:
        first = await served.run(run_input('call:get_weather {"city":"Paris"}',
                                           thread=conversation), agent="chat")
        after_first = await stored(served, conversation)
        history = [*after_first, {"id": "run-2-u", "role": "user", "content": "thanks"}]
        second = await served.run(run_input("", thread=conversation, run="run-2",
                                            messages=history), agent="chat")
        after_second = await stored(served, conversation)
        replay = await served.run(run_input("", thread=conversation, run="run-3"),
                                  path="/agent/chat/connect")
        saved = await agent.load_state(conversation)  # type: ignore[attr-defined]
    for events in (first, second):
        verify_events(events)
    # The run tells the client the checkpoint's messages, the tool's result under the id
    # the service gave it (the client sends it back, and the service skips what it has).
    assert roles(after_first) == ["user", "call", "tool", "assistant"], after_first
    assert [m["id"] for m in after_first] == [m["id"] for m in saved.messages[:4]]
    assert of_type(first, "MESSAGES_SNAPSHOT")[-1]["messages"] == after_first
    assert not of_type(second, "RUN_ERROR"), second[-1]
    assert text_of(second) == "echo: thanks"
    assert roles(after_second) == ["user", "call", "tool", "assistant", "user", "assistant"]
    assert [m["id"] for m in after_second] == [m["id"] for m in saved.messages]
    assert of_type(replay, "MESSAGES_SNAPSHOT")[-1]["messages"] == after_second


async def test_the_graphql_client_follows_up_a_server_tool(
        legacy: tuple[str, str], serve_runtime: ServeRuntime) -> None:
    runtime, _ = await legacy_runtime(*legacy)
    conversation = thread()
    async with serve_runtime(runtime) as served:
        first = await served.generate(chat_data(
            [text_message("u1", "user", 'call:get_weather {"city":"Paris"}')],
            thread=conversation, agentSession={"agentName": "chat"}))
        final = states(first)[-1]
        second = await served.generate(chat_data(
            [*history_of(final), text_message("u2", "user", "thanks")], thread=conversation,
            agentSession={"agentName": "chat", "nodeName": final["nodeName"]}))
        saved = await runtime.agents["chat"].load_state(conversation)  # type: ignore[attr-defined]
    # The client replaces its history with the last agent state's: the checkpoint's ids.
    assert [m["id"] for m in final["state"]["messages"]] == [
        m["id"] for m in saved.messages[:1]] + [
        c["id"] for c in saved.messages[1]["toolCalls"]] + [
        m["id"] for m in saved.messages[2:4]]
    assert second["status"]["code"] == "Success", second["status"]
    assert texts(second) == ["echo: thanks"]
    assert [m.get("content") for m in states(second)[-1]["state"]["messages"]
            if "content" in m] == [
        'call:get_weather {"city":"Paris"}', texts(first)[0], "thanks", "echo: thanks"]
    assert len(saved.messages) == 6


async def test_the_graphql_client_keeps_a_runtime_actions_result_and_follows_up(
        legacy: tuple[str, str], serve_runtime: ServeRuntime) -> None:
    """The SDK sees a runtime action among the client's: its graph ends at the call, the
    runtime answers it, then the last sync carries the checkpoint, which lacks the answer.
    Before, that checkpoint's snapshot replaced the 1.10 client's history without the
    result; the next turn sent a call without a result."""
    found = await CopilotKitRemoteEndpoint(legacy[0]).discover()
    runtime = CopilotRuntime(agents=found.agents,
                             actions=[Action("lookup", lambda: {"answer": 42})],
                             service_adapter=OpenAIAdapter(base_url=legacy[1], api_key="sk-mock",
                                                           max_retries=0))
    conversation = thread()
    async with serve_runtime(runtime) as served:
        first = await served.generate(chat_data(
            [text_message("u1", "user", "call:lookup {}")], thread=conversation,
            agentSession={"agentName": "chat"}))
        final = states(first)[-1]
        second = await served.generate(chat_data(
            [*history_of(final), text_message("u2", "user", "thanks")], thread=conversation,
            agentSession={"agentName": "chat", "nodeName": final["nodeName"]}))
        saved = await runtime.agents["chat"].load_state(conversation)  # type: ignore[attr-defined]
    assert first["status"]["code"] == "Success", first["status"]
    held = final["state"]["messages"]
    assert [next(k for k in ("content", "arguments", "result") if k in m) for m in held] == [
        "content", "arguments", "result"], held
    assert orjson.loads(held[2]["result"]) == {"answer": 42}
    assert held[2]["actionExecutionId"] == held[1]["id"]
    assert second["status"]["code"] == "Success", second["status"]
    assert texts(second) == ["echo: thanks"]
    assert [m["role"] for m in saved.messages] == ["user", "assistant", "tool", "user",
                                                   "assistant"]


async def test_messages_a_node_returns_reach_the_chat(
        legacy: tuple[str, str], serve_runtime: ServeRuntime) -> None:
    runtime, _ = await legacy_runtime(*legacy)
    asked, reporting = thread(), thread()
    async with serve_runtime(runtime) as served:
        question = await served.run(run_input("ask me", thread=asked), agent="asking")
        answer = await served.run(run_input(
            "", thread=asked, run="run-2", messages=await stored(served, asked),
            forwardedProps={"command": {"resume": "cats"}}), agent="asking")
        answered = await stored(served, asked)
        reported = await served.run(run_input("Go", thread=reporting), agent="reporter")
        report = await stored(served, reporting)
    for events in (question, answer, reported):
        verify_events(events)
    assert any(e.get("name") == "on_interrupt" for e in of_type(question, "CUSTOM")), question
    assert [(m["role"], m["content"]) for m in answered] == [
        ("user", "ask me"), ("assistant", "topic=cats")]
    # (as the TypeScript runtime: the checkpoint's conversation, which the message emitted
    # by hand is not part of)
    assert [(m["role"], m["content"]) for m in report] == [
        ("user", "Go"), ("assistant", "Done")]


async def test_runtime_event_form(legacy: tuple[str, str], serve_runtime: ServeRuntime) -> None:
    runtime, _ = await legacy_runtime(*legacy)
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("Hello", thread=thread()), agent="scripted")
    verify_events(events)
    assert types(events) == [
        "RUN_STARTED", "STEP_STARTED", "STATE_SNAPSHOT", "TEXT_MESSAGE_START",
        "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END", "TOOL_CALL_START",
        "TOOL_CALL_ARGS", "TOOL_CALL_END", "TOOL_CALL_RESULT", "STATE_SNAPSHOT",
        "STEP_FINISHED", "RUN_FINISHED"]
    assert text_of(events) == "scripted: Hello"
    assert events[2]["snapshot"] == {"seen": "Hello", "count": 1}
    # (a snapshot, not a delta: this state is smaller than the patch that changes it)
    assert events[-3]["snapshot"] == {"seen": "Hello", "count": 1, "done": True}
    assert events[-4]["content"] == "found"


# ---- retries and headers, against an in-process fake ---------------------------------------


class FlakyEndpoint:
    """Answers each route with the statuses queued for it, then successfully."""

    def __init__(self) -> None:
        self.failures: dict[str, list[int]] = {}
        self.calls: dict[str, int] = {}
        self.headers: list[dict[str, str]] = []
        self.bodies: list[Any] = []  # (the agent runs')

    async def handle(self, request: web.Request) -> web.StreamResponse:
        route = request.match_info["route"]
        self.calls[route] = self.calls.get(route, 0) + 1
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        queued = self.failures.get(route) or []
        if queued:
            return web.json_response({"error": "try later"}, status=queued.pop(0))
        if route == "info":
            return web.json_response({"actions": [{"name": "ping", "parameters": []}],
                                      "agents": [{"name": "bot", "type": "crewai"}]})
        if route == "actions/execute":
            return web.json_response({"result": "pong"})
        body = await request.json()
        self.bodies.append(body)
        lines = [{"type": "TextMessageStart", "messageId": "m"},
                 {"type": "TextMessageContent", "messageId": "m",
                  "content": f"hi {body['messages'][-1]['content']}"},
                 {"type": "TextMessageEnd", "messageId": "m"}]
        return web.Response(body=b"".join(orjson.dumps(x) + b"\n" for x in lines),
                            content_type="application/json")


@pytest.fixture
async def flaky() -> AsyncIterator[tuple[FlakyEndpoint, str]]:
    fake = FlakyEndpoint()
    app = web.Application()
    app.router.add_post("/ck/{route:.*}", fake.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield fake, f"http://127.0.0.1:{port}/ck"
    await runner.cleanup()


FAST = RetryPolicy(base_delay=0.01, max_delay=0.02)


async def test_safe_calls_retry_on_every_retryable_status(
        flaky: tuple[FlakyEndpoint, str]) -> None:
    fake, url = flaky
    endpoint = CopilotKitRemoteEndpoint(url, retry=FAST)
    fake.failures["info"] = [503, 502, 429]
    found = await endpoint.discover()
    assert fake.calls["info"] == 4
    assert list(found.agents) == ["bot"]
    fake.failures["info"] = [504, 504, 504, 504]
    with pytest.raises(UpstreamError, match="answered HTTP 504"):
        await endpoint.discover()
    assert fake.calls["info"] == 8  # one try and three retries
    await endpoint.aclose()


async def test_calls_with_effects_retry_only_when_nothing_ran(
        flaky: tuple[FlakyEndpoint, str]) -> None:
    fake, url = flaky
    endpoint = CopilotKitRemoteEndpoint(url, retry=FAST)
    fake.failures["actions/execute"] = [503, 429]
    assert await endpoint.execute_action("ping", {}) == "pong"
    assert fake.calls["actions/execute"] == 3
    fake.failures["actions/execute"] = [502]  # a gateway error: the action may have run
    with pytest.raises(UpstreamError, match="answered HTTP 502"):
        await endpoint.execute_action("ping", {})
    assert fake.calls["actions/execute"] == 4
    await endpoint.aclose()
    unreachable = CopilotKitRemoteEndpoint(f"http://127.0.0.1:{free_port()}/ck",
                                           retry=FAST)
    with pytest.raises(UpstreamError, match="could not be reached"):
        await unreachable.execute_action("ping", {})
    await unreachable.aclose()


async def test_agent_runs_forward_headers_by_policy(flaky: tuple[FlakyEndpoint, str],
                                                    serve_runtime: ServeRuntime) -> None:
    fake, url = flaky
    endpoint = CopilotKitRemoteEndpoint(url, headers={"X-Service": "runtime"}, retry=FAST)
    found = await endpoint.discover()
    fake.failures["agents/execute"] = [503]
    async with serve_runtime(CopilotRuntime(agents=dict(found.agents))) as served:
        response = await served.post("/agent/bot/run", run_input("Ada"), headers={
            "Authorization": "Bearer u", "X-Tenant": "acme", "Cookie": "s=1",
            "X-Forwarded-For": "1.2.3.4"})
        events = [orjson.loads(frame[frame.index(b"data: ") + 6:])
                  for frame in (await response.read()).split(b"\n\n") if b"data: " in frame]
    verify_events(events)
    assert text_of(events) == "hi Ada"
    assert fake.calls["agents/execute"] == 2  # 503: the run had not started, so retried
    sent = fake.headers[-1]
    assert (sent["authorization"], sent["x-tenant"], sent["x-service"]) == (
        "Bearer u", "acme", "runtime")
    assert "cookie" not in sent
    assert "x-forwarded-for" not in sent


async def test_a_non_ascii_forwarded_header_reaches_the_endpoint_byte_for_byte(
        flaky: tuple[FlakyEndpoint, str], serve_runtime: ServeRuntime) -> None:
    """The client's UTF-8 bytes arrived UTF-8 encoded twice before."""
    fake, url = flaky
    found = await CopilotKitRemoteEndpoint(url, retry=FAST).discover()
    async with serve_runtime(CopilotRuntime(agents=dict(found.agents))) as served:
        response = await served.post("/agent/bot/run", run_input("Ada"),
                                     headers={"X-User-Name": "José"})  # (sent as UTF-8)
        assert response.status == 200
        await response.read()
    sent = fake.headers[-1]["x-user-name"]
    assert sent.encode("utf-8", "surrogateescape") == "José".encode()


async def test_a_tool_results_error_reaches_the_endpoint(
        flaky: tuple[FlakyEndpoint, str], serve_runtime: ServeRuntime) -> None:
    """The legacy messages have no error field: a frontend tool's failed result reached the
    endpoint as an empty result, which its model took for a success."""
    fake, url = flaky
    found = await CopilotKitRemoteEndpoint(url, retry=FAST).discover()
    messages = [{"id": "u1", "role": "user", "content": "hi"},
                {"id": "a1", "role": "assistant", "toolCalls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "lookup", "arguments": "{}"}},
                    {"id": "c2", "type": "function",
                     "function": {"name": "lookup", "arguments": "{}"}}]},
                {"id": "t1", "role": "tool", "toolCallId": "c1", "content": "",
                 "error": "lookup failed: quota exceeded"},
                {"id": "t2", "role": "tool", "toolCallId": "c2", "content": "rows",
                 "error": "partial"},
                {"id": "u2", "role": "user", "content": "why?"}]
    async with serve_runtime(CopilotRuntime(agents=dict(found.agents))) as served:
        events = await served.run(run_input("", messages=messages), agent="bot")
    verify_events(events)
    results = [m for m in fake.bodies[-1]["messages"] if m["type"] == "ResultMessage"]
    # (as the built-in agent tells its model; a result that says something says it)
    assert [(m["actionExecutionId"], m["result"]) for m in results] == [
        ("c1", "Error: lookup failed: quota exceeded"), ("c2", "rows")]
