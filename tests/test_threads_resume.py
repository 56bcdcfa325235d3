"""Resuming a thread (`connect` with `Last-Event-ID`) never hides events silently.

A thread deleted and made again with the same id goes on with the positions where the deleted
one stopped, on every store and across workers sharing PostgreSQL, so an event id a client kept
from the deleted thread never hides the new thread's first events. A replay that leaves out
runs that do not fit in the store's `replay_bytes` says so on the wire: a CUSTOM event named
`copilot_runtime.replay_omitted`, `{"omittedRuns": n}`, right after the first replayed run's
start, which the real clients take as they take any CUSTOM event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from copilot_runtime import CopilotRuntime, DemoAdapter, RunInput, coordinator, thread_store
from copilot_runtime import events as ev
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.events import EventBatches
from copilot_runtime.testing import verify_events
from copilot_runtime.threads import DurableThreadStore, InMemoryThreadStore, ThreadStore
from tests import test_store_conformance as conformance
from tests.conftest import GatedAgent, Served, ServeRuntime, parse_sse_ids, run_input
from tests.hitl_support.postgres import postgres_schema
from tests.test_real_clients import run_client_script
from tests.test_trust_ownership import call

pytestmark = pytest.mark.timeout(60)

KINDS = ["memory", "sqlite", "postgresql"]
#: The conformance suite's store fixture: memory, SQLite and PostgreSQL (a schema of its own).
any_store = conformance.store
#: What makes a stored run about 10 KB.
FILLER = "x" * 10_000
JS_DIR = Path(__file__).parent / "js"
#: The name of the event that says a replay left runs out (a wire contract: spelled out).
REPLAY_OMITTED = "copilot_runtime.replay_omitted"


@pytest.fixture(params=KINDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "postgresql":
        with postgres_schema() as url:
            yield url
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'threads.db'}"
    else:
        yield "memory://"


@contextlib.asynccontextmanager
async def worker(url: str, serve_runtime: ServeRuntime,
                 runtime: CopilotRuntime | None = None) -> AsyncIterator[Served]:
    """A runtime on the store `url` (with a coordinator on PostgreSQL), served."""
    if runtime is None:
        options: dict[str, Any] = {"thread_store": thread_store(url)}
        if url.startswith("postgresql"):
            options["coordinator"] = coordinator(url)
        runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), **options)
    async with serve_runtime(runtime) as served:
        yield served


@pytest.fixture
async def served(store_url: str, serve_runtime: ServeRuntime) -> AsyncIterator[Served]:
    async with worker(store_url, serve_runtime) as s:
        yield s


async def connect(served: Served, thread: str, last_event_id: str | None = None
                  ) -> tuple[int, list[tuple[int | None, dict[str, Any]]]]:
    headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id}
    status, body, _ = await call(served, "POST", "/agent/default/connect", None,
                                 run_input("", thread=thread), headers)
    return status, parse_sse_ids(body) if status == 200 else [orjson.loads(body)]


async def run_ids(served: Served, thread: str, text: str, run: str
                  ) -> list[tuple[int | None, dict[str, Any]]]:
    status, body, _ = await call(served, "POST", "/agent/default/run", None,
                                 run_input(text, thread=thread, run=run))
    assert status == 200, body
    return parse_sse_ids(body)


async def test_a_stale_last_event_id_misses_nothing_of_a_thread_made_again(
        served: Served) -> None:
    """Before: the thread made again started at position 0, so a client that had seen the
    deleted thread's events up to id N (a long answer) and connected with `Last-Event-ID: N`
    got nothing of the new thread's first N+1 events: here, all of its run."""
    old = await run_ids(served, "t", "a long question " * 20, "r1")
    last_seen = max(p for p, _ in old if p is not None)
    status, _, _ = await call(served, "DELETE", "/threads/t", None)
    assert status == 200
    new = await run_ids(served, "t", "short", "r2")
    positions = [p for p, _ in new]
    assert positions[0] == last_seen + 1  # the positions go on
    assert positions == list(range(positions[0], positions[0] + len(new)))
    status, replay = await connect(served, "t", str(last_seen))
    assert status == 200
    events = [e for _, e in replay]
    verify_events(events)
    assert [e["runId"] for e in events if e["type"] == "RUN_STARTED"] == ["r2"]
    assert replay[-1][0] == positions[-1]


