"""An MCP server that misbehaves cannot leak its insides, break its neighbours' calls, or take
its valid tools down with an invalid one.

A raw streamable-HTTP MCP server (JSON answers, a 2025-06-18 session) answers each method as
the test scripts it: a `tools/list` that fails with a crash report holding a DSN, a listing
with a tool whose `inputSchema` is not an object, tool calls that hang or answer late, or fail
saying the key they were sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog
from structlog.testing import capture_logs

from copilot_runtime import ActionError, CopilotRuntime, MCPServer, MCPToolset, UpstreamError
from copilot_runtime.actions import Action
from copilot_runtime.mcp_tools import MAX_ANSWER_BYTES
from copilot_runtime.protocols.graphql.agent_tools import MAX_REQUEST_MCP_SERVERS
from copilot_runtime.testing import ScriptedAdapter, text_turn, tool_turn
from tests.conftest import ServeRuntime, free_port, parse_sse, run_input
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, merge, parse_multipart, user_turn
from tests.mcp_support.legacy_stdio import nested
from tests.mcp_support.servers import weather_server
from tests.mcp_support.serving import killable

LEGACY = Path(__file__).parent / "mcp_support" / "legacy_stdio.py"

pytestmark = pytest.mark.timeout(60)

Json = dict[str, Any]
TRACE = ('Traceback (most recent call last):\n  File "/opt/mcp-srv/tools/db.py", line 12, in '
         'run\n    conn = connect("postgresql://admin:s3cr3t@db.internal/prod")\n'
         'OperationalError: refused')
ECHO = {"name": "echo", "description": "Echo",
        "inputSchema": {"type": "object", "properties": {"x": {"type": "string"}}}}


class ScriptedMCP:
    """An ASGI MCP server: `list` answers tools/list (a JSON-RPC error text, or the tools),
    `delays[x]` is how long a tools/call with argument x waits before it answers, `errors[x]`
    the JSON-RPC error it answers with, `texts[x]` the text it answers; x "held" sets `holding`
    and answers once `held` is set."""

    def __init__(self, tools: list[Json] | None = None, list_error: str | None = None) -> None:
        self.tools = tools if tools is not None else [ECHO]
        self.list_error = list_error
        self.delays: dict[str, float] = {"hang": 3600.0}
        self.errors: dict[str, Json] = {}
        self.texts: dict[str, str] = {}
        #: `structuredContent` a tools/call with argument x answers with besides its text
        #: (an empty text: no content blocks at all).
        self.structured: dict[str, Any] = {}
        #: The content blocks a tools/call with argument x answers with, as they are.
        self.blocks: dict[str, list[Any]] = {}
        #: The `isError` a tools/call with argument x answers with, as it is (not a bool).
        self.error_flags: dict[str, Any] = {}
        #: The arguments x whose tools/call answers a tool error (`isError`), besides "key".
        self.failing: set[str] = set()
        self.holding, self.held = asyncio.Event(), asyncio.Event()
        #: Answers come as one SSE event each (as the TypeScript SDK's servers send them).
        self.sse = False
        #: The `nextCursor` of every listing page (one that never ends, when set).
        self.next_cursor: str | None = None
        self.methods: list[str] = []
        #: An HTTP status every request is answered with (a revoked token: 401), when set.
        self.status: int | None = None
        #: The `Authorization` header of each request ("" without one).
        self.authorizations: list[str] = []
        #: The answers under way (a hanging one never notices its client gone).
        self.answering: set[asyncio.Task[Any]] = set()
        #: The arguments x whose tools/call answer is a JSON body that goes on past
        #: `MAX_ANSWER_BYTES` and never ends.
        self.endless: set[str] = set()
        #: The `serverInfo` `initialize` answers with.
        self.server_info: Any = {"name": "scripted", "version": "1"}

    async def __call__(self, scope: Json, receive: Callable[[], Awaitable[Json]],
                       send: Callable[[Json], Awaitable[None]]) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        task = asyncio.current_task()
        assert task is not None
        self.answering.add(task)
        task.add_done_callback(self.answering.discard)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break

        async def answer(status: int, payload: Any = None) -> None:
            try:
                body = orjson.dumps(payload) if payload is not None else b""
            except orjson.JSONEncodeError:  # a lone surrogate (escaped, as JSON.stringify
                body = json.dumps(payload).encode()  # writes it), or 300 levels
            sse = self.sse and payload is not None
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", b"text/event-stream" if sse else b"application/json"),
                (b"mcp-session-id", b"sess-1")]})
            await send({"type": "http.response.body",
                        "body": b"event: message\ndata: " + body + b"\n\n" if sse else body})

        if self.status is not None:
            await send({"type": "http.response.start", "status": self.status, "headers": [
                (b"content-type", b"application/json"),
                (b"www-authenticate", b'Bearer error="invalid_token"')]})
            await send({"type": "http.response.body",
                        "body": b'{"error":"invalid_token","error_description":"expired"}'})
            return
        if scope["method"] != "POST":
            await answer(405)
            return
        request = orjson.loads(body)
        method, request_id = request.get("method"), request.get("id")
        self.methods.append(method)
        self.authorizations.append(dict(scope["headers"]).get(b"authorization", b"").decode())
        if request_id is None:
            await answer(202)
            return
        result: Json
        if method == "initialize":
            result = {"protocolVersion": "2025-06-18",
                      "capabilities": {"tools": {"listChanged": False}},
                      "serverInfo": self.server_info}
        elif method == "tools/list":
            await asyncio.sleep(self.delays.get("list", 0.0))
            if self.list_error is not None:
                await answer(200, {"jsonrpc": "2.0", "id": request_id,
                                   "error": {"code": -32603, "message": self.list_error}})
                return
            result = {"tools": self.tools}
            if self.next_cursor is not None:
                result["nextCursor"] = self.next_cursor
        elif method == "tools/call":
            x = str(request["params"].get("arguments", {}).get("x"))
            await asyncio.sleep(self.delays.get(x, 0.0))
            if x == "held":
                self.holding.set()
                await self.held.wait()
            if x in self.endless:
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"application/json"), (b"mcp-session-id", b"sess-1")]})
                head = b'{"jsonrpc":"2.0","id":%d,"result":{"content":[{"type":"text","text":"'
                await send({"type": "http.response.body", "body": head % request_id,
                            "more_body": True})
                for _ in range(MAX_ANSWER_BYTES // 2**20 + 2):
                    await send({"type": "http.response.body", "body": b"x" * 2**20,
                                "more_body": True})
                await asyncio.sleep(3600)
            # "key": a tool error, "key-rpc": a JSON-RPC error, echoing the key sent
            key = dict(scope["headers"]).get(b"x-api-key", b"").decode()
            if x == "key-rpc":
                await answer(200, {"jsonrpc": "2.0", "id": request_id,
                                   "error": {"code": -32000, "message": f"key {key} revoked"}})
                return
            if x in self.errors:
                await answer(200, {"jsonrpc": "2.0", "id": request_id, "error": self.errors[x]})
                return
            said = f"key {key} revoked" if x == "key" else self.texts.get(x, f"echoed {x}")
            result = {"isError": x == "key" or x in self.failing,
                      "content": [{"type": "text", "text": said}] if said else []}
            if x in self.structured:
                result["structuredContent"] = self.structured[x]
            if x in self.blocks:
                result["content"] = self.blocks[x]
            if x in self.error_flags:
                result["isError"] = self.error_flags[x]
        else:
            result = {}
        await answer(200, {"jsonrpc": "2.0", "id": request_id, "result": result})


@contextlib.asynccontextmanager
async def scripted(server: ScriptedMCP) -> AsyncIterator[str]:
    async with killable(server) as (url, _):
        try:
            yield url + "/mcp"
        finally:
            for task in list(server.answering):
                task.cancel()  # else the server's end waits for them


# ---- a failing tools/list: no crash report for the client or the model ----------------------


async def test_a_listing_that_fails_with_a_crash_report_is_withheld() -> None:
    """Before: "could not list its tools: MCPError: Traceback … postgresql://admin:s3cr3t@…"
    went into the start's error, a request-scoped server's GraphQL error, and (once a
    runtime's server came back failing) every call's tool result and what the model read."""
    async with scripted(ScriptedMCP(list_error=TRACE)) as url:
        toolset = MCPToolset([MCPServer(url=url, name="h", timeout=10)])
        with structlog.testing.capture_logs() as logs, pytest.raises(UpstreamError) as caught:
            await toolset.start()
    assert caught.value.message == (
        "MCP server h could not be connected: MCP server h could not list its tools: MCPError "
        "(its message is withheld: see the server's log)")
    # the operator still learns why (`configure_logging` redacts the DSN's password)
    assert any("OperationalError: refused" in str(e.get("error")) for e in logs), logs


async def test_a_listing_that_hangs_at_start_says_so() -> None:
    """A server that never answers `tools/list` fails the start within its timeout, saying
    so (before: "ReadTimeout", the HTTP client's bound, which was the call's too; with one
    request's read timeout failing that request alone, the HTTP bound is a second longer).
    """
    server = ScriptedMCP()
    async with scripted(server) as url:
        server.delays["list"] = 3600.0
        toolset = MCPToolset([MCPServer(url=url, name="h", timeout=1.0)])
        async with asyncio.timeout(5):
            with pytest.raises(UpstreamError) as caught:
                await toolset.start()
    assert caught.value.message == (
        "MCP server h could not be connected: MCP server h could not list its tools: MCPError: "
        "Request 'tools/list' timed out")


async def test_graphql_clients_get_no_crash_report_of_a_request_scoped_server(
        serve_runtime: ServeRuntime) -> None:
    async with scripted(ScriptedMCP(list_error=TRACE)) as url:
        runtime = CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("never")),
                                 mcp_allowed_urls=[url])
        async with serve_runtime(runtime) as served:
            answer = await served.session.post(served.url, headers=CLIENT_HEADERS, json={
                "query": CHAT_DOCUMENT, "variables": {
                    "data": user_turn("hi"), "properties": {"mcpServers": [{"endpoint": url}]}}})
            response = merge(parse_multipart(await answer.read()))
    status = response["data"]["generateCopilotResponse"]["status"]
    assert status["__typename"] == "FailedResponseStatus", status
    assert status["details"]["description"].endswith(
        "could not list its tools: MCPError (its message is withheld: see the server's log)")
    for secret in ("s3cr3t", "/opt/", "Traceback"):
        assert secret not in orjson.dumps(response).decode()


async def chat(served: Any, named: list[Json], text: str = "hi") -> Json:
    """A 1.10 client's chat naming `named` in `properties.mcpServers`, its answer merged."""
    answer = await served.session.post(served.url, headers=CLIENT_HEADERS, json={
        "query": CHAT_DOCUMENT, "variables": {
            "data": user_turn(text), "properties": {"mcpServers": named}}})
    body = await answer.read()
    if answer.content_type.startswith("multipart"):
        return merge(parse_multipart(body))
    parsed: Json = orjson.loads(body)
    return parsed


async def test_a_request_names_each_server_once_and_a_few_at_most(
        serve_runtime: ServeRuntime) -> None:
    """Before: one allowed endpoint named 300 times in `properties.mcpServers` opened 300
    sessions for the run (300 `initialize` and `tools/list` round trips) and offered the
    model each tool 300 times. Now a server named again (its endpoint and key) is one, and a
    request naming more than a few is refused before anything is connected."""
    server = ScriptedMCP()
    model = ScriptedAdapter(text_turn("done"))
    async with scripted(server) as url:
        runtime = CopilotRuntime(service_adapter=model, mcp_allowed_urls=[url])
        async with serve_runtime(runtime) as served:
            once = await chat(served, [{"endpoint": url}, {"endpoint": url + "/"}] * 150)
            too_many = await chat(served, [{"endpoint": url, "apiKey": f"key{n}"}
                                           for n in range(MAX_REQUEST_MCP_SERVERS + 1)])
    assert once["data"]["generateCopilotResponse"]["status"]["code"] == "Success", once
    assert [tool.name for tool in model.requests[0].tools] == ["echo"]
    assert server.methods.count("initialize") == 1
    assert too_many["data"] is None
    assert too_many["errors"][0]["message"] == (
        f"properties.mcpServers names more than {MAX_REQUEST_MCP_SERVERS} MCP servers")


async def test_a_request_scoped_servers_api_key_serves_the_run_and_is_not_kept(
        serve_runtime: ServeRuntime) -> None:
    """Before: `properties` were merged into the run's `forwardedProps` whole, so the
    server's `apiKey` sat in the RUN_STARTED input the thread stored: `connect` replayed it
    to any later reader of the thread. The run still sends it to the server."""
    key = "mcpkey-VERYSECRET-0123456789"
    server = ScriptedMCP()
    model = ScriptedAdapter(tool_turn(("echo", '{"x": "hi"}')), text_turn("done"))
    async with scripted(server) as url:
        runtime = CopilotRuntime(service_adapter=model, mcp_allowed_urls=[url])
        async with serve_runtime(runtime) as served:
            answer = await chat(served, [{"endpoint": url, "apiKey": key,
                                          "headers": {"X-Other": "other-secret-42"}}])
            connect = await served.post("/agent/default/connect", {
                "threadId": "gql-thread", "runId": "r2", "messages": [], "tools": [],
                "context": [], "state": {}, "forwardedProps": {}})
            replayed = await connect.read()
    assert answer["data"]["generateCopilotResponse"]["status"]["code"] == "Success", answer
    assert "tools/call" in server.methods
    assert set(server.authorizations) == {f"Bearer {key}"}  # (the run did send it)
    assert connect.status == 200
    started = next(e for e in parse_sse(replayed) if e["type"] == "RUN_STARTED")
    assert started["input"]["forwardedProps"]["mcpServers"] == [{"endpoint": url}]
    assert key.encode() not in replayed
    assert b"other-secret-42" not in replayed


@pytest.mark.parametrize("key", ["s3cret\r\nX-Injected: 1", "s3crét", "s3cr3t7 ", " s3cr3t7",
                                 35310, ["s3cret"]])
async def test_an_api_key_no_header_can_hold_refuses_the_request_unsaid(
        serve_runtime: ServeRuntime, key: Any) -> None:
    """Before: the run started, then failed as an upstream outage (`NETWORK_ERROR`, 503:
    "could not be connected: LocalProtocolError: Illegal header value b's3cret…'"), the
    key echoed; a key that was no string went without a word, the server called with no
    key. Now the request is refused before anything is connected, as one naming a server
    off the allow list is, and the key is not repeated."""
    server = ScriptedMCP()
    async with scripted(server) as url:
        runtime = CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("never")),
                                 mcp_allowed_urls=[url])
        async with serve_runtime(runtime) as served:
            refused = await chat(served, [{"endpoint": url, "apiKey": key}])
    assert refused["data"] is None
    assert refused["errors"][0]["message"] == (
        "An apiKey of properties.mcpServers holds a character no HTTP header can (a control "
        "character, one outside ASCII, or a space at either end)" if isinstance(key, str) else
        "An apiKey of properties.mcpServers must be a string")
    assert refused["errors"][0]["extensions"]["statusCode"] == 400, refused
    assert "s3cr" not in orjson.dumps(refused).decode()
    assert "35310" not in orjson.dumps(refused).decode()
    assert server.methods == []


