"""An answer the provider did not finish never looks finished, on every provider and route.

A scripted loopback upstream (`test_hostile_providers`) ends an answer at the token limit
(OpenAI `length`, Anthropic `max_tokens`, Gemini `MAX_TOKENS`): with nothing said (every token
went to reasoning), in the middle of a tool call's arguments, or after some text. Anthropic's
`pause_turn` is not an end either. Nor is any other end but a normal one: a content filter
or a refusal, Anthropic's `model_context_window_exceeded`, Mistral's `model_length` and
`error`, DeepSeek's `insufficient_system_resource`: none ever finishes a call whose arguments
it cut, and each says its own error. LangChain chat models' own stop reasons (ChatAnthropic's
`max_tokens`/`refusal`, ChatGoogleGenerativeAI's `MAX_TOKENS`/`SAFETY`) mean what the direct
adapters make of them. And text that arrives in the same read as a mid-stream
error event reaches the client and the thread before the error, worded as the direct routes
word it on the SDK routes too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest
from ag_ui.core import UserMessage
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessageChunk
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk, ChatResult

from copilot_runtime import CopilotRuntime, LangChainAdapter, action
from copilot_runtime._exceptions import UpstreamError
from copilot_runtime.adapters.anthropic import AnthropicAdapter
from copilot_runtime.adapters.base import ChatRequest, StreamEnd, TextDelta
from copilot_runtime.hooks import RunFinished
from tests.conftest import ServeRuntime, run_input, text_of, types
from tests.gql.wire import user_turn
from tests.test_graphql_agents import turn
from tests.test_hostile_providers import (
    AN_START,
    HEAD,
    OA_DONE,
    SET_COLOR,
    ScriptedUpstream,
    Step,
    an,
    an_args,
    an_delta,
    an_end,
    an_stop,
    an_text_block,
    an_tool_start,
    gm_parts,
    hostile,
    make_adapter,
    oa_finish,
    oa_text,
    oa_tool,
    run,
    sse,
)

pytestmark = pytest.mark.timeout(60)

ROUTES = [(p, t) for p in ("openai", "anthropic", "google") for t in ("direct", "sdk")]
GM_USAGE = {"promptTokenCount": 3, "candidatesTokenCount": 0, "thoughtsTokenCount": 100}
AN_THINKING = [an({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
               an_delta({"type": "thinking_delta", "thinking": "Let me think..."}),
               an_stop()]

#: The token limit reached before the model said anything (its tokens went to reasoning).
NOTHING_SAID: dict[str, list[Step]] = {
    "openai": [HEAD, oa_text(""), oa_finish("length"), OA_DONE],
    "anthropic": [HEAD, AN_START, *AN_THINKING, *an_end("max_tokens")],
    "google": [HEAD, gm_parts({"text": "thinking...", "thought": True}),
               gm_parts(reason="MAX_TOKENS", usage=GM_USAGE)],
}
#: ... after some text.
CUT_TEXT: dict[str, list[Step]] = {
    "openai": [HEAD, oa_text("The three causes are: 1) the"), oa_finish("length"), OA_DONE],
    "anthropic": [HEAD, AN_START, *an_text_block("The three causes are: 1) the"),
                  *an_end("max_tokens")],
    "google": [HEAD, gm_parts({"text": "The three causes are: 1) the"}),
               gm_parts(reason="MAX_TOKENS", usage=GM_USAGE)],
}
#: ... in the middle of a tool call's arguments (Gemini sends its calls whole).
CUT_CALL: dict[str, list[Step]] = {
    "openai": [HEAD, oa_tool(0, "call_1", "setColor", '{"c": "re'), oa_finish("length"),
               OA_DONE],
    "anthropic": [HEAD, AN_START, an_tool_start(0), an_args(0, '{"c": "re'), an_stop(),
                  *an_end("max_tokens")],
}


def truncated(events: list[dict[str, Any]]) -> str:
    assert types(events)[-1] == "RUN_ERROR", events
    assert events[-1]["code"] == "OUTPUT_TRUNCATED", events[-1]
    assert "token limit" in events[-1]["message"], events[-1]
    return str(events[-1]["message"])


@pytest.mark.parametrize(("provider", "transport"), ROUTES)
async def test_an_answer_cut_before_it_said_anything_is_an_error(
        serve_runtime: ServeRuntime, provider: str, transport: str) -> None:
    """Before: RUN_STARTED, RUN_FINISHED: an empty answer that looked complete."""
    async with hostile(serve_runtime, provider, NOTHING_SAID[provider],
                       transport=transport) as (served, _):
        events = await run(served, run_input("hi"))
    truncated(events)
    assert text_of(events) == ""


@pytest.mark.parametrize(("provider", "transport"), ROUTES)
async def test_an_answer_cut_after_some_text_keeps_it_and_says_so(
        serve_runtime: ServeRuntime, provider: str, transport: str) -> None:
    """As text a content filter cut: a finished answer, whose RUN_FINISHED says why it
    ended (before: nothing told a cut answer from a whole one)."""
    thread = f"t-cut-{provider}-{transport}"
    async with hostile(serve_runtime, provider, CUT_TEXT[provider],
                       transport=transport) as (served, _):
        events = await run(served, run_input("hi", thread=thread))
        response = await served.session.get(served.url + f"/threads/{thread}/messages")
        stored = (await response.json())["messages"]
    assert types(events)[-1] == "RUN_FINISHED", events
    assert events[-1]["result"] == {"finishReason": "length"}
    assert text_of(events) == "The three causes are: 1) the"
    assert [m.get("content") for m in stored if m["role"] == "assistant"] == [
        "The three causes are: 1) the"]


@pytest.mark.parametrize(("provider", "transport"),
                         [r for r in ROUTES if r[0] in CUT_CALL])
async def test_a_tool_call_cut_mid_arguments_fails_the_run(
        serve_runtime: ServeRuntime, provider: str, transport: str) -> None:
    """Before: TOOL_CALL_END and RUN_FINISHED: the client ran a call with broken JSON."""
    async with hostile(serve_runtime, provider, CUT_CALL[provider],
                       transport=transport) as (served, _):
        events = await run(served, run_input("paint", tools=[SET_COLOR]))
    assert "'setColor'" in truncated(events)


@pytest.mark.parametrize("provider", list(CUT_CALL))
async def test_a_server_action_is_not_run_with_cut_arguments(
        serve_runtime: ServeRuntime, provider: str) -> None:
    ran: list[str] = []

    @action
    def setColor(c: str) -> str:
        """Sets the colour."""
        ran.append(c)
        return "done"

    async with ScriptedUpstream(CUT_CALL[provider]) as upstream:
        runtime = CopilotRuntime(service_adapter=make_adapter(provider, upstream.url,
                                                              "direct"), actions=[setColor])
        async with serve_runtime(runtime) as served:
            events = await run(served, run_input("paint"))
    truncated(events)
    assert ran == []
    assert len(upstream.requests) == 1
    assert "TOOL_CALL_RESULT" not in types(events)


def cut_call_by(provider: str, reason: str) -> list[Step]:
    """`setColor` called with `{"c": "re`, then the answer ended with `reason`."""
    if provider == "openai":
        return [HEAD, oa_tool(0, "call_1", "setColor", '{"c": "re'), oa_finish(reason),
                OA_DONE]
    return [HEAD, AN_START, an_tool_start(0), an_args(0, '{"c": "re'), an_stop(),
            *an_end(reason)]


#: Ends other than the token limit that cut a call, and the code that says so.
CUT_CALL_BY = {
    "openai content_filter": "CONTENT_FILTERED",
    "anthropic refusal": "CONTENT_FILTERED",
    "anthropic model_context_window_exceeded": "OUTPUT_TRUNCATED",
    "openai model_length": "OUTPUT_TRUNCATED",  # Mistral's context window
    "openai insufficient_system_resource": "UPSTREAM_ERROR",  # DeepSeek's
    "openai error": "UPSTREAM_ERROR",  # Mistral's
}


@pytest.mark.parametrize("transport", ["direct", "sdk"])
@pytest.mark.parametrize("case", CUT_CALL_BY)
async def test_a_tool_call_cut_by_any_other_end_fails_the_run_with_its_reason(
        serve_runtime: ServeRuntime, case: str, transport: str) -> None:
    """Before: TOOL_CALL_START/ARGS/END then RUN_FINISHED, as if finished (the real client
    failed with tool_argument_parse_failed). Now the run ends with the reason's error, as at
    the token limit."""
    provider, reason = case.split()
    async with hostile(serve_runtime, provider, cut_call_by(provider, reason),
                       transport=transport) as (served, _):
        events = await run(served, run_input("paint", tools=[SET_COLOR]))
    assert types(events)[-1] == "RUN_ERROR", events
    assert events[-1]["code"] == CUT_CALL_BY[case], events[-1]
    if reason != "error":
        assert "'setColor'" in events[-1]["message"], events[-1]
    assert "RUN_FINISHED" not in types(events), events


@pytest.mark.parametrize("case", ["openai content_filter", "anthropic refusal",
                                  "openai model_length"])
async def test_a_server_action_is_not_run_with_arguments_cut_by_any_other_end(
        serve_runtime: ServeRuntime, case: str) -> None:
    """Before: the action ran with the cut JSON (a "not valid JSON" result), and the model was
    asked again right after its filter or refusal. Now nothing runs and the run fails."""
    ran: list[str] = []

    @action
    def setColor(c: str) -> str:
        """Sets the colour."""
        ran.append(c)
        return "done"

    provider, reason = case.split()
    async with ScriptedUpstream(cut_call_by(provider, reason), cut_call_by(provider, reason)
                                ) as upstream:
        runtime = CopilotRuntime(service_adapter=make_adapter(provider, upstream.url,
                                                              "direct"), actions=[setColor])
        async with serve_runtime(runtime) as served:
            events = await run(served, run_input("paint"))
    assert events[-1]["code"] == CUT_CALL_BY[case], events[-1]
    assert ran == []
    assert len(upstream.requests) == 1
    assert "TOOL_CALL_RESULT" not in types(events)


async def test_a_graphql_call_cut_by_the_filter_is_a_failed_turn(
        serve_runtime: ServeRuntime) -> None:
    """Before: an ActionExecutionMessage with the cut arguments and Success, in a successful
    turn. Now the message and the turn are failed, the turn with CONTENT_FILTERED."""
    show = {"name": "setColor", "description": "Sets the colour",
            "jsonSchema": '{"type": "object", "properties": {"c": {"type": "string"}}}'}
    async with hostile(serve_runtime, "openai", cut_call_by("openai", "content_filter")
                       ) as (served, _):
        response = await turn(served, user_turn("paint", actions=[show]))
    status = response["status"]
    assert status["__typename"] == "FailedResponseStatus", status
    assert status["details"]["originalError"]["originalErrorType"] == "CONTENT_FILTERED"
    calls = [m for m in response["messages"]
             if m["__typename"] == "ActionExecutionMessageOutput"]
    assert [m["status"]["code"] for m in calls] == ["Failed"], calls


#: Text cut by the context window: the words Anthropic and Mistral use for it.
CUT_BY_WINDOW: dict[str, list[Step]] = {
    "anthropic": [HEAD, AN_START, *an_text_block("The three causes are: 1) the"),
                  *an_end("model_context_window_exceeded")],
    "openai": [HEAD, oa_text("The three causes are: 1) the"), oa_finish("model_length"),
               OA_DONE],
}


@pytest.mark.parametrize("provider", list(CUT_BY_WINDOW))
async def test_text_cut_by_the_context_window_says_it_was_cut(
        serve_runtime: ServeRuntime, provider: str) -> None:
    """Before: a bare RUN_FINISHED, as a whole answer. Now it says `length`, as at the token
    limit."""
    async with hostile(serve_runtime, provider, CUT_BY_WINDOW[provider]) as (served, _):
        events = await run(served, run_input("hi"))
    assert types(events)[-1] == "RUN_FINISHED", events
    assert events[-1]["result"] == {"finishReason": "length"}
    assert text_of(events) == "The three causes are: 1) the"


@pytest.mark.parametrize("transport", ["direct", "sdk"])
async def test_an_answer_ended_by_an_error_finish_reason_is_an_upstream_error(
        serve_runtime: ServeRuntime, transport: str) -> None:
    """Mistral's `finish_reason: "error"` (the generation failed). Before: RUN_FINISHED, as
    a whole answer. Now the text said stays and the run fails with UPSTREAM_ERROR."""
    script: list[Step] = [HEAD, oa_text("Here is the first half of"), oa_finish("error"),
                          OA_DONE]
    async with hostile(serve_runtime, "openai", script, transport=transport) as (served, _):
        events = await run(served, run_input("hi"))
    assert types(events)[-1] == "RUN_ERROR", events
    assert events[-1]["code"] == "UPSTREAM_ERROR", events[-1]
    assert "error" in events[-1]["message"], events[-1]
    assert text_of(events) == "Here is the first half of"


@pytest.mark.parametrize("transport", ["direct", "sdk"])
async def test_an_anthropic_paused_turn_does_not_look_finished(
        serve_runtime: ServeRuntime, transport: str) -> None:
    """Before: `pause_turn` was read as "stop", a finished answer."""
    script: list[Step] = [HEAD, AN_START, *an_text_block("Searching the web for"),
                          *an_end("pause_turn")]
    async with hostile(serve_runtime, "anthropic", script, transport=transport) \
            as (served, _):
        events = await run(served, run_input("hi"))
    assert types(events)[-1] == "RUN_ERROR", events
    assert "paused" in events[-1]["message"], events[-1]
    assert text_of(events) == "Searching the web for"


# ---- text in the same read as a mid-stream error --------------------------------------------

#: One write (one read): text, then the provider's error event.
TEXT_THEN_ERROR: dict[str, list[Step]] = {
    "openai": [HEAD, oa_text("Here is the first half of") + sse(
        {"error": {"message": "The server had an error", "type": "server_error"}})],
    "anthropic": [HEAD, AN_START, b"".join(
        [*an_text_block("Here is the first half of"),  # type: ignore[list-item]
         an({"type": "error", "error": {"type": "overloaded_error",
                                        "message": "Overloaded"}})])],
    "google": [HEAD, gm_parts({"text": "Here is the first half of"}) + sse(
        {"error": {"code": 503, "message": "The model is overloaded",
                   "status": "UNAVAILABLE"}})],
}
SAID = {"openai": "OpenAI reported an error mid-stream: The server had an error",
        "anthropic": "Anthropic reported an error mid-stream: Overloaded",
        "google": "Gemini reported an error mid-stream: The model is overloaded"}


@pytest.mark.parametrize(("provider", "transport"), ROUTES)
async def test_text_read_with_a_mid_stream_error_reaches_the_client_first(
        serve_runtime: ServeRuntime, provider: str, transport: str) -> None:
    """Before: the read's text was dropped with the error (kept only when it came in an
    earlier read); the SDK route of Gemini said "Gemini request failed with HTTP 503"."""
    thread = f"t-err-{provider}-{transport}"
    async with hostile(serve_runtime, provider, TEXT_THEN_ERROR[provider],
                       transport=transport) as (served, _):
        events = await run(served, run_input("hi", thread=thread))
        response = await served.session.get(served.url + f"/threads/{thread}/messages")
        stored = (await response.json())["messages"]
    assert types(events)[-1] == "RUN_ERROR", events
    assert events[-1]["message"] == SAID[provider]
    assert text_of(events) == "Here is the first half of"
    assert [m.get("content") for m in stored if m["role"] == "assistant"] == [
        "Here is the first half of"]


#: The provider's token counts, then the error that ends the answer (Mistral's "error"
#: finish carries its usage in the same chunk).
USAGE_THEN_ERROR: dict[str, list[Step]] = {
    "openai": [HEAD, oa_text("Here is"), sse({
        "id": "c", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "error"}],
        "usage": {"prompt_tokens": 1200, "completion_tokens": 40}}), OA_DONE],
    "anthropic": [HEAD, AN_START, *an_text_block("Here is"),
                  an({"type": "error", "error": {"type": "overloaded_error",
                                                 "message": "Overloaded"}})],
    "google": [HEAD, gm_parts({"text": "Here is"}, usage={
        "promptTokenCount": 1200, "candidatesTokenCount": 40}),
        sse({"error": {"code": 503, "message": "The model is overloaded"}})],
}
#: What `on_run_finished` reads of them (AN_START says 3 input tokens, no output yet).
USED = {"openai": {"input_tokens": 1200, "output_tokens": 40},
        "anthropic": {"input_tokens": 3, "output_tokens": 0},
        "google": {"input_tokens": 1200, "output_tokens": 40}}


@pytest.mark.parametrize(("provider", "transport"), ROUTES)
async def test_tokens_reported_before_a_mid_stream_error_are_counted(
        serve_runtime: ServeRuntime, provider: str, transport: str) -> None:
    """Before: an upstream error raised after the provider reported its token counts lost
    them: `on_run_finished` said usage {}. Now the run's usage holds them."""
    finished: list[RunFinished] = []
    reported = asyncio.Event()

    def on_run_finished(ended: RunFinished) -> None:
        finished.append(ended)
        reported.set()

    async with ScriptedUpstream(USAGE_THEN_ERROR[provider]) as upstream:
        runtime = CopilotRuntime(
            service_adapter=make_adapter(provider, upstream.url, transport),
            on_run_finished=on_run_finished)
        async with serve_runtime(runtime) as served:
            events = await run(served, run_input("hi"))
            # (the hook runs after the answer's end)
            await asyncio.wait_for(reported.wait(), 10)
    assert types(events)[-1] == "RUN_ERROR", events
    assert finished[0].usage == USED[provider]


