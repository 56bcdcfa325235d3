"""The part of a client's run config a LangGraph run takes.

CopilotKit's `useCoAgent({config})` reaches the runtime as 1.10's `agentStates[].config`
and as AG-UI's `forwardedProps.config`; the TypeScript runtimes merge it into the run's
`RunnableConfig`. It is client input on a server many users share, so only this passes:

* `configurable` keys the graph declares (its context schema, which LangGraph 1.0 also
  reads a `config_schema` into; on the Platform, its assistant's config and context
  schemas) that the operator left unset: a key the agent's own `config` sets (on the
  Platform, also its assistant's config or context) stays the operator's, so a client
  cannot move a run to another tenant, model or endpoint. A graph that declares none
  takes none. A client's value the context schema's type refuses is refused before the
  graph starts (`check_client_context`).
* Never the keys that address a checkpoint or that the runtime, LangGraph or the Platform
  set (`OWNED_KEYS`, `OWNED_PREFIXES`), declared or not: a client naming another
  thread's `thread_id` or `checkpoint_ns` would read and write that thread.
* `recursion_limit`, a positive integer, at most `bound` (the agent's own limit): a
  client may make a run stop sooner, never let it loop longer.

Anything else (`callbacks`, `tags`, `metadata`, `run_name`, ...) is ignored. A `config`,
`configurable` or `recursion_limit` of the wrong type is refused (`InvalidRequestError`).
"""

from __future__ import annotations

import dataclasses
import typing
import weakref
from collections.abc import Collection, Mapping
from typing import Any, Final

import pydantic
from langchain_core.runnables.config import DEFAULT_RECURSION_LIMIT

from copilot_runtime._exceptions import InvalidRequestError

__all__ = ["OWNED_KEYS", "OWNED_PREFIXES", "check_client_context", "client_run_config",
           "context_init_keys", "declared_keys", "graph_config_keys", "recursion_bound"]

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
    except Exception:  # a schema pydantic cannot describe: its fields say the same
        return _field_names(getattr(graph, "context_schema", None))


def _field_names(schema: Any) -> frozenset[str]:
    """The fields of a context class, inherited ones included (a class's own
    `__annotations__` has only those it adds)."""
    if schema is None:
        return frozenset()
    if dataclasses.is_dataclass(schema):
        return frozenset(f.name for f in dataclasses.fields(schema))
    if isinstance(schema, type) and issubclass(schema, pydantic.BaseModel):
        return frozenset(schema.model_fields)
    return frozenset(_hints(schema) or ())


def _hints(schema: Any) -> dict[str, Any] | None:
    """A class's field types, its bases' included (None: a name that cannot be resolved)."""
    try:
        return typing.get_type_hints(schema, include_extras=True)
    except Exception:
        return None


def context_init_keys(schema: Any) -> frozenset[str] | None:
    """The keys a context class takes from the run's context dict (LangGraph builds a
    dataclass or pydantic context as `schema(**context)`), or None: any (a TypedDict or
    dict context is passed as it is, so an undeclared operator key still reaches it)."""
    if dataclasses.is_dataclass(schema):
        # (a field with init=False is no argument of its __init__)
        return frozenset(f.name for f in dataclasses.fields(schema) if f.init)
    if isinstance(schema, type) and issubclass(schema, pydantic.BaseModel):
        if schema.model_config.get("extra") == "allow":
            return None
        keys = set(schema.model_fields)
        for info in schema.model_fields.values():  # a model may be built by alias only
            keys.update(alias for alias in (info.alias, info.validation_alias)
                        if isinstance(alias, str))
        return frozenset(keys)
    return None


#: Per context class, how to check a client's values: a pydantic model's validator, else
#: one per field its type hints name (a dataclass's `__post_init__` is not run for it).
_CHECKERS: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()
_ARBITRARY: Final = pydantic.ConfigDict(arbitrary_types_allowed=True)


def _checker(schema: type) -> Any:
    checker = _CHECKERS.get(schema)
    if checker is None:
        if issubclass(schema, pydantic.BaseModel):
            checker = pydantic.TypeAdapter(schema)
        else:
            checker = {}
            for name, hint in (_hints(schema) or {}).items():
                adapter = _adapter(hint)
                if adapter is not None:  # (else a type pydantic cannot check: the graph's)
                    checker[name] = adapter
        _CHECKERS[schema] = checker
    return checker


def _adapter(hint: Any) -> pydantic.TypeAdapter[Any] | None:
    # A model or pydantic dataclass refuses a config of its own: it has one.
    for config in (_ARBITRARY, None):
        try:
            return pydantic.TypeAdapter(hint, config=config)
        except Exception:
            continue
    return None


def check_client_context(schema: Any, context: Mapping[str, Any],
                         client_keys: Collection[str]) -> None:
    """Refuse (`InvalidRequestError`) a client's value of `context` (the run's whole
    `configurable`) that the context schema's type refuses. Checked once, before the run:
    inside the graph it failed as the agent's error, logged with a traceback at any
    client's will. The operator's values are the graph's to judge, as before."""
    if not client_keys or not isinstance(schema, type):
        return
    checker = _checker(schema)
    bad: list[str] = []
    if isinstance(checker, pydantic.TypeAdapter):
        keys = context_init_keys(schema)
        try:
            checker.validate_python(
                {k: v for k, v in context.items() if keys is None or k in keys})
        except pydantic.ValidationError as exc:
            bad = [f"{error['loc'][0]}: {error['msg']}" for error in exc.errors()
                   if error["loc"] and error["loc"][0] in client_keys]
    else:
        for key in client_keys:
            adapter = checker.get(key)
            if adapter is None:
                continue
            try:
                adapter.validate_python(context[key])
            except pydantic.ValidationError as exc:
                bad.append(f"{key}: {exc.errors()[0]['msg']}")
    if bad:
        raise InvalidRequestError("; ".join(
            f"forwardedProps.config.configurable.{said}" for said in sorted(set(bad))))


def recursion_bound(config: Mapping[str, Any],
                    assistant: Mapping[str, Any] | None = None) -> int:
    """The recursion limit of a run unless a client lowers it: the agent's `config`'s,
    else (on the Platform, which lays a run's config over its assistant's) the
    assistant's, else LangChain's default, which ag-ui-langgraph writes into every run's
    config (`ensure_config`), so LangGraph's own default never applies."""
    for source in (config, assistant or {}):
        limit = source.get("recursion_limit")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return limit
    return DEFAULT_RECURSION_LIMIT


def client_run_config(base: Mapping[str, Any], sent: Any, declared: Collection[str],
                      bound: int, operator: Collection[str] = ()) -> dict[str, Any]:
    """The run's config: `base` (the agent's) with what the client `sent` may set (see
    the module docstring). `operator`: keys set elsewhere than `base` that stay the
    operator's (a Platform assistant's)."""
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
    own = base.get("configurable") or {}
    taken = {key: value for key, value in (configurable or {}).items()
             if key in declared and key not in OWNED_KEYS
             and not key.startswith(OWNED_PREFIXES)
             and key not in own and key not in operator}
    if taken:
        config["configurable"] = {**own, **taken}
    if limit is not None:
        config["recursion_limit"] = min(limit, bound)
    return config
