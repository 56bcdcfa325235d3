"""Guardrails and the approvals service's own answers.

The service resumes graphs on its own: with the timeout answer when an approval's deadline
passes, and, at recovery, with an answer recorded earlier that never reached the graph, or
that a graph took before its run died. Guardrails judge what clients write: the runtime's
timeout is not judged (it was: a judge call per timeout with a `TopicGuardrail`, and a
guardrail that refused it left the approval expired and never applied, retried for ever);
nor is carrying on a graph that took its answer already. An answer recorded but never
applied is judged when it is resent; a refused one is reopened, to be answered again, not
resent every 30 s (refused each time) while the approval answers 409 to any new answer.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from copilot_runtime import CopilotRuntime, PatternGuardrail
from copilot_runtime._input import parse_run_input
from copilot_runtime.approvals import timeout_answer
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.workflows.accounts import account_review
from tests.conftest import poll, run_input
from tests.test_approval_recovery import (
    ANSWER,
    THREAD,
    Payments,
    agent_of,
    asked,
    killed_in_pay,
    paying_runtime,
)
from tests.test_hostile_trust import DENIED, Recorder

pytestmark = pytest.mark.timeout(90)


async def _driven(runtime: CopilotRuntime, agent_id: str, body: dict[str, Any]) -> list[Any]:
    run = await runtime.start_run(agent_id, parse_run_input(body))
    events: list[Any] = []

    async def write(batch: Any) -> None:
        events.extend(batch)

    async with run:
        await run.drive(write)
    return events


async def test_the_runtimes_timeout_answer_is_not_judged(tmp_path: Path) -> None:
    """An approval whose deadline passes is resumed with the runtime's timeout answer,
    unjudged: before the fix a guardrail judged it (the recorder saw it), and one that
    refused it (here: its words) left the approval expired and never applied."""
    recorder = Recorder()
    saver = checkpointer(f"sqlite:///{tmp_path}/cp.sqlite3")
    runtime = CopilotRuntime(
        agents={"accounts": account_review(timeout_seconds=1).agent(
            name="accounts", checkpointer=saver)},
        guardrails=[recorder, PatternGuardrail(deny=[r"\bdeadline\b"])])
    try:
        events = await _driven(runtime, "accounts", run_input(
            "Review account GLOBEX-002", thread="late", protocolVersion="1.0"))
        assert events[-1]["outcome"]["type"] == "interrupt", events[-1]
        await runtime.start()
        async for _ in poll(20):
            expired = await runtime.approvals.list(status="expired")
            if expired and expired[0].applied and not runtime.is_running("late"):
                break
        assert expired, "the approval never expired"
        assert expired[0].applied, "the timeout answer was never applied"
        assert expired[0].answer["action"] == "timeout"
        assert expired[0].answered_by == "runtime"
    finally:
        await runtime.aclose()
    assert recorder.judged == ["Review account GLOBEX-002"]


async def test_a_recorded_answer_a_guardrail_refuses_is_reopened(tmp_path: Path) -> None:
    """An answer recorded and never applied (a crash before its run; guardrails set up
    since it was recorded) is judged as recovery resends it: refused, the approval is
    reopened, to be answered again. Before the fix it stayed answered, not applied: resent
    and refused at every recovery, and any new answer was refused 409."""
    payments = Payments()
    payments.gate.set()
    runtime = paying_runtime(f"sqlite:///{tmp_path}/cp.db", payments)
    runtime.guardrails = [PatternGuardrail(deny=[r"\bpassword\b"])]
    try:
        approval = await asked(runtime)
        agent = agent_of(runtime)
        assert await agent.approvals.claim(approval.id, "answered",
                                           {"action": "revise", "payload": DENIED}, "ann",
                                           time.time() - 60)
        await runtime.approvals._recover()
        settled = await agent.approvals.get(approval.id)
        assert settled is not None
        assert (settled.status, settled.answer) == ("pending", None)
        assert await agent.approvals.unapplied() == []
        assert not runtime.is_running(THREAD)
        result = await runtime.approvals.answer(approval.id, ANSWER, answered_by="ann")
        assert result["approval"]["status"] == "answered", result
        assert payments.done == [ANSWER]
    finally:
        await runtime.aclose()


async def test_a_timeout_answer_sent_again_is_not_judged(tmp_path: Path) -> None:
    """A timeout recorded and never applied (a crash before its run) is sent again by the
    recovery, unjudged: it is the runtime's own. Before the fix a guardrail that refused
    its words left it recorded and unapplied (and, judged as a person's answer, it would
    have been reopened)."""
    payments = Payments()
    payments.gate.set()
    runtime = paying_runtime(f"sqlite:///{tmp_path}/cp.db", payments)
    recorder = Recorder()
    try:
        approval = await asked(runtime)
        runtime.guardrails = [recorder, PatternGuardrail(deny=[r"\bdeadline\b"])]
        agent = agent_of(runtime)
        timeout = timeout_answer("2026-01-01T00:00:00Z")
        assert await agent.approvals.claim(approval.id, "expired", timeout, "runtime",
                                           time.time() - 60)
        await runtime.approvals._recover()
        async for _ in poll(20):
            settled = await agent.approvals.get(approval.id)
            if settled is not None and settled.applied and not runtime.is_running(THREAD):
                break
        assert settled is not None
        assert (settled.status, settled.applied) == ("expired", True)
        assert payments.done == [timeout]
    finally:
        await runtime.aclose()
    assert recorder.judged == []


async def test_carrying_on_a_graph_that_took_its_answer_is_not_judged(
        tmp_path: Path) -> None:
    """A graph that took an approval's answer and whose run died is carried on at the next
    start without judging that answer again (the graph has it already): before the fix the
    recorder saw it."""
    url = f"sqlite:///{tmp_path}/cp.db"
    approval = await killed_in_pay(url)
    recorder = Recorder()
    payments = Payments()
    payments.gate.set()
    runtime = paying_runtime(url, payments)
    runtime.guardrails = [recorder]
    try:
        await runtime.start()
        async for _ in poll(20):
            settled, _, _ = await runtime.approvals.get(approval.id)
            if settled.applied and not runtime.is_running(THREAD):
                break
        assert settled.applied, "the graph was never carried on"
        assert payments.done == [ANSWER]
    finally:
        await runtime.aclose()
    assert recorder.judged == []
