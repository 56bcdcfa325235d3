"""A user's attachments (AG-UI media parts, and the pre-1.0 `binary` part they replace) as
each model provider's request carries them, and the run's failure for one its provider has
no input form for (before: dropped, and the model answered as if nothing had been sent)."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from ag_ui.core import (
    AudioPart,
    DataSource,
    DocumentPart,
    FileSource,
    ImagePart,
    TextPart,
    UrlSource,
    UserMessage,
    VideoPart,
)

from copilot_runtime import (
    AnthropicAdapter,
    CopilotRuntime,
    GoogleGenAIAdapter,
    InvalidRequestError,
    OpenAIAdapter,
)
from copilot_runtime._exceptions import UnsupportedAttachmentError
from copilot_runtime.adapters.anthropic import to_anthropic_messages
from copilot_runtime.adapters.google import to_gemini_contents
from copilot_runtime.adapters.langchain import to_langchain_messages
from copilot_runtime.messages import attachment_filename, to_openai
from copilot_runtime.testing import MockAnthropicServer, MockGeminiServer, MockOpenAIServer
from tests.conftest import Served, ServeRuntime, parse_sse, run_input, text_of, types
from tests.gql.wire import CREATED, chat_data

pytestmark = pytest.mark.timeout(30)

Part = AudioPart | DocumentPart | ImagePart | VideoPart


def user(*parts: Part) -> list[UserMessage]:
    return [UserMessage(id="u", content=[TextPart(text="what is in this?"), *parts])]


def openai_parts(*parts: Part) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = to_openai(user(*parts))[0]["content"]
    return content[1:]


# ---- OpenAI Chat Completions -----------------------------------------------------------------


@pytest.mark.parametrize(("mime", "audio_format"), [
    ("audio/wav", "wav"), ("audio/x-wav", "wav"), ("audio/mpeg", "mp3"),
    ("Audio/MP3; rate=44100", "mp3")])
def test_openai_takes_wav_and_mp3_as_input_audio(mime: str, audio_format: str) -> None:
    assert openai_parts(AudioPart(source=DataSource(value="UklGRg==", mime_type=mime))) == [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": audio_format}}]


@pytest.mark.parametrize(("part", "said"), [
    (VideoPart(source=DataSource(value="AAAA", mime_type="video/mp4")),
     "the video attachment (video/mp4) given as inline data: it has no video input"),
    (AudioPart(source=DataSource(value="T2dn", mime_type="audio/ogg")),
     "the audio attachment (audio/ogg) given as inline data: audio goes only as inline WAV"),
    (AudioPart(source=UrlSource(value="https://example.test/a.wav", mime_type="audio/wav")),
     "the audio attachment (audio/wav) given as a URL"),
    (DocumentPart(source=UrlSource(value="https://example.test/doc.pdf",
                                   mime_type="application/pdf")),
     "the document attachment (application/pdf) given as a URL: documents go only as inline "
     "PDF data"),
    (DocumentPart(source=DataSource(value="aGk=", mime_type="text/plain")),
     "the document attachment (text/plain) given as inline data"),
    (ImagePart(source=FileSource(value="file-abc")),
     "the image attachment given as a provider file id"),
])
def test_openai_refuses_what_it_cannot_take(part: Part, said: str) -> None:
    with pytest.raises(UnsupportedAttachmentError) as raised:
        to_openai(user(part))
    assert raised.value.code == "UNSUPPORTED_ATTACHMENT"
    assert isinstance(raised.value, InvalidRequestError)
    assert raised.value.message.startswith("OpenAI Chat Completions cannot take ")
    assert said in raised.value.message
    assert "example.test" not in raised.value.message  # (a URL may carry a signed token)


def test_openai_pdf_carries_a_filename() -> None:
    """Chat Completions answers 400 for `file_data` without `filename`."""
    def pdf(**metadata: Any) -> DocumentPart:
        return DocumentPart(source=DataSource(value="JVBERi0=", mime_type="application/pdf"),
                            metadata=metadata or None)

    def filename(part: DocumentPart) -> Any:
        return openai_parts(part)[0]["file"]["filename"]

    assert openai_parts(pdf(filename="a.pdf")) == [{"type": "file", "file": {
        "filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}}]
    assert filename(pdf()) == "attachment.pdf"
    assert filename(pdf(filename="../../etc/Q3 report\n(final).pdf")) == "Q3 report_(final).pdf"
    assert filename(pdf(filename=42)) == filename(pdf(filename="/..")) == "attachment.pdf"
    long = filename(pdf(filename="x" * 500 + ".pdf"))
    assert len(long) == 100
    assert long.endswith("x.pdf")
    assert openai_parts(DocumentPart(source=FileSource(value="file-abc"))) == [
        {"type": "file", "file": {"file_id": "file-abc"}}]


def test_filename_is_read_from_the_part_metadata_only() -> None:
    part = DocumentPart(source=DataSource(value="JVBE", mime_type="application/pdf"),
                        metadata={"filename": "notes.pdf"})
    assert attachment_filename(part, None) == "notes.pdf"
    assert attachment_filename(DocumentPart(source=part.source, metadata="x"), None) is None


# ---- Anthropic, Gemini, LangChain -------------------------------------------------------------


def test_anthropic_takes_pdf_by_url_and_plain_text_and_names_documents() -> None:
    _, turns = to_anthropic_messages(user(
        DocumentPart(source=UrlSource(value="https://example.test/d.pdf"),
                     metadata={"filename": "d.pdf"}),
        DocumentPart(source=DataSource(value="aGVsbG8=", mime_type="text/plain"))))
    assert turns[0]["content"][1:] == [
        {"type": "document", "source": {"type": "url", "url": "https://example.test/d.pdf"},
         "title": "d.pdf"},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "hello"}}]


@pytest.mark.parametrize(("part", "said"), [
    (AudioPart(source=DataSource(value="UklGRg==", mime_type="audio/wav")),
     "the audio attachment (audio/wav) given as inline data: it has no audio input"),
    (VideoPart(source=UrlSource(value="https://example.test/v.mp4")),
     "the video attachment given as a URL: it has no video input"),
    (DocumentPart(source=DataSource(value="UEsDBA==", mime_type="application/vnd.openxmlformats"
                                    "-officedocument.wordprocessingml.document")),
     "documents go as PDF"),
    (DocumentPart(source=UrlSource(value="https://example.test/a.txt", mime_type="text/plain")),
     "the document attachment (text/plain) given as a URL"),
    (DocumentPart(source=DataSource(value="//79", mime_type="text/plain")),
     "not base64-encoded UTF-8 text"),
])
def test_anthropic_refuses_what_it_cannot_take(part: Part, said: str) -> None:
    with pytest.raises(UnsupportedAttachmentError) as raised:
        to_anthropic_messages(user(part))
    assert raised.value.message.startswith("The Anthropic Messages API cannot take ")
    assert said in raised.value.message


@pytest.mark.parametrize(("provider", "name"), [
    ("openai", "OpenAI Chat Completions"), ("anthropic", "The Anthropic Messages API")])
@pytest.mark.parametrize(("mime", "data", "why"), [
    ("application/pdf", "JVBERi0=", r"\(application/pdf\) given as inline data: images go "
                                    r"as PNG, JPEG, GIF or WebP"),
    ("image/svg+xml", "PHN2Zz4=", r"\(image/svg\+xml\) given as inline data: images go"),
    ("image/png", "%%%not-base64", r"\(image/png\) given as inline data: its data is not "
                                   r"base64"),
    ("image/png", "iVBORw0KGgo", r"\(image/png\) given as inline data: its data is not "
                                 r"base64"),  # (cut: its padding gone)
])
def test_an_image_its_provider_cannot_read_is_refused_before_the_model_is_called(
        provider: str, name: str, mime: str, data: str, why: str) -> None:
    """Before: sent, and refused by the API (a generic upstream error), never saying what."""
    convert: Any = {"openai": to_openai, "anthropic": to_anthropic_messages}[provider]
    with pytest.raises(UnsupportedAttachmentError, match=f"^{name} cannot take the image "
                                                        f"attachment {why}"):
        convert(user(ImagePart(source=DataSource(value=data, mime_type=mime))))


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_an_image_typed_jpg_goes_as_jpeg(provider: str) -> None:
    """`image/jpg` (a GraphQL `imageMessage` of format `jpg`) is no type the APIs know."""
    part = ImagePart(source=DataSource(value="/9j/", mime_type="image/JPG"))
    if provider == "openai":
        assert openai_parts(part) == [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/"}}]
    else:
        [message] = to_anthropic_messages(user(part))[1]
        assert message["content"][1]["source"]["media_type"] == "image/jpeg"


def test_gemini_refuses_data_that_is_not_base64() -> None:
    with pytest.raises(UnsupportedAttachmentError, match=r"image attachment .* not base64"):
        to_gemini_contents(user(ImagePart(source=DataSource(value="%%%not base64",
                                                            mime_type="image/png"))))
    _, contents = to_gemini_contents(user(
        AudioPart(source=DataSource(value="aGk=", mime_type="audio/wav")),
        VideoPart(source=DataSource(value="aGk=", mime_type="video/mp4"))))
    assert contents[0]["parts"][1:] == [
        {"inline_data": {"mime_type": "audio/wav", "data": b"hi"}},
        {"inline_data": {"mime_type": "video/mp4", "data": b"hi"}}]


@pytest.mark.parametrize("mime", ["Image/PNG; charset=binary", "image/PNG",
                                  "image/png;base64,AAAA#"])
def test_gemini_and_langchain_get_the_media_type_without_case_or_parameters(
        mime: str) -> None:
    """As OpenAI and Anthropic do: the client's MIME type was sent raw (a GraphQL `format`
    of `PNG` as `image/PNG`), which the APIs refuse or misread."""
    data = ImagePart(source=DataSource(value="aGk=", mime_type=mime))
    url = ImagePart(source=UrlSource(value="https://example.test/a.png", mime_type=mime))
    _, contents = to_gemini_contents(user(data, url))
    assert contents[0]["parts"][1:] == [
        {"inline_data": {"mime_type": "image/png", "data": b"hi"}},
        {"file_data": {"file_uri": "https://example.test/a.png", "mime_type": "image/png"}}]
    [message] = to_langchain_messages(user(data, url))
    assert [block.get("mime_type") for block in message.content[1:]] == ["image/png"] * 2


def test_langchain_file_blocks_carry_the_filename() -> None:
    [message] = to_langchain_messages(user(DocumentPart(
        source=DataSource(value="JVBE", mime_type="application/pdf"),
        metadata={"filename": "a.pdf"})))
    assert message.content[1] == {"type": "file", "base64": "JVBE",
                                  "mime_type": "application/pdf", "filename": "a.pdf"}


# ---- over AG-UI -----------------------------------------------------------------------------


def with_parts(thread: str, *parts: dict[str, Any]) -> dict[str, Any]:
    body = run_input("x", thread=thread)
    body["messages"][0]["content"] = [{"type": "text", "text": "what is in this?"}, *parts]
    return body


async def test_legacy_binary_audio_and_named_pdf_reach_the_model(
        served: Served, llm: MockOpenAIServer) -> None:
    events = await served.run(with_parts(
        "t-files", {"type": "binary", "mimeType": "audio/wav", "data": "UklGRg=="},
        {"type": "binary", "mimeType": "application/pdf", "data": "JVBERi0=",
         "filename": "report.pdf"}))
    assert events[-1]["type"] == "RUN_FINISHED"
    assert llm.requests[-1]["messages"][-1]["content"][1:] == [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "file", "file": {"filename": "report.pdf",
                                  "file_data": "data:application/pdf;base64,JVBERi0="}}]


@pytest.mark.parametrize(("part", "said"), [
    ({"type": "binary", "mimeType": "video/mp4", "data": "AAAA"}, "video attachment"),
    ({"type": "binary", "mimeType": "application/pdf", "url": "https://example.test/d.pdf"},
     "document attachment (application/pdf) given as a URL"),
    ({"type": "audio", "source": {"type": "data", "value": "T2dn", "mimeType": "audio/ogg"}},
     "audio attachment (audio/ogg)"),
])
async def test_an_attachment_the_model_cannot_take_fails_the_run(
        served: Served, llm: MockOpenAIServer, part: dict[str, Any], said: str) -> None:
    events = await served.run(with_parts("t-refused", part))
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"]
    assert events[-1]["code"] == "UNSUPPORTED_ATTACHMENT"
    assert said in events[-1]["message"]
    assert text_of(events) == ""
    assert llm.requests == []  # nothing was sent without it


async def test_a_legacy_binary_part_of_an_upper_case_image_type_is_an_image(
        served: Served, llm: MockOpenAIServer) -> None:
    """MIME types are case-insensitive: `IMAGE/PNG` was upgraded to a document (refused)."""
    events = await served.run(with_parts(
        "t-upper", {"type": "binary", "mimeType": "IMAGE/PNG", "data": "iVBORw0KGgo="}))
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert llm.requests[-1]["messages"][-1]["content"][1:] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]


def legacy_by_id(mime: str) -> dict[str, Any]:
    """A 0.x `binary` part naming a file the provider already holds, by its id only."""
    return {"type": "binary", "mimeType": mime, "id": "file-abc123", "filename": "report.pdf"}


def by_id(kind: str, mime: str) -> dict[str, Any]:
    """The part `legacy_by_id(mime)` is given back as: the id is its source."""
    return {"type": kind, "source": {"type": "file", "value": "file-abc123", "mimeType": mime},
            "id": "file-abc123", "metadata": {"filename": "report.pdf"}}


@contextlib.asynccontextmanager
async def provider_runtime(provider: str) -> AsyncIterator[tuple[CopilotRuntime,
                                                                 list[dict[str, Any]]]]:
    """A runtime on `provider`'s mock, with the list of the requests the mock is sent."""
    mock: MockOpenAIServer | MockAnthropicServer | MockGeminiServer
    async with contextlib.AsyncExitStack() as stack:
        if provider == "openai":
            mock = await stack.enter_async_context(MockOpenAIServer())
            adapter: Any = OpenAIAdapter(base_url=mock.base_url, api_key="k", max_retries=0)
        elif provider == "anthropic":
            mock = await stack.enter_async_context(MockAnthropicServer())
            adapter = AnthropicAdapter(base_url=mock.base_url, api_key="k", max_retries=0)
        else:
            mock = await stack.enter_async_context(MockGeminiServer())
            adapter = GoogleGenAIAdapter(base_url=mock.base_url, api_key="k", max_retries=0)
        yield CopilotRuntime(service_adapter=adapter), mock.requests


