"""In-process LangGraph graphs whose values JSON cannot carry as they are.

- Every key named "config" or "runtime", at any depth of a graph's state, was left out of the
  client's STATE_SNAPSHOT and of the thread's stored state (ag-ui-langgraph's
  `make_json_safe`, written for tool-call payloads, drops them); the client sending its
  state back, as `useCoAgent` does, then deleted them from the graph's checkpoint too.
- An int key made the whole snapshot unencodable (dropped, the thread's state null), a
  tuple key failed the run (AGENT_ERROR); dates, bytes and decimals went out as their
  Python `repr`; a NaN that stayed NaN sent an empty STATE_DELTA (NaN never equals itself).
- An interrupt whose value has a tuple key failed its run and every later run of the
  thread, and no approval was recorded to answer it.
- A `ChatMessage` with a role of its own in the checkpoint failed its run and every later
  run of the thread.
- A state schema pydantic cannot describe (a `typing.TypedDict` before Python 3.12, a field
  of an arbitrary class) failed every run of the graph, which LangGraph itself runs fine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import decimal
import enum
import math
import typing
import uuid
from collections.abc import Callable
from typing import Annotated, Any

import jsonpatch
import pydantic
import pytest
import typing_extensions
from langchain_core.messages import AIMessage, AnyMessage, ChatMessage, FunctionMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import interrupt

from copilot_runtime import CopilotRuntime
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.testing import verify_events
from copilot_runtime.workflows.review_loop import ReviewLoop
from copilot_runtime.workflows.specialists import SpecialistRequest
from tests.conftest import Served, ServeRuntime, run_input, text_of, types
from tests.gql.wire import chat_data, text_message

pytestmark = pytest.mark.timeout(60)

Json = dict[str, Any]
Node = Callable[[Any], dict[str, Any]]
V1 = {"protocolVersion": "1.0"}


class Values(typing_extensions.TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    settings: Any
    runtime: Any
    values: Any
    score: float
    step: int
    answer: Any


class PlainTypedDictState(typing.TypedDict, total=False):
    """`typing.TypedDict`: pydantic refuses it before Python 3.12 (LangGraph does not)."""
    messages: Annotated[list[AnyMessage], add_messages]
    note: str


class Handle:
    """An arbitrary class (a client, a DataFrame): pydantic has no schema for it."""


class ArbitraryFieldState(typing_extensions.TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    note: str
    handle: Handle


def graph_of(state: type[Any], *nodes: Node, saver: InMemorySaver | None = None) -> Any:
    """`nodes` one after the other, checkpointed in memory."""
    builder = StateGraph(state)
    previous = START
    for index, node in enumerate(nodes):
        builder.add_node(f"n{index}", node)  # type: ignore[call-overload]  # (any state)
        builder.add_edge(previous, f"n{index}")
        previous = f"n{index}"
    builder.add_edge(previous, END)
    return builder.compile(checkpointer=saver or InMemorySaver())


def lg_runtime(graph: Any) -> CopilotRuntime:
    return CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})


def of_type(events: list[Json], kind: str) -> list[Json]:
    return [e for e in events if e["type"] == kind]


def finished(events: list[Json]) -> None:
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED", events[-1]


def client_state(events: list[Json]) -> Any:
    """The state a client holds after `events`: the snapshots, each delta applied."""
    state: Any = {}
    for event in events:
        if event["type"] == "STATE_SNAPSHOT":
            state = event["snapshot"]
        elif event["type"] == "STATE_DELTA":
            state = jsonpatch.apply_patch(state, event["delta"])
    return state


async def get_json(served: Served, path: str) -> Any:
    response = await served.session.get(served.url + path)
    assert response.status == 200, (path, await response.text())
    return await response.json()


async def connect(served: Served, thread: str) -> list[Json]:
    body = run_input("", thread=thread, run="connect")
    body["messages"] = []
    return await served.run(body, agent="lg", path="/agent/lg/connect")


async def graph_values(graph: Any, thread: str) -> Json:
    snapshot = await graph.aget_state({"configurable": {"thread_id": thread}})
    values: Json = snapshot.values
    return values


# ---- state values ----------------------------------------------------------------------------


SETTINGS = {"model": {"config": {"temperature": 0.2}, "name": "m"}, "mode": "fast"}


async def test_config_and_runtime_keys_survive_the_clients_round_trip(
        serve_runtime: ServeRuntime) -> None:
    """Before: the client was shown `{"settings": {"model": {"name": "m"}, ...}}` without
    "runtime", `/threads/{id}/state` said the same, and the state the client sent back
    replaced the graph's settings by the cut ones: the model's config was gone for good."""
    seen: list[Any] = []

    def node(state: Values) -> dict[str, Any]:
        seen.append(state.get("settings"))
        step = state.get("step", 0) + 1
        out: dict[str, Any] = {"step": step, "messages": [AIMessage(f"run {step}")]}
        if step == 1:
            out |= {"settings": SETTINGS, "runtime": {"python": "3.11"}}
        return out

    graph = graph_of(Values, node)
    thread = "t-config"
    async with serve_runtime(lg_runtime(graph)) as served:
        first = await served.run(run_input("one", thread=thread), agent="lg")
        stored = await get_json(served, f"/threads/{thread}/state")
        shown = client_state(first)
        second = await served.run(run_input("two", thread=thread, run="r2", state=shown),
                                  agent="lg")
    finished(first)
    finished(second)
    expected = {"settings": SETTINGS, "runtime": {"python": "3.11"}, "step": 1}
    assert of_type(first, "STATE_SNAPSHOT")[0]["snapshot"] == expected
    assert shown == expected
    assert stored["state"] == expected
    # the state sent back reached the graph whole, and is what its checkpoint holds
    assert seen == [None, SETTINGS]
    values = await graph_values(graph, thread)
    assert (values["settings"], values["runtime"], values["step"]) == (
        SETTINGS, {"python": "3.11"}, 2)
    assert client_state(first + second) == {**expected, "step": 2}


ODD_VALUES = {
    "byInt": {1: "gold", 2: "silver"},
    "byTuple": {(0, 0): "X"},
    "big": 2 ** 70,
    "due": datetime.datetime(2024, 5, 1, 12, 0, tzinfo=datetime.UTC),
    "blob": b"\x01\x02",
    "price": decimal.Decimal("1.10"),
    "nan": math.nan,
}
ODD_AS_SENT = {
    "byInt": {"1": "gold", "2": "silver"},
    "byTuple": {"(0, 0)": "X"},
    "big": "1180591620717411303424",
    "due": "2024-05-01T12:00:00+00:00",
    "blob": "AQI=",
    "price": "1.10",
    "nan": None,
}


async def test_odd_state_values_reach_the_client_in_their_documented_forms(
        serve_runtime: ServeRuntime) -> None:
    """Before: the int key made the snapshot unencodable, so it was dropped (the client saw no
    state, `/threads/{id}/state` was null), the tuple key failed the run with AGENT_ERROR,
    and dates, bytes and decimals were their Python `repr`."""
    def node(state: Values) -> dict[str, Any]:
        return {"values": ODD_VALUES, "step": 1, "messages": [AIMessage("done", id="ai-1")]}

    # (msgpack has no int past 64 bits: such a graph's checkpoints need pickle's help)
    saver = InMemorySaver(serde=JsonPlusSerializer(pickle_fallback=True))
    thread = "t-odd"
    async with serve_runtime(lg_runtime(graph_of(Values, node, saver=saver))) as served:
        events = await served.run(run_input("go", thread=thread), agent="lg")
        stored = await get_json(served, f"/threads/{thread}/state")
        again = await served.run(run_input("again", thread=thread, run="r2"), agent="lg")
    finished(events)
    finished(again)
    snapshots = of_type(events, "STATE_SNAPSHOT")
    assert snapshots, types(events)
    assert snapshots[0]["snapshot"] == {"values": ODD_AS_SENT, "step": 1}
    assert stored["state"] == client_state(events) == {"values": ODD_AS_SENT, "step": 1}


async def test_a_nan_that_stays_nan_sends_no_empty_delta(serve_runtime: ServeRuntime) -> None:
    """Before: NaN went to the client as null, but compared with itself it had always
    changed, so each later state sent a STATE_DELTA whose patch was empty."""
    def first(state: Values) -> dict[str, Any]:
        return {"score": math.nan, "step": 1}

    def second(state: Values) -> dict[str, Any]:
        assert math.isnan(state["score"])
        return {"step": 2, "messages": [AIMessage("scored", id="ai-1")]}

    async with serve_runtime(lg_runtime(graph_of(Values, first, second))) as served:
        events = await served.run(run_input("go", thread="t-nan"), agent="lg")
    finished(events)
    states = [e for e in events if e["type"] in ("STATE_SNAPSHOT", "STATE_DELTA")]
    assert states, types(events)
    assert [e for e in states if e.get("delta") == []] == []
    assert of_type(events, "STATE_SNAPSHOT")[0]["snapshot"] == {"score": None, "step": 1}
    assert client_state(events) == {"score": None, "step": 2}


# ---- interrupts ------------------------------------------------------------------------------


async def test_an_interrupt_with_a_tuple_key_is_recorded_and_resumed(
        serve_runtime: ServeRuntime) -> None:
    """Before: encoding the interrupt failed its run (AGENT_ERROR) and, re-emitted at the
    start of each run, every later run of the thread; `/approvals` stayed empty, so there was
    nothing to answer."""
    def ask(state: Values) -> dict[str, Any]:
        if state.get("answer") is not None:
            return {"messages": [AIMessage("already answered", id="ai-again")]}
        answer = interrupt({"question": "Place the X?", "grid": {("a", 1): "x"}})
        return {"answer": answer, "messages": [AIMessage(f"resumed with {answer}", id="ai-1")]}

    thread = "t-ask"
    async with serve_runtime(lg_runtime(graph_of(Values, ask))) as served:
        asked = await served.run(run_input("go", thread=thread, **V1), agent="lg")
        listed = await get_json(served, f"/approvals?threadId={thread}")
        verify_events(asked)
        outcome = asked[-1].get("outcome") or {}
        assert outcome.get("type") == "interrupt", asked[-1]
        (pending,) = outcome["interrupts"]
        body = run_input("", thread=thread, run="r2", resume=[
            {"interruptId": pending["id"], "status": "resolved", "payload": "yes"}], **V1)
        body["messages"] = []
        resumed = await served.run(body, agent="lg")
        after = await get_json(served, f"/approvals?threadId={thread}&status=answered")
        following = await served.run(run_input("more", thread=thread, run="r3", **V1),
                                     agent="lg")
    value = {"question": "Place the X?", "grid": {"('a', 1)": "x"}}
    (approval,) = listed["approvals"]
    assert (approval["id"], approval["status"], approval["value"]) == (
        pending["id"], "pending", value)
    finished(resumed)
    assert "outcome" not in resumed[-1] or resumed[-1]["outcome"]["type"] == "success"
    (snapshot,) = of_type(resumed, "MESSAGES_SNAPSHOT")
    assert "resumed with yes" in [m.get("content") for m in snapshot["messages"]]
    assert [a["id"] for a in after["approvals"]] == [pending["id"]]
    finished(following)
    assert "outcome" not in following[-1] or following[-1]["outcome"]["type"] == "success"
    (snapshot,) = of_type(following, "MESSAGES_SNAPSHOT")
    assert snapshot["messages"][-1]["content"] == "already answered"


# ---- messages --------------------------------------------------------------------------------


async def test_chat_messages_with_their_own_roles_do_not_break_the_thread(
        serve_runtime: ServeRuntime) -> None:
    """Before: ag-ui-langgraph's converter refused `ChatMessage` ("Unsupported message
    type"): the run that wrote one ended with AGENT_ERROR, and so did every later run of its
    thread, whose checkpoint still held it."""
    def wizard(state: Values) -> dict[str, Any]:
        if any(m.id == "w1" for m in state["messages"]):
            return {"messages": [AIMessage("welcome back", id="ai-back")]}
        return {"messages": [ChatMessage(role="wizard", content="abracadabra", id="w1")]}

    def user(state: Values) -> dict[str, Any]:
        if any(m.id == "u1" for m in state["messages"]):
            return {}
        return {"messages": [ChatMessage(role="user", content="said for the user", id="u1")]}

    thread = "t-roles"
    async with serve_runtime(lg_runtime(graph_of(Values, wizard, user))) as served:
        first = await served.run(run_input("hi", thread=thread), agent="lg")
        second = await served.run(run_input("again", thread=thread, run="r2"), agent="lg")
        replay = await connect(served, thread)
        stored = await get_json(served, f"/threads/{thread}/messages")
    finished(first)
    finished(second)
    roles = {"w1": ("assistant", "abracadabra"), "u1": ("user", "said for the user")}
    for events in (first, second):
        (snapshot,) = of_type(events, "MESSAGES_SNAPSHOT")
        by_id = {m["id"]: (m["role"], m.get("content")) for m in snapshot["messages"]}
        assert {k: by_id.get(k) for k in roles} == roles, snapshot["messages"]
    (snapshot,) = of_type(second, "MESSAGES_SNAPSHOT")
    assert snapshot["messages"][-1]["content"] == "welcome back"
    verify_events(replay)
    assert "RUN_ERROR" not in types(replay)
    assert types(replay).count("RUN_FINISHED") == 2
    assert of_type(replay, "MESSAGES_SNAPSHOT")[-1]["messages"] == snapshot["messages"]
    assert {"w1", "u1"} <= {m["id"] for m in stored["messages"]}


# ---- state schemas ---------------------------------------------------------------------------


UNDESCRIBABLE = pytest.mark.parametrize(
    "state", [PlainTypedDictState, ArbitraryFieldState],
    ids=["typing-TypedDict", "arbitrary-class-field"])


@UNDESCRIBABLE
async def test_a_state_schema_pydantic_cannot_describe_still_runs(
        state: type[Any], serve_runtime: ServeRuntime) -> None:
    """Before: the bridge asked pydantic for the graph's JSON schema and caught none of its
    errors (they are RuntimeErrors): every run ended with AGENT_ERROR before the graph ran.
    The schema's keys now come from the graph's channels."""
    def node(values: Any) -> dict[str, Any]:
        heard = values["messages"][-1].content
        return {"note": f"heard {heard}", "messages": [AIMessage(f"echo: {heard}")]}

    async with serve_runtime(lg_runtime(graph_of(state, node))) as served:
        first = await served.run(run_input("hi", thread="t-schema"), agent="lg")
        second = await served.run(run_input("again", thread="t-schema", run="r2"),
                                  agent="lg")
    for events, said in ((first, "hi"), (second, "again")):
        finished(events)
        (snapshot,) = of_type(events, "MESSAGES_SNAPSHOT")
        assert snapshot["messages"][-1]["content"] == f"echo: {said}"
        assert client_state(events) == {"note": f"heard {said}"}


@UNDESCRIBABLE
async def test_the_clients_state_reaches_a_graph_pydantic_cannot_describe(
        state: type[Any], serve_runtime: ServeRuntime) -> None:
    """Before: no run of such a graph got as far as the graph (AGENT_ERROR). The state a
    client sends (`useCoAgent`) must reach it as it does a graph pydantic can describe."""
    seen: list[Any] = []

    def node(values: Any) -> dict[str, Any]:
        seen.append(values.get("note"))
        return {"messages": [AIMessage("noted")]}

    graph = graph_of(state, node)
    async with serve_runtime(lg_runtime(graph)) as served:
        events = await served.run(run_input("hi", thread="t-note",
                                            state={"note": "from the client"}), agent="lg")
    finished(events)
    assert seen == ["from the client"]
    assert (await graph_values(graph, "t-note"))["note"] == "from the client"


# ---- json_safe and known_messages ------------------------------------------------------------


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Point:
    x: int
    when: datetime.date


class Model(pydantic.BaseModel):
    name: str
    size: int


class Plain:
    def __init__(self) -> None:
        self.shown = 1
        self._hidden = 2


def test_json_safe_keeps_every_key_and_converts_every_kind() -> None:
    from copilot_runtime.agents._lg_values import json_safe  # (new with the fix)

    cycle: list[Any] = ["head"]
    cycle.append(cycle)
    value = {
        "config": {"runtime": 1, "nested": {"config": True}},
        "keys": {1: "int", (1, "a"): "tuple", None: "none", 1.5: "float", Colour.RED: "enum"},
        "bools": {True: "yes", False: "no"},
        "ints": [2 ** 63 - 1, 2 ** 64 - 1, 2 ** 64, -(2 ** 63), -(2 ** 63) - 1, 2 ** 70],
        "dates": [datetime.datetime(2024, 5, 1, 12, 0, 30, 5, tzinfo=datetime.UTC),
                  datetime.date(2024, 5, 1), datetime.time(12, 30)],
        "bytes": [b"\x00\xff", bytearray(b"ab"), memoryview(b"c")],
        "decimal": decimal.Decimal("1.10"),
        "uuid": uuid.UUID(int=1),
        "floats": [math.nan, math.inf, -math.inf, 0.5],
        "enum": Colour.RED,
        "set": {3},
        "tuple": (1, 2),
        "dataclass": Point(1, datetime.date(2024, 1, 2)),
        "model": Model(name="m", size=2),
        "object": Plain(),
        "cycle": cycle,
    }
    assert json_safe(value) == {
        "config": {"runtime": 1, "nested": {"config": True}},
        "keys": {"1": "int", "(1, 'a')": "tuple", "null": "none", "1.5": "float",
                 "red": "enum"},
        "bools": {"true": "yes", "false": "no"},
        "ints": [2 ** 63 - 1, 2 ** 64 - 1, "18446744073709551616", -(2 ** 63),
                 "-9223372036854775809", "1180591620717411303424"],
        "dates": ["2024-05-01T12:00:30.000005+00:00", "2024-05-01", "12:30:00"],
        "bytes": ["AP8=", "YWI=", "Yw=="],
        "decimal": "1.10",
        "uuid": "00000000-0000-0000-0000-000000000001",
        "floats": [None, None, None, 0.5],
        "enum": "red",
        "set": [3],
        "tuple": [1, 2],
        "dataclass": {"x": 1, "when": "2024-01-02"},
        "model": {"name": "m", "size": 2},
        "object": {"shown": 1},
        "cycle": ["head", "<recursive>"],
    }
    # plain JSON, and what JSON has no key for, both come back as a copy
    for keys in ({"a": 1}, {1: "a"}):
        original: dict[str, Any] = {"state": {"items": [{"n": 1}], **keys}}
        safe = json_safe(original)
        before = repr(safe)
        original["state"]["items"].append({"n": 2})
        original["state"]["items"][0]["n"] = 99
        original["state"]["added"] = True
        assert repr(safe) == before
    # the values the wire already carries are unchanged
    assert json_safe({"s": "x", "n": None, "b": False, "f": 1.5, "l": [1]}) == {
        "s": "x", "n": None, "b": False, "f": 1.5, "l": [1]}


def test_known_messages_maps_what_the_converter_does_not_know() -> None:
    from copilot_runtime.agents._lg_values import known_messages  # (new with the fix)

    known = known_messages([
        ChatMessage(role="wizard", content="a", id="1"),
        ChatMessage(role="Human", content="b", id="2"),
        ChatMessage(role="developer", content="c", id="3"),
        FunctionMessage(name="lookup", content="d", id="4"),
        AIMessage("e", id="5"),
        "not a message",
    ])
    assert [(m.type, m.content, m.id) for m in known] == [
        ("ai", "a", "1"), ("human", "b", "2"), ("system", "c", "3"), ("tool", "d", "4"),
        ("ai", "e", "5")]
    assert known[3].tool_call_id == "lookup"


# ---- a client's nodeName ----------------------------------------------------------------------


class _Transfer(typing_extensions.TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    role: str
    approved: bool


class _Asked(typing_extensions.TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]


def _transfer_graph(done: list[tuple[Any, Any]], cut_off: list[str] | None = None,
                    **compile_options: Any) -> Any:
    """START → setup (role "user") → gate (asks for approval) → act (records what it saw).

    `setup` is cut off, each run `cut_off` names ("crash": it fails; "stop": it waits for
    the run to be stopped), once for each entry."""
    return _transfer_steps(done, cut_off).compile(checkpointer=InMemorySaver(),
                                                  **compile_options)


def _transfer_steps(done: list[tuple[Any, Any]], cut_off: list[str] | None = None
                    ) -> StateGraph[_Transfer]:
    async def setup(state: _Transfer) -> dict[str, Any]:
        if cut_off:
            if cut_off.pop(0) == "crash":
                raise RuntimeError("the model provider went away")
            await asyncio.Event().wait()
        return {"role": "user"}

    def gate(state: _Transfer) -> dict[str, Any]:
        return {"approved": interrupt({"question": "Approve the transfer?"}) == "yes"}

    def act(state: _Transfer) -> dict[str, Any]:
        done.append((state.get("role"), state.get("approved")))
        return {"messages": [AIMessage("transferred", id=f"done-{len(done)}")]}

    builder: StateGraph[_Transfer] = StateGraph(_Transfer, input_schema=_Asked)
    for name, node in (("setup", setup), ("gate", gate), ("act", act)):
        builder.add_node(name, node)  # type: ignore[call-overload]  # (sync and async)
    builder.add_edge(START, "setup")
    builder.add_edge("setup", "gate")
    builder.add_edge("gate", "act")
    builder.add_edge("act", END)
    return builder


def _transfer_in_a_subgraph(done: list[tuple[Any, Any]], cut_off: list[str] | None = None,
                            **subgraph_options: Any) -> Any:
    """START → transfer (`_transfer_graph`'s steps, compiled with `subgraph_options`) → END."""
    builder: StateGraph[_Transfer] = StateGraph(_Transfer, input_schema=_Asked)
    builder.add_node("transfer", _transfer_steps(done, cut_off).compile(**subgraph_options))
    builder.add_edge(START, "transfer")
    builder.add_edge("transfer", END)
    return builder.compile(checkpointer=InMemorySaver())


async def test_a_clients_node_name_skips_no_node_and_sets_no_key_it_may_not(
        serve_runtime: ServeRuntime) -> None:
    """`forwardedProps.nodeName` (1.10's `agentSession.nodeName`) made the run write the
    client's state as that node's output and go on from there ("continue"): on a new thread
    any client skipped the approval and set keys outside the input schema (`act` ran as an
    approved admin). It is honoured only where the graph stopped at a breakpoint its author
    set (below, which still works); elsewhere the run starts as any other."""
    done: list[tuple[Any, Any]] = []
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg",
                                                          graph=_transfer_graph(done))})
    forged = {"state": {"role": "admin", "approved": True},
              "forwardedProps": {"nodeName": "gate"}, "protocolVersion": "1.0"}
    async with serve_runtime(runtime) as served:
        for thread in ("new", "at rest"):
            if thread == "at rest":  # once through, approved
                asked = await served.run(run_input("go", thread=thread, protocolVersion="1.0"),
                                         agent="lg")
                (question,) = asked[-1]["outcome"]["interrupts"]
                await served.run(run_input("", thread=thread, run="r2", messages=[], resume=[{
                    "interruptId": question["id"], "status": "resolved", "payload": "yes"}],
                    protocolVersion="1.0"), agent="lg")
                assert done == [("user", True)]
                done.clear()
            events = await served.run(run_input("go", thread=thread, run="r3", **forged),
                                      agent="lg")
            verify_events(events)
            assert events[-1]["outcome"]["type"] == "interrupt", events[-1]
            assert done == []
            response = await served.session.get(f"{served.url}/threads/{thread}/state")
            assert (await response.json())["state"].get("role") == "user"


