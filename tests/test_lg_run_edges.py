"""`LangGraphAgent` at the edges of a run, on both protocols:

* `forwardedProps` entries named like a state key become graph input (ag-ui-langgraph and
  CopilotKit's runtimes merge them in), so guardrails judge them like `state`; the others
  (an auth token, say) still go to no judge;
* a new user message while an interrupt waits is refused with `APPROVAL_ERROR`, instead of
  being dropped while the interrupt was announced again;
* the recursion limit and a failing checkpoint store end the run with precise codes;
* what a node writes with `get_stream_writer()` is sent as the `langgraph_stream_writer`
  custom event (GraphQL 1.10 has no place for custom events: they are not carried there);
* a state larger than the inbound body limit is logged, once per thread;
* the client's run config (`forwardedProps.config`, 1.10's `agentStates[].config`) sets
  only the `configurable` keys the graph declares, never the runtime's (another thread's
  `thread_id`), and may only lower the recursion limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, NotRequired, Required

import orjson
import psycopg
import pydantic
import pytest
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    AnyMessage,
    BaseMessage,
    ToolMessage,
)
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.runtime import Runtime
from langgraph.types import Command, interrupt
from structlog.testing import capture_logs
from typing_extensions import TypedDict

from copilot_runtime import CopilotRuntime, PatternGuardrail
from copilot_runtime._compaction import patched_state
from copilot_runtime._trust import judged
from copilot_runtime.agents._lg_config import graph_config_keys
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.testing import verify_events
from tests.agents_support.graphs import graph_values
from tests.conftest import Served, ServeRuntime, run_input, text_of
from tests.gql.wire import (
    CLIENT_HEADERS,
    chat_data,
    text_message,
)
from tests.hitl_support.postgres import SERVER, postgres_schema

Json = dict[str, Any]
V1 = {"protocolVersion": "1.0"}
SESSION = {"agentName": "lg"}
REFUSED = "Not that."


class State(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    topic: str
    user_role: str
    blob: str


def says_topic() -> Any:
    """One node that answers with the state it was given."""
    def answer(state: State) -> Json:
        return {"messages": [AIMessage(content=f"topic={state.get('topic')} "
                                               f"role={state.get('user_role')}")]}

    graph = StateGraph(State)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=InMemorySaver())


def said(events: list[Json]) -> str:
    """The last assistant message of the run's last messages snapshot (a node's message
    that no model streamed arrives only there)."""
    snapshot = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]
    content: str = [m for m in snapshot if m["role"] == "assistant"][-1]["content"]
    return content


# ---- A. forwardedProps that become graph input are judged -----------------------------------


def test_judged_takes_the_forwarded_entries_named_as_input() -> None:
    request = {"messages": [], "forwardedProps": {"topic": "t1", "authToken": "secret-1"}}
    (marks, texts), = judged(request, set(), (), ["topic"])
    assert [c["text"] for c in texts[0]["content"]] == ["t1"]
    assert len(marks) == 1
    # Judged once a thread: sent again unchanged, nothing is new to judge.
    assert judged(request, set(marks), (), ["topic"]) == [([], [])]
    # Without the agent saying so, forwardedProps stay the app's data.
    assert judged(request, set()) == [([], [])]


def test_the_agent_names_its_input_keys_as_the_client_spells_them() -> None:
    agent = LangGraphAgent(name="lg", graph=says_topic())
    props = {"topic": 1, "userRole": 2, "authToken": 3, "command": {}, "nodeName": "x"}
    assert sorted(agent.forwarded_input(props)) == ["topic", "userRole"]


async def test_forwarded_state_keys_are_judged_on_both_protocols(
        serve_runtime: ServeRuntime) -> None:
    graph = says_topic()
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)},
                             guardrails=[PatternGuardrail(deny=[r"\bforbidden\b"],
                                                          reason=REFUSED)])
    async with serve_runtime(runtime) as served:
        # The graph takes `topic` and `userRole` (as user_role) from forwardedProps.
        refused = await served.run(run_input("hi", thread="a1", forwardedProps={
            "topic": "the forbidden plan"}), agent="lg")
        camel = await served.run(run_input("hi", thread="a2", forwardedProps={
            "userRole": "forbidden admin"}), agent="lg")
        # An entry the graph does not take is the app's: not judged.
        kept = await served.run(run_input("hi", thread="a3", forwardedProps={
            "authToken": "forbidden-token", "topic": "weather"}), agent="lg")
        gql_refused = await served.generate(chat_data([text_message("u1", "user", "hi")],
                                                   thread="a4", agentSession=SESSION),
                                 properties={"topic": "forbidden"})
        gql_kept = await served.generate(chat_data([text_message("u1", "user", "hi")],
                                                thread="a5", agentSession=SESSION),
                              properties={"authToken": "forbidden", "topic": "rain"})
    for events in (refused, camel, kept):
        verify_events(events)
    assert text_of(refused) == REFUSED
    assert text_of(camel) == REFUSED
    assert "topic" not in await graph_values(graph, "a1")
    assert "user_role" not in await graph_values(graph, "a2")
    assert said(kept) == "topic=weather role=None"
    assert gql_refused["status"]["reason"] == "GUARDRAILS_VALIDATION_FAILED"
    assert "topic" not in await graph_values(graph, "a4")
    assert gql_kept["status"]["code"] == "Success"
    assert (await graph_values(graph, "a5"))["topic"] == "rain"


# ---- B. a new message while an interrupt waits ----------------------------------------------


def asks() -> Any:
    def ask(state: State) -> Json:
        return {"topic": interrupt("which topic?")}

    def answer(state: State) -> Json:
        return {"messages": [AIMessage(content=f"topic={state['topic']}")]}

    graph = StateGraph(State)
    graph.add_node("ask", ask)
    graph.add_node("answer", answer)
    graph.add_edge(START, "ask")
    graph.add_edge("ask", "answer")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_a_message_while_an_interrupt_waits_is_refused_not_lost(
        serve_runtime: ServeRuntime) -> None:
    graph = asks()
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    first = {"id": "m1", "role": "user", "content": "go"}
    late = {"id": "m2", "role": "user", "content": "also this"}
    async with serve_runtime(runtime) as served:
        asked = await served.run(run_input("go", thread="b1", messages=[first], **V1),
                                 agent="lg")
        (pending,) = asked[-1]["outcome"]["interrupts"]
        sent = await served.run(run_input("", thread="b1", run="r2",
                                          messages=[first, late], **V1), agent="lg")
        # The same messages again (a client re-running the thread) still hear of it.
        again = await served.run(run_input("", thread="b1", run="r3", messages=[first],
                                           **V1), agent="lg")
        answered = await served.run(run_input("", thread="b1", run="r4", messages=[first],
                                              resume=[{"interruptId": pending["id"],
                                                       "status": "resolved",
                                                       "payload": "cats"}], **V1),
                                    agent="lg")
        gql_asked = await served.generate(chat_data([text_message("g1", "user", "go")],
                                                 thread="b2", agentSession=SESSION))
        gql_sent = await served.generate(chat_data([text_message("g1", "user", "go"),
                                                 text_message("g2", "user", "more")],
                                                thread="b2", agentSession=SESSION))
    for events in (asked, sent, again, answered):
        verify_events(events)
    assert (sent[-1]["type"], sent[-1]["code"]) == ("RUN_ERROR", "APPROVAL_ERROR")
    assert "answer first" in sent[-1]["message"]
    assert again[-1]["outcome"]["interrupts"][0]["id"] == pending["id"]
    assert said(answered) == "topic=cats"
    assert gql_asked["metaEvents"]
    status = gql_sent["status"]
    assert status["code"] == "Failed"
    assert status["details"]["originalError"]["originalErrorType"] == "APPROVAL_ERROR"
    assert "answer first" in status["details"]["description"]


async def test_another_agent_on_a_shared_checkpointer_does_not_take_a_waiting_thread(
        serve_runtime: ServeRuntime) -> None:
    """Two agents on one checkpointer (the demo's review_loop and account_review) read and
    write the same thread's checkpoints. A chat through the second on a thread where the
    first's approval waited ran its graph on the first's checkpoint, and the approval was
    withdrawn. The run is refused now (as a message is while the agent's own approval
    waits), naming the agent that waits, on both protocols; the approval still waits."""
    saver = checkpointer("memory")
    asking, talking = asks().builder, says_topic().builder
    runtime = CopilotRuntime(agents={
        "asker": LangGraphAgent(name="asker", graph=asking.compile(checkpointer=saver)),
        "lg": LangGraphAgent(name="lg", graph=talking.compile(checkpointer=saver))})
    first = {"id": "m1", "role": "user", "content": "go"}
    async with serve_runtime(runtime) as served:
        asked = await served.run(run_input("go", thread="x1", messages=[first], **V1),
                                 agent="asker")
        (pending,) = asked[-1]["outcome"]["interrupts"]
        sent = await served.run(run_input("hello", thread="x1", run="r2", **V1), agent="lg")
        gql_sent = await served.generate(chat_data([text_message("g1", "user", "hi")],
                                                  thread="x1", agentSession=SESSION))
        elsewhere = await served.run(run_input("hello", thread="x2", run="r3", **V1),
                                     agent="lg")
        waiting = await runtime.approvals.list(thread_id="x1")
        answered = await served.run(run_input("", thread="x1", run="r4", messages=[first],
                                              resume=[{"interruptId": pending["id"],
                                                       "status": "resolved",
                                                       "payload": "cats"}], **V1),
                                    agent="asker")
        after = await served.run(run_input("hello", thread="x1", run="r5", **V1), agent="lg")
    assert (sent[-1]["type"], sent[-1]["code"]) == ("RUN_ERROR", "APPROVAL_ERROR"), sent[-1]
    assert "'asker'" in sent[-1]["message"]
    status = gql_sent["status"]
    assert status["code"] == "Failed"
    assert status["details"]["originalError"]["originalErrorType"] == "APPROVAL_ERROR"
    assert "'asker'" in status["details"]["description"]
    assert said(elsewhere) == "topic=None role=None"  # another thread is no business of it
    assert [(a.id, a.agent_id, a.status) for a in waiting] == [
        (pending["id"], "asker", "pending")]
    assert said(answered) == "topic=cats"
    assert after[-1]["type"] == "RUN_FINISHED"  # answered: the thread is free again


# ---- C. precise failures ------------------------------------------------------------------


def loops() -> Any:
    graph = StateGraph(State)
    graph.add_node("spin", lambda state: {"topic": "again"})
    graph.add_edge(START, "spin")
    graph.add_edge("spin", "spin")
    return graph.compile(checkpointer=InMemorySaver())


async def test_the_recursion_limit_is_told_precisely(serve_runtime: ServeRuntime) -> None:
    agent = LangGraphAgent(name="lg", graph=loops(), config={"recursion_limit": 7})
    async with serve_runtime(CopilotRuntime(agents={"lg": agent})) as served:
        events = await served.run(run_input("go", thread="c1"), agent="lg")
        gql = await served.generate(chat_data([text_message("u1", "user", "go")], thread="c2",
                                           agentSession=SESSION))
    verify_events(events)
    error = events[-1]
    assert (error["type"], error["code"]) == ("RUN_ERROR", "AGENT_EXECUTION_ERROR")
    assert error["message"] == ("Agent 'lg' reached its recursion limit (7 steps) without "
                                "finishing: its graph may loop, or needs a higher "
                                "recursion_limit in its config")
    assert gql["status"]["details"]["originalError"]["originalErrorType"] == \
        "AGENT_EXECUTION_ERROR"


def queries_its_own_database() -> Any:
    def node(state: State) -> Json:
        raise sqlite3.OperationalError("no such table: orders")

    graph = StateGraph(State)
    graph.add_node("node", node)
    graph.add_edge(START, "node")
    graph.add_edge("node", END)
    return graph.compile(checkpointer=InMemorySaver())


@contextlib.contextmanager
def store(kind: str, tmp_path: Path, tables: str = "checkpoints"
          ) -> Iterator[tuple[str, Callable[[], None]]]:
    """A checkpointer URL, and what drops its tables (its checkpoints', or its approval
    ledger's: `tables="ledger"`)."""
    if kind == "sqlite":
        where = tmp_path / "cp.sqlite3"

        def drop_sqlite() -> None:
            with sqlite3.connect(where) as db:
                if tables == "ledger":
                    db.execute("DROP TABLE copilot_approvals")
                    return
                db.execute("DROP TABLE checkpoints")
                db.execute("DROP TABLE writes")

        yield f"sqlite:///{where}", drop_sqlite
        return
    with postgres_schema() as url:
        schema = url.rsplit("schema=", 1)[1]

        def drop_postgres() -> None:
            with psycopg.connect(SERVER, autocommit=True) as conn:
                if tables == "ledger":
                    conn.execute(f'DROP TABLE "{schema}".copilot_approvals')
                    return
                conn.execute(f'DROP TABLE "{schema}".checkpoints, "{schema}".checkpoint_writes')

        yield url, drop_postgres


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_failing_checkpoint_store_is_service_unavailable(
        serve_runtime: ServeRuntime, tmp_path: Path, kind: str) -> None:
    with store(kind, tmp_path) as (url, drop_tables):
        await checkpoint_store_fails(serve_runtime, url, drop_tables)


async def checkpoint_store_fails(serve_runtime: ServeRuntime, url: str,
                                 drop_tables: Callable[[], None]) -> None:
    graph = says_topic().builder.compile(checkpointer=checkpointer(url))
    runtime = CopilotRuntime(agents={
        "lg": LangGraphAgent(name="lg", graph=graph),
        "own": LangGraphAgent(name="own", graph=queries_its_own_database())})
    async with serve_runtime(runtime) as served:
        ran = await served.run(run_input("go", thread="c0"), agent="lg")
        assert ran[-1]["type"] == "RUN_FINISHED"
        drop_tables()  # the store loses its tables
        events = await served.run(run_input("go", thread="c3"), agent="lg")
        gql = await served.generate(chat_data([text_message("u1", "user", "go")], thread="c4",
                                           agentSession=SESSION))
        # Reading a thread outside a run: as unavailable as runs (was 500).
        loaded = await load_state(served, "c0")
        listed = await served.session.get(served.url + "/approvals?threadId=c0")
        # The graph's own database failing is the graph's failure, as before.
        own = await served.run(run_input("go", thread="c5"), agent="own")
    (error,) = loaded["errors"]
    assert error["extensions"]["runtimeCode"] == "SERVICE_UNAVAILABLE", error
    assert listed.status == 503, await listed.text()
    verify_events(events)
    assert (events[-1]["type"], events[-1]["code"]) == ("RUN_ERROR", "SERVICE_UNAVAILABLE")
    assert "no such table" not in events[-1]["message"]
    assert gql["status"]["details"]["originalError"]["code"] == "NETWORK_ERROR"
    assert (own[-1]["type"], own[-1]["code"]) == ("RUN_ERROR", "AGENT_ERROR")


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_lost_approval_ledger_is_service_unavailable(
        serve_runtime: ServeRuntime, tmp_path: Path, kind: str) -> None:
    """Before: a run read the ledger's table (taken answers to carry on) and failed with
    the generic AGENT_ERROR."""
    with store(kind, tmp_path, tables="ledger") as (url, drop_tables):
        graph = says_topic().builder.compile(checkpointer=checkpointer(url))
        runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
        async with serve_runtime(runtime) as served:
            ran = await served.run(run_input("go", thread="c0"), agent="lg")
            assert ran[-1]["type"] == "RUN_FINISHED"
            drop_tables()
            events = await served.run(run_input("go", thread="c1"), agent="lg")
    verify_events(events)
    assert (events[-1]["type"], events[-1]["code"]) == ("RUN_ERROR", "SERVICE_UNAVAILABLE")


async def load_state(served: Served, thread: str) -> Json:
    response = await served.session.post(served.url, data=orjson.dumps({
        "query": "query load($data: LoadAgentStateInput!) { loadAgentState(data: $data) "
                 "{ threadId threadExists state } }",
        "variables": {"data": {"threadId": thread, "agentName": "lg"}}}),
        headers=CLIENT_HEADERS)
    assert response.status == 200
    answer: Json = await response.json()
    return answer


# ---- D. get_stream_writer() --------------------------------------------------------------


def writes() -> Any:
    def inner(state: State) -> Json:
        get_stream_writer()({"progress": 2, "where": "subgraph"})
        return {}

    sub = StateGraph(State)
    sub.add_node("inner", inner)
    sub.add_edge(START, "inner")
    sub.add_edge("inner", END)

    def node(state: State) -> Json:
        get_stream_writer()({"progress": 1})
        return {"messages": [AIMessage(content="done")]}

    graph = StateGraph(State)
    graph.add_node("node", node)
    graph.add_node("sub", sub.compile())
    graph.add_edge(START, "node")
    graph.add_edge("node", "sub")
    graph.add_edge("sub", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_stream_writer_output_is_a_custom_event(serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=writes())})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread="d1", **V1), agent="lg")
        gql = await served.generate(chat_data([text_message("u1", "user", "go")], thread="d2",
                                           agentSession=SESSION))
    verify_events(events)
    written = [e["value"] for e in events
               if e["type"] == "CUSTOM" and e["name"] == "langgraph_stream_writer"]
    assert written == [{"progress": 1}, {"progress": 2, "where": "subgraph"}]
    assert said(events) == "done"
    assert gql["status"]["code"] == "Success"