async def test_a_thread_deleted_on_one_worker_goes_on_on_another(
        serve_runtime: ServeRuntime) -> None:
    """The same across workers sharing PostgreSQL: the worker that runs the thread made
    again reads how far the thread another worker deleted had got."""
    with postgres_schema() as url:
        async with worker(url, serve_runtime) as one, worker(url, serve_runtime) as two:
            old = await run_ids(one, "t", "a long question " * 20, "r1")
            last_seen = max(p for p, _ in old if p is not None)
            status, _, _ = await call(one, "DELETE", "/threads/t", None)
            assert status == 200
            new = await run_ids(two, "t", "short", "r2")
            assert new[0][0] == last_seen + 1
            for served in (one, two):
                status, replay = await connect(served, "t", str(last_seen))
                assert status == 200
                assert [e["runId"] for _, e in replay if e["type"] == "RUN_STARTED"] == ["r2"]


async def test_a_thread_evicted_from_memory_leaves_its_positions() -> None:
    """The in-memory store forgets its least recently used threads: one of those made
    again goes on from where it was too (a client may still hold its event ids)."""
    store = InMemoryThreadStore(max_threads=1)
    events = conformance._run("t", "r1", "a b c")
    await conformance._finish(store, "t", "r1", events, 0)
    await conformance._finish(store, "u", "r1", conformance._run("u", "r1", "x"), 0)
    assert await store.get("t") is None  # evicted
    assert await store.first_position("t") == len(events)
    # At most `max_tombstones` ids are remembered, the oldest forgotten first.
    store.max_tombstones = 1
    await conformance._finish(store, "v", "r1", conformance._run("v", "r1", "x"), 0)
    assert await store.first_position("t") == 0
    assert await store.first_position("u") > 0


# -- a replay that leaves runs out says so ------------------------------------------------------


def omissions(replayed: list[tuple[int | None, dict[str, Any]]]) -> list[tuple[int, Any]]:
    """Where the omission events are in `replayed`, and what they say."""
    return [(index, e["value"]) for index, (_, e) in enumerate(replayed)
            if e["type"] == "CUSTOM" and e.get("name") == REPLAY_OMITTED]


async def _four_runs(store: ThreadStore) -> list[int]:
    """Four finished runs of ~10 KB on thread "t" of `store`; each one's last position."""
    position, lasts = 0, []
    for index in range(4):
        events = conformance._run("t", f"r{index}", "a b", user=f"u{index} {FILLER}")
        await conformance._finish(store, "t", f"r{index}", events, position,
                                  created=1.0 + index)
        position += len(events)
        lasts.append(position - 1)
    return lasts


async def test_a_store_replay_that_leaves_runs_out_says_so(any_store: ThreadStore) -> None:
    """Before: `events_after` left the oldest runs out silently. Now the replay holds an
    omission event right after its first run's start, saying how many of the runs after
    the position it left out, on every store."""
    lasts = await _four_runs(any_store)
    store: Any = any_store  # (a built-in store: it has `replay_bytes`)
    assert omissions(await any_store.events_after("t", -1)) == []
    store.replay_bytes = 25_000  # two runs of ~10 KB fit
    replayed = await any_store.events_after("t", -1)
    verify_events([e for _, e in replayed])
    assert [e["runId"] for _, e in replayed if e["type"] == "RUN_STARTED"] == ["r2", "r3"]
    assert omissions(replayed) == [(1, {"omittedRuns": 2})]
    assert replayed[1][0] is None  # no position of its own
    # Only the runs after the position count: after r0, r1 is left out; after r1, nothing.
    assert omissions(await any_store.events_after("t", lasts[0])) == [(1, {"omittedRuns": 1})]
    assert omissions(await any_store.events_after("t", lasts[1])) == []
    store.replay_bytes = 1
    assert omissions(await any_store.events_after("t", -1)) == [(1, {"omittedRuns": 3})]
    assert omissions(await any_store.events_after("t", lasts[3])) == []
    if isinstance(any_store, DurableThreadStore):
        # A running run is not a finished run left out.
        events = conformance._run("t", "r4", "c")
        await any_store.append_events("t", "default", "r4", 9.0, lasts[-1] + 1, events[:2])
        replayed = await any_store.events_after("t", -1)
        assert omissions(replayed) == [(1, {"omittedRuns": 3})]
        assert [e["runId"] for _, e in replayed if e["type"] == "RUN_STARTED"] == ["r3", "r4"]


def earlier_ids(replayed: list[tuple[int | None, dict[str, Any]]]) -> list[str] | None:
    """The ids of the MESSAGES_SNAPSHOT right after the omission event, or None."""
    (index, _), = omissions(replayed)
    following = replayed[index + 1][1]
    return [m["id"] for m in following["messages"]] \
        if following["type"] == "MESSAGES_SNAPSHOT" else None


