"""An OpenAI-compatible server that ends its stream cleanly after the finish reason but never
sends `data: [DONE]` (older TGI, oobabooga, ik_llama.cpp, llama-box, mistral.rs did so).

The whole answer had arrived, yet every run ended UPSTREAM_PROTOCOL_ERROR ("The OpenAI stream
ended before the answer was complete") on both routes, and a tool call was never run. The
official SDKs take such an end as the answer's end; so does the runtime now. A stream that
ends before any finish reason is still cut short.
"""

from __future__ import annotations

from typing import Any

import pytest

from copilot_runtime import CopilotRuntime, action
from tests.conftest import ServeRuntime, run_input, text_of, types
from tests.test_hostile_providers import (
    HEAD,
    ScriptedUpstream,
    Step,
    make_adapter,
    oa_finish,
    oa_text,
    oa_tool,
    protocol_error,
    run,
    sse,
)

pytestmark = pytest.mark.timeout(30)

TRANSPORTS = ["direct", "sdk"]
USAGE = sse({"id": "c", "object": "chat.completion.chunk", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})


@action
def look_up_weather(city: str) -> dict[str, str]:
    """The weather in a city."""
    return {"city": city, "sky": "sunny"}


async def _runs(serve_runtime: ServeRuntime, transport: str, *scripts: list[Step]
                ) -> tuple[list[dict[str, Any]], ScriptedUpstream]:
    async with ScriptedUpstream(*scripts) as upstream:
        runtime = CopilotRuntime(
            service_adapter=make_adapter("openai", upstream.url, transport, timeout=5),
            actions=[look_up_weather])
        async with serve_runtime(runtime) as served:
            return await run(served, run_input("weather?")), upstream


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("with_usage", [False, True])
async def test_an_answer_without_done_finishes_the_run(
        serve_runtime: ServeRuntime, transport: str, with_usage: bool) -> None:
    script: list[Step] = [HEAD, oa_text("part1 "), oa_text("part2"), oa_finish("stop")]
    if with_usage:  # (stream_options.include_usage: a chunk after the finish reason)
        script.append(USAGE)
    events, _ = await _runs(serve_runtime, transport, script)
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    assert text_of(events) == "part1 part2"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_tool_calls_without_done_are_run(serve_runtime: ServeRuntime,
                                               transport: str) -> None:
    calls: list[Step] = [HEAD, oa_tool(0, "call_1", "look_up_weather", '{"city":"Oslo"}'),
                         oa_finish("tool_calls"), USAGE]
    then: list[Step] = [HEAD, oa_text("Sunny in Oslo."), oa_finish("stop")]
    events, upstream = await _runs(serve_runtime, transport, calls, then)
    assert types(events)[-1] == "RUN_FINISHED", events[-1]
    (result,) = [e for e in events if e["type"] == "TOOL_CALL_RESULT"]
    assert "sunny" in result["content"]
    assert text_of(events) == "Sunny in Oslo."
    assert len(upstream.requests) == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_end_before_the_finish_reason_is_still_a_protocol_error(
        serve_runtime: ServeRuntime, transport: str) -> None:
    events, _ = await _runs(serve_runtime, transport, [HEAD, oa_text("part1 "), USAGE])
    protocol_error(events, "openai")
    assert "ended before the answer was complete" in events[-1]["message"]
