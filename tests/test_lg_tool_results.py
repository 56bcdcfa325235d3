"""A server-side tool's result keeps its place in the chat: before the answer the model gave
from it, in the client's history, in the stored thread and in what a reload replays.

Before the fix, TOOL_CALL_RESULT named its message by the tool call's id (ToolNode's
ToolMessage had none yet) while the checkpoint, and so the run's MESSAGES_SNAPSHOT, held the
uuid LangGraph gave it later: the client (and the stored thread, which mirrors it) merged the
snapshot by id and moved the result after the answer, a history OpenAI refuses."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import httpx
import pytest
from copilotkit import CopilotKitState
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Command, RetryPolicy, interrupt

from copilot_runtime import CopilotRuntime
from copilot_runtime.agents._lg_bridge import (
    _tool_results,
    _ToolMessageIds,
    _with_tool_message_ids,
)
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.testing import MockOpenAIServer, verify_events
from tests.agents_support import graphs
from tests.conftest import ServeRuntime, run_input
from tests.test_real_clients import run_client_script

pytestmark = pytest.mark.timeout(120)

WEATHER_CALL = 'call:get_weather {"city":"Oslo"}'


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as http:
        yield http


@tool
def record_city(city: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command[Any]:
    """Remember a city."""
    # A ToolMessage without an id inside a Command, which ToolNode deep-copies.
    return Command(update={"messages": [ToolMessage(content=f"noted {city}",
                                                    tool_call_id=tool_call_id)]})


@tool
def confirm_city(city: str) -> str:
    """Confirm a city with the user."""
    return f"{city}: {interrupt('sure?')}"


@tool
def look_up(query: str) -> str:
    """Look something up."""
    raise ValueError("the index is down")


def _tool_loop(base_url: str, client: httpx.AsyncClient, tools: list[Any],
               **tool_node: Any) -> Any:
    llm = graphs.model(base_url, client)

    async def chat(state: CopilotKitState) -> dict[str, Any]:
        return {"messages": [await llm.bind_tools(tools).ainvoke(state["messages"])]}

    return _agent_loop("chat", chat, ToolNode(tools, **tool_node))


def _to_tools(state: CopilotKitState) -> Literal["tools", "__end__"]:
    last = state["messages"][-1]
    return "tools" if isinstance(last, AIMessage) and last.tool_calls else END


def _agent_loop(name: str, node: Any, tools: ToolNode,
                tools_retry: RetryPolicy | None = None) -> Any:
    """A graph (not compiled) of `node` calling `tools` until it calls none."""
    builder = StateGraph(CopilotKitState)
    builder.add_node(name, node)
    builder.add_node("tools", tools, retry_policy=tools_retry)
    builder.add_edge(START, name)
    builder.add_conditional_edges(name, _to_tools)
    builder.add_edge("tools", name)
    return builder


def _inside_a_subgraph(base_url: str, client: httpx.AsyncClient) -> Any:
    inner = _tool_loop(base_url, client, graphs.SERVER_TOOLS).compile()
    outer = StateGraph(CopilotKitState)
    outer.add_node("assistant", inner)
    outer.add_edge(START, "assistant")
    outer.add_edge("assistant", END)
    return outer.compile(checkpointer=InMemorySaver())


def _runtime(llm: MockOpenAIServer, client: httpx.AsyncClient) -> CopilotRuntime:
    return CopilotRuntime(agents={
        "chat": LangGraphAgent(name="chat", graph=graphs.chat_graph(llm.base_url, client)),
        "sub": LangGraphAgent(name="sub", graph=_inside_a_subgraph(llm.base_url, client)),
        "command": LangGraphAgent(name="command", graph=_tool_loop(
            llm.base_url, client, [record_city]).compile(checkpointer=InMemorySaver())),
        # A tool that raises, ToolNode catching it: an error ToolMessage is its result.
        "failing": LangGraphAgent(name="failing", graph=_tool_loop(
            llm.base_url, client, [look_up], handle_tool_errors=True).compile(
                checkpointer=InMemorySaver())),
        # Arguments the tool refuses: ToolNode's default handler answers with the error.
        "invalid": LangGraphAgent(name="invalid", graph=_tool_loop(
            llm.base_url, client, graphs.SERVER_TOOLS).compile(checkpointer=InMemorySaver())),
        "interrupted": LangGraphAgent(name="interrupted", graph=_tool_loop(
            llm.base_url, client, [confirm_city]).compile(checkpointer=InMemorySaver())),
    })


def _shape(messages: list[dict[str, Any]]) -> list[tuple[str, str, bool]]:
    return [(m["id"], m["role"], bool(m.get("toolCalls"))) for m in messages]


def _shape_by_call(messages: list[dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """`_shape`, each assistant turn's results in the order of its calls."""
    order = {call["id"]: (i, n) for i, m in enumerate(messages)
             for n, call in enumerate(m.get("toolCalls") or [])}
    results = sorted((m for m in messages if m["role"] == "tool"),
                     key=lambda m: order.get(m["toolCallId"], (-1, 0)))
    out = iter(results)
    return _shape([next(out) if m["role"] == "tool" else m for m in messages])


