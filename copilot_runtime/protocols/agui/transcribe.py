"""`POST {base}/transcribe` and the envelope's `transcribe`: audio in, its text out.

The audio comes as `multipart/form-data` (an `audio` file) or as JSON
`{"audio": base64, "mimeType", "filename"?}` (what the single-route clients send). The answer
is `{"text", "size", "type"}`; failures are `{"error": code, "message", "retryable"}` with
the status of their code, as the CopilotKit clients expect (503 when no service is set).
"""

from __future__ import annotations

import base64
import binascii
import quopri
import re
import urllib.parse
from typing import Any

import structlog

from copilot_runtime._exceptions import InvalidRequestError, TranscriptionError
from copilot_runtime._input import parse_json_body_off_loop
from copilot_runtime.adapters.transcription import Transcriber
from copilot_runtime.protocols.http import Request, read_body, send_json

__all__ = ["AUDIO_TYPES", "serve_transcription"]

_log = structlog.get_logger("copilot_runtime.transcription")

#: What the route accepts (the part before any `;`), besides no type at all.
AUDIO_TYPES = ("audio/mpeg", "audio/mp3", "audio/mp4", "audio/wav", "audio/webm",
               "audio/ogg", "audio/flac", "audio/aac")
#: A form with more parts than this is not a recording upload.
MAX_PARTS = 64
#: The most bytes of one part's header lines: a browser's are well under 1 KB (a file name
#: is at most 255 bytes), so more is not a recording form.
MAX_PART_HEADERS = 4096
_MAX_TYPE = 255


async def serve_transcription(request: Request, transcriber: Transcriber | None,
                              max_body_size: int, envelope_body: Any = None, *,
                              single: bool = False) -> None:
    try:
        if transcriber is None:
            raise TranscriptionError("service_not_configured",
                                     "Transcription service is not configured")
        if single:
            audio, mime_type, filename = _from_json(envelope_body)
        else:
            audio, mime_type, filename = await _from_request(request, max_body_size)
        try:
            text = await transcriber.transcribe(audio, mime_type=mime_type, filename=filename)
        except TranscriptionError:
            raise
        except Exception:
            _log.exception("transcription failed")
            raise TranscriptionError("provider_error", "The transcription failed") from None
    except TranscriptionError as exc:
        await send_json(request, exc.status, exc.body)
        return
    await send_json(request, 200, {"text": text, "size": len(audio), "type": mime_type})


async def _from_request(request: Request, max_body_size: int) -> tuple[bytes, str, str]:
    content_type = request.header("content-type") or ""
    if content_type.lower().startswith("multipart/form-data"):
        body = await read_body(request, max_body_size)
        # Linear scans in C over a body already bounded: cheaper than a thread hop.
        return _from_form(content_type, body)
    if content_type.lower().startswith("application/json"):
        body = await read_body(request, max_body_size)  # too large: the usual 413
        try:
            data = await parse_json_body_off_loop(body)
        except InvalidRequestError:
            raise TranscriptionError("invalid_request",
                                     "Request body must be valid JSON") from None
        return _from_json(data)
    raise TranscriptionError("invalid_request", "Request must be multipart/form-data or "
                             "application/json with base64 audio")


def _from_form(content_type: str, body: bytes) -> tuple[bytes, str, str]:
    """The `audio` file of a `multipart/form-data` body (RFC 7578).

    Parsed here rather than by the standard library's email parser, whose header parsing
    is superlinear (seconds for a crafted 60 KB part) and recursive (a few thousand `(` raise
    RecursionError): every step below is a bounded or linear scan."""
    boundary = _boundary(content_type)
    # A delimiter is "--boundary" at the start of a line; the CRLF before it is not content.
    chunks = (b"\r\n" + body).split(b"\r\n--" + boundary, MAX_PARTS + 1)
    if len(chunks) > MAX_PARTS + 1 and not chunks[-1].startswith(b"--"):
        # Counted on the split the parts are read from, by the boundary they are read by
        # (a count by another reading of the boundary let a form of tiny parts past it).
        raise TranscriptionError("invalid_request", f"The form has more than {MAX_PARTS} parts")
    for chunk in chunks[1:]:
        if chunk.startswith(b"--"):
            break  # the closing delimiter
        line_end = chunk.find(b"\r\n")
        if line_end == -1:
            break
        headers_end = chunk.find(b"\r\n\r\n", line_end, line_end + MAX_PART_HEADERS + 4)
        if headers_end == -1:
            if chunk.find(b"\r\n\r\n", line_end) == -1:
                break  # a part without its blank line: nothing of it is content
            raise TranscriptionError("invalid_request", "A form part's headers exceed "
                                     f"{MAX_PART_HEADERS} bytes")
        headers = _part_headers(chunk[line_end + 2:headers_end])
        disposition, params = _disposition(headers.get("content-disposition", ""))
        if disposition != "form-data" or params.get("name") != "audio":
            continue
        filename = _filename(params)
        if filename is None:
            continue
        payload = _decoded(chunk[headers_end + 4:],
                           headers.get("content-transfer-encoding", "").strip().lower())
        return _checked(payload, headers.get("content-type", "").strip(), filename)
    raise TranscriptionError("invalid_request", "No audio file found in form data. Please "
                             "include an 'audio' field.")


