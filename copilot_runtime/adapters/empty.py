"""`EmptyAdapter`: for deployments that serve only agents, with no built-in LLM agent.

`CopilotRuntime(service_adapter=EmptyAdapter(), agents=...)` says so explicitly: the runtime
registers no default LLM agent over it, and a request that still reaches it (a GraphQL 1.x
client naming no agent) gets a clear error instead of a model's answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from copilot_runtime._exceptions import InvalidRequestError
from copilot_runtime.adapters.base import ChatDelta, ChatRequest

__all__ = ["EmptyAdapter"]


class EmptyAdapter:
    """A service adapter with no model behind it."""

    provider = "empty"

    async def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        raise InvalidRequestError(
            "This runtime has no language model (EmptyAdapter): address one of its agents")
        yield []  # pragma: no cover - makes this an async generator

    async def aclose(self) -> None:
        return None
