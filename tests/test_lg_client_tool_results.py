"""A tool result the client sends (a frontend tool's) reaches a LangGraph graph's model as the
client wrote it, and comes back in snapshots, a reconnect and the stored thread as sent.

Before the fix, a result in parts (AG-UI's text, image, ... parts) reached the model and the
checkpoint as each part's Python repr ("type='text' id=None text='see' ...") and came back
as ""; a result with an `error` reached the model as an empty result, and came back with
the word "error" for its error."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from copilot_runtime import CopilotRuntime
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.testing import MockOpenAIServer, verify_events
from tests.agents_support import graphs
from tests.conftest import ServeRuntime, run_input, text_of
from tests.test_real_clients import run_client_script

pytestmark = pytest.mark.timeout(120)

PARTS = [{"type": "text", "text": "see"},
         {"type": "image", "source": {"type": "url", "value": "https://example.test/x.png"}}]
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


async def test_a_result_in_parts_reaches_the_model_as_content_blocks(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    first, held, later, model_saw = await conversation(llm, client, serve_runtime,
                                                       {"content": PARTS})
    # (langchain-openai sends LangChain's standard image block as Chat Completions' image_url)
    blocks = [{"type": "text", "text": "see"},
              {"type": "image_url", "image_url": {"url": "https://example.test/x.png"}}]
    assert model_saw == [[{"role": "tool", "tool_call_id": "c1", "content": blocks}]] * 2
    sent = {"id": "t1", "role": "tool", "toolCallId": "c1", "content": PARTS}
    assert tool_messages(snapshot_of(first)) == [sent]
    assert tool_messages(held) == [sent]
    assert tool_messages(snapshot_of(later)) == [sent]
    assert text_of(later) == "echo: third"


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
