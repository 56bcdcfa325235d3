"""Existing agents, written before LangGraph: objects whose `execute_with_events(context)`
yields events.

An existing agent yields dicts `{"event": <name>, "data": {...}}` with these names:
`agent_started`, `agent_stream`, `tool_call`, `tool_result`, `agent_completed` (its
`output`), `approval_required` (what needs approving), `agent_error` (`error_message`).
`run_existing_agent` consumes them inside a LangGraph node: each one reaches the client as
an AG-UI `CUSTOM` event of the same name while the agent works, and the outcome comes back
as an `AgentRun`. `wrap_existing_agent` is the wrapper: a one-agent LangGraph graph
(and `existing_agent` a `LangGraphAgent`) that runs it and, when the agent asks for it,
stops for an approval with a timeout.

Bounds, so an agent that misbehaves fails its step instead of filling memory, checkpoints
or the client: an output (or approval request) larger than `max_output_bytes` (1 MB by
default, as the checkpoint stores it) fails the step; an event larger than
`MAX_EVENT_BYTES` (its name counted; one that cannot be JSON) reaches the client as a
notice instead, a name is cut to `MAX_EVENT_NAME_CHARS`, and one that CopilotKit or the
runtime gives a meaning (`copilotkit_*`, `on_interrupt`, `Exit`, …) is forwarded as an
`agent_event` naming it; the agent is read up to its `agent_completed`; the run keeps the
first `MAX_KEPT_EVENTS` events (`events_seen` counts them all); and with `timeout_seconds`
an agent that has not finished by then fails its step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol, runtime_checkable

import orjson
import structlog
from langchain_core.callbacks.manager import adispatch_custom_event
from langchain_core.messages import AnyMessage, BaseMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.errors import GraphBubbleUp
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from copilot_runtime._exceptions import (
    FAILURES_OF_CALLED_CODE,
    AgentExecutionError,
    cancelled_itself,
    upstream_said,
)
from copilot_runtime._seconds import MAX_SECONDS, checked_seconds
from copilot_runtime._strings import not_one_string
from copilot_runtime._time import iso_time
from copilot_runtime.approvals.decisions import Decision, parse_decision
from copilot_runtime.workflows._answers import too_long
from copilot_runtime.workflows._emit import say
from copilot_runtime.workflows._served import ServedExistingAgent, context_refusal

__all__ = [
    "MAX_EVENT_BYTES",
    "MAX_EVENT_NAME_CHARS",
    "MAX_KEPT_EVENTS",
    "MAX_OUTPUT_BYTES",
    "AgentExecutionError",
    "AgentRun",
    "ExistingAgent",
    "WrappedAgentState",
    "approval_outcome",
    "approval_request",
    "checked_timeout",
    "existing_agent",
    "run_existing_agent",
    "wrap_existing_agent",
]

_log = structlog.get_logger("copilot_runtime.workflows")

#: The longest approval timeout (100 years): beyond it a deadline is not a date any clock
#: can write (`expiresAt`), so it is refused; None is the way to say "never expires".
MAX_TIMEOUT_SECONDS: float = MAX_SECONDS

# What checkpoints are written with by default: an output it cannot write would fail the
# checkpoint after the step ran, outside the step's own failure rules.
_SERDE = JsonPlusSerializer()

#: The largest output (or approval request) of an agent, in bytes as a checkpoint stores
#: it: it is kept in the graph's state, so in every checkpoint after it, and sent to the
#: client in state snapshots.
MAX_OUTPUT_BYTES = 1_000_000
#: The largest event forwarded to the client as it is (bytes of its JSON); a larger one is
#: forwarded as a notice of its size.
MAX_EVENT_BYTES = 64_000
#: How many of an agent run's events `AgentRun.events` keeps (the first ones).
MAX_KEPT_EVENTS = 200
#: The longest event name kept and forwarded (characters); a longer one is cut.
MAX_EVENT_NAME_CHARS = 200
# Names the runtime, CopilotKit or ag-ui-langgraph give a meaning of their own (a message
# to emit, the agent's exit, an interrupt): an agent's event of such a name is forwarded
# as an `agent_event` naming it, never taken for theirs.
_RESERVED_NAMES = frozenset({"on_interrupt", "Exit", "PredictState", "manually_emit_message",
                             "manually_emit_tool_call", "manually_emit_state",
                             "langgraph_stream_writer"})
_RESERVED_PREFIXES = ("copilotkit_", "on_copilotkit_", "copilot_runtime.")

#: The answer an approval expects (the interrupt's `responseSchema`).
APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"action": {"enum": ["approve", "reject"]}, "reason": {"type": "string"}},
    "required": ["action"],
}
#: The context key threads kept the wrapper's approval data under before it had its own.
_OLD_APPROVAL_KEY = "approval_data"


@runtime_checkable
class ExistingAgent(Protocol):
    def execute_with_events(self, context: dict[str, Any]
                            ) -> AsyncIterator[Mapping[str, Any]]:
        ...


@dataclass(slots=True)
class AgentRun:
    output: Any = None
    #: What the agent asked to have approved (`approval_required`), if anything.
    approval: dict[str, Any] | None = None
    #: The first `MAX_KEPT_EVENTS` events.
    events: list[dict[str, Any]] = field(default_factory=list)
    #: How many events the agent sent in all.
    events_seen: int = 0


async def run_existing_agent(agent: ExistingAgent, name: str, context: dict[str, Any],
                             config: RunnableConfig | None = None, *,
                             timeout_seconds: float | None = None,
                             max_output_bytes: int = MAX_OUTPUT_BYTES) -> AgentRun:
    """Run `agent` to its `agent_completed`; raise `AgentExecutionError` on `agent_error`,
    when it has not finished within `timeout_seconds`, and when its output (or approval
    request) is something a checkpoint cannot store or is larger than `max_output_bytes`,
    so the caller's failure rules apply before its output is kept or streamed as a success.

    With `config` (inside a graph node), each event is also dispatched as a LangChain
    custom event, which the runtime sends to the client as an AG-UI `CUSTOM` event.
    """
    run = AgentRun()
    deadline = asyncio.timeout(timeout_seconds)
    try:
        async with deadline:
            completed = await _consume(agent, name, context, config, run)
    except TimeoutError:
        if not deadline.expired():
            # The agent's own I/O timed out (its `wait_for`, a socket's or an HTTP client's
            # timeout), not this step's deadline: its failure, as any other exception.
            raise
        _log.warning("existing agent timed out", agent=name, seconds=timeout_seconds,
                     events=run.events_seen)
        raise AgentExecutionError(
            name, f"{name} did not finish within {timeout_seconds:g} seconds") from None
    if not completed:
        raise AgentExecutionError(name, f"{name} ended without a result")
    _check_storable(name, "output", run.output, max_output_bytes)
    if run.approval is not None:
        _check_storable(name, "approval request", run.approval, max_output_bytes)
    return run


async def _consume(agent: ExistingAgent, name: str, context: dict[str, Any],
                   config: RunnableConfig | None, run: AgentRun) -> bool:
    """Read `agent`'s events into `run` up to its `agent_completed`; whether it sent one."""
    events = agent.execute_with_events(context)
    try:
        async for event in events:
            kind = str(event.get("event") or "agent_event")[:MAX_EVENT_NAME_CHARS]
            data = dict(event.get("data") or {})
            if kind == "agent_error" and data.get("error_message") is not None:
                # The agent's own words, as a provider's are passed on: secret-looking
                # values blanked, a stack trace or a source path withheld, 500 characters
                # at most.
                data["error_message"] = upstream_said(str(data["error_message"]))
            run.events_seen += 1
            if len(run.events) < MAX_KEPT_EVENTS:
                run.events.append({"event": kind, "data": data})
            if config is not None:
                await adispatch_custom_event(*_forwarded(name, kind, data), config=config)
            if kind == "agent_completed":
                # Its result: what it sends after (a heartbeat, a late warning) is not read.
                run.output = data.get("output")
                return True
            if kind == "approval_required":
                run.approval = data
            elif kind == "agent_error":
                raise AgentExecutionError(name, str(data.get("error_message") or
                                                    f"{name} reported an error"), data)
        return False
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:  # an agent stopped early (its result, error, a timeout)
            await aclose()


