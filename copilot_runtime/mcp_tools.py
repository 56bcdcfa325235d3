"""Tools published by MCP servers, as server-side actions of the built-in agent.

On the official `mcp` SDK (the `mcp` extra). `MCPToolset` connects to each server once (over
streamable HTTP, or stdio for a local command), lists its tools and turns each into an
`Action` whose handler calls the tool on that server; a tool error comes back to the model as
a tool error. Two servers publishing the same name are told apart by a prefix.

    toolset = MCPToolset([MCPServer(url="http://127.0.0.1:9000/mcp", headers={...}),
                          MCPServer.stdio("python", ["my_server.py"])])
    await toolset.start()
    runtime = CopilotRuntime(service_adapter=..., actions=[*my_actions, *toolset.actions])
    ...
    await toolset.aclose()   # in the same task as start(), as the SDK's sessions require

Servers are named by the application only: nothing here connects to an address a request
chose.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx2
from mcp.client.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from copilot_runtime._exceptions import ActionError, ConfigurationError, UpstreamError
from copilot_runtime.actions import Action

__all__ = ["MCPServer", "MCPToolset"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


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

    def __post_init__(self) -> None:
        if (self.url is None) == (self.command is None):
            raise ConfigurationError("An MCPServer needs either url= or a stdio command")

    @classmethod
    def stdio(cls, command: str, args: Sequence[str] = (), *,
              env: Mapping[str, str] | None = None, name: str | None = None) -> MCPServer:
        return cls(command=command, args=tuple(args), env=env, name=name)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.url is not None:
            return urlsplit(self.url).hostname or "mcp"
        return (self.command or "mcp").rsplit("/", 1)[-1]


class MCPToolset:
    """Connected MCP servers and their tools as `actions`."""

    def __init__(self, servers: Sequence[MCPServer]) -> None:
        self.servers = list(servers)
        self.actions: list[Action] = []
        self._stack: AsyncExitStack | None = None

    async def start(self) -> None:
        """Connect to every server and list its tools (once)."""
        if self._stack is not None:
            return
        stack = AsyncExitStack()
        listed: list[tuple[MCPServer, Client, Any]] = []
        try:
            for server in self.servers:
                client = await stack.enter_async_context(self._client(server, stack))
                try:
                    tools = (await client.list_tools()).tools
                except Exception as exc:
                    raise UpstreamError(f"MCP server {server.label} could not list its tools: "
                                        f"{type(exc).__name__}: {exc}") from None
                listed.extend((server, client, tool) for tool in tools)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        counts: dict[str, int] = {}
        for _, _, tool in listed:
            counts[tool.name] = counts.get(tool.name, 0) + 1
        self.actions = [
            _tool_action(client, tool, server if counts[tool.name] > 1 else None)
            for server, client, tool in listed]

    def _client(self, server: MCPServer, stack: AsyncExitStack) -> Client:
        if server.url is not None:
            http = httpx2.AsyncClient(headers=dict(server.headers),
                                      timeout=httpx2.Timeout(server.timeout))
            stack.push_async_callback(http.aclose)
            return Client(streamable_http_client(server.url, http_client=http),
                          read_timeout_seconds=server.timeout)
        assert server.command is not None
        return Client(StdioServerParameters(command=server.command, args=list(server.args),
                                            env=dict(server.env) if server.env else None),
                      read_timeout_seconds=server.timeout)

    async def aclose(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.aclose()


def _tool_action(client: Client, tool: Any, namespace: MCPServer | None) -> Action:
    name = _UNSAFE.sub("_", tool.name)
    if namespace is not None:
        name = f"{_UNSAFE.sub('_', namespace.label)}__{name}"
    remote = tool.name

    async def call(**arguments: Any) -> Any:
        try:
            result = await client.call_tool(remote, arguments)
        except Exception as exc:
            raise ActionError(f"the MCP tool {remote} failed: {type(exc).__name__}: {exc}"
                              ) from None
        text = "".join(getattr(block, "text", "") for block in result.content)
        if result.is_error:
            raise ActionError(text or f"the MCP tool {remote} reported an error")
        if result.structured_content is not None:
            return result.structured_content
        return text

    schema = tool.input_schema if isinstance(tool.input_schema, dict) else None
    return Action(name[:64], call, description=tool.description or "",
                  parameters=schema or {"type": "object", "properties": {}})