# ---- E. a state too large to be sent back ---------------------------------------------------


def grows() -> Any:
    graph = StateGraph(State)
    graph.add_node("grow", lambda state: {"blob": "x" * 5000})
    graph.add_edge(START, "grow")
    graph.add_edge("grow", END)
    return graph.compile(checkpointer=InMemorySaver())


@pytest.fixture
async def small_limit_served(serve_runtime: ServeRuntime) -> AsyncIterator[Served]:
    agent = LangGraphAgent(name="lg", graph=grows(), state_warning_bytes=4096)
    async with serve_runtime(CopilotRuntime(agents={"lg": agent}),
                             max_body_size=4096) as served:
        yield served


async def test_a_state_the_client_cannot_send_back_is_logged_once(
        small_limit_served: Served) -> None:
    served = small_limit_served
    with capture_logs() as logs:
        first = await served.run(run_input("go", thread="e1"), agent="lg")
        await served.run(run_input("go", thread="e1", run="r2"), agent="lg")
        await served.run(run_input("go", thread="e2"), agent="lg")
    verify_events(first)
    warned = [entry for entry in logs if "larger than the inbound body limit" in entry["event"]]
    assert [(w["thread_id"], w["limit"]) for w in warned] == [("e1", 4096), ("e2", 4096)]
    assert warned[0]["state_bytes"] > 5000
    # What the warning is about: that state sent back is refused.
    echo = run_input("again", thread="e1", run="r3",
                     state={"blob": "x" * 5000})
    response = await served.post("/agent/lg/run", echo)
    assert response.status == 413


