"""A LangGraph thread's saved state as an `AgentThreadState`.

The checkpoint is the truth about a LangGraph thread: it holds every message, including
those of runs the runtime never saw (another process, a script, a previous deployment).
Its LangChain messages become AG-UI messages through ag-ui-langgraph's own converter, the
one its MESSAGES_SNAPSHOT uses (a client's tool results given back as it sent them:
`_lg_tool_messages`), so a loaded thread and a streamed one read alike; the
state leaves out what `_lg_events` keeps out of snapshots (messages and the tool plumbing),
and, as snapshots do, the keys the graph's output schema leaves out (`schema_keys`).

While a subgraph waits on an interrupt, what it said so far is in the subgraph's state,
not yet in its parent's: `graph_values` adds those messages, so a snapshot, a loaded
thread and a reconnecting client show the chat the user saw streamed.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping
from typing import Any, cast

import pydantic
from langchain_core.runnables import RunnableConfig
from langgraph.pregel import Pregel

from copilot_runtime.agents._lg_events import PLUMBING_STATE_KEYS
from copilot_runtime.agents._lg_tool_messages import to_agui
from copilot_runtime.agents._lg_values import json_safe, known_messages
from copilot_runtime.agents.base import AgentThreadState

__all__ = ["graph_values", "load_graph_state", "schema_keys", "thread_state_from_values"]


def schema_keys(graph: Any, config: Any = None) -> dict[str, list[str]]:
    """The state keys of a graph's input and output schemas (`"input"`, `"output"`).

    What a run's snapshots show (the translator's `get_schema_keys`) and what a loaded
    thread shows are both cut to the "output" keys: one reading, so the two cannot
    disagree on what the graph's output schema hides. `graph` is a compiled graph or the
    platform's stand-in (which answers the JSON schema methods only). A compiled graph's
    are read once: pydantic builds both schemas (~30 ms for a workflow's graph, on the
    event loop, on every run start and every `loadAgentState`)."""
    if not isinstance(graph, Pregel):
        return _read_schema_keys(graph, config)
    keys = _SCHEMA_KEYS.get(graph)
    if keys is None:
        keys = _SCHEMA_KEYS[graph] = _read_schema_keys(graph, config)
    return {"input": list(keys["input"]), "output": list(keys["output"])}


#: Each compiled graph's schema keys (its state schemas do not change once compiled).
_SCHEMA_KEYS: weakref.WeakKeyDictionary[Any, dict[str, list[str]]] = \
    weakref.WeakKeyDictionary()


def _read_schema_keys(graph: Any, config: Any) -> dict[str, list[str]]:
    try:
        inputs = _field_keys(graph, "input", graph.get_input_jsonschema(config))
        outputs = _field_keys(graph, "output", graph.get_output_jsonschema(config))
    except Exception:  # pydantic's schema errors are RuntimeErrors
        # A state schema pydantic cannot describe (`typing.TypedDict` before Python
        # 3.12, a field of an arbitrary class) runs fine in LangGraph: the compiled
        # graph's channels say the same, instead of failing every run.
        inputs = _schema_channels(graph, "input")
        outputs = _schema_channels(graph, "output")
    return {"input": inputs, "output": outputs}


def _field_keys(graph: Any, which: str, schema: Any) -> list[str]:
    """The JSON schema's property names as state keys: a pydantic state's field with an
    alias is named by its alias there, by its field name in the checkpoint."""
    names = list(schema.get("properties") or ())
    model = getattr(getattr(graph, "builder", None), f"{which}_schema", None)
    if not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)):
        return names
    by_alias: dict[str, str] = {}
    for name, info in model.model_fields.items():
        for alias in (info.alias, info.validation_alias, info.serialization_alias):
            if isinstance(alias, str):
                by_alias.setdefault(alias, name)
    return [by_alias.get(key, key) if key not in model.model_fields else key
            for key in names]


def _schema_channels(graph: Any, which: str) -> list[str]:
    """The state keys of a compiled graph's input or output schema, read from its builder
    (a compiled graph's `input_channels` is only its start node), else all its channels."""
    builder = getattr(graph, "builder", None)
    schemas = getattr(builder, "schemas", None)
    schema = getattr(builder, f"{which}_schema", None)
    channels = schemas.get(schema) if isinstance(schemas, dict) else None
    if channels is None:
        channels = getattr(graph, "channels", None) or ()
    return [name for name in channels if isinstance(name, str) and not name.startswith("__")
            and not name.startswith("branch:")]


def thread_state_from_values(thread_id: str, values: Mapping[str, Any] | None,
                             output_keys: Collection[str] | None = None) -> AgentThreadState:
    """The thread whose checkpoint holds `values` (LangChain messages under `messages`),
    its state cut to `output_keys` when given (`schema_keys(graph)["output"]`).

    A thread without values does not exist as far as the client is concerned: LangGraph
    answers an unknown thread with an empty snapshot rather than an error.
    """
    if not values:
        return AgentThreadState(thread_id, exists=False)
    state = {key: json_safe(value) for key, value in values.items()
             if key not in PLUMBING_STATE_KEYS
             and (output_keys is None or key in output_keys)}
    raw = values.get("messages")
    messages = [m.model_dump(mode="json", by_alias=True, exclude_none=True)
                for m in to_agui(known_messages(raw))] if raw else []
    return AgentThreadState(thread_id, exists=True, state=state, messages=messages)


async def load_graph_state(graph: Any, thread_id: str,
                           config: Mapping[str, Any] | None = None) -> AgentThreadState:
    """Read `thread_id` from the checkpointer of a compiled graph.

    `config` is the agent's base `RunnableConfig` (its `configurable` may name a checkpoint
    namespace, for example); the thread id always comes from the argument.
    """
    base = dict(config or {})
    configurable = {**(base.get("configurable") or {}), "thread_id": thread_id}
    values = await graph_values(graph, {**base, "configurable": configurable})
    return thread_state_from_values(thread_id, values, schema_keys(graph, base)["output"])


async def graph_values(graph: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the thread `config` names, with the messages of its interrupted
    subgraphs that the parent's `messages` lack added at their end.

    A graph that is not a compiled LangGraph graph (the platform's, read over its API)
    is read as it is."""
    if not isinstance(graph, Pregel):
        snapshot = await graph.aget_state(config)
        return dict(snapshot.values or {})
    snapshot = await graph.aget_state(cast(RunnableConfig, config), subgraphs=True)
    values = dict(snapshot.values or {})
    if not any(task.interrupts for task in snapshot.tasks or ()):
        return values
    messages = list(values.get("messages") or ())
    seen = {getattr(m, "id", None) for m in messages} - {None}
    for extra in _subgraph_messages(snapshot.tasks):
        message_id = getattr(extra, "id", None)
        if message_id is None or message_id not in seen:
            messages.append(extra)
            seen.add(message_id)
    if messages:
        values["messages"] = messages
    return values


def _subgraph_messages(tasks: Any) -> list[Any]:
    """The messages of the interrupted subgraphs among `tasks`, nested ones included."""
    out: list[Any] = []
    for task in tasks or ():
        state = getattr(task, "state", None)
        if not task.interrupts or state is None or not hasattr(state, "values"):
            continue  # not a subgraph (`state` is its config then), or not interrupted
        out.extend((state.values or {}).get("messages") or ())
        out.extend(_subgraph_messages(state.tasks))
    return out
