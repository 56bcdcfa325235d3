"""Positions, resumable streams and the threads API, over HTTP on memory and SQLite stores.

Every event of `run` and `connect` carries its position in the thread as the SSE `id:`;
`connect` with `Last-Event-ID` sends only what came after it; a durable store holds a run's
events while it streams, and a run a crash left open is closed as interrupted at start-up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from copilot_runtime import BearerTokenAuth, CopilotRuntime, DemoAdapter
from copilot_runtime import events as ev
from copilot_runtime.testing import verify_events
from copilot_runtime.threads import INTERRUPTED_CODE, SQLiteThreadStore, ThreadStore
from copilot_runtime.threads.memory import InMemoryThreadStore
from tests.conftest import GatedAgent, Served, ServeRuntime, parse_sse_ids, run_input, text_of


def _store(kind: str, tmp_path: Path) -> ThreadStore:
    return InMemoryThreadStore() if kind == "memory" else \
        SQLiteThreadStore(tmp_path / "threads.sqlite3")


async def _replayed(served: Served, thread: str) -> list[dict[str, Any]]:
    """The thread as `connect` replays it, checked against the clients' ordering rules."""
    replay = [e for _, e in parse_sse_ids(await (await served.post(
        "/agent/default/connect", run_input("", thread=thread))).read())]
    verify_events(replay)
    return replay


async def _read_until(response: aiohttp.ClientResponse, wanted: str
                      ) -> tuple[bytes, list[tuple[int | None, dict[str, Any]]]]:
    """Read a stream until an event of type `wanted` has arrived (whole frames only)."""
    body = b""
    async with asyncio.timeout(20):
        while True:
            body += await response.content.readany()
            whole = body[:body.rfind(b"\n\n") + 2] if b"\n\n" in body else b""
            events = parse_sse_ids(whole)
            if any(e["type"] == wanted for _, e in events):
                return whole, events


