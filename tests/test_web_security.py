"""Web-facing defences: crafted transcription forms, CORS with credentials, the demo's origin
and Host checks, and the caching headers of private answers."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from copilot_runtime import ConfigurationError, CopilotRuntime, CORSPolicy, create_app
from copilot_runtime.demo_pages import DemoPages, _names_loopback, binds_loopback
from copilot_runtime.testing.scripted import ScriptedAdapter, text_turn

pytestmark = pytest.mark.timeout(30)

_FORM_TYPE = {"content-type": "multipart/form-data; boundary=xx"}


class _EchoTranscriber:
    async def transcribe(self, audio: bytes, *, mime_type: str, filename: str) -> str:
        return f"{len(audio)} {mime_type} {filename}"

    async def aclose(self) -> None:
        pass


def _form(headers: bytes, payload: bytes = b"AAAA") -> bytes:
    return b"--xx\r\n" + headers + b"\r\n\r\n" + payload + b"\r\n--xx--\r\n"


@pytest.fixture
async def transcribing() -> AsyncIterator[httpx.AsyncClient]:
    runtime = CopilotRuntime(service_adapter=ScriptedAdapter(), transcription=_EchoTranscriber())
    app = create_app(runtime, "/copilotkit")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        yield client
    await runtime.aclose()


async def test_a_recording_form_parses(transcribing: httpx.AsyncClient) -> None:
    body = (b"preamble\r\n--xx\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhi\r\n"
            + _form(b'Content-Disposition: form-data; name="audio"; filename="r\xc3\xa9c.webm"'
                    b"\r\nContent-Type: audio/webm; codecs=opus", b"\r\n--x" * 1000))
    response = await transcribing.post("/copilotkit/transcribe", content=body,
                                       headers=_FORM_TYPE)
    assert response.status_code == 200, response.text
    assert response.json()["text"] == "5000 audio/webm; codecs=opus réc.webm"
    extended = _form(b"Content-Disposition: form-data; name=audio; filename=\"x\"; "
                     b"filename*=utf-8''%C3%A9.ogg\r\nContent-Transfer-Encoding: base64",
                     b"QUJD")
    response = await transcribing.post("/copilotkit/transcribe", content=extended,
                                       headers=_FORM_TYPE)
    assert response.json()["text"] == "3  é.ogg"


@pytest.mark.parametrize("charset", [b"idna", b"punycode", b"undefined"])
async def test_a_filename_charset_that_cannot_decode_falls_back(
        transcribing: httpx.AsyncClient, charset: bytes) -> None:
    """These codecs raise UnicodeError even with errors="replace": it was a 500 with a logged
    stack. The plain `filename` is used, as for a charset Python does not know; without
    one the part is no file, and the form has no audio (a 400)."""
    extended = b"filename*=" + charset + b"''%41%FF.webm"
    response = await transcribing.post("/copilotkit/transcribe", content=_form(
        b'Content-Disposition: form-data; name="audio"; filename="plain.webm"; ' + extended
        + b"\r\nContent-Type: audio/webm"), headers=_FORM_TYPE)
    assert response.status_code == 200, response.text
    assert response.json()["text"] == "4 audio/webm plain.webm"
    response = await transcribing.post("/copilotkit/transcribe", content=_form(
        b'Content-Disposition: form-data; name="audio"; ' + extended
        + b"\r\nContent-Type: audio/webm"), headers=_FORM_TYPE)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "invalid_request"


@pytest.mark.parametrize("headers", [
    # RFC 2047 encoded words and parameters: seconds in the email parser's header code.
    b'Content-Disposition: form-data; name="audio"; filename="' + b"=?utf-8?q?a?= " * 11_000
    + b'"\r\nContent-Type: audio/webm',
    b'Content-Disposition: form-data; name="audio"; filename="a.webm"\r\n'
    b"Content-Type: audio/webm" + b"; a=b" * 12_000,
], ids=["encoded-words", "parameters"])
async def test_crafted_part_headers_are_refused_at_once(transcribing: httpx.AsyncClient,
                                                        headers: bytes) -> None:
    started = time.perf_counter()
    response = await transcribing.post("/copilotkit/transcribe", content=_form(headers),
                                       headers=_FORM_TYPE)
    assert time.perf_counter() - started < 2  # seconds before; ~10 ms unloaded
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_request"


@pytest.mark.parametrize("boundary", ['" xx"', '"zz"x; boundary=xx', "xx"])
async def test_a_form_of_too_many_parts_is_refused_whatever_its_boundary_says(
        transcribing: httpx.AsyncClient, boundary: str) -> None:
    """The parts were counted by another reading of the boundary than the parser's: a quoted
    boundary with a space, or a second boundary parameter, let a form of thousands of tiny
    parts be parsed whole, on the event loop."""
    tiny = b'Content-Disposition: form-data; name="n"\r\n\r\nx\r\n'
    delimiter = b"-- xx\r\n" if boundary.startswith('" ') else b"--xx\r\n"
    body = (delimiter + tiny) * 5000 + delimiter[:-2] + b"--\r\n"
    response = await transcribing.post(
        "/copilotkit/transcribe", content=body,
        headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    assert response.status_code == 400, response.text
    assert "more than 64 parts" in response.json()["message"]


async def test_unclosed_comments_are_no_server_error(transcribing: httpx.AsyncClient) -> None:
    # Thousands of `(` made the email parser recurse too deep: a 500 with a logged stack.
    part = _form(b'Content-Disposition: form-data; name="audio"; filename="a.webm" '
                 + b"(" * 3000 + b"\r\nContent-Type: audio/webm")
    response = await transcribing.post("/copilotkit/transcribe", content=part,
                                       headers=_FORM_TYPE)
    assert response.status_code == 200, response.text
    assert response.json()["text"] == "4 audio/webm a.webm"
    response = await transcribing.post(
        "/copilotkit/transcribe", content=_form(b'Content-Disposition: form-data; name="a"'),
        headers={"content-type": "multipart/form-data; boundary=xx; " + "(" * 3000})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "invalid_request"


def test_credentials_need_listed_origins() -> None:
    # Reflecting every origin (`null` too) with credentials let any site read a signed-in
    # user's threads: the combination is refused where it is configured.
    with pytest.raises(ConfigurationError, match="origins listed"):
        CORSPolicy(allow_credentials=True)
    with pytest.raises(ConfigurationError):
        CORSPolicy(origins=("https://app.example", "*"), allow_credentials=True)
    policy = CORSPolicy(origins=("https://app.example",), allow_credentials=True)
    for origin in (b"https://evil.example", b"null"):
        for headers in (policy.headers({b"origin": origin}),
                        policy.preflight({b"origin": origin,
                                          b"access-control-request-method": b"GET"})):
            assert not any(name.startswith(b"access-control-allow-origin")
                           or name == b"access-control-allow-credentials"
                           for name, _ in headers)
    assert (b"access-control-allow-credentials", b"true") in policy.headers(
        {b"origin": b"https://app.example"})
    assert (b"access-control-allow-origin", b"null") in CORSPolicy(
        origins=("null",), allow_credentials=True).headers({b"origin": b"null"})


def test_origins_are_several_strings_not_one() -> None:
    # One string was taken as its origins: `in` on a string is a substring test, so
    # https://app.example.co (anyone may register it) was reflected, with credentials, for
    # origins="https://app.example.com". Refused where it is configured, as elsewhere.
    for origins in ("https://app.example.com", b"https://app.example.com"):
        with pytest.raises(ConfigurationError, match="several strings"):
            CORSPolicy(origins=origins, allow_credentials=True)  # type: ignore[arg-type]
    # "*" alone is every origin however written (it worked so before, as the TypeScript
    # runtime's option is written), and still no credentials with it.
    assert CORSPolicy(origins="*").origins == ("*",)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="cannot be combined"):
        CORSPolicy(origins="*", allow_credentials=True)  # type: ignore[arg-type]
    policy = CORSPolicy(origins=["https://app.example.com"],  # type: ignore[arg-type]
                        allow_credentials=True)
    assert policy.headers({b"origin": b"https://app.example.co"}) == [(b"vary", b"Origin")]


def test_loopback_binds_and_hosts() -> None:
    assert binds_loopback("127.0.0.1")
    assert binds_loopback("localhost")
    assert binds_loopback("::1")
    assert not binds_loopback("")
    assert not binds_loopback("0.0.0.0")
    for host in (b"localhost", b"localhost:8000", b"127.0.0.1:1", b"[::1]:8000", b"LOCALHOST.",
                 None):
        assert _names_loopback(host), host
    for host in (b"rebind.evil.example", b"localhost.evil.example", b"[::2]:80", b"10.0.0.1",
                 b"127.0.0.1.evil.example", b""):
        assert not _names_loopback(host), host


async def test_demo_pages_refuse_foreign_hosts(tmp_path: Path) -> None:
    runtime = CopilotRuntime(service_adapter=ScriptedAdapter())
    app = DemoPages(create_app(runtime, "/copilotkit"), "/copilotkit", tmp_path,
                    loopback_hosts_only=True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as ok, \
            httpx.AsyncClient(transport=transport, base_url="http://rebind.example") as rebound:
        assert (await ok.get("/copilotkit/info")).status_code == 200
        refused = await rebound.get("/copilotkit/info")
        assert refused.status_code == 421
        assert refused.headers["content-type"].startswith("text/plain")
        assert (await rebound.get("/")).status_code == 421
    await runtime.aclose()


async def test_private_answers_are_not_cached_nor_sniffed() -> None:
    runtime = CopilotRuntime(service_adapter=ScriptedAdapter(text_turn("hello")))
    app = create_app(runtime, "/copilotkit")
    query = 'query { loadAgentState(data: {threadId: "t1", agentName: "default"}) { state } }'
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        run = await client.post("/copilotkit/agent/default/run", json={
            "threadId": "t1", "runId": "r1", "state": {}, "tools": [], "context": [],
            "forwardedProps": {}, "messages": [{"id": "m1", "role": "user", "content": "hi"}]})
        assert run.status_code == 200
        for path in ("/threads", "/threads/t1/messages", "/threads/t1/events", "/threads/t1/state",
                     "/approvals", "/threads/missing/messages"):
            response = await client.get("/copilotkit" + path)
            assert response.headers.get_list("cache-control") == ["no-store"], path
            assert response.headers["x-content-type-options"] == "nosniff", path
        graphql = await client.get("/copilotkit", params={"query": query})
        assert graphql.status_code == 200, graphql.text
        assert graphql.headers["cache-control"] == "no-store"
        assert graphql.headers["x-content-type-options"] == "nosniff"
        ready = await client.get("/copilotkit/ready")
        assert ready.headers.get_list("cache-control") == ["no-store"]
    await runtime.aclose()
