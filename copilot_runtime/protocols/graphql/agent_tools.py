"""What the agent of an `agentSession` is offered, as the 1.x runtimes offered it.

Besides the frontend's actions, the agent of a session gets the runtime's server-side
actions and every other agent as tools, never itself (`copilot_runtime._server_tools`
answers those calls). The built-in agent that stands for the service adapter is neither
wrapped nor offered: it runs its own actions, and 1.10 had no such agent to offer. A
handed-over agent is offered the same, except that after `MAX_HANDOFFS` hand-overs in one
run no more agents are offered (two agents could otherwise hand the conversation back and
forth until the client gives up).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from copilot_runtime._exceptions import InvalidRequestError
from copilot_runtime._input import RunInput
from copilot_runtime._server_tools import ServerTools, ServerToolsAgent
from copilot_runtime.actions import Action
from copilot_runtime.agents.base import Agent
from copilot_runtime.agents.builtin import BuiltInAgent
from copilot_runtime.agents.mcp_request import RequestMCPAgent
from copilot_runtime.protocols.graphql.inputs import RunRequest, run_request
from copilot_runtime.protocols.graphql.queries import is_service_adapter
from copilot_runtime.runtime import CopilotRuntime

__all__ = ["MAX_HANDOFFS", "MAX_REQUEST_MCP_SERVERS", "answered_later", "server_actions",
           "session_run"]

MAX_HANDOFFS: Final = 2
#: The most MCP servers (endpoint and key) one request may name: each is a session opened
#: for its run (one allowed endpoint named 300 times was 300 sessions, each tool 300 times).
MAX_REQUEST_MCP_SERVERS: Final = 8


def server_actions(runtime: CopilotRuntime) -> dict[str, Action]:
    """The runtime's server-side actions: its own, and those of a built-in `default` agent
    made by hand (where actions discovered from remote endpoints are usually put)."""
    default = runtime.agents.get("default")
    found: dict[str, Action] = {}
    for action in [*runtime.actions,
                   *(default.actions.values() if isinstance(default, BuiltInAgent) else ())]:
        found.setdefault(action.name, action)
    return found


def answered_later(runtime: CopilotRuntime, request: RunRequest) -> frozenset[str] | None:
    """The calls of `request`'s run whose results the runtime sends once the agent's answer
    has streamed, by name; None for every call the client does not run (a built-in agent
    answers each of its own calls so). Another agent's calls to anything else (a graph's
    own tools, a call it announces for the page to render) are answered by the agent, in
    its own time, or never."""
    if isinstance(runtime.agents.get(request.agent_id), BuiltInAgent):
        return None
    return request.server_tools


def _builtin_loop(runtime: CopilotRuntime, agent_id: str) -> bool:
    """Whether `agent_id` is the runtime's own built-in `default` agent: the service
    adapter's chat of 1.10, which never saw actions `available: "remote"` (only agents do)."""
    return agent_id == "default" and isinstance(runtime.agents.get(agent_id), BuiltInAgent)


def _offered(runtime: CopilotRuntime, agent_id: str, actions: Mapping[str, Action],
             with_agents: bool) -> ServerTools:
    if agent_id not in runtime.agents or is_service_adapter(runtime, agent_id):
        return ServerTools()
    others = {other: agent.description for other, agent in runtime.agents.items()
              if other != agent_id and not is_service_adapter(runtime, other)
              } if with_agents else {}
    return ServerTools(actions, others)


def session_run(runtime: CopilotRuntime, data: Mapping[str, Any],
                properties: Mapping[str, Any] | None, *, has_public_key: bool
                ) -> tuple[RunRequest, Agent | None]:
    """The run a request asks for, and its agent wrapped with the server-side tools it is
    offered (None when it is offered none: then the runtime's agent runs as it is)."""
    actions = server_actions(runtime)
    names = list(actions)

    def prepare(agent_data: Mapping[str, Any], agent_id: str,
                handoffs: int) -> tuple[RunRequest, Agent | None]:
        tools = _offered(runtime, agent_id, actions, with_agents=handoffs < MAX_HANDOFFS)
        request = run_request(agent_data, properties, server_actions=names,
                              has_public_key=has_public_key, offered_tools=tools.specs(),
                              remote_actions=not _builtin_loop(runtime, agent_id))
        if not tools:
            return request, None

        def start(other: str) -> tuple[Agent, RunInput]:
            # The other agent takes the same conversation on the same thread, as a new run.
            handed, wrapped = prepare({**data, "agentSession": {"agentName": other},
                                       "runId": None}, other, handoffs + 1)
            return wrapped or runtime.agents[other], handed.input

        return request, ServerToolsAgent(runtime.agents[agent_id], tools, start)

    session = data.get("agentSession")
    if not session:
        return run_request(data, properties, server_actions=names,
                           has_public_key=has_public_key,
                           remote_actions=not _builtin_loop(runtime, "default")), None
    return prepare(data, str(session.get("agentName") or "default"), 0)


def _api_key(entry: Mapping[str, Any]) -> str:
    """An entry's `apiKey` ("" for none), sent as a header: one no header can hold (a line
    break, a letter outside ASCII) refuses the request, without its text (it failed the run
    with the HTTP client's words as an upstream outage, 503, echoing the key)."""
    key = entry.get("apiKey")
    if key is None:
        return ""
    if not isinstance(key, str):  # (a number, say: it went without a word, and no key)
        raise InvalidRequestError("An apiKey of properties.mcpServers must be a string")
    if not (key.isascii() and key.isprintable()) or key != key.strip(" "):
        raise InvalidRequestError("An apiKey of properties.mcpServers holds a character no "
                                  "HTTP header can (a control character, one outside ASCII, "
                                  "or a space at either end)")
    return key


def with_request_mcp(runtime: CopilotRuntime, properties: Mapping[str, Any] | None,
                     agent_id: str, agent: Agent | None) -> Agent | None:
    """`agent` offered the MCP servers of `properties.mcpServers` (the 1.x form), when the
    runtime allows servers per request; a server it does not allow refuses the request."""
    named = (properties or {}).get("mcpServers") or (properties or {}).get("mcpEndpoints")
    if not named or not runtime.mcp_allowed_urls:
        return agent  # nothing named, or per-request servers not enabled: never contacted
    if not isinstance(named, list):
        raise InvalidRequestError("properties.mcpServers must be a list")
    from copilot_runtime.mcp_tools import MCPServer

    servers: dict[tuple[str, str], MCPServer] = {}  # one per endpoint and key named
    for entry in named:
        endpoint = entry.get("endpoint") if isinstance(entry, dict) else None
        if not isinstance(endpoint, str) or not endpoint:
            raise InvalidRequestError("Each of properties.mcpServers needs an 'endpoint'")
        if endpoint.rstrip("/") not in runtime.mcp_allowed_urls:
            raise InvalidRequestError(
                f"The MCP server {endpoint[:200]!r} is not allowed by this runtime")
        key = _api_key(entry)
        servers.setdefault((endpoint.rstrip("/"), key), MCPServer(
            url=endpoint, headers={"Authorization": f"Bearer {key}"} if key else {}))
        if len(servers) > MAX_REQUEST_MCP_SERVERS:
            raise InvalidRequestError(f"properties.mcpServers names more than "
                                      f"{MAX_REQUEST_MCP_SERVERS} MCP servers")
    inner = runtime.agents[agent_id]
    if agent is not None or not isinstance(inner, BuiltInAgent):
        raise InvalidRequestError("MCP servers named per request work with the built-in "
                                  "agent only")
    return RequestMCPAgent(inner, list(servers.values()))
