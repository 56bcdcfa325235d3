"""A built-in agent that, for one run, is also offered the tools of MCP servers the request
named and the application allowed (`CopilotRuntime(mcp_allowed_urls=...)`).

The servers are connected when the run starts and closed when it ends; a server whose tool
list changes during the run offers the new list from the run's next step. A request can
never make the runtime connect to an address outside the application's list: the GraphQL
edge refuses such a request before anything is connected or streamed.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from copilot_runtime._input import RunInput
from copilot_runtime.actions import Action
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.agents.builtin import BuiltInAgent
from copilot_runtime.events import Event, EventBatches

if TYPE_CHECKING:
    from copilot_runtime.mcp_tools import MCPServer

__all__ = ["RequestMCPAgent"]


class RequestMCPAgent(Agent):
    def __init__(self, inner: BuiltInAgent, servers: Sequence[MCPServer]) -> None:
        super().__init__(description=inner.description)
        self.class_name = inner.class_name
        self.inner = inner
        self.servers = list(servers)

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input, context)

    async def _run(self, input: RunInput, context: RunContext
                   ) -> AsyncIterator[Sequence[Event]]:
        from copilot_runtime.mcp_tools import MCPToolset

        toolset = MCPToolset(self.servers)
        await toolset.start()
        try:
            agent: Any = copy.copy(self.inner)

            def offer(tools: list[Action]) -> None:
                # The application's own actions keep their names.
                agent.actions = {**{a.name: a for a in tools}, **self.inner.actions}

            offer(toolset.actions)
            toolset.on_change.append(offer)  # a server's changed tools, from the next step
            async for batch in agent.run(input, context):
                yield batch
        finally:
            await toolset.aclose()
