"""A thread read while its run goes on (GraphQL `loadAgentState`, AG-UI
`GET threads/{id}/messages`): it holds that run as far as it went, on every store, and on a
worker other than the one driving the run; once the run ends, its messages are there once.

Before, both reads built the thread from its finished runs alone: a thread read mid-run had
none of its running run's messages (an empty thread on its first run), and the 1.10 page,
which reads a thread once, showed it empty and sent its next message without the history."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

import copilot_runtime._runs
from copilot_runtime import (
    BearerTokenAuth,
    CopilotRuntime,
    OpenAIAdapter,
    _thread_reads,
    thread_store,
)
from copilot_runtime import events as ev
from copilot_runtime._compaction import compact_events, events_to_messages
from copilot_runtime._exceptions import ServiceUnavailableError
from copilot_runtime._input import RunInput, parse_run_input
from copilot_runtime._thread_reads import read_thread
from copilot_runtime.agents.base import Agent, AgentThreadState, RunContext
from copilot_runtime.auth import Principal, RequestInfo
from copilot_runtime.events import Event, EventBatches
from copilot_runtime.protocols.graphql.queries import load_agent_state
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import GatedAgent, Served, ServeRuntime, run_input
from tests.scale_support.cluster import eventually
from tests.scale_support.services import postgres_schema
from tests.test_trust_ownership import call

pytestmark = pytest.mark.timeout(60)

_LOAD = ("query loadAgentState($data: LoadAgentStateInput!) { loadAgentState(data: $data) "
         "{ threadId threadExists messages } }")


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/threads.sqlite3"
    else:
        with postgres_schema("midrun") as url:
            yield url


def _input(thread: str, run: str) -> Any:
    return parse_run_input({"threadId": thread, "runId": run, "messages": [
        {"id": f"{run}-u", "role": "user", "content": f"asked in {run}"}]})


async def _ignore(batch: Any) -> None:
    return None


async def _read(served: Served, thread: str) -> tuple[list[tuple[str, Any]],
                                                      list[tuple[str, Any]]]:
    """The thread's messages (id, content) as `loadAgentState` and the AG-UI route give them."""
    response = await served.session.post(served.url, data=orjson.dumps({
        "query": _LOAD, "variables": {"data": {"threadId": thread, "agentName": "default"}}}),
        headers={"Content-Type": "application/json"})
    loaded = (await response.json())["data"]["loadAgentState"]
    assert loaded["threadExists"] is True
    graphql = [(m["id"], m.get("content")) for m in orjson.loads(loaded["messages"])]
    response = await served.session.get(f"{served.url}/threads/{thread}/messages")
    assert response.status == 200, await response.text()
    agui = [(m["id"], m.get("content")) for m in (await response.json())["messages"]]
    return graphql, agui


async def _started(runtime: CopilotRuntime, thread: str, run: str
                   ) -> tuple[asyncio.Task[None], list[Event]]:
    """Run `run` driven until the gated agent waits (its first words written)."""
    written: list[Event] = []

    async def write(batch: Any) -> None:
        written.extend(batch)

    active = await runtime.start_run("default", _input(thread, run))
    driving = asyncio.create_task(active.drive(write))
    await eventually(lambda: any(e.get("delta") == "one " for e in written), deadline=10,
                     what="the run's first words")
    return driving, written


async def test_a_thread_read_mid_run_holds_the_run_so_far(
        store_url: str, serve_runtime: ServeRuntime) -> None:
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=thread_store(store_url))
    async with serve_runtime(runtime) as served:
        agent.gate.set()
        await (await runtime.start_run("default", _input("t", "r1"))).drive(_ignore)
        agent.gate.clear()
        finished = [("r1-u", "asked in r1"), ("m-r1", "one two")]
        # A thread's later run, and a thread's first run (no finished run stored yet).
        driving, _ = await _started(runtime, "t", "r2")
        first, _ = await _started(runtime, "new", "n1")
        midway = await _read(served, "t")
        assert midway == ([*finished, ("r2-u", "asked in r2"), ("m-r2", "one ")],) * 2
        assert await _read(served, "new") == ([("n1-u", "asked in n1"), ("m-n1", "one ")],) * 2
        agent.gate.set()
        async with asyncio.timeout(10):
            await asyncio.gather(driving, first)
        # Once stored, each message once.
        assert await _read(served, "t") == (
            [*finished, ("r2-u", "asked in r2"), ("m-r2", "one two")],) * 2
        assert await _read(served, "new") == (
            [("n1-u", "asked in n1"), ("m-n1", "one two")],) * 2


