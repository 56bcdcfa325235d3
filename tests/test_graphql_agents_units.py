"""Agents on the GraphQL edge, piece by piece: agent-state messages, interrupt meta events,
hand-over attribution, and the message conversions of `loadAgentState`."""

from __future__ import annotations

import random
import time
import tracemalloc
from typing import Any

import orjson
import pytest
from graphql import OperationDefinitionNode, parse
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from structlog.testing import capture_logs

from copilot_runtime import events as ev
from copilot_runtime._server_tools import AGENT_FINISHED, AGENT_STARTED
from copilot_runtime.agents._lg_state import thread_state_from_values
from copilot_runtime.messages import from_json_representation, to_json_representation
from copilot_runtime.protocols.graphql.agent_state import PartialJson, partial_json
from copilot_runtime.protocols.graphql.increments import ResponseEncoder
from copilot_runtime.protocols.graphql.inputs import run_request
from copilot_runtime.protocols.graphql.plan import OperationPlan, compile_operation
from copilot_runtime.protocols.graphql.schema import copilot_schema
from tests.gql.wire import CLIENT_DOCUMENT, chat_data, merge, parse_multipart, text_message

Batch = list[dict[str, Any]]


def _operation(document: str) -> OperationDefinitionNode:
    operation = parse(document).definitions[0]
    assert isinstance(operation, OperationDefinitionNode)
    return operation


def _plan() -> OperationPlan:
    return compile_operation(copilot_schema(), _operation(CLIENT_DOCUMENT), {}, None)


PLAN = _plan()


def respond(*batches: Batch, state: dict[str, Any] | None = None,
            finish: bool = True) -> dict[str, Any]:
    """The merged response of the agent `planner` producing `batches`."""
    encoder = ResponseEncoder(PLAN, thread_id="t-1", run_id=None, frontend_tools=frozenset(),
                              stopped=lambda: False, incremental=True, agent_name="planner",
                              agent_run_id="run-9", agent_state=state)
    tail = [[ev.run_finished("t-1", "run-9")]] if finish else []
    body = b"".join(encoder.encode(b) for b in [[ev.run_started("t-1", "run-9")], *batches,
                                                 *tail])
    result: dict[str, Any] = merge(parse_multipart(body))["data"]["generateCopilotResponse"]
    return result


def states(response: dict[str, Any]) -> list[tuple[str, str, bool, bool, Any]]:
    """(agent, node, active, running, state) of every agent-state message, in order."""
    return [(m["agentName"], m["nodeName"], m["active"], m["running"], orjson.loads(m["state"]))
            for m in response["messages"] if m["__typename"] == "AgentStateMessageOutput"]


def test_steps_and_state_become_agent_state_messages() -> None:
    response = respond(
        [ev.step_started("plan")],
        [ev.state_snapshot({"items": ["a"], "messages": ["plumbing"]})],
        [ev.state_delta([{"op": "add", "path": "/items/-", "value": "b"}])],
        [ev.state_delta([{"op": "remove", "path": "/nothing"}])],  # does not apply: dropped
        [ev.state_snapshot(["not", "an", "object"])],  # the 1.x protocol knows objects only
        [ev.step_finished("plan")],
        [ev.state_delta([{"op": "replace", "path": "/items/0", "value": "A"}])],
        state={"items": [], "seed": True})
    assert states(response) == [
        ("planner", "plan", True, True, {"items": [], "seed": True}),
        ("planner", "plan", True, True, {"items": ["a"]}),
        ("planner", "plan", True, True, {"items": ["a", "b"]}),
        ("planner", "plan", True, True, {"items": ["a", "b"]}),
        ("planner", "plan", False, True, {"items": ["a", "b"]}),
        ("planner", "plan", True, True, {"items": ["A", "b"]}),
        # the end: not active, and the graph is at its end
        ("planner", "__end__", False, True, {"items": ["A", "b"]}),
    ]
    first = response["messages"][0]
    assert first["id"].startswith("ck-")
    assert first["role"] == "assistant"
    assert (first["threadId"], first["runId"]) == ("t-1", "run-9")
    assert first["status"] == {"code": "Success", "__typename": "SuccessMessageStatus"}
    assert len({m["id"] for m in response["messages"]}) == len(response["messages"])


