"""A tool result no call of the history asked for reaches the model as a user message
quoting it (`paired_tool_calls`): "(Result of tool call <its toolCallId>: <its text, else
its error>)", then its attachments. Guardrails judge it as the user's words, and the thread
keeps a mark of what they let through. Before the fix both left out parts of what the model
reads: the mark was of the result's role and content only (a result with the same empty
content let through once, any `error` after it passed unjudged), the call id was never
judged, and an attachment's filename stood in for the text, its `error` unjudged."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import pytest

from copilot_runtime._trust import judged
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.threads.base import JUDGED_MARK_PREFIX
from tests.conftest import Served, run_input, text_of
from tests.test_hostile_trust import _GENERATE, DENIED, GQL, REFUSAL, call, gql_text, guarded

pytestmark = pytest.mark.timeout(60)

__all__ = ["guarded"]  # a fixture

_IMAGE = {"type": "image", "metadata": {"filename": "chart.png"},
          "source": {"type": "data", "value": "iVBORw0KGgo=", "mimeType": "image/png"}}


def _orphan(message_id: str, call_id: str, content: Any, error: str | None = None
            ) -> dict[str, Any]:
    message = {"id": message_id, "role": "tool", "toolCallId": call_id, "content": content}
    return message if error is None else {**message, "error": error}


async def test_an_error_is_judged_after_a_result_with_the_same_content_was_let_through(
        guarded: Served, llm: MockOpenAIServer) -> None:
    first = run_input("hi", thread="orphans", run="r1")
    first["messages"].append(_orphan("x1", "none-1", "", "it failed"))
    assert text_of(await guarded.run(first)) == "echo: (Result of tool call none-1: it failed)"
    second = run_input("hi", thread="orphans", run="r2")
    second["messages"] = [*first["messages"], _orphan("x2", "none-2", "", DENIED)]
    assert text_of(await guarded.run(second)) == REFUSAL
    assert len(llm.requests) == 1  # only the harmless run reached the model


async def test_the_call_id_the_model_reads_is_judged(
        guarded: Served, llm: MockOpenAIServer) -> None:
    body = run_input("hi", thread="call-id")
    body["messages"].append(_orphan("x1", DENIED, "ok"))
    assert text_of(await guarded.run(body)) == REFUSAL
    assert llm.requests == []


async def test_an_error_is_judged_when_the_content_has_no_text_part(
        guarded: Served, llm: MockOpenAIServer) -> None:
    """An image's filename is text a guardrail reads, but the model reads the error in the
    quote (the content has no text part)."""
    body = run_input("hi", thread="image")
    body["messages"].append(_orphan("x1", "none-1", [_IMAGE], DENIED))
    assert text_of(await guarded.run(body)) == REFUSAL
    assert llm.requests == []
    # Control: a harmless error reaches the model in the quote, the image after it.
    body = run_input("hi", thread="image-2")
    body["messages"].append(_orphan("x1", "none-1", [_IMAGE], "it failed"))
    assert text_of(await guarded.run(body)) == "echo: (Result of tool call none-1: it failed)"
    assert len(llm.requests) == 1


def _old_mark(role: str, content: Any) -> str:
    """A mark as versions before the fix kept it (of role and content)."""
    digest = hashlib.blake2b(orjson.dumps([role, content]), digest_size=16).hexdigest()
    return JUDGED_MARK_PREFIX + digest


def test_a_thread_stored_before_judges_only_its_orphan_results_again() -> None:
    """A user message's mark is as before: a stored thread's history is not judged again.
    An orphan result's is not (it was of less than the model reads): it is judged once
    more, as what the model reads."""
    history = [{"id": "u1", "role": "user", "content": "hi"},
               _orphan("x1", "none-1", "it worked")]
    seen = {_old_mark("user", "hi"), _old_mark("tool", "it worked")}
    (marks, messages), = judged({"messages": history}, seen)
    assert marks[0] not in seen
    assert messages[-1] == {"id": "x1", "role": "user",
                            "content": "(Result of tool call none-1: it worked)"}
    assert judged({"messages": history}, {*seen, *marks}) == [([], history)]


async def test_graphql_gives_the_model_no_result_without_its_call(
        guarded: Served, llm: MockOpenAIServer) -> None:
    """GraphQL judges as AG-UI does, but a `resultMessage` whose action execution is not in
    the request never reaches the model (nor has an error): nothing there to judge."""
    data = {"threadId": "gql-orphan", "frontend": {"actions": []},
            "metadata": {"requestType": "Chat"},
            "messages": [gql_text("u1", "user", "hi"), {
                "id": "r1", "createdAt": "2025-01-01T00:00:00.000Z", "resultMessage": {
                    "actionExecutionId": "none-1", "actionName": "lookup", "result": DENIED}}]}
    status, body = await call(guarded, "POST", "", None,
                              {"query": _GENERATE, "variables": {"data": data}}, GQL)
    assert status == 200, body
    assert orjson.loads(body)["data"]["generateCopilotResponse"]["status"] == {
        "code": "Success"}
    (request,) = llm.requests
    assert "password" not in orjson.dumps(request["messages"]).decode()
