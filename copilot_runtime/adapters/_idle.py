"""A bound on each wait for the next piece of an SDK's streamed answer.

The SDK routes read their answer through the SDK's HTTP client, whose own read timeout
does not always hold: aiohttp never wakes a body reader after a chunk it could not parse
mid-body, so the run waited forever and its thread stayed busy. `IdleBound` holds every
wait to the adapter's timeout itself, the way the direct route's watchdog does
(`_http1`): one timer per `seconds`, not per read, since a read only notes when it began.
A ready client of the app's own, given no adapter timeout, bounds each wait by its own read
timeout instead (`read_timeout`), or by the adapter's default when it has none.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

from copilot_runtime._exceptions import UpstreamTimeoutError

__all__ = ["DEFAULT_TIMEOUT", "IdleBound", "read_timeout", "wait_bound"]

_T = TypeVar("_T")

#: An adapter's timeout when none is given, in seconds: the bound on each wait.
DEFAULT_TIMEOUT = 120.0


class IdleBound(Generic[_T]):
    """`pieces`, each wait for the next one ended after `seconds` by an
    `UpstreamTimeoutError(silent)` (`seconds` None: unbounded). Time the consumer spends
    between reads never counts. `close()` (in the consumer's `finally`) drops the timer."""

    __slots__ = ("_expired", "_loop", "_next", "_seconds", "_silent", "_task", "_timer",
                 "_waiting_since")

    def __init__(self, pieces: AsyncIterator[_T], seconds: float | None, silent: str) -> None:
        self._next = pieces.__anext__
        self._seconds = seconds
        self._silent = silent
        self._loop = asyncio.get_running_loop()
        #: When the current wait began; None between waits.
        self._waiting_since: float | None = None
        self._task: asyncio.Task[object] | None = None
        self._timer: asyncio.TimerHandle | None = None
        #: Set when the timer cancelled the waiting task.
        self._expired = False

    def __aiter__(self) -> IdleBound[_T]:
        return self

    async def __anext__(self) -> _T:
        since = self._waiting_since = self._loop.time()
        task = self._task = asyncio.current_task()
        if self._timer is None and self._seconds is not None:
            self._timer = self._loop.call_at(since + self._seconds, self._check)
        try:
            return await self._next()
        except asyncio.CancelledError:
            if not self._expired or task is None:
                raise
            self._expired = False
            if task.uncancel() > 0:
                raise  # cancelled by someone else too (a stop): theirs to handle
            raise UpstreamTimeoutError(self._silent) from None
        finally:
            self._waiting_since = None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        since = self._waiting_since
        if since is None or self._task is None or self._seconds is None:
            return  # not waiting: the next wait arms the timer again
        deadline = since + self._seconds
        if self._loop.time() >= deadline:
            self._expired = True
            self._task.cancel()
        else:
            self._timer = self._loop.call_at(deadline, self._check)


def read_timeout(setting: object) -> float | None:
    """The read timeout of an SDK client's `timeout` setting, in seconds: the number itself,
    or a timeout object's `read` (httpx's, the SDKs' own); None when there is none."""
    read = getattr(setting, "read", setting)
    if isinstance(read, bool) or not isinstance(read, int | float):
        return None
    return float(read)


def wait_bound(timeout: float | None, client_timeout: float | None) -> float:
    """The bound on each wait through an SDK: the adapter's `timeout` when given, else a
    ready client's own read timeout, else `DEFAULT_TIMEOUT` (never none: a silent upstream
    kept the run and its thread busy for ever)."""
    if timeout is not None:
        return timeout
    return DEFAULT_TIMEOUT if client_timeout is None else client_timeout
