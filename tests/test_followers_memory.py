"""A `connect` follower of a live run that does not keep up (its client reads slowly, or not
at all) costs the same whatever it misses.

Before, each listener kept a queue entry per batch the run published (a tuple, its batch
kept alive): the probe measured +81 MB for 100 stuck followers of a fast run; here, 100
followers that read nothing of a 5,000-batch run held 32.5 MB more than the run itself.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest

from copilot_runtime import CopilotRuntime
from copilot_runtime import events as ev
from copilot_runtime._input import RunInput, parse_run_input
from copilot_runtime.agents.base import Agent, EventBatches, RunContext
from tests.conftest import run_input

pytestmark = pytest.mark.timeout(60)


class Many(Agent):
    """`count` small batches, one after another."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input.run_id)

    async def _run(self, run_id: str) -> Any:
        message = f"m-{run_id}"
        yield [ev.text_message_start(message)]
        for _ in range(self.count):
            yield [ev.text_message_content(message, "x")]
        yield [ev.text_message_end(message)]


async def _growth_with_followers(followers: int, batches: int) -> int:
    """The memory a run of `batches` batches leaves allocated, `followers` of it never read."""
    runtime = CopilotRuntime(agents={"default": Many(batches)})
    run = await runtime.start_run("default", _parse(run_input("go", thread=f"m{followers}")),
                                  {})
    held = [run.subscribe()[1] for _ in range(followers)]
    tracemalloc.start()
    try:
        async def nothing(_: object) -> None:
            return None

        async with run:
            await run.drive(nothing)
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(held) == followers
    await runtime.aclose()
    return current


def _parse(data: dict[str, Any]) -> RunInput:
    return parse_run_input(data)


async def test_followers_that_read_nothing_hold_no_copy_of_the_run() -> None:
    """Each listener kept a queue entry (a tuple, its batch kept alive) per batch the run
    published: 100 stuck followers of a fast run took +81 MB. A follower is now a position
    in the run's own events."""
    alone = await _growth_with_followers(0, 5000)
    followed = await _growth_with_followers(50, 5000)
    assert followed - alone < 200_000, (alone, followed)


async def test_a_follower_that_falls_behind_gets_what_it_missed_at_once() -> None:
    runtime = CopilotRuntime(agents={"default": Many(10)})
    run = await runtime.start_run("default", _parse(run_input("go", thread="behind")), {})
    so_far, follower = run.subscribe()
    assert so_far == []
    written: list[int] = []

    async def write(batch: Any) -> None:
        written.append(len(batch))

    async with run:
        await run.drive(write)
    first, batch = await follower.get()  # type: ignore[misc]
    assert first == 0
    assert list(batch) == run.events
    assert await follower.get() is None
    await runtime.aclose()
