"""The runtime each worker of the multi-worker tests serves: the built-in agent on the mock
LLM at `LLM_BASE_URL`, threads at `SCALE_THREADS`, runs coordinated by `SCALE_COORDINATOR`.

With `SCALE_AUTH=1` callers are identified, so ownership is checked across workers:
`Authorization: Bearer <name>` is principal `<name>`; a request without it (the real
client's) is principal `anon`."""

from __future__ import annotations

import os

from copilot_runtime import CopilotRuntime, Principal, thread_store
from copilot_runtime.auth import RequestInfo
from tests.realclient_app import getWeather, mock_llm_adapter


class NamedCallers:
    async def authenticate(self, request: RequestInfo) -> Principal:
        value = request.headers.get("authorization", "")
        return Principal(value.removeprefix("Bearer ").strip() or "anon")


runtime = CopilotRuntime(auth=NamedCallers() if os.environ.get("SCALE_AUTH") else None,
                         service_adapter=mock_llm_adapter(),
                         actions=[getWeather],
                         thread_store=thread_store(os.environ["SCALE_THREADS"]),
                         coordinator=os.environ.get("SCALE_COORDINATOR"))
