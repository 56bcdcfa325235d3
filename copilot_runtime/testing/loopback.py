"""`LoopbackServer`: the base of the test servers, an aiohttp app on a free loopback port.

Subclasses add their routes in `routes`; `pause` sleeps inside a streaming handler but
returns early when the client has gone, so a server notices a cancelled request.
"""

from __future__ import annotations

import asyncio
from typing import Self

from aiohttp import web

__all__ = ["LoopbackServer", "pause"]


class LoopbackServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        """Add the server's routes to `app`."""
        raise NotImplementedError

    def app(self) -> web.Application:
        app = web.Application()
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
