"""The part of a client's run config a LangGraph run takes.

CopilotKit's `useCoAgent({config})` reaches the runtime as 1.10's `agentStates[].config`
and as AG-UI's `forwardedProps.config`; the TypeScript runtimes merge it into the run's
`RunnableConfig`. It is client input on a server many users share, so only this passes:

* `configurable` keys the graph declares (its context schema, which LangGraph 1.0 also
  reads a `config_schema` into; on the Platform, its assistant's config and context
  schemas), laid over the agent's own `config`. A graph that declares none takes none.
* Never the keys that address a checkpoint or that the runtime, LangGraph or the Platform
  set (`OWNED_KEYS`, `OWNED_PREFIXES`), declared or not: a client naming another
  thread's `thread_id` or `checkpoint_ns` would read and write that thread.
* `recursion_limit`, a positive integer, at most `bound` (the agent's own limit): a
  client may make a run stop sooner, never let it loop longer.

Anything else (`callbacks`, `tags`, `metadata`, `run_name`, ...) is ignored. A `config`,
`configurable` or `recursion_limit` of the wrong type is refused (`InvalidRequestError`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Final

from langchain_core.runnables.config import DEFAULT_RECURSION_LIMIT

from copilot_runtime._exceptions import InvalidRequestError

__all__ = ["OWNED_KEYS", "OWNED_PREFIXES", "client_run_config", "declared_keys",
           "graph_config_keys", "recursion_bound"]

#: `configurable` keys a client never sets: the checkpoint's address (LangGraph's
#: `thread_id`, `checkpoint_id`, `checkpoint_ns`, `checkpoint_map`, and the older
#: `thread_ts`), and what the Platform sets for a run (its ids, the authenticated user).
OWNED_KEYS: Final = frozenset({
    "thread_id", "checkpoint_id", "checkpoint_ns", "checkpoint_map", "thread_ts",
    "checkpoint_during", "run_id", "assistant_id", "graph_id", "user_id"})
#: ... and key prefixes: LangGraph's internals (`__pregel_*`, the durability the agent
#: sets), the Platform's (`langgraph_auth_user`, ...), forwarded headers (`x-*`).
OWNED_PREFIXES: Final = ("__", "langgraph_", "x-")


def declared_keys(*schemas: Any) -> frozenset[str]:
    """The property names of the JSON schemas given (None, or not a schema: none)."""
    keys: set[str] = set()
    for schema in schemas:
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        if isinstance(properties, Mapping):
            keys.update(key for key in properties if isinstance(key, str))
    return frozenset(keys)


def graph_config_keys(graph: Any) -> frozenset[str]:
    """The `configurable` keys a compiled graph declares: its context schema's fields."""
    try:
        return declared_keys(graph.get_context_jsonschema())
    except Exception:  # a schema pydantic cannot describe: its annotations say the same
        hints = getattr(getattr(graph, "context_schema", None), "__annotations__", None)
        return frozenset(key for key in hints or () if isinstance(key, str))


def recursion_bound(config: Mapping[str, Any]) -> int:
    """The recursion limit of a run unless a client lowers it: the agent's `config`'s,
    else LangChain's default, which ag-ui-langgraph writes into every run's config
    (`ensure_config`), so LangGraph's own default never applies."""
    limit = config.get("recursion_limit")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return limit
    return DEFAULT_RECURSION_LIMIT


def client_run_config(base: Mapping[str, Any], sent: Any, declared: Collection[str],
                      bound: int) -> dict[str, Any]:
    """The run's config: `base` (the agent's) with what the client `sent` may set (see
    the module docstring)."""
    config = dict(base)
    if sent is None:
        return config
    if not isinstance(sent, Mapping):
        raise InvalidRequestError("forwardedProps.config must be a JSON object")
    configurable = sent.get("configurable")
    if configurable is not None and not isinstance(configurable, Mapping):
        raise InvalidRequestError("forwardedProps.config.configurable must be a JSON object")
    limit = sent.get("recursion_limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):
        raise InvalidRequestError(
            "forwardedProps.config.recursion_limit must be a positive integer")
    taken = {key: value for key, value in (configurable or {}).items()
             if key in declared and key not in OWNED_KEYS
             and not key.startswith(OWNED_PREFIXES)}
    if taken:
        config["configurable"] = {**(base.get("configurable") or {}), **taken}
    if limit is not None:
        config["recursion_limit"] = min(limit, bound)
    return config
