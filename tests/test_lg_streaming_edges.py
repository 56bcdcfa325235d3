"""`LangGraphAgent` streaming what models send in shapes the translator did not expect, and
refusing client input it could not take, on both protocols:

* a tool call whose arguments come in the chunk that names it (Ollama, vLLM, Gemini send a
  whole call in one chunk): its arguments are streamed; before, the first chunk's were
  dropped (AG-UI: no `TOOL_CALL_ARGS`; GraphQL 1.10: empty `arguments`, so the frontend
  action ran with none);
* one node calling two models at once (`asyncio.gather`): each call streams into its own
  message or tool call; before, both went into one (garbled text, corrupt arguments);
* a `state.copilotkit` that is not an object, a `state.tools` that is not a list of
  objects, a `nodeName` that is not text (AG-UI's forwarded props, GraphQL's properties), or
  tool-call arguments that are JSON but not an object: `INVALID_REQUEST` saying so;
  before, the generic `AGENT_ERROR`, its stack logged; an activity message in the history
  is left out of the graph's input; before, every run of the thread failed on its role.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

import pytest
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, AnyMessage, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from typing_extensions import TypedDict

from copilot_runtime import CopilotRuntime
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.testing import verify_events
from tests.conftest import ServeRuntime, run_input
from tests.gql.wire import chat_data, text_message

pytestmark = pytest.mark.timeout(30)

Json = dict[str, Any]
V1 = {"protocolVersion": "1.0"}
CITY = {"city": "Paris, France"}
ACTION = {"name": "showCity", "description": "Show a city", "jsonSchema": json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})}
TOOL = {"name": "showCity", "description": "Show a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


class State(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]


class ToolCallingModel(BaseChatModel):
    """Streams one `showCity` call: its id and name in the first chunk, with the first of
    `pieces` of its arguments (the rest follow, one chunk each)."""

    call_id: str
    pieces: list[str]
    # Between chunks: lets a concurrent call's chunks come in between.
    pause: float = 0.0

    @property
    def _llm_type(self) -> str:
        return "tool-calling-test-model"

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        raise NotImplementedError("streams only")

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        for n, piece in enumerate(self.pieces):
            await asyncio.sleep(self.pause)
            first = n == 0
            chunk = ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[{
                "index": 0, "id": self.call_id if first else None,
                "name": "showCity" if first else None, "args": piece}]))
            if run_manager is not None:
                await run_manager.on_llm_new_token("", chunk=chunk)
            yield chunk


class TextModel(BaseChatModel):
    """Streams `words`, one chunk each, pausing between them."""

    words: list[str]
    pause: float = 0.005

    @property
    def _llm_type(self) -> str:
        return "text-test-model"

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        raise NotImplementedError("streams only")

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        for word in self.words:
            await asyncio.sleep(self.pause)
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=word))
            if run_manager is not None:
                await run_manager.on_llm_new_token(word, chunk=chunk)
            yield chunk


def one_model(model: BaseChatModel) -> Any:
    async def chat(state: State, config: RunnableConfig) -> Json:
        return {"messages": [await model.ainvoke(state["messages"], config)]}

    builder = StateGraph(State)
    builder.add_node("chat", chat)
    builder.add_edge(START, "chat")
    builder.add_edge("chat", END)
    return builder.compile(checkpointer=InMemorySaver())


def two_models_at_once(first: BaseChatModel, second: BaseChatModel) -> Any:
    async def chat(state: State, config: RunnableConfig) -> Json:
        answers = await asyncio.gather(first.ainvoke(state["messages"], config),
                                       second.ainvoke(state["messages"], config))
        return {"messages": list(answers)}

    builder = StateGraph(State)
    builder.add_node("chat", chat)
    builder.add_edge(START, "chat")
    builder.add_edge("chat", END)
    return builder.compile(checkpointer=InMemorySaver())


def streamed_arguments(events: list[Json]) -> dict[str, str]:
    """Each streamed tool call's arguments, by call id."""
    out: dict[str, str] = {}
    for event in events:
        if event["type"] == "TOOL_CALL_START":
            out[event["toolCallId"]] = ""
        elif event["type"] == "TOOL_CALL_ARGS":
            out[event["toolCallId"]] += event["delta"]
    return out


