"""copilot-runtime: the CopilotKit runtime, in Python.

The public API is what this module exports; everything in a module whose name starts with
an underscore is private and may change.
"""

from typing import TYPE_CHECKING, Any

from copilot_runtime._exceptions import (
    ActionError,
    AgentExecutionError,
    AgentNotFoundError,
    ApprovalClosedError,
    ApprovalError,
    ApprovalNotFoundError,
    AuthenticationError,
    ConfigurationError,
    ContentFilteredError,
    CopilotRuntimeError,
    InvalidRequestError,
    JSONTooDeepError,
    ModelNotAllowedError,
    NothingToResumeError,
    OutputTruncatedError,
    PayloadTooLargeError,
    RateLimitedError,
    RequestError,
    RequestRejectedError,
    RequestTimeoutError,
    ServiceUnavailableError,
    ThreadBusyError,
    ThreadNotFoundError,
    TranscriptionError,
    UnsupportedEncodingError,
    UnsupportedMediaTypeError,
    UpstreamConnectionError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeoutError,
)
from copilot_runtime._input import RunInput
from copilot_runtime._version import __version__
from copilot_runtime.actions import Action, action
from copilot_runtime.adapters import (
    DemoAdapter,
    EmptyAdapter,
    OpenAIAdapter,
    OpenAITranscription,
    ServiceAdapter,
)
from copilot_runtime.agents import (
    Agent,
    AgentThreadState,
    BuiltInAgent,
    HeaderPolicy,
    RunContext,
)
from copilot_runtime.asgi import CopilotEndpoint, create_app, mount_runtime
from copilot_runtime.auth import BearerTokenAuth, JWTAuth, Principal
from copilot_runtime.coordination import Coordinator, coordinator
from copilot_runtime.guardrails import PatternGuardrail, TopicGuardrail, Verdict
from copilot_runtime.limits import RateLimit
from copilot_runtime.protocols.http import CORSPolicy
from copilot_runtime.runtime import CopilotRuntime, approval_service
from copilot_runtime.threads import (
    DurableThreadStore,
    InMemoryThreadStore,
    SQLiteThreadStore,
    ThreadStore,
    thread_store,
)

if TYPE_CHECKING:
    from copilot_runtime.agents import (
        CopilotKitRemoteEndpoint,
        HttpAgent,
        RemoteDiscovery,
        RemoteEndpointAgent,
        RetryPolicy,
        Timeouts,
    )

__all__ = [
    "Action",
    "ActionError",
    "Agent",
    "AgentExecutionError",
    "AgentNotFoundError",
    "AgentThreadState",
    "AnthropicAdapter",
    "ApprovalClosedError",
    "ApprovalError",
    "ApprovalNotFoundError",
    "ApprovalPolicy",
    "AuthenticationError",
    "BearerTokenAuth",
    "BuiltInAgent",
    "CORSPolicy",
    "ConfigurationError",
    "ContentFilteredError",
    "Coordinator",
    "CopilotEndpoint",
    "CopilotKitRemoteEndpoint",
    "CopilotRuntime",
    "CopilotRuntimeError",
    "DemoAdapter",
    "DurableCheckpointer",
    "DurableThreadStore",
    "EmptyAdapter",
    "GoogleGenAIAdapter",
    "HeaderPolicy",
    "HttpAgent",
    "InMemoryThreadStore",
    "InvalidRequestError",
    "JSONTooDeepError",
    "JWTAuth",
    "LangChainAdapter",
    "LangGraphAgent",
    "LangGraphPlatformAgent",
    "MCPServer",
    "MCPToolset",
    "ModelNotAllowedError",
    "NothingToResumeError",
    "OpenAIAdapter",
    "OpenAITranscription",
    "Orchestrator",
    "OutputTruncatedError",
    "PatternGuardrail",
    "PayloadTooLargeError",
    "PostgresThreadStore",
    "Principal",
    "RateLimit",
    "RateLimitedError",
    "RemoteDiscovery",
    "RemoteEndpointAgent",
    "RequestError",
    "RequestRejectedError",
    "RequestTimeoutError",
    "RetryPolicy",
    "ReviewLoop",
    "RunContext",
    "RunInput",
    "SQLiteThreadStore",
    "ServiceAdapter",
    "ServiceUnavailableError",
    "Step",
    "ThreadBusyError",
    "ThreadNotFoundError",
    "ThreadStore",
    "Timeouts",
    "TopicGuardrail",
    "TranscriptionError",
    "UnsupportedEncodingError",
    "UnsupportedMediaTypeError",
    "UpstreamConnectionError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamTimeoutError",
    "Verdict",
    "__version__",
    "action",
    "approval_service",
    "checkpointer",
    "coordinator",
    "create_app",
    "existing_agent",
    "mount_runtime",
    "thread_store",
]


_LAZY: dict[str, tuple[str, str | None]] = {
    # Remote agents: on first use (their HTTP client is aiohttp). name: (module, extra)
    "HttpAgent": ("copilot_runtime.agents", None),
    "Timeouts": ("copilot_runtime.agents", None),
    "CopilotKitRemoteEndpoint": ("copilot_runtime.agents", None),
    "RemoteDiscovery": ("copilot_runtime.agents", None),
    "RemoteEndpointAgent": ("copilot_runtime.agents", None),
    "RetryPolicy": ("copilot_runtime.agents", None),
    # These need optional extras: imported when asked for.
    "AnthropicAdapter": ("copilot_runtime.adapters", "anthropic"),
    "GoogleGenAIAdapter": ("copilot_runtime.adapters", "google"),
    "LangChainAdapter": ("copilot_runtime.adapters", "langchain"),
    "MCPServer": ("copilot_runtime.mcp_tools", "mcp"),
    "MCPToolset": ("copilot_runtime.mcp_tools", "mcp"),
    "LangGraphAgent": ("copilot_runtime.agents", "langgraph"),
    "LangGraphPlatformAgent": ("copilot_runtime.agents", "platform"),
    "checkpointer": ("copilot_runtime.checkpointers", "langgraph"),
    "DurableCheckpointer": ("copilot_runtime.checkpointers", "langgraph"),
    "PostgresThreadStore": ("copilot_runtime.threads.postgres", "postgres"),
    "ReviewLoop": ("copilot_runtime.workflows", "langgraph"),
    "Orchestrator": ("copilot_runtime.workflows", "langgraph"),
    "Step": ("copilot_runtime.workflows", "langgraph"),
    "ApprovalPolicy": ("copilot_runtime.workflows", "langgraph"),
    "existing_agent": ("copilot_runtime.workflows", "langgraph"),
}


def __getattr__(name: str) -> Any:
    entry = _LAZY.get(name)
    if entry is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, extra = entry
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if extra is None or (exc.name is not None
                             and exc.name.split(".")[0] == "copilot_runtime"):
            raise
        raise ImportError(f"{name} needs the {extra} extra: pip install "
                          f"'copilot-runtime[{extra}]' (missing: {exc.name})",
                          name=exc.name) from exc
