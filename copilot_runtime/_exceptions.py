"""Every exception the runtime raises, in one place.

    CopilotRuntimeError
    ├── ConfigurationError          a runtime, agent or action set up wrongly (raised at start-up)
    ├── RequestError                a request we cannot serve (answered with its status, 4xx or 503)
    │   ├── InvalidRequestError     malformed JSON, wrong types, missing fields        → 400
    │   │   └── JSONTooDeepError    JSON nested deeper than the runtime can re-encode  → 400
    │   ├── AgentNotFoundError      the agent id is not registered                     → 404
    │   ├── ThreadBusyError         a run is already active on the thread              → 409
    │   ├── PayloadTooLargeError    the body exceeds the configured limit              → 413
    │   ├── RequestTimeoutError     the body stopped arriving                          → 408
    │   ├── UnsupportedEncodingError a Content-Encoding the runtime does not read       → 415
    │   ├── AuthenticationError     no credentials, or bad ones                        → 401
    │   ├── RequestRejectedError    an `on_request` hook refused the request           → 403
    │   ├── ThreadNotFoundError     no such thread, or not the caller's                → 404
    │   ├── RateLimitedError        the caller has used up its runs for now            → 429
    │   ├── ServiceUnavailableError the thread store or coordinator cannot be reached  → 503
    │   ├── ModelNotAllowedError    a model the agent does not allow                   → 400
    │   ├── UnsupportedAttachmentError a user's file the model provider cannot take     → 400
    │   ├── TranscriptionError      audio that cannot be transcribed, or a failed service
    │   └── ApprovalError           an approval cannot be answered
    │       ├── ApprovalNotFoundError  no such approval                                → 404
    │       ├── ApprovalClosedError    answered or withdrawn (409), expired (410)
    │       └── NothingToResumeError   a resume names no interrupt that waits          → 409
    ├── UpstreamError               an LLM provider or remote agent failed             → RUN_ERROR
    │   ├── UpstreamTimeoutError    ... by going silent (before or during its answer)
    │   ├── UpstreamConnectionError ... by refusing or closing the connection
    │   ├── UpstreamProtocolError   ... by answering with something its protocol forbids
    │   ├── ContentFilteredError    ... by withholding the whole answer (its content filter)
    │   └── OutputTruncatedError    ... by ending it at the token limit before it was usable
    ├── ActionError                 a server-side action failed (the model sees it as a tool error)
    ├── ChunkError                  a *_CHUNK event that opens nothing (a remote's: UpstreamError)
    ├── ClientDisconnected          the client left before its request body arrived (no answer)
    └── AgentExecutionError         a wrapped existing agent reported an error or no result

Messages are written for the client: they never contain stack traces or file paths. What an
upstream said is passed on only through `quoted`, which withholds text that holds either; an
LLM provider's words through `upstream_said`, which also blanks the credentials its request
carried.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

from copilot_runtime._time import iso_time

__all__ = [
    "APPROVAL_REFUSAL_CODES",
    "SECRET_KEYS",
    "SECRET_VALUES",
    "ActionError",
    "AgentExecutionError",
    "AgentNotFoundError",
    "ApprovalClosedError",
    "ApprovalError",
    "ApprovalNotFoundError",
    "AuthenticationError",
    "ChunkError",
    "ClientDisconnected",
    "ConfigurationError",
    "ContentFilteredError",
    "CopilotRuntimeError",
    "InvalidRequestError",
    "JSONTooDeepError",
    "ModelNotAllowedError",
    "NothingToResumeError",
    "OutputTruncatedError",
    "PayloadTooLargeError",
    "RateLimitedError",
    "RequestError",
    "RequestRejectedError",
    "RequestTimeoutError",
    "ServiceUnavailableError",
    "ThreadBusyError",
    "ThreadNotFoundError",
    "TranscriptionError",
    "UnsupportedAttachmentError",
    "UnsupportedOperationError",
    "UpstreamConnectionError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamTimeoutError",
    "failure_text",
    "header_secrets",
    "quoted",
    "scrub_secrets",
    "upstream_said",
]

# What marks text as a program's insides: a Python or Node stack, or a source file's path.
_INTERNALS = re.compile(
    r"Traceback \(most recent call last\)|File \"[^\"]*\", line \d"
    r"|\n\s+at \S.*\(.*:\d+:\d+\)"
    r"|(?:[A-Za-z]:\\|/)[\w.@ -]*(?:[\\/][\w.@ -]+)*\.(?:py|pyc|js|mjs|cjs|ts|go|rb|java|rs|php)\b")


def quoted(text: str, limit: int = 200, known: Sequence[str | None] = ()) -> str | None:
    """What an upstream said, fit to pass on to a client: the `known` secrets and
    secret-looking values blanked (`scrub_secrets`), at most `limit` characters, or None when
    it holds a stack trace or a source file's path (a remote's own crash report)."""
    text = scrub_secrets(text, *known)  # before the cut, which could split a secret
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return None if _INTERNALS.search(text) else text


#: What stands for an upstream's words that `quoted` withholds.
WITHHELD = "no message fit to show"


def upstream_said(text: str, known: Sequence[str | None] = ()) -> str:
    """An LLM provider's own words (an error body's message, an error event mid-stream) as
    a client reads them: `quoted` to 500 characters, with the credentials the request
    carried (`known`) blanked; `WITHHELD` when they hold a program's insides."""
    return quoted(text, 500, known) or WITHHELD


