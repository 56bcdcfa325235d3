"""Hooks: the application's code around requests and runs (the TypeScript middleware).

    on_request(request: RequestInfo) -> Mapping | None     before a request is served
    on_run_finished(run: RunFinished) -> None             after a run has been stored
    on_error(error: ErrorInfo) -> None                    a run ended with an error

`on_request` runs after authentication: it may refuse the request by raising a
`RequestError` (say `copilot_runtime.RequestRejectedError`, 403 unless given another
error status), or return annotations that agents see as `RunContext.annotations`. It is a
policy, so it fails closed: if it raises anything else (a `RequestError` whose status is no
HTTP error, or a `CancelledError` of its own, included), or has not answered within
`request_timeout` seconds, the request is refused with 503 (a policy whose backing service
is down must not admit everyone, nor hold requests without end). The other two run in the
background, so they never hold up or break a stream; whatever they raise is logged, and one
that has not returned within `background_timeout` seconds is cancelled (and logged): a hook
waiting on a service that never answers would otherwise keep each run's messages in memory
for the life of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from copilot_runtime._exceptions import (
    FAILURES_OF_CALLED_CODE,
    RequestError,
    ServiceUnavailableError,
    cancelled_itself,
    is_error_status,
    unwinding,
)
from copilot_runtime.auth import Principal, RequestInfo

__all__ = ["ErrorInfo", "HookRunner", "OnError", "OnRequest", "OnRunFinished", "RunFinished"]

_log = structlog.get_logger("copilot_runtime.hooks")

# What a plain (not async) hook's call may raise: it has no await, so a `CancelledError`
# is the hook's own (it read a cancelled future), never its caller's cancellation.
_PLAIN_HOOK_FAILURES: tuple[type[BaseException], ...] = (
    *FAILURES_OF_CALLED_CODE, asyncio.CancelledError)

#: Seconds `on_request` may take before its request is refused (503).
DEFAULT_REQUEST_TIMEOUT = 10.0
#: Seconds `on_run_finished` or `on_error` (async) may take before it is cancelled.
DEFAULT_BACKGROUND_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class RunFinished:
    agent_id: str
    thread_id: str
    run_id: str
    principal: Principal | None
    #: The messages the run added (AG-UI messages as dicts), the user's input included; for
    #: a `suggestion`, every message it was sent, then its answer.
    new_messages: list[dict[str, Any]]
    #: Token counts summed over the run's model calls (`input_tokens`, `output_tokens`),
    #: where the agent reports them.
    usage: Mapping[str, int]
    #: finished, error, stopped, disconnected, interrupted or refused (by a guardrail).
    outcome: str
    duration: float
    error: Mapping[str, Any] | None = None
    annotations: Mapping[str, Any] = field(default_factory=dict)
    #: A chat suggestion's run (`/agent/{id}/suggest`), kept out of its thread (stored
    #: nowhere; its thread id is often a throwaway one), not a turn of the chat.
    suggestion: bool = False


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    message: str
    code: str
    agent_id: str | None = None
    thread_id: str | None = None
    run_id: str | None = None
    principal: Principal | None = None
    request_id: str | None = None


# Each hook may be an async function or a plain one (which then runs on the event loop:
# keep it quick).
OnRequest = Callable[[RequestInfo],
                     Awaitable[Mapping[str, Any] | None] | Mapping[str, Any] | None]
OnRunFinished = Callable[[RunFinished], Awaitable[None] | None]
OnError = Callable[[ErrorInfo], Awaitable[None] | None]


async def policy_answer(who: str, call: Callable[[], Any], request_id: str,
                        seconds: float | None = None) -> Any:
    """What a policy the runtime calls for a request answers (the authenticator,
    `on_request`; a plain function's answer is used as is). A policy fails closed: anything
    it raises but a `RequestError` with an HTTP error status (a `CancelledError` of its own,
    a library's own BaseException or a group of them, included), or no answer within
    `seconds`, refuses the request with 503, logged as `who`'s."""
    try:
        async with asyncio.timeout(seconds):
            answer = call()
            if inspect.isawaitable(answer):
                answer = await answer
            return answer
    except RequestError as exc:
        if is_error_status(exc.status):
            raise
        _log.error(f"{who} refused with a status that is no HTTP error: request refused",
                   status=repr(exc.status), request_id=request_id)
    except asyncio.CancelledError:
        if not cancelled_itself():
            raise
        _log.error(f"{who} cancelled itself: request refused", request_id=request_id)
    except TimeoutError:
        _log.error(f"{who} timed out: request refused", timeout=seconds,
                   request_id=request_id)
    except FAILURES_OF_CALLED_CODE:
        _log.exception(f"{who} failed: request refused", request_id=request_id)
    except BaseException as exc:
        if unwinding(exc):
            raise  # a GeneratorExit, the request's cancellation: Python's, not the policy's
        # (gevent's Timeout, func_timeout's, a group: they left the ASGI app, a bare 500)
        _log.exception(f"{who} failed: request refused", request_id=request_id)
    raise ServiceUnavailableError("The request could not be checked; try again shortly")


class HookRunner:
    def __init__(self, on_request: OnRequest | None, on_run_finished: OnRunFinished | None,
                 on_error: OnError | None, *,
                 request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
                 background_timeout: float = DEFAULT_BACKGROUND_TIMEOUT) -> None:
        self.on_request = on_request
        self.request_timeout = request_timeout
        self.background_timeout = background_timeout
        self.on_run_finished = on_run_finished
        self.on_error = on_error
        self._tasks: set[asyncio.Task[None]] = set()

    async def request(self, info: RequestInfo) -> None:
        if self.on_request is None:
            return
        on_request = self.on_request
        annotations = await policy_answer("on_request hook", lambda: on_request(info),
                                          info.request_id, self.request_timeout)
        if annotations is not None and not isinstance(annotations, Mapping):
            _log.error("on_request hook returned neither a mapping nor None: ignored",
                       returned=type(annotations).__name__, request_id=info.request_id)
            return
        if annotations:
            info.annotations.update(annotations)

    def run_finished(self, run: RunFinished) -> None:
        if self.on_run_finished is not None:
            self._spawn(self.on_run_finished, run, "on_run_finished")

    def error(self, error: ErrorInfo) -> None:
        if self.on_error is not None:
            self._spawn(self.on_error, error, "on_error")

    def _spawn(self, hook: Callable[[Any], Any], argument: Any, name: str) -> None:
        """Run `hook` in the background; a plain function (not async) has run by the time
        it returns, and its failure is logged like an async one's."""
        try:
            work = hook(argument)
        except _PLAIN_HOOK_FAILURES:
            _log.exception(f"{name} hook failed")
            return
        if not inspect.isawaitable(work):
            return

        async def guarded() -> None:
            deadline = asyncio.timeout(self.background_timeout)
            try:
                async with deadline:
                    await work
            except FAILURES_OF_CALLED_CODE:
                if deadline.expired():  # (not a TimeoutError the hook raised itself)
                    _log.error(f"{name} hook timed out: cancelled",
                               timeout=self.background_timeout)
                else:
                    _log.exception(f"{name} hook failed")
            except asyncio.CancelledError:
                if not cancelled_itself():  # drain() at shutdown
                    raise
                _log.exception(f"{name} hook failed")

        task = asyncio.get_running_loop().create_task(guarded(), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109 - a grace period
        """Wait for the hooks still running (at shutdown), cancelling them after `timeout`."""
        tasks = list(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
