"""`existing_agent`'s `LangGraphAgent`: it refuses a run whose client `context` is not a JSON
object before the graph keeps it. In a module of its own: the LangGraph bridge is imported
only when such an agent is built."""

from __future__ import annotations

from typing import Any

from ag_ui_langgraph.utils import camel_to_snake  # type: ignore[import-untyped]

from copilot_runtime._exceptions import InvalidRequestError
from copilot_runtime._input import RunInput
from copilot_runtime.agents.base import RunContext
from copilot_runtime.agents.langgraph import LangGraphAgent
from copilot_runtime.events import EventBatches

__all__ = ["ServedExistingAgent", "context_refusal"]


class ServedExistingAgent(LangGraphAgent):
    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        # Kept, a context that is no object failed this run and every later one of the
        # thread (the graph's input is checkpointed before its node reads it).
        for given in _contexts_given(self, input):
            refusal = context_refusal(given)
            if refusal is not None:
                return _refused(refusal)
        return super().run(input, context)


def _contexts_given(agent: LangGraphAgent, input: RunInput) -> list[Any]:
    """The `context` values the run would give the graph: the client's `state.context`,
    and a `forwardedProps` entry named so (as ag-ui-langgraph merges them)."""
    given: list[Any] = []
    state, props = input.model.state, input.model.forwarded_props
    if isinstance(state, dict) and "context" in state:
        given.append(state["context"])
    if isinstance(props, dict):
        given.extend(props[key] for key in agent.forwarded_input(props)
                     if camel_to_snake(key) == "context")
    return given


async def _refused(refusal: str) -> EventBatches:
    """A run that ends at once with INVALID_REQUEST, as `LangGraphAgent`'s own refusals do."""
    raise InvalidRequestError(refusal)
    yield  # (an async generator, as runs are)


def context_refusal(given: Any) -> str | None:
    """Why a client's `context` cannot be the wrapped agent's, or None when it can: a JSON
    object, or nothing."""
    if given is None or isinstance(given, dict):
        return None
    kinds = {str: "a string", bool: "a boolean", int: "a number", float: "a number",
             list: "an array"}
    kind = kinds.get(type(given), type(given).__name__)
    return f"The wrapped agent's context must be a JSON object, not {kind}"
