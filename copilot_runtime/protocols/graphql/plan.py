"""What a `generateCopilotResponse` operation selects, compiled once into a projection plan.

The streaming path never executes GraphQL: it builds each response object by walking a plan
compiled from the operation's selection set (per concrete type: which response keys, from
which fields, with which sub-selections, and which ones `@defer` or `@stream` ask to send
later). Compiling honours aliases, fragments, type conditions, `@include`/`@skip` and the
labels of `@defer`/`@stream`.

`@defer` is honoured where something is worth waiting for: on `CopilotResponse` (its
`status` is known when the run ends) and on messages (their `status` is known when they end).
`@stream` is honoured on `messages`, `metaEvents`, `content` and `arguments`. Everywhere else
the data is complete when its parent is sent, so those directives are delivered inline,
which the incremental-delivery proposal allows a server to do. `initialCount` is treated as
0: urql merges items by index, so the merged result is the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphql import (
    FieldNode,
    FragmentDefinitionNode,
    FragmentSpreadNode,
    GraphQLDeferDirective,
    GraphQLError,
    GraphQLIncludeDirective,
    GraphQLNamedType,
    GraphQLObjectType,
    GraphQLSchema,
    GraphQLSkipDirective,
    GraphQLStreamDirective,
    InlineFragmentNode,
    NamedTypeNode,
    OperationDefinitionNode,
    SelectionSetNode,
    get_named_type,
    is_abstract_type,
    is_composite_type,
)
from graphql.execution.values import VariableValues, get_directive_values

__all__ = [
    "Deferred",
    "Field",
    "ObjectPlan",
    "OperationPlan",
    "Selection",
    "compile_operation",
]

ROOT_FIELD = "generateCopilotResponse"
ROOT_TYPE = "CopilotResponse"
# Fields whose value arrives over time, so their parent cannot be sent complete before then.
_ASYNC_FIELDS = frozenset({"status", "messages", "metaEvents", "content", "arguments"})


@dataclass(frozen=True, slots=True)
class Field:
    key: str
    name: str
    #: Plans of the field's concrete types, for object, interface and union fields.
    sub: Selection | None = None
    stream: bool = False
    label: str | None = None


@dataclass(frozen=True, slots=True)
class Deferred:
    fields: tuple[Field, ...]
    label: str | None


@dataclass(frozen=True, slots=True)
class ObjectPlan:
    fields: tuple[Field, ...]
    deferred: tuple[Deferred, ...] = ()
    #: The key of the one streamed `content`/`arguments`/`messages`/... field, if any.
    streamed: Mapping[str, Field] = field(default_factory=dict)
    #: Whether the initial fields include one that is not known until later (an inline
    #: `status`, or a list that is neither streamed nor complete yet).
    waits: bool = False


#: Concrete type name -> its plan.
Selection = Mapping[str, ObjectPlan]


@dataclass(frozen=True, slots=True)
class OperationPlan:
    """How to answer one `generateCopilotResponse` operation."""

    #: The operation's own selections in order: ("__typename" | "root", response key).
    top: tuple[tuple[str, str], ...]
    root_key: str
    field_node: FieldNode
    #: Every field inline: the single-result form.
    flat: ObjectPlan
    #: Honouring `@defer`/`@stream`, or None when the selection needs the whole run first.
    incremental: ObjectPlan | None


@dataclass(frozen=True, slots=True)
class _Level:
    """Which directives are honoured at one level of the response tree, and below it."""

    defer: bool
    stream: frozenset[str]
    children: Mapping[str, _Level]


_PLAIN = _Level(False, frozenset(), {})
_MESSAGE = _Level(True, frozenset({"content", "arguments"}), {})
_ROOT = _Level(True, frozenset({"messages", "metaEvents"}), {"messages": _MESSAGE})


class _Compiler:
    def __init__(self, schema: GraphQLSchema, fragments: Mapping[str, FragmentDefinitionNode],
                 variables: VariableValues | None, honour: bool) -> None:
        self.schema = schema
        self.fragments = fragments
        self.variables = variables
        self.honour = honour

    # -- selection sets ------------------------------------------------------------------

    def selection(self, type_: GraphQLNamedType, sets: Sequence[SelectionSetNode],
                  level: _Level) -> Selection:
        if is_abstract_type(type_):
            concrete = self.schema.get_possible_types(type_)
        else:
            assert isinstance(type_, GraphQLObjectType)
            concrete = [type_]
        return {t.name: self.object(t, sets, level) for t in concrete}

    def object(self, type_: GraphQLObjectType, sets: Sequence[SelectionSetNode],
               level: _Level) -> ObjectPlan:
        initial: dict[str, list[FieldNode]] = {}
        groups: list[tuple[str | None, dict[str, list[FieldNode]]]] = []
        for selection_set in sets:
            self._collect(type_, selection_set, initial, groups, level, set())
        fields = tuple(self._field(type_, key, nodes, level) for key, nodes in initial.items())
        deferred = tuple(
            Deferred(tuple(self._field(type_, key, nodes, level, in_defer=True)
                           for key, nodes in group.items()), label)
            for label, group in groups if group)
        streamed: dict[str, Field] = {}
        waits = False
        for f in fields:
            if f.stream:
                if f.name in streamed:
                    waits = True  # the same list under two streamed keys: send it complete
                streamed[f.name] = f
            elif f.name in _ASYNC_FIELDS:
                waits = True
        return ObjectPlan(fields, deferred, streamed, waits)

    def _collect(self, type_: GraphQLObjectType, selection_set: SelectionSetNode,
                 into: dict[str, list[FieldNode]],
                 groups: list[tuple[str | None, dict[str, list[FieldNode]]]],
                 level: _Level, visited: set[str]) -> None:
        for node in selection_set.selections:
            if not self._included(node):
                continue
            if isinstance(node, FieldNode):
                key = node.alias.value if node.alias else node.name.value
                into.setdefault(key, []).append(node)
                continue
            if isinstance(node, InlineFragmentNode):
                condition, inner = node.type_condition, node.selection_set
            else:
                assert isinstance(node, FragmentSpreadNode)
                name = node.name.value
                fragment = self.fragments.get(name)
                if fragment is None or name in visited:
                    continue
                visited = visited | {name}
                condition, inner = fragment.type_condition, fragment.selection_set
            if not self._applies(condition, type_):
                continue
            label = self._defer(node) if level.defer else None
            if label is not None:
                group: dict[str, list[FieldNode]] = {}
                groups.append((label or None, group))
                self._collect(type_, inner, group, groups, level, visited)
            else:
                self._collect(type_, inner, into, groups, level, visited)

    def _field(self, parent: GraphQLObjectType, key: str, nodes: list[FieldNode],
               level: _Level, *, in_defer: bool = False) -> Field:
        name = nodes[0].name.value
        if name.startswith("__"):
            return Field(key, name)
        field_type = get_named_type(parent.fields[name].type)
        sub: Selection | None = None
        if is_composite_type(field_type):
            sets = [n.selection_set for n in nodes if n.selection_set is not None]
            sub = self.selection(field_type, sets, level.children.get(name, _PLAIN))
        stream_label: str | None = None
        if name in level.stream and not in_defer:
            stream_label = self._stream(nodes)
        return Field(key, name, sub, stream_label is not None, stream_label or None)

    # -- directives ----------------------------------------------------------------------

    def _included(self, node: FieldNode | InlineFragmentNode | Any) -> bool:
        skip = get_directive_values(GraphQLSkipDirective, node, self.variables)
        if skip is not None and skip.get("if") is True:
            return False
        include = get_directive_values(GraphQLIncludeDirective, node, self.variables)
        return include is None or include.get("if") is not False

    def _defer(self, node: InlineFragmentNode | FragmentSpreadNode) -> str | None:
        """The label ("" when none) if `node` is deferred, else None."""
        if not self.honour:
            return None
        args = get_directive_values(GraphQLDeferDirective, node, self.variables)
        if args is None or args.get("if") is False:
            return None
        label = args.get("label")
        return label if isinstance(label, str) else ""

    def _stream(self, nodes: list[FieldNode]) -> str | None:
        if not self.honour:
            return None
        for node in nodes:
            args = get_directive_values(GraphQLStreamDirective, node, self.variables)
            if args is not None and args.get("if") is not False:
                label = args.get("label")
                return label if isinstance(label, str) else ""
        return None

    def _applies(self, condition: NamedTypeNode | None, type_: GraphQLObjectType) -> bool:
        if condition is None:
            return True
        named = self.schema.get_type(condition.name.value)
        if named is None:
            return False
        if named is type_:
            return True
        return is_abstract_type(named) and self.schema.is_sub_type(named, type_)


def _waits(root: ObjectPlan) -> bool:
    """Whether something must be complete before it is sent: then nothing is streamed.

    A streamed message is sent when it starts, so its own plan must not wait (say, for an
    inline `status`); sending later messages first would leave holes in the list.
    """
    messages = root.streamed.get("messages")
    return root.waits or (messages is not None and messages.sub is not None
                          and any(plan.waits for plan in messages.sub.values()))


def compile_operation(schema: GraphQLSchema, operation: OperationDefinitionNode,
                      fragments: Mapping[str, FragmentDefinitionNode],
                      variables: VariableValues | None) -> OperationPlan:
    """The plan of a validated mutation, or GraphQLError if it asks for more than one run."""
    mutation = schema.mutation_type
    assert mutation is not None
    root_type = schema.get_type(ROOT_TYPE)
    assert isinstance(root_type, GraphQLObjectType)
    flat_compiler = _Compiler(schema, fragments, variables, honour=False)
    top: dict[str, list[FieldNode]] = {}
    flat_compiler._collect(mutation, operation.selection_set, top, [], _PLAIN, set())
    roots = [(key, nodes) for key, nodes in top.items() if nodes[0].name.value == ROOT_FIELD]
    if len(roots) != 1:
        raise GraphQLError("An operation may run generateCopilotResponse only once",
                           operation)
    root_key, root_nodes = roots[0]
    sets = [n.selection_set for n in root_nodes if n.selection_set is not None]
    flat = flat_compiler.object(root_type, sets, _ROOT)
    incremental: ObjectPlan | None = _Compiler(schema, fragments, variables, honour=True).object(
        root_type, sets, _ROOT)
    if incremental is not None and _waits(incremental):
        incremental = None
    order = tuple(("root" if nodes[0].name.value == ROOT_FIELD else "__typename", key)
                  for key, nodes in top.items())
    return OperationPlan(order, root_key, root_nodes[0], flat, incremental)
