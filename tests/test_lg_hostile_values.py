"""In-process LangGraph threads a client's state or a graph's interrupt used to break for good.

- A client `state` (or a `forwardedProps` entry merged as input, or GraphQL `agentStates`)
  that a pydantic state schema refuses was written into the checkpoint before LangGraph
  validated it: that run and every later one failed (AGENT_ERROR), `loadAgentState` and
  `GET /approvals?threadId=` answered 500. It is refused before the run now
  (INVALID_REQUEST, naming the key); a thread already holding such a value is readable,
  and its runs say what is wrong.
- An interrupt whose `message`, `reason`, `toolCallId`, `responseSchema` or `expiresAt` is
  not of the type AG-UI's Interrupt gives it failed its run (AGENT_ERROR) while the graph
  waited on it: the thread was stuck. Such fields stay in the raw value now. An
  `expiresAt` of 1e308 reached the ledger and made `GET /approvals` answer 500 for every
  thread.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

import orjson
import pydantic
import pytest
from langchain_core.messages import AIMessage, AnyMessage, RemoveMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import interrupt
from typing_extensions import TypedDict

from copilot_runtime import CopilotRuntime
from copilot_runtime._time import parse_time
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.testing import verify_events
from tests.conftest import Served, ServeRuntime, run_input, types
from tests.gql.wire import CLIENT_HEADERS, chat_data, text_message

pytestmark = pytest.mark.timeout(60)

Json = dict[str, Any]
V1 = {"protocolVersion": "1.0"}
SESSION = {"agentName": "lg"}
LOAD = ("query load($data: LoadAgentStateInput!) { loadAgentState(data: $data) "
        "{ threadId threadExists state messages } }")


class Counted(pydantic.BaseModel):
    messages: Annotated[list[AnyMessage], add_messages] = []
    count: int = 0
    tags: list[str] = []


class CountedDict(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    count: int


def counter(state: Any) -> Json:
    count = state.count if isinstance(state, pydantic.BaseModel) else state.get("count", 0)
    return {"count": count + 1, "messages": [AIMessage(f"count={count}")]}


def compiled(schema: type[Any]) -> Any:
    builder = StateGraph(schema)
    builder.add_node("count", counter)
    builder.add_edge(START, "count")
    builder.add_edge("count", END)
    return builder.compile(checkpointer=InMemorySaver())


def runtime_of(graph: Any) -> CopilotRuntime:
    return CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})


def ending(events: list[Json]) -> tuple[str, str | None]:
    verify_events(events)
    return events[-1]["type"], events[-1].get("code")


async def load(served: Served, thread: str) -> Json:
    response = await served.session.post(served.url, data=orjson.dumps({
        "query": LOAD, "variables": {"data": {"threadId": thread, "agentName": "lg"}}}),
        headers=CLIENT_HEADERS)
    assert response.status == 200
    answer: Json = await response.json()
    return answer


# ---- the client's state against a pydantic state schema ------------------------------------


async def test_a_state_the_schema_refuses_is_refused_before_the_run(
        serve_runtime: ServeRuntime) -> None:
    graph = compiled(Counted)
    async with serve_runtime(runtime_of(graph)) as served:
        first = await served.run(run_input("hi", thread="t"), agent="lg")
        bad = await served.run(run_input("hi", thread="t", run="r2",
                                         state={"count": "abc"}), agent="lg")
        forwarded = await served.run(run_input("hi", thread="t", run="r3",
                                               forwardedProps={"tags": "not a list"}),
                                     agent="lg")
        after = await served.run(run_input("hi", thread="t", run="r4"), agent="lg")
        coerced = await served.run(run_input("hi", thread="t", run="r5",
                                             state={"count": "7"}), agent="lg")
        listed = await served.session.get(served.url + "/approvals?threadId=t")
        loaded = await load(served, "t")
        gql = await served.generate(chat_data(
            [text_message("u1", "user", "hi")], thread="g", agentSession=SESSION,
            agentStates=[{"agentName": "lg", "state": orjson.dumps({"count": "abc"}).decode(),
                          "config": "{}"}]))
        gql_after = await served.generate(chat_data(
            [text_message("u2", "user", "again")], thread="g", agentSession=SESSION))
    assert ending(first) == ("RUN_FINISHED", None)
    assert ending(bad) == ("RUN_ERROR", "INVALID_REQUEST")
    assert "state.count" in bad[-1]["message"]
    assert "abc" not in bad[-1]["message"]
    assert ending(forwarded) == ("RUN_ERROR", "INVALID_REQUEST")
    assert "forwardedProps.tags" in forwarded[-1]["message"]
    # The thread is as the refused runs found it.
    assert ending(after) == ("RUN_FINISHED", None)
    assert "count=1" in orjson.dumps(after).decode()
    assert ending(coerced) == ("RUN_FINISHED", None)  # (what pydantic takes is taken)
    assert "count=7" in orjson.dumps(coerced).decode()
    assert listed.status == 200
    assert orjson.loads(loaded["data"]["loadAgentState"]["state"])["count"] == 8
    assert gql["status"]["code"] == "Failed"
    assert gql["status"]["details"]["originalError"]["originalErrorType"] == "INVALID_REQUEST"
    assert gql_after["status"]["code"] == "Success", gql_after["status"]


async def test_a_typeddict_schema_is_not_validated(serve_runtime: ServeRuntime) -> None:
    """LangGraph does not validate a TypedDict state: neither does the runtime."""
    async with serve_runtime(runtime_of(compiled(CountedDict))) as served:
        events = await served.run(run_input("hi", thread="t", state={"count": 2}),
                                  agent="lg")
    assert ending(events) == ("RUN_FINISHED", None)


class Reshaped(pydantic.BaseModel):
    messages: Annotated[list[AnyMessage], add_messages] = []
    count: int = 0
    tags: list[str] = []

    @pydantic.field_validator("tags", mode="before")
    @classmethod
    def split(cls, value: Any) -> Any:
        return value.split(",") if isinstance(value, str) else value


async def test_a_value_the_schemas_validators_reshape_is_the_graphs_to_judge(
        serve_runtime: ServeRuntime) -> None:
    """The check read only a field's type: "a,b" for `list[str]` was refused though the
    model's own validator makes it a list, and the graph takes it."""
    async with serve_runtime(runtime_of(compiled(Reshaped))) as served:
        events = await served.run(run_input("hi", thread="t", state={"tags": "a,b"}),
                                  agent="lg")
        refused = await served.run(run_input("hi", thread="t", run="r2",
                                             state={"count": "abc"}), agent="lg")
    assert ending(events) == ("RUN_FINISHED", None)
    assert ending(refused) == ("RUN_ERROR", "INVALID_REQUEST")  # other fields still checked


