"""The review loop: planner → specialist → a person approves or asks for a revision.

    task ─▶ planner ─▶ specialist ─▶ review ─┬─ approve ─▶ complete
                           ▲                  ├─ reject / timeout ─▶ complete (not approved)
                           └──── revise ──────┘
                                (directly, with the original task, the draft and the history)

* The planner routes each new task (the latest user message) to one specialist
  (`router`, by default `keyword_router`) and starts its execution history. A router that
  fails, or names no specialist of the loop (a model's router naming one that is not
  here), fails the task with a message saying so; the next task is routed afresh.
* A specialist's result always goes to review when review is on, so nothing completes
  without a clarification request (property 1; the numbers are the loop's six correctness
  properties, each tested); `state["review"] = False`, set by the client for a task,
  completes right after the specialist (property 5) when the loop is built with
  `client_may_skip_review=True` (by default the client cannot switch off the review); a
  later task is reviewed unless it sends the switch again.
  Nothing else of the state is the client's: the graph's input schema (`ReviewInput`) holds
  the chat, and `review` where the client may set it.
* Review is a LangGraph `interrupt` carrying a clarification request; it is
  checkpointed, so a pending review survives a restart. An approval completes the task
  without another specialist run (3); a revision goes straight back to the same specialist
  with the original task, the draft, the history and the revision (2, 4), as often as the person
  asks (6: no limit; each answer is a new graph invocation, so LangGraph's recursion limit
  does not cap the loop).
* Error rules: a specialist that fails (a CancelledError of its own too, unless the run
  is being cancelled), answers nothing or answers something that is not
  text (None, a dict), sends the error to review so
  the person can revise again (without review the task fails); a task cut off while its
  specialist ran (a stop, a disconnect) and run again without a new message carries on
  with the same plan instead of planning again; if the clarification request
  cannot be built, the task fails ("could not ask for review"): nothing is approved that
  nobody was asked about. A task whose kept state holds what the loop never writes (a
  checkpoint of a release whose clients could set it, a specialist since removed) fails,
  naming the key, and the next task is planned afresh. One deliberate change: an answer
  that is neither an approval nor a revision is asked again (`on_malformed="ask_again"`),
  because taking it as an approval would approve work nobody approved;
  `on_malformed="approve"` approves it instead, but only an answer that says nothing: one
  that names an action or an `approved` flag it cannot be read as (a revise with nothing
  to change, `"false"` as a string) is still asked again, and the final message says the
  approval was taken from an answer not understood.
* Bounds: an answer longer than `max_feedback_chars` (default 32 000 characters) is asked
  again with a notice, and not stored; a draft longer than `max_draft_chars` (a million
  characters) is a specialist failure; a model specialist's prompt carries the task, the
  latest history entries, the draft and the revision, each cut to a bounded length
  (`specialist_prompt`). The state keeps the current draft whole and the latest
  `history_entries` steps of the history (earlier drafts cut to `HISTORY_DRAFT_CHARS`,
  answers to `history_entry_chars`), counting the rest in `history_left_out`; in the chat,
  a draft older than the latest `chat_drafts` (5) is replaced by a line saying it was
  superseded. So a revision grows the checkpoint by that line, not by a draft and the
  whole history again.
"""

from __future__ import annotations

import reprlib
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import orjson
import structlog
from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.errors import GraphBubbleUp
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, interrupt
from typing_extensions import TypedDict

from copilot_runtime._exceptions import FAILURES_OF_CALLED_CODE, ConfigurationError
from copilot_runtime._time import iso_time
from copilot_runtime.approvals.decisions import parse_decision
from copilot_runtime.workflows._answers import MAX_FEEDBACK_CHARS, answer_length, shown
from copilot_runtime.workflows._emit import say
from copilot_runtime.workflows.existing import FAILURES_OF_AGENTS, checked_timeout, run_cancelled
from copilot_runtime.workflows.specialists import (
    PROMPT_ENTRY_CHARS,
    Specialist,
    SpecialistRequest,
    keyword_router,
)

