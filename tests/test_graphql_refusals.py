"""The runtime's refusals as the 1.10 client shows them.

react-core 1.10.6's fetch wrapper (`@copilotkit/runtime-client-gql`'s `createFetchFn`) turns
any answer from 400 to 500 into "Unknown error occurred" without reading its body, so a
request from that client (it sends `X-CopilotKit-Runtime-Client-GQL-Version`) is refused with
200 and a GraphQL error whose `extensions.code` is one the client knows, the runtime's own as
`runtimeCode` and the real status as `statusCode`. Other callers keep the real status.
`tests/gql/drive_refusal.mjs` drives the real client and routes its errors as react-core does.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest

from copilot_runtime import BearerTokenAuth, CopilotRuntime, OpenAIAdapter, RateLimit
from copilot_runtime._exceptions import RequestRejectedError
from copilot_runtime.auth import RequestInfo
from copilot_runtime.protocols.graphql.errors import kit_errors
from copilot_runtime.protocols.graphql.transport import refusal_status
from copilot_runtime.testing import MockOpenAIServer
from tests.conftest import ServeRuntime
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, user_turn
from tests.test_graphql_real_client import _npm_ci

DRIVER = Path(__file__).resolve().parent / "gql" / "drive_refusal.mjs"
TOKEN = "tok-alice-0001"
KNOWN_CODES = {"AGENT_NOT_FOUND", "NETWORK_ERROR", "NOT_FOUND", "AUTHENTICATION_ERROR",
               "MISUSE", "CONFIGURATION_ERROR", "UNKNOWN"}


def runtime(llm: MockOpenAIServer, **options: Any) -> CopilotRuntime:
    return CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0),
        **options)


async def drive(url: str, **options: Any) -> dict[str, Any]:
    node = shutil.which("node")
    assert node is not None, "these tests need Node.js >= 20"
    _npm_ci()
    proc = await asyncio.create_subprocess_exec(
        node, str(DRIVER), url, json.dumps(options), cwd=DRIVER.parent,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert out, err.decode()[-3000:]
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    assert "error" not in result, result["error"] + err.decode()[-2000:]
    return result


def shown(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The errors the client handed to react-core, as its handler routes them."""
    assert result["status"] is None  # nothing ran
    return [routed for handled in result["handled"] for routed in handled["graphQLErrors"]]


# -- the status and the error a refusal gets -----------------------------------------------


@pytest.mark.parametrize("status", [400, 401, 403, 405, 408, 409, 413, 415, 429, 500])
def test_the_kit_client_gets_200_where_its_fetch_wrapper_drops_the_body(status: int) -> None:
    assert refusal_status(status, kit_client=True) == 200
    assert refusal_status(status, kit_client=False) == status


@pytest.mark.parametrize("status", [501, 502, 503, 504])
def test_a_status_past_500_reaches_the_kit_client_as_it_is(status: int) -> None:
    # The wrapper lets these through, and urql reads the GraphQL errors of any status.
    assert refusal_status(status, kit_client=True) == status


def test_kit_errors_carry_a_code_the_client_knows_and_the_real_status() -> None:
    errors = kit_errors([
        {"message": "Request body exceeds the limit of 10 bytes",
         "extensions": {"code": "PAYLOAD_TOO_LARGE", "statusCode": 413}},
        {"message": "Syntax Error: Expected Name", "locations": [{"line": 1, "column": 3}],
         "extensions": {"code": "GRAPHQL_PARSE_FAILED"}},
        {"message": "Missing or invalid credentials",
         "extensions": {"code": "AUTHENTICATION_ERROR", "statusCode": 401}},
        {"message": "no code"},
    ], 400)
    assert [(e["message"], e["extensions"]["code"], e["extensions"].get("runtimeCode"),
             e["extensions"]["statusCode"], e["extensions"]["originalError"]["message"])
            for e in errors] == [
        ("Request body exceeds the limit of 10 bytes", "MISUSE", "PAYLOAD_TOO_LARGE", 413,
         "Request body exceeds the limit of 10 bytes"),
        ("Syntax Error: Expected Name", "MISUSE", "GRAPHQL_PARSE_FAILED", 400,
         "Syntax Error: Expected Name"),
        ("Missing or invalid credentials", "AUTHENTICATION_ERROR", None, 401,
         "Missing or invalid credentials"),
        ("no code", "MISUSE", None, 400, "no code"),
    ]
    [server_failed] = kit_errors([{"message": "failed"}], 500)
    assert (server_failed["extensions"]["code"], server_failed["extensions"]["statusCode"]) \
        == ("UNKNOWN", 500)
    assert errors[1]["locations"] == [{"line": 1, "column": 3}]


