"""The orchestrator: existing agents in sequence over a shared state, then an
approval with a timeout.

    start ─▶ step 1 ─▶ step 2 ─▶ … ─▶ approval ─┬─ approve / reject / timeout ─▶ finish
                ╰─ a required step fails ───────┼──────────────────────────────▶ finish
                                      ▲          └─ revise: the step that produced the
                                      └───────────  approved key runs again, with feedback

Each `Step` names an existing agent (`execute_with_events(context)`), the keys of the
shared state it reads (`input_keys`) and the key its output is stored under (`output_key`).
A definition is checked when it is built (`ConfigurationError`, naming the step and the
key): every input key is written by an earlier step or given by `inputs()` (its keys are
`provided_keys`; the default `account_inputs` gives `account_id`, from the message or else
the client's `state.account_id`, and `user_message`), no two steps write the same key (nor
a key the orchestrator keeps itself), and the approval's key is some step's output. The
steps run in the order given, so there are no cycles. Of the state, the client sets only
the chat and `account_id` (`OrchestratorInput`).
A required step that fails stops the run, which finishes with the partial results; an
optional one is logged in `errors` (the latest 20) and the run goes on. A step fails, too,
when its agent has not finished within the step's `timeout_seconds` (None by default: no
limit), or returns an output larger than its `max_output_bytes` (1 MB by default), which
would otherwise be kept in every checkpoint after it and sent to the client. A step whose
agent asks for an approval (`approval_required`, as under `existing_agent`) waits for a
person (expiring after the step's `approval_timeout_seconds`) before its output is kept;
rejected or timed out, the step fails. A revision that fails (an optional producer) asks
the approval again about the earlier output, saying so. When the
`ApprovalPolicy`'s key has a value, a person is asked to approve it; the request expires
after `timeout_seconds`, after which the runtime answers it with a timeout; an answer
longer than the review loop's `MAX_FEEDBACK_CHARS` is asked again. The final output
(`status`, `agents_completed`, `results`, `approval`, `step_approvals`, `errors`), in
`state["result"]`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import structlog
from langchain_core.messages import AnyMessage
from langchain_core.runnables import RunnableConfig
from langgraph.errors import GraphBubbleUp
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from copilot_runtime._exceptions import ConfigurationError
from copilot_runtime._strings import not_one_string
from copilot_runtime.approvals.decisions import parse_decision
from copilot_runtime.workflows._answers import shown, too_long
from copilot_runtime.workflows._emit import say
from copilot_runtime.workflows.existing import (
    FAILURES_OF_AGENTS,
    MAX_OUTPUT_BYTES,
    ExistingAgent,
    _last_user_text,
    approval_outcome,
    approval_request,
    checked_timeout,
    failure_text,
    run_cancelled,
    run_existing_agent,
)

__all__ = ["ACCOUNT_ID_CHARS", "ACCOUNT_INPUT_KEYS", "ApprovalPolicy", "Orchestrator",
           "OrchestratorInput", "OrchestratorState", "Step", "account_inputs"]

_log = structlog.get_logger("copilot_runtime.workflows")

Inputs = Callable[[str, Mapping[str, Any]], dict[str, Any]]
_RESERVED = frozenset({"start", "step_approval", "approval", "finish"})
# Keys of the shared state the orchestrator writes itself; `session_id` and `step` also
# reach every step's context.
_OWN_KEYS = frozenset({"session_id", "workflow", "step", "agents_completed", "errors",
                       "feedback", "feedback_for", "approval", "step_approvals"})
# How many step errors the shared state keeps (the latest).
_ERRORS_KEPT = 20
# How much of an approver's reason a step's failure quotes.
_REASON_CHARS = 200
#: What `account_inputs` puts into the shared state.
ACCOUNT_INPUT_KEYS = frozenset({"account_id", "user_message"})


@dataclass(frozen=True, slots=True)
class Step:
    agent: str
    runner: ExistingAgent
    input_keys: tuple[str, ...]
    output_key: str
    required: bool = True
    #: Seconds the agent has to finish, else the step fails (None: no limit).
    timeout_seconds: float | None = None
    #: The largest output the step may keep, in bytes as the checkpoint stores it.
    max_output_bytes: int = MAX_OUTPUT_BYTES
    #: Seconds a person has to answer the agent's `approval_required` (None: no expiry).
    approval_timeout_seconds: float | None = 300

    def __post_init__(self) -> None:
        not_one_string(self.input_keys, f"step {self.agent!r}: input_keys")
        seconds = self.timeout_seconds
        if seconds is not None and (isinstance(seconds, bool)
                                    or not isinstance(seconds, int | float)
                                    or not math.isfinite(seconds) or seconds <= 0):
            raise ConfigurationError(f"step {self.agent!r}: timeout_seconds must be a "
                                     f"positive number of seconds or None, not {seconds!r}")
        size = self.max_output_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigurationError(f"step {self.agent!r}: max_output_bytes must be a "
                                     f"positive int, not {size!r}")
        object.__setattr__(self, "approval_timeout_seconds", checked_timeout(
            self.approval_timeout_seconds, f"step {self.agent!r}: approval_timeout_seconds"))


@dataclass(frozen=True, slots=True)
class ApprovalPolicy:
    #: The shared-state key whose value needs approving (skipped when it is empty).
    key: str = "recommendations"
    timeout_seconds: float | None = 300
    message: str = "Approve the recommendation?"

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ConfigurationError(f"ApprovalPolicy.key must be a non-empty string, "
                                     f"not {self.key!r}")
        object.__setattr__(self, "timeout_seconds", checked_timeout(
            self.timeout_seconds, "ApprovalPolicy.timeout_seconds"))


class OrchestratorInput(TypedDict, total=False):
    """What a client may set: the chat, and the account (`account_inputs` reads it). The
    rest of the state is the orchestrator's own (the runtime gives a graph only its input
    schema's keys of the client's `state` and `forwardedProps`)."""

    messages: Annotated[list[AnyMessage], add_messages]
    account_id: str


class OrchestratorState(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    #: The account the client's state names (`account_inputs` prefers one in the message).
    account_id: str
    #: The state the steps share: inputs, each step's output, `agents_completed`, `errors`.
    shared: dict[str, Any]
    #: Which step runs next (an index into the steps).
    next_step: int
    status: Literal["running", "awaiting_approval", "completed", "error"]
    notice: str | None
    #: A step's approval being asked: the step's index, its output and its request.
    step_approval: dict[str, Any] | None
    #: What the step approval's question opens with (an answer that was not understood).
    step_notice: str | None
    #: The final output: `status`, `agents_completed`, `results`, `approval`, `errors`.
    result: dict[str, Any]


_ACCOUNT = re.compile(r"\b[A-Z][A-Z0-9]*-\d{2,}\b")
#: The longest account id taken from the client's state (an id, not a document).
ACCOUNT_ID_CHARS = 64


def account_inputs(message: str, state: Mapping[str, Any]) -> dict[str, Any]:
    """The account review's inputs from a chat turn: an account id (`ACME-001`) from the message or
    the client's state (text of at most `ACCOUNT_ID_CHARS`; anything else is no id), and the
    message itself."""
    found = _ACCOUNT.search(message)
    account = found.group(0) if found else _given_account(state.get("account_id"))
    return {"account_id": account, "user_message": message}


def _given_account(given: Any) -> str | None:
    """The account id the client's state gave, when it is one: text, not too long."""
    if isinstance(given, str) and 0 < len(given.strip()) <= ACCOUNT_ID_CHARS:
        return given.strip()
    return None


