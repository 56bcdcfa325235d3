"""Real MCP servers built with the SDK, for the MCP tests: `weather` (streamable HTTP or
stdio) and `clock`, which also publishes `add` (a name clash with `weather`'s)."""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError


def weather_server() -> MCPServer:
    server = MCPServer("weather")

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


def clock_server() -> MCPServer:
    server = MCPServer("clock")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two numbers, the clock's way."""
        return a + b + 1000

    return server


if __name__ == "__main__":
    (clock_server() if "clock" in sys.argv[1:] else weather_server()).run("stdio")