async def test_a_thread_already_holding_a_refused_value_is_readable(
        serve_runtime: ServeRuntime) -> None:
    """A thread poisoned before the check (by another process, or an older release)."""
    graph = compiled(Counted)
    config = {"configurable": {"thread_id": "t"}}
    with pytest.raises(pydantic.ValidationError):
        await graph.ainvoke({"count": "abc"}, config)
    async with serve_runtime(runtime_of(graph)) as served:
        loaded = await load(served, "t")
        listed = await served.session.get(served.url + "/approvals?threadId=t")
        run = await served.run(run_input("hi", thread="t", run="r2"), agent="lg")
    state = loaded["data"]["loadAgentState"]
    assert state["threadExists"] is True
    assert orjson.loads(state["state"])["count"] == "abc"
    assert listed.status == 200
    assert ending(run) == ("RUN_ERROR", "AGENT_EXECUTION_ERROR")
    assert "count" in run[-1]["message"]
    assert "abc" not in run[-1]["message"]


# ---- interrupts' lifted fields -----------------------------------------------------------


class Asked(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    answer: Any


def asks(value: Any) -> Any:
    def ask(state: Asked) -> Json:
        answer = interrupt(value)
        return {"answer": answer, "messages": [AIMessage(f"got {answer}")]}

    builder = StateGraph(Asked)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=InMemorySaver())


ODD_FIELDS = pytest.mark.parametrize("value", [
    {"message": {"text": "Approve the refund?", "amount": 12}},
    {"message": 42},
    {"reason": 3, "question": "ok?"},
    {"toolCallId": 7},
    {"responseSchema": ["yes", "no"]},
    {"question": "ok?", "expiresAt": True},
    {"question": "ok?", "expiresAt": 1e308},
], ids=["message-object", "message-number", "reason-number", "tool-call-id-number",
        "schema-list", "expires-bool", "expires-huge"])


@ODD_FIELDS
async def test_an_interrupt_with_odd_fields_reaches_the_client(
        serve_runtime: ServeRuntime, value: Json) -> None:
    async with serve_runtime(runtime_of(asks(value))) as served:
        asked = await served.run(run_input("go", thread="t", **V1), agent="lg")
        listed = await served.session.get(served.url + "/approvals")
        listed_body = await listed.json()
        outcome = asked[-1].get("outcome") or {}
        (pending,) = outcome.get("interrupts") or [None]
        body = run_input("", thread="t", run="r2", messages=[], resume=[
            {"interruptId": pending["id"], "status": "resolved", "payload": "yes"}], **V1)
        resumed = await served.run(body, agent="lg")
    assert ending(asked) == ("RUN_FINISHED", None)
    assert pending["metadata"]["langgraph"]["raw"] == value
    for key, lifted in (("message", "message"), ("reason", "reason"),
                        ("toolCallId", "toolCallId"), ("responseSchema", "responseSchema"),
                        ("expiresAt", "expiresAt")):
        if key in value:
            assert lifted not in pending or pending[lifted] != value[key], pending
    assert listed.status == 200, listed_body
    (approval,) = listed_body["approvals"]
    assert approval["expiresAt"] is None
    assert types(resumed)[-1] == "RUN_FINISHED", resumed[-1]