async def test_a_server_tool_result_stays_before_the_answer(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    asks = {"chat": WEATHER_CALL, "sub": WEATHER_CALL,
            "command": 'call:record_city {"city":"Oslo"}',
            "failing": 'call:look_up {"query":"Oslo"}',
            "invalid": 'call:get_weather {"town":"Oslo"}',
            "interrupted": 'call:confirm_city {"city":"Oslo"}'}
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    stored: dict[str, Any] = {}
    async with serve_runtime(_runtime(llm, client)) as served:
        for agent, text in asks.items():
            runs[agent] = [await served.run(run_input(text, thread=f"t-{agent}"), agent=agent)]
        # The tool asked (interrupt()); its result comes in the run that answers.
        runs["interrupted"].append(await served.run(run_input(
            "", thread="t-interrupted", run="run-2", messages=[],
            forwardedProps={"command": {"resume": "yes"}}), agent="interrupted"))
        for agent in asks:
            stored[agent] = await (await served.session.get(
                f"{served.url}/threads/t-{agent}/messages")).json()
    held = run_client_script("apply_events.mjs", [
        {"events": [e for run in runs[agent] for e in run], "state": {}} for agent in asks])
    for agent, client_held in zip(asks, held, strict=True):
        for run in runs[agent]:
            verify_events(run)
        events = runs[agent][-1]
        (result,) = [e for e in events if e["type"] == "TOOL_CALL_RESULT"]
        snapshot = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]
        assert [m["role"] for m in snapshot] == ["user", "assistant", "tool", "assistant"], agent
        # The result streamed is the message the graph keeps.
        assert result["messageId"] == snapshot[2]["id"], agent
        assert _shape(client_held["messages"]) == _shape(snapshot), agent
        assert _shape(stored[agent]["messages"]) == _shape(snapshot), agent
        if agent in ("failing", "invalid"):
            # A tool's failure is its result, told as one (what the model reads next).
            assert "error" in result, result
            assert result["content"] == snapshot[2]["content"], agent
            assert ("the index is down" if agent == "failing" else "city") in result["content"]


async def test_a_tool_that_succeeds_on_a_retry_is_announced_and_answered_once(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    """Its failed try was kept as a failed call, never cleared by the try that succeeded:
    as ToolNode ended, the call was announced and answered a second time (the client held
    two tool messages with one id)."""
    tries = itertools.count()

    @tool
    def flaky(query: str) -> str:
        """Look something up, failing the first time."""
        if next(tries) == 0:
            raise ValueError("first try fails")
        return "second try ok"

    builder = _tool_loop(llm.base_url, client, [flaky])
    builder.nodes["tools"].retry_policy = RetryPolicy(retry_on=ValueError, max_attempts=2,
                                                      initial_interval=0.01)
    runtime = CopilotRuntime(agents={"retried": LangGraphAgent(
        name="retried", graph=builder.compile(checkpointer=InMemorySaver()))})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input('call:flaky {"query":"x"}', thread="t-retried"),
                                  agent="retried")
    verify_events(events)
    announced = [e["type"] for e in events if e["type"] in (
        "TOOL_CALL_START", "TOOL_CALL_END", "TOOL_CALL_RESULT")]
    assert announced == ["TOOL_CALL_START", "TOOL_CALL_END", "TOOL_CALL_RESULT"]
    (result,) = [e for e in events if e["type"] == "TOOL_CALL_RESULT"]
    assert result["content"] == "second try ok"
    assert "error" not in result
    snapshot = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]
    (held,) = run_client_script("apply_events.mjs", [{"events": events, "state": {}}])
    assert _shape(held["messages"]) == _shape(snapshot)
    assert [m["role"] for m in snapshot] == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize("first_try_delay", [0.0, 0.3], ids=["ends-first", "ends-last"])