async def test_a_thread_is_listed_renamed_and_archived_as_its_first_run_starts(
        store_url: str, serve_runtime: ServeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, on SQLite and PostgreSQL a thread whose first run had not made its first
    batched write yet (its first 200 ms) was not listed, and its rename and archive were
    404s, while the in-memory store had it from the run's start. Its worker now has the run
    write its events before it answers; someone else's thread stays a 404."""
    # Never written as it goes here: what the list or PATCH asks is the run's first write.
    monkeypatch.setattr(copilot_runtime._runs, "FLUSH_INTERVAL", 60.0)
    alice, bob = "tok-alice-0001", "tok-bob-00002"
    async with MockOpenAIServer(chunks=10) as llm:
        runtime = CopilotRuntime(
            service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock",
                                          max_retries=0),
            thread_store=thread_store(store_url),
            auth=BearerTokenAuth({alice: "alice", bob: "bob"}))
        async with serve_runtime(runtime) as served:
            async def listed(token: str, archived: bool = False) -> dict[str, Any]:
                status, body, _ = await call(served, "GET", "/threads?includeArchived="
                                             f"{str(archived).lower()}", token)
                assert status == 200, body
                return {t["id"]: t for t in orjson.loads(body)["threads"]}

            def streaming(thread: str) -> bool:
                live = runtime.runs.active.get(thread)
                return live is not None and any(
                    e.get("type") == "TEXT_MESSAGE_CONTENT" for e in live.events)

            # A slow answer (300 ms a chunk, 3 s in all) on each of three new threads.
            runs = {thread: asyncio.create_task(call(
                served, "POST", "/agent/default/run", alice,
                run_input("slow:300 plan my trip", thread=thread, run=f"{thread}-r")))
                for thread in ("listed", "renamed", "archived")}
            await eventually(lambda: all(map(streaming, runs)), deadline=10,
                             what="the runs' first words")
            assert await listed(bob) == {}
            assert (await call(served, "PATCH", "/threads/renamed", bob,
                               {"name": "Mine"}))[0] == 404
            # Someone else's list and change wrote none of alice's runs.
            assert [runtime.runs.active[t]._flushed for t in runs] == [0, 0, 0]
            assert (await call(served, "PATCH", "/threads/renamed", alice,
                               {"name": "Plans"}))[0] == 200
            assert (await call(served, "PATCH", "/threads/renamed", alice,
                               {"agentId": "other", "name": "Other"}))[0] == 404
            assert (await call(served, "POST", "/threads/archived/archive", alice))[0] == 200
            assert sorted(await listed(alice)) == ["listed", "renamed"]
            assert all(map(streaming, runs))  # all of it while the runs went on
            for running in runs.values():
                status, body, _ = await running
                assert status == 200, body
                assert b"RUN_FINISHED" in body
            # Kept once the runs were stored.
            assert await listed(bob, archived=True) == {}
            threads = await listed(alice, archived=True)
            assert {t: (threads[t]["name"], threads[t]["archived"]) for t in threads} == {
                "listed": (None, False), "renamed": ("Plans", False),
                "archived": (None, True)}
            assert sorted(await listed(alice)) == ["listed", "renamed"]


@pytest.fixture(params=["sqlite", "postgresql"])
def durable_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/threads.sqlite3"
    else:
        with postgres_schema("midrun") as url:
            yield url


def _runtime(llm: MockOpenAIServer, url: str) -> CopilotRuntime:
    return CopilotRuntime(service_adapter=OpenAIAdapter(base_url=llm.base_url,
                                                        api_key="sk-mock", max_retries=0),
                          thread_store=thread_store(url))


