"""`ScriptedAdapter`: an in-process model whose answers a test writes down in advance.

Each call to the model takes the next turn of the script. A turn is a list of batches of
`ChatDelta`s (each batch is what one upstream read would deliver), or a function of the
`ChatRequest` that returns them. Every request is kept in `requests` for assertions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from copilot_runtime._exceptions import UpstreamError
from copilot_runtime.adapters.base import (
    ChatDelta,
    ChatRequest,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
)

__all__ = ["ScriptedAdapter", "text_turn", "tool_turn"]

Turn = Sequence[Sequence[ChatDelta]] | Callable[[ChatRequest], Sequence[Sequence[ChatDelta]]]


def text_turn(*pieces: str) -> list[list[ChatDelta]]:
    """A turn that answers with `pieces` of text, one batch each."""
    batches: list[list[ChatDelta]] = [[TextDelta(p)] for p in pieces]
    return [*batches, [StreamEnd("stop")]]


def tool_turn(*calls: tuple[str, str], call_id_prefix: str = "call") -> list[list[ChatDelta]]:
    """A turn that calls tools: `(name, arguments_json)` pairs, arguments in one piece."""
    batches: list[list[ChatDelta]] = [
        [ToolCallDelta(i, f"{call_id_prefix}_{i}", name, arguments)]
        for i, (name, arguments) in enumerate(calls)
    ]
    return [*batches, [StreamEnd("tool_calls")]]


class ScriptedAdapter:
    provider = "scripted"

    def __init__(self, *turns: Turn) -> None:
        self.turns = list(turns)
        self.requests: list[ChatRequest] = []

    async def aclose(self) -> None:
        return None

    async def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        self.requests.append(request)
        if not self.turns:
            raise UpstreamError("The scripted model has no answer left")
        turn = self.turns.pop(0)
        batches = turn(request) if callable(turn) else turn
        for batch in batches:
            yield batch
