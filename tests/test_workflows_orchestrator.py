"""The orchestrator (`workflows.orchestrator`): steps over a shared state, required and
optional failures, the approval with its timeout, and the wrapper for existing agents."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from copilot_runtime._input import parse_run_input
from copilot_runtime.agents.base import RunContext
from copilot_runtime.testing import verify_events
from copilot_runtime.workflows.accounts import DEMO_ACCOUNTS, account_review
from copilot_runtime.workflows.existing import (
    AgentExecutionError,
    existing_agent,
    run_existing_agent,
    wrap_existing_agent,
)
from copilot_runtime.workflows.orchestrator import ApprovalPolicy, Orchestrator, Step

Event = dict[str, Any]


class Scripted:
    """An existing agent: records its contexts, then completes, fails or raises."""

    def __init__(self, name: str, output: Any = None, *, error: str | None = None,
                 raises: bool = False, approval: dict[str, Any] | None = None) -> None:
        self.name, self.output, self.error, self.raises = name, output, error, raises
        self.approval = approval
        self.contexts: list[dict[str, Any]] = []

    async def execute_with_events(self, context: dict[str, Any]) -> AsyncIterator[Event]:
        self.contexts.append(dict(context))
        yield {"event": "agent_started", "data": {"agent": self.name}}
        if self.raises:
            raise ConnectionError("upstream at 10.0.0.7 refused")
        if self.error:
            yield {"event": "agent_error", "data": {"error_message": self.error}}
            return
        if self.approval is not None:
            yield {"event": "approval_required", "data": self.approval}
        yield {"event": "agent_completed", "data": {"output": self.output}}


def run(graph: Any, thread: str, *answers: Any, message: str = "Review ACME-001"
        ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start the graph, answer its interrupts in turn; its final state and the requests."""
    config = {"configurable": {"thread_id": thread}}

    async def go() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        result = await graph.ainvoke({"messages": [HumanMessage(content=message)]}, config)
        requests: list[dict[str, Any]] = []
        pending = list(answers)
        while "__interrupt__" in result:
            requests.append(result["__interrupt__"][0].value)
            if not pending:
                break
            result = await graph.ainvoke(Command(resume=pending.pop(0)), config)
        return dict((await graph.aget_state(config)).values), requests

    return asyncio.run(go())


def three_steps(optional_fails: bool = False, required_fails: bool = False
                ) -> tuple[Orchestrator, list[Scripted]]:
    agents = [Scripted("scout", {"summary": "found", "size": 3}),
              Scripted("analyst", None, error="memory store offline")
              if optional_fails else Scripted("analyst", {"trend": "up"}),
              Scripted("author", None, raises=True) if required_fails
              else Scripted("author", [{"action_type": "call"}, {"action_type": "mail"}])]
    steps = [Step("scout", agents[0], ("account_id", "session_id"), "snapshot"),
             Step("analyst", agents[1], ("account_id", "snapshot"), "history",
                  required=not optional_fails),
             Step("author", agents[2], ("snapshot", "history"), "recommendations")]
    return Orchestrator(steps, approval=ApprovalPolicy(timeout_seconds=30)), agents


def test_steps_read_their_inputs_and_write_their_output() -> None:
    orchestrator, agents = three_steps()
    state, requests = run(orchestrator.compile(InMemorySaver()), "t1",
                          {"action": "approve", "userId": "ann"})
    assert agents[0].contexts == [{"account_id": "ACME-001", "session_id": "t1", "step": 1}]
    assert agents[1].contexts[0] == {"account_id": "ACME-001", "step": 2, "session_id": "t1",
                                     "snapshot": {"summary": "found", "size": 3}}
    assert agents[2].contexts[0]["history"] == {"trend": "up"}
    result = state["result"]
    assert result["status"] == "completed"
    assert result["agents_completed"] == ["scout", "analyst", "author"]
    assert result["results"]["recommendations"] == [{"action_type": "call"},
                                                    {"action_type": "mail"}]
    assert result["approval"]["status"] == "approved"
    assert result["approval"]["approved_by"] == "ann"
    assert requests[0]["recommendation"] == {"action_type": "call"}
    assert requests[0]["timeout_seconds"] == 30
    assert requests[0]["expiresAt"].endswith("Z")


