"""The part of a client's run config a LangGraph run takes.

CopilotKit's `useCoAgent({config})` reaches the runtime as 1.10's `agentStates[].config`
and as AG-UI's `forwardedProps.config`; the TypeScript runtimes merge it into the run's
`RunnableConfig`. It is client input on a server many users share, so only this passes:

* `configurable` keys the graph declares (its context schema, which LangGraph 1.0 also
  reads a `config_schema` into; on the Platform, its assistant's config and context
  schemas) that the operator left unset: a key the agent's own `config` sets (on the
  Platform, also its assistant's config or context) stays the operator's, so a client
  cannot move a run to another tenant, model or endpoint; a field's names (a pydantic
  field's name, alias and validation aliases) are one key there. A graph that declares
  none takes none. A client's value the context schema's type refuses is refused before
  the graph starts, and the graph gets it as the check made it (`check_client_context`).
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
import typing_extensions
from langchain_core.runnables.config import DEFAULT_RECURSION_LIMIT
from pydantic.fields import FieldInfo

from copilot_runtime._exceptions import InvalidRequestError

__all__ = ["OWNED_KEYS", "OWNED_PREFIXES", "check_client_context", "client_run_config",
           "context_init_keys", "context_key_names", "declared_keys", "graph_config_keys",
           "recursion_bound"]

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
        keys: set[str] = set()
        for name, info in schema.model_fields.items():  # (a model may take aliases only)
            keys |= _input_names(name, info)
        return frozenset(keys)
    return None


def _input_names(name: str, info: FieldInfo) -> set[str]:
    """Every key a model's field may be given under: its name, its alias, its validation
    aliases (each of an `AliasChoices`; an `AliasPath`'s first key)."""
    names = {name}
    if isinstance(info.alias, str):
        names.add(info.alias)
    alias = info.validation_alias
    for choice in alias.choices if isinstance(alias, pydantic.AliasChoices) else [alias]:
        first = choice.path[0] if isinstance(choice, pydantic.AliasPath) and choice.path \
            else choice
        if isinstance(first, str):
            names.add(first)
    return names


def context_key_names(schema: Any) -> dict[str, frozenset[str]]:
    """For each key a context class's field may be given under, all of that field's keys
    (a pydantic model's: see `_input_names`; other classes' fields have one)."""
    if not (isinstance(schema, type) and issubclass(schema, pydantic.BaseModel)):
        return {}
    out: dict[str, frozenset[str]] = {}
    for name, info in schema.model_fields.items():
        names = frozenset(_input_names(name, info))
        if len(names) > 1:
            out.update(dict.fromkeys(names, names))
    return out


#: Per context class, how to check a client's values: a pydantic model's validator, else
#: one per field its type hints name (a dataclass's `__post_init__` is not run for it;
#: LangGraph builds a dataclass without validation, a TypedDict is passed as it is).
_CHECKERS: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()
_ARBITRARY: Final = pydantic.ConfigDict(arbitrary_types_allowed=True)


def _checker(schema: type) -> Any:
    checker = _CHECKERS.get(schema)
    if checker is None:
        if issubclass(schema, pydantic.BaseModel):
            checker = pydantic.TypeAdapter(schema)
        else:
            checker = {}
            hints = _hints(schema) or {}
            if dataclasses.is_dataclass(schema):  # (not its ClassVars, nor init=False)
                hints = {f.name: hints[f.name] for f in dataclasses.fields(schema)
                         if f.init and f.name in hints}
            for name, hint in hints.items():
                adapter = _adapter(_bare(hint))
                if adapter is not None:  # (else a type pydantic cannot check: the graph's)
                    checker[name] = adapter
        _CHECKERS[schema] = checker
    return checker


#: A TypedDict's key qualifiers: pydantic takes a hint wrapped in one for any value.
_QUALIFIERS: Final = frozenset({typing.Required, typing.NotRequired,
                                typing_extensions.Required, typing_extensions.NotRequired,
                                typing_extensions.ReadOnly})


def _bare(hint: Any) -> Any:
    """`hint` without its TypedDict qualifiers, at any depth of `Annotated` (whose other
    metadata, such as pydantic's constraints, stays)."""
    origin = typing.get_origin(hint)
    if origin in _QUALIFIERS:
        return _bare(typing.get_args(hint)[0])
    if origin is typing.Annotated:
        inner = _bare(hint.__origin__)
        if inner is not hint.__origin__:
            return typing.Annotated[(inner, *hint.__metadata__)]
    return hint


def _adapter(hint: Any) -> pydantic.TypeAdapter[Any] | None:
    # A model or pydantic dataclass refuses a config of its own: it has one.
    for config in (_ARBITRARY, None):
        try:
            return pydantic.TypeAdapter(hint, config=config)
        except Exception:
            continue
    return None


def check_client_context(schema: Any, context: Mapping[str, Any],
                         client_keys: Collection[str]) -> dict[str, Any]:
    """Refuse (`InvalidRequestError`) a client's value of `context` (the run's whole
    `configurable`) that the context schema's type refuses. Checked once, before the run:
    inside the graph it failed as the agent's error, logged with a traceback at any
    client's will. The operator's values are the graph's to judge, as before.

    Returns the client's values as the check made them ("7" for an `int`, a dict for a
    model or dataclass field), to run with: LangGraph validates a pydantic context
    itself, but builds a dataclass without coercion and passes a TypedDict as it is, so
    the graph got a value other than the one checked (none for a pydantic context)."""
    checked: dict[str, Any] = {}
    if not client_keys or not isinstance(schema, type):
        return checked
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
                checked[key] = adapter.validate_python(context[key])
            except pydantic.ValidationError as exc:
                bad.append(f"{key}: {exc.errors()[0]['msg']}")
    if bad:
        raise InvalidRequestError("; ".join(
            f"forwardedProps.config.configurable.{said}" for said in sorted(set(bad))))
    return checked


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
                      bound: int, operator: Collection[str] = (),
                      names: Mapping[str, Collection[str]] | None = None) -> dict[str, Any]:
    """The run's config: `base` (the agent's) with what the client `sent` may set (see
    the module docstring). `operator`: keys set elsewhere than `base` that stay the
    operator's (a Platform assistant's). `names`: per key, all the keys of its field
    (`context_key_names`): if the operator set one, the client sets none."""
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
    kept = {*own, *operator}
    for key in list(kept):
        kept.update((names or {}).get(key, ()))
    taken = {key: value for key, value in (configurable or {}).items()
             if key in declared and key not in OWNED_KEYS
             and not key.startswith(OWNED_PREFIXES) and key not in kept}
    if taken:
        config["configurable"] = {**own, **taken}
    if limit is not None:
        config["recursion_limit"] = min(limit, bound)
    return config
