"""A GraphQL response stays busy while its run is silent.

Proxies and load balancers cut connections idle for 30-60 s, and a graph node may think for
longer than that. AG-UI sends an SSE comment after 15 s of silence; a GraphQL response sent
nothing at all until the run spoke again (the 1.10 runtime, graphql-yoga's multipart writer,
sends nothing either). Now it gets an empty multipart part, which urql (the 1.10 client's
transport) skips without yielding a result, or, for a single JSON answer, a newline before
the JSON. The real client is driven through a silence several keep-alive intervals long.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from copilot_runtime import Agent, CopilotRuntime, RunContext, RunInput
from copilot_runtime import events as ev
from copilot_runtime.events import EventBatches
from tests.conftest import ServeRuntime
from tests.gql.wire import (
    CLIENT_DOCUMENT,
    CLIENT_HEADERS,
    chat_data,
    merge,
    parse_multipart,
    text_message,
)
from tests.test_graphql_real_client import GQL_DIR, _npm_ci

Json = dict[str, Any]
SILENCE = 1.2
KEEPALIVE = 0.2
EMPTY_PART = "\r\n---\r\n\r\n\r\n---"


class Thinker(Agent):
    """Starts a step, says nothing for `SILENCE` seconds, then answers."""

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._events()

    async def _events(self) -> AsyncIterator[list[Json]]:
        yield [ev.step_started("think")]
        await asyncio.sleep(SILENCE)
        yield [ev.text_message_start("m1"), ev.text_message_content("m1", "after the silence"),
               ev.text_message_end("m1"), ev.step_finished("think")]


def runtime() -> CopilotRuntime:
    return CopilotRuntime(agents={"thinker": Thinker(description="Thinks for a while")})


async def test_the_real_client_reads_through_keepalives(serve_runtime: ServeRuntime) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not on PATH: these tests need Node.js >= 20", pytrace=False)
    _npm_ci()
    async with serve_runtime(runtime(), keepalive=KEEPALIVE) as served:
        proc = await asyncio.create_subprocess_exec(
            node, str(GQL_DIR / "drive_session.mjs"), served.url, "thinker", cwd=GQL_DIR,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    seen = json.loads(out.decode().strip().splitlines()[-1])
    raw = "".join(chunk["text"] for chunk in seen["chunks"])
    # Keep-alives went over the wire while the agent was silent ...
    keepalives = [c["at"] for c in seen["chunks"] if EMPTY_PART[len("\r\n---"):] in c["text"]]
    assert raw.count("\r\n\r\n\r\n---") >= 3, raw
    first, *_, last = seen["results"]
    assert all(first["at"] <= at <= last["at"] for at in keepalives)
    # ... and the client yielded a result for each JSON part only: nothing to render for them.
    assert len(seen["results"]) == raw.count("Content-Type: application/json")
    assert seen["errors"] == []
    assert last["status"] == {"code": "Success", "__typename": "SuccessResponseStatus"}
    assert last["messages"] == [{"role": "assistant", "content": "after the silence",
                                 "status": "Success"}]
    # Our own reading of the body skips them too.
    merged = merge(parse_multipart(raw.encode()))["data"]["generateCopilotResponse"]
    assert merged["status"]["code"] == "Success"


async def test_a_single_json_answer_gets_newlines_before_it(
        serve_runtime: ServeRuntime) -> None:
    data = chat_data([text_message("u1", "user", "Take your time.")], thread="t-json",
                     agentSession={"agentName": "thinker"})
    async with serve_runtime(runtime(), keepalive=KEEPALIVE) as served:
        response = await served.session.post(served.url, data=orjson.dumps(
            {"query": CLIENT_DOCUMENT, "variables": {"data": data}}),
            headers={**CLIENT_HEADERS, "Accept": "application/json"})
        body = await response.read()
    assert response.status == 200
    assert response.headers["content-type"].startswith("application/json")
    assert body.startswith(b"\n\n\n"), body[:20]
    answer = orjson.loads(body)["data"]["generateCopilotResponse"]
    assert answer["status"]["code"] == "Success"
    assert [m["content"] for m in answer["messages"]
            if m["__typename"] == "TextMessageOutput"] == [["after the silence"]]


async def test_no_keepalive_when_turned_off(serve_runtime: ServeRuntime) -> None:
    async with serve_runtime(runtime(), keepalive=None) as served:
        response = await served.session.post(served.url, data=orjson.dumps(
            {"query": CLIENT_DOCUMENT, "variables": {"data": chat_data(
                [text_message("u1", "user", "Hi")], thread="t-off",
                agentSession={"agentName": "thinker"})}}), headers=CLIENT_HEADERS)
        body = await response.read()
    assert b"\r\n\r\n\r\n---" not in body
    assert merge(parse_multipart(body))["data"]["generateCopilotResponse"]["status"][
        "code"] == "Success"
