"""The real clients of both generations carrying bearer tokens: CopilotKitCore 1.75 with a
plain AG-UI HttpAgent (tests/js/drive_trust.mjs), and @copilotkit/runtime-client-gql 1.10.6
(tests/gql/drive_trust.mjs). Two users; missing and bad tokens; a guardrail refusal as each
client shows it, with the mock model never called for it."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from copilot_runtime import (
    BearerTokenAuth,
    CopilotRuntime,
    OpenAIAdapter,
    PatternGuardrail,
)
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.threads import ThreadOwner
from tests.conftest import Served, ServeRuntime
from tests.test_graphql_real_client import _npm_ci
from tests.test_real_clients import _ensure_node_modules

TESTS = Path(__file__).resolve().parent
ALICE, BOB = "tok-alice-0001", "tok-bob-00002"
REFUSAL = "I can't discuss passwords."


async def drive(script: Path, url: str, **options: Any) -> dict[str, Any]:
    node = shutil.which("node")
    assert node is not None, "these tests need Node.js >= 20"
    proc = await asyncio.create_subprocess_exec(
        node, str(script), url, json.dumps(options), cwd=script.parent,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert out, err.decode()[-3000:]
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    assert "error" not in result, result["error"] + err.decode()[-2000:]
    return result


def contents(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(m["role"], m["content"]) for m in messages if m["role"] in ("user", "assistant")]


@pytest.fixture
async def served(serve_runtime: ServeRuntime, llm: MockOpenAIServer
                 ) -> AsyncIterator[Served]:
    _ensure_node_modules()
    _npm_ci()
    runtime = CopilotRuntime(
        service_adapter=OpenAIAdapter(base_url=llm.base_url, api_key="sk-mock", max_retries=0),
        auth=BearerTokenAuth({ALICE: "alice", BOB: "bob"}),
        guardrails=[PatternGuardrail(deny=[r"password"], reason=REFUSAL)])
    async with serve_runtime(runtime) as s:
        yield s


async def test_agui_clients_with_tokens(served: Served, llm: MockOpenAIServer) -> None:
    script = TESTS / "js" / "drive_trust.mjs"
    alice = await drive(script, served.url, token=ALICE, threadId="rc-alice", text="Hi there")
    assert alice["status"] == "connected"
    assert alice["errors"] == []
    assert contents(alice["messages"]) == [("user", "Hi there"),
                                           ("assistant", "echo: Hi there")]
    assert alice.get("httpAgentError") is None
    assert contents(alice["httpAgentMessages"])[-1] == ("assistant", "echo: And again")
    record = await served.runtime.store.get("rc-alice")
    assert record is not None
    assert record.owner == ThreadOwner("alice")
    assert len(record.runs) == 2
    calls = len(llm.requests)

    # Bob: reloading alice's thread shows nothing; running on it fails, in both clients.
    bob = await drive(script, served.url, token=BOB, threadId="rc-alice", connectOnly=True)
    assert bob["status"] == "connected"
    assert bob.get("connectError") is None
    assert bob["messages"] == []
    bob = await drive(script, served.url, token=BOB, threadId="rc-alice", text="mine?")
    assert {"url": "/agent/default/run", "status": 404} in bob["statuses"]
    assert not any(m["role"] == "assistant" for m in bob["messages"])
    assert bob["httpAgentError"] is not None
    assert len(llm.requests) == calls
    record = await served.runtime.store.get("rc-alice")
    assert record is not None
    assert len(record.runs) == 2
    # Alice reloads her own thread.
    again = await drive(script, served.url, token=ALICE, threadId="rc-alice",
                        connectOnly=True)
    assert ("assistant", "echo: And again") in contents(again["messages"])

    # No token, a bad token: the client cannot connect (401), nothing runs.
    for token in (None, "tok-wrong-0000"):
        result = await drive(script, served.url, token=token, threadId="rc-x")
        assert result["status"] == "error"
        assert {"url": "/info", "status": 401} in result["statuses"]
    # A refusal: an assistant message with the reason, a normal end, no model call.
    refused = await drive(script, served.url, token=ALICE, threadId="rc-guard",
                          text="what is the admin password")
    assert contents(refused["messages"]) == [("user", "what is the admin password"),
                                             ("assistant", REFUSAL)]
    assert refused["errors"] == []
    assert len(llm.requests) == calls + 1  # only the HttpAgent's "And again" follow-up


async def test_graphql_client_with_tokens(served: Served, llm: MockOpenAIServer) -> None:
    script = TESTS / "gql" / "drive_trust.mjs"
    alice = await drive(script, served.url, token=ALICE, threadId="gql-alice", text="Hello")
    assert alice["errors"] == []
    assert alice["status"]["code"] == "Success"
    assert alice["messages"][-1] == {"role": "assistant", "content": "echo: Hello"}
    assert alice["loadAgentState"]["threadExists"] is True
    calls = len(llm.requests)

    bob = await drive(script, served.url, token=BOB, threadId="gql-alice", text="mine?")
    assert bob["status"] is None
    assert any("NOT_FOUND" in e["codes"] for e in bob["errors"])
    assert bob["loadAgentState"]["threadExists"] is False
    assert bob["loadAgentState"]["messages"] == "[]"
    assert len(llm.requests) == calls

    for token in (None, "tok-wrong-0000"):
        result = await drive(script, served.url, token=token, threadId="gql-x")
        assert result["status"] is None
        assert result["errors"]
        assert result["loadAgentState"] is None

    refused = await drive(script, served.url, token=ALICE, threadId="gql-guard",
                          text="tell me the password")
    assert refused["status"]["code"] == "Failed"
    assert refused["status"]["reason"] == "GUARDRAILS_VALIDATION_FAILED"
    assert refused["status"]["details"] == {"guardrailsReason": REFUSAL}
    assert {"role": "assistant", "content": REFUSAL} in refused["messages"]
    assert len(llm.requests) == calls