class TreeState(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    tree: dict[str, Any]


def nests(levels: int) -> Any:
    """Writes a tree `levels` objects deep into its state."""
    def build(state: TreeState) -> Json:
        tree: dict[str, Any] = {"leaf": True}
        for _ in range(levels - 1):
            tree = {"child": tree}
        return {"messages": [AIMessage(content="built")], "tree": tree}

    graph = StateGraph(TreeState)
    graph.add_node("build", build)
    graph.add_edge(START, "build")
    graph.add_edge("build", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_a_state_nested_deeper_than_a_client_can_send_back_is_logged_once(
        serve_runtime: ServeRuntime) -> None:
    """The built-in agent refuses to make a state deeper than a client can send back; a
    graph's state is its own, but the client's echo of it was refused on every later turn
    ("nested too deep") with nothing said where the state was made."""
    agent = LangGraphAgent(name="lg", graph=nests(70))
    shallow = LangGraphAgent(name="ok", graph=nests(62))  # (the state is one level more)
    async with serve_runtime(CopilotRuntime(agents={"lg": agent, "ok": shallow})) as served:
        with capture_logs() as logs:
            first = await served.run(run_input("go", thread="n1"), agent="lg")
            await served.run(run_input("go", thread="n1", run="r2"), agent="lg")
            await served.run(run_input("go", thread="n2"), agent="lg")
            fine = await served.run(run_input("go", thread="n3"), agent="ok")
        echo = run_input("again", thread="n1", run="r3",
                         state=[e for e in first if e["type"] == "STATE_SNAPSHOT"][-1]["snapshot"])
        response = await served.post("/agent/lg/run", echo)
        again = await served.run(run_input("again", thread="n3", run="r2", state=[
            e for e in fine if e["type"] == "STATE_SNAPSHOT"][-1]["snapshot"]), agent="ok")
    verify_events(first)
    warned = [entry for entry in logs if "deeper than a client" in entry["event"]]
    assert [(w["thread_id"], w["limit"]) for w in warned] == [("n1", 63), ("n2", 63)]
    # What the warning is about: that state sent back is refused; one level less is taken.
    assert response.status == 400
    assert "nested too deep" in await response.text()
    assert again[-1]["type"] == "RUN_FINISHED"


# ---- F. what a node's Command writes is in the run's next state snapshot ------------------


def commands() -> Any:
    """Nodes that write state with `Command(update=..., goto=...)`, as a dict and as pairs."""
    def choose(state: State) -> Command[Literal["assign"]]:
        return Command(update={"topic": "weather"}, goto="assign")

    def assign(state: State) -> Command[Literal["finish"]]:
        return Command(update=[("user_role", "admin")], goto="finish")

    def finish(state: State) -> Json:
        return {"blob": "b"}

    graph = StateGraph(State)
    graph.add_node("choose", choose)
    graph.add_node("assign", assign)
    graph.add_node("finish", finish)
    graph.add_edge(START, "choose")
    graph.add_edge("finish", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_a_command_update_is_in_the_state_as_its_step_ends(
        serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=commands())})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread="f1", **V1), agent="lg")
    verify_events(events)
    # The state the client holds as each step ends (snapshots, then deltas on them).
    held: Any = {}
    at_step_end: dict[str, Any] = {}
    for event in events:
        if event["type"] == "STATE_SNAPSHOT":
            held = event["snapshot"]
        elif event["type"] == "STATE_DELTA":
            held = patched_state(held, event["delta"])
        elif event["type"] == "STEP_FINISHED":
            at_step_end[event["stepName"]] = held
    assert at_step_end == {"choose": {"topic": "weather"},
                           "assign": {"topic": "weather", "user_role": "admin"},
                           "finish": {"topic": "weather", "user_role": "admin", "blob": "b"}}


