"""Hostile input to the human-in-the-loop paths, transcription and LangGraph agents.

- A resume answer sent as JSON text (AG-UI `forwardedProps.command.resume`, GraphQL
  `metaEvents[].response`) was decoded without a depth bound: 300 levels ended the run with
  AGENT_ERROR "failed unexpectedly" (GraphQL: statusCode 500), 5000 levels with a
  RecursionError. It is now held to the request's bound (JSON_TOO_DEEP); text too deep for
  the JSON decoder at all is taken as text.
- An answer nested 252 levels could be stored, after which `GET /approvals?status=all`
  answered 500 for every caller (the listing nests it three levels deeper).
- The review loop crashed on an answer it should ask again about: JSON-looking text nested
  5000 levels (RecursionError) or a revision whose payload nests 300 levels (unencodable).
- A multipart upload of tens of thousands of tiny parts froze the whole server while the
  standard library parsed it; a `mimeType` holding control characters (or over 255 of them)
  reached the provider's SDK and came back as a retryable 500 (an over-long one went on to
  the provider), and the filename went on at any length, CR/LF percent-escaped.
- A LangGraph run whose `state` is not an object failed unexpectedly inside the bridge.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from copilot_runtime import CopilotRuntime, DemoAdapter, OpenAITranscription
from copilot_runtime.approvals.decisions import parse_decision
from tests import test_hitl_agui
from tests.conftest import Served, ServeRuntime, free_port
from tests.test_hitl_agui import Drafting, get, interrupt_of, run

pytestmark = pytest.mark.timeout(60)

#: The review loop served with its approvals, as the AG-UI approval tests have it.
hitl = test_hitl_agui.hitl

V1 = {"protocolVersion": "1.0"}
TASK = "Prepare the invoice for ACME"
AUDIO = b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(range(256))

GQL_DOCUMENT = """mutation($data: GenerateCopilotResponseInput!) {
  generateCopilotResponse(data: $data) {
    threadId
    status {
      __typename
      ... on BaseResponseStatus { code }
      ... on FailedResponseStatus { reason details }
    }
    metaEvents { name ... on LangGraphInterruptEvent { value } }
  }
}"""
GQL_HEADERS = {"X-CopilotKit-Runtime-Client-GQL-Version": "1.10.6"}


def brackets(depth: int) -> str:
    """A JSON array nested `depth` levels deep, as text."""
    return "[" * depth + "]" * depth


def objects(depth: int) -> str:
    """A JSON object nested `depth` levels deep, as text."""
    return '{"a":' * depth + "1" + "}" * depth


def errors_logged(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry.get("log_level") in ("error", "critical")]


async def legacy_resume(served: Served, thread: str, resume: Any) -> list[dict[str, Any]]:
    """Resume `thread` as CopilotKit's useInterrupt does: the answer in forwardedProps."""
    return await run(served, thread, forwardedProps={"command": {"resume": resume}})


async def approvals(served: Served, query: str) -> tuple[int, Any]:
    response = await served.session.get(f"{served.url}/approvals?{query}")
    return response.status, orjson.loads(await response.read())


# -- (1) a resume answer sent as JSON text is held to the request's depth bound -----------

async def test_a_legacy_resume_nested_too_deep_is_json_too_deep(
        hitl: tuple[Served, list[Drafting]]) -> None:
    served, specialists = hitl
    await run(served, "deep300", TASK)
    with capture_logs() as logs:
        refused = await legacy_resume(served, "deep300", brackets(300))
    last = refused[-1]
    assert (last["type"], last.get("code")) == ("RUN_ERROR", "JSON_TOO_DEEP"), last
    assert last["message"] == "The resume answer is nested too deep (at most 64 levels)"
    assert not errors_logged(logs), errors_logged(logs)
    # Nothing was claimed: the question still waits, and a plain answer goes through.
    _, listed = await get(served, "/approvals?threadId=deep300&status=all")
    assert [a["status"] for a in listed["approvals"]] == ["pending"]
    done = await legacy_resume(served, "deep300", "approve")
    assert done[-1]["type"] == "RUN_FINISHED", done[-1]
    assert len(specialists[0].calls) == 1


