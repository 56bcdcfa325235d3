"""`parallel_review`: two reviews asked at once (parallel nodes, each calling `interrupt`),
then a summary of both answers. The graph several pending interrupts come from."""

from __future__ import annotations

from typing import Annotated, Any

from langchain_core.messages import AIMessage, AnyMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import interrupt
from typing_extensions import TypedDict


class Review(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    invoice: Any
    closing: Any


def _ask(part: str) -> Any:
    def ask(state: Review) -> dict[str, Any]:
        return {part: interrupt({"question": f"Approve the {part}?", "part": part})}
    return ask


def _summary(state: Review) -> dict[str, Any]:
    said = f"invoice: {state.get('invoice')}; closing: {state.get('closing')}"
    return {"messages": [AIMessage(content=said)]}


def parallel_review(checkpointer: Any) -> Any:
    graph = StateGraph(Review)
    graph.add_node("ask_invoice", _ask("invoice"))
    graph.add_node("ask_closing", _ask("closing"))
    graph.add_node("summary", _summary)
    graph.add_edge(START, "ask_invoice")
    graph.add_edge(START, "ask_closing")
    graph.add_edge(["ask_invoice", "ask_closing"], "summary")
    graph.add_edge("summary", END)
    return graph.compile(checkpointer=checkpointer)
