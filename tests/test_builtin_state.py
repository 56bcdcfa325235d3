"""The built-in agent and the application state a client shares (AG-UI `state`).

Before, the model never saw the run's `state` and had no way to change it. Now it reads the
state in its system prompt and may change it with `AGUISendStateSnapshot` and
`AGUISendStateDelta` (the TypeScript runtime's tools): each call becomes a `STATE_SNAPSHOT`
or `STATE_DELTA`, the next model step sees the new state, and the thread stores it. A call
that cannot be applied is a tool error the model reads; GraphQL runs see none of this.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from copilot_runtime import Action, BuiltInAgent, CopilotRuntime
from copilot_runtime.adapters import ChatRequest
from copilot_runtime.testing import ScriptedAdapter, text_turn, tool_turn, verify_events
from tests.conftest import Served, ServeRuntime, run_input, types
from tests.test_real_clients import run_client_script

pytestmark = pytest.mark.timeout(60)

SNAPSHOT, DELTA = "AGUISendStateSnapshot", "AGUISendStateDelta"
CART = {"cart": ["apple", "pear"]}


def _tools(request: ChatRequest) -> list[str]:
    return [tool.name for tool in request.tools]


def _call(name: str, arguments: Any) -> list[Any]:
    return tool_turn((name, orjson.dumps(arguments).decode()))


def _nested(levels: int) -> list[Any]:
    """Lists `levels` deep: with the state object and the request body around them, too deep
    for a client to send back (`MAX_JSON_DEPTH`)."""
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


async def _run(served: Served, thread: str, state: Any) -> list[dict[str, Any]]:
    events = await served.run(run_input("change my cart", thread=thread, state=state))
    verify_events(events)
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    return events


async def test_the_model_sees_the_state_and_is_offered_the_state_tools(
        serve_runtime: ServeRuntime) -> None:
    model = ScriptedAdapter(text_turn("You have an apple and a pear."))
    async with serve_runtime(CopilotRuntime(service_adapter=model)) as served:
        await _run(served, "t-sees", CART)
    request = model.requests[0]
    assert '"pear"' in (request.system_prompt or "")
    assert _tools(request) == [SNAPSHOT, DELTA]


async def test_an_empty_state_is_not_shown_nor_are_the_tools_offered_unless_asked(
        serve_runtime: ServeRuntime) -> None:
    """By default a run sharing no state offers no state tools: a model that takes no tools
    (a LangChain model without `bind_tools`) still chats. `state_tools=True` offers them
    on every run, as the TypeScript runtime does."""
    model = ScriptedAdapter(text_turn("hi"), text_turn("hi"))
    runtime = CopilotRuntime(service_adapter=model, instructions="Be brief.")
    always = ScriptedAdapter(text_turn("hi"))
    eager = CopilotRuntime(agents={"default": BuiltInAgent(always, state_tools=True)})
    async with serve_runtime(runtime) as served:
        await _run(served, "t-empty", {})
        await _run(served, "t-none", None)
    async with serve_runtime(eager) as served:
        await _run(served, "t-eager", {})
    assert [r.system_prompt for r in model.requests] == ["Be brief.", "Be brief."]
    assert [_tools(r) for r in model.requests] == [[], []]
    assert _tools(always.requests[0]) == [SNAPSHOT, DELTA]


async def test_a_delta_and_a_snapshot_change_the_state_the_model_and_the_thread_see(
        serve_runtime: ServeRuntime) -> None:
    model = ScriptedAdapter(
        _call(DELTA, {"delta": [{"op": "add", "path": "/cart/-", "value": "plum"},
                                {"op": "remove", "path": "/cart/0"}]}),
        _call(SNAPSHOT, {"snapshot": {"cart": ["pear", "plum"], "total": 2}}),
        text_turn("Done: pear and plum."))
    async with serve_runtime(CopilotRuntime(service_adapter=model)) as served:
        events = await _run(served, "t-change", CART)
        state = await (await served.session.get(served.url + "/threads/t-change/state")).json()
        replay = await served.run(run_input("", thread="t-change"),
                                  path="/agent/default/connect")
    final = {"cart": ["pear", "plum"], "total": 2}
    assert types(events).count("TOOL_CALL_RESULT") == 2
    delta, = _of(events, "STATE_DELTA")
    assert delta["delta"] == [{"op": "add", "path": "/cart/-", "value": "plum"},
                              {"op": "remove", "path": "/cart/0"}]
    snapshot, = _of(events, "STATE_SNAPSHOT")
    assert snapshot["snapshot"] == final
    results = _of(events, "TOOL_CALL_RESULT")
    assert all("error" not in r for r in results)
    # Each state event comes just before the result of the call that made it.
    assert events.index(delta) + 1 == events.index(results[0])
    assert events.index(snapshot) + 1 == events.index(results[1])
    # Each model step sees the state as the calls before it left it.
    prompts = [r.system_prompt or "" for r in model.requests]
    assert ('"apple"' in prompts[0], '"plum"' in prompts[0]) == (True, False)
    assert ('"apple"' in prompts[1], '"plum"' in prompts[1]) == (False, True)
    assert '"total": 2' in prompts[2]
    assert state == {"state": final}
    verify_events(replay)
    assert _of(replay, "STATE_SNAPSHOT")[-1]["snapshot"] == final
    # The real client holds the same state, live and after reloading the thread.
    live, reloaded = run_client_script("apply_events.mjs", [
        {"events": events, "state": CART}, {"events": replay, "state": {}}])
    assert live["state"] == final
    assert reloaded["state"] == final


@pytest.mark.parametrize(("name", "arguments", "reason"), [
    (DELTA, {"delta": [{"op": "replace", "path": "/missing/x", "value": 1}]}, "does not apply"),
    (DELTA, {"delta": [{"op": "test", "path": "/cart", "value": []}]}, "`op` must be"),
    (DELTA, {"delta": [{"op": "add", "path": "/cart/-"}]}, "needs a `value`"),
    (DELTA, {"delta": {"op": "add"}}, "must be a list"),
    (DELTA, {"delta": [{"op": "replace", "path": "", "value": [1]}]}, "a JSON object"),
    (SNAPSHOT, {"snapshot": ["not", "an", "object"]}, "must be a JSON object"),
    (SNAPSHOT, {}, "must be a JSON object"),
    (SNAPSHOT, {"snapshot": {"deep": _nested(63)}}, "nest deeper"),
    # Copies of copies double the state at each operation: 40 of them held the server for
    # minutes before the size was checked at the end.
    (DELTA, {"delta": [{"op": "copy", "from": "/cart", "path": "/cart/-"}] * 40},
     "copies more than the state holds"),
])
async def test_a_call_that_cannot_be_applied_is_a_tool_error_and_changes_nothing(
        serve_runtime: ServeRuntime, name: str, arguments: Any, reason: str) -> None:
    model = ScriptedAdapter(_call(name, arguments), text_turn("Sorry."))
    async with serve_runtime(CopilotRuntime(service_adapter=model)) as served:
        events = await _run(served, "t-bad", CART)
        state = await (await served.session.get(served.url + "/threads/t-bad/state")).json()
    result, = _of(events, "TOOL_CALL_RESULT")
    assert reason in result["error"], result
    assert reason in orjson.loads(result["content"])["error"]
    assert types(events).count("STATE_SNAPSHOT") + types(events).count("STATE_DELTA") == 0
    assert '"pear"' in (model.requests[1].system_prompt or "")
    assert state == {"state": None}


async def test_a_malformed_call_is_a_tool_error(serve_runtime: ServeRuntime) -> None:
    model = ScriptedAdapter(tool_turn((DELTA, '{"delta": [')), text_turn("Sorry."))
    async with serve_runtime(CopilotRuntime(service_adapter=model)) as served:
        events = await _run(served, "t-malformed", CART)
    result, = _of(events, "TOOL_CALL_RESULT")
    assert result["error"] == "the arguments are not valid JSON"


async def test_a_state_call_with_a_lone_surrogate_is_taken_as_server_actions_take_it(
        serve_runtime: ServeRuntime) -> None:
    # (a model cutting an emoji: valid JSON, refused as "not valid JSON" before)
    arguments = '{"snapshot": {"note": "smile \\ud83d"}}'
    model = ScriptedAdapter(tool_turn((SNAPSHOT, arguments)), text_turn("Done."))
    async with serve_runtime(CopilotRuntime(service_adapter=model)) as served:
        events = await _run(served, "t-surrogate", CART)
    result, = _of(events, "TOOL_CALL_RESULT")
    assert "error" not in result, result
    snapshot, = _of(events, "STATE_SNAPSHOT")
    assert snapshot["snapshot"] == {"note": "smile \ufffd"}


async def test_state_tools_off_leaves_the_state_read_only(serve_runtime: ServeRuntime) -> None:
    model = ScriptedAdapter(_call(SNAPSHOT, {"snapshot": {}}), text_turn("No."))
    agent = BuiltInAgent(model, state_tools=False)
    async with serve_runtime(CopilotRuntime(agents={"default": agent})) as served:
        events = await _run(served, "t-off", CART)
    assert _tools(model.requests[0]) == []
    assert '"pear"' in (model.requests[0].system_prompt or "")
    assert "not change it" in (model.requests[0].system_prompt or "")
    result, = _of(events, "TOOL_CALL_RESULT")  # a tool it was not offered
    assert "no tool named" in result["error"]
    assert not _of(events, "STATE_SNAPSHOT")


async def test_graphql_runs_of_the_default_agent_see_no_state_tools(
        serve_runtime: ServeRuntime) -> None:
    from tests.gql.wire import user_turn

    model = ScriptedAdapter(text_turn("hello"))
    runtime = CopilotRuntime(service_adapter=model, instructions="Be brief.")
    async with serve_runtime(runtime) as served:
        await served.generate(user_turn("hi", agentStates=[
            {"agentName": "default", "state": orjson.dumps(CART).decode()}]))
    assert _tools(model.requests[0]) == []
    assert model.requests[0].system_prompt == "Be brief."


async def test_the_openai_adapter_carries_a_state_call_through_the_mock_llm(
        served: Served) -> None:
    """The real adapter and the loopback OpenAI server: the state tools' schemas go out, the
    model's call comes back, and the tool result answers it (the mock refuses otherwise)."""
    patch = [{"op": "replace", "path": "/cart/1", "value": "plum"}]
    body = run_input("call:AGUISendStateDelta " + orjson.dumps({"delta": patch}).decode(),
                     thread="t-openai", state=CART)
    events = await served.run(body)
    verify_events(events)
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    delta, = _of(events, "STATE_DELTA")
    assert delta["delta"] == patch
    result, = _of(events, "TOOL_CALL_RESULT")
    assert "error" not in result
    state = await (await served.session.get(served.url + "/threads/t-openai/state")).json()
    assert state == {"state": {"cart": ["apple", "plum"]}}


