"""`LangGraphAgent` with the graphs that run several things at once, or nest them.

* Several interrupts pending at once (parallel nodes): each answered on its own, by id
  (AG-UI 1.0 `resume`), or by the question it quotes (the legacy
  `forwardedProps.command.resume` and GraphQL's `metaEvents`, which name no interrupt);
  before, every resume failed as AGENT_ERROR and the thread was stuck for good.
* Parallel branches (`Send` workers) each streaming a model answer: one message, or one
  tool call, per branch; before, both shared one message id and one call's arguments.
* State the client echoes back unchanged keeps the checkpoint's typed values (a date
  stayed a date); before, its JSON form replaced them and the next run failed.
* An interrupt inside a subgraph: what the subgraph said is in the snapshots, the final
  GraphQL state and `loadAgentState`; before, it vanished from the chat.
* Two interrupting tools in one `ToolNode`: logged as the hazard it is.
"""

from __future__ import annotations

import datetime
import json
import operator
from collections.abc import AsyncIterator
from typing import Annotated, Any

import httpx
import orjson
import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from langgraph.types import Send, interrupt
from structlog.testing import capture_logs
from typing_extensions import TypedDict

from copilot_runtime import CopilotRuntime
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.testing import MockOpenAIServer, verify_events
from tests.agents_support import graphs
from tests.agents_support.graphs import graph_values
from tests.conftest import ServeRuntime, run_input, types
from tests.gql.wire import (
    CLIENT_DOCUMENT,
    CLIENT_HEADERS,
    chat_data,
    merge,
    parse_multipart,
    text_message,
)

Json = dict[str, Any]
V1 = {"protocolVersion": "1.0"}
LOAD_STATE = """query load($data: LoadAgentStateInput!) {
  loadAgentState(data: $data) { threadId threadExists state messages } }"""


