"""`generateCopilotResponse(data, properties)` → the core's `RunInput`.

The translation follows what the 1.10 runtime does with a request:

* `system` text messages reach the model as `developer` messages (that runtime's OpenAI
  adapter sends them so); agent-state messages are UI state and are left out; an action
  execution becomes a tool call of the assistant message it belongs to (`parentMessageId`),
  so the calls of one answer travel in one message, as models expect; a result without a
  call, or a second result for one call, is dropped;
* frontend actions become the run's tools, except `disabled` ones, and `remote` ones
  ("only available to the agent") when the built-in loop runs, which stands for the service
  adapter's own chat (1.10 dropped them there only); their `jsonSchema` is the tool's
  parameters;
* `forwardedParameters` become the model settings the core reads from `forwardedProps`,
  `properties` are merged into `forwardedProps` (as that runtime forwards them to agents),
  and an `agentSession` names the agent to run, with its state from `agentStates`, its
  `nodeName`, its `config` and, from `metaEvents`, the value to resume an interrupt with
  and the question it answers.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from copilot_runtime._exceptions import InvalidRequestError
from copilot_runtime._input import RunInput, parse_run_input
from copilot_runtime._limits import check_json_text
from copilot_runtime.messages import from_graphql_inputs

__all__ = ["RunRequest", "run_request"]

_EMPTY_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
# Model settings the core would also read from the top level of `forwardedProps`: set here
# (None when not forwarded) so that `properties` never change the model's settings.
_SETTINGS = ("model", "temperature", "maxTokens", "max_tokens", "stop", "toolChoice",
             "tool_choice")


@dataclass(frozen=True, slots=True)
class RunRequest:
    agent_id: str
    input: RunInput
    #: `runId` as the client sent it: the response echoes it.
    client_run_id: str | None
    #: Names of the tools the client runs itself (a call to any other is answered here).
    frontend_tools: frozenset[str]
    #: Names of the runtime's own server-side tools: its actions and what the session's
    #: agent is offered.
    server_tools: frozenset[str] = frozenset()


def run_request(data: Mapping[str, Any], properties: Mapping[str, Any] | None,
                *, server_actions: Collection[str], has_public_key: bool,
                offered_tools: Sequence[Mapping[str, Any]] = (),
                remote_actions: bool = False) -> RunRequest:
    """Translate coerced GraphQL input; raise `InvalidRequestError` for what cannot run.

    `offered_tools` are the server-side tools of an agent session (`_server_tools`): they
    come first, and a frontend action with the same name as one of them is not offered
    again (the 1.10 runtime keeps the first of each name, server-side ones first).
    `remote_actions`: whether actions `available: "remote"` are offered (to an agent, not
    to the built-in loop).
    """
    if data.get("cloud") and not has_public_key:
        raise InvalidRequestError(
            "Copilot Cloud options (data.cloud) need the X-CopilotCloud-Public-API-Key header")
    session = data.get("agentSession") or {}
    agent_id = session.get("agentName") or "default"
    thread_id = data.get("threadId") or session.get("threadId") or str(uuid.uuid4())
    client_run_id = data.get("runId")
    actions = [a for a in (data.get("frontend") or {}).get("actions") or ()
               if a.get("available") != "disabled"]
    offered = {t["name"] for t in offered_tools}
    tools = [*offered_tools, *({"name": a["name"], "description": a.get("description") or "",
                                "parameters": _schema(a.get("jsonSchema"))}
                               for a in actions
                               if (remote_actions or a.get("available") != "remote")
                               and a["name"] not in offered)]
    state, agent_props = _agent_state(data, agent_id, session)
    forwarded: dict[str, Any] = {**agent_props, **_kept_properties(properties),
                                 "forwardedParameters": _settings(data)}
    messages = from_graphql_inputs(data.get("messages") or ())
    raw = {
        "threadId": thread_id,
        "runId": client_run_id or str(uuid.uuid4()),
        "state": state,
        "messages": messages,
        "tools": tools,
        "context": [{"description": c["description"], "value": c["value"]}
                    for c in data.get("context") or ()],
        "forwardedProps": forwarded,
    }
    frontend = frozenset(a["name"] for a in actions) - frozenset(server_actions) - offered
    run_input = parse_run_input(raw)
    # The client's system messages are its instructions, made again (a new id) each request.
    run_input.transient = frozenset(m["id"] for m in messages if m["role"] == "developer")
    return RunRequest(agent_id, run_input, client_run_id, frontend,
                      frozenset(server_actions) | offered)


#: What a request-scoped MCP server entry may hold that is a credential: used for the run
#: only (`agent_tools.with_request_mcp` reads the request's own `properties`).
_SERVER_CREDENTIALS = frozenset({"apiKey", "headers"})


def _kept_properties(properties: Mapping[str, Any] | None) -> dict[str, Any]:
    """`properties` as the run's input keeps them: the MCP servers named without their keys.
    The input is stored with the thread (its RUN_STARTED) and replayed by `connect`."""
    kept = dict(properties or {})
    for name in ("mcpServers", "mcpEndpoints"):
        named = kept.get(name)
        if isinstance(named, list):
            kept[name] = [{k: v for k, v in entry.items() if k not in _SERVER_CREDENTIALS}
                          if isinstance(entry, dict) else entry for entry in named]
    return kept


def _schema(text: Any) -> dict[str, Any]:
    # The 1.10 runtime falls back to an empty schema when it cannot parse one; so do we.
    try:
        schema = check_json_text(text, "An action's jsonSchema") if isinstance(
            text, str) else None
    except orjson.JSONDecodeError:
        schema = None
    return schema if isinstance(schema, dict) else dict(_EMPTY_SCHEMA)


def _settings(data: Mapping[str, Any]) -> dict[str, Any]:
    settings: dict[str, Any] = dict.fromkeys(_SETTINGS)
    given = data.get("forwardedParameters") or {}
    for key in ("model", "temperature", "stop"):
        if given.get(key) is not None:
            settings[key] = given[key]
    max_tokens = given.get("maxTokens")
    if max_tokens is not None:
        # A GraphQL Float; the model wants a whole number of tokens. One beyond 64 bits
        # stays a float (refused as not a whole number): no stage could encode it.
        settings["maxTokens"] = int(max_tokens) if float(max_tokens).is_integer() and abs(
            max_tokens) < 2**63 else max_tokens
    choice = given.get("toolChoice")
    if choice == "function":
        choice = given.get("toolChoiceFunctionName")  # the one tool the model must call
    if choice is not None:
        settings["toolChoice"] = choice
    return settings


def _json_object(text: Any, what: str) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = check_json_text(text, what)
    except orjson.JSONDecodeError as exc:
        # What is wrong with the text, as AG-UI's refusal of a body says it (a number
        # beyond a double's range is JSON, but not one the runtime can read).
        raise InvalidRequestError(
            f"{what} must be a JSON object encoded as a string ({exc.msg})") from None
    except TypeError:
        raise InvalidRequestError(f"{what} must be a JSON object encoded as a string") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{what} must be a JSON object encoded as a string")
    return value


def _agent_state(data: Mapping[str, Any], agent_id: str,
                 session: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The agent's state from `agentStates`, and what the run passes on to the agent."""
    state: dict[str, Any] = {}
    props: dict[str, Any] = {}
    for entry in data.get("agentStates") or ():
        if entry.get("agentName") == agent_id:
            state = _json_object(entry.get("state"), "agentStates[].state")
            # The client echoes the agent-state messages' state, conversation included;
            # the conversation travels as `messages`, and a graph must not get it twice.
            state.pop("messages", None)
            config = _json_object(entry.get("config"), "agentStates[].config")
            if "streamSubgraphs" in config:
                props["streamSubgraphs"] = config.pop("streamSubgraphs")
            props["config"] = config
            break
    if session.get("nodeName"):
        props["nodeName"] = session["nodeName"]
    meta_events = data.get("metaEvents") or ()
    if meta_events:
        # The question it answers (the meta event's `value`), as the AG-UI legacy client
        # sends it: the agent's one clue to which interrupt it is for when several wait.
        props["command"] = {"resume": meta_events[0].get("response"),
                            "interruptEvent": meta_events[0].get("value")}
    return state, props


