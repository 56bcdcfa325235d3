"""Parsing and validating each distinct GraphQL document once.

Parsing and validating the 1.10 client's 5 KB mutation costs about 6 ms in graphql-core,
more than everything else a request does, and the client sends the same text every time.
`DocumentCache` keeps, per document text, the parsed document or its errors, and per
operation the compiled response plan, in a small LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from graphql import (
    DirectiveNode,
    DocumentNode,
    ExecutableDefinitionNode,
    FieldNode,
    FragmentDefinitionNode,
    FragmentSpreadNode,
    GraphQLError,
    GraphQLSchema,
    InlineFragmentNode,
    OperationDefinitionNode,
    SelectionSetNode,
    VariableNode,
    Visitor,
    parse,
    validate,
    visit,
)
from graphql.execution.values import VariableValues
from graphql.language.visitor import REMOVE

from copilot_runtime.protocols.graphql.plan import OperationPlan, compile_operation
from copilot_runtime.protocols.graphql.variables import Signatures, VariableCoercer

__all__ = ["DocumentCache", "Prepared"]

# Larger documents are still served, just not kept (the client's is about 5 KB).
_MAX_CACHED_LENGTH = 64 * 1024
# Bounds on a document, checked before validation. The 1.10 client's largest has 272 tokens,
# 98 fields and no named fragment; a tool's whole introspection 183 tokens and 3 fragments.
# Parsing 50,000 tokens, or validating a few hundred fields of one name or fragments spread
# side by side (graphql-core compares them pairwise), held the event loop for up to a second:
# every stream of the worker stalled for each such request.
_MAX_TOKENS = 2_000
# Fields, fragment spreads and inline fragments, each fragment's counted wherever it is spread
# (the client's largest document makes 121, a tool's whole introspection 239).
_MAX_SELECTIONS = 300
_MAX_FRAGMENTS = 20


class _StripIncremental(Visitor):
    """Removes `@defer` and `@stream`: queries are answered in one piece."""

    def enter_directive(self, node: DirectiveNode, *_args: Any) -> Any:
        return REMOVE if node.name.value in ("defer", "stream") else None


class _DirectiveVariables(Visitor):
    def __init__(self) -> None:
        super().__init__()
        self.found = False

    def enter_directive(self, node: DirectiveNode, *_args: Any) -> Any:
        if any(isinstance(arg.value, VariableNode) for arg in node.arguments or ()):
            self.found = True


@dataclass(slots=True)
class Prepared:
    """A document as parsed and validated, or the errors that stopped it."""

    document: DocumentNode | None
    errors: list[GraphQLError]
    #: `GRAPHQL_PARSE_FAILED` or `GRAPHQL_VALIDATION_FAILED` when there are errors.
    code: str | None = None
    fragments: dict[str, FragmentDefinitionNode] = field(default_factory=dict)
    #: Whether directives take variables, so plans depend on the request.
    variable_directives: bool = False
    _plans: dict[str | None, OperationPlan | GraphQLError] = field(default_factory=dict)
    _plain: DocumentNode | None = None
    _signatures: dict[str | None, Signatures | None] = field(default_factory=dict)

    def coerce(self, coercer: VariableCoercer, operation: OperationDefinitionNode,
               variables: dict[str, Any], *, slow: bool = True
               ) -> VariableValues | list[GraphQLError] | None:
        """The operation's variables coerced (its signatures are worked out once); see
        `VariableCoercer.coerce` for `slow`."""
        name = operation.name.value if operation.name else None
        definitions = operation.variable_definitions or ()
        try:
            signatures = self._signatures[name]
        except KeyError:
            signatures = self._signatures[name] = coercer.signatures(definitions)
        return coercer.coerce(definitions, variables, signatures, slow=slow)

    def plain(self) -> DocumentNode:
        """The document without `@defer`/`@stream`, for one-piece execution."""
        if self._plain is None:
            assert self.document is not None
            self._plain = visit(self.document, _StripIncremental())
        return self._plain

    def plan(self, schema: GraphQLSchema, operation: OperationDefinitionNode,
             variables: VariableValues) -> OperationPlan:
        """The operation's response plan (cached unless it depends on the variables)."""
        if self.variable_directives:
            return compile_operation(schema, operation, self.fragments, variables)
        name = operation.name.value if operation.name else None
        cached = self._plans.get(name)
        if cached is None:
            try:
                cached = compile_operation(schema, operation, self.fragments, None)
            except GraphQLError as exc:
                cached = exc
            self._plans[name] = cached
        if isinstance(cached, GraphQLError):
            raise cached
        return cached