def _forwarded(name: str, kind: str, data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """An event's name and value for the client: as it is, or a notice when it is too
    large or cannot be sent as JSON; a name CopilotKit or the runtime gives a meaning of its
    own becomes `agent_event`, the name in its value."""
    value = {"agent": name, **data}
    if kind in _RESERVED_NAMES or kind.startswith(_RESERVED_PREFIXES):
        kind, value = "agent_event", {"agent": name, "event": kind, **data}
    size = _json_size(value)
    if size is None:
        return kind, {"agent": name, "omitted": f"a {kind} event that cannot be sent as JSON"}
    size += len(kind.encode())
    if size <= MAX_EVENT_BYTES:
        return kind, value
    return kind, {"agent": name, "omitted": f"a {kind} event of {size} bytes (events of "
                                            f"more than {MAX_EVENT_BYTES} are not forwarded)"}


def _json_size(value: Any) -> int | None:
    """Bytes of `value` as JSON, or None when it cannot be JSON (it holds itself)."""
    try:
        return len(orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS))
    except (orjson.JSONEncodeError, TypeError):
        pass  # an int past 64 bits, a cycle, nesting too deep: measured the slow way
    try:
        return len(json.dumps(value, default=str, ensure_ascii=False).encode())
    except (ValueError, TypeError, RecursionError):
        return None