class State(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    a: Any
    b: Any
    due: Any
    topic: str
    log: Annotated[list[str], operator.add]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as http:
        yield http


def two_questions() -> Any:
    """Two parallel nodes, each asking its own question."""
    def ask_a(state: State) -> Json:
        return {"a": interrupt({"which": "a", "when": datetime.date(2024, 1, 2)})}

    def ask_b(state: State) -> Json:
        return {"b": interrupt(["b", 3])}

    graph = StateGraph(State)
    graph.add_node("ask_a", ask_a)
    graph.add_node("ask_b", ask_b)
    graph.add_edge(START, "ask_a")
    graph.add_edge(START, "ask_b")
    graph.add_edge("ask_a", END)
    graph.add_edge("ask_b", END)
    return graph.compile(checkpointer=InMemorySaver())


def fan_out(base_url: str, client: httpx.AsyncClient, prompts: list[str]) -> Any:
    """One `Send` worker per prompt, each calling the model at the same time."""
    llm = graphs.model(base_url, client)

    async def worker(state: State, config: RunnableConfig) -> Json:
        return {"messages": [await llm.ainvoke([HumanMessage(content=state["topic"])],
                                               config)]}

    graph = StateGraph(State)
    graph.add_node("worker", worker)
    graph.add_conditional_edges(START, lambda s: [Send("worker", {"topic": p})
                                                  for p in prompts], ["worker"])
    graph.add_edge("worker", END)
    return graph.compile(checkpointer=InMemorySaver())


def interrupt_of(events: list[Json]) -> list[Json]:
    outcome = events[-1].get("outcome") or {}
    interrupts: list[Json] = outcome.get("interrupts") or []
    return interrupts


def answer(meta: Json, response: str) -> Json:
    """A meta event answered, as the 1.10 client sends it back."""
    return {"name": meta["name"], "value": meta["value"], "response": response}


def gql_states(response: Json) -> list[Json]:
    return [orjson.loads(m["state"]) for m in response["messages"]
            if m["__typename"] == "AgentStateMessageOutput"]


# ---- 1. several interrupts pending at once -----------------------------------------------


async def test_parallel_interrupts_answered_one_at_a_time_by_id(
        serve_runtime: ServeRuntime) -> None:
    graph = two_questions()
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        asked = await served.run(run_input("go", thread="p1", **V1), agent="lg")
        first, second = interrupt_of(asked)
        # The first answer alone: its node runs, the other question is asked again.
        one = await served.run(run_input("", thread="p1", run="r2", messages=[], resume=[
            {"interruptId": first["id"], "status": "resolved", "payload": {"k": 1}}], **V1),
            agent="lg")
        verify_events(one)
        assert types(one)[-1] == "RUN_FINISHED"
        assert [i["id"] for i in interrupt_of(one)] == [second["id"]]
        two = await served.run(run_input("", thread="p1", run="r3", messages=[], resume=[
            {"interruptId": second["id"], "status": "resolved", "payload": 7}], **V1),
            agent="lg")
        verify_events(two)
        assert types(two)[-1] == "RUN_FINISHED"
        assert interrupt_of(two) == []
    done = await graph_values(graph, "p1")
    assert (done["a"], done["b"]) == ({"k": 1}, 7)


async def test_parallel_interrupts_answered_together(serve_runtime: ServeRuntime) -> None:
    graph = two_questions()
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        asked = await served.run(run_input("go", thread="p2", **V1), agent="lg")
        first, second = interrupt_of(asked)
        done = await served.run(run_input("", thread="p2", run="r2", messages=[], resume=[
            {"interruptId": first["id"], "status": "resolved", "payload": "yes"},
            {"interruptId": second["id"], "status": "resolved", "payload": "no"}], **V1),
            agent="lg")
    verify_events(done)
    assert types(done)[-1] == "RUN_FINISHED"
    assert interrupt_of(done) == []
    assert {(await graph_values(graph, "p2"))[k] for k in ("a", "b")} == {"yes", "no"}


async def test_legacy_answer_goes_to_the_question_it_quotes(
        serve_runtime: ServeRuntime) -> None:
    graph = two_questions()
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        asked = await served.run(run_input("go", thread="p3"), agent="lg")
        questions = [e["value"] for e in asked if e.get("name") == "on_interrupt"]
        assert len(questions) == 2
        asking_b = next(q for q in questions if json.loads(q) == ["b", 3])
        # As CopilotKit's useInterrupt sends it: the answer, and the event it answers.
        one = await served.run(run_input("", thread="p3", run="r2", messages=[],
                                         forwardedProps={"command": {
                                             "resume": json.dumps({"ok": "b"}),
                                             "interruptEvent": asking_b}}), agent="lg")
        verify_events(one)
        assert types(one)[-1] == "RUN_FINISHED"
        assert (await graph_values(graph, "p3"))["b"] == {"ok": "b"}
        again = [e["value"] for e in one if e.get("name") == "on_interrupt"]
        assert [json.loads(q)["which"] for q in again] == ["a"]
        # An answer that says nothing of its question, or quotes one nobody asks: refused,
        # and the thread still waits for the right answer.
        vague = await served.run(run_input("", thread="p3-x", run="r1"), agent="lg")
        assert len([e for e in vague if e.get("name") == "on_interrupt"]) == 2
        unsaid = await served.run(run_input("", thread="p3-x", run="r2", messages=[],
                                            forwardedProps={"command": {"resume": "yes"}}),
                                  agent="lg")
        assert (unsaid[-1]["type"], unsaid[-1]["code"]) == ("RUN_ERROR", "INVALID_REQUEST")
        assert "waits on 2 interrupts" in unsaid[-1]["message"]
        stale = await served.run(run_input("", thread="p3", run="r3", messages=[],
                                           forwardedProps={"command": {
                                               "resume": "yes", "interruptEvent": asking_b}}),
                                 agent="lg")
        verify_events(stale)
        # Only one question is left, and this answer quotes the one answered already (a
        # second tab, a stale page): taking it would answer a question its sender never saw.
        assert (stale[-1]["type"], stale[-1]["code"]) == ("RUN_ERROR", "INTERRUPT_NOT_PENDING")
        assert "a" not in await graph_values(graph, "p3")
        # An answer that quotes nothing goes to the one question left, as it always has.
        bare = await served.run(run_input("", thread="p3", run="r4", messages=[],
                                          forwardedProps={"command": {"resume": "yes"}}),
                                agent="lg")
        assert types(bare)[-1] == "RUN_FINISHED"
        assert (await graph_values(graph, "p3"))["a"] == "yes"
        gone = await served.run(run_input("", thread="p3-x", run="r3", messages=[],
                                          forwardedProps={"command": {
                                              "resume": "yes",
                                              "interruptEvent": '{"which": "z"}'}}),
                                agent="lg")
        assert (gone[-1]["type"], gone[-1]["code"]) == ("RUN_ERROR", "INTERRUPT_NOT_PENDING")
    assert "a" not in await graph_values(graph, "p3-x")


@pytest.mark.parametrize("nothing", [{}, "null", " null ", "{}"], ids=repr)
async def test_a_legacy_answer_of_nothing_is_no_answer_however_many_wait(
        serve_runtime: ServeRuntime, nothing: Any) -> None:
    """{}, or `null` or {} as JSON text, is no answer (the approval ledger's rule): the
    questions are asked again. Before, the text was refused while several interrupts
    waited ("must say which one it is for"), and with one left, quoting a question answered
    already ("no longer asks"), where {} was no answer."""
    graph = two_questions()
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        asked = await served.run(run_input("go", thread="p7"), agent="lg")
        questions = [e["value"] for e in asked if e.get("name") == "on_interrupt"]
        both = await served.run(run_input("", thread="p7", run="r2", messages=[],
                                          forwardedProps={"command": {"resume": nothing}}),
                                agent="lg")
        verify_events(both)
        assert types(both)[-1] == "RUN_FINISHED", both[-1]
        assert len([e for e in both if e.get("name") == "on_interrupt"]) == 2
        asking_b = next(q for q in questions if json.loads(q) == ["b", 3])
        await served.run(run_input("", thread="p7", run="r3", messages=[],
                                   forwardedProps={"command": {
                                       "resume": "yes", "interruptEvent": asking_b}}),
                         agent="lg")
        stale = await served.run(run_input("", thread="p7", run="r4", messages=[],
                                           forwardedProps={"command": {
                                               "resume": nothing, "interruptEvent": asking_b}}),
                                 agent="lg")
        verify_events(stale)
        assert types(stale)[-1] == "RUN_FINISHED", stale[-1]
    values = await graph_values(graph, "p7")
    assert (values["b"], "a" in values) == ("yes", False)


async def test_graphql_meta_event_answers_the_question_it_carries(
        serve_runtime: ServeRuntime) -> None:
    graph = two_questions()
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    session = {"agentName": "lg"}
    async with serve_runtime(runtime) as served:
        asked = await served.generate(chat_data([text_message("u1", "user", "go")],
                                             thread="p4", agentSession=session))
        metas = asked["metaEvents"]
        assert [m["name"] for m in metas] == ["LangGraphInterruptEvent"] * 2
        # The 1.10 client answers the question it shows, with the meta event it got.
        shown = metas[-1]
        answered = await served.generate(chat_data([], thread="p4", agentSession=session,
                                                metaEvents=[answer(shown, "first")]))
        assert answered["status"]["code"] == "Success"
        left = answered["metaEvents"]
        assert [m["value"] for m in left] == [metas[0]["value"]]
        done = await served.generate(chat_data([], thread="p4", agentSession=session,
                                            metaEvents=[answer(left[0], "second")]))
        assert done["status"]["code"] == "Success"
        assert done["metaEvents"] == []
    state = await graph_values(graph, "p4")
    shown_b = json.loads(shown["value"]) == ["b", 3]
    assert (state["b"], state["a"]) == (("first", "second") if shown_b else ("second", "first"))


def one_after_another() -> Any:
    """Two questions, the second asked once the first is answered (a review loop's drafts)."""
    def first(state: State) -> Json:
        return {"a": interrupt({"draft": 1})}

    def second(state: State) -> Json:
        return {"b": interrupt({"draft": 2})}

    graph = StateGraph(State)
    graph.add_node("first", first)
    graph.add_node("second", second)
    graph.add_edge(START, "first")
    graph.add_edge("first", "second")
    graph.add_edge("second", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_an_answer_to_a_question_answered_already_is_refused(
        serve_runtime: ServeRuntime) -> None:
    """The 1.10 client shows draft 1's question; someone else answers it (another tab, a
    reviewer over HTTP) and the graph asks about draft 2. The first client's answer still
    quotes draft 1: refused, never taken as the answer to draft 2, which stays asked."""
    graph = one_after_another()
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    session = {"agentName": "lg"}
    async with serve_runtime(runtime) as served:
        asked = await served.generate(chat_data([text_message("u1", "user", "go")],
                                             thread="p5", agentSession=session))
        shown = asked["metaEvents"][0]
        other = await served.generate(chat_data([], thread="p5", agentSession=session,
                                             metaEvents=[answer(shown, "revise it")]))
        assert [json.loads(m["value"]) for m in other["metaEvents"]] == [{"draft": 2}]
        response = await served.session.post(served.url, data=orjson.dumps(
            {"query": CLIENT_DOCUMENT, "variables": {"data": chat_data(
                [], thread="p5", agentSession=session,
                metaEvents=[answer(shown, "approve")])}}), headers=CLIENT_HEADERS)
        stale = merge(parse_multipart(await response.read()))
        status = stale["data"]["generateCopilotResponse"]["status"]
        assert status["code"] == "Failed", status
        assert "no longer asks the question" in json.dumps(status)
        assert "b" not in await graph_values(graph, "p5")
        # Over AG-UI, as CopilotKit's interrupt hooks send it: refused as well.
        legacy = await served.run(run_input("", thread="p5", run="r9", messages=[],
                                            forwardedProps={"command": {
                                                "resume": "approve",
                                                "interruptEvent": shown["value"]}}),
                                  agent="lg")
        assert (legacy[-1]["type"], legacy[-1]["code"]) == ("RUN_ERROR",
                                                           "INTERRUPT_NOT_PENDING")
        kept = await graph_values(graph, "p5")
        assert (kept["a"], "b" in kept) == ("revise it", False)
        # The question that is asked can still be answered.
        done = await served.generate(chat_data([], thread="p5", agentSession=session,
                                            metaEvents=[answer(other["metaEvents"][0],
                                                               "approve")]))
        assert done["status"]["code"] == "Success"
    assert (await graph_values(graph, "p5"))["b"] == "approve"


async def test_a_question_with_a_64_bit_id_is_answered_as_a_browser_quotes_it(
        serve_runtime: ServeRuntime) -> None:
    """The 1.10 client parses the question and quotes it back with `JSON.stringify`: an
    integer beyond 2**53 comes back as the nearest double. Still the question asked (before,
    refused as answered already, and the thread took no answer and no message again)."""
    def ask(state: State) -> Json:
        return {"a": interrupt({"invoice_id": 2**53 + 1, "lines": [-(2**60) - 1, 7]})}

    graph = StateGraph(State)
    graph.add_node("ask", ask)
    graph.add_edge(START, "ask")
    graph.add_edge("ask", END)
    compiled = graph.compile(checkpointer=InMemorySaver())
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=compiled)})
    session = {"agentName": "lg"}
    async with serve_runtime(runtime) as served:
        asked = await served.generate(chat_data([text_message("u1", "user", "go")],
                                             thread="p6", agentSession=session))
        shown = asked["metaEvents"][0]
        assert json.loads(shown["value"])["invoice_id"] == 9007199254740993
        # What JSON.stringify(JSON.parse(value)) gives in a browser.
        quoted = '{"invoice_id":9007199254740992,"lines":[-1152921504606847000,7]}'
        done = await served.generate(chat_data([], thread="p6", agentSession=session,
                                            metaEvents=[{**answer(shown, "approve"),
                                                         "value": quoted}]))
        assert done["status"]["code"] == "Success", done["status"]
        assert (await graph_values(compiled, "p6"))["a"] == "approve"


