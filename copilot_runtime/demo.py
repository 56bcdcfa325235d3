"""The demo runtime behind `copilot-runtime demo`: a default agent, two example actions, and
the two human-in-the-loop workflows.

With `OPENAI_API_KEY` / `OPENAI_BASE_URL`, `ANTHROPIC_API_KEY` or `GOOGLE_API_KEY` set it
talks to that provider's model (see `copilot_runtime.adapters.from_env`); without, to the
offline demo models, so it runs with no key or network.

Agents:

* `default`: the built-in agent with `get_weather` and `roll_dice`.
* `review_loop`: a planner sends the task to the Invoice, Closing or Audit
  specialist, and a person approves the result or asks for a revision, as often as needed.
  The client may set `state.review = false` to skip the review for a task.
* `account_review`: three agents analyse a demo account (`ACME-001`,
  `GLOBEX-002`, `INITECH-003`; named in the message, or `state.account_id`), then a
  person approves the first recommendation within `approval_timeout` seconds.

The workflows need the `langgraph` extra; without it the demo serves `default` only. Their
graphs are checkpointed at `checkpoints` (a `copilot_runtime.checkpointers` URL), so a
pending approval survives a restart of the demo.
"""

from __future__ import annotations

import random
from typing import Annotated, Any

from pydantic import Field

from copilot_runtime.actions import action
from copilot_runtime.adapters.base import ServiceAdapter
from copilot_runtime.adapters.demo import DemoAdapter
from copilot_runtime.adapters.from_env import adapter_from_env
from copilot_runtime.agents.base import Agent
from copilot_runtime.runtime import CopilotRuntime
from copilot_runtime.threads.base import ThreadStore

__all__ = [
    "WORKFLOWS_NEED_EXTRA",
    "build_demo_runtime",
    "demo_workflows",
    "get_weather",
    "missing_workflow_dependency",
    "roll_dice",
]

_CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy")


@action
def get_weather(city: str) -> dict[str, Any]:
    """Get the current weather for a city (demo data, the same for a city every time)."""
    seed = sum(city.lower().encode())
    return {"city": city, "temperature": 5 + seed % 25, "unit": "celsius",
            "conditions": _CONDITIONS[seed % len(_CONDITIONS)]}


@action
def roll_dice(sides: Annotated[int, Field(ge=2, le=1000)] = 6,
              count: Annotated[int, Field(ge=1, le=100)] = 1) -> dict[str, Any]:
    """Roll `count` dice with `sides` sides each."""
    # The bounds are in the schema, so a model (the offline one too) keeps within them.
    rolls = [random.randint(1, sides) for _ in range(count)]
    return {"rolls": rolls, "total": sum(rolls)}


def _configured_model() -> tuple[ServiceAdapter, str] | None:
    return adapter_from_env()  # OpenAI, Anthropic or Gemini, from the environment


def demo_adapter() -> tuple[ServiceAdapter, str]:
    """The configured model, or the offline one; and a line saying which."""
    configured = _configured_model()
    if configured is not None:
        return configured
    return DemoAdapter(), ("the offline demo model (set OPENAI_API_KEY, ANTHROPIC_API_KEY or "
                           "GOOGLE_API_KEY/GEMINI_API_KEY for a real one)")


#: What a user without the `langgraph` extra is told, once, when the demo starts.
WORKFLOWS_NEED_EXTRA = ("the review_loop and account_review workflows need the langgraph "
                        "extra: pip install 'copilot-runtime[langgraph]'")


def missing_workflow_dependency() -> str | None:
    """The top-level module the workflows need and cannot import, or None if they can run.

    Everything the workflows import is tried here, before any agent is built, so a missing
    piece (the extra, or a dependency of the translator) is found in one place.
    """
    try:
        import copilot_runtime.agents.langgraph
        import copilot_runtime.checkpointers
        import copilot_runtime.workflows.accounts
        import copilot_runtime.workflows.models
        import copilot_runtime.workflows.review_loop
        import copilot_runtime.workflows.specialists  # noqa: F401
    except ImportError as exc:
        return (exc.name or "?").split(".")[0]
    return None


def demo_workflows(checkpoints: str = "memory", *, approval_timeout: float | None = 300,
                   adapter: ServiceAdapter | None = None) -> dict[str, Agent]:
    """The review loop and the account review as agents, checkpointed at `checkpoints`.

    `adapter` is the specialists' model; by default the configured one, else the offline
    specialist model. Empty when the `langgraph` extra is not installed
    (`missing_workflow_dependency()` says what is missing).
    """
    if missing_workflow_dependency() is not None:
        return {}
    from copilot_runtime.checkpointers import checkpointer
    from copilot_runtime.workflows.accounts import account_review
    from copilot_runtime.workflows.models import AdapterChatModel, OfflineSpecialistAdapter
    from copilot_runtime.workflows.review_loop import ReviewLoop
    from copilot_runtime.workflows.specialists import finance_specialists

    if adapter is None:
        configured = _configured_model()
        adapter = configured[0] if configured else OfflineSpecialistAdapter()
    saver = checkpointer(checkpoints)  # one database for both graphs and their approvals
    model = AdapterChatModel(adapter=adapter)
    # The demo's clients may switch review off for a task (`state.review = false`, as said
    # above); a deployment decides that itself, the loop refuses it by default.
    review: Agent = ReviewLoop(finance_specialists(model), client_may_skip_review=True).agent(
        name="review_loop", checkpointer=saver,
        description="Invoice, Closing and Audit specialists; you approve or revise")
    accounts: Agent = account_review(timeout_seconds=approval_timeout).agent(
        name="account_review", checkpointer=saver,
        description="Account snapshot, history and recommendations; you approve")
    return {"review_loop": review, "account_review": accounts}


def build_demo_runtime(thread_store: ThreadStore | None = None, *,
                       checkpoints: str = "memory",
                       approval_timeout: float | None = 300,
                       coordinator: str | None = None) -> tuple[CopilotRuntime, str]:
    adapter, description = demo_adapter()
    runtime = CopilotRuntime(
        service_adapter=adapter,
        actions=[get_weather, roll_dice],
        instructions="You are the assistant of the copilot-runtime demo. Be brief.",
        thread_store=thread_store,
        coordinator=coordinator,
        agents=demo_workflows(checkpoints, approval_timeout=approval_timeout),
    )
    return runtime, description
