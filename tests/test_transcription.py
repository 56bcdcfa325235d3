"""The `transcribe` route: audio in, its text out, through the real OpenAI SDK and the mock."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from copilot_runtime import CopilotRuntime, DemoAdapter, OpenAITranscription
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import Served, ServeRuntime

AUDIO = b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(range(256)) * 4


@pytest.fixture
async def transcribing(llm: MockOpenAIServer, serve_runtime: ServeRuntime
                       ) -> AsyncIterator[Served]:
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                             transcription=OpenAITranscription(base_url=llm.base_url))
    async with serve_runtime(runtime, max_body_size=64 * 1024) as served:
        yield served


def _form(audio: bytes | None, content_type: str = "audio/wav",
          field: str = "audio") -> aiohttp.FormData:
    form = aiohttp.FormData()
    if audio is not None:
        form.add_field(field, audio, filename="clip.wav", content_type=content_type)
    form.add_field("note", "not audio")
    return form


async def _post(served: Served, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    async with served.session.post(served.url + "/transcribe", **kwargs) as response:
        return response.status, await response.json()


async def test_multipart_audio_is_transcribed(transcribing: Served,
                                              llm: MockOpenAIServer) -> None:
    status, body = await _post(transcribing, data=_form(AUDIO))
    assert status == 200, body
    assert body == {"text": f"heard {len(AUDIO)} bytes of audio/wav as whisper-1",
                    "size": len(AUDIO), "type": "audio/wav"}
    assert llm.headers[-1]["authorization"] == "Bearer sk-none"


async def test_json_base64_audio_and_the_envelope(transcribing: Served) -> None:
    encoded = base64.b64encode(AUDIO).decode()
    status, body = await _post(transcribing, json={
        "audio": "data:audio/webm;base64," + encoded, "mimeType": "audio/webm; codecs=opus"})
    assert status == 200, body
    assert body["size"] == len(AUDIO)
    assert body["type"] == "audio/webm; codecs=opus"
    async with transcribing.session.post(transcribing.url, json={
            "method": "transcribe", "body": {"audio": encoded, "mimeType": "audio/ogg",
                                             "filename": "a.ogg"}}) as response:
        assert response.status == 200
        assert (await response.json())["text"].endswith("of audio/ogg as whisper-1")


@pytest.mark.parametrize(("kwargs", "status", "code"), [
    ({"data": _form(None)}, 400, "invalid_request"),
    ({"data": _form(AUDIO, field="file")}, 400, "invalid_request"),
    ({"data": _form(AUDIO, content_type="video/x-msvideo")}, 400, "invalid_audio_format"),
    ({"data": _form(b"")}, 400, "audio_too_short"),
    ({"json": {"audio": "!!not base64!!", "mimeType": "audio/wav"}}, 400, "invalid_request"),
    ({"json": {"audio": "AAAA"}}, 400, "invalid_request"),
    ({"json": {"mimeType": "audio/wav"}}, 400, "invalid_request"),
    ({"json": {"audio": "AAAA", "mimeType": "text/html"}}, 400, "invalid_audio_format"),
    ({"data": b"raw bytes", "headers": {"Content-Type": "audio/wav"}}, 400, "invalid_request"),
    ({"data": b"{broken", "headers": {"Content-Type": "application/json"}}, 400,
     "invalid_request"),
])
async def test_what_cannot_be_transcribed(transcribing: Served, kwargs: dict[str, Any],
                                          status: int, code: str) -> None:
    got, body = await _post(transcribing, **kwargs)
    assert (got, body["error"]) == (status, code), body
    assert body["retryable"] is False
    assert "Traceback" not in body["message"]
    assert ".py" not in body["message"]


@pytest.mark.parametrize(("upstream", "status", "code", "retryable"), [
    (429, 429, "rate_limited", True),
    (401, 401, "auth_failed", False),
    (500, 500, "provider_error", True),
])
async def test_upstream_failures(transcribing: Served, llm: MockOpenAIServer, upstream: int,
                                 status: int, code: str, retryable: bool) -> None:
    llm.statuses = [upstream] * 3  # the SDK retries once
    got, body = await _post(transcribing, data=_form(AUDIO))
    assert (got, body["error"], body["retryable"]) == (status, code, retryable), body
    assert "mock error" not in body["message"]


async def test_an_unreachable_service_is_a_network_error(serve_runtime: ServeRuntime) -> None:
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0), transcription=
                             OpenAITranscription(base_url="http://127.0.0.1:9/v1", timeout=5))
    async with serve_runtime(runtime) as served:
        status, body = await _post(served, data=_form(AUDIO))
    assert (status, body["error"], body["retryable"]) == (502, "network_error", True)


async def test_an_oversized_upload_is_a_413(transcribing: Served) -> None:
    async with transcribing.session.post(transcribing.url + "/transcribe",
                                         data=_form(AUDIO * 200)) as response:
        assert response.status == 413


async def test_unconfigured_and_info(serve_runtime: ServeRuntime,
                                     transcribing: Served) -> None:
    async with serve_runtime(CopilotRuntime(service_adapter=DemoAdapter(delay=0))) as plain:
        status, body = await _post(plain, data=_form(AUDIO))
        assert (status, body) == (503, {"error": "service_not_configured", "message":
                                        "Transcription service is not configured",
                                        "retryable": False})
        info = await (await plain.session.get(plain.url + "/info")).json()
        assert info["audioFileTranscriptionEnabled"] is False
    for served in (transcribing,):
        info = await (await served.session.get(served.url + "/info")).json()
        assert info["audioFileTranscriptionEnabled"] is True
        async with served.session.post(served.url, json={"method": "info"}) as response:
            assert (await response.json())["audioFileTranscriptionEnabled"] is True
        async with served.session.get(served.url + "/transcribe") as response:
            assert response.status == 405
