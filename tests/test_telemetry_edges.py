"""Logs and spans at their edges: an upstream's failure naming the request's credentials,
an upstream's terminal controls on a console, an unexpected 500, and a run stopped or left
while the model streams."""

from __future__ import annotations

import asyncio
import json

import pytest
import structlog

from copilot_runtime import CopilotRuntime, HttpAgent
from tests.conftest import RawServer, ServeRuntime, run_input

pytestmark = pytest.mark.timeout(30)

UPSTREAM_KEY = "f3a9c0de55aa41b7b2c9e8d7c6b5a401"


class MalformedAnswer(RawServer):
    """Answers with a header line aiohttp cannot parse: a `ClientResponseError`."""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Bad Header Without Colon\r\n\r\n")
        await writer.drain()
        writer.close()


async def test_a_remote_agents_credential_headers_stay_out_of_the_log(
        serve_runtime: ServeRuntime) -> None:
    """An upstream's malformed answer raises a `ClientResponseError`, whose repr holds every
    header of the request: the "remote call failed" warning logged the operator's key under
    a name no pattern knows (Azure's `Ocp-Apim-Subscription-Key`, `X-Functions-Key`). Now
    the warning keeps the error's type, status and message, never the request's headers."""
    async with MalformedAnswer() as upstream:
        agent = HttpAgent(upstream.url + "/run", headers={
            "Ocp-Apim-Subscription-Key": UPSTREAM_KEY, "X-Functions-Key": UPSTREAM_KEY})
        async with serve_runtime(CopilotRuntime(agents={"remote": agent})) as served:
            with structlog.testing.capture_logs() as logs:
                events = await served.run(run_input("Hi"), agent="remote")
    assert events[-1]["type"] == "RUN_ERROR"
    assert UPSTREAM_KEY not in json.dumps(events)
    (failed,) = [e for e in logs if e["event"] == "remote call failed"]
    assert failed["error"].startswith("ClientResponseError(status=400, message=")
    assert UPSTREAM_KEY not in repr(logs)
