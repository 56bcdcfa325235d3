"""The human-in-the-loop workflows driven by the real npm clients, end to end.

`tests/js/drive_hitl.mjs` runs `CopilotKitCore` (`@copilotkit/core` 1.75 with
`@ag-ui/client` 0.0.59: interrupts as the `on_interrupt` custom event, answered through
`forwardedProps.command.resume` as react-core's `useInterrupt` does) and `@ag-ui/client`
1.0 (the interrupt outcome, answered with `resume`) against our server, a child process
(`tests/hitl_support/app.py`) with its threads and checkpoints in SQLite files, or its
checkpoints in PostgreSQL. The offline specialist model writes every call to a log, which
tells a repeated call. A server is killed with SIGKILL while an approval waits and
restarted on the same database.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from copilot_runtime.testing import verify_events
from tests.hitl_support.counting import calls
from tests.hitl_support.driver import drive
from tests.hitl_support.postgres import postgres_schema
from tests.hitl_support.server import Server, sqlite_server, task_for

APPROVE = {"legacy": {"approved": True}, "v1": {"action": "approve"}}
CLIENTS = ["legacy", "v1"]


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    with sqlite_server(tmp_path_factory.mktemp("hitl-real-client")) as running:
        yield running


def check_step(step: dict[str, Any], client: str, *, interrupted: bool) -> None:
    """The client accepted the run, and heard of its interrupt in its own form."""
    verify_events(step["events"])
    custom = [e for e in step["events"] if e["type"] == "CUSTOM" and e["name"] == "on_interrupt"]
    finished = step["events"][-1]
    assert finished["type"] == "RUN_FINISHED"
    if client == "legacy":
        assert "outcome" not in finished
        assert len(custom) == int(interrupted)
        assert step["pendingInterrupts"] == []
    else:
        assert custom == []
        assert ("outcome" in finished) == interrupted
        assert len(step["pendingInterrupts"]) == int(interrupted)
    assert (step["interrupt"] is not None) == interrupted
    assert step.get("errors", []) == []


def request_of(step: dict[str, Any], client: str) -> dict[str, Any]:
    """The clarification request, as the client's UI would read it."""
    interrupt = step["interrupt"]
    value = interrupt if client == "legacy" else interrupt["metadata"]["langgraph"]["raw"]
    assert value["type"] == "user_clarification_request"
    return dict(value)


def contents(step: dict[str, Any]) -> list[str]:
    return [m.get("content") or "" for m in step["messages"] if m["role"] == "assistant"]


@pytest.mark.parametrize("client", CLIENTS)
def test_approve_at_once(running: tuple[Server, Path], client: str) -> None:
    served, log = running
    task = task_for(client)
    result = drive("converse", served.url, client=client, task=task, answers=[APPROVE[client]])
    assert result["coreErrors"] == []
    first, done = result["steps"]
    check_step(first, client, interrupted=True)
    request = request_of(first, client)
    assert request["data"]["agent"] == "Invoice"
    assert request["data"]["agent_result"].startswith("(Offline demo model) Invoice "
                                                      "specialist, draft 1")
    assert contents(first)[-1] == request["data"]["agent_result"]
    check_step(done, client, interrupted=False)
    assert done["state"]["status"] == "completed"
    assert contents(done)[-1] == "Approved: the Invoice specialist's result is final."
    assert [c["iteration"] for c in calls(log, task)] == ["1"]


@pytest.mark.parametrize("client", CLIENTS)
def test_revise_three_times_then_approve(running: tuple[Server, Path], client: str) -> None:
    served, log = running
    task = task_for(client)
    revisions = ["add VAT", "net 30 payment terms", "split the consulting line"]
    answers: list[Any] = ([{"approved": False, "answer": r} for r in revisions]
                          if client == "legacy"
                          else [{"action": "revise", "payload": r} for r in revisions])
    result = drive("converse", served.url, client=client, task=task,
                   answers=[*answers, APPROVE[client]])
    steps = result["steps"]
    assert len(steps) == 5
    for step in steps[:4]:
        check_step(step, client, interrupted=True)
    check_step(steps[4], client, interrupted=False)
    requests = [request_of(s, client) for s in steps[:4]]
    assert [r["data"]["iteration"] for r in requests] == [1, 2, 3, 4]
    for revision, request in zip(revisions, requests[1:], strict=True):
        assert request["data"]["agent_result"].endswith(f'Revised as asked: "{revision}".')
    final = steps[4]["state"]
    assert final["task"] == task
    assert [e["user_feedback"] for e in final["history"] if e["agent"] == "HITL"] == [
        *revisions, "approve"]
    assert final["status"] == "completed"
    made = calls(log, task)
    assert [(c["specialist"], c["iteration"], c["revision"]) for c in made] == [
        ("Invoice", "1", None), *[("Invoice", str(i + 2), r) for i, r in enumerate(revisions)]]
    # each revision saw the original task and everything before it
    assert all(f"Task: {task}" in c["prompt"] for c in made)
    assert "- iteration 3, HITL: split the consulting line" in made[-1]["prompt"]
    assert "- iteration 1, HITL: add VAT" in made[-1]["prompt"]


