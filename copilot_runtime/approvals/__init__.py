"""Human-in-the-loop approvals: the ledger of interrupts waiting for a person.

A core subsystem, below the agents: the ledger (`ledger`: memory, and `sql`: SQLite and
PostgreSQL beside a checkpointer), what a run does with it (`resume`), how an answer reads
(`decisions`), and the service that lists, answers, times out and recovers approvals
(`service`), owned by `CopilotRuntime` as `runtime.approvals`. Nothing here imports
LangGraph; the errors are in `copilot_runtime._exceptions`.
"""

from copilot_runtime._exceptions import (
    ApprovalClosedError,
    ApprovalError,
    ApprovalNotFoundError,
    NothingToResumeError,
)
from copilot_runtime.approvals.decisions import Decision, parse_decision, timeout_answer
from copilot_runtime.approvals.ledger import (
    Approval,
    ApprovalStatus,
    ApprovalStore,
    MemoryApprovalStore,
    SupportsApprovals,
)
from copilot_runtime.approvals.service import ApprovalService, RunHost

__all__ = [
    "Approval",
    "ApprovalClosedError",
    "ApprovalError",
    "ApprovalNotFoundError",
    "ApprovalService",
    "ApprovalStatus",
    "ApprovalStore",
    "Decision",
    "MemoryApprovalStore",
    "NothingToResumeError",
    "RunHost",
    "SupportsApprovals",
    "parse_decision",
    "timeout_answer",
]
