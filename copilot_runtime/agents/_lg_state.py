"""A LangGraph thread's saved state as an `AgentThreadState`.

The checkpoint is the truth about a LangGraph thread: it holds every message, including
those of runs the runtime never saw (another process, a script, a previous deployment).
Its LangChain messages become AG-UI messages through ag-ui-langgraph's own converter, the
one its MESSAGES_SNAPSHOT uses, so a loaded thread and a streamed one read alike; the
state leaves out what `_lg_events` keeps out of snapshots (messages and the tool plumbing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ag_ui_langgraph.utils import langchain_messages_to_agui  # type: ignore[import-untyped]

from copilot_runtime.agents._lg_events import PLUMBING_STATE_KEYS
from copilot_runtime.agents._lg_values import json_safe, known_messages
from copilot_runtime.agents.base import AgentThreadState

__all__ = ["load_graph_state", "thread_state_from_values"]


def thread_state_from_values(thread_id: str, values: Mapping[str, Any] | None
                             ) -> AgentThreadState:
    """The thread whose checkpoint holds `values` (LangChain messages under `messages`).

    A thread without values does not exist as far as the client is concerned: LangGraph
    answers an unknown thread with an empty snapshot rather than an error.
    """
    if not values:
        return AgentThreadState(thread_id, exists=False)
    state = {key: json_safe(value) for key, value in values.items()
             if key not in PLUMBING_STATE_KEYS}
    raw = values.get("messages")
    messages = [m.model_dump(mode="json", by_alias=True, exclude_none=True)
                for m in langchain_messages_to_agui(known_messages(raw))] if raw else []
    return AgentThreadState(thread_id, exists=True, state=state, messages=messages)


async def load_graph_state(graph: Any, thread_id: str,
                           config: Mapping[str, Any] | None = None) -> AgentThreadState:
    """Read `thread_id` from the checkpointer of a compiled graph.

    `config` is the agent's base `RunnableConfig` (its `configurable` may name a checkpoint
    namespace, for example); the thread id always comes from the argument.
    """
    base = dict(config or {})
    configurable = {**(base.get("configurable") or {}), "thread_id": thread_id}
    snapshot = await graph.aget_state({**base, "configurable": configurable})
    return thread_state_from_values(thread_id, snapshot.values)
