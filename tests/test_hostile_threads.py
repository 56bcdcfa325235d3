"""The threads API under hostile use: deletes that must forget, ids named like routes, threads
too big to read whole, changes that race, and a delete while the first run still streams.

A `DELETE threads/{id}` forgets the thread everywhere the runtime keeps it, the agents' own
memory included: before, an in-process LangGraph agent kept its checkpoints, so whoever ran
next on the freed id (another user) got the deleted conversation back. A thread named like a
route word ("threads", "info", "messages", ...) is reachable through its thread routes. Reads
are bounded to the newest runs that fit (`omittedRuns` counts the others) on every store. Of
two changes that race, the one that finds the thread gone is a 404, not a 200 for nothing.
Every 404 of the thread routes has one body, and a thread whose first run still streams is
busy (409) on every store.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from copilot_runtime import BearerTokenAuth, CopilotRuntime, DemoAdapter, coordinator, thread_store
from copilot_runtime.agents import BuiltInAgent
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.testing import MockOpenAIServer, verify_events
from copilot_runtime.threads import DurableThreadStore, ThreadStore
from tests import test_store_conformance as conformance
from tests.agents_support import graphs
from tests.conftest import GatedAgent, Served, ServeRuntime, parse_sse, poll, run_input, types
from tests.hitl_support.postgres import postgres_schema
from tests.test_graphql_agents import LOAD_STATE, query
from tests.test_trust_ownership import ALICE, BOB, call, run_as

pytestmark = pytest.mark.timeout(60)

KINDS = ["memory", "sqlite", "postgresql"]
# Every word the AG-UI routes are matched on, each a valid thread id.
ROUTE_WORDS = ["threads", "info", "messages", "events", "state", "transcribe", "approvals",
               "approval", "agent", "run", "connect", "stop"]
#: The conformance suite's store fixture: memory, SQLite and PostgreSQL (a schema of its own).
any_store = conformance.store


@pytest.fixture(params=KINDS)
def store_options(request: pytest.FixtureRequest, tmp_path: Path
                  ) -> Iterator[dict[str, Any]]:
    """A runtime's store (and, on PostgreSQL, its coordinator) of the kind; a PostgreSQL
    schema of the test's own, dropped afterwards."""
    if request.param == "postgresql":
        with postgres_schema() as url:
            yield {"thread_store": thread_store(url), "coordinator": coordinator(url)}
    elif request.param == "sqlite":
        yield {"thread_store": thread_store(f"sqlite:///{tmp_path / 'threads.db'}")}
    else:
        yield {}


@pytest.fixture
async def served(store_options: dict[str, Any], serve_runtime: ServeRuntime
                 ) -> AsyncIterator[Served]:
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), **store_options)
    async with serve_runtime(runtime) as s:
        yield s


async def answer(served: Served, method: str, path: str, body: Any = None
                 ) -> tuple[int, Any]:
    status, raw, _ = await call(served, method, path, None, body)
    return status, orjson.loads(raw) if raw else None


def contents(messages: list[dict[str, Any]]) -> list[str]:
    return [m.get("content") or "" for m in messages]


