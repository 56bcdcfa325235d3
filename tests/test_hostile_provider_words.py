"""What an LLM provider says reaches a client only the way `upstream_said` passes it on.

A scripted loopback upstream (`test_hostile_providers`) answers with an error body, or with an
error event in the middle of its stream, holding a stack trace, 6.6 KB of text, or the API key
the runtime sent it (32 hex characters: an Azure-style key no pattern knows). On every route
(direct and SDK) of OpenAI, Anthropic and Gemini, the client's `RUN_ERROR` (and the GraphQL
`FailedResponseStatus`) and the stored thread must hold no trace, no key, and at most about
500 characters of the upstream's words. Also: the codes of Anthropic's broken streams.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from copilot_runtime._exceptions import WITHHELD
from tests.conftest import ServeRuntime, run_input, types
from tests.gql.wire import user_turn
from tests.test_graphql_agents import turn
from tests.test_hostile_providers import (
    AN_OPEN_TEXT,
    AN_START,
    HEAD,
    PROVIDER_WORDS,
    Step,
    an,
    an_delta,
    an_end,
    an_text_block,
    gm_parts,
    hostile,
    oa_text,
    protocol_error,
    run,
    sse,
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
