"""Real MCP servers built with the SDK, for the MCP tests: `weather` (streamable HTTP or
stdio); `getweather`, the real-client apps' `getWeather` action as an MCP tool; `clock`, which
also publishes `add` (a name clash with `weather`'s); and `changing`, whose `swap` tool
replaces its `old` tool by a `new` one and says so, and whose `vanish` tool ends its
process; `named`, whose tools have the names a test gives and answer with them."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError


def weather_server(*, quiet: bool = False) -> MCPServer:
    server = MCPServer("weather", subscriptions=False if quiet else None)

    @server.tool()
    def forecast(city: str, days: int = 1) -> dict[str, object]:
        """The forecast for a city."""
        return {"city": city, "days": days, "sky": "clear"}

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    @server.tool()
    def explode(reason: str) -> str:
        """Always fails."""
        raise ToolError(f"exploded: {reason}")

    return server


def get_weather_server() -> MCPServer:
    """`getWeather` as the real-client tests' apps define it, served over MCP instead."""
    server = MCPServer("getweather")

    @server.tool()
    def getWeather(city: str) -> dict[str, object]:  # the name the clients see
        """Get the current weather for a city."""
        return {"city": city, "temperature": 21, "unit": "celsius", "conditions": "sunny"}

    return server


def clock_server(*, quiet: bool = False) -> MCPServer:
    server = MCPServer("clock", subscriptions=False if quiet else None)

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two numbers, the clock's way."""
        return a + b + 1000

    return server


def changing_server() -> MCPServer:
    server = MCPServer("changing")

    @server.tool()
    def old() -> str:
        """A tool `swap` removes."""
        return "old"

    def new(word: str) -> str:
        """A tool `swap` adds."""
        return f"new: {word}"

    @server.tool()
    async def swap(ctx: Context) -> str:
        """Replace `old` by `new`, then tell the client the tool list changed."""
        server.remove_tool("old")
        server.add_tool(new)
        # A 2026-07-28 client hears it on its subscriptions/listen stream; an earlier
        # one on the session (each call is dropped where it does not apply).
        await ctx.notify_tools_changed()
        await ctx.request_context.session.send_tool_list_changed()
        return "swapped"

    @server.tool()
    def vanish() -> str:
        """Exit the server's process, as a crash would."""
        os._exit(3)

    return server


def process_server() -> MCPServer:
    server = MCPServer("process")

    @server.tool()
    def pid() -> int:
        """This server's process id."""
        return os.getpid()

    return server


def slow_server(started: list[str]) -> MCPServer:
    """`slow` notes each call in `started` (shared by the instances a test starts); the first
    never ends, a later one answers."""
    server = MCPServer("slow")

    @server.tool()
    async def slow(tag: str) -> str:
        """Never ends the first time."""
        started.append(tag)
        if len(started) == 1:
            await asyncio.Event().wait()
        return tag

    return server


def named_server(names: list[str]) -> MCPServer:
    """A tool of each of `names` (long ones, many of them), each answering with its name: a
    call shows which tool ran."""
    server = MCPServer("named")
    for name in names:
        server.add_tool(_answering(name), name=name, description=f"Answers {name}")
    return server


def _answering(name: str) -> Callable[[], str]:
    def which() -> str:
        return name

    return which


SERVERS = {"weather": weather_server, "clock": clock_server, "changing": changing_server,
           "getweather": get_weather_server, "process": process_server}

if __name__ == "__main__":
    if sys.argv[2:] and Path(sys.argv[2]).exists():
        sys.exit(1)  # down: the test's marker says so
    SERVERS[sys.argv[1] if sys.argv[1:] else "weather"]().run("stdio")
