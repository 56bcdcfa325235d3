"""Agents over the GraphQL protocol, in-process over real HTTP: real LangGraph graphs on the
loopback mock LLM, a scripted remote AG-UI agent, a fake CopilotKit remote endpoint, and
scripted agents where a test needs exact events.

Requests use the 1.10 client's own document (`CLIENT_DOCUMENT`) and are merged as urql
merges them; `tests/test_graphql_agents_real_client.py` drives the real client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import httpx
import orjson
import pydantic
import pytest
from aiohttp import web
from copilotkit import CopilotKitState
from copilotkit.langgraph import copilotkit_emit_tool_call, copilotkit_interrupt
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from typing_extensions import TypedDict

from copilot_runtime import (
    Action,
    Agent,
    BuiltInAgent,
    CopilotRuntime,
    OpenAIAdapter,
    RunContext,
    RunInput,
)
from copilot_runtime import events as ev
from copilot_runtime.agents._lg_state import load_graph_state
from copilot_runtime.agents.http import HttpAgent
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.agents.langgraph_platform import LangGraphPlatformAgent
from copilot_runtime.agents.remote_endpoint import CopilotKitRemoteEndpoint
from copilot_runtime.events import EventBatches
from copilot_runtime.testing import MockOpenAIServer
from tests.agents_support import graphs
from tests.agents_support.agui_server import ScriptedAGUIServer
from tests.conftest import Served, ServeRuntime, openai_runtime, run_input
from tests.gql.wire import (
    CLIENT_DOCUMENT,
    CLIENT_HEADERS,
    call_message,
    chat_data,
    merge,
    parse_multipart,
    result_message,
    text_message,
)

LOAD_STATE = """query load($data: LoadAgentStateInput!) {
  loadAgentState(data: $data) { threadId threadExists state messages } }"""
AGENTS = "query { availableAgents { agents { name id description } } }"
SAY_HELLO = {"name": "sayHello", "description": "Says hello", "available": "enabled",
             "jsonSchema": '{"type":"object","properties":{"name":{"type":"string"}}}'}

Json = dict[str, Any]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as http:
        yield http


async def turn(served: Served, data: Json, headers: dict[str, str] | None = None) -> Json:
    """One `generateCopilotResponse` as the client sends it, merged as the client merges it."""
    response = await served.session.post(served.url, data=orjson.dumps(
        {"query": CLIENT_DOCUMENT, "variables": {"data": data}}),
        headers={**CLIENT_HEADERS, **(headers or {})})
    assert response.status == 200, await response.text()
    merged = merge(parse_multipart(await response.read()))
    assert "errors" not in merged
    result: Json = merged["data"]["generateCopilotResponse"]
    return result


def session(agent: str, text: str, thread: str, **extra: Any) -> Json:
    messages = [text_message("sys", "system", "Be brief."), text_message(f"{thread}-u", "user",
                                                                        text)]
    return chat_data(messages, thread=thread, agentSession={"agentName": agent}, **extra)


async def query(served: Served, text: str, variables: Json | None = None,
                headers: dict[str, str] | None = None) -> Any:
    response = await served.session.post(served.url, data=orjson.dumps(
        {"query": text, "variables": variables or {}}), headers={**CLIENT_HEADERS,
                                                                 **(headers or {})})
    assert response.status == 200, await response.text()
    return await response.json()


def states(response: Json) -> list[Json]:
    return [{**m, "state": orjson.loads(m["state"])} for m in response["messages"]
            if m["__typename"] == "AgentStateMessageOutput"]


def kinds(response: Json) -> list[str]:
    return [m["__typename"].removesuffix("MessageOutput") for m in response["messages"]]


def texts(response: Json) -> list[str]:
    return ["".join(m["content"]) for m in response["messages"]
            if m["__typename"] == "TextMessageOutput"]


def history_of(final: Json) -> list[Json]:
    """The client's history after a response: the conversation in the last state message,
    as `MessageInput`s (what react-core sends next)."""
    items = []
    for item in final["state"]["messages"]:
        if "content" in item:
            items.append(text_message(item["id"], item["role"], item["content"]))
        elif "arguments" in item:
            items.append(call_message(item["id"], item["name"], json.dumps(item["arguments"]),
                                      item.get("parentMessageId")))
        else:
            items.append(result_message(item["id"], item["actionExecutionId"],
                                        item["actionName"], item["result"]))
    return items


class Scripted(Agent):
    """Yields the given batches; remembers each run's input and context."""

    def __init__(self, *batches: list[Json], description: str = "scripted") -> None:
        super().__init__(description=description)
        self.batches = batches
        self.seen: list[tuple[RunInput, RunContext]] = []

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        self.seen.append((input, context))
        return self._events()

    async def _events(self) -> AsyncIterator[list[Json]]:
        for batch in self.batches:
            yield batch


