"""GraphQL over HTTP as the 1.10 runtime answers it: content types, statuses, headers.

* Single results are `application/graphql-response+json` or `application/json` (whichever
  the `Accept` header names first; `application/json` when it names neither), with
  `charset=utf-8`.
* A request that cannot be executed (bad JSON, parse, validation or variable errors)
  gets 400 with `{"errors": [...]}`; an error while resolving gets 200 with `data: null`.
* Except to the 1.10 client (`kit_client`): its fetch wrapper turns an answer from 400 to
  500 into "Unknown error occurred" without reading it, so it gets its refusals with 200
  (`refusal_status`), the real status in `extensions.statusCode` (`send_refusal`).
* Every answer carries `x-copilotkit-runtime-version`: the client's own
  `x-copilotkit-runtime-client-gql-version` echoed, so no 1.x client reports a version
  mismatch (it compares the two), or 1.10.6, the version whose protocol this is.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from graphql import GraphQLError

from copilot_runtime._exceptions import ServiceUnavailableError
from copilot_runtime.protocols.graphql.errors import error_extensions, kit_errors
from copilot_runtime.protocols.http import Request, send_bytes

__all__ = [
    "MULTIPART",
    "PROTOCOL_VERSION",
    "accepts_multipart",
    "encode_part",
    "json_content_type",
    "kit_client",
    "multipart_end",
    "multipart_start",
    "refusal_status",
    "request_errors",
    "send_refusal",
    "send_result",
    "version_header",
]

MULTIPART = (b"content-type", b'multipart/mixed; boundary="-"')
_GRAPHQL_JSON = b"application/graphql-response+json; charset=utf-8"
_JSON = b"application/json; charset=utf-8"
_VERSION = re.compile(rb"[0-9A-Za-z.+\-]{1,40}")
PROTOCOL_VERSION = b"1.10.6"


# `multipart/mixed; boundary="-"` as the 1.10 runtime frames it: the body opens with the
# boundary line, every part ends with it, and `--` after the last one closes the stream.
multipart_start = b"\r\n---"
multipart_end = b"--\r\n"


def encode_part(payload: Any) -> bytes:
    """One part: its headers, its JSON, and the boundary line that ends it."""
    body = orjson.dumps(payload)
    return (b"\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n\r\n"
            % len(body)) + body + b"\r\n---"


def json_content_type(request: Request) -> bytes:
    accept = request.headers.get(b"accept", b"")
    for media_range in accept.split(b","):
        media_type = media_range.split(b";", 1)[0].strip().lower()
        if media_type == b"application/graphql-response+json":
            return _GRAPHQL_JSON
        if media_type == b"application/json":
            return _JSON
    return _JSON


def accepts_multipart(request: Request) -> bool:
    return b"multipart/mixed" in request.headers.get(b"accept", b"").lower()


def version_header(request: Request) -> list[tuple[bytes, bytes]]:
    version = request.headers.get(b"x-copilotkit-runtime-client-gql-version")
    if version is None or not _VERSION.fullmatch(version):
        version = PROTOCOL_VERSION
    return [(b"x-copilotkit-runtime-version", version)]


async def send_result(request: Request, status: int, body: bytes,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", json_content_type(request)), *version_header(request)]
    try:
        await send_bytes(request, status, body, [*headers, *(extra or ())])
    except ServiceUnavailableError as exc:  # a large answer while too many are being sent
        error = {"message": exc.message, "extensions": error_extensions(exc, exc.message)}
        await send_bytes(request, exc.status, orjson.dumps({"errors": [error], "data": None}),
                         [*headers, (b"retry-after", str(exc.retry_after).encode())])


def kit_client(request: Request) -> bool:
    """Whether `request` comes from CopilotKit's GraphQL client (1.10: react-core's)."""
    return b"x-copilotkit-runtime-client-gql-version" in request.headers


def refusal_status(status: int, *, kit_client: bool) -> int:
    """The HTTP status a refusal with `status` is answered with. The 1.10 client's fetch
    wrapper throws "Unknown error occurred" for any answer from 400 to 500 before its body
    is read, so it gets 200 and shows the errors' words; past 500 the wrapper lets the answer
    through and urql reads its errors, so a 503 stays one (for balancers and proxies too)."""
    return 200 if kit_client and 400 <= status <= 500 else status


async def send_refusal(request: Request, status: int, payload: dict[str, Any],
                       extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """A refused request's `{"errors": [...]}` (with `data` if `payload` has it), and
    `extra` headers (`Retry-After`, `Allow`): as it is, or to the 1.10 client in the form
    its page shows (`refusal_status`, `kit_errors`)."""
    if kit_client(request):
        payload = {**payload, "errors": kit_errors(payload["errors"], status)}
        status = refusal_status(status, kit_client=True)
    await send_result(request, status, orjson.dumps(payload), extra)


def request_errors(errors: list[GraphQLError], code: str | None = None) -> dict[str, Any]:
    """`{"errors": [...]}` for a request that could not be executed."""
    formatted = []
    for error in errors:
        entry: dict[str, Any] = dict(error.formatted)
        if code is not None:
            entry["extensions"] = {**(error.extensions or {}), "code": code}
        formatted.append(entry)
    return {"errors": formatted}
