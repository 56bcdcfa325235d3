"""Chat suggestions of CopilotKit 1.75 (`POST agent/{id}/suggest`, the single-route
`agent/suggest`): a run as any other (forced `copilotkitSuggest` tool, guardrails, limits,
ownership), kept out of its thread: never stored, never holding the thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from structlog.testing import capture_logs

from copilot_runtime import (
    BearerTokenAuth,
    CopilotRuntime,
    PatternGuardrail,
    Principal,
    RateLimit,
    SQLiteThreadStore,
    Verdict,
    _runs,
)
from copilot_runtime import events as ev
from copilot_runtime._exceptions import ApprovalNotFoundError
from copilot_runtime._input import RunInput
from copilot_runtime._trust import AllowedMarks
from copilot_runtime.agents.base import EventBatches, RunContext
from copilot_runtime.agents.http import HttpAgent
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.agents.langgraph_platform import LangGraphPlatformAgent
from copilot_runtime.agents.remote_endpoint import RemoteEndpointAgent
from copilot_runtime.approvals.resume import record_interrupts
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.guardrails import Messages
from copilot_runtime.hooks import RunFinished
from copilot_runtime.runtime import approval_service
from copilot_runtime.testing import MockOpenAIServer, verify_events
from copilot_runtime.threads.base import SUGGESTION_THREAD_PREFIX
from copilot_runtime.workflows.review_loop import ReviewLoop
from tests.agents_support import graphs
from tests.conftest import (
    GatedAgent,
    Served,
    ServeRuntime,
    openai_runtime,
    parse_sse,
    poll,
    run_input,
    text_of,
    types,
)
from tests.hitl_support.postgres import postgres_schema
from tests.test_hitl_agui import Drafting

pytestmark = pytest.mark.asyncio

SUGGEST_TOOL: dict[str, Any] = {
    "name": "copilotkitSuggest", "description": "Suggest what the user could say next",
    "parameters": {"type": "object", "properties": {"suggestions": {"type": "array", "items": {
        "type": "object", "properties": {"title": {"type": "string"},
                                         "message": {"type": "string"}}}}}}}
FORCED = {"toolChoice": {"type": "function", "function": {"name": "copilotkitSuggest"}}}
SUGGESTIONS = {"suggestions": [{"title": "Weather", "message": "What is the weather in Paris?"}]}
ALICE, BOB = "tok-alice-0001", "tok-bob-00002"


def suggest_input(thread: str, history: list[dict[str, Any]] | None = None,
                  run: str = "sugg-run") -> dict[str, Any]:
    """What `@copilotkit/core` 1.75's `generateSuggestions()` sends: the chat's history, then
    its prompt (here with the mock's line for the forced call), one tool, the tool forced."""
    prompt = ("Suggest what the user could say next.\n"
              f"call:copilotkitSuggest {orjson.dumps(SUGGESTIONS).decode()}")
    return run_input("", thread=thread, run=run, tools=[SUGGEST_TOOL], forwardedProps=FORCED,
                     messages=[*(history or []), {"id": f"{run}-p", "role": "user",
                                                  "content": prompt}])


def suggested(events: list[dict[str, Any]]) -> Any:
    return orjson.loads("".join(e["delta"] for e in events if e["type"] == "TOOL_CALL_ARGS"))


async def test_info_advertises_suggestions(served: Served) -> None:
    assert (await (await served.session.get(served.url + "/info")).json())["suggestions"]
    single = await (await served.post("", {"method": "info"})).json()
    assert single["suggestions"] is True


async def test_suggest_streams_the_forced_call_and_stores_nothing(
        served: Served, llm: MockOpenAIServer) -> None:
    events = await served.run(suggest_input("sugg-thread"), path="/agent/default/suggest")
    verify_events(events)
    assert types(events) == ["RUN_STARTED", "TOOL_CALL_START", *["TOOL_CALL_ARGS"] * 5,
                             "TOOL_CALL_END", "RUN_FINISHED"]
    assert events[1]["toolCallName"] == "copilotkitSuggest"
    assert suggested(events) == SUGGESTIONS
    assert llm.requests[-1]["tool_choice"] == FORCED["toolChoice"]
    assert await served.runtime.store.get("sugg-thread") is None
    listed = await (await served.session.get(served.url + "/threads")).json()
    assert listed["threads"] == []


async def test_single_route_suggest(served: Served) -> None:
    response = await served.post("", {"method": "agent/suggest",
                                      "params": {"agentId": "default"},
                                      "body": suggest_input("single-sugg")})
    assert response.status == 200
    events = parse_sse(await response.read())
    assert suggested(events) == SUGGESTIONS
    assert await served.runtime.store.get("single-sugg") is None


async def test_suggest_for_an_unknown_agent_is_404(served: Served) -> None:
    response = await served.post("/agent/nobody/suggest", suggest_input("t"))
    assert response.status == 404
    single = await served.post("", {"method": "agent/suggest", "params": {"agentId": "nobody"},
                                    "body": suggest_input("t")})
    assert single.status == 404
    assert (await served.session.get(served.url + "/agent/default/suggest")).status == 405


async def test_suggest_on_the_chat_thread_leaves_its_history_and_slot_alone(
        served: Served) -> None:
    """A suggestion sent with the chat's own thread id (a client may) while the chat's run
    streams: no 409, and the thread keeps only the chat's runs."""
    await served.run(run_input("first question", thread="chat"))
    before = await (await served.session.get(served.url + "/threads/chat/messages")).json()
    slow = asyncio.create_task(served.run(run_input("slow:60 a b c d e", thread="chat",
                                                    run="run-2")))
    async for _ in poll():
        if "chat" in served.runtime.runs.active:
            break
    assert "chat" in served.runtime.runs.active
    history = [{"id": "run-1-u", "role": "user", "content": "first question"}]
    events = await served.run(suggest_input("chat", history), path="/agent/default/suggest")
    assert suggested(events) == SUGGESTIONS
    chat = await slow
    assert types(chat)[-1] == "RUN_FINISHED"
    after = await (await served.session.get(served.url + "/threads/chat/messages")).json()
    assert after["messages"][:len(before["messages"])] == before["messages"]
    assert [m["content"] for m in after["messages"] if m["role"] == "user"] == [
        "first question", "slow:60 a b c d e"]
    assert not any(m.get("toolCalls") for m in after["messages"])
    assert not served.runtime.runs.unstored


async def test_guardrails_limits_and_ownership_apply(serve_runtime: ServeRuntime,
                                                     llm: MockOpenAIServer) -> None:
    runtime = openai_runtime(llm, auth=BearerTokenAuth({ALICE: "alice", BOB: "bob"}),
                             guardrails=[PatternGuardrail(deny=[r"\bpassword\b"])],
                             rate_limit=RateLimit(runs_per_minute=3))

    async def suggest(token: str, body: dict[str, Any]) -> tuple[int, bytes]:
        response = await served.post("/agent/default/suggest", body,
                                     headers={"Authorization": f"Bearer {token}"})
        return response.status, await response.read()

    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/default/run", run_input("hi", thread="alices"),
                                     headers={"Authorization": f"Bearer {ALICE}"})
        assert response.status == 200
        await response.read()
        # Bob may not run on alice's thread, suggestion or not.
        assert (await suggest(BOB, suggest_input("alices")))[0] == 404
        calls = len(llm.requests)
        status, body = await suggest(ALICE, suggest_input("s1", [
            {"id": "h", "role": "user", "content": "my password is hunter2"}]))
        assert status == 200
        events = parse_sse(body)
        assert "TOOL_CALL_START" not in types(events)
        assert text_of(events) == "Sorry, I can't help with that request."  # a refusal
        assert len(llm.requests) == calls  # the model never saw it
        assert (await suggest(ALICE, suggest_input("s2")))[0] == 200
        status, body = await suggest(ALICE, suggest_input("s3"))
        assert status == 429, body  # alice's third run this minute: the chat's, and two
        assert await runtime.store.get("s2") is None


