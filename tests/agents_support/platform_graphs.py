"""The graphs a loopback LangGraph Platform server (`langgraph dev`) serves in the tests.

The server imports this module in its own process; the mock LLM's URL comes from the
`LLM_BASE_URL` environment variable. Platform graphs have no checkpointer: the server
provides persistence.
"""

from __future__ import annotations

import os
from typing import Any

from copilotkit import CopilotKitState
from langchain_core.messages import AIMessage
from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from tests.agents_support import graphs

_BASE_URL = os.environ.get("LLM_BASE_URL", "http://127.0.0.1:8090/v1")


def _without_checkpointer(graph: Any) -> Any:
    return graph.copy(update={"checkpointer": None})


chat = _without_checkpointer(graphs.chat_graph(_BASE_URL))
planner = _without_checkpointer(graphs.shared_state_graph(_BASE_URL))
failing = _without_checkpointer(graphs.failing_graph())


def _loops() -> Any:
    """A node that always runs again: only the recursion limit stops it."""
    graph = StateGraph(CopilotKitState)
    graph.add_node("spin", lambda state: {})
    graph.add_edge(START, "spin")
    graph.add_edge("spin", "spin")
    return graph.compile()


def _writes() -> Any:
    """Writes with `get_stream_writer()`, in a node and in a subgraph's node."""

    def inner(state: CopilotKitState) -> dict[str, Any]:
        get_stream_writer()({"progress": 2, "where": "subgraph"})
        return {}

    sub = StateGraph(CopilotKitState)
    sub.add_node("inner", inner)
    sub.add_edge(START, "inner")
    sub.add_edge("inner", END)

    def node(state: CopilotKitState) -> dict[str, Any]:
        get_stream_writer()({"progress": 1})
        return {"messages": [AIMessage(content="done")]}

    graph = StateGraph(CopilotKitState)
    graph.add_node("node", node)
    graph.add_node("sub", sub.compile())
    graph.add_edge(START, "node")
    graph.add_edge("node", "sub")
    graph.add_edge("sub", END)
    return graph.compile()


class _AskingState(CopilotKitState):
    topic: str


def _asks() -> Any:
    """Asks a question (`interrupt`), then answers with what it was told."""

    def ask(state: _AskingState) -> dict[str, Any]:
        return {"topic": interrupt("which topic?")}

    def answer(state: _AskingState) -> dict[str, Any]:
        return {"messages": [AIMessage(content=f"topic={state['topic']}")]}

    graph = StateGraph(_AskingState)
    graph.add_node("ask", ask)
    graph.add_node("answer", answer)
    graph.add_edge(START, "ask")
    graph.add_edge("ask", "answer")
    graph.add_edge("answer", END)
    return graph.compile()


asking = _asks()
looping = _loops()
writer = _writes()
