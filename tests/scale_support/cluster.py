"""Worker processes of one deployment on their own ports, started with the real command line
(`python -m copilot_runtime serve`), and what the tests need to drive them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
BASE_PATH = "/api/copilotkit"
STARTUP_S = 40.0
APP = "tests.scale_support.app:runtime"


@dataclass
class Worker:
    name: str
    env: dict[str, str]
    log: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{BASE_PATH}"

    def start(self) -> None:
        self.port = free_port()
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "copilot_runtime", "serve", APP,
                 "--port", str(self.port), "--path", BASE_PATH, "--log-level", "warning"],
                cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    async def ready(self, session: aiohttp.ClientSession) -> None:
        end = time.monotonic() + STARTUP_S
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                pytest.fail(f"worker {self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                async with session.get(self.url + "/info") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > end:
                pytest.fail(f"worker {self.name} did not start:\n{self.log.read_text()[-3000:]}")
            await asyncio.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: the worker dies mid-whatever, with no chance to clean up."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@dataclass
class Cluster:
    workers: list[Worker]
    session: aiohttp.ClientSession
    extra: dict[str, Any] = field(default_factory=dict)

    async def start(self) -> None:
        for worker in self.workers:
            worker.start()
        await asyncio.gather(*(w.ready(self.session) for w in self.workers))

    async def restart(self) -> None:
        for worker in self.workers:
            worker.stop()
        await self.start()

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()

    async def post(self, worker: Worker, path: str, body: Any,
                   headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        return await self.session.post(
            worker.url + path, data=orjson.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})})


def make_cluster(count: int, tmp_path: Path, session: aiohttp.ClientSession, *,
                 llm_url: str, threads: str, coordinator: str, auth: bool = True) -> Cluster:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLM_BASE_URL": llm_url,
           "SCALE_THREADS": threads, "SCALE_COORDINATOR": coordinator,
           "SCALE_AUTH": "1" if auth else ""}
    workers = [Worker(chr(ord("A") + i), env, tmp_path / f"worker-{i}.log")
               for i in range(count)]
    return Cluster(workers, session)


@contextlib.asynccontextmanager
async def started_cluster(count: int, logs: Path, *, llm_url: str, threads: str,
                          coordinator: str, auth: bool = True) -> AsyncIterator[Cluster]:
    """`count` workers sharing `threads` and `coordinator`, started; stopped at the end."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        cluster = make_cluster(count, logs, session, llm_url=llm_url, threads=threads,
                               coordinator=coordinator, auth=auth)
        try:
            await cluster.start()
            yield cluster
        finally:
            cluster.close()


def sse_frames(data: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    """Each SSE event of a body: its `id:` (None without one) and its data."""
    out: list[tuple[str | None, dict[str, Any]]] = []
    for frame in data.split(b"\n\n"):
        event_id: str | None = None
        payload: bytes | None = None
        for line in frame.split(b"\n"):
            if line.startswith(b"id:"):
                event_id = line[3:].strip().decode()
            elif line.startswith(b"data:"):
                payload = line[5:].strip()
        if payload is not None:
            out.append((event_id, orjson.loads(payload)))
    return out


async def eventually(check: Callable[[], Any], deadline: float = 15.0,
                     what: str = "condition") -> Any:
    """Poll `check` (sync or async) until it returns something true; fail after `deadline`."""
    end = time.monotonic() + deadline
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > end:
            pytest.fail(f"{what} not reached within {deadline} s")
        await asyncio.sleep(0.05)


async def drive(scenario: str, url: str, **options: Any) -> dict[str, Any]:
    """Run a scenario of tests/js/drive.mjs (the real CopilotKit client) against `url`,
    without blocking the event loop (the mock LLM may be serving in it)."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("the real-client tests need Node.js on PATH", pytrace=False)
    js = REPO / "tests" / "js"
    process = await asyncio.create_subprocess_exec(
        node, str(js / "drive.mjs"), scenario, url, json.dumps(options), cwd=js,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COPILOTKIT_TELEMETRY_DISABLED": "true", "DO_NOT_TRACK": "1"})
    try:
        async with asyncio.timeout(40):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        pytest.fail(f"driver scenario {scenario} hung", pytrace=False)
    lines = [line for line in out.decode().splitlines() if line.strip()]
    result: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    if not result.get("ok"):
        pytest.fail(f"driver scenario {scenario} failed: {result.get('error')}\n"
                    f"{err.decode()[-2000:]}", pytrace=False)
    return result
