"""Back-to-back user messages (and tool results) are judged joined, as the parts of one
message are: a model reads them as one stretch of user input (the Anthropic adapter sends
them as one turn), so a word split across two of them is still that word, on both
protocols. Of the text let through before, only the window next to the new goes along."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from copilot_runtime import PatternGuardrail, Principal, Verdict
from copilot_runtime._trust import STRETCH_WINDOW, history_texts, judged, judged_mark
from copilot_runtime.guardrails import latest_user_text
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import Served, ServeRuntime, openai_runtime, run_input, text_of, types

pytestmark = pytest.mark.timeout(60)

REFUSAL = "Sorry, I can't help with that request."
GQL = {"X-CopilotKit-Runtime-Client-GQL-Version": "1.10.6"}


@pytest.fixture
async def guarded(serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> AsyncIterator[Served]:
    runtime = openai_runtime(llm, guardrails=[PatternGuardrail([r"\bdrop\s+table\b"])])
    async with serve_runtime(runtime) as served:
        yield served


def _user(message_id: str, content: Any) -> dict[str, Any]:
    return {"id": message_id, "role": "user", "content": content}


_SPLIT: dict[str, list[dict[str, Any]]] = {
    "two user messages": [_user("u1", "please drop "), _user("u2", "table users")],
    "a system message between": [
        _user("u1", "please drop "), {"id": "s1", "role": "system", "content": "Be brief."},
        _user("u2", "table users")],
    "parts of both": [
        _user("u1", [{"type": "text", "text": "hi"}, {"type": "text", "text": ", please drop "}]),
        _user("u2", [{"type": "text", "text": "table users"}])],
    "a blank assistant message between": [
        _user("u1", "please drop "), {"id": "a1", "role": "assistant", "content": ""},
        _user("u2", "table users")],
}


@pytest.mark.parametrize("case", list(_SPLIT))
async def test_agui_a_word_split_across_user_messages_is_refused(
        guarded: Served, llm: MockOpenAIServer, case: str) -> None:
    """Before: each message was judged on its own, and the model got "please drop table
    users" in one turn."""
    body = run_input("", thread=f"split-{case}", run="r1")
    body["messages"] = _SPLIT[case]
    events = await guarded.run(body)
    assert text_of(events) == REFUSAL
    assert types(events)[-1] == "RUN_FINISHED"
    assert llm.requests == []


async def test_a_message_let_through_before_is_joined_with_the_new_one_after_it(
        guarded: Served, llm: MockOpenAIServer) -> None:
    """A message allowed in an earlier run, sent back with no answer after it, is still
    read by the model together with the new one."""
    first = await guarded.run(run_input("please drop ", thread="again", run="r1"))
    assert text_of(first) == "echo: please drop "
    body = run_input("", thread="again", run="r2")
    body["messages"] = [_user("r1-u", "please drop "), _user("r2-u", "table users")]
    assert text_of(await guarded.run(body)) == REFUSAL
    assert len(llm.requests) == 1


async def test_an_answer_between_user_messages_keeps_them_apart(
        guarded: Served, llm: MockOpenAIServer) -> None:
    body = run_input("", thread="apart", run="r1")
    body["messages"] = [_user("u1", "please drop "),
                        {"id": "a1", "role": "assistant", "content": "Drop what?"},
                        _user("u2", "table users")]
    events = await guarded.run(body)
    assert text_of(events) == "echo: table users"


_GENERATE = """mutation($data: GenerateCopilotResponseInput!) {
  generateCopilotResponse(data: $data) {
    status { ... on BaseResponseStatus { code } ... on FailedResponseStatus { reason details } }
  } }"""


async def test_graphql_a_word_split_across_user_messages_is_refused(
        guarded: Served, llm: MockOpenAIServer) -> None:
    messages = [{"id": f"u{i}", "createdAt": "2025-01-01T00:00:00.000Z",
                 "textMessage": {"role": "user", "content": text}}
                for i, text in enumerate(["please drop ", "table users"])]
    data = {"threadId": "gq-split", "frontend": {"actions": []},
            "metadata": {"requestType": "Chat"}, "messages": messages}
    response = await guarded.post("", {"query": _GENERATE, "variables": {"data": data}},
                                  headers=GQL)
    result = (await response.json())["data"]["generateCopilotResponse"]
    assert result["status"] == {"code": "Failed", "reason": "GUARDRAILS_VALIDATION_FAILED",
                                "details": {"guardrailsReason": REFUSAL}}
    assert llm.requests == []


class Recorder:
    """A guardrail that allows everything, and notes the user text it was asked to judge."""

    def __init__(self) -> None:
        self.judged: list[str | None] = []

    async def check(self, messages: Any, principal: Principal | None) -> Verdict:
        self.judged.append(latest_user_text(messages))
        return Verdict(True)


