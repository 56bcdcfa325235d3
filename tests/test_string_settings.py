"""Settings that take several strings refuse one string.

A `str` is an iterable of strings, so `CopilotRuntime(approver_roles="approver")` passed as
`Iterable[str]` and became the set of its letters: real approvers were refused (404) and a
principal with the role "a" could approve every thread of its tenant. The same held for a
principal's roles, a `HeaderPolicy`'s lists (`deny="authorization"` denied nothing but
one-letter names) and every other public setting of several strings. Each refuses a lone
string now, naming the setting; lists and tuples of strings pass as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from copilot_runtime import (
    BuiltInAgent,
    ConfigurationError,
    CopilotRuntime,
    CORSPolicy,
    HeaderPolicy,
    JWTAuth,
    MCPServer,
    OpenAIAdapter,
    Orchestrator,
    PatternGuardrail,
    Principal,
    Step,
    TopicGuardrail,
)
from copilot_runtime.workflows.existing import existing_agent, wrap_existing_agent
from copilot_runtime.workflows.specialists import ModelSpecialist

pytestmark = pytest.mark.timeout(30)

ADAPTER = OpenAIAdapter(base_url="http://127.0.0.1:9/v1", api_key="sk-test")


class Runner:
    async def run(self, context: Any) -> Any:
        return context


def _step(keys: Any) -> Step:
    return Step("author", Runner(), keys, "recommendations")  # type: ignore[arg-type]


MADE: dict[str, Callable[[Any], object]] = {
    "approver_roles": lambda v: CopilotRuntime(service_adapter=ADAPTER, approver_roles=v),
    "mcp_allowed_urls": lambda v: CopilotRuntime(service_adapter=ADAPTER, mcp_allowed_urls=v),
    "roles": lambda v: Principal("alice", roles=v),
    "allow": lambda v: HeaderPolicy(allow=v),
    "allow_prefixes": lambda v: HeaderPolicy(allow_prefixes=v),
    "deny": lambda v: HeaderPolicy(deny=v),
    "deny_prefixes": lambda v: HeaderPolicy(deny_prefixes=v),
    "algorithms": lambda v: JWTAuth("k" * 32, algorithms=v),
    "origins": lambda v: CORSPolicy(origins=v, allow_credentials=True),
    "PatternGuardrail": lambda v: PatternGuardrail(deny=v),
    "TopicGuardrail allow": lambda v: TopicGuardrail(ADAPTER, allow=v),
    "TopicGuardrail deny": lambda v: TopicGuardrail(ADAPTER, deny=v),
    "allowed_models": lambda v: BuiltInAgent(ADAPTER, allowed_models=v),
    "args": lambda v: MCPServer(command="server", args=v),
    "MCPServer.stdio": lambda v: MCPServer.stdio("server", v),
    "input_keys": _step,
    "provided_keys": lambda v: Orchestrator([_step(("account_id",))], provided_keys=v),
    "context_keys": lambda v: wrap_existing_agent(Runner(), "wrapped", context_keys=v),
    "existing_agent": lambda v: existing_agent(Runner(), name="wrapped", context_keys=v,
                                               checkpointer=InMemorySaver()),
    "keywords": lambda v: ModelSpecialist("Invoice", "invoices", "Prepare invoices.",
                                          object(), keywords=v),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("setting", MADE)
def test_one_string_for_several_is_refused(setting: str) -> None:
    with pytest.raises(ConfigurationError, match="takes several strings, not one string"):
        MADE[setting]("account_id")
    MADE[setting](["account_id"])  # (a list of one passes)


def test_approver_roles_and_principal_roles_are_whole_names() -> None:
    runtime = CopilotRuntime(service_adapter=ADAPTER, approver_roles=["approver"])
    assert runtime.approver_roles == {"approver"}
    assert Principal("carol", roles=("approver",)).roles == {"approver"}
    with pytest.raises(ConfigurationError, match="approver_roles"):
        CopilotRuntime(service_adapter=ADAPTER, approver_roles="approver")
