"""The GraphQL edge's pieces on their own: plans, the event encoder, input translation."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from graphql import FragmentDefinitionNode, GraphQLError, OperationDefinitionNode, parse
from graphql.execution.values import get_variable_values

from copilot_runtime import events as ev
from copilot_runtime._exceptions import InvalidRequestError, JSONTooDeepError
from copilot_runtime.event_order import RunEventOrder
from copilot_runtime.messages import from_graphql_inputs, to_json_representation
from copilot_runtime.protocols.graphql.errors import said_of
from copilot_runtime.protocols.graphql.increments import ResponseEncoder, encode_result
from copilot_runtime.protocols.graphql.inputs import run_request
from copilot_runtime.protocols.graphql.plan import OperationPlan, compile_operation
from copilot_runtime.protocols.graphql.schema import copilot_schema
from copilot_runtime.protocols.graphql.transport import encode_part, multipart_end
from tests.gql.wire import (
    CHAT_DOCUMENT,
    CLIENT_DOCUMENT,
    call_message,
    chat_data,
    merge,
    parse_multipart,
    result_message,
    text_message,
    user_turn,
)
from tests.test_graphql_real_client import _npm_ci

Batch = list[dict[str, Any]]


def compiled(document: str = CHAT_DOCUMENT) -> OperationPlan:
    operation, *definitions = parse(document).definitions
    assert isinstance(operation, OperationDefinitionNode)
    fragments = {d.name.value: d for d in definitions if isinstance(d, FragmentDefinitionNode)}
    return compile_operation(copilot_schema(), operation, fragments, None)


def encode(batches: list[Batch], *, frontend: frozenset[str] = frozenset(),
           stopped: bool = False, incremental: bool = True,
           plan: OperationPlan | None = None,
           answered_later: frozenset[str] | None = None) -> tuple[bytes, list[bytes]]:
    encoder = ResponseEncoder(plan or compiled(), thread_id="t", run_id=None,
                              frontend_tools=frontend, stopped=lambda: stopped,
                              incremental=incremental, answered_later=answered_later)
    writes = [encoder.encode(batch) for batch in [[ev.run_started("t", "r")], *batches]]
    return b"".join(writes), writes


def streamed(batches: list[Batch], **options: Any) -> dict[str, Any]:
    body, _ = encode(batches, **options)
    result: dict[str, Any] = merge(parse_multipart(body))["data"]["generateCopilotResponse"]
    return result


def call(call_id: str, name: str, *args: str) -> Batch:
    return [ev.tool_call_start(call_id, name, "answer"),
            *(ev.tool_call_args(call_id, a) for a in args), ev.tool_call_end(call_id)]


FINISHED = [ev.run_finished("t", "r")]


# ---- plans ------------------------------------------------------------------------------------


def test_the_client_document_streams() -> None:
    plan = compiled()
    assert plan.incremental is not None
    assert plan.root_key == "generateCopilotResponse"
    root = plan.incremental
    assert set(root.streamed) == {"messages", "metaEvents"}
    assert [f.name for d in root.deferred for f in d.fields] == ["status"]
    text = root.streamed["messages"].sub["TextMessageOutput"]  # type: ignore[index]
    assert [f.key for f in text.fields] == ["__typename", "id", "createdAt", "content", "role",
                                             "parentMessageId"]
    assert not text.waits
    assert [f.key for f in plan.flat.fields][:3] == ["threadId", "runId", "extensions"]


def test_each_payload_lists_its_keys_in_selection_order() -> None:
    # The client's document selects `__typename` inside its deferred fragment before the
    # streamed lists; the initial payload still ends with it, as the TypeScript runtime's does.
    root = compiled(CLIENT_DOCUMENT).incremental
    assert root is not None
    assert [f.key for f in root.fields] == ["threadId", "runId", "extensions", "messages",
                                            "metaEvents", "__typename"]
    assert [f.key for f in root.deferred[0].fields] == ["status", "__typename"]


def test_nested_defers_and_fragments() -> None:
    document = """mutation($data: GenerateCopilotResponseInput!) {
      generateCopilotResponse(data: $data) {
        a: threadId
        ... @defer(label: "outer") { runId ... @defer(label: "inner") { threadId a: threadId } }
        ... F @include(if: true) ... G @skip(if: true)
      } }
      fragment F on CopilotResponse { runId ... on CopilotResponse @defer { status { code } } }
      fragment G on CopilotResponse { extensions { __typename } }"""
    plan = compiled(document)
    root = plan.incremental
    assert root is not None
    assert [f.key for f in root.fields] == ["a", "runId"]
    assert [(d.label, [f.key for f in d.fields]) for d in root.deferred] == [
        ("outer", ["runId"]), ("inner", ["threadId", "a"]), (None, ["status"])]
    assert [f.key for f in plan.flat.fields] == ["a", "runId", "threadId", "status"]
    assert plan.flat.deferred == ()


@pytest.mark.parametrize("selection", [
    "status { __typename } messages @stream { __typename }",
    "messages { __typename }",
    "messages @stream { ... on TextMessageOutput { content status { __typename } } }",
    "messages @stream { ... on TextMessageOutput { content } }",
])
def test_what_must_wait_is_sent_in_one_piece(selection: str) -> None:
    document = ("mutation($data: GenerateCopilotResponseInput!) { "
                f"generateCopilotResponse(data: $data) {{ {selection} }} }}")
    assert compiled(document).incremental is None


def test_one_run_per_operation() -> None:
    document = """mutation($data: GenerateCopilotResponseInput!) {
      a: generateCopilotResponse(data: $data) { threadId }
      b: generateCopilotResponse(data: $data) { threadId } }"""
    with pytest.raises(GraphQLError, match=r"exactly once \(this one runs it 2 times\)"):
        compiled(document)
    # One that runs none was told it ran it more than once.
    for document in ("mutation { __typename }", """mutation($data: GenerateCopilotResponseInput!) {
          generateCopilotResponse(data: $data) @skip(if: true) { threadId } }"""):
        with pytest.raises(GraphQLError, match=r"exactly once \(this one runs it not at all\)"):
            compiled(document)


# ---- the encoder --------------------------------------------------------------------------------


def test_initial_part_then_one_part_per_batch() -> None:
    _, writes = encode([
        [ev.text_message_start("m"), ev.text_message_content("m", "a"),
         ev.text_message_content("m", "b")],
        [ev.text_message_content("m", "c"), ev.text_message_end("m")], FINISHED])
    assert writes[0].startswith(b"\r\n---\r\nContent-Type: application/json; charset=utf-8\r\n")
    assert writes[0].count(b"\r\n---") == 2  # the prefix and the initial part
    first, second = (json.loads(w.split(b"\r\n\r\n", 1)[1][:-len(b"\r\n---")])
                     for w in writes[1:3])
    assert first["incremental"][1] == {
        "items": ["a", "b"], "path": ["generateCopilotResponse", "messages", 0, "content", 0]}
    assert second["incremental"][0]["items"] == ["c"]
    assert second["incremental"][0]["path"][-1] == 2
    assert second["incremental"][1]["data"]["status"]["code"] == "Success"
    assert writes[-1].endswith(b'"hasNext":false}\r\n-----\r\n')


def test_results_follow_their_calls_as_in_1_10() -> None:
    result = streamed([
        call("c1", "getWeather", '{"city":', '"Paris"}') + call("c2", "notify", "{}")
        + call("c3", "getWeather", '{"city":"Rome"}'),
        [ev.tool_call_result("x1", "c1", '{"t":1}'), ev.tool_call_result("x3", "c3", '{"t":3}')],
        FINISHED], frontend=frozenset({"notify"}))
    kinds = [(m["__typename"], m["id"]) for m in result["messages"]]
    assert kinds == [("ActionExecutionMessageOutput", "c1"), ("ResultMessageOutput", "result-c1"),
                     ("ActionExecutionMessageOutput", "c2"), ("ActionExecutionMessageOutput", "c3"),
                     ("ResultMessageOutput", "result-c3")]
    assert result["messages"][0]["arguments"] == ['{"city":', '"Paris"}']
    assert result["messages"][1]["actionName"] == "getWeather"
    assert all(m["status"]["code"] == "Success" for m in result["messages"])


def test_signed_reasoning_is_not_shown_to_1_10_clients() -> None:
    """REASONING_ENCRYPTED_VALUE (an AG-UI 1.0 run's, stored in the thread) has no GraphQL
    form: the 1.10 client gets the call alone, as without it."""
    signed = ev.reasoning_encrypted_value("tool-call", "c1", "opaque")
    plain = streamed([call("c1", "notify", "{}"), FINISHED], frontend=frozenset({"notify"}))
    with_signed = streamed([[*call("c1", "notify", "{}"), signed], FINISHED],
                           frontend=frozenset({"notify"}))
    def shown(result: dict[str, Any]) -> list[Any]:
        return [{k: v for k, v in m.items() if k != "createdAt"} for m in result["messages"]]

    assert shown(with_signed) == shown(plain)
    assert [m["__typename"] for m in shown(plain)] == ["ActionExecutionMessageOutput"]
    assert "opaque" not in json.dumps(with_signed)


def test_held_messages_are_sent_when_no_result_comes() -> None:
    result = streamed([[*call("c1", "lookup", "{}"), ev.text_message_start("m"),
                        ev.text_message_content("m", "after")], FINISHED])
    assert [m["__typename"] for m in result["messages"]] == [
        "ActionExecutionMessageOutput", "TextMessageOutput"]
    assert result["messages"][1]["content"] == ["after"]


def test_only_calls_answered_later_hold_what_follows() -> None:
    # (an agent's call to anything else, a call it announces for the page to render, say,
    # gets no result from the runtime: what followed it was held to the end of the run)
    closing = encode_part({"hasNext": False}) + multipart_end
    _, writes = encode([[*call("c1", "showCard", "{}"), ev.text_message_start("m"),
                         ev.text_message_content("m", "now")],
                        [*call("c2", "getWeather", "{}"), ev.text_message_start("n"),
                         ev.text_message_content("n", "later")],
                        [ev.tool_call_result("x2", "c2", "sunny")], FINISHED],
                       answered_later=frozenset({"getWeather"}))
    seen = [[m["id"] for m in merge(parse_multipart(b"".join(writes[:n]) + closing))[
        "data"]["generateCopilotResponse"]["messages"]] for n in (2, 3, 4)]
    assert seen == [["c1", "m"], ["c1", "m", "c2"], ["c1", "m", "c2", "result-c2", "n"]]


def test_a_new_step_ends_the_hold_for_calls_no_one_answered() -> None:
    """A graph-side tool that failed in a tool node (or a call a graph only announced) gets
    no result: everything after it was held to the end of the run, the answer not streamed.
    Now the next step ends the hold; a result that does come in the step after still
    follows its call."""
    _, writes = encode([
        [ev.step_started("chat"), *call("c1", "lookup", "{}"), *call("c2", "lookup", "{}"),
         ev.step_finished("chat")],
        [ev.step_started("tools"), ev.tool_call_result("x2", "c2", "found"),
         ev.step_finished("tools")],
        [ev.step_started("chat"), ev.text_message_start("m"), ev.text_message_content("m", "an")],
        [ev.text_message_content("m", "swer"), ev.text_message_end("m")], FINISHED])
    # What the client holds after each write (an unfinished body closed where it stops).
    closing = encode_part({"hasNext": False}) + multipart_end
    parts = [merge(parse_multipart(b"".join(writes[:n]) + (b"" if n == len(writes) else closing))
                   )["data"]["generateCopilotResponse"] for n in range(1, len(writes) + 1)]
    after_tools, streaming = parts[2], parts[3]
    assert [(m["__typename"], m["id"]) for m in after_tools["messages"]] == [
        ("ActionExecutionMessageOutput", "c1"), ("ActionExecutionMessageOutput", "c2"),
        ("ResultMessageOutput", "result-c2")]
    assert streaming["messages"][-1]["content"] == ["an"]  # streamed as it comes
    final = parts[-1]
    assert [m["id"] for m in final["messages"]] == ["c1", "c2", "result-c2", "m"]
    assert final["messages"][-1]["content"] == ["an", "swer"]


@pytest.mark.parametrize("incremental", [True, False])
def test_keepalives_leave_the_result_as_it_is(incremental: bool) -> None:
    encoder = ResponseEncoder(compiled(), thread_id="t", run_id=None, frontend_tools=frozenset(),
                              stopped=lambda: False, incremental=incremental)
    # Multipart: nothing before the first part, which a client would take for the result.
    assert encoder.keepalive() == (b"" if incremental else b"\n")
    body = encoder.encode([ev.run_started("t", "r")]) + encoder.keepalive()
    body += encoder.encode([ev.text_message_start("m"), ev.text_message_content("m", "hi")])
    body += encoder.keepalive() + encoder.keepalive()
    body += encoder.encode([ev.text_message_end("m"), *FINISHED])
    assert encoder.keepalive() == b""  # the response is complete
    if incremental:
        assert body.count(b"\r\n---\r\n\r\n\r\n---") == 2
        result = merge(parse_multipart(body))["data"]["generateCopilotResponse"]
    else:
        assert body.startswith(b"\n\n\n{")
        result = json.loads(body)["data"]["generateCopilotResponse"]
    assert result["messages"][0]["content"] == ["hi"]
    assert result["status"]["code"] == "Success"


def test_failure_marks_open_messages_failed() -> None:
    result = streamed([
        [ev.text_message_start("m"), ev.text_message_content("m", "partial")],
        [ev.text_message_end("m"), ev.run_error("upstream broke", code="UPSTREAM_ERROR")]])
    (message,) = result["messages"]
    assert message["status"]["code"] == "Failed"
    assert message["status"]["reason"]
    status = result["status"]
    assert (status["code"], status["reason"]) == ("Failed", "UNKNOWN_ERROR")
    assert status["details"]["description"] == "upstream broke"
    assert status["details"]["originalError"]["code"] == "NETWORK_ERROR"


def test_a_stopped_run_reports_the_interrupted_message() -> None:
    result = streamed([[ev.text_message_start("m"), ev.text_message_content("m", "par")],
                       [ev.text_message_end("m"), *FINISHED]], stopped=True)
    assert result["messages"][0]["status"]["code"] == "Failed"
    assert result["status"]["reason"] == "MESSAGE_STREAM_INTERRUPTED"
    assert result["status"]["details"]["messageId"] == "m"


def test_chunk_events_open_and_fill_messages() -> None:
    # The edge sees a run's events after the core's ordering, which expands chunks.
    order = RunEventOrder("t", "r")
    result = streamed([list(order.normalize(batch)) for batch in [[
        {"type": ev.TEXT_MESSAGE_CHUNK, "messageId": "m", "role": "assistant", "delta": "he"},
        {"type": ev.TEXT_MESSAGE_CHUNK, "delta": "llo"},
        {"type": ev.TOOL_CALL_CHUNK, "toolCallId": "c", "toolCallName": "go", "delta": "{}"},
    ], FINISHED]], frontend=frozenset({"go"}))
    text, action = result["messages"]
    assert text["content"] == ["he", "llo"]
    assert (action["name"], action["arguments"]) == ("go", ["{}"])
    assert text["status"]["code"] == action["status"]["code"] == "Success"


def test_single_result_mode_writes_once() -> None:
    body, writes = encode([[ev.text_message_start("m"), ev.text_message_content("m", "hi")],
                           [ev.text_message_end("m")], FINISHED], incremental=False)
    assert writes[:-1] == [b"", b"", b""]
    result = json.loads(body)["data"]["generateCopilotResponse"]
    assert result["messages"][0]["content"] == ["hi"]
    assert result["status"] == {"code": "Success", "__typename": "SuccessResponseStatus"}


def test_result_encoding() -> None:
    assert encode_result('{"error":"bad"}', "bad") == (
        '{"error":{"code":"HANDLER_ERROR","message":"bad"},"result":""}')
    # Only a failure the event declares is one: content that looks like one is a result.
    for unchanged in ('{"error":"x"}', '{"ok":true}', "plain", '{"error":{"a":1}}'):
        assert encode_result(unchanged) == unchanged


# ---- inputs -----------------------------------------------------------------------------------


def test_history_becomes_model_ready_messages() -> None:
    messages = from_graphql_inputs([
        text_message("s", "system", "rules"),
        text_message("u", "user", "go"),
        text_message("a", "assistant", "calling"),
        call_message("c1", "f", "{}", parent="a"),
        result_message("r1", "c1", "f", "one"),
        call_message("c2", "f", "{}", parent="a"),
        result_message("r2", "c2", "f", "two"),
        result_message("r2-again", "c2", "f", "dup"),
        result_message("orphan", "nope", "f", "x"),
        text_message("t", "tool", "no call to answer"),
        call_message("c3", "g", '{"x":1}'),
        {"id": "img", "createdAt": "2025-01-01T00:00:00Z",
         "imageMessage": {"format": "png", "bytes": "AAA", "role": "user"}},
    ])
    assert [(m["role"], m["id"]) for m in messages] == [
        ("developer", "s"), ("user", "u"), ("assistant", "a"), ("tool", "r1"), ("tool", "r2"),
        ("assistant", "c3"), ("user", "img")]
    assert [c["id"] for c in messages[2]["toolCalls"]] == ["c1", "c2"]
    assert messages[2]["content"] == "calling"
    assert messages[6]["content"][0]["source"] == {"type": "data", "value": "AAA",
                                                   "mimeType": "image/png"}


def test_run_request_translation() -> None:
    data = user_turn(
        "hi", thread=None, actions=[
            {"name": "ui", "description": "d", "jsonSchema": '{"type":"object"}'},
            {"name": "getWeather", "description": "shadowed", "jsonSchema": "{}"}],
        forwardedParameters={"maxTokens": 12.0, "toolChoice": "auto"},
        context=[{"description": "page", "value": "home"}])
    request = run_request(data, {"tenant": "t1", "temperature": 9},
                          server_actions=["getWeather"], has_public_key=False)
    assert request.agent_id == "default"
    assert request.client_run_id is None
    assert request.frontend_tools == frozenset({"ui"})
    raw = request.input.raw
    assert raw["threadId"]  # made up when the client sends none
    assert raw["runId"]
    assert raw["forwardedProps"]["tenant"] == "t1"
    assert raw["forwardedProps"]["forwardedParameters"] == {
        "model": None, "temperature": None, "maxTokens": 12, "max_tokens": None, "stop": None,
        "toolChoice": "auto", "tool_choice": None}
    assert raw["context"] == [{"description": "page", "value": "home"}]
    assert [t["name"] for t in raw["tools"]] == ["ui", "getWeather"]


def test_run_request_refusals() -> None:
    with pytest.raises(InvalidRequestError):
        run_request(user_turn("x", agentStates=[{"agentName": "default", "state": "[1]"}]),
                    None, server_actions=(), has_public_key=False)
    with pytest.raises(InvalidRequestError):
        run_request(user_turn("x", cloud={"guardrails": None}), None, server_actions=(),
                    has_public_key=False)
    assert run_request(user_turn("x", cloud={"guardrails": None}), None, server_actions=(),
                       has_public_key=True).agent_id == "default"


def test_stored_messages_for_load_agent_state() -> None:
    loaded = to_json_representation([
        {"id": "s", "role": "developer", "content": "rules"},
        {"id": "u", "role": "user", "content": "go"},
        {"id": "a", "role": "assistant", "toolCalls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]},
        {"id": "t1", "role": "tool", "toolCallId": "c", "content": "done"},
        {"id": "t2", "role": "tool", "toolCallId": "c", "content": "done"},
        {"id": "b", "role": "assistant", "content": "ok"},
    ])
    assert loaded == [
        {"id": "u", "role": "user", "content": "go"},
        {"id": "c", "name": "f", "arguments": {"x": 1}, "parentMessageId": "a"},
        {"id": "t1", "actionExecutionId": "c", "actionName": "f", "result": "done"},
        {"id": "b", "role": "assistant", "content": "ok", "parentMessageId": "b"},
    ]


# ---- scalars ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("variables", "ok"), [
    ({"data": chat_data([text_message("u", "user", "x")])}, True),
    ({"data": chat_data([{**text_message("u", "user", "x"), "createdAt": "2025-01-01"}])}, False),
    ({"data": chat_data([{**text_message("u", "user", "x"),
                          "createdAt": "2025-01-01T10:00:00"}])}, False),
    ({"data": chat_data([]), "properties": {"a": [1]}}, True),
    ({"data": chat_data([]), "properties": "text"}, False),
])
def test_scalars_coerce_variables(variables: dict[str, Any], ok: bool) -> None:
    operation = parse(CHAT_DOCUMENT).definitions[0]
    assert isinstance(operation, OperationDefinitionNode)
    coerced = get_variable_values(copilot_schema(), operation.variable_definitions, variables)
    assert isinstance(coerced, list) is not ok


def _subclasses(kind: type) -> list[type]:
    return [kind, *(c for sub in kind.__subclasses__() for c in _subclasses(sub))]


def test_every_code_the_1_10_client_is_sent_is_one_it_knows() -> None:
    """The 1.10 client's error class looks `extensions.code` up in its own table and fails
    on any other (`Cannot destructure property 'statusCode'`, a TypeError in the page):
    a busy thread (`THREAD_BUSY`) and a rate limit (`RATE_LIMITED`) broke the page that
    sent them. Every code our errors carry is one of the table read from the client's
    own package; ours go beside it as `runtimeCode`."""
    from copilot_runtime import _exceptions
    from copilot_runtime.protocols.graphql import errors

    _npm_ci()  # the 1.10 client's packages
    shared = Path(__file__).parent / "gql" / "node_modules" / "@copilotkit" / "shared"
    table = (shared / "dist" / "index.js").read_text(encoding="utf-8")
    known = set(re.findall(r'CopilotKitErrorCode2\["([A-Z_]+)"\]', table))
    assert {"UNKNOWN", "MISUSE", "NETWORK_ERROR"} <= known
    assert set(errors._KIT) <= known
    assert set(errors._FROM_RUNTIME.values()) <= known
    for kind in _subclasses(_exceptions.CopilotRuntimeError):
        error = kind.__new__(kind)
        error.message = "refused"
        extensions = errors.error_extensions(error, "refused")
        assert extensions["code"] in known, kind
        assert errors.failed_status("refused", getattr(kind, "code", None))[
            "details"]["originalError"]["code"] in known, kind


def test_a_run_refused_mid_stream_is_coded_as_before_one() -> None:
    """A request error raised once the stream ran (a second answer to an interrupt, a model
    the agent does not allow) reached the 1.10 client as `UNKNOWN`, status 500, severity
    critical: only some codes were mapped. Every request error's code reads in a failed
    status as the same error reads before the stream starts."""
    from copilot_runtime import _exceptions
    from copilot_runtime.protocols.graphql.errors import failed_status, kit_code_of

    codes: dict[str, Any] = {}
    for kind in _subclasses(_exceptions.CopilotRuntimeError):
        if "code" in vars(kind) and issubclass(kind, _exceptions.RequestError):
            error = kind.__new__(kind)
            codes[kind.code] = kit_code_of(error)
    codes.update(dict.fromkeys(
        ("APPROVAL_EXPIRED", "APPROVAL_WITHDRAWN", "APPROVAL_ALREADY_ANSWERED"), "MISUSE"))
    assert {"INTERRUPT_NOT_PENDING", "MODEL_NOT_ALLOWED", "RATE_LIMITED"} <= codes.keys()
    for code, expected in codes.items():
        seen = failed_status("refused", code)["details"]["originalError"]
        assert (code, seen["code"]) == (code, expected)
        assert seen["originalErrorType"] == code


def test_an_invalid_request_says_its_details_once() -> None:
    # (a refusal whose details are its message said it twice: "...(at most 64 levels):
    # ...(at most 64 levels)")
    deep = JSONTooDeepError("agentStates[0].state", 64)
    assert said_of(deep) == "agentStates[0].state is nested too deep (at most 64 levels)"
    assert said_of(InvalidRequestError("Bad input", "the field x")) == "Bad input: the field x"
