"""A deadline for a block whose clean-up, once cancelled, may itself wait on the server
that stopped answering."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["within"]

#: How often a block still running past its deadline is cancelled again.
_AGAIN = 0.05


@contextlib.asynccontextmanager
async def within(seconds: float) -> AsyncIterator[None]:
    """The block, cancelled after `seconds` (then TimeoutError), like `asyncio.timeout`; but
    a block still running after its cancellation is cancelled again, every `_AGAIN` seconds.
    psycopg answers a cancelled statement by asking the server to cancel it and waiting up
    to 5 s for that: from a server that stopped answering, those 5 s would be added to the
    deadline. Cancelled again, it closes the connection at once."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    sent = 0
    handle: asyncio.TimerHandle

    def cancel() -> None:
        nonlocal handle, sent
        sent += 1
        task.cancel()
        handle = loop.call_later(_AGAIN, cancel)

    handle = loop.call_later(seconds, cancel)
    try:
        yield
    except asyncio.CancelledError:
        if sent == 0:
            raise
        for _ in range(sent):
            task.uncancel()
        if task.cancelling():
            raise  # cancelled by someone else too: theirs to handle
        raise TimeoutError from None
    finally:
        handle.cancel()
