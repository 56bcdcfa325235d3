"""Run inside a fresh virtual environment holding only copilot-runtime and one extra:
`python check_extra.py EXTRA` imports the public names EXTRA exists for and runs one real
run through them, printing `ok EXTRA` at the end. It imports nothing from the test suite
(the environment has none of the test dependencies)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Coroutine
from typing import Any


async def run_events(runtime: Any, agent_id: str, text: str) -> list[dict[str, Any]]:
    """One AG-UI run through the app on a real server, the way a client makes it."""
    import aiohttp
    import uvicorn

    from copilot_runtime import create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(create_app(runtime, path="/copilotkit"), host="127.0.0.1",
                            port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not serving.done(), "the server did not start"
            await asyncio.sleep(0.02)
        body = {"threadId": f"t-{uuid.uuid4().hex}", "runId": "r1", "state": {}, "tools": [],
                "context": [], "forwardedProps": {},
                "messages": [{"id": "m1", "role": "user", "content": text}]}
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{port}/copilotkit/agent/{agent_id}/run", json=body,
                headers={"Accept": "text/event-stream"}) as answer:
            text_body = await answer.text()
            assert answer.status == 200, (answer.status, text_body)
    finally:
        server.should_exit = True  # the lifespan closes the runtime
        await serving
    return [json.loads(line[6:]) for line in text_body.splitlines()
            if line.startswith("data: ")]


def types(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"] for event in events]


async def check_base() -> None:
    from copilot_runtime import (  # noqa: F401  (the names a base install exists for)
        Action,
        CopilotRuntime,
        DemoAdapter,
        HttpAgent,
        OpenAIAdapter,
        SQLiteThreadStore,
        action,
        create_app,
        mount_runtime,
    )

    @action
    def get_weather(city: str) -> dict[str, Any]:
        """The weather in a city."""
        return {"city": city, "conditions": "sunny"}

    runtime = CopilotRuntime(service_adapter=DemoAdapter(), actions=[get_weather])
    events = await run_events(runtime, "default", "What is the weather in Paris?")
    assert "TOOL_CALL_RESULT" in types(events), types(events)
    assert types(events)[-1] == "RUN_FINISHED", types(events)
    # Names of an extra that is not installed say which extra adds them.
    message = ""
    try:
        from copilot_runtime import LangGraphAgent  # noqa: F401
    except ImportError as exc:
        message = str(exc)
    assert "pip install 'copilot-runtime[langgraph]'" in message, message


def one_step_graph(saver: Any) -> Any:
    from langchain_core.messages import AIMessage
    from langgraph.graph import START, MessagesState, StateGraph

    def answer(state: MessagesState) -> dict[str, Any]:
        return {"messages": [AIMessage(content="hello from the graph")]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    return builder.compile(checkpointer=saver)


async def run_graph_on(url: str) -> None:
    from copilot_runtime import CopilotRuntime, LangGraphAgent, checkpointer

    saver = checkpointer(url)
    agent = LangGraphAgent(name="graph", graph=one_step_graph(saver))
    events = await run_events(CopilotRuntime(agents={"graph": agent}), "graph", "hi")
    assert types(events)[-1] == "RUN_FINISHED", types(events)
    (snapshot,) = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"]
    assert snapshot["messages"][-1]["content"] == "hello from the graph", events


async def check_langgraph() -> None:
    from copilot_runtime import (  # noqa: F401
        LangGraphAgent,
        Orchestrator,
        ReviewLoop,
        checkpointer,
        existing_agent,
    )
    from copilot_runtime.demo import missing_workflow_dependency

    assert missing_workflow_dependency() is None, missing_workflow_dependency()
    with tempfile.TemporaryDirectory() as tmp:
        await run_graph_on(f"sqlite:///{tmp}/checkpoints.sqlite3")


async def check_postgres() -> None:
    import psycopg

    server = os.environ.get("COPILOT_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
    schema = f"fresh_{uuid.uuid4().hex[:12]}"
    try:
        await run_graph_on(f"{server}?schema={schema}")
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def check_platform() -> None:
    from copilot_runtime import CopilotRuntime, LangGraphPlatformAgent

    # Nothing listens on port 9 of loopback: the agent must reach for it and say it failed.
    agent = LangGraphPlatformAgent(deployment_url="http://127.0.0.1:9", graph_id="agent",
                                   timeout=5)
    events = await run_events(CopilotRuntime(agents={"remote": agent}), "remote", "hi")
    assert types(events)[-1] == "RUN_ERROR", types(events)
    assert "127.0.0.1" not in json.dumps(events[-1]), events[-1]


CHECKS: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {
    "": check_base,
    "langgraph": check_langgraph,
    "postgres": check_postgres,
    "platform": check_platform,
}

if __name__ == "__main__":
    extra = sys.argv[1] if len(sys.argv) > 1 else ""
    asyncio.run(CHECKS[extra]())
    print(f"ok {extra or 'base'}")
