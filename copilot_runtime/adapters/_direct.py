"""An adapter's own route to its provider: one pre-encoded request, retried the way the
provider's SDK retries it, and its streamed answer read through the adapter's parser.

The OpenAI and Anthropic SDKs come from one generator and share a retry policy
(`SDKRetries`): 408, 409, 429 and 5xx are retried (an `x-should-retry` header overrides), as
are connections that fail or close without an answer; the wait honours `retry-after-ms` /
`Retry-After`, else grows from 0.5 s to 8 s with up to 25 % jitter; each attempt says its
number in `X-Stainless-Retry-Count`. They differ in one bound: OpenAI gives up on a
Retry-After above two minutes, Anthropic waits for it. The Gemini adapter brings its SDK's
policy of its own.

On top of each SDK's policy, one bound of this runtime's (`max_retry_wait`, the adapters'
argument): a chat user is not kept waiting, the stream open and silent, for a provider that
asks for longer. A Retry-After above it, or waits that would add up past it, end the request
at once with the provider's error, which says when to try again (`status_failure`). A wait
is an `asyncio.sleep` in the run's task, so a stop or a disconnect cancels it at once. The
SDK route of the adapters that build their SDK's client holds each wait to the bound too
(`sdk_wait_bound`, a response hook of that client).
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import os
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import NamedTuple, Protocol, TypeVar

import orjson

from copilot_runtime._exceptions import (
    ConfigurationError,
    UpstreamConnectionError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeoutError,
    upstream_said,
)
from copilot_runtime.adapters import _http1
from copilot_runtime.adapters.base import ChatDelta

__all__ = ["DEFAULT_MAX_RETRY_WAIT", "FINISHED_WAIT", "Failures", "RetryPolicy", "SDKRetries",
           "StreamParser", "after_finish", "body_message", "check_max_retry_wait",
           "credentials", "header_credentials", "proxy_in_environment", "retry_after_seconds",
           "sdk_wait_bound", "send", "status_failure", "stream", "unwaited"]

_T = TypeVar("_T")

_INITIAL_RETRY_DELAY = 0.5
_MAX_RETRY_DELAY = 8.0
#: The longest a request waits, in all, for its provider to be ready again (seconds).
DEFAULT_MAX_RETRY_WAIT = 60.0
#: After an answer's finish reason, the longest wait for what may still follow it (the usage
#: asked for, the end marker), in seconds: some servers and proxies send nothing more and
#: keep the connection open, and the answer is complete without it.
FINISHED_WAIT = 2.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                    "all_proxy")


def proxy_in_environment() -> bool:
    """Whether an HTTP proxy is set in the environment: the own route connects directly,
    so an adapter sends through its SDK then, whose client honours the proxy."""
    return any(os.environ.get(name) for name in _PROXY_VARIABLES)


_CREDENTIAL_LINES = re.compile(
    rb"(?im)^(?:authorization|x-api-key|api-key|x-goog-api-key)[ \t]*:[ \t]*"
    rb"(?:(?:bearer|basic)[ \t]+)?([^\r\n]+)")


def credentials(head: bytes) -> tuple[str, ...]:
    """The credentials a request's head carries, custom headers' too (to keep them out of
    error messages, the status error's here and the stream parser's mid-stream)."""
    return tuple(m.decode("latin-1").strip() for m in _CREDENTIAL_LINES.findall(head))


def header_credentials(headers: Mapping[str, object]) -> tuple[str, ...]:
    """`credentials` of an SDK client's headers (its `default_headers` hold its key)."""
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items()
                    if isinstance(value, str))
    return credentials(lines.encode("latin-1", "replace"))


class Failures(NamedTuple):
    """What each failure of one provider's requests is called."""

    #: Begins "… request failed with HTTP 429: …".
    provider: str
    #: Nothing arrived for the read timeout.
    silent: str
    connect_failed: str
    hung_up: str
    malformed: str
    #: The connection broke in the middle of the answer.
    broke_off: str


class RetryPolicy(Protocol):
    #: Whether each attempt carries `X-Stainless-Retry-Count: N` (after `head`).
    counts_attempts: bool
    #: Whether a request that got no answer head within the read timeout is tried again.
    retries_silence: bool

    def status_error(self, status: int, text: bytes) -> str:
        """What follows "… request failed with HTTP {status}: " for this error body."""
        ...

    def retry_after(self, response: _http1.Response) -> float | None:
        """Seconds to wait before trying an answer of this status again, or None: never."""
        ...

    def asked_wait(self, response: _http1.Response, text: bytes) -> float | None:
        """Seconds the provider asked to be left alone for (its Retry-After), or None."""
        ...

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt `attempt` (0: the first) without an answer."""
        ...


class StreamParser(Protocol):
    """An incremental parser of a provider's streamed answer."""

    @property
    def done(self) -> bool:
        """Whether the answer's end was read (the rest of the body is not needed)."""
        ...

    @property
    def finished(self) -> bool:
        """Whether the answer is complete but for what may follow its finish reason (true
        once `done`): the rest is then read only for `FINISHED_WAIT` (`after_finish`)."""
        ...

    def feed(self, data: bytes) -> Sequence[ChatDelta]:
        ...

    def finish(self) -> Sequence[ChatDelta]:
        """What the answer's end adds once the body has ended; raises when it was cut short."""
        ...