# ---- 2. parallel branches stream into their own messages ----------------------------------


async def test_parallel_branches_stream_their_own_messages(
        client: httpx.AsyncClient, serve_runtime: ServeRuntime) -> None:
    async with MockOpenAIServer(chunks=4) as llm:
        graph = fan_out(llm.base_url, client, ["slow:20 alpha beta gamma",
                                               "slow:20 one two three"])
        runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
        async with serve_runtime(runtime) as served:
            events = await served.run(run_input("go", thread="b1", **V1), agent="lg")
            gql = await served.generate(chat_data([text_message("u1", "user", "go")],
                                               thread="b1-gql",
                                               agentSession={"agentName": "lg"}))
    verify_events(events)
    starts = [e["messageId"] for e in events if e["type"] == "TEXT_MESSAGE_START"]
    assert len(set(starts)) == 2
    texts = {s: "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT"
                        and e["messageId"] == s) for s in starts}
    assert sorted(texts.values()) == ["echo: slow:20 alpha beta gamma",
                                      "echo: slow:20 one two three"]
    snapshot = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]
    assert {m["id"]: m["content"] for m in snapshot if m["role"] == "assistant"} == texts
    gql_texts = sorted("".join(m["content"]) for m in gql["messages"]
                       if m["__typename"] == "TextMessageOutput")
    assert gql_texts == sorted(texts.values())