# -- 1. a delete makes the agents forget -----------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_deleted_langgraph_thread_reaches_no_one_who_reuses_its_id(
        kind: str, llm: MockOpenAIServer, serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    """Before: DELETE removed the thread store's copy only; the graph's checkpointer kept the
    conversation, so bob, running on the freed id, got alice's deleted messages in his run's
    MESSAGES_SNAPSHOT and in his GraphQL loadAgentState."""
    options: dict[str, Any] = {} if kind == "memory" else {
        "thread_store": thread_store(f"sqlite:///{tmp_path / 'threads.db'}")}
    async with httpx.AsyncClient() as client:
        agent = LangGraphAgent(name="lg", graph=graphs.chat_graph(llm.base_url, client))
        runtime = CopilotRuntime(agents={"lg": agent}, auth=BearerTokenAuth(
            {ALICE: "alice", BOB: "bob"}), **options)
        async with serve_runtime(runtime) as served:
            secret = "alice's secret: the vault code is 4711"
            alices = await run_as(served, ALICE, "conv-42", secret, agent="lg", run="a1")
            assert types(alices)[-1] == "RUN_FINISHED"
            status, body, _ = await call(served, "DELETE", "/threads/conv-42", ALICE)
            assert (status, orjson.loads(body)) == (200, {"deleted": True, "id": "conv-42"})
            status, _, _ = await call(served, "GET", "/threads/conv-42/messages", ALICE)
            assert status == 404
            asked = "hi, what did we talk about?"
            bobs = await run_as(served, BOB, "conv-42", asked, agent="lg", run="b1")
            loaded = await query(served, LOAD_STATE, {"data": {
                "threadId": "conv-42", "agentName": "lg"}}, headers={
                "Authorization": f"Bearer {BOB}"})
            status, body, _ = await call(served, "GET", "/threads/conv-42/messages", BOB)
    assert types(bobs)[-1] == "RUN_FINISHED"
    (snapshot,) = [e for e in bobs if e["type"] == "MESSAGES_SNAPSHOT"]
    assert contents(snapshot["messages"]) == [asked, f"echo: {asked}"]
    state = loaded["data"]["loadAgentState"]
    assert state["threadExists"] is True
    assert contents(json.loads(state["messages"])) == [asked, f"echo: {asked}"]
    assert status == 200
    assert contents(orjson.loads(body)["messages"]) == [asked, f"echo: {asked}"]
    assert "4711" not in orjson.dumps([bobs, loaded]).decode()
    # The model was never shown alice's words in bob's run.
    assert "4711" not in orjson.dumps(llm.requests[-1]).decode()


# -- 2. route words are thread ids --------------------------------------------------------------


async def test_threads_named_like_route_words_are_read_renamed_and_deleted(
        served: Served) -> None:
    """Before: thread "threads" answered 405 to every read, rename and delete (a GET listed
    every thread instead); "info" could be read but never renamed or deleted (the info route
    won), and the list kept both after everything was deleted."""
    for word in ROUTE_WORDS:
        await served.run(run_input(f"hello {word}", thread=word, run=f"r-{word}"))
    status, listed = await answer(served, "GET", "/threads")
    assert status == 200
    assert sorted(t["id"] for t in listed["threads"]) == sorted(ROUTE_WORDS)
    for word in ROUTE_WORDS:
        status, got = await answer(served, "GET", f"/threads/{word}/messages")
        assert status == 200, (word, got)
        assert contents(got["messages"])[0] == f"hello {word}"
        status, got = await answer(served, "GET", f"/threads/{word}/events")
        assert status == 200, (word, got)
        assert [e["threadId"] for e in got["events"] if e["type"] == "RUN_STARTED"] == [word]
        status, got = await answer(served, "GET", f"/threads/{word}/state")
        assert status == 200, (word, got)
        assert "state" in got
        status, got = await answer(served, "PATCH", f"/threads/{word}", {"name": f"<{word}>"})
        assert (status, got) == (200, {"id": word, "name": f"<{word}>"}), word
    status, listed = await answer(served, "GET", "/threads")
    assert {t["id"]: t["name"] for t in listed["threads"]} == {
        word: f"<{word}>" for word in ROUTE_WORDS}
    for word in ROUTE_WORDS:
        status, got = await answer(served, "DELETE", f"/threads/{word}")
        assert (status, got) == (200, {"deleted": True, "id": word}), word
        status, got = await answer(served, "GET", f"/threads/{word}/messages")
        assert status == 404, (word, got)
    # The routes the words name still answer as they did.
    status, info = await answer(served, "GET", "/info")
    assert status == 200
    assert "default" in info["agents"]
    status, listed = await answer(served, "GET", "/threads")
    assert (status, listed["threads"]) == (200, [])


