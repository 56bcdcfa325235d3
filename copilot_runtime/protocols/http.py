"""The few ASGI building blocks every protocol edge shares: bodies, JSON answers, CORS, SSE.

Written against bare ASGI: the streaming path is the runtime's hot loop, and Starlette's
`StreamingResponse` would add a task group and a per-chunk wrapper to every request.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    MutableMapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any

import orjson
import structlog

from copilot_runtime import events as ev
from copilot_runtime._exceptions import (
    AgentNotFoundError,
    ApprovalClosedError,
    AuthenticationError,
    ClientDisconnected,
    ConfigurationError,
    InvalidRequestError,
    JSONTooDeepError,
    PayloadTooLargeError,
    RateLimitedError,
    RequestError,
    RequestTimeoutError,
    ServiceUnavailableError,
    UnsupportedEncodingError,
    UnsupportedMediaTypeError,
)
from copilot_runtime._limits import replayable
from copilot_runtime._runs import ActiveRun, client_watched
from copilot_runtime._strings import not_one_string
from copilot_runtime.auth import RequestInfo
from copilot_runtime.events import Event
from copilot_runtime.headers import forwardable
from copilot_runtime.threads.base import Positioned

__all__ = [
    "ABORT_EXTENSION",
    "ASGIApp",
    "CORSPolicy",
    "Receive",
    "Request",
    "Scope",
    "Send",
    "encode_sse",
    "error_body",
    "error_headers",
    "from_cursor",
    "read_body",
    "request_info",
    "send_error",
    "send_json",
    "send_method_not_allowed",
    "stream_events",
    "stream_run",
    "to_cursor",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

_log = structlog.get_logger("copilot_runtime.http")

#: No `Connection`: the server says it (an HTTP/1.1 connection is kept unless it says
#: `close`, for an HTTP/1.0 client or one that asked; a `keep-alive` here contradicted it).
_SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON = (b"content-type", b"application/json")
#: What every whole answer carries: most are one user's (threads, messages, state,
#: approvals), so no cache keeps them, and no browser reads them as anything but their type.
_PRIVATE: Headers = [(b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff")]
_NOSNIFF: Headers = _PRIVATE[1:]


@dataclass(frozen=True, slots=True)
class CORSPolicy:
    """Which browser origins may call the runtime.

    The default, like the TypeScript runtime's `cors: true`, allows every origin without
    credentials. With `origins`, only those are answered (reflected, with `Vary: Origin`),
    and `allow_credentials` lets cookies through: for those origins only, so it needs them
    listed (`"null"`, the origin of sandboxed and `file:` pages, only when listed too).
    `origins=()` sends no CORS headers at all: same-origin pages only.
    """

    origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_age: int = 600

    def __post_init__(self) -> None:
        # "*" alone: every origin, however written (as the TypeScript runtime's option is)
        if self.origins == "*":  # type: ignore[comparison-overlap]
            object.__setattr__(self, "origins", ("*",))
        # One string would be matched as a substring: "https://app.example.co" in it.
        not_one_string(self.origins, "CORSPolicy's origins")
        if self.allow_credentials and "*" in self.origins:
            # Reflecting every origin with credentials lets any site act as the signed-in user.
            raise ConfigurationError(
                "CORSPolicy(allow_credentials=True) needs the allowed origins listed, e.g. "
                "CORSPolicy(origins=('https://app.example',), allow_credentials=True); "
                "'*' cannot be combined with credentials")

    def headers(self, request_headers: Mapping[bytes, bytes]) -> Headers:
        origin = request_headers.get(b"origin")
        if "*" in self.origins:  # never with credentials (refused when configured)
            return [(b"access-control-allow-origin", b"*")]
        if origin is None or origin.decode("latin-1") not in self.origins:
            return [(b"vary", b"Origin")]
        out = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        if self.allow_credentials:
            out.append((b"access-control-allow-credentials", b"true"))
        return out

    def preflight(self, request_headers: Mapping[bytes, bytes]) -> Headers:
        allowed = self.headers(request_headers)
        return [*allowed, *self.preflight_extra(allowed, request_headers)]

    def preflight_extra(self, allowed: Headers, request_headers: Mapping[bytes, bytes]
                        ) -> Headers:
        """What a preflight's answer adds to `allowed` (`headers`'s answer to it)."""
        if allowed[0][0] != b"access-control-allow-origin":
            return []  # an origin not allowed learns nothing of what others may do
        requested = request_headers.get(b"access-control-request-headers")
        return [
            (b"access-control-allow-methods", b"GET, HEAD, PUT, POST, DELETE, PATCH, OPTIONS"),
            # Reflecting the requested headers lets `Authorization` through, which `*` does not.
            (b"access-control-allow-headers", requested or b"*"),
            (b"access-control-max-age", str(self.max_age).encode()),
            (b"vary", b"Access-Control-Request-Headers, Access-Control-Request-Method"),
        ]


class Request:
    """What the handlers need of an HTTP request, parsed once."""

    __slots__ = ("answer_headers", "headers", "info", "method", "path", "query", "receive", "scope",
                 "send", "status")

    def __init__(self, scope: Scope, receive: Receive, send: Send, path: str,
                 answer_headers: Headers) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.method: str = scope["method"]
        self.path = path
        raw = scope["headers"]
        headers = {k.lower(): v for k, v in raw}
        self.headers: dict[bytes, bytes] = headers if len(headers) == len(raw) else _combined(raw)
        self.query: bytes = scope.get("query_string", b"")
        #: What every answer to it carries: CORS's headers, and its `X-Request-ID`.
        self.answer_headers = answer_headers
        #: Who asks, when the runtime needs to know (identity, hooks, limits, telemetry).
        self.info: RequestInfo | None = None
        #: The answer's HTTP status once it has started (for the request's span).
        self.status: int | None = None

    def header(self, name: str) -> str | None:
        value = self.headers.get(name.encode())
        return value.decode("latin-1") if value is not None else None

    def forwardable_headers(self, *, credentials: bool = True) -> dict[str, str]:
        """The headers an agent receives (each passes on only what its policy allows);
        without `credentials`, not those that authenticated the caller to the runtime."""
        return forwardable(self.headers.items(), credentials=credentials)

    def is_json(self) -> bool:
        """Whether the body is JSON by its Content-Type (`application/json`, or a type of
        the `+json` suffix): none a browser sends cross-site without a preflight."""
        content_type = self.headers.get(b"content-type", b"")
        mime = content_type.split(b";", 1)[0].strip().lower()
        return mime == b"application/json" or (
            mime.startswith(b"application/") and mime.endswith(b"+json"))

    def has_body(self) -> bool:
        """Whether a body comes (a length that is not 0, or chunks)."""
        length = self.headers.get(b"content-length")
        return b"transfer-encoding" in self.headers or (
            length is not None and length.strip().lstrip(b"0") != b"")


def _combined(raw: Iterable[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """Headers with each repeated field's lines combined, in order, as HTTP does (cookies
    with "; ", the rest with ", "). A singleton such as `Authorization` sent twice then reads
    as one malformed value, refused, instead of whichever copy came first or last (a proxy
    in front may have checked the other one)."""
    combined: dict[bytes, bytes] = {}
    repeated: dict[bytes, dict[bytes, None]] = {}  # a field's distinct lines, in order
    for name, value in raw:
        key = name.lower()
        first = combined.setdefault(key, value)
        if first is not value:
            # The same line twice says it once (proxies repeat lines); a dict, not a list,
            # so thousands of lines of one field cost linear time, not quadratic.
            repeated.setdefault(key, {first: None})[value] = None
    for key, values in repeated.items():
        combined[key] = (b"; " if key == b"cookie" else b", ").join(values)
    return combined


#: What an incoming `X-Request-ID` may be to be kept (a proxy's or a client's id: letters,
#: digits and `-_.:`, at most 128): anything else could forge or break a log line.
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def request_info(request: Request) -> RequestInfo:
    """The request as authenticators, hooks and limits see it; its id is the request's
    `X-Request-ID` when that is a plain token (a load balancer's, to follow a request from
    its logs into ours), else a new one. Every answer carries it back as `X-Request-ID`."""
    client = request.scope.get("client")
    return RequestInfo(
        method=request.method, path=request.path,
        headers={k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers.items()},
        client=client[0] if client else None, request_id=tell_request_id(request))


def tell_request_id(request: Request) -> str:
    """The request's id (its plain `X-Request-ID`, else a new one), added to what every
    answer to it carries."""
    given = request.headers.get(b"x-request-id")
    request_id = (given.decode() if given is not None and _REQUEST_ID.fullmatch(given)
                  else uuid.uuid4().hex)
    request.answer_headers = [*request.answer_headers, (b"x-request-id", request_id.encode())]
    return request_id


# How much of an over-limit body is read (and discarded) before answering 413, and for how
# long: see `_drain`.
_DRAIN_BYTES = 64 * 1024 * 1024
_DRAIN_SECONDS = 30.0
_NOT_JSON = "The request body must be JSON, sent as Content-Type: application/json"
#: The longest silence while a body arrives: past it the request is answered 408, so a
#: client that sends part of a body and stops cannot hold its request open for ever.
BODY_IDLE_SECONDS = 30.0
#: The longest a whole body may take, however steadily it trickles: past it, 408.
BODY_SECONDS = 120.0
#: The longest a response's write may wait on a client that reads nothing (its socket full,
#: the connection open): past it the client counts as gone, as on a disconnect (its run
#: stopped and stored, a followed stream ended), so it cannot hold its thread for ever.
SEND_IDLE_SECONDS = 30.0
#: Answers of at least this many bytes (a long thread's replay or events) are large: sent in
#: pieces of this size, each when the client took the last, and counted against
#: `LARGE_ANSWERS_BYTES`.
LARGE_ANSWER = 256 * 1024
#: The most bytes of large answers this process sends at once. A client that reads nothing
#: holds its answer until it counts as gone (`SEND_IDLE_SECONDS`): fifty `connect`s of a
#: 26 MB thread that read nothing held 1.3 GB. Past it a large answer is refused (503)
#: before it starts, and a stream's large batch waits for room. One alone always goes.
LARGE_ANSWERS_BYTES = 256 * 1024 * 1024


class _LargeAnswers:
    """The bytes of large answers being sent now."""

    held = 0

    @classmethod
    def take(cls, size: int) -> bool:
        if cls.held and cls.held + size > LARGE_ANSWERS_BYTES:
            return False
        cls.held += size
        return True

    @classmethod
    async def wait_for_room(cls, size: int) -> bool:
        """`take`, waiting up to `SEND_IDLE_SECONDS` for room (False: none came)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + SEND_IDLE_SECONDS
        while not cls.take(size):
            if loop.time() >= until:
                return False
            await asyncio.sleep(0.05)
        return True

    @classmethod
    def give(cls, size: int) -> None:
        cls.held -= size