async def test_a_node_name_continues_a_graph_stopped_at_a_breakpoint(
        serve_runtime: ServeRuntime) -> None:
    """What `nodeName` is for: a graph its author stops before a node (`interrupt_before`)
    is continued with the client's state as that node's output."""
    done: list[tuple[Any, Any]] = []
    graph = _transfer_graph(done, interrupt_before=["gate"])
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread="t"), agent="lg")
        assert types(events)[-1] == "RUN_FINISHED"
        assert done == []
        events = await served.run(run_input("", thread="t", run="r2", messages=[],
                                            state={"approved": True},
                                            forwardedProps={"nodeName": "gate"}), agent="lg")
        verify_events(events)
    assert done == [("user", True)]


async def _park(served: Served, graph: Any, thread: str, how: str, node: str = "setup"
                ) -> None:
    """Leave `thread` cut off in `_transfer_graph`'s `setup` (`cut_off` says `how`): parked,
    not at rest, LangGraph keeps the node that was running as its `next`."""
    response = await served.post("/agent/lg/run", run_input("go", thread=thread, **V1))
    if how == "stop":
        await response.content.readuntil(b'"STEP_STARTED"')
        stopped = await served.post(f"/agent/lg/stop/{thread}", {})
        assert (await stopped.json())["stopped"] is True
    await response.read()
    parked = await graph.aget_state({"configurable": {"thread_id": thread}})
    assert parked.next == (node,)


