"""`LangGraphAgent`: real LangGraph graphs in-process, their model the loopback mock LLM."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from langgraph.graph import END, START, StateGraph

from copilot_runtime import BuiltInAgent, ConfigurationError, CopilotRuntime, OpenAIAdapter
from copilot_runtime.agents.http import HttpAgent
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.testing import MockOpenAIServer, verify_events
from tests.agents_support import graphs
from tests.agents_support.agui_server import ScriptedAGUIServer
from tests.conftest import ServeRuntime, run_input, text_of, types

SAY_HELLO = {"name": "sayHello", "description": "Say hello to someone",
             "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                            "required": ["name"]}}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as http:
        yield http


def lg_runtime(graph: Any, **agents: Any) -> CopilotRuntime:
    return CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph), **agents})


def of_type(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


async def test_chat(llm: MockOpenAIServer, client: httpx.AsyncClient,
                    serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(lg_runtime(graphs.chat_graph(llm.base_url, client))) as served:
        info = await (await served.session.get(served.url + "/info")).json()
        events = await served.run(run_input("Hello", context=[
            {"description": "user name", "value": "Ada"}]), agent="lg")
    verify_events(events)
    entry = info["agents"]["lg"]
    assert entry["className"] == "LangGraphAgent"
    assert entry["capabilities"]["state"]["deltas"] is True
    assert text_of(events) == "echo: Hello"
    assert types(events)[:3] == ["RUN_STARTED", "STEP_STARTED", "TEXT_MESSAGE_START"]
    assert "RAW" not in types(events)  # raw LangChain events stay off the wire
    (snapshot,) = of_type(events, "MESSAGES_SNAPSHOT")
    assert [(m["role"], m.get("content")) for m in snapshot["messages"]] == [
        ("user", "Hello"), ("assistant", "echo: Hello")]
    # the message streamed is the message in the snapshot
    assert snapshot["messages"][1]["id"] == of_type(events, "TEXT_MESSAGE_START")[0]["messageId"]
    for state in of_type(events, "STATE_SNAPSHOT"):
        assert not {"messages", "copilotkit", "tools", "ag-ui"} & state["snapshot"].keys()
    # the frontend's context reached the graph through state["copilotkit"]["context"]
    assert "'user name'" in llm.requests[0]["messages"][0]["content"]


async def test_server_tool_loop(llm: MockOpenAIServer, client: httpx.AsyncClient,
                                serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(lg_runtime(graphs.chat_graph(llm.base_url, client))) as served:
        events = await served.run(run_input('call:get_weather {"city":"Paris"}'), agent="lg")
    verify_events(events)
    (start,) = of_type(events, "TOOL_CALL_START")
    (result,) = of_type(events, "TOOL_CALL_RESULT")
    assert start["toolCallName"] == "get_weather"
    assert result["toolCallId"] == start["toolCallId"]
    weather = {"city": "Paris", "temperature": 18, "conditions": "cloudy"}
    assert orjson.loads(result["content"]) == weather
    assert text_of(events) == "echo: " + result["content"]
    steps = [e["stepName"] for e in of_type(events, "STEP_STARTED")]
    assert steps == ["chat", "tools", "chat"]


async def test_frontend_tool_then_follow_up(llm: MockOpenAIServer, client: httpx.AsyncClient,
                                            serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(lg_runtime(graphs.chat_graph(llm.base_url, client))) as served:
        first = await served.run(run_input('call:sayHello {"name":"Ada"}', thread="t-ft",
                                           tools=[SAY_HELLO]), agent="lg")
        verify_events(first)
        (start,) = of_type(first, "TOOL_CALL_START")
        assert start["toolCallName"] == "sayHello"
        assert "TOOL_CALL_RESULT" not in types(first)  # the client runs frontend tools
        assert [t["function"]["name"] for t in llm.requests[0]["tools"]] == [
            "get_weather", "sayHello"]
        messages = [
            {"id": "run-1-u", "role": "user", "content": 'call:sayHello {"name":"Ada"}'},
            {"id": start["parentMessageId"], "role": "assistant", "toolCalls": [
                {"id": start["toolCallId"], "type": "function", "function": {
                    "name": "sayHello", "arguments": '{"name":"Ada"}'}}]},
            {"id": "tool-1", "role": "tool", "toolCallId": start["toolCallId"],
             "content": '{"greeting":"Hello, Ada!"}'},
        ]
        second = await served.run(run_input("", thread="t-ft", run="run-2", tools=[SAY_HELLO],
                                            messages=messages), agent="lg")
    verify_events(second)
    assert text_of(second) == 'echo: {"greeting":"Hello, Ada!"}'
    (snapshot,) = of_type(second, "MESSAGES_SNAPSHOT")
    assert [m["role"] for m in snapshot["messages"]] == ["user", "assistant", "tool", "assistant"]


async def test_shared_state_read_and_written(llm: MockOpenAIServer, client: httpx.AsyncClient,
                                             serve_runtime: ServeRuntime) -> None:
    graph = graphs.shared_state_graph(llm.base_url, client)
    async with serve_runtime(lg_runtime(graph)) as served:
        first = await served.run(run_input("Plan", thread="t-state", state={
            "items": ["from the frontend"], "counter": 5}), agent="lg")
        # the frontend edits the state the agent wrote, and runs again
        edited = {"items": ["edited", "by the user"], "counter": 10, "note": "1 items"}
        second = await served.run(run_input("Again", thread="t-state", run="run-2",
                                            state=edited), agent="lg")
        stored = await (await served.session.get(
            served.url + "/threads/t-state/state")).json()
    for events in (first, second):
        verify_events(events)
    snapshots = of_type(first, "STATE_SNAPSHOT")
    assert snapshots[0]["snapshot"] == {"items": ["from the frontend", "item 2"], "counter": 6}
    assert of_type(first, "STATE_DELTA")[0]["delta"] == [
        {"op": "add", "path": "/note", "value": "2 items"}]
    assert text_of(first) == "echo: items=['from the frontend', 'item 2']"
    assert text_of(second) == "echo: items=['edited', 'by the user', 'item 3']"
    assert stored["state"] == {"items": ["edited", "by the user", "item 3"], "counter": 11,
                               "note": "3 items"}


async def test_copilotkit_custom_events_and_emit_metadata(
        llm: MockOpenAIServer, client: httpx.AsyncClient, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(lg_runtime(graphs.custom_events_graph(llm.base_url, client))) \
            as served:
        events = await served.run(run_input("Go", state={"progress": 0}), agent="lg")
    verify_events(events)
    # the quiet model call ran but did not reach the client
    assert len(llm.requests) == 2
    assert text_of(events) == "Working on itecho: Go"
    (manual,) = of_type(events, "TOOL_CALL_START")
    assert (manual["toolCallId"], manual["toolCallName"]) == ("manual-call-1", "showProgress")
    assert of_type(events, "TOOL_CALL_ARGS")[0]["delta"] == '{"percent": 50}'
    assert of_type(events, "CUSTOM") == [{"type": "CUSTOM", "name": "Exit", "value": True}]
    # intermediate state is merged into the state, not a replacement of it
    first_state = of_type(events, "STATE_SNAPSHOT")[0]["snapshot"]
    assert first_state == {"progress": 50}
    final = {"progress": 100, "done": True}
    last = [e for e in events if e["type"] in ("STATE_SNAPSHOT", "STATE_DELTA")][-1]
    assert last.get("snapshot") == final or last.get("delta") == [
        {"op": "replace", "path": "/progress", "value": 100},
        {"op": "add", "path": "/done", "value": True}]


async def test_emit_tool_calls_by_name(llm: MockOpenAIServer, client: httpx.AsyncClient,
                                       serve_runtime: ServeRuntime) -> None:
    tools = [{**SAY_HELLO, "name": name} for name in ("hiddenTool", "visibleTool")]
    async with serve_runtime(lg_runtime(graphs.selective_tools_graph(llm.base_url, client))) \
            as served:
        events = await served.run(run_input('call:hiddenTool {"name":"a"}\n'
                                            'call:visibleTool {"name":"b"}', tools=tools),
                                  agent="lg")
    verify_events(events)
    assert [e["toolCallName"] for e in of_type(events, "TOOL_CALL_START")] == ["visibleTool"]


async def test_graph_failure_is_a_run_error_without_internals(
        serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(lg_runtime(graphs.failing_graph())) as served:
        events = await served.run(run_input("x"), agent="lg")
    verify_events(events)
    assert events[-1] == {"type": "RUN_ERROR", "message": "Agent 'lg' failed unexpectedly",
                          "code": "AGENT_ERROR"}


async def test_model_failure_is_an_upstream_error(llm: MockOpenAIServer, client: httpx.AsyncClient,
                                                  serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(lg_runtime(graphs.chat_graph(llm.base_url, client))) as served:
        events = await served.run(run_input("error:503"), agent="lg")
    verify_events(events)
    assert events[-1] == {"type": "RUN_ERROR", "code": "UPSTREAM_ERROR",
                          "message": "The model provider answered HTTP 503"}


async def test_agents_side_by_side(llm: MockOpenAIServer, client: httpx.AsyncClient,
                                   serve_runtime: ServeRuntime) -> None:
    """A graph, a second graph, a remote AG-UI agent and the built-in agent, concurrently."""
    async with ScriptedAGUIServer() as remote:
        runtime = CopilotRuntime(agents={
            "chat": LangGraphAgent(name="chat", graph=graphs.chat_graph(llm.base_url, client)),
            "planner": LangGraphAgent(name="planner",
                                      graph=graphs.shared_state_graph(llm.base_url, client)),
            "remote": HttpAgent(remote.url),
            "default": BuiltInAgent(OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock",
                                                  max_retries=0)),
        })
        async with serve_runtime(runtime) as served:
            info = await (await served.session.get(served.url + "/info")).json()
            results = await asyncio.gather(
                served.run(run_input("slow:30 one", thread="a"), agent="chat"),
                served.run(run_input("slow:30 two", thread="b"), agent="chat"),
                served.run(run_input("three", thread="c", state={"items": []}),
                           agent="planner"),
                served.run(run_input("four", thread="d"), agent="remote"),
                served.run(run_input("five", thread="e"), agent="default"))
    assert {k: v["className"] for k, v in info["agents"].items()} == {
        "chat": "LangGraphAgent", "planner": "LangGraphAgent", "remote": "HttpAgent",
        "default": "BuiltInAgent"}
    for events in results:
        verify_events(events)
    assert [text_of(e) for e in results] == [
        "echo: slow:30 one", "echo: slow:30 two", "echo: items=['item 1']", "remote: four",
        "echo: five"]


async def test_stop_cancels_the_graph_and_its_model_call(
        llm: MockOpenAIServer, client: httpx.AsyncClient, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(lg_runtime(graphs.chat_graph(llm.base_url, client))) as served:
        response = await served.post("/agent/lg/run", run_input("slow:100 stop me",
                                                                thread="t-stop"))
        await response.content.readuntil(b"TEXT_MESSAGE_CONTENT")
        stop = await served.post("/agent/lg/stop/t-stop", {})
        assert (await stop.json())["stopped"] is True
        rest = await response.read()
        for _ in range(100):
            if llm.cancelled_streams:
                break
            await asyncio.sleep(0.01)
    assert llm.cancelled_streams == 1
    assert rest.rstrip().endswith(b'"type":"RUN_FINISHED","threadId":"t-stop","runId":"run-1"}')


async def test_raw_events_on_request(llm: MockOpenAIServer, client: httpx.AsyncClient,
                                     serve_runtime: ServeRuntime) -> None:
    agent = LangGraphAgent(name="lg", graph=graphs.chat_graph(llm.base_url, client),
                           emit_raw_events=True)
    async with serve_runtime(CopilotRuntime(agents={"lg": agent})) as served:
        events = await served.run(run_input("Hi"), agent="lg")
    # (verify_events reads nulls inside RAW's LangChain event as protocol nulls: skip RAW)
    verify_events([e for e in events if e["type"] != "RAW"])
    raw = of_type(events, "RAW")
    assert raw
    assert {e["event"]["event"] for e in raw} >= {"on_chat_model_stream", "on_chain_end"}


def test_graph_without_checkpointer_is_refused() -> None:
    builder = StateGraph(graphs.CopilotKitState)
    builder.add_node("noop", lambda state: {})
    builder.add_edge(START, "noop")
    builder.add_edge("noop", END)
    with pytest.raises(ConfigurationError, match="checkpointer"):
        LangGraphAgent(name="x", graph=builder.compile())