class Listed(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    items: Annotated[list[str], operator.add]


def reduced() -> Any:
    """Nodes that add to a key with a reducer: by a returned dict and by a Command."""
    def seed(state: Listed) -> Json:
        return {"items": ["a"]}

    def more(state: Listed) -> Command[Literal["last"]]:
        return Command(update={"items": ["b"], "messages": [AIMessage(content="noted")]},
                       goto="last")

    def last(state: Listed) -> Json:
        return {"items": ["c"]}

    graph = StateGraph(Listed)
    graph.add_node("seed", seed)
    graph.add_node("more", more)
    graph.add_node("last", last)
    graph.add_edge(START, "seed")
    graph.add_edge("seed", "more")
    graph.add_edge("last", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_a_write_to_a_key_with_a_reducer_is_reduced_in_the_next_state_sent(
        serve_runtime: ServeRuntime) -> None:
    """A node's `{"items": ["b"]}` (or its Command's) on `operator.add`'s key adds to the
    state: the snapshot as its step ended showed `["b"]` alone, as if it replaced it. Now
    a node's exit shows the key as it was before its step, and the next snapshot as
    LangGraph reduced it (the step's reduced state exists only after the node's exit)."""
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=reduced())})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread="f2", **V1), agent="lg")
        again = await served.run(run_input("go", thread="f2", run="r2", **V1), agent="lg")
    for run, before in ((events, []), (again, ["a", "b", "c"])):
        verify_events(run)
        at_step_end, held = held_at_step_ends(run, "items")
        assert at_step_end == {"seed": before, "more": [*before, "a"],
                               "last": [*before, "a", "b"]}, before
        assert held["items"] == [*before, "a", "b", "c"]


def held_at_step_ends(run: list[Json], key: str) -> tuple[dict[str, Any], Json]:
    """The state's `key` as the client held it when each step ended (by step name, the
    last time it ended), and the state it held at the run's end."""
    held: Any = {}
    at_step_end: dict[str, Any] = {}
    for event in run:
        if event["type"] == "STATE_SNAPSHOT":
            held = event["snapshot"]
        elif event["type"] == "STATE_DELTA":
            held = patched_state(held, event["delta"])
        elif event["type"] == "STEP_FINISHED":
            at_step_end[event["stepName"]] = held.get(key)
    return at_step_end, held


def named_like_their_nodes() -> Any:
    """A node whose runnable has the node's name, and a subgraph compiled under the name of
    the node it is added as: each has two chains named as its node."""
    inner = StateGraph(Listed)
    inner.add_node("inner", lambda state: {"items": ["in"]})
    inner.add_edge(START, "inner")
    inner.add_edge("inner", END)
    graph = StateGraph(Listed)
    graph.add_node("a", RunnableLambda(lambda state: {"items": ["a"]}, name="a"))
    graph.add_node("research", inner.compile(name="research"))
    graph.add_edge(START, "a")
    graph.add_edge("a", "research")
    graph.add_edge("research", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_a_node_named_as_its_runnable_adds_its_write_once(
        serve_runtime: ServeRuntime) -> None:
    """The node's task and its runnable both end under the node's name: the write was
    added for each (`["a", "a"]` as "a" ended)."""
    graph = named_like_their_nodes()
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        run = await served.run(run_input("go", thread="f3", **V1), agent="lg")
    verify_events(run)
    at_step_end, held = held_at_step_ends(run, "items")
    # (The subgraph returns its whole state, ["a", "in"], which operator.add appends.)
    # (the base reads the checkpoint as the subgraph starts; never the subgraph's own
    # `["in"]` as the graph's)
    assert (at_step_end["a"], at_step_end["research"]) == (["a"], ["a"])
    assert held["items"] == ["a", "a", "in"] == (await graph_values(graph, "f3"))["items"]


#: What `merge` was given, call by call.
MERGED: list[Json] = []


def merge(left: dict[str, list[str]] | None, right: dict[str, list[str]]
          ) -> dict[str, list[str]]:
    """A reducer that returns a new dict but extends the lists it shares with `left`."""
    MERGED.append(right)
    out = dict(left or {})
    for key, value in right.items():
        out.setdefault(key, []).extend(value)
    return out


class ByTopic(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    by_topic: Annotated[dict[str, list[str]], merge]


async def test_a_reducer_that_changes_its_left_value_is_not_run_on_the_graphs_state(
        serve_runtime: ServeRuntime) -> None:
    """The mid-run fold called `merge` on a shallow copy of the graph's own value: its
    lists, extended in place, put "b" in the checkpoint twice; and it ran once more per
    write than the graph does."""
    graph = StateGraph(ByTopic)
    graph.add_node("a", lambda state: {"by_topic": {"t": ["a"]}})
    graph.add_node("b", lambda state: {"by_topic": {"t": ["b"]}})
    graph.add_edge(START, "a")
    graph.add_edge("a", "b")
    graph.add_edge("b", END)
    compiled = graph.compile(checkpointer=InMemorySaver())
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=compiled)})
    MERGED.clear()
    async with serve_runtime(runtime) as served:
        run = await served.run(run_input("go", thread="f4", **V1), agent="lg")
    verify_events(run)
    assert (await graph_values(compiled, "f4"))["by_topic"] == {"t": ["a", "b"]}
    assert MERGED == [{"t": ["a"]}, {"t": ["b"]}]
    at_step_end, held = held_at_step_ends(run, "by_topic")
    assert at_step_end == {"a": {}, "b": {"t": ["a"]}}
    assert held["by_topic"] == {"t": ["a", "b"]}


