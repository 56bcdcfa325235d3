"""Compaction, message reconstruction, and thread stores (in memory and SQLite)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from copilot_runtime import Agent, CopilotRuntime, DemoAdapter, RunContext, RunInput, thread_store
from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events, events_to_messages
from copilot_runtime.events import EventBatches
from copilot_runtime.testing import verify_events
from copilot_runtime.threads import InMemoryThreadStore, SQLiteThreadStore, StoredRun
from tests.conftest import ServeRuntime, run_input, text_of
from tests.hitl_support.postgres import postgres_schema


def _run() -> list[ev.Event]:
    return [
        ev.run_started("t", "r", {"threadId": "t", "runId": "r", "messages": [
            {"id": "u1", "role": "user", "content": "hi"}]}),
        ev.state_snapshot({"n": 1}),
        ev.text_message_start("m1"),
        ev.text_message_content("m1", "Hel"),
        ev.text_message_content("m1", "lo"),
        ev.text_message_end("m1"),
        ev.state_delta([{"op": "replace", "path": "/n", "value": 2}]),
        ev.tool_call_start("c1", "f", "m2"),
        ev.tool_call_args("c1", '{"a"'),
        ev.tool_call_args("c1", ":1}"),
        ev.tool_call_end("c1"),
        ev.tool_call_result("m3", "c1", '"ok"'),
        ev.run_finished("t", "r"),
    ]


def test_compaction_joins_deltas_and_folds_state() -> None:
    compacted = compact_events(_run())
    verify_events(compacted)
    assert [e["type"] for e in compacted] == [
        "RUN_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END",
        "TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END", "TOOL_CALL_RESULT",
        "STATE_SNAPSHOT", "RUN_FINISHED"]
    assert compacted[2]["delta"] == "Hello"
    assert compacted[5]["delta"] == '{"a":1}'
    assert compacted[8]["snapshot"] == {"n": 2}


def test_a_runs_first_delta_patches_the_state_its_client_sent() -> None:
    """The client applies a run's deltas to the state it sent with the run; the stored
    snapshot was the patch applied to {} (a `replace` failed: the thread's state read {})."""
    sent = {"count": 1, "items": ["a"]}
    patch = [{"op": "replace", "path": "/count", "value": 2},
             {"op": "add", "path": "/items/-", "value": "b"}]
    run = [ev.run_started("t", "r", {"threadId": "t", "runId": "r", "state": sent,
                                     "messages": []}),
           ev.state_delta(patch), ev.run_finished("t", "r")]
    assert compact_events(run)[-2]["snapshot"] == {"count": 2, "items": ["a", "b"]}
    assert sent == {"count": 1, "items": ["a"]}  # (the input is not patched in place)
    without = [ev.run_started("t", "r", {"threadId": "t", "runId": "r", "messages": []}),
               ev.state_delta([{"op": "add", "path": "/n", "value": 1}]),
               ev.run_finished("t", "r")]
    assert compact_events(without)[-2]["snapshot"] == {"n": 1}


def test_an_id_started_again_in_a_run_keeps_what_each_start_streamed() -> None:
    """A model numbering its call ids per answer (`call_0` in each step of a run) starts an
    id again once it ended, as AG-UI allows: the second start took the first's slot, and
    the stored run lost the first call's arguments (and a message's text likewise)."""
    run = [ev.run_started("t", "r", {"threadId": "t", "runId": "r", "messages": []})]
    for step, query in enumerate(("one", "two")):
        run += [ev.text_message_start("m"), ev.text_message_content("m", f"step {step}"),
                ev.text_message_end("m"),
                ev.tool_call_start("call_0", "lookup", f"a{step}"),
                ev.tool_call_args("call_0", '{"q":'), ev.tool_call_args("call_0", f'"{query}"}}'),
                ev.tool_call_end("call_0"),
                ev.tool_call_result(f"res{step}", "call_0", query)]
    run.append(ev.run_finished("t", "r"))
    compacted = compact_events(run)
    verify_events(compacted)
    assert [e["delta"] for e in compacted if e["type"] == "TOOL_CALL_ARGS"] == [
        '{"q":"one"}', '{"q":"two"}']
    assert [e["delta"] for e in compacted if e["type"] == "TEXT_MESSAGE_CONTENT"] == [
        "step 0", "step 1"]
    calls = [call["function"]["arguments"] for message in events_to_messages([compacted])
             for call in message.get("toolCalls") or ()]
    assert calls == ['{"q":"one"}', '{"q":"two"}']


def test_events_to_messages() -> None:
    messages = events_to_messages([compact_events(_run())])
    assert messages == [
        {"id": "u1", "role": "user", "content": "hi"},
        {"id": "m1", "role": "assistant", "content": "Hello"},
        {"id": "m2", "role": "assistant", "toolCalls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]},
        {"id": "m3", "role": "tool", "toolCallId": "c1", "content": '"ok"'},
    ]


def _handed_over_run() -> list[ev.Event]:
    """An agent (sending no snapshot of its own) hands over to one that sends its own."""
    go = {"id": "u1", "role": "user", "content": "go"}
    return [
        ev.run_started("t", "r", {"threadId": "t", "runId": "r", "messages": [go]}),
        ev.tool_call_start("c1", "helper", "m1"), ev.tool_call_end("c1"),
        ev.tool_call_result("r1", "c1", "helper agent started"),
        ev.custom(ev.AGENT_STARTED, {"agentName": "helper", "runId": "r2"}),
        ev.text_message_start("h1"), ev.text_message_content("h1", "helper says 42"),
        ev.text_message_end("h1"),
        {"type": ev.MESSAGES_SNAPSHOT, "messages": [
            go, {"id": "h1", "role": "assistant", "content": "helper says 42"},
            {"id": "h2", "role": "assistant", "content": "not streamed"}]},
        ev.custom(ev.AGENT_FINISHED, {"agentName": "helper"}),
        ev.run_finished("t", "r"),
    ]


def test_a_handed_over_agents_snapshot_adds_to_the_conversation() -> None:
    """A handed-over agent's MESSAGES_SNAPSHOT is its own conversation, not the run's: it
    replaced the thread's, dropping the call and its result (and a bounded read started
    from it)."""
    from copilot_runtime.threads.base import earlier_messages

    expected = [("u1", "go"), ("m1", None), ("r1", "helper agent started"),
                ("h1", "helper says 42"), ("h2", "not streamed")]
    for events in (_handed_over_run(), compact_events(_handed_over_run())):
        assert [(m["id"], m.get("content")) for m in events_to_messages([events])] == expected
        earlier = earlier_messages([events], None)
        assert earlier is not None
        assert [(m["id"], m.get("content")) for m in earlier["messages"]] == expected
    # The agent's own snapshot after the hand-over is the conversation again.
    outer = {"type": ev.MESSAGES_SNAPSHOT, "messages": [{"id": "u1", "role": "user",
                                                         "content": "go"}]}
    events = [*_handed_over_run()[:-1], outer]
    assert [m["id"] for m in events_to_messages([events])] == ["u1"]
    earlier = earlier_messages([events], None)
    assert earlier is not None
    assert [m["id"] for m in earlier["messages"]] == ["u1"]


def test_an_agent_message_with_an_input_message_id_is_a_message_of_its_own() -> None:
    """An agent's text message whose id a client had given a message of its own with a list
    of parts made `GET /threads/{id}/messages` a 500 (text added to a list), on every store,
    for good; a tool call whose parent id was a user message's was added to that message.
    Each is a message of its own after the input's, as a client applying the stream has it."""
    parts = [{"type": "text", "text": "hi"}]
    run = [
        ev.run_started("t", "r", {"threadId": "t", "runId": "r", "messages": [
            {"id": "x", "role": "user", "content": parts},
            {"id": "y", "role": "user", "content": "look it up"}]}),
        ev.text_message_start("x"),
        ev.text_message_content("x", "Hello"),
        ev.text_message_end("x"),
        ev.tool_call_start("c1", "f", "y"),
        ev.tool_call_args("c1", "{}"),
        ev.tool_call_end("c1"),
        ev.run_finished("t", "r"),
    ]
    for events in (run, compact_events(run)):
        assert events_to_messages([events]) == [
            {"id": "x", "role": "user", "content": parts},
            {"id": "y", "role": "user", "content": "look it up"},
            {"id": "x", "role": "assistant", "content": "Hello"},
            {"id": "y", "role": "assistant", "toolCalls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        ]

async def test_memory_store_evicts_least_recently_used() -> None:
    store = InMemoryThreadStore(max_threads=2, max_runs_per_thread=1)
    for thread in ("a", "b"):
        await store.append_run(thread, "default", StoredRun("r1", [], 1.0), ["m"])
    await store.get("a")
    await store.append_run("c", "default", StoredRun("r1", [], 2.0), [])
    assert await store.get("b") is None
    await store.append_run("a", "default", StoredRun("r2", [], 3.0), ["n"])
    record = await store.get("a")
    assert record is not None
    assert [r.run_id for r in record.runs] == ["r2"]
    assert record.message_ids == {"m", "n"}
    assert [r.thread_id for r in await store.list()] == ["a", "c"]


async def test_memory_store_reports_evictions_without_a_line_for_each() -> None:
    from structlog.testing import capture_logs

    store = InMemoryThreadStore(max_threads=10)
    with capture_logs() as logs:
        for index in range(500):
            await store.append_run(f"t{index}", "default", StoredRun("r", [], 1.0), [])
    reports = [e for e in logs if e["event"] == "threads evicted from memory"]
    # The first eviction is said at once; the next 489 wait for the minute to pass.
    assert len(reports) == 1
    assert reports[0]["threads"] == 1
    assert reports[0]["store_threads"] == 10


async def test_sqlite_store_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "threads.sqlite3"
    store = SQLiteThreadStore(path)
    await store.append_run("t1", "default", StoredRun("r1", compact_events(_run()), 1.0),
                           ["u1", "m1"])
    await store.append_run("t2", "other", StoredRun("r1", [], 2.0), [])
    await store.append_run("t1", "default", StoredRun("r2", [], 3.0), ["u2"])
    await store.aclose()

    reopened = SQLiteThreadStore(path)
    record = await reopened.get("t1")
    assert record is not None
    assert [r.run_id for r in record.runs] == ["r1", "r2"]
    assert record.message_ids == {"u1", "m1", "u2"}
    assert record.state == {"n": 2}
    assert [r.thread_id for r in await reopened.list()] == ["t1", "t2"]
    assert [r.thread_id for r in await reopened.list("other")] == ["t2"]
    assert await reopened.get("nope") is None
    await reopened.aclose()


async def test_history_survives_a_restart(tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    path = tmp_path / "threads.sqlite3"
    first = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                           thread_store=SQLiteThreadStore(path))
    async with serve_runtime(first) as served:
        before = await served.run(run_input("remember this", thread="durable"))
    second = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                            thread_store=SQLiteThreadStore(path))
    async with serve_runtime(second) as served:
        replay = await served.run(run_input("", thread="durable"),
                                  path="/agent/default/connect")
        verify_events(replay)
        assert text_of(replay) == text_of(before)
        again = await served.run({**run_input("more", thread="durable", run="r2")})
        assert again[0]["input"]["messages"] == [
            {"id": "r2-u", "role": "user", "content": "more"}]


class _RecordingStore(InMemoryThreadStore):
    """Keeps the message ids each run's write was given."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[set[str]] = []

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         message_ids: Iterable[str], **options: Any) -> None:
        ids = set(message_ids)
        self.written.append(ids)
        await super().append_run(thread_id, agent_id, run, ids, **options)


async def test_a_run_writes_only_the_message_ids_its_thread_lacks(
        serve_runtime: ServeRuntime) -> None:
    """A client sends the whole history with each message: every run wrote every id of it
    again (a conflicting insert per message per run in a durable store)."""
    store = _RecordingStore()
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store)
    async with serve_runtime(runtime) as served:
        first = await served.run(run_input("hello", thread="t", run="r1"))
        answer = next(e["messageId"] for e in first if e["type"] == "TEXT_MESSAGE_START")
        history = [{"id": "r1-u", "role": "user", "content": "hello"},
                   {"id": answer, "role": "assistant", "content": text_of(first)},
                   {"id": "r2-u", "role": "user", "content": "again"}]
        second = await served.run({**run_input("", thread="t", run="r2"),
                                   "messages": history})
        verify_events(second)
        record = await store.get("t")
    again = next(e["messageId"] for e in second if e["type"] == "TEXT_MESSAGE_START")
    assert store.written == [{"r1-u", answer}, {"r2-u", again}]
    assert record is not None
    assert record.message_ids == {"r1-u", answer, "r2-u", again}
    assert [m["id"] for m in events_to_messages(r.events for r in record.runs)] == [
        "r1-u", answer, "r2-u", again]


class _ToolThenTextAgent(Agent):
    """Runs a tool of its own on its first run (its result under an id of its own making),
    answers in text after; remembers the ids of the messages each run was given."""

    def __init__(self) -> None:
        super().__init__(description="A custom agent with a server-side tool")
        self.given: list[list[str]] = []

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        self.given.append([m.id for m in input.model.messages])
        return self._events(first=len(self.given) == 1)

    async def _events(self, first: bool) -> AsyncIterator[list[ev.Event]]:
        if first:
            yield [ev.tool_call_start("call-1", "lookup", "asked"),
                   ev.tool_call_args("call-1", "{}"), ev.tool_call_end("call-1"),
                   ev.tool_call_result(f"agent-{uuid.uuid4()}", "call-1", "found")]
        else:
            yield [ev.text_message_start(f"text-{len(self.given)}"),
                   ev.text_message_content(f"text-{len(self.given)}", "ok"),
                   ev.text_message_end(f"text-{len(self.given)}")]


async def test_an_agents_tool_result_sent_back_is_kept_once(
        tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    """An AG-UI client sends an agent's tool result back under the id it streamed: the
    thread holds it, so it is neither kept again nor echoed as the run's input; a frontend
    tool's result is new. The agent is given what the client sent, as always."""
    agent = _ToolThenTextAgent()
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), agents={"custom": agent},
                             thread_store=SQLiteThreadStore(tmp_path / "threads.sqlite3"))
    async with serve_runtime(runtime) as served:
        first = await served.run(run_input("look it up", thread="t", run="r1"),
                                 agent="custom")
        streamed = next(e["messageId"] for e in first if e["type"] == "TOOL_CALL_RESULT")
        call = {"id": "asked", "role": "assistant", "toolCalls": [
            {"id": "call-1", "type": "function",
             "function": {"name": "lookup", "arguments": "{}"}}]}
        frontend_call = {"id": "ui-call", "role": "assistant", "toolCalls": [
            {"id": "call-2", "type": "function",
             "function": {"name": "notify", "arguments": "{}"}}]}
        resent = {"id": streamed, "role": "tool", "toolCallId": "call-1", "content": "found"}
        frontend_result = {"id": "ui-result", "role": "tool", "toolCallId": "call-2",
                           "content": "shown"}
        history = [{"id": "r1-u", "role": "user", "content": "look it up"}, call, resent,
                   frontend_call, frontend_result]
        second = await served.run({**run_input("", thread="t", run="r2"),
                                   "messages": history}, agent="custom")
        kept = (await (await served.session.get(
            served.url + "/threads/t/messages")).json())["messages"]
    assert second[0]["input"]["messages"] == [frontend_call, frontend_result]
    assert [(m["id"], m.get("toolCallId")) for m in kept if m["role"] == "tool"] == [
        (streamed, "call-1"), ("ui-result", "call-2")]
    assert agent.given[1] == [m["id"] for m in history]


class _CallNumberingAgent(Agent):
    """Asks for a frontend tool under `call_0` in every answer (as providers that number an
    answer's calls from 0 do), and answers in text once given its result."""

    def __init__(self) -> None:
        super().__init__(description="Calls a frontend tool, its calls numbered per answer")

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._events(input.model.messages[-1].role == "user", input.run_id)

    async def _events(self, asked: bool, run_id: str) -> AsyncIterator[list[ev.Event]]:
        if asked:
            yield [ev.tool_call_start("call_0", "notify", f"a-{run_id}"),
                   ev.tool_call_args("call_0", "{}"), ev.tool_call_end("call_0")]
        else:
            yield [ev.text_message_start(f"t-{run_id}"),
                   ev.text_message_content(f"t-{run_id}", "done"),
                   ev.text_message_end(f"t-{run_id}")]


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/threads.sqlite3"
    else:
        with postgres_schema() as url:
            yield url


async def test_a_frontend_result_for_a_call_id_used_again_is_kept(
        store_url: str, serve_runtime: ServeRuntime) -> None:
    """An agent that numbers its calls from 0 in each answer asks again under `call_0`: the
    client's result for the new call is new (echoed and kept), not taken for the earlier
    call's, which left the thread with a call without a result (a model refuses that)."""
    store = thread_store(store_url)
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                             agents={"custom": _CallNumberingAgent()}, thread_store=store)

    def asked(run: str) -> dict[str, Any]:
        return {"id": f"a-{run}", "role": "assistant", "toolCalls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "notify", "arguments": "{}"}}]}

    try:
        async with serve_runtime(runtime) as served:
            async def run(run_id: str, messages: list[dict[str, Any]]) -> list[ev.Event]:
                return await served.run({**run_input("", thread="t", run=run_id),
                                         "messages": messages}, agent="custom")

            history: list[dict[str, Any]] = [
                {"id": "u1", "role": "user", "content": "notify me"}]
            await run("r1", history)
            history += [asked("r1"),
                        {"id": "res-1", "role": "tool", "toolCallId": "call_0",
                         "content": "shown 1"}]
            await run("r2", history)
            history += [{"id": "t-r2", "role": "assistant", "content": "done"},
                        {"id": "u2", "role": "user", "content": "notify me again"}]
            await run("r3", history)
            second_result = {"id": "res-2", "role": "tool", "toolCallId": "call_0",
                             "content": "shown 2"}
            history += [asked("r3"), second_result]
            fourth = await run("r4", history)
            kept = (await (await served.session.get(
                served.url + "/threads/t/messages")).json())["messages"]
    finally:
        await store.aclose()
    assert fourth[0]["input"]["messages"] == [second_result]
    assert [(m["id"], m["role"]) for m in kept] == [
        ("u1", "user"), ("a-r1", "assistant"), ("res-1", "tool"), ("t-r2", "assistant"),
        ("u2", "user"), ("a-r3", "assistant"), ("res-2", "tool"), ("t-r4", "assistant")]
