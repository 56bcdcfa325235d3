"""Escaped lone UTF-16 surrogates in JSON, as a JavaScript sender writes them.

`JSON.stringify` writes a string cut inside an emoji (`"😀".slice(0, 1)`) as `"\\ud83d"`.
The TypeScript runtime takes such a body; ours answered 400 (orjson refuses the escape),
which the 1.10 client shows as "Failed to find CopilotKit API endpoint", on every later
request too, as the cut string stays in the chat. Each lone half now reads as U+FFFD.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from copilot_runtime import CopilotRuntime
from copilot_runtime._exceptions import InvalidRequestError, JSONTooDeepError
from copilot_runtime._input import parse_json_body
from copilot_runtime._limits import MAX_JSON_DEPTH, check_json_text, decode_json
from copilot_runtime.actions import action
from copilot_runtime.agents._legacy import RuntimeEventTranslator
from copilot_runtime.agents._wire import RemoteEventChecker
from copilot_runtime.agents.builtin import BuiltInAgent
from copilot_runtime.agents.remote_endpoint import _parse_line
from copilot_runtime.approvals.decisions import parse_decision
from copilot_runtime.testing import MockOpenAIServer
from copilot_runtime.testing.scripted import ScriptedAdapter, text_turn, tool_turn
from tests.conftest import Served, ServeRuntime, parse_sse, run_input, text_of, types
from tests.gql.wire import CLIENT_DOCUMENT, CLIENT_HEADERS, chat_data, merge, parse_multipart
from tests.gql.wire import text_message as gql_text_message

pytestmark = pytest.mark.timeout(30)

TIMEOUT = 20
REPLACEMENT = "\ufffd"


def as_javascript_sends(value: Any) -> bytes:
    """`value` as `JSON.stringify` writes it: lone surrogates as `\\udXXX` escapes
    (Python's `json` escapes them the same way; orjson would refuse to)."""
    import json

    return json.dumps(value, ensure_ascii=True).encode()


# -- the decoder ---------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    (rb'"\ud83d"', REPLACEMENT),                            # a lone high half
    (rb'"\udc00"', REPLACEMENT),                            # a lone low half
    (rb'"\uD83D"', REPLACEMENT),                            # hex digits in either case
    (rb'"\ud83d\u0041"', REPLACEMENT + "A"),                # high, then a non-low escape
    (rb'"\ud83d\ud83d"', REPLACEMENT * 2),                  # high, then another high
    (rb'"\ud83d\ud83d\ude00"', REPLACEMENT + "\U0001F600"),  # a lone high before a pair
    (rb'"\ud83d\ude00\ude00"', "\U0001F600" + REPLACEMENT),  # a pair, then a lone low
    (rb'["\ud83d\ude00", "\ud83d"]', ["\U0001F600", REPLACEMENT]),  # a valid pair is kept
    (rb'["\\ud83d", "\udc00"]', ["\\ud83d", REPLACEMENT]),  # `\\` then "ud83d": plain text
    (rb'["\\\ud83d", "\ud83d"]', ["\\" + REPLACEMENT, REPLACEMENT]),  # `\\`, then an escape
    (rb'"a\"\ud83d\n"', 'a"' + REPLACEMENT + "\n"),          # after other escapes
    (rb'{"\ud83d": {"k\udc00": 1}}', {REPLACEMENT: {"k" + REPLACEMENT: 1}}),  # in keys
])
def test_lone_surrogates_read_as_the_replacement_character(text: bytes, expected: Any) -> None:
    for value in (decode_json(text), parse_json_body(text), check_json_text(text.decode(), "x")):
        assert value == expected
        orjson.dumps(value)  # what was read can be written again (events, stores, SDKs)


@pytest.mark.parametrize("body", [
    b'"\xff\\ud83d"',                # raw invalid UTF-8 as well as an escape
    b'"\xed\xa0\xbd"',               # a surrogate encoded raw (CESU), not escaped
    b'"\xed\xa0\xbd\\ud83d"',
])
def test_raw_invalid_utf8_is_still_refused_as_before(body: bytes) -> None:
    with pytest.raises(orjson.JSONDecodeError) as before:
        orjson.loads(body.replace(b"\\ud83d", b""))
    with pytest.raises(InvalidRequestError) as refused:
        parse_json_body(body)
    assert refused.value.message == "Invalid request body"
    assert refused.value.details == f"Malformed JSON: {before.value.msg}"


