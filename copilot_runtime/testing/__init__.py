"""Test doubles shipped with the library.

`MockOpenAIServer`, `MockAnthropicServer` and `MockGeminiServer` speak each provider's wire
format on loopback, so the real SDKs run end to end;
`ScriptedAdapter` is an in-process model with written answers; `verify_events` checks the
ordering rules AG-UI clients enforce.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EventOrderError",
    "LoopbackServer",
    "MockAnthropicServer",
    "MockGeminiServer",
    "MockOpenAIServer",
    "ScriptedAdapter",
    "text_turn",
    "tool_turn",
    "verify_events",
]


def __getattr__(name: str) -> Any:
    # Imported lazily so `python -m copilot_runtime.testing` does not import the module twice.
    if name == "MockOpenAIServer":
        from copilot_runtime.testing.mock_openai import MockOpenAIServer

        return MockOpenAIServer
    if name == "MockAnthropicServer":
        from copilot_runtime.testing.mock_anthropic import MockAnthropicServer

        return MockAnthropicServer
    if name == "MockGeminiServer":
        from copilot_runtime.testing.mock_gemini import MockGeminiServer

        return MockGeminiServer
    if name == "LoopbackServer":
        from copilot_runtime.testing.loopback import LoopbackServer

        return LoopbackServer
    if name in ("ScriptedAdapter", "text_turn", "tool_turn"):
        from copilot_runtime.testing import scripted

        return getattr(scripted, name)
    if name in ("EventOrderError", "verify_events"):
        from copilot_runtime.testing import verify

        return getattr(verify, name)
    raise AttributeError(name)
