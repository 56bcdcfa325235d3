"""The demo runtime behind `copilot-runtime demo`: a default agent and two example actions.

With `OPENAI_API_KEY` or `OPENAI_BASE_URL` set it talks to that model (`OPENAI_MODEL`,
default gpt-4o-mini); without, to the offline demo model, so it runs with no key or network.
"""

from __future__ import annotations

import os
import random
from typing import Any

from copilot_runtime.actions import action
from copilot_runtime.adapters.base import ServiceAdapter
from copilot_runtime.adapters.demo import DemoAdapter
from copilot_runtime.adapters.openai import OpenAIAdapter
from copilot_runtime.runtime import CopilotRuntime
from copilot_runtime.threads.base import ThreadStore

__all__ = ["build_demo_runtime", "get_weather", "roll_dice"]

_CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy")


@action
def get_weather(city: str) -> dict[str, Any]:
    """Get the current weather for a city (demo data, the same for a city every time)."""
    seed = sum(city.lower().encode())
    return {"city": city, "temperature": 5 + seed % 25, "unit": "celsius",
            "conditions": _CONDITIONS[seed % len(_CONDITIONS)]}


@action
def roll_dice(sides: int = 6, count: int = 1) -> dict[str, Any]:
    """Roll `count` dice with `sides` sides each."""
    if not 2 <= sides <= 1000 or not 1 <= count <= 100:
        raise ValueError("sides must be 2-1000 and count 1-100")
    rolls = [random.randint(1, sides) for _ in range(count)]
    return {"rolls": rolls, "total": sum(rolls)}


def demo_adapter() -> tuple[ServiceAdapter, str]:
    """The configured model, or the offline one; and a line saying which."""
    base_url = os.environ.get("OPENAI_BASE_URL")
    if os.environ.get("OPENAI_API_KEY") or base_url:
        model = os.environ.get("OPENAI_MODEL", "gpt-4o-mini")
        where = base_url or "api.openai.com"
        return OpenAIAdapter(model=model, base_url=base_url), f"model {model} at {where}"
    return DemoAdapter(), "the offline demo model (set OPENAI_API_KEY for a real one)"


def build_demo_runtime(thread_store: ThreadStore | None = None) -> tuple[CopilotRuntime, str]:
    adapter, description = demo_adapter()
    runtime = CopilotRuntime(
        service_adapter=adapter,
        actions=[get_weather, roll_dice],
        instructions="You are the assistant of the copilot-runtime demo. Be brief.",
        thread_store=thread_store,
    )
    return runtime, description