async def _eventually(check: Any, message: str, within: float = 20) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, message
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_ids_are_positions_through_the_thread(kind: str, tmp_path: Path,
                                                    serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                             thread_store=_store(kind, tmp_path))
    async with serve_runtime(runtime) as served:
        first = parse_sse_ids(await (await served.post(
            "/agent/default/run", run_input("hello", thread="t"))).read())
        second = parse_sse_ids(await (await served.post(
            "/agent/default/run", run_input("again", thread="t", run="r2"))).read())
        assert [p for p, _ in first] == list(range(len(first)))
        assert [p for p, _ in second] == list(range(len(first), len(first) + len(second)))
        replay = parse_sse_ids(await (await served.post(
            "/agent/default/connect", run_input("", thread="t"))).read())
        end = next(i for i, (p, _) in enumerate(replay) if p is not None)
        verify_events([e for _, e in replay][:end + 1])
        verify_events([e for _, e in replay][end + 1:])
        # A compacted run: no ids inside, the run's last position on its last event.
        assert [p for p, _ in replay if p is not None] == [len(first) - 1,
                                                          len(first) + len(second) - 1]
        # Resuming at a run boundary: only the runs after it.
        after = parse_sse_ids(await (await served.post(
            "/agent/default/connect", run_input("", thread="t"),
            headers={"Last-Event-ID": str(len(first) - 1)})).read())
        assert [e["runId"] for _, e in after if e["type"] == "RUN_STARTED"] == ["r2"]
        assert text_of([e for _, e in after]) == text_of([e for _, e in second])
        # Resuming at the end: nothing.
        assert parse_sse_ids(await (await served.post(
            "/agent/default/connect", run_input("", thread="t"),
            headers={"Last-Event-ID": str(len(first) + len(second) - 1)})).read()) == []


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_resume_follows_a_live_run_from_where_the_client_left(
        kind: str, tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    """A second connection resumes while the run waits at its gate (a client whose first
    connection dropped would: its own dropped stream would have stopped the run)."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=_store(kind, tmp_path))
    async with serve_runtime(runtime) as served:
        running = await served.post("/agent/default/run", run_input("hi", thread="live2"))
        _, seen = await _read_until(running, "TEXT_MESSAGE_CONTENT")
        position = seen[-1][0]
        assert position is not None
        connect = await served.post("/agent/default/connect",
                                    run_input("", thread="live2"),
                                    headers={"Last-Event-ID": str(position)})
        await asyncio.sleep(0.1)
        assert runtime.is_running("live2")
        agent.gate.set()
        rest = parse_sse_ids(await connect.read())
        whole = parse_sse_ids(await running.read())
        # Exactly what the run's own stream sent after `position`, with the same ids.
        assert rest == [item for item in seen + whole if item[0] is not None
                        and item[0] > position]
        assert text_of([e for _, e in seen + rest]) == "one two"
        assert rest[-1][1]["type"] == "RUN_FINISHED"


async def test_resume_inside_a_run_that_ended_is_exact_on_a_durable_store(
        tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                             thread_store=_store("sqlite", tmp_path))
    async with serve_runtime(runtime) as served:
        whole = parse_sse_ids(await (await served.post(
            "/agent/default/run", run_input("tell me more", thread="t"))).read())
        contents = [p for p, e in whole if e["type"] == "TEXT_MESSAGE_CONTENT"]
        assert len(contents) > 3
        cut = contents[2]  # the client saw the first three deltas, then lost its connection
        rest = parse_sse_ids(await (await served.post(
            "/agent/default/connect", run_input("", thread="t"),
            headers={"Last-Event-ID": str(cut)})).read())
        assert rest == [item for item in whole if item[0] is not None and item[0] > cut]


@pytest.mark.parametrize("value", ["abc", "1.5", "-7", "99999999999999999999",
                                   "3_0", "+3", "0x10"])
async def test_a_bad_last_event_id_is_a_400(value: str, serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0))
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/default/connect", run_input("", thread="t"),
                                     headers={"Last-Event-ID": value})
        assert response.status == 400
        assert "Last-Event-ID" in await response.text()


async def test_a_durable_store_holds_a_run_while_it_streams(
        tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    agent = GatedAgent()
    store = SQLiteThreadStore(tmp_path / "threads.sqlite3")
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=store)
    async with serve_runtime(runtime) as served:
        running = await served.post("/agent/default/run", run_input("hi", thread="t"))
        _, seen = await _read_until(running, "TEXT_MESSAGE_CONTENT")

        async def written() -> bool:
            return len(await store.events_after("t", -1)) == len(seen)

        await _eventually(written, "the running run's events never reached the store")
        assert runtime.is_running("t")
        assert await store.open_runs() == [("t", "run-1")]
        assert [item for item in await store.events_after("t", -1)] == seen
        agent.gate.set()
        whole = seen + parse_sse_ids(await running.read())
        assert await store.open_runs() == []
        record = await store.get("t")
        assert record is not None
        assert record.next_position == len(whole)


async def test_a_run_a_crash_left_open_is_closed_as_interrupted(
        tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    path = tmp_path / "threads.sqlite3"
    crashed = SQLiteThreadStore(path)
    # What a process that died mid-run left: its first events, written as it streamed.
    started = ev.run_started("t", "r1", {"threadId": "t", "runId": "r1", "messages": [
        {"id": "u1", "role": "user", "content": "hi"}]})
    await crashed.append_events("t", "default", "r1", 1.0, 0, [
        started, ev.text_message_start("m1"), ev.text_message_content("m1", "half an ans")])
    await crashed.aclose()
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                             thread_store=SQLiteThreadStore(path))
    async with serve_runtime(runtime) as served:
        replay = await _replayed(served, "t")
        assert text_of(replay) == "half an ans"
        assert replay[-1]["type"] == "RUN_ERROR"
        assert replay[-1]["code"] == INTERRUPTED_CODE
        again = await served.run(run_input("again", thread="t", run="r2"))
        assert again[-1]["type"] == "RUN_FINISHED"
        messages = await (await served.session.get(
            served.url + "/threads/t/messages")).json()
        assert [m["content"] for m in messages["messages"]][:2] == ["hi", "half an ans"]


async def test_a_run_cut_by_a_shutdown_is_stored_as_interrupted(
        tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    """A runtime closed while a run streams (a restart of the one process) closes the run
    as interrupted. Before, a shutdown stopped it like a user's stop: its half answer was
    stored under a RUN_FINISHED, as if complete (and when the server cancelled the request
    first, stored with no end at all, which broke every later replay of the thread)."""
    path = tmp_path / "threads.sqlite3"
    runtime = CopilotRuntime(agents={"default": GatedAgent()},
                             thread_store=SQLiteThreadStore(path))
    async with serve_runtime(runtime) as served:
        running = await served.post("/agent/default/run", run_input("hi", thread="t"))
        await _read_until(running, "TEXT_MESSAGE_CONTENT")
        await runtime.aclose()  # what the lifespan's shutdown does
    again = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                           thread_store=SQLiteThreadStore(path))
    async with serve_runtime(again) as served:
        replay = await _replayed(served, "t")
        assert text_of(replay) == "one "
        assert (replay[-1]["type"], replay[-1].get("code")) == ("RUN_ERROR", INTERRUPTED_CODE)
        after = await served.run(run_input("again", thread="t", run="r2"))
        assert after[-1]["type"] == "RUN_FINISHED"


# -- the threads API -------------------------------------------------------------------

@pytest.fixture
async def two_users(tmp_path: Path, serve_runtime: ServeRuntime) -> AsyncIterator[Served]:
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                             thread_store=SQLiteThreadStore(tmp_path / "threads.sqlite3"),
                             auth=BearerTokenAuth({"token-alice": "alice", "token-bob": "bob"}))
    async with serve_runtime(runtime) as served:
        yield served


def _as(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_threads_pages_names_and_deletion(two_users: Served) -> None:
    served = two_users
    for index in range(5):
        await served.post("/agent/default/run", run_input(f"question {index}",
                                                          thread=f"t{index}"),
                          headers=_as("token-alice"))
    await served.post("/agent/default/run", run_input("bob's", thread="b1"),
                      headers=_as("token-bob"))
    session, url = served.session, served.url

    async def page(query: str, token: str = "token-alice") -> dict[str, Any]:
        response = await session.get(f"{url}/threads{query}", headers=_as(token))
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body

    first = await page("?limit=2")
    assert [t["id"] for t in first["threads"]] == ["t4", "t3"]
    assert first["threads"][0]["title"] == "question 4"
    second = await page(f"?limit=2&cursor={first['nextCursor']}")
    assert [t["id"] for t in second["threads"]] == ["t2", "t1"]
    last = await page(f"?limit=2&cursor={second['nextCursor']}")
    assert [t["id"] for t in last["threads"]] == ["t0"]
    assert last["nextCursor"] is None
    assert [t["id"] for t in (await page("", "token-bob"))["threads"]] == ["b1"]
    # (Python's int() read "1_0" as 10, "+2" and a full-width two as 2, and took the
    # first of repeated parameters.)
    for bad in ("?limit=0", "?limit=x", "?cursor=-1", "?limit=100000", "?limit=1_0",
                "?limit=+2", "?limit=%EF%BC%92", "?limit=2&limit=3", "?cursor=0&cursor=2",
                "?agentId=a&agentId=b"):
        response = await session.get(f"{url}/threads{bad}", headers=_as("token-alice"))
        assert response.status == 400, bad

    renamed = await session.patch(f"{url}/threads/t3", json={"name": "Plans"},
                                  headers=_as("token-alice"))
    assert renamed.status == 200
    assert (await renamed.json())["name"] == "Plans"
    assert (await page("?limit=2"))["threads"][1]["name"] == "Plans"
    for bad_body in ({"name": 5}, {"title": "x"}, [], {"name": "x" * 201}):
        response = await session.patch(f"{url}/threads/t3", json=bad_body,
                                        headers=_as("token-alice"))
        assert response.status == 400, bad_body

    # Someone else's thread, or none: the same 404, and nothing changes.
    for method, path in (("PATCH", "/threads/t3"), ("DELETE", "/threads/t3"),
                         ("PATCH", "/threads/nope"), ("DELETE", "/threads/nope")):
        response = await session.request(method, url + path, json={"name": "x"},
                                          headers=_as("token-bob"))
        assert response.status == 404, (method, path)
    assert (await page("?limit=2"))["threads"][1]["name"] == "Plans"

    deleted = await session.delete(f"{url}/threads/t3", headers=_as("token-alice"))
    assert deleted.status == 200
    assert (await session.get(f"{url}/threads/t3/messages",
                              headers=_as("token-alice"))).status == 404
    assert [t["id"] for t in (await page(""))["threads"]] == ["t4", "t2", "t1", "t0"]
    assert (await session.delete(f"{url}/threads/t3", headers=_as("token-alice"))).status == 404
    assert (await session.put(f"{url}/threads/t4", headers=_as("token-alice"))).status == 405


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_thread_is_listed_read_and_renamed_while_its_first_run_streams(
        kind: str, tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    """Before: on the in-memory store a thread did not exist until its first run ended (its
    list empty, its messages, state and rename a 404), while SQLite had it at once."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=_store(kind, tmp_path))
    async with serve_runtime(runtime) as served:
        running = await served.post("/agent/default/run", run_input("Plan my trip", thread="t"))
        await _read_until(running, "TEXT_MESSAGE_CONTENT")

        async def listed() -> bool:  # (SQLite: once the run's first events are written)
            body = await (await served.session.get(served.url + "/threads")).json()
            return [t["id"] for t in body["threads"]] == ["t"]

        await _eventually(listed, "the running thread was never listed", within=5)
        url = served.url + "/threads/t"
        messages = await served.session.get(url + "/messages")
        # (the run so far: its user message and what it streamed)
        assert messages.status == 200
        assert [(m["role"], m["content"]) for m in (await messages.json())["messages"]] == [
            ("user", "Plan my trip"), ("assistant", "one ")]
        state = await served.session.get(url + "/state")
        assert (state.status, await state.json()) == (200, {"state": None})
        renamed = await served.session.patch(url, json={"name": "Trip"})
        assert renamed.status == 200
        agent.gate.set()
        await running.read()
        body = await (await served.session.get(served.url + "/threads")).json()
        assert [(t["id"], t["name"], t["title"]) for t in body["threads"]] == [
            ("t", "Trip", "Plan my trip")]
        assert len((await (await served.session.get(url + "/messages")).json())["messages"]) == 2


async def test_a_running_thread_cannot_be_deleted(tmp_path: Path,
                                                  serve_runtime: ServeRuntime) -> None:
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent},
                             thread_store=SQLiteThreadStore(tmp_path / "threads.sqlite3"))
    async with serve_runtime(runtime) as served:
        agent.gate.set()
        await served.run(run_input("first", thread="t", run="r0"))
        agent.gate.clear()
        running = await served.post("/agent/default/run", run_input("hi", thread="t"))
        await _read_until(running, "TEXT_MESSAGE_CONTENT")
        response = await served.session.delete(served.url + "/threads/t")
        assert response.status == 409
        agent.gate.set()
        await running.read()
        assert (await served.session.delete(served.url + "/threads/t")).status == 200


