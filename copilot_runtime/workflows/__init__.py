"""Human-in-the-loop workflows, and the approval machinery they share.

* `ReviewLoop`: planner → specialist → a person approves or asks for a revision.
* `Orchestrator`: existing agents in sequence, then an approval with a timeout;
  `account_review()` is its example on offline demo data, `existing_agent` the wrapper that
  turns one existing agent into a `LangGraphAgent`.
* Approvals: every LangGraph interrupt is a pending approval in a ledger beside the
  checkpoints (`approvals`), answerable from a chat or over plain HTTP, timed out when it
  expires and resumed after a restart (`service`).

Everything but `approvals`, `decisions` and `service` needs the `langgraph` extra; names are
imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AdapterChatModel",
    "Approval",
    "ApprovalPolicy",
    "ApprovalService",
    "ApprovalStore",
    "Decision",
    "ModelSpecialist",
    "OfflineSpecialistAdapter",
    "Orchestrator",
    "ReviewLoop",
    "SpecialistRequest",
    "Step",
    "account_review",
    "approval_service",
    "existing_agent",
    "finance_specialists",
    "keyword_router",
    "parse_decision",
    "run_existing_agent",
    "wrap_existing_agent",
]

_WHERE = {
    "AdapterChatModel": "workflows.models", "OfflineSpecialistAdapter": "workflows.models",
    "ApprovalPolicy": "workflows.orchestrator", "Orchestrator": "workflows.orchestrator",
    "Step": "workflows.orchestrator",
    "ModelSpecialist": "workflows.specialists", "SpecialistRequest": "workflows.specialists",
    "finance_specialists": "workflows.specialists", "keyword_router": "workflows.specialists",
    "ReviewLoop": "workflows.review_loop", "account_review": "workflows.accounts",
    "existing_agent": "workflows.existing", "run_existing_agent": "workflows.existing",
    "wrap_existing_agent": "workflows.existing",
    # The approvals subsystem sits in the core (`copilot_runtime.approvals`); the workflows
    # re-export what their users reach for.
    "Approval": "approvals", "ApprovalStore": "approvals", "ApprovalService": "approvals",
    "Decision": "approvals", "parse_decision": "approvals", "approval_service": "runtime",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"copilot_runtime.{module}"), name)
