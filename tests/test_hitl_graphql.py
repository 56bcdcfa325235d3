"""The human-in-the-loop workflows driven by the real GraphQL client, end to end.

`tests/gql/drive_hitl.mjs` runs `@copilotkit/runtime-client-gql` 1.10.6 and keeps the chat
the way react-core 1.10 does: an interrupt arrives as the `LangGraphInterruptEvent` meta
event; the answer goes back with the next request's `metaEvents: [{name, value, response}]`.
The server is the HITL test server (`tests/hitl_support/app.py`, a child process with its
threads and checkpoints in SQLite files); the offline specialist model logs every call, which
tells a repeated call. One server is killed with SIGKILL while an approval waits, and
restarted on the same files while the page stays open.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hitl_support.counting import calls
from tests.hitl_support.gql_driver import drive_gql, drive_gql_across
from tests.hitl_support.server import Server, sqlite_server, task_for

APPROVE = {"action": "approve"}
SUCCESS = {"code": "Success", "__typename": "SuccessResponseStatus"}


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    with sqlite_server(tmp_path_factory.mktemp("hitl-graphql")) as running:
        yield running


def check_step(step: dict[str, Any], *, interrupted: bool) -> None:
    """A successful response; an interrupt, if any, as one `LangGraphInterruptEvent` that
    the chat now holds, and the agent session left open at the interrupted node."""
    assert step["errors"] == []
    assert step["status"] == SUCCESS
    names = [m["name"] for m in step["metaEvents"]]
    assert names == (["LangGraphInterruptEvent"] if interrupted else [])
    assert (step["interrupt"] is not None) == interrupted
    last = step["states"][-1]
    assert last["nodeName"] != "__end__" if interrupted else last["nodeName"] == "__end__"
    if interrupted:
        assert step["interrupt"]["value"] == step["metaEvents"][0]["value"]
        assert step["agentSession"]["nodeName"] == last["nodeName"]


def request_of(step: dict[str, Any]) -> dict[str, Any]:
    """The clarification request, as the chat's interrupt renderer reads it."""
    value = step["interrupt"]["value"]
    assert value["type"] == "user_clarification_request"
    return dict(value)


