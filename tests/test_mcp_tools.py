"""MCP servers' tools as server-side actions, against real MCP servers built with the SDK:
one over streamable HTTP on loopback, one over stdio (a child process)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from copilot_runtime import (
    ActionError,
    ConfigurationError,
    CopilotRuntime,
    MCPServer,
    MCPToolset,
    OpenAIAdapter,
)
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import ServeRuntime, run_input, serve, text_of, types
from tests.mcp_support.servers import weather_server

TIMEOUT_S = 60
SERVERS = Path(__file__).parent / "mcp_support" / "servers.py"


async def test_streamable_http_and_stdio_tools_become_actions(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    async with asyncio.timeout(TIMEOUT_S), serve(weather_server().streamable_http_app()) as url:
        toolset = MCPToolset([
            MCPServer(url=url + "/mcp", headers={"Authorization": "Bearer t"}),
            MCPServer.stdio(sys.executable, [str(SERVERS), "clock"], name="clock")])
        await toolset.start()
        try:
            names = sorted(a.name for a in toolset.actions)
            # `add` is published by both: namespaced; the others keep their names
            assert names == ["127_0_0_1__add", "clock__add", "explode", "forecast"]
            by_name = {a.name: a for a in toolset.actions}
            assert by_name["forecast"].parameters["properties"]["city"]["type"] == "string"
            assert orjson.loads(await by_name["forecast"].execute('{"city":"Oslo"}')) == {
                "city": "Oslo", "days": 1, "sky": "clear"}
            added = await by_name["clock__add"].execute('{"a":1,"b":2}')
            assert orjson.loads(added) == {"result": 1003}
            with pytest.raises(ActionError, match="exploded: now"):
                await by_name["explode"].execute('{"reason":"now"}')

            runtime = CopilotRuntime(
                service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="k",
                                              max_retries=0), actions=toolset.actions)
            async with serve_runtime(runtime) as served:
                events = await served.run(run_input('call:forecast {"city":"Rome","days":2}'))
                failed = await served.run(run_input('call:explode {"reason":"x"}', run="r2"))
        finally:
            await toolset.aclose()
    assert types(events)[-1] == "RUN_FINISHED"
    result = next(e for e in events if e["type"] == "TOOL_CALL_RESULT")
    assert orjson.loads(result["content"]) == {"city": "Rome", "days": 2, "sky": "clear"}
    assert text_of(events) == "echo: " + result["content"]
    error = next(e for e in failed if e["type"] == "TOOL_CALL_RESULT")
    assert "exploded: x" in orjson.loads(error["content"])["error"]
    assert types(failed)[-1] == "RUN_FINISHED"


def test_server_needs_one_transport() -> None:
    with pytest.raises(ConfigurationError):
        MCPServer()
    with pytest.raises(ConfigurationError):
        MCPServer(url="http://x", command="y")


async def test_runtime_offers_its_mcp_servers_tools(llm: MockOpenAIServer,
                                                    serve_runtime: ServeRuntime) -> None:
    """`CopilotRuntime(mcp_servers=...)` connects when it starts (the app's lifespan), gives
    the built-in agent the tools, and closes the sessions when it stops."""

    async with asyncio.timeout(TIMEOUT_S), serve(weather_server().streamable_http_app()) as url:
        from copilot_runtime import action

        @action
        def explode(reason: str) -> str:
            """The application's own action of the same name as a tool: it wins."""
            return f"kept: {reason}"

        runtime = CopilotRuntime(
            service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="k", max_retries=0),
            actions=[explode], mcp_servers=[MCPServer(url=url + "/mcp")])
        async with serve_runtime(runtime) as served:
            assert sorted(a.name for a in runtime.actions) == ["add", "explode", "forecast"]
            events = await served.run(run_input('call:forecast {"city":"Rome","days":2}'))
            own = await served.run(run_input('call:explode {"reason":"x"}', run="r2"))
        assert runtime.mcp._stack is None  # closed with the app
    result = next(e for e in events if e["type"] == "TOOL_CALL_RESULT")
    assert orjson.loads(result["content"]) == {"city": "Rome", "days": 2, "sky": "clear"}
    assert types(events)[-1] == "RUN_FINISHED"
    assert next(e for e in own if e["type"] == "TOOL_CALL_RESULT")["content"] == '"kept: x"'


async def test_servers_a_request_names_are_never_contacted(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """Without `mcp_allowed_urls` a request cannot make the runtime connect anywhere: the
    1.x `properties.mcpServers` and AG-UI `forwardedProps.mcpServers` are ignored, and a
    listening socket of the test sees no connection."""
    from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, user_turn

    connections = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    listener = await asyncio.start_server(count, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    named = [{"endpoint": f"http://127.0.0.1:{port}/mcp", "apiKey": "k"}]
    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="k", max_retries=0))
    try:
        async with serve_runtime(runtime) as served:
            answer = await served.session.post(served.url, headers=CLIENT_HEADERS, json={
                "query": CHAT_DOCUMENT, "variables": {
                    "data": user_turn("hello"), "properties": {"mcpServers": named}}})
            assert answer.status == 200
            await answer.read()
            events = await served.run(run_input("hello", forwardedProps={"mcpServers": named}))
        assert types(events)[-1] == "RUN_FINISHED"
        await asyncio.sleep(0.2)
        assert connections == 0
    finally:
        listener.close()
        await listener.wait_closed()


async def test_servers_a_request_names_need_the_applications_allow_list(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """With `mcp_allowed_urls`, a 1.x request's `properties.mcpServers` on the list are offered
    for that run (connected in the run, closed after it); one off the list refuses the request
    with a GraphQL error before anything is connected."""
    from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, merge, parse_multipart, user_turn

    connections = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    listener = await asyncio.start_server(count, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(TIMEOUT_S), \
                serve(weather_server().streamable_http_app()) as url:
            runtime = CopilotRuntime(
                service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="k",
                                              max_retries=0),
                mcp_allowed_urls=[url + "/mcp/"])
            async with serve_runtime(runtime) as served:
                async def chat(text: str, endpoint: str) -> Any:
                    answer = await served.session.post(served.url, headers=CLIENT_HEADERS, json={
                        "query": CHAT_DOCUMENT, "variables": {
                            "data": user_turn(text),
                            "properties": {"mcpServers": [{"endpoint": endpoint}]}}})
                    assert answer.status == 200
                    body = await answer.read()
                    if answer.content_type.startswith("multipart"):
                        return merge(parse_multipart(body))
                    return orjson.loads(body)

                allowed = await chat('call:forecast {"city":"Rome","days":2}', url + "/mcp")
                refused = await chat("hello", f"http://127.0.0.1:{port}/mcp")
            assert runtime.actions == []  # nothing stays offered after the run
    finally:
        listener.close()
        await listener.wait_closed()
    assert '\\"sky\\":\\"clear\\"' in orjson.dumps(allowed).decode(), allowed
    assert refused["data"] is None
    assert "is not allowed by this runtime" in refused["errors"][0]["message"]
    assert connections == 0