__all__ = ["ANSWER_SCHEMA", "CHAT_DRAFTS", "HISTORY_DRAFT_CHARS", "HISTORY_ENTRIES",
           "HISTORY_ENTRY_CHARS", "MAX_DRAFT_CHARS", "MAX_FEEDBACK_CHARS", "ReviewInput",
           "ReviewLoop", "ReviewState"]

_log = structlog.get_logger("copilot_runtime.workflows")

Router = Callable[[str, Sequence[Specialist]], tuple[str, str]]
Status = Literal["working", "awaiting_review", "completed", "rejected", "timed_out", "failed"]

#: How many of the latest drafts the chat keeps whole (the state keeps the chat), so a
#: reviewer can look back over the last rounds: earlier ones become one line each.
CHAT_DRAFTS = 5
#: The longest draft a specialist may answer (characters): it is kept whole in the state
#: and sent in the review request.
MAX_DRAFT_CHARS = 1_000_000
# How much of an answer that could not be read is kept in the history.
_ECHO_CHARS = 200
#: How many of the latest history entries the state keeps (a revision adds two: the draft
#: and the answer). Every checkpoint holds a copy of the state, so a history that kept
#: every step grew each one with the length of the review.
HISTORY_ENTRIES = 20
#: How many characters of one history entry's answer or error the state keeps: what a
#: model specialist's prompt carries of it (`PROMPT_ENTRY_CHARS`).
HISTORY_ENTRY_CHARS = PROMPT_ENTRY_CHARS
#: How many characters of a draft its history entry keeps: the draft being revised is kept
#: whole (`draft`), the ones before it only as a reminder of what they began with.
HISTORY_DRAFT_CHARS = 200

#: What a review answer looks like (sent to clients as the interrupt's `responseSchema`).
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "action": {"enum": ["approve", "revise", "reject"]},
        "payload": {"type": "string", "description": "what to change, for revise"},
    },
    "required": ["action"],
}


# How much of a router's reason the plan keeps, and of a name it gave that is no specialist.
_REASON_CHARS = 300
_ECHO_NAME_CHARS = 80


class _NotRouted(Exception):
    """The router gave no specialist of this loop; its text says what it gave."""


class ReviewInput(TypedDict, total=False):
    """What a client may set: the chat. The rest of the state is the loop's own (the
    runtime gives a graph only its input schema's keys of the client's `state`)."""

    messages: Annotated[list[AnyMessage], add_messages]


class ReviewInputWithSwitch(ReviewInput, total=False):
    """The input where the client may switch review off for a task
    (`client_may_skip_review=True`)."""

    review: bool


