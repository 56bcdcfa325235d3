"""Guardrails judge the client-written text that reaches an agent outside messages, on both
protocols: the strings of `state` (AG-UI `state`; GraphQL `agentStates`), which a LangGraph
graph merges into its state and often puts in the prompt; a LangGraph interrupt's answer
(`forwardedProps.command.resume`, AG-UI 1.0's `resume`, a GraphQL `metaEvents` response, the
approvals route's answers); messages' `name`s; tool results' errors. Before the fix none of
it was judged. The rest of `forwardedProps` (GraphQL `properties`, an agent's `config`) is
the app's data, auth tokens often: it is not sent to a guardrail.

Each text is judged once a thread: the state an agent wrote is its own, so a client that
sends it back costs no judge call; a hostile huge or deep state is refused, not walked."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from copilot_runtime import CopilotRuntime, PatternGuardrail
from copilot_runtime import events as ev
from copilot_runtime._compaction import apply_state_delta
from copilot_runtime._trust import _DEEPEST, _MOST_VALUES, _TooMuchToJudge, judged
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.runtime import approval_service
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.workflows.review_loop import ReviewLoop
from tests.agents_support import graphs
from tests.conftest import Served, ServeRuntime, openai_runtime, run_input, text_of, types
from tests.gql.wire import chat_data, text_message
from tests.test_graphql_agents import Scripted, history_of, session, states, texts, turn
from tests.test_hitl_agui import V1, Drafting, answer, interrupt_of, run
from tests.test_hostile_trust import (
    _GENERATE,
    DENIED,
    GQL,
    REFUSAL,
    Recorder,
    assert_graphql_refused,
    call,
    guarded,
)

pytestmark = pytest.mark.timeout(90)

__all__ = ["guarded"]  # a fixture

_HELLO = {"id": "u1", "role": "user", "content": "hello"}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as http:
        yield http


def _deep(depth: int, leaf: Any) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"next": value}
    return value


_AGUI: dict[str, dict[str, Any]] = {
    "state value": {"state": {"notes": DENIED}},
    "state nested in a list": {"state": {"items": [{"title": "a"}, {"title": DENIED}]}},
    "state nested key": {"state": {"draft": {DENIED: True}}},
    # The built-in agent shows the model the whole state, keys too: before the fix a
    # top-level key was never judged.
    "state top-level key": {"state": {DENIED: True}},
    "state not an object": {"state": [DENIED]},
    "forwardedProps.command.resume": {"forwardedProps": {"command": {"resume": DENIED}}},
    "forwardedProps.command.resume object": {
        "forwardedProps": {"command": {"resume": {"approved": True, "comment": DENIED}}}},
    "resume payload": {"resume": [{"interruptId": "i1", "status": "resolved",
                                   "payload": {"answer": DENIED}}]},
    "tool result error": {"messages": [
        _HELLO, {"id": "a1", "role": "assistant", "toolCalls": [{
            "id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"id": "t1", "role": "tool", "toolCallId": "c1", "content": "", "error": DENIED}]},
    "user message name": {"messages": [{**_HELLO, "name": "the admin password"}]},
    "assistant message name": {"messages": [
        _HELLO, {"id": "a1", "role": "assistant", "content": "hi", "name": "password"},
        {"id": "u2", "role": "user", "content": "go on"}]},
}


@pytest.mark.parametrize("case", list(_AGUI))
async def test_agui_guardrails_judge_state_forwarded_props_and_names(
        guarded: Served, llm: MockOpenAIServer, case: str) -> None:
    body = run_input("hello", thread="st-1", run="st-r")
    body.update(_AGUI[case])
    events = await guarded.run(body)
    assert text_of(events) == REFUSAL, events
    assert types(events)[-1] == "RUN_FINISHED"
    assert llm.requests == []  # the model saw nothing


async def test_forwarded_props_but_an_interrupt_answer_are_not_judged(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """`forwardedProps` but `command.resume` is the app's data (an auth token, a thread's
    metadata), model settings and the node a graph starts from: none of it goes to a
    guardrail, whose judge model must not be sent an app's secrets (before the fix all of
    it but the settings was judged, and a denied word in a token refused the run)."""
    recorder = Recorder()
    guardrails = [recorder, PatternGuardrail(deny=[r"\bpassword\b"])]
    async with serve_runtime(openai_runtime(llm, guardrails=guardrails)) as served:
        events = await served.run(run_input("hello", thread="st-settings", forwardedProps={
            "temperature": 0.5, "stop": ["password"], "nodeName": "chat_node",
            "authToken": "secret-token-1234", "threadMetadata": {"title": DENIED},
            "command": {"goto": "password"}}))
    assert types(events)[-1] == "RUN_FINISHED"
    assert text_of(events) != REFUSAL, events
    assert recorder.judged == ["hello"]


_PLANNER = "planner"


def _planner_session(thread: str, **extra: Any) -> dict[str, Any]:
    return chat_data([text_message(f"{thread}-u", "user", "hello")], thread=thread,
                     agentSession={"agentName": _PLANNER}, **extra)


_GRAPHQL: dict[str, dict[str, Any]] = {
    "agentStates state": {"agentStates": [
        {"agentName": _PLANNER, "state": json.dumps({"notes": [DENIED]})}]},
    "agentStates top-level key": {"agentStates": [
        {"agentName": _PLANNER, "state": json.dumps({DENIED: "yes"})}]},
    "metaEvents response": {"metaEvents": [
        {"name": "LangGraphInterruptEvent", "value": '"Proceed?"', "response": DENIED}]},
    "CopilotKit interrupt response": {"metaEvents": [
        {"name": "CopilotKitLangGraphInterruptEvent", "value": '{"action": "approve"}',
         "response": json.dumps({"approved": False, "why": DENIED})}]},
}


@pytest.mark.parametrize("case", list(_GRAPHQL))
async def test_graphql_guardrails_judge_agent_state_and_interrupt_answers(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer, case: str) -> None:
    agent = Scripted([ev.text_message_start("m1"), ev.text_message_content("m1", "done"),
                      ev.text_message_end("m1")])
    runtime = openai_runtime(llm, guardrails=[PatternGuardrail(deny=[r"\bpassword\b"])],
                             agents={_PLANNER: agent})
    async with serve_runtime(runtime) as served:
        await assert_graphql_refused(served, _planner_session("gst-1", **_GRAPHQL[case]))
    assert agent.seen == []  # the agent was never called


_WITH_PROPERTIES = _GENERATE.replace(
    "mutation($data: GenerateCopilotResponseInput!)",
    "mutation($data: GenerateCopilotResponseInput!, $properties: JSONObject)").replace(
    "generateCopilotResponse(data: $data)",
    "generateCopilotResponse(data: $data, properties: $properties)")


async def test_graphql_properties_and_agent_config_are_not_judged(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """`properties` (an app's auth token, often) and an agent session's `config` reach the
    agent as `forwardedProps`, not as the user's words: they are not sent to a guardrail
    (before the fix they were, and refused the run); an interrupt's answer sent among the
    properties (`command.resume`) still is."""
    recorder = Recorder()
    agent = Scripted([ev.text_message_start("m1"), ev.text_message_content("m1", "done"),
                      ev.text_message_end("m1")])
    runtime = openai_runtime(llm, agents={_PLANNER: agent}, guardrails=[
        recorder, PatternGuardrail(deny=[r"\bpassword\b"])])
    config = json.dumps({"configurable": {"persona": DENIED}})
    data = _planner_session("gst-props", agentStates=[
        {"agentName": _PLANNER, "state": "{}", "config": config}])
    async with serve_runtime(runtime) as served:
        status, body = await call(served, "POST", "", None, {
            "query": _WITH_PROPERTIES, "variables": {"data": data, "properties": {
                "authorization": "Bearer secret-token-1234", "note": {"text": DENIED}}}},
            GQL)
        assert status == 200, body
        response = orjson.loads(body)["data"]["generateCopilotResponse"]
        assert response["status"]["code"] == "Success", response
        assert recorder.judged == ["hello"]
        status, body = await call(served, "POST", "", None, {
            "query": _WITH_PROPERTIES, "variables": {
                "data": _planner_session("gst-props-2"),
                "properties": {"command": {"resume": DENIED}}}}, GQL)
        assert status == 200, body
        response = orjson.loads(body)["data"]["generateCopilotResponse"]
        assert response["status"]["details"] == {"guardrailsReason": REFUSAL}, response
    assert len(agent.seen) == 1


# ---- the agent's own state ------------------------------------------------------------------


def _client_state(events: list[dict[str, Any]], state: Any) -> Any:
    """The state an AG-UI client holds after a run's events (as `@ag-ui/client` applies
    them)."""
    for event in events:
        if event["type"] == "STATE_SNAPSHOT":
            state = event["snapshot"]
        elif event["type"] == "STATE_DELTA":
            state = apply_state_delta(state, event["delta"])
    return state


async def test_agui_the_agents_own_state_is_not_judged_again(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer, client: httpx.AsyncClient) -> None:
    """A LangGraph graph reads the state the page wrote and writes it back changed: the
    page's text is judged once; the state the graph wrote, sent back as the client holds
    it, is not judged at all (only the new user message is); a field the page edits is
    judged, alone."""
    recorder = Recorder()
    runtime = CopilotRuntime(guardrails=[recorder], agents={_PLANNER: LangGraphAgent(
        name=_PLANNER, graph=graphs.shared_state_graph(llm.base_url, client))})
    async with serve_runtime(runtime) as served:
        state: Any = {"items": ["from the page"], "counter": 5}
        first = await served.run(run_input("Plan", thread="own", run="r1", state=state),
                                 agent=_PLANNER)
        assert types(first)[-1] == "RUN_FINISHED", first
        state = _client_state(first, state)
        assert state["items"] == ["from the page", "item 2"]
        messages = [{"id": "r1-u", "role": "user", "content": "Plan"}]
        for run in ("r2", "r3"):
            messages.append({"id": f"{run}-u", "role": "user", "content": f"Again {run}"})
            events = await served.run(run_input("", thread="own", run=run, state=state,
                                                messages=messages), agent=_PLANNER)
            assert types(events)[-1] == "RUN_FINISHED", events
            state = _client_state(events, state)
        edited = {**state, "items": [*state["items"], "a page edit"]}
        messages.append({"id": "r4-u", "role": "user", "content": "Once more"})
        events = await served.run(run_input("", thread="own", run="r4", state=edited,
                                            messages=messages), agent=_PLANNER)
        assert types(events)[-1] == "RUN_FINISHED", events
    # (keys too: a client can send any; the user messages, sent back to back with no
    # answer between, are read by the model as one, and judged so with each new one)
    assert recorder.judged == [
        "Plan", "items\nfrom the page\ncounter", "Plan\nAgain r2", "Plan\nAgain r2\nAgain r3",
        "Plan\nAgain r2\nAgain r3\nOnce more", "\n".join(["items", *edited["items"]])]


async def test_graphql_the_agents_own_state_is_not_judged_again(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer, client: httpx.AsyncClient) -> None:
    """The same over GraphQL: the 1.10 client sends the last agent-state message's state
    back in `agentStates` (its conversation included, which the runtime leaves out)."""
    recorder = Recorder()
    runtime = CopilotRuntime(guardrails=[recorder], agents={_PLANNER: LangGraphAgent(
        name=_PLANNER, graph=graphs.shared_state_graph(llm.base_url, client))})
    async with serve_runtime(runtime) as served:
        response = await turn(served, session(_PLANNER, "Plan", "gown", agentStates=[
            {"agentName": _PLANNER, "state": '{"items": ["from the page"], "counter": 5}'}]))
        for text in ("Again", "And again"):
            last = states(response)[-1]
            response = await turn(served, chat_data(
                [*history_of(last), text_message(f"u-{text}", "user", text)], thread="gown",
                agentSession={"agentName": _PLANNER, "nodeName": last["nodeName"]},
                agentStates=[{"agentName": _PLANNER, "state": json.dumps(last["state"])}]))
            assert texts(response)[-1].startswith("echo: items=")
    assert recorder.judged == ["Be brief.", "Plan", "items\nfrom the page\ncounter", "Again",
                               "And again"]


class _StateWriter(Scripted):
    """Writes a state of `values` strings, then answers."""

    def __init__(self, values: int) -> None:
        super().__init__([ev.state_snapshot({"rows": [f"row {i}" for i in range(values)]}),
                          ev.text_message_start("m1"), ev.text_message_content("m1", "done"),
                          ev.text_message_end("m1")])


async def test_hostile_state_is_refused_not_walked(serve_runtime: ServeRuntime,
                                                   llm: MockOpenAIServer) -> None:
    """A state with more values than a run may bring to judge, or nesting deeper than it
    may, is refused (within the body's own bounds); the agent's own state of as many
    values, sent back, is not walked, so not refused."""
    recorder = Recorder()
    agent = _StateWriter(_MOST_VALUES + 10)
    runtime = openai_runtime(llm, guardrails=[recorder], agents={"writer": agent})
    async with serve_runtime(runtime) as served:
        huge = {"rows": [""] * (_MOST_VALUES + 10)}
        events = await served.run(run_input("hello", thread="huge", state=huge))
        assert text_of(events).startswith(f"Your request brings more than {_MOST_VALUES}")
        deep = {"draft": _deep(_DEEPEST + 1, "x")}
        events = await served.run(run_input("hello", thread="deep", state=deep))
        assert text_of(events).startswith(f"Your request nests values more than {_DEEPEST}")
        assert llm.requests == []
        # Not kept as let through: refused again.
        events = await served.run(run_input("hello", thread="deep", run="again", state=deep))
        assert text_of(events).startswith("Your request nests values")

        first = await served.run(run_input("hello", thread="mine", run="r1"), agent="writer")
        state = _client_state(first, {})
        assert len(state["rows"]) == _MOST_VALUES + 10
        second = await served.run(run_input("more", thread="mine", run="r2", state=state,
                                            messages=[_HELLO | {"id": "r1-u"},
                                                      {"id": "r2-u", "role": "user",
                                                       "content": "more"}]), agent="writer")
        assert text_of(second) == "done"
    assert recorder.judged == ["hello", "hello\nmore"]  # (back to back: judged as one)


def test_in_process_input_too_deep_to_encode_is_refused() -> None:
    """An input built in process is not held to the body's depth bound: a state deeper
    than JSON encoders write, or holding what JSON cannot, is refused, not an error."""
    with pytest.raises(_TooMuchToJudge) as raised:
        judged({"messages": [_HELLO], "state": {"draft": _deep(1000, "x")}}, set())
    assert "levels deep" in raised.value.verdict.reason
    with pytest.raises(_TooMuchToJudge) as raised:
        judged({"messages": [_HELLO], "state": {"draft": object()}}, set())
    assert "cannot be checked" in raised.value.verdict.reason


@pytest.mark.parametrize("wait", [True, False], ids=["wait", "no-wait"])
async def test_a_refused_interrupt_answer_leaves_the_approval_pending(
        serve_runtime: ServeRuntime, tmp_path: Path, wait: bool) -> None:
    """A denied answer to a LangGraph interrupt, as AG-UI 1.0's `resume` or through the
    approvals route (waiting or not), never reaches the graph: the approval stays pending,
    and a clean answer then goes through.

    The route judges the answer before it records it, and says so: 422 with the guardrail's
    reason. Before the fix a waiting answer said 200, run `finished`; one not waiting said
    202, its answer recorded: the recovery resent it every 30 s, refused each time, and the
    approval answered 409 to any new answer."""
    saver = checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3")
    specialists = [Drafting(n) for n in ("Invoice", "Closing", "Audit")]
    runtime = CopilotRuntime(
        agents={"review": ReviewLoop(specialists).agent(name="review", checkpointer=saver)},
        guardrails=[PatternGuardrail(deny=[r"\bpassword\b"])])
    service = approval_service(runtime)
    try:
        async with serve_runtime(runtime) as served:
            pending = interrupt_of(await run(served, "hitl", "Prepare the invoice", **V1))
            events = await run(served, "hitl", resume=[{
                "interruptId": pending["id"], "status": "resolved",
                "payload": {"action": "revise", "payload": DENIED}}], **V1)
            assert text_of(events) == REFUSAL
            status, body = await answer(served, pending["id"], {
                "action": "revise", "payload": DENIED, "wait": wait})
            assert (status, body) == (422, {
                "error": "Refused by a guardrail", "message": REFUSAL,
                "code": "GUARDRAILS_VALIDATION_FAILED"}), body
            (listed,) = await service.list(status=None)
            assert (listed.status, listed.answer) == ("pending", None)
            assert not runtime.is_running("hitl")  # the thread was given back
            store = runtime.agents["review"].approvals  # type: ignore[attr-defined]
            assert await store.unapplied() == []  # nothing for the recovery to resend
            assert [c.feedback for c in specialists[0].calls] == [None]  # asked once, only
            status, body = await answer(served, pending["id"], {"action": "approve"})
            assert (status, body["approval"]["status"]) == (200, "answered"), body
            assert body["approval"]["applied"] is True
    finally:
        await service.aclose()
