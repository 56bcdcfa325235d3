"""Any LangChain chat model (`BaseChatModel`): every provider LangChain has an integration for.

The model is streamed with `astream`, tools bound with `bind_tools` (in the OpenAI function
format, which every integration accepts), and its tool-call chunks merged by index (a new id
at an index in use starting a new call, a name in a later piece kept), or by id for
integrations that send whole calls without an index. LangChain streams carry no terminal
event: the end of the iterator is the end of the answer, and the finish reason is read from
the chunks' metadata when the integration reports one, in the runtime's words (ChatAnthropic's
`max_tokens` and ChatGoogleGenerativeAI's `SAFETY` are `length` and `content_filter`, as
through the direct adapters).

Per-request model settings LangChain cannot apply generically (a different model, temperature
or token limit) are refused with a clear error; `stop` and `tool_choice` are applied. The
runtime's own temperature and token limit (a guardrail judge's) are left out: the chat model's
settings apply.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ag_ui.core import (
    AssistantMessage,
    DeveloperMessage,
    Message,
    SystemMessage,
    ToolMessage,
    UserMessage,
)
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
)
from langchain_core.messages import SystemMessage as LCSystemMessage
from langchain_core.messages import ToolMessage as LCToolMessage

from copilot_runtime._exceptions import (
    ConfigurationError,
    CopilotRuntimeError,
    InvalidRequestError,
    UpstreamError,
    UpstreamTimeoutError,
    upstream_said,
)
from copilot_runtime.adapters._common import (
    GEMINI_FAILED_REASONS,
    GEMINI_FINISH_REASONS,
    OPENING_TURN,
    arguments_object,
    error_body_message,
    text_of,
    tool_schema,
    usage,
)
from copilot_runtime.adapters.base import (
    ChatDelta,
    ChatRequest,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
)
from copilot_runtime.messages import (
    attachment_filename,
    attachment_source,
    media_type,
    paired_tool_calls,
    tool_media_after_results,
)

__all__ = ["LangChainAdapter", "to_langchain_messages"]


class LangChainAdapter:
    """A LangChain chat model behind the `ServiceAdapter` interface."""

    provider = "langchain"

    def __init__(self, chat_model: BaseChatModel) -> None:
        self.chat_model = chat_model

    @property
    def model(self) -> str | None:
        """The chat model's model name, for telemetry: ChatOpenAI's `model_name`, most
        other integrations' `model` (None: a model that has neither)."""
        for name in ("model_name", "model"):
            value = getattr(self.chat_model, name, None)
            if isinstance(value, str) and value:
                return value
        return None

    async def aclose(self) -> None:
        return None  # the application owns the model and its clients

    def runnable(self, request: ChatRequest) -> Any:
        """The model with the request's tools bound (none when tools are forbidden)."""
        settings: tuple[tuple[str, Any], ...] = (("model", request.model),)
        if not request.runtime_settings:
            # The runtime's own (a judge's) are left out, not refused: refused, the judge
            # failed closed on every message. Not bound either: which a model takes is not
            # knowable generically (a reasoning model refuses temperature 0, and its
            # thinking would use up a small token limit).
            settings += (("temperature", request.temperature),
                         ("maxTokens", request.max_tokens))
        unsupported = [name for name, value in settings if value is not None]
        if unsupported:
            raise InvalidRequestError(
                f"LangChainAdapter cannot change {', '.join(unsupported)} per request; "
                f"configure them on the chat model")
        if not request.tools or request.tool_choice == "none":
            return self.chat_model
        tools = [{"type": "function", "function": {
            "name": t.name, "description": t.description,
            "parameters": tool_schema(t.parameters, t.name)}} for t in request.tools]
        try:
            if request.tool_choice in (None, "auto"):
                return self.chat_model.bind_tools(tools)
            # "any" is the word every LangChain chat model takes for "some tool" (ChatAnthropic
            # would take "required" for a tool's name).
            choice = "any" if request.tool_choice == "required" else request.tool_choice
            return self.chat_model.bind_tools(tools, tool_choice=choice)
        except NotImplementedError:  # a chat model that takes no tools: say so, not a crash
            raise ConfigurationError(
                f"The LangChain chat model {type(self.chat_model).__name__} takes no tools, "
                f"and this run offers {len(tools)}") from None

    async def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        runnable = self.runnable(request)
        messages = to_langchain_messages(request.messages)
        if request.system_prompt:
            messages.insert(0, LCSystemMessage(content=request.system_prompt))
        options = {"stop": request.stop} if request.stop else {}
        calls = _CallPieces()
        finish: str | None = None
        tokens: dict[str, Any] | None = None
        try:
            async for chunk in runnable.astream(messages, **options):
                if not isinstance(chunk, AIMessageChunk):
                    continue
                out: list[ChatDelta] = []
                text = _chunk_text(chunk.content)
                if text:
                    out.append(TextDelta(text))
                for call in chunk.tool_call_chunks:
                    name, arguments = call.get("name"), call.get("args") or ""
                    index, new = calls.place(call.get("index"), call.get("id"))
                    if new or name or arguments:  # (a name may come after the first piece)
                        out.append(ToolCallDelta(index, call.get("id"), name, arguments))
                reason = _finish_reason(chunk.response_metadata)
                if reason:
                    failed = GEMINI_FAILED_REASONS.get(reason)
                    if failed is not None:  # (no answer: an error, as the direct route's)
                        if out:
                            yield out
                        raise UpstreamError(f"{failed} ({reason})")
                    finish = reason
                if chunk.usage_metadata:
                    tokens = dict(chunk.usage_metadata)
                if out:
                    yield out
        except CopilotRuntimeError:
            raise
        except Exception as exc:  # integrations raise their provider SDK's errors
            raise _upstream_error(exc) from None
        if finish is None or (finish == "stop" and calls.count):
            # (Gemini's STOP and Ollama's `done_reason` say "stop" after calls too)
            finish = "tool_calls" if calls.count else "stop"
        yield [StreamEnd(finish, usage(tokens.get("input_tokens"), tokens.get("output_tokens"))
                         if tokens else None)]