# ---- one slow or abandoned call fails alone ---------------------------------------------------


def tool(toolset: MCPToolset, name: str = "echo") -> Action:
    return next(a for a in toolset.actions if a.name == name)


@contextlib.asynccontextmanager
async def started(server: ScriptedMCP, bound: float) -> AsyncIterator[MCPToolset]:
    async with scripted(server) as url:
        toolset = MCPToolset([MCPServer(url=url, name="h", timeout=bound)])
        await toolset.start()
        try:
            yield toolset
        finally:
            await toolset.aclose()


@pytest.mark.parametrize("first", ["times out", "is abandoned"])
async def test_one_call_past_its_timeout_leaves_the_others_on_the_session(first: str) -> None:
    """Before: the first call's POST reached the HTTP client's read timeout (the server's
    `timeout`, the same bound as the call's own; a call whose run was stopped leaves its POST
    open until then), which ended the whole session: a call the server answered just after
    failed "Connection closed", and the session was opened again. Now only the first call
    fails; the session and its other calls go on."""
    server = ScriptedMCP()
    server.delays["late"] = 0.8
    async with started(server, bound=1.0) as toolset:
        echo = tool(toolset)
        conn = toolset._connections[0]
        session = conn.client
        first_call = asyncio.create_task(echo.execute('{"x": "hang"}'))
        if first == "is abandoned":
            await asyncio.sleep(0.2)
            first_call.cancel()
        await asyncio.sleep(0.5 - (0.2 if first == "is abandoned" else 0.0))
        # answered at about 1.3 s: after the first call's bound, within its own
        assert await echo.execute('{"x": "late"}') == "\"echoed late\""
        with pytest.raises(ActionError if first == "times out" else asyncio.CancelledError):
            await first_call
        assert (conn.client, conn.gone) == (session, None)
        assert await echo.execute('{"x": "again"}') == "\"echoed again\""
        assert server.methods.count("initialize") == 1


