"""What an adapter keeps of an answer for the tool loop's next request goes back to its own
thread only: OpenAI-compatible `reasoning_content` (DeepSeek, Kimi K2), Claude's signed
thinking, Gemini's thought signatures.

Each was kept in one store for the whole process, keyed by the provider's id of the answer's
first tool call, and put back on any later request whose history held a call of that id. Kimi
K2 names calls `functions.NAME:IDX`, the same in every conversation, and a history's call ids
are the client's to write: one user's reasoning went out in another user's requests (and to
their model, which may repeat it). Now it is kept per thread, and only for the call that was
streamed (same name; for Gemini, whose calls come whole, same arguments too).

A thread's id is free again once the thread is deleted (by its owner, or by retention), and
may become another principal's: kept by thread id alone, bob's reasoning went into alice's
request on the id he had freed. Now the thread's owner is part of the key, and a deleted
thread's values are dropped with it.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import orjson
import pytest
from ag_ui.core import UserMessage

from copilot_runtime import BearerTokenAuth, CopilotRuntime, OpenAIAdapter
from copilot_runtime._input import parse_run_input
from copilot_runtime.adapters._common import KeptForThreads
from copilot_runtime.adapters.anthropic import AnthropicAdapter, AnthropicStreamParser
from copilot_runtime.adapters.base import ChatRequest, ToolSpec
from copilot_runtime.testing import ScriptedAdapter, text_turn
from copilot_runtime.threads import ThreadOwner
from tests.conftest import ServeRuntime, run_input, text_of, types
from tests.test_hostile_providers import (
    AN_START,
    ANSWER,
    HEAD,
    OA_DONE,
    TIMEOUT_S,
    ScriptedUpstream,
    Step,
    an,
    an_args,
    an_delta,
    an_end,
    an_stop,
    an_tool_start,
    gm_parts,
    hostile,
    make_adapter,
    oa_finish,
    oa_tool,
    run,
    sse,
)
from tests.test_trust_ownership import ALICE, BOB, TOKENS, auth, call

pytestmark = pytest.mark.timeout(60)

#: The id every thread's first call gets, as Kimi K2 names calls.
CALL_ID = "functions.lookup:0"
ARGUMENTS = '{"q":"balance"}'
LOOKUP = {"name": "lookup", "description": "Looks up an account",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
_THINKING = {"type": "enabled", "budget_tokens": 1024}


def _calling(provider: str, reasoning: str) -> list[Step]:
    """An answer that reasons (`reasoning`: its text, or its signature for Gemini), then
    calls `lookup` under `CALL_ID`."""
    if provider == "openai":
        return [HEAD, sse({"choices": [{"index": 0, "delta": {
                    "role": "assistant", "reasoning_content": reasoning}, "finish_reason": None}]}),
                oa_tool(0, CALL_ID, "lookup", ARGUMENTS), oa_finish("tool_calls"), OA_DONE]
    if provider == "anthropic":
        return [HEAD, AN_START,
                an({"type": "content_block_start", "index": 0, "content_block": {
                    "type": "thinking", "thinking": "", "signature": ""}}),
                an_delta({"type": "thinking_delta", "thinking": reasoning}),
                an_delta({"type": "signature_delta", "signature": "sig-" + reasoning}),
                an_stop(0), an_tool_start(1, CALL_ID, "lookup"), an_args(1, ARGUMENTS),
                an_stop(1), *an_end("tool_use")]
    return [HEAD, gm_parts({"text": "Let me look.", "thought": True}, {
                "functionCall": {"id": CALL_ID, "name": "lookup",
                                 "args": orjson.loads(ARGUMENTS)},
                "thoughtSignature": base64.b64encode(reasoning.encode()).decode()},
                reason="STOP", usage={"promptTokenCount": 3, "candidatesTokenCount": 2})]


def _follow_up(thread: str, run: str, name: str = "lookup",
               arguments: str = ARGUMENTS) -> dict[str, Any]:
    """The client's tool result, after the history it kept of the thread's first run."""
    return run_input("", thread=thread, run=run, tools=[LOOKUP], messages=[
        {"id": "u", "role": "user", "content": "my balance?"},
        {"id": "a", "role": "assistant", "toolCalls": [{
            "id": CALL_ID, "type": "function",
            "function": {"name": name, "arguments": arguments}}]},
        {"id": "t", "role": "tool", "toolCallId": CALL_ID, "content": "12"}])


def _sent_back(provider: str, request: bytes) -> str | None:
    """What the request to the provider carried on the call's assistant message: reasoning
    text, thinking text, or a signature (decoded; None for none or Google's stand-in)."""
    body = orjson.loads(request.split(b"\r\n\r\n", 1)[1])
    if provider == "openai":
        (message,) = [m for m in body["messages"] if m.get("tool_calls")]
        return message.get("reasoning_content")  # type: ignore[no-any-return]
    if provider == "anthropic":
        (turn,) = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
        if turn[0]["type"] != "thinking":
            return None
        assert turn[0]["signature"] == "sig-" + turn[0]["thinking"]
        return turn[0]["thinking"]  # type: ignore[no-any-return]
    (turn,) = [c["parts"] for c in body["contents"] if c["role"] == "model"]
    signature = turn[0].get("thoughtSignature") or turn[0].get("thought_signature")
    said = base64.urlsafe_b64decode(signature.replace("+", "-").replace("/", "_")).decode(
        errors="replace")
    return None if said == base64.urlsafe_b64decode(
        "skip_thought_signature_validator").decode(errors="replace") else said


@pytest.mark.parametrize("transport", ["direct", "sdk"])
@pytest.mark.parametrize("provider", ["openai", "anthropic", "google"])
async def test_a_threads_kept_reasoning_never_goes_to_another_thread(
        serve_runtime: ServeRuntime, provider: str, transport: str) -> None:
    """Threads B and A (two users) each get a call under the same id; each one's tool result
    goes back with its own reasoning, never the other's (B's carried A's, the latest); a
    thread that never streamed the call gets none, nor does B's call under another name."""
    b_said, a_said = "B thinks of B's account.", "A's private card is 4111-1111-1111-1111."
    options = {"thinking": _THINKING} if provider == "anthropic" else {}
    done = ANSWER[provider]("Done.")
    async with hostile(serve_runtime, provider, _calling(provider, b_said),
                       _calling(provider, a_said), done, transport=transport,
                       **options) as (served, upstream):
        for thread, run_id in (("thread-B", "b1"), ("thread-A", "a1")):
            first = await run(served, run_input("my balance?", thread=thread, run=run_id,
                                                tools=[LOOKUP]))
            (start,) = [e for e in first if e["type"] == "TOOL_CALL_START"]
            assert start["toolCallId"] == CALL_ID
        followed = [await run(served, body) for body in (
            _follow_up("thread-B", "b2"), _follow_up("thread-A", "a2"),
            _follow_up("thread-C", "c1"), _follow_up("thread-B", "b3", name="other"))]
    for events in followed:
        assert types(events)[-1] == "RUN_FINISHED"
        assert text_of(events)
    sent = [_sent_back(provider, request) for request in upstream.requests[2:]]
    assert sent == [b_said, a_said, None, None]


async def test_gemini_signature_goes_back_only_with_the_arguments_it_was_given_for(
        serve_runtime: ServeRuntime) -> None:
    """A Gemini call comes whole: its signature goes back only on that call, not on one of
    the same id and name with other arguments."""
    async with hostile(serve_runtime, "google", _calling("google", "own"),
                       ANSWER["google"]("Done.")) as (served, upstream):
        await run(served, run_input("my balance?", thread="t", run="r1", tools=[LOOKUP]))
        await run(served, _follow_up("t", "r2", arguments='{"q":"everything"}'))
        await run(served, _follow_up("t", "r3"))
    assert [_sent_back("google", r) for r in upstream.requests[1:]] == [None, "own"]


async def test_a_request_of_no_thread_keeps_nothing() -> None:
    """An adapter called outside any run, told no thread, keeps no reasoning (it could
    never tell whose requests to give it back to)."""
    async with ScriptedUpstream(_calling("openai", "unowned")) as upstream:
        adapter = OpenAIAdapter(base_url=upstream.url + "/v1", api_key="sk-mock",
                                max_retries=0)
        try:
            async with asyncio.timeout(TIMEOUT_S):
                async for _ in adapter.stream(ChatRequest(
                        messages=[UserMessage(id="u", content="my balance?")])):
                    pass
        finally:
            await adapter.aclose()
    assert len(adapter._reasoning) == 0


async def test_the_built_in_agent_names_its_runs_thread_in_every_request() -> None:
    # The thread is the agent's to say, not only the run's log context's (an agent run
    # outside the runtime's run machinery has none).
    adapter = ScriptedAdapter([text_turn("hi")])
    runtime = CopilotRuntime(service_adapter=adapter)
    run = await runtime.start_run("default", parse_run_input(run_input("go", thread="t-own")))

    async def write(batch: Any) -> None:
        pass

    await run.drive(write)
    assert [r.thread_id for r in adapter.requests] == ["t-own"]


async def _ask(adapter: Any, body: dict[str, Any], owner: ThreadOwner | None) -> None:
    """One request of `body`'s run straight to `adapter`, for its thread and `owner`."""
    model = parse_run_input(body).model
    request = ChatRequest(messages=list(model.messages),
                          tools=[ToolSpec(LOOKUP["name"], LOOKUP["description"],
                                          LOOKUP["parameters"])],
                          thread_id=model.thread_id, thread_owner=owner)
    async with asyncio.timeout(TIMEOUT_S):
        async for _ in adapter.stream(request):
            pass


@pytest.mark.parametrize("provider", ["openai", "anthropic", "google"])
async def test_kept_reasoning_goes_back_only_to_its_threads_owner(provider: str) -> None:
    """What was kept for bob's thread goes into bob's next request on it, never into
    alice's request on a thread of the same id (his deleted, the id hers now), nor into a
    request that names no owner."""
    bob, alice = ThreadOwner("bob"), ThreadOwner("alice")
    options = {"thinking": _THINKING} if provider == "anthropic" else {}
    async with ScriptedUpstream(_calling(provider, "bob's card"),
                                ANSWER[provider]("Done.")) as upstream:
        adapter = make_adapter(provider, upstream.url, "direct", **options)
        try:
            await _ask(adapter, run_input("my balance?", thread="t", run="b1"), bob)
            for owner in (alice, None, bob):
                await _ask(adapter, _follow_up("t", "r"), owner)
        finally:
            await adapter.aclose()
    assert [_sent_back(provider, r) for r in upstream.requests[1:]] == [
        None, None, "bob's card"]


@pytest.mark.parametrize("provider", ["openai", "anthropic", "google"])
async def test_a_deleted_threads_kept_reasoning_never_goes_to_the_ids_next_owner(
        serve_runtime: ServeRuntime, provider: str) -> None:
    """Bob's thread reasons over his card and calls a tool; he deletes it; alice starts a
    thread of the same id (hers now) with a history naming that call: her request to the
    provider carries none of bob's reasoning."""
    secret = "BOB: my card is 4111-1111-1111-1111"
    options = {"thinking": _THINKING} if provider == "anthropic" else {}
    async with asyncio.timeout(TIMEOUT_S), ScriptedUpstream(
            _calling(provider, secret), ANSWER[provider]("Done.")) as upstream:
        runtime = CopilotRuntime(
            service_adapter=make_adapter(provider, upstream.url, "direct", **options),
            auth=BearerTokenAuth(TOKENS))
        async with serve_runtime(runtime) as served:
            response = await served.post("/agent/default/run", run_input(
                "my balance?", thread="t-1", run="b1", tools=[LOOKUP]), headers=auth(BOB))
            assert response.status == 200
            await response.read()
            assert (await call(served, "DELETE", "/threads/t-1", BOB))[0] == 200
            response = await served.post("/agent/default/run", _follow_up("t-1", "a1"),
                                         headers=auth(ALICE))
            assert response.status == 200
            assert b"RUN_FINISHED" in await response.read()
    assert _sent_back(provider, upstream.requests[1]) is None


@pytest.mark.parametrize("provider", ["openai", "anthropic", "google"])
async def test_a_deleted_threads_kept_reasoning_is_dropped_with_it(
        serve_runtime: ServeRuntime, provider: str) -> None:
    """Without authentication too: a thread deleted, a new thread of its id gets nothing
    the deleted one kept (nor does it stay held)."""
    options = {"thinking": _THINKING} if provider == "anthropic" else {}
    async with hostile(serve_runtime, provider, _calling(provider, "old thread's"),
                       ANSWER[provider]("Done."), **options) as (served, upstream):
        await run(served, run_input("my balance?", thread="t-1", run="r1", tools=[LOOKUP]))
        response = await served.session.delete(served.url + "/threads/t-1")
        assert response.status == 200
        assert types(await run(served, _follow_up("t-1", "r2")))[-1] == "RUN_FINISHED"
        adapter = served.runtime.service_adapter
    assert _sent_back(provider, upstream.requests[1]) is None
    kept = {"openai": "_reasoning", "anthropic": "_thinking", "google": "_signatures"}
    assert len(getattr(adapter, kept[provider])) == 0


def test_a_threads_values_are_forgotten_whoever_owned_them() -> None:
    """`forget` drops a thread's values of every owner, and the bound's accounting with them,
    evictions included."""
    kept: KeptForThreads[str] = KeptForThreads(10, len)
    kept.keep(("t", ThreadOwner("bob")), "c1", "f", "aaaa")
    kept.keep(("t", None), "c2", "f", "bbb")
    kept.keep(("u", None), "c1", "f", "cc")
    kept.keep(("u", None), "c3", "f", "ddd")  # past 10 characters: bob's, the oldest, goes
    assert (len(kept), kept.held) == (3, 8)
    kept.forget("t")
    assert (len(kept), kept.held) == (2, 5)
    assert kept.get(("u", None), "c1", "f", "{}") == "cc"
    assert kept.get(("u", ThreadOwner("bob")), "c1", "f", "{}") is None
    kept.forget("u")
    kept.forget("never kept")
    assert (len(kept), kept.held) == (0, 0)


def test_a_value_that_grows_after_it_was_kept_leaves_the_bound_exact() -> None:
    """A parser's thinking list grows after it was kept: counted again as it was dropped, the
    bound's count fell below zero, and the store then held past its bound."""
    kept: KeptForThreads[list[str]] = KeptForThreads(10, lambda v: sum(map(len, v)))
    grown = ["aaaa"]
    kept.keep(("t", None), "c1", "f", grown)
    grown.append("x" * 1_000)
    kept.forget("t")
    assert (len(kept), kept.held) == (0, 0)
    # A value too large to keep drops what the call had kept: none is kept for it then.
    kept.keep(("t", None), "c1", "f", ["aaaa"])
    kept.keep(("t", None), "c1", "f", ["x" * 11])
    assert (len(kept), kept.held) == (0, 0)


def test_the_anthropic_parser_keeps_an_answers_whole_thinking_again_as_it_ends() -> None:
    kept: list[tuple[str, str | None, list[dict[str, Any]]]] = []
    parser = AnthropicStreamParser(keep_thinking=lambda call, name, blocks: kept.append(
        (call, name, blocks)))
    parser.feed(_anthropic_sse(
        {"type": "message_start", "message": {"usage": {"input_tokens": 1}}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "thinking", "thinking": "first", "signature": "s1"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2,
         "content_block": {"type": "thinking", "thinking": "after", "signature": "s2"}},
        {"type": "content_block_stop", "index": 2},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
        {"type": "message_stop"}))
    # As the call started (its thinking so far), then whole, so the store weighs it all;
    # each a copy: what was kept first never grows after the store weighed it (a stream
    # cut before its end kept the live list, counted at its first size).
    assert [(call, name, len(blocks)) for call, name, blocks in kept] == [
        ("toolu_1", "f", 1), ("toolu_1", "f", 2)]


def test_anthropics_kept_thinking_is_bounded_by_its_characters() -> None:
    """Counted in answers (1,024), answers of nearly the run's bound of unseen thinking each
    were kept after their runs: 288 MiB after six runs no client was shown."""
    adapter = AnthropicAdapter(api_key="k")
    block = {"type": "thinking", "thinking": "x" * 4_000_000, "signature": "s"}
    for i in range(10):
        adapter._thinking.keep((f"t{i}", None), "toolu_1", "f", [block])
    assert adapter._thinking.held <= 16_000_000
    assert len(adapter._thinking) == 3


def _anthropic_sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"event: " + str(e["type"]).encode() + b"\ndata: " + orjson.dumps(e)
                    + b"\n\n" for e in events)