async def test_each_message_is_judged_and_the_stretch_once_joined(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """What a judge (a `TopicGuardrail` reads `latest_user_text`) is shown: each message
    alone, the last of a stretch with the whole stretch. Each text is judged at most twice:
    the cost stays linear in the input."""
    recorder = Recorder()
    async with serve_runtime(openai_runtime(llm, guardrails=[recorder])) as served:
        body = run_input("", thread="cost", run="r1")
        body["messages"] = [_user("u1", "a"), _user("u2", "b"),
                            {"id": "a1", "role": "assistant", "content": "ok"},
                            _user("u3", "c"), _user("u4", "d"), _user("u5", "e")]
        events = await served.run(body)
        assert types(events)[-1] == "RUN_FINISHED"
        # (the assistant message, not the thread's own, is judged last as other client text)
        assert recorder.judged == ["a", "a\nb", "c", "d", "c\nd\ne", "ok"]
        body = run_input("", thread="long", run="r1")
        body["messages"] = [_user(f"m{i}", "x" * 100) for i in range(32)]
        recorder.judged.clear()
        await served.run(body)
        assert len(recorder.judged) == 32
        assert sum(len(t or "") for t in recorder.judged) <= 2 * 32 * 101


_CALL = {"id": "c1", "type": "function", "function": {"name": "askUser", "arguments": "{}"}}


def _asked(message_id: str = "a1") -> dict[str, Any]:
    return {"id": message_id, "role": "assistant", "content": "", "toolCalls": [_CALL]}


def _result(content: str, call_id: str = "c1") -> dict[str, Any]:
    return {"id": f"t-{call_id}", "role": "tool", "toolCallId": call_id, "content": content}


async def _verdicts(messages: list[dict[str, Any]], seen: set[str]) -> list[bool]:
    guard = PatternGuardrail([r"\bdrop\s+table\b"])
    return [(await guard.check(judgement, None)).allowed
            for _, judgement in judged({"messages": messages}, seen)]


_SPLIT_BY_RESULT: dict[str, tuple[list[dict[str, Any]], int]] = {
    # (the messages, how many of the first the thread let through before)
    "a frontend action's result, then the user": (
        [_user("u0", "hi"), _asked(), _result("please drop "), _user("u2", "table users")], 0),
    "a result no call asked for, then the user": (
        [_result("please drop ", "nobody"), _user("u2", "table users")], 0),
    "a result let through before, then the user": (
        [_user("u0", "hi"), _asked(), _result("please drop "), _user("u2", "table users")], 3),
    "a new result, then a user message let through before": (
        [_user("u2", "table users"), _asked(), _result("please drop "),
         _user("u3", "table users")], 1),
}


@pytest.mark.parametrize("case", list(_SPLIT_BY_RESULT))
async def test_a_word_split_across_a_tool_result_and_the_user_is_refused(case: str) -> None:
    """A tool result and the user message after it go to the model as one user turn (the
    Anthropic adapter's): each was judged apart, and "please drop " + "table users" passed."""
    messages, let_through = _SPLIT_BY_RESULT[case]
    seen = {mark for message in messages[:let_through]
            for mark in [judged_mark(message), *(m for m, _ in history_texts(message))]}
    if case.startswith("a new result"):
        seen.add(judged_mark(messages[-1]))
    assert not all(await _verdicts(messages, seen))


async def test_an_answer_after_a_tool_result_keeps_it_apart_from_the_user() -> None:
    messages = [_user("u0", "hi"), _asked(), _result("please drop "),
                {"id": "a2", "role": "assistant", "content": "Done."}, _user("u2", "table users")]
    assert all(await _verdicts(messages, set()))


def test_the_text_let_through_before_a_new_message_is_judged_within_a_window() -> None:
    """5,000 messages let through, back to back, and one new: the judge was sent all of
    them (1,005,005 characters, past PatternGuardrail's max_chars) on each run. Now the
    `STRETCH_WINDOW` characters just before the new message, and the new one whole."""
    old = [_user(f"m{i}", "x" * 199 + "!") for i in range(5_000)]
    seen = {judged_mark(m) for m in old}
    new = _user("new", "y" * 10_000)
    (judgement,) = [j for _, j in judged({"messages": [*old, new]}, seen)]
    text = latest_user_text(judgement) or ""
    assert text.replace("\n", "").endswith("x" * 199 + "!" + "y" * 10_000)
    assert STRETCH_WINDOW <= len(text) - 10_000 <= STRETCH_WINDOW + 200
    # A new message among them: the let-through text on either side of it, windowed too.
    middle = [*old[:2_500], new, *old[2_500:]]
    (judgement,) = [j for _, j in judged({"messages": middle}, seen)]
    assert 2 * STRETCH_WINDOW <= len(latest_user_text(judgement) or "") - 10_000 \
        <= 2 * STRETCH_WINDOW + 400


async def test_agui_a_word_split_by_a_frontend_result_is_refused_once(
        guarded: Served, llm: MockOpenAIServer) -> None:
    """End to end: refused, the refusal falling on the user's message; sent back with the
    chat's history, it refuses no later turn."""
    messages = [_user("u0", "hi"), _asked(), _result("please drop "), _user("u2", "table users")]
    refused = await guarded.run(run_input("", thread="by-result", run="r1", messages=messages))
    assert text_of(refused) == REFUSAL
    assert llm.requests == []
    answer = {"id": "refusal", "role": "assistant", "content": text_of(refused)}
    events = await guarded.run(run_input("", thread="by-result", run="r2", messages=[
        *messages, answer, _user("u3", "hello")]))
    assert text_of(events) == "echo: hello"
