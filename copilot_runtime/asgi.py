"""The runtime as an ASGI application: one base URL, every protocol.

`CopilotEndpoint` routes by path and, on the base path, by body: JSON with `method` is the
AG-UI single-route envelope, JSON with `query` (or a GET with `?query=`) is GraphQL. It
answers CORS, enforces the body limit, and never lets an exception's internals reach a
client. `health` and `ready` under the base path answer a load balancer's probes, before
authentication, hooks and telemetry. `create_app` makes a standalone app; `mount_runtime`
adds the endpoint to an existing FastAPI or Starlette app.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from copilot_runtime._exceptions import (
    ClientDisconnected,
    InvalidRequestError,
    JSONTooDeepError,
    PayloadTooLargeError,
    RequestError,
    RequestTimeoutError,
    UnsupportedEncodingError,
    library_base_exception,
)
from copilot_runtime._input import parse_json_body_off_loop
from copilot_runtime.hooks import ErrorInfo
from copilot_runtime.protocols.agui.handlers import AGUIProtocol
from copilot_runtime.protocols.http import (
    CORSPolicy,
    Receive,
    Request,
    Scope,
    Send,
    error_body,
    error_headers,
    read_body,
    request_info,
    send_bytes,
    send_error,
    send_json,
    send_method_not_allowed,
    tell_request_id,
)
from copilot_runtime.runtime import CopilotRuntime

if TYPE_CHECKING:
    from starlette.routing import Route

    from copilot_runtime.protocols.graphql import GraphQLProtocol

__all__ = ["CopilotEndpoint", "create_app", "mount_runtime"]

_log = structlog.get_logger("copilot_runtime.asgi")
DEFAULT_MAX_BODY_SIZE = 8 * 1024 * 1024


class CopilotEndpoint:
    """An ASGI app serving `runtime` under `path`."""

    def __init__(
        self,
        runtime: CopilotRuntime,
        path: str = "/copilotkit",
        *,
        max_body_size: int = DEFAULT_MAX_BODY_SIZE,
        cors: CORSPolicy | None = None,
        keepalive: float | None = 15.0,
    ) -> None:
        self.runtime = runtime
        self.path = "/" + path.strip("/") if path.strip("/") else ""
        self.max_body_size = max_body_size
        self.cors = cors or CORSPolicy()
        self.agui = AGUIProtocol(runtime, max_body_size=max_body_size, keepalive=keepalive)
        self.keepalive = keepalive
        self._graphql: GraphQLProtocol | None = None
        self._probes = {self.path + "/health": False, self.path + "/ready": True}

    @property
    def graphql(self) -> GraphQLProtocol:
        """The GraphQL protocol, imported and built on first use: a deployment whose clients
        all speak AG-UI never loads graphql-core (several MB of an idle worker)."""
        if self._graphql is None:
            from copilot_runtime.protocols.graphql import GraphQLProtocol

            self._graphql = GraphQLProtocol(self.runtime, keepalive=self.keepalive)
        return self._graphql

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._handle_lifespan(receive, send)
            return
        if kind != "http":
            return
        path = _routing_path(scope)
        root: str = scope.get("root_path", "").rstrip("/")
        if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
            # (a whole segment only: root_path /copilot is no prefix of /copilotkit/info)
            path = path[len(root):]
        request = Request(scope, receive, send, path, [])
        readiness = self._probes.get(path.rstrip("/") or "/")
        if readiness is not None:
            if self.runtime.wants_request_info:  # told as on every other answer, unidentified
                tell_request_id(request)
            await self._probe(request, readiness)
            return
        if not self.runtime.started:
            # Served without our lifespan (a host app that does not run it, or a test
            # client): what runs beside the requests starts with the first one.
            await self.runtime.start()
        request.answer_headers = self.cors.headers(request.headers)
        if not self.runtime.wants_request_info:
            await self._answered(request, path, identify=False)
        elif request.method != "OPTIONS":
            await self._identified(request, path)
        else:  # a preflight carries no credentials: told its id, never identified
            with structlog.contextvars.bound_contextvars(request_id=tell_request_id(request)):
                await self._answered(request, path, identify=False)

    async def _probe(self, request: Request, readiness: bool) -> None:
        """`health`: 200 while the process serves. `ready`: 200, or 503 naming what cannot
        serve now (`CopilotRuntime.unready`), so that a balancer sends requests elsewhere
        while this worker's store or coordinator is away, or while it closes. Neither needs
        credentials, nor says more than that."""
        if request.method not in ("GET", "HEAD"):
            await send_method_not_allowed(request, b"GET, HEAD")
            return
        if not readiness:
            await send_json(request, 200, {"status": "ok"})
            return
        unready: list[str] = []
        if not self.runtime.started:
            try:
                await self.runtime.start()
            except Exception:  # its log says why; the probe only that it cannot serve
                unready = ["starting"]
        if not unready:
            unready = await self.runtime.unready()
        if unready:
            await send_json(request, 503, {"status": "unavailable", "unavailable": unready},
                            [(b"retry-after", b"1"), (b"cache-control", b"no-store")])
        else:
            await send_json(request, 200, {"status": "ready"}, [(b"cache-control", b"no-store")])

    async def _identified(self, request: Request, path: str) -> None:
        """Dispatch once the runtime knows who asks (a 401 or a hook's refusal otherwise)."""
        info = request.info = request_info(request)
        telemetry = self.runtime.telemetry
        with structlog.contextvars.bound_contextvars(request_id=info.request_id):
            if telemetry is None:
                await self._answered(request, path, identify=True)
                return
            with telemetry.request_span(info, lambda: request.status) as span:
                await self._answered(request, path, identify=True, span=span)

    async def _answered(self, request: Request, path: str, *, identify: bool,
                        span: Any = None) -> None:
        """Dispatch (once identified, with `identify`). An unexpected failure (a library's own
        BaseException too: gevent's `Timeout`) is logged with its stack and answered 500
        here, inside the request's log context and its `span` (which records the exception
        and then reads the 500)."""
        try:
            if not identify or await self._identify(request):
                await self._dispatch(request, path)
        except BaseException as exc:
            if not isinstance(exc, Exception) and not library_base_exception(exc):
                raise  # Python unwinding (a cancellation, a shutdown): not a failure here
            telemetry = self.runtime.telemetry
            if span is not None and telemetry is not None:
                telemetry.span_failed(span, exc)
            # Logged with its stack; the client learns only that the server failed.
            _log.exception("unhandled error", path=path, method=request.method)
            if request.info is not None:
                self.runtime.hooks.error(ErrorInfo(
                    "The runtime failed to handle the request", "INTERNAL_ERROR",
                    principal=request.info.principal, request_id=request.info.request_id))
            message = "The runtime failed to handle the request"
            with contextlib.suppress(Exception):
                if _speaks_graphql(request):
                    await self.graphql.refuse(request, 500, message, "UNKNOWN")
                else:
                    await send_json(request, 500, {"error": "internal_error", "message": message})

    async def _identify(self, request: Request) -> bool:
        assert request.info is not None
        try:
            await self.runtime.identify(request.info)
        except RequestError as exc:
            if _speaks_graphql(request):
                await self.graphql.refuse(request, exc.status, exc.message, exc.code,
                                          error_headers(exc))
            else:
                await send_json(request, exc.status, error_body(exc), error_headers(exc))
            return False
        return True

    async def _dispatch(self, request: Request, path: str) -> None:
        base = self.path
        if base and not (path == base or path.startswith(base + "/")):
            await send_json(request, 404, {"error": "Not found"})
            return
        relative = path[len(base):].strip("/")
        if request.method == "OPTIONS":
            # `answer_headers` holds the CORS headers already (and the request id).
            allowed = self.cors.headers(request.headers)
            await send_bytes(request, 204, b"", self.cors.preflight_extra(allowed,
                                                                          request.headers))
            return
        if not relative:
            await self._base(request)
            return
        segments = relative.split("/")
        if not await self.agui.handle(request, segments):
            await send_json(request, 404, {"error": "Not found"})

    async def _base(self, request: Request) -> None:
        """POST to the base path: the body says which protocol it speaks."""
        query = request.query
        # (HEAD as GET, as every GET route here: the server sends no body)
        if request.method in ("GET", "HEAD") and (query.startswith(b"query=")
                                                  or b"&query=" in query):
            await self.graphql.get(request)
            return
        # The 1.10 client reads errors in the GraphQL form only, whatever it sent.
        graphql = _speaks_graphql(request)
        if request.method != "POST":
            if graphql:
                await self.graphql.not_served(
                    request, 405, "GraphQL is served with POST, or GET with ?query=")
            else:
                await send_method_not_allowed(request, b"POST")
            return
        if not request.is_json():
            if graphql:
                await self.graphql.not_served(
                    request, 415, 'GraphQL requests are JSON (application/json): {"query": ...}')
            else:
                await send_json(request, 415, {
                    "error": "invalid_request",
                    "message": "Single-route endpoint expects JSON payloads"})
            return
        try:
            body = await read_body(request, self.max_body_size)
            data = await parse_json_body_off_loop(body)
        except PayloadTooLargeError as exc:
            if graphql:
                await self.graphql.refuse(request, 413, exc.message, exc.code)
            else:
                await send_json(request, 413, {"error": "Payload too large",
                                               "message": exc.message, "code": exc.code})
            return
        except InvalidRequestError as exc:
            too_deep = isinstance(exc, JSONTooDeepError)
            if _speaks_graphql(request):  # its error form
                await self.graphql.invalid_json(request, exc.message if too_deep else None)
                return
            # The TypeScript runtime's answer to JSON it cannot parse; the depth bound is
            # ours, and carries its code, as the README's limits table says.
            await send_json(request, 400, {
                "error": "invalid_request", "message": exc.message, "code": exc.code}
                if too_deep else {"error": "invalid_request", "message": "Invalid JSON payload"})
            return
        except (RequestTimeoutError, UnsupportedEncodingError) as exc:
            if graphql:
                await self.graphql.refuse(request, exc.status, exc.message, exc.code,
                                          error_headers(exc))
            else:
                await send_error(request, exc)
            return
        except ClientDisconnected:
            return
        if isinstance(data, dict) and "query" in data and "method" not in data:
            await self.graphql.post(request, data)
            return
        if graphql and not (isinstance(data, dict) and "method" in data):
            await self.graphql.not_one_operation(request, data)  # a batch, a persisted hash
            return
        await self.agui.envelope(request, data)

    async def _handle_lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            try:
                message = await receive()
            except asyncio.CancelledError:
                # The server left without a shutdown message (a second ^C forces its exit,
                # then its loop cancels what is left): not the app's error, which uvicorn
                # logged with a stack. The runs' ends went out at the first ^C, and the
                # next start closes whatever was left open.
                return
            if message["type"] == "lifespan.startup":
                # Approvals that expired while the server was down are timed out, and answers
                # a crash cut off are sent again, without waiting for a first request.
                try:
                    await self.runtime.start()
                except Exception as exc:  # an unreachable coordinator, say: one line, no stack
                    with contextlib.suppress(Exception):
                        await self.runtime.aclose()  # what had started
                    reason = " ".join(str(exc).split())  # psycopg's take several lines
                    await send({"type": "lifespan.startup.failed",
                                "message": f"copilot-runtime: error: cannot start: "
                                           f"{type(exc).__name__}: {reason}"})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.runtime.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


_KEEP_ENCODED = re.compile(r"(%2[fF]|%25)")


def _routing_path(scope: Scope) -> str:
    """The path to route on, decoded once except for `%2F` and `%25`.

    The server's `path` is percent-decoded already, and the routes unquote each segment
    (a thread id may hold `/`): decoding twice made `threads/a%2541` name thread `aA`
    (reading, renaming or deleting the wrong thread) and left an id with `/` unreachable.
    From `raw_path`, an encoded `/` stays inside its segment and an encoded `%` is decoded
    once, by the route. Without a `raw_path` that matches `path` (it is optional in ASGI, and
    something in front of this app may rewrite `path`), `path` is used with its `%` encoded
    again, so the route's unquote gives it back as it is (an id holding `/` is then out of
    reach).
    """
    path = str(scope["path"])
    raw = scope.get("raw_path")
    if not raw or b"%" not in raw:
        return path.replace("%", "%25") if "%" in path else path
    text = raw.split(b"?", 1)[0].decode("utf-8", "replace")
    if urllib.parse.unquote(text) != path:
        return path.replace("%", "%25")
    return "".join(part.upper() if _KEEP_ENCODED.fullmatch(part) else urllib.parse.unquote(part)
                   for part in _KEEP_ENCODED.split(text))


def create_app(
    runtime: CopilotRuntime,
    path: str = "/copilotkit",
    *,
    max_body_size: int = DEFAULT_MAX_BODY_SIZE,
    cors: CORSPolicy | None = None,
    keepalive: float | None = 15.0,
) -> CopilotEndpoint:
    """A standalone ASGI app serving `runtime` under `path` (run it with any ASGI server).

    `keepalive`: seconds of silence after which an SSE stream gets a `: keep-alive` comment
    and a GraphQL response an empty multipart part (None: never).
    """
    return CopilotEndpoint(runtime, path, max_body_size=max_body_size, cors=cors,
                           keepalive=keepalive)


def mount_runtime(
    app: Any,
    runtime: CopilotRuntime,
    path: str = "/copilotkit",
    *,
    max_body_size: int = DEFAULT_MAX_BODY_SIZE,
    cors: CORSPolicy | None = None,
) -> CopilotEndpoint:
    """Serve `runtime` under `path` inside an existing FastAPI or Starlette app.

    The runtime starts and closes with the host app: its lifespan is wrapped, so the
    runtime starts after the host's own start-up and is closed (`runtime.aclose()`)
    before the host's own shutdown.
    """
    from starlette.routing import Route  # the host app is Starlette: loaded already

    endpoint = CopilotEndpoint(runtime, path, max_body_size=max_body_size, cors=cors)
    base = endpoint.path or "/"
    routes: Sequence[Route] = [
        Route(base, endpoint=endpoint, methods=None),
        Route(base.rstrip("/") + "/{rest:path}", endpoint=endpoint, methods=None),
    ]
    app.router.routes.extend(routes)
    host_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(host: Any) -> AsyncIterator[Any]:
        async with host_lifespan(host) as state:
            await runtime.start()
            try:
                yield state
            finally:
                await runtime.aclose()

    app.router.lifespan_context = lifespan
    return endpoint


def _speaks_graphql(request: Request) -> bool:
    """Whether the client is CopilotKit's GraphQL client (1.10), which reads errors in the
    GraphQL form only, and only with the statuses `GraphQLProtocol.refuse` gives them."""
    return b"x-copilotkit-runtime-client-gql-version" in request.headers

