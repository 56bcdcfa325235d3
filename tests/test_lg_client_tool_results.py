"""A tool result the client sends (a frontend tool's) reaches a LangGraph graph's model as the
client wrote it, and comes back in snapshots, a reconnect and the stored thread as sent.

Before the fix, a result in parts (AG-UI's text, image, ... parts) reached the model and the
checkpoint as each part's Python repr ("type='text' id=None text='see' ...") and came back
as ""; a result with an `error` reached the model as an empty result, and came back with
the word "error" for its error. Then its media parts reached OpenAI as `image_url` parts in
a tool message, which the real API refuses (so did every later run of the thread)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from copilotkit import CopilotKitState
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph

from copilot_runtime import CopilotRuntime
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.testing import MockOpenAIServer, verify_events
from tests.agents_support import graphs
from tests.conftest import Served, ServeRuntime, run_input, text_of
from tests.test_real_clients import run_client_script

pytestmark = pytest.mark.timeout(120)

PARTS = [{"type": "text", "text": "see"},
         {"type": "image", "source": {"type": "url", "value": "https://example.test/x.png"}},
         {"type": "audio", "source": {"type": "data", "value": "UklGRiQAAABXQVZF",
                                      "mimeType": "audio/wav"}}]
FAILED = {"content": "", "error": "lookup failed: quota exceeded"}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as http:
        yield http


def history(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A frontend tool's call and the client's `result` of it, then a new question."""
    return [{"id": "u1", "role": "user", "content": "hi"},
            {"id": "a1", "role": "assistant", "toolCalls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "lookup", "arguments": "{}"}}]},
            {"id": "t1", "role": "tool", "toolCallId": "c1", **result},
            {"id": "u2", "role": "user", "content": "next"}]


def tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m.get("role") == "tool"]


def snapshot_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]


async def conversation(llm: MockOpenAIServer, client: httpx.AsyncClient,
                       serve_runtime: ServeRuntime, result: dict[str, Any]
                       ) -> tuple[list[Any], list[Any], list[Any], list[dict[str, Any]]]:
    """Run `history(result)`, reconnect, and run a turn on from the snapshot the client
    kept: each run's events, and the model's tool messages of each model call."""
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
        name="lg", graph=graphs.chat_graph(llm.base_url, client))})
    async with serve_runtime(runtime) as served:
        first = await served.run(run_input("", thread="tr", messages=history(result)),
                                 agent="lg")
        connected = await served.run(run_input("", thread="tr", run="c1", messages=[]),
                                     path="/agent/lg/connect")
        (held,) = run_client_script("apply_events.mjs", [{"events": connected, "state": {}}])
        later = await served.run(run_input("", thread="tr", run="run-2", messages=[
            *held["messages"], {"id": "u3", "role": "user", "content": "third"}]), agent="lg")
    for events in (first, later):
        verify_events(events)
    return first, held["messages"], later, [tool_messages(r["messages"]) for r in llm.requests]


