"""A LangGraph Platform agent over GraphQL, against a real `langgraph dev` server (in-memory):
its agent-state messages, and `loadAgentState` read from the platform's thread.

A module fixture starts the mock LLM and `langgraph dev` serving
`tests/agents_support/platform_graphs.py` as child processes, on loopback, offline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from copilot_runtime import CopilotRuntime
from copilot_runtime.agents.langgraph_platform import LangGraphPlatformAgent
from tests.agents_support.fake_platform import FakePlatform, frame, model_stream
from tests.agents_support.processes import REPO_ROOT, VENV_BIN, child_process, free_port, mock_llm
from tests.conftest import ServeRuntime, serve
from tests.gql.wire import CLIENT_DOCUMENT, CLIENT_HEADERS, chat_data, text_message
from tests.test_graphql_agents import LOAD_STATE, history_of, query, session, states, texts, turn

GRAPHS = REPO_ROOT / "tests" / "agents_support" / "platform_graphs.py"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("langgraph-dev-graphql")
    (workdir / "langgraph.json").write_text(json.dumps({
        "dependencies": [str(REPO_ROOT)], "graphs": {"planner": f"{GRAPHS}:planner"}}))
    port = free_port()
    with mock_llm(workdir) as llm_url, child_process(
            "langgraph-dev",
            [str(VENV_BIN / "langgraph"), "dev", "--no-browser", "--no-reload",
             "--host", "127.0.0.1", "--port", str(port), "--n-jobs-per-worker", "2",
             "--config", str(workdir / "langgraph.json")],
            ready_url=f"http://127.0.0.1:{port}/ok", log_dir=workdir, cwd=workdir,
            env={"LLM_BASE_URL": llm_url, "PYTHONPATH": str(REPO_ROOT),
                 "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false"}):
        yield f"http://127.0.0.1:{port}"


async def test_platform_agent_session_and_its_saved_thread(
        deployment: str, serve_runtime: ServeRuntime) -> None:
    agent = LangGraphPlatformAgent(deployment_url=deployment, graph_id="planner")
    runtime = CopilotRuntime(agents={"platform": agent})
    async with serve_runtime(runtime) as served:
        first = await turn(served, session("platform", "Plan", "t-platform", agentStates=[
            {"agentName": "platform", "state": '{"items": ["from the page"]}'}]))
        final = states(first)[-1]
        second = await turn(served, chat_data(
            [*history_of(final), text_message("u2", "user", "Again")], thread="t-platform",
            agentSession={"agentName": "platform", "nodeName": final["nodeName"]},
            agentStates=[{"agentName": "platform", "state": json.dumps(final["state"])}]))
        loaded = (await query(served, LOAD_STATE, {"data": {
            "threadId": "t-platform", "agentName": "platform"}}))["data"]["loadAgentState"]
        missing = (await query(served, LOAD_STATE, {"data": {
            "threadId": "t-platform-never", "agentName": "platform"}}))["data"][
            "loadAgentState"]
    assert texts(first) == ["echo: items=['from the page', 'item 2']"]
    assert (final["agentName"], final["nodeName"], final["active"]) == (
        "platform", "__end__", False)
    assert texts(second) == ["echo: items=['from the page', 'item 2', 'item 3']"]
    assert loaded["threadExists"] is True
    assert json.loads(loaded["state"]) == {"items": ["from the page", "item 2", "item 3"],
                                           "counter": 2, "note": "3 items"}
    assert [m["content"] for m in json.loads(loaded["messages"])] == [
        "Plan", "echo: items=['from the page', 'item 2']", "Again",
        "echo: items=['from the page', 'item 2', 'item 3']"]
    assert missing == {"threadId": "t-platform-never", "threadExists": False, "state": "{}",
                       "messages": "[]"}


async def test_a_platform_event_of_a_wrong_shape_is_a_network_error(
        serve_runtime: ServeRuntime) -> None:
    """Before: an event whose `tool_call_chunks` is a string failed the turn as the agent's
    own bug (UNKNOWN_ERROR, status 500) with the translator's stack in the log."""
    bad = model_stream("Hi")
    bad["data"]["chunk"]["tool_call_chunks"] = "abc"
    fake = FakePlatform(frames=[frame("events", model_stream("Hi")), frame("events", bad)])
    async with serve(fake.app) as platform:
        runtime = CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
            deployment_url=platform, graph_id="fake")})
        async with serve_runtime(runtime) as served:
            response = await turn(served, session("platform", "hi", "t-shape"))
    details = response["status"]["details"]
    assert details["description"] == ("The LangGraph Platform sent an event of an unexpected "
                                      "shape")
    assert (details["originalError"]["code"], details["originalError"]["statusCode"],
            details["originalError"]["originalErrorType"]) == (
        "NETWORK_ERROR", 503, "UPSTREAM_ERROR")


