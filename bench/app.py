"""The Python runtime as bench/run measures it.

Served with ``python -m copilot_runtime serve bench.app:runtime --path /api/copilotkit``; the
OpenAI adapter talks to the loopback mock LLM at ``$LLM_BASE_URL``. The one server-side action
matches the TypeScript servers in bench/ts-agui and bench/ts-graphql.

With ``BENCH_TRUST=1`` the runtime authenticates a bearer token (``$BENCH_TOKEN``, which
the ``python-trust`` target of bench/run sends) and checks input with a pattern guardrail:
the cost of serving many users, measured against the plain runtime.

``BENCH_PROVIDER=anthropic|gemini`` puts the Anthropic or Gemini adapter on that provider's
mock at ``$LLM_BASE_URL`` instead (the python-anthropic and python-gemini targets).

``BENCH_STORE`` picks a durable thread store (bench/soak.py sets it): a SQLite file path, or a
``postgresql://`` URL once `copilot_runtime.thread_store` can open one. ``BENCH_COORDINATOR``
names a shared coordinator (``postgresql://...`` or ``redis://...``) for one worker that
coordinates as if others were there (what `bench/profile` needs to see its cost).
"""

import os
from typing import Any

from copilot_runtime import BearerTokenAuth, CopilotRuntime, OpenAIAdapter, PatternGuardrail, action


@action
def getWeather(city: str) -> dict:  # camelCase: the name the client and the LLM see
    """Get the current weather for a city."""
    return {"city": city, "temperature": 21, "unit": "celsius", "conditions": "sunny"}


options: dict[str, Any] = {}
if os.environ.get("BENCH_TRUST"):
    options = {"auth": BearerTokenAuth({os.environ["BENCH_TOKEN"]: "bench-user"}),
               "guardrails": [PatternGuardrail(deny=[r"\bpassword\b", r"ignore (all )?previous"])]}


def _store(spec: str) -> Any:
    if spec.startswith(("postgresql://", "postgres://")):
        import copilot_runtime

        opener = getattr(copilot_runtime, "thread_store", None)
        if opener is None:
            raise SystemExit("BENCH_STORE: this copilot-runtime has no thread_store() for URLs")
        return opener(spec)
    from copilot_runtime.threads import SQLiteThreadStore

    return SQLiteThreadStore(spec.removeprefix("sqlite:"))


if os.environ.get("BENCH_STORE"):
    options["thread_store"] = _store(os.environ["BENCH_STORE"])
if os.environ.get("BENCH_COORDINATOR"):
    options["coordinator"] = os.environ["BENCH_COORDINATOR"]

def _adapter() -> Any:
    provider, url = os.environ.get("BENCH_PROVIDER", "openai"), os.environ["LLM_BASE_URL"]
    if provider == "anthropic":
        from copilot_runtime import AnthropicAdapter

        return AnthropicAdapter(api_key="sk-mock", base_url=url)
    if provider == "gemini":
        from copilot_runtime import GoogleGenAIAdapter

        return GoogleGenAIAdapter(api_key="mock-key", base_url=url)
    return OpenAIAdapter(model="gpt-4o", base_url=url, api_key="sk-mock")


runtime = CopilotRuntime(service_adapter=_adapter(), actions=[getWeather], **options)
