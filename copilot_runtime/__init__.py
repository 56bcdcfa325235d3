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
from copilot_runtime.adapters import DemoAdapter, EmptyAdapter, OpenAIAdapter, ServiceAdapter
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
    "AnthropicAdapter",
    "ApprovalPolicy",
    "BuiltInAgent",
    "CORSPolicy",
    "ConfigurationError",
    "CopilotEndpoint",
    "CopilotKitRemoteEndpoint",
    "CopilotRuntime",
    "CopilotRuntimeError",
    "DemoAdapter",
    "DurableCheckpointer",
    "EmptyAdapter",
    "GoogleGenAIAdapter",
    "HeaderPolicy",
    "HttpAgent",
    "InMemoryThreadStore",
    "InvalidRequestError",
    "LangChainAdapter",
    "LangGraphAgent",
    "LangGraphPlatformAgent",
    "MCPServer",
    "MCPToolset",
    "OpenAIAdapter",
    "Orchestrator",
    "PayloadTooLargeError",
    "RemoteDiscovery",
    "RemoteEndpointAgent",
    "RequestError",
    "RetryPolicy",
    "ReviewLoop",
    "RunContext",
    "RunInput",
    "SQLiteThreadStore",
    "ServiceAdapter",
    "Step",
    "ThreadBusyError",
    "ThreadStore",
    "Timeouts",
    "UpstreamError",
    "UpstreamTimeoutError",
    "__version__",
    "action",
    "approval_service",
    "checkpointer",
    "create_app",
    "existing_agent",
    "mount_runtime",
]


_LAZY = {
    # These need optional extras (langgraph, platform, postgres, anthropic, google,
    # langchain, mcp): imported when asked for.
    "AnthropicAdapter": "copilot_runtime.adapters",
    "GoogleGenAIAdapter": "copilot_runtime.adapters",
    "LangChainAdapter": "copilot_runtime.adapters",
    "MCPServer": "copilot_runtime.mcp_tools",
    "MCPToolset": "copilot_runtime.mcp_tools",
    "LangGraphAgent": "copilot_runtime.agents",
    "LangGraphPlatformAgent": "copilot_runtime.agents",
    "checkpointer": "copilot_runtime.checkpointers",
    "DurableCheckpointer": "copilot_runtime.checkpointers",
    "ReviewLoop": "copilot_runtime.workflows",
    "Orchestrator": "copilot_runtime.workflows",
    "Step": "copilot_runtime.workflows",
    "ApprovalPolicy": "copilot_runtime.workflows",
    "existing_agent": "copilot_runtime.workflows",
    "approval_service": "copilot_runtime.workflows",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