async def test_load_agent_state_failing_on_the_platform_is_a_network_error_of_503(
        serve_runtime: ServeRuntime) -> None:
    """Before: the platform's own status (401: the runtime's key refused) was the error's
    `statusCode`, as if the client's credentials had failed (a run's failure says 503), and
    the graph was named as if it were the agent's id."""
    async with serve(FakePlatform(fail_with=401).app) as platform:
        runtime = CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
            deployment_url=platform, graph_id="fake")})
        async with serve_runtime(runtime) as served:
            answer = await query(served, LOAD_STATE, {"data": {
                "threadId": "t1", "agentName": "platform"}})
    (error,) = answer["errors"]
    assert error["message"] == "The LangGraph Platform's graph 'fake' answered HTTP 401"
    assert (error["extensions"]["code"], error["extensions"]["statusCode"]) == (
        "NETWORK_ERROR", 503)


async def test_a_users_authorization_goes_to_the_platform_as_a_bearer_token(
        serve_runtime: ServeRuntime) -> None:
    """The 1.10 runtime sends `properties.authorization` to a LangGraph Platform deployment
    as `authorization: Bearer <it>` (for a user's token its graph checks); before, it was
    never sent. An `Authorization` the operator set (`headers=`) still wins."""
    user = FakePlatform(frames=[frame("events", model_stream("Hi"))])
    operator = FakePlatform(frames=[frame("events", model_stream("Hi"))])
    async with serve(user.app) as user_url, serve(operator.app) as operator_url:
        runtime = CopilotRuntime(agents={
            "platform": LangGraphPlatformAgent(deployment_url=user_url, graph_id="fake"),
            "operated": LangGraphPlatformAgent(
                deployment_url=operator_url, graph_id="fake",
                headers={"Authorization": "Bearer operator-token"})})
        async with serve_runtime(runtime) as served:
            for agent in ("platform", "operated"):
                await served.generate(session(agent, "hi", f"t-{agent}"),
                                      {"authorization": "user-token"})
    assert user.headers
    assert operator.headers
    assert {seen.get("authorization") for seen in user.headers} == {"Bearer user-token"}
    assert {seen.get("authorization") for seen in operator.headers} == {
        "Bearer operator-token"}


async def test_a_users_authorization_no_header_can_hold_refuses_the_run_unsaid(
        serve_runtime: ServeRuntime) -> None:
    fake = FakePlatform(frames=[frame("events", model_stream("Hi"))])
    async with serve(fake.app) as platform:
        runtime = CopilotRuntime(agents={"platform": LangGraphPlatformAgent(
            deployment_url=platform, graph_id="fake")})
        async with serve_runtime(runtime) as served:
            response = await served.session.post(served.url, json={
                "query": CLIENT_DOCUMENT, "variables": {
                    "data": session("platform", "hi", "t-bad"),
                    "properties": {"authorization": "tok\r\nX-Injected: 1"}}},
                headers=CLIENT_HEADERS)
            body = await response.read()
    assert b"forwardedProps.authorization (properties.authorization) must be text" in body
    assert b"X-Injected" not in body
    assert not fake.calls
