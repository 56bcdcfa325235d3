"""The runtime `tests/test_graphql_real_client.py` serves: the built-in agent on the loopback
mock LLM with the server-side action `getWeather`, as the TypeScript anchor runtime has.

CORS reflects the origin and allows credentials, as the 1.10 runtime's GraphQL server does by
default (a browser client configured with `credentials: "include"` needs that).
"""

from __future__ import annotations

import os
from typing import Any

from copilot_runtime import CopilotRuntime, CORSPolicy, OpenAIAdapter, action, create_app


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
app = create_app(runtime, "/copilotkit", cors=CORSPolicy(allow_credentials=True))