async def test_anthropic_sdk_event_route_words_a_mid_stream_error_as_the_direct_route(
        ) -> None:
    """Before (Vertex, Bedrock): "Anthropic request failed with HTTP 200: Overloaded"."""
    script: list[Step] = [HEAD, AN_START, *an_text_block("Here is"), 0.05,
                          an({"type": "error", "error": {"type": "overloaded_error",
                                                         "message": "Overloaded"}})]
    async with ScriptedUpstream(script) as upstream:
        client = anthropic.AsyncAnthropicVertex(
            region="us-east5", project_id="p", access_token="tok", base_url=upstream.url,
            max_retries=0)
        adapter = AnthropicAdapter(model="claude-on-vertex", client=client)
        text: list[str] = []
        failure = ""
        try:
            async for batch in adapter.stream(ChatRequest(messages=[])):
                text.extend(d.text for d in batch if isinstance(d, TextDelta))
        except UpstreamError as exc:
            failure = str(exc)
        finally:
            await adapter.aclose()
            await client.close()  # the application's: the adapter leaves it open
    assert failure == SAID["anthropic"]
    assert text == ["Here is"]


# ---- LangChain: each integration's own words for why an answer ended -------------------------


class _ScriptedChatModel(BaseChatModel):
    """A stand-in for langchain-anthropic's ChatAnthropic and langchain-google-genai's
    ChatGoogleGenerativeAI (not installed here): it streams the chunks they yield, whose
    `response_metadata` holds the provider's own stop reason (`stop_reason` "max_tokens" or
    "refusal"; `finish_reason` "SAFETY", "MAX_TOKENS", ... as Gemini's enum names)."""

    script: list[AIMessageChunk]

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Any, **_: Any) -> Any:
        return self

    def _generate(self, *_: Any, **__: Any) -> ChatResult:
        raise NotImplementedError

    async def _astream(self, *_: Any, **__: Any) -> AsyncIterator[ChatGenerationChunk]:
        for chunk in self.script:
            yield ChatGenerationChunk(message=chunk)


