"""The runtime the real-client tests serve: the built-in agent on the loopback mock LLM with
the server-side action `getWeather`, as the TypeScript anchor runtimes have. `LLM_PROVIDER`
(openai, anthropic, google) picks the adapter and so the mock's wire format. With
`MCP_WEATHER=1` the same `getWeather` comes from a real MCP server (a stdio child process)
instead of a Python action."""

from __future__ import annotations

import os
from typing import Any

from copilot_runtime import CopilotRuntime, OpenAIAdapter, ServiceAdapter, action


@action
def getWeather(city: str) -> dict[str, Any]:
    """Get the current weather for a city."""
    return {"city": city, "temperature": 21, "unit": "celsius", "conditions": "sunny"}


def mock_llm_adapter() -> ServiceAdapter:
    """The adapter `LLM_PROVIDER` names (openai by default), on the mock at `LLM_BASE_URL`."""
    provider = os.environ.get("LLM_PROVIDER", "openai")
    base_url = os.environ.get("LLM_BASE_URL", "http://127.0.0.1:8090/v1")
    if provider == "anthropic":
        from copilot_runtime import AnthropicAdapter

        return AnthropicAdapter(model="claude-mock", base_url=base_url, api_key="sk-mock",
                                max_retries=0)
    if provider == "google":
        from copilot_runtime import GoogleGenAIAdapter

        return GoogleGenAIAdapter(model="gemini-mock", base_url=base_url, api_key="mock-key",
                                  max_retries=0)
    return OpenAIAdapter(model="gpt-4o", base_url=base_url, api_key="sk-mock", max_retries=0)


def mock_llm_runtime() -> CopilotRuntime:
    """A runtime whose default agent talks to the mock at `LLM_BASE_URL`."""
    if os.environ.get("MCP_WEATHER"):
        import sys
        from pathlib import Path

        from copilot_runtime import MCPServer

        servers = Path(__file__).parent / "mcp_support" / "servers.py"
        return CopilotRuntime(service_adapter=mock_llm_adapter(), mcp_servers=[
            MCPServer.stdio(sys.executable, [str(servers), "getweather"])])
    return CopilotRuntime(service_adapter=mock_llm_adapter(), actions=[getWeather])


runtime = mock_llm_runtime()
