"""A stop, then at once the thread's next run (a user who stops an answer and types again):
the new run waits for the stopped one to be stored and begins, on every store and on any
worker of a shared coordinator, instead of a 409 while a durable store writes the stopped run
(its thread stays held until then, so that the next run reads its head with it)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from copilot_runtime import BearerTokenAuth, CopilotRuntime, _runs
from copilot_runtime.testing import verify_events
from copilot_runtime.threads.base import StoredRun
from copilot_runtime.threads.sqlite import SQLiteThreadStore
from tests.conftest import (
    GatedAgent,
    Served,
    ServeRuntime,
    parse_sse,
    poll,
    run_input,
    text_of,
    types,
)
from tests.gql.wire import CLIENT_DOCUMENT, CLIENT_HEADERS, merge, parse_multipart, user_turn
from tests.scale_support.services import postgres_schema, redis_prefix

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class SlowWrites(SQLiteThreadStore):
    """A durable store whose finished runs take a while to write (a busy database)."""

    takes = 0.5

    async def append_run(self, thread_id: str, agent_id: str, run: StoredRun,
                         *args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(self.takes)
        await super().append_run(thread_id, agent_id, run, *args, **kwargs)


async def test_a_run_sent_right_after_a_stop_waits_for_the_stopped_run(
        serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent},
                             thread_store=SlowWrites(str(tmp_path / "threads.sqlite3")))
    async with serve_runtime(runtime) as served:
        first = await served.post("/agent/default/run", run_input("hi", thread="t-again"))
        await first.content.readuntil(b"\n\n")  # RUN_STARTED: it runs
        stop = await served.post("/agent/default/stop/t-again", {"runId": "run-1"})
        assert stop.status == 200
        assert (await stop.json())["stopped"] is True
        agent.gate.set()
        again = await served.post("/agent/default/run",
                                  run_input("once more", thread="t-again", run="run-2"))
        assert again.status == 200, await again.text()
        events = parse_sse(await again.read())
        stopped = parse_sse(await first.read())
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED"
    assert text_of(events) == "one two"
    assert types(stopped)[-1] in {"RUN_FINISHED", "RUN_ERROR"}


async def test_a_run_on_a_thread_whose_run_goes_on_is_still_busy(
        serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    """Only a stopped run is waited for: one still running makes the thread busy (409)."""
    agent = GatedAgent()
    runtime = CopilotRuntime(agents={"default": agent},
                             thread_store=SlowWrites(str(tmp_path / "threads.sqlite3")))
    async with serve_runtime(runtime) as served:
        first = await served.post("/agent/default/run", run_input("hi", thread="t-busy"))
        await first.content.readuntil(b"\n\n")
        again = await served.post("/agent/default/run",
                                  run_input("once more", thread="t-busy", run="run-2"))
        assert again.status == 409
        agent.gate.set()
        assert types(parse_sse(await first.read()))[-1] == "RUN_FINISHED"


ALICE, BOB = {"Authorization": "Bearer token-alice"}, {"Authorization": "Bearer token-bob"}


def owned_runtime(agent: GatedAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                  ) -> CopilotRuntime:
    # A run longer than the minute its owner is remembered for (`_KnownOwners`): the owner
    # check is the live run's, not the remembered one's.
    monkeypatch.setattr(_runs._KnownOwners, "ttl", 0.1)
    store = SlowWrites(str(tmp_path / "threads.sqlite3"))
    store.takes = 1.5
    return CopilotRuntime(agents={"default": agent}, thread_store=store,
                          auth=BearerTokenAuth({"token-alice": "alice", "token-bob": "bob"}))


async def test_someone_elses_run_after_a_stop_is_refused_at_once(
        serve_runtime: ServeRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: Bob waited as long as Alice's stopped run took to store (then a 404): how long
    said the thread was there; and his reservation meanwhile made Alice's next run a 409."""
    agent = GatedAgent()
    async with serve_runtime(owned_runtime(agent, tmp_path, monkeypatch)) as served:
        first = await served.post("/agent/default/run", run_input("hi", thread="t-alice"),
                                  headers=ALICE)
        await first.content.readuntil(b"\n\n")
        await asyncio.sleep(0.3)  # her owner is no longer remembered: the run is long
        stop = await served.post("/agent/default/stop/t-alice", {"runId": "run-1"},
                                 headers=ALICE)
        assert stop.status == 200
        agent.gate.set()
        began = time.monotonic()
        bob = await served.post("/agent/default/run",
                                run_input("peek", thread="t-alice", run="bob-1"), headers=BOB)
        assert bob.status == 404
        assert time.monotonic() - began < 1.0
        again = await served.post("/agent/default/run",
                                  run_input("once more", thread="t-alice", run="run-2"),
                                  headers=ALICE)
        assert again.status == 200, await again.text()
        assert types(parse_sse(await again.read()))[-1] == "RUN_FINISHED"
        await first.read()


