"""Input that was accepted at one edge and broke a later stage, and paths decoded twice.

- A GraphQL `JSONObject` literal in the document (`properties: {big: 2**64}`) has no size
  limit in GraphQL, but orjson (the stream, every store) writes only 64-bit integers: the
  run streamed and was then not stored (SQLite and PostgreSQL: thread 404; memory: the
  user's messages lost). Such a literal, or one nested deeper than `MAX_JSON_DEPTH`, is now
  a GraphQL validation error (400) before anything runs.
- `forwardedParameters.maxTokens` of 1e300 or 2.0**64 became an integer beyond 64 bits:
  "Agent failed unexpectedly" with a stack trace in the log, and the run not stored. It is
  now refused as the client's mistake (MISUSE, 400) and the thread stays readable.
- An agent's event a store cannot encode (a CUSTOM value with an integer beyond 64 bits)
  made the raw events unwritable, so the whole run was not stored (SQLite, PostgreSQL):
  it is now written in a reduced form, while running and at the end.
- Thread, stop and approval routes unquoted a path the server had decoded already:
  `threads/a%2541` named thread `aA`, and an id holding `/` (sent as `%2F`) was unreachable.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yarl
from structlog.testing import capture_logs

from copilot_runtime import (
    Agent,
    CopilotRuntime,
    RunContext,
    RunInput,
    coordinator,
    create_app,
    thread_store,
)
from copilot_runtime import events as ev
from copilot_runtime._limits import MAX_JSON_DEPTH
from copilot_runtime.events import EventBatches
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.threads import StoredRun, ThreadStore
from tests.conftest import (
    GatedAgent,
    Served,
    ServeRuntime,
    openai_runtime,
    parse_sse,
    poll,
    run_input,
    text_of,
    types,
)
from tests.gql.wire import (
    CHAT_DOCUMENT,
    CLIENT_HEADERS,
    OTHER_CLIENT_HEADERS,
    chat_data,
    merge,
    parse_multipart,
    text_message,
    user_turn,
)
from tests.hitl_support.postgres import postgres_schema

pytestmark = pytest.mark.timeout(60)

#: Thread ids a double decode confuses: `a%41` decoded twice is `aA`; `a/b` holds a slash.
ODD_THREADS = ("aA", "a%41", "a/b")


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_schema() as url:
        yield url


def _store_options(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    if kind == "postgresql":
        url = request.getfixturevalue("pg_url")
        return {"thread_store": thread_store(url), "coordinator": coordinator(url)}
    if kind == "sqlite":
        return {"thread_store": thread_store(f"sqlite:///{tmp_path / 'threads.db'}")}
    return {}


class WhoAgent(Agent):
    """Names the thread it runs on, in its answer and in its state."""

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input.thread_id, input.run_id)

    async def _run(self, thread_id: str, run_id: str) -> EventBatches:
        message = f"m-{run_id}"
        yield [ev.state_snapshot({"thread": thread_id}), ev.text_message_start(message),
               ev.text_message_content(message, f"on {thread_id}"),
               ev.text_message_end(message)]


class HugeValueAgent(Agent):
    """Says "one ", sends a CUSTOM event holding integers beyond 64 bits, then (once `gate`
    is set, when there is one) says "two"."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        super().__init__()
        self.gate = gate

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input.run_id)

    async def _run(self, run_id: str) -> EventBatches:
        message = f"m-{run_id}"
        yield [ev.text_message_start(message), ev.text_message_content(message, "one "),
               ev.custom("huge", {"n": 2**70, "list": [1, -(2**64)]})]
        if self.gate is not None:
            await self.gate.wait()
        yield [ev.text_message_content(message, "two"), ev.text_message_end(message)]


@pytest.fixture(params=["memory", "postgresql"])
async def served(request: pytest.FixtureRequest, llm: MockOpenAIServer, tmp_path: Path,
                 serve_runtime: ServeRuntime) -> AsyncIterator[Served]:
    options = _store_options(request.param, request, tmp_path)
    runtime = openai_runtime(llm, agents={"who": WhoAgent()}, **options)
    async with serve_runtime(runtime) as s:
        yield s


