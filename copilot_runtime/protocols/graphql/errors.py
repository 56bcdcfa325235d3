"""Errors in the shapes the 1.10 client reads: resolver errors and failed response statuses.

The client (`@copilotkit/runtime-client-gql` and react-core 1.10) routes an error by
`extensions.visibility` and explains it by `extensions.code`, so resolver errors carry the
same `{name, statusCode, code, visibility, severity, troubleshootingUrl, originalError}`
extensions as the TypeScript runtime's, and a failed run reports the same
`FailedResponseStatus.details`. Unlike that runtime we never attach a stack trace or a path:
`originalError` holds the message only.
"""

from __future__ import annotations

from typing import Any

import orjson

from copilot_runtime._exceptions import (
    CopilotRuntimeError,
    InvalidRequestError,
    RequestError,
    UpstreamError,
)

__all__ = [
    "error_extensions",
    "failed_status",
    "guardrails_status",
    "interrupted_status",
    "kit_code",
    "kit_code_of",
    "kit_errors",
    "kit_extensions",
    "said_of",
]

_DOCS = "https://docs.copilotkit.ai"
# code -> (statusCode, visibility, severity, troubleshootingUrl), as the 1.10 client knows them.
# Only these codes: the client's error class looks a code up in its own table and fails
# (a TypeError in the page) on any other. Our own conditions go under one of them, the
# runtime's code beside it as `runtimeCode`.
_KIT: dict[str, tuple[int, str, str, str | None]] = {
    "AGENT_NOT_FOUND": (500, "banner", "critical",
                        f"{_DOCS}/coagents/troubleshooting/common-issues"
                        "#i-am-getting-agent-not-found-error"),
    "NETWORK_ERROR": (503, "banner", "critical",
                      f"{_DOCS}/troubleshooting/common-issues"
                      "#i-am-getting-a-network-errors--api-not-found"),
    "NOT_FOUND": (404, "banner", "critical", None),
    "AUTHENTICATION_ERROR": (401, "banner", "critical", None),
    "MISUSE": (400, "dev_only", "warning", None),
    "CONFIGURATION_ERROR": (400, "banner", "warning", None),
    "UNKNOWN": (500, "toast", "critical", None),
}
# The runtime's own codes (RUN_ERROR.code, CopilotRuntimeError.code) -> the client's.
_FROM_RUNTIME = {
    "UPSTREAM_ERROR": "NETWORK_ERROR",
    "UPSTREAM_TIMEOUT": "NETWORK_ERROR",
    "UPSTREAM_CONNECTION_ERROR": "NETWORK_ERROR",
    "UPSTREAM_PROTOCOL_ERROR": "NETWORK_ERROR",
    "SERVICE_UNAVAILABLE": "NETWORK_ERROR",
    # A run cut by its worker's death or shutdown, or by a lost lease: try again shortly.
    "RUN_INTERRUPTED": "NETWORK_ERROR",
    "LEASE_LOST": "NETWORK_ERROR",
    "JSON_TOO_DEEP": "MISUSE",
    "AGENT_NOT_FOUND": "AGENT_NOT_FOUND",
    # A run on the thread already: try again once it ended (the client knows no such code).
    "THREAD_BUSY": "UNKNOWN",
    "THREAD_NOT_FOUND": "NOT_FOUND",
    "AUTHENTICATION_ERROR": "AUTHENTICATION_ERROR",
    "INVALID_REQUEST": "MISUSE",
    "PAYLOAD_TOO_LARGE": "MISUSE",
    "CONFIGURATION_ERROR": "CONFIGURATION_ERROR",
    # What else a request may be refused for, as `kit_code_of` names it before a stream
    # starts (during one, a stale answer to an interrupt, a model the agent does not allow,
    # an attachment its model cannot take).
    **dict.fromkeys((
        "REQUEST_TIMEOUT", "UNSUPPORTED_MEDIA_TYPE", "REQUEST_REJECTED", "RATE_LIMITED",
        "MODEL_NOT_ALLOWED", "UNSUPPORTED_ATTACHMENT", "APPROVAL_ERROR", "APPROVAL_NOT_FOUND",
        "APPROVAL_EXPIRED", "APPROVAL_WITHDRAWN", "APPROVAL_ALREADY_ANSWERED",
        "INTERRUPT_NOT_PENDING", "NOT_IMPLEMENTED"), "MISUSE"),
    # A request the GraphQL edge cannot execute (the codes the TypeScript runtime sends).
    **dict.fromkeys(("BAD_REQUEST", "GRAPHQL_PARSE_FAILED", "GRAPHQL_VALIDATION_FAILED",
                     "PERSISTED_QUERY_NOT_SUPPORTED"), "MISUSE"),
}


def kit_code(runtime_code: str | None) -> str:
    return _FROM_RUNTIME.get(runtime_code or "", "UNKNOWN")


