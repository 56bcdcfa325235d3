"""Chat models for the workflows: the runtime's provider adapters as LangChain chat models.

`AdapterChatModel` puts a `ServiceAdapter` (`OpenAIAdapter` for any OpenAI-compatible
server, or an offline one) behind LangChain's `BaseChatModel`, so a graph node calls it like
any LangChain model and its tokens stream to the client as AG-UI text events (LangGraph
reports them as `on_chat_model_stream`). Any other LangChain chat model works in its place.

`OfflineSpecialistAdapter` is the deterministic stand-in the demo uses when no model is
configured: it says plainly that it is not a real model, and writes a short draft from the
task, the specialist's instructions and the latest revision request, so the approve and
revise loop can be clicked through without a key. The same input gives the same draft.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ag_ui.core import AssistantMessage, Message, UserMessage
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables.config import var_child_runnable_config
from pydantic import ConfigDict

from copilot_runtime.adapters.base import (
    ChatDelta,
    ChatRequest,
    ServiceAdapter,
    StreamEnd,
    TextDelta,
)

__all__ = ["AdapterChatModel", "OfflineSpecialistAdapter"]


class AdapterChatModel(BaseChatModel):
    """A LangChain chat model answering through a runtime `ServiceAdapter` (text only)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    adapter: Any
    model_name: str | None = None

    @property
    def _llm_type(self) -> str:
        return f"copilot-runtime-{getattr(self.adapter, 'provider', 'adapter')}"

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        raise NotImplementedError("AdapterChatModel is asynchronous: use ainvoke/astream")

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        text = "".join([chunk.text async for chunk in self._astream(messages, stop,
                                                                     run_manager)])
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))])

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        system = [str(m.content) for m in messages if isinstance(m, SystemMessage)]
        request = ChatRequest(messages=_to_agui(messages),
                              system_prompt="\n\n".join(system) or None,
                              model=self.model_name, stop=stop, tool_choice="none")
        adapter: ServiceAdapter = self.adapter
        said = False
        stream = aiter(adapter.stream(request))
        # A LangChain model inside the adapter (LangChainAdapter) must not inherit this run's
        # callbacks, or the graph streams its tokens a second time, as another message. It
        # reads them as it starts, in the first step: only that one runs without them.
        outer = var_child_runnable_config.set(None)
        try:
            batch = await anext(stream, None)
        finally:
            var_child_runnable_config.reset(outer)
        try:
            while batch is not None:
                for delta in batch:
                    if isinstance(delta, TextDelta) and delta.text:
                        said = True
                        chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta.text))
                        if run_manager is not None:
                            await run_manager.on_llm_new_token(delta.text, chunk=chunk)
                        yield chunk
                batch = await anext(stream, None)
        except Exception:
            if said:
                # Broken off mid-answer: LangChain reports no end for a model that failed,
                # so the text already streamed would stay an open message until the run
                # ended. A chunk with no text ends it now (as a provider's last chunk does).
                yield ChatGenerationChunk(message=AIMessageChunk(content=[]))
            raise
        if not said:
            # An answer with no text is an empty answer, not LangChain's "No generations
            # found in stream" error: the caller decides what an empty answer means.
            yield ChatGenerationChunk(message=AIMessageChunk(content=""))


def _to_agui(messages: Sequence[BaseMessage]) -> list[Message]:
    out: list[Message] = []
    for index, message in enumerate(messages):
        if isinstance(message, SystemMessage):
            continue
        text = message.text if isinstance(message.text, str) else str(message.content)
        message_id = message.id or f"m{index}"
        if isinstance(message, AIMessage):
            out.append(AssistantMessage(id=message_id, role="assistant", content=text))
        else:
            out.append(UserMessage(id=message_id, role="user", content=text))
    return out


class OfflineSpecialistAdapter:
    """An offline, deterministic stand-in for an LLM, for the workflows of the demo.

    It reads the specialist from the system prompt's first line (`You are the <Name>
    specialist`), the task and the revision request from the user message (the lines the
    review loop writes: `Task:`, `Iteration:`, `Revision requested:`), and answers with a short,
    plausible draft that names what it applied.
    """

    provider = "offline-demo"

    def __init__(self, *, delay: float = 0.01) -> None:
        self.delay = delay

    async def aclose(self) -> None:
        return None

    async def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        for piece in re.findall(r"\S+\s*", _draft(request)):
            if self.delay:
                await asyncio.sleep(self.delay)
            yield [TextDelta(piece)]
        yield [StreamEnd("stop")]


def _draft(request: ChatRequest) -> str:
    system = request.system_prompt or ""
    found = re.search(r"You are the (\w+) specialist", system)
    specialist = found.group(1) if found else "workflow"
    prompt = ""
    for message in reversed(request.messages):
        if isinstance(message, UserMessage) and isinstance(message.content, str):
            prompt = message.content
            break
    first_line = prompt.strip().splitlines()[0] if prompt.strip() else ""
    task = _line(prompt, "Task:") or first_line
    revision = _line(prompt, "Revision requested:")
    iteration = _line(prompt, "Iteration:")
    # ASCII digits, a few: `isdigit` takes '²' (no int), and int() refuses 5000 digits.
    attempt = int(iteration) if iteration and re.fullmatch(r"[0-9]{1,9}", iteration) else 1
    digest = int(hashlib.sha256(f"{specialist}:{task}".encode()).hexdigest()[:8], 16)
    figure = 1_000 + digest % 9_000
    focus = {
        "Invoice": f"invoice total {figure:,} EUR across {2 + digest % 4} line items, "
                   f"due in {15 + digest % 30} days",
        "Closing": f"{3 + digest % 5} open reconciliations, accruals of {figure:,} EUR, "
                   "close checklist ready for sign-off",
        "Audit": f"{1 + digest % 4} control findings, sample of {20 + digest % 30} "
                 "transactions tested, no material misstatement",
    }.get(specialist, f"a plan in {2 + digest % 3} steps")
    text = (f"(Offline demo model) {specialist} specialist, draft {attempt} for "
            f"\"{task}\": {focus}.")
    if revision:
        text += f" Revised as asked: \"{revision}\"."
    return text


def _line(text: str, prefix: str) -> str | None:
    for line in reversed(text.splitlines()):
        if line.startswith(prefix):
            return line[len(prefix):].strip() or None
    return None
