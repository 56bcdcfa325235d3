"""Two interrupts pending at once, answered by the real npm clients, end to end.

The HITL test server's `parallel_review` graph (`tests/hitl_support/parallel.py`) asks two
questions from parallel nodes. The clients answer as they do in apps:

* `CopilotKitCore` 1.75 (the `on_interrupt` custom event) shows the last question it heard
  and answers it through `forwardedProps.command = {resume, interruptEvent}`;
* `@ag-ui/client` 1.0 answers every pending interrupt by id with `resume`;
* `@copilotkit/runtime-client-gql` 1.10.6 (as react-core's chat keeps it) answers the last
  `LangGraphInterruptEvent` it got with `metaEvents: [{name, value, response}]`.

Each answer must reach the question it was given for; the question left is asked again,
and the graph finishes once both are answered. Before, every answer failed (AGENT_ERROR,
or a failed GraphQL response) and the thread stayed stuck.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from copilot_runtime.testing import verify_events
from tests.hitl_support.driver import drive
from tests.hitl_support.gql_driver import drive_gql
from tests.hitl_support.server import Server, sqlite_server

AGENT = "parallel_review"
SUCCESS = {"code": "Success", "__typename": "SuccessResponseStatus"}


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    with sqlite_server(tmp_path_factory.mktemp("hitl-parallel")) as running:
        yield running


def last_said(messages: list[dict[str, Any]]) -> str:
    said: str = [m for m in messages if m["role"] == "assistant"][-1]["content"]
    return said


def test_legacy_client_answers_each_question_in_turn(running: tuple[Server, Path]) -> None:
    served, _ = running
    result = drive("converse", served.url, client="legacy", agentId=AGENT, task="Review",
                   answers=["yes", "no"])
    asked, first, second = result["steps"]
    for step in result["steps"]:
        verify_events(step["events"])
        assert step["events"][-1]["type"] == "RUN_FINISHED"
    assert result["coreErrors"] == []
    # Both questions were heard; the client shows (and answers) the last one.
    heard = [e for e in asked["events"] if e["type"] == "CUSTOM" and e["name"] == "on_interrupt"]
    assert len(heard) == 2
    shown = asked["interrupt"]["part"]
    other = "closing" if shown == "invoice" else "invoice"
    # That answer reached its question; the other one is asked again.
    assert first["interrupt"]["part"] == other
    assert second["interrupt"] is None
    assert last_said(second["messages"]) == (
        f"invoice: {'yes' if shown == 'invoice' else 'no'}; "
        f"closing: {'yes' if shown == 'closing' else 'no'}")
    assert (second["state"]["invoice"], second["state"]["closing"]) == (
        ("yes", "no") if shown == "invoice" else ("no", "yes"))


def test_v1_client_answers_both_at_once(running: tuple[Server, Path]) -> None:
    served, _ = running
    result = drive("converse", served.url, client="v1", agentId=AGENT, task="Review",
                   answers=[{"approved": True}])
    asked, done = result["steps"]
    assert len(asked["pendingInterrupts"]) == 2
    verify_events(done["events"])
    assert done["errors"] == []
    assert done["pendingInterrupts"] == []
    assert last_said(done["messages"]) == (
        "invoice: {'approved': True}; closing: {'approved': True}")


def test_graphql_client_answers_each_question_in_turn(running: tuple[Server, Path]) -> None:
    served, _ = running
    result = drive_gql("converse", served.url, agentId=AGENT, task="Review",
                       answers=["yes", "no"])
    asked, first, second = result["steps"]
    for step in result["steps"]:
        assert step["errors"] == []
        assert step["status"] == SUCCESS
    assert [m["name"] for m in asked["metaEvents"]] == ["LangGraphInterruptEvent"] * 2
    shown = asked["interrupt"]["value"]["part"]
    other = "closing" if shown == "invoice" else "invoice"
    assert [m["value"]["part"] for m in first["metaEvents"]] == [other]
    assert second["metaEvents"] == []
    final = second["states"][-1]["state"]
    assert (final["invoice"], final["closing"]) == (
        ("yes", "no") if shown == "invoice" else ("no", "yes"))
