"""`CopilotRuntime`: the agents, actions and threads that every wire protocol serves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from copilot_runtime._exceptions import AgentNotFoundError, ConfigurationError
from copilot_runtime._input import RunInput
from copilot_runtime._runs import ActiveRun, RunManager
from copilot_runtime.actions import Action
from copilot_runtime.adapters.base import ServiceAdapter
from copilot_runtime.adapters.empty import EmptyAdapter
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.agents.builtin import BuiltInAgent
from copilot_runtime.events import Event
from copilot_runtime.threads.base import ThreadStore
from copilot_runtime.threads.memory import InMemoryThreadStore

__all__ = ["CopilotRuntime"]

#: The CopilotKit runtime version whose protocol this runtime speaks; `/info` reports it.
COMPATIBLE_VERSION = "1.75.0"


class CopilotRuntime:
    """The protocol-neutral runtime.

    `agents` maps agent ids to agents. With `service_adapter`, a `BuiltInAgent` over it
    serves as the `default` agent (unless `agents` names one `default` already) with the
    server-side `actions`.
    """

    def __init__(
        self,
        *,
        agents: Mapping[str, Agent] | None = None,
        actions: Iterable[Action] = (),
        service_adapter: ServiceAdapter | None = None,
        thread_store: ThreadStore | None = None,
        instructions: str | None = None,
        max_steps: int = 10,
    ) -> None:
        self.agents: dict[str, Agent] = dict(agents or {})
        self.actions = list(actions)
        self.service_adapter = service_adapter
        for agent_id, agent in self.agents.items():
            if not agent_id or "/" in agent_id:
                raise ConfigurationError(f"Invalid agent id {agent_id!r}")
            if not isinstance(agent, Agent):
                raise ConfigurationError(f"Agent {agent_id!r} is not an Agent")
        if isinstance(service_adapter, EmptyAdapter):
            if self.actions:
                raise ConfigurationError("actions need a model; EmptyAdapter has none")
        elif service_adapter is not None and "default" not in self.agents:
            self.agents["default"] = BuiltInAgent(
                service_adapter, actions=self.actions, instructions=instructions,
                max_steps=max_steps)
        elif self.actions and service_adapter is None:
            raise ConfigurationError("actions need a service_adapter for the default agent")
        self.store: ThreadStore = thread_store or InMemoryThreadStore()
        self.runs = RunManager(self.store)

    def agent(self, agent_id: str) -> Agent:
        try:
            return self.agents[agent_id]
        except KeyError:
            raise AgentNotFoundError(agent_id, sorted(self.agents)) from None

    def info(self) -> dict[str, Any]:
        """What `/info` says about the agents."""
        agents: dict[str, Any] = {}
        for agent_id, agent in self.agents.items():
            entry: dict[str, Any] = {"name": agent_id, "description": agent.description,
                                     "className": agent.class_name}
            capabilities = agent.capabilities()
            if capabilities:
                entry["capabilities"] = capabilities
            agents[agent_id] = entry
        return {"version": COMPATIBLE_VERSION, "agents": agents}

    async def start_run(self, agent_id: str, input: RunInput,
                        headers: Mapping[str, str] | None = None, *,
                        follow_up_server_tools: bool = True,
                        agent: Agent | None = None) -> ActiveRun:
        """Reserve the thread and prepare a run; drive it with `ActiveRun.drive`.

        `agent` runs in place of the registered one (a protocol edge may wrap it, e.g. to
        offer it tools); the run still belongs to `agent_id`.
        """
        registered = self.agent(agent_id)
        context = RunContext(agent_id=agent_id, headers=dict(headers or {}),
                             follow_up_server_tools=follow_up_server_tools)
        return await self.runs.begin(agent_id, agent or registered, input, context)

    def stop_run(self, agent_id: str, thread_id: str, run_id: str | None = None) -> bool:
        self.agent(agent_id)
        return self.runs.stop(thread_id, run_id)

    def connect(self, agent_id: str, thread_id: str) -> AsyncIterator[Sequence[Event]]:
        self.agent(agent_id)
        return self.runs.replay(thread_id)

    async def aclose(self) -> None:
        """Stop active runs and release agents, adapters and the store."""
        for run in list(self.runs.active.values()):
            run.cancel("stop")
        closed: set[int] = set()
        for agent in self.agents.values():
            if id(agent) not in closed:
                closed.add(id(agent))
                await agent.aclose()
        await self.store.aclose()