async def test_a_call_waiting_too_long_for_a_connection_fails_alone() -> None:
    """Before: with the HTTP client's 100 connections taken (100 calls past their timeout
    whose POSTs stay open a little longer), a 101st call's POST waited for one, and its
    `PoolTimeout`, raised in the session's task group, ended the session and every call in
    flight on it. Now that call fails alone; the session goes on."""
    server = ScriptedMCP()
    server.delays["waits"] = 3600.0  # (should a connection come free in time, it times out too)
    async with started(server, bound=1.0) as toolset:
        echo = tool(toolset)
        conn = toolset._connections[0]
        session = conn.client
        hanging = [asyncio.create_task(echo.execute('{"x": "hang"}')) for _ in range(100)]
        # (every one holds its connection before the next call asks for one: under load a
        # tenth of a second was not enough, and that call found a connection free)
        while server.methods.count("tools/call") < 100:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        with pytest.raises(ActionError, match="timed out"):
            await echo.execute('{"x": "waits"}')  # its POST waits for the pool, in vain
        await asyncio.gather(*hanging, return_exceptions=True)
        await asyncio.sleep(1.2)  # their POSTs' read timeouts free the pool
        for _ in range(5):  # (under load a read timeout may free its connection late)
            with contextlib.suppress(ActionError):
                assert await echo.execute('{"x": "again"}') == "\"echoed again\""
                break
        else:
            raise AssertionError("the pool was never given back")
        assert (conn.client, conn.gone) == (session, None)
        assert server.methods.count("initialize") == 1


