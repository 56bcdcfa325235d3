"""The runtime bench/scale.py serves: bench/app.py's agent, with threads at `SCALE_THREADS`
and runs coordinated by `SCALE_COORDINATOR` (both optional)."""

import os

from bench.app import getWeather
from copilot_runtime import CopilotRuntime, OpenAIAdapter


def _store():  # type: ignore[no-untyped-def]
    url = os.environ.get("SCALE_THREADS")
    if not url:
        return None
    from copilot_runtime import thread_store

    return thread_store(url)


runtime = CopilotRuntime(
    service_adapter=OpenAIAdapter(model="gpt-4o", base_url=os.environ["LLM_BASE_URL"],
                                  api_key="sk-mock"),
    actions=[getWeather],
    thread_store=_store(),
    coordinator=os.environ.get("SCALE_COORDINATOR"),
)
