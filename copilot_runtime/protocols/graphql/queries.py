"""The queries: `hello`, `availableAgents` and `loadAgentState`.

They are answered by ordinary GraphQL execution (they are neither hot nor streamed), with
resolvers that never let an exception's internals through: runtime errors become GraphQL
errors with the client's extensions, anything else is logged and reported as unexpected.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from graphql import GraphQLError, GraphQLResolveInfo

from copilot_runtime._compaction import events_to_messages
from copilot_runtime._exceptions import AgentNotFoundError, CopilotRuntimeError
from copilot_runtime._input import RunInput, parse_run_input
from copilot_runtime._limits import readable
from copilot_runtime._thread_reads import read_thread, running_messages
from copilot_runtime.agents.builtin import BuiltInAgent
from copilot_runtime.auth import RequestInfo
from copilot_runtime.messages import shows_attachments, to_json_representation
from copilot_runtime.protocols.graphql.errors import error_extensions, kit_extensions
from copilot_runtime.runtime import CopilotRuntime
from copilot_runtime.threads.base import (
    MAX_REPLAY_BYTES,
    ThreadOwner,
    id_problem,
    refused_answer,
)

__all__ = ["QueryContext", "agent_not_found", "is_service_adapter", "listed_agents",
           "query_root", "stored_in_place"]

_log = structlog.get_logger("copilot_runtime.graphql")


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
    return GraphQLError(exc.message, extensions=error_extensions(exc, exc.message))


def is_service_adapter(runtime: CopilotRuntime, agent_id: str) -> bool:
    """Whether `agent_id` is the runtime's own built-in agent.

    It stands for the 1.10 runtime's service adapter, which that runtime does not list as an
    agent (react-core would treat it as a CoAgent) nor offer to agents as a tool.
    """
    agent = runtime.agents.get(agent_id)
    return (agent_id == "default" and isinstance(agent, BuiltInAgent)
            and runtime.service_adapter is not None and agent.adapter is runtime.service_adapter)


def listed_agents(runtime: CopilotRuntime) -> list[dict[str, str]]:
    """The agents `availableAgents` lists: by their ids, which is all a client needs to
    start a session (where an agent lives, a URL or an assistant id, stays here)."""
    return [{"name": agent_id, "id": agent_id, "description": agent.description}
            for agent_id, agent in runtime.agents.items()
            if not is_service_adapter(runtime, agent_id)]


async def load_agent_state(runtime: CopilotRuntime, data: Mapping[str, Any],
                           headers: Mapping[str, str] | None = None,
                           request: RequestInfo | None = None) -> dict[str, Any]:
    """The thread as the agent keeps it (`Agent.load_state`), else as the runtime stored it.

    `state` and `messages` are JSON strings; `state` never holds `messages`.
    """
    thread_id: str = data["threadId"]
    agent_id: str = data["agentName"]
    agent = runtime.agents.get(agent_id)
    if agent is None:
        raise agent_not_found(agent_id, runtime)
    owner = runtime.owner_filter(request)
    if id_problem(thread_id) is not None or (
            owner is not None and not await runtime.can_see(request, thread_id)):
        # Someone else's thread does not exist for this caller, nor one no store can keep.
        return _no_thread(thread_id)
    loaded = await agent.load_state(thread_id, headers=headers or {})
    if loaded is not None:
        # Checked again once read: its owner may have deleted it and another started one
        # of its id.
        if not loaded.exists or (owner is not None
                                 and not await runtime.can_see(request, thread_id)):
            return _no_thread(thread_id)
        # The agent keeps a run's answer once it has it (a graph: at its node's end); the
        # running run's messages this worker has so far go after, as the AG-UI routes
        # show them (another worker's run: not until the agent keeps them).
        kept = {m.get("id") for m in loaded.messages}
        running = [m for m in await running_messages(runtime.runs, thread_id, agent_id, owner)
                   if m.get("id") not in kept]
        return _thread(thread_id, loaded.state, [*loaded.messages, *running])
    stored = await _stored(runtime, thread_id, owner)
    if stored is None:
        return _no_thread(thread_id)
    state, messages = stored
    return _thread(thread_id, state, messages)


async def _stored(runtime: CopilotRuntime, thread_id: str, owner: ThreadOwner | None
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The thread's state and messages as the runtime stored them, its running run as far
    as it went included (`read_thread`); None for no thread, or for one not `owner`'s (None:
    anyone's)."""
    # The newest runs a replay reads (the store's `replay_bytes`), as the AG-UI routes do:
    # a thread of many big runs read whole took gigabytes per request.
    record = await read_thread(runtime.runs, thread_id, getattr(
        runtime.store, "replay_bytes", MAX_REPLAY_BYTES))
    # The owner of what was read: the one checked before may have deleted it since, and
    # another started one of its id.
    if record is None or (owner is not None and record.owner != owner):
        return None
    record = readable(record)  # a thread stored broken is still read
    state = record.state
    # A run refused over its approval answer is left out, as the AG-UI replays leave it;
    # the messages of the runs left out go first, as they do there.
    earlier = [[record.earlier]] if record.earlier is not None else []
    return state if isinstance(state, dict) else {}, events_to_messages(
        earlier + [r.events for r in record.runs if not refused_answer(r.events)])


