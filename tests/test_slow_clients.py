"""Slow, stuck and hostile clients at the transport level, under `copilot-runtime serve`'s
HTTP protocol (`_serving._StopRunsFirst`).

Before, a client that stopped reading kept its connection, its request task and megabytes
of kernel buffers after its run was cut (the last write waited on it for ever), and made
uvicorn log an ERROR line per stream; a connection that sent no headers, or a body one byte
at a time, was held for ever; a follower that read nothing queued every batch of the run;
a compressed body was called malformed JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
import uvicorn

from copilot_runtime import CopilotRuntime, _serving, create_app
from copilot_runtime import events as ev
from copilot_runtime._input import RunInput
from copilot_runtime.agents.base import Agent, EventBatches, RunContext
from copilot_runtime.protocols import http
from tests.conftest import ServeRuntime, free_port, poll, run_input, uvicorn_serving
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, merge, parse_multipart, user_turn

pytestmark = pytest.mark.timeout(60)

PATH = "/api"
CHUNK = "x" * 256 * 1024


class Flood(Agent):
    """Streams 256 KiB text deltas until `stop` is set: a few fill any socket's buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = asyncio.Event()
        self.sent = 0

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input.run_id)

    async def _run(self, run_id: str) -> Any:
        message = f"m-{run_id}"
        yield [ev.text_message_start(message)]
        while not self.stop.is_set() and self.sent < 2000:
            self.sent += 1
            yield [ev.text_message_content(message, CHUNK)]
            await asyncio.sleep(0.02)
        yield [ev.text_message_content(message, "done"), ev.text_message_end(message)]


class Errors(logging.Handler):
    """The ERROR lines uvicorn logs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def uvicorn_errors() -> Iterator[Errors]:
    errors = Errors()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(errors)
    try:
        yield errors
    finally:
        logger.removeHandler(errors)


@contextlib.asynccontextmanager
async def serving(app: Any, **options: Any) -> AsyncIterator[tuple[uvicorn.Server, int]]:
    """`app` served in this loop with the command line's HTTP protocol and options."""
    async with uvicorn_serving(app, log_config=None, http=_serving._StopRunsFirst, ws="none",
                               access_log=False, **options) as served:
        yield served


