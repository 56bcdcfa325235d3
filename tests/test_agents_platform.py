"""`LangGraphPlatformAgent` against a real LangGraph API server (`langgraph dev`, in-memory).

A module fixture starts the mock LLM and `langgraph dev` serving
`tests/agents_support/platform_graphs.py` as child processes, on loopback, offline.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from copilot_runtime import CopilotRuntime
from copilot_runtime.agents.langgraph_platform import LangGraphPlatformAgent, platform_thread_id
from copilot_runtime.testing import verify_events
from tests.agents_support.processes import REPO_ROOT, VENV_BIN, child_process, free_port, mock_llm
from tests.conftest import ServeRuntime, run_input, text_of, types

SAY_HELLO = {"name": "sayHello", "description": "Say hello to someone",
             "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}
GRAPHS = REPO_ROOT / "tests" / "agents_support" / "platform_graphs.py"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("langgraph-dev")
    (workdir / "langgraph.json").write_text(json.dumps({
        "dependencies": [str(REPO_ROOT)],
        "graphs": {name: f"{GRAPHS}:{name}"
                   for name in ("chat", "planner", "failing", "looping", "writer", "asking")},
    }))
    port = free_port()
    with mock_llm(workdir) as llm_url, child_process(
            "langgraph-dev",
            [str(VENV_BIN / "langgraph"), "dev", "--no-browser", "--no-reload",
             "--host", "127.0.0.1", "--port", str(port), "--n-jobs-per-worker", "4",
             "--config", str(workdir / "langgraph.json")],
            ready_url=f"http://127.0.0.1:{port}/ok", log_dir=workdir, cwd=workdir,
            env={"LLM_BASE_URL": llm_url, "PYTHONPATH": str(REPO_ROOT),
                 "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false"}):
        yield f"http://127.0.0.1:{port}"


def platform_runtime(deployment: str, graph_id: str = "chat") -> CopilotRuntime:
    return CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
        deployment_url=deployment, graph_id=graph_id, description="on the platform")})


def thread() -> str:
    return f"thread-{uuid.uuid4().hex[:8]}"  # not a UUID: exercises the thread mapping


def of_type(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def test_thread_ids() -> None:
    known = "5d3c1e2a-0000-4000-8000-000000000001"
    assert platform_thread_id(known) == known
    mapped = platform_thread_id("thread-1")
    assert uuid.UUID(mapped).version == 5
    assert platform_thread_id("thread-1") == mapped != platform_thread_id("thread-2")


def test_each_thread_id_has_a_platform_thread_of_its_own() -> None:
    """Owners are kept per runtime thread id: ids that named one platform thread (a `ck-`
    prefix, other spellings of a UUID, the UUID5 an id maps to) let anyone who knew a
    thread's id continue its conversation under an id nobody owned yet."""
    known = "5d3c1e2a-0000-4000-8000-000000000001"
    aliases = ["ck-" + known, known.upper(), known.replace("-", ""), "{" + known + "}",
               "urn:uuid:" + known, platform_thread_id("alice-notes")]
    ids = [known, "alice-notes", *aliases]
    platform_ids = [platform_thread_id(thread_id) for thread_id in ids]
    assert len(set(platform_ids)) == len(ids)
    assert all(uuid.UUID(p).version == 5 for p in platform_ids[1:])


