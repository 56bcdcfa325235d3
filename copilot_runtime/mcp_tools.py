"""Tools published by MCP servers, as server-side actions of the built-in agent.

On the official `mcp` SDK (the `mcp` extra). `MCPToolset` connects to each server once (over
streamable HTTP, or stdio for a local command), lists its tools and turns each into an
`Action` whose handler calls the tool on that server; a tool error comes back to the model as
a tool error. Two servers publishing the same name (once made safe) are told apart by a
prefix; a name longer than providers accept is cut and ends with a hash of the whole, as does
a made-safe name another tool has too (see `_names`); a server offers at most its `max_tools`
tools. Opening a session (discovery and `initialize`) is bounded by the server's `timeout`.

    toolset = MCPToolset([MCPServer(url="http://127.0.0.1:9000/mcp", headers={...}),
                          MCPServer.stdio("python", ["my_server.py"])])
    await toolset.start()
    runtime = CopilotRuntime(service_adapter=..., actions=[*my_actions, *toolset.actions])
    ...
    await toolset.aclose()

A server that goes away (its process exits, its endpoint closes) is reconnected by its task
with a capped exponential backoff; its tools answer with a tool error meanwhile, and are
listed again once it is back. A call that finds the session dead before its request reached
the server (see `_tool_action`) asks for a reconnect attempt at once and, if it succeeds
within the call's timeout, goes to the new session (once): a server restarted between two
calls serves the second.

Servers are named by the application only: nothing here connects to an address a request
chose.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import contextvars
import functools
import hashlib
import random
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx2
import mcp.types as types
import orjson
import pydantic
import structlog
from mcp.client.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import ListenNotSupportedError, Subscription
from mcp.shared.exceptions import MCPError
from typing_extensions import Buffer

from copilot_runtime._exceptions import (
    ActionError,
    ConfigurationError,
    UpstreamError,
    failure_text,
    header_secrets,
    quoted,
    scrub_secrets,
)
from copilot_runtime._limits import decode_json, without_lone_surrogates
from copilot_runtime._strings import not_one_string
from copilot_runtime.actions import MAX_ACTION_RESULT_BYTES, Action

__all__ = ["MCPServer", "MCPToolset"]

_log = structlog.get_logger("copilot_runtime.mcp_tools")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
#: Reads one block of a tool's result (see `_lenient_block`).
_BLOCK: pydantic.TypeAdapter[types.ContentBlock] = pydantic.TypeAdapter(types.ContentBlock)
#: Pages of one tool listing read at most (a server whose cursor never ends is cut off).
_MAX_PAGES = 100
#: The longest tool name providers accept (OpenAI's function names, as `Action` checks).
_MAX_NAME = 64
#: Hex digits of the hash a cut name ends with (32 bits: a clash is hashed again anyway).
_HASH_DIGITS = 8
#: Tools a server offers unless its `max_tools` says otherwise: OpenAI refuses a request
#: offering more than 128, and the application's own actions need room too.
MAX_TOOLS = 100
#: A lost server's first reconnect attempt comes after about this many seconds; each failed
#: attempt doubles the wait, up to `RECONNECT_MAX_DELAY_S` (`MCPToolset` takes both).
RECONNECT_DELAY_S = 0.5
RECONNECT_MAX_DELAY_S = 30.0
#: What a call's failure says about the session: these mean the connection is gone (an
#: answer from a live server, e.g. an unknown tool, does not).
_CONNECTION_ERRORS = (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError,
                      anyio.EndOfStream, httpx2.TransportError)
_SESSION_UNKNOWN = frozenset({"Session not found", "Session terminated"})
#: Why a session could not be opened when its URL refused the POST of `initialize`.
_LEGACY_SSE = ("it looks like a legacy HTTP+SSE MCP server (its URL refuses a POST); only "
               "streamable HTTP and stdio are supported")
#: The SDK's message for a call whose session's transport closed.
_SDK_CLOSED = "Connection closed"
#: The SDK's stand-in for a POST answered with an HTTP error status (no JSON-RPC error in
#: its body): the status, which tells a revoked token from a crash, is not in it.
_SDK_HTTP_ERROR = "Server returned an error response"
#: A transport failure before any byte of the request left: the server never saw it.
_NOT_CONNECTED = (httpx2.ConnectError, httpx2.ConnectTimeout)
#: How long a tool change stream may stay silent before it is read as lost (then listened
#: to again, the tools listed again): a server's change stream is silent while nothing
#: changes, and a call's read timeout (a short server `timeout`) dropped it every few seconds;
#: a server gone without closing its connection is still noticed within this.
_LISTEN_READ_TIMEOUT_S = 300.0
#: The JSON-RPC method of a change stream's POST.
_LISTEN = "subscriptions/listen"
#: An `env` value of a stdio server shorter than this is a setting ("1", "debug"), not a
#: credential: blanking it would garble every message it happens to appear in.
_MIN_ENV_SECRET = 8
#: The most bytes of one answer read: a stdio line, an HTTP JSON body (an SSE event has the
#: SDK's own bound, 1 MiB). Both were read whole (200 MB: 1 GB more memory, and the loop held
#: for seconds) before the action's bound was checked; past this one, reading stops and the
#: call it answers fails. Room for a result at the action's bound told twice (as structured
#: content and as text), escaped.
MAX_ANSWER_BYTES = 4 * MAX_ACTION_RESULT_BYTES
#: Why a call fails whose answer is past `MAX_ANSWER_BYTES`.
_TOO_LARGE = f"the server's answer is larger than {MAX_ANSWER_BYTES} bytes, the most read"
#: Why a call fails whose answer is valid JSON the SDK cannot read (300 levels deep), or is
#: no JSON at all: pydantic's words quote the answer's bytes and a link, for the log only.
_UNREADABLE = "the server's answer could not be read"
#: How the SDK's failure to parse an HTTP answer starts (JSON, or an SSE event's).
_SDK_UNPARSED = "Failed to parse "


class _Sending:
    """What became of one call's HTTP requests, noted by `_NotingTransport`."""

    def __init__(self) -> None:
        #: A request of the call could not connect (so it never reached the server).
        self.unconnected = False
        #: A request of the call was answered (the server saw it).
        self.answered = False
        #: The HTTP error status a POST of the call was answered with, if any.
        self.refused: int | None = None
        #: The latest `tools/call` result of the call as received, before the SDK reads it
        #: (see `_note_call_results`).
        self.result: object = None


#: The call whose requests are being sent. The SDK sends each request from a task of its own
#: that starts with a copy of the caller's context, so the transport sees the call's record.
_SENDING: contextvars.ContextVar[_Sending | None] = contextvars.ContextVar(
    "copilot_runtime_mcp_sending", default=None)