def test_a_failing_optional_step_is_logged_and_the_run_goes_on() -> None:
    orchestrator, agents = three_steps(optional_fails=True)
    state, _ = run(orchestrator.compile(InMemorySaver()), "t2", "reject")
    result = state["result"]
    assert result["status"] == "completed"
    assert result["agents_completed"] == ["scout", "author"]
    assert result["errors"] == [{"agent": "analyst", "error": "memory store offline",
                                 "critical": False}]
    assert result["approval"]["status"] == "rejected"
    assert agents[2].contexts[0]["history"] is None


def test_a_failing_required_step_stops_with_partial_results() -> None:
    orchestrator, _ = three_steps(required_fails=True)
    state, requests = run(orchestrator.compile(InMemorySaver()), "t3")
    assert requests == []  # nothing to approve
    result = state["result"]
    assert result["status"] == "error"
    assert result["message"] == "Critical agent author failed"
    assert result["error"] == "author failed (ConnectionError)"  # not the exception's text
    assert result["partial_results"]["snapshot"] == {"summary": "found", "size": 3}
    assert result["partial_results"]["agents_completed"] == ["scout", "analyst"]


def test_the_approval_can_time_out_be_revised_and_asked_again() -> None:
    orchestrator, agents = three_steps()
    state, requests = run(orchestrator.compile(InMemorySaver()), "t4",
                          {"action": "revise", "payload": "shorter"}, 17,
                          {"action": "timeout", "reason": "Nobody answered"})
    assert len(requests) == 3
    assert agents[2].contexts[1]["feedback"] == "shorter"  # the author ran again
    assert requests[2]["message"].startswith("That answer was neither")
    result = state["result"]
    assert result["approval"]["status"] == "timeout"
    assert result["approval"]["reason"] == "Nobody answered"
    assert result["agents_completed"] == ["scout", "analyst", "author"]


def test_nothing_to_approve_skips_the_approval() -> None:
    agent = Scripted("author", [])
    orchestrator = Orchestrator([Step("author", agent, (), "recommendations")],
                                approval=ApprovalPolicy())
    state, requests = run(orchestrator.compile(InMemorySaver()), "t5")
    assert requests == []
    assert state["result"]["approval"] is None


def test_the_account_review_example_on_demo_data() -> None:
    graph = account_review(timeout_seconds=300).compile(InMemorySaver())
    state, requests = run(graph, "acme", "OK")
    snapshot = state["result"]["results"]["account_snapshot"]
    assert snapshot["name"] == DEMO_ACCOUNTS["ACME-001"]["name"]
    assert state["result"]["results"]["historical_context"]["trend"] == "declining"
    first = requests[0]["recommendation"]
    assert first["action_type"] == "executive_outreach"
    assert first["priority"] == "high"
    assert state["result"]["approval"]["status"] == "approved"
    unknown, requests = run(graph, "nope", message="Review NOPE-404")
    assert unknown["result"]["status"] == "error"
    assert "No account 'NOPE-404'" in unknown["result"]["error"]


def test_run_existing_agent() -> None:
    async def go() -> None:
        done = await run_existing_agent(Scripted("a", 5), "a", {})
        assert done.output == 5
        assert [e["event"] for e in done.events] == ["agent_started", "agent_completed"]
        with pytest.raises(AgentExecutionError, match="boom"):
            await run_existing_agent(Scripted("a", error="boom"), "a", {})

        class Silent:
            async def execute_with_events(self, context: dict[str, Any]
                                          ) -> AsyncIterator[Event]:
                yield {"event": "agent_started", "data": {}}

        with pytest.raises(AgentExecutionError, match="ended without a result"):
            await run_existing_agent(Silent(), "silent", {})

    asyncio.run(go())


