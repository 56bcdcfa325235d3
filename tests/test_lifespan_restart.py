"""A runtime whose app's lifespan ends and starts again (one module-level app used in two
`with TestClient(app):` blocks, the everyday FastAPI test) serves again, as the first time.

Before, `aclose` left the runtime closed and its store shut while the second start went
ahead and said "complete": on SQLite every request was a 500 ("Cannot operate on a closed
database"), `/ready` said "closing" for good on any store, and the second shutdown returned
at once without stopping the runs still streaming. Now the second start opens again what
the first shutdown closed (store, limits, MCP, approvals, sweeps) and the second shutdown
stops runs as the first did; a runtime whose parts cannot open again (a PostgreSQL store,
a shared coordinator) refuses its second start with a message saying why, which the
lifespan sends as `lifespan.startup.failed`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from langgraph.checkpoint.memory import InMemorySaver

from copilot_runtime import (
    AnthropicAdapter,
    CopilotRuntime,
    GoogleGenAIAdapter,
    HttpAgent,
    LangGraphPlatformAgent,
    OpenAIAdapter,
    RateLimit,
    create_app,
    mount_runtime,
    thread_store,
)
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.auth import RequestInfo
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.testing import (
    MockAnthropicServer,
    MockGeminiServer,
    MockOpenAIServer,
    ScriptedAdapter,
    text_turn,
)
from copilot_runtime.threads import SQLiteThreadStore
from tests.agents_support import graphs
from tests.agents_support.agui_server import ScriptedAGUIServer
from tests.agents_support.fake_platform import FakePlatform, frame, model_stream
from tests.conftest import parse_sse, run_input, serve, text_of, types
from tests.hitl_support.postgres import postgres_schema

pytestmark = pytest.mark.timeout(60)

Message = dict[str, Any]


def test_a_test_client_used_twice_serves_each_time(tmp_path: Path) -> None:
    """Two `with TestClient(app):` blocks on one app (its runtime over SQLite, rate limited):
    each serves runs and is ready, and the second reads the first one's thread."""
    runtime = CopilotRuntime(
        service_adapter=ScriptedAdapter(text_turn("one"), text_turn("two")),
        thread_store=thread_store(f"sqlite:///{tmp_path / 'threads.db'}"),
        rate_limit=RateLimit(concurrent_runs=2))
    app = FastAPI()
    mount_runtime(app, runtime, "/copilotkit")
    for block, thread in enumerate(("t-1", "t-2")):
        with TestClient(app) as client:
            response = client.post("/copilotkit/agent/default/run",
                                   json=run_input("hi", thread=thread, run=f"r-{block}"))
            assert response.status_code == 200, (block, response.text)
            events = parse_sse(response.content)
            assert types(events)[-1] == "RUN_FINISHED", (block, events[-1])
            assert text_of(events) == ("one", "two")[block]
            ready = client.get("/copilotkit/ready")
            assert (ready.status_code, ready.json()) == (200, {"status": "ready"}), block
            first = client.get("/copilotkit/threads/t-1/messages")
            assert first.status_code == 200, first.text
            assert [m["content"] for m in first.json()["messages"]] == ["hi", "one"]
    assert not runtime.started


async def _lifespan(app: Any) -> tuple[Message, Callable[[], Awaitable[Message]]]:
    """Start `app`'s lifespan: what it answered, and how to shut it down (its answer)."""
    received: asyncio.Queue[Message] = asyncio.Queue()
    sent: asyncio.Queue[Message] = asyncio.Queue()
    await received.put({"type": "lifespan.startup"})
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}},
                                   received.get, sent.put))
    started = await sent.get()

    async def shut_down() -> Message:
        await received.put({"type": "lifespan.shutdown"})
        await task
        return await sent.get()

    if started["type"] != "lifespan.startup.complete":
        await task
    return started, shut_down


async def test_each_shutdown_of_a_lifespan_run_twice_stops_its_runs() -> None:
    """The ASGI lifespan run twice over one app: each start completes and leaves the runtime
    ready, and each shutdown ends the run still streaming at once (RUN_INTERRUPTED); the
    second returned early before, the run streaming on to its end."""
    async with MockOpenAIServer() as llm:
        runtime = CopilotRuntime(service_adapter=OpenAIAdapter(
            model="gpt-4o", api_key="sk-test", base_url=llm.base_url))
        app = create_app(runtime)
        transport = httpx.ASGITransport(app=app)
        for cycle in range(2):
            started, shut_down = await _lifespan(app)
            assert started == {"type": "lifespan.startup.complete"}, cycle
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=30) as client:
                ready = await client.get("/copilotkit/ready")
                assert ready.status_code == 200, (cycle, ready.text)
                run = asyncio.create_task(client.post(
                    "/copilotkit/agent/default/run",
                    content=orjson.dumps(run_input("slow:300 " + "word " * 20,
                                                   thread=f"t-{cycle}")),
                    headers={"Content-Type": "application/json"}))
                await asyncio.sleep(1.0)  # streaming
                began = time.monotonic()
                assert await shut_down() == {"type": "lifespan.shutdown.complete"}
                events = parse_sse((await run).content)
            assert time.monotonic() - began < 2.5, cycle
            assert (types(events)[-1], events[-1].get("code")) == (
                "RUN_ERROR", "RUN_INTERRUPTED"), (cycle, events[-1])
            assert not runtime.started


