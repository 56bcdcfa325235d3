"""An offline, deterministic stand-in for an LLM, for demos and tests without a key.

It says plainly that it is not a real model. It calls a declared tool when the user names
it, as it is or in words in order ("set the accent colour" for `set_accent_color`; an enum
argument takes the value the user named), or asks about the weather or for a dice roll and
such tools exist; after a tool result it reports what the tool returned. Arguments come from
the wording: a city after "in", "for" or "at" ("weather in paris today?" -> "Paris"), numbers
before or after a parameter's name or in dice notation ("3 dice with 20 sides", "2d8"),
within the schema's bounds; all of it from the message's first 4,000 characters. When the
city or the value of an enum is missing or not offered, it says what it can do instead of
calling the tool. Answers stream word by word, then in larger pieces, so a long one ends
within a few seconds; a long message is quoted in part.
"""

from __future__ import annotations

import asyncio
import bisect
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

_CITY_START = re.compile(r"\b(?:in|for|at)\s+", re.IGNORECASE)
_WORD = re.compile(r"[^\W\d_][\w'\-]*")
_SPACES = re.compile(r" +")
_WORD_RUN = re.compile(r"\w+")
#: What may come between a parameter's name and its number: the rest of the word, then
#: "of", "=" or ":" ("sides of 20", "count: 3"). Possessive (`*+`): nothing is tried twice,
#: so a run of spaces costs its length, not its square.
_NUMBER_AFTER = re.compile(r"\w*+\s*+(?:(?:of|=|:)\s*+)?(\d+(?:\.\d+)?)\b")
#: The tool choice and its arguments read the message's first 4,000 characters only: a tool
#: or a number named further on is not looked for, and a long message costs no more.
_READ_CHARS = 4_000
#: And a tool's first 32 parameters and an enum's first 64 values only: each costs a search
#: of the message (a page declaring 20,000 numbers held the server 15 s); the rest of the
#: required ones get defaults.
_READ_PARAMETERS = 32
_READ_VALUES = 64
#: Words that end a city's name ("in Paris today", "for London this weekend please").
_NOT_CITY = frozenset({
    "today", "tomorrow", "tonight", "now", "right", "currently", "later", "soon", "this",
    "next", "these", "that", "the", "a", "an", "me", "us", "please", "thanks", "week",
    "weekend", "morning", "afternoon", "evening", "night", "and", "or", "but", "in", "for",
    "at", "on", "of", "with", "is", "are", "was", "will", "be", "like"
})
_CITY_WORDS = 4
_CITY_ARGUMENTS = ("city", "location", "place")
_SIDES_ARGUMENTS = ("sides", "faces")
_COUNT_ARGUMENTS = ("count", "number", "times", "n")
#: Colours a user may name: one of them that the tool's enum does not offer is refused.
_COLOURS = frozenset({
    "red", "blue", "green", "yellow", "orange", "purple", "violet", "pink", "black", "white",
    "grey", "gray", "brown", "cyan", "magenta", "teal", "crimson", "indigo", "navy", "gold",
    "silver", "maroon", "olive", "lime", "turquoise", "beige"
})
#: The quote of the user's message, and how many words stream one by one before the rest
#: goes in larger pieces (each piece waits `delay`: at most ~150 pieces, 3 s at 20 ms).
_QUOTE_CHARS = 200
_SINGLE_WORDS = 100
_GROUPED_PIECES = 50


class DemoAdapter:
    provider = "demo"

    def __init__(self, *, delay: float = 0.02) -> None:
        self.delay = delay

    async def aclose(self) -> None:
        return None

    async def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        choice = None if request.tool_choice == "none" else _choose_tool(request)
        if isinstance(choice, tuple):
            name, arguments = choice
            seed = f"{len(request.messages)}:{name}:{arguments}".encode()
            call_id = "call_demo_" + hashlib.sha256(seed).hexdigest()[:16]
            yield [ToolCallDelta(0, call_id, name, arguments)]
            yield [StreamEnd("tool_calls")]
            return
        answer = choice if isinstance(choice, str) else _answer(request)
        for piece in _pieces(answer):
            if self.delay:
                await asyncio.sleep(self.delay)
            yield [TextDelta(piece)]
        yield [StreamEnd("stop")]


