"""What a `generateCopilotResponse` operation selects, compiled once into a projection plan.

The streaming path never executes GraphQL: it builds each response object by walking a plan
compiled from the operation's selection set (per concrete type: which response keys, from
which fields, with which sub-selections, and which ones `@defer` or `@stream` ask to send
later). graphql-core's own field collection (the one its executor uses) applies aliases,
fragments, type conditions, `@include`/`@skip` and `@defer`; compiling adds where `@defer`
and `@stream` are honoured, and their labels.

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

from graphql import (
    FieldNode,
    FragmentDefinitionNode,
    FragmentSpreadNode,
    GraphQLError,
    GraphQLNamedType,
    GraphQLObjectType,
    GraphQLSchema,
    GraphQLStreamDirective,
    InlineFragmentNode,
    OperationDefinitionNode,
    SelectionSetNode,
    get_named_type,
    is_abstract_type,
    is_composite_type,
)
from graphql.execution.collect_fields import (
    CollectedFields,
    FieldDetails,
    FragmentDetails,
    collect_fields,
    collect_subfields,
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
    """Plans of selection sets, with graphql-core collecting each level's fields.

    graphql-core's collection applies `@include`/`@skip`, fragments, type conditions and
    `@defer`; the compiler only decides where `@defer` and `@stream` are honoured.
    """

    def __init__(self, schema: GraphQLSchema, operation: OperationDefinitionNode,
                 fragments: Mapping[str, FragmentDefinitionNode],
                 variables: VariableValues | None, honour: bool) -> None:
        self.schema = schema
        self.operation = operation
        self.fragments = {name: FragmentDetails(node) for name, node in fragments.items()}
        self.variables = variables if variables is not None else VariableValues({}, {})
        self.honour = honour
        self._place: Mapping[int, int] | None = None

    # -- selection sets ------------------------------------------------------------------

    def selection(self, type_: GraphQLNamedType, nodes: Sequence[FieldNode],
                  level: _Level) -> Selection:
        if is_abstract_type(type_):
            concrete = self.schema.get_possible_types(type_)
        else:
            assert isinstance(type_, GraphQLObjectType)
            concrete = [type_]
        return {t.name: self.object(t, nodes, level) for t in concrete}

    def object(self, type_: GraphQLObjectType, nodes: Sequence[FieldNode],
               level: _Level) -> ObjectPlan:
        """The plan of the sub-selections of `nodes` (fields of one key) on `type_`."""
        # The parents' defer usages stay out: each level decides its own `@defer`.
        collected = collect_subfields(self.schema, self.fragments, self.variables,
                                      self.operation, type_,
                                      [FieldDetails(node, None) for node in nodes])
        initial, groups = self._split(collected, honour_defer=self.honour and level.defer)
        fields = tuple(self._field(type_, key, group, level) for key, group in initial.items())
        deferred = tuple(
            Deferred(tuple(self._field(type_, key, group_nodes, level, in_defer=True)
                           for key, group_nodes in group.items()), label)
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

    def _split(self, collected: CollectedFields, *, honour_defer: bool
               ) -> tuple[dict[str, list[FieldNode]],
                          list[tuple[str | None, dict[str, list[FieldNode]]]]]:
        """Field nodes by response key: those sent at once, and one group per `@defer`.

        A field belongs to its innermost `@defer`; where `@defer` is not honoured, inline.
        """
        if not honour_defer or not collected.new_defer_usages:
            return {key: [detail.node for detail in details]
                    for key, details in collected.grouped_field_set.items()}, []
        initial: dict[str, list[FieldNode]] = {}
        groups: list[tuple[str | None, dict[str, list[FieldNode]]]] = [
            (usage.label or None, {}) for usage in collected.new_defer_usages]
        index = {id(usage): i for i, usage in enumerate(collected.new_defer_usages)}
        for key, details in collected.grouped_field_set.items():
            for detail in details:
                into = initial
                if detail.defer_usage is not None:
                    into = groups[index[id(detail.defer_usage)]][1]
                into.setdefault(key, []).append(detail.node)
        # graphql-core orders keys by their first selection anywhere; each payload lists its
        # keys in the order they are selected within it (as the TypeScript runtime sends them).
        place = self._places()
        return (self._in_order(initial, place),
                [(label, self._in_order(group, place)) for label, group in groups])

    @staticmethod
    def _in_order(group: dict[str, list[FieldNode]], place: Mapping[int, int]
                  ) -> dict[str, list[FieldNode]]:
        return dict(sorted(group.items(), key=lambda item: place[id(item[1][0])]))

    def _places(self) -> Mapping[int, int]:
        """Each field node's place in a depth-first reading of the operation.

        Each fragment is read once, at its first spread, so a document cannot make this
        walk grow beyond its own size.
        """
        if self._place is None:
            place: dict[int, int] = {}
            read: set[str] = set()
            stack = [iter(self.operation.selection_set.selections)]
            while stack:
                node = next(stack[-1], None)
                if node is None:
                    stack.pop()
                    continue
                inner: SelectionSetNode | None = None
                if isinstance(node, FieldNode):
                    place.setdefault(id(node), len(place))
                    inner = node.selection_set
                elif isinstance(node, InlineFragmentNode):
                    inner = node.selection_set
                elif isinstance(node, FragmentSpreadNode) and node.name.value not in read:
                    read.add(node.name.value)
                    fragment = self.fragments.get(node.name.value)
                    inner = fragment.definition.selection_set if fragment else None
                if inner is not None:
                    stack.append(iter(inner.selections))
            self._place = place
        return self._place

    def _field(self, parent: GraphQLObjectType, key: str, nodes: list[FieldNode],
               level: _Level, *, in_defer: bool = False) -> Field:
        name = nodes[0].name.value
        if name.startswith("__"):
            return Field(key, name)
        field_type = get_named_type(parent.fields[name].type)
        sub: Selection | None = None
        if is_composite_type(field_type):
            sub = self.selection(field_type, nodes, level.children.get(name, _PLAIN))
        stream_label: str | None = None
        if name in level.stream and not in_defer:
            stream_label = self._stream(nodes)
        return Field(key, name, sub, stream_label is not None, stream_label or None)

    # -- directives ----------------------------------------------------------------------

    def _stream(self, nodes: list[FieldNode]) -> str | None:
        """The label ("" when none) if one of `nodes` is streamed and honoured, else None."""
        if not self.honour:
            return None
        for node in nodes:
            args = get_directive_values(GraphQLStreamDirective, node, self.variables)
            if args is not None and args.get("if") is not False:
                label = args.get("label")
                return label if isinstance(label, str) else ""
        return None


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
    flat_compiler = _Compiler(schema, operation, fragments, variables, honour=False)
    top = collect_fields(schema, flat_compiler.fragments, flat_compiler.variables, mutation,
                         operation).grouped_field_set
    roots = [(key, details) for key, details in top.items()
             if details[0].node.name.value == ROOT_FIELD]
    if len(roots) != 1:
        # (Both ways: the only mutation there is to run is a run.)
        raise GraphQLError(
            "A mutation runs generateCopilotResponse exactly once (this one runs it "
            f"{'not at all' if not roots else f'{len(roots)} times'})", operation)
    root_key, root_details = roots[0]
    root_nodes = [detail.node for detail in root_details]
    flat = flat_compiler.object(root_type, root_nodes, _ROOT)
    incremental: ObjectPlan | None = _Compiler(
        schema, operation, fragments, variables, honour=True).object(root_type, root_nodes, _ROOT)
    if incremental is not None and _waits(incremental):
        incremental = None
    order = tuple(("root" if details[0].node.name.value == ROOT_FIELD else "__typename", key)
                  for key, details in top.items())
    return OperationPlan(order, root_key, root_nodes[0], flat, incremental)
