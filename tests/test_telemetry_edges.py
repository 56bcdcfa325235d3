"""Logs and spans at their edges: an upstream's failure naming the request's credentials,
an upstream's terminal controls on a console, an unexpected 500, and a run stopped or left
while the model streams."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator

import pytest
import structlog

from copilot_runtime import CopilotRuntime, HttpAgent
from copilot_runtime.telemetry import configure_logging
from tests.conftest import RawServer, ServeRuntime, run_input

pytestmark = pytest.mark.timeout(30)

UPSTREAM_KEY = "f3a9c0de55aa41b7b2c9e8d7c6b5a401"


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """What `configure_logging` writes (processors and renderer included), for the test to
    configure and read."""
    out = io.StringIO()
    try:
        yield out
    finally:
        structlog.reset_defaults()


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


class ControlsInRepr:
    """An object whose own repr carries a terminal control sequence."""

    def __repr__(self) -> str:
        return "<obj \x1b[2J>"


def test_console_logs_escape_terminal_controls_in_every_value(log_lines: io.StringIO) -> None:
    """Only the message and an exception's text were escaped: a remote agent's unknown event
    type (`type=...`, a string the console renderer writes unquoted) retitled the window and
    cleared the screen. Now every value is: strings, and objects whose repr holds
    controls."""
    configure_logging(json=False)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(log_lines))
    structlog.get_logger("t").warning(
        "dropping events of an unknown type", type="\x1b]0;pwned\x07\x1b[2J\x1b[1A",
        quoted="a b\x1b[1Ac", obj=ControlsInRepr(), count=3)
    line = log_lines.getvalue()
    for raw in ("\x1b]0;", "\x07", "\x1b[2J", "\x1b[1A"):
        assert raw not in line, raw
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[1A" in line
    assert "<obj \\\\x1b[2J>" in line  # escaped, then quoted by the renderer
    assert "count" in line  # the other values
    assert "\x1b[" in line  # the renderer's colours
