"""The built-in LLM agent: a chat model, server-side actions and the frontend's tools.

Each step streams one model answer. Server-side actions the model calls run inside the run
and their results go back to the model, step after step, until it answers without calling
one (or `max_steps` is reached; the last step forbids tools so the user always gets an
answer). When the model calls a frontend tool the run ends, the client executes the tool and
starts the next run with the result.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from ag_ui.core import (
    AssistantMessage,
    FunctionCall,
    Message,
    ToolCall,
    ToolMessage,
)

from copilot_runtime._exceptions import ActionError, ConfigurationError, InvalidRequestError
from copilot_runtime._input import RunInput
from copilot_runtime.actions import Action
from copilot_runtime.adapters.base import (
    ChatRequest,
    ReasoningDelta,
    ServiceAdapter,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
)
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.events import (
    Event,
    EventBatches,
    reasoning_content,
    reasoning_end,
    reasoning_start,
    text_message_content,
    text_message_end,
    text_message_start,
    tool_call_args,
    tool_call_end,
    tool_call_result,
    tool_call_start,
)

__all__ = ["BuiltInAgent"]


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class BuiltInAgent(Agent):
    """An agent that is one LLM behind a `ServiceAdapter`, with server-side actions."""

    class_name = "BuiltInAgent"

    def __init__(
        self,
        adapter: ServiceAdapter,
        *,
        actions: Iterable[Action] = (),
        description: str = "",
        instructions: str | None = None,
        max_steps: int = 10,
    ) -> None:
        super().__init__(description=description)
        if max_steps < 1:
            raise ConfigurationError("max_steps must be at least 1")
        self.adapter = adapter
        self.actions: dict[str, Action] = {}
        for item in actions:
            if item.name in self.actions:
                raise ConfigurationError(f"Two actions are named {item.name!r}")
            self.actions[item.name] = item
        self.instructions = instructions
        self.max_steps = max_steps

    def capabilities(self) -> dict[str, Any]:
        return {"tools": {"supported": True, "clientProvided": True},
                "transport": {"streaming": True}}

    async def aclose(self) -> None:
        await self.adapter.aclose()

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input, context.follow_up_server_tools)

    async def _run(self, input: RunInput, follow_up: bool) -> EventBatches:
        model = input.model
        settings = model_settings(model.forwarded_props)
        tools = [ToolSpec(a.name, a.description, a.parameters) for a in self.actions.values()]
        for tool in model.tools or ():
            if tool.name not in self.actions:
                tools.append(ToolSpec(tool.name, tool.description,
                                      tool.parameters or {"type": "object", "properties": {}}))
        frontend = {t.name for t in tools} - self.actions.keys()
        history: list[Message] = list(model.messages)
        system_prompt = self._system_prompt(model.context or ())
        # REASONING_* events only for clients that declare AG-UI 1.0 (older ones throw on
        # unknown event types; the GraphQL edge declares no version): others never see them.
        show_reasoning = (model.protocol_version or "0").split(".", 1)[0] not in ("", "0")

        for step in range(self.max_steps):
            last_step = follow_up and step == self.max_steps - 1
            request = ChatRequest(
                messages=history, tools=tools, system_prompt=system_prompt,
                model=settings.get("model"), temperature=settings.get("temperature"),
                max_tokens=settings.get("max_tokens"), stop=settings.get("stop"),
                tool_choice="none" if last_step and tools else settings.get("tool_choice"),
            )
            message_id = str(uuid.uuid4())
            text: list[str] = []
            calls: list[_Call] = []
            by_index: dict[int, _Call] = {}
            text_open = False
            open_call: _Call | None = None
            reasoning_id: str | None = None

            async for deltas in self.adapter.stream(request):
                batch: list[Event] = []
                for delta in deltas:
                    if reasoning_id is not None and type(delta) is not ReasoningDelta:
                        batch.extend(reasoning_end(reasoning_id))
                        reasoning_id = None
                    if type(delta) is TextDelta:
                        if not text_open:
                            if open_call is not None or calls:
                                continue  # text after tool calls: not shown by any client
                            batch.append(text_message_start(message_id))
                            text_open = True
                        text.append(delta.text)
                        batch.append(text_message_content(message_id, delta.text))
                    elif type(delta) is ToolCallDelta:
                        call = by_index.get(delta.call_index)
                        if call is None:
                            if text_open:
                                batch.append(text_message_end(message_id))
                                text_open = False
                            if open_call is not None:
                                batch.append(tool_call_end(open_call.id))
                            call = _Call(delta.id or f"call_{uuid.uuid4().hex[:24]}",
                                         delta.name or "")
                            by_index[delta.call_index] = call
                            calls.append(call)
                            open_call = call
                            batch.append(tool_call_start(call.id, call.name, message_id))
                        if delta.arguments:
                            call.arguments.append(delta.arguments)
                            batch.append(tool_call_args(call.id, delta.arguments))
                    elif type(delta) is ReasoningDelta:
                        if show_reasoning and delta.text:
                            if reasoning_id is None:
                                reasoning_id = str(uuid.uuid4())
                                batch.extend(reasoning_start(reasoning_id))
                            batch.append(reasoning_content(reasoning_id, delta.text))
                    else:
                        assert type(delta) is StreamEnd
                if batch:
                    yield batch

            tail: list[Event] = []
            if reasoning_id is not None:
                tail.extend(reasoning_end(reasoning_id))
            if text_open:
                tail.append(text_message_end(message_id))
            if open_call is not None:
                tail.append(tool_call_end(open_call.id))
            history.append(AssistantMessage(
                id=message_id, content="".join(text) or None,
                tool_calls=[ToolCall(id=c.id, function=FunctionCall(
                    name=c.name, arguments="".join(c.arguments))) for c in calls] or None))
            server_calls = [c for c in calls if c.name not in frontend]
            if not calls:
                if tail:
                    yield tail
                return
            if tail:
                yield tail
            if not server_calls:
                return  # only frontend tools: the client runs them and starts the next run
            results = await asyncio.gather(*(self._execute(c) for c in server_calls))
            batch = []
            for call, content in zip(server_calls, results, strict=True):
                result_id = str(uuid.uuid4())
                batch.append(tool_call_result(result_id, call.id, content))
                history.append(ToolMessage(id=result_id, tool_call_id=call.id, content=content))
            yield batch
            if len(server_calls) < len(calls) or not follow_up:
                return  # the client has tools to run, or sends the follow-up itself

    async def _execute(self, call: _Call) -> str:
        action = self.actions.get(call.name)
        if action is None:
            return _tool_error(f"there is no tool named {call.name!r}")
        try:
            return await action.execute("".join(call.arguments))
        except ActionError as exc:
            return _tool_error(exc.message)

    def _system_prompt(self, context: Sequence[Any]) -> str | None:
        parts = [self.instructions] if self.instructions else []
        if context:
            lines = [f"- {c.description}: {c.value}" for c in context]
            parts.append("The application shared this context with you:\n" + "\n".join(lines))
        return "\n\n".join(parts) or None


def _tool_error(message: str) -> str:
    return orjson.dumps({"error": message}).decode()


_SETTING_KEYS = {
    "model": "model", "temperature": "temperature", "maxTokens": "max_tokens",
    "max_tokens": "max_tokens", "stop": "stop", "toolChoice": "tool_choice",
    "tool_choice": "tool_choice",
}


def model_settings(forwarded_props: Any) -> dict[str, Any]:
    """Model parameters a client may pass in `forwardedProps`, checked for type."""
    if not isinstance(forwarded_props, dict):
        return {}
    source = dict(forwarded_props)
    nested = source.get("forwardedParameters")
    if isinstance(nested, dict):
        source.update(nested)
    settings: dict[str, Any] = {}
    for key, name in _SETTING_KEYS.items():
        if key not in source or source[key] is None:
            continue
        value = source[key]
        if name == "model" and not isinstance(value, str):
            raise InvalidRequestError("forwardedProps.model must be a string")
        if name == "temperature" and (isinstance(value, bool)
                                      or not isinstance(value, int | float)):
            raise InvalidRequestError("forwardedProps.temperature must be a number")
        if name == "max_tokens" and (isinstance(value, bool) or not isinstance(value, int)
                                     or value < 1):
            raise InvalidRequestError("forwardedProps.maxTokens must be a positive integer")
        if name == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise InvalidRequestError("forwardedProps.stop must be a string or strings")
        if name == "tool_choice" and not isinstance(value, str):
            raise InvalidRequestError("forwardedProps.toolChoice must be a string")
        settings[name] = value
    return settings