async def test_a_sibling_call_answered_before_a_retry_is_answered_once(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime, first_try_delay: float) -> None:
    """Before: the node's retry ran `steady` again, and its call was announced and
    answered a second time, under another message id (the first try's result, which the
    client held, is in no checkpoint). Now the retry's result keeps the first try's id,
    and is not sent again. "ends-last": the first try of `steady` ends after its node
    failed and after the retry's own result (it was given a new id, the race that made this
    test fail one run in six)."""
    tries = itertools.count()
    steady_tries = itertools.count()

    @tool
    def flaky(query: str) -> str:
        """Look something up, failing the first time."""
        if next(tries) == 0:
            raise ValueError("first try fails")
        return "second try ok"

    @tool
    def steady(query: str) -> str:
        """Look something up."""
        if next(steady_tries) == 0:
            time.sleep(first_try_delay)
        return "steady ok"

    builder = _tool_loop(llm.base_url, client, [steady, flaky])
    builder.nodes["tools"].retry_policy = RetryPolicy(retry_on=ValueError, max_attempts=2,
                                                      initial_interval=0.01)
    runtime = CopilotRuntime(agents={"retried": LangGraphAgent(
        name="retried", graph=builder.compile(checkpointer=InMemorySaver()))})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input(
            'call:steady {"query":"a"}\ncall:flaky {"query":"b"}', thread="t-sibling"),
            agent="retried")
    verify_events(events)
    started = [e["toolCallId"] for e in events if e["type"] == "TOOL_CALL_START"]
    answered = {e["toolCallId"]: (e["messageId"], e["content"])
                for e in events if e["type"] == "TOOL_CALL_RESULT"}
    assert len(started) == len(set(started)) == 2
    assert sum(e["type"] == "TOOL_CALL_RESULT" for e in events) == 2
    snapshot = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]
    assert answered == {m["toolCallId"]: (m["id"], m["content"])
                        for m in snapshot if m["role"] == "tool"}
    assert sorted(content for _, content in answered.values()) == [
        "second try ok", "steady ok"]
    (held,) = run_client_script("apply_events.mjs", [{"events": events, "state": {}}])
    # (the client holds parallel results in the order they ended; the checkpoint in the
    # order of the calls)
    assert _shape_by_call(held["messages"]) == _shape_by_call(snapshot)


@pytest.mark.parametrize("first_try_delay", [0.0, 0.3], ids=["ends-first", "ends-last"])
@pytest.mark.parametrize("retry_around", ["toolnode", "subgraph"])
async def test_each_try_of_a_call_gets_the_id_the_checkpoint_keeps(
        retry_around: str, first_try_delay: float,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A retry around a subgraph runs its ToolNode in a new task: keyed by task alone,
    `steady`'s second result got another id than its first (announced twice; a review of
    the fix for the race above)."""
    given: list[str] = []
    original = _ToolMessageIds.on_tool_end

    def noting(self: _ToolMessageIds, output: Any, **kwargs: Any) -> None:
        original(self, output, **kwargs)
        given.extend(m.id for m in _tool_results(output)
                     if isinstance(m, ToolMessage) and m.tool_call_id == "c-steady")

    monkeypatch.setattr(_ToolMessageIds, "on_tool_end", noting)
    graph = _reusing_graph(retry_around, [[("c-steady", "steady", "x"),
                                           ("c-flaky", "flaky", "y")]], {0: first_try_delay})
    config = {"configurable": {"thread_id": "t"}}
    await graph.ainvoke({"messages": [("user", "hi")]}, _with_tool_message_ids(config))
    for _ in range(100):  # (a first try ending last ends after the graph)
        if len(given) == 2:
            break
        await asyncio.sleep(0.01)
    kept = [m.id for m in (await graph.aget_state(config)).values["messages"]
            if isinstance(m, ToolMessage) and m.tool_call_id == "c-steady"]
    assert len(given) == 2
    assert set(given) == set(kept)
    assert len(kept) == 1


def _reusing_graph(retry_around: str, turns: list[list[tuple[str, str, str]]],
                   steady_delays: dict[int, float]) -> Any:
    """A model reusing call ids from turn to turn (`call_0` each turn, as some local models
    do): `turns` are each turn's calls (id, tool, query); `flaky` fails its first try."""
    tries, steady_tries = itertools.count(), itertools.count()

    @tool
    def flaky(query: str) -> str:
        """Fails its first try."""
        if next(tries) == 0:
            raise RuntimeError("first try fails")
        return "flaky ok"

    @tool
    def steady(query: str) -> str:
        """Answers."""
        time.sleep(steady_delays.get(next(steady_tries), 0.0))
        return f"steady {query}"

    def agent(state: CopilotKitState) -> dict[str, Any]:
        turn = sum(isinstance(m, AIMessage) for m in state["messages"])
        if turn == len(turns):
            return {"messages": [AIMessage("done", id="ai-done")]}
        return {"messages": [AIMessage("", id=f"ai-{turn}", tool_calls=[
            {"id": call, "name": name, "args": {"query": query}}
            for call, name, query in turns[turn]])]}

    retry = RetryPolicy(max_attempts=2, initial_interval=0.05, retry_on=RuntimeError)
    inner = _agent_loop("agent", agent, ToolNode([steady, flaky], handle_tool_errors=False),
                        retry if retry_around == "toolnode" else None)
    if retry_around == "toolnode":
        return inner.compile(checkpointer=InMemorySaver())
    outer = StateGraph(CopilotKitState)
    outer.add_node("sub", inner.compile(), retry_policy=retry)
    outer.add_edge(START, "sub")
    outer.add_edge("sub", END)
    return outer.compile(checkpointer=InMemorySaver())