# An absolute file path (of two parts or more, not the path of a URL): what an exception's
# message may carry that no client should read.
_FILE_PATH = re.compile(r"(?<![\w:/.~-])(?:/[\w.@~-]+){2,}|\b[A-Za-z]:\\[\w.@ \\-]+")

# A PEM private key block up to its END line (its body stops at another BEGIN, so that
# many headers cost one pass), or to where its text was cut: then only a base64 body that
# runs to the text's end, which prose after a header (a format's description) never is. Its
# lines broken by newlines or, in JSON, by `\n`.
_PEM_PRIVATE_KEY = (
    r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY-----"
    r"(?:(?:[A-Za-z0-9+/=\s\\:,.]|-(?!----BEGIN))*?-----END[A-Z0-9 ]*PRIVATE KEY-----"
    r"|(?:\s|\\[nr])*[A-Za-z0-9+/=]{16}(?:[A-Za-z0-9+/=\s]|\\[nr])*+\Z)")

# Names whose values are secrets, as written before `:` or `=` in text.
_SECRET_NAME = (r"(?<![\w-])[\w-]*?(?:passw(?:or)?d|pwd|secret(?:[-_]?key(?:[-_]?base)?)?"
                r"|(?:api|access|private)[-_]?key"
                r"|token|credentials?)")
# A quoted value of 6 characters or more, not a number, its escapes read (libpq's `\'`, JSON's
# `\"`), without its closing quote (there is none where the text was cut).
_SINGLE_QUOTED = r"'(?!\d+')(?:[^'\\\r\n]|\\.){6,}"
_DOUBLE_QUOTED = r'"(?!\d+")(?:[^"\\\r\n]|\\.){6,}'

# A character of the columns or expressions (`lower(token)`) of a key PostgreSQL names: any
# before the `)=(` that ends them.
_KEY_PART = r"(?:(?!\)=\()[^\r\n])"

