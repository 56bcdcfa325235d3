"""The runtime `tests/test_graphql_agents_real_client.py` serves to the 1.10.6 GraphQL client.

`lg` (a chat graph with the server tool `get_weather`) and `planner` (a graph that shares
its state with the page) run in this process on the mock LLM at `LLM_BASE_URL`; `remote` is
an `HttpAgent` for the scripted AG-UI server at `REMOTE_AGENT_URL`. There is no service
adapter, so every agent is listed.

The LangGraph agents answer `loadAgentState` from their checkpointer.
"""

from __future__ import annotations

import os

from copilot_runtime import CopilotRuntime, create_app
from copilot_runtime.agents.http import HttpAgent
from copilot_runtime.agents.langgraph import LangGraphAgent
from tests.agents_support import graphs

_LLM = os.environ.get("LLM_BASE_URL", "http://127.0.0.1:8090/v1")


runtime = CopilotRuntime(agents={
    "lg": LangGraphAgent(name="lg", graph=graphs.chat_graph(_LLM),
                                   description="A chat graph that knows the weather"),
    "planner": LangGraphAgent(name="planner", graph=graphs.shared_state_graph(_LLM),
                                        description="Plans items with the page"),
    "remote": HttpAgent(os.environ.get("REMOTE_AGENT_URL", "http://127.0.0.1:8100/agent"),
                        description="A remote AG-UI agent"),
})
app = create_app(runtime, "/copilotkit")