# ---- the chunk that names a tool call carries arguments ------------------------------------


@pytest.mark.parametrize("pieces", [
    pytest.param([json.dumps(CITY)], id="whole-call-in-one-chunk"),
    pytest.param([json.dumps(CITY)[:6], json.dumps(CITY)[6:]], id="first-piece-with-name"),
])
async def test_arguments_in_the_chunk_naming_a_tool_call_are_streamed(
        serve_runtime: ServeRuntime, pieces: list[str]) -> None:
    model = ToolCallingModel(call_id="call-1", pieces=pieces)
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=one_model(model))})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("show Paris", thread="one-chunk", tools=[TOOL],
                                            **V1), agent="lg")
        gql = await served.generate(chat_data(
            [text_message("u1", "user", "show Paris")], thread="one-chunk-gql",
            actions=[ACTION], agentSession={"agentName": "lg"}))
    verify_events(events)
    assert streamed_arguments(events) == {"call-1": json.dumps(CITY)}
    calls = [m for m in gql["messages"] if m["__typename"] == "ActionExecutionMessageOutput"]
    assert [json.loads("".join(m["arguments"])) for m in calls] == [CITY]


# ---- concurrent model calls in one node ----------------------------------------------------


async def test_concurrent_model_calls_in_one_node_stream_their_own_messages(
        serve_runtime: ServeRuntime) -> None:
    graph = two_models_at_once(TextModel(words=["alpha", " one", " two", " three"]),
                               TextModel(words=["beta", " four", " five", " six"]))
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread="gather-text", **V1), agent="lg")
    verify_events(events)
    texts: dict[str, str] = {}
    for event in events:
        if event["type"] == "TEXT_MESSAGE_CONTENT":
            texts[event["messageId"]] = texts.get(event["messageId"], "") + event["delta"]
    assert sorted(texts.values()) == ["alpha one two three", "beta four five six"]
    snapshot = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]
    assert {m["id"]: m["content"] for m in snapshot if m["role"] == "assistant"} == texts


async def test_concurrent_model_calls_in_one_node_stream_their_own_tool_calls(
        serve_runtime: ServeRuntime) -> None:
    def calling(call_id: str, city: str) -> ToolCallingModel:
        text = json.dumps({"city": city})
        # OpenAI's shape: the id and name first, without arguments.
        return ToolCallingModel(call_id=call_id, pause=0.005,
                                pieces=["", *(text[i:i + 4] for i in range(0, len(text), 4))])

    graph = two_models_at_once(calling("call-paris", "Paris, France"),
                               calling("call-oslo", "Oslo, Norway"))
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("go", thread="gather-calls", **V1), agent="lg")
    verify_events(events)
    assert streamed_arguments(events) == {"call-paris": json.dumps({"city": "Paris, France"}),
                                          "call-oslo": json.dumps({"city": "Oslo, Norway"})}
    ends = sorted(e["toolCallId"] for e in events if e["type"] == "TOOL_CALL_END")
    assert ends == ["call-oslo", "call-paris"]


# ---- client input the translator cannot take -----------------------------------------------


def answers_with_what_it_read() -> Any:
    """One node that says which kinds of message it was given."""
    def chat(state: State) -> Json:
        roles = ",".join(m.type for m in state["messages"])
        return {"messages": [AIMessage(content=f"read {roles}")]}

    builder = StateGraph(State)
    builder.add_node("chat", chat)
    builder.add_edge(START, "chat")
    builder.add_edge("chat", END)
    return builder.compile(checkpointer=InMemorySaver())


def _history_with_call(arguments: str) -> list[Json]:
    return [{"id": "u1", "role": "user", "content": "hi"},
            {"id": "a1", "role": "assistant", "toolCalls": [{
                "id": "c1", "type": "function",
                "function": {"name": "f", "arguments": arguments}}]},
            {"id": "t1", "role": "tool", "toolCallId": "c1", "content": "done"}]