class _CallPieces:
    """Which call each tool-call piece belongs to. By the integration's `index`, but a new id
    at an index in use starts a new call: Ollama gives each of its parallel calls index 0,
    which merged them into one call with arguments no client parses. Pieces without an index
    (integrations that send whole calls) are told apart by id, or are each a call."""

    __slots__ = ("by_key", "count")

    def __init__(self) -> None:
        self.by_key: dict[Any, tuple[int, str | None]] = {}
        self.count = 0

    def place(self, index: int | None, call_id: str | None) -> tuple[int, bool]:
        """Our index of the piece's call, and whether the piece starts it."""
        key: Any = index if index is not None else (call_id or object())
        known = self.by_key.get(key)
        if known is not None and not (call_id and known[1] and call_id != known[1]):
            if call_id and not known[1]:
                self.by_key[key] = (known[0], call_id)  # the id came after the first piece
            return known[0], False
        self.by_key[key] = (self.count, call_id)
        self.count += 1
        return self.count - 1, True


#: The integrations' own stop reasons → the runtime's, as the direct adapters map them:
#: Anthropic's and Bedrock's (ChatAnthropic's `stop_reason`, ChatBedrockConverse's
#: `stopReason`), Gemini's enum names (ChatGoogleGenerativeAI's `finish_reason`). OpenAI's,
#: and Ollama's `done_reason`, are the runtime's words already; others pass as they are.
_FINISH_REASONS = {
    "end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls",
    "max_tokens": "length", "refusal": "content_filter",
    "guardrail_intervened": "content_filter", "content_filtered": "content_filter",
    **GEMINI_FINISH_REASONS,
}
_REASON_KEYS = ("finish_reason", "stop_reason", "stopReason", "done_reason")


def _finish_reason(metadata: dict[str, Any] | None) -> str | None:
    """The runtime's finish reason for the one a chunk's `response_metadata` reports."""
    if not metadata:  # (most chunks: text pieces)
        return None
    for key in _REASON_KEYS:
        reason = metadata.get(key)
        if reason:
            return _FINISH_REASONS.get(str(reason), str(reason))
    return None


def _upstream_error(exc: Exception) -> UpstreamError:
    status = getattr(exc, "status_code", None) or getattr(exc, "code", None)
    if isinstance(exc, asyncio.TimeoutError | TimeoutError) or "Timeout" in type(exc).__name__:
        return UpstreamTimeoutError("The LangChain model timed out")
    if isinstance(status, int) and 400 <= status < 600:
        message = error_body_message(getattr(exc, "body", None)) or getattr(
            exc, "message", None) or str(exc)
        return UpstreamError(f"LangChain model request failed with HTTP {status}: "
                             f"{upstream_said(message)}", status=status)
    return UpstreamError(
        f"The LangChain model failed: {type(exc).__name__}: {upstream_said(str(exc))}")


def _chunk_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or ():
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
    return "".join(parts)


def to_langchain_messages(messages: Sequence[Message]) -> list[BaseMessage]:
    """AG-UI history → LangChain messages (tool arguments as objects, tool calls paired:
    `paired_tool_calls`, a tool result's attachments in a human message after the results:
    `tool_media_after_results`, as not every integration takes media in a tool message),
    with an opening human message when no turn is left."""
    out: list[BaseMessage] = []
    for message in tool_media_after_results(paired_tool_calls(messages)):
        if isinstance(message, UserMessage):
            content = _user_content(message.content)
            if content != []:  # (an empty content array is refused by OpenAI's API)
                out.append(HumanMessage(content=content))
        elif isinstance(message, AssistantMessage):
            out.append(AIMessage(content=text_of(message.content) or "", tool_calls=[
                {"id": c.id, "name": c.function.name,
                 "args": arguments_object(c.function.arguments), "type": "tool_call"}
                for c in message.tool_calls or ()]))
        elif isinstance(message, ToolMessage):
            content = text_of(message.content) or ""
            if message.error:
                out.append(LCToolMessage(content=content or f"Error: {message.error}",
                                         tool_call_id=message.tool_call_id, status="error"))
            else:
                out.append(LCToolMessage(content=content, tool_call_id=message.tool_call_id))
        elif isinstance(message, SystemMessage | DeveloperMessage):
            out.append(LCSystemMessage(content=text_of(message.content) or ""))
    if not any(isinstance(item, HumanMessage | AIMessage | LCToolMessage) for item in out):
        out.append(HumanMessage(content=OPENING_TURN))
    return out


def _user_content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    blocks: list[Any] = []
    for part in content:
        kind = getattr(part, "type", None)
        if kind == "text":
            blocks.append({"type": "text", "text": part.text})
        elif kind in ("image", "audio", "video", "document"):
            source = attachment_source("LangChain", part)
            block_type = "file" if kind == "document" else kind
            mime = media_type(source)
            if source.type == "data":
                block = {"type": block_type, "base64": source.value, "mime_type": mime}
                filename = attachment_filename(part, None)
                if filename and kind == "document":  # (OpenAI's integration needs one)
                    block["filename"] = filename
                blocks.append(block)
            elif source.type == "url":
                blocks.append({"type": block_type, "url": source.value,
                               **({"mime_type": mime} if mime else {})})
            elif source.type == "file":
                blocks.append({"type": block_type, "file_id": source.value})
    return blocks
