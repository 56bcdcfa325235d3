"""The compiled variable coercion agrees with graphql-core's `get_variable_values`.

Whatever the variables: the same coerced values when they are valid, and the very same
errors (messages, locations) when they are not. Generated variants of a full chat request
(Hypothesis), and the cases the short path leaves to the library on purpose.
"""

from __future__ import annotations

import copy
from typing import Any

from graphql import (
    GraphQLError,
    OperationDefinitionNode,
    build_schema,
    get_operation_ast,
    parse,
)
from graphql.execution.values import VariableValues, get_variable_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from copilot_runtime.protocols.graphql.schema import copilot_schema
from copilot_runtime.protocols.graphql.variables import VariableCoercer
from tests.gql.wire import CLIENT_DOCUMENT, call_message, chat_data, result_message, text_message

SCHEMA = copilot_schema()
COERCER = VariableCoercer(SCHEMA)
_operation = get_operation_ast(parse(CLIENT_DOCUMENT))
assert isinstance(_operation, OperationDefinitionNode)
OPERATION = _operation


def _full() -> dict[str, Any]:
    messages = [
        text_message("s", "system", "Be brief."),
        text_message("u", "user", "hi"),
        call_message("c", "lookup", '{"q": 1}', parent="a"),
        result_message("r", "c", "lookup", "found"),
        {"id": "g", "createdAt": "2025-01-01T00:00:00+02:00", "agentStateMessage": {
            "active": True, "agentName": "a", "nodeName": "n", "role": "assistant",
            "runId": "r", "running": False, "state": "{}", "threadId": "t"}},
        {"id": "i", "createdAt": "2025-01-01T00:00:00Z", "imageMessage": {
            "bytes": "AAAA", "format": "png", "role": "user"}},
    ]
    actions = [{"name": "lookup", "description": "d", "jsonSchema": "{}",
                "available": "enabled"}]
    return chat_data(
        messages, actions=actions, agentSession={"agentName": "a", "nodeName": None},
        agentStates=[{"agentName": "a", "state": "{}", "config": None}],
        cloud={"guardrails": {"inputValidationRules": {"denyList": ["x"]}}},
        forwardedParameters={"maxTokens": 5, "temperature": 0.5, "stop": ["\n"],
                             "toolChoice": "auto"},
        metaEvents=[{"name": "LangGraphInterruptEvent", "value": "v", "response": "ok",
                     "messages": [text_message("m", "user", "x")]}],
        context=[{"description": "d", "value": "v"}])


def _same(variables: dict[str, Any], operation: OperationDefinitionNode = OPERATION,
          coercer: VariableCoercer = COERCER) -> None:
    definitions = operation.variable_definitions or ()
    expected = get_variable_values(coercer.schema, definitions, variables)
    got = coercer.coerce(definitions, variables)
    if isinstance(expected, list):
        assert isinstance(got, list)
        assert [e.formatted for e in got] == [e.formatted for e in expected]
    else:
        assert isinstance(got, VariableValues)
        assert got.coerced == expected.coerced
        assert {k: (s.signature.name, str(s.signature.type), s.value)
                for k, s in got.sources.items()} == {
            k: (s.signature.name, str(s.signature.type), s.value)
            for k, s in expected.sources.items()}


_ODD = st.sampled_from([None, 0, 1.5, True, "", "x", [], ["x"], {}, {"zz": 1},
                        "2025-01-01", "2025-01-01T00:00:00Z", "enabled", "user", "Chat"])


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*path, index))
    return found


@st.composite
def _variant(draw: st.DrawFn) -> dict[str, Any]:
    variables: dict[str, Any] = {"data": _full(), "properties": {"a": [1, {"b": 2}]}}
    for _ in range(draw(st.integers(0, 3))):
        paths = [p for p in _paths(variables) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = variables
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["delete", "replace", "add"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "replace":
            parent[path[-1]] = copy.deepcopy(draw(_ODD))
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(["zz", "id", "name", "role"]))] = copy.deepcopy(draw(_ODD))
        else:
            parent.append(copy.deepcopy(draw(_ODD)))
    return variables


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_variant())
def test_generated_variables_agree(variables: dict[str, Any]) -> None:
    _same(variables)


def test_valid_and_edge_cases_agree() -> None:
    _same({"data": _full()})
    _same({"data": _full(), "properties": None})
    _same({"data": chat_data([])})
    _same({})
    _same({"data": None})
    _same({"data": []})
    _same({"data": {**_full(), "messages": text_message("s", "user", "one, not a list")}})
    _same({"data": {**_full(), "context": {"description": "d", "value": "v"}}})
    _same({"data": _full(), "properties": "not an object"})


def test_defaults_and_deep_nesting_are_the_library_s() -> None:
    schema = build_schema("""
        input Nested { child: Nested, items: [Nested!], n: Int = 3 }
        type Query { f(a: Nested, b: [Int], c: String = "x"): String }
    """)
    coercer = VariableCoercer(schema)
    operation = get_operation_ast(parse(
        "query ($a: Nested, $b: [Int], $c: String = \"y\") { f(a: $a, b: $b, c: $c) }"))
    plain = get_operation_ast(parse("query ($a: Nested, $b: [Int]) { f(a: $a, b: $b) }"))
    assert isinstance(operation, OperationDefinitionNode)
    assert isinstance(plain, OperationDefinitionNode)
    deep: dict[str, Any] = {}
    for _ in range(250):
        deep = {"child": deep}
    deep_list: dict[str, Any] = {}
    for _ in range(250):
        deep_list = {"items": [deep_list]}
    for op in (operation, plain):
        for variables in ({"a": {"child": {}}, "b": [1, None]}, {"a": deep}, {"a": deep_list},
                          {"b": 1}, {"b": ["x"]}, {"a": {"n": None}}, {"c": None}, {}):
            _same(variables, op, coercer)
    result = coercer.coerce(plain.variable_definitions or (), {"a": deep})
    assert isinstance(result, list)
    assert isinstance(result[0], GraphQLError)
    assert result[0].message == "Variable values are nested too deeply."


def test_valid_variables_take_the_short_path(monkeypatch: Any) -> None:
    def refuse(*_args: Any) -> None:
        raise AssertionError("graphql-core was asked")

    monkeypatch.setattr("copilot_runtime.protocols.graphql.variables.get_variable_values",
                        refuse)
    got = COERCER.coerce(OPERATION.variable_definitions or (),
                         {"data": _full(), "properties": {"a": 1}})
    assert isinstance(got, VariableValues)
    assert got.coerced["data"]["cloud"]["guardrails"]["inputValidationRules"] == {
        "allowList": [], "denyList": ["x"]}