async def test_a_tool_error_echoing_the_servers_key_does_not_show_it() -> None:
    """Before: the key `headers=` gave the server reached the model and the client (the tool
    result) when the server's error said it."""
    key = "svc-4f9a8b7c6d5e"
    async with scripted(ScriptedMCP()) as url:
        toolset = MCPToolset([MCPServer(url=url, name="h", headers={"X-Api-Key": key},
                                        timeout=10)])
        await toolset.start()
        try:
            errors = []
            for x in ("key", "key-rpc"):
                with pytest.raises(ActionError) as caught:
                    await tool(toolset).execute(orjson.dumps({"x": x}).decode())
                errors.append(caught.value.message)
        finally:
            await toolset.aclose()
    assert errors == ["key [REDACTED] revoked",
                      "the MCP tool echo of h failed: MCPError: key [REDACTED] revoked"]


@pytest.mark.parametrize(("status", "said"), [(401, "HTTP 401 Unauthorized"),
                                              (403, "HTTP 403 Forbidden"),
                                              (500, "HTTP 500 Internal Server Error")])
async def test_an_http_error_answer_names_its_status(status: int, said: str) -> None:
    """Before: a server answering 401 (its token revoked), 403 or 500 gave "MCPError: Server
    returned an error response" (the SDK's words) and logged nothing: nobody could tell an
    expired token from a crash. The call's error, the start's and a log line name the HTTP
    status; never the token."""
    token = "tok-1234567890abcdef"
    server = ScriptedMCP()
    async with scripted(server) as url:
        toolset = MCPToolset([MCPServer(url=url, name="h", timeout=10,
                                        headers={"Authorization": f"Bearer {token}"})])
        await toolset.start()
        try:
            assert await tool(toolset).execute('{"x": "1"}') == '"echoed 1"'
            server.status = status
            with capture_logs() as logs, pytest.raises(ActionError) as caught:
                await tool(toolset).execute('{"x": "2"}')
        finally:
            await toolset.aclose()
        with pytest.raises(UpstreamError) as at_start:
            await MCPToolset([MCPServer(url=url, name="h", timeout=10,
                                        headers={"Authorization": f"Bearer {token}"})]).start()
    assert said in caught.value.message, caught.value.message
    assert said in at_start.value.message, at_start.value.message
    logged = [e for e in logs if e.get("status") == status]
    assert logged, logs
    assert logged[0]["server"] == "h"
    for text in (caught.value.message, at_start.value.message, str(logs)):
        assert token not in text


SECRET_STDIO = Path(__file__).parent / "mcp_support" / "secret_stdio.py"
CRED = "svc-cred-7Q2xZp9Lk4"


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_no_failure_of_a_server_shows_its_credentials(transport: str,
                                                            tmp_path: Path) -> None:
    """Each way a server's failure reaches the model and the client, with a server that
    says its credential in each: a header's value (HTTP) or an `env` value (stdio). Before:
    a failing listing (the start's error, and every call's once the server came back
    failing) quoted a header's value, and a stdio server's `env` was blanked nowhere."""
    http = ScriptedMCP()
    marker = tmp_path / "listing-fails"
    said: list[str] = []

    def listing_fails(fails: bool) -> None:
        http.list_error = f"credential {CRED} is not authorised" if fails else None
        if fails:
            marker.touch()
        else:
            marker.unlink(missing_ok=True)

    async def failure(action: Action, x: str) -> str:
        with pytest.raises(ActionError) as caught:
            await action.execute(orjson.dumps({"x": x}).decode())
        return caught.value.message

    with capture_logs() as logs:
        async with scripted(http) as url:
            server = (MCPServer(url=url, name="h", headers={"X-Api-Key": CRED}, timeout=10)
                      if transport == "http" else
                      MCPServer(command=sys.executable, args=[str(SECRET_STDIO), str(marker)],
                                env={"SERVICE_CRED": CRED, "DEBUG": "1"}, name="h", timeout=10))
            listing_fails(True)
            with pytest.raises(UpstreamError) as caught:
                await MCPToolset([server]).start()
            said.append(caught.value.message)
            listing_fails(False)
            toolset = MCPToolset([server], reconnect_delay=0.02, reconnect_max_delay=0.1)
            await toolset.start()
            try:
                echo = tool(toolset)
                said += [await failure(echo, "key"), await failure(echo, "key-rpc")]
                # the session is lost; the server that comes back fails its listing
                listing_fails(True)
                http.errors["gone"] = {"code": -32600, "message": "Session not found"}
                with contextlib.suppress(ActionError):
                    await echo.execute('{"x": "gone"}' if transport == "http" else '{"x": "exit"}')
                async with asyncio.timeout(10):
                    while "could not list" not in (gone := await failure(echo, "x")):  # noqa: ASYNC110
                        await asyncio.sleep(0.05)  # (the reconnects report to no event)
                said.append(gone)
            finally:
                await toolset.aclose()
    assert all("[REDACTED]" in text and CRED not in text for text in said), said
    assert said[1:3] == ["key [REDACTED] revoked",
                         "the MCP tool echo of h failed: MCPError: key [REDACTED] revoked"]
    # nor do the logs (shipped elsewhere, read by more people than the operator)
    assert logs
    assert not [entry for entry in logs if CRED in repr(entry)], logs


