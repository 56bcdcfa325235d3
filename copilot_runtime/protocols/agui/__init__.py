"""The AG-UI protocol of CopilotKit 1.50+."""

from copilot_runtime.protocols.agui.handlers import AGUIProtocol

__all__ = ["AGUIProtocol"]
