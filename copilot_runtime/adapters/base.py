"""The interface every LLM provider adapter implements.

An adapter turns one `ChatRequest` (provider-neutral: AG-UI messages, tool specs, model
parameters) into the provider's request, and the provider's stream into batches of small
`ChatDelta` values, one batch per upstream read. It raises `UpstreamError` for anything the
provider does wrong, with a message fit for the client. Closing the iterator early (a stop or
a disconnect) must cancel the upstream request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from ag_ui.core import Message

from copilot_runtime._exceptions import UpstreamError
from copilot_runtime.threads.base import ThreadOwner

__all__ = [
    "ChatDelta",
    "ChatRequest",
    "EncryptedReasoning",
    "ReasoningDelta",
    "ServiceAdapter",
    "StreamEnd",
    "TextDelta",
    "ToolCallDelta",
    "ToolSpec",
    "configured_model",
    "spent_before",
]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool declared to the model: a server-side action or a frontend tool."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(slots=True)
class ChatRequest:
    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    system_prompt: str | None = None
    model: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    #: "auto", "none", "required", or the name of one tool the model must call.
    tool_choice: str | None = None
    #: The settings are the runtime's own (a guardrail judge's), not a client's: an adapter
    #: fits them to its model without a warning, and `max_tokens` bounds the answer alone
    #: (a model that reasons first gets room for that on top).
    runtime_settings: bool = False
    #: The thread the request is for, and its owner (None: no authentication). What an
    #: adapter keeps of an answer for the tool loop (reasoning, signatures) goes back only
    #: into later requests of that thread and owner: a deleted thread's id may become
    #: another principal's. A request of no thread keeps and gets nothing.
    thread_id: str | None = None
    thread_owner: ThreadOwner | None = None


class TextDelta(NamedTuple):
    text: str


class ToolCallDelta(NamedTuple):
    """A piece of a tool call; `call_index` tells parallel calls apart, `id`/`name` come first."""

    call_index: int
    id: str | None
    name: str | None
    arguments: str


class ReasoningDelta(NamedTuple):
    """A piece of the model's visible reasoning (Claude's thinking, Gemini's thoughts)."""

    text: str


class EncryptedReasoning(NamedTuple):
    """An answer's signed reasoning as an opaque string, once per answer, after its tool
    call `call_index` started: the client keeps it on that call and sends it back, so the
    loop's next request can carry the reasoning wherever it lands (Claude's thinking)."""

    call_index: int
    value: str


class StreamEnd(NamedTuple):
    finish_reason: str | None
    usage: dict[str, Any] | None = None


ChatDelta = TextDelta | ToolCallDelta | ReasoningDelta | EncryptedReasoning | StreamEnd

def configured_model(adapter: object) -> str | None:
    """The model `adapter` asks for when a request names none (for telemetry): its `model`,
    as the provider adapters and `LangChainAdapter` name it (None: one that does not say)."""
    model = getattr(adapter, "model", None)
    return model if isinstance(model, str) and model else None


def spent_before(error: BaseException) -> StreamEnd | None:
    """The answer's end (finish reason, usage) as far as the provider told it before
    `error` (`UpstreamError.spent`): it bills the tokens it counted though the answer
    failed (None: it counted none)."""
    spent = error.spent if isinstance(error, UpstreamError) else None
    return spent if isinstance(spent, StreamEnd) else None


@runtime_checkable
class ServiceAdapter(Protocol):
    """An LLM provider. `provider` names it in errors and telemetry, and a `model` string
    attribute, where it has one, the model it asks for (see `configured_model`).

    One that keeps something of a thread between requests (an answer's reasoning, for its
    tool loop) also has `async forget_thread(thread_id)`, which the built-in agent calls
    when the runtime deletes the thread (its owner, or retention): its id is free again.
    """

    provider: str

    def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        """Stream the model's answer as batches of deltas."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
