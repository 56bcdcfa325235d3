"""A set in a graph's state (or an interrupt's question) as every process shows it.

Before, a set went out as a list in the process's hash order, which differs per process (a
restart, another worker): the client's unchanged echo of its state no longer equalled the
checkpoint's value, was written over it as graph input (the node got a list, `.add()`
failed, and the checkpoint kept the list: every later run failed), and a quoted interrupt
question holding a set was refused as "no longer asked". Now `json_safe` sorts a set's items
by their JSON, and an echo in another order (shown before that) still reads as an echo.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Annotated, Any

import pytest
import typing_extensions
from langchain_core.messages import AIMessage, AnyMessage
from langgraph.graph.message import add_messages

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