class _NotingTransport(httpx2.AsyncBaseTransport):
    """An HTTP transport that notes, for the call sending through it, whether a request could
    not connect: only then is it certain that the server never saw the call.

    It also keeps one request's read timeout from ending the session. The SDK sends each
    request's POST from a task of the session's task group: a `ReadTimeout` raised there (no
    answer head, or a JSON answer that stalls) fails the group, which ends the session and
    every call in flight on it, other runs' too; a call that timed out, or whose run was
    stopped, leaves its POST open until then. A POST's read timeout fails that request alone
    instead (its caller has timed out already: the HTTP bound is a little longer). So does
    its pool timeout: over 100 calls in flight on one session (the pool's connections) leave
    a POST waiting for one, which must not end the session either."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, listen_read_timeout: float) -> None:
        self.inner = inner
        #: The read timeout of a change stream's POST (see `_LISTEN_READ_TIMEOUT_S`).
        self.listen_read_timeout = listen_read_timeout
        #: A POST was answered 405: opening, the mark of a legacy HTTP+SSE server's URL.
        self.post_refused = False
        #: The HTTP error status the latest POST was answered with (None: a success): what
        #: an opening or a listing that failed with `_SDK_HTTP_ERROR` was told.
        self.refused: int | None = None

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        sending = _SENDING.get()
        if request.method == "POST" and _is_listen(request):
            bounds = request.extensions.get("timeout") or {}
            request.extensions = {**request.extensions, "timeout": {
                **bounds, "read": self.listen_read_timeout}}
        try:
            response = await self.inner.handle_async_request(request)
        except _NOT_CONNECTED:
            if sending is not None:
                sending.unconnected = True
            raise
        except (httpx2.ReadTimeout, httpx2.PoolTimeout) as exc:
            if request.method != "POST":
                raise
            # (the SDK answers its request with an error, and the session goes on)
            return _stand_in(request, 504, b"no answer within the read timeout"
                             if isinstance(exc, httpx2.ReadTimeout)
                             else b"no connection free within the pool timeout")
        if sending is not None:
            sending.answered = True
        if request.method == "POST":
            self.refused = response.status_code if response.status_code >= 400 else None
            if sending is not None and self.refused is not None:
                sending.refused = self.refused
            if response.status_code == 405:
                self.post_refused = True
        if request.method == "POST" and response.headers.get(
                "content-type", "").lower().startswith("application/json"):
            # (an SSE answer's read timeout already fails its request alone, in the SDK)
            response.stream = _JSONAnswer(response.stream)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def _is_listen(request: httpx2.Request) -> bool:
    """Whether `request` opens a change stream (`subscriptions/listen`)."""
    try:
        body = request.content
    except httpx2.RequestNotRead:
        return False
    if _LISTEN.encode() not in body:
        return False  # (most POSTs: read no further)
    try:
        sent = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(sent, dict) and sent.get("method") == _LISTEN


def _stand_in(request: httpx2.Request, status: int, said: bytes) -> httpx2.Response:
    """An answer the transport gives for a POST that got none, failing that request alone."""
    return httpx2.Response(status, headers={"content-type": "text/plain"}, content=said,
                           request=request)


class _AnswerTooLarge(httpx2.StreamError):
    """A JSON answer past `MAX_ANSWER_BYTES`: the SDK fails its request alone with it."""


class _JSONAnswer(httpx2.AsyncByteStream):
    """A POST's JSON answer, given to the SDK whole (it reads it whole anyway):

    - read no further than `MAX_ANSWER_BYTES` (`_AnswerTooLarge`);
    - each escaped lone surrogate read as U+FFFD, as `decode_json` reads one: what
      `JSON.stringify` writes for text cut inside an emoji, and pydantic refuses (the call
      failed, a tool listing failed the server's start);
    - its read timeout ends the body where it is: the SDK then fails that request with a
      parse error, and the session goes on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        parts: list[bytes] = []
        size = 0
        try:
            async for chunk in self.inner:
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise _AnswerTooLarge(_TOO_LARGE)
                parts.append(chunk)
        except httpx2.ReadTimeout:
            pass
        body = b"".join(parts)
        yield without_lone_surrogates(body) or body

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass(frozen=True)
class MCPServer:
    """One MCP server: `url` (streamable HTTP) with `headers`, or a stdio `command`."""

    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    command: str | None = None
    args: Sequence[str] = ()
    env: Mapping[str, str] | None = None
    #: Prefix of this server's tool names when another server publishes the same name.
    name: str | None = None
    timeout: float = 60.0
    #: The most tools of this server offered: the first ones it lists (None: no bound).
    max_tools: int | None = MAX_TOOLS

    def __post_init__(self) -> None:
        if (self.url is None) == (self.command is None):
            raise ConfigurationError("An MCPServer needs either url= or a stdio command")
        not_one_string(self.args, "An MCPServer's args")
        if self.max_tools is not None and self.max_tools < 1:
            raise ConfigurationError("An MCPServer's max_tools must be at least 1 (or None)")

    @classmethod
    def stdio(cls, command: str, args: Sequence[str] = (), *,
              env: Mapping[str, str] | None = None, name: str | None = None,
              max_tools: int | None = MAX_TOOLS) -> MCPServer:
        not_one_string(args, "An MCPServer's args")
        return cls(command=command, args=tuple(args), env=env, name=name, max_tools=max_tools)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.url is not None:
            return urlsplit(self.url).hostname or "mcp"
        return (self.command or "mcp").rsplit("/", 1)[-1]

    @property
    def secrets(self) -> tuple[str, ...]:
        """What this server was configured with that its words must never pass on: its
        headers' values (an HTTP server's credentials) and its `env`'s (a stdio server's).
        Every failure of the server that reaches the model or a client is blanked of them."""
        env = (value for value in (self.env or {}).values() if len(value) >= _MIN_ENV_SECRET)
        return (*header_secrets(self.headers), *env)


class _Connection:
    """One server's session, held open (and reopened) by a task of its own (see `MCPToolset`)."""

    def __init__(self, server: MCPServer, prefix: str) -> None:
        self.server = server
        #: The prefix of this server's tool names that another server publishes too.
        self.prefix = prefix
        #: The open session's client; None while there is none.
        self.client: Client | None = None
        self.tools: list[Any] = []
        #: Why the session ended, while it is down: its tools then fail at once with this.
        self.gone: str | None = None
        #: Set by a change notification, cleared by the listing that follows it: notifications
        #: arriving during a listing cost one more listing, not one each.
        self.stale = False
        self.lock = asyncio.Lock()
        self.closing = asyncio.Event()
        #: Wakes the task holding the session: closing, or a call found the connection gone.
        self.wake = asyncio.Event()
        #: Whether a session is open: closing lets it close itself.
        self.open = False
        #: Whether the task is opening a session, which may take up to the server's timeout:
        #: closing cancels it. (Waiting to reconnect, it wakes on closing.)
        self.connecting = False
        #: When the current session opened (the loop's clock), or None.
        self.opened_at: float | None = None
        #: When the last attempt to open a session failed (the loop's clock), while the server
        #: is down.
        self.failed_at = float("-inf")
        #: A call asks for an attempt now instead of after the backoff (closing sets it too).
        self.hurry = asyncio.Event()
        #: The outcome of the attempt under way, or of the next one when a call waits for it:
        #: the new session's client, or None when it failed.
        self.outcome: asyncio.Future[Client | None] | None = None
        #: Calls ask for no attempt within this many seconds of a failed one
        #: (`MCPToolset.reconnect_delay`): while the server stays down, most fail at once.
        self.hurry_spacing = RECONNECT_DELAY_S
        self.task: asyncio.Task[None] | None = None
        #: The HTTP transport of the latest session (None over stdio).
        self.transport: _NotingTransport | None = None

    def refused(self) -> int | None:
        """The HTTP error status the latest session's latest POST was answered with."""
        return None if self.transport is None else self.transport.refused

    def unavailable(self) -> str:
        if self.closing.is_set():
            return f"the session with the MCP server {self.server.label} is closed"
        return (f"the MCP server {self.server.label} is gone "
                f"({self.gone or 'the session ended'}); reconnecting")

    def lose(self, client: Client, reason: str) -> None:
        """A call on `client` found the connection gone: end that session (not a newer one)."""
        if self.client is client and self.gone is None:
            self.gone = reason
            self.wake.set()

    def settle(self, client: Client | None) -> None:
        """The task's attempt ended: with the new session's client, or None."""
        self.failed_at = asyncio.get_running_loop().time() if client is None else float("-inf")
        outcome, self.outcome = self.outcome, None
        if outcome is not None and not outcome.done():
            outcome.set_result(client)

    async def reconnected(self, dead: Client | None, deadline: float) -> Client | None:
        """A session to send a call on instead of `dead`: one opened since, or the outcome
        of the attempt under way, or of one asked for now (unless calls asked for one
        lately); None if there is none by `deadline`."""
        if self.closing.is_set():
            return None
        client = self.client
        if client is not None and client is not dead and self.gone is None:
            return client
        loop = asyncio.get_running_loop()
        if not self.connecting:
            if loop.time() - self.failed_at < self.hurry_spacing:
                return None  # the server was found down just now: fail at once
            self.hurry.set()
        if self.outcome is None:
            self.outcome = loop.create_future()
        outcome = self.outcome
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(outcome)
        except TimeoutError:
            return None


class MCPToolset:
    """Connected MCP servers and their tools as `actions`.

    Each server's tools are listed once, at `start()`, and again only when that server says
    its list changed (`notifications/tools/list_changed`): then `actions` is rebuilt and each
    `on_change` callback is called with the new list.

    Each session lives in a task of its own: the SDK runs a session's reader in a task group
    whose failure (the server going away) cancels the task that entered it, which must not
    be the caller's (an app's lifespan, a run). When a session ends, or a call finds its
    connection gone, the task reconnects after `reconnect_delay` seconds, doubled after each
    failed attempt up to `reconnect_max_delay` (with jitter), and lists the tools again
    (`on_change` hears of them); meanwhile the server's tools answer at once with a tool error
    naming the cause, except that a call finding the session dead (before its request reached
    the server) asks for an attempt at once, unless one failed within `reconnect_delay`, and
    goes to the new session if there is one within the server's timeout. A server that
    cannot be connected at `start()` fails the start.
    """

    def __init__(self, servers: Sequence[MCPServer], *,
                 reconnect_delay: float = RECONNECT_DELAY_S,
                 reconnect_max_delay: float = RECONNECT_MAX_DELAY_S) -> None:
        if not 0 < reconnect_delay <= reconnect_max_delay:
            raise ConfigurationError("MCPToolset needs 0 < reconnect_delay <= reconnect_max_delay")
        self.servers = list(servers)
        self.reconnect_delay = reconnect_delay
        self.reconnect_max_delay = reconnect_max_delay
        self.actions: list[Action] = []
        #: Called with the new `actions` after a server's tools were listed again.
        self.on_change: list[Callable[[list[Action]], None]] = []
        self._connections: list[_Connection] = []

    @property
    def started(self) -> bool:
        return bool(self._connections)

    async def start(self) -> None:
        """Connect to every server (at once), list its tools and ask to hear of changes."""
        if self._connections:
            return
        connections = [_Connection(server, prefix)
                       for server, prefix in zip(self.servers, _prefixes(self.servers),
                                                 strict=True)]
        for conn in connections:
            conn.hurry_spacing = self.reconnect_delay
        loop = asyncio.get_running_loop()
        ready: list[asyncio.Future[None]] = []
        for conn in connections:
            future: asyncio.Future[None] = loop.create_future()
            conn.task = asyncio.create_task(self._hold(conn, future),
                                            name=f"mcp:{conn.server.label}")
            ready.append(future)
        try:
            await asyncio.wait(ready)  # every outcome read: no failure left unretrieved
            errors = [e for future in ready if (e := future.exception()) is not None]
            if errors:
                raise errors[0]
        except BaseException:
            await _close(connections)
            raise
        self._connections = connections
        self.actions = self._build()
        # A server that said its tools changed while another was still starting was not
        # listed again then (nothing was published yet): it is now, before the start ends.
        await asyncio.gather(*(self._relist_stale(conn) for conn in connections if conn.stale))

    async def _hold(self, conn: _Connection, ready: asyncio.Future[None]) -> None:
        """Open the session and keep it open until `aclose()`, reopening it when it ends."""
        try:
            await self._keep_open(conn, ready)
        finally:
            conn.settle(None)  # a call waiting for an attempt fails now
            if not ready.done():
                ready.cancel()  # closed before it was ever connected

    async def _keep_open(self, conn: _Connection, ready: asyncio.Future[None]) -> None:
        server = conn.server
        loop = asyncio.get_running_loop()
        attempt = 0  # reconnect attempts since the last session that lasted
        while True:
            conn.opened_at = None
            conn.hurry.clear()
            try:
                await self._session(conn, None if ready.done() else ready)
                if conn.closing.is_set():
                    return
                reason = conn.gone or "the session ended"
            except BaseException as exc:
                if conn.closing.is_set():  # closed (maybe cancelled by `aclose()`) meanwhile
                    return
                task = asyncio.current_task()
                if isinstance(exc, asyncio.CancelledError) and task and task.cancelling():
                    raise  # cancelled from outside, not by the session's own task group
                reason = _reason(exc, server, conn.refused())
                if conn.opened_at is None and conn.transport and conn.transport.post_refused:
                    reason = _LEGACY_SSE  # (the SDK says only "an error response")
                if not ready.done():  # never connected: the start fails, no reconnecting
                    conn.gone = reason
                    ready.set_exception(exc if isinstance(exc, UpstreamError) else UpstreamError(
                        f"MCP server {server.label} could not be connected: {reason}"))
                    return
            conn.gone = reason
            if conn.opened_at is None:
                conn.settle(None)  # an attempt failed: a call waiting for it fails
            else:  # a session was lost (not an attempt that failed)
                _log.warning("MCP server connection lost; reconnecting", server=server.label,
                             error=reason)
                if loop.time() - conn.opened_at >= self.reconnect_max_delay:
                    attempt = 0  # it lasted: this outage starts again from the first delay
            attempt += 1
            delay = self._backoff(attempt)
            if attempt & (attempt - 1) == 0 and conn.opened_at is None:
                # after 1, 3, 7, 15... failed attempts: a long outage logs less and less often
                _log.warning("MCP server reconnect failed", server=server.label,
                             attempts=attempt - 1, error=reason, retry_in=round(delay, 2))
            else:
                _log.debug("MCP server reconnect scheduled", server=server.label,
                           attempt=attempt, error=reason, retry_in=round(delay, 2))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await conn.hurry.wait()  # (closing sets it too)
            if conn.closing.is_set():
                return

    def _backoff(self, attempt: int) -> float:
        """The wait before reconnect attempt `attempt` (1, 2...): doubling, capped, and
        jittered (between half and all of it) so servers lost together are not retried in
        step."""
        delay = min(self.reconnect_max_delay, self.reconnect_delay * 2.0 ** min(attempt - 1, 32))
        return delay * random.uniform(0.5, 1.0)

    async def _session(self, conn: _Connection, ready: asyncio.Future[None] | None) -> None:
        """One session: open it, list its tools, then wait for `aclose()` or a call that
        found the connection gone. `ready` hears of the first one; a later one (a reconnect)
        publishes its tools."""
        server = conn.server
        conn.connecting = True
        try:
            async with AsyncExitStack() as stack:
                # The SDK bounds discovery (by its own 10 s) and `initialize` apart: an
                # unresponsive URL took both to fail an app's start, or a run's.
                handshake = asyncio.timeout(server.timeout)
                try:
                    async with handshake:
                        client = await stack.enter_async_context(self._client(conn, stack))
                    _tolerate_output_mismatch(client, server)
                    _note_call_results(client)
                except Exception:
                    if not handshake.expired():
                        raise
                    raise UpstreamError(f"MCP server {server.label} could not be connected: "
                                        f"its handshake timed out ({server.timeout:g} s)"
                                        ) from None
                try:
                    tools = await _list_tools(client, server, refresh=ready is None)
                except Exception as exc:
                    # Its words (a crash report, a DSN) are for the log only: the reason
                    # reaches clients, and the model in every call's tool error.
                    _log.warning("MCP server could not list its tools", server=server.label,
                                 error=scrub_secrets(f"{type(exc).__name__}: {exc}",
                                                     *server.secrets))
                    raise UpstreamError(f"MCP server {server.label} could not list its tools: "
                                        f"{_reason(exc, server, conn.refused())}") from None
                changes = await _listen_for_changes(client, server, stack)
                conn.wake.clear()
                if conn.closing.is_set():
                    return
                conn.client, conn.tools, conn.gone = client, tools, None
                conn.open, conn.connecting = True, False
                conn.opened_at = asyncio.get_running_loop().time()
                watch = None if changes is None else asyncio.create_task(
                    _watch(conn, client, changes, functools.partial(self._relist, conn)),
                    name=f"mcp-changes:{server.label}")
                try:
                    if ready is not None:
                        ready.set_result(None)
                    else:
                        _log.info("MCP server reconnected", server=server.label,
                                  tools=[tool.name for tool in tools])
                        self._publish()  # (before a waiting call goes on: it sees them)
                    conn.settle(client)
                    if conn.stale:
                        # (a change said while this session was opening: its listing may
                        # have been read before it)
                        await self._relist_stale(conn)
                    await conn.wake.wait()
                finally:
                    conn.client = None
                    if watch is not None:
                        watch.cancel()
                        await asyncio.wait([watch])  # (a cancellation of this task goes on)
        finally:
            conn.open = conn.connecting = False

    def _client(self, conn: _Connection, stack: AsyncExitStack) -> Client:
        server = conn.server
        # The session's dispatcher, once the client made it: `Client.session` is only set
        # after the handshake, whose answers may be unreadable too.
        dispatcher: Any = None

        async def on_message(message: Any) -> None:
            if isinstance(message, types.ToolListChangedNotification):
                await self._relist(conn)
            elif isinstance(message, Exception):
                _log.warning("MCP server connection fault", server=server.label,
                             error=scrub_secrets(f"{type(message).__name__}: {message}",
                                                 *server.secrets))
                if dispatcher is not None:
                    _fail_unreadable_answer(dispatcher, message)

        def noting_session(client: Client) -> Client:
            build = getattr(client, "_build_session", None)
            if build is None:
                return client  # (an SDK without it: such answers time out, as they did)

            async def building(stack: AsyncExitStack) -> Any:
                nonlocal dispatcher
                session = await build(stack)
                dispatcher = getattr(session, "_dispatcher", None)
                return session

            client._build_session = building  # type: ignore[method-assign,assignment]
            return client

        if server.url is not None:
            # A mount, not `transport=`: that would drop the proxies the environment names
            # (a request through one is not noted, and not retried).
            noting = conn.transport = _NotingTransport(
                httpx2.AsyncHTTPTransport(),
                listen_read_timeout=max(_LISTEN_READ_TIMEOUT_S, server.timeout + 1.0))
            # Reads wait a little longer than a call: the call's own timeout says it first.
            http = httpx2.AsyncClient(headers=dict(server.headers),
                                      timeout=httpx2.Timeout(server.timeout,
                                                             read=server.timeout + 1.0),
                                      mounts={"all://": noting})
            stack.push_async_callback(http.aclose)
            return noting_session(Client(streamable_http_client(server.url, http_client=http),
                                         read_timeout_seconds=server.timeout,
                                         message_handler=on_message))
        assert server.command is not None
        # A byte of stdout that is not UTF-8 (a legacy code page) reads as U+FFFD: strict, it
        # ended the SDK's reader silently, and every later call timed out. Its lines are
        # bounded (`_StdoutLines`).
        return noting_session(Client(
            StdioServerParameters(command=server.command, args=list(server.args),
                                  env=dict(server.env) if server.env else None,
                                  encoding=_STDOUT_CODEC, encoding_error_handler="replace"),
            read_timeout_seconds=server.timeout, message_handler=on_message))

    async def _relist(self, conn: _Connection) -> None:
        """The server said its tools changed: list them again. Said while the toolset starts
        or the session opens, the connection stays stale: `start()` and `_session` list it
        again once it can be (before, the change was lost until the next one)."""
        conn.stale = True
        await self._relist_stale(conn)

    async def _relist_stale(self, conn: _Connection) -> None:
        async with conn.lock:
            client = conn.client
            if not conn.stale or client is None or conn not in self._connections:
                return  # listed since the notification, or still starting, or closed
            conn.stale = False
            try:
                tools = await _list_tools(client, conn.server, refresh=True)
            except Exception as exc:
                # The previous list stays: its tools answer with a tool error if the server
                # really is gone.
                _log.warning("MCP server could not list its changed tools",
                             server=conn.server.label, error=scrub_secrets(
                                 f"{type(exc).__name__}: {exc}", *conn.server.secrets))
                return
            if conn.client is not client:
                return  # the session ended meanwhile: its successor lists the tools itself
            if tools == conn.tools:
                return  # (a change stream that ended is listed again: mostly nothing changed)
            conn.tools = tools
        _log.info("MCP tools changed", server=conn.server.label,
                  tools=[tool.name for tool in tools])
        self._publish()

    def _publish(self) -> None:
        """Rebuild `actions` from every server's tools and tell each `on_change`."""
        if not self._connections:
            return  # still starting (`start()` builds them) or closed
        self.actions = self._build()
        for callback in list(self.on_change):
            try:
                callback(self.actions)
            except Exception:
                _log.exception("an MCP tools on_change callback failed")

    def _build(self) -> list[Action]:
        """The actions of every server's tools, in the servers' order; a name two servers
        publish (once made safe: `get.user` and `get_user`) gets each server's prefix, so the
        result does not depend on timing."""
        # (one server's `a.b` and `a_b` count once: a prefix would not tell them apart)
        counts = Counter(safe for conn in self._connections
                         for safe in {_UNSAFE.sub("_", tool.name) for tool in conn.tools})
        listed = [(conn, tool) for conn in self._connections for tool in conn.tools]
        names = iter(_names([(tool.name, conn.prefix
                              if counts[_UNSAFE.sub("_", tool.name)] > 1 else None)
                             for conn, tool in listed]))
        actions: dict[str, Action] = {}
        for conn in self._connections:
            for tool in conn.tools:
                try:
                    action = _tool_action(conn, tool, next(names))
                except ConfigurationError as exc:  # an invalid schema, an empty name...
                    _log.warning("MCP tool left out", server=conn.server.label,
                                 tool=tool.name, error=str(exc))
                    continue
                except (TypeError, ValueError, RecursionError) as exc:
                    # A listing of a shape nothing foresaw: the start, a tool change's
                    # rebuild or a reconnect failed on it (which then tried again for ever).
                    _log.warning("MCP tool left out: its listing is of an unexpected shape",
                                 server=conn.server.label, tool=tool.name,
                                 error=failure_text(exc))
                    continue
                if action.name in actions:  # (prefixes alike: `a_1` named, `a` numbered)
                    _log.warning("MCP tool left out: its name is taken",
                                 server=conn.server.label, tool=tool.name)
                    continue
                actions[action.name] = action
        return list(actions.values())

    async def aclose(self) -> None:
        """Close every session (from any task)."""
        connections, self._connections = self._connections, []
        await _close(connections)


async def _close(connections: Sequence[_Connection]) -> None:
    for conn in connections:
        conn.closing.set()
        conn.wake.set()
        conn.hurry.set()
        if conn.connecting and conn.task is not None:
            conn.task.cancel()  # nothing to close gracefully yet, and it may take long
    tasks = [conn.task for conn in connections if conn.task is not None]
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


def _reason(exc: BaseException, server: MCPServer, refused: int | None = None) -> str:
    """The first cause of a session's end, its exception groups opened, without the
    credentials `server` was configured with (an HTTP client quotes a header it refused);
    the SDK's stand-in for an HTTP error answer names its status (`refused`)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, UpstreamError):  # ours, made fit to show: blanked once more all the same
        return scrub_secrets(str(exc), *server.secrets)
    said = failure_text(_shown(exc, server), known=server.secrets)
    status = _http_status(exc, refused)
    return said if status is None else f"{said} (HTTP {status})"


def _shown(exc: BaseException, server: MCPServer) -> BaseException:
    """`exc` as a client or the model reads it. pydantic's words quote the server's answer
    (`input_value`) and link to pydantic's site: an answer breaking the MCP schema is told
    by its first few errors' places and messages, and the SDK's failure to parse an HTTP
    answer (which quotes them whole) by what it means; the whole is logged."""
    if isinstance(exc, pydantic.ValidationError):
        # (a few of the errors: formatting a huge answer's every one took seconds)
        first = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
        said = f"the server's answer breaks the MCP schema ({first})"
        detail = f"{exc.error_count()} errors: {first}"
    elif isinstance(exc, MCPError) and exc.message.startswith(_SDK_UNPARSED):
        said = _TOO_LARGE if exc.message.endswith(_TOO_LARGE) else _UNREADABLE
        detail = exc.message
    else:
        return exc
    _log.warning("MCP server's answer not shown as it was", server=server.label,
                 error=scrub_secrets(detail[:500], *server.secrets))
    return MCPError(types.INTERNAL_ERROR, said[:300])


def _http_status(exc: BaseException, refused: int | None) -> str | None:
    """"401 Unauthorized" when `exc` is the SDK's stand-in for an answer of HTTP `refused`."""
    if refused is None or not isinstance(exc, MCPError) or exc.message != _SDK_HTTP_ERROR:
        return None
    return f"{refused} {httpx2.codes.get_reason_phrase(refused)}".strip()


def _connection_gone(exc: Exception, client: Client) -> bool:
    """Whether a call's failure on `client` means the session's connection is gone (not
    that a live server refused the call)."""
    if isinstance(exc, MCPError):
        # The SDK's stand-in for a lost transport; and a restarted server's answer to a
        # session id it no longer knows (HTTP 404: the SDK server's message, else the
        # client's), after which the spec has the client start a new session.
        if exc.code == types.CONNECTION_CLOSED:
            return _transport_closed(exc, client)
        return exc.code == types.INVALID_REQUEST and exc.message in _SESSION_UNKNOWN
    return isinstance(exc, _CONNECTION_ERRORS)


def _fail_unreadable_answer(dispatcher: Any, fault: Exception) -> None:
    """Settles the request a server answered with a line the SDK could not read: the SDK
    drops the line, and over stdio its caller (a call, or the handshake) waited for the
    whole timeout, then read "timed out" (a tool that had run: the model may run it again).
    A line holding an escaped lone surrogate (text cut inside an emoji, as `JSON.stringify`
    writes it) is read with U+FFFD in its place, and answers its request. Any other fails
    its request at once, saying what was wrong: JSON-RPC it is not (`"result": null`, an
    error without its message), or JSON the SDK cannot read (300 levels deep). Its id is in
    the parse error, or in the line (the SDK's private table of pending requests: nothing
    is done where it has none)."""
    resolve = getattr(dispatcher, "_resolve_pending", None)
    if not isinstance(fault, pydantic.ValidationError) or resolve is None:
        return
    for error in fault.errors():
        answer = error.get("input")
        if isinstance(answer, str):  # (pydantic's JSON reader refused the line)
            _settle_refused_line(resolve, answer)
            return
        if isinstance(answer, dict) and "method" not in answer:
            request = answer.get("id")
            if _is_request_id(request):
                resolve(request, types.ErrorData(
                    code=types.INTERNAL_ERROR,
                    message="the server's answer is not a valid JSON-RPC response"))
            return


def _is_request_id(value: object) -> bool:
    return isinstance(value, str | int) and not isinstance(value, bool)


def _settle_refused_line(resolve: Callable[[Any, Any], None], line: str) -> None:
    """Answer or fail the request of a stdio `line` pydantic refused (see
    `_fail_unreadable_answer`); a line that answers nothing is left (dropped, as before)."""
    rewritten = without_lone_surrogates(line)
    if rewritten is not None:
        try:
            message = types.jsonrpc_message_adapter.validate_json(rewritten, by_name=False)
        except pydantic.ValidationError:
            pass  # (unreadable for another reason too)
        else:
            if isinstance(message, types.JSONRPCResponse):
                resolve(message.id, message.result)
            elif isinstance(message, types.JSONRPCError):
                resolve(message.id, message.error)
            return  # (a request or notification: dropped)
    try:
        answer = decode_json(line)  # (read as deep as orjson reads; the line is bounded)
    except orjson.JSONDecodeError:
        request = _answer_id(line[:_ENDS], line[-_ENDS:])
    else:
        request = answer.get("id") if isinstance(answer, dict) and "method" not in answer \
            else None
    if _is_request_id(request):
        resolve(request, types.ErrorData(code=types.INTERNAL_ERROR, message=_UNREADABLE))


#: The characters of each end of a line that are searched for its id (`_answer_id`).
_ENDS = 256
_ID = r'(-?\d{1,18}|"[^"\\]{0,200}")'
#: An answer's start with its id, in the order the Python SDK writes its keys.
_ID_FIRST = re.compile(r'\s*\{\s*"jsonrpc"\s*:\s*"2\.0"\s*,\s*"id"\s*:\s*' + _ID
                       + r'\s*,\s*"(?:result|error)"\s*:')
#: An answer's start in the TypeScript SDK's order (`{result, jsonrpc, id}`), and its end:
#: the last key of the outermost object (its `}` ends the line).
_RESULT_FIRST = re.compile(r'\s*\{\s*"(?:result|error)"\s*:')
_ID_LAST = re.compile(r'[{,]\s*"id"\s*:\s*' + _ID + r'\s*\}\s*$')


def _answer_id(start: str, end: str) -> int | str | None:
    """The id of the answer whose line starts with `start` and ends with `end`, where the
    SDKs write it (first, or last); None when it is not found there, or when the line may
    be a request of the server's (its ids are not the client's)."""
    found = _ID_FIRST.match(start) or (_RESULT_FIRST.match(start) and _ID_LAST.search(end))
    if not found:
        return None
    request: int | str = orjson.loads(found.group(1))
    return request


def _error_line(request: int | str, message: str) -> str:
    """A JSON-RPC error answering `request`, as a line of a stdio server's stdout."""
    return orjson.dumps({"jsonrpc": "2.0", "id": request, "error": {
        "code": types.INTERNAL_ERROR, "message": message}}).decode() + "\n"


#: The codec a stdio server's stdout is read with (`_StdoutLines`): the SDK's reader takes
#: an encoding by name, and has no other way in.
_STDOUT_CODEC = "copilot_runtime_mcp_stdout"


class _StdoutLines(codecs.IncrementalDecoder):
    """A stdio server's stdout as UTF-8 (a byte that is not UTF-8 reads as U+FFFD), given to the
    SDK's reader in whole lines, none longer than `MAX_ANSWER_BYTES` characters. The reader
    held a line whole however long, copying it again at each chunk (a 50 MB line: 35 s of
    the loop), then parsed it. The rest of a longer line is not held: in its place comes a
    JSON-RPC error (`_TOO_LARGE`) failing the request it answers, as soon as its id is
    found (at either end: `_answer_id`); without one, the line is dropped and logged."""

    def __init__(self, errors: str = "replace") -> None:
        super().__init__(errors)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors)
        self.reset()

    def reset(self) -> None:
        self.utf8.reset()
        #: The line so far (while within the bound), its length, and its start.
        self.parts: list[str] = []
        self.held = 0
        self.start = ""
        #: A line past the bound is being skipped: its end so far, and whether its
        #: request was failed already.
        self.skipping = False
        self.end = ""
        self.told = False

    def decode(self, input: Buffer, final: bool = False) -> str:
        *ended, rest = self.utf8.decode(input, final).split("\n")
        lines = []
        for piece in ended:
            lines.append(self._take(piece))
            lines.append(self._line())
        lines.append(self._take(rest))
        return "".join(lines)

    def _take(self, piece: str) -> str:
        """Holds `piece` of the current line; what to give the reader at once."""
        if len(self.start) < _ENDS:
            self.start += piece[:_ENDS - len(self.start)]
        if not self.skipping:
            if self.held + len(piece) <= MAX_ANSWER_BYTES:
                self.parts.append(piece)
                self.held += len(piece)
                return ""
            self.skipping = True
            self.end = "".join(self.parts[-_ENDS:])[-_ENDS:]
            self.parts, self.held = [], 0
            request = _answer_id(self.start, "")
            if request is not None:
                self.told = True
                return _error_line(request, _TOO_LARGE)
        self.end = (self.end + piece[-_ENDS:])[-_ENDS:]
        return ""

    def _line(self) -> str:
        """The line that just ended, as the reader is given it."""
        line = "".join(self.parts) + "\n"
        if self.skipping:
            line = ""
            if not self.told and (request := _answer_id(self.start, self.end)) is not None:
                line = _error_line(request, _TOO_LARGE)
            elif not self.told:
                _log.warning("MCP server's stdout line past the bound dropped; its request "
                             "not found", bound=MAX_ANSWER_BYTES, start=self.start[:100])
        self.parts, self.held, self.start = [], 0, ""
        self.skipping, self.end, self.told = False, "", False
        return line