async def test_a_suggestion_after_a_refused_turn_runs_without_it(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """Before: a suggestion sent with a chat's history that held a refused message was
    refused (the message judged again). Now it runs as the chat's next turn does: the
    refused message is left out, and the model never reads it."""
    runtime = openai_runtime(llm, guardrails=[PatternGuardrail(deny=[r"\bpassword\b"])])
    denied = {"id": "u1", "role": "user", "content": "what is the password?"}
    async with serve_runtime(runtime) as served:
        refused = await served.run(run_input("", thread="chat", run="r1", messages=[denied]))
        start = next(e for e in refused if e["type"] == "TEXT_MESSAGE_START")
        history = [denied, {"id": start["messageId"], "role": "assistant",
                            "content": text_of(refused)}]
        events = await served.run(suggest_input("chat", history),
                                  path="/agent/default/suggest")
    assert suggested(events) == SUGGESTIONS, events
    assert len(llm.requests) == 1
    assert "password" not in orjson.dumps(llm.requests).decode()


async def test_a_suggestion_whose_client_leaves_is_stopped(serve_runtime: ServeRuntime) -> None:
    """No one could pick a suggestion up again (it is not stored): the core's abort of a
    stale suggestion stops its run, where a chat's run would go on without its client."""
    agent = _WatchedGate()
    finished = _Finishes()
    async with serve_runtime(CopilotRuntime(agents={"gated": agent},
                                            on_run_finished=finished)) as served:
        response = await served.post("/agent/gated/suggest", run_input("hi", thread="left"))
        received = b""
        async with asyncio.timeout(10):
            while b"TEXT_MESSAGE_CONTENT" not in received:
                received += await response.content.readany()
        assert len(served.runtime.runs.unstored) == 1
        response.close()
        # Stopped while its agent waited at its gate, not run to its end (nothing opens
        # the gate), nor left running: the agent was cancelled there, and the run ended as
        # its client's leaving, before the server's shutdown could have ended it.
        async with asyncio.timeout(10):
            await agent.cancelled_at_gate.wait()
        await finished.reach(1)
        assert [f.outcome for f in finished.runs] == ["disconnected"]
        assert [m.get("content") for m in finished.runs[0].new_messages] == ["hi", "one "]
        assert not served.runtime.runs.unstored
        assert await served.runtime.store.get("left") is None

class _Finishes:
    """An `on_run_finished` hook that keeps what it is told, and can be awaited."""

    def __init__(self) -> None:
        self.runs: list[RunFinished] = []
        self._more = asyncio.Event()

    def __call__(self, finished: RunFinished) -> None:
        self.runs.append(finished)
        self._more.set()

    async def reach(self, count: int) -> None:
        async with asyncio.timeout(10):
            while len(self.runs) < count:
                self._more.clear()
                await self._more.wait()


class _WatchedGate(GatedAgent):
    """A `GatedAgent` that says whether its run was cancelled while waiting at the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled_at_gate = asyncio.Event()

    async def _run(self, run_id: str) -> Any:
        try:
            async for batch in super()._run(run_id):
                yield batch
        except asyncio.CancelledError:
            if not self.gate.is_set():
                self.cancelled_at_gate.set()
            raise


class _CountingGuardrail(PatternGuardrail):
    """Refuses "password"; counts its judge calls."""

    def __init__(self) -> None:
        super().__init__(deny=[r"\bpassword\b"])
        self.calls = 0

    async def check(self, messages: Messages, principal: Principal | None) -> Verdict:
        self.calls += 1
        return await super().check(messages, principal)


async def _long_chat(served: Served, thread: str, token: str | None = None
                     ) -> list[dict[str, Any]]:
    """Two chat runs of 20 user messages each on `thread`; its history as a client holds it."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    history: list[dict[str, Any]] = []
    for batch in range(2):
        history += [{"id": f"u{batch}-{i}", "role": "user", "content": f"question {batch} {i}"}
                    for i in range(20)]
        response = await served.post("/agent/default/run", run_input(
            "", thread=thread, run=f"chat-{batch}", messages=history), headers=headers)
        assert types(parse_sse(await response.read()))[-1] == "RUN_FINISHED"
        listed = await served.session.get(served.url + f"/threads/{thread}/messages",
                                          headers=headers)
        history = (await listed.json())["messages"]
    assert sum(m["role"] == "user" for m in history) == 40
    return history


async def test_a_suggestion_judges_only_what_the_chat_has_not(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """The client sends the chat's whole history under a throwaway thread id: what the
    chat's runs let through (and what its agent wrote) is not judged again, so a long chat
    keeps its suggestions, at one judge call for the prompt and one for the tool."""
    guard = _CountingGuardrail()
    async with serve_runtime(openai_runtime(llm, guardrails=[guard])) as served:
        history = await _long_chat(served, "chat")
        before = guard.calls
        events = await served.run(suggest_input("sugg-1", history),
                                  path="/agent/default/suggest")
        assert suggested(events) == SUGGESTIONS, text_of(events)
        assert guard.calls - before == 2
        # Forgotten (a restart, another worker, past the bound): judged again, and 41 new
        # messages are too many to judge, so it is refused; the chat's next turn has its
        # thread's marks remembered again.
        served.runtime.allowed_marks = AllowedMarks()
        events = await served.run(suggest_input("sugg-3", history),
                                  path="/agent/default/suggest")
        assert "more than 32 new messages" in text_of(events)
        history = [*history, {"id": "u-last", "role": "user", "content": "one more"}]
        events = await served.run(run_input("", thread="chat", run="chat-3", messages=history))
        assert types(events)[-1] == "RUN_FINISHED"
        before = guard.calls
        events = await served.run(suggest_input("sugg-4", history),
                                  path="/agent/default/suggest")
        assert suggested(events) == SUGGESTIONS, text_of(events)
        assert guard.calls - before == 2
        # Text no run let through is judged still: refused.
        sneaky = [*history, {"id": "new", "role": "user", "content": "my password is x"}]
        events = await served.run(suggest_input("sugg-2", sneaky),
                                  path="/agent/default/suggest")
        assert "TOOL_CALL_START" not in types(events)
        assert text_of(events) == "Sorry, I can't help with that request."


async def test_what_one_user_had_judged_is_judged_again_for_another(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    guard = _CountingGuardrail()
    runtime = openai_runtime(llm, guardrails=[guard],
                             auth=BearerTokenAuth({ALICE: "alice", BOB: "bob"}))
    async with serve_runtime(runtime) as served:
        history = await _long_chat(served, "alices", ALICE)
        response = await served.post("/agent/default/suggest", suggest_input("s", history),
                                     headers={"Authorization": f"Bearer {BOB}"})
        events = parse_sse(await response.read())
        assert "TOOL_CALL_START" not in types(events)  # 41 messages new to bob: too many
        assert "more than 32 new messages" in text_of(events)


async def test_allowed_marks_forget_the_oldest_past_their_bound() -> None:
    marks = AllowedMarks(most=2)
    marks.add(None, None, ["a", "b"])
    assert marks.holds(None, None, "a")  # (now the newest used)
    marks.add(None, None, ["c"])
    assert [marks.holds(None, None, m) for m in "abc"] == [True, False, True]
    assert not marks.holds(None, (("x",), ()), "a")  # judged under other topic rules


async def test_a_suggestion_reports_its_messages_and_says_it_is_one(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    finished = _Finishes()
    async with serve_runtime(openai_runtime(llm, on_run_finished=finished)) as served:
        await served.run(run_input("hello", thread="chat"))
        await served.run(suggest_input("sugg"), path="/agent/default/suggest")
        await finished.reach(2)
    chat, suggestion = finished.runs
    assert (chat.suggestion, suggestion.suggestion) == (False, True)
    assert [m["role"] for m in chat.new_messages] == ["user", "assistant"]
    assert [m["role"] for m in suggestion.new_messages] == ["user", "assistant"]
    call = suggestion.new_messages[-1]["toolCalls"][0]["function"]
    assert call["name"] == "copilotkitSuggest"
    assert orjson.loads(call["arguments"]) == SUGGESTIONS


# -- agents that keep their own threads (LangGraph checkpoints) ---------------------------


async def _checkpointed_threads(saver: Any) -> set[str]:
    """The thread ids a LangGraph checkpointer holds checkpoints of."""
    return {c.config["configurable"]["thread_id"] async for c in saver.alist(None)}


def _authorized(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_a_suggestion_never_touches_a_langgraph_thread(
        serve_runtime: ServeRuntime, llm: MockOpenAIServer) -> None:
    """The graph runs a suggestion on a throwaway thread it forgets at the run's end: the
    chat's thread keeps only the chat's turns, and an id suggested on before its first
    message stays free for its owner."""
    async with httpx.AsyncClient() as client:
        graph = graphs.chat_graph(llm.base_url, client)
        runtime = CopilotRuntime(agents={"lg": LangGraphAgent(name="lg", graph=graph)},
                                 auth=BearerTokenAuth({ALICE: "alice"}))
        async with serve_runtime(runtime) as served:
            async def post(path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
                response = await served.post(path, body, headers=_authorized(ALICE))
                assert response.status == 200, await response.text()
                return parse_sse(await response.read())

            events = await post("/agent/lg/suggest", run_input("Suggest", thread="chat-new",
                                                               run="s1"))
            # What the client hears is of the thread it named.
            assert {e["threadId"] for e in events if "threadId" in e} == {"chat-new"}
            events = await post("/agent/lg/run", run_input("Hello", thread="chat-new"))
            assert types(events)[-1] == "RUN_FINISHED"

            await post("/agent/lg/run", run_input("Hello there", thread="chat-1", run="r1"))
            history = [{"id": "r1-u", "role": "user", "content": "Hello there"}]
            await post("/agent/lg/suggest", run_input("", thread="chat-1", run="s2", messages=[
                *history, {"id": "s2-p", "role": "user", "content": "SUGGESTION-PROMPT"}]))
            kept = await runtime.agent("lg").load_state("chat-1")
            assert kept is not None
            assert [m.get("content") for m in kept.messages] == [
                "Hello there", "echo: Hello there"]
            await post("/agent/lg/run", run_input("", thread="chat-1", run="r3", messages=[
                *history, {"id": "r3-u", "role": "user", "content": "Next question"}]))
            assert [m.get("content") for m in llm.requests[-1]["messages"]] == [
                "Hello there", "echo: Hello there", "Next question"]
            assert await _checkpointed_threads(graph.checkpointer) == {"chat-new", "chat-1"}


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def checkpoints_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "postgresql":
        with postgres_schema() as url:
            yield url
    else:
        yield "memory" if request.param == "memory" else f"sqlite:///{tmp_path}/cp.sqlite3"


async def test_a_suggestion_claims_no_thread_of_a_checkpointed_workflow(
        serve_runtime: ServeRuntime, tmp_path: Path, checkpoints_url: str) -> None:
    """A ReviewLoop asks for approval on its first run: a suggestion that reaches that
    interrupt leaves no approval nor checkpoint behind, and its thread id to whoever runs
    on it first (before, bob's suggestion made alice's next thread nobody's)."""
    saver = checkpointer(checkpoints_url)
    loop = ReviewLoop([Drafting(name) for name in ("Invoice", "Closing")])
    runtime = CopilotRuntime(
        agents={"review": loop.agent(name="review", checkpointer=saver)},
        thread_store=SQLiteThreadStore(tmp_path / "threads.sqlite3"),
        auth=BearerTokenAuth({ALICE: "alice", BOB: "bob"}))
    async with serve_runtime(runtime) as served:
        async def post(token: str, path: str, thread: str) -> list[dict[str, Any]]:
            response = await served.post(path, run_input("Prepare the invoice", thread=thread),
                                         headers=_authorized(token))
            assert response.status == 200, await response.text()
            return parse_sse(await response.read())

        try:
            events = await post(ALICE, "/agent/review/suggest", "fresh-1")
            assert any(e["type"] == "CUSTOM" and e["name"] == "on_interrupt" for e in events)
            assert await runtime.store.summary("fresh-1") is None
            assert types(await post(ALICE, "/agent/review/run", "fresh-1"))[-1] == \
                "RUN_FINISHED"
            await post(BOB, "/agent/review/suggest", "fresh-3")
            assert types(await post(ALICE, "/agent/review/run", "fresh-3"))[-1] == \
                "RUN_FINISHED"
            approvals = await approval_service(runtime).list(status=None)
            assert sorted(a.thread_id for a in approvals) == ["fresh-1", "fresh-3"]
            assert await _checkpointed_threads(saver) == {"fresh-1", "fresh-3"}
        finally:
            await approval_service(runtime).aclose()
            await saver.aclose()


# -- the throwaway thread's leftovers -----------------------------------------------------


def _review_runtime(tmp_path: Path, saver: Any) -> CopilotRuntime:
    loop = ReviewLoop([Drafting(name) for name in ("Invoice", "Closing")])
    return CopilotRuntime(agents={"review": loop.agent(name="review", checkpointer=saver)},
                          thread_store=SQLiteThreadStore(tmp_path / "threads.sqlite3"))


class _NoDeleteSaver(InMemorySaver):
    """A checkpointer that cannot delete threads (LangGraph's base raises)."""

    adelete_thread = BaseCheckpointSaver.adelete_thread  # type: ignore[assignment]


async def _hanging_delete(thread_id: str) -> None:
    await asyncio.Event().wait()


async def _failing_delete(thread_id: str) -> None:
    raise ConnectionError("checkpoint store down")


@pytest.mark.parametrize("delete", ["unsupported", "raises", "hangs"])
async def test_a_suggestions_approval_goes_even_when_its_checkpoints_cannot(
        serve_runtime: ServeRuntime, tmp_path: Path, delete: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The approvals of a suggestion's interrupt are forgotten whether or not its
    checkpointer deletes the throwaway thread (before, a delete that raised or hung left
    one pending, listed and answerable: answering ran a stored 'copilot-suggestion-' thread);
    a checkpointer that cannot delete is skipped without an error logged."""
    monkeypatch.setattr(_runs, "FORGET_WAIT", 0.2, raising=False)
    monkeypatch.setattr(_runs, "SHUTDOWN_STORE_WAIT", 0.2)
    runtime = _review_runtime(tmp_path, _NoDeleteSaver() if delete == "unsupported"
                              else checkpointer("memory"))
    saver = runtime.agent("review").graph.checkpointer
    if delete != "unsupported":
        monkeypatch.setattr(saver, "adelete_thread",
                            _hanging_delete if delete == "hangs" else _failing_delete)
    async with serve_runtime(runtime) as served:
        with capture_logs() as logs:
            response = await served.post("/agent/review/suggest", run_input(
                "Prepare the invoice", thread="fresh-1"))
            events = parse_sse(await response.read())
            assert types(events)[-1] == "RUN_FINISHED"
            async for _ in poll(within=5):
                if not await approval_service(runtime).list(status=None) and not [
                        a for a in await runtime.agent("review").approvals.find()]:
                    break
        listed = await served.session.get(served.url + "/approvals")
        assert (await listed.json())["approvals"] == []
        assert not [e for e in logs if e["log_level"] == "error"]  # no stack, ever
        if delete == "unsupported":  # nothing to tell: deleting is optional to LangGraph
            assert not [e for e in logs if "forget" in e["event"]]


async def test_no_approval_of_a_suggestions_thread_is_listed_nor_answered(
        serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    """Even in the moment before its suggestion's end forgets it, an approval filed on a
    throwaway thread is nobody's: not listed, not found to answer."""
    runtime = _review_runtime(tmp_path, checkpointer("memory"))
    ledger = runtime.agent("review").approvals
    await ledger.add(record_interrupts(
        [{"id": "i-1", "value": {"question": "ok?"}}],
        thread_id=f"{SUGGESTION_THREAD_PREFIX}abc", agent_id="review", channel="outcome"))
    filed = [a.id for a in await ledger.find()]  # as a run in flight would have
    assert filed
    async with serve_runtime(runtime) as served:
        assert await approval_service(runtime).list(status=None) == []
        listed = await served.session.get(served.url + "/approvals?status=all")
        assert (await listed.json())["approvals"] == [], await listed.text()
        answered = await served.post(f"/approvals/{filed[0]}", {"action": "approve"})
        assert answered.status == 404, await answered.text()
        with pytest.raises(ApprovalNotFoundError):
            await approval_service(runtime).answer(filed[0], {"action": "approve"})


async def test_hidden_approvals_of_suggestions_do_not_end_a_listing_early(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page's read of the ledgers said "nothing left" when the rows it got, less the
    suggestions' it hid, were fewer than it asked for: the approvals after them were never
    listed (50 of 300 in a reviewer's run)."""
    import copilot_runtime.approvals.service as service

    monkeypatch.setattr(service, "_BATCH", 1)  # (each read asks for limit + 1 rows)
    runtime = _review_runtime(tmp_path, checkpointer("memory"))
    ledger = runtime.agent("review").approvals
    for index, thread in enumerate([f"{SUGGESTION_THREAD_PREFIX}a", f"{SUGGESTION_THREAD_PREFIX}b",
                                    "t1", "t2", "t3", "t4", "t5"]):
        await ledger.add(record_interrupts(
            [{"id": f"i-{index}", "value": {"question": "ok?"}}], thread_id=thread,
            agent_id="review", channel="outcome"))
    listed: list[str] = []
    after = None
    for _ in range(10):
        page, after = await approval_service(runtime).page(status=None, limit=3, after=after)
        listed += [approval.thread_id for approval in page]
        if after is None:
            break
    assert listed == ["t1", "t2", "t3", "t4", "t5"]


@pytest.mark.parametrize("resume", [
    {"forwardedProps": {"command": {"resume": "approve", "interruptEvent": "x"}}},
    {"resume": [{"interruptId": "abc", "status": "resolved", "payload": {"action": "approve"}}]},
])
async def test_a_suggestion_refuses_a_resume_naming_nothing_internal(
        serve_runtime: ServeRuntime, tmp_path: Path, resume: dict[str, Any]) -> None:
    """A suggestion answers no interrupt: a resume is refused before its run starts (before,
    its agent's refusal quoted the throwaway thread's id)."""
    runtime = _review_runtime(tmp_path, checkpointer("memory"))
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/review/suggest", {
            **run_input("Prepare the invoice", thread="fresh-5"), **resume})
        body = await response.read()
        assert response.status == 400, body
        assert b"suggestion" in body
        assert SUGGESTION_THREAD_PREFIX.encode() not in body


async def test_no_event_of_a_suggestion_names_its_throwaway_thread(
        serve_runtime: ServeRuntime, tmp_path: Path) -> None:
    runtime = _review_runtime(tmp_path, checkpointer("memory"))
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/review/suggest", run_input(
            "Prepare the invoice", thread="fresh-6"))
        body = await response.read()
        assert "on_interrupt" in [e.get("name") for e in parse_sse(body)]
        assert SUGGESTION_THREAD_PREFIX.encode() not in body


class _RecordingHttpAgent(HttpAgent):
    """An HttpAgent whose upstream is this test: what thread it was run on, and forgot."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9/agent")
        self.ran_on: list[str] = []
        self.forgotten: list[str] = []

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        self.ran_on.append(input.thread_id)
        return self._answer(input)

    async def _answer(self, input: RunInput) -> EventBatches:
        yield [ev.run_started(input.thread_id, input.run_id),
               ev.run_finished(input.thread_id, input.run_id)]

    async def forget_thread(self, thread_id: str) -> None:
        self.forgotten.append(thread_id)


async def test_a_remote_agent_runs_a_suggestion_on_the_thread_sent(
        serve_runtime: ServeRuntime) -> None:
    """An agent whose threads live upstream gets the client's thread id, as on the
    TypeScript runtime (the client sends a fresh one per suggestion), and is asked to forget
    nothing (before: a throwaway id upstream per suggestion, never deleted there)."""
    agent = _RecordingHttpAgent()
    runtime = CopilotRuntime(agents={"remote": agent})
    async with serve_runtime(runtime) as served:
        response = await served.post("/agent/remote/suggest", run_input("Hi", thread="s-9"))
        assert types(parse_sse(await response.read()))[-1] == "RUN_FINISHED"
    assert agent.ran_on == ["s-9"]
    assert agent.forgotten == []
    assert not any(kind.keeps_threads_here for kind in (
        HttpAgent, RemoteEndpointAgent, LangGraphPlatformAgent))
    assert LangGraphAgent.keeps_threads_here


async def test_a_slow_forget_holds_neither_the_suggestion_nor_shutdown(
        serve_runtime: ServeRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpointer that does not answer the delete: the client hears the suggestion's end
    within `FORGET_WAIT` (before: 10 s), and a shutdown meanwhile waits for the forget for
    `SHUTDOWN_STORE_WAIT` (before: the whole grace)."""
    monkeypatch.setattr(_runs, "FORGET_WAIT", 0.3, raising=False)
    monkeypatch.setattr(_runs, "SHUTDOWN_STORE_WAIT", 0.3)
    runtime = _review_runtime(tmp_path, checkpointer("memory"))
    saver = runtime.agent("review").graph.checkpointer
    deleting = asyncio.Event()

    async def hanging(thread_id: str) -> None:
        deleting.set()
        await asyncio.Event().wait()
    monkeypatch.setattr(saver, "adelete_thread", hanging)
    async with serve_runtime(runtime) as served:
        started = time.monotonic()
        response = await served.post("/agent/review/suggest", run_input(
            "Prepare the invoice", thread="fresh-7"))
        assert types(parse_sse(await response.read()))[-1] == "RUN_FINISHED"
        assert time.monotonic() - started < 1.5
        # A second suggestion, shut down while its end waits for the delete.
        deleting.clear()
        second = asyncio.ensure_future(served.post("/agent/review/suggest", run_input(
            "Prepare the invoice", thread="fresh-8", run="run-2")))
        await deleting.wait()
        started = time.monotonic()
        await runtime.aclose()
        assert time.monotonic() - started < 1.5
        await (await second).read()