#: Secret-looking values, as a pattern every redaction shares (upstream words passed on,
#: action errors, logs): a URL's `user:password`, bearer and Basic credentials, provider and
#: code-forge keys, JWTs, PEM private keys, secret query parameters, and secrets given by
#: name as `name: value` or `name=value` (a header dump, a DSN, a dict's repr, JSON): an
#: authorization with any scheme word, a cookie header's whole value, and any name ending in
#: password, secret, an API, access or private key, token or credential(s). A quoted value
#: goes whole (spaces and all) only where it is a value for sure: a DSN's or a call's
#: `password='…'`, and a mapping's `"password": "…"` (its key quoted, not a label's in
#: prose: `Field 'password': 'String should…'`); after a label (`password: "must contain a
#: digit"`) its first word alone. Counts are spared: `max_tokens=100` names `tokens`, and a
#: number alone is no secret.
SECRET_VALUES = (
    # A URL's user and password up to the `@` before its host, `@`s in the password too:
    # URL parsers (Redis', Python's) split at the last `@`, so `redis://:p@ss@host` is the
    # password `p@ss`, whose `ss` a match up to the first `@` left for all to read.
    r"(?<=://)[^\s/@]+(?:@[^\s/@]+)*(?=@)"
    r"|(?i:\b(?:bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,})"
    r"|\b(?:sk|rk|pk|gsk|xai|ghp|gho|ghu|ghs|ghr|glpat|github_pat)[-_][A-Za-z0-9_-]{8,}"
    r"|\bhf_[A-Za-z0-9]{30,}"  # Hugging Face (30+: `hf_hub_download` is a name)
    r"|\bxox[abposr]-[A-Za-z0-9-]{10,}"  # Slack
    r"|\bAIza[0-9A-Za-z_-]{20,}"
    # (where its characters' run begins: a long run of `eyJ-` with no dot was read again
    # from each `eyJ` in it)
    r"|(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]++\.[A-Za-z0-9._-]+"
    rf"|{_PEM_PRIVATE_KEY}"
    r"|(?i:(?<=[?&;])(?:api[-_]?key|key|token|access_token|secret|password|sig|signature)"
    r"=[^&\s\"']+"
    # (a signed URL's `X-Amz-Signature`, `X-Amz-Security-Token`, `X-Goog-Signature`: 8
    # characters or more, not a `page_token=2` or an `include_signature=true`)
    r"|(?<=[?&;])[\w-]*?[-_](?:token|sig|signature)=[^&\s\"']{8,})"
    # A unique or foreign key violation's `Key (token)=(…) already exists` (PostgreSQL's
    # DETAIL; its columns or expressions, `lower(token)`): the key's values, to the words
    # after them (a value may hold `) `), else to the line's end (where the lookahead always
    # stops a match: the text a match took is not read again, so the time stays linear).
    rf"|(?i:(?<=\bKey \()(?={_KEY_PART}{{0,300}}?"
    r"(?:passw(?:or)?d|pwd|secret|token(?!s|_count|_limit)|api[-_]?key|credential))"
    rf"{_KEY_PART}{{0,300}}\)=\([^\r\n]*?"
    r"(?=\) (?:already exists|is not present|is still referenced|conflicts with)"
    r"|\)?\.?(?:[\r\n]|\Z)))"
    r"|(?i:\b(?:proxy-)?authorization[\"']?[ \t]*[:=][ \t]*[\"']?(?:[a-z][\w.-]*[ \t]+)?"
    r"[^\s,;\"'}]{6,})"
    r"|(?i:\bcookie[\"']?[ \t]*[:=][ \t]*[\"']?[^\r\n\"']+)"
    # `"name": "…"`, its key quoted and not after a word (a label in prose): from the key's
    # name to the value's closing quote, which is left to close the key's opening one.
    rf"|(?i:(?<=[\"'])(?<!\w [\"']){_SECRET_NAME}[\"'][ \t]*:[ \t]*"
    rf"(?:{_SINGLE_QUOTED}(?='|\Z)|{_DOUBLE_QUOTED}(?=\"|\Z)))"
    rf"|(?i:{_SECRET_NAME}"
    # `name='…'`: the value with both its quotes (none is left behind).
    rf"(?:[ \t]*=[ \t]*(?:{_SINGLE_QUOTED}(?:'|\Z)|{_DOUBLE_QUOTED}(?:\"|\Z))"
    # Any other `name: value` or `name=value`: a private key, or one word.
    r"|[\"']?[ \t]*[:=][ \t]*[\"']?"
    rf"(?:{_PEM_PRIVATE_KEY}"
    r"|(?!\d+(?![^\s,;\"'}&]))[^\s,;\"'}&]{6,})))")
_SECRETS = re.compile(SECRET_VALUES)

#: Names whose values are secrets, as a pattern searched in a name (a log field's, a URL
#: query option's: `password`, `sslpassword`, `access_token`): matched without regard to
#: case. Any `*token` but counts and limits (`input_tokens`, `token_count`, `max_token`).
SECRET_KEYS = (
    r"(authorization|cookie|api[-_]?key|(?<!max_)token(?!s|_count|_limit)|secret|password"
    r"|passwd|credential|dsn"
    # These anywhere (`db_pwd`, `aws_access_key`, `private_key_passphrase`, `privateKeyPem`)
    # but in a path's, a file's, an id's or a directory's name (`private_key_path`,
    # `access_key_id`, `pwd_dir`): those name where a secret is, not the secret.
    r"|pwd(?![-_]?(?:dir|file|path))"
    r"|(?:private|access)[-_]?keys?(?![-_]?(?:path|file|id|dir|name|type))"
    # `auth` alone or as a name's last word (`proxy-auth`), not `author` or `auth_method`.
    r"|(?:^|[-_])auth$)")