@pytest.mark.parametrize("key", ["svc-4f9a8b7c6d5e ", "Zm9vYmFy+/c2VjcmV0/a2V5 "])
async def test_a_connection_failure_quoting_the_servers_key_does_not_show_it(key: str) -> None:
    """A header the HTTP client refuses (a key with a space at its end) failed the start
    with the client's words, which quote the header: the key with them (a base64 key's head
    too, its "+/" first taken for a file path)."""
    async with scripted(ScriptedMCP()) as url:
        toolset = MCPToolset([MCPServer(url=url, name="h", headers={"X-Api-Key": key},
                                        timeout=10)])
        with pytest.raises(UpstreamError) as caught:
            await toolset.start()
        await toolset.aclose()
    assert "could not be connected" in caught.value.message
    assert key.strip()[:8] not in caught.value.message, caught.value.message


@pytest.mark.parametrize("refusal", ["a server error", "an SSE answer over 1 MiB"])
async def test_a_live_servers_refusal_fails_its_call_alone(refusal: str) -> None:
    """JSON-RPC's generic server error (-32000, e.g. "quota exceeded") has the code of the
    SDK's stand-in for a lost transport, as has the SDK's error for an SSE answer over its
    1 MiB bound. Before: either was taken for a lost connection: the session ended, a call in
    flight on it (another run's) failed "Connection closed", a stdio server was started again
    (its state lost). Now the call fails alone; the session and its other calls go on."""
    server = ScriptedMCP()
    if refusal == "a server error":
        server.errors["refused"] = {"code": -32000, "message": "quota exceeded"}
        said = "quota exceeded"
    else:
        server.sse = True
        server.texts["refused"] = "x" * (1024 * 1024)
        said = "SSE stream failed: Server-sent event exceeded the 1048576 byte limit."
    async with started(server, bound=30.0) as toolset:
        echo = tool(toolset)
        conn = toolset._connections[0]
        session = conn.client
        held = asyncio.create_task(echo.execute('{"x": "held"}'))
        async with asyncio.timeout(20):
            await server.holding.wait()
        with pytest.raises(ActionError) as caught:
            await echo.execute('{"x": "refused"}')
        assert caught.value.message == f"the MCP tool echo of h failed: MCPError: {said}"
        server.held.set()
        assert await held == "\"echoed held\""
        assert (conn.client, conn.gone) == (session, None)
        assert server.methods.count("initialize") == 1


async def test_a_byte_not_utf8_on_a_stdio_servers_stdout_is_replaced() -> None:
    """Before: the SDK's reader of the server's stdout failed on it, saying nothing: that call
    and every later call of the server's tools timed out (its `timeout` each), and the
    session was never found gone. Now the byte reads as U+FFFD and the session goes on."""
    toolset = MCPToolset([MCPServer(command=sys.executable, args=[str(LEGACY)], name="legacy",
                                    timeout=10)])
    await toolset.start()
    try:
        assert await tool(toolset, "cafe").execute("{}") == '"caf\ufffd"'
        assert await tool(toolset, "ping").execute("{}") == '"pong"'
    finally:
        await toolset.aclose()


async def test_an_answer_that_is_no_json_rpc_fails_its_call_at_once() -> None:
    """Before: the SDK's stdio reader dropped an answer it could not read (`"result": null`,
    an error without its message), and the call waited for the server's whole timeout,
    then read "timed out". Now it fails at once, saying why, and the session goes on."""
    toolset = MCPToolset([MCPServer(command=sys.executable, args=[str(LEGACY)], name="legacy",
                                    timeout=30)])
    await toolset.start()
    try:
        for name in ("nothing", "mute"):
            started = time.monotonic()
            with pytest.raises(ActionError) as failed:
                await tool(toolset, name).execute("{}")
            assert time.monotonic() - started < 5
            assert failed.value.message == (
                f"the MCP tool {name} of legacy failed: MCPError: the server's answer is not "
                "a valid JSON-RPC response")
        assert await tool(toolset, "ping").execute("{}") == '"pong"'
    finally:
        await toolset.aclose()


async def test_a_handshake_answer_that_is_no_json_rpc_fails_the_start_at_once() -> None:
    """Before (a review): the answer to `initialize` was dropped the same way, and the
    start waited for the whole timeout, then read "timed out"."""
    toolset = MCPToolset([MCPServer(command=sys.executable,
                                    args=[str(LEGACY), "--unreadable-handshake"],
                                    name="legacy", timeout=30)])
    started = time.monotonic()
    with pytest.raises(UpstreamError) as failed:
        await toolset.start()
    await toolset.aclose()
    assert time.monotonic() - started < 5
    assert "the server's answer is not a valid JSON-RPC response" in failed.value.message


# ---- answers pydantic cannot read, and answers too large to read -----------------------------

def cut_emoji_listing(transport: str) -> contextlib.AbstractAsyncContextManager[MCPToolset]:
    """A server whose `summarize` tool's description was cut inside an emoji."""
    if transport == "stdio":
        return started_stdio("--cut-emoji-listing")
    server = ScriptedMCP(tools=[ECHO, {"name": "summarize", "description": "Summarizes text \ud83d",
                                       "inputSchema": {"type": "object"}}])
    return started(server, bound=30.0)


