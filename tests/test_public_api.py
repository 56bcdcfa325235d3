"""The public API is exactly what `copilot_runtime.__all__` says; changing it is deliberate."""

from __future__ import annotations

import copilot_runtime
from copilot_runtime import testing

EXPECTED = [
    "Action", "ActionError", "Agent", "AgentNotFoundError", "AnthropicAdapter", "EmptyAdapter",
    "GoogleGenAIAdapter", "LangChainAdapter", "MCPServer", "MCPToolset", "AgentThreadState",
    "BuiltInAgent",
    "CORSPolicy",
    "CopilotKitRemoteEndpoint", "HeaderPolicy", "HttpAgent", "LangGraphAgent",
    "LangGraphPlatformAgent", "RemoteDiscovery", "RemoteEndpointAgent", "RetryPolicy", "Timeouts",
    "ConfigurationError", "CopilotEndpoint", "CopilotRuntime", "CopilotRuntimeError",
    "DemoAdapter", "InMemoryThreadStore", "InvalidRequestError", "OpenAIAdapter",
    "PayloadTooLargeError", "RequestError", "RequestRejectedError", "RunContext", "RunInput",
    "SQLiteThreadStore",
    "ServiceAdapter", "ServiceUnavailableError", "ThreadBusyError", "ThreadStore",
    "UpstreamError", "UpstreamTimeoutError",
    "__version__", "action", "create_app", "mount_runtime",
    "ApprovalPolicy", "DurableCheckpointer", "Orchestrator", "ReviewLoop", "Step",
    "approval_service", "checkpointer", "existing_agent",
    "ApprovalClosedError", "ApprovalError", "ApprovalNotFoundError",
    "AuthenticationError", "BearerTokenAuth", "JWTAuth", "PatternGuardrail", "Principal",
    "RateLimit", "TopicGuardrail", "Verdict",
    "DurableThreadStore", "PostgresThreadStore", "thread_store", "OpenAITranscription",
    "Coordinator", "coordinator",
    "AgentExecutionError", "ContentFilteredError", "JSONTooDeepError", "ModelNotAllowedError",
    "NothingToResumeError", "OutputTruncatedError", "RateLimitedError", "RequestTimeoutError",
    "ThreadNotFoundError",
    "TranscriptionError", "UnsupportedEncodingError", "UnsupportedMediaTypeError",
    "UpstreamConnectionError",
    "UpstreamProtocolError",
]


def test_all_is_pinned() -> None:
    assert sorted(copilot_runtime.__all__) == sorted(EXPECTED)
    for name in copilot_runtime.__all__:
        assert getattr(copilot_runtime, name) is not None


def test_exception_hierarchy() -> None:
    base = copilot_runtime.CopilotRuntimeError
    for name in ("ActionError", "AgentNotFoundError", "ApprovalError", "ApprovalClosedError",
                 "ApprovalNotFoundError", "ConfigurationError", "RequestError",
                 "InvalidRequestError", "PayloadTooLargeError", "ServiceUnavailableError",
                 "ThreadBusyError",
                 "UpstreamError", "UpstreamTimeoutError"):
        assert issubclass(getattr(copilot_runtime, name), base)
    # Every error a client can be answered with is importable from the package itself.
    for name in ("JSONTooDeepError", "ModelNotAllowedError"):
        assert issubclass(getattr(copilot_runtime, name), copilot_runtime.InvalidRequestError)
    for name in ("RateLimitedError", "RequestTimeoutError", "ThreadNotFoundError",
                 "TranscriptionError", "UnsupportedMediaTypeError"):
        assert issubclass(getattr(copilot_runtime, name), copilot_runtime.RequestError)
    for name in ("ContentFilteredError", "OutputTruncatedError", "UpstreamConnectionError",
                 "UpstreamProtocolError"):
        assert issubclass(getattr(copilot_runtime, name), copilot_runtime.UpstreamError)
    assert issubclass(copilot_runtime.UnsupportedEncodingError,
                      copilot_runtime.UnsupportedMediaTypeError)
    assert issubclass(copilot_runtime.NothingToResumeError, copilot_runtime.ApprovalError)
    assert issubclass(copilot_runtime.AgentExecutionError, base)
    assert copilot_runtime.ThreadNotFoundError("t").status == 404
    assert copilot_runtime.RateLimitedError("slow down", 0).retry_after == 1
    assert copilot_runtime.ThreadBusyError("t").status == 409
    assert copilot_runtime.ServiceUnavailableError("down").status == 503
    assert copilot_runtime.PayloadTooLargeError(1).status == 413
    # The README's way for an `on_request` hook to refuse: 403 unless told otherwise.
    assert issubclass(copilot_runtime.RequestRejectedError, copilot_runtime.RequestError)
    assert copilot_runtime.RequestRejectedError().status == 403
    assert copilot_runtime.RequestRejectedError("no", status=451).status == 451


def test_testing_helpers() -> None:
    assert sorted(testing.__all__) == ["EventOrderError", "LoopbackServer", "MockAnthropicServer",
                                       "MockGeminiServer", "MockOpenAIServer",
                                       "ScriptedAdapter",
                                       "text_turn", "tool_turn", "verify_events"]
    for name in testing.__all__:
        assert getattr(testing, name) is not None