class _SlowToStore(InMemoryThreadStore):
    """Holds each finished run at the door until `opened` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.storing = asyncio.Event()
        self.opened = asyncio.Event()

    async def append_run(self, *args: Any, **kwargs: Any) -> None:
        self.storing.set()
        await self.opened.wait()
        await super().append_run(*args, **kwargs)


class _FailingToStore:
    """A store whose writes of finished runs fail while `failing` (a bug of its own, a run
    it cannot take): no outage, not tried again."""

    def __init__(self, store: ThreadStore) -> None:
        self.store = store
        self.failing = True
        self.append_run = store.append_run
        store.append_run = self._append_run  # type: ignore[method-assign]

    async def _append_run(self, *args: Any, **kwargs: Any) -> None:
        if self.failing:
            raise RuntimeError("this store cannot take the run")
        await self.append_run(*args, **kwargs)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_the_run_after_one_that_could_not_be_stored_goes_on_after_its_positions(
        serve_runtime: ServeRuntime, tmp_path: Path, kind: str) -> None:
    """A run its store failed to write (logged "could not store run") gave its thread back
    with the store's head behind the positions it had sent: the next run sent them again,
    so a client resuming after the lost run's end skipped most of the next one. Now the
    next run on this process goes on after them."""
    store = _store(kind, tmp_path)
    failing = _FailingToStore(store)
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store)
    async with serve_runtime(runtime) as served:
        lost = parse_sse_ids(await (await served.post(
            "/agent/default/run", run_input("hello", thread="w", run="r1"))).read())
        failing.failing = False
        ids = []
        for run in ("r2", "r3"):
            ran = parse_sse_ids(await (await served.post(
                "/agent/default/run", run_input("next", thread="w", run=run))).read())
            ids.append([p for p, _ in ran])
        assert ids[0][0] == lost[-1][0] + 1
        assert ids[1][0] == ids[0][-1] + 1  # (the stored head past it: the store's again)
        replayed = parse_sse_ids(await (await served.post(
            "/agent/default/connect", run_input("", thread="w"),
            headers={"Last-Event-ID": str(lost[-1][0])})).read())
        assert [e["runId"] for _, e in replayed if e["type"] == ev.RUN_STARTED] == [
            "r2", "r3"]


@pytest.mark.timeout(30)
async def test_a_thread_is_given_back_only_once_its_run_is_stored(
        serve_runtime: ServeRuntime) -> None:
    """Between a run's end and its store write, a new run on the thread is refused (it would
    read the thread without that run, and number its events over it) and `connect` replays
    the run from memory (the store does not have it yet)."""
    store = _SlowToStore()
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), thread_store=store)
    async with serve_runtime(runtime) as served:
        first = asyncio.ensure_future(served.post("/agent/default/run",
                                                  run_input("hello", thread="w")))
        async with asyncio.timeout(20):
            await store.storing.wait()
        busy = await served.post("/agent/default/run", run_input("next", thread="w", run="r2"))
        assert busy.status == 409
        replay = parse_sse_ids(await (await served.post(
            "/agent/default/connect", run_input("", thread="w"))).read())
        assert [e["type"] for _, e in replay][::len(replay) - 1] == ["RUN_STARTED",
                                                                    "RUN_FINISHED"]
        store.opened.set()
        ran = parse_sse_ids(await (await first).read())
        assert [p for p, _ in replay] == [p for p, _ in ran]
        second = parse_sse_ids(await (await served.post(
            "/agent/default/run", run_input("next", thread="w", run="r2"))).read())
        assert second[0][0] == len(ran)  # numbered after the first run, which is stored