class FakeEndpoint:
    """A CopilotKit remote endpoint (`add_fastapi_endpoint`) with one action and one agent."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], Json]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> FakeEndpoint:
        app = web.Application()
        app.router.add_post("/copilotkit/{route:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{port}/copilotkit"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _answer(self, request: web.Request) -> web.Response:
        route = request.match_info["route"]
        body = await request.json()
        self.requests.append((route, {k.lower(): v for k, v in request.headers.items()}, body))
        if route == "info":
            return web.json_response({
                "actions": [{"name": "add", "description": "Add two numbers", "parameters": [
                    {"name": "a", "type": "number"}, {"name": "b", "type": "number"}]}],
                "agents": [{"name": "researcher", "description": "Researches things",
                            "type": "langgraph"}],
                "sdkVersion": "0.1.87"})
        if route == "actions/execute":
            arguments = body["arguments"]
            return web.json_response({"result": {"sum": arguments["a"] + arguments["b"]}})
        assert route == "agents/state"
        messages = [{"role": "user", "content": "Find it", "id": "u1"},
                    {"role": "assistant", "content": "Found", "id": "a1",
                     "parentMessageId": "a1"}]
        return web.json_response({"threadId": body["threadId"], "threadExists": True,
                                  "state": {"topic": "otters", "messages": messages},
                                  "messages": messages})


def approval_graph() -> Any:
    """Asks for approval the `copilotkit` SDK's way, then answers with the reply."""

    async def ask(state: CopilotKitState) -> Json:
        answer, _ = copilotkit_interrupt(action="approveTransfer", args={"amount": 3})
        return {"messages": [AIMessage(content=f"approved: {answer}")]}

    graph = StateGraph(CopilotKitState)
    graph.add_node("ask", ask)
    graph.add_edge(START, "ask")
    graph.add_edge("ask", END)
    return graph.compile(checkpointer=InMemorySaver())


# ---- availableAgents ------------------------------------------------------------------------


async def test_available_agents_without_internals(llm: MockOpenAIServer,
                                                  serve_runtime: ServeRuntime) -> None:
    async with FakeEndpoint() as fake:
        found = await CopilotKitRemoteEndpoint(fake.url).discover()
        platform = LangGraphPlatformAgent(deployment_url="http://10.9.8.7:2024", graph_id="g",
                                          description="On the platform")
        runtime = openai_runtime(llm, agents={
            "remote": HttpAgent("http://10.9.8.7:9/secret/agent", description="Remote"),
            "platform": platform, **found.agents})
        async with serve_runtime(runtime) as served:
            answer = await query(served, AGENTS)
    assert answer["data"]["availableAgents"]["agents"] == [
        {"name": "remote", "id": "remote", "description": "Remote"},
        {"name": "platform", "id": "platform", "description": "On the platform"},
        {"name": "researcher", "id": "researcher", "description": "Researches things"},
    ]  # the built-in agent stands for the service adapter and stays hidden
    assert "10.9.8.7" not in json.dumps(answer)
    assert fake.url not in json.dumps(answer)


# ---- LangGraph over GraphQL -----------------------------------------------------------------


async def test_langgraph_chat_with_agent_state_messages(
        llm: MockOpenAIServer, client: httpx.AsyncClient, serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
        name="lg", graph=graphs.chat_graph(llm.base_url, client))})
    async with serve_runtime(runtime) as served:
        first = await turn(served, session("lg", "Hello", "t-chat"))
        final = states(first)[-1]
        # The client keeps the session at the node it was told, with the synced history.
        follow = chat_data([text_message("sys", "system", "Be brief."), *history_of(final),
                            text_message("u2", "user", "Again")], thread="t-chat",
                           agentSession={"agentName": "lg", "threadId": final["threadId"],
                                         "nodeName": final["nodeName"]})
        second = await turn(served, follow)
    assert first["status"] == {"code": "Success", "__typename": "SuccessResponseStatus"}
    assert texts(first) == ["echo: Hello"]
    assert texts(second) == ["echo: Again"]
    assert kinds(first) == ["AgentState", "Text", "AgentState", "AgentState", "AgentState",
                            "AgentState"]
    timeline = [(s["nodeName"], s["active"], s["running"]) for s in states(first)]
    assert timeline == [("chat", True, True), ("chat", True, True), ("chat", False, True),
                        ("chat", True, True), ("__end__", False, True)]
    for message in states(first):
        assert message["agentName"] == "lg"
        assert message["threadId"] == "t-chat"
        assert message["role"] == "assistant"
        assert message["runId"] == states(first)[0]["runId"]
        assert message["status"] == {"code": "Success", "__typename": "SuccessMessageStatus"}
    (answer,) = [m for m in first["messages"] if m["__typename"] == "TextMessageOutput"]
    assert final["state"] == {"messages": [
        {"id": "t-chat-u", "role": "user", "content": "Hello"},
        {"id": answer["id"], "role": "assistant", "content": "echo: Hello",
         "parentMessageId": answer["id"]}]}
    assert [m["content"] for m in states(second)[-1]["state"]["messages"]] == [
        "Hello", "echo: Hello", "Again", "echo: Again"]
    assert states(second)[0]["runId"] != states(first)[0]["runId"]


