"""Building response objects from a plan: the only "execution" the streaming path does.

A value is handed over as `(typename, fields)`: the concrete type and a mapping from schema
field names to values (objects again as `(typename, fields)`, lists of them as lists). The
projection picks, renames and orders what the operation selected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from copilot_runtime.protocols.graphql.plan import Field, ObjectPlan

__all__ = ["Obj", "project", "project_fields"]

#: An object value: its concrete GraphQL type and its fields by schema name.
Obj = tuple[str, Mapping[str, Any]]


def project(plan: ObjectPlan, typename: str, values: Mapping[str, Any], *,
            streaming: bool = False) -> dict[str, Any]:
    """The object as selected; with `streaming`, streamed lists start empty."""
    return project_fields(plan.fields, typename, values, streaming=streaming)


def project_fields(fields: Sequence[Field], typename: str, values: Mapping[str, Any], *,
                   streaming: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields:
        if f.name == "__typename":
            out[f.key] = typename
            continue
        value = values.get(f.name)
        if streaming and f.stream:
            out[f.key] = []  # the items follow as increments
        elif f.sub is None or value is None:
            out[f.key] = value
        elif isinstance(value, list):
            sub = f.sub
            out[f.key] = [project(sub[t], t, v) for t, v in value]
        else:
            t, v = value
            out[f.key] = project(f.sub[t], t, v)
    return out