def test_messages_snapshot_and_final_message_carry_the_conversation() -> None:
    conversation = [
        {"id": "u1", "role": "user", "content": "Hi"},
        {"id": "sys", "role": "system", "content": "hidden"},
        {"id": "a1", "role": "assistant", "content": "",
         "toolCalls": [{"id": "c1", "type": "function",
                        "function": {"name": "lookup", "arguments": '{"q": 1}'}}]},
        {"id": "r1", "role": "tool", "toolCallId": "c1", "content": "found"},
        {"id": "a2", "role": "assistant", "content": "Done"},
    ]
    response = respond([ev.step_started("chat")], [ev.step_finished("chat")],
                       [{"type": ev.MESSAGES_SNAPSHOT, "messages": conversation}])
    *_, snapshot, final = states(response)
    expected = [
        {"id": "u1", "role": "user", "content": "Hi"},
        {"id": "c1", "name": "lookup", "arguments": {"q": 1}, "parentMessageId": "a1"},
        {"id": "r1", "actionExecutionId": "c1", "actionName": "lookup", "result": "found"},
        {"id": "a2", "role": "assistant", "content": "Done", "parentMessageId": "a2"},
    ]
    assert snapshot == ("planner", "chat", True, True, {"messages": expected})
    assert final == ("planner", "__end__", False, True, {"messages": expected})


def test_exit_stops_running_and_a_silent_run_has_no_state_messages() -> None:
    exited = respond([ev.step_started("work")], [ev.custom("Exit", True)],
                     [ev.state_snapshot({"done": True})])
    assert [s[3] for s in states(exited)] == [True, False, False]
    assert states(respond([ev.text_message_start("m"), ev.text_message_content("m", "hi"),
                           ev.text_message_end("m")])) == []


def test_predicted_state_follows_streamed_arguments() -> None:
    predict = [{"state_key": "draft", "tool": "write", "tool_argument": "text"},
               {"state_key": "whole", "tool": "write", "tool_argument": None}]
    response = respond(
        [ev.step_started("writer"), ev.custom("PredictState", predict)],
        [ev.tool_call_start("c1", "write", "m1")],
        [ev.tool_call_args("c1", '{"text": "Hel')],
        [ev.tool_call_args("c1", 'lo", "n":')],  # stops after a colon: no prediction
        [ev.tool_call_args("c1", " 2}")],
        [ev.tool_call_end("c1")],
        [ev.tool_call_start("c2", "other", "m1"), ev.tool_call_args("c2", '{"text": "x"}'),
         ev.tool_call_end("c2")])
    predicted = [s[4] for s in states(response)][1:-1]
    assert predicted == [
        {"draft": "Hel", "whole": {"text": "Hel"}},
        {"draft": "Hello", "whole": {"text": "Hello", "n": 2}},
    ]


def test_a_predict_rule_whose_argument_is_not_text_is_ignored() -> None:
    # (a list as `tool_argument` raised TypeError mid-batch, and the batch was fed again)
    predict = [{"state_key": "note", "tool": "write", "tool_argument": ["text"]},
               {"state_key": "draft", "tool": "write", "tool_argument": "text"}]
    with capture_logs() as logs:
        response = respond(
            [ev.step_started("writer"), ev.custom("PredictState", predict)],
            [ev.tool_call_start("c1", "write", "m1"), ev.tool_call_args("c1", '{"text": "Hi"}'),
             ev.tool_call_end("c1")])
    (call,) = [m for m in response["messages"]
               if m["__typename"] == "ActionExecutionMessageOutput"]
    assert "".join(call["arguments"]) == '{"text": "Hi"}'
    assert [s[4] for s in states(response)][1:-1] == [{"draft": "Hi"}]
    (warned,) = [e for e in logs if "PredictState" in e["event"]]
    assert (warned["state_key"], warned["tool"]) == ("note", "write")


def test_partial_json() -> None:
    assert partial_json('{"a": "b\\') == {"a": "b"}
    assert partial_json('{"a": [1, {"b": 2') == {"a": [1, {"b": 2}]}
    assert partial_json('{"a": 1,') == {"a": 1}
    assert partial_json('{"a":') is None
    assert partial_json("[1, 2]") == [1, 2]