LC_USAGE = {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8}
LC_CALL = [AIMessageChunk(content=[], tool_call_chunks=[tool_call_chunk(
               name="setColor", args="", id="toolu_1", index=0)]),
           AIMessageChunk(content=[], tool_call_chunks=[tool_call_chunk(
               name=None, args='{"c": "re', id=None, index=0)])]


def lc_end(metadata: dict[str, Any]) -> AIMessageChunk:
    return AIMessageChunk(content="", response_metadata=metadata, usage_metadata=LC_USAGE)


#: Provider-native reasons → the runtime's (as the direct adapters map them).
LC_REASONS: dict[str, tuple[dict[str, Any], str]] = {
    "anthropic end_turn": ({"stop_reason": "end_turn"}, "stop"),
    "anthropic max_tokens": ({"stop_reason": "max_tokens"}, "length"),
    "anthropic refusal": ({"stop_reason": "refusal"}, "content_filter"),
    "google STOP": ({"finish_reason": "STOP"}, "stop"),
    "google MAX_TOKENS": ({"finish_reason": "MAX_TOKENS"}, "length"),
    **{f"google {reason}": ({"finish_reason": reason}, "content_filter")
       for reason in ("SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII")},
    "bedrock guardrail_intervened": ({"stopReason": "guardrail_intervened"},
                                     "content_filter"),
    "ollama length": ({"done_reason": "length"}, "length"),
    "openai length": ({"finish_reason": "length"}, "length"),
    "openai content_filter": ({"finish_reason": "content_filter"}, "content_filter"),
}