def test_errors_in_the_clients_form_already_are_kept() -> None:
    error = {"message": "Too many runs", "extensions": {
        "name": "CopilotError", "code": "MISUSE", "runtimeCode": "RATE_LIMITED",
        "statusCode": 429, "visibility": "dev_only", "severity": "warning",
        "troubleshootingUrl": None, "originalError": {"message": "Too many runs"}},
        "path": ["generateCopilotResponse"]}
    assert kit_errors([error], 429) == [error]


# -- the real client -------------------------------------------------------------------------


async def test_a_body_over_the_limit_shows_its_reason(serve_runtime: ServeRuntime,
                                                      llm: MockOpenAIServer) -> None:
    async with serve_runtime(runtime(llm), max_body_size=64 * 1024) as served:
        result = await drive(served.url, threadId="big", text="x" * 100_000)
    [error] = shown(result)
    assert error == {"shown": "Request body exceeds the limit of 65536 bytes",
                     "structured": "Request body exceeds the limit of 65536 bytes",
                     "code": "MISUSE", "statusCode": 413, "runtimeCode": "PAYLOAD_TOO_LARGE"}
    assert llm.requests == []


async def test_a_rate_limit_shows_its_reason(serve_runtime: ServeRuntime,
                                             llm: MockOpenAIServer) -> None:
    limited = runtime(llm, rate_limit=RateLimit(runs_per_minute=1))
    async with serve_runtime(limited) as served:
        first = await drive(served.url, threadId="r1")
        assert first["handled"] == []
        assert first["status"]["code"] == "Success"
        [error] = shown(await drive(served.url, threadId="r2"))
    assert error["code"] == "MISUSE"
    assert error["structured"] == error["shown"]
    assert (error["statusCode"], error["runtimeCode"]) == (429, "RATE_LIMITED")
    assert "rate limit" in error["shown"].lower() or "too many" in error["shown"].lower()


async def test_missing_credentials_show_their_reason(serve_runtime: ServeRuntime,
                                                     llm: MockOpenAIServer) -> None:
    guarded = runtime(llm, auth=BearerTokenAuth({TOKEN: "alice"}))
    async with serve_runtime(guarded) as served:
        [error] = shown(await drive(served.url, threadId="a1"))
    assert (error["code"], error["statusCode"]) == ("AUTHENTICATION_ERROR", 401)
    assert error["structured"] == error["shown"]
    assert error["shown"]
    assert "Unknown error occurred" not in error["shown"]


@pytest.mark.parametrize("status", [403, 503])
async def test_a_hooks_refusal_shows_its_reason(serve_runtime: ServeRuntime,
                                                llm: MockOpenAIServer, status: int) -> None:
    def on_request(request: RequestInfo) -> None:
        raise RequestRejectedError("Closed for maintenance until noon", status=status)

    async with serve_runtime(runtime(llm, on_request=on_request)) as served:
        [error] = shown(await drive(served.url, threadId="h1"))
    assert error == {"shown": "Closed for maintenance until noon",
                     "structured": "Closed for maintenance until noon",
                     "code": "MISUSE", "statusCode": status, "runtimeCode": "REQUEST_REJECTED"}


# -- the HTTP answers ------------------------------------------------------------------------


async def test_other_callers_keep_the_real_status_and_headers(serve_runtime: ServeRuntime,
                                                              llm: MockOpenAIServer) -> None:
    limited = runtime(llm, rate_limit=RateLimit(runs_per_minute=1))
    plain = {"Content-Type": "application/json"}
    body = orjson.dumps({"query": CHAT_DOCUMENT, "variables": {"data": user_turn("hi")}})
    async with serve_runtime(limited, max_body_size=64 * 1024) as served:
        post = served.session.post
        big = orjson.dumps({"query": "{ hello }", "variables": {"x": "x" * 100_000}})
        too_big = {name: await post(served.url, data=big, headers=headers)
                   for name, headers in (("kit", CLIENT_HEADERS), ("plain", plain))}
        first = await post(served.url, data=body, headers=CLIENT_HEADERS)
        await first.read()
        limited_kit = await post(served.url, data=body, headers=CLIENT_HEADERS)
        limited_plain = await post(served.url, data=body, headers=plain)
        broken = {name: await post(served.url, data=b'{"query": ', headers=headers)
                  for name, headers in (("kit", CLIENT_HEADERS), ("plain", plain))}
        assert (too_big["kit"].status, too_big["plain"].status) == (200, 413)
        assert (await too_big["kit"].json())["errors"][0]["extensions"]["statusCode"] == 413
        assert (limited_kit.status, limited_plain.status) == (200, 429)
        for answer in (limited_kit, limited_plain):
            assert int(answer.headers["Retry-After"]) >= 1
        assert (await limited_kit.json())["errors"][0]["extensions"]["statusCode"] == 429
        assert (broken["kit"].status, broken["plain"].status) == (200, 400)
        assert (await broken["kit"].json())["errors"][0]["extensions"]["runtimeCode"] \
            == "BAD_REQUEST"