async def test_tool_calling_graph(llm: MockOpenAIServer, client: httpx.AsyncClient,
                                  serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
        name="lg", graph=graphs.chat_graph(llm.base_url, client))})
    async with serve_runtime(runtime) as served:
        server = await turn(served, session("lg", 'call:get_weather {"city": "Paris"}', "t-srv"))
        frontend = await turn(served, session("lg", 'call:sayHello {"name": "Ada"}', "t-fe",
                                              frontend={"actions": [SAY_HELLO]}))
        final = states(frontend)[-1]
        (call,) = [m for m in frontend["messages"]
                   if m["__typename"] == "ActionExecutionMessageOutput"]
        follow = chat_data([*history_of(final), result_message("res-1", call["id"], "sayHello",
                                                               '"Hello, Ada!"')],
                           thread="t-fe", frontend={"actions": [SAY_HELLO]},
                           agentSession={"agentName": "lg", "nodeName": final["nodeName"]})
        answered = await turn(served, follow)
    # The graph's own tool: its call, its result right after, then the answer.
    order = [k for k in kinds(server) if k != "AgentState"]
    assert order == ["ActionExecution", "Result", "Text"]
    (result,) = [m for m in server["messages"] if m["__typename"] == "ResultMessageOutput"]
    assert json.loads(result["result"]) == {"city": "Paris", "temperature": 18,
                                            "conditions": "cloudy"}
    nodes = [s["nodeName"] for s in states(server) if s["active"]]
    assert "tools" in nodes
    # A frontend action: the call completes (status Success, so the client runs it), no result.
    assert call["name"] == "sayHello"
    assert "".join(call["arguments"]) == '{"name":"Ada"}'
    assert call["status"]["code"] == "Success"
    assert "Result" not in kinds(frontend)
    assert final["state"]["messages"][-1]["name"] == "sayHello"
    assert texts(answered) == ['echo: "Hello, Ada!"']


def unanswered_call_graphs(base_url: str, client: httpx.AsyncClient) -> dict[str, Any]:
    """Two graphs whose tool call gets no result from its tool, then an answer: a tool that
    raises in a `ToolNode(handle_tool_errors=True)` (its result is ToolNode's error
    message), and a call a node only announces (no result at all)."""
    llm = graphs.model(base_url, client)

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        raise ValueError("backend down")

    async def chat(state: CopilotKitState, config: RunnableConfig) -> Json:
        if state["messages"][-1].type == "tool":
            return {"messages": [await llm.ainvoke("the answer after the tool", config)]}
        return {"messages": [await llm.bind_tools([lookup]).ainvoke(state["messages"], config)]}

    def route(state: CopilotKitState) -> Literal["tools", "__end__"]:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    failing = StateGraph(CopilotKitState)
    failing.add_node("chat", chat)
    failing.add_node("tools", ToolNode([lookup], handle_tool_errors=True))
    failing.add_edge(START, "chat")
    failing.add_conditional_edges("chat", route)
    failing.add_edge("tools", "chat")

    async def show(state: CopilotKitState, config: RunnableConfig) -> Json:
        await copilotkit_emit_tool_call(config, name="showCard", args={"title": "Paris"})
        return {}

    async def answer(state: CopilotKitState, config: RunnableConfig) -> Json:
        return {"messages": [await llm.ainvoke("the answer after the card", config)]}

    announcing = StateGraph(CopilotKitState)
    announcing.add_node("show", show)
    announcing.add_node("answer", answer)
    announcing.add_edge(START, "show")
    announcing.add_edge("show", "answer")
    announcing.add_edge("answer", END)
    return {"failing": failing.compile(checkpointer=InMemorySaver()),
            "announcing": announcing.compile(checkpointer=InMemorySaver())}


async def test_answer_after_a_call_without_result_streams(
        llm: MockOpenAIServer, client: httpx.AsyncClient, serve_runtime: ServeRuntime) -> None:
    """A graph-side call that gets no result (its tool raised in the tool node, or the node
    only announced it) held every later message to the end of the run: the answer came
    whole after the final agent state instead of streaming. Now the hold ends with the
    next step, so the answer comes in its place, before the run's last agent states."""
    found = unanswered_call_graphs(llm.base_url, client)
    runtime = CopilotRuntime(agents={name: LangGraphAgent(name=name, graph=graph)
                                     for name, graph in found.items()})
    async with serve_runtime(runtime) as served:
        failed = await turn(served, session("failing", 'call:lookup {"q": "x"}', "t-fail"))
        announced = await turn(served, session("announcing", "Show it", "t-card"))
    for response, answer in ((failed, "the answer after the tool"),
                             (announced, "the answer after the card")):
        assert response["status"]["code"] == "Success"
        assert texts(response) == [f"echo: {answer}"]
        order = kinds(response)
        text_at = order.index("Text")
        assert order.index("ActionExecution") < text_at
        # The text streamed while its node ran: that node's end comes after it, not before.
        after = [m for m in response["messages"][text_at + 1:]
                 if m["__typename"] == "AgentStateMessageOutput"]
        assert (after[0]["nodeName"], after[0]["active"]) == (
            "chat" if response is failed else "answer", False), order
        assert after[-1]["nodeName"] == "__end__"
    (card,) = [m for m in announced["messages"]
               if m["__typename"] == "ActionExecutionMessageOutput"]
    assert card["name"] == "showCard"
    assert "Result" not in kinds(announced)
    # The caught error is the call's result, before the answer, in the 1.10 error form.
    (result,) = [m for m in failed["messages"] if m["__typename"] == "ResultMessageOutput"]
    assert kinds(failed).index("Result") < kinds(failed).index("Text")
    error = json.loads(result["result"])["error"]
    assert error["code"] == "HANDLER_ERROR"
    assert "backend down" in error["message"]