def _check_storable(name: str, what: str, value: Any, max_bytes: int) -> None:
    try:
        _, stored = _SERDE.dumps_typed(value)
    except Exception as exc:
        _log.warning("agent result cannot be checkpointed", agent=name, what=what,
                     error=repr(exc))
        raise AgentExecutionError(
            name, f"{name} returned an {what} that cannot be stored "
                  f"({_unstorable_type(value)} is not serialisable)") from None
    if len(stored) > max_bytes:
        _log.warning("agent result too large to keep", agent=name, what=what,
                     size=len(stored), limit=max_bytes)
        raise AgentExecutionError(
            name, f"{name} returned an {what} of {len(stored)} bytes; at most {max_bytes} "
                  "can be kept")


def _unstorable_type(value: Any) -> str:
    """The name of the first value inside `value` the checkpoint serializer refuses."""
    try:
        _SERDE.dumps_typed(value)
    except Exception:
        children: list[Any] = []
        if isinstance(value, Mapping):
            children = [*value.keys(), *value.values()]
        elif isinstance(value, list | tuple | set | frozenset):
            children = list(value)
        for child in children:
            found = _unstorable_type(child)
            if found:
                return found
        return type(value).__name__
    return ""


def checked_timeout(value: float | None, what: str) -> float | None:
    """`value` as an approval timeout in seconds, or ConfigurationError: a positive, finite
    number of seconds (at most `MAX_TIMEOUT_SECONDS`), or None for no expiry."""
    return checked_seconds(value, what, none_means="an approval that never expires")


#: What an agent's (a step's, a specialist's) own code may raise that is its failure: beyond
#: `FAILURES_OF_CALLED_CODE`, a CancelledError of its own (it awaited something another task
#: cancelled), unless the run itself is being cancelled (`run_cancelled`).
FAILURES_OF_AGENTS: tuple[type[BaseException], ...] = (
    *FAILURES_OF_CALLED_CODE, asyncio.CancelledError)


def run_cancelled(exc: BaseException) -> bool:
    """Whether `exc`, caught as one of `FAILURES_OF_AGENTS`, is the run itself being
    cancelled (a stop, a disconnect, a shutdown), which must go on, not the agent's failure."""
    return isinstance(exc, asyncio.CancelledError) and not cancelled_itself()


def failure_text(name: str, exc: BaseException) -> str:
    """What the client may read about a failure: the agent's own words, else the kind."""
    if isinstance(exc, AgentExecutionError):
        return exc.message
    return f"{name} failed ({type(exc).__name__})"


# -- approvals with a timeout: the `approval_required` request and its answer -----------

