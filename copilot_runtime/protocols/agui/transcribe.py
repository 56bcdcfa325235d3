"""`POST {base}/transcribe` and the envelope's `transcribe`: audio in, its text out.

The audio comes as `multipart/form-data` (an `audio` file) or as JSON
`{"audio": base64, "mimeType", "filename"?}` (what the single-route clients send). The answer
is `{"text", "size", "type"}`; failures are `{"error": code, "message", "retryable"}` with
the status of their code, as the CopilotKit clients expect (503 when no service is set).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import email.parser
import email.policy
import re
from typing import Any

import structlog

from copilot_runtime._exceptions import InvalidRequestError, TranscriptionError
from copilot_runtime._input import parse_json_body
from copilot_runtime.adapters.transcription import Transcriber
from copilot_runtime.protocols.http import Request, read_body, send_json

__all__ = ["AUDIO_TYPES", "serve_transcription"]

_log = structlog.get_logger("copilot_runtime.transcription")

#: What the route accepts (the part before any `;`), besides no type at all.
AUDIO_TYPES = ("audio/mpeg", "audio/mp3", "audio/mp4", "audio/wav", "audio/webm",
               "audio/ogg", "audio/flac", "audio/aac")
#: A form with more parts than this is not a recording upload.
MAX_PARTS = 64
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
        if _parts(content_type, body) > MAX_PARTS:
            raise TranscriptionError("invalid_request", f"The form has more than {MAX_PARTS} "
                                     "parts")
        # The standard library's parser is synchronous: keep it off the event loop.
        return await asyncio.to_thread(_from_form, content_type, body)
    if content_type.lower().startswith("application/json"):
        body = await read_body(request, max_body_size)  # too large: the usual 413
        try:
            data = parse_json_body(body)
        except InvalidRequestError:
            raise TranscriptionError("invalid_request",
                                     "Request body must be valid JSON") from None
        return _from_json(data)
    raise TranscriptionError("invalid_request", "Request must be multipart/form-data or "
                             "application/json with base64 audio")


def _from_form(content_type: str, body: bytes) -> tuple[bytes, str, str]:
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if message.is_multipart():
        for part in message.iter_parts():
            if part.get_param("name", header="content-disposition") != "audio":
                continue
            payload = part.get_payload(decode=True)
            filename = part.get_filename()
            if isinstance(payload, bytes) and filename is not None:
                mime_type = part.get("content-type", "") or ""
                return _checked(payload, str(mime_type), filename)
    raise TranscriptionError("invalid_request", "No audio file found in form data. Please "
                             "include an 'audio' field.")


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


def _parts(content_type: str, body: bytes) -> int:
    """How many parts the form has at most: its boundary's lines, counted in C (parsing a form
    of many tiny parts takes seconds)."""
    match = re.search(r'boundary="?([^";]+)"?', content_type, re.IGNORECASE)
    if match is None:
        return 0  # no boundary: the parser refuses the form
    return body.count(b"--" + match.group(1).strip().encode("latin-1", "replace"))


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