def _stdout_codec(name: str) -> codecs.CodecInfo | None:
    if name != _STDOUT_CODEC:
        return None
    utf8 = codecs.lookup("utf-8")
    return codecs.CodecInfo(utf8.encode, utf8.decode, name=_STDOUT_CODEC,
                            incrementalencoder=utf8.incrementalencoder,
                            incrementaldecoder=_StdoutLines)


codecs.register(_stdout_codec)


def _transport_closed(exc: MCPError, client: Client) -> bool:
    """Whether a CONNECTION_CLOSED failure is the SDK's for a closed transport. The code is
    also JSON-RPC's generic server error, which live servers answer with ("quota exceeded"),
    and the SDK's for one SSE answer it gave up on (one over 1 MiB): these fail their call
    alone. Only the SDK's own words, with its dispatcher closed (a private flag, trusted
    when there is one), mean the session is gone."""
    return exc.message == _SDK_CLOSED and bool(getattr(client.session._dispatcher, "_closed", True))


def _prefixes(servers: Sequence[MCPServer]) -> list[str]:
    """Each server's prefix: its label made safe, numbered in the servers' order when two
    servers have the same label (two unnamed servers on one host)."""
    labels = [_UNSAFE.sub("_", server.label) for server in servers]
    counts = Counter(labels)
    seen: Counter[str] = Counter()
    prefixes = []
    for label in labels:
        seen[label] += 1
        prefixes.append(f"{label}_{seen[label]}" if counts[label] > 1 else label)
    return prefixes