async def _asked(served: Served, graph: Any, thread: str, done: list[tuple[Any, Any]]
                 ) -> None:
    """The graph ran on from its start and asks for approval: nothing forged was written."""
    assert done == []
    values = await graph_values(graph, thread)
    assert (values.get("role"), values.get("approved")) == ("user", None)
    listed = await get_json(served, f"/approvals?threadId={thread}")
    assert [a["value"] for a in listed["approvals"]] == [{"question": "Approve the transfer?"}]


@pytest.mark.parametrize("how", ["stop", "crash"])
async def test_a_node_name_skips_no_node_of_a_graph_cut_off_mid_step(
        how: str, serve_runtime: ServeRuntime) -> None:
    """A stop, a disconnect or a crash leaves the graph parked at the node that was running
    (LangGraph keeps its `next`), which `nodeName` took for a breakpoint: a client's state
    was written as the approval node's output and `act` ran, approved, with no approval
    ever asked. The run carries the parked graph on, as one without `nodeName` does."""
    done: list[tuple[Any, Any]] = []
    graph = _transfer_graph(done, cut_off=[how])
    forged = {"state": {"role": "admin", "approved": True},
              "forwardedProps": {"nodeName": "gate"}, **V1}
    async with serve_runtime(lg_runtime(graph)) as served:
        await _park(served, graph, "t", how)
        events = await served.run(run_input("go", thread="t", run="r2", **forged), agent="lg")
        verify_events(events)
        assert events[-1]["outcome"]["type"] == "interrupt", events[-1]
        await _asked(served, graph, "t", done)


