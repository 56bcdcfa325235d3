"""MCP servers that go away and come back: the server's task reconnects with a capped
backoff (short here), lists the tools again, and serves them without a restart of the
runtime; calls while it is down fail at once with a tool error; closing is prompt whatever
the task is doing. Real SDK servers over streamable HTTP (stopped as a crash would, and
started again on the same port) and over stdio (a child process that exits)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from mcp.server.mcpserver import MCPServer as SDKServer
from structlog.testing import capture_logs

from copilot_runtime import (
    ActionError,
    ConfigurationError,
    CopilotRuntime,
    MCPServer,
    MCPToolset,
    OpenAIAdapter,
)
from copilot_runtime.actions import Action
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import ServeRuntime, free_port, run_input, types
from tests.mcp_support.servers import changing_server, clock_server, weather_server
from tests.mcp_support.serving import killable

TIMEOUT_S = 60
SERVERS = Path(__file__).parent / "mcp_support" / "servers.py"
#: Backoff of these tests: attempts every 20-100 ms instead of 0.5-30 s.
FAST = {"reconnect_delay": 0.02, "reconnect_max_delay": 0.1}
#: A call that finds its server down answers within this (no connect, no timeout).
FAIL_FAST_S = 1.0


def by_name(actions: list[Action]) -> dict[str, Action]:
    return {a.name: a for a in actions}


async def until(check: Callable[[], bool]) -> None:
    """Poll state that no event reports (a task's phase)."""
    while not check():  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def fails_fast(action: Action, arguments: str, match: str) -> None:
    started = time.monotonic()
    with pytest.raises(ActionError, match=match):
        await action.execute(arguments)
    assert time.monotonic() - started < FAIL_FAST_S


def tool_results(events: list[dict[str, Any]]) -> list[str]:
    return [e["content"] for e in events if e["type"] == "TOOL_CALL_RESULT"]


async def test_a_restarted_http_server_serves_its_tools_again(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """The runtime's MCP server is stopped as a crash would stop it: a run's call fails with
    a tool error at once, and so does every call while it is down; started again on the same
    port, its tools work again in the same runtime, and the agents are offered them."""
    port = free_port()
    app = weather_server().streamable_http_app
    async with asyncio.timeout(TIMEOUT_S):
        async with killable(app(), port) as (url, kill):
            runtime = CopilotRuntime(
                service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="k",
                                              max_retries=0),
                mcp_servers=[MCPServer(url=url + "/mcp", name="weather")])
            runtime.mcp.reconnect_delay = FAST["reconnect_delay"]
            runtime.mcp.reconnect_max_delay = FAST["reconnect_max_delay"]
            async with serve_runtime(runtime) as served:
                forecast = by_name(runtime.actions)["forecast"]
                before = await served.run(run_input('call:forecast {"city":"Oslo"}'))
                offered: list[list[Action]] = []
                changed = asyncio.Event()
                runtime.mcp.on_change.extend([offered.append, lambda _: changed.set()])
                with capture_logs() as logs:
                    await kill()
                    during = await served.run(run_input('call:forecast {"city":"Oslo"}',
                                                        run="r2"))
                    # the server is down: each call fails at once, without trying to connect
                    for _ in range(3):
                        await fails_fast(forecast, '{"city":"Oslo"}',
                                         "the MCP tool forecast is unavailable: the MCP "
                                         "server weather is gone")
                    await asyncio.sleep(0.5)  # some failed attempts, and their logs
                    async with killable(app(), port):
                        await changed.wait()
                        after = await served.run(run_input('call:forecast {"city":"Rome"}',
                                                           run="r3"))
                        # an action built before the outage calls the new session too
                        assert orjson.loads(await forecast.execute('{"city":"Bergen"}'))[
                            "city"] == "Bergen"
                        events = [entry["event"] for entry in logs]
                        failed = [e for e in logs if e["event"] == "MCP server reconnect failed"]
    assert orjson.loads(tool_results(before)[0])["sky"] == "clear"
    assert types(during)[-1] == "RUN_FINISHED"
    assert "the MCP tool forecast " in orjson.loads(tool_results(during)[0])["error"]
    assert orjson.loads(tool_results(after)[0]) == {"city": "Rome", "days": 1, "sky": "clear"}
    assert types(after)[-1] == "RUN_FINISHED"
    assert sorted(a.name for a in offered[-1]) == ["add", "explode", "forecast"]
    assert events.count("MCP server connection lost; reconnecting") == 1
    assert events.count("MCP server reconnected") == 1
    # about 10 attempts failed in 0.5 s: logged at warning after the 1st, 3rd, 7th only
    assert 1 <= len(failed) <= 4, failed
    assert all(e["log_level"] == "warning" for e in failed)


async def test_a_server_back_with_other_tools_is_listed_again() -> None:
    """A server that comes back with other tools: the new list is served, the ones it
    dropped are gone, and a name clash with another server is numbered (or dropped) again
    as at the start."""
    port = free_port()
    async with asyncio.timeout(TIMEOUT_S), \
            killable(weather_server().streamable_http_app()) as (weather, _):
        async with killable(clock_server().streamable_http_app(), port) as (clock, kill):
            toolset = MCPToolset([MCPServer(url=weather + "/mcp"),
                                  MCPServer(url=clock + "/mcp")], **FAST)
            changed = asyncio.Event()
            toolset.on_change.append(lambda _: changed.set())
            await toolset.start()
        try:
            assert sorted(by_name(toolset.actions)) == [
                "127_0_0_1_1__add", "127_0_0_1_2__add", "explode", "forecast"]
            clock_add = by_name(toolset.actions)["127_0_0_1_2__add"]
            await kill()
            await fails_fast(clock_add, '{"a":1,"b":2}', "the MCP tool add ")
            async with killable(changing_server().streamable_http_app(), port):
                await changed.wait()
                tools = by_name(toolset.actions)
                assert sorted(tools) == ["add", "explode", "forecast", "old", "swap", "vanish"]
                assert orjson.loads(await tools["old"].execute("{}")) == {"result": "old"}
                # the weather server's `add` no longer clashes: its plain name, its answer
                assert orjson.loads(await tools["add"].execute('{"a":1,"b":2}')) == {
                    "result": 3}
                # a tool the server dropped answers with a tool error, not a hang
                with pytest.raises(ActionError, match="Unknown tool: add"):
                    await clock_add.execute('{"a":1,"b":2}')
        finally:
            await toolset.aclose()


async def test_a_quick_restart_is_noticed_without_a_call() -> None:
    """A 2026-07-28 server restarted (with other tools) before any call: the end of its
    tool change stream ends the session, and the reconnect lists the new tools."""
    port = free_port()
    async with asyncio.timeout(TIMEOUT_S):
        async with killable(weather_server().streamable_http_app(), port) as (url, _):
            toolset = MCPToolset([MCPServer(url=url + "/mcp", name="w")], **FAST)
            offered: list[list[str]] = []
            changed = asyncio.Event()

            def heard(actions: list[Action]) -> None:
                offered.append([a.name for a in actions])
                changed.set()

            toolset.on_change.append(heard)
            await toolset.start()
        try:
            async with killable(clock_server().streamable_http_app(), port):
                await changed.wait()
                assert offered == [["add"]]
                added = await by_name(toolset.actions)["add"].execute('{"a":1,"b":2}')
                assert orjson.loads(added) == {"result": 1003}
        finally:
            await toolset.aclose()


def cutting_listens(inner: Any, after: float, methods: list[str]) -> Any:
    """`inner` behind a proxy that ends each `subscriptions/listen` stream `after` seconds
    in (an idle timeout), noting each POST's method in `methods`."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await inner(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        methods.append(orjson.loads(body).get("method"))

        unread = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> dict[str, Any]:
            return unread.pop() if unread else await receive()

        if methods[-1] != "subscriptions/listen":
            return await inner(scope, replayed, send)
        cut = False

        async def until_cut(message: dict[str, Any]) -> None:
            if not cut:
                await send(message)

        stream = asyncio.create_task(inner(scope, replayed, until_cut))
        await asyncio.sleep(after)
        cut = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        stream.cancel()
        await asyncio.wait([stream])

    return app


async def test_the_end_of_a_change_stream_spares_the_calls_in_flight() -> None:
    """A healthy 2026-07-28 server behind a proxy that ends long-lived streams: before, the
    end of its tool change stream ended the session, and a call in flight on it failed
    "Connection closed". Now the toolset listens again on the same session (and lists the
    tools again, for a change it may have missed), and the call is answered."""
    server = SDKServer("slow")

    @server.tool()
    async def slow() -> str:
        """Answers after a second."""
        await asyncio.sleep(1.0)
        return "done"

    methods: list[str] = []
    app = cutting_listens(server.streamable_http_app(), 0.3, methods)
    async with asyncio.timeout(TIMEOUT_S), killable(app) as (url, _):
        toolset = MCPToolset([MCPServer(url=url + "/mcp", name="s", timeout=10)], **FAST)
        await toolset.start()
        try:
            conn = toolset._connections[0]
            session = conn.client
            answer = await by_name(toolset.actions)["slow"].execute("{}")
            assert orjson.loads(answer) == {"result": "done"}
            assert (conn.client, conn.gone) == (session, None)
        finally:
            await toolset.aclose()
    assert methods.count("subscriptions/listen") >= 3, methods
    assert methods.count("tools/list") >= 3, methods


async def test_a_stdio_server_that_exits_is_started_again() -> None:
    """A stdio server whose process exits is started again: its tools work again, listed
    from the new process (here its `old` tool back, which `swap` had replaced). The call
    during which it exited fails (it ran); the next one waits for the new process (see
    test_mcp_call_retry.py)."""
    async with asyncio.timeout(TIMEOUT_S):
        toolset = MCPToolset([MCPServer.stdio(sys.executable, [str(SERVERS), "changing"],
                                              name="changing")], **FAST)
        changes: list[list[str]] = []
        changed = asyncio.Event()

        def heard(actions: list[Action]) -> None:
            changes.append([a.name for a in actions])
            changed.set()

        toolset.on_change.append(heard)
        await toolset.start()
        try:
            await by_name(toolset.actions)["swap"].execute("{}")
            await changed.wait()
            changed.clear()
            assert changes == [["swap", "vanish", "new"]]
            tools = by_name(toolset.actions)
            with pytest.raises(ActionError, match="the MCP tool vanish of changing failed"):
                await tools["vanish"].execute("{}")  # the process exits mid-call
            # a tool the new process does not publish: its server's answer, as a tool error
            with pytest.raises(ActionError, match="Unknown tool: new"):
                await tools["new"].execute('{"word":"x"}')
            await changed.wait()
            assert changes[-1] == ["old", "swap", "vanish"]
            assert orjson.loads(await by_name(toolset.actions)["old"].execute("{}")) == {
                "result": "old"}
        finally:
            await toolset.aclose()


async def test_closing_while_waiting_to_reconnect_is_prompt() -> None:
    """`aclose()` while a server's task waits out a long backoff (HTTP) or one of several
    (stdio): it returns at once and leaves no task behind."""
    async with asyncio.timeout(TIMEOUT_S), \
            killable(weather_server().streamable_http_app()) as (url, kill):
        toolset = MCPToolset(
            [MCPServer(url=url + "/mcp", name="weather"),
             MCPServer.stdio(sys.executable, [str(SERVERS), "changing"], name="changing")],
            reconnect_delay=30.0, reconnect_max_delay=30.0)
        await toolset.start()
        tasks = [conn.task for conn in toolset._connections]
        try:
            await kill()
            tools = by_name(toolset.actions)
            with pytest.raises(ActionError):
                await tools["forecast"].execute('{"city":"Oslo"}')
            with pytest.raises(ActionError):
                await tools["vanish"].execute("{}")
            await until(lambda: all(c.gone and not c.open for c in toolset._connections))
        finally:
            started = time.monotonic()
            await toolset.aclose()
    assert time.monotonic() - started < 1.0
    assert all(task is not None and task.done() and not task.cancelled() for task in tasks)
    with pytest.raises(ActionError, match="the session with the MCP server weather is closed"):
        await tools["forecast"].execute('{"city":"Oslo"}')


async def test_closing_while_a_reconnect_attempt_hangs_is_prompt() -> None:
    """A server that comes back as a socket that accepts and never answers: the reconnect
    attempt would wait for the server's timeout; `aclose()` does not."""
    port = free_port()
    accepted = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        accepted.set()

    async with asyncio.timeout(TIMEOUT_S):
        async with killable(weather_server().streamable_http_app(), port) as (url, _):
            toolset = MCPToolset([MCPServer(url=url + "/mcp", name="weather")], **FAST)
            await toolset.start()
        tasks = [conn.task for conn in toolset._connections]
        with pytest.raises(ActionError):
            await by_name(toolset.actions)["forecast"].execute('{"city":"Oslo"}')
        listener = await asyncio.start_server(hang, "127.0.0.1", port)
        try:
            await accepted.wait()  # a reconnect attempt is waiting for an answer
            started = time.monotonic()
            await toolset.aclose()
            assert time.monotonic() - started < 1.0
        finally:
            await toolset.aclose()
            for writer in writers:
                writer.close()
            listener.close()
            await listener.wait_closed()
    assert tasks
    assert all(task is not None and task.done() for task in tasks)


def test_the_backoff_doubles_up_to_its_cap_with_jitter() -> None:
    toolset = MCPToolset([], reconnect_delay=0.5, reconnect_max_delay=30.0)
    for attempt, full in ((1, 0.5), (2, 1.0), (3, 2.0), (7, 30.0), (1000, 30.0)):
        delays = [toolset._backoff(attempt) for _ in range(50)]
        assert all(full / 2 <= d <= full for d in delays), (attempt, delays)
        assert len(set(delays)) > 1  # jittered
    with pytest.raises(ConfigurationError):
        MCPToolset([], reconnect_delay=0)
    with pytest.raises(ConfigurationError):
        MCPToolset([], reconnect_delay=2, reconnect_max_delay=1)