def _names(tools: Sequence[tuple[str, str | None]]) -> list[str]:
    """The action name of each tool (its name, and its server's prefix when another server
    publishes that name too): the name made safe, after the prefix. It stays so when it fits
    and is unambiguous: no other tool's is the same, or it is the tool's own name unchanged
    (`get_user` beside `get.user`). Otherwise it ends with a hash of the raw whole (its
    prefix and unsafe characters with it), cut to fit when it is longer than providers
    accept: the same on every listing and worker. Before, `get.user` and `get_user`, or
    `天気` and `翻訳` (both `__`), were one action and the other tool was left out; cut to 64
    characters, two tools sharing them were one action, whose calls ran either. A name kept
    is never taken by a hashed one: that is hashed again (so is one two tools would get)."""
    wanted = [_UNSAFE.sub("_", name) if prefix is None
              else f"{prefix}__{_UNSAFE.sub('_', name)}" for name, prefix in tools]
    counts = Counter(wanted)
    kept = [len(want) <= _MAX_NAME and (counts[want] == 1 or (prefix is None and want == name))
            for (name, prefix), want in zip(tools, wanted, strict=True)]
    taken = {want for want, keep in zip(wanted, kept, strict=True) if keep}
    names = []
    for (name, prefix), want, keep in zip(tools, wanted, kept, strict=True):
        if not keep:
            whole = name if prefix is None else f"{prefix}__{name}"
            again = 0
            while (hashed := _cut(want, whole, again)) in taken:
                again += 1
            taken.add(want := hashed)
        names.append(want)
    return names


