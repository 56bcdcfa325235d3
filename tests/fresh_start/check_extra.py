"""Run inside a fresh virtual environment holding only copilot-runtime and one extra:
`python check_extra.py EXTRA` imports the public names EXTRA exists for and runs one real
run through them, printing `ok EXTRA` at the end. It imports nothing from the test suite
(the environment has none of the test dependencies)."""

from __future__ import annotations

import asyncio
import faulthandler
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
    # Gemini's SDK route (a proxy, transport="sdk", client=) needs its extra: said at once,
    # not as every run's AGENT_ERROR; its own route needs none.
    from copilot_runtime import ConfigurationError
    from copilot_runtime.adapters.google import GoogleGenAIAdapter

    assert GoogleGenAIAdapter(api_key="k").transport == "direct"
    message = ""
    try:
        GoogleGenAIAdapter(api_key="k", transport="sdk")
    except ConfigurationError as exc:
        message = exc.message
    assert "pip install 'copilot-runtime[google]'" in message, message


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
    # PostgreSQL checkpoints need the postgres extra: said at once, naming it.
    from copilot_runtime import ConfigurationError

    message = ""
    try:
        checkpointer("postgresql://postgres@127.0.0.1:5432/test?schema=unused")
    except ConfigurationError as exc:
        message = exc.message
    assert "pip install 'copilot-runtime[postgres]'" in message, message


async def check_postgres() -> None:
    import psycopg

    server = os.environ.get("COPILOT_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
    schema = f"fresh_{uuid.uuid4().hex[:12]}"
    try:
        await run_graph_on(f"{server}?schema={schema}")
        # The thread store on the same schema: a chat is stored and read back.
        from copilot_runtime import CopilotRuntime, DemoAdapter, thread_store

        store = thread_store(f"{server}?schema={schema}")
        events = await run_events(CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                                                 thread_store=store), "default", "hi")
        assert types(events)[-1] == "RUN_FINISHED", types(events)
        reread = thread_store(f"{server}?schema={schema}")
        record = await reread.get(events[0]["threadId"])
        await reread.aclose()
        assert record is not None
        assert len(record.runs) == 1, record
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


async def check_auth() -> None:
    import time

    import jwt

    from copilot_runtime import JWTAuth
    from copilot_runtime.auth import RequestInfo

    secret = "a-fresh-start-secret-of-32-bytes!!"
    token = jwt.encode({"sub": "alice", "exp": int(time.time()) + 60}, secret,
                       algorithm="HS256")
    principal = await JWTAuth(secret, algorithms=["HS256"]).authenticate(
        RequestInfo("POST", "/run", {"authorization": f"Bearer {token}"}))
    assert principal.id == "alice", principal


async def check_otel() -> None:
    from copilot_runtime import CopilotRuntime, DemoAdapter
    from copilot_runtime.telemetry import Telemetry

    # The API alone (no SDK): spans and metrics go nowhere, and the run is unchanged.
    runtime = CopilotRuntime(service_adapter=DemoAdapter(), telemetry=Telemetry())
    events = await run_events(runtime, "default", "hi")
    assert types(events)[-1] == "RUN_FINISHED", types(events)


async def check_redis() -> None:
    from copilot_runtime import RateLimit
    from copilot_runtime.auth import RequestInfo
    from copilot_runtime.limits import RateLimiter, RedisCounters

    url = os.environ.get("COPILOT_TEST_REDIS", "redis://127.0.0.1:6379/0")
    counters = RedisCounters(url, prefix=f"fresh-{uuid.uuid4().hex}:")
    limiter = RateLimiter(RateLimit(concurrent_runs=1, backend=counters))
    try:
        lease = await limiter.acquire(RequestInfo("POST", "/run", {}, "127.0.0.1"))
        assert lease is not None
        await lease.release()
    finally:
        await limiter.aclose()


async def check_unreachable_provider(adapter: Any) -> None:
    """A provider's official SDK, installed alone, builds and sends a real request: to a
    loopback port where nothing listens, so the run ends with a clear upstream error."""
    from copilot_runtime import CopilotRuntime

    events = await run_events(CopilotRuntime(service_adapter=adapter), "default", "hi")
    assert types(events)[-1] == "RUN_ERROR", types(events)
    assert str(events[-1].get("code", "")).startswith("UPSTREAM_"), events[-1]


async def check_anthropic() -> None:
    from copilot_runtime import AnthropicAdapter

    await check_unreachable_provider(AnthropicAdapter(
        model="claude-sonnet-4-6", api_key="sk-test", base_url="http://127.0.0.1:9",
        max_retries=0))


async def check_google() -> None:
    from copilot_runtime import GoogleGenAIAdapter

    await check_unreachable_provider(GoogleGenAIAdapter(
        model="gemini-2.5-flash", api_key="test", base_url="http://127.0.0.1:9",
        max_retries=0))


async def check_langchain() -> None:
    from langchain_core.language_models.fake_chat_models import FakeListChatModel

    from copilot_runtime import CopilotRuntime, LangChainAdapter

    model = FakeListChatModel(responses=["hello from LangChain"])
    events = await run_events(CopilotRuntime(service_adapter=LangChainAdapter(model)),
                              "default", "hi")
    assert types(events)[-1] == "RUN_FINISHED", types(events)
    said = "".join(e.get("delta", "") for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")
    assert said == "hello from LangChain", events


async def check_mcp() -> None:
    from copilot_runtime import MCPServer, MCPToolset

    server = MCPServer(url="http://127.0.0.1:9/mcp")
    MCPToolset([server])
    stdio = MCPServer.stdio(sys.executable, ["-c", "pass"])
    assert stdio.label


CHECKS: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {
    "": check_base,
    "auth": check_auth,
    "otel": check_otel,
    "redis": check_redis,
    "langgraph": check_langgraph,
    "postgres": check_postgres,
    "platform": check_platform,
    "anthropic": check_anthropic,
    "google": check_google,
    "langchain": check_langchain,
    "mcp": check_mcp,
}

if __name__ == "__main__":
    extra = sys.argv[1] if len(sys.argv) > 1 else ""
    asyncio.run(CHECKS[extra]())
    print(f"ok {extra or 'base'}", flush=True)
    # Exiting takes a moment; one that hangs (seen once under heavy load, after "ok") shows
    # every thread's stack and fails, instead of running into the caller's timeout blind.
    faulthandler.dump_traceback_later(30, exit=True)
