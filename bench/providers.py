"""Server CPU per chat through each provider adapter, each on its own loopback mock.

    .venv/bin/python -m bench.providers [--seconds 8] [--concurrency 10] [--chunks 50]

For OpenAI, Anthropic and Gemini in turn: the provider's mock in this process, our runtime
(`copilot-runtime serve` of a one-line app) in a child process, and `concurrency` AG-UI
chats in closed loops for `seconds`. Reports requests/s and the server's CPU per chat
(from /proc, the child alone), and each provider's CPU against OpenAI's in the same run.
Needs the `anthropic` and `google` extras (the test environment has them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

from copilot_runtime.testing import MockAnthropicServer, MockGeminiServer, MockOpenAIServer

_APP = """
import os
from copilot_runtime import CopilotRuntime
provider, url = os.environ["BENCH_PROVIDER"], os.environ["BENCH_LLM_URL"]
if provider == "anthropic":
    from copilot_runtime import AnthropicAdapter
    adapter = AnthropicAdapter(api_key="sk-mock", base_url=url, max_retries=0)
elif provider == "gemini":
    from copilot_runtime import GoogleGenAIAdapter
    adapter = GoogleGenAIAdapter(api_key="mock-key", base_url=url, max_retries=0)
else:
    from copilot_runtime import OpenAIAdapter
    adapter = OpenAIAdapter(api_key="sk-mock", base_url=url, max_retries=0)
runtime = CopilotRuntime(service_adapter=adapter)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _chat(session: aiohttp.ClientSession, url: str) -> bool:
    body = {"threadId": str(uuid.uuid4()), "runId": str(uuid.uuid4()), "state": {},
            "tools": [], "context": [], "forwardedProps": {},
            "messages": [{"id": "u1", "role": "user", "content": "Tell me a story."}]}
    async with session.post(url, json=body) as response:
        data = await response.read()
    return response.status == 200 and b"RUN_FINISHED" in data


async def _measure(provider: str, llm_url: str, seconds: float, concurrency: int,
                   app_dir: str) -> tuple[float, float, int]:
    port = _free_port()
    env = {**os.environ, "BENCH_PROVIDER": provider, "BENCH_LLM_URL": llm_url,
           "PYTHONPATH": app_dir}
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "copilot_runtime", "serve", "bench_provider_app:runtime",
        "--host", "127.0.0.1", "--port", str(port), "--path", "/api/copilotkit",
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/api/copilotkit/agent/default/run"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                try:
                    async with session.get(url.rsplit("/agent", 1)[0] + "/info") as answer:
                        if answer.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            for _ in range(100):  # warm-up
                assert await _chat(session, url), f"{provider}: a chat failed"
            done = failed = 0
            cpu0, began = _cpu_seconds(server.pid), time.perf_counter()

            async def loop() -> None:
                nonlocal done, failed
                while time.perf_counter() - began < seconds:
                    if await _chat(session, url):
                        done += 1
                    else:
                        failed += 1

            await asyncio.gather(*[loop() for _ in range(concurrency)])
            wall, cpu = time.perf_counter() - began, _cpu_seconds(server.pid) - cpu0
    finally:
        server.terminate()
        await server.wait()
    return done / wall, cpu / max(done, 1) * 1000, failed


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--chunks", type=int, default=50)
    args = parser.parse_args()
    results: dict[str, tuple[float, float, int]] = {}
    with tempfile.TemporaryDirectory() as app_dir:
        await asyncio.to_thread(Path(app_dir, "bench_provider_app.py").write_text, _APP)
        for provider, mock in (("openai", MockOpenAIServer), ("anthropic", MockAnthropicServer),
                               ("gemini", MockGeminiServer)):
            async with mock(chunks=args.chunks) as server:
                results[provider] = await _measure(provider, server.base_url, args.seconds,
                                                   args.concurrency, app_dir)
    base = results["openai"][1]
    print(f"c={args.concurrency}, {args.seconds:g} s each, {args.chunks} chunks per answer")
    for provider, (rps, cpu, failed) in results.items():
        print(f"{provider:10} {rps:7.1f} req/s  {cpu:5.2f} ms CPU per chat "
              f"({cpu / base:.2f}x OpenAI's)  {failed} failed")


if __name__ == "__main__":
    asyncio.run(main())