async def test_shared_state_read_and_written(llm: MockOpenAIServer, client: httpx.AsyncClient,
                                             serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={"planner": LangGraphAgent(
        name="planner", graph=graphs.shared_state_graph(llm.base_url, client))})
    async with serve_runtime(runtime) as served:
        first = await turn(served, session("planner", "Plan", "t-state", agentStates=[
            {"agentName": "planner", "state": '{"items": ["from the page"], "counter": 5}'}]))
        written = states(first)[-1]["state"]
        # The page edits the state it got back (conversation included, as the client keeps it).
        edited = {**written, "items": ["edited"], "counter": 10}
        second = await turn(served, chat_data(
            [*history_of(states(first)[-1]), text_message("u2", "user", "Again")],
            thread="t-state", agentSession={"agentName": "planner", "nodeName": "__end__"},
            agentStates=[{"agentName": "planner", "state": json.dumps(edited)}]))
    assert states(first)[0]["state"] == {"items": ["from the page"], "counter": 5}
    assert {k: v for k, v in written.items() if k != "messages"} == {
        "items": ["from the page", "item 2"], "counter": 6, "note": "2 items"}
    assert texts(first) == ["echo: items=['from the page', 'item 2']"]
    assert states(second)[-1]["state"]["counter"] == 11
    assert texts(second) == ["echo: items=['edited', 'item 2']"]
    assert [m["content"] for m in states(second)[-1]["state"]["messages"]] == [
        "Plan", "echo: items=['from the page', 'item 2']", "Again",
        "echo: items=['edited', 'item 2']"]


async def test_two_agents_side_by_side(llm: MockOpenAIServer, client: httpx.AsyncClient,
                                       serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={
        "lg": LangGraphAgent(name="lg", graph=graphs.chat_graph(llm.base_url, client)),
        "planner": LangGraphAgent(name="planner",
                                  graph=graphs.shared_state_graph(llm.base_url, client))})
    async with serve_runtime(runtime) as served:
        left, right = await asyncio.gather(
            turn(served, session("lg", "Left", "t-left")),
            turn(served, session("planner", "Right", "t-right")))
    assert texts(left) == ["echo: Left"]
    assert texts(right) == ["echo: items=['item 1']"]
    assert {(s["agentName"], s["threadId"]) for s in states(left)} == {("lg", "t-left")}
    assert {(s["agentName"], s["threadId"]) for s in states(right)} == {("planner", "t-right")}
    assert "items" not in states(left)[-1]["state"]


async def test_copilotkit_interrupt_becomes_its_meta_event(serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={"approver": LangGraphAgent(name="approver",
                                                                graph=approval_graph())})
    async with serve_runtime(runtime) as served:
        response = await turn(served, session("approver", "Send it", "t-approve"))
    (meta,) = response["metaEvents"]
    assert meta["__typename"] == meta["name"] == "CopilotKitLangGraphInterruptEvent"
    assert json.loads(meta["data"]["value"]) == {"action": "approveTransfer",
                                                 "args": {"amount": 3}}
    (call,) = meta["data"]["messages"]
    assert (call["__typename"], call["name"], call["arguments"]) == (
        "ActionExecutionMessageOutput", "approveTransfer", ['{"amount":3}'])
    # Paused at the interrupt: the session stays at the node that asked.
    assert (states(response)[-1]["nodeName"], states(response)[-1]["running"]) == ("ask", True)


# ---- remote agents --------------------------------------------------------------------------


async def test_remote_agent_that_dies_mid_stream(serve_runtime: ServeRuntime) -> None:
    async with ScriptedAGUIServer() as remote:
        runtime = CopilotRuntime(agents={"remote": HttpAgent(remote.url)})
        async with serve_runtime(runtime) as served:
            response = await turn(served, session("remote", "die:3 hello", "t-dies"))
    status = response["status"]
    assert (status["__typename"], status["reason"]) == ("FailedResponseStatus", "UNKNOWN_ERROR")
    assert status["details"]["originalError"]["code"] == "NETWORK_ERROR"
    assert "closed the connection" in status["details"]["description"]
    assert "127.0.0.1" not in json.dumps(response)
    # What came before the failure was sent; no final state follows a failure.
    assert [(s["nodeName"], s["active"], s["state"].get("stage")) for s in states(response)] == [
        ("plan", True, None), ("plan", True, "planning"), ("plan", True, "answering"),
        ("plan", False, "answering")]