def _last_user_text(request: ChatRequest) -> str:
    for message in reversed(request.messages):
        if isinstance(message, UserMessage):
            content = message.content
            if isinstance(content, str):
                return content
            return " ".join(getattr(p, "text", "") or "" for p in content)
    return ""


def _pieces(answer: str) -> list[str]:
    """`answer` as streamed: word by word, then the rest in at most `_GROUPED_PIECES` pieces."""
    words: list[str] = re.findall(r"\S+\s*", answer)
    if len(words) <= _SINGLE_WORDS:
        return words
    rest = words[_SINGLE_WORDS:]
    size = -(-len(rest) // _GROUPED_PIECES)
    return words[:_SINGLE_WORDS] + ["".join(rest[i:i + size]) for i in range(0, len(rest), size)]


def _choose_tool(request: ChatRequest) -> tuple[str, str] | str | None:
    """The tool to call and its arguments (JSON); or why a tool asked for cannot be called,
    as the answer; or None: no tool asked for."""
    if not request.messages or not isinstance(request.messages[-1], UserMessage):
        return None
    text = _last_user_text(request)[:_READ_CHARS]
    lowered = text.lower()
    tools = {t.name: t for t in request.tools}
    spoken = _word_positions(lowered.replace("colour", "color"))
    for name, tool in tools.items():
        # "set_accent_color" is named either as it is or in words ("set the accent colour").
        words = name.lower().replace("-", "_").split("_")
        if name.lower() in lowered or _in_order(words, spoken):
            return _call(tool, text)
    if "weather" in lowered:
        for name, tool in tools.items():
            if "weather" in name.lower():
                return _call(tool, text)
    if re.search(r"\b(dice|die|roll)\b", lowered):
        for name, tool in tools.items():
            if "dice" in name.lower() or "roll" in name.lower():
                return _call(tool, text)
    return None


def _call(tool: ToolSpec, text: str) -> tuple[str, str] | str:
    arguments = _arguments_for(tool, text)
    if isinstance(arguments, str):
        return f"(Offline demo model) {arguments}"
    return tool.name, orjson.dumps(arguments).decode()


def _word_positions(text: str) -> dict[str, list[int]]:
    """Each word of `text` (a run of letters, digits and "_") and where it is: its indexes,
    in order, in the text's list of words."""
    positions: dict[str, list[int]] = {}
    for index, word in enumerate(_WORD_RUN.findall(text)):
        positions.setdefault(word, []).append(index)
    return positions


def _in_order(words: list[str], positions: dict[str, list[int]]) -> bool:
    """Whether all of `words` (two or more) are words of the text of `positions`, in that
    order. Each is the first of its kind after the one before, found by bisection: a tool
    costs a few steps per word, however long the text (a regex `a.*?b.*?c` backtracked: a
    short message took minutes)."""
    if len(words) < 2 or not all(words):
        return False
    before = -1
    for word in words:
        found = positions.get(word, [])
        after = bisect.bisect_right(found, before)
        if after == len(found):
            return False
        before = found[after]
    return True


def _city(text: str) -> str | None:
    """The place named after "in", "for" or "at", up to punctuation or a word such as "today"."""
    for start in _CITY_START.finditer(text):
        words: list[str] = []
        position = start.end()
        while len(words) < _CITY_WORDS:
            word = _WORD.match(text, position)
            if word is None or word.group().lower() in _NOT_CITY:
                break
            words.append(word.group())
            position = word.end()
            gap = _SPACES.match(text, position)
            if gap is None:
                break  # punctuation, or the end
            position = gap.end()
        if words:
            # Typed in lower case ("paris"): capitalised; "Rio de Janeiro" stays as typed.
            if not any(c.isupper() for word in words for c in word):
                words = [w[:1].upper() + w[1:] for w in words]
            return " ".join(words)
    return None


def _number_for(name: str, spec: dict[str, Any], text: str) -> int | float | None:
    """The number `text` gives the parameter `name` ("20 sides", "a 12-sided die", "sides 20";
    "d20" and "2d8" for sides and count; "3 dice" for a count), within the schema's bounds."""
    stem = re.escape(name.lower().rstrip("s"))
    dice = re.search(r"\b(\d*)d(\d+)\b", text)
    before = re.search(rf"\b(\d+(?:\.\d+)?)[\s-]*{stem}", text)
    after = None if before else _number_after(stem, text)
    if before:
        value = before.group(1)
    elif after is not None:
        value = after
    elif dice and name.lower() in _SIDES_ARGUMENTS:
        value = dice.group(2)
    elif dice and dice.group(1) and name.lower() in _COUNT_ARGUMENTS:
        value = dice.group(1)
    elif name.lower() in _COUNT_ARGUMENTS and (
            counted := re.search(r"\b(\d+)\s+(?:dice|die|times|rolls?)\b", text)):
        value = counted.group(1)
    else:
        return None
    number: int | float = int(float(value)) if spec.get("type") == "integer" else float(value)
    if isinstance(spec.get("minimum"), int | float):
        number = max(number, spec["minimum"])
    if isinstance(spec.get("maximum"), int | float):
        number = min(number, spec["maximum"])
    return number


def _number_after(stem: str, text: str) -> str | None:
    """The number after the first word that begins with `stem` and is followed by one
    ("sides 20", "sides: 20", "count of 3")."""
    for word in re.finditer(rf"\b{stem}", text):
        number = _NUMBER_AFTER.match(text, word.end())
        if number:
            return number.group(1)
    return None


def _arguments_for(tool: ToolSpec, text: str) -> dict[str, Any] | str:
    """Plausible arguments: a city and numbers the user named, otherwise simple defaults per
    type; or, when a city or an enum's value is missing or not offered, what it can do."""
    properties = tool.parameters.get("properties") or {}
    listed = tool.parameters.get("required")
    required = {r for r in listed if isinstance(r, str)} if isinstance(listed, list) else set()
    lowered = text.lower()
    arguments: dict[str, Any] = {}
    city = _city(text)
    named_colours = [c for c in re.findall(r"[a-z]+", lowered) if c in _COLOURS]
    for index, (name, spec) in enumerate(properties.items()):
        spec = spec if isinstance(spec, dict) else {}
        kind = spec.get("type")
        read = lowered if index < _READ_PARAMETERS else ""
        if kind in ("integer", "number"):
            number = _number_for(name, spec, read) if read else None
            if number is not None:
                arguments[name] = number
            elif name in required:
                arguments[name] = spec.get("default", 6)
        elif name not in required:
            continue
        elif name.lower() in _CITY_ARGUMENTS:
            if city is None:
                return ('Name a city for the weather, e.g. "What is the weather in Paris?" '
                        "A real model would ask which one.")
            arguments[name] = city
        elif kind == "boolean":
            arguments[name] = True
        elif spec.get("enum"):
            offered = [v for v in spec["enum"] if isinstance(v, str)]
            named = [v for v in offered[:_READ_VALUES] if read and re.search(
                rf"\b{re.escape(v.lower())}\b", read)]
            lowered_offered = {v.lower() for v in offered}
            other_colours = [c for c in named_colours if c not in lowered_offered]
            if not named and other_colours and any(v.lower() in _COLOURS for v in offered):
                return (f"I cannot set {other_colours[0]} with {tool.name}. "
                        f"I can set: {', '.join(offered)}.")
            arguments[name] = named[0] if named else spec["enum"][0]
        else:
            arguments[name] = city or "demo"
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
    if len(text) > _QUOTE_CHARS:
        text = f"{text[:_QUOTE_CHARS].rstrip()}... ({len(text)} characters)"
    tools = ", ".join(t.name for t in request.tools) or "none"
    return (
        "I am the offline demo model of copilot-runtime, not a real LLM: set OPENAI_API_KEY "
        "(or OPENAI_BASE_URL for an OpenAI-compatible server) to talk to one. "
        f"You said: \"{text}\". Tools I can call: {tools}. "
        "Try \"What is the weather in Paris?\" or \"Roll a die\"."
    )