def sent_user_parts(provider: str, request: dict[str, Any]) -> Any:
    """What a provider request carries of the user message after its text."""
    if provider == "gemini":
        return request["contents"][-1]["parts"][1:]
    return request["messages"][-1]["content"][1:]


@pytest.mark.parametrize(("provider", "mime", "sent"), [
    ("openai", "application/pdf", [{"type": "file", "file": {"file_id": "file-abc123"}}]),
    ("anthropic", "application/pdf", [
        {"type": "document", "source": {"type": "file", "file_id": "file-abc123"},
         "title": "report.pdf"}]),
    ("anthropic", "image/png", [
        {"type": "image", "source": {"type": "file", "file_id": "file-abc123"}}]),
    ("gemini", "application/pdf", [
        {"fileData": {"file_uri": "file-abc123", "mime_type": "application/pdf"}}]),
    ("gemini", "image/png", [
        {"fileData": {"file_uri": "file-abc123", "mime_type": "image/png"}}]),
])
async def test_a_legacy_binary_part_given_by_id_reaches_the_model_by_that_id(
        serve_runtime: ServeRuntime, provider: str, mime: str, sent: Any) -> None:
    """Before: an EMPTY inline attachment (`data:application/pdf;base64,`), stored so and
    sent again on every later run of the thread, with the id lost from its source."""
    kind = "image" if mime.startswith("image/") else "document"
    async with provider_runtime(provider) as (runtime, requests), \
            serve_runtime(runtime) as served:
        events = await served.run(with_parts("t-by-id", legacy_by_id(mime)))
        assert events[-1]["type"] == "RUN_FINISHED", events[-1]
        assert sent_user_parts(provider, requests[-1]) == sent
        assert events[0]["input"]["messages"][0]["content"][1] == by_id(kind, mime)
        stored = await (await served.session.get(
            served.url + "/threads/t-by-id/messages")).json()
        assert stored["messages"][0]["content"][1] == by_id(kind, mime)
        replay = await served.run(run_input("", thread="t-by-id"),
                                  path="/agent/default/connect")
        assert replay[0]["input"]["messages"][0]["content"][1] == by_id(kind, mime)