async def test_a_runtime_whose_store_cannot_open_again_refuses_its_second_start() -> None:
    """A PostgreSQL store's pool cannot open again once closed: the second start is refused,
    the lifespan says why (`lifespan.startup.failed`), not "complete" with a dead store."""
    with postgres_schema() as url:
        runtime = CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("one")),
                                 thread_store=thread_store(url))
        app = create_app(runtime)
        started, shut_down = await _lifespan(app)
        assert started == {"type": "lifespan.startup.complete"}
        assert await shut_down() == {"type": "lifespan.shutdown.complete"}
        started, _ = await _lifespan(app)
        assert started["type"] == "lifespan.startup.failed"
        assert "was closed (aclose) and cannot start again" in started["message"]
        assert "PostgresThreadStore has no reopen()" in started["message"]


async def test_a_runtime_closed_by_hand_starts_again(tmp_path: Path) -> None:
    """`start` after `aclose`, without an app: the SQLite store, the limits and an
    `on_request` hook serve again."""
    seen: list[str] = []

    def on_request(request: RequestInfo) -> None:
        seen.append(request.request_id)

    runtime = CopilotRuntime(
        service_adapter=ScriptedAdapter(text_turn("one"), text_turn("two")),
        thread_store=thread_store(f"sqlite:///{tmp_path / 'threads.db'}"),
        rate_limit=RateLimit(runs_per_minute=10), on_request=on_request)
    app = create_app(runtime)
    for cycle in range(2):
        await runtime.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            response = await client.post(
                "/copilotkit/agent/default/run",
                content=orjson.dumps(run_input("hi", thread=f"t-{cycle}")),
                headers={"Content-Type": "application/json"})
            assert response.status_code == 200, (cycle, response.text)
            assert text_of(parse_sse(response.content)) == ("one", "two")[cycle]
        assert await runtime.unready() == []
        await runtime.aclose()
        assert await runtime.unready() == ["closing"]
    assert len(seen) == 2


class SlowDisk(SQLiteThreadStore):
    """A SQLite store whose run writes take 1.5 s (a busy disk): longer than a run's end
    waits for its write once a shutdown began (`SHUTDOWN_STORE_WAIT`)."""

    async def append_run(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(1.5)
        return await super().append_run(*args, **kwargs)


async def test_a_restarted_runtime_is_no_longer_shutting_down(tmp_path: Path) -> None:
    """The first shutdown marked the runs as stopping (`RunManager.stopping_since`) for good:
    in the second life a run's end waited for its write 1 s (a shutdown's wait) instead of
    10 s, so the client heard RUN_FINISHED before its run was stored and its next message on
    the thread was refused as busy (409); the second shutdown's grace was spent already."""
    runtime = CopilotRuntime(
        service_adapter=ScriptedAdapter(*(text_turn(f"answer {i}") for i in range(4))),
        thread_store=SlowDisk(tmp_path / "threads.db"))
    app = create_app(runtime)
    transport = httpx.ASGITransport(app=app)
    for cycle in range(2):
        started, shut_down = await _lifespan(app)
        assert started == {"type": "lifespan.startup.complete"}, cycle
        assert runtime.runs.stopping_since is None, cycle
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=30) as client:
            for text in ("hi", "and then?"):
                response = await client.post(
                    "/copilotkit/agent/default/run",
                    content=orjson.dumps(run_input(text, thread=f"t-{cycle}")),
                    headers={"Content-Type": "application/json"})
                assert response.status_code == 200, (cycle, text, response.text)
                assert types(parse_sse(response.content))[-1] == "RUN_FINISHED", cycle
        assert await shut_down() == {"type": "lifespan.shutdown.complete"}


