"""MCP servers' tools as server-side actions, against real MCP servers built with the SDK:
over streamable HTTP on loopback and over stdio (a child process). Tools are listed once and
again only when a server says its list changed; a server that goes away leaves tool errors
until it is back (test_mcp_reconnect.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from structlog.testing import capture_logs

from copilot_runtime import (
    ActionError,
    ConfigurationError,
    CopilotRuntime,
    MCPServer,
    MCPToolset,
    OpenAIAdapter,
)
from copilot_runtime.agents.builtin import BuiltInAgent
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import RawServer, ServeRuntime, free_port, run_input, serve, text_of, types
from tests.mcp_support.servers import (
    changing_server,
    clock_server,
    named_server,
    weather_server,
)
from tests.mcp_support.serving import killable

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
        assert not runtime.mcp.started  # closed with the app
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


def counting(app: Any, methods: Counter[str]) -> Any:
    """`app`, counting the JSON-RPC methods its clients post."""

    async def wrapped(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                      send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        body = bytearray()

        async def spy() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
                if not message.get("more_body") and body:
                    sent = orjson.loads(body)
                    for item in sent if isinstance(sent, list) else [sent]:
                        methods[item.get("method")] += 1
            return message

        await app(scope, spy, send)

    return wrapped


def tool_results(events: list[dict[str, Any]]) -> list[str]:
    return [e["content"] for e in events if e["type"] == "TOOL_CALL_RESULT"]


async def test_changed_tools_are_listed_again_and_offered_to_the_next_run(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """Tools are listed once at start, not per run; when the server says its list changed
    (`notifications/tools/list_changed`, here on its 2026-07-28 `subscriptions/listen`
    stream) the runtime lists them again and the next run is offered the new list."""
    methods: Counter[str] = Counter()
    app = counting(changing_server().streamable_http_app(), methods)
    async with asyncio.timeout(TIMEOUT_S), serve(app) as url:
        runtime = CopilotRuntime(
            service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="k", max_retries=0),
            mcp_servers=[MCPServer(url=url + "/mcp")])
        async with serve_runtime(runtime) as served:
            changed = asyncio.Event()
            runtime.mcp.on_change.append(lambda _: changed.set())
            assert [a.name for a in runtime.actions] == ["old", "swap", "vanish"]
            first = await served.run(run_input("call:old {}"))
            await served.run(run_input("hello", run="r2"))
            assert methods["tools/list"] == 1
            assert methods["subscriptions/listen"] == 1

            swapped = await served.run(run_input("call:swap {}", run="r3"))
            await changed.wait()
            assert [a.name for a in runtime.actions] == ["swap", "vanish", "new"]
            agent = runtime.agents["default"]
            assert isinstance(agent, BuiltInAgent)
            assert "old" not in agent.actions
            assert "new" in agent.actions
            new = await served.run(run_input('call:new {"word":"hi"}', run="r4"))
            assert methods["tools/list"] == 2
    assert [orjson.loads(r) for r in tool_results(first)] == [{"result": "old"}]
    assert [orjson.loads(r) for r in tool_results(swapped)] == [{"result": "swapped"}]
    assert [orjson.loads(r) for r in tool_results(new)] == [{"result": "new: hi"}]
    assert types(new)[-1] == "RUN_FINISHED"


async def test_changed_tools_over_stdio() -> None:
    async with asyncio.timeout(TIMEOUT_S):
        toolset = MCPToolset([MCPServer.stdio(sys.executable, [str(SERVERS), "changing"])])
        changed = asyncio.Event()
        toolset.on_change.append(lambda _: changed.set())
        await toolset.start()
        try:
            assert [a.name for a in toolset.actions] == ["old", "swap", "vanish"]
            swap = next(a for a in toolset.actions if a.name == "swap")
            assert orjson.loads(await swap.execute("{}")) == {"result": "swapped"}
            await changed.wait()
            assert [a.name for a in toolset.actions] == ["swap", "vanish", "new"]
            new = next(a for a in toolset.actions if a.name == "new")
            assert orjson.loads(await new.execute('{"word":"x"}')) == {"result": "new: x"}
        finally:
            await toolset.aclose()


async def test_changed_tools_from_a_server_of_an_earlier_protocol(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2025 server sends `notifications/tools/list_changed` on its own, with no stream to
    ask for: the session's message handler hears it just the same."""
    from mcp.client.client import Client

    import copilot_runtime.mcp_tools

    monkeypatch.setattr(copilot_runtime.mcp_tools, "Client",
                        functools.partial(Client, mode="legacy"))
    methods: Counter[str] = Counter()
    app = counting(changing_server().streamable_http_app(), methods)
    async with asyncio.timeout(TIMEOUT_S), serve(app) as url:
        toolset = MCPToolset([MCPServer(url=url + "/mcp")])
        changed = asyncio.Event()
        toolset.on_change.append(lambda _: changed.set())
        await toolset.start()
        try:
            await next(a for a in toolset.actions if a.name == "swap").execute("{}")
            await changed.wait()
            assert [a.name for a in toolset.actions] == ["swap", "vanish", "new"]
        finally:
            await toolset.aclose()
    assert methods["initialize"] == 1
    assert methods["subscriptions/listen"] == 0
    assert methods["tools/list"] == 2