async def test_a_replay_that_leaves_runs_out_gives_their_messages_first(
        any_store: ThreadStore) -> None:
    """A whole-thread replay that leaves runs out has, right after the omission event, a
    MESSAGES_SNAPSHOT of the messages of the runs left out, then the first replayed run's
    input messages (moved from its start: a client adds a start's messages at once, above
    the snapshot's); within `replay_bytes`, the newest, in order; a bounded `get` has the
    same snapshot. A resume (its client holds the earlier messages) has none."""
    lasts = await _four_runs(any_store)
    store: Any = any_store
    store.replay_bytes = 25_000  # two runs of ~10 KB fit, and the messages of two
    replayed = await any_store.events_after("t", -1)
    verify_events([e for _, e in replayed])
    assert earlier_ids(replayed) == ["u-r0", "m-r0", "u-r1", "m-r1", "u-r2"]
    assert replayed[0][1]["input"]["messages"] == []
    record = await any_store.get("t", max_bytes=25_000)
    assert record is not None
    assert record.earlier is not None
    assert [m["id"] for m in record.earlier["messages"]] == ["u-r0", "m-r0", "u-r1", "m-r1"]
    store.replay_bytes = 15_000  # one run, and the one before it read back for messages
    assert earlier_ids(await any_store.events_after("t", -1)) == ["u-r2", "m-r2", "u-r3"]
    store.replay_bytes = 5_000  # of those messages, only the newest fits (the ~10 KB one not)
    replayed = await any_store.events_after("t", -1)
    verify_events([e for _, e in replayed])
    assert earlier_ids(replayed) == ["m-r2", "u-r3"]
    assert omissions(await any_store.events_after("t", lasts[0])) == [(1, {"omittedRuns": 2})]
    assert earlier_ids(await any_store.events_after("t", lasts[0])) is None


async def test_connect_says_which_runs_it_left_out(served: Served) -> None:
    """`connect` of a thread too big to replay whole: the client gets the newest runs and
    the omission event in the first of them, and the real clients (CopilotKitCore 1.75 and
    @ag-ui/client) restore the thread from it without an error."""
    lasts = []
    for index in range(4):
        ran = await run_ids(served, "big", f"q{index} {FILLER}", f"r{index}")
        lasts.append(ran[-1][0])
    store: Any = served.runtime.store
    store.replay_bytes = 25_000  # each run stores ~10.5 KB (a 200-character quote): two fit
    status, replayed = await connect(served, "big")
    assert status == 200
    verify_events([e for _, e in replayed])
    assert [e["runId"] for _, e in replayed if e["type"] == "RUN_STARTED"] == ["r2", "r3"]
    assert omissions(replayed) == [(1, {"omittedRuns": 2})]
    # Resumed after the first run, one run is left out; after the second, none.
    status, got = await connect(served, "big", str(lasts[0]))
    assert [e["runId"] for _, e in got if e["type"] == "RUN_STARTED"] == ["r2", "r3"]
    assert omissions(got) == [(1, {"omittedRuns": 1})]
    status, got = await connect(served, "big", str(lasts[1]))
    assert omissions(got) == []

    result = await drive("connect", served.url, threadId="big")
    assert result["coreErrors"] == []
    customs = [e for e in result["events"] if e["type"] == "CUSTOM"]
    assert [(e["name"], e["value"]) for e in customs] == [(REPLAY_OMITTED, {"omittedRuns": 2})]
    # The messages of the runs left out come first (a MESSAGES_SNAPSHOT after the omission).
    users = [m["content"][:2] for m in result["messages"] if m["role"] == "user"]
    assert users == ["q0", "q1", "q2", "q3"]


