"""Specialists for the review loop, and the planner's default way of choosing one.

A specialist is anything with a `name`, a `description` and an async `run(request)` that
returns its result: text (the loop streams it to the client), or the message a LangChain
chat model returned (it streamed while it was written, under that message's id). It gets
the original task, the iteration, the draft being revised, the latest revision and the latest
steps of the execution history (bounded: see `ReviewLoop`), so a revision is done with what
came before it. `ModelSpecialist` asks a chat model;
`finance_specialists` are the example Invoice, Closing and Audit specialists.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage

from copilot_runtime._strings import not_one_string

__all__ = [
    "PROMPT_ENTRY_CHARS",
    "PROMPT_HISTORY_ENTRIES",
    "ModelSpecialist",
    "Specialist",
    "SpecialistRequest",
    "finance_specialists",
    "keyword_router",
    "specialist_prompt",
]


@dataclass(frozen=True, slots=True)
class SpecialistRequest:
    #: The task as the user first gave it: a revision never replaces it.
    task: str
    iteration: int
    #: The latest steps: `{"iteration", "agent", "result" | "user_feedback" | "error"}`, at
    #: most the loop's `history_entries`, each text cut to its `history_entry_chars` (an
    #: entry cut short says how long it was in `cut_from`).
    history: tuple[Mapping[str, Any], ...]
    #: What the person asked to change (None on the first pass).
    feedback: str | None = None
    #: The draft being revised, in full ("" on the first pass).
    draft: str = ""
    #: How many earlier steps the history no longer holds.
    left_out: int = 0


@runtime_checkable
class Specialist(Protocol):
    @property
    def name(self) -> str:
        ...

    @property
    def description(self) -> str:
        ...

    async def run(self, request: SpecialistRequest) -> str | BaseMessage:
        ...


#: How many of the latest history entries a prompt carries: a long revision loop must not
#: grow the prompt past the model's context.
PROMPT_HISTORY_ENTRIES = 8
#: How many characters of one history entry (a draft, a revision) a prompt carries.
PROMPT_ENTRY_CHARS = 4000


def specialist_prompt(request: SpecialistRequest, *,
                      history_entries: int = PROMPT_HISTORY_ENTRIES,
                      entry_chars: int = PROMPT_ENTRY_CHARS) -> str:
    """The request as text for a model: task, iteration, history, the draft to revise,
    revision.

    Bounded: only the latest `history_entries` entries, each cut to `entry_chars`
    characters, with a line saying what was left out; the draft cut to `entry_chars` too.
    """
    lines = [f"Task: {request.task}", f"Iteration: {request.iteration}", "Execution history:"]
    shown = request.history[-history_entries:] if history_entries > 0 else ()
    left_out = request.left_out + len(request.history) - len(shown)
    if left_out:
        lines.append(f"- ({left_out} earlier entr{'ies' if left_out != 1 else 'y'} "
                     "left out)")
    for entry in shown:
        said = str(entry.get("result") or entry.get("user_feedback") or entry.get("error")
                   or "")
        whole = entry.get("cut_from") or len(said)  # the loop may have cut it already
        if whole > len(said) or len(said) > entry_chars:
            said = f"{said[:entry_chars]}… (cut: {whole} characters in all)"
        lines.append(f"- iteration {entry.get('iteration')}, {entry.get('agent')}: {said}")
    if request.draft:
        draft = request.draft
        if len(draft) > entry_chars:
            draft = f"{draft[:entry_chars]}… (cut: {len(draft)} characters in all)"
        lines.append(f"Draft to revise:\n{draft}")
    if request.feedback:
        lines.append(f"Revision requested: {request.feedback}")
    return "\n".join(lines)


@dataclass
class ModelSpecialist:
    """A specialist that asks `model`; its answer streams to the client as it is written."""

    name: str
    description: str
    instructions: str
    model: BaseChatModel
    #: Words in a task that send it to this specialist (the default router).
    keywords: tuple[str, ...] = field(default_factory=tuple)
    #: The prompt's bounds (`specialist_prompt`): the latest history entries it carries,
    #: and the characters of each.
    history_entries: int = PROMPT_HISTORY_ENTRIES
    entry_chars: int = PROMPT_ENTRY_CHARS

    def __post_init__(self) -> None:
        not_one_string(self.keywords, f"specialist {self.name!r}: keywords")

    async def run(self, request: SpecialistRequest) -> BaseMessage:
        messages = [
            SystemMessage(content=f"You are the {self.name} specialist. {self.instructions} "
                                  "Answer with the result only. When a revision is "
                                  "requested, redo the task with it, keeping the rest."),
            HumanMessage(content=specialist_prompt(request,
                                                   history_entries=self.history_entries,
                                                   entry_chars=self.entry_chars)),
        ]
        return await self.model.ainvoke(messages)


def finance_specialists(model: BaseChatModel) -> list[ModelSpecialist]:
    """The example specialists: Invoice, Closing and Audit, on `model`."""
    return [
        ModelSpecialist(
            "Invoice", "Prepares and corrects invoices",
            "You prepare invoices: line items, amounts, taxes and payment terms.", model,
            ("invoice", "bill", "billing", "payment", "vat", "tax", "receivable")),
        ModelSpecialist(
            "Closing", "Runs the month-end close",
            "You run the financial close: reconciliations, accruals and the checklist.",
            model, ("close", "closing", "month-end", "month end", "reconcil", "accrual",
                    "ledger")),
        ModelSpecialist(
            "Audit", "Reviews controls and compliance",
            "You audit: controls, samples, findings and their severity.", model,
            ("audit", "control", "compliance", "sox", "review", "finding")),
    ]


def keyword_router(task: str, specialists: Sequence[Specialist]) -> tuple[str, str]:
    """The specialist whose `keywords` (or name) the task mentions most; else the first."""
    lowered = task.lower()
    best, best_hits = specialists[0].name, 0
    matched: list[str] = []
    for specialist in specialists:
        words = list(dict.fromkeys([specialist.name.lower(),
                                    *getattr(specialist, "keywords", ())]))
        hits = [w for w in words if re.search(rf"\b{re.escape(w)}", lowered)]
        if len(hits) > best_hits:
            best, best_hits, matched = specialist.name, len(hits), hits
    reason = f"the task mentions {', '.join(repr(w) for w in matched)}" if matched \
        else "no specialist matched, so the first one takes it"
    return best, reason