def test_the_wrapper_runs_the_agent_then_its_approval() -> None:
    agent = Scripted("writer", {"summary": "draft ready"}, approval={"draft": "v1"})
    graph = wrap_existing_agent(agent, "writer", approval_timeout_seconds=5).compile(
        checkpointer=InMemorySaver())
    state, requests = run(graph, "w1", {"action": "approve", "userId": "bo"},
                          message="write it")
    assert agent.contexts[0]["user_message"] == "write it"
    assert state["agent_outputs"] == {"writer": {"summary": "draft ready"}}
    assert state["approval_required"] is True
    assert requests[0]["data"] == {"draft": "v1"}
    assert requests[0]["timeout_seconds"] == 5
    assert state["approval_response"]["status"] == "approved"
    assert state["approval_response"]["approved_by"] == "bo"
    assert [m.content for m in state["messages"]][1:] == ["draft ready", "Approval approved."]

    failing = wrap_existing_agent(Scripted("w", error="quota exceeded"), "w").compile(
        checkpointer=InMemorySaver())
    state, requests = run(failing, "w2")
    assert requests == []
    assert state["error"] == "quota exceeded"


def test_an_agents_error_words_are_passed_on_without_its_secrets() -> None:
    """An agent's `error_message` is its own words, passed on as a provider's are: a key it
    quotes is blanked, and a crash report with its source paths is withheld."""
    async def go() -> list[str]:
        said = []
        for error in ("quota exceeded for key sk-live-4f9a8b7c6d5e",
                      'Traceback (most recent call last):\n  File "/srv/app/agent.py", line 3'):
            with pytest.raises(AgentExecutionError) as raised:
                await run_existing_agent(Scripted("a", error=error), "a", {})
            said.append(raised.value.message)
        return said

    keyed, crashed = asyncio.run(go())
    assert keyed == "quota exceeded for key [REDACTED]"
    assert "/srv/app" not in crashed
    assert "Traceback" not in crashed


async def test_the_wrapped_agent_streams_its_events_as_custom_events() -> None:
    agent = existing_agent(Scripted("writer", {"summary": "draft ready"}), name="writer",
                           checkpointer=InMemorySaver())
    body = {"threadId": "w", "runId": "r1", "state": {}, "tools": [], "context": [],
            "forwardedProps": {}, "messages": [{"id": "u", "role": "user", "content": "go"}]}
    events = [e async for batch in agent.run(parse_run_input(body), RunContext("writer"))
              for e in batch]
    verify_events([{"type": "RUN_STARTED", "threadId": "w", "runId": "r1"}, *events[1:]])
    custom = [(e["name"], e["value"].get("agent")) for e in events if e["type"] == "CUSTOM"]
    assert ("agent_started", "writer") in custom
    assert ("agent_completed", "writer") in custom
    texts = [e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT"]
    assert texts == ["draft ready"]


async def run_account_review(thread: str, text: str, **fields: Any) -> list[Event]:
    """One AG-UI run of the account review, as a client sends it."""
    agent = account_review(timeout_seconds=None).agent(name="accounts",
                                                       checkpointer=InMemorySaver())
    body = {"threadId": thread, "runId": "r1", "state": {}, "tools": [], "context": [],
            "forwardedProps": {}, "messages": [{"id": "u", "role": "user", "content": text}],
            "protocolVersion": "1.0", **fields}
    return [e async for batch in agent.run(parse_run_input(body), RunContext("accounts"))
            for e in batch]


@pytest.mark.parametrize(("where", "key"), [("state", "account_id"),
                                            ("forwardedProps", "account_id"),
                                            ("forwardedProps", "accountId")])
async def test_the_account_id_may_come_from_the_clients_state(where: str, key: str) -> None:
    # The rest of the orchestrator's state is its own: where the steps start, what they share.
    given = {key: "GLOBEX-002", "next_step": 2, "shared": {"account_id": "ACME-001"}}
    events = await run_account_review("given", "Review this account please",
                                      **{where: given})
    (asked,) = events[-1]["outcome"]["interrupts"]
    request = asked["metadata"]["langgraph"]["raw"]
    assert request["recommendation"]["account_id"] == "GLOBEX-002"
    assert [e["stepName"] for e in events if e["type"] == "STEP_STARTED"][:2] == [
        "start", "zoho_scout"]


@pytest.mark.parametrize("given", [None, "", "   ", "A" * 65, ["GLOBEX-002"], 7], ids=repr)
async def test_no_account_id_is_said_so(given: Any) -> None:
    events = await run_account_review("none", "Review this account please",
                                      state={"account_id": given})
    said = "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")
    assert "No account id in the message (demo accounts: ACME-001, " in said
    assert "None" not in said