async def raw_socket(port: int, data: bytes = b"", rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    if data:
        await loop.sock_sendall(sock, data)
    return sock


async def after_an_answer(port: int, first: bytes) -> socket.socket:
    """A connection on which `first` (a whole request, or nothing) was sent and answered 200."""
    sock = await raw_socket(port, first)
    if first:
        try:
            answer = await asyncio.get_running_loop().sock_recv(sock, 65536)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
        except BaseException:
            sock.close()
            raise
    return sock


async def assert_serving(port: int, request: bytes) -> None:
    """`request` (closing its connection) is answered 200: the server goes on serving."""
    sock = await raw_socket(port, request)
    try:
        assert (await read_until_closed(sock, 10)).startswith(b"HTTP/1.1 200 ")
    finally:
        sock.close()


def post(path: str, body: bytes, headers: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def read_until_closed(sock: socket.socket, within: float) -> bytes:
    """What the server sends until it closes the connection (TimeoutError if it does not)."""
    loop = asyncio.get_running_loop()
    received = b""
    async with asyncio.timeout(within):
        while True:
            try:
                chunk = await loop.sock_recv(sock, 65536)
            except ConnectionResetError:
                return received
            if not chunk:
                return received
            received += chunk


# -- a client that stops reading: its connection is aborted -----------------------------


def _gql_request() -> bytes:
    headers = "".join(f"{k}: {v}\r\n" for k, v in CLIENT_HEADERS.items()
                      if k.lower() != "content-type")
    body = orjson.dumps({"query": CHAT_DOCUMENT,
                         "variables": {"data": user_turn("flood", thread="gql-unread")}})
    return post(PATH, body, headers)


@pytest.mark.parametrize("who_gives_up", ["the app", "the protocol"])
@pytest.mark.parametrize("route", ["run", "connect", "graphql"])
async def test_a_client_that_reads_nothing_loses_its_connection(
        monkeypatch: pytest.MonkeyPatch, uvicorn_errors: Errors, route: str,
        who_gives_up: str) -> None:
    """Once the server gives up on a client that reads nothing (the stream's write waited
    `SEND_IDLE_SECONDS`, or the connection's writes `WRITE_STALL_SECONDS`), the connection
    is aborted: its task, descriptor and buffers go at once, and nothing is logged as an
    ERROR. Before, they stayed until the client closed (the last write waited on it for
    ever) and uvicorn logged an ERROR line per follower."""
    app_gives_up = who_gives_up == "the app"
    monkeypatch.setattr(http, "SEND_IDLE_SECONDS", 1.0 if app_gives_up else 60.0)
    monkeypatch.setattr(_serving, "WRITE_STALL_SECONDS", 60.0 if app_gives_up else 1.0,
                        raising=False)
    agent = Flood()
    # A run whose client is gone is stopped at once (0), so its request task goes too; one
    # that outlives its client: tests/test_detached_runs.py.
    runtime = CopilotRuntime(agents={"default": agent}, detached_run_seconds=0)
    async with serving(create_app(runtime, PATH)) as (server, port):
        followed: asyncio.Task[Any] | None = None
        if route == "graphql":
            request = _gql_request()
        elif route == "run":
            request = post(f"{PATH}/agent/default/run",
                           orjson.dumps(run_input("flood", thread="unread")))
        else:
            # A live run followed by a client that reads nothing; its own client reads.
            followed = asyncio.create_task(_read_run(port, "followed"))
            async for _ in poll(10):
                if agent.sent > 40:  # a replay larger than any socket's buffers
                    break
            request = post(f"{PATH}/agent/default/connect",
                           orjson.dumps(run_input("", thread="followed", run="c")))
        base = 1 if followed else 0  # the reading client of a followed run
        sock = await raw_socket(port, request, rcvbuf=4096)
        try:
            async for _ in poll(5):
                if len(server.server_state.connections) > base:
                    break
            # Given up on (1 s, noticed within 2 s), then aborted at once.
            async for _ in poll(8):
                if len(server.server_state.connections) == base:
                    break
            assert len(server.server_state.connections) == base, \
                "the stuck client's connection is still held"
            async for _ in poll(5):
                if len(server.server_state.tasks) == base:
                    break
            assert len(server.server_state.tasks) == base, "its request task waits on it"
            await read_until_closed(sock, 10)  # an end (a reset): what it had not read is gone
        finally:
            sock.close()
        agent.stop.set()
        if followed is not None:
            assert b"RUN_FINISHED" in await asyncio.wait_for(followed, 30)
        async for _ in poll(10):
            if not runtime.runs.active:
                break
        assert not runtime.runs.active
    assert not uvicorn_errors.lines


async def _read_run(port: int, thread: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post(f"{PATH}/agent/default/run", orjson.dumps(run_input("f", thread=thread)),
                      "Connection: close\r\n"))
    data = await reader.read()
    writer.close()
    return data


async def big_answer(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI app answering 8 MiB in one write."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(8 << 20).encode())]})
    await send({"type": "http.response.body", "body": b"x" * (8 << 20)})


async def test_a_client_that_reads_slowly_is_not_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a connection whose buffered answer stops draining is given up on: one that
    drains slowly, for longer than `WRITE_STALL_SECONDS`, is not."""
    monkeypatch.setattr(_serving, "WRITE_STALL_SECONDS", 0.5, raising=False)
    async with serving(big_answer) as (_, port):
        sock = await raw_socket(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", rcvbuf=4096)
        loop = asyncio.get_running_loop()
        received = 0
        started = time.monotonic()
        try:
            while received < 8 << 20:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 5)
                assert chunk, "the server closed a connection that was reading"
                received += len(chunk)
                if time.monotonic() - started < 2.5:
                    await asyncio.sleep(0.1)  # slowly, at first
        finally:
            sock.close()
        assert time.monotonic() - started > 2


# -- headers: a deadline, and a cap on connections --------------------------------------


@pytest.fixture
def headers_deadline(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(_serving, "HEADERS_SECONDS", 0.5, raising=False)
    return 0.5


async def test_a_connection_that_sends_nothing_is_closed(headers_deadline: float) -> None:
    """Idle sockets were held for ever (520 of them took every descriptor of a server whose
    limit was 512): now a connection has `HEADERS_SECONDS` to send its request's headers."""
    runtime = CopilotRuntime(agents={"default": Flood()})
    async with serving(create_app(runtime, PATH)) as (server, port):
        started = time.monotonic()
        idle = await raw_socket(port)
        try:
            assert await read_until_closed(idle, 5) == b""
        finally:
            idle.close()
        assert time.monotonic() - started < 3
        assert not server.server_state.connections


async def test_headers_sent_a_byte_at_a_time_are_answered_408(headers_deadline: float) -> None:
    """A request whose headers trickle in (slowloris) gets 408 at the deadline, also after
    a first answer on the same connection (uvicorn's keep-alive timer stops at a byte)."""
    runtime = CopilotRuntime(agents={"default": Flood()})
    async with serving(create_app(runtime, PATH)) as (_, port):
        loop = asyncio.get_running_loop()
        for first in (b"", b"GET /api/info HTTP/1.1\r\nHost: x\r\n\r\n"):
            sock = await after_an_answer(port, first)
            try:
                async def trickle(s: socket.socket = sock) -> None:
                    for byte in b"GET /api/info HTTP/1.1\r\nHost: x\r\n":
                        await loop.sock_sendall(s, bytes([byte]))
                        await asyncio.sleep(0.1)

                sending = asyncio.create_task(trickle())
                try:
                    answer = await read_until_closed(sock, 5)
                finally:
                    sending.cancel()
                    with contextlib.suppress(asyncio.CancelledError, OSError):
                        await sending
                assert answer.startswith(b"HTTP/1.1 408 "), answer
            finally:
                sock.close()


async def test_headers_past_their_bound_are_answered_431_and_closed() -> None:
    """uvicorn's httptools protocol kept every header it was sent: one request of 420 MB of
    headers was answered 200 (the server holding it all), six of 250 MB took 1.5 GB that
    stayed. Now a request's headers have `MAX_HEADER_BYTES`; one under it is served, even
    and the server goes on."""
    runtime = CopilotRuntime(agents={"default": Flood()})
    line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
    async with serving(create_app(runtime, PATH)) as (server, port):
        loop = asyncio.get_running_loop()
        sock = await raw_socket(port, b"GET /api/info HTTP/1.1\r\nHost: x\r\n")
        try:
            async def send_headers(s: socket.socket = sock) -> None:
                with contextlib.suppress(OSError):
                    for _ in range(10_000):  # 10 MB, unless cut first
                        await loop.sock_sendall(s, line * 10)

            sending = asyncio.create_task(send_headers())
            try:
                answer = await read_until_closed(sock, 10)
            finally:
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sending
            assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        finally:
            sock.close()
        await assert_serving(port, b"GET /api/info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                             + line * (_serving.MAX_HEADER_BYTES // len(line) - 1) + b"\r\n")
        assert len(server.server_state.connections) == 0


async def test_a_header_line_that_never_ends_is_answered_431() -> None:
    """httptools hands a header over only once its line ends: one line of 60 MiB without
    an end was never counted, joined piece by piece (quadratic: other connections waited
    seconds) until the header timer cut it. Now the bytes of an unfinished line count, on a
    first request as on a next one, and the server goes on serving."""
    runtime = CopilotRuntime(agents={"default": Flood()})
    endless = b"GET /api/info HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (200 * 1024)
    async with serving(create_app(runtime, PATH)) as (server, port):
        loop = asyncio.get_running_loop()
        for first in (b"", b"GET /api/info HTTP/1.1\r\nHost: x\r\n\r\n"):
            sock = await after_an_answer(port, first)
            try:
                with contextlib.suppress(OSError):  # (cut once answered)
                    await loop.sock_sendall(sock, endless)
                answer = await read_until_closed(sock, 5)  # (the header timer is 10 s)
                assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
            finally:
                sock.close()
        await assert_serving(port, b"GET /api/info HTTP/1.1\r\nHost: x\r\n"
                                   b"Connection: close\r\n\r\n")
        assert len(server.server_state.connections) == 0


CHUNKED_INFO = (b"POST /api HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n11\r\n{\"method\":\"info\"}\r\n0\r\n")


@pytest.mark.parametrize("trailer", [
    b"X-Trailer: " + b"a" * (4 * _serving.MAX_HEADER_BYTES),  # one line that never ends
    b"X-Trailer: a\r\n" * (_serving.MAX_HEADER_BYTES // 4),  # endless lines
])
async def test_a_trailer_section_past_the_header_bound_is_answered_431(trailer: bytes) -> None:
    """A chunked body's trailer section had no bound (the parser is in the body there): one
    endless trailer line grew the server by its size and, joined piece by piece, stalled
    every other client, until the body's idle timeout 30 s later. Now it has the headers'."""
    runtime = CopilotRuntime(agents={"default": Flood()})
    async with serving(create_app(runtime, PATH)) as (server, port):
        loop = asyncio.get_running_loop()
        sock = await raw_socket(port, CHUNKED_INFO)
        try:
            with contextlib.suppress(OSError):  # (cut once answered)
                for start in range(0, len(trailer), 16 * 1024):
                    await loop.sock_sendall(sock, trailer[start:start + 16 * 1024])
            answer = await read_until_closed(sock, 5)
            assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        finally:
            sock.close()
        await assert_serving(port, b"GET /api/info HTTP/1.1\r\nHost: x\r\n"
                                   b"Connection: close\r\n\r\n")
        assert len(server.server_state.connections) == 0


async def test_a_chunked_body_with_trailers_or_many_small_chunks_is_served() -> None:
    """What the trailer bound must not count: the chunks' own framing, however many."""
    runtime = CopilotRuntime(agents={"default": Flood()})
    body = b'{"method":"info","pad":"' + b"a" * (2 * _serving.MAX_HEADER_BYTES) + b'"}'
    tiny = b"".join(b"1\r\n%b\r\n" % body[i:i + 1] for i in range(len(body)))
    async with serving(create_app(runtime, PATH)) as (_, port):
        for chunks in (tiny, b"%x\r\n%b\r\n" % (len(body), body)):
            await assert_serving(port, CHUNKED_INFO.replace(
                b"11\r\n{\"method\":\"info\"}\r\n0\r\n", chunks + b"0\r\n")
                .replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")
                + b"X-Trailer: a\r\n" * 100 + b"\r\n")


async def test_the_body_of_a_request_answered_early_is_not_counted_as_headers() -> None:
    """A request answered before its body is read (an unknown agent's 404, a 401) gets
    the rest of its body after the answer: the first header bound counted those bytes as the
    next request's headers, and answered 431 and closed the connection mid-upload."""
    runtime = CopilotRuntime(agents={"default": Flood()})
    async with serving(create_app(runtime, PATH)) as (_, port):
        loop = asyncio.get_running_loop()
        body = b'{"messages":"' + b"a" * (4 * _serving.MAX_HEADER_BYTES) + b'"}'
        sock = await raw_socket(port, post(f"{PATH}/agent/missing/run", b"")
                                .replace(b"Content-Length: 0", b"Content-Length: %d"
                                         % len(body)) + body[:1000])
        try:
            answer = await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
            assert answer.startswith(b"HTTP/1.1 404 "), answer
            await loop.sock_sendall(sock, body[1000:])  # (a 431 closed the socket here)
            sock.shutdown(socket.SHUT_WR)
            rest = await read_until_closed(sock, 5)
            assert b" 431 " not in rest, rest
        finally:
            sock.close()


async def test_connections_past_the_limit_are_answered_503_and_closed(
        headers_deadline: float) -> None:
    """At most `limit_concurrency` connections are held (`--limit-concurrency`): one more
    is answered 503 and closed at once, not kept idle holding a descriptor."""
    runtime = CopilotRuntime(agents={"default": Flood()})
    async with serving(create_app(runtime, PATH), limit_concurrency=3) as (server, port):
        held = [await raw_socket(port) for _ in range(3)]
        try:
            async for _ in poll(5):
                if len(server.server_state.connections) == 3:
                    break
            extra = await raw_socket(port)
            try:
                answer = await read_until_closed(extra, 2)
            finally:
                extra.close()
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert len(server.server_state.connections) <= 3
        finally:
            for sock in held:
                sock.close()
        async for _ in poll(5):
            if not server.server_state.connections:
                break
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /api/info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 200 ")
        writer.close()


def test_the_command_line_takes_a_connection_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--limit-concurrency N` reaches uvicorn; without it, a default bounded by the
    process's open-file limit."""
    import structlog

    from copilot_runtime import cli

    asked: list[tuple[Any, ...]] = []
    serve = cli._serve
    monkeypatch.setattr(cli, "_serve", lambda *args, **kwargs: asked.append(args))
    monkeypatch.setattr(cli, "_print_next_steps", lambda *args: None)
    logging_config = structlog.get_config()  # `main` sets the runtime's logging up
    try:
        cli.main(["serve", "tests.test_slow_clients:RUNTIME", "--port", str(free_port()),
                  "--limit-concurrency", "7"])
        with pytest.raises(SystemExit):
            cli.main(["serve", "tests.test_slow_clients:RUNTIME", "--limit-concurrency", "0"])
    finally:
        structlog.configure(**logging_config)
    assert [args[-1] for args in asked] == [7]
    seen: dict[str, Any] = {}
    monkeypatch.setattr(_serving, "serve", lambda app, workers, **options: seen.update(options))
    monkeypatch.setattr(cli, "_tune_gc", lambda: None)
    serve(None, "127.0.0.1", free_port(), "warning", 1, 7)
    assert seen["limit_concurrency"] == 7
    assert 1 <= _serving.default_connection_limit() <= _serving.CONNECTION_LIMIT


RUNTIME = CopilotRuntime(agents={"default": Flood()})


# -- HTTP/1.0 clients: streams are framed by the connection's close ----------------------


class Short(Agent):
    """Answers "hello" in two tokens."""

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input.run_id)

    async def _run(self, run_id: str) -> Any:
        message = f"m-{run_id}"
        yield [ev.text_message_start(message), ev.text_message_content(message, "hel")]
        yield [ev.text_message_content(message, "lo"), ev.text_message_end(message)]


@pytest.mark.parametrize("route", ["run", "graphql", "info"])
async def test_an_http_1_0_client_is_answered_without_chunks(route: str) -> None:
    """A stream (SSE, multipart) was answered with chunked framing whatever the request's
    version, which RFC 9112 forbids for HTTP/1.0 (its client reads the chunk sizes as
    data). Now such an answer ends with the connection; one with a length keeps it."""
    runtime = CopilotRuntime(agents={"default": Short()})
    request = {"run": post(f"{PATH}/agent/default/run", orjson.dumps(run_input("hi"))),
               "graphql": _gql_request(),
               "info": b"GET /api/info HTTP/1.1\r\nHost: x\r\n\r\n"}[route]
    async with serving(create_app(runtime, PATH)) as (_, port):
        sock = await raw_socket(port, request.replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1))
        try:
            answer = await read_until_closed(sock, 10)
        finally:
            sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert b"transfer-encoding" not in headers, head
    assert headers[b"connection"] == b"close"
    if route == "run":
        assert b"content-length" not in headers
        events = [orjson.loads(line[6:]) for line in body.split(b"\n") if line[:6] == b"data: "]
        assert [e["type"] for e in events][-1] == "RUN_FINISHED"
        assert "".join(e.get("delta", "") for e in events) == "hello"
    elif route == "graphql":
        assert b"content-length" not in headers
        merged = merge(parse_multipart(body))  # (which checks the parts' framing)
        assert merged["data"]["generateCopilotResponse"]["status"]["code"] == "Success"
    else:
        assert int(headers[b"content-length"]) == len(body)


# -- a body that trickles: one deadline for all of it -----------------------------------


async def test_a_body_that_trickles_is_answered_408_at_the_whole_body_deadline(
        serve_runtime: ServeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte every `BODY_IDLE_SECONDS / 3` held its request for as long as the client
    liked (only silences were bounded): the whole body now has `BODY_SECONDS`, and the
    connection is closed with the 408 (the rest of the body would go on arriving)."""
    monkeypatch.setattr(http, "BODY_IDLE_SECONDS", 0.6)
    monkeypatch.setattr(http, "BODY_SECONDS", 1.0, raising=False)
    runtime = CopilotRuntime(agents={"default": Flood()})
    async with serve_runtime(runtime, PATH) as served:
        port = int(served.url.rsplit(":", 1)[1].split("/", 1)[0])
        head = (f"POST {PATH}/agent/default/run HTTP/1.1\r\nHost: x\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
        sock = await raw_socket(port, head)
        loop = asyncio.get_running_loop()

        async def trickle() -> None:
            while True:
                await loop.sock_sendall(sock, b" ")
                await asyncio.sleep(0.2)

        started = time.monotonic()
        sending = asyncio.create_task(trickle())
        try:
            answer = await read_until_closed(sock, 6)  # answered, then closed
        finally:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await sending
            sock.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"not complete after 1 s" in answer
        assert time.monotonic() - started < 4


# -- compressed bodies: 415, not "Malformed JSON" ---------------------------------------


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
async def test_a_compressed_body_is_answered_415(serve_runtime: ServeRuntime,
                                                 encoding: str) -> None:
    """The runtime does not decompress bodies: a compressed one was answered 400 "Malformed
    JSON" (AG-UI) or "Invalid JSON payload" (the single endpoint, GraphQL's route)."""
    quick = Flood()
    quick.stop.set()  # (the plain run at the end answers at once)
    runtime = CopilotRuntime(agents={"default": quick})
    body = gzip.compress(orjson.dumps(run_input("hi", thread="zipped")))
    gql = gzip.compress(orjson.dumps({"query": CHAT_DOCUMENT,
                                      "variables": {"data": user_turn("hi")}}))
    async with serve_runtime(runtime, PATH) as served:
        for url, data in ((f"{served.url}/agent/default/run", body), (served.url, gql)):
            async with served.session.post(url, data=data, headers={
                    "Content-Type": "application/json",
                    "Content-Encoding": encoding}) as response:
                answer = await response.json()
                assert response.status == 415, answer
                assert answer["code"] == "UNSUPPORTED_MEDIA_TYPE"
                assert f"Content-Encoding '{encoding}' is not supported" in answer["message"]
        async with served.session.post(f"{served.url}/agent/default/run", json=run_input(
                "hi", thread="plain"), headers={"Content-Encoding": "identity"}) as response:
            assert response.status == 200
    assert "zipped" not in runtime.runs.active


class _GoneAfter:
    """An ASGI server's side of one request whose `send` raises OSError from its `n`-th body
    write on, as the spec lets a server do once the client has gone (uvicorn returns)."""

    def __init__(self, path: str, body: Any, n: int, headers: list[tuple[bytes, bytes]]
                 | None = None) -> None:
        self.scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": headers or [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        self.body, self.n, self.writes = orjson.dumps(body), n, 0
        self.gone = asyncio.Event()
        self.read = False

    async def receive(self) -> dict[str, Any]:
        if not self.read:
            self.read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            self.writes += 1
            if self.writes >= self.n:
                self.gone.set()
                raise OSError("the client has gone")


@pytest.mark.parametrize("edge", ["agui", "graphql"])
async def test_a_server_whose_send_raises_once_the_client_left_stores_the_run_whole(
        edge: str, caplog: pytest.LogCaptureFixture) -> None:
    """A run whose write raised (the ASGI spec lets `send` raise OSError when the client has
    gone; hypercorn and daphne do) went through `drive` as an unhandled error: the run was
    stored without its end, and every later replay of the thread broke the clients. It is a
    disconnect now, stored with its end; a follower's raising write ends its `connect`."""
    from copilot_runtime.testing import verify_events
    from tests.conftest import GatedAgent, parse_sse

    agent = GatedAgent()
    # Stopped at once when its client is gone (0): an AG-UI run that outlives it is
    # tests/test_detached_runs.py's.
    runtime = CopilotRuntime(agents={"default": agent}, detached_run_seconds=0)
    app = create_app(runtime, PATH)
    if edge == "agui":
        gone = _GoneAfter(f"{PATH}/agent/default/run", run_input("hi", thread="t"), 2)
    else:
        data = user_turn("hi", thread="t")
        data["agentSession"] = {"agentName": "default"}
        gone = _GoneAfter(PATH, {"query": CHAT_DOCUMENT, "variables": {"data": data}}, 2,
                          [(k.lower().encode(), v.encode()) for k, v in CLIENT_HEADERS.items()])
    with caplog.at_level(logging.ERROR):
        async with asyncio.timeout(10):
            await app(gone.scope, gone.receive, gone.send)
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 timeout=10) as client:
        async def replay() -> list[dict[str, Any]]:
            answer = await client.post(f"{PATH}/agent/default/connect",
                                       json=run_input("", thread="t"))
            events = parse_sse(answer.content)
            verify_events(events)
            return events

        assert [e["type"] for e in await replay()][-1] == "RUN_FINISHED"
        # A follower whose write raises: its connect ends, the run goes on.
        second = asyncio.create_task(client.post(
            f"{PATH}/agent/default/run", json=run_input("again", thread="t", run="r2")))
        async for _ in poll():
            if runtime.runs.active.get("t") is not None:
                break
        follower = _GoneAfter(f"{PATH}/agent/default/connect", run_input("", thread="t"), 2)
        following = asyncio.create_task(app(follower.scope, follower.receive, follower.send))
        await asyncio.sleep(0.1)
        agent.gate.set()
        async with asyncio.timeout(10):
            await following
            assert (await second).status_code == 200
        assert [e["type"] for e in await replay()][-1] == "RUN_FINISHED"
    await runtime.aclose()
    assert not [r for r in caplog.records if "unhandled" in r.getMessage()]


def test_many_lines_of_one_header_field_are_combined_in_linear_time() -> None:
    """Each line of a repeated field was looked for among the field's earlier lines: the
    ~9,000 short lines that fit in the header bound held the event loop ~3 s (every
    stream and probe of the worker waited). Now combining is linear."""
    raw = [(b"X", b"%d" % i) for i in range(30_000)] + [(b"x", b"7"), (b"Cookie", b"a=1"),
                                                         (b"cookie", b"b=2")]
    began = time.perf_counter()
    combined = http._combined(raw)
    assert time.perf_counter() - began < 2.0  # was minutes for these lines
    assert combined[b"x"] == b", ".join(b"%d" % i for i in range(30_000))  # "7" said once
    assert combined[b"cookie"] == b"a=1; b=2"