async def send(pool: _http1.HTTPPool, head: bytes, tail: bytes, body: bytes, *,
               read_timeout: float, max_retries: int, max_wait: float, failures: Failures,
               policy: RetryPolicy) -> _http1.Response:
    """The answer's head after the policy's retries, or the `UpstreamError` of the last try.

    `head` is the request line and headers before the attempt count, `tail` those after it
    (without Content-Length). No wait is longer, and all of them add up to no more, than
    `max_wait` seconds: past that the error is raised instead (see the module doc).
    """
    tail += b"Content-Length: %d\r\n\r\n" % len(body)
    attempt = 0
    waited = 0.0
    while True:
        # (of an error answer: its status, what it said, the wait it asked for)
        status: int | None = None
        said = ""
        asked: float | None = None
        data = b"".join((head, b"X-Stainless-Retry-Count: %d\r\n" % attempt, tail, body)) \
            if policy.counts_attempts else b"".join((head, tail, body))
        wait: float | None = None
        try:
            response = await pool.request(data, read_timeout)
        except _http1.ConnectError as exc:
            error: UpstreamError = UpstreamTimeoutError(failures.silent) if (
                exc.timeout) else UpstreamConnectionError(failures.connect_failed)
        except _http1.Disconnected:
            error = UpstreamConnectionError(failures.hung_up)
        except _http1.ReadTimeout:
            error = UpstreamTimeoutError(failures.silent)
            if not policy.retries_silence:
                raise error from None
        except _http1.HTTPClientError:
            raise UpstreamProtocolError(failures.malformed) from None
        else:
            if 200 <= response.status < 300:
                return response
            try:
                text = await response.read()
            except _http1.HTTPClientError:
                text = b""
            response.release()
            status = response.status
            # An error body may echo the credential it was sent: never pass that on.
            said = upstream_said(policy.status_error(status, text), credentials(head + tail))
            asked = policy.asked_wait(response, text)
            if asked is not None and asked > max_wait:
                raise status_failure(failures.provider, status, said, asked)
            error = status_failure(failures.provider, status, said, None)
            wait = policy.retry_after(response)
            if wait is None:
                raise error
        if attempt >= max_retries:
            raise error
        delay = policy.backoff(attempt) if wait is None or wait <= 0 else wait
        if waited + delay > max_wait:
            raise error if status is None else status_failure(
                failures.provider, status, said, asked)
        await asyncio.sleep(delay)
        waited += delay
        attempt += 1


def status_failure(provider: str, status: int, said: str,
                   asked: float | None = None) -> UpstreamError:
    """The error of an answer of HTTP `status` (`said`: the provider's words, already
    through `upstream_said`). Given `asked`, the seconds the provider asked to wait which
    the bound on waits did not allow, the message also says the provider is rate-limiting
    or unavailable, and when to try again."""
    message = f"{provider} request failed with HTTP {status}: {said}"
    if asked is not None and 0 < asked < 1e9 and (status in (408, 409, 429) or status >= 500):
        state = "rate-limiting requests" if status == 429 else "unavailable"
        message += f" ({provider} is {state}: try again in {math.ceil(asked)} s)"
    return UpstreamError(message, status=status)


class _SDKResponse(Protocol):
    """What `sdk_wait_bound` reads of an SDK's HTTP answer (an `httpx2.Response`)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> MutableMapping[str, str]: ...


def sdk_wait_bound(max_wait: float) -> Callable[[_SDKResponse], Awaitable[None]]:
    """A response hook for an SDK's HTTP client, holding its retries to `max_wait`: an
    answer asking for a longer wait is marked `x-should-retry: false` (the header both SDKs
    obey), so the SDK raises its error at once instead of sleeping for as long as the
    provider asks (Anthropic's SDK waits any Retry-After, OpenAI's up to a minute)."""

    async def hook(response: _SDKResponse) -> None:
        status = response.status_code
        if status in (408, 409, 429) or status >= 500:
            asked = retry_after_seconds(response.headers.get)
            if asked is not None and asked > max_wait:
                response.headers["x-should-retry"] = "false"

    return hook


def unwaited(asked: float | None, max_wait: float) -> float | None:
    """`asked` when the bound on waits would not allow it (what `status_failure` takes):
    for an SDK's error, whose route cannot tell why it gave up."""
    return asked if asked is not None and asked > max_wait else None