class Predicted(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    log: Annotated[list[str], operator.add]
    doc: str


class DocWriter(BaseChatModel):
    """A model that streams one `write_doc` tool call, its `text` in pieces."""

    @property
    def _llm_type(self) -> str:
        return "doc-writer"

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        raise NotImplementedError

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: Any = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        yield ChatGenerationChunk(message=AIMessageChunk(content="", id="ai1", tool_call_chunks=[
            {"name": "write_doc", "args": "", "id": "call1", "index": 0}]))
        for piece in ('{"text": "', "new ", 'doc"}'):
            yield ChatGenerationChunk(message=AIMessageChunk(
                content="", id="ai1",
                tool_call_chunks=[{"name": None, "args": piece, "id": None, "index": 0}]))


def predicts_doc() -> Any:
    """A model node that streams `doc` as predicted state and adds to a reducer's key; the
    tool node writes `doc`."""
    model = DocWriter()

    def chat(state: Predicted, config: RunnableConfig) -> Json:
        config = {**config, "metadata": {**(config.get("metadata") or {}),
                  "copilotkit:emit-intermediate-state": [
                      {"state_key": "doc", "tool": "write_doc", "tool_argument": "text"}]}}
        return {"messages": [model.invoke(state["messages"], config)], "log": ["chat ran"]}

    def write(state: Predicted) -> Json:
        call = state["messages"][-1].tool_calls[0]  # type: ignore[union-attr]
        return {"messages": [ToolMessage("ok", tool_call_id=call["id"], id="tm1")],
                "doc": call["args"]["text"]}

    graph = StateGraph(Predicted)
    graph.add_node("chat", chat)
    graph.add_node("write", write)
    graph.add_edge(START, "chat")
    graph.add_edge("chat", "write")
    graph.add_edge("write", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_a_reducer_write_does_not_undo_the_predicted_state(
        serve_runtime: ServeRuntime) -> None:
    """Before: the reduced `log` went to the base as a made-up exit of "chat", whose state
    snapshot the base withholds while a predicted-state tool call waits for its tool: it
    was sent, with the old `doc`, wiping what the client predicted."""
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=predicts_doc())})
    async with serve_runtime(runtime) as served:
        run = await served.run(run_input("go", thread="f6", state={"doc": "old"}, **V1),
                               agent="lg")
    verify_events(run)
    started = next(i for i, e in enumerate(run) if e["type"] == "TOOL_CALL_START")
    tool_step = next(i for i, e in enumerate(run)
                     if e["type"] == "STEP_STARTED" and e["stepName"] == "write")
    assert [e for e in run[started:tool_step] if e["type"] == "STATE_SNAPSHOT"] == []
    _, held = held_at_step_ends(run, "doc")
    assert (held["doc"], held["log"]) == ("new doc", ["chat ran"])


class Tagged(Listed, total=False):
    topic: str


def chain_of_two() -> Any:
    graph = StateGraph(Tagged)
    graph.add_node("a", lambda state: {"items": ["a"], "topic": "A"})
    graph.add_node("b", lambda state: {"items": ["b"], "topic": "B"})
    graph.add_edge(START, "a")
    graph.add_edge("a", "b")
    graph.add_edge("b", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_a_reducer_write_adds_no_events_of_its_own(serve_runtime: ServeRuntime) -> None:
    """Before: each step that wrote a reducer's key added a made-up `on_chain_end` of the
    root graph (its name and run id, the keys written as its output): one more state
    snapshot per step and, with raw events on, the graph seen to end after each step."""
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=chain_of_two(),
                                                          emit_raw_events=True)})
    async with serve_runtime(runtime) as served:
        run = await served.run(run_input("go", thread="f7", **V1), agent="lg")
    verify_events(run)
    raw = [e["event"] for e in run if e["type"] == "RAW"]
    root = next(e["run_id"] for e in raw if not e.get("parent_ids"))
    ends = [i for i, e in enumerate(raw) if e["run_id"] == root and e["event"] == "on_chain_end"]
    assert len(ends) == 1
    assert not any(e["event"] == "on_chain_end" for e in raw[ends[0] + 1:])
    # each node's exit, then the run's end
    assert sum(e["type"] == "STATE_SNAPSHOT" for e in run) == 3
    _, held = held_at_step_ends(run, "items")
    assert (held["items"], held["topic"]) == (["a", "b"], "B")


# ---- G. the client's run config (useCoAgent's `config`) -------------------------------------


class Settings(TypedDict, total=False):
    """The graph's context schema: the `configurable` keys a client may set. It names
    `thread_id` and `checkpoint_ns` too: those stay the runtime's all the same."""
    model: str
    thread_id: str
    checkpoint_ns: str


def reads_config(*, declared: bool = True) -> Any:
    """One node that answers with what its config and state hold."""
    def answer(state: State, config: RunnableConfig) -> Json:
        conf = config.get("configurable") or {}
        heard = [m.content for m in state["messages"] if m.type == "human"]
        return {"messages": [AIMessage(
            f"model={conf.get('model')} user={conf.get('user')} "
            f"limit={config.get('recursion_limit')} tags={config.get('tags')} heard={heard}")]}

    graph = StateGraph(State, context_schema=Settings if declared else None)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=InMemorySaver())


def with_config(config: Any) -> Json:
    """1.10's `agentStates` entry carrying `config` (as JSON text, as the client sends it)."""
    return {"agentStates": [{"agentName": "lg", "state": "{}",
                             "config": orjson.dumps(config).decode()}]}


def gql_said(response: Json) -> str:
    """The last assistant message of the last agent state (a node's message that no model
    streamed arrives only there)."""
    last = [m for m in response["messages"] if m["__typename"] == "AgentStateMessageOutput"
            and "messages" in orjson.loads(m["state"])][-1]
    content: str = [m for m in orjson.loads(last["state"])["messages"]
                    if m["role"] == "assistant"][-1]["content"]
    return content


CLIENT_CONFIG = {"configurable": {"model": "m1", "user": "u1"}, "recursion_limit": 5,
                 "tags": ["client"], "callbacks": "x", "metadata": {"a": 1}}