# -- across workers: a shared coordinator ---------------------------------------------------


@pytest.fixture(params=["postgresql", "redis"])
def coordinator_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "postgresql":
        with postgres_schema("stoprun") as url:
            yield f"{url}&lease_ttl=2"
    else:
        with redis_prefix() as url:
            yield f"{url}&lease_ttl=2"


Workers = tuple[Served, Served, GatedAgent]


@pytest.fixture
async def workers(serve_runtime: ServeRuntime, tmp_path: Path, coordinator_url: str,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Workers]:
    """Workers A and B on one SQLite file (its finished runs slow to write) and a shared
    coordinator, with Alice's and Bob's tokens; B's agent waits after its first words."""
    idle, gated = GatedAgent(), GatedAgent()
    idle.gate.set()
    async with contextlib.AsyncExitStack() as stack:
        a, b = [await stack.enter_async_context(serve_runtime(CopilotRuntime(
            agents={"default": agent}, thread_store=SlowWrites(str(tmp_path / "t.sqlite3")),
            coordinator=coordinator_url,
            auth=BearerTokenAuth({"token-alice": "alice", "token-bob": "bob"}))))
            for agent in (idle, gated)]
        yield a, b, gated


async def running_on(worker: Served, thread: str) -> Any:
    """Alice's run on `worker`, streaming (its first words sent)."""
    first = await worker.post("/agent/default/run", run_input("hi", thread=thread),
                              headers=ALICE)
    assert first.status == 200, await first.text()
    await first.content.readuntil(b"\n\n")
    return first


async def stopped_then_run(first: Any, stop_on: Served, run_on: Served, thread: str) -> None:
    """Stop Alice's run on `thread` (streaming: `first`) on `stop_on`, send her next run to
    `run_on` at once: it waits for the stopped run and streams to its end; so does `first`."""
    stop = await stop_on.post(f"/agent/default/stop/{thread}", {"runId": "run-1"},
                              headers=ALICE)
    assert (await stop.json())["stopped"] is True
    again = await run_on.post("/agent/default/run",
                              run_input("once more", thread=thread, run="run-2"), headers=ALICE)
    assert again.status == 200, await again.text()
    assert types(parse_sse(await again.read()))[-1] == "RUN_FINISHED"
    assert types(parse_sse(await first.read()))[-1] == "RUN_FINISHED"


async def test_a_run_right_after_a_stop_on_another_worker_waits_for_the_stopped_run(
        workers: Workers) -> None:
    """Before: the next run landing on a worker other than the stopped run's was refused
    (409) until that worker had stored the run and given its lease back."""
    a, b, gated = workers
    first = await running_on(b, "t-elsewhere")
    stop = await a.post("/agent/default/stop/t-elsewhere", {"runId": "run-1"}, headers=ALICE)
    assert (await stop.json())["stopped"] is True
    again = await a.post("/agent/default/run",
                         run_input("once more", thread="t-elsewhere", run="run-2"),
                         headers=ALICE)
    assert again.status == 200, await again.text()
    events = parse_sse(await again.read())
    verify_events(events)
    assert types(events)[-1] == "RUN_FINISHED"
    assert text_of(events) == "one two"
    assert types(parse_sse(await first.read()))[-1] == "RUN_FINISHED"
    gated.gate.set()


def graphql_turn(text: str, thread: str) -> bytes:
    return orjson.dumps({"query": CLIENT_DOCUMENT,
                         "variables": {"data": user_turn(text, thread=thread)}})


