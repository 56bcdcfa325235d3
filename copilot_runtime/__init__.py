"""copilot-runtime: the CopilotKit runtime, in Python.

The public API is what this module exports; everything in a module whose name starts with
an underscore is private and may change.
"""

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
from copilot_runtime.agents import Agent, BuiltInAgent, RunContext
from copilot_runtime.asgi import CopilotEndpoint, create_app, mount_runtime
from copilot_runtime.protocols._http import CORSPolicy
from copilot_runtime.runtime import CopilotRuntime
from copilot_runtime.threads import InMemoryThreadStore, SQLiteThreadStore, ThreadStore

__all__ = [
    "Action",
    "ActionError",
    "Agent",
    "AgentNotFoundError",
    "BuiltInAgent",
    "CORSPolicy",
    "ConfigurationError",
    "CopilotEndpoint",
    "CopilotRuntime",
    "CopilotRuntimeError",
    "DemoAdapter",
    "InMemoryThreadStore",
    "InvalidRequestError",
    "OpenAIAdapter",
    "PayloadTooLargeError",
    "RequestError",
    "RunContext",
    "RunInput",
    "SQLiteThreadStore",
    "ServiceAdapter",
    "ThreadBusyError",
    "ThreadStore",
    "UpstreamError",
    "UpstreamTimeoutError",
    "__version__",
    "action",
    "create_app",
    "mount_runtime",
]
