"""`LangGraphAgent`: a compiled LangGraph graph running in this process.

Built on `ag-ui-langgraph` (see `_lg_bridge` for what it does and what is added to it):
every run clones the translator, so concurrent runs share nothing but the graph and its
checkpointer. The graph must have a checkpointer, because the translator reads the thread's
checkpoint to merge the client's messages and to find interrupts; the thread id is the
AG-UI `threadId`.

Frontend tools reach the graph as `state["copilotkit"]["actions"]` (and `state["tools"]`),
the context as `state["copilotkit"]["context"]`: the `CopilotKitState` convention of the
`copilotkit` SDK. The client's `state` is the graph's input state (filtered to the keys of
its input schema); state changes come back as `STATE_SNAPSHOT`, then `STATE_DELTA`.
Raw LangChain events stay off the wire unless `emit_raw_events=True`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import openai
import structlog

from copilot_runtime._exceptions import ConfigurationError, UpstreamError, UpstreamTimeoutError
from copilot_runtime._input import RunInput
from copilot_runtime.agents._lg_bridge import CopilotKitLangGraphBridge
from copilot_runtime.agents._lg_events import WireEncoder
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.events import EventBatches

__all__ = ["LangGraphAgent"]

_log = structlog.get_logger("copilot_runtime.agents")


class LangGraphAgent(Agent):
    """A LangGraph graph compiled with a checkpointer.

    `name` is the agent's name inside the graph's events; `config` is the base
    `RunnableConfig` of every run. `emit_interrupt_outcome` ends an interrupted run with the
    AG-UI interrupt outcome (clients on `@ag-ui/client` 0.0.59+ resume with `resume`);
    `legacy_interrupt_events` also sends the `on_interrupt` custom event older CopilotKit
    frontends listen for. `state_deltas=False` sends every state change as a snapshot.
    """

    class_name = "LangGraphAgent"

    def __init__(
        self,
        *,
        name: str,
        graph: Any,
        description: str = "",
        config: Mapping[str, Any] | None = None,
        emit_raw_events: bool = False,
        emit_interrupt_outcome: bool = False,
        legacy_interrupt_events: bool = True,
        state_deltas: bool = True,
    ) -> None:
        super().__init__(description=description)
        if getattr(graph, "checkpointer", None) is None:
            raise ConfigurationError(
                f"LangGraphAgent {name!r} needs a graph compiled with a checkpointer, "
                "e.g. graph.compile(checkpointer=InMemorySaver())")
        self.name = name
        self.graph = graph
        self.state_deltas = state_deltas
        self._template = CopilotKitLangGraphBridge(
            name=name, graph=graph, description=description or None,
            config=dict(config) if config else None, emit_raw_events=emit_raw_events,
            emit_interrupt_outcome=emit_interrupt_outcome,
            enable_legacy_on_interrupt_event=legacy_interrupt_events)

    def capabilities(self) -> dict[str, Any]:
        capabilities: dict[str, Any] = self._template.get_capabilities()
        capabilities["state"] = {**capabilities.get("state", {}), "deltas": self.state_deltas}
        capabilities["tools"] = {"supported": True, "clientProvided": True}
        return capabilities

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return translate_bridge_run(self._template.clone(), input,
                                    WireEncoder(state_deltas=self.state_deltas))


async def translate_bridge_run(bridge: CopilotKitLangGraphBridge, input: RunInput,
                               encoder: WireEncoder) -> EventBatches:
    """Run `bridge` on `input`, yielding wire events; model failures become `UpstreamError`.

    Shared with `LangGraphPlatformAgent`, whose bridge drives a remote graph.
    """
    try:
        async for event in bridge.stream(input.model):
            wire = encoder.encode(event)
            if wire is not None:
                yield (wire,)
    except openai.APIError as exc:
        # The client learns what kind of failure it was; the provider's own text goes to
        # the log (it may name deployments, keys or internal hosts).
        _log.warning("model call failed in a LangGraph run", error=repr(exc))
        if isinstance(exc, openai.APITimeoutError):
            raise UpstreamTimeoutError("The model provider did not answer in time") from None
        if isinstance(exc, openai.APIStatusError):
            raise UpstreamError(f"The model provider answered HTTP {exc.status_code}",
                                status=exc.status_code) from None
        raise UpstreamError("The model provider could not be reached") from None
