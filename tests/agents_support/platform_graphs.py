"""The graphs a loopback LangGraph Platform server (`langgraph dev`) serves in the tests.

The server imports this module in its own process; the mock LLM's URL comes from the
`LLM_BASE_URL` environment variable. Platform graphs have no checkpointer: the server
provides persistence.
"""

from __future__ import annotations

import os
from typing import Any

from tests.agents_support import graphs

_BASE_URL = os.environ.get("LLM_BASE_URL", "http://127.0.0.1:8090/v1")


def _without_checkpointer(graph: Any) -> Any:
    return graph.copy(update={"checkpointer": None})


chat = _without_checkpointer(graphs.chat_graph(_BASE_URL))
planner = _without_checkpointer(graphs.shared_state_graph(_BASE_URL))
failing = _without_checkpointer(graphs.failing_graph())