def held_until(app: Any, released: asyncio.Event) -> Any:
    """`app`, whose requests wait for `released`: a server slow to start."""

    async def wrapped(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                      send: Any) -> None:
        if scope["type"] == "http":
            await released.wait()
        await app(scope, receive, send)

    return wrapped


async def test_a_change_said_while_the_toolset_starts_is_listed() -> None:
    """Server a said its tools changed while the start still waited for server b: the
    listing that followed was skipped (nothing was published yet) and the change was lost
    until a's tools changed again. Now a's new tools are offered once the start is over."""
    from mcp.client.client import Client
    from mcp.client.streamable_http import streamable_http_client

    methods: Counter[str] = Counter()
    released = asyncio.Event()
    async with asyncio.timeout(TIMEOUT_S), \
            serve(counting(changing_server().streamable_http_app(), methods)) as a, \
            serve(held_until(weather_server().streamable_http_app(), released)) as b:
        toolset = MCPToolset([MCPServer(url=a + "/mcp", name="a"),
                              MCPServer(url=b + "/mcp", name="b")])
        changed = asyncio.Event()
        toolset.on_change.append(lambda _: changed.set())
        starting = asyncio.create_task(toolset.start())
        while methods["subscriptions/listen"] == 0:  # noqa: ASYNC110 (a listens; b waits)
            await asyncio.sleep(0.01)
        async with Client(streamable_http_client(a + "/mcp")) as other:
            await other.call_tool("swap", {})
        await asyncio.sleep(0.5)  # (the change reaches the toolset)
        released.set()
        await starting
        try:
            async with asyncio.timeout(5):
                await changed.wait()
            assert sorted(a.name for a in toolset.actions) == [
                "add", "explode", "forecast", "new", "swap", "vanish"]
            new = next(a for a in toolset.actions if a.name == "new")
            assert orjson.loads(await new.execute('{"word":"hi"}')) == {"result": "new: hi"}
        finally:
            await toolset.aclose()


async def test_an_idle_servers_change_stream_is_kept_and_nothing_is_republished() -> None:
    """With a short `timeout` the change stream read with a call's read timeout (the
    timeout and 1 s): a server whose tools never changed had its stream dropped every 2 s,
    its tools listed again, "MCP tools changed" logged and the tools published again. The
    stream now stays open, and a listing that finds the same tools says nothing."""
    methods: Counter[str] = Counter()
    async with asyncio.timeout(TIMEOUT_S), \
            serve(counting(weather_server().streamable_http_app(), methods)) as url:
        toolset = MCPToolset([MCPServer(url=url + "/mcp", name="w", timeout=1.0)])
        published: list[list[str]] = []
        toolset.on_change.append(lambda actions: published.append([a.name for a in actions]))
        await toolset.start()
        try:
            with capture_logs() as logs:
                await asyncio.sleep(4.5)
                forecast = next(a for a in toolset.actions if a.name == "forecast")
                assert orjson.loads(await forecast.execute('{"city":"Oslo"}'))["sky"] == "clear"
        finally:
            await toolset.aclose()
    assert (methods["subscriptions/listen"], methods["tools/list"]) == (1, 1)
    assert published == []
    assert [e["event"] for e in logs if e["log_level"] != "debug"] == []


