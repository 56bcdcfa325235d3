"""A set in a graph's state (or an interrupt's question) as every process shows it.

Before, a set went out as a list in the process's hash order, which differs per process (a
restart, another worker): the client's unchanged echo of its state no longer equalled the
checkpoint's value, was written over it as graph input (the node got a list, `.add()`
failed, and the checkpoint kept the list: every later run failed), and a quoted interrupt
question holding a set was refused as "no longer asked". Now `json_safe` sorts a set's items
by their JSON, and an echo in another order (shown before that) still reads as an echo.

That held only for a set that was a key's own value: one inside a dict or a list, or a set
of frozensets, still broke the thread, a 64-bit id a browser echoed as the nearest double
was written over the checkpoint's, and a client's change of 1 to true was dropped. Now the
echo and a quoted question are compared as the client read them, at any depth (`is_shown`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Annotated, Any

import pytest
import typing_extensions
from langchain_core.messages import AIMessage, AnyMessage
from langgraph.graph.message import add_messages
from langgraph.types import interrupt

from copilot_runtime.agents._lg_bridge import _echoed_keys
from copilot_runtime.agents._lg_values import json_safe
from tests.conftest import ServeRuntime, run_input
from tests.test_hostile_graphs import finished, graph_of, graph_values, lg_runtime

pytestmark = pytest.mark.timeout(120)

_SHOWN = """
import orjson
from copilot_runtime.agents._lg_values import json_safe
words = {f"tag-{i}" for i in range(40)}
print(orjson.dumps(json_safe({"tags": words, "frozen": frozenset(words), "mixed": {1, "1", None},
                              "nested": [{("a", 1), ("b", 2)}]})).decode())
"""


def test_a_set_is_shown_in_the_same_order_by_every_process() -> None:
    shown = {subprocess.run([sys.executable, "-c", _SHOWN], capture_output=True, check=True,
                            text=True, env={**os.environ, "PYTHONHASHSEED": seed},
                            timeout=60).stdout for seed in ("1", "2", "3")}
    assert len(shown) == 1, shown  # one order per process before
    assert json_safe({"b", "a", "c"}) == ["a", "b", "c"]


class Tagged(typing_extensions.TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    tags: set[str]


def tags_each_word(state: Tagged) -> dict[str, Any]:
    tags = state.get("tags", set())
    word = str(state["messages"][-1].content)
    return {"tags": tags | {word},  # (a list has no `|` with a set: the run fails)
            "messages": [AIMessage(f"tags was a {type(tags).__name__}")]}


async def test_a_set_echoed_in_another_processs_order_keeps_the_checkpoints_set(
        serve_runtime: ServeRuntime) -> None:
    graph = graph_of(Tagged, tags_each_word)
    async with serve_runtime(lg_runtime(graph)) as served:
        for word in ("alpha", "beta", "gamma"):
            finished(await served.run(run_input(word, thread="t", run=f"r-{word}"), agent="lg"))
        # the client holds the set as an earlier process showed it: in its hash order
        echoed = {"tags": ["gamma", "alpha", "beta"]}
        again = await served.run(run_input("delta", thread="t", run="r-delta", state=echoed),
                                 agent="lg")
    finished(again)
    values = await graph_values(graph, "t")
    assert values["messages"][-1].content == "tags was a set"  # a list before
    assert values["tags"] == {"alpha", "beta", "gamma", "delta"}


# ---- an echo is the checkpoint's value as the client was shown it, at any depth -----------

_OLD_ORDER = ["gamma", "alpha", "beta"]  # {"alpha", "beta", "gamma"} as a pre-fix process showed it
_BIG = 2**53 + 1  # e.g. a 64-bit id a service handed the graph


@pytest.mark.parametrize(("saved", "given", "echoed"), [
    ({"alpha", "beta", "gamma"}, _OLD_ORDER, True),
    ({"tags": {"alpha", "beta", "gamma"}}, {"tags": _OLD_ORDER}, True),
    ([{"alpha", "beta", "gamma"}], [_OLD_ORDER], True),
    ({frozenset({"b", "a"}), frozenset({"d", "c"})}, [["d", "c"], ["b", "a"]], True),
    # a tuple's order counts, a frozenset's not: each item pairs with one it can be
    ({frozenset({1, 2}), (2, 1)}, [[1, 2], [2, 1]], True),
    ({frozenset({1, 2}), (2, 1)}, [[2, 1], [2, 1]], True),
    ({frozenset({1, 2}), (2, 1)}, [[1, 2], [1, 2]], False),
    ({frozenset("xz"), ("y",), frozenset({1, 2}), (2, 1)},  # (not pairing off in sorted order)
     [["z", "x"], ["y"], [2, 1], [1, 2]], True),
    ([("a", "b")], [["b", "a"]], False),
    ({"tags": {"alpha", "beta"}}, {"tags": ["alpha", "beta", "gamma"]}, False),
    ({"tags": {"alpha", "beta"}}, {"tags": ["alpha", "alpha"]}, False),
    # an integer beyond 2**53 as a browser reads it (the nearest double)
    (_BIG, 9007199254740992, True),
    ({"ids": [_BIG]}, {"ids": [9007199254740992]}, True),
    ({"ids": {_BIG, 7}}, {"ids": [9007199254740992, 7]}, True),
    (_BIG, 9007199254740996, False),
    (5, 5.0, True),
    # JSON's true is not 1, nor false 0 (Python's `==` takes them for equal)
    (1, True, False),
    (0, False, False),
    (True, 1, False),
    ({"n": [0]}, {"n": [False]}, False),
    (float("nan"), None, True),  # (JSON.stringify writes null)
    (None, 0, False),
])
def test_an_echo_is_the_checkpoints_value_as_it_was_shown(saved: Any, given: Any,
                                                          echoed: bool) -> None:
    from copilot_runtime.agents._lg_bridge import _echoed_keys  # (the comparison it makes)

    assert bool(_echoed_keys({"k": given}, {"k": saved})) is echoed


class Prefs(typing_extensions.TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    prefs: dict[str, Any]


def tag_pref(state: Prefs) -> dict[str, Any]:
    tags = (state.get("prefs") or {}).get("tags", set())
    word = str(state["messages"][-1].content)
    return {"prefs": {"tags": tags | {word}},
            "messages": [AIMessage(f"tags was a {type(tags).__name__}")]}


async def test_a_set_inside_a_dict_echoed_in_another_order_keeps_the_checkpoints_set(
        serve_runtime: ServeRuntime) -> None:
    """Before, only a set that was a key's own value was compared in any order: this one
    was written over as a list, and the run (and every later one) failed."""
    graph = graph_of(Prefs, tag_pref)
    async with serve_runtime(lg_runtime(graph)) as served:
        for word in ("alpha", "beta", "gamma"):
            finished(await served.run(run_input(word, thread="t", run=f"r-{word}"), agent="lg"))
        echoed = {"prefs": {"tags": _OLD_ORDER}}
        again = await served.run(run_input("delta", thread="t", run="r-delta", state=echoed),
                                 agent="lg")
    finished(again)
    values = await graph_values(graph, "t")
    assert values["messages"][-1].content == "tags was a set"
    assert values["prefs"]["tags"] == {"alpha", "beta", "gamma", "delta"}


class Chat(typing_extensions.TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    chat_id: int


def keep_id(state: Chat) -> dict[str, Any]:
    return {"chat_id": state.get("chat_id") or _BIG, "messages": [AIMessage("ok")]}


async def test_a_64_bit_id_echoed_as_a_browser_reads_it_is_not_written(
        serve_runtime: ServeRuntime) -> None:
    """Before, the nearest double a browser echoes was taken for a change: it was written
    as graph input, and the checkpoint's id silently became another."""
    graph = graph_of(Chat, keep_id)
    async with serve_runtime(lg_runtime(graph)) as served:
        finished(await served.run(run_input("one", thread="t", run="r1"), agent="lg"))
        echoed = {"chat_id": 9007199254740992}  # JSON.parse("9007199254740993") in a browser
        finished(await served.run(run_input("two", thread="t", run="r2", state=echoed),
                                  agent="lg"))
    assert (await graph_values(graph, "t"))["chat_id"] == _BIG