async def test_a_store_that_cannot_write_holds_no_list_or_change_of_a_thread(
        durable_url: str, serve_runtime: ServeRuntime, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """Before, while the store could not write, a list waited `STORE_RETRY_FOR` for a run
    that had ended unwritten to be stored, and a PATCH twice that (its run's write asked
    for by the route, the archive and the rename): where they answered at once before
    threads were listed from their first run's start. They wait a first write's bound."""
    monkeypatch.setattr(copilot_runtime._runs, "STORE_RETRY_FOR", 3.0)  # (the runs' ends)
    async with MockOpenAIServer(chunks=2) as llm:
        runtime = _runtime(llm, durable_url)
        async with serve_runtime(runtime) as served:
            assert (await call(served, "POST", "/agent/default/run", None,
                               run_input("hi", thread="kept", run="kept-1")))[0] == 200
            store = runtime.store
            writes = {name: getattr(store, name)
                      for name in ("append_events", "append_run", "rename", "archive")}

            async def down(*args: Any, **kwargs: Any) -> Any:
                raise ServiceUnavailableError("disk full (simulated)")

            for name in writes:
                setattr(store, name, down)
            runs = [asyncio.create_task(call(served, "POST", "/agent/default/run", None,
                                             run_input("again", thread=thread, run=run)))
                    for thread, run in (("kept", "kept-2"), ("new", "new-1"))]

            def ending(thread: str) -> bool:
                live = runtime.runs.active.get(thread)
                return live is not None and live._finished

            await eventually(lambda: ending("kept") and ending("new"), deadline=10,
                             what="the runs' ends, unwritten")
            async with asyncio.timeout(2.5):  # before: 3 s, then 6 s
                status, body, _ = await call(served, "GET", "/threads", None)
                assert status == 200, body
                assert [t["id"] for t in orjson.loads(body)["threads"]] == ["kept"]
                change = {"name": "Plans", "archived": True}
                assert (await call(served, "PATCH", "/threads/kept", None, change))[0] == 503
                assert (await call(served, "PATCH", "/threads/new", None, change))[0] == 404
            assert all(ending(thread) for thread in ("kept", "new"))  # answered meanwhile
            for name, write in writes.items():  # the store is back: the runs are stored
                setattr(store, name, write)
            for running in runs:
                assert (await running)[0] == 200
            await eventually(lambda: not runtime.runs.active, deadline=10,
                             what="the runs stored")
            assert (await call(served, "PATCH", "/threads/new", None, change))[0] == 200


async def test_only_a_new_threads_run_writes_sooner_once_a_request(
        durable_url: str, serve_runtime: ServeRuntime, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """Before, a list had every run here that had not written yet write at once, its thread
    stored or not (a write more for each run begun in the last 200 ms, whenever anyone
    listed), and a PATCH asked for its run's write three times. Only the runs of threads
    the store has no record of write sooner, asked once a request."""
    monkeypatch.setattr(copilot_runtime._runs, "FLUSH_INTERVAL", 60.0)  # (no timer's write)
    async with MockOpenAIServer(chunks=10) as llm:
        runtime = _runtime(llm, durable_url)
        async with serve_runtime(runtime) as served:
            for thread in ("old-a", "old-b"):
                assert (await call(served, "POST", "/agent/default/run", None, run_input(
                    "hi", thread=thread, run=f"{thread}-1")))[0] == 200
            written: list[str] = []
            append_events = runtime.store.append_events

            async def counted(thread_id: str, *args: Any, **kwargs: Any) -> Any:
                written.append(thread_id)
                return await append_events(thread_id, *args, **kwargs)

            monkeypatch.setattr(runtime.store, "append_events", counted)
            asked: list[str | None] = []
            write_first_batches = runtime.runs.write_first_batches

            async def counted_asks(thread_id: str | None = None, **kwargs: Any) -> Any:
                asked.append(thread_id)
                return await write_first_batches(thread_id, **kwargs)

            monkeypatch.setattr(runtime.runs, "write_first_batches", counted_asks)
            threads = ("old-a", "old-b", "new-a", "new-b", "new-c")
            runs = [asyncio.create_task(call(served, "POST", "/agent/default/run", None,
                                             run_input("slow:300 again", thread=thread,
                                                       run=f"{thread}-2")))
                    for thread in threads]

            def streaming(thread: str) -> bool:
                live = runtime.runs.active.get(thread)
                return live is not None and any(
                    e.get("type") == "TEXT_MESSAGE_CONTENT" for e in live.events)

            await eventually(lambda: all(map(streaming, threads)), deadline=10,
                             what="the runs' first words")
            assert (await call(served, "PATCH", "/threads/new-b", None,
                               {"name": "Plans", "archived": True}))[0] == 200
            assert (asked, written) == (["new-b"], ["new-b"])
            # As a Python application asks it (no route before it).
            assert await runtime.rename_thread("new-c", "Trip")
            assert await runtime.archive_thread("new-c")
            assert written == ["new-b", "new-c"]
            status, body, _ = await call(served, "GET", "/threads?includeArchived=true", None)
            assert status == 200, body
            assert sorted(t["id"] for t in orjson.loads(body)["threads"]) == sorted(threads)
            assert written == ["new-b", "new-c", "new-a"]  # not the stored threads' runs
            assert all(map(streaming, threads))  # all of it while the runs went on
            for running in runs:
                assert (await running)[0] == 200


async def test_a_rename_as_a_new_threads_first_run_is_stored_changes_it(
        durable_url: str, serve_runtime: ServeRuntime, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A review: the rename asked the store first, found no thread, and then asked the run,
    which had meanwhile been stored and had left: refused, a stored thread (PostgreSQL's pool
    can order them so). The run is asked first."""
    async with MockOpenAIServer(chunks=4) as llm:
        runtime = _runtime(llm, durable_url)
        async with serve_runtime(runtime) as served:
            rename = runtime.store.rename

            async def answered_late(thread_id: str, *args: Any, **kwargs: Any) -> Any:
                done = await rename(thread_id, *args, **kwargs)
                await eventually(lambda: thread_id not in runtime.runs.active, deadline=10,
                                 what="the run stored")
                return done

            monkeypatch.setattr(runtime.store, "rename", answered_late)
            run = asyncio.create_task(call(served, "POST", "/agent/default/run", None,
                                           run_input("slow:100 hi", thread="r", run="r-1")))

            def streaming() -> bool:
                live = runtime.runs.active.get("r")
                return live is not None and any(
                    e.get("type") == "TEXT_MESSAGE_CONTENT" for e in live.events)

            await eventually(streaming, deadline=10, what="the run's first words")
            assert await runtime.rename_thread("r", "Named")
            assert (await run)[0] == 200
            record = await runtime.store.summary("r")
            assert record is not None
            assert record.name == "Named"


@pytest.fixture
def shared_url() -> Iterator[str]:
    with postgres_schema("midrun") as base:
        yield base


@pytest.fixture
async def workers(shared_url: str
                  ) -> AsyncIterator[tuple[CopilotRuntime, CopilotRuntime, GatedAgent]]:
    """Two runtimes as two workers on one PostgreSQL store and coordinator."""
    agent = GatedAgent()
    made = [CopilotRuntime(agents={"default": a}, thread_store=thread_store(shared_url),
                           coordinator=f"{shared_url}&lease_ttl=2") for a in (agent, GatedAgent())]
    try:
        for runtime in made:
            await runtime.start()
        yield made[0], made[1], agent
    finally:
        for runtime in made:
            await runtime.aclose()


async def test_a_thread_read_on_another_worker_mid_run_holds_what_was_written(
        workers: tuple[CopilotRuntime, CopilotRuntime, GatedAgent],
        serve_runtime: ServeRuntime) -> None:
    """The other worker has the running run's events as its worker wrote them so far."""
    driver, reader, agent = workers
    agent.gate.set()
    await (await driver.start_run("default", _input("t", "r1"))).drive(_ignore)
    agent.gate.clear()
    driving, _ = await _started(driver, "t", "r2")

    async def holds_first_words() -> bool:
        # (the driver writes its events in batches as they stream)
        stored = await reader.store.events_after("t", -1)
        return any(e.get("delta") == "one " for _, e in stored)

    await eventually(holds_first_words, deadline=10, what="the run's first words stored")
    async with serve_runtime(reader) as served:
        assert await _read(served, "t") == ([
            ("r1-u", "asked in r1"), ("m-r1", "one two"), ("r2-u", "asked in r2"),
            ("m-r2", "one ")],) * 2
        agent.gate.set()
        async with asyncio.timeout(10):
            await driving
        assert await _read(served, "t") == ([
            ("r1-u", "asked in r1"), ("m-r1", "one two"), ("r2-u", "asked in r2"),
            ("m-r2", "one two")],) * 2


async def test_another_worker_lists_renames_and_archives_a_thread_from_its_first_run_start(
        workers: tuple[CopilotRuntime, CopilotRuntime, GatedAgent],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers sharing a coordinator write a run's start before it streams: the others have
    its thread at once, before any of its batched writes."""
    monkeypatch.setattr(copilot_runtime._runs, "FLUSH_INTERVAL", 60.0)
    driver, reader, agent = workers
    driving, _ = await _started(driver, "new", "n1")
    assert [r.thread_id for r in await reader.list_threads(None, 10, owner=None)] == ["new"]
    assert await reader.rename_thread("new", "Plans")
    assert await reader.archive_thread("new")
    agent.gate.set()
    async with asyncio.timeout(10):
        await driving
    record = await reader.store.summary("new")
    assert record is not None
    assert (record.name, record.archived) == ("Plans", True)


async def test_someone_elses_thread_read_mid_run_does_not_exist(
        serve_runtime: ServeRuntime) -> None:
    """A running run read from memory (a thread whose first run goes on, which the in-memory
    store does not hold yet) is its owner's alone, as a stored thread is."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=thread_store("memory://"),
                             auth=BearerTokenAuth({"tok-alice-0001": "alice",
                                                   "tok-bob-00002": "bob"}))
    async with serve_runtime(runtime) as served:
        async def run() -> None:
            response = await served.session.post(
                served.url + "/agent/default/run", data=orjson.dumps(
                    {"threadId": "t", "runId": "r1", "tools": [], "context": [],
                     "forwardedProps": {}, "state": {},
                     "messages": [{"id": "u", "role": "user", "content": "mine"}]}),
                headers={"Content-Type": "application/json",
                         "Authorization": "Bearer tok-alice-0001"})
            await response.read()

        running = asyncio.create_task(run())
        try:
            await eventually(lambda: (live := runtime.runs.active.get("t")) is not None
                             and any(e.get("delta") == "one " for e in live.events),
                             deadline=10, what="the run's first words")
            for token, seen in (("tok-alice-0001", True), ("tok-bob-00002", False)):
                headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
                response = await served.session.post(served.url, data=orjson.dumps({
                    "query": _LOAD,
                    "variables": {"data": {"threadId": "t", "agentName": "default"}}}),
                    headers=headers)
                loaded = (await response.json())["data"]["loadAgentState"]
                assert loaded["threadExists"] is seen
                assert ("mine" in loaded["messages"]) is seen
                response = await served.session.get(f"{served.url}/threads/t/messages",
                                                    headers=headers)
                assert response.status == (200 if seen else 404)
                assert ("mine" in await response.text()) is seen
        finally:  # (the server waits for the run's stream as it stops)
            agent.gate.set()
            async with asyncio.timeout(10):
                await running


def _as(who: str) -> RequestInfo:
    return RequestInfo("POST", "/", {}, principal=Principal(who))


async def test_a_read_racing_a_delete_holds_nothing_of_the_next_owners_run(
        workers: tuple[CopilotRuntime, CopilotRuntime, GatedAgent]) -> None:
    """Alice's read finds her thread running on the other worker; before it reads the
    events written after the thread's record, her run ends, her thread is deleted, and bob
    starts a run of its id there: her read holds none of bob's run (before, it held his
    question and his answer so far)."""
    driver, reader, agent = workers
    agent.gate.set()
    await (await driver.start_run("default", _input("t", "r1"), request=_as("alice"))
           ).drive(_ignore)
    agent.gate.clear()
    alices = asyncio.create_task((await driver.start_run(
        "default", _input("t", "r2"), request=_as("alice"))).drive(_ignore))
    durable = reader.runs.durable
    assert durable is not None
    real = durable.events_after

    async def written(run: str) -> bool:
        return any(e.get("type") == ev.RUN_STARTED and e.get("runId") == run
                   for _, e in await real("t", -1))

    await eventually(lambda: written("r2"), deadline=10, what="alice's run stored")
    bobs: list[asyncio.Task[None]] = []

    async def deleted_then_bobs_run(thread_id: str, position: int) -> Any:
        if not bobs:
            agent.gate.set()
            async with asyncio.timeout(10):
                await alices
            agent.gate.clear()
            assert await driver.store.delete("t")
            run = await driver.start_run("default", _input("t", "b1"), request=_as("bob"))
            bobs.append(asyncio.create_task(run.drive(_ignore)))
            await eventually(lambda: written("b1"), deadline=10, what="bob's run stored")
        return await real(thread_id, position)

    durable.events_after = deleted_then_bobs_run  # type: ignore[method-assign]
    try:
        loaded = await load_agent_state(reader, {"threadId": "t", "agentName": "default"},
                                        None, request=_as("alice"))
        assert bobs
        assert "b1" not in loaded["messages"]
        assert "asked in b1" not in loaded["messages"]
    finally:
        durable.events_after = real  # type: ignore[method-assign]
        agent.gate.set()
        async with asyncio.timeout(10):
            await asyncio.gather(alices, *bobs)


async def test_an_idle_thread_read_on_a_shared_coordinator_reads_no_written_events(
        workers: tuple[CopilotRuntime, CopilotRuntime, GatedAgent]) -> None:
    """Nothing runs on the thread (its record says where its events got to): the read is
    its record alone, no look for a running run's events."""
    driver, reader, agent = workers
    agent.gate.set()
    for run in ("r1", "r2"):
        await (await driver.start_run("default", _input("t", run))).drive(_ignore)
    durable = reader.runs.durable
    assert durable is not None
    real = durable.events_after
    calls = 0

    async def counted(thread_id: str, position: int) -> Any:
        nonlocal calls
        calls += 1
        return await real(thread_id, position)

    durable.events_after = counted  # type: ignore[method-assign]
    try:
        record = await read_thread(reader.runs, "t", None)
    finally:
        durable.events_after = real  # type: ignore[method-assign]
    assert record is not None
    assert [r.run_id for r in record.runs] == ["r1", "r2"]
    assert calls == 0


class _ManyPieces(Agent):
    """Streams one message in `pieces` pieces, then waits for `gate`."""

    def __init__(self, pieces: int) -> None:
        super().__init__()
        self.pieces = pieces
        self.gate = asyncio.Event()

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run()

    async def _run(self) -> Any:
        yield [ev.text_message_start("m"),
               *(ev.text_message_content("m", "a") for _ in range(self.pieces))]
        await self.gate.wait()
        yield [ev.text_message_end("m")]


@pytest.mark.parametrize("pieces", [10, 2000])
async def test_a_running_run_read_again_is_compacted_once_and_a_long_one_off_the_loop(
        pieces: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read of a running run compacted all of it again on the event loop (60,000
    pieces: 24-37 ms a read, the worker's streams stalled): a read with nothing new since
    the last one is that one's, and a run of many events is compacted in a thread."""
    agent = _ManyPieces(pieces)
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=thread_store("memory://"))
    compacted_in: list[int] = []

    def counted(events: Any) -> list[Event]:
        compacted_in.append(threading.get_ident())
        return compact_events(events)

    monkeypatch.setattr(_thread_reads, "compact_events", counted)
    await runtime.start()
    try:
        driving = asyncio.create_task((await runtime.start_run(
            "default", _input("t", "r"))).drive(_ignore))
        await eventually(lambda: (live := runtime.runs.active.get("t")) is not None
                         and len(live.events) > pieces, deadline=10, what="the pieces")
        reads = [await read_thread(runtime.runs, "t", None) for _ in range(3)]
        assert len(compacted_in) == 1
        on_loop = compacted_in[0] == threading.get_ident()
        assert on_loop is (pieces < 1000)
        for record in reads:
            assert record is not None
            assert events_to_messages([record.runs[-1].events])[-1]["content"] == "a" * pieces
        agent.gate.set()
        async with asyncio.timeout(10):
            await driving
    finally:
        await runtime.aclose()


class _KeepsThreads(GatedAgent):
    """Keeps its threads itself (as a checkpointed graph does), up to its running run's
    input: its answer is not kept until the run ends."""

    async def load_state(self, thread_id: str, *, headers: Any = None
                         ) -> AgentThreadState | None:
        return AgentThreadState(thread_id, True, {}, [
            {"id": "r1-u", "role": "user", "content": "asked in r1"},
            {"id": "m-r1", "role": "assistant", "content": "one two"},
            {"id": "r2-u", "role": "user", "content": "asked in r2"}])


async def test_an_agent_keeping_its_threads_is_read_mid_run_with_the_answer_so_far() -> None:
    """loadAgentState of an agent that keeps its threads (`load_state`, a graph's
    checkpointer) showed the thread without its running answer, which the AG-UI routes
    show: the running run's messages this worker has go after the agent's, each once."""
    agent = _KeepsThreads()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=thread_store("memory://"))
    await runtime.start()
    try:
        agent.gate.set()
        await (await runtime.start_run("default", _input("t", "r1"))).drive(_ignore)
        agent.gate.clear()
        driving, _ = await _started(runtime, "t", "r2")
        loaded = await load_agent_state(runtime, {"threadId": "t", "agentName": "default"})
        assert [(m["id"], m.get("content")) for m in orjson.loads(loaded["messages"])] == [
            ("r1-u", "asked in r1"), ("m-r1", "one two"), ("r2-u", "asked in r2"),
            ("m-r2", "one ")]
        agent.gate.set()
        async with asyncio.timeout(10):
            await driving
    finally:
        await runtime.aclose()


async def test_a_read_on_the_running_worker_racing_a_delete_holds_no_run_of_the_last_owner(
        tmp_path: Path) -> None:
    """Review: the running run is taken before the store is read; if it ends meanwhile and
    its thread is deleted and begun again by another principal, the record read is theirs,
    and the run was shown in it (bob read alice's answer)."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent},
                             thread_store=thread_store(f"sqlite:///{tmp_path}/t.sqlite3"),
                             auth=BearerTokenAuth({"tok-alice-0001": "alice",
                                                   "tok-bob-00002": "bob"}))

    def as_(who: str) -> RequestInfo:
        return RequestInfo("POST", "/", {}, principal=Principal(who))

    def asked(run: str) -> RunInput:
        return parse_run_input({"threadId": "t", "runId": run, "messages": [
            {"id": f"{run}-u", "role": "user", "content": f"asked in {run}"}]})

    async def ignore(_: Any) -> None:
        pass

    async def streamed(run_id: str) -> None:
        def seen() -> bool:
            live = runtime.runs.active.get("t")
            return live is not None and live.run_id == run_id and any(
                e.get("delta") == "one " for e in live.events)
        await eventually(seen, what=f"{run_id} streaming")

    await runtime.start()
    try:
        alices = asyncio.create_task((await runtime.start_run(
            "default", asked("r1"), request=as_("alice"))).drive(ignore))
        await streamed("r1")
        real, bobs = runtime.runs.store.get, []

        async def racing_get(thread_id: str, **options: Any) -> Any:
            if not bobs:  # alice's run ends, her thread goes, bob begins one of its id
                agent.gate.set()
                await alices
                agent.gate.clear()
                assert await runtime.store.delete("t")
                bobs.append(asyncio.create_task((await runtime.start_run(
                    "default", asked("b1"), request=as_("bob"))).drive(ignore)))
                await streamed("b1")
            return await real(thread_id, **options)

        runtime.runs.store.get = racing_get  # type: ignore[method-assign]
        record = await read_thread(runtime.runs, "t", None)
        runtime.runs.store.get = real  # type: ignore[method-assign]
        assert record is not None
        assert record.owner is not None
        assert record.owner.principal_id == "bob"
        assert "r1" not in [run.run_id for run in record.runs]
        agent.gate.set()
        await asyncio.gather(*bobs)
    finally:
        await runtime.aclose()