async def test_a_result_in_parts_reaches_the_model_as_text(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    """Media in a tool message went to OpenAI as `image_url` (or audio) parts, which its API
    refuses in a tool message; the checkpoint kept them, so every later run failed too."""
    first, held, later, model_saw = await conversation(llm, client, serve_runtime,
                                                       {"content": PARTS})
    # (the text, then a line naming each media part: never its inline data)
    text = "see\n[image attachment: https://example.test/x.png]\n[audio attachment: audio/wav]"
    assert model_saw == [[{"role": "tool", "tool_call_id": "c1", "content": text}]] * 2
    sent = {"id": "t1", "role": "tool", "toolCallId": "c1", "content": PARTS}
    assert tool_messages(snapshot_of(first)) == [sent]
    assert tool_messages(held) == [sent]
    assert tool_messages(snapshot_of(later)) == [sent]
    assert text_of(later) == "echo: third"


async def test_a_data_url_or_a_long_address_is_named_briefly(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    """A data URL given as a part's URL (what a browser's readAsDataURL gives) went into the
    model's text whole: a screenshot's millions of base64 characters, kept by the checkpoint
    for every later run. Now its type alone is named, and a long address is cut."""
    inline = "data:image/png;base64," + "iVBORw0KGgo" * 2000
    far = "https://example.test/" + "a" * 1000
    parts = [{"type": "text", "text": "see"},
             {"type": "image", "source": {"type": "url", "value": inline}},
             {"type": "image", "source": {"type": "url", "value": far}}]
    first, _, _, model_saw = await conversation(llm, client, serve_runtime, {"content": parts})
    text = f"see\n[image attachment: image/png]\n[image attachment: {far[:300]}...]"
    assert model_saw == [[{"role": "tool", "tool_call_id": "c1", "content": text}]] * 2
    assert tool_messages(snapshot_of(first))[0]["content"] == parts  # (the client's, whole)


async def test_the_mock_model_refuses_media_in_a_tool_message(llm: MockOpenAIServer) -> None:
    """As OpenAI's API does: a tool message takes text parts only."""
    async with openai.AsyncOpenAI(base_url=llm.base_url, api_key="sk-mock",
                                  max_retries=0) as sdk:
        for part, words in (
                ({"type": "image_url", "image_url": {"url": "https://example.test/x.png"}},
                 "Image URLs are only allowed for messages with role 'user'"),
                ({"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}},
                 "Invalid value: 'input_audio'. Supported values are: 'text'.")):
            with pytest.raises(openai.BadRequestError, match=words):
                await sdk.chat.completions.create(model="gpt-4o", messages=[
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                          "function": {"name": "f",
                                                                       "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1",
                     "content": [{"type": "text", "text": "see"}, part]}])  # type: ignore[list-item]
        text = await sdk.chat.completions.create(model="gpt-4o", messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]}])
    assert text.choices[0].message.content == "echo: ok"


