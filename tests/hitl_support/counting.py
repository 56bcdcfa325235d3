"""A model adapter that writes down every call, so a test can tell a repeated call."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from ag_ui.core import UserMessage

from copilot_runtime.adapters.base import ChatDelta, ChatRequest, ServiceAdapter


class CountingAdapter:
    """Delegates to `inner`; appends `{"specialist", "task", "iteration", "revision"}` to
    `log` (one JSON line per call, written before the answer streams)."""

    def __init__(self, inner: ServiceAdapter, log: str | None) -> None:
        self.inner = inner
        self.log = Path(log) if log else None
        self.provider = inner.provider

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        if self.log is not None:
            prompt = next((m.content for m in reversed(request.messages)
                           if isinstance(m, UserMessage) and isinstance(m.content, str)), "")
            who = re.search(r"You are the (\w+) specialist", request.system_prompt or "")
            with self.log.open("a") as out:  # closed at once: a SIGKILL loses nothing
                out.write(json.dumps({
                    "specialist": who.group(1) if who else None,
                    "task": _field(prompt, "Task:"), "iteration": _field(prompt, "Iteration:"),
                    "revision": _field(prompt, "Revision requested:"), "prompt": prompt,
                }) + "\n")
        async for batch in self.inner.stream(request):
            yield batch


def _field(prompt: str, prefix: str) -> str | None:
    for line in prompt.splitlines():
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    return None


def calls(log: Path, task: str) -> list[dict[str, object]]:
    """The logged calls for `task`."""
    if not log.exists():
        return []
    found = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [c for c in found if c["task"] == task]