async def test_an_image_given_by_id_fails_the_run_on_openai(
        served: Served, llm: MockOpenAIServer) -> None:
    """Chat Completions takes images inline or by URL only: the run fails, saying so,
    instead of sending an empty image."""
    events = await served.run(with_parts("t-image-id", legacy_by_id("image/png")))
    assert types(events) == ["RUN_STARTED", "RUN_ERROR"]
    assert events[-1]["code"] == "UNSUPPORTED_ATTACHMENT"
    assert "image attachment (image/png) given as a provider file id" in events[-1]["message"]
    assert llm.requests == []


async def test_a_legacy_binary_part_with_no_id_url_or_data_is_refused(served: Served) -> None:
    """AG-UI 0.x required one of them; with none there is nothing to attach (before: an
    empty inline attachment)."""
    response = await served.post("/agent/default/run", with_parts(
        "t-nothing", {"type": "binary", "mimeType": "image/png", "data": ""}))
    assert response.status == 400, await response.text()
    [issue] = orjson.loads((await response.json())["details"])
    assert issue["path"] == ["messages", 0, "content", 1]
    assert "one of id, url or data" in issue["message"]


@pytest.mark.parametrize("provider", ["openai", "anthropic", "gemini", "langchain"])
def test_empty_inline_data_is_refused_by_every_adapter(provider: str) -> None:
    """An image with no bytes (a GraphQL `imageMessage` with empty `bytes`, or a part with an
    empty data source) is not sent as an empty attachment."""
    part = ImagePart(source=DataSource(value="", mime_type="image/png"))
    convert: Any = {"openai": to_openai, "anthropic": to_anthropic_messages,
                    "gemini": to_gemini_contents, "langchain": to_langchain_messages}[provider]
    with pytest.raises(UnsupportedAttachmentError,
                       match=r"image attachment \(image/png\) given as inline data: "
                             r"its data is empty"):
        convert(user(part))


