"""Test doubles shipped with the library: a loopback OpenAI server and a scripted adapter."""

from __future__ import annotations

from typing import Any

__all__ = ["EventOrderError", "MockOpenAIServer", "verify_events"]


def __getattr__(name: str) -> Any:
    # Imported lazily so `python -m copilot_runtime.testing` does not import the module twice.
    if name == "MockOpenAIServer":
        from copilot_runtime.testing.mock_openai import MockOpenAIServer

        return MockOpenAIServer
    if name in ("EventOrderError", "verify_events"):
        from copilot_runtime.testing import verify

        return getattr(verify, name)
    raise AttributeError(name)
