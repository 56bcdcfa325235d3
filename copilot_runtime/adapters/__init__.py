"""LLM providers, one module each, behind the `ServiceAdapter` interface.

`AnthropicAdapter`, `GoogleGenAIAdapter` and `LangChainAdapter` need the `anthropic`,
`google` and `langchain` extras and are imported on first use.
"""

from __future__ import annotations

from typing import Any

from copilot_runtime.adapters.base import (
    ChatDelta,
    ChatRequest,
    EncryptedReasoning,
    ReasoningDelta,
    ServiceAdapter,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
)
from copilot_runtime.adapters.demo import DemoAdapter
from copilot_runtime.adapters.empty import EmptyAdapter
from copilot_runtime.adapters.openai import OpenAIAdapter
from copilot_runtime.adapters.transcription import OpenAITranscription, Transcriber

__all__ = [
    "AnthropicAdapter",
    "ChatDelta",
    "ChatRequest",
    "DemoAdapter",
    "EmptyAdapter",
    "EncryptedReasoning",
    "GoogleGenAIAdapter",
    "LangChainAdapter",
    "OpenAIAdapter",
    "OpenAITranscription",
    "ReasoningDelta",
    "ServiceAdapter",
    "StreamEnd",
    "TextDelta",
    "ToolCallDelta",
    "ToolSpec",
    "Transcriber",
]

_OPTIONAL = {
    "AnthropicAdapter": ("copilot_runtime.adapters.anthropic", "anthropic"),
    "GoogleGenAIAdapter": ("copilot_runtime.adapters.google", "google"),
    "LangChainAdapter": ("copilot_runtime.adapters.langchain", "langchain"),
}


def __getattr__(name: str) -> Any:
    if name in _OPTIONAL:
        import importlib

        module_name, extra = _OPTIONAL[name]
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(
                f"{name} needs the '{extra}' extra: pip install 'copilot-runtime[{extra}]' "
                f"({exc})") from exc
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
