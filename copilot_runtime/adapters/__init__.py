"""LLM providers, one module each, behind the `ServiceAdapter` interface."""

from copilot_runtime.adapters.base import (
    ChatDelta,
    ChatRequest,
    ServiceAdapter,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
)
from copilot_runtime.adapters.demo import DemoAdapter
from copilot_runtime.adapters.openai import OpenAIAdapter

__all__ = [
    "ChatDelta",
    "ChatRequest",
    "DemoAdapter",
    "OpenAIAdapter",
    "ServiceAdapter",
    "StreamEnd",
    "TextDelta",
    "ToolCallDelta",
    "ToolSpec",
]