async def test_a_graphql_node_name_skips_no_node_of_a_graph_cut_off_mid_step(
        serve_runtime: ServeRuntime) -> None:
    """The same over GraphQL: 1.10 sends `agentSession.nodeName` with `agentStates`."""
    done: list[tuple[Any, Any]] = []
    graph = _transfer_graph(done, cut_off=["stop"])
    async with serve_runtime(lg_runtime(graph)) as served:
        await _park(served, graph, "t", "stop")
        await served.generate(chat_data(
            [text_message("u2", "user", "go")], thread="t",
            agentSession={"agentName": "lg", "nodeName": "gate"},
            agentStates=[{"agentName": "lg",
                          "state": '{"role": "admin", "approved": true}'}]))
        await _asked(served, graph, "t", done)


async def test_a_node_name_continues_a_graph_stopped_after_a_node(
        serve_runtime: ServeRuntime) -> None:
    """A breakpoint after a node (`interrupt_after`) is one too: the step after it is the
    client's."""
    done: list[tuple[Any, Any]] = []
    graph = _transfer_graph(done, interrupt_after=["setup"])
    async with serve_runtime(lg_runtime(graph)) as served:
        events = await served.run(run_input("go", thread="t"), agent="lg")
        assert types(events)[-1] == "RUN_FINISHED"
        events = await served.run(run_input("", thread="t", run="r2", messages=[],
                                            state={"approved": True},
                                            forwardedProps={"nodeName": "gate"}), agent="lg")
        verify_events(events)
    assert done == [("user", True)]