def final_state(step: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = step["states"][-1]["state"]
    return state


def assistant_texts(step: dict[str, Any]) -> list[str]:
    return [m["content"] for m in step["history"] if m["role"] == "assistant"]


def test_approve_at_once(running: tuple[Server, Path]) -> None:
    served, log = running
    task = task_for("gql-approve")
    result = drive_gql("converse", served.url, task=task, answers=[APPROVE], again=True)
    first, done, twice = result["steps"]
    check_step(first, interrupted=True)
    request = request_of(first)
    assert request["data"]["agent"] == "Invoice"
    assert request["data"]["agent_result"].startswith("(Offline demo model) Invoice "
                                                      "specialist, draft 1")
    assert first["texts"][-1] == request["data"]["agent_result"]
    check_step(done, interrupted=False)
    assert final_state(done)["status"] == "completed"
    assert done["texts"] == ["Approved: the Invoice specialist's result is final."]
    # the chat holds each message once: the task, the routing, the draft, the approval
    assert assistant_texts(done)[-2:] == [request["data"]["agent_result"],
                                          "Approved: the Invoice specialist's result is final."]
    assert [m["content"] for m in done["history"]].count(task) == 1
    assert [c["iteration"] for c in calls(log, task)] == ["1"]
    thread = result["threadId"]
    assert served.request("GET", f"/approvals?status=pending&threadId={thread}") \
        == (200, {"approvals": [], "nextCursor": None})
    # The same answer once more (a second click): refused, and nothing runs again.
    assert twice["status"]["__typename"] == "FailedResponseStatus"
    assert twice["status"]["details"]["originalError"]["originalErrorType"] == \
        "INTERRUPT_NOT_PENDING"
    assert twice["texts"] == []
    assert twice["metaEvents"] == []
    assert [c["iteration"] for c in calls(log, task)] == ["1"]
    assert stored_runs(served, thread, 2) >= 2
    _, history = served.request("GET", f"/threads/{thread}/messages")
    assert [m.get("content") for m in history["messages"]].count(
        "Approved: the Invoice specialist's result is final.") == 1


def test_revise_three_times_then_approve(running: tuple[Server, Path]) -> None:
    served, log = running
    task = task_for("gql-revise")
    revisions = ["add VAT", "net 30 payment terms", "split the consulting line"]
    answers = [{"action": "revise", "payload": r} for r in revisions]
    result = drive_gql("converse", served.url, task=task, answers=[*answers, APPROVE])
    steps = result["steps"]
    assert len(steps) == 5
    for step in steps[:4]:
        check_step(step, interrupted=True)
    check_step(steps[4], interrupted=False)
    requests = [request_of(s) for s in steps[:4]]
    assert [r["data"]["iteration"] for r in requests] == [1, 2, 3, 4]
    for revision, request, step in zip(revisions, requests[1:], steps[1:4], strict=True):
        assert request["data"]["agent_result"].endswith(f'Revised as asked: "{revision}".')
        assert step["texts"] == [request["data"]["agent_result"]]
    final = final_state(steps[4])
    assert final["task"] == task
    assert [e["user_feedback"] for e in final["history"] if e["agent"] == "HITL"] == [
        *revisions, "approve"]
    assert final["status"] == "completed"
    drafts = [r["data"]["agent_result"] for r in requests]
    assert assistant_texts(steps[4])[-5:] == [
        *drafts, "Approved: the Invoice specialist's result is final."]
    made = calls(log, task)
    assert [(c["specialist"], c["iteration"], c["revision"]) for c in made] == [
        ("Invoice", "1", None), *[("Invoice", str(i + 2), r) for i, r in enumerate(revisions)]]
    # each revision saw the original task and everything before it
    assert all(f"Task: {task}" in c["prompt"] for c in made)
    assert "- iteration 3, HITL: split the consulting line" in made[-1]["prompt"]
    assert "- iteration 1, HITL: add VAT" in made[-1]["prompt"]


def test_review_switched_off(running: tuple[Server, Path]) -> None:
    served, log = running
    task = task_for("gql-no-review")
    result = drive_gql("converse", served.url, task=task, state={"review": False})
    (step,) = result["steps"]
    check_step(step, interrupted=False)
    assert final_state(step)["status"] == "completed"
    assert step["texts"][-1] == ("Done: the Invoice specialist's result is final "
                                 "(review was off).")
    assert len(calls(log, task)) == 1
    assert served.request("GET", f"/approvals?threadId={result['threadId']}") == (
        200, {"approvals": [], "nextCursor": None})


def stored_runs(served: Server, thread: str, at_least: int) -> int:
    """How many runs the thread store holds for `thread`, waiting a little for `at_least`.

    A run is recorded just after the batch that ends its response is written (the
    shared `protocols/_http.stream_run` ends the body before `ActiveRun._finish` stores the
    run), so a client can have the whole answer a moment before the record exists."""
    deadline = time.monotonic() + 5
    while True:
        _, events = served.request("GET", f"/threads/{thread}/events")
        count = len([e for e in events["events"] if e["type"] == "RUN_STARTED"])
        if count >= at_least or time.monotonic() > deadline:
            return count
        time.sleep(0.05)


def test_sigkill_while_waiting_then_approve(tmp_path: Path) -> None:
    """The page stays open at the question while the server is killed with SIGKILL and
    restarted on the same SQLite files; then the person approves from the open page."""
    log = tmp_path / "calls.jsonl"
    served = Server({"HITL_CHECKPOINTS": f"sqlite:///{tmp_path}/cp.sqlite3",
                     "HITL_THREADS": str(tmp_path / "threads.sqlite3"),
                     "HITL_CALLS": str(log)}, tmp_path)
    task = task_for("gql-restart")
    seen: dict[str, Any] = {}

    def crash_and_restart(waiting: dict[str, Any]) -> None:
        thread = waiting["threadId"]
        check_step(waiting["steps"][0], interrupted=True)
        _, pending = served.request("GET", f"/approvals?threadId={thread}")
        (seen["approval"],) = pending["approvals"]
        # (the kill waits for the first run's record: see `stored_runs`)
        assert stored_runs(served, thread, 1) == 1
        served.kill()  # SIGKILL: a crash while the approval waits
        served.start()  # the same files, a new process, the same port
        _, after = served.request("GET", f"/approvals?threadId={thread}")
        assert [(a["id"], a["status"]) for a in after["approvals"]] == [
            (seen["approval"]["id"], "pending")]

    served.start()
    try:
        result = drive_gql_across(served.url, crash_and_restart, task=task, answers=[APPROVE])
        thread = result["threadId"]
        first, done = result["steps"]
        draft = request_of(first)["data"]["agent_result"]
        assert seen["approval"]["value"]["data"]["agent_result"] == draft
        check_step(done, interrupted=False)
        assert final_state(done)["status"] == "completed"
        assert done["texts"] == ["Approved: the Invoice specialist's result is final."]
        # nothing repeated: one specialist call in all, one draft, one approval
        assert [c["iteration"] for c in calls(log, task)] == ["1"]
        assert assistant_texts(done).count(draft) == 1
        assert stored_runs(served, thread, 2) == 2
        _, history = served.request("GET", f"/threads/{thread}/messages")
        texts = [m.get("content") for m in history["messages"]]
        assert texts.count(draft) == 1
        assert texts.count(task) == 1
        assert texts[-1] == "Approved: the Invoice specialist's result is final."
        _, answered = served.request("GET", f"/approvals?status=answered&threadId={thread}")
        assert [(a["id"], a["applied"]) for a in answered["approvals"]] == [
            (seen["approval"]["id"], True)]
        assert final_state(done)["history"][-1]["user_feedback"] == "approve"
    finally:
        served.stop()


def test_an_approval_times_out(running: tuple[Server, Path]) -> None:
    """Nobody answers the account review's approval; the server's timer does. A late answer
    from the open page then gets a Failed status (INTERRUPT_NOT_PENDING) and changes
    nothing."""
    served, _ = running
    seen: dict[str, Any] = {}

    def wait_for_the_timeout(waiting: dict[str, Any]) -> None:
        thread = waiting["threadId"]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            _, body = served.request("GET", f"/approvals?status=expired&threadId={thread}")
            if body["approvals"] and body["approvals"][0]["applied"]:
                seen["expired"] = body["approvals"][0]
                return
            time.sleep(0.1)
        pytest.fail("the approval did not time out")

    result = drive_gql_across(served.url, wait_for_the_timeout, agentId="account_review",
                              task="Review account INITECH-003", answers=[APPROVE])
    asked, late = result["steps"]
    assert asked["errors"] == []
    assert asked["status"] == SUCCESS
    assert [m["name"] for m in asked["metaEvents"]] == ["LangGraphInterruptEvent"]
    value = asked["interrupt"]["value"]
    assert value["reason"] == "approval"
    assert value["expiresAt"].endswith("Z")
    assert seen["expired"]["answer"]["action"] == "timeout"
    # The 1.x answer names no interrupt (`metaEvents` carry the question's value and the
    # response only), so it goes to whatever the thread waits on: nothing, by now.
    status = late["status"]
    assert (status["__typename"], status["reason"]) == ("FailedResponseStatus",
                                                        "UNKNOWN_ERROR")
    assert status["details"]["originalError"]["originalErrorType"] == "INTERRUPT_NOT_PENDING"
    assert "is not waiting for an answer" in status["details"]["description"]
    assert late["metaEvents"] == []
    # the timer's run, recorded (a moment after it ends), is the thread's last word
    assert stored_runs(served, result["threadId"], 2) >= 2
    _, history = served.request("GET", f"/threads/{result['threadId']}/messages")
    assert history["messages"][-1]["content"] == "Completed 3 of 3 steps; approval: timeout."
