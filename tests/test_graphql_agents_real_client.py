"""Agent sessions over GraphQL, driven by the real client, `@copilotkit/runtime-client-gql`
1.10.6, the way react-core 1.10's chat drives them.

A module fixture starts the mock LLM, the scripted remote AG-UI agent and our server
(`tests/gql/agents_app.py`: LangGraph graphs `lg` and `planner` in-process, and `remote`)
as child processes, and runs `tests/gql/drive_agents.mjs` once over every case. The driver
keeps each chat's state as useChat does: the agent session and node the last agent-state
message names, the agents' states (sent back as `agentStates`), the history the last state
message syncs, and the frontend actions it runs before its follow-up. Each test reads one
case.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

import pytest

from tests.agents_support.processes import REPO_ROOT, child_process, free_port, mock_llm
from tests.test_graphql_real_client import _npm_ci

GQL_DIR = REPO_ROOT / "tests" / "gql"
Json = dict[str, Any]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Json:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not on PATH: these tests need Node.js >= 20", pytrace=False)
    _npm_ci()
    logs = tmp_path_factory.mktemp("graphql-agents-real-client")
    remote_port, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}/copilotkit"
    with mock_llm(logs) as llm_url, child_process(
            "agui-agent", [sys.executable, "-m", "tests.agents_support.agui_server",
                           "--port", str(remote_port)],
            ready_url=f"http://127.0.0.1:{remote_port}/agent", ready_method="POST",
            log_dir=logs), child_process(
            "runtime", [sys.executable, "-m", "copilot_runtime", "serve",
                        "tests.gql.agents_app:app", "--host", "127.0.0.1", "--port", str(port)],
            ready_url=url, ready_method="POST", log_dir=logs,
            env={"LLM_BASE_URL": llm_url,
                 "REMOTE_AGENT_URL": f"http://127.0.0.1:{remote_port}/agent"}):
        done = subprocess.run([node, str(GQL_DIR / "drive_agents.mjs"), url], cwd=GQL_DIR,
                              capture_output=True, text=True, timeout=120, check=False)
        log = (logs / "runtime.log").read_text(errors="replace")
    if done.returncode != 0 or not done.stdout.strip():
        pytest.fail(f"drive_agents.mjs failed ({done.returncode}):\n{done.stderr[-3000:]}\n"
                    f"--- server log ---\n{log[-3000:]}", pytrace=False)
    results: Json = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def case(cases: Json, name: str) -> Any:
    result = cases.get(name)
    assert result is not None, f"drive_agents.mjs produced no result for {name}"
    assert "driverError" not in result, result["driverError"]
    return result


def of(response: Json, kind: str) -> list[Json]:
    return [m for m in response["messages"] if m["type"] == kind]


def texts(response: Json) -> list[str]:
    return [m["content"] for m in of(response, "text")]


def ok(response: Json) -> None:
    assert response["errors"] == []
    assert response["status"] == {"code": "Success", "__typename": "SuccessResponseStatus"}
    assert all(m["status"] == "Success" for m in response["messages"])


def test_available_agents(cases: Json) -> None:
    result = case(cases, "available_agents")
    assert result["error"] is None
    assert [(a["name"], a["id"], a["description"])
            for a in result["data"]["availableAgents"]["agents"]] == [
        ("lg", "lg", "A chat graph that knows the weather"),
        ("planner", "planner", "Plans items with the page"),
        ("remote", "remote", "A remote AG-UI agent")]


def test_langgraph_chat_keeps_its_session(cases: Json) -> None:
    result = case(cases, "lg_chat")
    (first,), (second,) = result["first"], result["second"]
    for response in (first, second):
        ok(response)
        assert {(s["agentName"], s["threadId"]) for s in of(response, "state")} == {
            ("lg", "gql-agents-chat")}
    assert texts(first) == ["echo: Hello agent"]
    assert texts(second) == ["echo: And again"]
    last = of(first, "state")[-1]
    assert (last["nodeName"], last["active"], last["running"]) == ("__end__", False, True)
    # What the client did with it: stayed in the agent's session, synced the history.
    after = result["afterFirst"]
    assert after["agentSession"] == {"threadId": "gql-agents-chat", "agentName": "lg",
                                     "nodeName": "__end__"}
    assert after["history"] == [{"role": "user", "content": "Hello agent"},
                                {"role": "assistant", "content": "echo: Hello agent"}]
    assert [h["content"] for h in result["after"]["history"]] == [
        "Hello agent", "echo: Hello agent", "And again", "echo: And again"]
    # loadAgentState reads the graph's checkpoint.
    assert result["loadError"] is None
    loaded = result["loaded"]
    assert loaded["threadExists"] is True
    assert json.loads(loaded["state"]) == {}
    assert [m["content"] for m in json.loads(loaded["messages"])] == [
        "Hello agent", "echo: Hello agent", "And again", "echo: And again"]


def test_tool_calling_graph_and_frontend_action(cases: Json) -> None:
    result = case(cases, "lg_tools")
    (server,) = result["server"]
    ok(server)
    order = [m["type"] for m in server["messages"] if m["type"] != "state"]
    assert order == ["call", "result", "text"]
    (call,), (answer,) = of(server, "call"), of(server, "result")
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert answer["actionExecutionId"] == call["id"]
    # The frontend action: run by the client, then its follow-up answers with the result.
    called, followed = result["frontend"]
    ok(called)
    ok(followed)
    assert [m["name"] for m in of(called, "call")] == ["sayHello"]
    assert texts(followed) == ['echo: {"greeting":"Hello, Ada!"}']
    history = result["after"]["history"]
    assert history[-3:] == [
        {"call": "sayHello", "arguments": {"name": "Ada"}},
        {"result": '{"greeting":"Hello, Ada!"}', "actionName": "sayHello"},
        {"role": "assistant", "content": 'echo: {"greeting":"Hello, Ada!"}'}]


def test_shared_state_read_and_written_by_the_page(cases: Json) -> None:
    result = case(cases, "shared_state")
    (first,), (second,) = result["first"], result["second"]
    ok(first)
    ok(second)
    assert of(first, "state")[0]["state"] == {"items": ["from the page"], "counter": 5}
    assert texts(first) == ["echo: items=['from the page', 'item 2']"]
    page_state = result["afterFirst"]["coagentStates"]["planner"]["state"]
    assert {k: v for k, v in page_state.items() if k != "messages"} == {
        "items": ["from the page", "item 2"], "counter": 6, "note": "2 items"}
    # The page wrote items and counter; the agent read them and wrote back.
    assert texts(second) == ["echo: items=['edited', 'by the user', 'item 3']"]
    final = result["after"]["coagentStates"]["planner"]
    assert {k: v for k, v in final["state"].items() if k != "messages"} == {
        "items": ["edited", "by the user", "item 3"], "counter": 11, "note": "3 items"}


def test_two_agents_side_by_side(cases: Json) -> None:
    result = case(cases, "two_agents")
    (left,), (right,) = result["lg"], result["planner"]
    ok(left)
    ok(right)
    assert texts(left) == ["echo: Hi from the left"]
    assert texts(right) == ["echo: items=['item 1']"]
    assert {s["agentName"] for s in of(left, "state")} == {"lg"}
    assert {s["agentName"] for s in of(right, "state")} == {"planner"}
    assert set(result["lgAfter"]["coagentStates"]) == {"lg"}
    assert set(result["plannerAfter"]["coagentStates"]) == {"planner"}


def test_handoff_to_another_agent(cases: Json) -> None:
    result = case(cases, "handoff")
    (response,) = result["seen"]
    ok(response)
    (call,), (started,) = of(response, "call"), of(response, "result")
    assert call["name"] == "planner"
    assert started["result"] == "planner agent started"
    assert texts(response) == ["echo: items=['item 1']"]
    assert next(s["agentName"] for s in of(response, "state")) == "lg"
    assert "planner" in {s["agentName"] for s in of(response, "state")}
    # The client follows the agent that answered.
    assert result["after"]["agentSession"]["agentName"] == "planner"


def test_remote_agent_that_dies_mid_stream(cases: Json) -> None:
    result = case(cases, "remote_dies")
    (response,) = result["seen"]
    status = response["status"]
    assert (status["__typename"], status["reason"]) == ("FailedResponseStatus", "UNKNOWN_ERROR")
    assert status["details"]["originalError"]["code"] == "NETWORK_ERROR"
    assert "Remote agent 'remote'" in status["details"]["description"]
    assert "127.0.0.1" not in json.dumps(response)
    assert [s["state"].get("stage") for s in of(response, "state")] == [
        None, "planning", "answering", "answering"]
    assert result["after"]["history"] == [{"role": "user", "content": "die:3 hello"}]


def test_remote_agent_answers(cases: Json) -> None:
    result = case(cases, "remote_ok")
    (response,) = result["seen"]
    ok(response)
    assert texts(response) == ["remote: hello remote"]
    assert result["after"]["coagentStates"]["remote"]["state"] == {
        "runs": 1, "stage": "answering", "lastInput": "hello remote", "nothing": None}


def test_load_state_of_an_unknown_thread(cases: Json) -> None:
    result = case(cases, "load_unknown_thread")
    assert result["error"] is None
    assert result["data"]["loadAgentState"] == {
        "threadId": "gql-agents-never", "threadExists": False, "state": "{}",
        "messages": "[]", "__typename": "LoadAgentStateResponse"}


def test_no_internals_reach_the_client(cases: Json) -> None:
    text = json.dumps(cases)
    for leak in ("Traceback", ".py", str(REPO_ROOT), "site-packages"):
        assert leak not in text, leak