# ---- over GraphQL -----------------------------------------------------------------------------


async def _image_status(served: Any, data: str) -> dict[str, Any]:
    """The status of a GraphQL turn of one PNG `imageMessage` whose bytes are `data`."""
    result = await served.generate(chat_data([{
        "id": "img-1", "createdAt": CREATED,
        "imageMessage": {"format": "png", "bytes": data, "role": "user"}}]))
    status: dict[str, Any] = result["status"]
    return status


async def test_graphql_names_the_attachment_its_model_cannot_take(
        serve_runtime: ServeRuntime) -> None:
    """An `imageMessage` whose bytes are not base64: Gemini's conversion dropped it, and the
    model answered a turn that said nothing."""
    async with MockGeminiServer() as gemini:
        runtime = CopilotRuntime(service_adapter=GoogleGenAIAdapter(
            api_key="k", base_url=gemini.base_url, max_retries=0))
        async with serve_runtime(runtime) as served:
            status = await _image_status(served, "%%%")
        assert gemini.requests == []
    assert (status["code"], status["reason"]) == ("Failed", "UNKNOWN_ERROR")
    assert "image attachment (image/png) given as inline data" in \
        status["details"]["description"]
    error = status["details"]["originalError"]
    assert (error["code"], error["originalErrorType"]) == ("MISUSE", "UNSUPPORTED_ATTACHMENT")


