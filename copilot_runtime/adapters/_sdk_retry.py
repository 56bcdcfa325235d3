"""Sending one pre-encoded request the way the official OpenAI and Anthropic SDKs do.

Both SDKs come from one generator and share their retry policy: 408, 409, 429 and 5xx are
retried (an `x-should-retry` header overrides), as are connections that fail or close without
an answer; the wait honours `retry-after-ms` / `Retry-After`, else grows from 0.5 s to 8 s
with up to 25 % jitter; each attempt says its number in `X-Stainless-Retry-Count`. They differ
in one bound: OpenAI gives up on a Retry-After above two minutes, Anthropic waits for it.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from typing import NamedTuple

import orjson

from copilot_runtime._exceptions import (
    UpstreamConnectionError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeoutError,
)
from copilot_runtime.adapters import _http1

__all__ = ["Failures", "body_message", "retry_after", "send", "should_retry"]

_INITIAL_RETRY_DELAY = 0.5
_MAX_RETRY_DELAY = 8.0


class Failures(NamedTuple):
    """What each failure of one provider's requests is called."""

    #: Begins "… request failed with HTTP 429: …".
    provider: str
    silent: str
    connect_failed: str
    hung_up: str
    malformed: str


async def send(pool: _http1.HTTPPool, head: bytes, tail: bytes, body: bytes, *,
               read_timeout: float, max_retries: int, failures: Failures,
               max_retry_after: float | None) -> _http1.Response:
    """The answer's head after the SDKs' retries, or the `UpstreamError` of the last attempt.

    `head` is the request line and headers before the retry count, `tail` those after it
    (without Content-Length); `max_retry_after` is the longest Retry-After still waited for
    (None: any).
    """
    tail += b"Content-Length: %d\r\n\r\n" % len(body)
    attempt = 0
    while True:
        data = b"".join((head, b"X-Stainless-Retry-Count: %d\r\n" % attempt, tail, body))
        wait: float | None = None
        try:
            response = await pool.request(data, read_timeout)
        except _http1.ConnectError as exc:
            error: UpstreamError = UpstreamTimeoutError(failures.silent) if (
                exc.timeout) else UpstreamConnectionError(failures.connect_failed)
            retry = True
        except _http1.Disconnected:
            error, retry = UpstreamConnectionError(failures.hung_up), True
        except _http1.ReadTimeout:
            error, retry = UpstreamTimeoutError(failures.silent), True
        except _http1.HTTPClientError:
            error, retry = UpstreamProtocolError(failures.malformed), False
        else:
            if 200 <= response.status < 300:
                return response
            try:
                text = await response.read()
            except _http1.HTTPClientError:
                text = b""
            response.release()
            error = UpstreamError(
                f"{failures.provider} request failed with HTTP {response.status}: "
                f"{body_message(text, response.status)}", status=response.status)
            wait = retry_after(response)
            retry = should_retry(response, wait, max_retry_after)
        if not retry or attempt >= max_retries:
            raise error
        await asyncio.sleep(_delay(attempt, wait, max_retry_after))
        attempt += 1


def body_message(text: bytes, status: int) -> str:
    """What the SDKs' error message is for this error body."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            message = error.get("message")
            if isinstance(message, str) and message:
                return message
    return f"Error code: {status}"


def retry_after(response: _http1.Response) -> float | None:
    """The server's Retry-After (`retry-after-ms` first), in seconds, as the SDKs read it."""
    for name, divisor in (("retry-after-ms", 1000), ("retry-after", 1)):
        value = response.header(name)
        if value is None:
            continue
        try:
            return float(value) / divisor
        except ValueError:
            continue
    value = response.header("retry-after")
    if value:
        try:
            parsed = email.utils.parsedate_tz(value)
            if parsed is not None:
                return float(email.utils.mktime_tz(parsed) - time.time())
        except (TypeError, ValueError, OverflowError):
            return None
    return None


def should_retry(response: _http1.Response, wait: float | None,
                 max_retry_after: float | None) -> bool:
    if wait is not None and max_retry_after is not None and wait > max_retry_after:
        return False
    should = response.header("x-should-retry")
    if should in ("true", "false"):
        return should == "true"
    return response.status in (408, 409, 429) or response.status >= 500


def _delay(attempt: int, wait: float | None, max_retry_after: float | None) -> float:
    if wait is not None and wait > 0 and (max_retry_after is None or wait <= max_retry_after):
        return min(wait, 4_294_967.0)
    delay = min(_INITIAL_RETRY_DELAY * 2.0 ** min(attempt, 1000), _MAX_RETRY_DELAY)
    return delay * (1 - 0.25 * random.random())  # jitter, not a secret