@contextlib.asynccontextmanager
async def started_stdio(*flags: str, bound: float = 30.0) -> AsyncIterator[MCPToolset]:
    toolset = MCPToolset([MCPServer(command=sys.executable, args=[str(LEGACY), *flags],
                                    name="legacy", timeout=bound)])
    try:
        async with asyncio.timeout(10):
            await toolset.start()
        yield toolset
    finally:
        await toolset.aclose()


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_an_answer_with_text_cut_inside_an_emoji_is_used(transport: str) -> None:
    """`JSON.stringify` writes text cut inside an emoji as an escaped lone surrogate
    (`"\\ud83d"`, valid JSON), which pydantic's JSON reader refuses. Before: over stdio the
    SDK dropped the answer and the call waited for its whole timeout, then read "timed out"
    (the tool had run: the model may run it again); over HTTP it failed with pydantic's text
    (the answer's bytes, a link). Now the surrogate reads as U+FFFD and the answer is used."""
    if transport == "stdio":
        context = started_stdio(bound=10.0)
        name, argument = "cut_emoji", "{}"
    else:
        server = ScriptedMCP()
        server.texts["cut"] = "cut emoji: \ud83d"
        context = started(server, bound=10.0)
        name, argument = "echo", '{"x": "cut"}'
    async with context as toolset:
        started_at = time.monotonic()
        assert await tool(toolset, name).execute(argument) == '"cut emoji: \ufffd"'
        assert time.monotonic() - started_at < 5


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_a_listing_with_a_description_cut_inside_an_emoji_offers_every_tool(
        transport: str) -> None:
    """Before: one such description failed the server's start, over stdio after its whole
    timeout, over HTTP at once with pydantic's text for the client. Now every tool is
    offered, the description's cut character as U+FFFD."""
    async with cut_emoji_listing(transport) as toolset:
        summarize = tool(toolset, "summarize")
        assert summarize.description == "Summarizes text \ufffd"
        assert len(toolset.actions) > 1


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_an_answer_nesting_too_deep_to_read_fails_its_call_at_once(transport: str) -> None:
    """Structured content 300 levels deep is valid JSON the SDK's reader refuses. Before: over
    stdio the call waited for its whole timeout ("timed out"), over HTTP it failed with
    pydantic's text. Now it fails at once, saying only that the answer could not be read,
    and the session goes on."""
    if transport == "stdio":
        context = started_stdio(bound=30.0)
        name, argument, again = "deep", "{}", ("ping", "{}", '"pong"')
    else:
        server = ScriptedMCP()
        server.structured["deep"] = nested(300)
        context = started(server, bound=30.0)
        name, argument, again = "echo", '{"x": "deep"}', ("echo", '{"x": "a"}', '"echoed a"')
    async with context as toolset:
        started_at = time.monotonic()
        with pytest.raises(ActionError) as failed:
            await tool(toolset, name).execute(argument)
        assert time.monotonic() - started_at < 5
        label = "legacy" if transport == "stdio" else "h"
        assert failed.value.message == (f"the MCP tool {name} of {label} failed: MCPError: "
                                        "the server's answer could not be read")
        assert await tool(toolset, again[0]).execute(again[1]) == again[2]


async def test_a_json_answer_past_the_bound_is_not_read_on() -> None:
    """Before: a JSON (not SSE) answer was read whole before the action's bound was checked
    (200 MB: the process grew by 1 GB, the loop stalled 1.4 s), and one that never ended was
    read until the read timeout. Now reading stops at `MAX_ANSWER_BYTES`: that call fails at
    once, and the session goes on."""
    server = ScriptedMCP()
    server.endless.add("endless")
    async with started(server, bound=30.0) as toolset:
        echo = tool(toolset)
        started_at = time.monotonic()
        with pytest.raises(ActionError) as failed:
            await echo.execute('{"x": "endless"}')
        assert time.monotonic() - started_at < 10
        assert failed.value.message == (
            f"the MCP tool echo of h failed: MCPError: the server's answer is larger than "
            f"{MAX_ANSWER_BYTES} bytes, the most read")
        assert await echo.execute('{"x": "a"}') == '"echoed a"'


@pytest.mark.parametrize("name", ["huge_ts", "huge_py"])
async def test_a_stdio_line_past_the_bound_is_not_held(name: str) -> None:
    """Before: the SDK held a stdout line whole however long, copying it again at each chunk
    (a 50 MB line: 35 s of the loop), then parsed it. Now a line is read no further than
    `MAX_ANSWER_BYTES`: the call it answers (its id at either end, where the SDKs write it)
    fails at once, and the session goes on."""
    async with started_stdio() as toolset:
        started_at = time.monotonic()
        with pytest.raises(ActionError) as failed:
            await tool(toolset, name).execute("{}")
        assert time.monotonic() - started_at < 10
        assert failed.value.message == (
            f"the MCP tool {name} of legacy failed: MCPError: the server's answer is larger "
            f"than {MAX_ANSWER_BYTES} bytes, the most read")
        assert await tool(toolset, "ping").execute("{}") == '"pong"'


async def test_a_handshake_breaking_the_mcp_schema_is_told_without_pydantics_words() -> None:
    """Before: the start failed with pydantic's text, for clients too: the server's answer
    quoted (`input_value`) and a link to pydantic's site. Now the places and messages of
    its first errors are told, and the whole is logged."""
    server = ScriptedMCP()
    server.server_info = {"name": "x" * 40 + "-secret-looking-value", "version": 12345}
    async with scripted(server) as url:
        toolset = MCPToolset([MCPServer(url=url, name="h", timeout=10)])
        with pytest.raises(UpstreamError) as failed:
            await toolset.start()
        await toolset.aclose()
    said = failed.value.message
    assert "the server's answer breaks the MCP schema (serverInfo.version: Input should be " \
           "a valid string)" in said, said
    assert "input_value" not in said
    assert "pydantic" not in said
    assert "12345" not in said


