"""Real LangGraph graphs for the agent tests, their model the loopback mock LLM.

Each factory takes the mock's base URL. The graphs follow the `copilotkit` SDK's
conventions: `CopilotKitState`, the frontend's tools bound from `state["copilotkit"]`,
and the `copilotkit.langgraph` helpers for custom events.
"""

from __future__ import annotations

from typing import Any, Literal

import httpx
from copilotkit import CopilotKitState
from copilotkit.langgraph import (
    copilotkit_customize_config,
    copilotkit_emit_message,
    copilotkit_emit_state,
    copilotkit_emit_tool_call,
    copilotkit_exit,
)
from langchain_core.messages import AIMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode


def model(base_url: str, client: httpx.AsyncClient | None = None) -> ChatOpenAI:
    # An explicit client the test closes: langchain-openai's shared default one would
    # outlive the test's event loop and leak its sockets.
    return ChatOpenAI(model="gpt-4o", base_url=base_url, api_key="sk-mock",  # type: ignore[arg-type]
                      max_retries=0, streaming=True, http_async_client=client)


@tool
def get_weather(city: str) -> dict[str, Any]:
    """Get the current weather for a city."""
    return {"city": city, "temperature": 18, "conditions": "cloudy"}


SERVER_TOOLS = [get_weather]


def chat_graph(base_url: str, client: httpx.AsyncClient | None = None) -> Any:
    """A chat that may call the server tool `get_weather` and any frontend tool.

    Server tool calls run in a `ToolNode` and loop back to the model; a frontend tool call
    ends the run so the client can execute it.
    """
    llm = model(base_url, client)

    async def chat(state: CopilotKitState, config: RunnableConfig) -> dict[str, Any]:
        frontend = state.get("copilotkit", {}).get("actions", [])
        bound = llm.bind_tools([*SERVER_TOOLS, *frontend])
        context = state.get("copilotkit", {}).get("context", [])
        system = [SystemMessage(content=f"context: {context}")] if context else []
        reply = await bound.ainvoke([*system, *state["messages"]], config)
        return {"messages": [reply]}

    def route(state: CopilotKitState) -> Literal["tools", "__end__"]:
        last = state["messages"][-1]
        names = {t.name for t in SERVER_TOOLS}
        if isinstance(last, AIMessage) and any(c["name"] in names for c in last.tool_calls):
            return "tools"
        return END

    graph = StateGraph(CopilotKitState)
    graph.add_node("chat", chat)
    graph.add_node("tools", ToolNode(SERVER_TOOLS))
    graph.add_edge(START, "chat")
    graph.add_conditional_edges("chat", route)
    graph.add_edge("tools", "chat")
    return graph.compile(checkpointer=InMemorySaver())


class PlannerState(CopilotKitState):
    """Shared with the frontend: it writes `items`, the graph adds to them and counts."""

    items: list[str]
    counter: int
    note: str


def shared_state_graph(base_url: str, client: httpx.AsyncClient | None = None) -> Any:
    """Reads the state the frontend wrote, answers about it, and writes it back changed."""
    llm = model(base_url, client)

    async def plan(state: PlannerState, config: RunnableConfig) -> dict[str, Any]:
        items = list(state.get("items") or [])
        items.append(f"item {len(items) + 1}")
        return {"items": items, "counter": (state.get("counter") or 0) + 1}

    async def answer(state: PlannerState, config: RunnableConfig) -> dict[str, Any]:
        reply = await llm.ainvoke(
            [*state["messages"][:-1],
             state["messages"][-1].model_copy(update={"content": f"items={state['items']}"})],
            config)
        return {"messages": [reply], "note": f"{len(state['items'])} items"}

    graph = StateGraph(PlannerState)
    graph.add_node("plan", plan)
    graph.add_node("answer", answer)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "answer")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=InMemorySaver())


class ProgressState(CopilotKitState):
    progress: int
    done: bool


def custom_events_graph(base_url: str, client: httpx.AsyncClient | None = None) -> Any:
    """Uses every `copilotkit.langgraph` helper the runtime must honour."""
    llm = model(base_url, client)

    async def work(state: ProgressState, config: RunnableConfig) -> dict[str, Any]:
        await copilotkit_emit_state(config, {"progress": 50})
        await copilotkit_emit_message(config, "Working on it")
        await copilotkit_emit_tool_call(config, name="showProgress", args={"percent": 50},
                                        tool_call_id="manual-call-1")
        # An internal model call the user must not see, nor its tool call.
        # (copilotkit_customize_config changes the metadata dict it is given: pass a copy)
        quiet = copilotkit_customize_config(
            {**config, "metadata": dict(config.get("metadata") or {})},
            emit_messages=False, emit_tool_calls=False)
        await llm.ainvoke(state["messages"], quiet)
        await copilotkit_exit(config)
        reply = await llm.ainvoke(state["messages"], config)
        return {"messages": [reply], "progress": 100, "done": True}

    graph = StateGraph(ProgressState)
    graph.add_node("work", work)
    graph.add_edge(START, "work")
    graph.add_edge("work", END)
    return graph.compile(checkpointer=InMemorySaver())


def selective_tools_graph(base_url: str, client: httpx.AsyncClient | None = None) -> Any:
    """Emits only the tool calls named in `copilotkit:emit-tool-calls`."""
    llm = model(base_url, client)

    async def chat(state: CopilotKitState, config: RunnableConfig) -> dict[str, Any]:
        frontend = state.get("copilotkit", {}).get("actions", [])
        selective = copilotkit_customize_config(
            {**config, "metadata": dict(config.get("metadata") or {})},
            emit_tool_calls=["visibleTool"])
        reply = await llm.bind_tools(frontend).ainvoke(state["messages"], selective)
        return {"messages": [reply]}

    graph = StateGraph(CopilotKitState)
    graph.add_node("chat", chat)
    graph.add_edge(START, "chat")
    graph.add_edge("chat", END)
    return graph.compile(checkpointer=InMemorySaver())


def failing_graph() -> Any:
    """A graph whose node raises: the client must get a RUN_ERROR without internals."""

    async def boom(state: CopilotKitState) -> dict[str, Any]:
        raise RuntimeError("secret detail /srv/app/config.py")

    graph = StateGraph(CopilotKitState)
    graph.add_node("boom", boom)
    graph.add_edge(START, "boom")
    graph.add_edge("boom", END)
    return graph.compile(checkpointer=InMemorySaver())


async def graph_values(graph: Any, thread: str) -> dict[str, Any]:
    """The values of `graph`'s checkpoint for `thread`."""
    state = await graph.aget_state({"configurable": {"thread_id": thread}})
    return dict(state.values)