def assert_clean(body: bytes) -> None:
    """No stack trace or file path reaches a client."""
    for marker in (b"Traceback", b'File "', b".py", b"/site-packages/", b"TypeError",
                   b"64-bit range"):
        assert marker not in body, body[:400]


def quoted(thread_id: str) -> str:
    return urllib.parse.quote(thread_id, safe="")


async def answer(served: Served, method: str, path: str, body: Any = None,
                 headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """`path` sent exactly as written (aiohttp normalizes `%41` to `A` unless told not to)."""
    data = None if body is None else orjson.dumps(body)
    async with served.session.request(
            method, yarl.URL(served.url + path, encoded=True), data=data,
            headers={"Content-Type": "application/json", **(headers or {})}) as response:
        return response.status, await response.read()


async def answer_httpx(client: httpx.AsyncClient, served: Served, method: str, path: str,
                       body: Any = None) -> tuple[int, bytes]:
    """The same through httpx, with the already-encoded path as the raw target."""
    url = httpx.URL(served.url + path)
    assert url.raw_path.split(b"?")[0].endswith(path.split("?")[0].encode())  # not re-encoded
    response = await client.request(method, url, content=None if body is None
                                    else orjson.dumps(body),
                                    headers={"Content-Type": "application/json"})
    return response.status_code, response.content


async def graphql(served: Served, document: str, data: dict[str, Any],
                  headers: dict[str, str] = CLIENT_HEADERS) -> tuple[int, bytes]:
    return await answer(served, "POST", "", {"query": document, "variables": {"data": data}},
                        headers=headers)


def streamed(body: bytes) -> dict[str, Any]:
    """The merged `generateCopilotResponse` of a multipart answer."""
    merged = merge(parse_multipart(body))
    assert "errors" not in merged, merged
    result: dict[str, Any] = merged["data"]["generateCopilotResponse"]
    return result


async def messages_of(served: Served, thread_id: str) -> list[tuple[str, Any]]:
    status, body = await answer(served, "GET", f"/threads/{quoted(thread_id)}/messages")
    assert status == 200, (thread_id, body)
    return [(m["role"], m.get("content")) for m in orjson.loads(body)["messages"]]


def with_properties(literal: str) -> str:
    """The chat document with `properties` written as a literal instead of a variable."""
    document = CHAT_DOCUMENT.replace(", $properties: JSONObject", "").replace(
        "properties: $properties", f"properties: {literal}")
    assert literal in document
    return document


# -- GraphQL JSON literals: 64-bit integers, bounded depth ----------------------------------

_TOO_BIG = "JSON integers must fit in 64 bits"
HOSTILE_LITERALS = {
    "one-past-u64": ("{big: 18446744073709551616}", _TOO_BIG),
    "one-below-i64": ("{small: -9223372036854775809}", _TOO_BIG),
    "nested-huge": ("{a: [1, {b: 123456789012345678901234567890}]}", _TOO_BIG),
    "too-deep": ("{d: " + "[" * MAX_JSON_DEPTH + "1" + "]" * MAX_JSON_DEPTH + "}",
                 f"JSON is nested too deep (at most {MAX_JSON_DEPTH} levels)"),
}


async def test_graphql_literals_beyond_64_bits_or_too_deep_are_refused(
        served: Served, llm: MockOpenAIServer) -> None:
    """Before: each streamed a run (200) that then was not stored, or (too deep) was run."""
    status, body = await graphql(served, CHAT_DOCUMENT, user_turn("before", thread="lit-0"))
    assert status == 200, body
    assert streamed(body)["status"]["code"] == "Success"
    asked = len(llm.requests)
    for index, (name, (literal, message)) in enumerate(HOSTILE_LITERALS.items(), 1):
        thread = f"lit-{index}"
        status, body = await graphql(served, with_properties(literal),
                                     user_turn(f"hostile {name}", thread=thread),
                                     OTHER_CLIENT_HEADERS)
        assert status == 400, (name, body[:300])
        assert_clean(body)
        assert orjson.loads(body) == {"errors": [{
            "message": message, "extensions": {"code": "GRAPHQL_VALIDATION_FAILED"}}]}, name
        # Nothing ran, nothing was stored.
        status, body = await answer(served, "GET", f"/threads/{thread}/messages")
        assert status == 404, (name, body)
    assert len(llm.requests) == asked
    # The thread stored before stays readable, and the server still serves it.
    assert await messages_of(served, "lit-0") == [
        ("user", "before"), ("assistant", "echo: before")]
    again = chat_data([text_message("sys-1", "system", "Be brief."),
                       text_message("user-1", "user", "before"),
                       text_message("user-2", "user", "after")], thread="lit-0")
    status, body = await graphql(served, CHAT_DOCUMENT, again)
    assert status == 200, body
    assert streamed(body)["status"]["code"] == "Success"
    assert (await messages_of(served, "lit-0"))[-2:] == [
        ("user", "after"), ("assistant", "echo: after")]


async def test_graphql_literals_at_the_64_bit_and_depth_limits_still_work(
        served: Served, llm: MockOpenAIServer) -> None:
    """Control (passes on the old code too): the largest and smallest integers orjson writes,
    and a literal exactly `MAX_JSON_DEPTH` levels deep, run and are stored."""
    deep = "[" * (MAX_JSON_DEPTH - 1) + "0" + "]" * (MAX_JSON_DEPTH - 1)
    literal = ("{u64: 18446744073709551615, i64: -9223372036854775808, "
               f"big: 9007199254740993, deep: {deep}}}")
    status, body = await graphql(served, with_properties(literal),
                                 user_turn("edge values", thread="lit-edge"))
    assert status == 200, body[:300]
    assert streamed(body)["status"]["code"] == "Success"
    assert await messages_of(served, "lit-edge") == [
        ("user", "edge values"),
        ("assistant", "echo: edge values")]
    assert llm.requests[-1]["messages"][-1]["content"] == "edge values"


# -- GraphQL maxTokens beyond 64 bits ----------------------------------------------------


@pytest.mark.parametrize("max_tokens", [1e300, 2.0**64], ids=["1e300", "2.0**64"])
async def test_graphql_max_tokens_beyond_64_bits_is_the_client_s_mistake(
        served: Served, llm: MockOpenAIServer, max_tokens: float) -> None:
    """Before: "Agent 'default' failed unexpectedly" (UNKNOWN, 500), a stack trace in the
    log, and the run not stored (thread 404; memory: the user's message lost)."""
    thread = f"tokens-{max_tokens:.0e}"
    asked = len(llm.requests)
    with capture_logs() as logs:
        status, body = await graphql(served, CHAT_DOCUMENT, user_turn(
            "hi", thread=thread, forwardedParameters={"maxTokens": max_tokens}))
    assert status == 200, body[:300]
    assert_clean(body)
    result = streamed(body)["status"]
    assert result["code"] == "Failed", result
    assert "maxTokens" in result["details"]["description"]
    assert "unexpectedly" not in result["details"]["description"]
    original = result["details"]["originalError"]
    assert (original["code"], original["statusCode"]) == ("MISUSE", 400), original
    failures = [e for e in logs if e.get("exc_info") or e["log_level"] in ("error", "critical")]
    assert failures == [], failures
    assert len(llm.requests) == asked  # refused before the model is asked
    # The thread is stored with the user's message, and a good request on it works.
    assert await messages_of(served, thread) == [("user", "hi")]
    again = chat_data([text_message("sys-1", "system", "Be brief."),
                       text_message("user-1", "user", "hi"),
                       text_message("user-2", "user", "again")],
                      thread=thread, forwardedParameters={"maxTokens": 100})
    status, body = await graphql(served, CHAT_DOCUMENT, again)
    assert status == 200, body
    assert streamed(body)["status"]["code"] == "Success"
    assert llm.requests[-1]["max_tokens"] == 100
    assert (await messages_of(served, thread))[-2:] == [
        ("user", "again"), ("assistant", "echo: again")]


# -- an event no store can encode ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
@pytest.mark.parametrize("running", [False, True], ids=["at-the-end", "while-running"])
async def test_an_event_a_store_cannot_encode_leaves_the_run_stored(
        request: pytest.FixtureRequest, llm: MockOpenAIServer, tmp_path: Path,
        serve_runtime: ServeRuntime, kind: str, running: bool) -> None:
    """Before: the raw events could not be written ("could not store run", and while running
    "could not write a running run's events"): the thread did not exist afterwards."""
    options = _store_options(kind, request, tmp_path)
    store: ThreadStore = options["thread_store"]
    gate = asyncio.Event()
    if not running:
        gate.set()
    runtime: CopilotRuntime = openai_runtime(llm, agents={"huge": HugeValueAgent(gate)},
                                             **options)
    thread = f"huge-{'running' if running else 'end'}"
    with capture_logs() as logs:
        async with serve_runtime(runtime) as served:
            task = asyncio.create_task(served.run(run_input("hi", thread=thread, run="r1"),
                                                  agent="huge"))
            if running:
                # Written as it goes (every FLUSH_INTERVAL), the huge value reduced.
                written: list[Any] = []
                async for _ in poll(within=10):
                    written = [e for _, e in await store.events_after(thread, -1)]
                    if len(written) >= 4:
                        break
                # One event for each streamed (positions kept), the huge value left out.
                assert types(written)[:3] == [
                    "RUN_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT"], written
                assert len(written) == 4, written
                assert str(2**70).encode() not in orjson.dumps(written)
                gate.set()
            events = await asyncio.wait_for(task, 30)
            assert types(events)[-1] == "RUN_FINISHED"
            assert text_of(events) == "one two"
            status, body = await answer(served, "GET", f"/threads/{thread}/events")
            assert status == 200, body
            stored = orjson.loads(body)["events"]
            assert types(stored) == ["RUN_STARTED", "TEXT_MESSAGE_START",
                                     "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END",
                                     "RUN_FINISHED"]
            assert await messages_of(served, thread) == [
                ("user", "hi"), ("assistant", "one two")]
            # Replayed to a client that connects, and the thread takes another run.
            status, body = await answer(served, "POST", "/agent/huge/connect",
                                        run_input("", thread=thread, run="c"))
            assert status == 200, body
            replayed = parse_sse(body)
            assert types(replayed)[0] == "RUN_STARTED"
            assert types(replayed)[-1] == "RUN_FINISHED"
            assert text_of(replayed) == "one two"
            again = await served.run(run_input("again", thread=thread, run="r2"),
                                     agent="huge")
            assert types(again)[-1] == "RUN_FINISHED"
            record = await store.get(thread)
            assert record is not None
            assert [run.run_id for run in record.runs] == ["r1", "r2"]
    failed = [e["event"] for e in logs if e["log_level"] in ("error", "critical")]
    assert failed == [], failed


# -- percent-encoded ids in paths: decoded once ---------------------------------------------


async def test_thread_routes_touch_exactly_the_thread_named(served: Served) -> None:
    """Before: `threads/a%2541/...` read, renamed and deleted thread `aA`, and `a/b` (sent as
    `a%2Fb`) was a 404 on every route."""
    for index, thread in enumerate(ODD_THREADS):
        events = await served.run(run_input(f"I am {thread}", thread=thread,
                                            run=f"r{index}"), agent="who")
        assert types(events)[-1] == "RUN_FINISHED"

    async with httpx.AsyncClient(timeout=30) as client:
        async def both(method: str, path: str, body: Any = None) -> bytes:
            """The same answer through aiohttp and httpx (a read: no change between)."""
            first = await answer(served, method, path, body)
            second = await answer_httpx(client, served, method, path, body)
            assert first == second, (path, first, second)
            assert first[0] == 200, (path, first)
            return first[1]

        async def check_reads(thread: str) -> None:
            spellings = {quoted(thread)}
            if "/" in thread:
                spellings.add(quoted(thread).replace("%2F", "%2f"))
            for path in sorted(spellings):
                messages = orjson.loads(await both("GET", f"/threads/{path}/messages"))
                assert [m.get("content") for m in messages["messages"]] == [
                    f"I am {thread}", f"on {thread}"], (path, messages)
                events = orjson.loads(await both("GET", f"/threads/{path}/events"))["events"]
                assert {e["threadId"] for e in events if "threadId" in e} == {thread}
                state = orjson.loads(await both("GET", f"/threads/{path}/state"))
                assert state == {"state": {"thread": thread}}, (path, state)

        async def listed() -> dict[str, Any]:
            status, body = await answer(served, "GET", "/threads")
            assert status == 200, body
            return {t["id"]: t["name"] for t in orjson.loads(body)["threads"]
                    if t["id"] in ODD_THREADS}

        for thread in ODD_THREADS:
            await check_reads(thread)
        # `a%41` sent as such is `aA` (one decode), on both clients.
        body = orjson.loads(await both("GET", "/threads/a%41/messages"))
        assert body["messages"][0]["content"] == "I am aA"

        # Renaming one names that one only.
        names: dict[str, Any] = dict.fromkeys(ODD_THREADS)
        for index, thread in enumerate(("a%41", "a/b", "aA")):
            change = {"name": f"name of {thread}"}
            path = f"/threads/{quoted(thread)}"
            status, body = (await answer(served, "PATCH", path, change) if index % 2 else
                            await answer_httpx(client, served, "PATCH", path, change))
            assert status == 200, (thread, body)
            names[thread] = change["name"]
            assert await listed() == names, thread

        # Deleting one deletes that one only; the others stay readable.
        left = set(ODD_THREADS)
        for index, thread in enumerate(("a%41", "a/b", "aA")):
            path = f"/threads/{quoted(thread)}"
            status, body = (await answer(served, "DELETE", path) if index % 2 else
                            await answer_httpx(client, served, "DELETE", path))
            assert status == 200, (thread, body)
            left.discard(thread)
            assert set(await listed()) == left, thread
            status, body = await answer(served, "GET", f"{path}/messages")
            assert status == 404, (thread, body)
            for other in sorted(left):
                await check_reads(other)


async def test_stop_route_stops_exactly_the_thread_named(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    """Before: `stop/a%2541` stopped the run on thread `aA`, and `stop/a%2Fb` was a 404."""
    agent = GatedAgent()
    runtime = openai_runtime(llm, agents={"gated": agent})
    async with serve_runtime(runtime) as served, httpx.AsyncClient(timeout=30) as client:
        runs = {thread: asyncio.create_task(served.run(
            run_input("wait", thread=thread, run=f"r-{index}"), agent="gated"))
            for index, thread in enumerate(("aA", "a/b"))}
        async for _ in poll(within=10):
            if {"aA", "a/b"} <= set(runtime.runs.active):
                break
        assert {"aA", "a/b"} <= set(runtime.runs.active)

        status, body = await answer(served, "POST", "/agent/gated/stop/a%2541")
        assert (status, orjson.loads(body)) == (200, {
            "stopped": False, "message": "No active run for thread 'a%41'."})
        status, body = await answer_httpx(client, served, "POST", "/agent/gated/stop/a%2541")
        assert (status, orjson.loads(body)["stopped"]) == (200, False)
        assert {"aA", "a/b"} <= set(runtime.runs.active)

        status, body = await answer_httpx(client, served, "POST", "/agent/gated/stop/a%2Fb")
        assert (status, orjson.loads(body)["stopped"]) == (200, True), body
        stopped = await asyncio.wait_for(runs["a/b"], 30)
        assert types(stopped)[-1] in ("RUN_ERROR", "RUN_FINISHED"), types(stopped)
        assert "aA" in runtime.runs.active

        status, body = await answer(served, "POST", "/agent/gated/stop/aA")
        assert (status, orjson.loads(body)["stopped"]) == (200, True), body
        agent.gate.set()
        await asyncio.wait_for(runs["aA"], 30)


async def test_approval_route_names_the_id_sent(llm: MockOpenAIServer,
                                                serve_runtime: ServeRuntime) -> None:
    """Before: `approvals/a%2541` looked up approval `aA`, `approvals/x%2Fy` was no route."""
    async with serve_runtime(openai_runtime(llm)) as served, \
            httpx.AsyncClient(timeout=30) as client:
        for path, approval in (("a%2541", "a%41"), ("x%2Fy", "x/y"), ("x%2fy", "x/y")):
            expected = {"error": "Approval not found", "message": f"No approval '{approval}'",
                        "code": "APPROVAL_NOT_FOUND"}
            status, body = await answer(served, "GET", f"/approvals/{path}")
            assert (status, orjson.loads(body)) == (404, expected), path
            status, body = await answer_httpx(client, served, "POST", f"/approvals/{path}",
                                              {"action": "approve"})
            assert (status, orjson.loads(body)) == (404, expected), path


async def _get_without_raw_path(app: Any, path: str) -> tuple[int, Any]:
    """GET `path` (as a server decodes it) through `app`, with no `raw_path` in the scope
    (ASGI makes it optional)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": path, "root_path": "",
             "query_string": b"", "headers": [], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], orjson.loads(body)


@pytest.mark.timeout(60)
async def test_a_path_without_raw_path_is_decoded_once(llm: MockOpenAIServer) -> None:
    """Without `raw_path`, the decoded `path` names the thread as it is: `a%41` is not
    decoded again into `aA`."""
    runtime = openai_runtime(llm)
    app = create_app(runtime, "/api")
    for thread in ("aA", "a%41"):
        await runtime.store.append_run(
            thread, "default", StoredRun(f"r-{thread}", [
                ev.run_started(thread, f"r-{thread}"), ev.text_message_start(f"m-{thread}"),
                ev.text_message_content(f"m-{thread}", thread),
                ev.text_message_end(f"m-{thread}"), ev.run_finished(thread, f"r-{thread}")],
                0.0), [f"m-{thread}"])
    try:
        for thread in ("aA", "a%41"):
            status, messages = await _get_without_raw_path(app, f"/api/threads/{thread}/messages")
            assert status == 200, messages
            assert [m["content"] for m in messages["messages"]] == [thread]
    finally:
        await runtime.aclose()


async def test_root_path_is_stripped_only_as_whole_segments(llm: MockOpenAIServer) -> None:
    """The server's `root_path` was stripped as a string prefix: with root_path `/copilot`
    (a proxy's `--root-path`), the runtime at `/copilotkit` lost `/copilot` from its paths,
    and `/copilotkit/info` was a 404. Now only a whole leading segment is stripped."""
    runtime = openai_runtime(llm)
    app = create_app(runtime, "/copilotkit")
    try:
        for root, path in (("/copilot", "/copilotkit/info"),
                           ("/copilot", "/copilot/copilotkit/info"),
                           ("/copilot/", "/copilot/copilotkit/info"),
                           ("/api", "/api/copilotkit/info"),
                           ("", "/copilotkit/info")):
            transport = httpx.ASGITransport(app=app, root_path=root)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                response = await client.get(path)
            assert response.status_code == 200, (root, path, response.text)
            assert "default" in response.json()["agents"]
        transport = httpx.ASGITransport(app=app, root_path="/copilot")
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/copilot/info")).status_code == 404
    finally:
        await runtime.aclose()