async def test_a_clash_between_unnamed_servers_is_numbered_in_the_servers_order() -> None:
    """Two servers on one host without a name publish `add`: each gets its own prefix, the
    same whichever answers first."""
    async with asyncio.timeout(TIMEOUT_S), \
            serve(weather_server().streamable_http_app()) as weather, \
            serve(clock_server().streamable_http_app()) as clock:
        for urls, clock_prefix in (([weather, clock], "127_0_0_1_2"),
                                   ([clock, weather], "127_0_0_1_1")):
            toolset = MCPToolset([MCPServer(url=url + "/mcp") for url in urls])
            await toolset.start()
            try:
                by_name = {a.name: a for a in toolset.actions}
                assert sorted(by_name) == sorted(
                    ["127_0_0_1_1__add", "127_0_0_1_2__add", "explode", "forecast"])
                added = await by_name[f"{clock_prefix}__add"].execute('{"a":1,"b":2}')
                assert orjson.loads(added) == {"result": 1003}
            finally:
                await toolset.aclose()


async def test_a_server_that_goes_away_leaves_tool_errors(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """An HTTP server stopped and a stdio server that exited mid-call: those calls answer with
    a tool error, the runs finish, and the runtime goes on serving (and closes at once while
    waiting to reconnect; reconnecting is tested in test_mcp_reconnect.py). The next call of
    the stdio server's tools starts it again (test_mcp_call_retry.py)."""
    async with asyncio.timeout(TIMEOUT_S), \
            killable(weather_server().streamable_http_app()) as (url, kill):
        runtime = CopilotRuntime(
            service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="k", max_retries=0),
            mcp_servers=[MCPServer(url=url + "/mcp", name="weather"),
                         MCPServer.stdio(sys.executable, [str(SERVERS), "changing"])])
        runtime.mcp.reconnect_delay = runtime.mcp.reconnect_max_delay = 60.0  # down throughout
        async with serve_runtime(runtime) as served:
            before = await served.run(run_input('call:forecast {"city":"Oslo"}'))
            await kill()
            after = await served.run(run_input('call:forecast {"city":"Oslo"}', run="r2"))
            vanished = await served.run(run_input("call:vanish {}", run="r3"))
            again = await served.run(run_input("call:old {}", run="r4"))
            still = await served.run(run_input("hello", run="r5"))
    assert orjson.loads(tool_results(before)[0])["sky"] == "clear"
    for events, tool in ((after, "forecast"), (vanished, "vanish")):
        assert types(events)[-1] == "RUN_FINISHED"
        error = orjson.loads(tool_results(events)[0])["error"]
        assert f"the MCP tool {tool} " in error, error
    assert orjson.loads(tool_results(again)[0]) == {"result": "old"}
    assert text_of(still) == "echo: hello"


async def test_a_server_that_cannot_be_reached_fails_the_start() -> None:
    from copilot_runtime import UpstreamError

    async with asyncio.timeout(TIMEOUT_S), \
            serve(weather_server().streamable_http_app()) as url:
        toolset = MCPToolset([MCPServer(url=url + "/mcp"),
                              MCPServer(url=f"http://127.0.0.1:{free_port()}/mcp")])
        with pytest.raises(UpstreamError, match="could not be connected"):
            await toolset.start()
        assert not toolset.started
        assert toolset.actions == []
        toolset = MCPToolset([MCPServer(url=f"http://127.0.0.1:{free_port()}/mcp", name="a"),
                              MCPServer(url=f"http://127.0.0.1:{free_port()}/mcp", name="b")])
        with pytest.raises(UpstreamError, match="MCP server a could not be connected"):
            await toolset.start()  # both fail: the first server's error, in their order