async def test_an_interrupts_deadline_in_epoch_seconds_is_kept(
        serve_runtime: ServeRuntime) -> None:
    deadline = time.time() + 3600
    async with serve_runtime(runtime_of(asks({"question": "ok?", "expiresAt": deadline}))
                             ) as served:
        asked = await served.run(run_input("go", thread="t", **V1), agent="lg")
        listed = await (await served.session.get(served.url + "/approvals")).json()
    assert ending(asked) == ("RUN_FINISHED", None)
    (pending,) = asked[-1]["outcome"]["interrupts"]
    assert parse_time(pending["expiresAt"]) == pytest.approx(deadline, abs=0.001)
    (approval,) = listed["approvals"]
    assert parse_time(approval["expiresAt"]) == pytest.approx(deadline, abs=0.001)


@pytest.mark.parametrize("value", [1e308, -1e308, math.inf, -math.inf, math.nan, 10**20,
                                   "9999-12-31T23:00:00-05:00", "0001-01-01T00:00:00+05:00"])
def test_parse_time_refuses_times_no_clock_reaches(value: float | str) -> None:
    """(ISO text too: year 9999 west of UTC is year 10000 in UTC, which `iso_time`, and
    every listing of an approval holding it, failed on)"""
    assert parse_time(value) is None


def test_parse_time_takes_epoch_seconds_and_iso_text() -> None:
    assert parse_time(0) == 0.0
    assert parse_time("1970-01-01T00:00:01Z") == 1.0
    assert parse_time(True) is None


# ---- a graph that trims its history, then asks ---------------------------------------------


def trims_then_asks() -> Any:
    """Keeps only the last message (as summarising graphs do), then asks to approve."""
    def trim(state: Asked) -> Json:
        return {"messages": [RemoveMessage(id=m.id) for m in state["messages"][:-1]
                             if m.id is not None]}

    def act(state: Asked) -> Json:
        last = state["messages"][-1].content
        if "approve" in str(last):
            answer = interrupt({"question": f"Really {last}?"})
            return {"answer": answer, "messages": [AIMessage(f"done: {answer}", id="ai-done")]}
        return {"messages": [AIMessage(f"echo {last}", id="ai-echo")]}

    builder = StateGraph(Asked)
    builder.add_node("trim", trim)
    builder.add_node("act", act)
    builder.add_edge(START, "trim")
    builder.add_edge("trim", "act")
    builder.add_edge("act", END)
    return builder.compile(checkpointer=InMemorySaver())


async def test_an_answer_sent_with_a_history_the_graph_trimmed_is_taken(
        serve_runtime: ServeRuntime) -> None:
    """Before: the user messages the graph removed read as new ones sent with the answer,
    which was refused (APPROVAL_ERROR) however often it was sent with the chat, as the 1.10
    client always sends it. Only messages after the last one the graph knows are new."""
    held = [{"id": "u1", "role": "user", "content": "hello"}]
    async with serve_runtime(runtime_of(trims_then_asks())) as served:
        first = await served.run(run_input("", thread="t", messages=held, **V1), agent="lg")
        held += [{"id": "ai-echo", "role": "assistant", "content": "echo hello"},
                 {"id": "u2", "role": "user", "content": "approve the payment"}]
        asked = await served.run(run_input("", thread="t", run="r2", messages=held, **V1),
                                 agent="lg")
        (pending,) = asked[-1]["outcome"]["interrupts"]
        answer = [{"interruptId": pending["id"], "status": "resolved", "payload": "yes"}]
        # A message the graph never saw, sent with the answer, is still refused.
        more = [*held, {"id": "u3", "role": "user", "content": "and more"}]
        refused = await served.run(run_input("", thread="t", run="r3", messages=more,
                                             resume=answer, **V1), agent="lg")
        answered = await served.run(run_input("", thread="t", run="r4", messages=held,
                                              resume=answer, **V1), agent="lg")
        chat = [text_message("gu1", "user", "hello")]
        await served.generate(chat_data(chat, thread="g", agentSession=SESSION))
        chat.append(text_message("gu2", "user", "approve the payment"))
        gql_asked = await served.generate(chat_data(chat, thread="g", agentSession=SESSION))
        (meta,) = gql_asked["metaEvents"]
        reply = {"name": meta["name"], "value": meta["value"], "response": "yes"}
        gql_answered = await served.generate(chat_data(chat, thread="g", agentSession=SESSION,
                                                       metaEvents=[reply]))
    assert ending(first) == ("RUN_FINISHED", None)
    assert ending(refused) == ("RUN_ERROR", "APPROVAL_ERROR")
    assert ending(answered) == ("RUN_FINISHED", None)
    assert "done: yes" in orjson.dumps(answered).decode()
    assert gql_answered["status"]["code"] == "Success", gql_answered["status"]
    assert "done: yes" in orjson.dumps(gql_answered).decode()