async def test_a_node_name_is_honoured_only_at_a_subgraphs_breakpoint(
        serve_runtime: ServeRuntime) -> None:
    """A subgraph's own breakpoint counts (the parent's `next` is the subgraph's node); a
    subgraph cut off mid-step does not: its node's output was the client's, the approval
    skipped."""
    done: list[tuple[Any, Any]] = []
    parked = _transfer_in_a_subgraph(done, cut_off=["stop"])
    stopped = _transfer_in_a_subgraph(done, interrupt_before=["gate"])
    forged = {"state": {"role": "admin", "approved": True},
              "forwardedProps": {"nodeName": "transfer"}, **V1}
    async with serve_runtime(CopilotRuntime(agents={
            "lg": LangGraphAgent(name="lg", graph=parked),
            "bp": LangGraphAgent(name="bp", graph=stopped)})) as served:
        await _park(served, parked, "t", "stop", node="transfer")
        events = await served.run(run_input("go", thread="t", run="r2", **forged), agent="lg")
        verify_events(events)
        assert events[-1]["outcome"]["type"] == "interrupt", events[-1]
        assert (await graph_values(parked, "t")).get("approved") is None
        events = await served.run(run_input("go", thread="t"), agent="bp")
        assert types(events)[-1] == "RUN_FINISHED"
        events = await served.run(run_input("", thread="t", run="r2", messages=[], **forged),
                                  agent="bp")
        verify_events(events)
        assert (await graph_values(stopped, "t")).get("approved") is True
    assert done == []


