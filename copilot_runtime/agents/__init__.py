"""Agent kinds, one module each, behind the `Agent` interface."""

from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.agents.builtin import BuiltInAgent

__all__ = ["Agent", "BuiltInAgent", "RunContext"]