async def test_the_clients_config_sets_the_configurable_keys_the_graph_declares(
        serve_runtime: ServeRuntime) -> None:
    """Before: `forwardedProps.config` (1.10's `agentStates[].config`) never reached the
    graph. Now its declared `configurable` keys and a lower `recursion_limit` do; an
    undeclared key (`user`), `tags`, `callbacks` and `metadata` do not."""
    agents = {"lg": LangGraphAgent(name="lg", graph=reads_config()),
              "none": LangGraphAgent(name="none", graph=reads_config(declared=False))}
    async with serve_runtime(CopilotRuntime(agents=agents)) as served:
        agui = await served.run(run_input("hi", thread="g1", forwardedProps={
            "config": CLIENT_CONFIG}), agent="lg")
        gql = await served.generate(chat_data(
            [text_message("u1", "user", "hi")], thread="g2", agentSession=SESSION,
            **with_config(CLIENT_CONFIG)))
        undeclared = await served.run(run_input("hi", thread="g3", forwardedProps={
            "config": CLIENT_CONFIG}), agent="none")
    verify_events(agui)
    assert said(agui) == "model=m1 user=None limit=5 tags=None heard=['hi']"
    assert gql["status"]["code"] == "Success", gql["status"]
    assert gql_said(gql) == "model=m1 user=None limit=5 tags=None heard=['hi']"
    # A graph that declares no configurable keys takes none.
    assert said(undeclared).startswith("model=None user=None limit=5 ")


async def test_a_client_cannot_raise_the_recursion_limit(serve_runtime: ServeRuntime) -> None:
    agent = LangGraphAgent(name="lg", graph=reads_config(), config={"recursion_limit": 7})
    async with serve_runtime(CopilotRuntime(agents={"lg": agent})) as served:
        higher = await served.run(run_input("hi", thread="r1", forwardedProps={
            "config": {"recursion_limit": 1000}}), agent="lg")
        lower = await served.run(run_input("hi", thread="r2", forwardedProps={
            "config": {"recursion_limit": 3}}), agent="lg")
    assert "limit=7 " in said(higher)
    assert "limit=3 " in said(lower)


async def test_a_clients_config_cannot_reach_another_thread(
        serve_runtime: ServeRuntime) -> None:
    """`thread_id`, `checkpoint_ns`, `checkpoint_id` and LangGraph's own keys stay the
    runtime's, even where the graph's context schema names them."""
    graph = reads_config()
    hostile = {"configurable": {
        "thread_id": "victim", "checkpoint_ns": "", "checkpoint_id": "1",
        "checkpoint_map": {"": "1"}, "__pregel_durability": "exit", "model": "m2"}}
    async with serve_runtime(CopilotRuntime(agents={
            "lg": LangGraphAgent(name="lg", graph=graph)})) as served:
        victim = await served.run(run_input("victim secret", thread="victim"), agent="lg")
        agui = await served.run(run_input("hi", thread="attacker", forwardedProps={
            "config": hostile}), agent="lg")
        gql = await served.generate(chat_data(
            [text_message("u1", "user", "hi")], thread="attacker-2", agentSession=SESSION,
            **with_config(hostile)))
    assert said(victim).endswith("heard=['victim secret']")
    assert said(agui) == "model=m2 user=None limit=25 tags=None heard=['hi']"
    assert "victim secret" not in orjson.dumps(agui).decode()
    assert gql_said(gql) == "model=m2 user=None limit=25 tags=None heard=['hi']"
    assert "victim secret" not in orjson.dumps(gql).decode()
    # The victim's thread is as its owner left it.
    assert [m.content for m in (await graph_values(graph, "victim"))["messages"]] == [
        "victim secret", said(victim)]
    assert [m.content for m in (await graph_values(graph, "attacker"))["messages"]] == [
        "hi", said(agui)]


@pytest.mark.parametrize("config", [
    "text", [1], {"configurable": [1]}, {"configurable": "x"}, {"recursion_limit": 0},
    {"recursion_limit": -3}, {"recursion_limit": True}, {"recursion_limit": "5"},
    {"recursion_limit": 2.5}], ids=["text", "list", "configurable-list", "configurable-text",
                                     "limit-0", "limit-negative", "limit-bool",
                                     "limit-text", "limit-float"])
async def test_a_config_of_the_wrong_shape_is_invalid_request(
        serve_runtime: ServeRuntime, config: Any) -> None:
    graph = reads_config()
    async with serve_runtime(CopilotRuntime(agents={
            "lg": LangGraphAgent(name="lg", graph=graph)})) as served:
        refused = await served.run(run_input("hi", thread="w1", forwardedProps={
            "config": config}), agent="lg")
        after = await served.run(run_input("hi", thread="w1", run="r2"), agent="lg")
        gql = None
        if isinstance(config, dict):  # (GraphQL's `config` is a JSON object already)
            gql = await served.generate(chat_data(
                [text_message("u1", "user", "hi")], thread="w2", agentSession=SESSION,
                **with_config(config)))
    verify_events(refused)
    assert (refused[-1]["type"], refused[-1]["code"]) == ("RUN_ERROR", "INVALID_REQUEST")
    assert refused[-1]["message"].startswith("forwardedProps.config")
    assert said(after).endswith("heard=['hi']")  # nothing of the refused run was kept
    if gql is not None:
        assert gql["status"]["code"] == "Failed"
        assert gql["status"]["details"]["originalError"]["originalErrorType"] == \
            "INVALID_REQUEST"


@dataclasses.dataclass
class DataclassContext:
    model: str = "default"


class PydanticContext(pydantic.BaseModel):
    model: str = "default"


def reads_context(schema: Any) -> Any:
    """One node that answers with its run's context (LangGraph 1.x's `Runtime.context`)."""
    def answer(state: State, runtime: Runtime[Any]) -> Json:
        return {"messages": [AIMessage(f"model={runtime.context.model}")]}

    graph = StateGraph(State, context_schema=schema)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("schema", [DataclassContext, PydanticContext])
async def test_a_graph_with_a_dataclass_or_pydantic_context_runs(
        serve_runtime: ServeRuntime, schema: Any) -> None:
    """Before: the whole `configurable` (`thread_id`, `__pregel_durability`) was passed as
    the run's context, and a context class that names fewer keys refused it: every run of
    such a graph failed with AGENT_ERROR. Now the context holds the keys it names."""
    agents = {"lg": LangGraphAgent(name="lg", graph=reads_context(schema)),
              "own": LangGraphAgent(name="own", graph=reads_context(schema),
                                    config={"configurable": {"model": "agent's"}})}
    async with serve_runtime(CopilotRuntime(agents=agents)) as served:
        plain = await served.run(run_input("hi", thread="x1"), agent="lg")
        sent = await served.run(run_input("hi", thread="x2", forwardedProps={
            "config": {"configurable": {"model": "m1"}}}), agent="lg")
        own = await served.run(run_input("hi", thread="x3"), agent="own")
        gql = await served.generate(chat_data(
            [text_message("u1", "user", "hi")], thread="x4", agentSession=SESSION,
            **with_config({"configurable": {"model": "m2"}})))
    for events in (plain, sent, own):
        verify_events(events)
    assert said(plain) == "model=default"
    assert said(sent) == "model=m1"
    assert said(own) == "model=agent's"
    assert gql_said(gql) == "model=m2"