async def test_a_legacy_resume_too_deep_to_decode_is_taken_as_text(
        hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    text = brackets(5000)
    await run(served, "deep5000", TASK)
    with capture_logs() as logs:
        answered = await legacy_resume(served, "deep5000", text)
    assert [e for e in answered if e["type"] == "RUN_ERROR"] == []
    assert not errors_logged(logs), errors_logged(logs)
    status, listed = await approvals(served, "threadId=deep5000&status=answered")
    assert status == 200
    assert [a["answer"] for a in listed["approvals"]] == [text]


@pytest.mark.parametrize(("depth", "failed"), [(300, True), (5000, False)])
async def test_a_graphql_meta_event_response_nested_deep(
        hitl: tuple[Served, list[Drafting]], depth: int, failed: bool) -> None:
    served, _ = hitl
    thread = f"gql-{depth}"
    data: dict[str, Any] = {
        "threadId": thread, "frontend": {"actions": []}, "metadata": {"requestType": "Chat"},
        "agentSession": {"agentName": "review"},
        "messages": [{"id": f"{thread}-u", "createdAt": "2025-01-01T00:00:00.000Z",
                      "textMessage": {"role": "user", "content": TASK}}]}
    response = await served.post("", {"query": GQL_DOCUMENT, "variables": {"data": data}},
                                 headers=GQL_HEADERS)
    first = orjson.loads(await response.read())["data"]["generateCopilotResponse"]
    (meta,) = first["metaEvents"]
    data["messages"] = []
    data["metaEvents"] = [{"name": "LangGraphInterruptEvent", "value": meta["value"],
                           "response": brackets(depth)}]
    with capture_logs() as logs:
        response = await served.post("", {"query": GQL_DOCUMENT,
                                          "variables": {"data": data}}, headers=GQL_HEADERS)
        raw = await response.read()
    assert response.status == 200, raw[:400]
    assert b"Traceback" not in raw
    status = orjson.loads(raw)["data"]["generateCopilotResponse"]["status"]
    if failed:
        assert status["__typename"] == "FailedResponseStatus", status
        original = status["details"]["originalError"]
        assert original["originalErrorType"] == "JSON_TOO_DEEP", status
        assert original["statusCode"] == 400, status
        expected = ["pending"]
    else:
        assert status["__typename"] == "SuccessResponseStatus", status
        expected = ["answered", "pending"]  # taken as text: a revision, asked about again
    assert not errors_logged(logs), errors_logged(logs)
    code, listed = await approvals(served, f"threadId={thread}&status=all")
    assert code == 200
    assert sorted(a["status"] for a in listed["approvals"]) == expected


# -- (2) one answer can no longer poison the approval listing -----------------------------

async def test_an_answer_nested_252_levels_cannot_break_the_approval_list(
        hitl: tuple[Served, list[Drafting]]) -> None:
    served, _ = hitl
    await run(served, "healthy", TASK)
    await legacy_resume(served, "healthy", "approve")
    await run(served, "poison", TASK)
    refused = await legacy_resume(served, "poison", brackets(252))
    for query, threads in [("status=all", {"healthy", "poison"}),
                           ("status=answered", {"healthy"}),
                           ("threadId=poison&status=all", {"poison"}),
                           ("threadId=healthy&status=all", {"healthy"})]:
        status, listed = await approvals(served, query)
        assert status == 200, (query, listed)
        assert {a["threadId"] for a in listed["approvals"]} == threads, query
    _, poisoned = await approvals(served, "threadId=poison&status=all")
    assert [a["status"] for a in poisoned["approvals"]] == ["pending"]
    assert (refused[-1]["type"], refused[-1].get("code")) == ("RUN_ERROR", "JSON_TOO_DEEP")


# -- (3) the review loop asks again instead of failing ------------------------------------

def test_parse_decision_of_json_text_nested_deep() -> None:
    # Too deep for the JSON decoder: plain text, which the seed's rule makes a revision.
    deep = parse_decision(objects(5000))
    assert deep is not None
    assert (deep.action, deep.feedback) == ("revise", objects(5000))
    # Decodable, but deeper than any request may nest: not an answer anyone wrote.
    assert parse_decision('{"action":"revise","payload":' + objects(300) + "}") is None
    shallow = parse_decision('{"action":"revise","payload":' + objects(3) + "}")
    assert shallow is not None
    assert shallow.payload == {"a": {"a": {"a": 1}}}


async def test_a_revision_whose_payload_nests_300_levels_is_asked_again(
        hitl: tuple[Served, list[Drafting]]) -> None:
    served, specialists = hitl
    first = interrupt_of(await run(served, "rev300", TASK, **V1))
    answer = '{"action":"revise","payload":' + objects(300) + "}"
    with capture_logs() as logs:
        again = await run(served, "rev300", resume=[{
            "interruptId": first["id"], "status": "resolved", "payload": answer}], **V1)
    assert [e for e in again if e["type"] == "RUN_ERROR"] == []
    assert not errors_logged(logs), errors_logged(logs)
    asked = interrupt_of(again)
    assert asked["message"].startswith("That answer was neither an approval nor a revision")
    assert asked["metadata"]["langgraph"]["raw"]["data"]["iteration"] == 1
    assert len(specialists[0].calls) == 1  # nothing was redone
    status, listed = await approvals(served, "threadId=rev300&status=all")
    assert status == 200
    assert sorted(a["status"] for a in listed["approvals"]) == ["answered", "pending"]


async def test_json_looking_text_nested_5000_levels_does_not_fail_the_run(
        hitl: tuple[Served, list[Drafting]]) -> None:
    served, specialists = hitl
    first = interrupt_of(await run(served, "obj5000", TASK, **V1))
    with capture_logs() as logs:
        again = await run(served, "obj5000", resume=[{
            "interruptId": first["id"], "status": "resolved", "payload": objects(5000)}],
            **V1)
    assert [e for e in again if e["type"] == "RUN_ERROR"] == []
    assert not errors_logged(logs), errors_logged(logs)
    asked = interrupt_of(again)  # a question again: the text was taken as what to change
    assert asked["id"] != first["id"]
    assert specialists[0].calls[-1].feedback == objects(5000)
    status, _ = await approvals(served, "status=all")
    assert status == 200


# -- (4) transcription: many-part forms, control characters --------------------------------

@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A stand-in for OpenAI's transcription API that keeps every request body."""
    bodies: list[bytes] = []

    async def transcriptions(request: web.Request) -> web.Response:
        bodies.append(await request.read())
        return web.json_response({"text": "heard it"})

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1", bodies
    finally:
        await runner.cleanup()


@pytest.fixture
async def transcribing(serve_runtime: ServeRuntime, upstream: tuple[str, list[bytes]]
                       ) -> AsyncIterator[Served]:
    runtime = CopilotRuntime(service_adapter=DemoAdapter(delay=0),
                             transcription=OpenAITranscription(base_url=upstream[0]))
    async with serve_runtime(runtime) as served:  # the default 8 MiB body limit
        yield served


async def test_a_form_of_many_parts_is_refused_without_freezing_the_server(
        transcribing: Served) -> None:
    # 60,000 tiny parts (3 MB): the standard library's parser took over 4 s for 40,000,
    # with every other request waiting.
    parts = 60_000
    body = b"--b\r\nContent-Disposition: form-data; name=x\r\n\r\ny\r\n" * parts + b"--b--\r\n"
    session, url = transcribing.session, transcribing.url
    finished: list[float] = []
    answering, uploaded = asyncio.Event(), asyncio.Event()

    async def ping() -> None:
        while not uploaded.is_set():
            async with session.get(url + "/info") as response:
                assert response.status == 200
                await response.read()
            finished.append(time.monotonic())
            answering.set()
            await asyncio.sleep(0.01)

    pinger = asyncio.create_task(ping())
    try:
        await answering.wait()
        started = time.monotonic()
        async with session.post(url + "/transcribe", data=io.BytesIO(body), headers={
                "Content-Type": "multipart/form-data; boundary=b"}) as response:
            status, answer = response.status, orjson.loads(await response.read())
        took = time.monotonic() - started
        await asyncio.sleep(0.1)
        uploaded.set()
        await pinger
    finally:
        pinger.cancel()
    assert took < 2.0, f"the upload took {took:.1f}s"
    gaps = [b - a for a, b in itertools.pairwise(finished)]
    assert max(gaps, default=0.0) < 1.0, f"GET /info waited {max(gaps):.1f}s"
    assert (status, answer["error"], answer["retryable"]) == (400, "invalid_request", False)
    assert "more than 64 parts" in answer["message"]


@pytest.mark.parametrize("mime_type", [
    'audio/wav;\r\nX-Injected: yes\r\nContent-Disposition: form-data; name="model"',
    "audio/wav;\x00",
    "audio/webm;\tcodecs=opus\x7f",
    "audio/wav;" + "x" * 300,
], ids=["crlf", "nul", "del", "too-long"])
async def test_a_mime_type_with_control_characters_or_too_long_is_a_400(
        transcribing: Served, upstream: tuple[str, list[bytes]], mime_type: str) -> None:
    async with transcribing.session.post(transcribing.url + "/transcribe", json={
            "audio": base64.b64encode(AUDIO).decode(), "mimeType": mime_type}) as response:
        status, answer = response.status, await response.json()
    assert (status, answer["error"], answer["retryable"]) == (
        400, "invalid_audio_format", False), answer
    assert "control characters" in answer["message"]
    assert upstream[1] == []  # never sent on


async def test_the_filename_is_stripped_of_control_characters_and_capped(
        transcribing: Served, upstream: tuple[str, list[bytes]]) -> None:
    for filename, sent in [("clip\r\nX-Injected: yes.wav", b'filename="clipX-Injected: yes.wav"'),
                           ("a" * 1000 + ".wav", b'filename="' + b"a" * 255 + b'"')]:
        async with transcribing.session.post(transcribing.url + "/transcribe", json={
                "audio": base64.b64encode(AUDIO).decode(), "mimeType": "audio/wav",
                "filename": filename}) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["text"] == "heard it"
        assert sent in upstream[1][-1]
        assert b"\r\nX-Injected" not in upstream[1][-1]


# -- (5) a LangGraph agent's state must be an object ---------------------------------------

@pytest.mark.parametrize("protocol", [{}, V1], ids=["legacy", "v1"])
@pytest.mark.parametrize("state", [[1, 2], "text", 5, True], ids=["list", "str", "int", "bool"])
async def test_a_langgraph_state_that_is_not_an_object_is_invalid_request(
        hitl: tuple[Served, list[Drafting]], state: Any, protocol: dict[str, str]) -> None:
    served, specialists = hitl
    with capture_logs() as logs:
        refused = await run(served, "not-an-object", TASK, state=state, **protocol)
    assert [e["type"] for e in refused] == ["RUN_STARTED", "RUN_ERROR"]
    assert refused[-1]["code"] == "INVALID_REQUEST", refused[-1]
    assert refused[-1]["message"] == "A LangGraph agent's state must be a JSON object"
    assert not errors_logged(logs), errors_logged(logs)
    assert specialists[0].calls == []
    # The thread is not harmed: the same request with an object state runs.
    done = await run(served, "not-an-object", TASK, state={}, **protocol)
    assert done[-1]["type"] == "RUN_FINISHED", done[-1]
    assert len(specialists[0].calls) == 1