async def test_agents_and_stopped_threads_named_threads_keep_their_routes(
        serve_runtime: ServeRuntime) -> None:
    """The agent routes name agents and threads in their own places: with thread routes
    matched first, `agent/threads/run` (an agent named "threads") and `agent/default/stop/
    threads` (a thread named "threads") answered 405 for a while."""
    runtime = CopilotRuntime(agents={
        "threads": BuiltInAgent(DemoAdapter(delay=0)), "default": BuiltInAgent(
            DemoAdapter(delay=0))})
    async with serve_runtime(runtime) as served:
        events = await served.run(run_input("hello", thread="threads"), agent="threads")
        assert types(events)[-1] == "RUN_FINISHED"
        response = await served.post("/agent/default/stop/threads", {})
        assert response.status == 200, await response.text()
        assert (await response.json())["stopped"] is False
        status, got = await answer(served, "GET", "/threads/threads/messages")
        assert status == 200
        assert contents(got["messages"])[0] == "hello"


@pytest.mark.parametrize("thread", ["run", "connect"])
async def test_an_agent_named_agent_stops_its_threads_named_like_its_routes(
        thread: str, serve_runtime: ServeRuntime) -> None:
    """`agent/agent/stop/run` also reads as the run route of an agent "stop" (the route's
    last three segments): it was that, a 404 "Agent 'stop' does not exist", so the threads
    "run" and "connect" of an agent named "agent" could not be stopped."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"agent": agent})
    async with serve_runtime(runtime) as served:
        running = await served.post("/agent/agent/run", run_input("hi", thread=thread))
        async for _ in poll():
            if runtime.runs.active.get(thread) is not None:
                break
        response = await served.post(f"/agent/agent/stop/{thread}", {})
        assert response.status == 200, await response.text()
        assert (await response.json())["stopped"] is True
        events = parse_sse(await running.read())
        assert types(events)[-1] == "RUN_FINISHED"
        verify_events(events)

# -- 3. reads bounded to the newest runs that fit ------------------------------------------------

_FILLER = "x" * 10_000


async def test_a_thread_route_reads_only_the_newest_runs_that_fit(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: SQLite and PostgreSQL loaded every run of the thread for every read (gigabytes
    of memory for a few concurrent reads of a thread of big runs) and the answer held them
    all; now the routes read at most the store's `replay_bytes` of the newest runs, the last one
    always, and say how many older ones they left out (`omittedRuns`)."""
    for index in range(5):
        await served.run(run_input(f"q{index} {_FILLER}", thread="big", run=f"r{index}"))
    status, whole = await answer(served, "GET", "/threads/big/messages")
    assert status == 200
    assert whole["omittedRuns"] == 0
    assert [m["content"][:2] for m in whole["messages"] if m["role"] == "user"] == [
        "q0", "q1", "q2", "q3", "q4"]

    # Each run stores about 10.5 KB (the question, and the demo's short quote): two fit.
    monkeypatch.setattr(served.runtime.store, "replay_bytes", 25_000, raising=False)  # two runs
    status, got = await answer(served, "GET", "/threads/big/messages")
    assert status == 200
    assert got["omittedRuns"] == 3
    # The messages of the runs left out come first, as many as `replay_bytes` holds of the
    # newest of them (what reading back as much of those runs gave): those of r1 and r2.
    assert [m["content"][:2] for m in got["messages"] if m["role"] == "user"] == [
        "q1", "q2", "q3", "q4"]
    assert got["messages"] == whole["messages"][-len(got["messages"]):]
    status, got = await answer(served, "GET", "/threads/big/events")
    assert status == 200
    assert got["omittedRuns"] == 3
    assert [e["runId"] for e in got["events"] if e["type"] == "RUN_STARTED"] == ["r3", "r4"]
    # As `connect` replays it: the omission, then those messages, after the first start.
    assert [e["type"] for e in got["events"][:3]] == [
        "RUN_STARTED", "CUSTOM", "MESSAGES_SNAPSHOT"]

    # A bound smaller than any run: the last run all the same.
    monkeypatch.setattr(served.runtime.store, "replay_bytes", 1, raising=False)
    status, got = await answer(served, "GET", "/threads/big/events")
    assert status == 200
    assert got["omittedRuns"] == 4
    assert [e["runId"] for e in got["events"] if e["type"] == "RUN_STARTED"] == ["r4"]
    status, got = await answer(served, "GET", "/threads/big/messages")
    assert (status, got["omittedRuns"]) == (200, 4)
    assert [m["content"][:2] for m in got["messages"] if m["role"] == "user"] == ["q4"]
    status, got = await answer(served, "GET", "/threads/big/state")
    assert status == 200
    # The thread still takes runs, and the next read has the new one last.
    await served.run(run_input("q5 short", thread="big", run="r5"))
    status, got = await answer(served, "GET", "/threads/big/events")
    assert (status, got["omittedRuns"]) == (200, 5)
    assert [e["runId"] for e in got["events"] if e["type"] == "RUN_STARTED"] == ["r5"]


