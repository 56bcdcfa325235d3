"""The adapter the environment configures, for the CLI's demo (and any app that wants it).

`COPILOT_RUNTIME_PROVIDER` (openai, anthropic, google) chooses when several keys are set;
otherwise the first configured of: `OPENAI_API_KEY` or `OPENAI_BASE_URL`, `ANTHROPIC_API_KEY`,
`GOOGLE_API_KEY` / `GEMINI_API_KEY`. Models: `OPENAI_MODEL`, `ANTHROPIC_MODEL`, `GEMINI_MODEL`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime.adapters.base import ServiceAdapter

__all__ = ["adapter_from_env"]

_PROVIDERS = ("openai", "anthropic", "google")


def _configured(provider: str, env: Mapping[str, str]) -> bool:
    if provider == "openai":
        return bool(env.get("OPENAI_API_KEY") or env.get("OPENAI_BASE_URL"))
    if provider == "anthropic":
        return bool(env.get("ANTHROPIC_API_KEY"))
    return bool(env.get("GOOGLE_API_KEY") or env.get("GEMINI_API_KEY"))


def adapter_from_env(env: Mapping[str, str] | None = None,
                     ) -> tuple[ServiceAdapter, str] | None:
    """(adapter, a line saying which model where), or None when no provider is configured."""
    env = os.environ if env is None else env
    chosen = env.get("COPILOT_RUNTIME_PROVIDER", "").strip().lower()
    if chosen and chosen not in _PROVIDERS:
        raise ConfigurationError(f"COPILOT_RUNTIME_PROVIDER must be one of "
                                 f"{', '.join(_PROVIDERS)}, not {chosen!r}")
    provider = chosen or next((p for p in _PROVIDERS if _configured(p, env)), None)
    if provider is None:
        return None
    try:
        if provider == "anthropic":
            from copilot_runtime.adapters.anthropic import DEFAULT_MODEL, AnthropicAdapter

            model = env.get("ANTHROPIC_MODEL", DEFAULT_MODEL)
            return (AnthropicAdapter(model=model, api_key=env.get("ANTHROPIC_API_KEY")),
                    f"model {model} at Anthropic")
        if provider == "google":
            from copilot_runtime.adapters.google import GoogleGenAIAdapter

            model = env.get("GEMINI_MODEL", "gemini-2.5-flash")
            key = env.get("GOOGLE_API_KEY") or env.get("GEMINI_API_KEY")
            return GoogleGenAIAdapter(model=model, api_key=key), f"model {model} at Google"
    except ImportError as exc:
        raise ConfigurationError(
            f"The {provider} provider needs its extra: pip install "
            f"'copilot-runtime[{provider}]' ({exc})") from None
    from copilot_runtime.adapters.openai import OpenAIAdapter

    base_url = env.get("OPENAI_BASE_URL")
    model = env.get("OPENAI_MODEL", "gpt-4o-mini")
    return (OpenAIAdapter(model=model, base_url=base_url, api_key=env.get("OPENAI_API_KEY")),
            f"model {model} at {base_url or 'api.openai.com'}")