async def test_an_action_named_like_a_state_tool_keeps_its_name(
        serve_runtime: ServeRuntime) -> None:
    def save(snapshot: Any = None) -> str:
        return "saved by the app"

    own = Action(SNAPSHOT, save, description="The app's own",
                 parameters={"type": "object", "properties": {}})
    model = ScriptedAdapter(_call(SNAPSHOT, {"snapshot": {"a": 1}}), text_turn("ok"))
    async with serve_runtime(CopilotRuntime(service_adapter=model, actions=[own])) as served:
        events = await _run(served, "t-own", CART)
    assert _tools(model.requests[0]) == [SNAPSHOT, DELTA]
    assert model.requests[0].tools[0].description == "The app's own"
    assert "saved by the app" in _of(events, "TOOL_CALL_RESULT")[0]["content"]
    assert "STATE_SNAPSHOT" not in types(events)


async def test_a_state_as_deep_as_a_client_can_send_back_is_taken(
        serve_runtime: ServeRuntime) -> None:
    model = ScriptedAdapter(_call(SNAPSHOT, {"snapshot": {"deep": _nested(62)}}),
                            text_turn("ok"), text_turn("again"))
    async with serve_runtime(CopilotRuntime(service_adapter=model)) as served:
        events = await _run(served, "t-deep", {"deep": []})
        again = await served.run(run_input("hi", thread="t-deep-2",
                                           state=_of(events, "STATE_SNAPSHOT")[0]["snapshot"]))
    assert again[-1]["type"] == "RUN_FINISHED", again[-1]  # the body is within the bound


async def test_state_calls_have_tool_spans(serve_runtime: ServeRuntime) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from copilot_runtime.telemetry import Telemetry

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    model = ScriptedAdapter(tool_turn((SNAPSHOT, '{"snapshot": {"a": 1}}'), (DELTA, "[]")),
                            text_turn("ok"))
    runtime = CopilotRuntime(service_adapter=model, telemetry=Telemetry(tracer_provider))
    try:
        async with serve_runtime(runtime) as served:
            await _run(served, "t-spans", CART)
    finally:
        tracer_provider.shutdown()
    tools = {s.name: s for s in exporter.get_finished_spans()
             if s.name.startswith("execute_tool ")}
    assert set(tools) == {f"execute_tool {SNAPSHOT}", f"execute_tool {DELTA}"}
    assert tools[f"execute_tool {SNAPSHOT}"].status.status_code != StatusCode.ERROR
    assert tools[f"execute_tool {DELTA}"].status.status_code == StatusCode.ERROR