async def test_a_threads_state_is_answered_whatever_runs_a_read_leaves_out(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `GET /threads/{id}/state` and GraphQL `loadAgentState` looked for the state in
    the newest runs they read alone: once the run that set it was older than `replay_bytes`
    of newer runs, the route answered `{"state": null}` and loadAgentState `"{}"` with
    `threadExists` true (which a CopilotKit 1.10 page takes as the state, wiping its own)."""
    store = served.runtime.store
    events = conformance._stateful("planned", "r0", {"plan": ["draft", "review"]})
    await conformance._finish(store, "planned", "r0", events, 0)
    position = len(events)
    for index in (1, 2):
        events = conformance._run("planned", f"r{index}", f"answer {_FILLER}")
        await conformance._finish(store, "planned", f"r{index}", events, position,
                                  created=1.0 + index)
        position += len(events)
    monkeypatch.setattr(store, "replay_bytes", 15_000, raising=False)  # a run: ~10 KB
    status, got = await answer(served, "GET", "/threads/planned/events")
    assert (status, got["omittedRuns"]) == (200, 2)
    status, got = await answer(served, "GET", "/threads/planned/state")
    assert (status, got) == (200, {"state": {"plan": ["draft", "review"]}})
    loaded = await query(served, LOAD_STATE, {"data": {
        "threadId": "planned", "agentName": "default"}})
    state = loaded["data"]["loadAgentState"]
    assert state["threadExists"] is True
    assert json.loads(state["state"]) == {"plan": ["draft", "review"]}


async def test_store_get_with_max_bytes_keeps_the_newest_runs(any_store: ThreadStore) -> None:
    """Before: `get` had no bound at all (a TypeError here); SQLite and PostgreSQL read every
    run of the thread. Now each store keeps the newest runs whose stored events fit, at least
    the last one, and counts the others in `omitted_runs`."""
    position = 0
    for index in range(4):
        events = conformance._run("t", f"r{index}", "a b", user=f"u{index} {_FILLER}")
        await conformance._finish(any_store, "t", f"r{index}", events, position,
                                  created=1.0 + index)
        position += len(events)
    whole = await any_store.get("t")
    assert whole is not None
    assert ([r.run_id for r in whole.runs], whole.omitted_runs) == (
        ["r0", "r1", "r2", "r3"], 0)
    # Each run stores a little over 10 KB.
    cases = {None: ["r0", "r1", "r2", "r3"], 10**9: ["r0", "r1", "r2", "r3"],
             25_000: ["r2", "r3"], 15_000: ["r3"], 1: ["r3"], 0: ["r3"]}
    for bound, kept in cases.items():
        record = await any_store.get("t", max_bytes=bound)
        assert record is not None
        assert [r.run_id for r in record.runs] == kept, bound
        assert record.omitted_runs == 4 - len(kept), bound
        assert [r.events for r in record.runs] == [r.events for r in whole.runs[-len(kept):]]
        # What describes the thread is the whole thread's.
        assert (record.next_position, record.message_ids, record.title) == (
            whole.next_position, whole.message_ids, whole.title), bound
    assert await any_store.get("nope", max_bytes=1) is None


async def test_connect_replays_only_the_newest_runs_that_fit(served: Served) -> None:
    """`connect` read every run of the thread too (what the thread routes now bound), the
    whole of it for every connection: the same bound holds there, the last run always."""
    for index in range(5):
        await served.run(run_input(f"q{index} {_FILLER}", thread="big", run=f"r{index}"))

    async def replayed() -> list[str]:
        response = await served.post("/agent/default/connect", run_input("", thread="big"))
        events = parse_sse(await response.read())
        verify_events(events)
        return [e["runId"] for e in events if e["type"] == "RUN_STARTED"]

    assert await replayed() == ["r0", "r1", "r2", "r3", "r4"]
    store: Any = served.runtime.store  # (a built-in store: it has `replay_bytes`)
    store.replay_bytes = 25_000  # each run stores ~10.5 KB (the answer quotes 200 characters)
    assert await replayed() == ["r3", "r4"]
    store.replay_bytes = 1
    assert await replayed() == ["r4"]
    await served.run(run_input("q5 short", thread="big", run="r5"))
    assert await replayed() == ["r5"]


async def test_store_events_after_keeps_the_newest_runs(any_store: ThreadStore) -> None:
    """Each store's `events_after`, the read behind `connect`: the newest finished runs
    within its `replay_bytes`, at least the last, whatever position it resumes after."""
    position, firsts = 0, []
    for index in range(4):
        events = conformance._run("t", f"r{index}", "a b", user=f"u{index} {_FILLER}")
        await conformance._finish(any_store, "t", f"r{index}", events, position,
                                  created=1.0 + index)
        firsts.append(position)
        position += len(events)

    async def runs_after(after: int) -> list[str]:
        return [e["runId"] for _, e in await any_store.events_after("t", after)
                if e["type"] == "RUN_STARTED"]

    assert await runs_after(-1) == ["r0", "r1", "r2", "r3"]
    store: Any = any_store  # (a built-in store: it has `replay_bytes`)
    store.replay_bytes = 25_000  # a run: ~10 KB
    assert await runs_after(-1) == ["r2", "r3"]
    assert await runs_after(firsts[3] - 1) == ["r3"]  # after r2: only what follows counts
    store.replay_bytes = 1
    assert await runs_after(-1) == ["r3"]
    assert await any_store.events_after("nope", -1) == []


# -- 4. a change that loses a race is a 404 -----------------------------------------------------


async def test_of_two_racing_deletes_one_is_a_404(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the route ignored what `store.delete` returned, so of two DELETEs that both
    found the thread both answered 200 (SQLite and PostgreSQL, where the lookup and the
    delete are separate awaits). The store is held here so that both always pass the lookup
    before either deletes: exactly one 200, the other 404. (Under a shared coordinator the
    second waits for the first's hold on the thread instead, then finds it gone.)"""
    threads = served.runtime.store
    delete = threads.delete
    entered: list[str] = []
    second_in, first_done = asyncio.Event(), asyncio.Event()
    deletes: list[bool] = []
    waits_for_the_first = served.runtime.coordinator.shared

    async def held_delete(thread_id: str) -> bool:
        entered.append(thread_id)
        if len(entered) == 1:  # the first waits for the second to be in, then deletes
            if not waits_for_the_first:
                await second_in.wait()
            done = await delete(thread_id)
            first_done.set()
        else:  # the second deletes after the first
            second_in.set()
            await first_done.wait()
            done = await delete(thread_id)
        deletes.append(done)
        return done

    monkeypatch.setattr(threads, "delete", held_delete)
    await served.run(run_input("hello", thread="twice", run="r1"))
    answers = await asyncio.gather(answer(served, "DELETE", "/threads/twice"),
                                   answer(served, "DELETE", "/threads/twice"))
    # Both passed the lookup; one store delete won (under a shared coordinator the second
    # finds the thread gone once it holds it, and asks the store nothing).
    assert sorted(deletes) == ([True] if waits_for_the_first else [False, True])
    assert sorted(answers, key=lambda a: a[0]) == [
        (200, {"deleted": True, "id": "twice"}),
        (404, {"error": "Thread not found", "message": "Thread 'twice' does not exist",
               "code": "THREAD_NOT_FOUND"})]
    # Unheld, as clients race: still one of each, round after round.
    monkeypatch.setattr(threads, "delete", delete)
    for index in range(5):
        await served.run(run_input("hello", thread=f"race-{index}", run="r1"))
        statuses = await asyncio.gather(answer(served, "DELETE", f"/threads/race-{index}"),
                                        answer(served, "DELETE", f"/threads/race-{index}"))
        assert sorted(status for status, _ in statuses) == [200, 404], statuses
    status, listed = await answer(served, "GET", "/threads")
    assert (status, listed["threads"]) == (200, [])


async def test_a_rename_that_loses_to_a_delete_is_a_404(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a PATCH whose thread was deleted between its lookup and its write answered 200
    `{"name": "renamed"}`, a name stored nowhere (SQLite and PostgreSQL). The rename is held
    after its lookup here while a DELETE takes the thread away."""
    threads = served.runtime.store
    rename = threads.rename
    renaming, deleted = asyncio.Event(), asyncio.Event()
    renamed: list[bool] = []

    async def held_rename(thread_id: str, name: str | None) -> bool:
        renaming.set()
        await deleted.wait()
        done = await rename(thread_id, name)
        renamed.append(done)
        return done

    monkeypatch.setattr(threads, "rename", held_rename)
    await served.run(run_input("hello", thread="both", run="r1"))
    patch = asyncio.ensure_future(answer(served, "PATCH", "/threads/both", {"name": "renamed"}))
    await renaming.wait()
    removal = await answer(served, "DELETE", "/threads/both")
    deleted.set()
    status, body = await patch
    assert removal == (200, {"deleted": True, "id": "both"})
    assert renamed == [False]
    assert status == 404, body
    assert body["code"] == "THREAD_NOT_FOUND"
    status, _ = await answer(served, "GET", "/threads/both/state")
    assert status == 404
    status, listed = await answer(served, "GET", "/threads")
    assert (status, listed["threads"]) == (200, [])


# -- 5. one 404 body ----------------------------------------------------------------------------


async def test_every_thread_route_answers_the_same_404(served: Served) -> None:
    """Before: GET threads/{id}/messages|events|state answered a 404 built by hand, without
    the `code` THREAD_NOT_FOUND that PATCH and DELETE carry."""
    await served.run(run_input("hello", thread="there", run="r1"))
    bodies = []
    for method, path, body in (("GET", "/threads/nope/messages", None),
                               ("GET", "/threads/nope/events", None),
                               ("GET", "/threads/nope/state", None),
                               ("PATCH", "/threads/nope", {"name": "x"}),
                               ("DELETE", "/threads/nope", None)):
        status, got = await answer(served, method, path, body)
        assert status == 404, (method, path, got)
        bodies.append(got)
    assert bodies[0]["code"] == "THREAD_NOT_FOUND"
    assert bodies[0]["error"] == "Thread not found"
    assert "nope" in bodies[0]["message"]
    assert all(body == bodies[0] for body in bodies), bodies


# -- 6. a delete while the first run streams -----------------------------------------------------


async def test_delete_while_the_first_run_streams_is_busy_on_every_store(
        store_options: dict[str, Any], serve_runtime: ServeRuntime) -> None:
    """Before: the in-memory store answered 404 (it makes a thread's record only when its
    first run ends), and the durable stores did too until the run's first events were
    written; SQLite and PostgreSQL then said 409. Now every store says 409 THREAD_BUSY."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, **store_options)
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/default/run", run_input("hi", thread="fresh"))
        assert response.status == 200
        streamed = b""
        while b"TEXT_MESSAGE_CONTENT" not in streamed:
            chunk = await response.content.readany()
            assert chunk, streamed
            streamed += chunk
        status, body = await answer(served, "DELETE", "/threads/fresh")
        assert (status, body["code"]) == (409, "THREAD_BUSY"), body
        if isinstance(runtime.store, DurableThreadStore):
            # Once the run's first events are written, still busy.
            async for _ in poll():
                if await runtime.store.summary("fresh") is not None:
                    break
            assert await runtime.store.summary("fresh") is not None
            status, body = await answer(served, "DELETE", "/threads/fresh")
            assert (status, body["code"]) == (409, "THREAD_BUSY"), body
        agent.gate.set()
        events = parse_sse(streamed + await response.read())
        assert types(events)[-1] == "RUN_FINISHED"
        status, body = await answer(served, "DELETE", "/threads/fresh")
        assert (status, body) == (200, {"deleted": True, "id": "fresh"})
        status, _ = await answer(served, "GET", "/threads/fresh/messages")
        assert status == 404