class DocumentCache:
    def __init__(self, schema: GraphQLSchema, size: int = 128) -> None:
        self.schema = schema
        self.size = size
        self._entries: OrderedDict[str, Prepared] = OrderedDict()

    def get(self, text: str) -> Prepared:
        entry = self._entries.get(text)
        if entry is not None:
            self._entries.move_to_end(text)
            return entry
        entry = self._prepare(text)
        if len(text) <= _MAX_CACHED_LENGTH:
            self._entries[text] = entry
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return entry

    def _prepare(self, text: str) -> Prepared:
        try:
            document = parse(text, max_tokens=_MAX_TOKENS, allow_empty_selection_sets=False)
        except GraphQLError as exc:
            return Prepared(None, [exc], "GRAPHQL_PARSE_FAILED")
        too_big = _too_big(document)
        if too_big is not None:
            return Prepared(None, [GraphQLError(too_big)], "GRAPHQL_VALIDATION_FAILED")
        errors = validate(self.schema, document, allow_empty_selection_sets=False)
        if errors:
            return Prepared(None, errors, "GRAPHQL_VALIDATION_FAILED")
        fragments = {d.name.value: d for d in document.definitions
                     if isinstance(d, FragmentDefinitionNode)}
        repeated = _loads_state_repeatedly(document, fragments)
        if repeated is not None:
            return Prepared(None, [repeated], "GRAPHQL_VALIDATION_FAILED")
        finder = _DirectiveVariables()
        visit(document, finder)
        return Prepared(document, [], None, fragments, finder.found)


def _too_big(document: DocumentNode) -> str | None:
    """Why the document is beyond the bounds validation and execution are cheap within, if
    it is.

    Selections are counted as written and as executed: a fragment's as often as it is
    spread, so that spreads under many aliases multiply (20 aliases of a fragment that holds
    20 aliases spreading another counted 66 selections as written, and held the event loop
    for 6.7 s while they were executed).
    """
    fragments = [d for d in document.definitions if isinstance(d, FragmentDefinitionNode)]
    if len(fragments) > _MAX_FRAGMENTS:
        return (f"The document defines {len(fragments)} fragments; at most {_MAX_FRAGMENTS} "
                "are served")
    written = {d: _written(d.selection_set) for d in document.definitions
               if isinstance(d, ExecutableDefinitionNode)}
    by_name: dict[str, tuple[int, list[str]]] = {}
    for fragment in fragments:
        by_name.setdefault(fragment.name.value, written[fragment])
    sizes: dict[str, int] = {}

    def expanded(name: str) -> int:
        """The fragment's selections with its own spreads expanded (capped past the bound)."""
        size = sizes.get(name)
        if size is None:
            sizes[name] = 0  # a cycle (which validation refuses) adds nothing
            count, spreads = by_name.get(name, (0, []))
            for spread in spreads:
                count = min(count + expanded(spread), _MAX_SELECTIONS + 1)
            size = sizes[name] = count
        return size

    spread = {name for _, spreads in written.values() for name in spreads}
    executed = sum(count + sum(expanded(name) for name in spreads)
                   for definition, (count, spreads) in written.items()
                   if isinstance(definition, OperationDefinitionNode))
    executed += sum(expanded(name) for name in by_name if name not in spread)
    if max(executed, sum(count for count, _ in written.values())) > _MAX_SELECTIONS:
        return (f"The document makes more than {_MAX_SELECTIONS} selections (fields and "
                f"fragments); at most {_MAX_SELECTIONS} are served")
    return None


def _written(selection_set: SelectionSetNode) -> tuple[int, list[str]]:
    """The selections of `selection_set` and below as written, and the fragments spread."""
    count, spreads = 0, []
    pending = [selection_set]
    while pending:
        selections = pending.pop().selections
        count += len(selections)
        for selection in selections:
            if isinstance(selection, FragmentSpreadNode):
                spreads.append(selection.name.value)
            elif (inner := getattr(selection, "selection_set", None)) is not None:
                pending.append(inner)
    return count, spreads


def _loads_state_repeatedly(document: DocumentNode,
                            fragments: dict[str, FragmentDefinitionNode]) -> GraphQLError | None:
    """An operation that selects `loadAgentState` under more than one response key: each
    reads and serialises a whole thread (up to the replay cap), so a few hundred bytes of
    aliases built hundreds of MB of answer. Fragments count wherever spread, and fields
    count whatever their `@skip`/`@include` (a document is checked once, not per request).
    """
    for operation in document.definitions:
        if not isinstance(operation, OperationDefinitionNode):
            continue
        found: dict[str, FieldNode] = {}
        read: set[str] = set()
        pending = [operation.selection_set]
        while pending:  # the field is on Query only, so only the top level can hold it
            for selection in pending.pop().selections:
                if isinstance(selection, FieldNode):
                    if selection.name.value == "loadAgentState":
                        found.setdefault((selection.alias or selection.name).value, selection)
                elif isinstance(selection, InlineFragmentNode):
                    pending.append(selection.selection_set)
                elif isinstance(selection, FragmentSpreadNode) \
                        and selection.name.value not in read:
                    read.add(selection.name.value)
                    fragment = fragments.get(selection.name.value)
                    if fragment is not None:
                        pending.append(fragment.selection_set)
        if len(found) > 1:
            return GraphQLError(
                f"An operation may select loadAgentState once at most (each reads and sends a "
                f"whole thread); this one selects it under {len(found)} names",
                list(found.values())[:2])
    return None