def kit_code_of(exc: CopilotRuntimeError) -> str:
    """The client's code for `exc`: the same as its runtime code reads in a failed status."""
    code = _FROM_RUNTIME.get(exc.code)
    if code is not None:
        return code
    if isinstance(exc, RequestError):
        return "MISUSE"
    if isinstance(exc, UpstreamError):
        return "NETWORK_ERROR"
    return "UNKNOWN"


def said_of(exc: CopilotRuntimeError) -> str:
    """`exc`'s message as a GraphQL error says it: an invalid request names what was wrong
    (the AG-UI answer carries that as `details`, which a GraphQL error has no place for)."""
    details = getattr(exc, "details", None)
    if not isinstance(exc, InvalidRequestError) or not isinstance(details, str) or not details \
            or details == exc.message:  # (a refusal whose message says it all)
        return exc.message
    try:
        issues = orjson.loads(details)
    except orjson.JSONDecodeError:
        return f"{exc.message}: {details}"
    if not isinstance(issues, list):
        return exc.message
    said = [f"{'.'.join(map(str, issue.get('path') or ())) or 'body'}: {issue.get('message')}"
            for issue in issues[:3] if isinstance(issue, dict)]
    return f"{exc.message}: {'; '.join(said)}" if said else exc.message


def kit_extensions(code: str, message: str, runtime_code: str | None = None,
                   status: int | None = None) -> dict[str, Any]:
    """The extensions of an error the 1.10 client reads; `code` must be one of its own
    (`_KIT`), and `runtime_code` (named as `runtimeCode` when it differs) says exactly what
    happened, with the HTTP `status` that condition has (else the code's)."""
    known, visibility, severity, url = _KIT.get(code, _KIT["UNKNOWN"])
    code = code if code in _KIT else "UNKNOWN"
    ours = runtime_code is not None and runtime_code != code
    # (a condition the client has a code for keeps that code's status, as the TypeScript
    # runtime sends it)
    extensions = {"name": "CopilotError", "statusCode": status if ours and status else known,
                  "code": code, "visibility": visibility, "severity": severity,
                  "troubleshootingUrl": url, "originalError": {"message": message}}
    if ours:
        extensions["runtimeCode"] = runtime_code
    return extensions


def error_extensions(exc: CopilotRuntimeError, message: str) -> dict[str, Any]:
    """`kit_extensions` of a refused request (its message as `said_of` says it)."""
    status = getattr(exc, "status", None)  # (a request's error has one)
    return kit_extensions(kit_code_of(exc), message, exc.code,
                          status if isinstance(status, int) else None)


def kit_errors(errors: list[dict[str, Any]], status: int) -> list[dict[str, Any]]:
    """`errors` of a request refused with HTTP `status`, each with `kit_extensions`: its
    `extensions.code` as `runtimeCode` and the real status as `statusCode`, so the 1.10
    client's page can show it (react-core builds its error class from the code, and that
    throws on a code the client lacks). An error in that form already (with a `visibility`)
    is kept."""
    kept = []
    for error in errors:
        extensions = error.get("extensions") or {}
        if "visibility" in extensions:
            kept.append(error)
            continue
        runtime_code = extensions.get("code")
        real_status = extensions.get("statusCode")
        real_status = real_status if isinstance(real_status, int) else status
        if runtime_code is None:  # graphql-core's variable errors have none
            code = "MISUSE" if real_status < 500 else "UNKNOWN"
        else:
            code = runtime_code if runtime_code in _KIT else kit_code(runtime_code)
        message = str(error.get("message", ""))
        kept.append({**error, "extensions": {
            **kit_extensions(code, message, runtime_code), "statusCode": real_status}})
    return kept


def failed_status(message: str, runtime_code: str | None) -> dict[str, Any]:
    """`FailedResponseStatus` fields for a run that ended with RUN_ERROR."""
    code = kit_code(runtime_code)
    extensions = kit_extensions(code, message)
    return {"code": "Failed", "reason": "UNKNOWN_ERROR", "details": {
        "description": message,
        "originalError": {
            "code": code, "statusCode": extensions["statusCode"],
            "severity": extensions["severity"], "visibility": extensions["visibility"],
            "originalErrorType": runtime_code or "RUNTIME_ERROR",
            "extensions": extensions,
        },
    }}


def guardrails_status(reason: str) -> dict[str, Any]:
    """`FailedResponseStatus` fields for input a guardrail refused: the 1.10 client shows
    `details.guardrailsReason` as the assistant's answer."""
    return {"code": "Failed", "reason": "GUARDRAILS_VALIDATION_FAILED",
            "details": {"guardrailsReason": reason}}


def interrupted_status(message_id: str) -> dict[str, Any]:
    """`FailedResponseStatus` fields for a run stopped while `message_id` was streaming."""
    return {"code": "Failed", "reason": "MESSAGE_STREAM_INTERRUPTED", "details": {
        "messageId": message_id,
        "description": "The run was stopped before this message was complete; its status "
                       "says more."}}