def ask_with_options(state: Prefs) -> dict[str, Any]:
    answer = interrupt({"question": "which?", "options": {"colors": {"red", "green", "blue"}}})
    return {"messages": [AIMessage(f"answered {answer}")]}


async def test_a_quoted_question_with_a_set_inside_is_the_question_asked(
        serve_runtime: ServeRuntime) -> None:
    """Before, a set below the question's top level quoted in another process's order was
    refused as a question no longer asked."""
    graph = graph_of(Prefs, ask_with_options)
    async with serve_runtime(lg_runtime(graph)) as served:
        asked = await served.run(run_input("go", thread="q", run="r1"), agent="lg")
        assert any(e.get("name") == "on_interrupt" for e in asked)
        quoted = {"question": "which?", "options": {"colors": ["red", "blue", "green"]}}
        answered = await served.run(run_input("", thread="q", run="r2", messages=[],
                                              forwardedProps={"command": {
                                                  "resume": "blue",
                                                  "interruptEvent": json.dumps(quoted)}}),
                                    agent="lg")
    finished(answered)
    assert (await graph_values(graph, "q"))["messages"][-1].content == "answered blue"


@pytest.mark.parametrize(("saved", "given", "echoed"), [
    (2**60, 2**60 + 1, False),  # no double: a client reading integers whole changed it
    (2**64 - 1, 2**64 - 2, False),
    (2**53 + 1, 2**53, True),  # what a browser reads 2**53 + 1 as
    (2**60, 2**60, True),
    ({"tags": {"b", "a"}}, {"tags": ["a", "b"]}, True),
    (1, True, False),
])
def test_an_integer_no_browser_could_send_is_compared_exactly(saved: Any, given: Any,
                                                              echoed: bool) -> None:
    """Before: every integer was compared as the double it rounds to, so a client that reads
    integers whole (a server, a Python client) changing 2**60 to 2**60 + 1 had its change
    dropped as an echo (a review)."""
    assert bool(_echoed_keys({"k": given}, {"k": saved})) is echoed
