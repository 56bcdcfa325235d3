"""A large agent state is not repeated in every agent-state message of a GraphQL response.

Every step start, step end and state event of an agent made an agent-state message carrying
the whole state: a 10 MB state made a 73 MB response. The 1.10 client reads only the last
agent-state message of each agent (`filterAdjacentAgentStateMessages`), whole, at every part.
Now a large state that has not changed updates the agent's last message (a `data` patch:
new id, node and flags) instead of coming again. The client must see, after every part,
exactly what it saw before: the same state, node and flags, and a new id where there was a
new message (react-core runs a state render once per id of an inactive message).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from itertools import pairwise
from typing import Any

import pytest

from copilot_runtime import Agent, CopilotRuntime, RunContext, RunInput
from copilot_runtime import events as ev
from copilot_runtime.events import EventBatches
from copilot_runtime.protocols.graphql import increments
from copilot_runtime.protocols.graphql.increments import ResponseEncoder
from copilot_runtime.protocols.graphql.transport import encode_part, multipart_end
from tests.conftest import ServeRuntime
from tests.gql.wire import CLIENT_DOCUMENT, merge, parse_multipart
from tests.test_graphql_real_client import GQL_DIR, _npm_ci
from tests.test_graphql_units import compiled

Json = dict[str, Any]
DOC = "x" * 200_000  # over `STATE_REPEATED_BELOW`


def batches() -> list[list[Json]]:
    """A planner's run: the state changes twice, around steps that leave it as it is."""
    return [
        [ev.step_started("load")],
        [ev.state_snapshot({"doc": DOC, "n": 1})],
        [ev.step_finished("load")],
        [ev.step_started("write"), ev.text_message_start("m1")],
        [ev.text_message_content("m1", "writing"), ev.text_message_end("m1")],
        [ev.state_snapshot({"doc": DOC, "n": 2})],
        [ev.step_finished("write")],
        [ev.step_started("check"), ev.step_finished("check")],
    ]


def client_views(body_parts: list[bytes]) -> list[Json]:
    """What the 1.10 client takes from the response after each write: its messages with
    each agent's last agent-state message in the place of its first, as
    `filterAdjacentAgentStateMessages` does."""
    views = []
    closing = encode_part({"hasNext": False}) + multipart_end
    for n in range(1, len(body_parts) + 1):
        body = b"".join(body_parts[:n])
        if not body.endswith(multipart_end):
            body += closing
        messages = merge(parse_multipart(body))["data"]["generateCopilotResponse"]["messages"]
        kept: list[Json] = []
        for message in messages:
            if message["__typename"] == "AgentStateMessageOutput":
                same = [i for i, m in enumerate(kept) if m.get("agentName") == message[
                    "agentName"] and m["__typename"] == "AgentStateMessageOutput"]
                if same:
                    kept[same[0]] = message
                    continue
            kept.append(message)
        views.append({"messages": [{k: v for k, v in m.items() if k not in ("id", "createdAt")}
                                   for m in kept],
                      "state ids": [m["id"] for m in kept
                                    if m["__typename"] == "AgentStateMessageOutput"]})
    return views


def encoded() -> list[bytes]:
    encoder = ResponseEncoder(compiled(CLIENT_DOCUMENT), thread_id="t", run_id=None,
                              frontend_tools=frozenset(), stopped=lambda: False,
                              incremental=True, agent_name="planner", agent_run_id="r",
                              agent_state={})
    return [encoder.encode(batch) for batch in [[ev.run_started("t", "r")], *batches(),
                                                 [ev.run_finished("t", "r")]]]


def new_ids(views: list[Json]) -> list[bool]:
    """After each part, whether the agent-state message the client reads has a new id."""
    ids = [v["state ids"] for v in views]
    return [a != b for a, b in pairwise(ids)]


def test_the_client_sees_the_same_with_fewer_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = encoded()
    monkeypatch.setattr(increments, "STATE_REPEATED_BELOW", 10**12, raising=False)
    repeated = encoded()
    body, before = b"".join(ours), b"".join(repeated)
    # The document's state twice (it changed twice); it was in every agent-state message.
    assert body.count(DOC.encode()) == 2
    assert before.count(DOC.encode()) == 8
    assert len(body) < len(before) / 3
    mine, theirs = client_views(ours), client_views(repeated)
    assert [v["messages"] for v in mine] == [v["messages"] for v in theirs]
    # A new agent-state message where there was one: a new id, seen by the client.
    assert new_ids(mine) == new_ids(theirs)
    final = mine[-1]["messages"]
    (state,) = [m for m in final if m["__typename"] == "AgentStateMessageOutput"]
    assert json.loads(state["state"]) == {"doc": DOC, "n": 2}
    assert (state["nodeName"], state["active"]) == ("__end__", False)


def test_small_states_are_repeated_as_in_1_10() -> None:
    encoder = ResponseEncoder(compiled(CLIENT_DOCUMENT), thread_id="t", run_id=None,
                              frontend_tools=frozenset(), stopped=lambda: False,
                              incremental=True, agent_name="planner", agent_run_id="r",
                              agent_state={"n": 1})
    body = b"".join(encoder.encode(batch) for batch in [
        [ev.run_started("t", "r"), ev.step_started("a")], [ev.step_finished("a")],
        [ev.run_finished("t", "r")]])
    messages = merge(parse_multipart(body))["data"]["generateCopilotResponse"]["messages"]
    assert [(m["nodeName"], m["active"], m["state"]) for m in messages] == [
        ("a", True, '{"n":1}'), ("a", False, '{"n":1}'), ("__end__", False, '{"n":1}')]


class Planner(Agent):
    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._events()

    async def _events(self) -> AsyncIterator[list[Json]]:
        for batch in batches():
            yield batch
            await asyncio.sleep(0.05)  # one part each


async def test_the_real_client_sees_the_same(serve_runtime: ServeRuntime,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not on PATH: these tests need Node.js >= 20", pytrace=False)
    _npm_ci()
    seen = []
    async with serve_runtime(CopilotRuntime(agents={"planner": Planner(description="Plans")})
                             ) as served:
        for limit in (None, 10**12):  # as it is; then every state repeated, as 1.10 did
            if limit is not None:
                monkeypatch.setattr(increments, "STATE_REPEATED_BELOW", limit, raising=False)
            proc = await asyncio.create_subprocess_exec(
                node, str(GQL_DIR / "drive_session.mjs"), served.url, "planner", f"t-{limit}",
                cwd=GQL_DIR, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
            seen.append(json.loads(out.decode().strip().splitlines()[-1]))
    ours, repeated = seen
    for result in (ours, repeated):
        assert result["errors"] == []
        assert result["results"][-1]["status"]["code"] == "Success"
    sizes = [sum(len(c["text"]) for c in r["chunks"]) for r in seen]
    assert sizes[0] < sizes[1] / 3, sizes

    def views(result: Json) -> list[Any]:
        return [(r["messages"], [{k: v for k, v in s.items() if k not in ("id", "runId",
                                                                        "threadId")}
                                 for s in r["agentStates"]]) for r in result["results"]]

    assert views(ours) == views(repeated)
    assert len(ours["results"]) >= len(batches())

    def state_ids(result: Json) -> list[Json]:
        return [{"state ids": [s["id"] for s in r["agentStates"]]} for r in result["results"]]

    assert new_ids(state_ids(ours)) == new_ids(state_ids(repeated))
    (last,) = ours["results"][-1]["agentStates"]
    assert last["state"] == {"doc": DOC, "n": 2}
    assert (last["nodeName"], last["active"], last["running"]) == ("__end__", False, True)