async def test_parallel_branches_stream_their_own_tool_calls(
        client: httpx.AsyncClient, serve_runtime: ServeRuntime) -> None:
    async with MockOpenAIServer(chunks=4) as llm:
        graph = fan_out(llm.base_url, client, ['call:toolA {"x": "aaaaaaaaaaaaaaaa"}',
                                               'call:toolB {"y": "bbbbbbbbbbbbbbbbbbbb"}'])
        runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
        async with serve_runtime(runtime) as served:
            events = await served.run(run_input("go", thread="b2", **V1), agent="lg")
            gql = await served.generate(chat_data([text_message("u1", "user", "go")],
                                               thread="b2-gql",
                                               agentSession={"agentName": "lg"}))
    verify_events(events)
    calls = {e["toolCallId"]: e["toolCallName"] for e in events
             if e["type"] == "TOOL_CALL_START"}
    assert sorted(calls.values()) == ["toolA", "toolB"]
    args = {calls[i]: json.loads("".join(e["delta"] for e in events
                                         if e["type"] == "TOOL_CALL_ARGS"
                                         and e["toolCallId"] == i)) for i in calls}
    assert args == {"toolA": {"x": "aaaaaaaaaaaaaaaa"}, "toolB": {"y": "bbbbbbbbbbbbbbbbbbbb"}}
    ends = [e["toolCallId"] for e in events if e["type"] == "TOOL_CALL_END"]
    assert sorted(ends) == sorted(calls)
    gql_args = {m["name"]: json.loads("".join(m["arguments"])) for m in gql["messages"]
                if m["__typename"] == "ActionExecutionMessageOutput"}
    assert gql_args == args