def approval_request(subject: Mapping[str, Any], *, message: str,
                     timeout_seconds: float | None, notice: str | None = None,
                     **extra: Any) -> dict[str, Any]:
    """The interrupt value of an approval: the `approval_required` payload an existing agent
    asked for, with the AG-UI `Interrupt` fields (`reason`, `message`, `expiresAt`,
    `responseSchema`)."""
    now = time.time()
    request: dict[str, Any] = {
        "type": "approval_required", "reason": "approval",
        "message": f"{notice} {message}" if notice else message,
        "responseSchema": APPROVAL_SCHEMA, **subject, **extra,
    }
    if timeout_seconds is not None:
        # Computed when the node first runs; when it runs again on resume, `interrupt`
        # returns the answer and this value is not used, so the deadline does not move.
        request["timeout_seconds"] = timeout_seconds
        request["expiresAt"] = iso_time(now + timeout_seconds)
    return request


def approval_outcome(decision: Decision) -> dict[str, Any]:
    """The `ApprovalResult` an existing agent gets for a decision (approve, reject or timeout)."""
    status = {"approve": "approved", "reject": "rejected", "timeout": "timeout",
              "revise": "revision_requested"}[decision.action]
    result: dict[str, Any] = {"status": status, "responded_at": iso_time(time.time())}
    if decision.action == "approve":
        result["approved_by"] = decision.by
    elif decision.action == "reject":
        result["rejected_by"] = decision.by
    result["reason"] = decision.feedback or (
        "Approval request timed out" if decision.action == "timeout" else None)
    return result


# -- the wrapper: one existing agent as a LangGraph graph --------------------------------

class WrappedAgentInput(TypedDict, total=False):
    """What a client may set: the chat and the agent's `context`. The approval, its notice
    and the outputs are the wrapper's own."""

    messages: Annotated[list[AnyMessage], add_messages]
    context: dict[str, Any]


