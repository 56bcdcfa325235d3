"""The bounds on a GraphQL document that keep one small request from holding the worker:
selections counted with fragments expanded, and one `loadAgentState` per operation."""

from __future__ import annotations

import asyncio
import io
import time
from typing import Any

import orjson
import pytest
from graphql import get_introspection_query

from copilot_runtime.protocols.graphql.documents import DocumentCache
from copilot_runtime.protocols.graphql.schema import copilot_schema
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import ServeRuntime, openai_runtime
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_DOCUMENT, OTHER_CLIENT_HEADERS, chat_data

SELECTIONS = ("The document makes more than 300 selections (fields and fragments); at most "
              "300 are served")
# The 1.10 client's own query (`@copilotkit/runtime-client-gql`).
LOAD_STATE = """query loadAgentState($data: LoadAgentStateInput!) {
    loadAgentState(data: $data) { threadId threadExists state messages } }"""


def introspection_fanout(outer: int, inner: int) -> str:
    """Fragment S holds `inner` aliased `types { ...F }`; the query spreads S under `outer`
    aliased `__schema`: 20x20 is 66 selections as written, 8,900 executed."""
    f = ("fragment F on __Type { fields { type { ofType { fields { type { ofType { name } } } } } "
         "} }")
    s = "fragment S on __Schema { " + " ".join(f"a{i}: types {{ ...F }}"
                                               for i in range(inner)) + " }"
    return "{ " + " ".join(f"s{i}: __schema {{ ...S }}" for i in range(outer)) + " } " + s + " " + f


def message_fanout(outer: int, inner: int) -> str:
    """`outer` aliased `messages { ...M }`, M holding `inner` aliased `content`: every chunk
    of a streamed message is sent `outer * inner` times."""
    m = "fragment M on TextMessageOutput { " + " ".join(f"c{i}: content"
                                                        for i in range(inner)) + " }"
    r = "fragment R on CopilotResponse { " + " ".join(f"m{i}: messages {{ ...M }}"
                                                      for i in range(outer)) + " }"
    return ("mutation chat($data: GenerateCopilotResponseInput!) { "
            "generateCopilotResponse(data: $data) { threadId ...R } } " + r + " " + m)


def refused(text: str) -> str | None:
    prepared = DocumentCache(copilot_schema()).get(text)
    if prepared.document is not None:
        return None
    assert prepared.code == "GRAPHQL_VALIDATION_FAILED"
    return "; ".join(error.message for error in prepared.errors)


def test_fragments_count_as_often_as_they_are_spread() -> None:
    """Before: each spread counted once whatever its fragment held, so the 20x20 document
    (66 selections as written) held the event loop 6.7 s and answered 2.6 MB; the message
    fan-out (295 as written) cost 0.9 s and grew with every chunk streamed."""
    assert refused(introspection_fanout(20, 20)) == SELECTIONS
    assert refused(introspection_fanout(40, 40)) == SELECTIONS
    assert refused(message_fanout(100, 95)) == SELECTIONS
    # Nested fragments multiply: 3 spreads of G, each 3 spreads of H (101 fields): 909.
    nested = ("{ ...G ...G ...G } fragment G on Query { ...H ...H ...H } "
              "fragment H on Query { " + " ".join(f"a{i}: hello" for i in range(101)) + " }")
    assert refused(nested) == SELECTIONS
    # 3 spreads + 3 * 99 fields = 300 selections expanded: served; one spread more is not.
    within = ("{ ...K ...K ...K } fragment K on Query { "
              + " ".join(f"a{i}: hello" for i in range(99)) + " }")
    assert refused(within) is None
    assert refused(within.replace("...K ...K ...K", "...K ...K ...K ...K")) == SELECTIONS
    # A cycle (which validation names) neither loops nor is blamed on the size.
    cycle = refused("{ ...A } fragment A on Query { hello ...B } fragment B on Query { ...A }")
    assert cycle is not None
    assert "cannot spread fragment" in cycle.lower()
    # The client's documents and a tool's whole introspection stay within the bounds.
    for document in (CHAT_DOCUMENT, CLIENT_DOCUMENT, LOAD_STATE,
                     get_introspection_query(descriptions=True, specified_by_url=True,
                                             directive_is_repeatable=True,
                                             schema_description=True,
                                             input_value_deprecation=True)):
        assert refused(document) is None


def test_load_agent_state_once_per_operation() -> None:
    """Before: ~149 aliased `loadAgentState` in one query each read and serialised the whole
    thread (up to the 32 MB replay cap): a 300 MB answer built in memory."""
    once = "may select loadAgentState once at most"
    many = ("query q($d: LoadAgentStateInput!) { "
            + " ".join(f"a{i}: loadAgentState(data: $d) {{ messages }}" for i in range(149))
            + " }")
    message = refused(many)
    assert message is not None
    assert once in message
    assert "under 149 names" in message
    # Through fragments and inline fragments, @skip and @include notwithstanding.
    spread = ("query q($d: LoadAgentStateInput!, $no: Boolean!) { "
              "a: loadAgentState(data: $d) { state } ...L "
              "... @include(if: $no) { c: loadAgentState(data: $d) { threadId } } } "
              "fragment L on Query { b: loadAgentState(data: $d) @skip(if: $no) { messages } }")
    message = refused(spread)
    assert message is not None
    assert once in message
    assert "under 3 names" in message
    # One response key, however many times it is selected, is resolved once.
    assert refused("query q($d: LoadAgentStateInput!) { loadAgentState(data: $d) { state } "
                   "...L } fragment L on Query { loadAgentState(data: $d) { messages } }"
                   ) is None
    # One per operation: a document may hold several operations.
    assert refused("query a($d: LoadAgentStateInput!) { loadAgentState(data: $d) { state } } "
                   "query b($d: LoadAgentStateInput!) { loadAgentState(data: $d) { state } }"
                   ) is None