async def test_chat(deployment: str, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(platform_runtime(deployment)) as served:
        info = await (await served.session.get(served.url + "/info")).json()
        events = await served.run(run_input("Hello", thread=thread()), agent="platform")
    verify_events(events)
    assert info["agents"]["platform"]["className"] == "LangGraphPlatformAgent"
    assert text_of(events) == "echo: Hello"
    (snapshot,) = of_type(events, "MESSAGES_SNAPSHOT")
    assert [m["role"] for m in snapshot["messages"]] == ["user", "assistant"]


async def test_server_tool_frontend_tool_and_follow_up(
        deployment: str, serve_runtime: ServeRuntime) -> None:
    conversation = thread()
    async with serve_runtime(platform_runtime(deployment)) as served:
        server_tool = await served.run(run_input('call:get_weather {"city":"Paris"}',
                                                 thread=thread()), agent="platform")
        first = await served.run(run_input('call:sayHello {"name":"Ada"}', thread=conversation,
                                           tools=[SAY_HELLO]), agent="platform")
        (start,) = of_type(first, "TOOL_CALL_START")
        messages = [
            {"id": "run-1-u", "role": "user", "content": 'call:sayHello {"name":"Ada"}'},
            {"id": start["parentMessageId"], "role": "assistant", "toolCalls": [
                {"id": start["toolCallId"], "type": "function",
                 "function": {"name": "sayHello", "arguments": '{"name":"Ada"}'}}]},
            {"id": "tool-1", "role": "tool", "toolCallId": start["toolCallId"],
             "content": "hi Ada"}]
        second = await served.run(run_input("", thread=conversation, run="run-2",
                                            tools=[SAY_HELLO], messages=messages),
                                  agent="platform")
    for events in (server_tool, first, second):
        verify_events(events)
    (result,) = of_type(server_tool, "TOOL_CALL_RESULT")
    assert json.loads(result["content"])["city"] == "Paris"
    assert text_of(server_tool) == "echo: " + result["content"]
    assert start["toolCallName"] == "sayHello"
    assert "TOOL_CALL_RESULT" not in types(first)
    assert text_of(second) == "echo: hi Ada"


async def test_a_clients_tool_result_in_parts_or_with_an_error_reaches_the_model(
        deployment: str, serve_runtime: ServeRuntime) -> None:
    """A frontend tool's result in parts reached the platform's graph as each part's Python
    repr, and one with an `error` as an empty result; the platform's thread gave them back
    as "" and with the word "error" for its error."""
    parts = [{"type": "text", "text": "see"}, {"type": "image", "source": {
        "type": "url", "value": "https://example.test/x.png"}}]
    failed = {"content": "", "error": "lookup failed: quota exceeded"}
    answers = {}
    async with serve_runtime(platform_runtime(deployment)) as served:
        for name, result in (("parts", {"content": parts}), ("error", failed)):
            messages = [
                {"id": "u1", "role": "user", "content": "hi"},
                {"id": "a1", "role": "assistant", "toolCalls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "lookup", "arguments": "{}"}}]},
                {"id": "t1", "role": "tool", "toolCallId": "c1", **result}]
            answers[name] = await served.run(run_input("", thread=thread(), messages=messages),
                                             agent="platform")
    for events in answers.values():
        verify_events(events)
    # (the mock model echoes the text of the last message: here the tool's result, its
    # image named in a line of text, as a tool message takes no image)
    assert text_of(answers["parts"]) == "echo: see\n[image attachment: https://example.test/x.png]"
    assert text_of(answers["error"]) == "echo: Error: lookup failed: quota exceeded"
    snapshots = {name: [m for m in of_type(events, "MESSAGES_SNAPSHOT")[-1]["messages"]
                        if m["role"] == "tool"] for name, events in answers.items()}
    assert snapshots == {
        "parts": [{"id": "t1", "role": "tool", "toolCallId": "c1", "content": parts}],
        "error": [{"id": "t1", "role": "tool", "toolCallId": "c1", **failed}]}


async def test_shared_state(deployment: str, serve_runtime: ServeRuntime) -> None:
    conversation = thread()
    async with serve_runtime(platform_runtime(deployment, "planner")) as served:
        first = await served.run(run_input("Plan", thread=conversation, state={
            "items": ["from the frontend"], "counter": 1, "unknown": "filtered out"}),
            agent="platform")
        second = await served.run(run_input("Again", thread=conversation, run="run-2", state={
            "items": ["edited"], "counter": 7, "note": "x"}), agent="platform")
    for events in (first, second):
        verify_events(events)
    assert of_type(first, "STATE_SNAPSHOT")[0]["snapshot"] == {
        "items": ["from the frontend", "item 2"], "counter": 2}
    assert text_of(first) == "echo: items=['from the frontend', 'item 2']"
    assert text_of(second) == "echo: items=['edited', 'item 2']"


async def test_deleting_a_thread_deletes_the_platforms_thread(
        deployment: str, serve_runtime: ServeRuntime) -> None:
    """`DELETE /threads/{id}` forgets the thread on the platform too: before, the platform
    kept the conversation, and whoever started a thread of that id next was handed it."""
    conversation = thread()
    runtime = platform_runtime(deployment)
    agent = runtime.agents["platform"]
    async with serve_runtime(runtime) as served:
        await served.run(run_input("remember 4711", thread=conversation), agent="platform")
        assert (await agent.load_state(conversation)).exists
        response = await served.session.delete(f"{served.url}/threads/{conversation}")
        assert response.status == 200, await response.text()
        assert not (await agent.load_state(conversation)).exists
        again = await served.run(run_input("hello again", thread=conversation, run="run-2"),
                                 agent="platform")
        await agent.forget_thread(thread())  # one the platform never had: nothing to do
    (snapshot,) = of_type(again, "MESSAGES_SNAPSHOT")
    assert "remember 4711" not in json.dumps(snapshot)


async def test_failing_graph_without_internals(deployment: str,
                                               serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(platform_runtime(deployment, "failing")) as served:
        events = await served.run(run_input("x", thread=thread()), agent="platform")
    verify_events(events)
    assert events[-1]["type"] == "RUN_ERROR"
    assert events[-1]["message"] == "The graph failed on the LangGraph Platform (RuntimeError)"


async def test_the_recursion_limit_is_told_as_in_process(
        deployment: str, serve_runtime: ServeRuntime) -> None:
    """Before: UPSTREAM_ERROR "The graph failed on the LangGraph Platform
    (GraphRecursionError)", where the in-process agent says what happened and what to do."""
    runtime = CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
        deployment_url=deployment, graph_id="looping", config={"recursion_limit": 7})})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread=thread()), agent="platform")
    verify_events(events)
    assert (events[-1]["type"], events[-1]["code"]) == ("RUN_ERROR", "AGENT_EXECUTION_ERROR")
    assert events[-1]["message"] == (
        "Agent 'platform' reached its recursion limit (7 steps) without finishing: its "
        "graph may loop, or needs a higher recursion_limit in its config")