async def test_a_graphql_clients_stop_then_its_next_message_elsewhere_waits(
        workers: Workers) -> None:
    """The 1.10 client's stop button aborts its request: the run is cut as its client left,
    which marked nothing (a review): its next message on another worker was a 409."""
    a, b, gated = workers
    first = await b.session.post(b.url, data=graphql_turn("hi", "t-gql"),
                                 headers={**CLIENT_HEADERS, **ALICE})
    await first.content.readany()
    first.close()  # the stop button
    async for _ in poll(10):
        run = b.runtime.runs.active.get("t-gql")
        if run is not None and run.cancel_reason == "disconnect":
            break
    again = await a.session.post(a.url, data=graphql_turn("once more", "t-gql"),
                                 headers={**CLIENT_HEADERS, **ALICE})
    answer = merge(parse_multipart(await again.read()))
    assert "errors" not in answer, answer["errors"]
    turn = answer["data"]["generateCopilotResponse"]
    assert turn["status"]["code"] == "Success", turn["status"]
    gated.gate.set()


async def test_a_run_right_after_a_stop_on_the_driving_worker_waits_elsewhere(
        workers: Workers) -> None:
    """The stop asked where the run is driven (no signal goes out): the next run on
    another worker waits for it all the same."""
    a, b, _ = workers
    await stopped_then_run(await running_on(b, "t-driver"), b, a, "t-driver")


async def test_a_stop_not_yet_heard_by_the_driving_worker_is_waited_for_there(
        workers: Workers) -> None:
    """The next run lands on the driving worker before the stop's signal did: it stops its
    run (the coordinator says a stop was asked) and waits for it, not a 409."""
    a, b, gated = workers
    hub = b.runtime.runs.coordinator._hub  # type: ignore[union-attr]
    hub.stop_handler = None  # B hears no stop signal
    first = await running_on(b, "t-unheard")
    stop = await a.post("/agent/default/stop/t-unheard", {"runId": "run-1"}, headers=ALICE)
    assert (await stop.json())["stopped"] is True
    again = await b.post("/agent/default/run",
                         run_input("once more", thread="t-unheard", run="run-2"),
                         headers=ALICE)
    assert again.status == 200, await again.text()
    assert types(parse_sse(await first.read()))[-1] == "RUN_FINISHED"
    gated.gate.set()  # the next run's agent goes on
    assert types(parse_sse(await again.read()))[-1] == "RUN_FINISHED"


async def test_a_run_that_goes_on_elsewhere_is_still_busy_and_someone_elses_at_once(
        workers: Workers) -> None:
    """Only a stopped run is waited for: one still going is a 409 at once, and the thread
    of someone else's run does not exist for him (a 404 at once), stopped or not."""
    a, b, gated = workers
    first = await running_on(b, "t-going")
    began = time.monotonic()
    busy = await a.post("/agent/default/run",
                        run_input("once more", thread="t-going", run="run-2"), headers=ALICE)
    assert busy.status == 409
    assert time.monotonic() - began < 0.5
    stop = await a.post("/agent/default/stop/t-going", {"runId": "run-1"}, headers=ALICE)
    assert (await stop.json())["stopped"] is True
    began = time.monotonic()
    bob = await a.post("/agent/default/run", run_input("peek", thread="t-going", run="bob-1"),
                       headers=BOB)
    assert bob.status == 404
    assert time.monotonic() - began < 0.5
    gated.gate.set()
    await first.read()


