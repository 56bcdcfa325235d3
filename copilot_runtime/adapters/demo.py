"""An offline, deterministic stand-in for an LLM, for demos and tests without a key.

It says plainly that it is not a real model. It calls a declared tool when the user names
it, as it is or in words in order ("set the accent colour" for `set_accent_color`; an enum
argument takes the value the user named), or asks about the weather or for a dice roll and
such tools exist; after a tool result it reports what the tool returned. Answers stream
word by word.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from ag_ui.core import AssistantMessage, ToolMessage, UserMessage

from copilot_runtime.adapters.base import (
    ChatDelta,
    ChatRequest,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
)

__all__ = ["DemoAdapter"]

_CITY = re.compile(r"\b(?:in|for|at)\s+([A-Z][\w\-' ]*[\w])", re.UNICODE)


class DemoAdapter:
    provider = "demo"

    def __init__(self, *, delay: float = 0.02) -> None:
        self.delay = delay

    async def aclose(self) -> None:
        return None

    async def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        call = None if request.tool_choice == "none" else _choose_tool(request)
        if call is not None:
            name, arguments = call
            seed = f"{len(request.messages)}:{name}:{arguments}".encode()
            call_id = "call_demo_" + hashlib.sha256(seed).hexdigest()[:16]
            yield [ToolCallDelta(0, call_id, name, arguments)]
            yield [StreamEnd("tool_calls")]
            return
        for word in re.findall(r"\S+\s*", _answer(request)):
            if self.delay:
                await asyncio.sleep(self.delay)
            yield [TextDelta(word)]
        yield [StreamEnd("stop")]


def _last_user_text(request: ChatRequest) -> str:
    for message in reversed(request.messages):
        if isinstance(message, UserMessage):
            content = message.content
            if isinstance(content, str):
                return content
            return " ".join(getattr(p, "text", "") or "" for p in content)
    return ""


def _choose_tool(request: ChatRequest) -> tuple[str, str] | None:
    if not request.messages or not isinstance(request.messages[-1], UserMessage):
        return None
    text = _last_user_text(request)
    lowered = text.lower()
    tools = {t.name: t for t in request.tools}
    spoken = lowered.replace("colour", "color")
    for name, tool in tools.items():
        # "set_accent_color" is named either as it is or in words ("set the accent colour").
        words = name.lower().replace("-", "_").split("_")
        if name.lower() in lowered or _in_order(words, spoken):
            return name, orjson.dumps(_arguments_for(tool, text)).decode()
    if "weather" in lowered:
        for name, tool in tools.items():
            if "weather" in name.lower():
                return name, orjson.dumps(_arguments_for(tool, text)).decode()
    if re.search(r"\b(dice|die|roll)\b", lowered):
        for name, tool in tools.items():
            if "dice" in name.lower() or "roll" in name.lower():
                return name, orjson.dumps(_arguments_for(tool, text)).decode()
    return None


def _in_order(words: list[str], text: str) -> bool:
    """Whether all of `words` (two or more) appear in `text` as words, in that order."""
    if len(words) < 2 or not all(words):
        return False
    return re.search(r"\b" + r"\b.*?\b".join(map(re.escape, words)) + r"\b", text) is not None


def _arguments_for(tool: ToolSpec, text: str) -> dict[str, Any]:
    """Plausible arguments: a city if one is named, otherwise simple defaults per type."""
    properties = tool.parameters.get("properties") or {}
    required = tool.parameters.get("required") or []
    arguments: dict[str, Any] = {}
    city = _CITY.search(text)
    for name in required:
        spec = properties.get(name) or {}
        kind = spec.get("type")
        if name.lower() in ("city", "location", "place") and city:
            arguments[name] = city.group(1).strip()
        elif kind in ("integer", "number"):
            arguments[name] = spec.get("default", 6)
        elif kind == "boolean":
            arguments[name] = True
        elif spec.get("enum"):
            named = [v for v in spec["enum"] if isinstance(v, str) and re.search(
                rf"\b{re.escape(v.lower())}\b", text.lower())]
            arguments[name] = named[0] if named else spec["enum"][0]
        else:
            arguments[name] = city.group(1).strip() if city else "demo"
    return arguments


def _answer(request: ChatRequest) -> str:
    last = request.messages[-1] if request.messages else None
    if isinstance(last, ToolMessage):
        name = "the tool"
        for message in request.messages:
            if isinstance(message, AssistantMessage):
                for call in message.tool_calls or ():
                    if call.id == last.tool_call_id:
                        name = call.function.name
        content = last.content if isinstance(last.content, str) else ""
        return (f"(Offline demo model) {name} returned: {content}. "
                "A real model would now phrase this as an answer.")
    text = _last_user_text(request).strip()
    tools = ", ".join(t.name for t in request.tools) or "none"
    return (
        "I am the offline demo model of copilot-runtime, not a real LLM: set OPENAI_API_KEY "
        "(or OPENAI_BASE_URL for an OpenAI-compatible server) to talk to one. "
        f"You said: \"{text}\". Tools I can call: {tools}. "
        "Try \"What is the weather in Paris?\" or \"Roll a die\"."
    )