def _cut(name: str, whole: str, again: int) -> str:
    """`name` (cut to fit) ending with a hash of `whole` (of it and `again`, after a clash)."""
    hashed = whole if again == 0 else f"{whole}\n{again}"
    digest = hashlib.sha256(hashed.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{name[:_MAX_NAME - _HASH_DIGITS - 1]}_{digest[:_HASH_DIGITS]}"


async def _list_tools(client: Client, server: MCPServer, *, refresh: bool) -> list[Any]:
    tools: dict[str, Any] = {}
    cursor: str | None = None
    for _ in range(_MAX_PAGES):
        try:
            page = await client.list_tools(cursor=cursor,
                                           cache_mode="refresh" if refresh else "use")
        except pydantic.ValidationError:
            page = await _list_tools_leniently(client, server, cursor)
        for tool in page.tools:
            # A name the server lists again (on another page of a cursor that goes round)
            # is one tool: as two, each was renamed apart from the other.
            tools.setdefault(tool.name, tool)
        cursor = page.next_cursor
        if cursor is None:
            break
    else:
        _log.warning("MCP tool listing cut off: its cursor did not end",
                     server=server.label, pages=_MAX_PAGES, tools=len(tools))
    listed = list(tools.values())
    if server.max_tools is not None and len(listed) > server.max_tools:
        # Every run would offer them all, and a provider refuses too many (OpenAI: 128).
        _log.warning("MCP tools left out: the server lists more than its max_tools",
                     server=server.label, listed=len(listed), offered=server.max_tools)
        del listed[server.max_tools:]
    return listed


async def _list_tools_leniently(client: Client, server: MCPServer, cursor: str | None
                                ) -> types.ListToolsResult:
    """A listing page the SDK refused whole because a tool in it breaks the MCP schema (an
    `inputSchema` that is no object), read again as JSON: the valid tools are kept, each
    invalid one is left out with a warning (one bad tool took all of a server's down, and an
    app's start with `mcp_servers=`).

    The SDK has no public way to read a result it cannot validate: this is its
    `send_request` (the session's stamp, its dispatcher) without the validation, and the
    listing is absorbed as `list_tools` would (calls look their tools up in it).
    """
    session = client.session
    data = types.ListToolsRequest(params=types.PaginatedRequestParams(cursor=cursor)).model_dump(
        by_alias=True, mode="json", exclude_none=True)
    options: Any = {"timeout": server.timeout}
    session._stamp(data, options)
    raw = await session._dispatcher.send_raw_request("tools/list", data.get("params"), options)
    tools: list[types.Tool] = []
    listed = raw.get("tools") if isinstance(raw, dict) else None
    for item in listed if isinstance(listed, list) else ():
        try:
            tools.append(types.Tool.model_validate(item, by_name=False))
        except pydantic.ValidationError as exc:
            name = item.get("name") if isinstance(item, dict) else None
            _log.warning("MCP tool left out: it breaks the MCP schema", server=server.label,
                         tool=str(name)[:100], error=str(exc)[:500])
    next_cursor = raw.get("nextCursor") if isinstance(raw, dict) else None
    page = types.ListToolsResult(
        tools=tools, next_cursor=next_cursor if isinstance(next_cursor, str) else None)
    return session._absorb_tool_listing(page, complete=cursor is None and page.next_cursor is None)


async def _listen_for_changes(client: Client, server: MCPServer, stack: AsyncExitStack
                              ) -> Subscription | None:
    """Ask a 2026-07-28 server for its tool list changes. The stream's notifications reach
    the client's message handler like an earlier server's, which sends them unasked."""
    tools = client.server_capabilities.tools
    if tools is None or not tools.list_changed:
        return None
    try:
        return await stack.enter_async_context(client.listen(tools_list_changed=True))
    except ListenNotSupportedError:
        return None  # an earlier protocol: no stream to ask for
    except Exception as exc:
        _log.warning("MCP server's tool changes will not be heard", server=server.label,
                     error=scrub_secrets(f"{type(exc).__name__}: {exc}", *server.secrets))
        return None


async def _watch(conn: _Connection, client: Client, changes: Subscription,
                 relist: Callable[[], Awaitable[None]]) -> None:
    """Listen again on the same session when its change stream ends, and list the tools
    again (a change may have come in between); end the session when that fails. Over HTTP
    at 2026-07-28 the session outlives a server that went away (each call is a request of
    its own) but the stream does not; and a proxy ends long streams of a healthy server,
    whose calls in flight must go on. A stream that ends at once ends the session too: the
    reconnect's backoff, not this loop, paces a server that keeps refusing it."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    reason = await _until_ended(changes, conn.server)
    while loop.time() - began >= conn.hurry_spacing and not conn.closing.is_set():
        began = loop.time()
        try:
            async with client.listen(tools_list_changed=True) as again:
                await relist()
                reason = await _until_ended(again, conn.server)
        except Exception as exc:
            reason = _reason(exc, conn.server)
            break
    conn.lose(client, reason)


async def _until_ended(changes: Subscription, server: MCPServer) -> str:
    """Why a change stream ended, once it has."""
    try:
        async for _ in changes:
            pass  # each event reaches the message handler too
    except Exception as exc:
        return _reason(exc.__cause__ or exc, server)
    return "the server closed its tool change stream"


def _tool_action(conn: _Connection, tool: Any, name: str) -> Action:
    """The action `name` calling `tool` on `conn`'s server."""
    remote = tool.name

    async def call(**arguments: Any) -> Any:
        deadline = asyncio.get_running_loop().time() + conn.server.timeout
        client = conn.client  # the session of the moment: a reconnect replaces it
        if conn.gone is None and client is not None:
            sending = _Sending()
            try:
                result = await _call_tool(client, conn.server, remote, arguments, sending)
            except Exception as exc:
                failure = _failure(conn, client, remote, exc, sending)
                if not _never_reached(exc, sending):
                    raise failure from None
            else:
                return _answer(remote, result, conn.server.secrets)
        # Sending it again cannot run the tool twice: the session was known dead before the
        # request was sent, or the request certainly did not reach the server. A call that
        # broke after its request left (the connection closed mid-call, a timeout) may have
        # run, and is not sent again.
        fresh = await conn.reconnected(client, deadline)
        if fresh is None:
            raise ActionError(f"the MCP tool {remote} is unavailable: {conn.unavailable()}")
        remaining = deadline - asyncio.get_running_loop().time()
        again = _Sending()
        try:
            result = await _call_tool(fresh, conn.server, remote, arguments, again,
                                      read_timeout=remaining)
        except Exception as exc:
            raise _failure(conn, fresh, remote, exc, again) from None
        return _answer(remote, result, conn.server.secrets)

    schema = tool.input_schema if isinstance(tool.input_schema, dict) else None
    if schema and schema.get("type", "object") != "object":
        # (a provider refuses a request offering it: every run would fail)
        raise ConfigurationError(f"its inputSchema is of type {str(schema['type'])[:40]!r}, "
                                 "not 'object'")
    action = Action(name, call, description=tool.description or "",
                    parameters=schema or {"type": "object", "properties": {}})
    action.expendable = True  # (left out first by a run offering too many tools)
    return action


def _tolerate_output_mismatch(client: Client, server: MCPServer) -> None:
    """Keep a result that breaks its tool's `outputSchema` instead of failing the call.

    The SDK checks a result against the schema after the call has run, and raises: the
    model read a tool failure for a side effect that happened (a booking made). The SDK has
    no switch for it; its public check, `validate_tool_result`, which every `call_tool`
    path calls, is wrapped for this session: a result that breaks the schema is logged and
    kept, its structured content dropped when it has content blocks to fall back on."""
    session = client.session
    strict = session.validate_tool_result

    async def validate(name: str, result: types.CallToolResult) -> None:
        try:
            await strict(name, result)
        except Exception as exc:  # (a RuntimeError: no, or wrong, content; a schema unusable)
            _log.warning("MCP tool result breaks its outputSchema; passed on all the same",
                         server=server.label, tool=name[:100],
                         error=scrub_secrets(f"{exc}"[:500], *server.secrets))
            if result.content:
                result.structured_content = None

    session.validate_tool_result = validate  # type: ignore[method-assign]


def _note_call_results(client: Client) -> None:
    """Note each `tools/call` result of this session, as received, in its call's `_Sending`:
    a result the SDK refuses whole is then read leniently (`_call_tool`), not sent again.

    The SDK has no public way to read a result it cannot validate: its dispatcher's
    `send_raw_request`, which its `call_tool` awaits in the caller's task, is wrapped for
    this session."""
    dispatcher: Any = client.session._dispatcher
    send = dispatcher.send_raw_request

    async def noting(method: str, params: Any, opts: Any = None, **rest: Any) -> Any:
        raw = await send(method, params, opts, **rest)
        if method == "tools/call" and (sending := _SENDING.get()) is not None:
            sending.result = raw
        return raw

    dispatcher.send_raw_request = noting


async def _call_tool(client: Client, server: MCPServer, remote: str, arguments: dict[str, Any],
                     sending: _Sending, *, read_timeout: float | None = None
                     ) -> types.CallToolResult:
    """`client.call_tool`, its requests noted in `sending` (see `_NotingTransport`). A result
    the SDK refuses whole (a block of a type it does not know, a field out of its schema) is
    read block by block: the tool ran, and the model read that it failed."""
    token = _SENDING.set(sending)
    try:
        return await client.call_tool(remote, arguments, read_timeout_seconds=read_timeout)
    except pydantic.ValidationError as exc:
        result = _lenient_result(sending.result, server, remote, exc)
        if result is None:
            raise
        if not result.is_error:
            await client.session.validate_tool_result(remote, result)  # (it only logs)
        return result
    finally:
        _SENDING.reset(token)


def _lenient_result(raw: object, server: MCPServer, remote: str,
                    exc: pydantic.ValidationError) -> types.CallToolResult | None:
    """A tool's result the SDK refused, its valid blocks kept and each other one told of
    in a text block; None when `raw` is no finished result (an input request, say)."""
    if not isinstance(raw, dict) or raw.get("resultType", "complete") != "complete":
        return None
    listed = raw.get("content")
    items = listed if isinstance(listed, list) else []
    blocks: list[types.ContentBlock] = []
    unread: tuple[str, int] | None = None  # (a run of unreadable blocks of one kind: a line)
    for item in items[:_LENIENT_BLOCKS]:
        block = _lenient_block(item)
        if block is None:
            kind = item.get("type") if isinstance(item, dict) else None
            kind = _UNSAFE.sub("_", kind)[:40] if isinstance(kind, str) else type(item).__name__
            if unread is not None and unread[0] == kind:
                unread = (kind, unread[1] + 1)
                continue
            if unread is not None:
                blocks.append(_unread(*unread))
            unread = (kind, 1)
            continue
        if unread is not None:
            blocks.append(_unread(*unread))
            unread = None
        blocks.append(block)
    if unread is not None:
        blocks.append(_unread(*unread))
    if len(items) > _LENIENT_BLOCKS:
        blocks.append(types.TextContent(
            type="text", text=f"[{len(items) - _LENIENT_BLOCKS} more blocks not shown]"))
    structured = raw.get("structuredContent")
    # (a few of the errors: formatting a huge result's every one took seconds on the loop)
    first = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
    _log.warning("MCP tool result breaks the MCP schema; its valid parts passed on",
                 server=server.label, tool=remote[:100], errors=exc.error_count(),
                 error=scrub_secrets(first[:500], *server.secrets))
    return types.CallToolResult(content=blocks, is_error=_flag(raw.get("isError", False)),
                                structured_content=structured
                                if isinstance(structured, dict) else None)


#: The blocks of a result the SDK refused that are read one by one (the rest are counted).
_LENIENT_BLOCKS = 1000
_BOOL: pydantic.TypeAdapter[bool] = pydantic.TypeAdapter(bool)


def _flag(value: object) -> bool:
    """`isError` as the SDK's types read it ("true" and 1 are true): read otherwise, a tool
    error was passed to the model as a success."""
    try:
        return _BOOL.validate_python(value)
    except pydantic.ValidationError:
        return bool(value)


def _unread(kind: str, count: int) -> types.TextContent:
    said = f"{kind} block" if count == 1 else f"{count} {kind} blocks"
    return types.TextContent(type="text", text=f"[{said}, not understood, not shown]")


def _lenient_block(item: object) -> types.ContentBlock | None:
    """One block of a result the SDK refused: as it is when valid, else without what only
    annotates it (an audience the types do not know), else None."""
    tries = [item]
    if isinstance(item, dict):
        tries.append({key: value for key, value in item.items()
                      if key not in ("annotations", "_meta")})
    for candidate in tries:
        try:
            block: types.ContentBlock = _BLOCK.validate_python(candidate, by_name=False)
        except pydantic.ValidationError:
            continue
        return block
    return None


def _failure(conn: _Connection, client: Client, remote: str, exc: Exception,
             sending: _Sending) -> ActionError:
    """The tool error of a call that raised `exc`; a connection found gone ends its session.
    An HTTP error answer is logged too: a revoked token or a server failing needs the
    operator, and the model may not say so."""
    said = failure_text(_shown(exc, conn.server), known=conn.server.secrets)
    if (status := _http_status(exc, sending.refused)) is not None:
        said = f"{said} (HTTP {status})"
        _log.warning("MCP server answered a tool call with an HTTP error",
                     server=conn.server.label, tool=remote[:100], status=sending.refused,
                     error=status)
    if _connection_gone(exc, client):
        conn.lose(client, said)
    return ActionError(f"the MCP tool {remote} of {conn.server.label} failed: {said}")


def _never_reached(exc: Exception, sending: _Sending) -> bool:
    """Whether a call that raised `exc` certainly did not run on the server: its request
    could not connect (the server down or restarting), and no request of it was answered
    (none of its rounds ran); or a server that no longer knows the session refused it."""
    if not isinstance(exc, MCPError):
        return False
    if exc.code == types.CONNECTION_CLOSED:
        return sending.unconnected and not sending.answered
    return exc.code == types.INVALID_REQUEST and exc.message in _SESSION_UNKNOWN


def _said(block: Any) -> str:
    """One block of a tool's result as text a model reads: a text block's text, an embedded
    resource's text, and for what has no text (an image, audio, a blob, a link) what it is
    (these were left out: a tool that returned a file's contents returned "")."""
    if isinstance(block, types.TextContent):
        return block.text
    if isinstance(block, types.EmbeddedResource):
        resource = block.resource
        if isinstance(resource, types.TextResourceContents):
            return resource.text
        return f"[resource {resource.uri}: {resource.mime_type or 'binary'}, " \
               f"{len(getattr(resource, 'blob', '')) * 3 // 4} bytes, not shown]"
    if isinstance(block, types.ImageContent | types.AudioContent):
        kind = "image" if isinstance(block, types.ImageContent) else "audio"
        return f"[{kind}: {block.mime_type}, {len(block.data) * 3 // 4} bytes, not shown]"
    if isinstance(block, types.ResourceLink):
        return f"[resource link: {block.uri}" + (f" ({block.name})" if block.name else "") + "]"
    return ""


def _answer(remote: str, result: types.CallToolResult, known: Sequence[str] = ()) -> Any:
    """A tool's result as the action's: its structured content, else its blocks as text,
    one a line; an error's text `quoted`, the `known` secrets (its server's) blanked."""
    text = "\n".join(said for said in map(_said, result.content) if said)
    if result.is_error:
        if not text and result.structured_content is not None:
            # (an error told only as structured content: its detail was lost)
            text = orjson.dumps(result.structured_content).decode()
        # The server's own words, passed on as a remote agent's are: cut, and withheld when
        # they hold its stack or a source file's path (then only the log has them).
        said = quoted(text, 500, known) if text else None
        if text and said is None:
            _log.warning("MCP tool error withheld", tool=remote,
                         error=scrub_secrets(text[:2000], *known))
        raise ActionError(said or f"the MCP tool {remote} reported an error")
    if result.structured_content is not None:
        return result.structured_content
    return text
