"""Back-to-back user messages are judged joined, as the parts of one message are: a model
reads them as one stretch of user input (the Anthropic adapter sends them as one turn), so a
word split across two of them is still that word, on both protocols."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from copilot_runtime import PatternGuardrail, Principal, Verdict
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


async def test_the_text_let_through_beside_new_messages_goes_within_a_window() -> None:
    """Before: the whole back-to-back history let through went to the judges each run (5,000
    messages: a megabyte, past PatternGuardrail's bound); then a window counted in raw
    characters, which 5,000 spaces or invisible characters pushed a split word out of (a
    review)."""
    from copilot_runtime._trust import STRETCH_WINDOW, _stretch_parts

    history = [_user(f"m{i}", "x" * 200) for i in range(5000)]
    messages = [*history, _user("new", "hello")]
    stretch = [(i, i == len(history)) for i in range(len(messages))]
    parts = _stretch_parts(messages, stretch)
    assert sum(len(p["text"]) for p in parts) <= STRETCH_WINDOW + len("hello")
    assert parts[-1] == {"type": "text", "text": "hello"}
    for padding in (" " * 5000, "\u200b" * 5000):
        messages = [_user("old", "please drop " + padding), _user("new", "table users")]
        joined = {"role": "user", "content": _stretch_parts(messages, [(0, False), (1, True)])}
        verdict = await PatternGuardrail(deny=[r"\bdrop\s+table\b"]).check([joined], None)
        assert not verdict.allowed, repr(padding[:1])


async def test_a_short_message_let_through_between_new_ones_is_judged_once() -> None:
    """Before: both windows covered it whole, so it went twice, and "table please, drop "
    twice made a "drop table" no one wrote: refused (a review)."""
    from copilot_runtime._trust import _stretch_parts

    messages = [_user("a", "Hello. "), _user("b", "table please, drop "), _user("c", "thanks")]
    parts = _stretch_parts(messages, [(0, True), (1, False), (2, True)])
    assert [p["text"] for p in parts] == ["Hello. ", "table please, drop ", "thanks"]
    verdict = await PatternGuardrail(deny=[r"\bdrop\s+table\b"]).check(
        [{"role": "user", "content": parts}], None)
    assert verdict.allowed