@pytest.mark.parametrize(("body", "problem"), [
    (b'{"a": "\\ud83d",}', "trailing comma is not allowed"),
    (b'"\\ud83d', "unexpected end of data"),
    (b'["\\ud83d", \x00]', None),                         # a raw NUL: refused as it is
    (b'\\ud83d', None),                                   # an escape outside any string
])
def test_malformed_json_with_a_lone_surrogate_is_still_refused(
        body: bytes, problem: str | None) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parse_json_body(body)
    assert refused.value.details.startswith("Malformed JSON: ")
    if problem is not None:
        assert refused.value.details == f"Malformed JSON: {problem}"


def test_the_depth_bound_holds_on_the_slow_path() -> None:
    deep = b"[" * (MAX_JSON_DEPTH + 1) + b'"\\ud83d"' + b"]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(JSONTooDeepError):
        parse_json_body(deep)
    with pytest.raises(JSONTooDeepError):
        check_json_text(deep.decode(), "'variables'")
    with pytest.raises(orjson.JSONDecodeError):  # orjson's own bound, beyond ours
        decode_json(b"[" * 5000 + b'"\\ud83d"' + b"]" * 5000)


def test_hostile_escapes_take_one_linear_pass() -> None:
    # 4 MiB of each worst case: dense halves, pairs, and escaped backslashes before "u".
    for unit in (rb"\ud83d", rb"\udc00", rb"\ud83d\ude00", rb"\\\ud83d", rb"\\u"):
        body = b'["' + unit * (4 * 1024 * 1024 // len(unit)) + rb'\ud83d"]'
        value = decode_json(body)
        assert value[0].endswith(REPLACEMENT)


# -- what upstreams send (a JavaScript remote agent writes the same escapes) ----------------


def test_remote_agent_lines_and_events_take_lone_surrogates() -> None:
    line = _parse_line(rb'{"type": "x", "text": "\ud83d"}', "Remote agent 'x'")
    assert line["text"] == REPLACEMENT
    events = RemoteEventChecker("Remote agent 'x'").payloads(
        [rb'{"type": "CUSTOM", "name": "n", "value": "cut \ud83d"}'])
    assert events[0]["value"] == "cut " + REPLACEMENT
    translated = RuntimeEventTranslator("Remote agent 'x'").translate(
        {"type": "AgentStateMessage", "state": r'{"doc": "cut \ud83d"}', "active": True,
         "nodeName": "n"})
    snapshots = [e for e in translated if e["type"] == "STATE_SNAPSHOT"]
    assert snapshots[0]["snapshot"] == {"doc": "cut " + REPLACEMENT}


# -- both protocols, end to end -------------------------------------------------------------


@pytest.mark.parametrize("where", ["message", "context"])
async def test_agui_run_takes_a_lone_surrogate(
        served: Served, llm: MockOpenAIServer, where: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        cut = "\ud83d"  # what `"😀".slice(0, 1)` is in JavaScript
        text = "Summarise: " + (cut if where == "message" else "")
        body = run_input(text, thread=f"surrogate-{where}")
        if where == "context":
            body["context"] = [{"description": "doc", "value": "cut mid-emoji " + cut}]
        response = await served.post("/agent/default/run", raw=as_javascript_sends(body))
        assert response.status == 200, await response.text()
        events = parse_sse(await response.read())
        assert types(events)[-1] == "RUN_FINISHED"
        if where == "message":
            assert text_of(events) == "echo: Summarise: " + REPLACEMENT
        else:  # the model was given the context, cut where the client cut it
            assert "cut mid-emoji " + REPLACEMENT in orjson.dumps(llm.requests[-1]).decode()
        # The thread keeps it, and the next request of the chat works.
        response = await served.session.get(served.url + f"/threads/surrogate-{where}/events")
        assert response.status == 200
        assert REPLACEMENT in (await response.read()).decode()
        again = run_input("next", thread=f"surrogate-{where}", run="run-2")
        assert types(await served.run(again))[-1] == "RUN_FINISHED"


@pytest.mark.parametrize("where", ["message", "context"])
async def test_graphql_generate_takes_a_lone_surrogate(
        served: Served, llm: MockOpenAIServer, where: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        cut = "\ud83d"
        text = "Summarise: " + (cut if where == "message" else "")
        data = chat_data([gql_text_message("u1", "user", text)], thread=f"gql-surr-{where}")
        if where == "context":
            data["context"] = [{"description": "doc", "value": "cut mid-emoji " + cut}]
        response = await served.session.post(served.url, data=as_javascript_sends(
            {"query": CLIENT_DOCUMENT, "variables": {"data": data}}), headers=CLIENT_HEADERS)
        assert response.status == 200, await response.text()
        merged = merge(parse_multipart(await response.read()))
        assert "errors" not in merged, merged
        result = merged["data"]["generateCopilotResponse"]
        assert result["status"]["code"] == "Success", result["status"]
        answers = [m["content"] for m in result["messages"]
                   if m["__typename"] == "TextMessageOutput"]
        assert ["".join(a) if isinstance(a, list) else a for a in answers] == [
            "echo: " + text.replace(cut, REPLACEMENT)]
        if where == "context":
            assert "cut mid-emoji " + REPLACEMENT in orjson.dumps(llm.requests[-1]).decode()


def test_an_approval_answer_given_as_json_text_keeps_its_decision() -> None:
    # Before, the text was not JSON to us, so "approve" became a revision asking for it.
    decision = parse_decision('{"action": "approve", "reason": "cut \\ud83d"}')
    assert decision is not None
    assert (decision.action, decision.feedback) == ("approve", "cut " + REPLACEMENT)


async def test_a_server_side_action_takes_arguments_with_a_lone_surrogate(
        serve_runtime: ServeRuntime) -> None:
    """A model's tool-call arguments holding an escaped lone surrogate (a string it cut
    inside an emoji): read as U+FFFD, as every other JSON is. Before, the action refused
    them as "not valid JSON (no low surrogate in string)"."""
    @action
    def lookup(q: str) -> dict[str, str]:
        """Look something up."""
        return {"got": q}

    async with asyncio.timeout(TIMEOUT):
        adapter = ScriptedAdapter(tool_turn(("lookup", '{"q": "smile \\ud83d"}')),
                                  text_turn("done"))
        runtime = CopilotRuntime(agents={"default": BuiltInAgent(adapter, actions=[lookup])})
        async with serve_runtime(runtime) as served:
            events = await served.run(run_input("look it up", thread="surrogate-action"))
        results = [e["content"] for e in events if e["type"] == "TOOL_CALL_RESULT"]
        assert [orjson.loads(r) for r in results] == [{"got": "smile " + REPLACEMENT}]
        assert text_of(events) == "done"


# -- a byte order mark -----------------------------------------------------------------------

BOM = b"\xef\xbb\xbf"


def test_one_leading_byte_order_mark_is_skipped_as_fetch_does() -> None:
    # Fetch's `Request.json()` (the TypeScript runtime's) decodes UTF-8 dropping one BOM.
    assert parse_json_body(BOM + b'{"a": 1}') == {"a": 1}
    assert decode_json(BOM + b"[1]") == [1]
    for refused in (BOM + BOM + b"{}", b" " + BOM + b"{}", BOM):  # only one, only first
        with pytest.raises(InvalidRequestError):
            parse_json_body(refused)


async def test_every_protocol_takes_a_body_with_a_byte_order_mark(served: Served) -> None:
    async with asyncio.timeout(TIMEOUT):
        info = await served.post("", raw=BOM + b'{"method": "info"}')
        assert info.status == 200, await info.text()
        assert "agents" in await info.json()
        run = await served.post("/agent/default/run",
                                raw=BOM + orjson.dumps(run_input("hi", thread="bom-run")))
        assert run.status == 200, await run.text()
        assert types(parse_sse(await run.read()))[-1] == "RUN_FINISHED"
        data = chat_data([gql_text_message("u1", "user", "hi")], thread="bom-gql")
        answer = await served.session.post(served.url, data=BOM + orjson.dumps(
            {"query": CLIENT_DOCUMENT, "variables": {"data": data}}), headers=CLIENT_HEADERS)
        assert answer.status == 200, await answer.text()
        merged = merge(parse_multipart(await answer.read()))
        assert merged["data"]["generateCopilotResponse"]["status"]["code"] == "Success"
