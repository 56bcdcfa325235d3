"""A legacy CopilotKit remote endpoint: the real `copilotkit` SDK serving real graphs.

Runs in `.venv-legacy` (see `tests/agents_support/legacy-requirements.txt`), because the
current SDK no longer ships the agent that serves a LangGraph graph on `/agents/execute`.
`python -m tests.agents_support.legacy_server --port P` with `LLM_BASE_URL` set serves
`/copilotkit/...`:

* agent `chat` (type `langgraph`): `graphs.chat_graph`, server tool `get_weather`;
* agent `planner` (type `langgraph`): `graphs.shared_state_graph`;
* agent `reporter` (type `langgraph`): emits a message, intermediate state, and exits;
* agent `asking` (type `langgraph`): interrupts for a topic, then a node answers it;
* agent `scripted` (type `crewai`): streams CopilotKit runtime events itself;
* action `add(a, b)`, and action `explode` that raises.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from copilotkit import Action, CopilotKitRemoteEndpoint, CopilotKitState
from copilotkit.agent import Agent
from copilotkit.integrations.fastapi import add_fastapi_endpoint
from copilotkit.langgraph import copilotkit_emit_message, copilotkit_emit_state, copilotkit_exit
from copilotkit.langgraph_agent import LangGraphAgent
from copilotkit.protocol import (
    action_execution_args,
    action_execution_end,
    action_execution_result,
    action_execution_start,
    agent_state_message,
    emit_runtime_events,
    text_message_content,
    text_message_end,
    text_message_start,
)
from fastapi import FastAPI
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from tests.agents_support import graphs


class ReportState(CopilotKitState):
    progress: int


def reporter_graph() -> Any:
    async def report(state: ReportState, config: RunnableConfig) -> dict[str, Any]:
        await copilotkit_emit_state(config, {"progress": 50})
        await copilotkit_emit_message(config, "Halfway there")
        await copilotkit_exit(config)
        return {"messages": [AIMessage(content="Done")], "progress": 100}

    builder = StateGraph(ReportState)
    builder.add_node("report", report)
    builder.add_edge(START, "report")
    builder.add_edge("report", END)
    return builder.compile(checkpointer=InMemorySaver())


class AskState(CopilotKitState):
    topic: str


def asking_graph() -> Any:
    """Asks for a topic (an interrupt); the answer is a node's message, no model streams."""
    def ask(state: AskState) -> dict[str, Any]:
        return {"topic": interrupt("which topic?")}

    def reply(state: AskState) -> dict[str, Any]:
        return {"messages": [AIMessage(content=f"topic={state['topic']}")]}

    builder = StateGraph(AskState)
    builder.add_node("ask", ask)
    builder.add_node("reply", reply)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "reply")
    builder.add_edge("reply", END)
    return builder.compile(checkpointer=InMemorySaver())


class ScriptedAgent(Agent):
    """An agent that speaks CopilotKit runtime events itself (the non-LangGraph form)."""

    def execute(self, *, state: dict[str, Any], config: Any = None, messages: list[Any],
                thread_id: str, actions: Any = None, meta_events: Any = None,
                **kwargs: Any) -> AsyncIterator[str]:
        last = messages[-1] if messages else {}
        text = last.get("content") or last.get("result") or ""

        async def stream() -> AsyncIterator[str]:
            def sync(active: bool, value: dict[str, Any]) -> str:
                return emit_runtime_events(agent_state_message(
                    thread_id=thread_id, agent_name=self.name, node_name="script",
                    run_id="scripted-run", active=active, role="assistant",
                    state=json.dumps(value), running=True))

            yield sync(True, {"seen": text, "count": len(messages)})
            yield emit_runtime_events(
                text_message_start(message_id="scripted-msg", parent_message_id=None),
                text_message_content(message_id="scripted-msg", content="scripted: "),
                text_message_content(message_id="scripted-msg", content=text),
                text_message_end(message_id="scripted-msg"))
            yield emit_runtime_events(
                action_execution_start(action_execution_id="scripted-call",
                                       action_name="lookup", parent_message_id="scripted-msg"),
                action_execution_args(action_execution_id="scripted-call", args='{"q":1}'),
                action_execution_end(action_execution_id="scripted-call"),
                action_execution_result(action_name="lookup",
                                        action_execution_id="scripted-call", result="found"))
            yield sync(False, {"seen": text, "count": len(messages), "done": True})

        return stream()

    async def get_state(self, *, thread_id: str) -> dict[str, Any]:
        return {"threadId": thread_id, "threadExists": False, "state": {}, "messages": []}

    def dict_repr(self) -> Any:
        return {**super().dict_repr(), "type": "crewai"}


def add(a: float, b: float) -> dict[str, float]:
    return {"sum": a + b}


def explode() -> None:
    raise RuntimeError("the action failed on purpose")


def build_app(base_url: str) -> FastAPI:
    agents = [
        LangGraphAgent(name="chat", description="Chats and checks the weather",
                       graph=graphs.chat_graph(base_url)),
        LangGraphAgent(name="planner", description="Plans with shared state",
                       graph=graphs.shared_state_graph(base_url)),
        LangGraphAgent(name="reporter", description="Reports progress",
                       graph=reporter_graph()),
        LangGraphAgent(name="asking", description="Asks for a topic", graph=asking_graph()),
        ScriptedAgent(name="scripted", description="Speaks runtime events"),
    ]
    sdk = CopilotKitRemoteEndpoint(
        actions=[
            Action(name="add", description="Add two numbers", handler=add, parameters=[
                {"name": "a", "type": "number", "description": "first"},
                {"name": "b", "type": "number", "description": "second"}]),
            Action(name="explode", description="Always fails", handler=explode),
        ],
        # The callable form: this SDK refuses LangGraphAgent in a plain list (it wants the
        # AG-UI agent), but still serves it on /agents/execute when agents come from a
        # function of the request context.
        agents=lambda context: agents,
    )
    app = FastAPI()
    add_fastapi_endpoint(app, sdk, "/copilotkit")
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=8200)
    args = parser.parse_args()
    app = build_app(os.environ.get("LLM_BASE_URL", "http://127.0.0.1:8090/v1"))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