async def test_graphql_refuses_an_image_with_no_bytes(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """Before: the model was sent `data:image/png;base64,` (an empty image)."""
    runtime = CopilotRuntime(service_adapter=OpenAIAdapter(
        base_url=llm.base_url, api_key="k", max_retries=0))
    async with serve_runtime(runtime) as served:
        status = await _image_status(served, "")
    assert llm.requests == []
    assert status["code"] == "Failed"
    assert "its data is empty" in status["details"]["description"]
    assert status["details"]["originalError"]["originalErrorType"] == "UNSUPPORTED_ATTACHMENT"


LOAD_STATE = """query loadAgentState($data: LoadAgentStateInput!) {
  loadAgentState(data: $data) { threadId threadExists state messages } }"""


async def test_an_image_survives_a_graphql_reload(served: Served, llm: MockOpenAIServer) -> None:
    """A 1.10 page reload: `loadAgentState` gave the image message as `content: ""` (what
    the client can show of it was nothing), the client sent that back as a text message,
    and every later turn reached the model without the image."""
    image = {"format": "png", "bytes": "iVBORw0KGgo=", "role": "user"}
    first = [{"id": "u-1", "createdAt": CREATED,
              "textMessage": {"content": "what is it?", "role": "user"}},
             {"id": "img-1", "createdAt": CREATED, "imageMessage": image}]
    assert (await served.generate(chat_data(first, thread="t-reload")))["status"][
        "code"] == "Success"
    response = await served.post("", {"query": LOAD_STATE, "variables": {
        "data": {"threadId": "t-reload", "agentName": "default"}}})
    loaded = orjson.loads((await response.json())["data"]["loadAgentState"]["messages"])
    assert {"id": "img-1", "role": "user", "content": "[image]"} in loaded
    # What the 1.10 client's `loadMessagesFromJsonRepresentation` makes of it, sent back.
    history = [{"id": item["id"], "createdAt": CREATED, "textMessage": {
        "content": item["content"], "role": item["role"]}} for item in loaded]
    history.append({"id": "u-2", "createdAt": CREATED,
                    "textMessage": {"content": "and the colour?", "role": "user"}})
    assert (await served.generate(chat_data(history, thread="t-reload")))["status"][
        "code"] == "Success"
    sent = llm.requests[-1]["messages"]
    assert {"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,iVBORw0KGgo="}}]} in sent
    assert sent[-1] == {"role": "user", "content": "and the colour?"}