async def replayed_while_running(
        store_url: str, serve_runtime: ServeRuntime, earlier: list[tuple[str, str]],
        live: tuple[str, str], last_event_id: str | None = None,
        replay_bytes: int | None = None) -> list[tuple[int | None, dict[str, Any]]]:
    """What a `connect` (with `last_event_id`) answers while the run `live` (its text and
    id) streams, after the runs `earlier`; with the store's `replay_bytes` set first."""
    agent = GatedAgent()
    agent.gate.set()
    options: dict[str, Any] = {"thread_store": thread_store(store_url)}
    if store_url.startswith("postgresql"):
        options["coordinator"] = coordinator(store_url)
    runtime = CopilotRuntime(agents={"default": agent}, **options)
    async with worker(store_url, serve_runtime, runtime) as served:
        for text, run in earlier:
            await run_ids(served, "t", text, run)
        if replay_bytes is not None:
            store: Any = runtime.store
            store.replay_bytes = replay_bytes
        agent.gate.clear()
        running = await served.post("/agent/default/run", run_input(live[0], thread="t",
                                                                     run=live[1]))
        body = b""
        async with asyncio.timeout(20):
            while b"TEXT_MESSAGE_CONTENT" not in body:
                body += await running.content.readany()
        joined = asyncio.ensure_future(connect(served, "t", last_event_id))
        await asyncio.sleep(0.2)
        agent.gate.set()
        await running.read()
        status, replayed = await joined
    assert status == 200
    verify_events([e for _, e in replayed])
    positions = [p for p, _ in replayed if p is not None]
    assert positions == sorted(set(positions))  # nothing twice
    return replayed


async def test_connect_to_a_running_thread_says_which_runs_it_left_out(
        store_url: str, serve_runtime: ServeRuntime) -> None:
    """The same while the thread runs: the stored runs as the store replays them (bounded,
    the omission said), then the live run, once."""
    replayed = await replayed_while_running(
        store_url, serve_runtime, [(f"q{index}", f"r{index}") for index in range(3)],
        ("live", "r3"), replay_bytes=1)  # only the newest run
    assert [e["runId"] for _, e in replayed if e["type"] == "RUN_STARTED"] == ["r2", "r3"]
    assert omissions(replayed) == [(1, {"omittedRuns": 2})]


async def test_a_running_thread_with_a_run_stored_before_positions_resumes_once(
        store_url: str, serve_runtime: ServeRuntime) -> None:
    """A thread an older release began (its run stored without positions), running now:
    a resume with the id of an event of the live run got the old run again in the middle
    of the live one (the real clients reject a RUN_STARTED after one not finished), and a
    connect without an id lost it. The old run comes once, before the live one, in a
    whole-thread replay alone."""
    agent = GatedAgent()
    options: dict[str, Any] = {"thread_store": thread_store(store_url)}
    if store_url.startswith("postgresql"):
        options["coordinator"] = coordinator(store_url)
    runtime = CopilotRuntime(agents={"default": agent}, **options)
    await conformance.stored_before_positions(
        runtime.store, "t", "r0", conformance._run("t", "r0", "old", user="before"))
    async with worker(store_url, serve_runtime, runtime) as served:
        running = await served.post("/agent/default/run", run_input("live", thread="t",
                                                                     run="r1"))
        body = b""
        async with asyncio.timeout(20):
            while b"TEXT_MESSAGE_CONTENT" not in body:
                body += await running.content.readany()
        seen = parse_sse_ids(body.rpartition(b"\n\n")[0])
        last_seen = max(p for p, _ in seen if p is not None)
        whole = asyncio.ensure_future(connect(served, "t"))
        resumed = asyncio.ensure_future(connect(served, "t", str(last_seen)))
        await asyncio.sleep(0.2)
        agent.gate.set()
        await running.read()
        (status, replayed), (resumed_status, rest) = await whole, await resumed
    assert (status, resumed_status) == (200, 200)
    assert [e["runId"] for _, e in replayed if e["type"] == "RUN_STARTED"] == ["r0", "r1"]
    verify_events([e for _, e in replayed])
    assert [e["type"] for _, e in rest if e["type"] == "RUN_STARTED"] == []
    verify_events([e for _, e in seen] + [e for _, e in rest])