class Orchestrator:
    def __init__(self, steps: Sequence[Step], *, approval: ApprovalPolicy | None = None,
                 workflow: str = "account_analysis", inputs: Inputs = account_inputs,
                 provided_keys: Iterable[str] | None = None) -> None:
        names = [s.agent for s in steps]
        if not steps or len(set(names)) != len(names) or _RESERVED & set(names):
            raise ConfigurationError(
                f"steps need unique agent names, none of {sorted(_RESERVED)}")
        not_one_string(provided_keys, "provided_keys")
        if provided_keys is None:
            provided_keys = ACCOUNT_INPUT_KEYS if inputs is account_inputs else ()
        _check_definition(steps, approval, frozenset(provided_keys))
        self.steps = list(steps)
        self.approval = approval
        self.workflow = workflow
        self.inputs = inputs

    def graph(self) -> StateGraph[OrchestratorState, None, OrchestratorInput]:
        # The steps' shared state and the next step are the orchestrator's to set, not the
        # client's.
        graph: StateGraph[OrchestratorState, None, OrchestratorInput] = StateGraph(
            OrchestratorState, input_schema=OrchestratorInput)
        graph.add_node("start", self._start)
        for step in self.steps:
            graph.add_node(step.agent, self._step)  # the state says which step runs
        graph.add_node("step_approval", self._step_approval)
        graph.add_node("approval", self._approval)
        graph.add_node("finish", self._finish)
        graph.add_edge(START, "start")
        graph.add_edge("finish", END)
        return graph

    def compile(self, checkpointer: Any) -> Any:
        return self.graph().compile(checkpointer=checkpointer)

    def agent(self, *, name: str = "orchestrator", checkpointer: Any,
              description: str = "Agents in sequence, then an approval", **options: Any
              ) -> Any:
        from copilot_runtime.agents.langgraph import LangGraphAgent

        return LangGraphAgent(name=name, graph=self.compile(checkpointer),
                              description=description, **options)

    # -- nodes -------------------------------------------------------------------------

    def _start(self, state: OrchestratorState, config: RunnableConfig) -> Command[str]:
        message = _last_user_text(state.get("messages") or [])
        session = (config.get("configurable") or {}).get("thread_id")
        shared = {**self.inputs(message, state), "session_id": session,
                  "workflow": self.workflow, "step": 0, "agents_completed": [], "errors": []}
        return Command(goto=self.steps[0].agent, update={
            "shared": shared, "next_step": 0, "status": "running", "notice": None,
            "result": {}})

    async def _step(self, state: OrchestratorState, config: RunnableConfig) -> Command[str]:
        index = state.get("next_step", 0)
        step = self.steps[index]
        shared = dict(state.get("shared") or {})
        shared["step"] = int(shared.get("step", 0)) + 1
        context = {key: shared.get(key) for key in step.input_keys}
        context.update(step=shared["step"], session_id=shared.get("session_id"))
        if shared.get("feedback") and shared.get("feedback_for") == step.agent:
            context["feedback"] = shared["feedback"]  # only the step asked to revise
        try:
            run = await run_existing_agent(step.runner, step.agent, context, config,
                                           timeout_seconds=step.timeout_seconds,
                                           max_output_bytes=step.max_output_bytes)
        except GraphBubbleUp:  # the agent asks a person (`interrupt`): the graph stops here
            raise
        except FAILURES_OF_AGENTS as exc:
            if run_cancelled(exc):
                raise
            _log.warning("required step failed" if step.required else
                         "optional step failed", agent=step.agent, error=repr(exc))
            return await self._failed(index, shared, failure_text(step.agent, exc), config)
        said = await say(f"{step.agent}: {_summary(run.output)}", config)
        if run.approval is not None:
            # What the agent did waits for a person, as under `existing_agent`: its output
            # is kept only once approved.
            return Command(goto="step_approval", update={
                "shared": shared, "status": "awaiting_approval", "step_notice": None,
                "step_approval": {"index": index, "output": run.output,
                                  "request": run.approval},
                "messages": [said]})
        return self._completed(index, shared, run.output, [said])

    def _following(self, index: int) -> str:
        """The node after step `index`."""
        if index + 1 < len(self.steps):
            return self.steps[index + 1].agent
        return "approval" if self.approval else "finish"

    def _completed(self, index: int, shared: dict[str, Any], output: Any,
                   messages: list[Any]) -> Command[str]:
        step, following = self.steps[index], self._following(index)
        shared[step.output_key] = output
        completed = list(shared.get("agents_completed", []))
        if step.agent not in completed:  # a step run again for a revision counts once
            completed.append(step.agent)
        shared["agents_completed"] = completed
        return Command(goto=following, update={
            "shared": shared, "next_step": index + 1, "step_approval": None,
            "status": "awaiting_approval" if following == "approval" else "running",
            "messages": messages})

    async def _failed(self, index: int, shared: dict[str, Any], error: str,
                      config: RunnableConfig) -> Command[str]:
        """Step `index` failed with `error`: a required one stops the run, an optional one
        is logged and the run goes on."""
        step = self.steps[index]
        # The latest few: an optional step failing at every revision adds one each time.
        shared["errors"] = [*shared.get("errors", []), {
            "agent": step.agent, "error": error, "critical": step.required}][-_ERRORS_KEPT:]
        if step.required:  # a critical failure: stop with what we have
            return Command(goto="finish", update={
                "shared": shared, "status": "error", "step_approval": None,
                "messages": [await say(f"{step.agent} failed: {error}", config)]})
        update: dict[str, Any] = {
            "shared": shared, "next_step": index + 1, "step_approval": None,
            "messages": [await say(f"{step.agent} failed (optional, continuing): "
                                   f"{error}", config)]}
        if shared.get("feedback") and shared.get("feedback_for") == step.agent:
            # The approval is asked again about the earlier output: the person is told why.
            update["notice"] = f"The revision failed ({error}); this is the earlier result."
        return Command(goto=self._following(index), update=update)

    async def _step_approval(self, state: OrchestratorState, config: RunnableConfig
                             ) -> Command[str]:
        """A person approves what a step's agent asked to have approved (its
        `approval_required`), else the step fails under its required/optional rule."""
        pending = dict(state.get("step_approval") or {})
        index = int(pending.get("index", 0))
        step = self.steps[index]
        shared = dict(state.get("shared") or {})
        answer = interrupt(approval_request(
            {"agent": step.agent, "data": pending.get("request"),
             "session_id": shared.get("session_id"), "account_id": shared.get("account_id")},
            message=f"Approve what {step.agent} asks?",
            timeout_seconds=step.approval_timeout_seconds, notice=state.get("step_notice")))
        decision = parse_decision(answer)
        if decision is None or decision.action == "revise":
            return Command(goto="step_approval", update={
                "step_notice": "Answer approve or reject."})
        if (notice := too_long(decision)) is not None:
            return Command(goto="step_approval", update={"step_notice": notice})
        outcome = approval_outcome(decision)
        shared["step_approvals"] = {**shared.get("step_approvals", {}), step.agent: outcome}
        said = await say(f"{step.agent}: approval {outcome['status']}.", config)
        if decision.action == "approve":
            return self._completed(index, shared, pending.get("output"), [said])
        if decision.action == "timeout":
            error = f"{step.agent}'s approval timed out"
        else:
            reason = (decision.feedback or "")[:_REASON_CHARS]
            error = f"{step.agent}'s approval was rejected" + (f": {reason}" if reason else "")
        _log.warning("step not approved", agent=step.agent, decision=decision.action)
        return await self._failed(index, shared, error, config)

    def _approval(self, state: OrchestratorState) -> Command[str]:
        assert self.approval is not None
        shared = dict(state.get("shared") or {})
        subject = shared.get(self.approval.key)
        if not subject:
            return Command(goto="finish")
        first = subject[0] if isinstance(subject, list) and subject else subject
        answer = interrupt(approval_request(
            {"recommendation": first, "recommendations": subject,
             "session_id": shared.get("session_id"), "account_id": shared.get("account_id")},
            message=self.approval.message, timeout_seconds=self.approval.timeout_seconds,
            notice=state.get("notice")))
        decision = parse_decision(answer)
        if decision is None:
            return Command(goto="approval", update={
                "notice": "That answer was neither an approval nor a rejection."})
        if (notice := too_long(decision)) is not None:
            # Kept, it would be in every checkpoint until the end and in the step's context.
            return Command(goto="approval", update={"notice": notice})
        if decision.action == "revise":
            # The step that produced what is being approved runs again with the feedback.
            producer = next(i for i, s in enumerate(self.steps)
                            if s.output_key == self.approval.key)
            shared["feedback"] = decision.feedback or shown(decision.payload)
            shared["feedback_for"] = self.steps[producer].agent
            return Command(goto=self.steps[producer].agent, update={
                "shared": shared, "next_step": producer, "notice": None})
        shared["approval"] = approval_outcome(decision)
        shared.pop("feedback", None)
        shared.pop("feedback_for", None)
        return Command(goto="finish", update={"shared": shared, "notice": None})

    async def _finish(self, state: OrchestratorState, config: RunnableConfig
                      ) -> dict[str, Any]:
        shared = dict(state.get("shared") or {})
        critical = next((e for e in shared.get("errors", []) if e.get("critical")), None)
        if critical is not None:
            result = {"status": "error",
                      "message": f"Critical agent {critical['agent']} failed",
                      "error": critical["error"], "partial_results": shared}
            text = f"Stopped: {result['message']} ({critical['error']})."
        else:
            approval = shared.get("approval")
            result = {
                "status": "completed", "account_id": shared.get("account_id"),
                "workflow": shared.get("workflow"),
                "agents_completed": shared.get("agents_completed", []),
                "results": {s.output_key: shared.get(s.output_key) for s in self.steps},
                "approval": approval, "errors": shared.get("errors", []),
                "step_approvals": shared.get("step_approvals", {}),
            }
            verdicts = [f"{agent}'s approval: {given['status']}"
                        for agent, given in result["step_approvals"].items()]
            if approval:
                verdicts.append(f"approval: {approval['status']}")
            verdict = ", ".join(verdicts) or "no approval needed"
            text = (f"Completed {len(result['agents_completed'])} of {len(self.steps)} "
                    f"steps; {verdict}.")
        return {"result": result, "status": result["status"],
                "messages": [await say(text, config)]}


