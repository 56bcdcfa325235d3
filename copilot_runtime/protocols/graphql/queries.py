"""The queries: `hello`, `availableAgents` and `loadAgentState`.

They are answered by ordinary GraphQL execution (they are neither hot nor streamed), with
resolvers that never let an exception's internals through: runtime errors become GraphQL
errors with the client's extensions, anything else is logged and reported as unexpected.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import orjson
import structlog
from graphql import GraphQLError, GraphQLResolveInfo

from copilot_runtime._compaction import events_to_messages
from copilot_runtime._exceptions import AgentNotFoundError, CopilotRuntimeError
from copilot_runtime.agents.builtin import BuiltInAgent
from copilot_runtime.protocols.graphql.errors import kit_code_of, kit_extensions
from copilot_runtime.runtime import CopilotRuntime

__all__ = ["agent_not_found", "query_root", "to_copilotkit_messages"]

_log = structlog.get_logger("copilot_runtime.graphql")
_HIDDEN_ROLES = frozenset({"system", "developer"})


def agent_not_found(agent_id: str, runtime: CopilotRuntime) -> AgentNotFoundError:
    """The error for an agent name the runtime does not know, naming the ones it does."""
    error = AgentNotFoundError(agent_id, sorted(runtime.agents))
    if error.available:
        names = ", ".join(f"'{name}'" for name in error.available)
        error.message = f"Agent '{agent_id}' is not available here; the agents are: {names}"
    else:
        error.message = f"Agent '{agent_id}' is not available: this runtime has no agents"
    error.args = (error.message,)
    return error


def as_graphql_error(exc: CopilotRuntimeError) -> GraphQLError:
    return GraphQLError(exc.message, extensions=kit_extensions(kit_code_of(exc), exc.message))


def listed_agents(runtime: CopilotRuntime) -> list[dict[str, str]]:
    """The agents `availableAgents` lists.

    The runtime's own built-in agent stands for the 1.10 runtime's service adapter, which
    that runtime does not list as an agent (react-core would treat it as a CoAgent).
    """
    listed = []
    for agent_id, agent in runtime.agents.items():
        if (agent_id == "default" and isinstance(agent, BuiltInAgent)
                and runtime.service_adapter is not None
                and agent.adapter is runtime.service_adapter):
            continue
        listed.append({"name": agent_id, "id": agent_id, "description": agent.description})
    return listed


async def load_agent_state(runtime: CopilotRuntime, data: Mapping[str, Any]) -> dict[str, Any]:
    thread_id: str = data["threadId"]
    agent_id: str = data["agentName"]
    if agent_id not in runtime.agents:
        raise agent_not_found(agent_id, runtime)
    record = await runtime.store.get(thread_id)
    if record is None:
        return {"threadId": thread_id, "threadExists": False, "state": "{}", "messages": "[]"}
    state = record.state
    state = {k: v for k, v in state.items() if k != "messages"} if isinstance(
        state, dict) else {}
    messages = to_copilotkit_messages(events_to_messages(r.events for r in record.runs))
    return {"threadId": thread_id, "threadExists": True,
            "state": orjson.dumps(state).decode(), "messages": orjson.dumps(messages).decode()}


def to_copilotkit_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """AG-UI messages → the JSON form react-core 1.10 loads (it sniffs the keys).

    System and developer messages are left out: the 1.10 client rebuilds its system prompt
    for every request, so a loaded one would be sent twice.
    """
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    answered: set[str] = set()
    for message in messages:
        role = message.get("role")
        message_id = message.get("id")
        if role in _HIDDEN_ROLES or not isinstance(message_id, str):
            continue
        if role == "tool":
            call_id = message.get("toolCallId")
            if not isinstance(call_id, str) or call_id in answered:
                continue  # the same result stored twice (by the run and by the follow-up)
            answered.add(call_id)
            out.append({"id": message_id, "actionExecutionId": call_id,
                        "actionName": names.get(call_id, ""),
                        "result": _text(message.get("content"))})
            continue
        content = _text(message.get("content"))
        calls = message.get("toolCalls") or ()
        if role in ("user", "assistant") and (content or not calls):
            item: dict[str, Any] = {"id": message_id, "role": role, "content": content}
            if role == "assistant":
                item["parentMessageId"] = message_id
            out.append(item)
        for call in calls:
            function = call.get("function") or {}
            names[call["id"]] = function.get("name", "")
            try:
                arguments = orjson.loads(function.get("arguments") or "{}")
            except orjson.JSONDecodeError:
                arguments = {}
            out.append({"id": call["id"], "name": function.get("name", ""),
                        "arguments": arguments, "parentMessageId": message_id})
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and p.get("type") == "text")
    return ""


Resolver = Callable[..., Awaitable[Any]]


def _guarded(work: Callable[..., Awaitable[Any]]) -> Resolver:
    async def resolve(info: GraphQLResolveInfo[Any], **args: Any) -> Any:
        try:
            return await work(**args)
        except CopilotRuntimeError as exc:
            raise as_graphql_error(exc) from None
        except GraphQLError:
            raise
        except Exception:
            # The stack goes to the log; the client learns only that it failed.
            _log.exception("query failed", field=info.field_name)
            message = f"The runtime could not answer {info.field_name}"
            raise GraphQLError(message, extensions=kit_extensions("UNKNOWN", message)) from None

    return resolve


def query_root(runtime: CopilotRuntime) -> dict[str, Resolver]:
    """The root value for executing queries (graphql-core calls its callables)."""

    async def hello() -> str:
        return "Hello World"

    async def available_agents() -> dict[str, Any]:
        return {"agents": listed_agents(runtime)}

    async def load_state(data: Mapping[str, Any]) -> dict[str, Any]:
        return await load_agent_state(runtime, data)

    return {"hello": _guarded(hello), "availableAgents": _guarded(available_agents),
            "loadAgentState": _guarded(load_state)}