#: RFC 2046 limits a boundary to 70 characters.
_BOUNDARY = re.compile(r'boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))(?=\s*(?:;|$))', re.IGNORECASE)
#: One `; name=value` of a header, the value a quoted string or a token (each attempt stops
#: at the end of the header: the header is at most MAX_PART_HEADERS long).
_PARAM = re.compile(r';\s*([^\s=;]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')
_QUOTED_PAIR = re.compile(r"\\(.)")


def _boundary(content_type: str) -> bytes:
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise TranscriptionError("invalid_request", "The multipart/form-data Content-Type "
                                 "needs a boundary of 1 to 70 characters")
    return (match.group(1) or match.group(2)).encode("latin-1", "replace")


def _part_headers(block: bytes) -> dict[str, str]:
    """A part's header lines by lower-cased name (folded lines unfolded; the first of a
    repeated name wins)."""
    headers: dict[str, str] = {}
    kept: str | None = None  # the name of the line being read, if it is the one kept
    for line in block.decode("utf-8", "replace").split("\r\n"):
        if line[:1] in (" ", "\t"):
            if kept is not None:
                headers[kept] += " " + line.strip()
            continue
        raw_name, colon, value = line.partition(":")
        name = raw_name.strip().lower()
        kept = name if colon and name and name not in headers else None
        if kept is not None:
            headers[kept] = value.strip()
    return headers


def _disposition(value: str) -> tuple[str, dict[str, str]]:
    kind, _, rest = value.partition(";")
    params: dict[str, str] = {}
    for match in _PARAM.finditer(";" + rest):
        raw = match.group(2).strip()
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = _QUOTED_PAIR.sub(r"\1", raw[1:-1])
        params.setdefault(match.group(1).lower(), raw)
    return kind.strip().lower(), params


def _filename(params: dict[str, str]) -> str | None:
    """`filename*` (RFC 5987: charset'language'percent-encoded) before `filename`."""
    extended = params.get("filename*")
    if extended is not None and extended.count("'") >= 2:
        charset, _, rest = extended.partition("'")
        encoded = rest.partition("'")[2]
        try:
            return urllib.parse.unquote(encoded, encoding=charset or "utf-8", errors="replace")
        except (LookupError, UnicodeError):
            # An unknown charset, or a codec that fails whatever `errors` says (idna,
            # punycode, undefined): the plain name, if any, is better.
            pass
    return params.get("filename")


def _decoded(payload: bytes, transfer_encoding: str) -> bytes:
    """The part's bytes; RFC 7578 deprecates transfer encodings, but old clients send them."""
    if transfer_encoding == "base64":
        try:
            return base64.b64decode(payload)
        except (binascii.Error, ValueError):
            raise TranscriptionError("invalid_request",
                                     "The audio part is not valid base64") from None
    if transfer_encoding == "quoted-printable":
        return quopri.decodestring(payload)
    return payload


def _from_json(data: Any) -> tuple[bytes, str, str]:
    if not isinstance(data, dict) or not isinstance(data.get("audio"), str) \
            or not data["audio"]:
        raise TranscriptionError("invalid_request", "Request must include 'audio' field "
                                 "with base64-encoded audio data")
    mime_type = data.get("mimeType")
    if not isinstance(mime_type, str) or not mime_type:
        raise TranscriptionError("invalid_request", "Request must include 'mimeType' field "
                                 "(e.g., 'audio/webm')")
    filename = data.get("filename")
    encoded = data["audio"].split(",", 1)[-1]  # a data: URL's prefix is allowed
    try:
        audio = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise TranscriptionError("invalid_request",
                                 "Failed to decode base64 audio data") from None
    return _checked(audio, mime_type,
                    filename if isinstance(filename, str) and filename else "recording.webm")


def _checked(audio: bytes, mime_type: str, filename: str) -> tuple[bytes, str, str]:
    if len(mime_type) > _MAX_TYPE or any(ord(c) < 0x20 or ord(c) == 0x7F for c in mime_type):
        raise TranscriptionError("invalid_audio_format", "The audio type must be a MIME type "
                                 f"of at most {_MAX_TYPE} characters, without control characters")
    # The name only goes to the provider's form: keep it printable and short.
    filename = "".join(c for c in filename if ord(c) >= 0x20 and ord(c) != 0x7F)[:255] \
        or "recording.webm"
    base = mime_type.split(";", 1)[0].strip().lower()
    if base and base not in AUDIO_TYPES and base != "application/octet-stream":
        raise TranscriptionError("invalid_audio_format", f"Unsupported audio format "
                                 f"'{base[:80]}'. Supported: {', '.join(AUDIO_TYPES)}")
    if not audio:
        raise TranscriptionError("audio_too_short", "The audio is empty")
    return audio, mime_type, filename
