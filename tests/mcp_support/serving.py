"""MCP servers on loopback that a test can stop as a crash would, and start again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn

from tests.conftest import free_port


@contextlib.asynccontextmanager
async def killable(app: Any, port: int | None = None
                   ) -> AsyncIterator[tuple[str, Callable[[], Awaitable[None]]]]:
    """`app` on loopback (on `port`, else a free one), and a function that stops it at once,
    open streams and all."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port or free_port(),
                                           log_level="critical", lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
        if task.done():
            task.result()

    async def kill() -> None:
        server.should_exit = True  # seen on uvicorn's next tick: stop accepting before
        for listener in server.servers:
            listener.close()
        while not task.done():  # (and abort what a client opened meanwhile)
            for connection in list(server.server_state.connections):
                connection.transport.abort()  # as a crash would: no goodbye on open streams
            await asyncio.wait([task], timeout=0.01)
        await task

    try:
        yield f"http://127.0.0.1:{server.config.port}", kill
    finally:
        if not task.done():
            await kill()