# ---- one tool that breaks the schema is left out alone ---------------------------------------

BAD_TOOLS = [{"name": "string_schema", "description": "Its input is a string",
              "inputSchema": {"type": "string"}},
             {"name": "no_schema", "description": "No inputSchema at all"}]


async def test_a_tool_whose_schema_is_no_object_is_left_out_alone(
        serve_runtime: ServeRuntime) -> None:
    """Before: the SDK refused the whole listing (`tools.0.inputSchema.type`), so the server
    had no tools at all, and with `mcp_servers=` the app did not start."""
    server = ScriptedMCP(tools=[*BAD_TOOLS, ECHO])
    model = ScriptedAdapter(tool_turn(("echo", '{"x": "hi"}')), text_turn("done"))
    async with scripted(server) as url:
        runtime = CopilotRuntime(service_adapter=model,
                                 mcp_servers=[MCPServer(url=url, name="h", timeout=10)])
        with structlog.testing.capture_logs() as logs:
            async with serve_runtime(runtime) as served:
                events = await served.run(run_input("go"))
    assert [e["content"] for e in events if e["type"] == "TOOL_CALL_RESULT"] == ['"echoed hi"']
    left_out = {e["tool"] for e in logs if e["event"].startswith("MCP tool left out")}
    assert left_out == {"string_schema", "no_schema"}, logs


async def test_a_tool_whose_schema_cannot_be_checked_is_left_out_alone() -> None:
    """Before: a tool whose `inputSchema` nests `not` 150 deep raised RecursionError out of
    the toolset's build of its actions (and one whose `$schema` is a list TypeError): the
    start failed ("cannot start: RecursionError"), as did a request-scoped server's run, a
    tool change's rebuild and every reconnect (tried again for ever)."""
    deep: Json = {"type": "string"}
    for _ in range(150):
        deep = {"not": deep}
    server = ScriptedMCP(tools=[
        {"name": "deep", "inputSchema": {"type": "object", "properties": {"q": deep}}},
        {"name": "odd", "inputSchema": {"type": "object", "$schema": ["x"]}}, ECHO])
    with capture_logs() as logs:
        async with started(server, bound=10.0) as toolset:
            assert [action.name for action in toolset.actions] == ["echo"]
            assert await tool(toolset).execute('{"x": "hi"}') == '"echoed hi"'
    assert {e["tool"]: e["error"] for e in logs if e["event"] == "MCP tool left out"} == {
        "deep": "Action 'deep' has a parameters schema nested too deeply to check",
        "odd": "Action 'odd' has an invalid parameters schema: its $schema is not a string"}


async def test_a_tool_whose_schema_refers_outside_itself_is_left_out_unfetched() -> None:
    """Before: a tool's `inputSchema` `$ref` to a URL or a file was fetched by the runtime
    when a call's arguments were checked (blocking the event loop; the document's contents
    quoted to the model and client), and a dangling local one failed the run."""
    from tests.test_actions import recording_server, with_ref

    with recording_server() as (url, asked):
        server = ScriptedMCP(tools=[
            {"name": "remote", "inputSchema": with_ref(f"{url}/internal/meta.json")},
            {"name": "local_file", "inputSchema": with_ref("file:///etc/passwd")},
            {"name": "dangling", "inputSchema": with_ref("#/$defs/Missing")}, ECHO])
        with capture_logs() as logs:
            async with started(server, bound=10.0) as toolset:
                assert [action.name for action in toolset.actions] == ["echo"]
                assert await tool(toolset).execute('{"x": "hi"}') == '"echoed hi"'
    assert asked == []
    left_out = {e["tool"]: e["error"] for e in logs if e["event"] == "MCP tool left out"}
    assert sorted(left_out) == ["dangling", "local_file", "remote"]
    assert all("cannot be resolved" in error for error in left_out.values()), left_out


async def test_a_listing_whose_cursor_never_ends_is_cut_off_once_and_said() -> None:
    """A server whose `nextCursor` never ended was read 100 pages: its tool, listed on each,
    became 100 tools renamed apart (`h__echo`), 99 warnings logged, and the cut-off said
    nothing. A name listed again is one tool now, and the cut-off is logged."""
    server = ScriptedMCP()
    server.next_cursor = "again"
    async with scripted(server) as url:
        toolset = MCPToolset([MCPServer(url=url, name="h", timeout=5)])
        with capture_logs() as logs:
            await toolset.start()
        try:
            assert [action.name for action in toolset.actions] == ["echo"]
        finally:
            await toolset.aclose()
    assert server.methods.count("tools/list") == 100
    assert [entry["event"] for entry in logs if entry["log_level"] == "warning"] == [
        "MCP tool listing cut off: its cursor did not end"]


# ---- a result that breaks the tool's outputSchema: the tool ran, the model must know --------

BOOK = {"name": "book", "description": "Books a flight",
        "inputSchema": {"type": "object", "properties": {"x": {"type": "string"}}},
        "outputSchema": {"type": "object", "properties": {"booking": {"type": "string"}},
                         "required": ["booking"]}}


async def test_a_result_breaking_its_output_schema_still_reaches_the_model() -> None:
    """Before: the SDK checks a result against the tool's `outputSchema` after the call has
    run, and raised; the model read "the MCP tool book failed" for a flight that was booked.
    Now the result reaches it (its blocks when its structured content is missing or wrong,
    else that content), and the log says the server broke its schema."""
    server = ScriptedMCP(tools=[BOOK])
    server.texts.update({"none": '{"booking": "BK-1"}', "wrong": "booked BK-2", "ok": "BK-3",
                         "bare": ""})
    server.structured.update({"wrong": {"booking": 2}, "ok": {"booking": "BK-3"},
                              "bare": {"booking": 4}})
    async with started(server, bound=10) as toolset:
        book = tool(toolset, "book")
        with capture_logs() as logs:
            assert await book.execute('{"x": "none"}') == '"{\\"booking\\": \\"BK-1\\"}"'
            assert await book.execute('{"x": "wrong"}') == '"booked BK-2"'
            # (no blocks to fall back on: its structured content, as it is)
            assert await book.execute('{"x": "bare"}') == '{"booking":4}'
        assert await book.execute('{"x": "ok"}') == '{"booking":"BK-3"}'
    warned = [e for e in logs if e["event"].startswith("MCP tool result breaks its outputSchema")]
    assert [e["tool"] for e in warned] == ["book"] * 3, logs
    assert "did not return structured content" in warned[0]["error"]