@pytest.mark.parametrize("case", LC_REASONS)
async def test_langchain_provider_stop_reasons_are_the_runtimes(case: str) -> None:
    """Before: passed through as they were ("max_tokens", "refusal", "SAFETY"), which the
    agent does not know: a cut or filtered answer looked finished. Now each is `length`,
    `content_filter` or `stop`, as the direct adapters say (OpenAI's pass as they are)."""
    metadata, expected = LC_REASONS[case]
    model = _ScriptedChatModel(script=[AIMessageChunk(content="Here is"), lc_end(metadata)])
    deltas = [d async for b in LangChainAdapter(model).stream(ChatRequest(
        messages=[UserMessage(id="u", content="hi")])) for d in b]
    assert deltas[-1] == StreamEnd(expected, {"prompt_tokens": 3, "completion_tokens": 5,
                                              "total_tokens": 8})


WHOLE_CALL = AIMessageChunk(content=[], tool_call_chunks=[tool_call_chunk(
    name="setColor", args='{"c": "red"}', id="call_1", index=0)])


@pytest.mark.parametrize("metadata", [{"finish_reason": "STOP"}, {"done_reason": "stop"}])
async def test_a_langchain_answer_with_calls_that_says_stop_ends_in_tool_calls(
        metadata: dict[str, Any]) -> None:
    """Gemini's STOP and Ollama's `done_reason` say "stop" after tool calls too: the direct
    Gemini adapter says `tool_calls` then, and so did this adapter before it read
    `done_reason` (telemetry's finish reason)."""
    model = _ScriptedChatModel(script=[WHOLE_CALL, lc_end(metadata)])
    deltas = [d async for b in LangChainAdapter(model).stream(ChatRequest(
        messages=[UserMessage(id="u", content="hi")])) for d in b]
    end = deltas[-1]
    assert isinstance(end, StreamEnd)
    assert end.finish_reason == "tool_calls"