async def test_agents_get_server_actions_and_other_agents_as_tools(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    caller = Scripted(
        [ev.step_started("route"), ev.tool_call_start("c1", "getWeather", "m1"),
         ev.tool_call_args("c1", '{"city": "Oslo"}'), ev.tool_call_end("c1")],
        [ev.tool_call_start("c2", "helper", "m1"), ev.tool_call_end("c2")],
        [ev.text_message_start("m2"), ev.text_message_content("m2", "handed over"),
         ev.text_message_end("m2"), ev.step_finished("route")])
    helper = Scripted(
        [ev.run_started("ignored", "ignored"), ev.step_started("help"),
         ev.state_snapshot({"helped": True})],
        [ev.text_message_start("h1"), ev.text_message_content("h1", "helping"),
         ev.text_message_end("h1"), ev.step_finished("help"),
         ev.run_finished("ignored", "ignored")],
        description="Helps out")
    runtime = openai_runtime(llm, agents={"caller": caller, "helper": helper})
    frontend = [SAY_HELLO, {**SAY_HELLO, "name": "getWeather"}]
    async with serve_runtime(runtime) as served:
        response = await turn(served, session("caller", "go", "t-tools",
                                              frontend={"actions": frontend}))
    ((caller_input, _),) = caller.seen
    ((helper_input, helper_context),) = helper.seen
    tools = {t.name: t for t in caller_input.model.tools or ()}
    assert list(tools) == ["getWeather", "helper", "sayHello"]  # never itself, nor `default`
    # the server's schema, not the page's
    assert (tools["getWeather"].parameters or {})["required"] == ["city"]
    assert tools["helper"].description == "Helps out"
    assert [t.name for t in helper_input.model.tools or ()] == ["getWeather", "caller",
                                                               "sayHello"]
    assert helper_context.agent_id == "helper"
    assert helper_input.thread_id == "t-tools"
    assert [m.content for m in helper_input.model.messages] == ["Be brief.", "go"]
    outputs = [(m["__typename"].removesuffix("MessageOutput"),
                m.get("name") or m.get("result") or m.get("agentName")
                or "".join(m.get("content", ())))
               for m in response["messages"]]
    weather = json.dumps({"city": "Oslo", "temperature": 21, "unit": "celsius",
                          "conditions": "sunny"}, separators=(",", ":"))
    assert outputs == [
        ("AgentState", "caller"), ("ActionExecution", "getWeather"), ("Result", weather),
        ("ActionExecution", "helper"), ("Result", "helper agent started"),
        ("AgentState", "helper"), ("AgentState", "helper"), ("Text", "helping"),
        ("AgentState", "helper"), ("AgentState", "helper"),
        ("Text", "handed over"), ("AgentState", "caller"), ("AgentState", "caller")]
    assert response["status"]["code"] == "Success"


async def test_remote_endpoint_actions_agents_and_state(llm: MockOpenAIServer,
                                                        serve_runtime: ServeRuntime) -> None:
    caller = Scripted([ev.tool_call_start("c1", "add", "m1"),
                       ev.tool_call_args("c1", '{"a": 2, "b": 3}'), ev.tool_call_end("c1")])
    async with FakeEndpoint() as fake:
        found = await CopilotKitRemoteEndpoint(fake.url).discover()
        default = BuiltInAgent(OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock",
                                             max_retries=0), actions=found.actions)
        runtime = CopilotRuntime(agents={"default": default, "caller": caller, **found.agents})
        async with serve_runtime(runtime) as served:
            response = await turn(served, session("caller", "add", "t-remote"))
            loaded = await query(served, LOAD_STATE, {"data": {
                "threadId": "t-remote-9", "agentName": "researcher"}},
                headers={"Authorization": "Bearer token-1", "Cookie": "session=secret"})
    ((caller_input, _),) = caller.seen
    assert "add" in [t.name for t in caller_input.model.tools or ()]
    (result,) = [m for m in response["messages"] if m["__typename"] == "ResultMessageOutput"]
    assert (result["actionName"], json.loads(result["result"])) == ("add", {"sum": 5})
    state = loaded["data"]["loadAgentState"]
    assert state["threadExists"] is True
    assert state["threadId"] == "t-remote-9"
    assert json.loads(state["state"]) == {"topic": "otters"}
    assert json.loads(state["messages"]) == [
        {"id": "u1", "role": "user", "content": "Find it"},
        {"id": "a1", "role": "assistant", "content": "Found", "parentMessageId": "a1"}]
    route, headers, body = fake.requests[-1]
    assert route == "agents/state"
    assert body["name"] == "researcher"
    assert headers["authorization"] == "Bearer token-1"
    assert "cookie" not in headers


# ---- loadAgentState for LangGraph threads ---------------------------------------------------


async def test_load_agent_state_of_a_langgraph_thread(
        llm: MockOpenAIServer, client: httpx.AsyncClient, serve_runtime: ServeRuntime) -> None:
    graph = graphs.chat_graph(llm.base_url, client)
    # A thread this runtime never ran: only the checkpointer knows it.
    await graph.ainvoke({"messages": [HumanMessage(content="From a script", id="h1")]},
                        {"configurable": {"thread_id": "t-outside"}})
    direct = await load_graph_state(graph, "t-outside")
    assert direct.exists
    assert direct.state == {}
    assert [(m["role"], m["content"]) for m in direct.messages] == [
        ("user", "From a script"), ("assistant", "echo: From a script")]
    assert not (await load_graph_state(graph, "t-nowhere")).exists

    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        await turn(served, session("lg", "Through the runtime", "t-inside"))
        outside, inside, nowhere = [
            (await query(served, LOAD_STATE, {"data": {"threadId": thread,
                                                        "agentName": "lg"}}))["data"][
                "loadAgentState"] for thread in ("t-outside", "t-inside", "t-nowhere")]
    assert outside["threadExists"] is True
    assert json.loads(outside["state"]) == {}
    loaded = json.loads(outside["messages"])
    assert loaded[0] == {"id": "h1", "role": "user", "content": "From a script"}
    assert loaded[1]["content"] == "echo: From a script"
    assert loaded[1]["parentMessageId"] == loaded[1]["id"]
    assert [m["content"] for m in json.loads(inside["messages"])] == [
        "Through the runtime", "echo: Through the runtime"]  # the system prompt is not kept
    assert nowhere == {"threadId": "t-nowhere", "threadExists": False, "state": "{}",
                       "messages": "[]"}


class Inside(CopilotKitState):
    question: str
    secret: str
    answer: str


class Asked(CopilotKitState):
    question: str


class Answered(TypedDict):
    messages: list[Any]
    answer: str