class WrappedAgentState(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    context: dict[str, Any]
    approval_required: bool
    #: What the agent asked to have approved: the wrapper's, apart from the client's context.
    approval_data: dict[str, Any] | None
    approval_response: dict[str, Any] | None
    agent_outputs: dict[str, Any]
    error: str | None
    notice: str | None


def wrap_existing_agent(agent: ExistingAgent, name: str, *,
                        approval_timeout_seconds: float | None = 300,
                        approval_message: str = "Approve this?",
                        context_keys: Iterable[str] | None = None,
                        timeout_seconds: float | None = None,
                        max_output_bytes: int = MAX_OUTPUT_BYTES) -> StateGraph[Any]:
    """The wrapper: a graph with one node running `agent`, then (if it asked for
    one) an approval. Compile it with a checkpointer, or use `existing_agent`.

    The agent's context is the graph state's `context`, which the client sends (with the
    chat, all it sets: `WrappedAgentInput`): it is input, not identity, and a JSON object
    (another value ends the run with a message saying so, and is dropped; `existing_agent`
    refuses it before the graph keeps it). `context_keys` lets only those keys through
    (plus `user_message`, the latest user message); by default all pass. The approval comes
    after the agent completed: what it approves is the wrapper's own (`approval_data`), its
    decision is in the state (`approval_response`) and the chat, not sent back to the agent;
    an answer longer than `MAX_FEEDBACK_CHARS` is asked again. `timeout_seconds` and
    `max_output_bytes` bound the agent's run (see the module docstring): past them, it ends
    with an error.
    """
    approval_timeout_seconds = checked_timeout(approval_timeout_seconds,
                                               "approval_timeout_seconds")
    not_one_string(context_keys, "context_keys")
    allowed = None if context_keys is None else frozenset(context_keys)
    async def run_agent(state: WrappedAgentState, config: RunnableConfig) -> Command[str]:
        refusal = context_refusal(state.get("context"))
        if refusal is not None:
            # (`existing_agent` refuses it before it is kept.) Served otherwise, the graph
            # kept it: it is dropped, or every later run of the thread would fail as this one.
            _log.warning("existing agent given a context that is not an object", agent=name)
            return Command(goto=END, update={
                "context": {}, "error": refusal,
                "messages": [await say(f"{name}: {refusal}.", config)]})
        given = dict(state.get("context") or {})
        # Where threads kept before the wrapper's approval data (each later run gave it to
        # the agent as the client's): never the agent's, and dropped from what is kept.
        old_approval = given.pop(_OLD_APPROVAL_KEY, None) is not None
        kept_context = dict(given)
        if allowed is not None:
            given = {key: value for key, value in given.items() if key in allowed}
        context = {**given, "user_message": _last_user_text(state.get("messages") or [])}
        outputs = dict(state.get("agent_outputs") or {})
        try:
            run = await run_existing_agent(agent, name, context, config,
                                           timeout_seconds=timeout_seconds,
                                           max_output_bytes=max_output_bytes)
        except GraphBubbleUp:  # the agent asks a person (`interrupt`): the graph stops here
            raise
        except FAILURES_OF_AGENTS as exc:
            if run_cancelled(exc):
                raise
            _log.warning("existing agent failed", agent=name, error=repr(exc))
            error = failure_text(name, exc)
            return Command(goto=END, update={
                "error": error, "messages": [await say(f"{name}: {error}", config)]})
        outputs[name] = run.output
        update: dict[str, Any] = {"agent_outputs": outputs, "error": None,
                                  **({"context": kept_context} if old_approval else {}),
                                  "messages": [await say(_summary(run.output), config)]}
        if run.approval is None:
            return Command(goto=END, update={**update, "approval_required": False,
                                             "approval_data": None})
        # Kept apart from the client's context: it is not what the agent is given next.
        return Command(goto="approval", update={**update, "approval_required": True,
                                                "approval_data": run.approval})

    async def approval(state: WrappedAgentState, config: RunnableConfig) -> Command[str]:
        # (a thread paused here before kept it in the context)
        data = state.get("approval_data") or (state.get("context") or {}).get(
            _OLD_APPROVAL_KEY) or {}
        answer = interrupt(approval_request(
            {"data": data}, message=approval_message,
            timeout_seconds=approval_timeout_seconds, notice=state.get("notice")))
        decision = parse_decision(answer)
        if decision is None or decision.action == "revise":
            return Command(goto="approval", update={
                "notice": "Answer approve or reject."})
        if (notice := too_long(decision)) is not None:
            # Kept, its reason would be in every checkpoint after it and every state snapshot.
            return Command(goto="approval", update={"notice": notice})
        result = approval_outcome(decision)
        return Command(goto=END, update={
            "approval_response": result, "notice": None,
            "messages": [await say(f"Approval {result['status']}.", config)]})

    # A client's `notice` would open the approver's question, its `approval_response` say
    # "approved" while the approval waited (or with none asked).
    graph: StateGraph[Any] = StateGraph(WrappedAgentState, input_schema=WrappedAgentInput)
    graph.add_node(name, run_agent)
    graph.add_node("approval", approval)
    graph.add_edge(START, name)
    return graph


def existing_agent(agent: ExistingAgent, *, name: str, checkpointer: Any,
                   description: str = "", approval_timeout_seconds: float | None = 300,
                   context_keys: Iterable[str] | None = None,
                   timeout_seconds: float | None = None,
                   max_output_bytes: int = MAX_OUTPUT_BYTES, **options: Any) -> Any:
    """`agent` as a `LangGraphAgent` the runtime can serve (see `wrap_existing_agent`)."""
    graph = wrap_existing_agent(agent, name,
                                approval_timeout_seconds=approval_timeout_seconds,
                                context_keys=context_keys, timeout_seconds=timeout_seconds,
                                max_output_bytes=max_output_bytes)
    return ServedExistingAgent(name=name, graph=graph.compile(checkpointer=checkpointer),
                               description=description, **options)


def _summary(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("summary"), str):
        return str(output["summary"])
    return f"Result: {output!r}"


def _last_user_text(messages: list[AnyMessage] | list[BaseMessage]) -> str:
    for message in reversed(messages):
        if isinstance(message, HumanMessage):
            text = message.text
            return text.strip() if isinstance(text, str) else ""
    return ""