def scrub_secrets(text: str, *known: str | None) -> str:
    """`text` with `known` secrets (the key the runtime itself sent) and secret-looking
    values (`SECRET_VALUES`) replaced: for upstream words passed on to clients and spans."""
    for secret in known:
        if secret and len(secret) >= 6:
            text = text.replace(secret, "[REDACTED]")
    return _SECRETS.sub("[REDACTED]", text)


def header_secrets(headers: Mapping[str, str]) -> tuple[str, ...]:
    """The values of the headers an operator configured for an upstream (its credentials
    among them, whatever the header's name), each also without its scheme word
    (`Bearer <token>`): the `known` secrets of what that upstream says, should it echo them."""
    return tuple(part for value in headers.values()
                 for part in (value, value.rpartition(" ")[2]))


#: What code the runtime calls (an agent, an action, a workflow's step) may raise that the
#: runtime answers as that code's failure: `SystemExit` too (`sys.exit`, argparse's
#: `parser.error`, click), which out of an event loop's task ends the whole process, every
#: user's runs with it; and a `KeyboardInterrupt` raised by code (the servers turn Ctrl-C
#: into a shutdown, never into this exception inside a request).
FAILURES_OF_CALLED_CODE: tuple[type[BaseException], ...] = (
    Exception, SystemExit, KeyboardInterrupt)


#: The BaseExceptions that are no `Exception` Python itself raises to unwind a task, a
#: generator or the process: they go on up, whoever catches failures.
_UNWINDING: tuple[type[BaseException], ...] = (
    asyncio.CancelledError, GeneratorExit, KeyboardInterrupt, SystemExit)


def library_base_exception(exc: BaseException) -> bool:
    """Whether `exc` is a library's own BaseException that is no `Exception` (gevent's
    `Timeout`, func_timeout's `FunctionTimedOut`): a failure of the code that raised it, not
    one Python unwinds with (`_UNWINDING`), nor a group holding one (a TaskGroup cancelled
    wraps its `CancelledError`: stopped here, the unwinding went no further)."""
    if isinstance(exc, BaseExceptionGroup) and exc.subgroup(_UNWINDING) is not None:
        return False
    return not isinstance(exc, (Exception, *_UNWINDING))


def cancelled_itself() -> bool:
    """Whether the `asyncio.CancelledError` being handled was raised by the code called (its
    failure), not by a cancellation of the current task (which must go on)."""
    task = asyncio.current_task()
    return task is not None and not task.cancelling()


def unwinding(exc: BaseException) -> bool:
    """Whether `exc`, raised by code the runtime calls (a policy), is Python unwinding through
    it rather than its failure: a GeneratorExit, or a CancelledError while the current task
    is being cancelled. A group is answered as its members would be bare: an anyio task group
    wraps the policy's own SystemExit or CancelledError too, which refuse the request."""
    def holds(kind: type[BaseException]) -> bool:
        if isinstance(exc, BaseExceptionGroup):
            return exc.subgroup(kind) is not None
        return isinstance(exc, kind)

    return holds(GeneratorExit) or (holds(asyncio.CancelledError) and not cancelled_itself())


def scrubbed(said: str, *known: str | None) -> str:
    """What code the runtime calls said (an exception's message), its credentials, the
    `known` secrets and file paths blanked, for the model and the client to read."""
    # The known secrets first: a key holding "+/" would be cut by the paths' blanking, and
    # its head then go out (`quoted` blanks the rest).
    return _FILE_PATH.sub("<path>", scrub_secrets(said, *known))


def failure_text(exc: BaseException, limit: int = 300, known: Sequence[str | None] = ()) -> str:
    """An exception raised by code the runtime calls (an action, a tool), as the model and,
    through its tool result, the client read it: its type and message, with credentials in
    URLs, the `known` secrets and file paths blanked, at most `limit` characters; its type
    alone when the message holds a stack trace."""
    kind = type(exc).__name__
    try:
        said = str(exc)
    except Exception:  # an exception whose message cannot be made: its type says enough
        said = ""
    message = scrubbed(said, *known)
    text = f"{kind}: {message}" if message else kind
    return quoted(text, limit, known) or f"{kind} (its message is withheld: see the server's log)"


class CopilotRuntimeError(Exception):
    """Base class of every error raised by copilot-runtime."""

    #: A stable machine-readable code, sent to clients as `RUN_ERROR.code` or a GraphQL extension.
    code: str = "RUNTIME_ERROR"
    #: Whether it was logged where it was raised (a remote call's failure, with its URL): the
    #: run it ends does not log it again.
    logged: bool = False

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


