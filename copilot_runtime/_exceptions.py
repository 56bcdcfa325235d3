"""Every exception the runtime raises, in one place.

    CopilotRuntimeError
    ├── ConfigurationError          a runtime, agent or action set up wrongly (raised at start-up)
    ├── RequestError                the client sent something we cannot serve (answered with 4xx)
    │   ├── InvalidRequestError     malformed JSON, wrong types, missing fields        → 400
    │   │   └── JSONTooDeepError    JSON nested deeper than the runtime can re-encode  → 400
    │   ├── AgentNotFoundError      the agent id is not registered                     → 404
    │   ├── ThreadBusyError         a run is already active on the thread              → 409
    │   └── PayloadTooLargeError    the body exceeds the configured limit              → 413
    ├── UpstreamError               an LLM provider or remote agent failed             → RUN_ERROR
    │   ├── UpstreamTimeoutError    ... by going silent (before or during its answer)
    │   ├── UpstreamConnectionError ... by refusing or closing the connection
    │   └── UpstreamProtocolError   ... by answering with something its protocol forbids
    └── ActionError                 a server-side action failed (the model sees it as a tool error)

Messages are written for the client: they never contain stack traces or file paths.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ActionError",
    "AgentNotFoundError",
    "ConfigurationError",
    "CopilotRuntimeError",
    "InvalidRequestError",
    "JSONTooDeepError",
    "PayloadTooLargeError",
    "RequestError",
    "ThreadBusyError",
    "UpstreamConnectionError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamTimeoutError",
]


class CopilotRuntimeError(Exception):
    """Base class of every error raised by copilot-runtime."""

    #: A stable machine-readable code, sent to clients as `RUN_ERROR.code` or a GraphQL extension.
    code: str = "RUNTIME_ERROR"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigurationError(CopilotRuntimeError):
    code = "CONFIGURATION_ERROR"


class RequestError(CopilotRuntimeError):
    """The request cannot be served; `status` is the HTTP status to answer with."""

    status: int = 400
    code = "INVALID_REQUEST"


class InvalidRequestError(RequestError):
    status = 400

    def __init__(self, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.details = details


class JSONTooDeepError(InvalidRequestError):
    """JSON in a request (a body, or JSON text in a GraphQL argument) nests too deep."""

    code = "JSON_TOO_DEEP"

    def __init__(self, what: str, limit: int) -> None:
        message = f"{what} is nested too deep (at most {limit} levels)"
        super().__init__(message, message)
        self.limit = limit


class AgentNotFoundError(RequestError):
    status = 404
    code = "AGENT_NOT_FOUND"

    def __init__(self, agent_id: str, available: list[str] | None = None) -> None:
        super().__init__(f"Agent '{agent_id}' does not exist")
        self.agent_id = agent_id
        self.available = available or []


class ThreadBusyError(RequestError):
    status = 409
    code = "THREAD_BUSY"

    def __init__(self, thread_id: str) -> None:
        super().__init__(
            f"Thread '{thread_id}' already has an active run; stop it or wait for it to finish"
        )
        self.thread_id = thread_id


class PayloadTooLargeError(RequestError):
    status = 413
    code = "PAYLOAD_TOO_LARGE"

    def __init__(self, limit: int) -> None:
        super().__init__(f"Request body exceeds the limit of {limit} bytes")
        self.limit = limit


class UpstreamError(CopilotRuntimeError):
    """An LLM provider or a remote agent failed; `status` is its HTTP status when it had one."""

    code = "UPSTREAM_ERROR"

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class UpstreamTimeoutError(UpstreamError):
    """The upstream stopped sending for longer than its timeout, before or mid-answer."""

    code = "UPSTREAM_TIMEOUT"


class UpstreamConnectionError(UpstreamError):
    """The connection could not be made, or was closed before the answer was complete."""

    code = "UPSTREAM_CONNECTION_ERROR"


class UpstreamProtocolError(UpstreamError):
    """The upstream answered, but not in its protocol (a malformed chunk, a missing end)."""

    code = "UPSTREAM_PROTOCOL_ERROR"


class ActionError(CopilotRuntimeError):
    code = "ACTION_ERROR"