@pytest.mark.parametrize(("extra", "says"), [
    pytest.param({"state": {"copilotkit": "x"}}, "state.copilotkit must be a JSON object",
                 id="copilotkit-not-an-object"),
    pytest.param({"messages": _history_with_call("[1,2]")},
                 "Message 'a1': the arguments of tool call 'c1' must be a JSON object",
                 id="arguments-not-an-object"),
    pytest.param({"forwardedProps": {"nodeName": 5}}, "nodeName must be a string",
                 id="node-name-a-number"),
    pytest.param({"forwardedProps": {"nodeName": {"a": 1}}}, "nodeName must be a string",
                 id="node-name-an-object"),
    pytest.param({"forwardedProps": {"node_name": ["x"]}}, "node_name must be a string",
                 id="node-name-a-list"),
    pytest.param({"state": {"tools": 5}}, "state.tools must be a list of JSON objects",
                 id="tools-not-a-list"),
    pytest.param({"state": {"tools": ["x"]}}, "state.tools must be a list of JSON objects",
                 id="tools-not-objects"),
])
async def test_input_the_translator_cannot_take_is_refused_saying_why(
        serve_runtime: ServeRuntime, extra: Json, says: str) -> None:
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
        name="lg", graph=answers_with_what_it_read())})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hi", thread="malformed", **extra), agent="lg")
    last = events[-1]
    assert last["type"] == "RUN_ERROR"
    assert last["code"] == "INVALID_REQUEST"
    assert says in last["message"]


async def test_unparseable_arguments_still_read_as_none(serve_runtime: ServeRuntime) -> None:
    # (a run stopped mid-call leaves them so: the thread must go on)
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
        name="lg", graph=answers_with_what_it_read())})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hi", thread="cut", messages=_history_with_call(
            '{"a": '), **V1), agent="lg")
    assert events[-1]["type"] == "RUN_FINISHED"


async def test_activity_messages_are_not_graph_input(serve_runtime: ServeRuntime) -> None:
    history = [{"id": "u1", "role": "user", "content": "hi"},
               {"id": "act1", "role": "activity", "activityType": "progress",
                "content": {"percent": 50}},
               {"id": "u2", "role": "user", "content": "next"}]
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
        name="lg", graph=answers_with_what_it_read())})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("", thread="activity", messages=history, **V1),
                                  agent="lg")
    verify_events(events)
    assert events[-1]["type"] == "RUN_FINISHED"
    snapshot = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"][-1]["messages"]
    assert snapshot[-1]["content"] == "read human,human"


@pytest.mark.parametrize(("properties", "agent_states", "says"), [
    pytest.param({"nodeName": 5}, None, "nodeName must be a string", id="node-name"),
    pytest.param(None, [{"agentName": "lg", "state": '{"tools": 5}'}],
                 "state.tools must be a list of JSON objects", id="state-tools"),
])
async def test_wrongly_typed_graphql_input_is_an_invalid_request(
        serve_runtime: ServeRuntime, properties: Json | None, agent_states: Any,
        says: str) -> None:
    """A client's `properties.nodeName` or agent state of the wrong type failed as the
    generic "failed unexpectedly" (AGENT_ERROR), its stack logged."""
    runtime = CopilotRuntime(agents={"lg": LangGraphAgent(
        name="lg", graph=answers_with_what_it_read())})
    extra = {} if agent_states is None else {"agentStates": agent_states}
    async with serve_runtime(runtime) as served:
        response = await served.generate(chat_data(
            [text_message("u1", "user", "hi")], thread="typed",
            agentSession={"agentName": "lg"}, **extra), properties)
    status = response["status"]
    assert status["code"] == "Failed"
    error = status["details"]["originalError"]
    assert (error["code"], error["statusCode"], error["originalErrorType"]) == (
        "MISUSE", 400, "INVALID_REQUEST"), status
    assert says in status["details"]["description"]