# ---- 4. echoed state keeps the checkpoint's types -----------------------------------------


def dated() -> Any:
    def note(state: State) -> Json:
        if "due" not in state:
            return {"due": datetime.date(2025, 1, 31), "log": ["set"],
                    "messages": [AIMessage(content="set")]}
        return {"log": ["read"],
                "messages": [AIMessage(content=f"due year {state['due'].year}")]}

    graph = StateGraph(State)
    graph.add_node("note", note)
    graph.add_edge(START, "note")
    graph.add_edge("note", END)
    return graph.compile(checkpointer=InMemorySaver())


async def test_echoed_state_keeps_the_checkpoints_typed_values(
        serve_runtime: ServeRuntime) -> None:
    graph = dated()
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        first = await served.run(run_input("one", thread="e1", **V1), agent="lg")
        shown = [e for e in first if e["type"] == "STATE_SNAPSHOT"][-1]["snapshot"]
        assert shown == {"due": "2025-01-31", "log": ["set"]}
        # useCoAgent sends back the state it holds, unchanged.
        second = await served.run(run_input("two", thread="e1", run="r2", state=shown, **V1),
                                  agent="lg")
        verify_events(second)
        assert types(second)[-1] == "RUN_FINISHED"
        said = [e for e in second if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]
        assert said[-1]["content"] == "due year 2025"
        # the client saw the same state as ever, the echoed keys included
        snapshots = [e["snapshot"] for e in second if e["type"] == "STATE_SNAPSHOT"]
        assert snapshots[0]["due"] == "2025-01-31"
        # a value the client changed still reaches the graph
        third = await served.run(run_input("three", thread="e1", run="r3", state={
            **shown, "log": ["set", "read"], "topic": "new"}, **V1), agent="lg")
        assert types(third)[-1] == "RUN_FINISHED"
    saved = await graph_values(graph, "e1")
    assert saved["due"] == datetime.date(2025, 1, 31)
    assert saved["topic"] == "new"
    # the echoed list went through no reducer a second time
    assert saved["log"] == ["set", "read", "read"]


# ---- 6. an interrupt inside a subgraph ----------------------------------------------------


