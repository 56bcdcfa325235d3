"""The runtime the HITL real-client tests serve, configured by the environment.

    HITL_CHECKPOINTS    checkpointer URL (sqlite:///..., postgresql://...?schema=..., memory)
    HITL_THREADS        SQLite file for the thread store (default: in memory)
    HITL_CALLS          file that gets one JSON line per specialist model call
    HITL_TIMEOUT        seconds before an account_review approval times out (default 300)

Agents: `review_loop` (the Invoice, Closing and Audit specialists on the offline model),
`account_review` (the orchestrator example) and `parallel_review` (two questions asked at
once), all on one checkpointer.
"""

from __future__ import annotations

import os

from copilot_runtime import CopilotRuntime, LangGraphAgent, SQLiteThreadStore
from copilot_runtime.checkpointers import checkpointer
from copilot_runtime.workflows.accounts import account_review
from copilot_runtime.workflows.models import AdapterChatModel, OfflineSpecialistAdapter
from copilot_runtime.workflows.review_loop import ReviewLoop
from copilot_runtime.workflows.specialists import finance_specialists
from tests.hitl_support.counting import CountingAdapter
from tests.hitl_support.parallel import parallel_review

_saver = checkpointer(os.environ.get("HITL_CHECKPOINTS", "memory"))
_model = AdapterChatModel(adapter=CountingAdapter(OfflineSpecialistAdapter(delay=0),
                                                  os.environ.get("HITL_CALLS")))
_threads = os.environ.get("HITL_THREADS")

runtime = CopilotRuntime(
    agents={
        # as the demo: a client may switch review off for a task
        "review_loop": ReviewLoop(finance_specialists(_model), client_may_skip_review=True
                                  ).agent(name="review_loop", checkpointer=_saver),
        "account_review": account_review(
            timeout_seconds=float(os.environ.get("HITL_TIMEOUT", "300"))).agent(
            name="account_review", checkpointer=_saver),
        "parallel_review": LangGraphAgent(name="parallel_review",
                                          graph=parallel_review(_saver)),
    },
    thread_store=SQLiteThreadStore(_threads) if _threads else None,
)