_FAILING_FIRST = [[("call_0", "steady", "a"), ("call_1", "flaky", "b")],
                  [("call_0", "steady", "c")]]
_FAILING_SECOND = [[("call_0", "steady", "a")],
                   [("call_0", "steady", "c"), ("call_1", "flaky", "b")]]


@pytest.mark.parametrize(("retry_around", "turns", "steady_delays"), [
    ("toolnode", _FAILING_FIRST, {}), ("toolnode", _FAILING_FIRST, {0: 0.15}),
    ("subgraph", _FAILING_FIRST, {}), ("subgraph", _FAILING_FIRST, {0: 0.15}),
    ("subgraph", _FAILING_SECOND, {}),
], ids=["toolnode", "toolnode-ends-last", "subgraph", "subgraph-ends-last",
        "subgraph-second-turn"])
async def test_a_call_id_a_model_reuses_keeps_each_turns_result(
        retry_around: str, turns: list[list[tuple[str, str, str]]],
        steady_delays: dict[int, float], monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: the first fix of the retry's ids gave a later turn's reused `call_0` the id
    of an earlier turn's result, and the checkpoint kept one of the two (its turn's
    assistant message left with a call and no result, a history models refuse). Now each
    turn's result keeps an id of its own, the same on each try of that turn."""
    given: dict[str, set[str]] = {}
    original = _ToolMessageIds.on_tool_end

    def noting(self: _ToolMessageIds, output: Any, **kwargs: Any) -> None:
        original(self, output, **kwargs)
        for m in _tool_results(output):
            if isinstance(m, ToolMessage) and m.tool_call_id == "call_0":
                given.setdefault(str(m.content), set()).add(str(m.id))

    monkeypatch.setattr(_ToolMessageIds, "on_tool_end", noting)
    graph = _reusing_graph(retry_around, turns, steady_delays)
    config = {"configurable": {"thread_id": "t"}}
    await graph.ainvoke({"messages": [("user", "hi")]}, _with_tool_message_ids(config))
    await asyncio.sleep(0.3)  # (a first try ending last ends after the graph)
    kept = {str(m.content): m.id for m in (await graph.aget_state(config)).values["messages"]
            if isinstance(m, ToolMessage) and m.tool_call_id == "call_0"}
    assert sorted(kept) == ["steady a", "steady c"]
    assert {content: {result} for content, result in kept.items()} == given