async def test_a_legacy_sse_server_is_said_to_be_one() -> None:
    """An HTTP+SSE server of the earlier protocol (what a client's `{type: "sse"}` names)
    refuses the POST of `initialize`; before, the start said only "MCPError: Server
    returned an error response"."""
    from copilot_runtime import UpstreamError

    async with asyncio.timeout(TIMEOUT_S), serve(weather_server().sse_app()) as url:
        toolset = MCPToolset([MCPServer(url=url + "/sse", name="legacy", timeout=5)])
        with pytest.raises(UpstreamError) as caught:
            await toolset.start()
    assert caught.value.message == (
        "MCP server legacy could not be connected: it looks like a legacy HTTP+SSE MCP server "
        "(its URL refuses a POST); only streamable HTTP and stdio are supported")


def test_a_tools_result_of_other_blocks_than_text_says_what_they_are() -> None:
    """Only text blocks were read: a tool returning a file as an embedded resource, an image
    or a link answered the model "" (several text blocks ran together, "ab")."""
    from mcp import types

    from copilot_runtime.mcp_tools import _answer

    result = types.CallToolResult(content=[
        types.TextContent(type="text", text="a"),
        types.TextContent(type="text", text="b"),
        types.EmbeddedResource(type="resource", resource=types.TextResourceContents(
            uri="file:///notes.txt", mimeType="text/plain", text="the file's text")),
        types.EmbeddedResource(type="resource", resource=types.BlobResourceContents(
            uri="file:///x.bin", mimeType="application/octet-stream", blob="AAAA")),
        types.ImageContent(type="image", data="iVBORw0KGgo=", mimeType="image/png"),
        types.AudioContent(type="audio", data="AAAA", mimeType="audio/wav"),
        types.ResourceLink(type="resource_link", uri="https://example.com/y", name="y"),
    ])
    assert _answer("tool", result).split("\n") == [
        "a", "b", "the file's text",
        "[resource file:///x.bin: application/octet-stream, 3 bytes, not shown]",
        "[image: image/png, 9 bytes, not shown]", "[audio: audio/wav, 3 bytes, not shown]",
        "[resource link: https://example.com/y (y)]"]


# ---- names providers accept, and a bound on how many tools a server offers -----------------

#: A tool name longer than providers accept (64 characters); names ending differently after
#: it share their first 64 characters.
LONG = "lookup_" + "customer_records_" * 4


def cut_name(whole: str, safe: str | None = None) -> str:
    """What a tool name too long for providers becomes: its first 55 characters (made safe),
    then the first 8 hex digits of the SHA-256 of the whole name (its prefix with it)."""
    return f"{(safe or whole)[:55]}_{hashlib.sha256(whole.encode()).hexdigest()[:8]}"


async def call_each(toolset: MCPToolset) -> dict[str, str]:
    """Each action's name, and the name of the remote tool its call ran."""
    return {a.name: orjson.loads(await a.execute("{}"))["result"] for a in toolset.actions}


async def test_tool_names_too_long_are_cut_apart_the_same_way_everywhere() -> None:
    """Names were cut to 64 characters: two tools sharing their first 64 became two actions
    of one name, and a call ran whichever won. A cut name ends with a hash of the whole now:
    each call reaches its own tool, and every toolset (every worker, every listing) gives a
    tool the same name. A name two servers publish is still prefixed first, then cut."""
    names = [LONG + "orders", LONG + "invoices", "short"]
    async with asyncio.timeout(TIMEOUT_S), serve(named_server(names).streamable_http_app()) as a, \
            serve(named_server([LONG + "orders"]).streamable_http_app()) as b:
        offered: list[dict[str, str]] = []
        for _ in range(2):
            toolset = MCPToolset([MCPServer(url=a + "/mcp", name="a"),
                                  MCPServer(url=b + "/mcp", name="b")])
            await toolset.start()
            try:
                offered.append(await call_each(toolset))
            finally:
                await toolset.aclose()
    assert offered[0] == offered[1]
    assert offered[0] == {
        cut_name(f"a__{LONG}orders"): LONG + "orders",
        cut_name(LONG + "invoices"): LONG + "invoices",
        "short": "short",
        cut_name(f"b__{LONG}orders"): LONG + "orders"}
    assert all(len(name) <= 64 for name in offered[0])