async def stored_in_place(runtime: CopilotRuntime, run_input: RunInput,
                          request: RequestInfo | None = None) -> RunInput:
    """`run_input` with each user message a 1.10 client loaded with its attachments shown
    as placeholders (`loadAgentState`: it loads text only) and sent back so, put back as
    the thread stored it: else the model never saw the image again after a reload.

    Only a message whose text ends in such a placeholder costs a read of the store; one
    whose id the thread does not hold as a user message with attachments stays as sent."""
    messages = run_input.raw.get("messages") or ()
    wanted = {m["id"] for m in messages if isinstance(m, dict) and m.get("role") == "user"
              and isinstance(m.get("content"), str) and shows_attachments(m["content"])}
    thread_id = run_input.thread_id
    owner = runtime.owner_filter(request)
    if not wanted or (owner is not None and not await runtime.can_see(request, thread_id)):
        return run_input  # (someone else's thread: its run is refused as it starts)
    stored = await _stored(runtime, thread_id, owner)
    found = {m["id"]: m for m in stored[1] if m.get("id") in wanted
             and m.get("role") == "user" and isinstance(m.get("content"), list)
             } if stored is not None else {}
    if not found:
        return run_input
    raw = {**run_input.raw, "messages": [
        found.get(m.get("id"), m) if isinstance(m, dict) else m for m in messages]}
    restored = parse_run_input(raw)
    restored.transient = run_input.transient
    return restored


def _no_thread(thread_id: str) -> dict[str, Any]:
    return {"threadId": thread_id, "threadExists": False, "state": "{}", "messages": "[]"}


def _thread(thread_id: str, state: Mapping[str, Any],
            messages: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    state = {k: v for k, v in state.items() if k != "messages"}
    return {"threadId": thread_id, "threadExists": True,
            "state": orjson.dumps(state, option=orjson.OPT_NON_STR_KEYS).decode(),
            "messages": orjson.dumps(to_json_representation(messages)).decode()}


Resolver = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class QueryContext:
    #: The client's headers the agents may forward (lower-cased), as for runs.
    headers: Mapping[str, str] = field(default_factory=dict)
    #: Who asks (None when the runtime does not need to know).
    request: RequestInfo | None = None


def _guarded(work: Callable[..., Awaitable[Any]]) -> Resolver:
    async def resolve(info: GraphQLResolveInfo[Any], **args: Any) -> Any:
        try:
            return await work(info.context, **args)
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
    """The root value for executing queries (graphql-core calls its callables).

    The execution's context is a `QueryContext`.
    """

    async def hello(context: QueryContext) -> str:
        return "Hello World"

    async def available_agents(context: QueryContext) -> dict[str, Any]:
        return {"agents": listed_agents(runtime)}

    async def load_state(context: QueryContext, data: Mapping[str, Any]) -> dict[str, Any]:
        return await load_agent_state(runtime, data, context.headers, context.request)

    return {"hello": _guarded(hello), "availableAgents": _guarded(available_agents),
            "loadAgentState": _guarded(load_state)}