async def test_a_handoff_to_the_parent_graph_is_no_failure_to_retry() -> None:
    """Review: a tool's `Command(graph=PARENT)` raises through its ToolNode (LangGraph's
    ParentCommand) and was taken for a failure: a later turn's `call_0` with the same
    arguments was linked to it as its retry, got its id, and replaced the handoff's result
    in the checkpoint."""

    @tool
    def transfer_to_b(tool_call_id: Annotated[str, InjectedToolCallId]) -> Command[Any]:
        """Hand off."""
        return Command(graph=Command.PARENT, goto="b", update={
            "messages": [ToolMessage("transferred", tool_call_id=tool_call_id)]})

    @tool
    def get_time() -> str:
        """The time."""
        return "12:00"

    def a_agent(state: CopilotKitState) -> dict[str, Any]:
        return {"messages": [AIMessage("", id="ai-1", tool_calls=[
            {"id": "call_0", "name": "transfer_to_b", "args": {}}])]}

    def b_agent(state: CopilotKitState) -> dict[str, Any]:
        if state["messages"][-1].content == "12:00":
            return {"messages": [AIMessage("done", id="ai-3")]}
        return {"messages": [AIMessage("", id="ai-2", tool_calls=[
            {"id": "call_0", "name": "get_time", "args": {}}])]}

    def route(state: CopilotKitState) -> Literal["b_tools", "__end__"]:
        last = state["messages"][-1]
        return "b_tools" if isinstance(last, AIMessage) and last.tool_calls else END

    inner = StateGraph(CopilotKitState)
    inner.add_node("agent", a_agent)
    inner.add_node("tools", ToolNode([transfer_to_b]))
    inner.add_edge(START, "agent")
    inner.add_edge("agent", "tools")
    inner.add_edge("tools", END)
    outer = StateGraph(CopilotKitState)
    outer.add_node("a", inner.compile())
    outer.add_node("b", b_agent)
    outer.add_node("b_tools", ToolNode([get_time]))
    outer.add_edge(START, "a")
    outer.add_conditional_edges("b", route)
    outer.add_edge("b_tools", "b")
    graph = outer.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t"}}
    await graph.ainvoke({"messages": [("user", "hi")]}, _with_tool_message_ids(config))
    results = [m for m in (await graph.aget_state(config)).values["messages"]
               if isinstance(m, ToolMessage)]
    assert [m.content for m in results] == ["transferred", "12:00"]
    assert len({m.id for m in results}) == 2


async def test_a_result_given_before_an_interrupt_keeps_its_id_when_the_run_is_resumed() -> None:
    """Review: a sibling's result streamed before another call of its ToolNode asked the
    user (an interrupt) got a new id when the resumed run ran the ToolNode again (another
    handler, another run): the client held a result the checkpoint did not keep."""

    @tool
    def steady(query: str) -> str:
        """Answers."""
        return f"steady {query}"

    @tool
    def ask(query: str) -> str:
        """Asks the user."""
        time.sleep(0.05)  # (the sibling ends first)
        return f"user said {interrupt(query)}"

    def agent(state: CopilotKitState) -> dict[str, Any]:
        if isinstance(state["messages"][-1], ToolMessage):
            return {"messages": [AIMessage("done", id="ai-2")]}
        return {"messages": [AIMessage("", id="ai-1", tool_calls=[
            {"id": "call_0", "name": "steady", "args": {"query": "a"}},
            {"id": "call_1", "name": "ask", "args": {"query": "ok?"}}])]}

    graph = _agent_loop("agent", agent, ToolNode([steady, ask])).compile(
        checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t"}}
    streamed: list[tuple[str, str | None]] = []
    for given in ({"messages": [("user", "hi")]}, Command(resume="yes")):
        async for event in graph.astream_events(given, _with_tool_message_ids(config),
                                                version="v2"):
            if event["event"] == "on_tool_end" and isinstance(
                    result := event["data"]["output"], ToolMessage):
                streamed.append((result.tool_call_id, result.id))
    kept = {m.tool_call_id: m.id for m in (await graph.aget_state(config)).values["messages"]
            if isinstance(m, ToolMessage)}
    assert [call for call, _ in streamed] == ["call_0", "call_0", "call_1"]
    assert {result for call, result in streamed if call == "call_0"} == {kept["call_0"]}


async def test_two_calls_of_one_id_keep_both_results() -> None:
    """Before: a model giving one id to two calls of a message (or a node's own loop reusing
    `call_0` each turn) had both results given one id, and the checkpoint kept one of them
    (its assistant turn left with a call and no result)."""

    @tool
    def steady(query: str) -> str:
        """Answers."""
        return f"steady {query}"

    def agent(state: CopilotKitState) -> dict[str, Any]:
        if isinstance(state["messages"][-1], ToolMessage):
            return {"messages": [AIMessage("done", id="ai-2")]}
        return {"messages": [AIMessage("", id="ai-1", tool_calls=[
            {"id": "call_0", "name": "steady", "args": {"query": "a"}},
            {"id": "call_0", "name": "steady", "args": {"query": "b"}}])]}

    graph = _agent_loop("agent", agent, ToolNode([steady])).compile(
        checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t"}}
    await graph.ainvoke({"messages": [("user", "hi")]}, _with_tool_message_ids(config))
    results = [m for m in (await graph.aget_state(config)).values["messages"]
               if isinstance(m, ToolMessage)]
    assert sorted(str(m.content) for m in results) == ["steady a", "steady b"]
    assert len({m.id for m in results}) == 2