@tool
def add_item(item: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command[Any]:
    """Add an item."""
    return Command(update={"items": [item], "messages": [
        ToolMessage(content="added", tool_call_id=tool_call_id)]})


async def test_a_tools_command_write_to_a_key_with_a_reducer_is_in_the_next_state_sent(
        serve_runtime: ServeRuntime) -> None:
    """ToolNode returns its tools' `Command`s as a list, not a dict of writes (the base
    sends no snapshot as it exits): the state showed none of them until the run's end.
    Now the next node's exit does."""
    graph = StateGraph(Listed)
    graph.add_node("a", lambda state: {"items": ["a"], "messages": [AIMessage(
        content="", tool_calls=[{"name": "add_item", "args": {"item": "t"}, "id": "c1"}])]})
    graph.add_node("tools", ToolNode([add_item]))
    graph.add_node("z", lambda state: {"items": ["z"]})
    graph.add_edge(START, "a")
    graph.add_edge("a", "tools")
    graph.add_edge("tools", "z")
    graph.add_edge("z", END)
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
        name="lg", graph=graph.compile(checkpointer=InMemorySaver()))})
    async with serve_runtime(runtime) as served:
        run = await served.run(run_input("go", thread="f5", **V1), agent="lg")
    verify_events(run)
    at_step_end, held = held_at_step_ends(run, "items")
    assert at_step_end == {"a": [], "tools": [], "z": ["a", "t"]}
    assert held["items"] == ["a", "t", "z"]


@dataclasses.dataclass
class TenantContext:
    tenant_id: str = "none"
    model: str = "default"


class LooseContext(TypedDict, total=False):
    model: str


def reads_tenant(schema: Any) -> Any:
    """One node that answers with its run's context, as the graph reads it."""
    def answer(state: State, runtime: Runtime[Any]) -> Json:
        context = runtime.context
        if isinstance(context, dict):
            shown = {k: v for k, v in context.items() if k in ("model", "api_base")}
            return {"messages": [AIMessage(f"context={sorted(shown.items())}")]}
        return {"messages": [AIMessage(f"tenant={context.tenant_id} model={context.model}")]}

    graph = StateGraph(State, context_schema=schema)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_a_client_cannot_replace_the_operators_configurable_keys(
        serve_runtime: ServeRuntime) -> None:
    """Before: a key the agent's `config` set and the context schema declared was the
    client's to replace (tenant "acme" ran as "globex"). Now it stays the operator's; the
    declared keys the operator left unset are the client's. And a TypedDict context gets
    the operator's undeclared keys again (they were dropped for every context schema)."""
    hostile = {"configurable": {"tenant_id": "globex", "model": "m1"}}
    agents = {"lg": LangGraphAgent(name="lg", graph=reads_tenant(TenantContext),
                                   config={"configurable": {"tenant_id": "acme"}}),
              "loose": LangGraphAgent(name="loose", graph=reads_tenant(LooseContext),
                                      config={"configurable": {
                                          "model": "m0", "api_base": "https://internal"}})}
    async with serve_runtime(CopilotRuntime(agents=agents)) as served:
        agui = await served.run(run_input("hi", thread="op1", forwardedProps={
            "config": hostile}), agent="lg")
        gql = await served.generate(chat_data(
            [text_message("u1", "user", "hi")], thread="op2", agentSession=SESSION,
            **with_config(hostile)))
        loose = await served.run(run_input("hi", thread="op3", forwardedProps={
            "config": {"configurable": {"model": "m9"}}}), agent="loose")
    verify_events(agui)
    assert said(agui) == "tenant=acme model=m1"
    assert gql_said(gql) == "tenant=acme model=m1"
    assert said(loose) == "context=[('api_base', 'https://internal'), ('model', 'm0')]"


class Opaque:
    """A type pydantic cannot describe: the context schema is read from the class."""


@dataclasses.dataclass
class RequiredTenant:
    tenant_id: str


@dataclasses.dataclass
class InheritingContext(RequiredTenant):
    client: Opaque | None = None
    model: str = "default"


async def test_an_inherited_context_field_is_declared(serve_runtime: ServeRuntime) -> None:
    """Before: a context pydantic cannot describe was read from its own
    `__annotations__`, without its base's fields: the operator's required `tenant_id` was
    dropped from the context, and every run failed."""
    graph = reads_tenant(InheritingContext)
    assert graph_config_keys(graph) == {"tenant_id", "client", "model"}
    agent = LangGraphAgent(name="lg", graph=graph,
                           config={"configurable": {"tenant_id": "acme"}})
    async with serve_runtime(CopilotRuntime(agents={"lg": agent})) as served:
        events = await served.run(run_input("hi", thread="in1", forwardedProps={
            "config": {"configurable": {"model": "m1"}}}), agent="lg")
    verify_events(events)
    assert said(events) == "tenant=acme model=m1"


@pytest.mark.parametrize("schema", [DataclassContext, PydanticContext, InheritingContext])
async def test_a_client_value_of_the_wrong_type_is_invalid_request(
        serve_runtime: ServeRuntime, schema: Any) -> None:
    """Before: a pydantic context refused it inside the graph (AGENT_ERROR, an error log
    with a traceback at any client's will), a dataclass took it as it was. Now the run is
    refused before the graph starts, naming the key."""
    wrong = {"configurable": {"model": {"nested": [1]}}}
    config = {"configurable": {"tenant_id": "acme"}} if schema is InheritingContext else {}
    agent = LangGraphAgent(name="lg", graph=reads_context(schema), config=config)
    with capture_logs() as logs:
        async with serve_runtime(CopilotRuntime(agents={"lg": agent})) as served:
            agui = await served.run(run_input("hi", thread="v1", forwardedProps={
                "config": wrong}), agent="lg")
            gql = await served.generate(chat_data(
                [text_message("u1", "user", "hi")], thread="v2", agentSession=SESSION,
                **with_config(wrong)))
            right = await served.run(run_input("hi", thread="v3", forwardedProps={
                "config": {"configurable": {"model": "m1"}}}), agent="lg")
    verify_events(agui)
    assert (agui[-1]["type"], agui[-1]["code"]) == ("RUN_ERROR", "INVALID_REQUEST")
    assert agui[-1]["message"].startswith("forwardedProps.config.configurable.model: ")
    assert gql["status"]["code"] == "Failed"
    assert gql["status"]["details"]["originalError"]["originalErrorType"] == \
        "INVALID_REQUEST"
    assert said(right) == "model=m1"
    assert not [log for log in logs if log["log_level"] in ("error", "critical")]


