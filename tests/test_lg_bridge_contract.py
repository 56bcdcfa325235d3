"""The ag-ui-langgraph internals that `agents/_lg_bridge.py` builds on, checked against the
installed release.

`CopilotKitLangGraphBridge` overrides private hooks of `ag_ui_langgraph.LangGraphAgent` and
relies on names the base reads. A release that renames a hook or changes its parameters
would otherwise make the override dead code, silently; each test here names what moved.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import pytest
from ag_ui_langgraph import LangGraphAgent  # type: ignore[import-untyped]
from ag_ui_langgraph.types import CustomEventNames  # type: ignore[import-untyped]

from copilot_runtime.agents import _lg_bridge
from copilot_runtime.agents._lg_bridge import CopilotKitLangGraphBridge

pytestmark = pytest.mark.timeout(30)

RELEASE = f"ag-ui-langgraph {version('ag-ui-langgraph')}"

#: The base's methods the bridge overrides.
HOOKS = ("prepare_stream", "get_schema_keys", "langgraph_default_merge_state",
         "_handle_single_event", "_dispatch_event", "_filter_orphan_tool_messages",
         "_interrupts_to_agui", "_prepare_interrupt_tail", "_current_lane",
         "_record_tool_call_owners", "_build_command_from_agui_resume",
         "get_state_and_messages_snapshots", "get_stream_kwargs")
#: The bridge's own methods: the base must not have them, or the bridge would shadow it.
OWN = ("stream", "_translate_metadata", "_base_metadata", "_translate_event",
       "_failed_tool_results", "_reduced")
#: The base's methods the bridge or `agents/langgraph*.py` call, with their parameters.
CALLED = {"_handle_stream_events": ["self", "input"], "clone": ["self"],
          "get_capabilities": ["self"], "get_state_snapshot": ["self", "state"],
          "_translate_snapshot_ids": ["self", "agui_messages"],
          "_merge_subagent_messages": ["self", "agui_messages"],
          "_collect_interrupts": ["tasks"],
          "_resolve_public_tool_call_id": ["self", "upstream_id", "lane"],
          "_resolve_public_message_id": ["self", "upstream_id", "lane"],
          "_streamed_call_key": ["self", "public_call_id"],
          "_tool_call_owner": ["self", "tool_call_id"]}
#: Keyword arguments `agents/langgraph.py` and `agents/langgraph_platform.py` construct with.
CONSTRUCTED_WITH = ("name", "graph", "description", "config", "emit_raw_events",
                    "emit_interrupt_outcome", "enable_legacy_on_interrupt_event")
#: Attributes and keys the base reads or writes that the bridge reads or writes too.
SHARED_NAMES = ("self._inbound_subagent_messages", "self.active_run",
                '"manually_emitted_state"', "self.constant_schema_keys", '"emit-messages"',
                '"emit-tool-calls"', '"predict_state"', "self.emit_subagent_events",
                '"current_subagent_run_id"', "self._ORPHAN_TOOL_MSG_RE",
                '"streamed_tool_call_ids"', '"tool_call_id"',
                # (`_reduced` updates the base's running state: `prepare_stream`'s dict)
                'state = prepared_stream_response["state"]', "current_graph_state = state",
                "current_graph_state.update(output)")


def _methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items()
            if inspect.isfunction(value) and name != "__init__"}


def _shape(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def _kind(function: Callable[..., Any]) -> str:
    if inspect.isasyncgenfunction(function):
        return "async generator"
    return "coroutine" if inspect.iscoroutinefunction(function) else "plain"


def test_the_lists_here_cover_every_method_of_the_bridge() -> None:
    assert _methods(CopilotKitLangGraphBridge) == {*HOOKS, *OWN}, (
        "agents/_lg_bridge.py gained or lost a method: list it in HOOKS (overrides a base "
        "method) or OWN here")


@pytest.mark.parametrize("hook", HOOKS)
def test_each_overridden_hook_still_exists_with_the_same_signature(hook: str) -> None:
    base = getattr(LangGraphAgent, hook, None)
    assert base is not None, (
        f"{RELEASE} no longer has LangGraphAgent.{hook}, which agents/_lg_bridge.py "
        f"overrides: the override is dead code")
    ours = getattr(CopilotKitLangGraphBridge, hook)
    assert _shape(ours) == _shape(base), (
        f"{RELEASE} changed LangGraphAgent.{hook}{inspect.signature(base)}; "
        f"agents/_lg_bridge.py overrides it as {hook}{inspect.signature(ours)}")
    assert _kind(ours) == _kind(base), (
        f"{RELEASE}: LangGraphAgent.{hook} is now a {_kind(base)}, the override a {_kind(ours)}")


@pytest.mark.parametrize("name", OWN)
def test_the_bridge_does_not_shadow_a_new_base_method(name: str) -> None:
    assert not hasattr(LangGraphAgent, name), (
        f"{RELEASE} added LangGraphAgent.{name}; agents/_lg_bridge.py defines its own "
        f"{name} and would shadow it")


@pytest.mark.parametrize("name", sorted(CALLED))
def test_the_base_methods_we_call_keep_their_parameters(name: str) -> None:
    base = getattr(LangGraphAgent, name, None)
    assert base is not None, f"{RELEASE} no longer has LangGraphAgent.{name}, which we call"
    assert list(inspect.signature(base).parameters) == CALLED[name], (
        f"{RELEASE} changed LangGraphAgent.{name}{inspect.signature(base)}")


def test_the_constructor_takes_the_keywords_we_pass() -> None:
    parameters = inspect.signature(LangGraphAgent.__init__).parameters
    missing = [name for name in CONSTRUCTED_WITH if name not in parameters]
    assert not missing, f"{RELEASE}: LangGraphAgent() no longer takes {missing}"


@pytest.mark.parametrize("name", SHARED_NAMES)
def test_the_base_still_uses_the_names_the_bridge_shares(name: str) -> None:
    source = inspect.getsource(inspect.getmodule(LangGraphAgent))  # type: ignore[arg-type]
    assert name in source, (
        f"{RELEASE} no longer mentions {name} in {LangGraphAgent.__module__}; "
        f"agents/_lg_bridge.py reads or writes it")


def test_the_custom_events_the_bridge_renames_to_still_exist() -> None:
    known = {member.value for member in CustomEventNames}
    renamed = set(_lg_bridge._RENAMED_CUSTOM_EVENTS.values())
    assert renamed <= known, (
        f"{RELEASE} no longer handles the custom events {sorted(renamed - known)}, which "
        f"agents/_lg_bridge.py translates CopilotKit's events into")


def test_langgraph_still_reads_the_durability_key_the_agent_sets() -> None:
    """`LangGraphAgent` sets each run's checkpoint durability through the configurable key
    LangGraph reads when a run is given none (how subgraphs inherit it)."""
    from langgraph._internal._constants import CONFIG_KEY_DURABILITY
    from langgraph.pregel import main

    from copilot_runtime.agents.langgraph import DURABILITY_KEY

    assert CONFIG_KEY_DURABILITY == DURABILITY_KEY, (
        f"langgraph {version('langgraph')} reads durability from {CONFIG_KEY_DURABILITY!r}; "
        f"agents/langgraph.py sets {DURABILITY_KEY!r}")
    assert "CONFIG_KEY_DURABILITY" in inspect.getsource(main)
