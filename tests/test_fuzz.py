"""Generated requests against every route of both protocols (Hypothesis).

The server runs in a process of its own (`fuzz_support.server`), its threads and
coordination on PostgreSQL (the strictest store). Whatever is sent: no 5xx, no stack trace or
file path in an answer, every JSON answer parses, every started event stream (SSE or GraphQL
multipart) ends properly, the server logs no unhandled error and no run it could not store,
and a normal chat works afterwards on both protocols. Its peak RSS stays under 200 MB.

The fast profile (fixed seed, 25 examples a test, 100 on the routes that start runs; the
issue-14 faults as explicit examples) runs in the test command. The long one is random:

    COPILOT_FUZZ=long .venv/bin/python -m pytest tests/test_fuzz.py -s

(1,000 examples a test, 4,000 on the run routes; `COPILOT_FUZZ_EXAMPLES=N` sets the base).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import free_port
from tests.gql.wire import CHAT_DOCUMENT, CLIENT_HEADERS, chat_data, text_message
from tests.hitl_support.postgres import postgres_schema

BASE = "/api/copilotkit"
LONG = os.environ.get("COPILOT_FUZZ") == "long"
EXAMPLES = int(os.environ.get("COPILOT_FUZZ_EXAMPLES", "1000" if LONG else "25"))
PEAK_RSS_LIMIT_KIB = 200 * 1024
pytestmark = pytest.mark.timeout(7200 if LONG else 300)

settings.register_profile(
    "fuzz", max_examples=EXAMPLES, deadline=None, database=None, derandomize=not LONG,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture])
FUZZ = settings.get_profile("fuzz")
# The routes that start runs get more of the budget: that is where the faults were.
RUNS = settings(FUZZ, max_examples=EXAMPLES * 4)

# What must never reach a client. (Generated text cannot plausibly contain these.)
LEAKS = (b"Traceback (most recent call last)", b'File "/', b"site-packages", b"/usr/lib/python")

COUNTS: dict[str, int] = {}


# -- the server ------------------------------------------------------------------------------


class Server:
    def __init__(self, port: int, process: subprocess.Popen[bytes], log: Path) -> None:
        self.port = port
        self.process = process
        self.log = log

    def peak_rss_kib(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        raise AssertionError("no VmHWM")

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            data = response.read()  # raises IncompleteRead on a cut stream
            return response.status, {k.lower(): v for k, v in response.getheaders()}, data
        finally:
            connection.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    root = Path(__file__).resolve().parent.parent
    with postgres_schema() as store, open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.fuzz_support.server", str(port), store], cwd=root,
            stdout=out, stderr=subprocess.STDOUT)
        yield from _serving(Server(port, process, log))


def _serving(served: Server) -> Iterator[Server]:
    process, log = served.process, served.log
    try:
        deadline = time.monotonic() + 60
        while b"ready" not in log.read_bytes():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the fuzz server did not start"
            time.sleep(0.05)
        yield served
        print(f"\nfuzz server: {sum(COUNTS.values())} requests {COUNTS}, "
              f"peak RSS {served.peak_rss_kib() / 1024:.1f} MiB")
    finally:
        process.terminate()
        process.wait(timeout=30)


# -- what every answer must be ---------------------------------------------------------------


def check(server: Server, route: str, method: str, path: str, body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    COUNTS[route] = COUNTS.get(route, 0) + 1
    status, answer_headers, data = server.request(method, path, body, headers)
    assert status < 500, (route, status, data[:300])
    for leak in LEAKS:
        assert leak not in data, (route, data[:300])
    kind = answer_headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        check_sse(route, data)
    elif kind.startswith("multipart/mixed"):
        assert data.endswith(b"\r\n-----\r\n"), (route, data[-80:])
    elif data and method != "HEAD":
        assert "json" in kind, (route, kind)
        json.loads(data)
    return status, data


def check_sse(route: str, data: bytes) -> None:
    assert not data or data.endswith(b"\n\n"), (route, data[-80:])
    events = [json.loads(frame[frame.index(b"data: ") + 6:]) for frame in data.split(b"\n\n")
              if b"data: " in frame]
    if route.endswith("run"):
        assert events, (route, data[:200])
        assert events[0]["type"] == "RUN_STARTED", events[0]
    if events:
        assert events[-1]["type"] in ("RUN_FINISHED", "RUN_ERROR"), (route, events[-1])


def check_log(server: Server) -> None:
    log = server.log.read_bytes()
    # Nor a run that streamed and then could not be stored.
    for fault in (b"unhandled error", b"could not store", b"could not write"):
        assert fault not in log, log[-3000:].decode(errors="replace")


# -- generated values ------------------------------------------------------------------------

# Text without the markers `LEAKS` looks for (no quote, slash or backslash) and without
# directives the mock LLM obeys (it would stall or fail on purpose).
text = st.text(st.characters(codec="utf-8", exclude_characters='"/\\:'), max_size=40)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner,
                                                                          max_size=4),
    max_leaves=20)
ids = st.one_of(st.sampled_from(["t1", "t2", "default", "", " ", "%2F", "..", "a" * 300]), text)


def nested(depth: int, leaf: Any) -> Any:
    for i in range(depth):
        leaf = {"k": leaf} if i % 2 else [leaf]
    return leaf


# Depths around every stage's limit: the edge's 64, orjson's ~254 (and a little past both).
deep = st.builds(nested, st.one_of(st.sampled_from([63, 64, 65, 200, 251, 252, 253, 254, 255,
                                                    260, 300]), st.integers(1, 320)),
                 json_values)

roles = st.sampled_from(["user", "assistant", "system", "developer", "tool", "activity",
                         "reasoning", "bogus"])
message = st.fixed_dictionaries(
    {"id": ids, "role": roles},
    optional={"content": st.one_of(text, json_values, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "binary", "image", "document", "x"])},
        optional={"text": text, "mimeType": text, "data": text, "url": text,
                  "source": json_values}), max_size=3)),
        "toolCalls": json_values, "toolCallId": ids, "name": text})
tool = st.fixed_dictionaries({"name": text, "description": text},
                             optional={"parameters": st.one_of(json_values, deep)})
run_body = st.fixed_dictionaries(
    {"threadId": ids, "runId": ids},
    optional={"messages": st.one_of(st.lists(message, max_size=4), scalars, json_values),
              "state": st.one_of(json_values, deep), "tools": st.one_of(
                  st.lists(tool, max_size=3), json_values),
              "context": json_values, "forwardedProps": st.one_of(json_values, deep),
              "parentRunId": json_values, "resume": json_values})


def valid_run(thread: str) -> dict[str, Any]:
    return {"threadId": thread, "runId": "r", "tools": [], "context": [],
            "forwardedProps": {}, "state": {},
            "messages": [{"id": "u", "role": "user", "content": "hi"}]}


def mutate(thread: str, key: str, value: Any, drop: bool) -> dict[str, Any]:
    run = valid_run(thread)
    if drop:
        run.pop(key, None)
    else:
        run[key] = value
    return run


# A valid run with one field replaced or removed: what gets past the first checks.
mutated_run = st.builds(
    mutate, st.sampled_from(["f1", "f2", "f3", "f4"]),
    st.sampled_from(["messages", "state", "tools", "context", "forwardedProps", "threadId",
                     "runId", "parentRunId", "resume", "extra"]),
    st.one_of(scalars, json_values, deep, st.lists(message, max_size=3),
              st.lists(tool, max_size=2)),
    st.booleans())
# A body: mostly run-shaped, sometimes anything, sometimes not JSON at all.
body = st.one_of(mutated_run.map(lambda b: json.dumps(b).encode()),
                 mutated_run.map(lambda b: json.dumps(b).encode()),
                 run_body.map(lambda b: json.dumps(b).encode()),
                 json_values.map(lambda v: json.dumps(v).encode()),
                 deep.map(lambda v: json.dumps(v).encode()),
                 st.binary(max_size=200),
                 run_body.map(lambda b: json.dumps(b).encode()[: len(json.dumps(b)) // 2]))


def quote(value: str) -> str:
    return urllib.parse.quote(value, safe="") or "x"


JSON = {"Content-Type": "application/json"}


# -- AG-UI multi-route -----------------------------------------------------------------------


@RUNS
@given(agent=st.one_of(st.just("default"), st.just("default"), ids),
       action=st.sampled_from(["run", "run", "connect"]), data=body)
# The faults of issue 14, kept as examples so every run tries them.
@example(agent="default", action="run", data=json.dumps(mutate("f1", "messages", True,
                                                                False)).encode())
@example(agent="default", action="run", data=json.dumps(mutate("f2", "state", nested(
    260, 1), False)).encode())
@example(agent="default", action="run", data=json.dumps(mutate("f3", "tools", [{
    "name": "t", "description": "", "parameters": nested(255, 1)}], False)).encode())
# What PostgreSQL's text cannot hold (NUL) in ids and in a run's first message (its title).
@example(agent="default", action="run", data=json.dumps(mutate("f5\x00", "messages", [
    {"id": "u\x00", "role": "user", "content": "hi\x00"}], False)).encode())
@example(agent="default", action="connect", data=json.dumps(mutate("f6", "runId", "r\x00",
                                                                    False)).encode())
def test_fuzz_agent_run_and_connect(server: Server, agent: str, action: str,
                                    data: bytes) -> None:
    status, _ = check(server, f"agent/{action}", "POST",
                      f"{BASE}/agent/{quote(agent)}/{action}", data, JSON)
    thread = _thread_of(data)
    if status == 200 and thread:
        # Whatever the run was, its thread stays readable.
        for what in ("events", "messages", "state"):
            check(server, "threads/x", "GET", f"{BASE}/threads/{quote(thread)}/{what}")
        check(server, "agent/connect", "POST", f"{BASE}/agent/default/connect", data, JSON)


def _thread_of(data: bytes) -> str | None:
    try:
        decoded = json.loads(data)
    except ValueError:
        return None
    thread = decoded.get("threadId") if isinstance(decoded, dict) else None
    return thread if isinstance(thread, str) else None


@FUZZ
@given(agent=st.one_of(st.just("default"), ids), thread=ids,
       data=st.one_of(st.just(b""), body, json_values.map(lambda v: json.dumps(
           {"runId": v}).encode())),
       method=st.sampled_from(["POST", "GET", "PUT"]))
def test_fuzz_agent_stop(server: Server, agent: str, thread: str, data: bytes,
                         method: str) -> None:
    check(server, "agent/stop", method, f"{BASE}/agent/{quote(agent)}/stop/{quote(thread)}",
          data, JSON)


@FUZZ
@given(thread=ids, what=st.sampled_from(["messages", "events", "state", "x"]),
       agent=st.one_of(st.none(), ids), method=st.sampled_from(["GET", "HEAD", "POST"]))
@example(thread="t\x00", what="messages", agent="\x00", method="GET")
def test_fuzz_threads_and_info(server: Server, thread: str, what: str, agent: str | None,
                               method: str) -> None:
    query = f"?agentId={quote(agent)}" if agent is not None else ""
    check(server, "threads", method, f"{BASE}/threads{query}")
    check(server, "threads/x", method, f"{BASE}/threads/{quote(thread)}/{what}")
    check(server, "info", method, f"{BASE}/info")


@FUZZ
@given(given_id=st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                      exclude_characters="\x7f"), max_size=200),
       what=st.sampled_from(["health", "ready", "ready/", "info", "threads"]),
       method=st.sampled_from(["GET", "HEAD", "POST", "DELETE", "OPTIONS"]))
@example(given_id="a" * 129, what="ready", method="GET")
@example(given_id="x y\tz", what="info", method="GET")
def test_fuzz_probes_and_request_ids(server: Server, given_id: str, what: str,
                                     method: str) -> None:
    status, answer = check(server, "probes", method, f"{BASE}/{what}", None,
                           {"X-Request-ID": given_id})
    if what.startswith(("health", "ready")) and method in ("GET", "HEAD"):
        assert status == 200, answer
        if method == "GET":
            assert json.loads(answer)["status"] in ("ok", "ready")
    # Every answer says the request's id (a probe's and a preflight's too, never
    # identified): the one given when plain.
    _, headers, _ = server.request(method, f"{BASE}/{what}", None, {"X-Request-ID": given_id})
    told = headers["x-request-id"]
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", told), told
    if re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", given_id):
        assert told == given_id


@FUZZ
@given(approval=ids, data=st.one_of(st.just(b""), body, json_values.map(
    lambda v: json.dumps({"decision": v}).encode())),
       method=st.sampled_from(["GET", "POST", "DELETE"]))
@example(approval="\x00", data=b"", method="GET")
def test_fuzz_approvals(server: Server, approval: str, data: bytes, method: str) -> None:
    check(server, "approvals", "GET", f"{BASE}/approvals")
    check(server, "approvals/x", method, f"{BASE}/approvals/{quote(approval)}", data, JSON)


# -- AG-UI single-route envelope -------------------------------------------------------------


envelope = st.fixed_dictionaries(
    {"method": st.one_of(st.sampled_from(["info", "agent/run", "agent/connect",
                                          "agent/stop"]), json_values)},
    optional={"params": st.one_of(st.fixed_dictionaries(
        {"agentId": st.one_of(st.just("default"), ids, json_values)},
        optional={"threadId": st.one_of(ids, json_values)}), json_values),
        "body": st.one_of(mutated_run, run_body, json_values, deep)})


@RUNS
@given(data=st.one_of(envelope.map(lambda e: json.dumps(e).encode()), body),
       content_type=st.sampled_from(["application/json", "text/plain", ""]))
@example(data=json.dumps({"method": "agent/run", "params": {"agentId": "default"},
                          "body": mutate("f4", "messages", -1, False)}).encode(),
         content_type="application/json")
def test_fuzz_envelope(server: Server, data: bytes, content_type: str) -> None:
    check(server, "envelope", "POST", BASE, data,
          {"Content-Type": content_type} if content_type else {})


# -- GraphQL ---------------------------------------------------------------------------------

DOCUMENTS = [
    CHAT_DOCUMENT,
    "query { hello }",
    "query { availableAgents { agents { name id description } } }",
    "query load($data: LoadAgentStateInput!) { loadAgentState(data: $data) "
    "{ threadId threadExists state messages } }",
    "{ __schema { types { name } } }",
]


def chat_variables(thread: str, words: str, state: Any, schema: Any, props: Any,
                   extra: dict[str, Any]) -> dict[str, Any]:
    data = chat_data(
        [text_message("u1", "user", words)], thread=thread or "gql-fuzz",
        actions=[{"name": "act", "description": "", "jsonSchema": json.dumps(schema)}],
        agentStates=[{"agentName": "default", "state": json.dumps(state)}])
    data.update(extra)
    return {"data": data, "properties": props}


graphql_variables = st.one_of(
    st.builds(chat_variables, ids, text, st.one_of(json_values, deep),
              st.one_of(json_values, deep), json_values,
              st.dictionaries(st.sampled_from(["messages", "agentSession", "frontend",
                                               "forwardedParameters", "metaEvents",
                                               "threadId", "runId", "cloud"]),
                              json_values, max_size=2)),
    st.builds(lambda t, a: {"data": {"threadId": t, "agentName": a}}, ids, ids),
    json_values)
graphql_body = st.one_of(
    st.builds(lambda q, v, n: {"query": q, "variables": v, "operationName": n},
              st.one_of(st.sampled_from(DOCUMENTS), text), graphql_variables,
              st.one_of(st.none(), text)),
    st.dictionaries(st.sampled_from(["query", "variables", "operationName", "extensions"]),
                    json_values))


@RUNS
@given(data=graphql_body, multipart=st.booleans())
@example(data={"query": CHAT_DOCUMENT, "variables": chat_variables(
    "g1", "hi", nested(260, 1), {}, {}, {})}, multipart=True)
def test_fuzz_graphql_post(server: Server, data: dict[str, Any], multipart: bool) -> None:
    headers = dict(CLIENT_HEADERS)
    if not multipart:
        headers["Accept"] = "application/json"
    check(server, "graphql", "POST", BASE, json.dumps(data).encode(), headers)


@FUZZ
@given(query=st.one_of(st.sampled_from(DOCUMENTS), text),
       variables=st.one_of(st.none(), text, json_values.map(json.dumps)))
def test_fuzz_graphql_get(server: Server, query: str, variables: str | None) -> None:
    params = {"query": query}
    if variables is not None:
        params["variables"] = variables
    check(server, "graphql-get", "GET", f"{BASE}?{urllib.parse.urlencode(params)}")


# -- afterwards ------------------------------------------------------------------------------


def test_fuzz_zz_normal_chat_works_afterwards(server: Server) -> None:
    """Runs last in the module (pytest keeps file order): the server still serves."""
    run = {"threadId": "after-fuzz", "runId": "r1", "tools": [], "context": [],
           "forwardedProps": {}, "state": {},
           "messages": [{"id": "u1", "role": "user", "content": "hello"}]}
    status, data = check(server, "agent/run", "POST", f"{BASE}/agent/default/run",
                         json.dumps(run).encode(), JSON)
    assert status == 200
    events = [json.loads(f[f.index(b"data: ") + 6:]) for f in data.split(b"\n\n")
              if b"data: " in f]
    assert "".join(e.get("delta", "") for e in events) == "echo: hello"
    variables = chat_variables("after-fuzz-gql", "hello", {}, {}, {}, {})
    status, data = check(server, "graphql", "POST", BASE, json.dumps(
        {"query": CHAT_DOCUMENT, "variables": variables}).encode(), dict(CLIENT_HEADERS))
    assert status == 200
    assert b'"errors"' not in data
    assert b"ec" in data
    check_log(server)
    peak = server.peak_rss_kib()
    assert peak < PEAK_RSS_LIMIT_KIB, f"peak RSS {peak / 1024:.0f} MiB"