def answering_graph() -> Any:
    """A graph whose `output_schema` hides a key its node writes (`secret`) and one only
    its input schema has (`question`)."""
    def answer(state: Inside) -> Json:
        return {"messages": [AIMessage(f"q={state.get('question')}")], "secret": "s3cr3t",
                "answer": f"A:{state.get('question')}"}

    graph = StateGraph(Inside, input_schema=Asked, output_schema=Answered)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_load_agent_state_shows_only_the_keys_of_the_graphs_output_schema(
        serve_runtime: ServeRuntime) -> None:
    """loadAgentState showed every key of the checkpoint, while the streamed state and
    AG-UI's `GET /threads/{id}/state` showed the output schema's only."""
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=answering_graph())})
    async with serve_runtime(runtime) as served:
        response = await turn(served, session("lg", "go", "t-io", agentStates=[{
            "agentName": "lg", "state": json.dumps({"question": "why"}), "config": "{}"}]))
        loaded = (await query(served, LOAD_STATE, {"data": {
            "threadId": "t-io", "agentName": "lg"}}))["data"]["loadAgentState"]
        stored = await served.session.get(served.url + "/threads/t-io/state")
        stored_state = (await stored.json())["state"]
    streamed = {k: v for k, v in states(response)[-1]["state"].items() if k != "messages"}
    assert streamed == {"answer": "A:why"}
    assert json.loads(loaded["state"]) == streamed
    assert stored_state == streamed


class Poisoned(pydantic.BaseModel):
    messages: Annotated[list[AnyMessage], add_messages] = []
    count: int = 0
    secret: str = ""


class Shown(TypedDict):
    messages: list[Any]
    count: int


async def test_load_agent_state_of_an_unreadable_thread_keeps_to_the_output_schema(
        serve_runtime: ServeRuntime) -> None:
    """A saved state the graph's pydantic schema refuses is shown as saved (its runs say
    what is wrong), but still only its output schema's keys."""
    builder = StateGraph(Poisoned, output_schema=Shown)
    builder.add_node("n", lambda state: {"count": state.count + 1})
    builder.add_edge(START, "n")
    builder.add_edge("n", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    with pytest.raises(pydantic.ValidationError):
        await graph.ainvoke({"count": "abc", "secret": "s3cr3t"},
                            {"configurable": {"thread_id": "t-bad"}})
    agent = LangGraphAgent(name="lg", graph=graph)
    loaded = await agent.load_state("t-bad")
    assert loaded.exists
    assert loaded.state == {"count": "abc"}


# ---- a client's own copy of a graph-side tool result ---------------------------------------


def failing_after_tool_graph(base_url: str, client: httpx.AsyncClient) -> Any:
    """Runs the server tool `echo_back` in a `ToolNode`; the model step after the tool
    fails once (as a provider outage would), then answers."""
    llm = graphs.model(base_url, client)
    failed: list[bool] = []

    @tool
    def echo_back(q: str) -> str:
        """Echo the query."""
        return q

    async def chat(state: CopilotKitState, config: RunnableConfig) -> Json:
        if state["messages"][-1].type == "tool" and not failed:
            failed.append(True)
            raise RuntimeError("provider outage")
        return {"messages": [await llm.bind_tools([echo_back]).ainvoke(state["messages"],
                                                                       config)]}

    def route(state: CopilotKitState) -> Literal["tools", "__end__"]:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    graph = StateGraph(CopilotKitState)
    graph.add_node("chat", chat)
    graph.add_node("tools", ToolNode([echo_back]))
    graph.add_edge(START, "chat")
    graph.add_conditional_edges("chat", route)
    graph.add_edge("tools", "chat")
    return graph.compile(checkpointer=InMemorySaver())


def held_by_client(response: Json) -> list[Json]:
    """What react-core 1.10 keeps of a response without a final agent state (a failed or
    stopped run): the messages it was streamed, as `MessageInput`s."""
    held = []
    for m in response["messages"]:
        if m["__typename"] == "ActionExecutionMessageOutput":
            held.append(call_message(m["id"], m["name"], "".join(m["arguments"]),
                                     m.get("parentMessageId")))
        elif m["__typename"] == "ResultMessageOutput":
            held.append(result_message(m["id"], m["actionExecutionId"], m["actionName"],
                                       m["result"]))
        elif m["__typename"] == "TextMessageOutput":
            held.append(text_message(m["id"], m["role"], "".join(m["content"])))
    return held


async def test_a_streamed_tool_result_sent_back_is_not_a_new_message(
        llm: MockOpenAIServer, client: httpx.AsyncClient, serve_runtime: ServeRuntime) -> None:
    """A failed run after a graph-side tool sends no final agent state: the client keeps the
    streamed result (id `result-<callId>`, not the checkpoint's) and sends it back. It was
    appended after the conversation as a new tool message answering no call, and every
    later message of the thread failed at the model (HTTP 400)."""
    graph = failing_after_tool_graph(llm.base_url, client)
    runtime = CopilotRuntime(agents={"lk": LangGraphAgent(name="lk", graph=graph)})
    history = [text_message("sys", "system", "Be brief."),
               text_message("u1", "user", 'call:echo_back {"q": "x"}')]
    async with serve_runtime(runtime) as served:
        failed = await turn(served, chat_data(history, thread="t-held",
                                              agentSession={"agentName": "lk"}))
        held = held_by_client(failed)
        retry = await turn(served, chat_data(
            [*history, *held, text_message("u2", "user", "Again")], thread="t-held",
            agentSession={"agentName": "lk"}))
    assert failed["status"]["code"] == "Failed"
    assert [m["id"].startswith("result-") for m in held if "resultMessage" in m] == [True]
    assert retry["status"]["code"] == "Success", retry["status"]
    values = await graphs.graph_values(graph, "t-held")
    assert [m.type for m in values["messages"]] == ["human", "ai", "tool", "human", "ai"]


# ---- answers of several text blocks ---------------------------------------------------------


def several_blocks_graph() -> Any:
    """Answers in langchain-anthropic's shape for cited text: several text blocks, after a
    reasoning block."""

    async def answer(state: CopilotKitState) -> Json:
        return {"messages": [AIMessage(content=[
            {"type": "reasoning", "reasoning": "hmm"}, {"type": "text", "text": "part one "},
            {"type": "text", "text": "part two"}])]}

    graph = StateGraph(CopilotKitState)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_an_answer_of_several_text_blocks_is_shown_whole(
        serve_runtime: ServeRuntime) -> None:
    """Only the first text block reached the final agent state, loadAgentState and
    MESSAGES_SNAPSHOT (ag-ui-langgraph's converter reads one)."""
    runtime = CopilotRuntime(agents={"blocks": LangGraphAgent(name="blocks",
                                                              graph=several_blocks_graph())})
    async with serve_runtime(runtime) as served:
        response = await turn(served, session("blocks", "Hello", "t-blocks"))
        loaded = await query(served, LOAD_STATE, {"data": {"threadId": "t-blocks",
                                                          "agentName": "blocks"}})
        events = await served.run(run_input("Hello", thread="t-blocks-agui"), agent="blocks")
    final = states(response)[-1]["state"]["messages"]
    assert [m["content"] for m in final if m.get("role") == "assistant"] == [
        "part one part two"]
    shown = json.loads(loaded["data"]["loadAgentState"]["messages"])
    assert [m["content"] for m in shown if m.get("role") == "assistant"] == [
        "part one part two"]
    (snapshot,) = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"]
    assert [(m["role"], m.get("content")) for m in snapshot["messages"]][1:] == [
        ("reasoning", "hmm"), ("assistant", "part one part two")]


# ---- a batch the response cannot carry ------------------------------------------------------


async def test_a_batch_the_encoder_fails_on_ends_the_response_with_an_error(
        serve_runtime: ServeRuntime) -> None:
    """The GraphQL encoder keeps what it was fed: a batch it failed on part-way was fed to
    it again, and the part it had taken came twice (a text piece repeated, a call's
    arguments no longer JSON). Now the response ends there, failed, saying why."""
    agent = Scripted([ev.step_started("s"), ev.text_message_start("m1"),
                      ev.text_message_content("m1", "one ")],
                     [ev.text_message_content("m1", "two "),
                      ev.state_snapshot({"tags": {"not", "json"}}),  # (a set)
                      ev.text_message_content("m1", "three")],
                     [ev.text_message_end("m1"), ev.step_finished("s")])
    async with serve_runtime(CopilotRuntime(agents={"scripted": agent})) as served:
        response = await turn(served, session("scripted", "go", "t-unencodable"))
        events = await served.run(run_input("go", thread="t-unencodable-agui"),
                                  agent="scripted")
    # AG-UI's frames are encoded afresh: the batch is sent without what JSON cannot carry.
    assert "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT") == (
        "one two three")
    assert "STATE_SNAPSHOT" not in [e["type"] for e in events]
    assert events[-1]["type"] == "RUN_FINISHED"
    assert texts(response) == ["one "]
    status = response["status"]
    assert status["code"] == "Failed", status
    assert "could not be encoded" in status["details"]["description"]


