"""A run over its store's byte bound (`max_run_bytes`) is stored cut, keeping what the thread
shows: its messages. Before, a run whose strings could not be cut enough kept only its
run-level events (the user's message, the answer and the state were gone on every store),
its input's message ids were still marked seen (the client's next run, which sends the
whole history, never stored the lost message), and the cut held the event loop ~20 s."""

from __future__ import annotations

import asyncio
import io
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from copilot_runtime import CopilotRuntime, _limits, thread_store
from copilot_runtime import events as ev
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.agents.builtin import BuiltInAgent
from copilot_runtime.events import EventBatches
from copilot_runtime.testing import verify_events
from copilot_runtime.testing.scripted import ScriptedAdapter, text_turn
from copilot_runtime.threads import ThreadStore
from tests.conftest import Served, ServeRuntime, parse_sse, run_input, types
from tests.hitl_support.postgres import SERVER

TIMEOUT = 120


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ThreadStore]:
    schema = f"oversized_{uuid.uuid4().hex[:10]}"
    if request.param == "memory":
        made = thread_store("memory://")
    elif request.param == "sqlite":
        made = thread_store(f"sqlite:///{tmp_path}/threads.sqlite3")
    else:
        made = thread_store(f"{SERVER}?schema={schema}")
    try:
        yield made
    finally:
        await made.aclose()
        if request.param == "postgresql":
            with psycopg.connect(SERVER, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def short_numbers_body(thread: str = "t1") -> bytes:
    """A body under the 8 MiB body bound whose state's numbers, written short ("1e15"),
    re-encode ~4x longer ("1000000000000000.0"): its run is ~30 MB stored."""
    head = orjson.dumps(run_input("please remember my data", thread=thread, run="r1",
                                  state={"samples": []}))
    return head.replace(b'"samples":[]', b'"samples":[' + b",".join([b"1e15"] * 1_600_000)
                        + b"]")


async def post_run(served: Served, body: bytes) -> list[dict[str, Any]]:
    response = await served.session.post(served.url + "/agent/default/run",
                                         data=io.BytesIO(body),
                                         headers={"Content-Type": "application/json"})
    assert response.status == 200, await response.text()
    events = parse_sse(await response.read())
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    return events


async def thread_reads(served: Served, thread: str) -> tuple[list[dict[str, Any]], Any]:
    """The thread's messages (id, content) and its stored events, checked replayable."""
    response = await served.session.get(served.url + f"/threads/{thread}/events")
    assert response.status == 200, await response.text()
    events = (await response.json())["events"]
    verify_events(events)
    response = await served.session.get(served.url + f"/threads/{thread}/messages")
    assert response.status == 200, await response.text()
    return (await response.json())["messages"], events


def contents(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(m["id"], m.get("content")) for m in messages]


async def test_a_run_over_the_byte_bound_keeps_its_messages_and_the_next_run_its_history(
        store: ThreadStore, serve_runtime: ServeRuntime) -> None:
    """At default limits, a body the runtime accepts whose numbers grow when re-encoded: the
    state the client sent with the run is what is left out, the user's message and the
    answer are stored, and the next run (the whole history again) adds to them."""
    async with asyncio.timeout(TIMEOUT):
        agent = BuiltInAgent(ScriptedAdapter(text_turn("noted"), text_turn("sure")))
        runtime = CopilotRuntime(agents={"default": agent}, thread_store=store)
        async with serve_runtime(runtime) as served:
            live = await post_run(served, short_numbers_body())
            answer = next(e["messageId"] for e in live if e["type"] == "TEXT_MESSAGE_START")
            messages, events = await thread_reads(served, "t1")
            assert contents(messages) == [("r1-u", "please remember my data"),
                                          (answer, "noted")]
            assert len(orjson.dumps(events)) <= _limits.DEFAULT_MAX_RUN_BYTES
            assert events[0]["input"]["state"] == {}

            second = run_input("second question", thread="t1", run="r2",
                               state={"samples": []})
            second["messages"] = [
                {"id": "r1-u", "role": "user", "content": "please remember my data"},
                {"id": answer, "role": "assistant", "content": "noted"},
                *second["messages"]]
            later = await post_run(served, orjson.dumps(second))
            again = next(e["messageId"] for e in later if e["type"] == "TEXT_MESSAGE_START")
            messages, _ = await thread_reads(served, "t1")
            assert contents(messages) == [("r1-u", "please remember my data"),
                                          (answer, "noted"), ("r2-u", "second question"),
                                          (again, "sure")]


class _BulkyState(Agent):
    """Answers with the user's long messages' count, then leaves a state of many small
    values over the bound (no string long enough to cut)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def run(self, input: Any, context: RunContext) -> EventBatches:
        return self._run(input.run_id)

    async def _run(self, run_id: str) -> Any:
        message = f"a-{run_id}"
        yield [ev.text_message_start(message), ev.text_message_content(message, "y" * 40_000),
               ev.text_message_end(message),
               ev.state_snapshot({"rows": [{"id": i, "v": "abcdefgh"}
                                           for i in range(self.rows)]})]


async def test_a_state_too_large_to_store_leaves_a_marker_and_the_messages(
        serve_runtime: ServeRuntime) -> None:
    """An agent's own state over the bound: the stored run has a state saying it was not
    stored, and every message, its long texts cut to one length that fits."""
    async with asyncio.timeout(TIMEOUT):
        bound = 256 * 1024
        runtime = CopilotRuntime(agents={"default": _BulkyState(20_000)}, max_run_bytes=bound)
        async with serve_runtime(runtime) as served:
            body = run_input("x" * 40_000, thread="t2", run="r1")
            body["messages"] += [{"id": f"more-{i}", "role": "user", "content": "z" * 40_000}
                                 for i in range(8)]
            await post_run(served, orjson.dumps(body))
            messages, events = await thread_reads(served, "t2")
            assert len(orjson.dumps(events)) <= bound
            assert [m["id"] for m in messages] == [
                "r1-u", *[f"more-{i}" for i in range(8)], "a-r1"]
            for message in messages:
                assert message["content"].endswith("...[truncated]")
                assert 256 < len(message["content"]) < 40_000
            response = await served.session.get(served.url + "/threads/t2/state")
            assert response.status == 200
            state = (await response.json())["state"]
            marker = _limits.STATE_NOT_STORED
            assert list(state) == [marker]
            assert state[marker]["bytes"] > bound


async def test_cutting_a_large_run_does_not_hold_the_event_loop(
        serve_runtime: ServeRuntime) -> None:
    """Before: the ~30 MB run of `short_numbers_body` was cut on the event loop, 18-26 s of
    it on a loaded machine: every stream and probe of the worker waited. It is cut in a
    thread now: /health answers meanwhile, and another thread's run goes through."""
    async with asyncio.timeout(TIMEOUT):
        agent = BuiltInAgent(ScriptedAdapter(text_turn("noted"), text_turn("other")))
        runtime = CopilotRuntime(agents={"default": agent})
        async with serve_runtime(runtime) as served:
            big = asyncio.create_task(post_run(served, short_numbers_body("big")))
            # The server shares this loop: the longest a probe waits, its sleep counted,
            # is the loop's longest stall.
            worst, started, probes = 0.0, time.monotonic(), 0
            while not big.done():
                response = await served.session.get(served.url + "/health")
                assert response.status == 200
                await response.read()
                probes += 1
                await asyncio.sleep(0.02)
                now = time.monotonic()
                worst, started = max(worst, now - started), now
            await big
            assert probes > 1
            # Generous: the run's own stages on the loop (its echo's encoding, the state in
            # the model's prompt) take ~1 s of a shared CI machine's, the cut took 18-26 s.
            assert worst < 8.0, f"the loop stalled {worst:.2f} s"
            other = await post_run(served, orjson.dumps(run_input("hi", thread="other")))
            assert "other" in orjson.dumps(other).decode()


async def test_messages_a_cut_run_could_not_keep_are_stored_by_the_next_run(
        tmp_path: Path, serve_runtime: ServeRuntime) -> None:
    """A run whose input messages alone pass the bound, even cut, keeps its run-level
    events only: its messages are not marked seen, so the next run, which sends the whole
    history again (here once an operator raised the bound), stores them."""
    async with asyncio.timeout(TIMEOUT):
        history = [{"id": f"h-{i}", "role": "user", "content": f"{i} " + "w" * 400}
                   for i in range(400)]
        url = f"sqlite:///{tmp_path}/threads.sqlite3"
        for run, bound, answer in (("r1", 64 * 1024, "first"), ("r2", None, "second")):
            store = thread_store(url)
            agent = BuiltInAgent(ScriptedAdapter(text_turn(answer)))
            options: dict[str, Any] = {} if bound is None else {"max_run_bytes": bound}
            runtime = CopilotRuntime(agents={"default": agent}, thread_store=store, **options)
            async with serve_runtime(runtime) as served:
                body = run_input("next", thread="t3", run=run)
                body["messages"] = [*history, *body["messages"]]
                await post_run(served, orjson.dumps(body))
                messages, _ = await thread_reads(served, "t3")
            await store.aclose()
        ids = [m["id"] for m in messages]
        assert ids[:400] == [m["id"] for m in history]
        assert "r2-u" in ids
        assert "second" in [m.get("content") for m in messages]
