"""Chat suggestions of CopilotKit 1.75 (`POST agent/{id}/suggest`, the single-route
`agent/suggest`): a run as any other (forced `copilotkitSuggest` tool, guardrails, limits,
ownership), kept out of its thread: never stored, never holding the thread."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from copilot_runtime import BearerTokenAuth, CopilotRuntime, PatternGuardrail, RateLimit
from copilot_runtime.testing import MockOpenAIServer, verify_events
from tests.conftest import (
    GatedAgent,
    Served,
    ServeRuntime,
    openai_runtime,
    parse_sse,
    poll,
    run_input,
    text_of,
    types,
)

pytestmark = pytest.mark.asyncio

SUGGEST_TOOL: dict[str, Any] = {
    "name": "copilotkitSuggest", "description": "Suggest what the user could say next",
    "parameters": {"type": "object", "properties": {"suggestions": {"type": "array", "items": {
        "type": "object", "properties": {"title": {"type": "string"},
                                         "message": {"type": "string"}}}}}}}
FORCED = {"toolChoice": {"type": "function", "function": {"name": "copilotkitSuggest"}}}
SUGGESTIONS = {"suggestions": [{"title": "Weather", "message": "What is the weather in Paris?"}]}
ALICE, BOB = "tok-alice-0001", "tok-bob-00002"


def suggest_input(thread: str, history: list[dict[str, Any]] | None = None,
                  run: str = "sugg-run") -> dict[str, Any]:
    """What `@copilotkit/core` 1.75's `generateSuggestions()` sends: the chat's history, then
    its prompt (here with the mock's line for the forced call), one tool, the tool forced."""
    prompt = ("Suggest what the user could say next.\n"
              f"call:copilotkitSuggest {orjson.dumps(SUGGESTIONS).decode()}")
    return run_input("", thread=thread, run=run, tools=[SUGGEST_TOOL], forwardedProps=FORCED,
                     messages=[*(history or []), {"id": f"{run}-p", "role": "user",
                                                  "content": prompt}])


def suggested(events: list[dict[str, Any]]) -> Any:
    return orjson.loads("".join(e["delta"] for e in events if e["type"] == "TOOL_CALL_ARGS"))


async def test_info_advertises_suggestions(served: Served) -> None:
    assert (await (await served.session.get(served.url + "/info")).json())["suggestions"]
    single = await (await served.post("", {"method": "info"})).json()
    assert single["suggestions"] is True


async def test_suggest_streams_the_forced_call_and_stores_nothing(
        served: Served, llm: MockOpenAIServer) -> None:
    events = await served.run(suggest_input("sugg-thread"), path="/agent/default/suggest")
    verify_events(events)
    assert types(events) == ["RUN_STARTED", "TOOL_CALL_START", *["TOOL_CALL_ARGS"] * 5,
                             "TOOL_CALL_END", "RUN_FINISHED"]
    assert events[1]["toolCallName"] == "copilotkitSuggest"
    assert suggested(events) == SUGGESTIONS
    assert llm.requests[-1]["tool_choice"] == FORCED["toolChoice"]
    assert await served.runtime.store.get("sugg-thread") is None
    listed = await (await served.session.get(served.url + "/threads")).json()
    assert listed["threads"] == []


async def test_single_route_suggest(served: Served) -> None:
    response = await served.post("", {"method": "agent/suggest",
                                      "params": {"agentId": "default"},
                                      "body": suggest_input("single-sugg")})
    assert response.status == 200
    events = parse_sse(await response.read())
    assert suggested(events) == SUGGESTIONS
    assert await served.runtime.store.get("single-sugg") is None


async def test_suggest_for_an_unknown_agent_is_404(served: Served) -> None:
    response = await served.post("/agent/nobody/suggest", suggest_input("t"))
    assert response.status == 404
    single = await served.post("", {"method": "agent/suggest", "params": {"agentId": "nobody"},
                                    "body": suggest_input("t")})
    assert single.status == 404
    assert (await served.session.get(served.url + "/agent/default/suggest")).status == 405


async def test_suggest_on_the_chat_thread_leaves_its_history_and_slot_alone(
        served: Served) -> None:
    """A suggestion sent with the chat's own thread id (a client may) while the chat's run
    streams: no 409, and the thread keeps only the chat's runs."""
    await served.run(run_input("first question", thread="chat"))
    before = await (await served.session.get(served.url + "/threads/chat/messages")).json()
    slow = asyncio.create_task(served.run(run_input("slow:60 a b c d e", thread="chat",
                                                    run="run-2")))
    async for _ in poll():
        if "chat" in served.runtime.runs.active:
            break
    assert "chat" in served.runtime.runs.active
    history = [{"id": "run-1-u", "role": "user", "content": "first question"}]
    events = await served.run(suggest_input("chat", history), path="/agent/default/suggest")
    assert suggested(events) == SUGGESTIONS
    chat = await slow
    assert types(chat)[-1] == "RUN_FINISHED"
    after = await (await served.session.get(served.url + "/threads/chat/messages")).json()
    assert after["messages"][:len(before["messages"])] == before["messages"]
    assert [m["content"] for m in after["messages"] if m["role"] == "user"] == [
        "first question", "slow:60 a b c d e"]
    assert not any(m.get("toolCalls") for m in after["messages"])
    assert not served.runtime.runs.unstored


async def test_guardrails_limits_and_ownership_apply(serve_runtime: ServeRuntime,
                                                     llm: MockOpenAIServer) -> None:
    runtime = openai_runtime(llm, auth=BearerTokenAuth({ALICE: "alice", BOB: "bob"}),
                             guardrails=[PatternGuardrail(deny=[r"\bpassword\b"])],
                             rate_limit=RateLimit(runs_per_minute=3))

    async def suggest(token: str, body: dict[str, Any]) -> tuple[int, bytes]:
        response = await served.post("/agent/default/suggest", body,
                                     headers={"Authorization": f"Bearer {token}"})
        return response.status, await response.read()

    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/default/run", run_input("hi", thread="alices"),
                                     headers={"Authorization": f"Bearer {ALICE}"})
        assert response.status == 200
        await response.read()
        # Bob may not run on alice's thread, suggestion or not.
        assert (await suggest(BOB, suggest_input("alices")))[0] == 404
        calls = len(llm.requests)
        status, body = await suggest(ALICE, suggest_input("s1", [
            {"id": "h", "role": "user", "content": "my password is hunter2"}]))
        assert status == 200
        events = parse_sse(body)
        assert "TOOL_CALL_START" not in types(events)
        assert text_of(events) == "Sorry, I can't help with that request."  # a refusal
        assert len(llm.requests) == calls  # the model never saw it
        assert (await suggest(ALICE, suggest_input("s2")))[0] == 200
        status, body = await suggest(ALICE, suggest_input("s3"))
        assert status == 429, body  # alice's third run this minute: the chat's, and two
        assert await runtime.store.get("s2") is None


async def test_a_suggestion_whose_client_leaves_is_stopped(serve_runtime: ServeRuntime) -> None:
    """No one could pick a suggestion up again (it is not stored): the core's abort of a
    stale suggestion stops its run, where a chat's run would go on without its client."""
    agent = GatedAgent()
    async with serve_runtime(CopilotRuntime(agents={"gated": agent})) as served:
        response = await served.post("/agent/gated/suggest", run_input("hi", thread="left"))
        received = b""
        async with asyncio.timeout(10):
            while b"TEXT_MESSAGE_CONTENT" not in received:
                received += await response.content.readany()
        assert len(served.runtime.runs.unstored) == 1
        response.close()
        async for _ in poll(10, every=0.01):
            if not served.runtime.runs.unstored:
                break
        assert not served.runtime.runs.unstored
        assert not agent.gate.is_set()  # stopped, not run to its end
        assert await served.runtime.store.get("left") is None