def _check_definition(steps: Sequence[Step], approval: ApprovalPolicy | None,
                      provided: frozenset[str]) -> None:
    """Refuse a definition that would run wrongly without a word (see the module doc)."""
    available = set(provided) | {"session_id", "step"}
    writers: dict[str, str] = {}
    for step in steps:
        for key in step.input_keys:
            if key not in available:
                later = next((s.agent for s in steps if s.output_key == key), None)
                where = (f"step {later!r} writes it only later" if later else
                         "no earlier step writes it and inputs() does not provide it "
                         "(declare what inputs() gives with provided_keys=)")
                raise ConfigurationError(
                    f"step {step.agent!r} reads {key!r}, but {where}")
        key = step.output_key
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"step {step.agent!r} needs a non-empty output_key")
        if key in writers:
            raise ConfigurationError(
                f"steps {writers[key]!r} and {step.agent!r} both write {key!r}: "
                "each step needs its own output_key")
        if key in _OWN_KEYS or key in provided:
            raise ConfigurationError(
                f"step {step.agent!r} writes {key!r}, a key the orchestrator or inputs() "
                "already sets")
        writers[key] = step.agent
        available.add(key)
    if approval is not None and approval.key not in writers:
        raise ConfigurationError(
            f"ApprovalPolicy.key {approval.key!r} is no step's output_key (the steps write "
            f"{sorted(writers)}), so the approval would never be asked")


def _summary(output: Any) -> str:
    if isinstance(output, dict) and isinstance(output.get("summary"), str):
        return str(output["summary"])
    if isinstance(output, list):
        return f"{len(output)} item{'s' if len(output) != 1 else ''}"
    return "done"
