"""`LoopbackServer`: the base of the test servers, an aiohttp app on a free loopback port.

Subclasses add their routes in `routes`; `pause` sleeps inside a streaming handler but
returns early when the client has gone, so a server notices a cancelled request. The mocked
providers share `Refused` (a request the provider would refuse), `stream` (how a mocked
answer is written: whole, paced or cut) and `serve_from_command_line`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Self

from aiohttp import web

__all__ = ["LoopbackServer", "Refused", "pause", "serve_from_command_line", "stream"]

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Refused(Exception):
    """A request the mocked provider refuses, with the status it answers."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class LoopbackServer:
    #: The largest request body it reads (aiohttp's default); a mocked provider sets its
    #: API's, so that what the real API takes is never refused by its mock (nor the reverse).
    max_body: int = 1024**2

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        """Add the server's routes to `app`."""
        raise NotImplementedError

    def too_large(self) -> web.Response:
        """The answer to a request body over `max_body`, as the mocked API gives it."""
        return web.Response(status=413, text="Request Entity Too Large")

    def app(self) -> web.Application:
        @web.middleware
        async def bounded(request: web.Request, handler: _Handler) -> web.StreamResponse:
            # From the declared length, before a byte is read; a body of no declared length
            # meets aiohttp's own bound (`client_max_size`) as it is read.
            length = request.content_length
            if length is not None and length > self.max_body:
                return self.too_large()
            return await handler(request)

        app = web.Application(client_max_size=self.max_body, middlewares=[bounded])
        self.routes(app)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def pause(request: web.Request, seconds: float) -> bool:
    """Sleep, but return False as soon as the client has closed the connection."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        transport = request.transport
        if transport is None or transport.is_closing():
            return False
        await asyncio.sleep(min(left, 0.01))
    return True


async def stream(request: web.Request, response: web.StreamResponse, frames: Sequence[bytes],
                 *, cut_after: int | None = None, delay: float = 0) -> bool:
    """Write `frames` to the prepared `response`: all at once, one every `delay` seconds, or
    only the first `cut_after` and then the connection cut without an end. False if the client
    left first."""
    try:
        if cut_after is not None:
            for frame in frames[:cut_after]:
                await response.write(frame)
            await asyncio.sleep(0.01)
            if request.transport is not None:
                request.transport.abort()
            return True
        if delay:
            for frame in frames:
                await response.write(frame)
                if not await pause(request, delay):
                    return False
        else:
            await response.write(b"".join(frames))
        await response.write_eof()
    except ConnectionResetError:
        return False
    return True


def serve_from_command_line(make: Callable[..., LoopbackServer], *, name: str, port: int,
                            description: str | None, argv: list[str] | None,
                            prog: str) -> None:
    """Serve the mock `make(host, port, chunks=, delay_ms=)` builds until interrupted;
    `prog` is the command its help names."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    parser.add_argument("--port", type=int, default=port, help="default: %(default)s")
    parser.add_argument("--chunks", type=int, default=10,
                        help="pieces an answer is streamed in (default: %(default)s)")
    parser.add_argument("--delay-ms", type=float, default=0,
                        help="milliseconds between pieces (default: %(default)s)")
    args = parser.parse_args(argv)
    server = make(args.host, args.port, chunks=args.chunks, delay_ms=args.delay_ms)
    server.record = False  # type: ignore[attr-defined]  # a long-running mock must not grow

    async def serve() -> None:
        await server.start()
        print(f"mock {name} listening on {getattr(server, 'base_url', server.port)}",
              flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