class AliasedState(pydantic.BaseModel):
    messages: Annotated[list[AnyMessage], add_messages] = []
    user_name: str = pydantic.Field(default="", alias="userName")
    score: int = 0


async def test_a_pydantic_state_field_with_an_alias_is_shown(
        serve_runtime: ServeRuntime) -> None:
    """Before: the state keys were read as the JSON schema names them (`userName`), the
    checkpoint's as the fields are named (`user_name`): the streamed and the loaded
    state dropped the field."""
    def answer(state: AliasedState) -> Json:
        return {"messages": [AIMessage("ok")], "user_name": "bob", "score": 7}

    graph = StateGraph(AliasedState)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    graph.add_edge("answer", END)
    agent = LangGraphAgent(name="lg", graph=graph.compile(checkpointer=InMemorySaver()))
    async with serve_runtime(CopilotRuntime(agents={"lg": agent})) as served:
        events = await served.run(run_input("hi", thread="al1"), agent="lg")
        loaded = await load_state(served, "al1")
    verify_events(events)
    streamed = [e["snapshot"] for e in events if e["type"] == "STATE_SNAPSHOT"][-1]
    assert {k: v for k, v in streamed.items() if k != "messages"} == {
        "user_name": "bob", "score": 7}
    state = orjson.loads(loaded["data"]["loadAgentState"]["state"])
    assert {k: v for k, v in state.items() if k != "messages"} == {
        "user_name": "bob", "score": 7}


class NamedTenant(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(populate_by_name=True)
    tenant: str = pydantic.Field("none", alias="tenantId")


class ChoiceTenant(pydantic.BaseModel):
    tenant: str = pydantic.Field(
        "none", validation_alias=pydantic.AliasChoices("tenant_id", "tenantId"))


def says_tenant(schema: Any) -> Any:
    def answer(state: State, runtime: Runtime[Any]) -> Json:
        return {"messages": [AIMessage(f"tenant={runtime.context.tenant}")]}

    graph = StateGraph(State, context_schema=schema)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize(("schema", "operator_key", "client_key"), [
    (NamedTenant, "tenant", "tenantId"), (NamedTenant, "tenantId", "tenant"),
    (ChoiceTenant, "tenant_id", "tenantId"), (ChoiceTenant, "tenantId", "tenant_id")])
async def test_an_operators_context_field_is_kept_whatever_name_either_side_uses(
        serve_runtime: ServeRuntime, schema: Any, operator_key: str, client_key: str) -> None:
    """Before: a field's names were compared one by one: the operator's `tenant` was
    replaced by a client's `tenantId` (its alias); and the operator's value under an
    `AliasChoices` name was cut from the run's context (the field's default ran)."""
    agent = LangGraphAgent(name="lg", graph=says_tenant(schema),
                           config={"configurable": {operator_key: "acme"}})
    async with serve_runtime(CopilotRuntime(agents={"lg": agent})) as served:
        plain = await served.run(run_input("hi", thread="n1"), agent="lg")
        hostile = await served.run(run_input("hi", thread="n2", forwardedProps={
            "config": {"configurable": {client_key: "globex"}}}), agent="lg")
    for events in (plain, hostile):
        verify_events(events)
        assert said(events) == "tenant=acme"


@dataclasses.dataclass
class Depth:
    depth: int = 1


class DepthModel(pydantic.BaseModel):
    depth: int = 1


@dataclasses.dataclass
class Limits:
    limit: int = 3
    opts: DepthModel = dataclasses.field(default_factory=DepthModel)
    nested: Depth = dataclasses.field(default_factory=Depth)


class LimitsDict(TypedDict):
    limit: NotRequired[int]
    opts: NotRequired[Annotated[DepthModel, "meta"]]
    nested: Required[Depth]


def reads_limits(schema: Any) -> Any:
    def answer(state: State, runtime: Runtime[Any]) -> Json:
        context = runtime.context
        get = context.get if isinstance(context, dict) else \
            lambda key, default=None: getattr(context, key)
        opts, nested = get("opts", DepthModel()), get("nested", Depth())
        return {"messages": [AIMessage(
            f"limit+1={get('limit', 3) + 1} depth={opts.depth} nested={nested.depth}")]}

    graph = StateGraph(State, context_schema=schema)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    graph.add_edge("answer", END)
    return graph.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("schema", [Limits, LimitsDict])
async def test_the_graph_gets_a_clients_context_value_as_it_was_checked(
        serve_runtime: ServeRuntime, schema: Any) -> None:
    """Before: a dataclass's `limit: int` took "7" (the check coerced it, the graph got
    the text: AGENT_ERROR), its model and dataclass fields got plain dicts, and a
    TypedDict's `NotRequired`/`Required` fields took anything. Now the graph gets what
    the check made of the value, and a value it refuses is INVALID_REQUEST."""
    agent = LangGraphAgent(name="lg", graph=reads_limits(schema), config={
        "configurable": {"nested": Depth(5)}} if schema is LimitsDict else {})
    sent = {"limit": "7", "opts": {"depth": 2}}
    wrong = {"limit": {"x": 1}}
    async with serve_runtime(CopilotRuntime(agents={"lg": agent})) as served:
        right = await served.run(run_input("hi", thread="k1", forwardedProps={
            "config": {"configurable": sent}}), agent="lg")
        refused = await served.run(run_input("hi", thread="k2", forwardedProps={
            "config": {"configurable": wrong}}), agent="lg")
        if schema is Limits:
            nested = await served.run(run_input("hi", thread="k3", forwardedProps={
                "config": {"configurable": {"nested": {"depth": 4}}}}), agent="lg")
            assert said(nested) == "limit+1=4 depth=1 nested=4"
    verify_events(right)
    assert said(right) == f"limit+1=8 depth=2 nested={5 if schema is LimitsDict else 1}"
    assert (refused[-1]["type"], refused[-1]["code"]) == ("RUN_ERROR", "INVALID_REQUEST")
    assert refused[-1]["message"].startswith("forwardedProps.config.configurable.limit: ")


def test_a_compiled_graphs_schema_keys_are_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: pydantic built the graph's input and output JSON schemas on every run start
    and every `loadAgentState` (~30 ms for the demo's review loop, on the event loop: a
    1.10 page's burst of thread reloads queued behind each other)."""
    from copilot_runtime.agents._lg_state import schema_keys

    graph = says_topic()
    calls: list[str] = []
    read = type(graph).get_output_jsonschema

    def counted(self: Any, config: Any = None) -> Any:
        calls.append("output")
        return read(self, config)

    monkeypatch.setattr(type(graph), "get_output_jsonschema", counted)
    first = schema_keys(graph, {})
    first["output"].append("changed by a caller")
    again = schema_keys(graph, {"recursion_limit": 5})
    assert calls == ["output"]
    assert "changed by a caller" not in again["output"]
    assert set(again["output"]) >= {"messages", "topic"}
    assert schema_keys(says_topic())["output"] == again["output"]  # another graph: read anew
    assert calls == ["output", "output"]
