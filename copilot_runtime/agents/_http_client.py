"""The HTTP plumbing the remote agent kinds share: sessions, timeouts, failures as errors.

Every remote call goes through aiohttp (already the runtime's transport), with one
connection pool per agent. Failures become `UpstreamError`/`UpstreamTimeoutError` with a
message for the client that says what went wrong without the remote's URL or internals;
the URL and the underlying exception go to the log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import orjson
import structlog

from copilot_runtime._exceptions import (
    UpstreamError,
    UpstreamTimeoutError,
    quoted,
    scrub_secrets,
)

__all__ = ["REDIRECT_NOT_FOLLOWED", "SessionHolder", "Timeouts", "error_for_exception",
           "error_for_status"]

_log = structlog.get_logger("copilot_runtime.agents")

#: What a remote's 3xx answer is said to be, after its status.
REDIRECT_NOT_FOLLOWED: Final = (": a redirect, not followed (it would take the request's "
                                "credentials along): configure the URL it points to")


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long a remote call may take, in seconds (None: no limit).

    `connect` bounds opening the connection; `read` bounds each silence while waiting for
    the answer's next bytes (a streaming agent that thinks for a long time between events
    needs a generous one); `total` bounds the whole call, stream included.
    """

    connect: float | None = 10.0
    read: float | None = 300.0
    total: float | None = None

    def client_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.total, sock_connect=self.connect,
                                     sock_read=self.read)


class SessionHolder:
    """One aiohttp session per agent, opened lazily inside the running event loop."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> aiohttp.ClientSession:
        session, loop = self._session, asyncio.get_running_loop()
        if session is None or session.closed or self._loop is not loop:
            # A runtime reused across event loops (tests, notebooks) needs a fresh pool.
            # No cap on its connections: aiohttp's default holds 100, and the 101st stream
            # waited for one of them to end, silently and without bound (Node's fetch, the
            # TypeScript runtime's, has no cap either).
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._session, self._loop = session, loop
        return session

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


def error_for_exception(exc: BaseException, what: str, url: str) -> UpstreamError:
    """The client-facing error for a failed call to `what` (e.g. "Agent 'x'")."""
    _log.warning("remote call failed", target=what, url=scrub_secrets(url),
                 error=scrub_secrets(_described(exc)))
    error = _error_for(exc, what)
    error.logged = True
    return error


def _error_for(exc: BaseException, what: str) -> UpstreamError:
    if isinstance(exc, TimeoutError):
        return UpstreamTimeoutError(f"{what} did not answer in time")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamError(f"{what} could not be reached (connection failed)")
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
                  | aiohttp.ClientOSError):
        return UpstreamError(f"{what} closed the connection before the answer was complete")
    return UpstreamError(f"{what} failed ({type(exc).__name__})")


def _described(exc: BaseException) -> str:
    """`exc` for the log. A `ClientResponseError`'s repr holds the request it answers, with
    every header the runtime sent: the operator's credentials under any name (an
    `X-Functions-Key`, an `Ocp-Apim-Subscription-Key`) and those forwarded from the client.
    The log names the URL already: only the status and the message are kept."""
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"{type(exc).__name__}(status={exc.status}, message={exc.message!r})"
    return repr(exc)


#: How much of an error answer's body is read, and for how long: its message is short, and
#: a remote that trickles it must not hold the run's error back.
_ERROR_BODY_BYTES = 4096
_ERROR_BODY_SECONDS = 2.0


async def _error_body(response: aiohttp.ClientResponse) -> bytes:
    """The start of an error answer's body: up to `_ERROR_BODY_BYTES` or its end, whichever
    comes first, however many reads it takes (one read got only the first TCP segment)."""
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(_ERROR_BODY_SECONDS):
            while size < _ERROR_BODY_BYTES:
                part = await response.content.read(_ERROR_BODY_BYTES - size)
                if not part:
                    break
                parts.append(part)
                size += len(part)
    except TimeoutError:
        pass  # what came in time (a message cut short does not decode: none is shown)
    return b"".join(parts)


async def error_for_status(response: aiohttp.ClientResponse, what: str,
                           known: Sequence[str] = ()) -> UpstreamError:
    """The client-facing error for an HTTP error answer, with the remote's own message
    (`quoted`, the `known` secrets the request carried blanked)."""
    detail = ""
    try:
        payload: Any = orjson.loads(await _error_body(response))
        if isinstance(payload, dict):
            for key in ("message", "error", "detail"):
                value = payload.get(key)
                if isinstance(value, str) and value:
                    said = quoted(value, known=known)  # None: a crash report, not for the client
                    detail = f": {said}" if said else ""
                    break
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError):
        pass
    if 300 <= response.status < 400:
        detail = REDIRECT_NOT_FOLLOWED
    return UpstreamError(f"{what} answered HTTP {response.status}{detail}",
                         status=response.status)
