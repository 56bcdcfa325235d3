"""Coercing an operation's variables, compiled per input type.

graphql-core's `get_variable_values` dispatches on the type at every value of the input
and walks the whole input once more to bound its nesting; for the 1.10 client's mutation
that is most of the GraphQL-specific CPU of a chat. `VariableCoercer` compiles each input
type once into a function that coerces a value exactly as `coerce_input_value` does, and
gives up on anything unusual (a value it would refuse, a non-list for a list, a variable
default, nesting beyond graphql-core's bound): then graphql-core itself runs, so every
error, message included, is the library's own. Only successes take the short path.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from graphql import (
    GraphQLEnumType,
    GraphQLError,
    GraphQLInputObjectType,
    GraphQLInputType,
    GraphQLList,
    GraphQLNamedType,
    GraphQLNonNull,
    GraphQLScalarType,
    GraphQLSchema,
    GraphQLString,
    Undefined,
    VariableDefinitionNode,
)
from graphql.execution.get_variable_signature import (
    GraphQLVariableSignature,
    get_variable_signature,
)
from graphql.execution.values import (
    VariableValues,
    VariableValueSource,
    get_variable_values,
)
from graphql.language.parser import MAX_NESTING_DEPTH
from graphql.type import is_required_input_field
from graphql.utilities.coerce_input_value import coerce_default_value

from copilot_runtime._limits import MAX_INPUT_ITEMS

__all__ = ["Signatures", "VariableCoercer"]

_Coerce = Callable[[Any, int], Any]
#: An operation's variables, each with its compiled coercer.
Signatures = tuple[tuple[GraphQLVariableSignature, _Coerce], ...]
#: Variable errors reported at most (graphql-core then adds one saying it stopped).
MAX_ERRORS = 50
#: Values one list of a variable may hold (the 1.10 client's messages, actions, context...),
#: as a run's input lists at most `MAX_INPUT_ITEMS` items over AG-UI.
MAX_LIST_VALUES = MAX_INPUT_ITEMS


class _GiveUp(Exception):
    """The short path cannot decide: graphql-core coerces (and reports) instead."""


class _TooMany(Exception):
    """A list longer than `MAX_LIST_VALUES`: refused before any of it is coerced."""



class VariableCoercer:
    """`coerce(definitions, inputs)`: what `get_variable_values` returns, sooner."""

    def __init__(self, schema: GraphQLSchema) -> None:
        self.schema = schema
        self._compiled: dict[tuple[GraphQLNamedType, bool], _Coerce] = {}

    def signatures(self, definitions: Collection[VariableDefinitionNode]) -> Signatures | None:
        """The operation's variables with their coercers (None: leave them to graphql-core).

        Worth keeping per operation: it depends only on the document."""
        found = []
        for node in definitions:
            signature = get_variable_signature(self.schema, node)
            if isinstance(signature, GraphQLError) or node.default_value is not None:
                return None
            found.append((signature, self._coercer(signature.type)))
        return tuple(found)

    def coerce(self, definitions: Collection[VariableDefinitionNode], inputs: dict[str, Any],
               signatures: Signatures | None = None, *, slow: bool = True
               ) -> VariableValues | list[GraphQLError] | None:
        """The variables coerced, or graphql-core's errors; None when the short path cannot
        decide and `slow` is False (the caller runs it again, slow, off the event loop:
        graphql-core walks all of a large input, ~1 s a million values, before it says
        anything)."""
        if signatures is None:
            signatures = self.signatures(definitions)
        if signatures is not None:
            sources: dict[str, VariableValueSource] = {}
            coerced: dict[str, Any] = {}
            try:
                for signature, coerce in signatures:
                    name = signature.name
                    value = inputs.get(name, Undefined)
                    if value is Undefined:
                        if isinstance(signature.type, GraphQLNonNull):
                            raise _GiveUp
                        # An omitted nullable variable without a default is left out.
                        sources[name] = VariableValueSource(signature)
                        continue
                    sources[name] = VariableValueSource(signature, value)
                    try:
                        coerced[name] = coerce(value, 0)
                    except _TooMany:
                        return [GraphQLError(
                            f"Variable '${name}' has a list of more than {MAX_LIST_VALUES:,} "
                            "values: at most that many are taken")]
                return VariableValues(sources, coerced)
            except (_GiveUp, RecursionError):
                pass
        if not slow:
            return None
        # Bounded: each error costs a message built and sent (a million `{}` messages took
        # the event loop ~150 s to refuse); graphql-core stops at the bound, saying so.
        return get_variable_values(self.schema, definitions, inputs, max_errors=MAX_ERRORS)

    # -- compiling -------------------------------------------------------------------------

    def _coercer(self, type_: GraphQLInputType, non_null: bool = False) -> _Coerce:
        """`type_`'s coercer; with `non_null`, one that also refuses null (so a non-null
        type costs no call of its own)."""
        if isinstance(type_, GraphQLNonNull):
            return self._coercer(type_.of_type, True)
        if isinstance(type_, GraphQLList):
            # Wrappers are made afresh for each variable definition: not worth keeping.
            return self._compile(type_, non_null)
        key = (type_, non_null)
        found = self._compiled.get(key)
        if found is None:
            # Registered before it is built, so that recursive input types terminate.
            cell: list[_Coerce] = []
            self._compiled[key] = lambda value, depth: cell[0](value, depth)
            found = self._compile(type_, non_null)
            cell.append(found)
            self._compiled[key] = found
        return found

    def _compile(self, type_: GraphQLInputType, non_null: bool) -> _Coerce:
        if isinstance(type_, GraphQLList):
            item = self._coercer(type_.of_type)

            def list_of(value: Any, depth: int) -> Any:
                if value is None:
                    if non_null:
                        raise _GiveUp
                    return None
                if type(value) is not list or depth >= MAX_NESTING_DEPTH:
                    raise _GiveUp  # a value as a list of one; or too deep: the library's
                if len(value) > MAX_LIST_VALUES:
                    raise _TooMany
                depth += 1
                return [item(v, depth) for v in value]
            return list_of
        if isinstance(type_, GraphQLInputObjectType):
            return self._compile_object(type_, non_null)
        if type_ is GraphQLString:
            def string(value: Any, _depth: int) -> Any:
                if type(value) is str or (value is None and not non_null):
                    return value
                raise _GiveUp
            return string
        assert isinstance(type_, GraphQLScalarType | GraphQLEnumType)
        leaf = type_.coerce_input_value

        def scalar(value: Any, _depth: int) -> Any:
            if value is None:
                if non_null:
                    raise _GiveUp
                return None
            try:
                return leaf(value)
            except Exception:  # refused: the library says why
                raise _GiveUp from None
        return scalar

    def _compile_object(self, type_: GraphQLInputObjectType, non_null: bool) -> _Coerce:
        if type_.is_one_of:
            raise_always: _Coerce = _give_up
            return raise_always
        # Whether a missing field takes a default (else `coerce_default_value` gives
        # `Undefined`), decided once: most of the client's optional fields are missing.
        fields = [(name, field.out_name or name, self._coercer(field.type),
                   is_required_input_field(field),
                   field.default is not None or field.default_value is not Undefined, field)
                  for name, field in type_.fields.items()]
        known = frozenset(type_.fields)
        out_type = type_.out_type
        plain = out_type is GraphQLInputObjectType.out_type

        def input_object(value: Any, depth: int) -> Any:
            if value is None:
                if non_null:
                    raise _GiveUp
                return None
            if type(value) is not dict or depth >= MAX_NESTING_DEPTH or not known.issuperset(
                    value):
                raise _GiveUp
            depth += 1
            coerced: dict[str, Any] = {}
            for name, out_name, coerce, required, defaulted, field in fields:
                if name in value:
                    coerced[out_name] = coerce(value[name], depth)
                elif required:
                    raise _GiveUp
                elif defaulted:
                    default = coerce_default_value(field)
                    if default is not Undefined:
                        coerced[out_name] = default
            return coerced if plain else out_type(coerced)
        return input_object


def _give_up(_value: Any, _depth: int) -> Any:
    raise _GiveUp