def nested(base_url: str, client: httpx.AsyncClient) -> Any:
    llm = graphs.model(base_url, client)

    async def talk(state: State, config: RunnableConfig) -> Json:
        return {"messages": [await llm.ainvoke(state["messages"], config)]}

    def ask(state: State) -> Json:
        answer = interrupt({"question": "ok?"})
        return {"a": answer, "messages": [AIMessage(content=f"sub got {answer}")]}

    inner = StateGraph(State)
    inner.add_node("talk", talk)
    inner.add_node("ask", ask)
    inner.add_edge(START, "talk")
    inner.add_edge("talk", "ask")
    inner.add_edge("ask", END)
    outer = StateGraph(State)
    outer.add_node("inner", inner.compile())
    outer.add_edge(START, "inner")
    outer.add_edge("inner", END)
    return outer.compile(checkpointer=InMemorySaver())


async def test_a_waiting_subgraphs_messages_stay_in_the_chat(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    graph = nested(llm.base_url, client)
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello sub", thread="s1", **V1), agent="lg")
        gql = await served.generate(chat_data([text_message("s2-u", "user", "hello sub")],
                                           thread="s2", agentSession={"agentName": "lg"}))
        loaded = await (await served.session.post(served.url, data=orjson.dumps(
            {"query": LOAD_STATE, "variables": {"data": {"threadId": "s2",
                                                         "agentName": "lg"}}}),
            headers=CLIENT_HEADERS)).json()
        # a page reload while the question waits
        connected = await served.run(run_input("", thread="s1", run="c1", messages=[], **V1),
                                     path="/agent/lg/connect")
        resumed = await served.run(run_input("", thread="s1", run="r2", messages=[], resume=[
            {"interruptId": interrupt_of(events)[0]["id"], "status": "resolved",
             "payload": "fine"}], **V1), agent="lg")
    verify_events(events)
    assert interrupt_of(events)
    snapshot = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]
    assert [m.get("content") for m in snapshot] == ["hello sub", "echo: hello sub"]
    final = gql_states(gql)[-1]
    assert [m.get("content") for m in final["messages"]] == ["hello sub", "echo: hello sub"]
    reloaded = [e for e in connected if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]
    assert [m.get("content") for m in reloaded] == ["hello sub", "echo: hello sub"]
    history = json.loads(loaded["data"]["loadAgentState"]["messages"])
    assert [m.get("content") for m in history] == ["hello sub", "echo: hello sub"]
    verify_events(resumed)
    after = [e for e in resumed if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]
    assert [m.get("content") for m in after] == ["hello sub", "echo: hello sub",
                                                 "sub got fine"]


# ---- 3. two interrupting tools in one ToolNode --------------------------------------------


@tool
def send_email(to: str) -> str:
    """Send an email (asks a human first)."""
    return f"sent to {to}: {interrupt({'action': 'send_email', 'to': to})}"


@tool
def book(what: str) -> str:
    """Book something (asks a human first)."""
    return f"booked {what}: {interrupt({'action': 'book', 'what': what})}"


async def test_interrupting_tools_sharing_a_toolnode_are_logged(
        llm: MockOpenAIServer, client: httpx.AsyncClient,
        serve_runtime: ServeRuntime) -> None:
    model = graphs.model(llm.base_url, client).bind_tools([send_email, book])

    async def chat(state: State, config: RunnableConfig) -> Json:
        return {"messages": [await model.ainvoke(state["messages"], config)]}

    builder = StateGraph(State)
    builder.add_node("chat", chat)
    builder.add_node("tools", ToolNode([send_email, book]))
    builder.add_edge(START, "chat")
    builder.add_edge("chat", "tools")
    builder.add_edge("tools", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    prompt = 'call:send_email {"to": "a@b.c"}\ncall:book {"what": "room"}'
    async with serve_runtime(runtime) as served:
        with capture_logs() as logs:
            events = await served.run(run_input(prompt, thread="t1", **V1), agent="lg")
    assert len(interrupt_of(events)) == 1  # LangGraph reports one of them at a time
    (warning,) = [e for e in logs if "runs several tool calls at once" in e["event"]]
    assert (warning["log_level"], warning["task"], warning["tool_calls"]) == (
        "warning", "tools", 2)
