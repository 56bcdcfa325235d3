"""The protocol-neutral core, driven directly (no HTTP)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from copilot_runtime import ThreadBusyError
from copilot_runtime._input import parse_run_input
from copilot_runtime.events import Event
from copilot_runtime.testing import MockOpenAIServer, verify_events
from tests.conftest import openai_runtime, run_input, types


async def _drive(runtime: object, body: dict[str, object], **options: object) -> list[Event]:
    out: list[Event] = []

    async def write(batch: Sequence[Event]) -> None:
        out.extend(batch)

    run = await runtime.start_run("default", parse_run_input(body), **options)  # type: ignore[attr-defined]
    await run.drive(write)
    return out


async def test_without_follow_up_the_run_ends_after_tool_results(llm: MockOpenAIServer) -> None:
    runtime = openai_runtime(llm)
    events = await _drive(runtime, run_input('call:getWeather {"city":"Rome"}'),
                          follow_up_server_tools=False)
    verify_events(events)
    assert types(events)[-2:] == ["TOOL_CALL_RESULT", "RUN_FINISHED"]
    assert len(llm.requests) == 1
    assert "tool_choice" not in llm.requests[0]
    await runtime.aclose()


async def test_thread_is_reserved_before_the_first_await(llm: MockOpenAIServer) -> None:
    runtime = openai_runtime(llm)
    first = await runtime.start_run("default", parse_run_input(run_input("a")))
    with pytest.raises(ThreadBusyError):
        await runtime.start_run("default", parse_run_input(run_input("b")))
    events: list[Event] = []

    async def write(batch: Sequence[Event]) -> None:
        events.extend(batch)

    await first.drive(write)
    verify_events(events)
    assert "thread-1" not in runtime.runs.active
    await runtime.aclose()


def test_a_replaced_input_keeps_model_and_echo_in_step() -> None:
    from copilot_runtime._input import parse_run_input

    first = parse_run_input({"threadId": "t", "runId": "r", "messages": [],
                             "forwardedProps": {"command": {"resume": "yes"}, "keep": 1},
                             "resume": [{"interruptId": "i", "status": "resolved",
                                         "payload": {"ok": True}}]})
    changed = first.replace(forwarded_props={"keep": 1}, resume=None)
    assert changed.model.forwarded_props == {"keep": 1}
    assert changed.raw["forwardedProps"] == {"keep": 1}
    assert changed.model.resume is None
    assert "resume" not in changed.raw
    assert first.raw["forwardedProps"]["command"] == {"resume": "yes"}  # a copy