class ReviewState(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    #: The task as first given; revisions never replace it.
    task: str
    #: The id of the user message the task came from.
    task_message_id: str | None
    plan_id: str
    specialist: str
    #: The client's review switch for its next task (`client_may_skip_review`): the
    #: planner takes it for the task it plans and clears it.
    review: bool | None
    #: Whether this task's result goes to review: the client's switch, else the loop's.
    reviewing: bool
    iteration: int
    #: The latest draft, in full.
    draft: str
    #: The drafts the chat shows whole (their messages' ids, oldest first).
    draft_message_ids: list[str]
    #: The latest `HISTORY_ENTRIES` steps: drafts cut to `HISTORY_DRAFT_CHARS`, answers
    #: and errors to `HISTORY_ENTRY_CHARS`.
    history: list[dict[str, Any]]
    #: How many earlier steps of this task the history no longer holds.
    history_left_out: int
    status: Status
    feedback: str | None
    #: Said with the next clarification request (an answer not understood, a failure).
    notice: str | None
    #: The approval was an answer not understood, taken as one (`on_malformed="approve"`).
    approved_as_malformed: bool


class ReviewLoop:
    """The review loop as a LangGraph graph; see the module docstring."""

    def __init__(self, specialists: Sequence[Specialist], *, router: Router = keyword_router,
                 review: bool = True,
                 on_malformed: Literal["ask_again", "approve"] = "ask_again",
                 question: str = "Please approve or provide revision",
                 timeout_seconds: float | None = None,
                 max_feedback_chars: int = MAX_FEEDBACK_CHARS,
                 client_may_skip_review: bool = False,
                 history_entries: int = HISTORY_ENTRIES,
                 history_entry_chars: int = HISTORY_ENTRY_CHARS,
                 max_draft_chars: int = MAX_DRAFT_CHARS,
                 chat_drafts: int = CHAT_DRAFTS) -> None:
        if not specialists:
            raise ConfigurationError("the review loop needs at least one specialist")
        names = [s.name for s in specialists]
        reserved = {"planner", "review", "complete"}
        if len(set(names)) != len(names) or reserved & set(names):
            raise ConfigurationError(
                f"specialist names must be unique and not {sorted(reserved)}")
        if on_malformed not in ("ask_again", "approve"):
            raise ConfigurationError(
                f"on_malformed must be 'ask_again' or 'approve', not {on_malformed!r}")
        for option, value in (("max_feedback_chars", max_feedback_chars),
                              ("history_entries", history_entries),
                              ("history_entry_chars", history_entry_chars),
                              ("max_draft_chars", max_draft_chars),
                              ("chat_drafts", chat_drafts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{option} must be a positive int, not {value!r}")
        self.specialists = {s.name: s for s in specialists}
        self.router = router
        self.review = review
        self.on_malformed = on_malformed
        self.question = question
        self.timeout_seconds = checked_timeout(timeout_seconds, "timeout_seconds")
        self.max_feedback_chars = max_feedback_chars
        # Whether the client's `state["review"]` counts. Off by default: whoever starts a
        # task would otherwise switch off the review the loop's author set up, whatever
        # the approver roles say.
        self.client_may_skip_review = client_may_skip_review
        self.history_entries = history_entries
        self.history_entry_chars = history_entry_chars
        self.max_draft_chars = max_draft_chars
        self.chat_drafts = chat_drafts

    # -- the graph ---------------------------------------------------------------------

    def graph(self) -> StateGraph[ReviewState, None, ReviewInput]:
        """The uncompiled graph; compile it with a checkpointer (`compile`)."""
        # Only the chat (and the review switch, where allowed) is the client's to set: the
        # rest (status, iteration, the task's message id) would steer the planner.
        inputs = ReviewInputWithSwitch if self.client_may_skip_review else ReviewInput
        graph: StateGraph[ReviewState, None, ReviewInput] = StateGraph(
            ReviewState, input_schema=inputs)
        graph.add_node("planner", self._planner)
        for name in self.specialists:
            # One node per specialist (its steps carry its name); the state says which runs.
            graph.add_node(name, self._specialist)
        graph.add_node("review", self._review)
        graph.add_node("complete", self._complete)
        graph.add_edge(START, "planner")
        graph.add_edge("complete", END)
        return graph

    def compile(self, checkpointer: Any) -> Any:
        return self.graph().compile(checkpointer=checkpointer)

    def agent(self, *, name: str = "review_loop", checkpointer: Any,
              description: str = "Planner, specialists and a human review loop",
              **options: Any) -> Any:
        """A `LangGraphAgent` serving this loop."""
        from copilot_runtime.agents.langgraph import LangGraphAgent

        return LangGraphAgent(name=name, graph=self.compile(checkpointer),
                              description=description, **options)

    # -- nodes -------------------------------------------------------------------------

    async def _planner(self, state: ReviewState, config: RunnableConfig) -> Command[str]:
        latest = _last_user_message(state.get("messages") or [])
        task = _text_of(latest)
        if not task:
            return Command(goto="complete", update={
                "status": "failed", "notice": "There is no task: send one as a message."})
        specialist = state.get("specialist")
        if (latest is not None and latest.id and state.get("task_message_id") == latest.id
                and state.get("status") == "working" and isinstance(specialist, str)
                and self._unsound(state) is None):
            # The same task, cut off while its specialist ran (a stop, a disconnect) and run
            # again: carry on with the same plan rather than plan it a second time.
            return Command(goto=specialist, update={"review": None})
        # Each task has its own review switch: one the client sent for an earlier task is
        # not this one's.
        new_task: dict[str, Any] = {
            "task": task, "task_message_id": latest.id if latest is not None else None,
            "plan_id": uuid.uuid4().hex, "iteration": 1, "feedback": None, "draft": "",
            "draft_message_ids": [], "approved_as_malformed": False,
            "reviewing": self._review_asked(state), "review": None}
        try:
            name, reason = self._routed(task)
        except _NotRouted as failure:
            # The task fails, said precisely; the thread takes the next one as usual.
            return Command(goto="complete", update={
                **new_task, **self._recorded({}, {"iteration": 1, "agent": "Planner",
                                                  "error": str(failure)}),
                "status": "failed", "notice": str(failure)})
        routed = f"Routed to {name}: {reason}"
        return Command(goto=name, update={
            **new_task, "specialist": name,
            **self._recorded({}, {"iteration": 1, "agent": "Planner", "result": routed}),
            "status": "working", "notice": None,
            "messages": [await say(f"Planner: the {name} specialist takes this task "
                                   f"({reason}).", config)],
        })

    def _routed(self, task: str) -> tuple[str, str]:
        """The router's choice, checked: `_NotRouted` names what was wrong with it."""
        try:
            chosen = self.router(task, list(self.specialists.values()))
        except GraphBubbleUp:  # the router asks a person (`interrupt`): the graph stops here
            raise
        except FAILURES_OF_CALLED_CODE as exc:
            _log.exception("the review loop's router failed")
            raise _NotRouted(f"the planner's router failed ({type(exc).__name__})") from None
        if not (isinstance(chosen, tuple) and len(chosen) == 2
                and isinstance(chosen[0], str) and isinstance(chosen[1], str)):
            raise _NotRouted("the planner's router did not name a specialist")
        name, reason = chosen
        if name not in self.specialists:
            # A model's router may name one that is not here: no guess at which it meant.
            raise _NotRouted(
                f"the planner's router named {name[:_ECHO_NAME_CHARS]!r}, which is not one "
                f"of this loop's specialists ({', '.join(self.specialists)})")
        return name, reason[:_REASON_CHARS]

    async def _specialist(self, state: ReviewState, config: RunnableConfig) -> Command[str]:
        unsound = self._unsound(state)
        if unsound is not None:
            return _cannot_carry_on(unsound)
        name = state.get("specialist") or next(iter(self.specialists))
        specialist = self.specialists[name]
        iteration = state.get("iteration", 1)
        request = SpecialistRequest(task=state.get("task", ""), iteration=iteration,
                                    history=tuple(state.get("history") or ()),
                                    feedback=state.get("feedback"),
                                    draft=state.get("draft") or "",
                                    left_out=int(state.get("history_left_out") or 0))
        reviewing = self._reviewing(state)
        try:
            result = await specialist.run(request)
        except GraphBubbleUp:  # the specialist asks a person (`interrupt`): the graph stops
            raise
        except FAILURES_OF_AGENTS as exc:
            if run_cancelled(exc):
                raise
            _log.exception("specialist failed", specialist=name)
            failure = f"The {name} specialist failed ({type(exc).__name__})"
            return self._failed(state, name, failure, reviewing)
        if not isinstance(result, str | BaseMessage):
            # Not the text (or message) a specialist answers: a failure, said precisely,
            # rather than the chat message it cannot be.
            return self._failed(state, name, f"The {name} specialist answered "
                                             f"{type(result).__name__}, not text", reviewing)
        draft = _result_text(result)
        if not draft:
            return self._failed(state, name, f"The {name} specialist answered nothing",
                                reviewing)
        if len(draft) > self.max_draft_chars:
            # Kept, it would be in every checkpoint, the review request and the chat.
            return self._failed(state, name, (
                f"The {name} specialist answered {len(draft)} characters; a draft may "
                f"have at most {self.max_draft_chars}"), reviewing)
        # A model's message streamed as it was written; text is streamed now.
        message = result if isinstance(result, BaseMessage) else await say(result, config)
        if message.id is None:  # its id is how the chat's copy of it is found again
            message = message.model_copy(update={"id": str(uuid.uuid4())})
        whole = [i for i in state.get("draft_message_ids") or () if i != message.id]
        whole.append(str(message.id))
        # The chat keeps the latest `chat_drafts` drafts whole; an earlier one keeps its
        # place (and id, so the client's copy of the chat still matches) as one line.
        superseded = [AIMessage(id=old, content=f"(An earlier draft by the {name} "
                                                f"specialist, superseded by draft {iteration}.)")
                      for old in whole[:-self.chat_drafts]]
        return Command(goto="review", update={
            "draft": draft, "draft_message_ids": whole[-self.chat_drafts:],
            "messages": [*superseded, message],
            **self._recorded(state, {"iteration": iteration, "agent": name, "result": draft}),
            "notice": None, "status": "awaiting_review" if reviewing else "working"})

    def _failed(self, state: ReviewState, name: str, failure: str,
                reviewing: bool) -> Command[str]:
        """A specialist that failed, or answered what cannot be a draft: the person may
        revise, or without review the task fails."""
        recorded = self._recorded(state, {"iteration": state.get("iteration", 1),
                                          "agent": name, "error": failure})
        if reviewing:  # send the error and let the person revise again
            return Command(goto="review", update={
                **recorded, "status": "awaiting_review",
                "notice": f"{failure}. Revise the task to try again, or reject it."})
        return Command(goto="complete", update={
            **recorded, "status": "failed", "notice": failure})

    def _recorded(self, state: Mapping[str, Any], *entries: dict[str, Any]
                  ) -> dict[str, Any]:
        """The state update adding `entries` to the history, which keeps its latest
        `history_entries` entries, each text cut (`_cut`)."""
        history = [*(state.get("history") or ()), *(self._cut(e) for e in entries)]
        left_out = int(state.get("history_left_out") or 0)
        excess = len(history) - self.history_entries
        if excess > 0:
            history, left_out = history[excess:], left_out + excess
        return {"history": history, "history_left_out": left_out}

    def _cut(self, entry: dict[str, Any]) -> dict[str, Any]:
        """`entry` with its draft cut to `HISTORY_DRAFT_CHARS`, its answer or error to
        `history_entry_chars`; `cut_from` says how long it was."""
        for key, limit in (("result", HISTORY_DRAFT_CHARS),
                           ("user_feedback", self.history_entry_chars),
                           ("error", self.history_entry_chars)):
            text = entry.get(key)
            if isinstance(text, str) and len(text) > limit:
                return {**entry, key: text[:limit], "cut_from": len(text)}
        return entry

    def _reviewing(self, state: Mapping[str, Any]) -> bool:
        """Whether the task's result goes to review: as planned (a task an earlier release
        planned did not say: as the client's switch says then)."""
        planned = state.get("reviewing")
        return planned if isinstance(planned, bool) else self._review_asked(state)

    def _review_asked(self, state: Mapping[str, Any]) -> bool:
        """The client's review switch where the loop takes it and it is a bool, else the
        loop's default."""
        review = state.get("review") if self.client_may_skip_review else None
        return review if isinstance(review, bool) else self.review

    def _unsound(self, state: Mapping[str, Any]) -> str | None:
        """What of the task's kept state is not what the loop writes, in a few words;
        None when all of it is. A checkpoint an earlier release wrote may hold anything
        there: its clients could set these keys."""
        for key, sound, expected in _KEPT:
            value = state.get(key)
            if value is not None and not sound(value):
                return f"its {key} is {reprlib.repr(value)}, not {expected}"
        name = state.get("specialist")
        if name is not None and not (isinstance(name, str) and name in self.specialists):
            return (f"its specialist {reprlib.repr(name)} is not one of this loop's "
                    f"({', '.join(self.specialists)})")
        return None

    def _review(self, state: ReviewState) -> Command[str]:
        unsound = self._unsound(state)
        if unsound is not None:
            return _cannot_carry_on(unsound)
        iteration = state.get("iteration", 1)
        if not self._reviewing(state):
            return Command(goto="complete", update={"status": "completed"})
        try:
            request = self.clarification_request(state)
        except FAILURES_OF_CALLED_CODE as exc:
            # Fail closed: nobody was asked, so nothing may be recorded as approved.
            _log.exception("could not build the clarification request")
            failure = f"could not ask for review ({type(exc).__name__}), so nothing was approved"
            return Command(goto="complete", update={
                **self._recorded(state, {"iteration": iteration, "agent": "review",
                                         "error": failure}),
                "status": "failed", "notice": failure})
        answer = interrupt(request)  # the graph stops here until a person answers
        decision = parse_decision(answer)
        too_long = answer_length(decision)
        if too_long > self.max_feedback_chars:
            return Command(goto="review", update={
                **self._recorded(state, {
                    "iteration": iteration, "agent": "HITL", "too_long": True,
                    "user_feedback": f"(an answer of {too_long} characters, not kept)"}),
                "notice": f"That answer was {too_long} characters long; answers may be at "
                          f"most {self.max_feedback_chars}. Approve, or say more briefly "
                          f"what to change."})
        if decision is None and self.on_malformed == "approve" and not _names_a_choice(answer):
            return Command(goto="complete", update={
                **self._recorded(state, {
                    "iteration": iteration, "agent": "HITL", "malformed": True,
                    "user_feedback": "approved (answer not understood: "
                                     f"{shown(answer)[:_ECHO_CHARS]})"}),
                "status": "completed", "notice": None,
                "approved_as_malformed": True})
        if decision is None:
            return Command(goto="review", update={
                **self._recorded(state, {
                    "iteration": iteration, "agent": "HITL",
                    "user_feedback": shown(answer)[:_ECHO_CHARS], "malformed": True}),
                "notice": "That answer was neither an approval nor a revision. Approve, "
                          "or say what to change."})
        if decision.action == "revise":
            feedback = decision.feedback or shown(decision.payload)
            return Command(goto=state.get("specialist") or next(iter(self.specialists)),
                           update={**self._recorded(state, _feedback_entry(
                                       iteration, feedback, decision.by)),
                                   "iteration": iteration + 1,
                                   "feedback": feedback, "status": "working",
                                   "notice": None})
        status: Status = {"approve": "completed", "reject": "rejected",
                          "timeout": "timed_out"}[decision.action]  # type: ignore[assignment]
        said = decision.action if not decision.feedback \
            else f"{decision.action}: {decision.feedback}"
        return Command(goto="complete", update={
            **self._recorded(state, _feedback_entry(iteration, said, decision.by)),
            "status": status, "notice": decision.feedback})

    def clarification_request(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The `user_clarification_request` a client shows, as the interrupt's value.

        `reason`, `message`, `responseSchema` and `expiresAt` are the AG-UI `Interrupt`
        fields a client reads; `data` names the specialist, its result, the question and
        the iteration.
        """
        notice = state.get("notice")
        question = f"{notice} {self.question}" if notice else self.question
        iteration = state.get("iteration", 1)
        steps_left_out = int(state.get("history_left_out") or 0)
        now = time.time()
        request: dict[str, Any] = {
            "type": "user_clarification_request",
            "reason": "review",
            "message": question,
            "responseSchema": ANSWER_SCHEMA,
            "data": {
                # Steps so far, counting those the history no longer holds: unique.
                "request_id": f"{state.get('plan_id', '')}:{iteration}:"
                              f"{len(state.get('history') or ()) + steps_left_out}",
                "plan_id": state.get("plan_id", ""),
                "agent": state.get("specialist"),
                "agent_result": state.get("draft", ""),
                "question": question,
                "iteration": iteration,
                "timestamp": datetime.fromtimestamp(now, UTC).isoformat(),
            },
        }
        if self.timeout_seconds is not None:
            request["expiresAt"] = iso_time(now + self.timeout_seconds)
        return request

    async def _complete(self, state: ReviewState, config: RunnableConfig) -> dict[str, Any]:
        status = state.get("status", "completed")
        name = state.get("specialist", "specialist")
        notice = state.get("notice")
        if status == "completed" and state.get("approved_as_malformed"):
            text = (f"Approved because the answer was not understood "
                    f"(on_malformed='approve'): the {name} specialist's result is final.")
        elif status == "completed":
            text = (f"Approved: the {name} specialist's result is final." if
                    self._reviewing(state) else
                    f"Done: the {name} specialist's result is final (review was off).")
        elif status == "rejected":
            text = "Rejected" + (f" ({notice})" if notice else "") + ": the task stops here."
        elif status == "timed_out":
            text = "Nobody answered in time: the task stops without approval."
        else:
            text = f"The task failed: {notice or 'no result'}."
        return {"status": status if status != "working" else "completed",
                "messages": [await say(text, config)]}


def _is_count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_list_of(value: Any, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(item, kind) for item in value)


# The task's keys the nodes read, each with what it must be when set (unset or None: the
# loop's default), and how that is said.
_KEPT: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("task", lambda value: isinstance(value, str), "text"),
    ("iteration", lambda value: _is_count(value, 1), "a count from 1"),
    ("history", lambda value: _is_list_of(value, dict), "a list of steps"),
    ("history_left_out", lambda value: _is_count(value, 0), "a count"),
    ("draft", lambda value: isinstance(value, str), "text"),
    ("draft_message_ids", lambda value: _is_list_of(value, str), "a list of message ids"),
    ("feedback", lambda value: isinstance(value, str), "text"),
    ("notice", lambda value: isinstance(value, str), "text"),
)


def _cannot_carry_on(unsound: str) -> Command[str]:
    """The task stops, saying why: its kept state cannot be worked on."""
    return Command(goto="complete", update={
        "status": "failed",
        "notice": f"this task's saved state cannot be carried on ({unsound}); send the task "
                  "again"})


def _feedback_entry(iteration: int, feedback: str, by: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"iteration": iteration, "agent": "HITL", "user_feedback": feedback}
    if by:
        entry["by"] = by
    return entry


def _last_user_message(messages: Sequence[BaseMessage]) -> HumanMessage | None:
    for message in reversed(messages):
        if isinstance(message, HumanMessage):
            return message
    return None


def _result_text(result: str | BaseMessage) -> str:
    if isinstance(result, BaseMessage):
        return result.text if isinstance(result.text, str) else str(result.content)
    return result if isinstance(result, str) else str(result)


def _text_of(message: BaseMessage | None) -> str:
    text = message.text if message is not None else ""
    return text.strip() if isinstance(text, str) else ""


def _names_a_choice(answer: Any) -> bool:
    """Whether an unreadable answer still names a choice (an action, an `approved` flag, a
    0, a list holding a decision): such an answer may mean "no", so
    `on_malformed="approve"` must not approve it."""
    if answer is False or answer == 0:  # a bare "no"
        return True
    if isinstance(answer, list):  # ["no"]: any item that reads as a decision, or names one
        return any(parse_decision(item) is not None or _names_a_choice(item)
                   for item in answer)
    if isinstance(answer, str) and answer.strip().startswith("{"):
        try:
            answer = orjson.loads(answer.strip())
        except orjson.JSONDecodeError:
            return False
    if not isinstance(answer, dict):
        return False
    if any(answer.get(key) is not None for key in
           ("action", "decision", "status", "approved", "is_approval", "isApproval")):
        return True
    return any(_names_a_choice(answer.get(key)) for key in ("answer", "feedback", "text"))