@pytest.mark.asyncio
async def test_fanned_out_documents_are_refused_quickly_over_http(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(openai_runtime(llm)) as served:
        async def post(text: str, variables: dict[str, Any] | None = None
                       ) -> tuple[int, dict[str, Any], float]:
            started = time.monotonic()
            response = await served.session.post(
                served.url, json={"query": text, "variables": variables or {}},
                headers=OTHER_CLIENT_HEADERS)
            answer = await response.json()
            return response.status, answer, time.monotonic() - started

        status, answer, took = await post(introspection_fanout(20, 20))
        assert status == 400
        assert took < 2.0  # was 6.7 s (a loaded machine still answers in well under 2)
        assert answer["errors"] == [{"message": SELECTIONS,
                                     "extensions": {"code": "GRAPHQL_VALIDATION_FAILED"}}]
        status, answer, took = await post(
            "query q { " + " ".join(f"a{i}: loadAgentState(data: {{threadId: \"t\", "
                                    f"agentName: \"default\"}}) {{ messages }}"
                                    for i in range(3)) + " }")
        assert status == 400
        assert took < 2.0
        (error,) = answer["errors"]
        assert error["extensions"] == {"code": "GRAPHQL_VALIDATION_FAILED"}
        status, answer, _ = await post(LOAD_STATE, {"data": {"threadId": "t",
                                                             "agentName": "default"}})
        assert status == 200
        assert answer == {"data": {"loadAgentState": {
            "threadId": "t", "threadExists": False, "state": "{}", "messages": "[]"}}}


def schema_walk(aliases: int) -> str:
    """`aliases` aliased walks of every type's fields, their types and arguments: 15
    selections each, no fragment, within the document bounds at 20."""
    walk = ("types { name fields { name type { name ofType { name ofType { name } } } "
            "args { name type { name } } } }")
    return "{ " + " ".join(f"w{i}: __schema {{ {walk} }}" for i in range(aliases)) + " }"


@pytest.mark.asyncio
async def test_a_query_resolving_too_many_fields_is_refused(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """300 selections as written, no fragment: the lists multiplied them to ~22,000 fields
    resolved, ~0.5 s of the event loop on every request (only parsing is cached). Now a
    query resolves at most 4,000 fields; a whole introspection (~3,200) is still served."""
    assert refused(schema_walk(20)) is None  # within the document's own bounds
    async with serve_runtime(openai_runtime(llm)) as served:
        async def post(text: str) -> tuple[int, dict[str, Any]]:
            response = await served.session.post(served.url, json={"query": text},
                                                 headers=OTHER_CLIENT_HEADERS)
            return response.status, await response.json()

        status, answer = await post(schema_walk(20))
        assert (status, answer) == (400, {"errors": [{
            "message": "The query resolves more than 4,000 fields: ask for fewer",
            "extensions": {"code": "BAD_REQUEST"}}]})
        status, answer = await post(get_introspection_query(descriptions=True))
        assert status == 200
        assert "errors" not in answer
        assert answer["data"]["__schema"]["queryType"]["name"] == "Query"
        status, answer = await post(schema_walk(3))
        assert status == 200
        assert len(answer["data"]) == 3


@pytest.mark.asyncio
async def test_large_invalid_variables_are_judged_off_the_event_loop(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """A million `{}` messages took the worker's event loop ~150 s to refuse (graphql-core
    walked and reported every one). Now a list of more than 20,000 values is refused at
    once, errors stop at 50, and graphql-core's walk of a large invalid input (here 2
    million arrays under 20,000 messages) runs off the loop."""
    async with serve_runtime(openai_runtime(llm)) as served:
        async def post(messages: list[Any]) -> tuple[int, list[dict[str, Any]], float]:
            body = orjson.dumps({"query": CHAT_DOCUMENT,
                                 "variables": {"data": chat_data(messages)}})
            # A stall in the event loop's own CPU time (this thread's, between two ticks):
            # other processes' load lengthens its wall time, not this.
            worst, last, done = 0.0, time.thread_time(), False

            async def tick() -> None:
                nonlocal worst, last
                while not done:
                    await asyncio.sleep(0.01)
                    now = time.thread_time()
                    worst, last = max(worst, now - last), now

            ticking = asyncio.create_task(tick())
            try:
                response = await served.session.post(
                    served.url, data=io.BytesIO(body),
                    headers={**OTHER_CLIENT_HEADERS, "Content-Type": "application/json"})
                answer = await response.json()
            finally:
                done = True
                await ticking
            return response.status, answer["errors"], worst

        status, errors, _ = await post([{}] * 1_000_000)
        assert status == 400
        assert [e["message"] for e in errors] == [
            "Variable '$data' has a list of more than 20,000 values: at most that many are "
            "taken"]
        status, errors, worst = await post([{"a": [[]] * 100}] * 20_000)
        assert status == 400
        assert len(errors) == 51
        assert errors[-1]["message"].startswith("Too many errors processing variables")
        # (the walk on the loop: 0.58 s of its CPU here; off it: 0.014 s. Measured in wall
        # time, a load average of ~10 made the walk off the loop fail a 3.5 s bound.)
        assert worst < 0.25, f"the event loop stalled for {worst:.2f} s of its CPU time"
