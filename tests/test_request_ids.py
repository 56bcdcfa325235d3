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


async def test_preflights_and_probes_carry_the_request_id_too(
        llm: MockOpenAIServer, serve_runtime: ServeRuntime) -> None:
    # A preflight and the balancer's probes were the only answers without the id: a proxy's
    # log line for them could not be joined to ours, nor told from a cached answer.
    runtime = openai_runtime(llm, auth=BearerTokenAuth({TOKEN: "alice"}))
    async with serve_runtime(runtime) as served:
        session, url = served.session, served.url
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        for given in ("lb-1", None):
            sent = {} if given is None else {"X-Request-ID": given}
            for method, path, headers, status in (
                    ("OPTIONS", "/agent/default/run", preflight, 204),
                    ("GET", "/health", {}, 200), ("GET", "/ready", {}, 200),
                    ("HEAD", "/ready/", {}, 200), ("POST", "/health", {}, 405)):
                async with session.request(method, url + path,
                                           headers={**headers, **sent}) as response:
                    await response.read()
                    assert response.status == status, (method, path)
                    told = response.headers.getall("x-request-id")
                    assert len(told) == 1, (method, path, told)
                    if given is None:
                        assert MADE.fullmatch(told[0]), (method, path, told)
                    else:
                        assert told == [given], (method, path)
                    if method == "OPTIONS":  # the preflight's own headers are all still there
                        assert response.headers["access-control-allow-origin"] == "*"
                        assert response.headers["access-control-allow-headers"] == (
                            "authorization, content-type")
                        assert "OPTIONS" in response.headers["access-control-allow-methods"]
                        assert response.headers["access-control-max-age"] == "600"