async def test_stream_writer_output_is_a_custom_event(
        deployment: str, serve_runtime: ServeRuntime) -> None:
    """Before: what nodes wrote with get_stream_writer() never reached the client (the run
    asked the platform for the "events" mode only)."""
    async with serve_runtime(platform_runtime(deployment, "writer")) as served:
        events = await served.run(run_input("go", thread=thread()), agent="platform")
    verify_events(events)
    written = [e["value"] for e in events
               if e["type"] == "CUSTOM" and e["name"] == "langgraph_stream_writer"]
    assert written == [{"progress": 1}, {"progress": 2, "where": "subgraph"}]
    assert events[-1]["type"] == "RUN_FINISHED"


async def test_an_interrupt_and_its_answer_end_as_finished_runs(
        deployment: str, serve_runtime: ServeRuntime) -> None:
    """The platform's stream has no end event: a run is checked against its status, and a
    run that stopped at an interrupt is one that succeeded."""
    conversation = thread()
    first = {"id": "m1", "role": "user", "content": "go"}
    async with serve_runtime(platform_runtime(deployment, "asking")) as served:
        asked = await served.run(run_input("go", thread=conversation, messages=[first]),
                                 agent="platform")
        answered = await served.run(run_input(
            "", thread=conversation, run="run-2", messages=[first],
            forwardedProps={"command": {"resume": "cats"}}), agent="platform")
    for events in (asked, answered):
        verify_events(events)
        assert events[-1]["type"] == "RUN_FINISHED"
    assert [e["value"] for e in of_type(asked, "CUSTOM") if e["name"] == "on_interrupt"] == [
        "which topic?"]
    (snapshot,) = of_type(answered, "MESSAGES_SNAPSHOT")
    assert snapshot["messages"][-1]["content"] == "topic=cats"


async def test_unknown_graph_and_unreachable_deployment(
        deployment: str, serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={
        "missing": LangGraphPlatformAgent(deployment_url=deployment, graph_id="nope"),
        "down": LangGraphPlatformAgent(deployment_url=f"http://127.0.0.1:{free_port()}",
                                       graph_id="chat")})
    async with serve_runtime(runtime) as served:
        missing = await served.run(run_input("x", thread=thread()), agent="missing")
        down = await served.run(run_input("x", thread=thread()), agent="down")
    for events in (missing, down):
        verify_events(events)
    assert missing[-1]["message"] == \
        "The LangGraph deployment has no assistant for graph 'nope'"
    assert down[-1]["message"] == "LangGraph Platform agent 'down' could not be reached"


def test_graphs_file_exists() -> None:
    assert Path(GRAPHS).is_file()