async def test_a_probe_or_request_during_the_close_does_not_open_it_again(
        tmp_path: Path) -> None:
    """A readiness probe or a request that came while `aclose` ran (a hook being drained)
    started the runtime again: nothing reopened (the store was still open), its closed state
    was cleared and its sweeps started, then `aclose` closed the store anyway: `/ready` said
    200 while every request was a 500. A probe during the close says "closing" now, a request
    is served as it was before, and only a start once the close is over opens it again."""
    async def slow_hook(run: Any) -> None:
        await asyncio.sleep(1.0)  # posting the run to a webhook, say: the close drains it

    async with MockOpenAIServer() as llm:
        runtime = CopilotRuntime(
            service_adapter=OpenAIAdapter(model="gpt-4o", api_key="sk-test",
                                          base_url=llm.base_url),
            thread_store=thread_store(f"sqlite:///{tmp_path / 'threads.db'}"),
            thread_retention_seconds=3600, on_run_finished=slow_hook)
        app = create_app(runtime)
        started, shut_down = await _lifespan(app)
        assert started == {"type": "lifespan.startup.complete"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=30) as client:
            answered = await client.post(
                "/copilotkit/agent/default/run", content=orjson.dumps(run_input("hi")),
                headers={"Content-Type": "application/json"})
            assert types(parse_sse(answered.content))[-1] == "RUN_FINISHED"
            closing = asyncio.create_task(shut_down())
            await asyncio.sleep(0.3)  # the close waits for the hook
            assert not closing.done()
            probe = await client.get("/copilotkit/ready")
            assert (probe.status_code, probe.json()) == (
                503, {"status": "unavailable", "unavailable": ["closing"]})
            listed = await client.get("/copilotkit/threads")
            assert listed.status_code == 200, listed.text
            assert await closing == {"type": "lifespan.shutdown.complete"}
            assert not runtime.started
            assert await runtime.unready() == ["closing"]
            # A start once the close is over (the next request's) opens it again.
            ready = await client.get("/copilotkit/ready")
            assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
            again = await client.post(
                "/copilotkit/agent/default/run", content=orjson.dumps(run_input("hi")),
                headers={"Content-Type": "application/json"})
            assert types(parse_sse(again.content))[-1] == "RUN_FINISHED", again.text
            assert (await client.get("/copilotkit/threads")).status_code == 200
        await runtime.aclose()


async def _served_twice(runtime: CopilotRuntime, agent: str = "default"
                        ) -> list[tuple[str, Any]]:
    """Each of two lifespans of `runtime`'s app: its start's answer and its run's last event."""
    app = create_app(runtime)
    transport = httpx.ASGITransport(app=app)
    outcomes: list[tuple[str, Any]] = []
    for _ in range(2):
        started, shut_down = await _lifespan(app)
        if started["type"] != "lifespan.startup.complete":
            outcomes.append((started["type"], started.get("message")))
            continue
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=30) as client:
            response = await client.post(
                f"/copilotkit/agent/{agent}/run", content=orjson.dumps(run_input("hi")),
                headers={"Content-Type": "application/json"})
        events = parse_sse(response.content)
        outcomes.append((started["type"], (events[-1]["type"], events[-1].get("message"))))
        assert await shut_down() == {"type": "lifespan.shutdown.complete"}
    return outcomes


SERVED_TWICE = [("lifespan.startup.complete", ("RUN_FINISHED", None))] * 2


async def test_an_adapter_on_its_sdk_serves_a_restarted_runtime() -> None:
    """Each provider's adapter sending through its SDK closed its client at `aclose` and
    kept it: the second life's runs failed ("the client has been closed"). The client the
    adapter made is made again now, on its next use."""
    async with MockOpenAIServer() as openai_llm:
        openai = OpenAIAdapter(model="gpt-4o", api_key="sk-test",
                               base_url=openai_llm.base_url, transport="sdk")
        assert await _served_twice(CopilotRuntime(service_adapter=openai)) == SERVED_TWICE
    async with MockAnthropicServer() as anthropic_llm:
        anthropic = AnthropicAdapter(api_key="sk-mock", base_url=anthropic_llm.base_url,
                                     max_retries=0, transport="sdk")
        assert await _served_twice(CopilotRuntime(service_adapter=anthropic)) == SERVED_TWICE
    async with MockGeminiServer() as gemini_llm:
        google = GoogleGenAIAdapter(api_key="mock-key", base_url=gemini_llm.base_url,
                                    max_retries=0, transport="sdk")
        assert await _served_twice(CopilotRuntime(service_adapter=google)) == SERVED_TWICE


