"""copilot-runtime: the CopilotKit runtime, in Python.

The public API is what this module exports; everything in a module whose name starts with
an underscore is private and may change.
"""

from typing import Any

from copilot_runtime._exceptions import (
    ActionError,
    AgentNotFoundError,
    ConfigurationError,
    CopilotRuntimeError,
    InvalidRequestError,
    PayloadTooLargeError,
    RequestError,
    ThreadBusyError,
    UpstreamError,
    UpstreamTimeoutError,
)
from copilot_runtime._input import RunInput
from copilot_runtime._version import __version__
from copilot_runtime.actions import Action, action
from copilot_runtime.adapters import DemoAdapter, OpenAIAdapter, ServiceAdapter
from copilot_runtime.agents import (
    Agent,
    AgentThreadState,
    BuiltInAgent,
    CopilotKitRemoteEndpoint,
    HeaderPolicy,
    HttpAgent,
    RemoteDiscovery,
    RemoteEndpointAgent,
    RetryPolicy,
    RunContext,
    Timeouts,
)
from copilot_runtime.asgi import CopilotEndpoint, create_app, mount_runtime
from copilot_runtime.protocols._http import CORSPolicy
from copilot_runtime.runtime import CopilotRuntime
from copilot_runtime.threads import InMemoryThreadStore, SQLiteThreadStore, ThreadStore

__all__ = [
    "Action",
    "ActionError",
    "Agent",
    "AgentNotFoundError",
    "AgentThreadState",
    "BuiltInAgent",
    "CORSPolicy",
    "ConfigurationError",
    "CopilotEndpoint",
    "CopilotKitRemoteEndpoint",
    "CopilotRuntime",
    "CopilotRuntimeError",
    "DemoAdapter",
    "HeaderPolicy",
    "HttpAgent",
    "InMemoryThreadStore",
    "InvalidRequestError",
    "LangGraphAgent",
    "LangGraphPlatformAgent",
    "OpenAIAdapter",
    "PayloadTooLargeError",
    "RemoteDiscovery",
    "RemoteEndpointAgent",
    "RequestError",
    "RetryPolicy",
    "RunContext",
    "RunInput",
    "SQLiteThreadStore",
    "ServiceAdapter",
    "ThreadBusyError",
    "ThreadStore",
    "Timeouts",
    "UpstreamError",
    "UpstreamTimeoutError",
    "__version__",
    "action",
    "create_app",
    "mount_runtime",
]


def __getattr__(name: str) -> Any:
    # The LangGraph agents need optional extras; import them only when asked for.
    if name in ("LangGraphAgent", "LangGraphPlatformAgent"):
        from copilot_runtime import agents

        return getattr(agents, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
