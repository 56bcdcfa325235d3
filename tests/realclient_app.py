"""The runtime the real-client tests serve: the built-in agent on the loopback mock LLM with
the server-side action `getWeather`, as the TypeScript anchor runtimes have."""

from __future__ import annotations

import os
from typing import Any

from copilot_runtime import CopilotRuntime, OpenAIAdapter, action


@action
def getWeather(city: str) -> dict[str, Any]:
    """Get the current weather for a city."""
    return {"city": city, "temperature": 21, "unit": "celsius", "conditions": "sunny"}


def mock_llm_runtime() -> CopilotRuntime:
    """A runtime whose default agent talks to the mock at `LLM_BASE_URL`."""
    return CopilotRuntime(
        service_adapter=OpenAIAdapter(
            model="gpt-4o",
            base_url=os.environ.get("LLM_BASE_URL", "http://127.0.0.1:8090/v1"),
            api_key="sk-mock", max_retries=0),
        actions=[getWeather],
    )


runtime = mock_llm_runtime()