class RequestTimeoutError(RequestError):
    """The client stopped sending its body part way (a stalled upload, or a client holding
    the connection open on purpose)."""

    status = 408
    code = "REQUEST_TIMEOUT"

    def __init__(self, seconds: float, message: str | None = None) -> None:
        super().__init__(message or f"The request body stopped arriving for {seconds:g} s")
        self.seconds = seconds


class UnsupportedMediaTypeError(RequestError):
    """A body the route does not read: not JSON where it takes JSON (a browser sends a
    cross-site `text/plain` POST, cookies and all, without asking first), or compressed."""

    status = 415
    code = "UNSUPPORTED_MEDIA_TYPE"


class UnsupportedEncodingError(UnsupportedMediaTypeError):
    """A body sent compressed (`Content-Encoding`): the runtime reads bodies as they are."""

    def __init__(self, encoding: str) -> None:
        super().__init__(f"Content-Encoding {encoding[:40]!r} is not supported: send the "
                         "body uncompressed")
        self.encoding = encoding


class AuthenticationError(RequestError):
    """The request carries no credentials, or ones that do not check out (401).

    The message reaches the client: say what is wrong with the credentials, never why a
    secret did not match.
    """

    status = 401
    code = "AUTHENTICATION_ERROR"

    def __init__(self, message: str = "Authentication required") -> None:
        super().__init__(message)


class RequestRejectedError(RequestError):
    """An `on_request` hook refused the request; `status` defaults to 403, and must be an
    HTTP error status (an int from 400 to 599: else ValueError)."""

    code = "REQUEST_REJECTED"

    def __init__(self, message: str = "Request rejected", *, status: int = 403) -> None:
        if not is_error_status(status):
            raise ValueError(f"status must be an int from 400 to 599, not {status!r}")
        super().__init__(message)
        self.status = status


def is_error_status(status: object) -> bool:
    """Whether `status` is one a refusal can answer with: an int from 400 to 599 (another
    left the client without an answer, or with a body its framing forbids)."""
    return isinstance(status, int) and not isinstance(status, bool) and 400 <= status <= 599


class ServiceUnavailableError(RequestError):
    """A service the runtime keeps its state in (its thread store, its coordinator) did not
    answer in time or refused the connection: nothing was started, the request may be sent
    again shortly (`retry_after` seconds)."""

    status = 503
    code = "SERVICE_UNAVAILABLE"
    retry_after = 1


class ThreadNotFoundError(RequestError):
    """The thread does not exist, or belongs to someone else: the two look the same."""

    status = 404
    code = "THREAD_NOT_FOUND"

    def __init__(self, thread_id: str) -> None:
        super().__init__(f"Thread '{thread_id}' does not exist")
        self.thread_id = thread_id


class UnsupportedOperationError(RequestError):
    """What was asked for is not something this runtime can do: its thread store, an
    application's own, lacks the operation (`ThreadStore.archive`)."""

    status = 501
    code = "NOT_IMPLEMENTED"


class RateLimitedError(RequestError):
    """Too many runs for the caller; `retry_after` is in whole seconds."""

    status = 429
    code = "RATE_LIMITED"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = max(1, retry_after)


class ModelNotAllowedError(InvalidRequestError):
    code = "MODEL_NOT_ALLOWED"

    def __init__(self, model: str, allowed: list[str]) -> None:
        super().__init__(f"Model '{model}' is not allowed here; allowed: {', '.join(allowed)}")
        self.model = model


class UnsupportedAttachmentError(InvalidRequestError):
    """A user's attachment (audio, video, a document) that the agent's model provider has
    no input form for: the run fails naming it, where dropping it let the model answer as
    if the file had never been sent."""

    code = "UNSUPPORTED_ATTACHMENT"


class ClientDisconnected(CopilotRuntimeError):
    """The client went away while its request was read: there is nobody left to answer."""

    code = "CLIENT_DISCONNECTED"

    def __init__(self) -> None:
        super().__init__("The client disconnected")


class ApprovalError(RequestError):
    """An approval cannot be answered; `status` is the HTTP status the route answers with."""

    code = "APPROVAL_ERROR"


class ApprovalNotFoundError(ApprovalError):
    status = 404
    code = "APPROVAL_NOT_FOUND"

    def __init__(self, approval_id: str) -> None:
        super().__init__(f"No approval '{approval_id}'")