async def test_a_client_given_to_an_adapter_is_left_open_for_the_next_runtime() -> None:
    """A `client=` the application gave was closed by its adapter's `aclose`: the same
    runtime's second start was refused, and a new runtime given the same adapter (built once
    for every test, say) said "complete" while each of its runs failed ("the client has been
    closed"). The application owns what it gave: an adapter closes only a client it made, so
    the same runtime started again and a new one both serve, and the client is still open."""
    import aiohttp
    import anthropic
    import openai
    from google import genai

    async with MockOpenAIServer() as openai_llm, MockAnthropicServer() as anthropic_llm, \
            MockGeminiServer() as gemini_llm, aiohttp.ClientSession() as session:
        openai_client = openai.AsyncOpenAI(api_key="sk-test", base_url=openai_llm.base_url)
        anthropic_client = anthropic.AsyncAnthropic(
            api_key="sk-mock", base_url=anthropic_llm.base_url, max_retries=0)
        google_client = genai.Client(api_key="mock-key", http_options={
            "base_url": gemini_llm.base_url, "aiohttp_client": session})
        adapters = [OpenAIAdapter(model="gpt-4o", client=openai_client),
                    AnthropicAdapter(client=anthropic_client),
                    GoogleGenAIAdapter(client=google_client)]
        try:
            for adapter in adapters:
                for _ in range(2):  # a new runtime for the same adapter
                    runtime = CopilotRuntime(service_adapter=adapter)
                    assert await _served_twice(runtime) == SERVED_TWICE, adapter
            assert not openai_client.is_closed()
            assert not anthropic_client.is_closed()
        finally:
            await openai_client.close()
            await anthropic_client.close()
            await google_client.aio.aclose()


async def test_remote_agents_serve_a_restarted_runtime() -> None:
    """A remote AG-UI agent and a LangGraph Platform agent make their connections again
    after `aclose` (the platform's client was made once, and closed for good)."""
    async with ScriptedAGUIServer() as remote:
        runtime = CopilotRuntime(agents={"remote": HttpAgent(remote.url)})
        assert await _served_twice(runtime, "remote") == SERVED_TWICE
    fake = FakePlatform(frames=[frame("events", model_stream("Hello"))])
    async with serve(fake.app) as platform:
        runtime = CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
            deployment_url=platform, graph_id="fake")})
        assert await _served_twice(runtime, "platform") == SERVED_TWICE


class ClosingSaver(InMemorySaver):
    """A checkpointer of the application's own with an `aclose` (which cannot open it again)."""

    closed = False

    async def aclose(self) -> None:
        self.closed = True


async def test_a_langgraph_agent_closes_only_the_checkpointer_the_runtime_made(
        tmp_path: Path) -> None:
    """An in-process LangGraph agent on a `copilot_runtime.checkpointers` checkpointer (its
    SQLite file closed by `aclose`, opened again on its next use) serves a restarted runtime.
    A graph's checkpointer of the application's own was closed by `aclose` too, and the
    second start refused: it is the application's to close now, left open, and each start
    serves (the same runtime's, a new runtime's)."""
    async with MockOpenAIServer() as llm, httpx.AsyncClient() as client:
        graph = graphs.chat_graph(llm.base_url, client)
        graph.checkpointer = checkpointer(f"sqlite:///{tmp_path / 'checkpoints.db'}")
        runtime = CopilotRuntime(agents={"chat": LangGraphAgent(name="chat", graph=graph)})
        assert await _served_twice(runtime, "chat") == SERVED_TWICE
        saver = graph.checkpointer = ClosingSaver()
        agent = LangGraphAgent(name="chat", graph=graph)
        for _ in range(2):
            runtime = CopilotRuntime(agents={"chat": agent})
            assert await _served_twice(runtime, "chat") == SERVED_TWICE
        assert not saver.closed


class SlowRecovery(SQLiteThreadStore):
    """A SQLite store whose runs left open take 0.5 s to list (a slow disk at start-up)."""

    async def open_runs(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.5)
        return await super().open_runs(*args, **kwargs)


async def test_a_start_under_way_when_the_close_begins_leaves_nothing_running(
        tmp_path: Path) -> None:
    """A start still recovering (a first request's) when `aclose` began went on once the
    close was over: it started the retention sweep on the closed runtime (its SQLite file
    closed), which ran for ever, failing at each turn. The close waits for a start under way
    now, then closes what it started; the runtime starts again after, as any closed one."""
    runtime = CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("one")),
                             thread_store=SlowRecovery(tmp_path / "threads.db"),
                             thread_retention_seconds=3600)
    others = asyncio.all_tasks()
    for cycle in range(2):
        starting = asyncio.create_task(runtime.start())
        await asyncio.sleep(0.1)  # the start lists the runs left open
        await runtime.aclose()
        await starting
        assert not runtime.started, cycle
        assert runtime._retention is None, cycle
        assert await runtime.unready() == ["closing"], cycle
        assert asyncio.all_tasks() - others - {starting} == set(), cycle
    await runtime.start()
    assert await runtime.unready() == []
    await runtime.aclose()