# ---- a call no one answers, in the step that streams the answer ---------------------------


def emits_then_answers_graph(base_url: str, client: httpx.AsyncClient) -> Any:
    """One node: announces a call for the page to render, then streams its answer."""
    llm = graphs.model(base_url, client)

    async def work(state: CopilotKitState, config: RunnableConfig) -> Json:
        await copilotkit_emit_tool_call(config, name="showProgress", args={"percent": 50})
        return {"messages": [await llm.ainvoke("the answer after the card", config)]}

    graph = StateGraph(CopilotKitState)
    graph.add_node("work", work)
    graph.add_edge(START, "work")
    graph.add_edge("work", END)
    return graph.compile(checkpointer=InMemorySaver())


SHOW_PROGRESS = {"name": "showProgress", "description": "Renders progress",
                 "available": "disabled", "jsonSchema": '{"type":"object"}'}


@pytest.mark.parametrize("actions", [[SHOW_PROGRESS], []], ids=["render-only", "undeclared"])
async def test_an_answer_after_an_announced_call_in_its_step_streams(
        llm: MockOpenAIServer, client: httpx.AsyncClient, serve_runtime: ServeRuntime,
        actions: list[Json]) -> None:
    """A call a node announces for the page to render (a render-only action, or one the
    page did not declare) gets no result: the answer the same node streams after it was
    held to the end of the run. Only calls the runtime answers after the answer streamed
    (the built-in agent's server-side actions) are waited for."""
    runtime = CopilotRuntime(agents={"emit": LangGraphAgent(
        name="emit", graph=emits_then_answers_graph(llm.base_url, client))})
    async with serve_runtime(runtime) as served:
        response = await turn(served, session("emit", "Go", "t-emit",
                                              frontend={"actions": actions}))
    assert response["status"]["code"] == "Success"
    assert texts(response) == ["echo: the answer after the card"]
    order = kinds(response)
    text_at = order.index("Text")
    assert order.index("ActionExecution") < text_at
    # The text streamed while its node ran: the node's end comes after it.
    after = [(m["nodeName"], m["active"]) for m in response["messages"][text_at + 1:]
             if m["__typename"] == "AgentStateMessageOutput"]
    assert ("work", False) in after, order



# ---- what the runtime answers in a LangGraph agent's run ------------------------------------


