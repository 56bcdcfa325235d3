"""`LangGraphAgent` with `load_state` read from its checkpointer.

This is the one method this branch proposes for `LangGraphAgent` itself (whose module is
being changed elsewhere); until it is there, the tests use this subclass.
"""

from __future__ import annotations

from collections.abc import Mapping

from copilot_runtime.agents._lg_state import load_graph_state
from copilot_runtime.agents.base import AgentThreadState
from copilot_runtime.agents.langgraph import LangGraphAgent


class CheckpointLangGraphAgent(LangGraphAgent):
    async def load_state(self, thread_id: str, *,
                         headers: Mapping[str, str] | None = None) -> AgentThreadState:
        return await load_graph_state(self.graph, thread_id, getattr(self, "config", None))