async def drive(scenario: str, url: str, **options: Any) -> dict[str, Any]:
    """One scenario of the real-client driver (tests/js/drive.mjs) against `url`."""
    process = await asyncio.create_subprocess_exec(
        "node", str(JS_DIR / "drive.mjs"), scenario, url, json.dumps(options), cwd=JS_DIR,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COPILOTKIT_TELEMETRY_DISABLED": "true", "DO_NOT_TRACK": "1"})
    async with asyncio.timeout(40):
        out, err = await process.communicate()
    lines = [line for line in out.decode().splitlines() if line.strip()]
    assert lines, err.decode()[-3000:]
    result: dict[str, Any] = json.loads(lines[-1])
    assert result.get("ok"), (result.get("error"), err.decode()[-3000:])
    return result


# -- a Last-Event-ID the thread never reached ----------------------------------------------------


async def test_a_last_event_id_from_another_history_replays_the_whole_thread(
        served: Served) -> None:
    """Before: `connect` with an id past the thread's last position (kept from before an
    in-memory store restarted, or forged) replayed nothing and said nothing, and the next
    runs' events up to that id stayed hidden from that client. A thread at rest never gave
    such an id: the whole thread is replayed instead."""
    ran = await run_ids(served, "t", "hello", "r1")
    last = ran[-1][0]
    assert last is not None
    status, whole = await connect(served, "t")
    assert status == 200
    for stale in (str(last + 1), "1000", str(2**62)):
        status, got = await connect(served, "t", stale)
        assert (status, got) == (200, whole), stale
    # The thread's own ids still resume exactly.
    status, got = await connect(served, "t", str(last))
    assert (status, got) == (200, [])
    status, got = await connect(served, "t", str(last - 1))
    assert got[-1][0] == last
    assert len(got) < len(whole) or served.runtime.store.__class__.__name__ == \
        "InMemoryThreadStore"  # (which keeps no raw events: the run again, whole)
    # A thread that does not exist is still nothing.
    status, got = await connect(served, "nope", "1000")
    assert (status, got) == (200, [])


async def test_a_last_event_id_past_a_running_thread_replays_it_whole(
        store_url: str, serve_runtime: ServeRuntime) -> None:
    replayed = await replayed_while_running(store_url, serve_runtime, [("first", "r1")],
                                            ("live", "r2"), "1000000")
    assert [e["runId"] for _, e in replayed if e["type"] == "RUN_STARTED"] == ["r1", "r2"]


async def test_load_agent_state_reads_only_the_newest_runs_that_fit(served: Served) -> None:
    """Before: GraphQL's loadAgentState read the thread whole (every run of it, for every
    request: gigabytes for a thread of big runs), where the AG-UI routes and `connect` read
    at most the store's `replay_bytes` of its newest runs. It reads as they do now."""
    from tests.test_graphql_agents import LOAD_STATE, query

    for index in range(4):
        await run_ids(served, "big", f"q{index} {FILLER}", f"r{index}")

    async def users() -> list[str]:
        loaded = await query(served, LOAD_STATE, {"data": {"threadId": "big",
                                                           "agentName": "default"}})
        state = loaded["data"]["loadAgentState"]
        assert state["threadExists"] is True
        return [m["content"][:2] for m in json.loads(state["messages"])
                if m.get("role") == "user"]

    assert await users() == ["q0", "q1", "q2", "q3"]
    store: Any = served.runtime.store
    store.replay_bytes = 25_000  # each run stores ~10.5 KB (a 200-character quote): two fit
    # The runs left out give their messages (within `replay_bytes` too), in order.
    assert await users() == ["q0", "q1", "q2", "q3"]
    store.replay_bytes = 1  # the last run, and of the others' messages only the newest
    assert await users() == ["q3"]


async def test_load_agent_state_leaves_out_a_run_refused_over_its_approval_answer(
        served: Served) -> None:
    """A run refused over its approval answer (a stale tab's; a message sent before the
    answer, which never reached the agent) is left out of GraphQL's loadAgentState, as the
    AG-UI replays leave it: the fallback for agents without their own state read built
    messages from every stored run."""
    from copilot_runtime import events as ev
    from copilot_runtime.threads import StoredRun
    from tests.test_graphql_agents import LOAD_STATE, query

    await run_ids(served, "refused", "q0 first", "r0")
    record = await served.runtime.store.get("refused")
    assert record is not None
    first = record.next_position
    refused = [ev.run_started("refused", "r1", {"threadId": "refused", "runId": "r1",
                                                "messages": [{"id": "stale", "role": "user",
                                                              "content": "q1 stale"}]}),
               ev.run_error("answered already", code="APPROVAL_ALREADY_ANSWERED")]
    await served.runtime.store.append_run("refused", "default", StoredRun(
        "r1", refused, 2.0, 0, first, first + 1), ["stale"])
    loaded = await query(served, LOAD_STATE, {"data": {"threadId": "refused",
                                                       "agentName": "default"}})
    messages = json.loads(loaded["data"]["loadAgentState"]["messages"])
    assert [m["content"][:2] for m in messages if m.get("role") == "user"] == ["q0"]


async def test_connect_to_a_run_whose_id_the_thread_used_before_misses_nothing(
        store_url: str, serve_runtime: ServeRuntime) -> None:
    """A live run was told from the runs before it by its id: a `connect` while a run ran
    whose id an earlier run of the thread had (a client may send one again) left out that
    earlier run and every run after it, on every store. The live run is the thread's newest:
    only its own events are left to memory."""
    replayed = await replayed_while_running(
        store_url, serve_runtime, [("first", "r1"), ("second", "r2")], ("third", "r1"))
    assert [e["runId"] for _, e in replayed if e["type"] == "RUN_STARTED"] == [
        "r1", "r2", "r1"]


# -- a replay that leaves runs out keeps the history's order ------------------------------------


class SnapshottingAgent(Agent):
    """Says one message a run, then sends the whole conversation as a MESSAGES_SNAPSHOT (as a
    LangGraph agent does at a run's end): the history it remembers itself, as a graph's
    checkpoint holds it, the client sending only its new message."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[dict[str, Any]] = []

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input)

    async def _run(self, input: RunInput) -> Any:
        self.history.extend(m for m in input.raw["messages"]
                            if m["id"] not in {h["id"] for h in self.history})
        reply = f"a-{input.run_id}"
        self.history.append({"id": reply, "role": "assistant", "content": f"answer {FILLER}"})
        yield [ev.text_message_start(reply), ev.text_message_content(reply, f"answer {FILLER}"),
               ev.text_message_end(reply)]
        yield [{"type": "MESSAGES_SNAPSHOT", "messages": list(self.history)}]


async def test_a_replay_that_leaves_runs_out_keeps_the_history_in_order(
        store_url: str, serve_runtime: ServeRuntime) -> None:
    """Before: a thread whose runs outgrew `replay_bytes` came back out of order on a reloaded
    page and in GET messages: the first replayed run's answer above the first user message
    (the replay began at that run, whose start carries no earlier message, and a later
    MESSAGES_SNAPSHOT's earlier messages were put after it). Now the replay holds the
    messages of the runs left out (a MESSAGES_SNAPSHOT right after the omission event), and
    every reading of the thread has the live order, on every store."""
    options: dict[str, Any] = {"thread_store": thread_store(store_url)}
    if store_url.startswith("postgresql"):
        options["coordinator"] = coordinator(store_url)
    runtime = CopilotRuntime(agents={"default": SnapshottingAgent()}, **options)
    async with worker(store_url, serve_runtime, runtime) as served:
        live: list[str] = []
        for index in range(6):
            await run_ids(served, "order", f"q{index}", f"r{index}")
            live += [f"r{index}-u", f"a-r{index}"]
        store: Any = served.runtime.store
        # A run stores its answer (~10 KB) and a snapshot of every answer so far: the last
        # one (~70 KB) is replayed alone.
        store.replay_bytes = 60_000

        status, replayed = await connect(served, "order")
        assert status == 200
        events = [e for _, e in replayed]
        verify_events(events)
        assert omissions(replayed) == [(1, {"omittedRuns": 5})]
        applied = run_client_script("apply_events.mjs", [{"events": events, "state": {}}])
        assert [m["id"] for m in applied[0]["messages"]] == live

        status, body, _ = await call(served, "GET", "/threads/order/messages", None)
        assert status == 200
        assert [m["id"] for m in orjson.loads(body)["messages"]] == live


async def test_a_client_of_a_killed_process_resumes_to_its_runs_end_on_sqlite(
        tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    """One process on a SQLite file was killed mid-answer having sent events it had not
    written yet; the next process closes its run (`recover`), the closing events taking
    those events' positions. The client's resume with the id it last got ends its run: the
    message left open ended, then the RUN_ERROR. Before, an id at the RUN_ERROR's position
    got nothing, one before it the RUN_ERROR alone."""
    url = f"sqlite:///{tmp_path / 'threads.db'}"
    killed = thread_store(url)
    assert isinstance(killed, DurableThreadStore)
    started = ev.run_started("t", "r1", {"threadId": "t", "runId": "r1", "messages": [
        {"id": "u-r1", "role": "user", "content": "hello"}]})
    await killed.append_events("t", "default", "r1", 1.0, 0, [
        started, ev.text_message_start("m-r1"), ev.text_message_content("m-r1", "hel")])
    await killed.aclose()  # (what it wrote before it died: positions 0-2)
    async with worker(url, serve_runtime) as served:
        for seen in ("3", "4", "9"):  # it sent 1, 2 or 7 events more
            status, resumed = await connect(served, "t", seen)
            assert status == 200
            assert [(p, e["type"]) for p, e in resumed] == [
                (3, "TEXT_MESSAGE_END"), (4, "RUN_ERROR")], seen