@dataclasses.dataclass
class _HeldSpecialist:
    """A review loop's specialist whose first draft never comes (the run is stopped)."""

    name: str
    description: str = "drafts, after a first call that is stopped"
    calls: int = 0

    async def run(self, request: SpecialistRequest) -> str:
        self.calls += 1
        if self.calls == 1:
            await asyncio.Event().wait()
        return f"{self.name} draft for {request.task!r}"


async def test_a_node_name_of_a_review_loop_cut_off_mid_draft_gets_an_answer(
        serve_runtime: ServeRuntime) -> None:
    """A review loop stopped while a specialist drafts, then sent a new task with the
    `nodeName` of that specialist (what a 1.10 client holds then): the client's state was
    written as the specialist's output, whose `Command` leads nowhere, so nothing ran, no
    answer came, and the task stayed "working". It is planned and drafted now."""
    loop = ReviewLoop([_HeldSpecialist("Invoice"), _HeldSpecialist("Closing")])
    graph = loop.compile(InMemorySaver())
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    first = {"id": "u1", "role": "user", "content": "Prepare the invoice for ACME"}
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/lg/run", run_input(
            "", thread="t", messages=[first], **V1))
        head = await response.content.readuntil(b'"stepName":"Invoice"')
        stopped = await served.post("/agent/lg/stop/t", {})
        assert (await stopped.json())["stopped"] is True
        # (the planner's update is streamed before the specialist starts; the specialist,
        # stopped mid-draft, wrote nothing)
        assert b'"stepName":"planner"' in head
        assert b"STATE_SNAPSHOT" not in await response.read()
        assert (await graph_values(graph, "t"))["status"] == "working"
        events = await served.run(run_input("", thread="t", run="r2", messages=[
            first, {"id": "u2", "role": "user", "content": "Run the month-end close instead"}],
            forwardedProps={"nodeName": "Invoice"}, **V1), agent="lg")
        verify_events(events)
    assert events[-1]["outcome"]["type"] == "interrupt", events[-1]
    assert "draft for 'Run the month-end close instead'" in text_of(events)
    assert client_state(events)["status"] == "awaiting_review"