def calls_graph(base_url: str, client: httpx.AsyncClient, *, then: str | None = None) -> Any:
    """The model may call any action the run offers (the runtime's among them); with
    `then`, a node after it says that when it did, so the checkpoint goes on past the call."""
    llm = graphs.model(base_url, client)

    async def chat(state: CopilotKitState, config: RunnableConfig) -> Json:
        bound = llm.bind_tools(state.get("copilotkit", {}).get("actions", []))
        return {"messages": [await bound.ainvoke(state["messages"], config)]}

    async def report(state: CopilotKitState) -> Json:
        last = state["messages"][-1]
        called = isinstance(last, AIMessage) and last.tool_calls
        return {"messages": [AIMessage(content=then)]} if called else {}

    graph = StateGraph(CopilotKitState)
    graph.add_node("chat", chat)
    graph.add_edge(START, "chat")
    if then is None:
        graph.add_edge("chat", END)
    else:
        graph.add_node("report", report)
        graph.add_edge("chat", "report")
        graph.add_edge("report", END)
    return graph.compile(checkpointer=InMemorySaver())


def says_graph(text: str) -> Any:
    """A graph whose model streams `text` (it ends, as every in-process run, with its own
    MESSAGES_SNAPSHOT)."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel

    async def chat(state: CopilotKitState, config: RunnableConfig) -> Json:
        model = GenericFakeChatModel(messages=iter([AIMessage(content=text)]))
        return {"messages": [await model.ainvoke(state["messages"], config)]}

    graph = StateGraph(CopilotKitState)
    graph.add_node("chat", chat)
    graph.add_edge(START, "chat")
    graph.add_edge("chat", END)
    return graph.compile(checkpointer=InMemorySaver())


async def answered_in_the_run(served: Served, thread: str, tool: str
                              ) -> tuple[list[Any], list[Any], Json]:
    """A turn whose model calls `tool`, and a follow-up: what the first response's last
    `lg` state and the stored thread say, and the follow-up's response."""
    first = await turn(served, chat_data(
        [text_message("u1", "user", f"call:{tool} {{}}")], thread=thread,
        agentSession={"agentName": "lg"}))
    assert first["status"]["code"] == "Success", first["status"]
    final = [s for s in states(first) if s["agentName"] == "lg"][-1]
    held = final["state"]["messages"]
    assert held[2]["actionExecutionId"] == held[1]["id"]
    stored = (await (await served.session.get(
        served.url + f"/threads/{thread}/messages")).json())["messages"]
    assert [m["role"] for m in stored][:3] == ["user", "assistant", "tool"]
    second = await turn(served, chat_data(
        [*history_of(final), text_message("u2", "user", "thanks")], thread=thread,
        agentSession={"agentName": "lg", "nodeName": final["nodeName"]}))
    return ([m.get("content") or m.get("result") or m.get("name") for m in held],
            [m.get("content") for m in stored], second)


async def test_a_runtime_actions_result_follows_its_call_in_a_langgraph_checkpoint(
        llm: MockOpenAIServer, client: httpx.AsyncClient, serve_runtime: ServeRuntime) -> None:
    """The model calls a runtime action, then a later node says "Done". Before, the result
    went after the whole checkpoint (after "Done"), which the 1.10 client took for its
    history: the next turn sent a call not answered before the next message. And sent in
    its place, the graph appended it after "Done" all the same."""
    graph = calls_graph(llm.base_url, client, then="Done")
    runtime = openai_runtime(llm, agents={"lg": LangGraphAgent(name="lg", graph=graph)},
                             actions=[Action("lookup", lambda: {"answer": 42})])
    async with serve_runtime(runtime) as served:
        held, stored, second = await answered_in_the_run(served, "t-result-then", "lookup")
    assert held == ["call:lookup {}", "lookup", '{"answer":42}', "Done"]
    assert stored[2:] == ['{"answer":42}', "Done"]
    # The graph takes the result after its call, not after "Done", which the model refuses.
    assert second["status"]["code"] == "Success", second["status"]
    assert texts(second) == ["echo: thanks"]
    values = await graph.aget_state({"configurable": {"thread_id": "t-result-then"}})
    assert [type(m).__name__ for m in values.values["messages"]] == [
        "HumanMessage", "AIMessage", "ToolMessage", "AIMessage", "HumanMessage", "AIMessage"]


async def test_a_handed_over_langgraph_agents_snapshot_keeps_the_calls_result(
        llm: MockOpenAIServer, client: httpx.AsyncClient, serve_runtime: ServeRuntime) -> None:
    """The model hands over to an in-process LangGraph agent, which sends its own
    MESSAGES_SNAPSHOT (its conversation, without the call). Before, that snapshot dropped
    the call's result from the answer added to the caller's snapshot, and put the stored
    thread out of order: the next turn sent a call without its result."""
    runtime = openai_runtime(llm, agents={
        "lg": LangGraphAgent(name="lg", graph=calls_graph(llm.base_url, client)),
        "helper": LangGraphAgent(name="helper", graph=says_graph("helper says 42"),
                                 description="Helps")})
    async with serve_runtime(runtime) as served:
        held, stored, second = await answered_in_the_run(served, "t-handed", "helper")
    answer = ["helper agent started", "helper says 42"]
    assert held == ["call:helper {}", "helper", *answer]
    assert stored[2:] == answer
    assert second["status"]["code"] == "Success", second["status"]
    assert texts(second) == ["echo: thanks"]
