"""A small HTTP/1.1 client for an adapter's hot path: one pre-encoded request, one streamed body.

Why not the SDK's client stack: per chat, building and sending one request through the
`openai` SDK, httpx2 and aiohttp cost about as much CPU as everything else the runtime does,
and importing them costs an idle worker ~28 MB. This client writes the request head and body
in one `write`, parses the answer with `httptools` (llhttp, the parser uvicorn already uses),
and hands the body over per socket read, not per HTTP chunk. Keep-alive connections are
pooled per adapter; TLS comes from `asyncio` and the standard `ssl` module.

What it does not do, on purpose: redirects, proxies, cookies, HTTP/2. An adapter whose
configuration needs one of them uses its SDK instead.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httptools

if TYPE_CHECKING:
    import ssl

__all__ = [
    "BodyError",
    "ConnectError",
    "Disconnected",
    "HTTPPool",
    "HTTPProtocolError",
    "ReadTimeout",
    "Response",
]

# Reading pauses when this much body is waiting for its consumer (a slow client downstream).
_HIGH_WATER = 1 << 20
_MAX_IDLE = 256
#: How long a connection released before its body's end waits for that end (seconds): a
#: server silent that long after the answer its reader needed is not sending it.
_DRAIN_WAIT = 2.0


class HTTPClientError(Exception):
    """Something went wrong between us and the server (never an HTTP status)."""


class ConnectError(HTTPClientError):
    """The connection could not be made (refused, unreachable, TLS failed, or timed out)."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


class Disconnected(HTTPClientError):
    """The server closed the connection before the head of its answer."""


class BodyError(HTTPClientError):
    """The connection broke off in the middle of the body."""


class HTTPProtocolError(HTTPClientError):
    """The server's answer is not valid HTTP/1.1."""


class ReadTimeout(HTTPClientError):
    """Nothing arrived for the read timeout while we were waiting for it."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, pool: HTTPPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.uses = 0
        # One parser for the connection's life: llhttp reads one message after another.
        self.parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.buffered = 0
        self.head_done = False
        self.keep_alive = False
        self.complete = False
        self.got_bytes = False
        self.error: HTTPClientError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.last_data = 0.0
        self.wait_started = 0.0
        self.timeout = 0.0
        self.timer: asyncio.TimerHandle | None = None
        #: Released before the body's end: back to the pool when the end arrives.
        self.draining = False

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail(HTTPProtocolError("malformed HTTP response"))
            self.abort()
            return
        if self.draining and self.complete:
            self.draining = False
            self._cancel_timer()
            self.pool._put(self)
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.draining = False
        if not self.complete and self.error is None:
            if not self.head_done:
                self.error = Disconnected("closed before answering")
            elif self._reads_to_close() and exc is None:
                self.complete = True  # a body delimited by the connection's (clean) end
            else:
                self.error = BodyError("closed before the end of the body")
        self._cancel_timer()
        self._wake()

    def pause_writing(self) -> None:  # the request body is buffered by the transport
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        # Asked here: once the message is complete the parser has forgotten it.
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True

    # -- the request -------------------------------------------------------------------

    def send(self, data: bytes, timeout: float) -> None:
        if self.uses:
            self._reset()
        self.uses += 1
        self.timeout = timeout
        self.last_data = self.wait_started = self.loop.time()
        self.timer = self.loop.call_at(self.last_data + timeout, self._check)
        assert self.transport is not None
        self.transport.write(data)

    async def head(self) -> None:
        while not self.head_done:
            if self.error is not None:
                raise self.error
            await self._wait()
        if self.error is not None and not self.body:
            raise self.error

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, one piece per arrival (everything that came in one read, joined)."""
        decoder = self._decoder()
        while True:
            body = self.body
            if body:
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                self.buffered = 0
                if self.paused and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                if decoder is not None:
                    try:
                        data = decoder.decompress(data)
                    except zlib.error:
                        raise HTTPProtocolError("malformed compressed body") from None
                if data:
                    yield data
                continue
            if self.complete:
                self._cancel_timer()
                return
            if self.error is not None:
                raise self.error
            await self._wait()

    async def read(self, limit: int) -> bytes:
        """The whole body, at most `limit` bytes of it (the rest is dropped)."""
        out: list[bytes] = []
        size = 0
        async for data in self.chunks():
            if size < limit:
                out.append(data[: limit - size])
            size += len(data)
        return b"".join(out)

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def release(self) -> None:
        """Done with this request: keep the connection if it can serve another."""
        self._cancel_timer()
        if (self.closed or self.error is not None or not self.head_done
                or not self.keep_alive):
            self.abort()
        elif self.complete:
            self.body.clear()  # whatever the reader left after the end it wanted
            self.pool._put(self)
        else:
            # The answer was read to its end but the body's terminator is still on its way
            # (or never comes: some servers keep the body open after the answer's end).
            self.draining = True
            self.body.clear()
            self.timer = self.loop.call_later(_DRAIN_WAIT, self._drain_expired)

    def abort(self) -> None:
        self._cancel_timer()
        self.closed = True
        self.draining = False
        if self.transport is not None:
            self.transport.abort()

    # -- waiting -----------------------------------------------------------------------

    async def _wait(self) -> None:
        self.wait_started = self.loop.time()
        waiter = self.waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self.waiter = None

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: HTTPClientError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _check(self) -> None:
        """The read timeout's watchdog: one timer per `timeout` seconds, not per read."""
        self.timer = None
        if self.complete or self.closed:
            return
        now = self.loop.time()
        if self.waiter is not None:
            deadline = max(self.last_data, self.wait_started) + self.timeout
            if now >= deadline:
                self._fail(ReadTimeout(f"nothing for {self.timeout:g} s"))
                self.abort()
                return
        else:
            deadline = now + self.timeout
        self.timer = self.loop.call_at(deadline, self._check)

    def _drain_expired(self) -> None:
        self.timer = None
        if self.draining:
            self.abort()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _reads_to_close(self) -> bool:
        return self.header(b"content-length") is None and b"chunked" not in (
            self.header(b"transfer-encoding") or b"").lower()

    def _decoder(self) -> Any:
        encoding = (self.header(b"content-encoding") or b"").strip().lower()
        if encoding in (b"", b"identity"):
            return None
        if encoding in (b"gzip", b"x-gzip"):
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        if encoding == b"deflate":
            return zlib.decompressobj()
        raise HTTPProtocolError(f"unsupported content encoding {encoding.decode('latin-1')!r}")