async def test_a_cut_name_never_takes_another_tools_name() -> None:
    """A tool whose name fits keeps it, whatever a cut one would become: before, a long
    tool listed first took the name of the one named its first 64 characters, which was left
    out. A cut name that is another tool's (here one named so on purpose) is hashed again."""
    long, fits, named_so = LONG + "orders", LONG[:64], cut_name(LONG + "orders")
    server = named_server([long, fits, named_so])
    async with asyncio.timeout(TIMEOUT_S), serve(server.streamable_http_app()) as url:
        toolset = MCPToolset([MCPServer(url=url + "/mcp")])
        await toolset.start()
        try:
            offered = await call_each(toolset)
        finally:
            await toolset.aclose()
    assert offered[fits] == fits
    assert offered[named_so] == named_so
    (other,) = set(offered) - {fits, named_so}
    assert offered[other] == long
    assert len(other) == 64
    assert other.startswith(LONG[:55])


async def test_a_server_offers_at_most_its_max_tools() -> None:
    """A server listing 150 tools made every run offer all of them, which OpenAI refuses
    (more than 128): every run failed. The first `max_tools` (100 unless set) are offered,
    and one warning names the server and the counts."""
    names = [f"t{n:03}" for n in range(150)]
    async with asyncio.timeout(TIMEOUT_S), \
            serve(named_server(names).streamable_http_app()) as url:
        for bound, offered in ((100, 100), (5, 5), (None, 150)):
            server = (MCPServer(url=url + "/mcp", name="many") if bound == 100 else
                      MCPServer(url=url + "/mcp", name="many", max_tools=bound))
            toolset = MCPToolset([server])
            with capture_logs() as logs:
                await toolset.start()
            try:
                assert [a.name for a in toolset.actions] == names[:offered]
                assert await toolset.actions[-1].execute("{}") == orjson.dumps(
                    {"result": names[offered - 1]}).decode()
            finally:
                await toolset.aclose()
            warned = [entry for entry in logs if entry["log_level"] == "warning"]
            if bound is None:
                assert warned == []
            else:
                assert warned == [{"event": "MCP tools left out: the server lists more than "
                                            "its max_tools", "log_level": "warning",
                                   "server": "many", "listed": 150, "offered": bound}]
    for bad in (0, -1):
        with pytest.raises(ConfigurationError, match="max_tools"):
            MCPServer(url="http://x", max_tools=bad)


async def test_a_run_offers_at_most_max_tools_across_servers(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """Two servers at their default `max_tools` (100 each) made every run offer 200 tools
    and more, which OpenAI refuses: each run failed. A run now offers at most 128: the
    application's action and the client's tool are kept, the last MCP tools are left out,
    and one warning names them (not one per run)."""
    from copilot_runtime import action

    @action
    def own() -> str:
        """The application's own action."""
        return "own"

    a_names, b_names = [f"a{n:03}" for n in range(100)], [f"b{n:03}" for n in range(100)]
    frontend = {"name": "pick", "description": "The client's tool",
                "parameters": {"type": "object", "properties": {}}}
    async with asyncio.timeout(TIMEOUT_S), \
            serve(named_server(a_names).streamable_http_app()) as a, \
            serve(named_server(b_names).streamable_http_app()) as b:
        runtime = CopilotRuntime(
            service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="k", max_retries=0),
            actions=[own], mcp_servers=[MCPServer(url=a + "/mcp", name="a"),
                                        MCPServer(url=b + "/mcp", name="b")])
        async with serve_runtime(runtime) as served:
            with capture_logs() as logs:
                first = await served.run(run_input("call:a042 {}", tools=[frontend]))
                second = await served.run(run_input("hello", run="r2", tools=[frontend]))
    offered = [[tool["function"]["name"] for tool in request["tools"]]
               for request in llm.requests]
    assert offered[0] == ["own", *a_names, *b_names[:26], "pick"]
    assert offered[-1] == offered[0]
    assert orjson.loads(tool_results(first)[0]) == {"result": "a042"}
    assert types(second)[-1] == "RUN_FINISHED"
    warned = [e for e in logs if e["log_level"] == "warning"]
    assert warned == [{"event": "MCP tools left out of runs: more tools than the agent's "
                                "max_tools", "log_level": "warning", "tools": 202,
                       "max_tools": 128, "left_out": b_names[26:]}]