async def test_a_result_with_an_error_reaches_the_model_as_that_error(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    first, held, later, model_saw = await conversation(llm, client, serve_runtime, FAILED)
    # (as the built-in agent says a failed result that says nothing else)
    assert model_saw == [[{"role": "tool", "tool_call_id": "c1",
                           "content": "Error: lookup failed: quota exceeded"}]] * 2
    sent = {"id": "t1", "role": "tool", "toolCallId": "c1", **FAILED}
    assert tool_messages(snapshot_of(first)) == [sent]
    assert tool_messages(held) == [sent]
    assert tool_messages(snapshot_of(later)) == [sent]


async def test_an_error_beside_what_the_result_says_keeps_both(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    result = {"content": "partial rows", "error": "timed out"}
    first, _, _, model_saw = await conversation(llm, client, serve_runtime, result)
    assert model_saw[0] == [{"role": "tool", "tool_call_id": "c1", "content": "partial rows"}]
    assert tool_messages(snapshot_of(first)) == [
        {"id": "t1", "role": "tool", "toolCallId": "c1", **result}]


async def test_an_error_answering_a_call_langgraph_marked_interrupted_keeps_it(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    """Where the checkpoint held LangGraph's placeholder for the call, ag-ui-langgraph wrote
    the client's result over it copying its text only: the model read a successful result
    and the snapshot showed no error."""
    graph = graphs.chat_graph(llm.base_url, client)
    placeholder = "Tool call 'lookup' with id 'c1' was interrupted before completion."
    await graph.aupdate_state({"configurable": {"thread_id": "tp"}}, {"messages": [
        HumanMessage(content="hi", id="u1"),
        AIMessage(content="", id="a1", tool_calls=[
            {"id": "c1", "name": "lookup", "args": {}, "type": "tool_call"}]),
        ToolMessage(content=placeholder, id="p1", tool_call_id="c1")]}, as_node="chat")
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("", thread="tp", messages=history(FAILED)),
                                  agent="lg")
    verify_events(events)
    assert [tool_messages(r["messages"]) for r in llm.requests] == [[
        {"role": "tool", "tool_call_id": "c1",
         "content": "Error: lookup failed: quota exceeded"}]]
    assert tool_messages(snapshot_of(events)) == [
        {"id": "p1", "role": "tool", "toolCallId": "c1", **FAILED}]
    kept = (await graph.aget_state({"configurable": {"thread_id": "tp"}})).values["messages"]
    assert [m.status for m in kept if isinstance(m, ToolMessage)] == ["error"]


def rewriting_graph(content: str, status: str) -> Any:
    """A graph whose one node rewrites the client's tool result `t1` (as a retry step or a
    sanitiser does), keeping its other fields."""
    def rewrite(state: CopilotKitState) -> dict[str, Any]:
        (result,) = [m for m in state["messages"] if m.id == "t1"]
        return {"messages": [result.model_copy(update={"content": content,
                                                       "status": status})]}

    graph = StateGraph(CopilotKitState)
    graph.add_node("rewrite", rewrite)
    graph.add_edge(START, "rewrite")
    graph.add_edge("rewrite", END)
    return graph.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize(("written", "status", "shown"), [
    ("Retried: 3 rows", "success", {"content": "Retried: 3 rows"}),
    # (the error's line still leads: what the node put after it is the result)
    ("Error: lookup failed: quota exceeded\nretried: 3 rows", "error",
     {"content": "retried: 3 rows", "error": FAILED["error"]})])
async def test_a_result_a_node_rewrote_shows_as_the_node_left_it(
        serve_runtime: ServeRuntime, written: str, status: str, shown: dict[str, Any]) -> None:
    """The snapshot trusted the note of what the runtime had written after a node rewrote
    the result: it showed the node's text as ""."""
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
        name="lg", graph=rewriting_graph(written, status))})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("", thread="tw", messages=history(FAILED)[:3]),
                                  agent="lg")
    verify_events(events)
    assert tool_messages(snapshot_of(events)) == [
        {"id": "t1", "role": "tool", "toolCallId": "c1", **shown}]


async def test_a_result_of_text_parts_comes_back_as_sent(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    """Parts were put back in a snapshot as raw dicts, not validated: pydantic warned on each
    serialization, and the snapshot gave them back as `[]`."""
    result = {"content": [{"type": "text", "text": ""}], "error": "lookup failed"}
    first, held, _, model_saw = await conversation(llm, client, serve_runtime, result)
    sent = {"id": "t1", "role": "tool", "toolCallId": "c1", **result}
    assert tool_messages(snapshot_of(first)) == [sent]
    assert tool_messages(held) == [sent]
    assert model_saw[0] == [{"role": "tool", "tool_call_id": "c1",
                             "content": "Error: lookup failed"}]


LOAD_STATE = """query loadAgentState($data: LoadAgentStateInput!) {
  loadAgentState(data: $data) { threadId threadExists state messages } }"""


async def load_agent_state(served: Served, thread: str) -> list[dict[str, Any]]:
    response = await served.post("", {"query": LOAD_STATE, "variables": {
        "data": {"threadId": thread, "agentName": "lg"}}})
    loaded: list[dict[str, Any]] = json.loads(
        (await response.json())["data"]["loadAgentState"]["messages"])
    return loaded


async def test_a_graphql_reload_gives_a_failed_result_its_error(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    """The 1.10 client's `loadAgentState` showed a failed result as an empty one."""
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
        name="lg", graph=graphs.chat_graph(llm.base_url, client))})
    async with serve_runtime(runtime) as served:
        verify_events(await served.run(
            run_input("", thread="tg", messages=history(FAILED)), agent="lg"))
        loaded = await load_agent_state(served, "tg")
    assert [m for m in loaded if "result" in m] == [
        {"id": "t1", "actionExecutionId": "c1", "actionName": "lookup",
         "result": "Error: lookup failed: quota exceeded"}]