async def test_a_message_sent_with_an_answer_is_refused_not_lost(
        serve_runtime: ServeRuntime) -> None:
    """A new user message sent in the same request as an interrupt's answer: ag-ui-langgraph
    resumed with the answer alone, the message lost everywhere (the graph, the client's last
    snapshot) and the run a success. The request is refused now, as a message sent while the
    interrupt waits is, and the answer can be sent again, alone."""
    done: list[tuple[Any, Any]] = []
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg",
                                                          graph=_transfer_graph(done))})
    async with serve_runtime(runtime) as served:
        asked = await served.run(run_input("go", thread="t", protocolVersion="1.0"), agent="lg")
        (question,) = asked[-1]["outcome"]["interrupts"]
        answer = [{"interruptId": question["id"], "status": "resolved", "payload": "yes"}]
        events = await served.run(run_input("and another thing", thread="t", run="r2",
                                            resume=answer, protocolVersion="1.0"), agent="lg")
        verify_events(events)
        assert (events[-1]["type"], events[-1]["code"]) == ("RUN_ERROR", "APPROVAL_ERROR")
        assert "send the new message after it" in events[-1]["message"]
        assert done == []
        events = await served.run(run_input("", thread="t", run="r3", messages=[],
                                            resume=answer, protocolVersion="1.0"), agent="lg")
        assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert done == [("user", True)]