def check_max_retry_wait(adapter: str, seconds: float) -> float:
    """`seconds` as an adapter's `max_retry_wait`, or a `ConfigurationError`."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not 0 <= seconds < math.inf:
        raise ConfigurationError(
            f"{adapter}: max_retry_wait must be a number of seconds, 0 or more")
    return float(seconds)


async def stream(response: _http1.Response, parser: StreamParser,
                 failures: Failures) -> AsyncIterator[Sequence[ChatDelta]]:
    """The parser's deltas, one batch per read of the body, up to the answer's end.

    The connection goes back to the pool once the answer is read; a consumer that stops
    early (a stop, a disconnect), a failure, or a server silent after the answer's finish
    closes it, which cancels the upstream request.
    """
    silent = False
    try:
        chunks = response.chunks()
        async for data in chunks:
            deltas = parser.feed(data)
            if deltas:
                yield deltas
            if parser.finished:
                break
        if parser.finished and not parser.done:
            deltas, silent = await after_finish(chunks, parser.feed, parser)
            if deltas:
                yield deltas
        deltas = parser.finish()
        if deltas:
            yield deltas
    except UpstreamError as exc:
        if exc.pending:  # the deltas its read parsed before it, which come first
            pending, exc.pending = exc.pending, ()
            yield pending
        raise
    except _http1.ReadTimeout:
        raise UpstreamTimeoutError(failures.silent) from None
    except _http1.HTTPClientError:
        raise UpstreamConnectionError(failures.broke_off) from None
    finally:
        if parser.done and not silent:
            response.release()  # read to its end: the connection serves the next one
        else:
            response.abort()


async def after_finish(pieces: AsyncIterator[_T], feed: Callable[[_T], Sequence[ChatDelta]],
                       parser: StreamParser | None, wait: float = FINISHED_WAIT
                       ) -> tuple[list[ChatDelta], bool]:
    """What follows an answer's finish reason (`parser.finished`): `feed`'s deltas of the
    `pieces` read until the parser is done (`parser` None: until the body's end) for at most
    `wait` seconds; and whether the upstream was still silent then (its response
    is to be closed, the answer complete all the same: `parser.finish()` ends it).

    One timer per answer, armed only once its finish reason has come.
    """
    out: list[ChatDelta] = []
    try:
        async with asyncio.timeout(wait):
            async for piece in pieces:
                out.extend(feed(piece))
                if parser is not None and parser.done:
                    break
    except (TimeoutError, _http1.ReadTimeout, UpstreamTimeoutError):
        # (a read timeout shorter than the wait, the route's own bound, says the same)
        return out, True
    except UpstreamError as exc:
        if out:  # what came before it comes first (see `stream`)
            exc.pending = [*out, *exc.pending]
        raise
    return out, False


class SDKRetries:
    """The retry policy of the OpenAI and Anthropic SDKs (see the module doc)."""

    counts_attempts = True
    retries_silence = True

    def __init__(self, max_retry_after: float | None) -> None:
        #: The longest Retry-After still waited for (None: any).
        self.max_retry_after = max_retry_after

    def status_error(self, status: int, text: bytes) -> str:
        return body_message(text, status)

    def retry_after(self, response: _http1.Response) -> float | None:
        wait = retry_after_seconds(response.header)
        if wait is not None and self.max_retry_after is not None \
                and wait > self.max_retry_after:
            return None
        should = response.header("x-should-retry")
        if should in ("true", "false"):
            retry = should == "true"
        else:
            retry = response.status in (408, 409, 429) or response.status >= 500
        if not retry:
            return None
        return min(wait, 4_294_967.0) if wait is not None and wait > 0 else 0.0

    def asked_wait(self, response: _http1.Response, text: bytes) -> float | None:
        return retry_after_seconds(response.header)

    def backoff(self, attempt: int) -> float:
        delay = min(_INITIAL_RETRY_DELAY * 2.0 ** min(attempt, 1000), _MAX_RETRY_DELAY)
        return delay * (1 - 0.25 * random.random())  # jitter, not a secret


def body_message(text: bytes, status: int) -> str:
    """What the SDKs' error message is for this error body."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, list) and body:  # [{"error": {...}}]: Gemini's OpenAI endpoint
        body = body[0]
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            message = error.get("message")
            if isinstance(message, str) and message:
                return message
    return f"Error code: {status}"


def retry_after_seconds(header: Callable[[str], str | None]) -> float | None:
    """The server's Retry-After (`retry-after-ms` first), in seconds, as the SDKs read it
    from an answer's headers (`header`: a header's value by its name, or None)."""
    for name, divisor in (("retry-after-ms", 1000), ("retry-after", 1)):
        value = header(name)
        if value is None:
            continue
        try:
            return float(value) / divisor
        except ValueError:
            continue
    value = header("retry-after")
    if value:
        try:
            parsed = email.utils.parsedate_tz(value)
            if parsed is not None:
                return float(email.utils.mktime_tz(parsed) - time.time())
        except (TypeError, ValueError, OverflowError):
            return None
    return None