def test_review_switched_off(running: tuple[Server, Path]) -> None:
    served, log = running
    task = task_for("no-review")
    result = drive("converse", served.url, client="legacy", task=task, state={"review": False})
    (step,) = result["steps"]
    check_step(step, "legacy", interrupted=False)
    assert step["state"]["status"] == "completed"
    assert contents(step)[-1] == ("Done: the Invoice specialist's result is final "
                                  "(review was off).")
    assert len(calls(log, task)) == 1
    assert served.request("GET", f"/approvals?threadId={result['threadId']}") == (
        200, {"approvals": [], "nextCursor": None})


def test_an_approval_times_out(running: tuple[Server, Path]) -> None:
    served, _ = running
    result = drive("start", served.url, client="v1", agentId="account_review",
                   task="Review account INITECH-003")
    (step,) = result["steps"]
    check_step(step, "v1", interrupted=True)
    interrupt = step["interrupt"]
    assert interrupt["reason"] == "approval"
    assert interrupt["expiresAt"].endswith("Z")
    thread = result["threadId"]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # nobody answers; the server's timer does
        status, body = served.request("GET", f"/approvals?status=expired&threadId={thread}")
        if body["approvals"] and body["approvals"][0]["applied"]:
            break
        time.sleep(0.1)
    assert body["approvals"][0]["answer"]["action"] == "timeout"
    status, late = served.request("POST", f"/approvals/{interrupt['id']}", {"action": "approve"})
    assert (status, late["code"]) == (410, "APPROVAL_EXPIRED")
    chat = drive("resume", served.url, client="v1", agentId="account_review", threadId=thread,
                 interruptId=interrupt["id"], answers=[{"action": "approve"}])
    failed = chat["steps"][0]
    assert failed["events"][-1]["type"] == "RUN_ERROR"
    assert failed["events"][-1]["code"] == "APPROVAL_EXPIRED"
    reload = drive("connect", served.url, agentId="account_review", threadId=thread)
    (shown,) = reload["steps"]
    assert contents(shown)[-1] == "Completed 3 of 3 steps; approval: timeout."
    assert shown["state"]["result"]["approval"]["status"] == "timeout"


def restart_while_waiting(where: Path, env: dict[str, str], *, client: str,
                          answer_over_http: bool) -> None:
    """Phase one, SIGKILL while the approval waits, a restart on the same database, then
    the answer: the run resumes where it stopped, nothing lost, nothing done twice."""
    log = where / "calls.jsonl"
    env = {**env, "HITL_CALLS": str(log), "HITL_THREADS": str(where / "threads.sqlite3")}
    task = task_for(f"restart-{client}")
    served = Server(env, where)
    served.start()
    try:
        started = drive("start", served.url, client=client, task=task)
        thread = started["threadId"]
        check_step(started["steps"][0], client, interrupted=True)
        _, waiting = served.request("GET", f"/approvals?threadId={thread}")
        (approval,) = waiting["approvals"]
        served.kill()  # SIGKILL: a crash while the approval waits

        served.start()  # the same files (or schema), a new process
        _, after = served.request("GET", f"/approvals?threadId={thread}")
        assert [(a["id"], a["status"]) for a in after["approvals"]] == [
            (approval["id"], "pending")]
        if answer_over_http:
            status, answered = served.request("POST", f"/approvals/{approval['id']}",
                                              {"action": "approve", "userId": "ops-bot"})
            assert (status, answered["run"]["status"]) == (200, "finished")
            assert answered["approval"]["answeredBy"] == "ops-bot"
            shown = drive("connect", served.url, threadId=thread)["steps"][0]
        else:
            resumed = drive("resume", served.url, client=client, threadId=thread,
                            interruptId=approval["id"], answers=[APPROVE[client]])
            reload, shown = resumed["steps"] if client == "legacy" else (None, resumed["steps"][0])
            if reload is not None:  # the reload brought the question back
                assert request_of(reload, "legacy")["data"]["agent_result"] == \
                    approval["value"]["data"]["agent_result"]
            check_step(shown, client, interrupted=False)
        assert shown["state"]["status"] == "completed"
        # nothing repeated: one specialist call in all, one draft, one approval
        assert [c["iteration"] for c in calls(log, task)] == ["1"]
        _, history = served.request("GET", f"/threads/{thread}/messages")
        texts = [m.get("content") for m in history["messages"]]
        assert texts.count(approval["value"]["data"]["agent_result"]) == 1
        assert texts[-1] == "Approved: the Invoice specialist's result is final."
        _, events = served.request("GET", f"/threads/{thread}/events")
        assert len([e for e in events["events"] if e["type"] == "RUN_STARTED"]) == 2
        _, answered_list = served.request("GET", f"/approvals?status=answered&threadId={thread}")
        assert [a["applied"] for a in answered_list["approvals"]] == [True]
    finally:
        served.stop()


@pytest.mark.parametrize("client", CLIENTS)
def test_sigkill_while_waiting_sqlite(tmp_path: Path, client: str) -> None:
    restart_while_waiting(tmp_path, {"HITL_CHECKPOINTS": f"sqlite:///{tmp_path}/cp.sqlite3"},
                          client=client, answer_over_http=False)


def test_sigkill_while_waiting_postgres(tmp_path: Path) -> None:
    with postgres_schema() as url:
        restart_while_waiting(tmp_path, {"HITL_CHECKPOINTS": url}, client="v1",
                              answer_over_http=True)
