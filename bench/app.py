"""The Python runtime as bench/run measures it.

Served with ``python -m copilot_runtime serve bench.app:runtime --path /api/copilotkit``; the
OpenAI adapter talks to the loopback mock LLM at ``$LLM_BASE_URL``. The one server-side action
matches the TypeScript servers in bench/ts-agui and bench/ts-graphql.
"""

import os

from copilot_runtime import CopilotRuntime, OpenAIAdapter, action


@action
def getWeather(city: str) -> dict:  # camelCase: the name the client and the LLM see
    """Get the current weather for a city."""
    return {"city": city, "temperature": 21, "unit": "celsius", "conditions": "sunny"}


runtime = CopilotRuntime(
    service_adapter=OpenAIAdapter(
        model="gpt-4o", base_url=os.environ["LLM_BASE_URL"], api_key="sk-mock"
    ),
    actions=[getWeather],
)
