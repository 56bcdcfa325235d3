"""Agent kinds, one module each, behind the `Agent` interface.

`LangGraphAgent` and `LangGraphPlatformAgent` need the `langgraph` / `platform` extras and
are imported on first use. The remote agents (`HttpAgent`, the remote endpoints) are
imported on first use too: their HTTP client (aiohttp) is ~14 MB that a worker serving only
its own agents never needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from copilot_runtime.agents.base import Agent, AgentThreadState, RunContext
from copilot_runtime.agents.builtin import BuiltInAgent
from copilot_runtime.headers import HeaderPolicy

if TYPE_CHECKING:
    from copilot_runtime.agents._http_client import Timeouts
    from copilot_runtime.agents.http import HttpAgent
    from copilot_runtime.agents.remote_endpoint import (
        CopilotKitRemoteEndpoint,
        RemoteDiscovery,
        RemoteEndpointAgent,
        RetryPolicy,
    )

__all__ = [
    "Agent",
    "AgentThreadState",
    "BuiltInAgent",
    "CopilotKitRemoteEndpoint",
    "HeaderPolicy",
    "HttpAgent",
    "LangGraphAgent",
    "LangGraphPlatformAgent",
    "RemoteDiscovery",
    "RemoteEndpointAgent",
    "RetryPolicy",
    "RunContext",
    "Timeouts",
]

_OPTIONAL = {
    "LangGraphAgent": ("copilot_runtime.agents.langgraph", "langgraph"),
    "LangGraphPlatformAgent": ("copilot_runtime.agents.langgraph_platform", "platform"),
}


_REMOTE = {
    "HttpAgent": "copilot_runtime.agents.http",
    "Timeouts": "copilot_runtime.agents._http_client",
    "CopilotKitRemoteEndpoint": "copilot_runtime.agents.remote_endpoint",
    "RemoteDiscovery": "copilot_runtime.agents.remote_endpoint",
    "RemoteEndpointAgent": "copilot_runtime.agents.remote_endpoint",
    "RetryPolicy": "copilot_runtime.agents.remote_endpoint",
}


def __getattr__(name: str) -> Any:
    if name in _REMOTE:
        import importlib

        value = getattr(importlib.import_module(_REMOTE[name]), name)
        globals()[name] = value
        return value
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
