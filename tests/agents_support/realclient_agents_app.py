"""The runtime `tests/test_agents_real_client.py` drives with the real npm clients.

`lg` and `planner` are LangGraph graphs in this process on the mock LLM (`LLM_BASE_URL`);
`remote` is an `HttpAgent` for the scripted AG-UI server at `REMOTE_AGENT_URL`.
"""

from __future__ import annotations

import os

from copilot_runtime import CopilotRuntime
from copilot_runtime.agents.http import HttpAgent
from copilot_runtime.agents.langgraph import LangGraphAgent
from tests.agents_support import graphs

_LLM = os.environ.get("LLM_BASE_URL", "http://127.0.0.1:8090/v1")

runtime = CopilotRuntime(agents={
    "lg": LangGraphAgent(name="lg", graph=graphs.chat_graph(_LLM), description="A chat graph"),
    "planner": LangGraphAgent(name="planner", graph=graphs.shared_state_graph(_LLM)),
    "remote": HttpAgent(os.environ.get("REMOTE_AGENT_URL", "http://127.0.0.1:8100/agent"),
                        description="A remote AG-UI agent"),
})