async def test_a_stopped_run_slower_to_store_than_its_lease_lives_is_still_waited_for(
        workers: Workers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before (Redis): the stop's mark lived `lease_ttl` (2 s) from the stop, not as long as
    the stopped run's lease: a store taking 3 s made the next run a 409 after 2 s."""
    a, b, gated = workers
    monkeypatch.setattr(SlowWrites, "takes", 3.0)
    await stopped_then_run(await running_on(b, "t-slow"), a, a, "t-slow")
    gated.gate.set()


def hung(coordinator: Any) -> Any:
    """A coordinator call that never answers, within the coordinator's own bound (shortened
    to 3 s: 10 by default)."""
    coordinator.timeout = 3.0

    async def call(*_: Any) -> Any:
        async with coordinator._reachable():
            await asyncio.sleep(60)

    return call


async def test_a_second_run_on_the_driving_worker_is_busy_at_once_on_a_hung_coordinator(
        workers: Workers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the driving worker asked the coordinator whether its run was being stopped
    elsewhere before the 409, and a coordinator that does not answer held it 3 s."""
    _, b, gated = workers
    monkeypatch.setattr(b.runtime.runs, "_holder_stopping", hung(b.runtime.runs.coordinator))
    first = await running_on(b, "t-hung")
    began = time.monotonic()
    busy = await b.post("/agent/default/run", run_input("again", thread="t-hung", run="run-2"),
                        headers=ALICE)
    took = time.monotonic() - began
    gated.gate.set()
    assert busy.status == 409
    assert took < 1.5
    assert types(parse_sse(await first.read()))[-1] == "RUN_FINISHED"


async def test_a_stop_is_not_held_by_a_mark_the_coordinator_does_not_answer(
        workers: Workers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the stop's mark was awaited before its signal went out (the coordinator's
    bound, 3 s, then the signal's own: twice as long on a hung coordinator)."""
    a, b, _ = workers
    monkeypatch.setattr(a.runtime.runs, "_mark_stopping", hung(a.runtime.runs.coordinator))
    first = await running_on(b, "t-unmarked")
    began = time.monotonic()
    stop = await a.post("/agent/default/stop/t-unmarked", {"runId": "run-1"}, headers=ALICE)
    assert (await stop.json())["stopped"] is True
    assert time.monotonic() - began < 1.5
    assert types(parse_sse(await first.read()))[-1] == "RUN_FINISHED"


async def leaves_while_it_waits(worker: Served, thread: str) -> None:
    """Alice's next run on `thread`, whose client leaves (0.3 s) while it waits."""
    with contextlib.suppress(asyncio.TimeoutError):
        await worker.session.post(
            worker.url + "/agent/default/run",
            data=orjson.dumps(run_input("gone", thread=thread, run="run-2")),
            headers={"Content-Type": "application/json", **ALICE},
            timeout=aiohttp.ClientTimeout(total=0.3))
        pytest.fail("it did not wait")


async def runs_stored(worker: Served, thread: str) -> list[str]:
    replay = await worker.post("/agent/default/connect", run_input("", thread=thread, run="c"),
                               headers=ALICE)
    return [e["runId"] for e in parse_sse(await replay.read()) if e["type"] == "RUN_STARTED"]


async def test_a_next_run_whose_client_left_while_it_waited_elsewhere_starts_nothing(
        workers: Workers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: it started after the wait, for nobody (stored, and held the thread: its
    client's retry was a 409)."""
    a, b, gated = workers
    monkeypatch.setattr(SlowWrites, "takes", 1.5)
    first = await running_on(b, "t-leave")
    stop = await a.post("/agent/default/stop/t-leave", {"runId": "run-1"}, headers=ALICE)
    assert (await stop.json())["stopped"] is True
    await leaves_while_it_waits(a, "t-leave")
    assert types(parse_sse(await first.read()))[-1] == "RUN_FINISHED"
    gated.gate.set()
    retry = await a.post("/agent/default/run",
                         run_input("retry", thread="t-leave", run="run-3"), headers=ALICE)
    assert retry.status == 200, await retry.text()
    assert types(parse_sse(await retry.read()))[-1] == "RUN_FINISHED"
    assert await runs_stored(a, "t-leave") == ["run-1", "run-3"]


async def test_a_next_run_whose_client_left_while_it_waited_here_starts_nothing(
        serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    """The same on one worker (`begin`'s own wait for the stopped run)."""
    agent = GatedAgent()
    store = SlowWrites(str(tmp_path / "threads.sqlite3"))
    store.takes = 1.5
    runtime = CopilotRuntime(agents={"default": agent}, thread_store=store,
                             auth=BearerTokenAuth({"token-alice": "alice"}))
    async with serve_runtime(runtime) as served:
        first = await running_on(served, "t-leave")
        stop = await served.post("/agent/default/stop/t-leave", {"runId": "run-1"},
                                 headers=ALICE)
        assert (await stop.json())["stopped"] is True
        await leaves_while_it_waits(served, "t-leave")
        assert types(parse_sse(await first.read()))[-1] == "RUN_FINISHED"
        agent.gate.set()
        retry = await served.post("/agent/default/run",
                                  run_input("retry", thread="t-leave", run="run-3"),
                                  headers=ALICE)
        assert retry.status == 200, await retry.text()
        assert types(parse_sse(await retry.read()))[-1] == "RUN_FINISHED"
        assert await runs_stored(served, "t-leave") == ["run-1", "run-3"]