async def test_names_equal_once_made_safe_stay_apart() -> None:
    """Clashes were counted on the raw names: `get.user` (server a) and `get_user` (server
    b) got no prefix, both became `get_user`, and b's was left out with a warning, so the
    model's `get_user` ran a's tool; `天気` and `翻訳` both became `__` and one was left
    out. Made-safe names two servers share are prefixed now; one that is still taken, or
    ambiguous, ends with a hash of its raw name (a name that is its own stays as it is).
    Each call reaches its own tool, and every toolset names them alike."""
    async with asyncio.timeout(TIMEOUT_S), \
            serve(named_server(["get.user", "天気", "翻訳", "list.x", "list_x", "ok"])
                  .streamable_http_app()) as a, \
            serve(named_server(["get_user"]).streamable_http_app()) as b:
        offered: list[dict[str, str]] = []
        for _ in range(2):
            toolset = MCPToolset([MCPServer(url=a + "/mcp", name="a"),
                                  MCPServer(url=b + "/mcp", name="b")])
            with capture_logs() as logs:
                await toolset.start()
            try:
                offered.append(await call_each(toolset))
            finally:
                await toolset.aclose()
            assert [e for e in logs if e["log_level"] == "warning"] == []
    assert offered[0] == offered[1]
    assert offered[0] == {
        "a__get_user": "get.user", "b__get_user": "get_user",
        cut_name("天気", "__"): "天気", cut_name("翻訳", "__"): "翻訳",
        cut_name("list.x", "list_x"): "list.x", "list_x": "list_x", "ok": "ok"}


class Unresponsive(RawServer):
    """An MCP URL that answers every POST with an SSE stream of keep-alive comments and
    never a message: no read timeout ever fires on it. Its streams end with it."""

    def __init__(self) -> None:
        super().__init__()
        self.closing = asyncio.Event()
        self.streams: set[asyncio.Task[Any]] = set()

    async def __aexit__(self, *exc: object) -> None:
        self.closing.set()
        await asyncio.gather(*self.streams)
        await super().__aexit__(*exc)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.streams.add(task)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            while not reader.at_eof() and not self.closing.is_set():
                writer.write(b"8\r\n: ping\n\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.1)
        writer.close()


async def test_a_server_that_never_answers_fails_the_start_within_its_timeout() -> None:
    """The SDK's discovery (its own 10 s) and `initialize` were bounded apart: a URL that
    never answers took the server's timeout and 10 s more to fail the start (an app's
    lifespan, each run of a request's server). The handshake is bounded by the timeout."""
    from copilot_runtime import UpstreamError

    async with asyncio.timeout(TIMEOUT_S), Unresponsive() as server:
        toolset = MCPToolset([MCPServer(url=server.url + "/mcp", name="mute", timeout=1.0)])
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(UpstreamError) as caught:
            await toolset.start()
        took = loop.time() - began
    assert took < 1.0 + 2.0, took
    assert caught.value.message == (
        "MCP server mute could not be connected: its handshake timed out (1 s)")
    assert not toolset.started
