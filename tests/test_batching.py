"""The batcher behind grouped coordinator calls: a lone call goes at once, calls made while
one is in flight go together next, errors reach that batch's callers, and a result whose
caller left is handed over rather than lost."""

from __future__ import annotations

import asyncio

import pytest

from copilot_runtime._batching import Batcher

pytestmark = pytest.mark.timeout(30)


class Doubler:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: set[int] = set()

    async def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(items)
        await self.gate.wait()
        if self.fail & set(items):
            raise ValueError(f"refused {sorted(self.fail & set(items))}")
        return [2 * x for x in items]


async def test_calls_made_meanwhile_go_together_in_order() -> None:
    run = Doubler()
    batcher: Batcher[int, int] = Batcher(run, max_batch=3)
    assert await batcher(1) == 2
    run.gate.clear()
    first = asyncio.ensure_future(batcher(10))
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(batcher(x)) for x in range(5)]
    await asyncio.sleep(0)
    run.gate.set()
    assert await first == 20
    assert await asyncio.gather(*rest) == [0, 2, 4, 6, 8]
    assert run.batches == [[1], [10], [0, 1, 2], [3, 4]]
    assert await batcher(7) == 14  # and alone again afterwards
    assert run.batches[-1] == [7]


async def test_an_error_reaches_the_callers_of_its_batch_only() -> None:
    run = Doubler()
    batcher: Batcher[int, int] = Batcher(run, max_batch=2)
    run.gate.clear()
    run.fail = {3}
    first = asyncio.ensure_future(batcher(1))
    await asyncio.sleep(0)
    others = [asyncio.ensure_future(batcher(x)) for x in (2, 3, 4)]
    await asyncio.sleep(0)
    run.gate.set()
    results = await asyncio.gather(first, *others, return_exceptions=True)
    assert results[0] == 2
    assert all(isinstance(r, ValueError) for r in results[1:3])
    assert results[3] == 8


async def test_a_result_whose_caller_left_goes_to_the_orphan_handler() -> None:
    run = Doubler()
    orphans: list[int] = []

    async def orphan(result: int) -> None:
        orphans.append(result)

    batcher: Batcher[int, int] = Batcher(run, orphan=orphan)
    run.gate.clear()
    first = asyncio.ensure_future(batcher(1))
    await asyncio.sleep(0)
    leaving = asyncio.ensure_future(batcher(5))
    staying = asyncio.ensure_future(batcher(6))
    await asyncio.sleep(0)
    leaving.cancel()
    run.gate.set()
    assert await first == 2
    assert await staying == 12
    with pytest.raises(asyncio.CancelledError):
        await leaving
    for _ in range(3):
        await asyncio.sleep(0)
    assert orphans == [10]