# ---- the provider mocks' request bounds ---------------------------------------------------------


@pytest.mark.parametrize("provider", ["openai", "anthropic", "gemini"])
async def test_the_provider_mocks_take_an_image_of_megabytes(
        serve_runtime: ServeRuntime, provider: str) -> None:
    """The mocks took aiohttp's 1 MiB bound: any image of a few MB was a 413 there, though
    the real APIs take tens of MB."""
    image = {"type": "image", "source": {"type": "data", "value": "iVBORw0K" * 400_000,
                                         "mimeType": "image/png"}}
    async with provider_runtime(provider) as (runtime, requests), \
            serve_runtime(runtime) as served:
        response = await served.session.post(  # (a stream: aiohttp warns of big bytes)
            served.url + "/agent/default/run", headers={"Content-Type": "application/json"},
            data=io.BytesIO(orjson.dumps(with_parts("t-large", image))))
        events = parse_sse(await response.read())
    assert events[-1]["type"] == "RUN_FINISHED", events[-1]
    assert len(requests) == 1


@pytest.mark.parametrize(("mock", "path", "status", "error"), [
    (MockOpenAIServer, "/v1/chat/completions", 413, {"type": "invalid_request_error"}),
    (MockAnthropicServer, "/v1/messages", 413, {"type": "request_too_large"}),
    (MockGeminiServer, "/v1beta/models/m:generateContent", 400,
     {"code": 400, "status": "INVALID_ARGUMENT"}),
])
async def test_the_provider_mocks_refuse_a_request_over_their_apis_bound(
        mock: type[MockOpenAIServer | MockAnthropicServer | MockGeminiServer], path: str,
        status: int, error: dict[str, Any]) -> None:
    """Refused as the API refuses it, from its length alone (nothing of it is sent)."""
    async with mock() as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {server.max_body + 1}\r\nConnection: close\r\n\r\n"
                     .encode())
        await writer.drain()
        # (read by its length: the server lingers for the body it was promised)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = await reader.readexactly(length)
        writer.close()
        await writer.wait_closed()
    assert head.split()[1] == str(status).encode()
    said = orjson.loads(body)["error"]
    assert said.items() >= error.items()
    assert "exceeds" in said["message"]