# ---- a result with a block the SDK's types refuse: the tool ran, the model must know ---------


async def test_a_result_with_a_block_out_of_the_schema_keeps_its_other_blocks() -> None:
    """Before: the SDK validates a tool's whole result, and one block it does not take (a
    block type of a newer protocol or an extension, an image without its mimeType, a text
    annotated for an audience it does not know) failed the call: the model read "the MCP
    tool echo failed: ValidationError ..." for a booking that was made. Now the valid
    blocks reach it, each other one said in a word, and the call is not sent again."""
    server = ScriptedMCP()
    booked = {"type": "text", "text": "booked #42"}
    server.blocks.update({
        "widget": [booked, {"type": "widget", "html": "<b>x</b>"}],
        "image": [booked, {"type": "image", "data": "AAAA"}],
        "audience": [booked, {"type": "text", "text": "ok",
                              "annotations": {"audience": ["robot"]}}],
        "junk": [booked, 7, {"type": "x" * 300 + "\n"}]})
    server.structured["image"] = {"booking": 42}
    async with started(server, bound=10.0) as toolset:
        echo = tool(toolset)
        with capture_logs() as logs:
            said = {x: orjson.loads(await echo.execute(orjson.dumps({"x": x}).decode()))
                    for x in ("widget", "image", "audience", "junk")}
        assert await echo.execute('{"x": "after"}') == '"echoed after"'
    assert said == {
        "widget": "booked #42\n[widget block, not understood, not shown]",
        "image": {"booking": 42},
        "audience": "booked #42\nok",
        "junk": "booked #42\n[int block, not understood, not shown]\n"
                f"[{'x' * 40} block, not understood, not shown]"}
    assert server.methods.count("tools/call") == 5
    assert server.methods.count("initialize") == 1
    warned = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warned] == [
        "MCP tool result breaks the MCP schema; its valid parts passed on"] * 4
    assert {e["tool"] for e in warned} == {"echo"}


async def test_a_result_read_leniently_keeps_its_error_flag_and_tells_of_many_blocks_briefly(
        ) -> None:
    """Found by review: `isError` of "true" or 1 (which the SDK's types read as true) was a
    success once the result was read block by block; every unreadable block was a line of
    its own (a result of 100,000 took seconds on the loop and reached the model whole)."""
    server = ScriptedMCP()
    booked = {"type": "text", "text": "booked #42"}
    server.blocks.update({"flagged": [booked, {"type": "widget"}],
                          "many": [booked, *[{"type": "widget"}] * 3000]})
    server.error_flags.update({"flagged": "true"})
    async with started(server, bound=10.0) as toolset:
        echo = tool(toolset)
        with pytest.raises(ActionError, match="booked #42"):
            await echo.execute('{"x": "flagged"}')
        said = orjson.loads(await echo.execute('{"x": "many"}'))
    assert said == ("booked #42\n[999 widget blocks, not understood, not shown]\n"
                    "[2001 more blocks not shown]")


async def test_a_tool_error_told_only_as_structured_content_keeps_its_detail() -> None:
    """Before: a tool error was built from its text blocks only, and one answered with
    `structuredContent` alone reached the model as "the MCP tool echo reported an error".
    Now its structured content is its detail, cut and scrubbed as an error's text is."""
    server = ScriptedMCP()
    server.failing.update({"quota", "trace", "long"})
    server.texts.update({"quota": "", "trace": "", "long": ""})
    server.structured.update({"quota": {"code": "E42", "detail": "quota exceeded"},
                              "trace": {"trace": TRACE}, "long": {"detail": "z" * 2000}})
    async with started(server, bound=10.0) as toolset:
        echo = tool(toolset)
        failures: dict[str, str] = {}
        with capture_logs() as logs:
            for x in ("quota", "trace", "long"):
                with pytest.raises(ActionError) as caught:
                    await echo.execute(orjson.dumps({"x": x}).decode())
                failures[x] = caught.value.message
    assert failures["quota"] == '{"code":"E42","detail":"quota exceeded"}'
    assert failures["trace"] == "the MCP tool echo reported an error"  # withheld, logged
    assert [e["event"] for e in logs] == ["MCP tool error withheld"]
    assert "s3cr3t" not in logs[0]["error"]
    assert len(failures["long"]) == 500
    assert failures["long"].startswith('{"detail":"zzz')


async def test_a_start_that_failed_on_an_mcp_server_down_is_tried_again() -> None:
    """A runtime started by its first request (no lifespan): the start failed on an MCP
    server that was down, yet counted as done, so it was never tried again: `/ready` said
    200 without the server's tools, and the approvals' timer never ran (a hunt)."""
    port = free_port()
    runtime = CopilotRuntime(service_adapter=ScriptedAdapter([text_turn("hi")]), mcp_servers=[
        MCPServer(url=f"http://127.0.0.1:{port}/mcp", timeout=5)])
    try:
        with pytest.raises(UpstreamError):
            await runtime.start()
        assert not runtime.started
        async with killable(weather_server().streamable_http_app(), port):
            await runtime.start()
            assert runtime.started
            assert "forecast" in [a.name for a in runtime.actions]
            assert runtime.approvals._started
    finally:
        await runtime.aclose()
