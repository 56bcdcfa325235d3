"""The server the fuzz suite attacks, in a process of its own (so its peak RSS is its own).

    python -m tests.fuzz_support.server PORT [STORE_URL]

Serves the runtime (the built-in agent on the loopback OpenAI mock, one server action) at
`/api/copilotkit` and prints `ready` once listening. With a PostgreSQL `STORE_URL` its
threads and coordination live there: the strictest store (its text holds no NUL, its index
entries no long keys), so what it keeps every store keeps. (The suite reads its peak RSS from
`/proc/PID/status`.)
"""

from __future__ import annotations

import asyncio
import sys

import uvicorn

from copilot_runtime import CopilotRuntime, OpenAIAdapter, coordinator, create_app, thread_store
from copilot_runtime.testing import MockOpenAIServer
from tests.realclient_app import getWeather


async def main(port: int, store: str | None) -> None:
    async with MockOpenAIServer(chunks=5) as llm:
        runtime = CopilotRuntime(
            service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock",
                                          max_retries=0, timeout=10),
            actions=[getWeather],
            thread_store=thread_store(store) if store else None,
            coordinator=coordinator(store) if store else None,
            # A hook that does nothing: every request then takes the path that identifies
            # it (its id from X-Request-ID, hooks), fuzzed with the rest.
            on_request=lambda request: None)
        app = create_app(runtime, "/api/copilotkit", max_body_size=1024 * 1024)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="critical", lifespan="on"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
            if task.done():
                task.result()
        print("ready", flush=True)
        await task


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None))
