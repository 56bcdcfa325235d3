"""The request id: taken from a plain `X-Request-ID` (a load balancer's), else made, and sent
back on every answer (JSON, SSE, GraphQL multipart, errors), so that a request can be followed
from a proxy's logs, or a user's browser, into the runtime's logs, hooks and spans. Before,
the id was always made here and never told: nothing joined the two sides.
"""

from __future__ import annotations

import re

import orjson
import pytest

from copilot_runtime import BearerTokenAuth
from copilot_runtime.auth import RequestInfo
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import ServeRuntime, openai_runtime, run_input
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, user_turn

pytestmark = pytest.mark.timeout(60)

TOKEN = "tok-alice-0001"
MADE = re.compile(r"[0-9a-f]{32}")


async def test_a_plain_request_id_is_kept_and_every_answer_carries_it(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    seen: list[str] = []

    def on_request(request: RequestInfo) -> None:
        seen.append(request.request_id)

    runtime = openai_runtime(llm, auth=BearerTokenAuth({TOKEN: "alice"}), on_request=on_request)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with serve_runtime(runtime) as served:
        session, url = served.session, served.url

        async def answer_id(method: str, path: str, body: object, given: str | None,
                            headers: dict[str, str] | None = None) -> tuple[int, str]:
            sent = {**(headers if headers is not None else auth),
                    "Content-Type": "application/json"}
            if given is not None:
                sent["X-Request-ID"] = given
            async with session.request(method, url + path, headers=sent,
                                       data=None if body is None else orjson.dumps(body)
                                       ) as response:
                await response.read()
                return response.status, response.headers["x-request-id"]

        # JSON, an SSE run, a GraphQL stream, and a 401: each carries the id it was given.
        assert await answer_id("GET", "/info", None, "lb-7f3a.9:2") == (200, "lb-7f3a.9:2")
        assert await answer_id("POST", "/agent/default/run", run_input("Hi"), "req-2") == (
            200, "req-2")
        assert await answer_id("POST", "", {"query": CHAT_DOCUMENT, "variables": {
            "data": user_turn("Hi", thread="g")}}, "req-3", {**auth, **CLIENT_HEADERS}) == (
            200, "req-3")
        assert await answer_id("GET", "/info", None, "req-4", {}) == (401, "req-4")
        assert seen == ["lb-7f3a.9:2", "req-2", "req-3"]
        # What could forge or break a log line is not kept: a new id is made (and told).
        for bad in ("two words", "a" * 129, "x\u00e9", "", "id;drop"):
            status, made = await answer_id("GET", "/info", None, bad)
            assert status == 200
            assert MADE.fullmatch(made), (bad, made)
        status, made = await answer_id("GET", "/info", None, None)
        assert MADE.fullmatch(made)
        assert seen[-1] == made
