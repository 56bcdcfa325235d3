"""An example `Orchestrator`: reviewing a customer account, on offline demo data.

Three existing agents (`execute_with_events(context)`, see `existing`), each working
from the demo accounts below instead of a CRM and a memory store:

    zoho_scout             account_id, session_id            → account_snapshot
    memory_analyst         account_id, account_snapshot      → historical_context
    recommendation_author  account_id, snapshot, history     → recommendations

then a person approves the first recommendation (or rejects it, or lets it time out).
`account_review(...)` builds the `Orchestrator`. Everything is deterministic.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

from copilot_runtime.workflows.orchestrator import ApprovalPolicy, Orchestrator, Step

__all__ = ["DEMO_ACCOUNTS", "MemoryAnalyst", "RecommendationAuthor", "ZohoDataScout",
           "account_review"]

Event = dict[str, Any]

DEMO_ACCOUNTS: Final[dict[str, dict[str, Any]]] = {
    "ACME-001": {"name": "Acme Corp", "industry": "Manufacturing", "arr": 480_000,
                 "open_deals": 3, "support_tickets": 12, "health": "at risk",
                 "days_since_contact": 41,
                 "notes": ["renewal in 60 days", "champion left in Q2",
                           "ticket backlog on integrations"]},
    "GLOBEX-002": {"name": "Globex", "industry": "Energy", "arr": 1_250_000,
                   "open_deals": 5, "support_tickets": 2, "health": "healthy",
                   "days_since_contact": 6,
                   "notes": ["expansion talks with the EU team", "asked for SSO pricing"]},
    "INITECH-003": {"name": "Initech", "industry": "Software", "arr": 95_000,
                    "open_deals": 1, "support_tickets": 7, "health": "watch",
                    "days_since_contact": 19,
                    "notes": ["usage down 30% since March", "billing dispute closed"]},
}


def _event(name: str, **data: Any) -> Event:
    return {"event": name, "data": data}


class ZohoDataScout:
    """Reads the account from the (demo) CRM."""

    async def execute_with_events(self, context: dict[str, Any]) -> AsyncIterator[Event]:
        account_id = context.get("account_id")
        yield _event("agent_started", agent="zoho_scout", step=context.get("step"),
                     task=f"Load account {account_id}")
        yield _event("tool_call", tool_name="crm.get_account",
                     tool_args={"account_id": account_id}, tool_call_id=f"crm-{account_id}")
        account = DEMO_ACCOUNTS.get(str(account_id))
        yield _event("tool_result", tool_call_id=f"crm-{account_id}",
                     tool_name="crm.get_account", result=account, success=account is not None,
                     error=None if account else "not found")
        if account is None:
            known = ", ".join(DEMO_ACCOUNTS)
            missing = "No account id in the message" if account_id is None \
                else f"No account {account_id!r}"
            yield _event("agent_error", error_message=f"{missing} (demo accounts: {known})")
            return
        snapshot = {"account_id": account_id, **{k: v for k, v in account.items()
                                                 if k != "notes"},
                    "summary": f"{account['name']}: ARR {account['arr']:,} USD, "
                               f"{account['open_deals']} open deals, "
                               f"{account['support_tickets']} tickets, {account['health']}"}
        yield _event("agent_completed", agent="zoho_scout", step=context.get("step"),
                     output=snapshot)


class MemoryAnalyst:
    """Recalls what happened with the account before."""

    async def execute_with_events(self, context: dict[str, Any]) -> AsyncIterator[Event]:
        snapshot: Mapping[str, Any] = context.get("account_snapshot") or {}
        account = DEMO_ACCOUNTS.get(str(context.get("account_id")), {})
        yield _event("agent_started", agent="memory_analyst", step=context.get("step"),
                     task="Recall the account's history")
        notes = list(account.get("notes", []))
        trend = "declining" if snapshot.get("health") == "at risk" else (
            "stable" if snapshot.get("health") == "watch" else "growing")
        yield _event("agent_stream", agent="memory_analyst", content_type="text",
                     content=f"{len(notes)} notes found")
        yield _event("agent_completed", agent="memory_analyst", step=context.get("step"),
                     output={"notes": notes, "trend": trend,
                             "summary": f"{len(notes)} past notes; trend {trend}"})


class RecommendationAuthor:
    """Writes recommendations from the snapshot and the history."""

    async def execute_with_events(self, context: dict[str, Any]) -> AsyncIterator[Event]:
        snapshot: Mapping[str, Any] = context.get("account_snapshot") or {}
        history: Mapping[str, Any] = context.get("historical_context") or {}
        account_id = context.get("account_id")
        yield _event("agent_started", agent="recommendation_author",
                     step=context.get("step"), task="Write recommendations")
        recommendations = []
        if snapshot.get("health") == "at risk" or history.get("trend") == "declining":
            recommendations.append(_recommendation(
                account_id, 1, "executive_outreach", "high",
                f"Health is {snapshot.get('health')} and no contact for "
                f"{snapshot.get('days_since_contact')} days",
                "Protects the renewal"))
        if int(snapshot.get("support_tickets") or 0) > 5:
            recommendations.append(_recommendation(
                account_id, len(recommendations) + 1, "support_escalation", "medium",
                f"{snapshot.get('support_tickets')} open support tickets",
                "Fewer escalations before the renewal"))
        if int(snapshot.get("open_deals") or 0) >= 3:
            recommendations.append(_recommendation(
                account_id, len(recommendations) + 1, "expansion_proposal", "medium",
                f"{snapshot.get('open_deals')} open deals", "Larger contract"))
        if not recommendations:
            recommendations.append(_recommendation(
                account_id, 1, "check_in", "low", "Nothing urgent", "Keeps the relationship"))
        feedback = context.get("feedback")
        if feedback:  # a revision asked for by the approver
            for item in recommendations:
                item["reasoning"] += f" (revised: {feedback})"
        yield _event("agent_completed", agent="recommendation_author",
                     step=context.get("step"), output=recommendations)


def _recommendation(account_id: Any, index: int, action: str, priority: str, reasoning: str,
                    impact: str) -> dict[str, Any]:
    return {"recommendation_id": f"{account_id}-rec-{index}", "account_id": account_id,
            "action_type": action, "priority": priority, "reasoning": reasoning,
            "expected_impact": impact}


def account_review(*, timeout_seconds: float | None = 300) -> Orchestrator:
    """The account review: snapshot → history → recommendations → approval."""
    return Orchestrator(
        [Step("zoho_scout", ZohoDataScout(), ("account_id", "session_id"),
              "account_snapshot"),
         Step("memory_analyst", MemoryAnalyst(), ("account_id", "account_snapshot"),
              "historical_context"),
         Step("recommendation_author", RecommendationAuthor(),
              ("account_id", "account_snapshot", "historical_context"), "recommendations")],
        approval=ApprovalPolicy("recommendations", timeout_seconds=timeout_seconds,
                                message="Approve the first recommendation?"))
