"""The agent interface: whatever produces AG-UI events for a run.

An agent receives the validated `RunInput` and a `RunContext`, and yields batches of events.
The runtime owns the run's envelope: it sends `RUN_STARTED` before the agent starts (so the
client hears back at once), closes what the agent left open, and appends `RUN_FINISHED`, or
`RUN_ERROR` if the agent raises. An agent may end the run itself with `RUN_FINISHED` (to set
`result` or an interrupt `outcome`) or `RUN_ERROR`. A `RUN_STARTED` it yields first is merged
into the runtime's.

An agent that keeps its own threads (a LangGraph checkpointer, a remote service) may also
answer `load_state`, which the protocols use to show a thread the runtime never ran itself.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from copilot_runtime._input import RunInput
from copilot_runtime.auth import Principal
from copilot_runtime.events import EventBatches

__all__ = ["Agent", "AgentThreadState", "RunContext"]


@dataclass(slots=True)
class RunContext:
    """What an agent may know about the request beyond its input."""

    agent_id: str
    #: Request headers, lower-cased; the protocol edge decides which ones are passed on.
    headers: Mapping[str, str] = field(default_factory=dict)
    #: False ends the run after server-side tool results instead of calling the model again
    #: (the turn semantics of the GraphQL protocol, where the client sends the follow-up).
    follow_up_server_tools: bool = True
    #: Who asked for the run (None without authentication). Never sent to remote agents
    #: by the runtime; their `HeaderPolicy` decides which of the client's headers go.
    principal: Principal | None = None
    #: What `on_request` hooks added about the request.
    annotations: Mapping[str, Any] = field(default_factory=dict)
    #: Token counts of the run's model calls (`input_tokens`, `output_tokens`), summed by
    #: agents that know them.
    usage: dict[str, int] = field(default_factory=dict)
    #: The run's telemetry (`copilot_runtime.telemetry.RunTelemetry`) when configured:
    #: agents open model and tool spans under it.
    telemetry: Any = None
    #: Why the run is being cut short from outside, set before its task is cancelled:
    #: "stop" (its caller asked), "disconnect" (its client left), "lost" (this process lost
    #: the thread's lease) or "shutdown"; None for a cancellation nobody explained.
    cut_reason: str | None = None


@dataclass(slots=True)
class AgentThreadState:
    """A thread as the agent itself remembers it, in the core's vocabulary.

    `state` leaves out `messages`; `messages` are AG-UI messages as JSON-ready dicts
    (camelCase keys, like the `messages` of `RunAgentInput`).
    """

    thread_id: str
    exists: bool
    state: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)


class Agent(abc.ABC):
    """Base class of every agent kind."""

    #: Shown to clients as `className` in `/info`.
    class_name: str = "Agent"
    #: Whether the agent keeps its threads in this process (a LangGraph graph's
    #: checkpointer): a chat suggestion then runs on a throwaway thread it forgets at the
    #: end. An agent whose threads live upstream is sent the client's thread id as is.
    keeps_threads_here: bool = False

    def __init__(self, *, description: str = "") -> None:
        self.description = description

    def capabilities(self) -> dict[str, Any] | None:
        """AG-UI `AgentCapabilities` advertised in `/info`, or None."""
        return None

    @abc.abstractmethod
    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        """Yield the run's events in batches (see the module docstring for the contract)."""

    def forwarded_input(self, forwarded_props: Mapping[str, Any]) -> Collection[str]:
        """The keys of a request's `forwardedProps` whose values this agent takes as run
        input (a LangGraph graph's state keys): guardrails judge their values as they judge
        `state`. None by default: the rest of `forwardedProps` is the app's data (auth
        tokens, say), which is not sent to a judge model."""
        return ()

    async def load_state(self, thread_id: str, *,
                         headers: Mapping[str, str] | None = None) -> AgentThreadState | None:
        """The thread as the agent keeps it, or None to let the runtime's thread store answer.

        `headers` are the client's request headers (lower-cased), for agents that forward
        them as they do for runs. Failures raise `CopilotRuntimeError`s, like runs do.
        """
        return None

    async def forget_thread(self, thread_id: str) -> None:  # noqa: B027 - optional hook
        """Forget what the agent keeps of a thread the runtime deleted (nothing by default)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release what the agent made itself (called when the runtime shuts down; a runtime
        started again, or another runtime, may use the agent again after): not what the
        application gave it, which is the application's to close."""