def _partial_json_before(text: str) -> Any:
    """`partial_json` as it was when it read the whole text at every piece: the reference
    the piecewise reader must match."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    closers: list[str] = []
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            closers.append("}" if char == "{" else "]")
        elif char in "}]" and closers:
            closers.pop()
    if escaped:
        text = text[:-1]
    candidate = text + ('"' if in_string else "")
    stripped = candidate.rstrip()
    if stripped.endswith(","):
        candidate = stripped[:-1]
    try:
        return orjson.loads(candidate + "".join(reversed(closers)))
    except orjson.JSONDecodeError:
        return None


def _random_json(rng: random.Random, depth: int = 0) -> str:
    """A JSON text with the spacing, escapes and values streamed arguments have."""
    def space() -> str:
        return rng.choice(["", "", " ", "\n  ", "\t"])
    # (arguments are an object or a list at the top)
    kind = rng.randrange(2, 4) if depth == 0 else rng.randrange(4 if depth < 4 else 2)
    if kind == 0:
        return rng.choice(["0", "-12", "3.25", "1e3", "-0.5E-2", "true", "false", "null"])
    if kind == 1:
        chars = ["a", " ", "é", "😀", '\\"', "\\\\", "\\n", "\\u00e9", "\\ud83d\\ude00", "{",
                 "]", ",", ":"]
        return '"' + "".join(rng.choice(chars) for _ in range(rng.randrange(8))) + '"'
    items = [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 2:
        return "[" + ",".join(space() + item + space() for item in items) + "]"
    return "{" + ",".join(f'{space()}"k{i}"{space()}:{space()}{item}{space()}'
                          for i, item in enumerate(items)) + "}" + space()


def _same(got: Any, expected: Any) -> bool:
    return type(got) is type(expected) and got == expected


def test_partial_json_read_in_pieces_is_what_the_whole_text_read_again_was() -> None:
    # (re-reading all the pieces at every piece cost a streamed argument quadratic time)
    rng = random.Random(1110)
    texts = ['{"a": "b\\', '{"a": [1, {"b": 2', '{"a": 1,', '{"a":', "[1, 2]"]
    texts += [_random_json(rng) for _ in range(300)]
    # and text that is no JSON at all: stray closers, quotes, escapes
    texts += ["".join(rng.choice('{}[]",:\\ a1\n') for _ in range(rng.randrange(40)))
              for _ in range(200)]
    for text in texts:
        reader = PartialJson()
        for end in range(1, len(text) + 1):  # every prefix, a character at a time
            got = reader.add(text[end - 1])
            assert _same(got, _partial_json_before(text[:end])), (text, end)
        reader, end = PartialJson(), 0
        while end < len(text):  # pieces of a few characters, as a model streams them
            piece = text[end:end + rng.randrange(1, 8)]
            end += len(piece)
            assert _same(reader.add(piece), _partial_json_before(text[:end])), (text, end)
        assert _same(partial_json(text), _partial_json_before(text)), text


def _predicted_document(incremental: bool, plan: OperationPlan = PLAN) -> ResponseEncoder:
    """An encoder that has sent a 40 KB document predicted as it streams, 4 bytes a piece:
    an agent-state message for each piece after the first three (`{"document":` predicts
    nothing), as the 1.10 runtime sends them."""
    encoder = ResponseEncoder(plan, thread_id="t-1", run_id=None, frontend_tools=frozenset(),
                              stopped=lambda: False, incremental=incremental,
                              agent_name="planner", agent_run_id="run-9")
    document = orjson.dumps({"document": "word " * 8000}).decode()
    predict = [{"state_key": "document", "tool": "write", "tool_argument": "document"}]
    for batch in [[ev.run_started("t-1", "run-9"), ev.step_started("write"),
                   ev.custom("PredictState", predict), ev.tool_call_start("c1", "write", "m1")],
                  *([ev.tool_call_args("c1", document[i:i + 4])]
                    for i in range(0, len(document), 4)),
                  [ev.tool_call_end("c1"), ev.step_finished("write"),
                   ev.run_finished("t-1", "run-9")]]:
        encoder.encode(batch)
    assert encoder.done
    return encoder


def test_a_long_predicted_argument_is_scanned_once_a_piece() -> None:
    # 0.25 s here; scanning the arguments whole in Python at every piece took 7.5 s
    started = time.process_time()
    _predicted_document(incremental=True)
    assert time.process_time() - started < 2.5


def test_a_streamed_response_lets_superseded_agent_states_go() -> None:
    # 4 MB at the peak here; keeping every message to the end held 212 MB
    tracemalloc.start()
    try:
        _predicted_document(incremental=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40_000_000


def test_a_complete_answer_lists_every_agent_state_message() -> None:
    """The JSON answer, and a streamed one whose messages are deferred, send the list
    whole at the end: every agent-state message is in it, as in a 1.10 answer."""
    deferred = compile_operation(copilot_schema(), _operation("""
        mutation m($data: GenerateCopilotResponseInput!) {
          generateCopilotResponse(data: $data) {
            threadId
            ... @defer { messages { __typename ... on AgentStateMessageOutput { state } } }
          }
        }"""), {}, None)
    assert deferred.incremental is not None
    for encoder in (_predicted_document(incremental=False),
                    _predicted_document(incremental=True, plan=deferred)):
        values = encoder._root_values()["messages"]
        assert [typename for typename, _ in values] == [
            "AgentStateMessageOutput", "ActionExecutionMessageOutput",
            *["AgentStateMessageOutput"] * 10_001, "AgentStateMessageOutput",
            "AgentStateMessageOutput"]


def test_interrupts_become_meta_events() -> None:
    copilotkit_value = orjson.dumps({
        "__copilotkit_interrupt_value__": {"action": "approve", "args": {"amount": 3}},
        "__copilotkit_messages__": [{
            "type": "ai", "id": None, "content": "",
            "tool_calls": [{"id": "t1", "name": "approve", "args": {"amount": 3}}]}],
    }).decode()
    response = respond(
        [ev.step_started("ask")],
        [ev.custom("on_interrupt", '{"question": "Approve?"}')],
        [ev.custom("on_interrupt", copilotkit_value)],
        [ev.custom("on_copilotkit_interrupt", {"value": "Sure?", "messages": [
            {"role": "assistant", "content": "Sure?", "id": "q1"}]})],
        [ev.custom("something_else", {"x": 1})])
    plain, from_graph, from_endpoint = response["metaEvents"]
    assert plain == {"type": "MetaEvent", "name": "LangGraphInterruptEvent",
                     "value": '{"question": "Approve?"}', "__typename": "LangGraphInterruptEvent"}
    assert from_graph["__typename"] == "CopilotKitLangGraphInterruptEvent"
    assert orjson.loads(from_graph["data"]["value"]) == {"action": "approve",
                                                         "args": {"amount": 3}}
    (call,) = from_graph["data"]["messages"]
    assert call["__typename"] == "ActionExecutionMessageOutput"
    assert (call["id"], call["name"], call["arguments"]) == ("t1", "approve", ['{"amount":3}'])
    assert call["status"] == {"code": "Success", "__typename": "SuccessMessageStatus"}
    assert from_endpoint["data"]["value"] == "Sure?"
    (question,) = from_endpoint["data"]["messages"]
    assert (question["__typename"], question["content"], question["role"]) == (
        "TextMessageOutput", ["Sure?"], "assistant")
    # Stopped at an interrupt, the graph is not at its end: the client continues at the node.
    assert states(response)[-1][1:3] == ("ask", False)


def test_handed_over_agent_is_named_in_its_messages() -> None:
    response = respond(
        [ev.step_started("chat"), ev.state_snapshot({"mine": 1})],
        [ev.tool_call_start("c1", "writer", "m1"), ev.tool_call_end("c1"),
         ev.tool_call_result("r1", "c1", "writer agent started"),
         ev.custom(AGENT_STARTED, {"agentName": "writer", "runId": "run-w"})],
        [ev.step_started("draft"), ev.state_snapshot({"theirs": 2}), ev.step_finished("draft")],
        [ev.custom(AGENT_FINISHED, {"agentName": "writer"})],
        [ev.step_finished("chat")])
    assert states(response) == [
        ("planner", "chat", True, True, {}),
        ("planner", "chat", True, True, {"mine": 1}),
        ("writer", "draft", True, True, {}),
        ("writer", "draft", True, True, {"theirs": 2}),
        ("writer", "draft", False, True, {"theirs": 2}),
        ("writer", "__end__", False, True, {"theirs": 2}),
        ("planner", "chat", False, True, {"mine": 1}),
        ("planner", "__end__", False, True, {"mine": 1}),
    ]
    runs = [m["runId"] for m in response["messages"] if m["__typename"] ==
            "AgentStateMessageOutput"]
    assert runs[2:6] == ["run-w"] * 4


def test_a_failed_run_sends_no_final_state() -> None:
    response = respond([ev.step_started("plan"), ev.state_snapshot({"a": 1})],
                       [ev.run_error("gone", code="UPSTREAM_ERROR")], finish=False)
    assert [s[1:3] for s in states(response)] == [("plan", True), ("plan", True)]
    assert response["status"]["code"] == "Failed"


def test_no_agent_name_no_state_messages() -> None:
    encoder = ResponseEncoder(PLAN, thread_id="t", run_id=None, frontend_tools=frozenset(),
                              stopped=lambda: False, incremental=True)
    body = b"".join(encoder.encode(b) for b in [
        [ev.run_started("t", "r")], [ev.step_started("x"), ev.state_snapshot({"a": 1})],
        [ev.custom(AGENT_STARTED, {"agentName": "w"})], [ev.run_finished("t", "r")]])
    result = merge(parse_multipart(body))["data"]["generateCopilotResponse"]
    assert result["messages"] == []


# ---- loadAgentState conversions -------------------------------------------------------------


def test_langgraph_values_become_a_thread() -> None:
    values = {
        "messages": [
            SystemMessage(content="be brief", id="s1"),
            HumanMessage(content="Weather?", id="h1"),
            AIMessage(content="", id="a1",
                      tool_calls=[{"id": "c1", "name": "get_weather", "args": {"city": "Oslo"}}]),
            ToolMessage(content='{"t": 3}', tool_call_id="c1", id="r1"),
            AIMessage(content=[{"type": "text", "text": "Cold."}], id="a2"),
        ],
        "copilotkit": {"actions": []}, "tools": [], "items": ["x"],
    }
    thread = thread_state_from_values("t-9", values)
    assert thread.exists
    assert thread.state == {"items": ["x"]}
    assert to_json_representation(thread.messages) == [
        {"id": "h1", "role": "user", "content": "Weather?"},
        {"id": "c1", "name": "get_weather", "arguments": {"city": "Oslo"},
         "parentMessageId": "a1"},
        {"id": "r1", "actionExecutionId": "c1", "actionName": "get_weather",
         "result": '{"t": 3}'},
        {"id": "a2", "role": "assistant", "content": "Cold.", "parentMessageId": "a2"},
    ]
    assert not thread_state_from_values("t-0", {}).exists


def test_remote_endpoint_messages_become_agui_messages() -> None:
    sdk_form = [
        {"role": "user", "content": "Hi", "id": "u1"},
        {"role": "assistant", "content": "", "id": "a1", "parentMessageId": "a1"},
        {"id": "c1", "name": "add", "arguments": {"a": 1}, "parentMessageId": "a1"},
        {"actionExecutionId": "c1", "actionName": "add", "result": 2, "id": "r1"},
        {"id": "c2", "name": "orphan", "arguments": "{}", "parentMessageId": "gone"},
        {"state": {"x": 1}, "id": "s1"},
        "not a message",
    ]
    assert from_json_representation(sdk_form) == [
        {"id": "u1", "role": "user", "content": "Hi"},
        {"id": "a1", "role": "assistant", "content": "", "toolCalls": [
            {"id": "c1", "type": "function", "function": {"name": "add",
                                                          "arguments": '{"a":1}'}}]},
        {"id": "r1", "role": "tool", "toolCallId": "c1", "content": "2"},
        {"id": "gone", "role": "assistant", "toolCalls": [
            {"id": "c2", "type": "function", "function": {"name": "orphan",
                                                          "arguments": "{}"}}]},
    ]
    assert from_json_representation(None) == []


@pytest.mark.parametrize("kind", ["ai", "human", "tool"])
def test_interrupt_messages_of_every_kind(kind: str) -> None:
    value = orjson.dumps({"__copilotkit_interrupt_value__": "Continue?",
                          "__copilotkit_messages__": [
                              {"type": kind, "id": "m1", "content": "Continue?"}]}).decode()
    (meta,) = respond([ev.custom("on_interrupt", value)])["metaEvents"]
    assert meta["data"]["value"] == "Continue?"
    roles = [m["role"] for m in meta["data"]["messages"]]
    assert roles == {"ai": ["assistant"], "human": ["user"], "tool": []}[kind]


def test_agent_state_input_drops_the_conversation() -> None:
    # The client echoes the state of the last agent-state message, `messages` included.
    data = chat_data([text_message("u1", "user", "Hi")], agentSession={"agentName": "a"},
                     agentStates=[{"agentName": "a", "state": orjson.dumps({
                         "items": [1], "messages": [{"id": "u0", "content": "old"}]}).decode()}])
    offered = [{"name": "serverTool", "description": "", "parameters": {"type": "object"}}]
    page = {"name": "serverTool", "description": "the page's", "jsonSchema": "{}"}
    data["frontend"]["actions"] = [page, {**page, "name": "pageTool"}]
    request = run_request(data, None, server_actions=[], has_public_key=False,
                          offered_tools=offered)
    assert request.input.raw["state"] == {"items": [1]}
    assert [t["name"] for t in request.input.raw["tools"]] == ["serverTool", "pageTool"]
    assert request.input.raw["tools"][0]["parameters"] == {"type": "object"}
    assert request.frontend_tools == frozenset({"pageTool"})


# ---- a snapshot after what the runtime answered -----------------------------------------------


async def test_the_runtimes_answers_are_made_messages_once_for_all_later_snapshots(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each snapshot after a hand-over rebuilt the messages of every answered event (40 ms
    a snapshot after a long answer); they are built once, until another answer comes."""
    from copilot_runtime import _server_tools
    from copilot_runtime._input import parse_run_input
    from copilot_runtime._server_tools import ServerTools, ServerToolsAgent
    from copilot_runtime.agents.base import Agent, RunContext

    go = {"id": "u1", "role": "user", "content": "go"}

    class Script(Agent):
        def __init__(self, *batches: Batch) -> None:
            super().__init__()
            self.batches = batches

        def run(self, input: Any, context: RunContext) -> Any:
            async def batches() -> Any:
                for batch in self.batches:
                    yield batch
            return batches()

    snapshots = [[{"type": ev.MESSAGES_SNAPSHOT, "messages": [go, {
        "id": "m1", "role": "assistant", "toolCalls": [{
            "id": call, "type": "function", "function": {"name": "helper", "arguments": "{}"}}
            for call in calls]}, *({"id": f"s{i}", "role": "assistant", "content": "step"}
                                   for i in range(n))]}]
                 for calls, n in [*((["c1"], n) for n in range(20)), (["c1", "c2"], 1),
                                  (["c1", "c2"], 2)]]
    outer = Script([ev.tool_call_start("c1", "helper", "m1"), ev.tool_call_end("c1")],
                   *snapshots[:20],
                   [ev.tool_call_start("c2", "helper", "m1"), ev.tool_call_end("c2")],
                   *snapshots[20:])
    helper = Script([ev.text_message_start("h1"), ev.text_message_content("h1", "42"),
                     ev.text_message_end("h1")])
    input = parse_run_input({"threadId": "t", "runId": "r", "messages": [go], "tools": [],
                             "context": [], "state": {}, "forwardedProps": {}})
    built = 0
    real = _server_tools.events_to_messages

    def counted(runs: Any) -> list[dict[str, Any]]:
        nonlocal built
        built += 1
        return real(runs)

    monkeypatch.setattr(_server_tools, "events_to_messages", counted)
    agent = ServerToolsAgent(outer, ServerTools({}, {"helper": "h"}), lambda _: (helper, input))
    last: list[Any] = []
    async for batch in agent.run(input, RunContext(agent_id="outer")):
        last.extend(e["messages"] for e in batch if e["type"] == ev.MESSAGES_SNAPSHOT)
    assert built == 2  # once for each answered call
    assert [m["id"] for m in last[19]] == ["u1", "m1", last[19][2]["id"], "h1",
                                           *(f"s{i}" for i in range(19))]
    # The second call's result goes with the first's, before the first's agent's answer.
    assert [m.get("toolCallId") or m["id"] for m in last[-1]] == [
        "u1", "m1", "c1", "c2", "h1", "s0", "s1"]