class ClosedApproval(Protocol):
    """What `ApprovalClosedError` tells of the approval it names (an `approvals.Approval`)."""

    @property
    def id(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def expires_at(self) -> float | None: ...
    @property
    def answered_by(self) -> str | None: ...
    @property
    def answered_at(self) -> float | None: ...
    def to_json(self) -> dict[str, Any]: ...


class ApprovalClosedError(ApprovalError):
    """Answered already (409), expired (410), or withdrawn (409)."""

    #: Its codes: a run that ends with one of them lost the approval to another answer.
    CODES: frozenset[str] = frozenset({"APPROVAL_EXPIRED", "APPROVAL_WITHDRAWN",
                                       "APPROVAL_ALREADY_ANSWERED"})

    def __init__(self, approval: ClosedApproval) -> None:
        self.approval = approval
        if approval.status == "expired":
            self.status, self.code = 410, "APPROVAL_EXPIRED"
            when = iso_time(approval.expires_at) if approval.expires_at else "its deadline"
            message = f"Approval '{approval.id}' expired at {when}"
        elif approval.status == "withdrawn":
            self.status, self.code = 409, "APPROVAL_WITHDRAWN"
            message = f"Approval '{approval.id}' is no longer waiting for an answer"
        else:
            self.status, self.code = 409, "APPROVAL_ALREADY_ANSWERED"
            by = f" by {approval.answered_by}" if approval.answered_by else ""
            when = f" at {iso_time(approval.answered_at)}" if approval.answered_at else ""
            message = f"Approval '{approval.id}' was already answered{by}{when}"
        super().__init__(message)


class NothingToResumeError(ApprovalError):
    status = 409
    code = "INTERRUPT_NOT_PENDING"


#: The codes of a run refused over its approval answer (or a message sent while an approval
#: waits) before its agent did anything: the graph still waits as it did.
APPROVAL_REFUSAL_CODES: frozenset[str] = frozenset({
    ApprovalError.code, ApprovalNotFoundError.code, NothingToResumeError.code,
    *ApprovalClosedError.CODES})


class UpstreamError(CopilotRuntimeError):
    """An LLM provider or a remote agent failed; `status` is its HTTP status when it had one."""

    code = "UPSTREAM_ERROR"
    #: What a provider's adapter parsed from the same read before the error: its route
    #: delivers them first (whether they come depends on TCP read timing, not the answer).
    pending: Sequence[Any] = ()
    #: The answer's end as far as the provider told it before the error (an adapter's
    #: `StreamEnd`: its token counts, billed though the answer failed), or None.
    spent: Any = None

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


class ContentFilteredError(UpstreamError):
    """The provider's content filter (or the model's refusal) withheld the whole answer: no
    text, no tool call. A user would otherwise see an empty answer and no reason."""

    code = "CONTENT_FILTERED"


class OutputTruncatedError(UpstreamError):
    """The answer reached the model's output token limit (`max_tokens`) before it was usable:
    nothing said (every token went to reasoning), or a tool call cut mid-arguments."""

    code = "OUTPUT_TRUNCATED"


class ActionError(CopilotRuntimeError):
    code = "ACTION_ERROR"


class ChunkError(CopilotRuntimeError):
    """A first `*_CHUNK` event that cannot open its message or tool call. Never reaches a
    client: a remote agent's becomes an `UpstreamError`, an in-process agent's is dropped."""

    code = "CHUNK_ERROR"


class AgentExecutionError(CopilotRuntimeError):
    """A wrapped existing agent reported `agent_error`, or ended without a result."""

    code = "AGENT_EXECUTION_ERROR"

    def __init__(self, agent: str, message: str, data: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.agent = agent
        self.data = dict(data or {})


class TranscriptionError(RequestError):
    """The `transcribe` route's failures, with the codes the CopilotKit clients know."""

    STATUS: ClassVar[Mapping[str, int]] = {
        "service_not_configured": 503, "invalid_request": 400, "invalid_audio_format": 400,
        "audio_too_long": 400, "audio_too_short": 400, "rate_limited": 429,
        "auth_failed": 401, "provider_error": 500, "network_error": 502,
    }
    RETRYABLE = frozenset({"rate_limited", "provider_error", "network_error"})

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.status = self.STATUS.get(code, 500)

    @property
    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message,
                "retryable": self.code in self.RETRYABLE}