async def test_a_langchain_call_cut_at_anthropics_max_tokens_fails_the_run(
        serve_runtime: ServeRuntime) -> None:
    """Before: TOOL_CALL_END and RUN_FINISHED: the client ran a call with broken JSON. Now
    OUTPUT_TRUNCATED, as through the direct Anthropic adapter."""
    model = _ScriptedChatModel(script=[*LC_CALL, lc_end({"stop_reason": "max_tokens"})])
    async with serve_runtime(CopilotRuntime(service_adapter=LangChainAdapter(model))) \
            as served:
        events = await run(served, run_input("paint", tools=[SET_COLOR]))
    assert "'setColor'" in truncated(events)


async def test_a_langchain_gemini_answer_that_failed_is_the_runs_error(
        serve_runtime: ServeRuntime) -> None:
    """Before: ChatGoogleGenerativeAI's MALFORMED_FUNCTION_CALL (and Gemini's other failures)
    ended in RUN_STARTED, RUN_FINISHED: nothing said, as if complete. Now the error the direct
    Gemini adapter gives."""
    model = _ScriptedChatModel(script=[lc_end({"finish_reason": "MALFORMED_FUNCTION_CALL"})])
    async with serve_runtime(CopilotRuntime(service_adapter=LangChainAdapter(model))) \
            as served:
        events = await run(served, run_input("hi"))
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"], events
    assert events[-1]["message"].endswith(
        "Gemini produced a malformed function call (MALFORMED_FUNCTION_CALL)"), events[-1]


@pytest.mark.parametrize("metadata", [{"finish_reason": "SAFETY"}, {"stop_reason": "refusal"}])
async def test_a_langchain_answer_withheld_whole_is_content_filtered(
        serve_runtime: ServeRuntime, metadata: dict[str, Any]) -> None:
    """Before: RUN_STARTED, RUN_FINISHED: an empty answer that looked complete, where the
    direct Gemini and Anthropic adapters say CONTENT_FILTERED. Now CONTENT_FILTERED too."""
    model = _ScriptedChatModel(script=[lc_end(metadata)])
    async with serve_runtime(CopilotRuntime(service_adapter=LangChainAdapter(model))) \
            as served:
        events = await run(served, run_input("hi"))
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"], events
    assert events[-1]["code"] == "CONTENT_FILTERED", events[-1]