_TOO_MANY_LARGE = ("The server is sending many large answers now; try again shortly")


class _NoRoom(Exception):
    """A stream's large batch found no room among the large answers being sent."""


async def _send_body(request: Request, body: bytes, *, more_body: bool) -> None:
    """`body`, in pieces when it is large (see `LARGE_ANSWER`): the transport's flow control
    then holds the rest here until the client reads, never a second copy of all of it."""
    if len(body) < LARGE_ANSWER:
        await request.send({"type": "http.response.body", "body": body,
                            "more_body": more_body})
        return
    view = memoryview(body)
    for start in range(0, len(body), LARGE_ANSWER):
        end = start + LARGE_ANSWER
        await request.send({"type": "http.response.body", "body": bytes(view[start:end]),
                            "more_body": more_body or end < len(body)})


#: The scope extension a server may offer: a callable that aborts the request's connection,
#: called when the client counts as gone while its connection stays open (`copilot-runtime
#: serve` offers it). Without it the server closes the connection once the answer ends, which
#: uvicorn does only after the client has read what is still buffered.
ABORT_EXTENSION = "copilot_runtime.abort"


async def read_body(request: Request, limit: int, *, json: bool = False,
                    empty_too: bool = False) -> bytes:
    """The whole body, or `PayloadTooLargeError` once it is known to exceed `limit`
    (`RequestTimeoutError` if it stops arriving for `BODY_IDLE_SECONDS`, or is not all there
    after `BODY_SECONDS`; `UnsupportedEncodingError` if it is compressed: nothing here
    decompresses, and JSON's parser would call the bytes malformed). With `json`, a body
    whose Content-Type is not JSON is refused (`UnsupportedMediaTypeError`): a cross-site
    `text/plain` POST carries the user's cookies, and no preflight lets the site refuse it.
    With `empty_too` as well, so is a request without a body (an empty form posted
    cross-site, where the empty request itself is the command)."""
    header = request.headers.get(b"content-length")
    declared = int(header) if header is not None and header.isdigit() else None
    encoding = request.headers.get(b"content-encoding", b"identity").strip().lower()
    if json and not request.is_json() and (empty_too or request.has_body()):
        await _refuse_unread(request, declared)
        raise UnsupportedMediaTypeError(_NOT_JSON)
    if encoding not in (b"identity", b""):
        await _refuse_unread(request, declared)
        raise UnsupportedEncodingError(encoding.decode("latin-1"))
    if declared is not None and declared > limit:
        await _refuse_unread(request, declared)
        raise PayloadTooLargeError(limit)
    chunks: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BODY_SECONDS
    while True:
        left = deadline - loop.time()
        try:
            message = await _receive_within(request, min(BODY_IDLE_SECONDS, max(left, 0.0)))
        except RequestTimeoutError:
            if left >= BODY_IDLE_SECONDS:
                raise
            raise RequestTimeoutError(
                BODY_SECONDS, f"The request body was not complete after {BODY_SECONDS:g} s"
            ) from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if body:
            size += len(body)
            if size > limit:
                if more:
                    await _drain(request, None)
                raise PayloadTooLargeError(limit)
            chunks.append(body)
        if not more:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _receive_within(request: Request, seconds: float) -> MutableMapping[str, Any]:
    """The next message of the request, or `RequestTimeoutError` after `seconds` without one.

    A timer that cancels this task, not `asyncio.timeout`: every request pays it, and it
    costs half as much."""
    task = asyncio.current_task()
    assert task is not None
    stalled = False

    def stall() -> None:
        nonlocal stalled
        stalled = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(seconds, stall)
    try:
        return await request.receive()
    except asyncio.CancelledError:
        if stalled and task.uncancel() == 0:
            raise RequestTimeoutError(seconds) from None
        raise
    finally:
        timer.cancel()


