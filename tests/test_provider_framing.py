"""A provider's answer is read the same whatever its legal SSE framing and its TCP reads, and
its error body's message is read whatever the body's shape.

- An error body whose `error` holds a string (`{"error": {"code": 429, "error": "..."}}`)
  crashed the OpenAI SDK route's reading of it (AGENT_ERROR, a stack trace logged); a body
  that is a JSON array (Gemini's OpenAI-compatible endpoint: `[{"error": {...}}]`) lost the
  provider's message on both routes.
- Text before a malformed or misshapen event went out when the two came in separate reads,
  and was lost when they came in one.
- One event over several `data:` lines (joined with "\\n" by the SSE spec), a leading
  byte-order mark (dropped by the spec) and bare "\\r" line ends: malformed JSON, a first
  chunk silently skipped, or an error.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from ag_ui.core import UserMessage

from copilot_runtime._exceptions import UpstreamError
from copilot_runtime.adapters.base import ChatRequest
from tests.test_hostile_providers import (
    ScriptedUpstream,
    Step,
    make_adapter,
)

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 30


# ---- an error body of another shape -----------------------------------------------------------


def error_answer(status: bytes, body: Any) -> list[Step]:
    data = orjson.dumps(body)
    return [b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data]


ERROR_BODIES: dict[str, tuple[list[Step], str]] = {
    "error_a_string": (error_answer(b"429 Too Many Requests", {
        "error": {"code": 429, "error": "Rate limit reached"}}),
        "OpenAI request failed with HTTP 429: Error code: 429"),
    "message_empty": (error_answer(b"429 Too Many Requests", {
        "error": {"message": "", "error": "x"}}),
        "OpenAI request failed with HTTP 429: Error code: 429"),
    "a_list": (error_answer(b"400 Bad Request", [{"error": {
        "code": 400, "message": "Invalid function name.", "status": "INVALID_ARGUMENT"}}]),
        "OpenAI request failed with HTTP 400: Invalid function name."),
}


@pytest.mark.parametrize("transport", ["direct", "sdk"])
@pytest.mark.parametrize("case", ERROR_BODIES)
async def test_an_error_body_of_another_shape_is_the_providers_error(
        transport: str, case: str) -> None:
    script, message = ERROR_BODIES[case]
    async with asyncio.timeout(TIMEOUT_S), ScriptedUpstream(script) as upstream:
        adapter = make_adapter("openai", upstream.url, transport)
        try:
            with pytest.raises(UpstreamError) as info:
                async for _ in adapter.stream(ChatRequest(
                        messages=[UserMessage(id="u", content="hi")])):
                    pass
        finally:
            await adapter.aclose()
    assert type(info.value) is UpstreamError
    assert info.value.message == message
