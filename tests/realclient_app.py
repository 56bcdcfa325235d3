"""The runtime the real-client tests drive: the built-in agent on the loopback mock LLM."""

from __future__ import annotations

import os
from typing import Any

from copilot_runtime import CopilotRuntime, OpenAIAdapter, action


@action
def getWeather(city: str) -> dict[str, Any]:
    """Get the current weather for a city."""
    return {"city": city, "temperature": 21, "unit": "celsius", "conditions": "sunny"}


runtime = CopilotRuntime(
    service_adapter=OpenAIAdapter(
        model="gpt-4o", base_url=os.environ.get("LLM_BASE_URL", "http://127.0.0.1:8090/v1"),
        api_key="sk-mock", max_retries=0),
    actions=[getWeather],
)