class Response:
    """An answer whose head has arrived; its body is read with `chunks()` or `read()`."""

    __slots__ = ("_connection", "status")

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.status = connection.status

    def header(self, name: str) -> str | None:
        value = self._connection.header(name.lower().encode("latin-1"))
        return value.decode("latin-1") if value is not None else None

    def chunks(self) -> AsyncIterator[bytes]:
        return self._connection.chunks()

    async def read(self, limit: int = 1 << 20) -> bytes:
        return await self._connection.read(limit)

    def release(self) -> None:
        """Finished with the answer (read or not): the connection is reused or closed."""
        self._connection.release()

    def abort(self) -> None:
        """Close the connection now: the server sees the request cancelled."""
        self._connection.abort()


class HTTPPool:
    """Keep-alive connections to one origin (`scheme://host:port`)."""

    def __init__(self, scheme: str, host: str, port: int, *, connect_timeout: float) -> None:
        self.scheme = scheme
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        self._ssl: ssl.SSLContext | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    async def request(self, data: bytes, read_timeout: float) -> Response:
        """Send `data` (a whole request); return once the answer's head has arrived.

        `read_timeout` bounds every wait for the server, from the request to the body's end.
        """
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._idle.clear()  # connections of another loop (tests run one loop each)
            self._loop = loop
        while self._idle:
            connection = self._idle.pop()
            if connection.closed:
                continue
            try:
                return await self._exchange(connection, data, read_timeout)
            except Disconnected:
                if connection.got_bytes:
                    raise
                # The server closed the idle connection as we reused it: not a failure of
                # this request, which it never saw. Try another connection.
                continue
        return await self._exchange(await self._connect(), data, read_timeout)

    async def _exchange(self, connection: _Connection, data: bytes,
                        read_timeout: float) -> Response:
        try:
            connection.send(data, read_timeout)
            await connection.head()
        except BaseException:
            connection.abort()
            raise
        return Response(connection)

    async def _connect(self) -> _Connection:
        loop = self.loop
        ssl_context: ssl.SSLContext | None = None
        if self.scheme == "https":
            if self._ssl is None:
                import ssl

                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=ssl_context,
                    server_hostname=self.host if ssl_context is not None else None)
        except TimeoutError:
            raise ConnectError("connecting timed out", timeout=True) from None
        except OSError as exc:
            raise ConnectError(f"connection failed ({type(exc).__name__})") from None
        return protocol

    def _put(self, connection: _Connection) -> None:
        if not connection.closed and len(self._idle) < _MAX_IDLE:
            self._idle.append(connection)
        else:
            connection.abort()

    def close(self) -> bool:
        """Close the idle connections; whether there were any."""
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.abort()
        return bool(idle)
