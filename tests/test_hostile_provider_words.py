"""What an LLM provider says reaches a client only the way `upstream_said` passes it on.

A scripted loopback upstream (`test_hostile_providers`) answers with an error body, or with an
error event in the middle of its stream, holding a stack trace, 6.6 KB of text, or the API key
the runtime sent it (32 hex characters: an Azure-style key no pattern knows). On every route
(direct and SDK) of OpenAI, Anthropic and Gemini, the client's `RUN_ERROR` (and the GraphQL
`FailedResponseStatus`) and the stored thread must hold no trace, no key, and at most about
500 characters of the upstream's words. Also: parallel tool calls sharing one `index`
(Ollama; also through LangChain's ChatOpenAI), refusals and content-filtered answers, and the
codes of Anthropic's broken streams.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from copilot_runtime._exceptions import WITHHELD
from tests.conftest import ServeRuntime, run_input, text_of, types
from tests.gql.wire import user_turn
from tests.test_graphql_agents import turn
from tests.test_hostile_providers import (
    AN_OPEN_TEXT,
    AN_START,
    HEAD,
    OA_DONE,
    PROVIDER_WORDS,
    SET_COLOR,
    Step,
    an,
    an_delta,
    an_end,
    an_text_block,
    gm_parts,
    hostile,
    oa_finish,
    oa_text,
    oa_tool,
    protocol_error,
    run,
    sse,
    tool_calls,
)

pytestmark = pytest.mark.timeout(60)

PROVIDERS = ["openai", "anthropic", "google"]
TRANSPORTS = ["direct", "sdk"]
KEY = "3f9c2b7e1a4d4c0f8e6b5a2d9c7e1f03"
TRACE = ('Traceback (most recent call last):\n  File "/srv/llm-gateway/app/handlers.py", '
         'line 88, in handle\n    conn = connect(dsn)\nRuntimeError: the database is down')
LONG = "the upstream is overloaded, " * 240  # 6.7 KB
#: What each upstream says, and what the client must read of it.
WORDS = {"trace": TRACE, "long": LONG, "key": f"quota exceeded for key {KEY}. Check it."}


def status_answer(status: int, body: Any) -> list[Step]:
    data = orjson.dumps(body)
    return [b"HTTP/1.1 %d Error\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (status, len(data), data)]


def error_body(provider: str, message: str) -> dict[str, Any]:
    if provider == "anthropic":
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    if provider == "google":
        return {"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}
    return {"error": {"message": message, "type": "invalid_request_error"}}


def error_mid_stream(provider: str, message: str) -> list[Step]:
    if provider == "openai":
        return [HEAD, oa_text("Hel"), sse({"error": {"message": message, "type": "server"}})]
    if provider == "anthropic":
        return [HEAD, AN_START, AN_OPEN_TEXT, an_delta({"type": "text_delta", "text": "Hel"}),
                an({"type": "error", "error": {"type": "overloaded_error", "message": message}})]
    return [HEAD, gm_parts({"text": "Hel"}),
            sse({"error": {"code": 500, "message": message, "status": "INTERNAL"}})]


def script_for(provider: str, where: str, words: str) -> list[Step]:
    return status_answer(400, error_body(provider, words)) if where == "status" else (
        error_mid_stream(provider, words))


def assert_said_fitly(message: str, case: str) -> None:
    assert KEY not in message, message
    assert "Traceback" not in message, message
    assert len(message) < 600, len(message)
    if case == "trace":
        assert message.endswith(WITHHELD), message
    elif case == "long":
        assert message.endswith("…"), message
    else:
        assert message.endswith("quota exceeded for key [REDACTED]. Check it."), message


# ---- the upstream's words: cut, withheld, its key blanked ------------------------------------


@pytest.mark.parametrize("case", sorted(WORDS))
@pytest.mark.parametrize("where", ["status", "mid-stream"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("provider", PROVIDERS)
async def test_an_upstreams_words_reach_the_client_cut_withheld_and_without_its_key(
        serve_runtime: ServeRuntime, provider: str, transport: str, where: str,
        case: str) -> None:
    """Before: every status error body passed whole on the direct routes and the OpenAI and
    Gemini SDK routes (a trace, a 6.6 KB message); OpenAI's and Gemini's SDK mid-stream errors
    whole; and a mid-stream error echoing the key, on every route, kept it (in the client's
    RUN_ERROR and in the stored thread)."""
    thread = f"t-{provider}-{transport}-{where}-{case}"
    async with hostile(serve_runtime, provider, script_for(provider, where, WORDS[case]),
                       transport=transport, api_key=KEY) as (served, _):
        events = await run(served, run_input("hi", thread=thread))  # (no trace: assert_clean)
        stored = await (await served.session.get(
            served.url + f"/threads/{thread}/events")).read()
    assert types(events)[-1] == "RUN_ERROR", events
    message = events[-1]["message"]
    assert PROVIDER_WORDS[provider] in message, message
    assert_said_fitly(message, case)
    assert KEY.encode() not in stored
    assert b"Traceback" not in stored
    assert message.encode() in stored  # (the stored thread holds what the client read)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_credential_in_a_custom_header_is_blanked_too(
        serve_runtime: ServeRuntime, transport: str) -> None:
    """An Azure-style `api-key` header the application adds (`default_headers`): the key the
    request carried, whichever header carried it, never comes back to the client."""
    words = f"the key {KEY} has no quota left"
    async with hostile(serve_runtime, "openai", error_mid_stream("openai", words),
                       transport=transport, default_headers={"api-key": KEY}) as (served, _):
        events = await run(served, run_input("hi"))
    assert events[-1]["message"] == (
        "OpenAI reported an error mid-stream: the key [REDACTED] has no quota left")


async def test_graphql_clients_read_the_same_words(serve_runtime: ServeRuntime) -> None:
    """The 1.10 client shows `details.description`: the same cut, withheld, keyless words."""
    for provider, where, case in [("openai", "mid-stream", "key"),
                                  ("anthropic", "status", "trace"),
                                  ("google", "mid-stream", "long")]:
        async with hostile(serve_runtime, provider, script_for(provider, where, WORDS[case]),
                           transport="sdk", api_key=KEY) as (served, _):
            response = await turn(served, user_turn("hi", thread=f"gql-{provider}"))
        status = response["status"]
        assert status["__typename"] == "FailedResponseStatus", status
        assert KEY not in orjson.dumps(response).decode()
        assert_said_fitly(status["details"]["description"], case)
        assert status["details"]["originalError"]["code"] == "NETWORK_ERROR"


# ---- parallel tool calls sharing one index ---------------------------------------------------


def oa_calls(*calls: dict[str, Any]) -> bytes:
    return sse({"id": "c", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"tool_calls": list(calls)}, "finish_reason": None}]})


def call(call_id: str, colour: str, **index: int) -> dict[str, Any]:
    return {"id": call_id, "type": "function", **index,
            "function": {"name": "setColor", "arguments": orjson.dumps({"c": colour}).decode()}}


SHARED_INDEX: dict[str, list[Step]] = {
    # Ollama: index 0 for each call, in chunks of their own or in one chunk
    "index 0, two chunks": [oa_calls(call("c1", "red", index=0)),
                            oa_calls(call("c2", "blue", index=0))],
    "index 0, one chunk": [oa_calls(call("c1", "red", index=0), call("c2", "blue", index=0))],
    # older builds: no index at all
    "no index": [oa_calls(call("c1", "red")), oa_calls(call("c2", "blue"))],
}


@pytest.mark.parametrize(("case", "transport"), [
    *((case, "direct") for case in SHARED_INDEX),
    # (ChatOpenAI drops tool calls without an index: no "no index" case)
    *((case, "langchain") for case in SHARED_INDEX if case != "no index")])
async def test_parallel_tool_calls_sharing_one_index_stay_two_calls(
        serve_runtime: ServeRuntime, case: str, transport: str) -> None:
    """Before: one call c1 with arguments `{"c":"red"}{"c":"blue"}` (no client parses it), and
    c2 lost (through LangChain's ChatOpenAI too, whose calls were keyed by index alone). Now
    a new id at an index in use starts a new call."""
    script = [HEAD, *SHARED_INDEX[case], oa_finish("tool_calls"), OA_DONE]
    async with hostile(serve_runtime, "openai", script, transport=transport) as (served, _):
        events = await run(served, run_input("paint", thread="t-shared", tools=[SET_COLOR]))
        stored = await (await served.session.get(
            served.url + "/threads/t-shared/messages")).json()
    assert types(events)[-1] == "RUN_FINISHED", events
    assert tool_calls(events) == {"c1": ("setColor", {"c": "red"}),
                                  "c2": ("setColor", {"c": "blue"})}
    (assistant,) = [m for m in stored["messages"] if m.get("toolCalls")]
    assert [c["id"] for c in assistant["toolCalls"]] == ["c1", "c2"]


@pytest.mark.parametrize("transport", ["direct", "langchain"])
async def test_a_call_whose_id_comes_again_with_each_piece_stays_one_call(
        serve_runtime: ServeRuntime, transport: str) -> None:
    """Regression guard (passes on the old code too): an id repeated in every delta of one
    call does not split it."""
    script: list[Step] = [HEAD, oa_tool(0, "c1", "setColor", '{"c":'),
                          oa_tool(0, "c1", None, '"red"}'), oa_tool(1, "c2", "setColor", ""),
                          oa_tool(1, "c2", None, '{"c":"blue"}'),
                          oa_finish("tool_calls"), OA_DONE]
    async with hostile(serve_runtime, "openai", script, transport=transport) as (served, _):
        events = await run(served, run_input("paint", tools=[SET_COLOR]))
    assert tool_calls(events) == {"c1": ("setColor", {"c": "red"}),
                                  "c2": ("setColor", {"c": "blue"})}


# ---- refusals and filtered answers -----------------------------------------------------------


async def test_an_openai_refusal_is_the_answers_text(serve_runtime: ServeRuntime) -> None:
    """Before: `delta.refusal` was not decoded: RUN_STARTED, RUN_FINISHED and nothing else."""
    refusal = sse({"id": "c", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"refusal": "I can't help with that."}, "finish_reason": None}]})
    async with hostile(serve_runtime, "openai", [HEAD, refusal, oa_finish(), OA_DONE]) \
            as (served, _):
        events = await run(served, run_input("hi"))
    assert types(events)[-1] == "RUN_FINISHED", events
    assert text_of(events) == "I can't help with that."


FILTERED: dict[str, list[Step]] = {
    "openai": [HEAD, oa_finish("content_filter"), OA_DONE],
    "anthropic": [HEAD, AN_START, *an_end("refusal")],
    "google": [HEAD, gm_parts(reason="SAFETY")],
    # Gemini's other filters ended as an empty, finished answer.
    **{f"google {reason}": [HEAD, gm_parts(reason=reason)] for reason in (
        "IMAGE_PROHIBITED_CONTENT", "IMAGE_RECITATION", "MODEL_ARMOR")},
}


@pytest.mark.parametrize("case", FILTERED)
async def test_an_answer_the_filter_withheld_whole_is_a_precise_error(
        serve_runtime: ServeRuntime, case: str) -> None:
    """Before: an empty answer and RUN_FINISHED: the user saw nothing, and no reason."""
    provider = case.split()[0]
    async with hostile(serve_runtime, provider, FILTERED[case]) as (served, _):
        events = await run(served, run_input("hi", thread="t-filtered"))
        response = await turn(served, user_turn("hi", thread="gql-filtered"))
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"], events
    assert events[-1]["code"] == "CONTENT_FILTERED"
    assert events[-1]["message"] == (
        f"The model gave no answer: the {provider} content filter withheld it")
    status = response["status"]
    assert status["__typename"] == "FailedResponseStatus", status
    assert status["details"]["originalError"]["originalErrorType"] == "CONTENT_FILTERED"
    assert status["details"]["description"] == events[-1]["message"]


async def test_an_answer_the_filter_cut_keeps_its_text(serve_runtime: ServeRuntime) -> None:
    """Text before the filter stopped the answer stays a finished answer, whose RUN_FINISHED
    says why it ended (on 1.10, a successful turn)."""
    script: list[Step] = [HEAD, oa_text("Here is"), oa_finish("content_filter"), OA_DONE]
    async with hostile(serve_runtime, "openai", script) as (served, _):
        events = await run(served, run_input("hi"))
        response = await turn(served, user_turn("hi", thread="gql-cut"))
    assert types(events)[-1] == "RUN_FINISHED", events
    assert events[-1]["result"] == {"finishReason": "content_filter"}
    assert text_of(events) == "Here is"
    assert response["status"]["__typename"] == "SuccessResponseStatus", response["status"]


# ---- Anthropic: one code per fault, whichever route ------------------------------------------

ANTHROPIC_BROKEN: dict[str, list[Step]] = {
    "malformed JSON": [HEAD, AN_START, b"event: content_block_delta\ndata: {not json\n\n",
                       *an_end()],
    "not an object": [HEAD, AN_START, b"data: [1, 2]\n\n", *an_end()],
    "no message_stop": [HEAD, AN_START, *an_text_block("a"), an_end()[0]],
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", ANTHROPIC_BROKEN)
async def test_anthropic_protocol_faults_are_protocol_errors_on_both_routes(
        serve_runtime: ServeRuntime, case: str, transport: str) -> None:
    """Before: malformed JSON and a non-object frame were UPSTREAM_ERROR (README: protocol
    error, as for OpenAI and Gemini), and a stream ended without `message_stop` was
    UPSTREAM_CONNECTION_ERROR through the SDK, UPSTREAM_PROTOCOL_ERROR directly."""
    async with hostile(serve_runtime, "anthropic", ANTHROPIC_BROKEN[case],
                       transport=transport) as (served, _):
        events = await run(served, run_input("hi"))
    protocol_error(events, "anthropic")
