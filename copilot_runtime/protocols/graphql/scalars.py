"""The three custom scalars of the schema: `DateTimeISO`, `JSON` and `JSONObject`.

`build_schema` leaves custom scalars as identity functions; these give them the coercion
rules the TypeScript runtime applies, so a bad `createdAt` or a non-object `properties` is
refused while variables are coerced (a 400, as there), not deep inside a run.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson
from graphql import (
    GraphQLError,
    GraphQLScalarType,
    GraphQLSchema,
    ObjectValueNode,
    StringValueNode,
    ValueNode,
    print_ast,
    value_from_ast_untyped,
)

from copilot_runtime._limits import MAX_JSON_DEPTH, too_deep

__all__ = ["install_scalars"]


def _parse_datetime(value: Any) -> str:
    # Kept as the string the client sent: the runtime never needs it as a datetime.
    if isinstance(value, str) and "T" in value:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            parsed = None
        if parsed is not None and parsed.tzinfo is not None:
            return value
    raise GraphQLError(f"DateTimeISO expects an RFC 3339 date-time with an offset, got {value!r}")


def _parse_datetime_literal(node: ValueNode, _variables: Any = None) -> str:
    if not isinstance(node, StringValueNode):
        raise GraphQLError(f"DateTimeISO expects a string, got {print_ast(node)}")
    return _parse_datetime(node.value)


def _serialize_datetime(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    if isinstance(value, str):
        return value
    raise GraphQLError(f"DateTimeISO cannot serialize {type(value).__name__}")


def _parse_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise GraphQLError(f"JSONObject expects a JSON object, got {type(value).__name__}")
    return value




def _json_literal(node: ValueNode, variables: Any) -> Any:
    """A literal as JSON, held to what a JSON body may carry: GraphQL's integer literals have
    no size limit and its literals nest up to the parser's 200 levels, but orjson writes
    only 64-bit integers, and every JSON input is bounded to `MAX_JSON_DEPTH`."""
    value = value_from_ast_untyped(node, variables)
    if too_deep(value, MAX_JSON_DEPTH):
        raise GraphQLError(f"JSON is nested too deep (at most {MAX_JSON_DEPTH} levels)")
    try:
        orjson.dumps(value)  # what every later stage does with it
    except orjson.JSONEncodeError:
        raise GraphQLError("JSON integers must fit in 64 bits") from None
    return value


def _parse_object_literal(node: ValueNode, variables: Any = None) -> dict[str, Any]:
    if not isinstance(node, ObjectValueNode):
        raise GraphQLError(f"JSONObject expects an object, got {print_ast(node)}")
    return _parse_object(_json_literal(node, variables))


def _identity(value: Any) -> Any:
    return value


def _parse_json_literal(node: ValueNode, variables: Any = None) -> Any:
    return _json_literal(node, variables)


def install_scalars(schema: GraphQLSchema) -> None:
    """Give the schema's custom scalars their coercion functions (in place)."""
    rules: dict[str, tuple[Any, Any, Any]] = {
        "DateTimeISO": (_serialize_datetime, _parse_datetime, _parse_datetime_literal),
        "JSON": (_identity, _identity, _parse_json_literal),
        "JSONObject": (_parse_object, _parse_object, _parse_object_literal),
    }
    for name, (serialize, parse_value, parse_literal) in rules.items():
        scalar = schema.type_map[name]
        assert isinstance(scalar, GraphQLScalarType)
        # graphql-core 3.3 reads the `coerce_*` attributes (copied from these at build time);
        # both are set so every code path of the library sees the same rules.
        scalar.serialize = scalar.coerce_output_value = serialize  # type: ignore[method-assign]
        scalar.parse_value = scalar.coerce_input_value = parse_value  # type: ignore[method-assign]
        scalar.parse_literal = parse_literal  # type: ignore[method-assign]
        scalar.coerce_input_literal = parse_literal