async def _refuse_unread(request: Request, declared: int | None) -> None:
    """Prepare the refusal of a body none of which was read: drained (`_drain`), unless the
    client waits for a `100 Continue` before sending it (the first read would invite it):
    then the answer closes the connection instead, so what of the body it sends anyway is
    not read as its next request."""
    expect = request.headers.get(b"expect", b"")
    if expect.strip().lower() == b"100-continue":
        request.answer_headers = [*request.answer_headers, (b"connection", b"close")]
        return
    await _drain(request, declared)


async def _drain(request: Request, declared: int | None) -> None:
    """Read and discard the rest of an over-limit body before the 413 is sent.

    Many clients read the answer only after sending the whole body; a server that answers
    early and then closes (or lets keep-alive expire) with the body unread resets the
    connection, and such a client sees the reset, not the 413. Bounded in bytes and time:
    a body far over the limit is cut off as before.
    """
    if declared is not None and declared > _DRAIN_BYTES:
        return
    drained = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_DRAIN_SECONDS):
            while drained <= _DRAIN_BYTES:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return
                drained += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return


async def send_json(request: Request, status: int, payload: Any,
                    extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = orjson.dumps(payload)
    await send_bytes(request, status, body, [_JSON, *extra_headers])


#: The `error` title of an answer, by code: the TypeScript runtime's words where it has them.
_TITLES = {
    "THREAD_BUSY": "Thread busy",
    "PAYLOAD_TOO_LARGE": "Payload too large",
    "REQUEST_TIMEOUT": "Request timeout",
    "UNSUPPORTED_MEDIA_TYPE": "Unsupported media type",
    "GUARDRAILS_VALIDATION_FAILED": "Refused by a guardrail",
    "APPROVAL_ERROR": "Approval error",
    "APPROVAL_NOT_FOUND": "Approval not found",
    "APPROVAL_EXPIRED": "Approval expired",
    "APPROVAL_ALREADY_ANSWERED": "Approval already answered",
    "APPROVAL_WITHDRAWN": "Approval withdrawn",
    "INTERRUPT_NOT_PENDING": "Nothing to resume",
    "THREAD_NOT_FOUND": "Thread not found",
    "RATE_LIMITED": "Too many requests",
    "SERVICE_UNAVAILABLE": "Service unavailable",
    "AUTHENTICATION_ERROR": "Unauthorized",
    "REQUEST_REJECTED": "Forbidden",
    "NOT_IMPLEMENTED": "Not implemented",
}


def error_body(exc: RequestError) -> dict[str, Any]:
    """The JSON answer of a request that cannot be served (the one mapping every edge uses
    for plain HTTP answers; its status is `exc.status`)."""
    if isinstance(exc, InvalidRequestError):
        # The TypeScript runtime's {error, details}; a bound of this runtime's own (the
        # JSON depth) adds its code, as the README's limits table says.
        body: dict[str, Any] = {"error": exc.message}
        if exc.details is not None:
            body["details"] = exc.details
        if isinstance(exc, JSONTooDeepError):
            body["code"] = exc.code
        return body
    if isinstance(exc, AgentNotFoundError):
        return {"error": "Agent not found", "message": exc.message}
    body = {"error": _TITLES.get(exc.code, "Bad request"), "message": exc.message,
            "code": exc.code}
    if isinstance(exc, ApprovalClosedError):
        body["approval"] = exc.approval.to_json()
    return body


async def send_error(request: Request, exc: RequestError) -> None:
    await send_json(request, exc.status, error_body(exc), error_headers(exc))


def error_headers(exc: RequestError) -> list[tuple[bytes, bytes]]:
    """The headers that go with an error answer: `Retry-After` of a 429 or a 503,
    `WWW-Authenticate` of a 401, `Connection: close` of a 408 (the rest of a body that
    came too slowly would go on arriving on the connection, read as nothing)."""
    if isinstance(exc, RequestTimeoutError):
        return [(b"connection", b"close")]
    if isinstance(exc, RateLimitedError | ServiceUnavailableError):
        return [(b"retry-after", str(exc.retry_after).encode())]
    if isinstance(exc, AuthenticationError):
        return [(b"www-authenticate", b'Bearer realm="copilotkit"')]
    return []


async def send_method_not_allowed(request: Request, allow: bytes) -> None:
    await send_json(request, 405, {"error": "Method not allowed"}, [(b"allow", allow)])


async def send_bytes(request: Request, status: int, body: bytes,
                     headers: Iterable[tuple[bytes, bytes]]) -> None:
    """The whole answer; a large one is refused (`ServiceUnavailableError`) before it starts
    while `LARGE_ANSWERS_BYTES` are being sent."""
    large = len(body) >= LARGE_ANSWER
    if large and not _LargeAnswers.take(len(body)):
        raise ServiceUnavailableError(_TOO_MANY_LARGE)
    headers = list(headers)
    # A caller's own Cache-Control (a probe's) is kept, not doubled.
    private = _NOSNIFF if any(name == b"cache-control" for name, _ in headers) else _PRIVATE
    try:
        request.status = status
        await request.send({
            "type": "http.response.start", "status": status,
            "headers": [*headers, *private, (b"content-length", str(len(body)).encode()),
                        *request.answer_headers],
        })
        await _send_body(request, body, more_body=False)
    finally:
        if large:
            _LargeAnswers.give(len(body))


def encode_sse(batch: Sequence[Event], first: int | None = None) -> bytes:
    """A batch of events as SSE frames, `data: <json>\\n\\n` each, in one buffer; with
    `first`, each frame carries its position in the thread as `id:` (first, first + 1, ...)."""
    dumps = orjson.dumps
    if first is None:
        if len(batch) == 1:
            return b"data: " + dumps(batch[0]) + b"\n\n"
        return b"data: " + b"\n\ndata: ".join([dumps(e) for e in batch]) + b"\n\n"
    if len(batch) == 1:
        return b"id: %d\ndata: %b\n\n" % (first, dumps(batch[0]))
    # (positions and encodings paired by zip in C: no index arithmetic per event)
    return b"".join([b"id: %d\ndata: %b\n\n" % pair
                     for pair in zip(range(first, first + len(batch)), map(dumps, batch),
                                     strict=True)])


def encode_positioned(items: Sequence[Positioned]) -> bytes:
    """Events with their positions as SSE frames; an event without one has no `id:`."""
    dumps = orjson.dumps
    return b"".join([b"data: %b\n\n" % dumps(e) if p is None
                     else b"id: %d\ndata: %b\n\n" % (p, dumps(e)) for p, e in items])


async def _start_sse(request: Request) -> None:
    request.status = 200
    await request.send({"type": "http.response.start", "status": 200,
                        "headers": [*_SSE_HEADERS, *request.answer_headers]})


async def _end(request: Request) -> None:
    await request.send({"type": "http.response.body", "body": b"", "more_body": False})


class _Stream:
    """The state a response stream shares with its watcher task."""

    __slots__ = ("ended", "last_write", "sending")

    def __init__(self) -> None:
        self.ended = False
        self.last_write = 0.0
        #: A write is waiting on the client (since `last_write`).
        self.sending = False


_SSE_KEEPALIVE = b": keep-alive\n\n"


def _sse_keepalive() -> bytes:
    return _SSE_KEEPALIVE


async def _client_leaves(request: Request) -> None:
    """Return once the client of `request` (its body read) has left."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def leaving_seen(request: Request) -> contextlib.AbstractContextManager[None]:
    """Around `start_run`: a run that waits for a stopped one to give its thread back sees
    `request`'s client leave (and starts nothing for nobody). Its body must be read."""
    return client_watched(lambda: _client_leaves(request))


def _give_up(request: Request, on_disconnect: Callable[[], object]) -> None:
    """The client reads nothing: gone. Its connection is aborted if the server can (its
    buffers freed at once, the stuck write returns), then the stream stops as on a
    disconnect."""
    abort = request.scope.get("extensions", {}).get(ABORT_EXTENSION)
    if callable(abort):
        abort()
    on_disconnect()


async def _watch(request: Request, on_disconnect: Callable[[], object], stream: _Stream,
                 keepalive: float | None,
                 heartbeat: Callable[[], bytes] = _sse_keepalive) -> None:
    """Wait for the client to leave, or to stop reading (a write waiting on it for
    `SEND_IDLE_SECONDS`: gone as well); meanwhile, after `keepalive` seconds without a
    write, send `heartbeat()` (an SSE comment unless told otherwise; nothing when it gives
    no bytes) so proxies do not close a connection that is only waiting."""
    loop = asyncio.get_running_loop()
    # Awake at least every `SEND_IDLE_SECONDS`: a write stuck since just after a check is
    # noticed within twice that.
    every = min(keepalive, SEND_IDLE_SECONDS) if keepalive else SEND_IDLE_SECONDS
    delay = every
    while True:
        try:
            async with asyncio.timeout(delay):
                message = await request.receive()
        except TimeoutError:
            delay = every
            silent = loop.time() - stream.last_write
            if stream.sending:
                if silent >= SEND_IDLE_SECONDS:
                    _give_up(request, on_disconnect)
                    return
                delay = min(delay, SEND_IDLE_SECONDS - silent)
            elif keepalive and not stream.ended and silent >= keepalive * 0.9:
                body = heartbeat()
                if not body:
                    continue
                stream.last_write = loop.time()
                try:
                    async with asyncio.timeout(SEND_IDLE_SECONDS):
                        await request.send({"type": "http.response.body", "body": body,
                                            "more_body": True})
                except TimeoutError:
                    _give_up(request, on_disconnect)
                    return
                except OSError:  # the server says the client is gone (see `stream_run`)
                    on_disconnect()
                    return
            continue
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


async def stream_run(request: Request, run: ActiveRun,
                     encode: Callable[[Sequence[Event]], bytes] = encode_sse,
                     headers: Headers = _SSE_HEADERS, *,
                     keepalive: float | None = None,
                     heartbeat: Callable[[], bytes] = _sse_keepalive,
                     outlives_client: bool = False) -> None:
    """Drive `run`, writing each batch as one chunk; a disconnect cancels the run, or with
    `outlives_client` detaches it (`ActiveRun.detach`): it goes on, its writes dropped.
    AG-UI's runs outlive their client (a reload picks them up with `connect`); GraphQL's do
    not: the 1.10 client's stop button aborts its request, so there a disconnect is a stop.

    `encode` may return no bytes for a batch (a protocol that writes only at the end):
    nothing is sent then. The batch that ends the run also ends the body, in one write.
    `keepalive`: after that many seconds of silence, `heartbeat()` is sent (an SSE comment
    by default; a protocol with another framing gives its own, or no bytes to skip one).
    """
    send = request.send
    request.status = 200
    await request.send({"type": "http.response.start", "status": 200,
                        "headers": [*headers, *request.answer_headers]})
    stream = _Stream()
    loop = asyncio.get_running_loop()

    with_ids = encode is encode_sse
    # A protocol's own encoder (GraphQL's) keeps what it was fed: once it failed part-way
    # through a batch, it is fed that batch no more (what it took would come twice) and
    # nothing after its error. `skip` says either that or `gone` (the client left a run
    # that goes on): one test per batch, as before, for both.
    skip = failed = gone = False
    #: The driving task was cancelled to free it from a write to a gone client.
    freeing = False
    task = asyncio.current_task()

    def client_gone() -> None:
        nonlocal skip, gone, freeing
        if not outlives_client or run.manager.detached_run_seconds == 0:
            run.cancel("disconnect")
            return
        skip = gone = True
        run.detach()
        if stream.sending and task is not None:
            # A write waits on a client that reads nothing (a server without the abort
            # extension): it would hold the run, or its end, for ever.
            freeing = True
            task.cancel()

    async def write(batch: Sequence[Event]) -> None:
        nonlocal failed, skip, freeing
        if skip:
            if gone:
                return
            body = b""
        else:
            try:
                body = encode_sse(batch, run.batch_position(batch)) if with_ids \
                    else encode(batch)
            except (orjson.JSONEncodeError, TypeError):
                if with_ids:
                    # An agent produced what JSON cannot carry: send the rest (SSE frames
                    # are encoded afresh), not a broken stream.
                    safe = replayable(batch)
                    body = encode(safe) if safe else b""
                else:
                    skip = failed = True
                    body = _unencodable_end(encode)
        last = run.terminated
        if body or last:
            stream.ended = last
            stream.last_write = loop.time()
            stream.sending = True
            try:
                await send({"type": "http.response.body", "body": body, "more_body": not last})
            except OSError:
                # The ASGI server says the client is gone (the spec lets `send` raise an
                # OSError then; uvicorn returns instead): a disconnect, so the run is stored
                # with its end (this exception through `drive` left it without one), or
                # goes on without it.
                stream.sending = False
                client_gone()
                return
            except asyncio.CancelledError:
                if not freeing or task is None:
                    raise
                freeing = False
                task.uncancel()
                if run.cancel_reason is not None:
                    raise  # stopped meanwhile: `drive` ends it
                return
            finally:
                stream.sending = False

    stream.last_write = loop.time()
    watcher = asyncio.create_task(_watch(request, client_gone, stream, keepalive, heartbeat))
    try:
        await run.drive(write)
    finally:
        watcher.cancel()
    # A run cut because its client left, or reads nothing, has no one to end the body for:
    # a last write to a client that reads nothing would wait for ever.
    if not stream.ended and not gone and run.cancel_reason != "disconnect":
        stream.ended = True
        await _end(request)


def _unencodable_end(encode: Callable[[Sequence[Event]], bytes]) -> bytes:
    """What ends a response whose encoder failed on a batch: its encoding of the run's
    error, or nothing when it cannot say even that."""
    _log.error("an agent's events could not be encoded for the response: it ends failed",
               exc_info=True)
    try:
        return encode([ev.run_error("The agent's output could not be encoded for this "
                                    "response (not JSON)", code=ev.AGENT_ERROR_CODE)])
    except Exception:  # (its state is the failed batch's: the body is ended as it is)
        return b""


async def stream_events(request: Request, batches: AsyncIterator[Sequence[Positioned]],
                        *, keepalive: float | None = None) -> None:
    """Write an async iterator of batches of positioned events as SSE (the position as each
    frame's `id:`); stop reading when the client leaves. `keepalive`: a comment after that
    many seconds of silence (a followed run may be quiet for long: a tool at work)."""
    # The first batch (the thread as stored, maybe nothing) is read before the response
    # starts: a store or coordinator that cannot be reached is then a 503 (its RequestError
    # reaches the caller), not a 200 whose body is cut.
    try:
        head: Sequence[Positioned] | None = await anext(batches)
    except StopAsyncIteration:
        head = None
    # The first batch (a whole thread, maybe) is encoded first: too large to send now, it
    # is a 503 too.
    first = _encoded(head) if head else b""
    held = len(first) if len(first) >= LARGE_ANSWER else 0
    if held and not _LargeAnswers.take(held):
        raise ServiceUnavailableError(_TOO_MANY_LARGE)
    task = asyncio.current_task()
    left = False
    stream = _Stream()
    loop = asyncio.get_running_loop()

    def on_disconnect() -> None:
        nonlocal left
        left = True
        if task is not None:
            task.cancel()

    async def write(body: bytes) -> None:
        nonlocal left, held
        if not body:
            return
        if len(body) >= LARGE_ANSWER and not held:
            if not await _LargeAnswers.wait_for_room(len(body)):
                raise _NoRoom  # the stream ends here: the client resumes (`Last-Event-ID`)
            held = len(body)
        stream.last_write = loop.time()
        stream.sending = True
        try:
            await _send_body(request, body, more_body=True)
        except OSError:  # the client is gone (see `stream_run`): as if it said so
            left = True
            raise asyncio.CancelledError from None
        finally:
            if held:
                _LargeAnswers.give(held)
                held = 0
        stream.sending = False

    watcher: asyncio.Task[None] | None = None
    try:
        await _start_sse(request)
        stream.last_write = loop.time()
        watcher = asyncio.create_task(_watch(request, on_disconnect, stream, keepalive))
        await write(first)
        del first
        if head is not None:
            async for batch in batches:
                if batch:
                    await write(_encoded(batch))
    except _NoRoom:
        pass
    except asyncio.CancelledError:
        if not left or task is None:
            raise
        if task.cancelling():
            task.uncancel()
        return
    finally:
        if held:  # (the first batch's, never written)
            _LargeAnswers.give(held)
        stream.ended = True
        if watcher is not None:
            watcher.cancel()
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()
    await _end(request)


def _encoded(batch: Sequence[Positioned]) -> bytes:
    """A batch as SSE frames with their positions; what cannot be encoded is left out."""
    try:
        return encode_positioned(batch)
    except (orjson.JSONEncodeError, TypeError):
        safe = replayable([e for _, e in batch])
        return encode_sse(safe) if safe else b""


#: Longer than any cursor the routes make (ids of up to `MAX_ID_LENGTH` characters, up to
#: four bytes each, in base64).
_MAX_CURSOR = 4096
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")


def to_cursor(value: Any) -> str:
    """`value` (JSON) as a listing's `nextCursor`: URL-safe base64, no padding."""
    return base64.urlsafe_b64encode(orjson.dumps(value)).rstrip(b"=").decode()


def from_cursor(text: str, refusal: str) -> Any:
    """The value `to_cursor` made `text` of; `InvalidRequestError(refusal)` for anything
    it could not have made (the caller checks the value's shape)."""
    if len(text) > _MAX_CURSOR or not _BASE64URL.fullmatch(text):
        raise InvalidRequestError(refusal)
    try:
        return orjson.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (ValueError, orjson.JSONDecodeError):
        raise InvalidRequestError(refusal) from None
