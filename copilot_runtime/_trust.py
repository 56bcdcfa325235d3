"""What `CopilotRuntime` does for a run when it serves many users: ownership, limits,
guardrails, and what happens when the run ends (hooks, telemetry, the caller's slot).

Kept out of `runtime` so that a runtime without any of it takes its one short path.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from functools import partial
from typing import Any, Protocol

import orjson
import structlog

from copilot_runtime import events as ev
from copilot_runtime._compaction import events_to_messages
from copilot_runtime._input import RunInput
from copilot_runtime._runs import ActiveRun, RunManager
from copilot_runtime._server_tools import ServerToolsAgent
from copilot_runtime._withheld import (
    WITHHELD_MARK_PREFIX,
    called_ids,
    stand_ins,
    withheld_mark,
)
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.approvals.service import is_runtime_answer
from copilot_runtime.auth import Principal, RequestInfo, owner_of
from copilot_runtime.events import Event, EventBatches
from copilot_runtime.guardrails import (
    ALLOWED,
    CLIENT_TEXT,
    Guardrail,
    Verdict,
    check_failed,
    check_input,
    normalised,
    texts_of,
)
from copilot_runtime.hooks import ErrorInfo, HookRunner, RunFinished
from copilot_runtime.limits import Lease, RateLimiter
from copilot_runtime.messages import result_quote
from copilot_runtime.telemetry import Telemetry
from copilot_runtime.threads.base import (
    JUDGED_MARK_PREFIX,
    REFUSED_MARK_PREFIX,
    Positioned,
    ThreadOwner,
)

__all__ = ["Host", "may_approve", "replay_visible", "start_run", "thread_owner"]

_log = structlog.get_logger("copilot_runtime.runs")


class Host(Protocol):
    """What a run served to many users needs of its runtime."""

    runs: RunManager
    limiter: RateLimiter | None
    guardrails: list[Guardrail]
    allowed_marks: AllowedMarks
    #: Seconds each guardrail check may take (None: no bound).
    guardrail_timeout: float | None
    telemetry: Telemetry | None
    hooks: HookRunner

    @property
    def observed(self) -> bool:
        """Whether a run's end is observed (limits, hooks, telemetry)."""
        ...


async def thread_owner(runs: RunManager, thread_id: str) -> ThreadOwner | None:
    """The owner of the thread, running or stored; None for a thread with no owner and for
    one that does not exist (neither matches any principal)."""
    running = runs.active.get(thread_id)
    if running is not None and running.confirmed:
        return running.owner
    # A run still being begun names only who asks: the store says whose the thread is.
    record = await runs.store.summary(thread_id)
    return record.owner if record is not None else None


def may_approve(principal: Principal, approver_roles: frozenset[str],
                owner: ThreadOwner | None) -> bool:
    if owner is None:
        return False
    if owner == owner_of(principal):
        return True
    return bool(approver_roles & principal.roles) and owner.tenant == principal.tenant


async def replay_visible(runs: RunManager, owner: ThreadOwner, thread_id: str,
                         after: int = -1) -> AsyncIterator[Sequence[Positioned]]:
    """`runs.replay` of the thread if `owner` owns it; else nothing (as if it did not
    exist)."""
    if await thread_owner(runs, thread_id) != owner:
        return
    replay = runs.replay(thread_id, after)
    try:
        # Each batch checked again once read: its owner may have deleted it and another
        # started one of its id (stored, or running: the live run the replay follows). A
        # run here holds the thread (its owner known without a read); a replay following
        # another worker's run, or none, reads the store again later, after a delete and
        # reuse as much as before.
        async for batch in replay:
            if await thread_owner(runs, thread_id) != owner:
                return
            yield batch
    finally:
        aclose = getattr(replay, "aclose", None)  # its live run's follower given back
        if aclose is not None:
            await aclose()


class RefusalAgent(Agent):
    """Stands in for the agent when a guardrail refused the input: says why, and ends."""

    class_name = "RefusalAgent"

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run()

    async def _run(self) -> EventBatches:
        message_id = f"guardrail-{uuid.uuid4()}"
        yield [ev.text_message_start(message_id), ev.text_message_content(message_id, self.reason),
               ev.text_message_end(message_id)]


#: The roles whose text a client writes and a user reads as his own: guardrails judge each
#: such message new to a thread as the user's.
_CLIENT_ROLES = frozenset({"user", "developer", "system"})
#: How many earlier messages a judged message takes along as context.
_CONTEXT = 20
#: The most messages judged for one run (one judge call each): a request bringing more new
#: text than this is refused, not judged piece by piece.
_MOST_JUDGED = 32
#: The most tool results no call asked for that a thread stored before their mark was of
#: the quote the model reads had let through (`_let_through_unquoted`), judged again in one
#: run: they are no new text, and do not count toward `_MOST_JUDGED` (a thread holding
#: more would refuse every run), but are still a judge call each.
_MOST_REJUDGED = 256
#: How many characters of the text a thread let through, read back to back with a new user
#: message (`judged`), go along with it to be judged, on each side of the new messages:
#: enough to hold a word or phrase split across the two. The rest was judged when it was
#: let through; judging it all again each run cost the square of a thread's length. Counted
#: in the text as a pattern reads it (`normalised`): padding of spaces or invisible
#: characters does not push a split word out of it.
STRETCH_WINDOW = 4_096
#: How deep client text may nest within one value (a state entry, a tool's schema, an
#: interrupt's answer), and how many values (strings, numbers, objects, arrays, object
#: keys) the client text new to a run may hold: past either, the run is refused rather than
#: walked further.
_DEEPEST = 32
_MOST_VALUES = 50_000


#: How many marks of allowed text (`AllowedMarks`) a runtime remembers outside its threads.
MOST_ALLOWED_MARKS = 10_000

#: The topic rules a text was judged under (allowed, denied), None for the configured ones.
TopicRules = tuple[tuple[str, ...], tuple[str, ...]] | None


def topic_rules(topics: tuple[Sequence[str], Sequence[str]] | None) -> TopicRules:
    return None if topics is None or not (topics[0] or topics[1]) else (
        tuple(topics[0]), tuple(topics[1]))


class AllowedMarks:
    """The marks (content digests) of text this process's guardrails let through, or its
    agents wrote, for each owner and topic rules: a run kept out of any thread (a chat
    suggestion, which sends the chat's whole history under a throwaway thread id) judges
    only what is not among them. Bounded: past `most` marks, the least recently used are
    forgotten, and their text is judged again (as on another worker, which never saw it)."""

    __slots__ = ("_marks", "_refused", "most")

    def __init__(self, most: int = MOST_ALLOWED_MARKS) -> None:
        self.most = most
        self._marks: OrderedDict[tuple[ThreadOwner | None, TopicRules | str, str], None] = \
            OrderedDict()
        #: How many refused marks each owner has among `_marks` (`refuses_any`).
        self._refused: Counter[ThreadOwner | None] = Counter()

    def add(self, owner: ThreadOwner | None, rules: TopicRules | str,
            marks: Iterable[str]) -> None:
        for mark in marks:
            key = (owner, rules, mark)
            if key not in self._marks and mark.startswith(REFUSED_MARK_PREFIX):
                self._refused[owner] += 1
            self._marks[key] = None
            self._marks.move_to_end(key)
        while len(self._marks) > self.most:
            gone, _, mark = self._marks.popitem(last=False)[0]
            if mark.startswith(REFUSED_MARK_PREFIX):
                self._refused[gone] -= 1
                if not self._refused[gone]:
                    del self._refused[gone]

    def holds(self, owner: ThreadOwner | None, rules: TopicRules | str, mark: str) -> bool:
        key = (owner, rules, mark)
        if key not in self._marks:
            return False
        self._marks.move_to_end(key)
        return True

    def refuses_any(self, owner: ThreadOwner | None) -> bool:
        """Whether a refused mark of `owner`'s is remembered (under any rules)."""
        return owner in self._refused

    def seen_by(self, owner: ThreadOwner | None, rules: TopicRules) -> Collection[str]:
        """The marks `owner` had let through under `rules`, or that its agents wrote, as
        `judged` takes a thread's message ids."""
        return _Remembered(self, owner, rules)


#: What a thread's marks (its agent's output, `output_marks`, and what its guardrails let
#: through) are remembered under in place of topic rules (no client's rules can equal it):
#: the thread takes them as let through under any rules, and so does a suggestion.
_KEPT = "kept by a thread"


class _Remembered(Collection[str]):
    __slots__ = ("_allowed", "_owner", "_rules")

    def __init__(self, allowed: AllowedMarks, owner: ThreadOwner | None,
                 rules: TopicRules) -> None:
        self._allowed, self._owner, self._rules = allowed, owner, rules

    def __contains__(self, mark: object) -> bool:
        return isinstance(mark, str) and (
            self._allowed.holds(self._owner, self._rules, mark)
            or self._allowed.holds(self._owner, _KEPT, mark))

    def __iter__(self) -> Iterator[str]:  # (only asked whether it holds a mark)
        return iter(())

    def refuses_any(self) -> bool:
        return self._allowed.refuses_any(self._owner)

    def __len__(self) -> int:
        return 0


class _TooMuchToJudge(Exception):
    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.reason)
        self.verdict = verdict


_TOO_MANY_MESSAGES = Verdict(False, f"Your request brings more than {_MOST_JUDGED} new "
                                    "messages to check, so it was not sent.")
_TOO_MANY_REJUDGED = Verdict(False, f"Your request brings more than {_MOST_REJUDGED} earlier "
                                    "tool results to check again, so it was not sent.")
_TOO_MUCH_TEXT = Verdict(False, f"Your request brings more than {_MOST_VALUES} new values "
                                "to check, so it was not sent.")
_TOO_DEEP = Verdict(False, f"Your request nests values more than {_DEEPEST} levels deep, "
                           "too deep to be checked, so it was not sent.")
_UNCHECKABLE = Verdict(False, "Your request holds values that cannot be checked, so it was "
                              "not sent.")


def _mark(*parts: Any) -> str:
    digest = hashlib.blake2b(orjson.dumps(list(parts), default=str),
                             digest_size=16).hexdigest()
    return JUDGED_MARK_PREFIX + digest


def _value_mark(kind: str, key: Any, value: Any) -> str | None:
    """The mark of a JSON value under `kind` and `key`, its object keys in order (a client
    that parsed and wrote it again may reorder them); None if it cannot be encoded."""
    try:
        encoded = orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        return None
    digest = hashlib.blake2b(orjson.dumps([kind, key], default=str) + b"\n" + encoded,
                             digest_size=16).hexdigest()
    return JUDGED_MARK_PREFIX + digest


def judged_mark(message: Mapping[str, Any]) -> str:
    """What a thread keeps, among its message ids, of a client message its guardrails let
    through: a digest of the role and content of the message as the model reads it (a tool
    result no call asked for: `_as_read`), so the same text is not judged again, and other
    text under the same id is. Client ids never pass for one: the thread keeps none that
    begins with `JUDGED_MARK_PREFIX`."""
    return _mark(message.get("role"), message.get("content"))


def _as_read(result: Mapping[str, Any]) -> dict[str, Any]:
    """A tool result no call asked for as the model reads it (`paired_tool_calls`): a user
    message quoting its call id and its text, else its `error`, its attachments after. It
    is judged, and marked, so: the text a guardrail reads of its content (an attachment's
    filename, say) is not always what the model does."""
    content, error = result.get("content"), result.get("error")
    quote = result_quote(str(result.get("toolCallId")), content,
                         error if isinstance(error, str) else None)
    media = [part for part in content if isinstance(part, Mapping)
             and part.get("type") != "text"] if isinstance(content, list) else []
    return {"id": result.get("id"), "role": "user",
            "content": [{"type": "text", "text": quote}, *media] if media else quote}


def _let_through_unquoted(result: Mapping[str, Any], seen: Collection[str]) -> bool:
    """Whether a thread stored before results were marked `_as_read` let `result` (a tool
    result no call asked for) through: its mark was of its role and content, and it was
    judged as the joined text of its content, else its error. Neither covers all the model
    reads of it (its call id, what a guardrail reads of its attachments): it is judged again
    whole, as a new one is, but counted apart (`_MOST_REJUDGED`)."""
    return judged_mark(result) in seen


def refused_mark(message: Mapping[str, Any]) -> str:
    """What a thread keeps, among its message ids, of a client message its guardrails
    refused: a digest of the message's id, role and content, so that it is neither judged
    again nor given to the agent when clients send it back with the chat's history, while
    the same text as a new message (another id) is judged again. Its prefix and digest are
    not a `judged_mark`'s: it never passes for text let through. (A tool result's `error`
    and call id are not in it: it only leaves messages out, and a thread stored before
    keeps leaving out what it refused.)"""
    digest = hashlib.blake2b(orjson.dumps(
        ["refused", message.get("id"), message.get("role"), message.get("content")],
        default=str), digest_size=16).hexdigest()
    return REFUSED_MARK_PREFIX + digest


def _judged_as_users(message: Mapping[str, Any], called: Collection[Any]) -> bool:
    """Whether `message` is judged as the user's words: a client-written role, or a tool
    result no call of the history asked for (`paired_tool_calls` shows the model it as the
    user's)."""
    role = message.get("role")
    return role in _CLIENT_ROLES or (role == "tool" and message.get("toolCallId") not in called)


def _apart(message: Mapping[str, Any]) -> bool:
    """Whether `message` comes between the user messages around it as the model reads them:
    an answer with text or tool calls, or a tool result. System and developer messages go to
    the system prompt, and blank answers, reasoning and activity to no one (the Anthropic
    adapter sends the user messages around them as one turn)."""
    role = message.get("role")
    if role == "tool":
        return True
    return role == "assistant" and bool(
        message.get("toolCalls") or "".join(texts_of(message.get("content"))).strip())


def _parts(content: Any) -> list[Any]:
    """A message's content as a list of parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content) if isinstance(content, list) else []


def _edge(texts: Iterable[str], most: int, *, last: bool) -> list[str]:
    """The first (`last`: the last) `most` characters of `texts` as a pattern reads them
    (`normalised`), in order; only as many texts are read as that takes."""
    out: list[str] = []
    for text in texts:
        read = normalised(text)
        out.append(read[-most:] if last else read[:most])
        most -= len(out[-1])
        if most <= 0:
            break
    return out[::-1] if last else out


def _stretch_parts(messages: Sequence[Any], stretch: Sequence[tuple[int, bool]]) -> list[Any]:
    """Back-to-back user messages (each with whether it is new to the thread) as the parts
    of one message: the new ones whole, and of the ones let through before, between or after
    them only the `STRETCH_WINDOW` characters next to a new one."""
    out: list[Any] = []
    start = 0
    while start < len(stretch):
        at, new = stretch[start]
        if new:
            out.extend(_parts(messages[at].get("content")))
            start += 1
            continue
        end = start
        while end < len(stretch) and not stretch[end][1]:
            end += 1
        run = [messages[i] for i, _ in stretch[start:end]]
        before, after = start > 0, end < len(stretch)  # a new message before it, after it
        reach = (before + after) * STRETCH_WINDOW
        texts = _edge((t for m in run for t in texts_of(m.get("content"))), reach + 1,
                      last=False)
        if sum(map(len, texts)) > reach:  # longer than its windows: each of them, once
            texts = _edge((t for m in run for t in texts_of(m.get("content"))),
                          STRETCH_WINDOW, last=False) if before else []
            if after:
                texts += _edge((t for m in reversed(run)
                                for t in reversed(texts_of(m.get("content")))),
                               STRETCH_WINDOW, last=True)
        out.extend({"type": "text", "text": t} for t in texts)
        start = end
    return out


def refused_before(messages: Sequence[Any], seen: Collection[str]) -> set[int]:
    """The indices of the client messages of `messages` the thread refused in an earlier run
    (their `refused_mark` is in `seen`): sent back as the chat's history, they are left out
    of the agent's input, and not judged (judged, the chat was refused for good). The last
    such message is not among them: a turn sent again with nothing after it (a retry) is
    judged, and refused, again."""
    if not _holds_refused(seen):  # most threads: no message is digested for nothing
        return set()
    called = called_ids(messages)
    users = [i for i, m in enumerate(messages)
             if isinstance(m, dict) and _judged_as_users(m, called)]
    return {i for i in users[:-1] if refused_mark(messages[i]) in seen}


def _holds_refused(seen: Collection[str], prefix: str = REFUSED_MARK_PREFIX) -> bool:
    """Whether `seen` (a thread's message ids, or `AllowedMarks.seen_by`) may hold a
    `refused_mark` (or, with its prefix, a `withheld_mark`)."""
    if isinstance(seen, _Remembered):
        return seen.refuses_any()
    return any(mark.startswith(prefix) for mark in seen)


class _Walk:
    """Collects the strings of JSON values, keys too (a schema's property names and
    descriptions are text the model reads), within `_DEEPEST` levels and `_MOST_VALUES`
    values across one run's input (iteratively: hostile nesting cannot exhaust the stack)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = _MOST_VALUES

    def strings(self, values: Sequence[Any]) -> list[str]:
        out: list[str] = []
        self._take(len(values))
        stack: list[tuple[Any, int]] = [(v, 0) for v in reversed(values)]
        while stack:
            value, depth = stack.pop()
            if isinstance(value, str):
                if value:
                    out.append(value)
            elif isinstance(value, dict | list):
                if depth == _DEEPEST:
                    raise _TooMuchToJudge(_TOO_DEEP)
                # Counted before they are stacked: a hostile array is not copied first.
                if isinstance(value, dict):
                    self._take(2 * len(value))
                    for key, item in reversed(value.items()):
                        stack.append((item, depth + 1))
                        stack.append((key, depth + 1))
                else:
                    self._take(len(value))
                    stack.extend((item, depth + 1) for item in reversed(value))
        return out

    def _take(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise _TooMuchToJudge(_TOO_MUCH_TEXT)


def _json(text: Any) -> Any:
    try:
        return orjson.loads(text) if isinstance(text, str) else None
    except orjson.JSONDecodeError:
        return None


def history_texts(message: Mapping[str, Any]) -> list[tuple[str, list[Any]]]:
    """The texts of an assistant, reasoning or tool message (its content, a tool result's
    `error`, each tool call's name and arguments), each with its mark: JSON values whose
    strings are judged. A tool call's mark is of its arguments as JSON values, so that a
    client that parsed and wrote them again sends the same text. (Reasoning is text an
    agent may take as input, a graph and a remote agent do: that the thread did not write
    is judged as any history it did not make.)"""
    role = message.get("role")
    if role not in ("assistant", "reasoning", "tool"):
        return []
    pieces: list[tuple[str, list[Any]]] = []
    parts = [t for t in texts_of(message.get("content")) if t]
    # One text, as adapters join a message's parts for the model: parts judged one by one
    # let a word split across two of them through.
    texts = ["".join(parts)] if parts else []
    error = message.get("error") if role == "tool" else None
    if isinstance(error, str) and error:  # adapters show the model a failed tool's error
        texts.append(error)
    if texts:
        pieces.append((_mark(role, texts), texts))
    for call in message.get("toolCalls") or () if role == "assistant" else ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            name, arguments = function.get("name"), function.get("arguments")
            parsed = _json(arguments)
            canonical = arguments if parsed is None else orjson.dumps(
                parsed, option=orjson.OPT_SORT_KEYS).decode()
            pieces.append((_mark("toolCall", name, canonical), [name, arguments, parsed]))
    return pieces


def _state_entries(state: Any) -> list[tuple[str | None, list[Any]]]:
    """A state's entries, each with its mark and the values to judge: an object's top-level
    entries one by one (a client that edits one field brings only that one to judge, and a
    GraphQL client sends the state back without the `messages` it holds), key and value (an
    agent's schema may name the keys, but a client can send any, and the built-in agent
    shows the model the state whole), any other state whole."""
    if isinstance(state, dict):
        return [(_value_mark("state", key, value), [key, value])
                for key, value in state.items()]
    return [] if state is None else [(_value_mark("state", None, state), [state])]


def output_marks(events: list[Event]) -> set[str]:
    """The marks of what a run's agent wrote (its answers, tool calls and tool results, and
    its state): clients send them back as history and state, and they are not the client's
    text to judge."""
    produced = events_to_messages([[e for e in events if e["type"] != ev.RUN_STARTED]])
    marks = {mark for message in produced for mark, _ in history_texts(message)}
    for event in events:
        if event["type"] == ev.STATE_SNAPSHOT:
            marks.update(m for m, _ in _state_entries(event.get("snapshot")) if m is not None)
    return marks


def judged(input: Mapping[str, Any], seen: Collection[str],
           offered: Sequence[Mapping[str, Any]] = (),
           as_input: Collection[str] = (), dropped: Collection[int] = (),
           sources: list[int | None] | None = None, withheld: Collection[int] = (),
           pieces: list[tuple[int, list[str]]] | None = None
           ) -> list[tuple[list[str], list[Any]]]:
    """What guardrails judge of a run's input, each with the marks the thread keeps once
    it is let through.

    Each message whose text the client writes (`user`, `system`, `developer`) and that the
    thread has not let through before is judged as the user's, after the messages just
    before it. Judging only the last message let a client hide a refused one behind any
    other message, or send the refused text in a `system` or `developer` message; judging
    by message id let it send new text under the id of a message the thread holds. User
    messages back to back (nothing `_apart` between them) are read by a model as one: the
    last new one among them is judged with the content of them all.

    All other client-written text the model or the agent reads and the thread has not let
    through or produced itself is judged at once, as one message with `CLIENT_TEXT` set:
    `context` entries, tool definitions but `offered` (the runtime's own), assistant turns,
    reasoning and tool calls the thread did not make, tool results, messages' `name`s, the
    strings of `state` (its entries the agent wrote in an earlier run are its own), and a
    LangGraph interrupt's answers: `forwardedProps.command.resume` (a GraphQL `metaEvents`
    answer arrives so too) and the payloads of `resume` (AG-UI 1.0's answers, and the
    approvals service's). Of the rest of `forwardedProps`, only the entries named in `as_input` are
    judged, like `state` (the agent takes them as input: `Agent.forwarded_input`). A request
    with nothing new to judge is judged as it is.

    The messages at `dropped` (`refused_before`) are not judged: the agent is not given
    them. `sources`, if given, gets for each judgement the index of the message it judges
    as the user's, None for the one of all other text. The messages at `withheld` are
    stand-ins (`_withheld.stand_ins`): only the text they kept of the client's (a user
    message's) is judged. `pieces`, if given, gets for each message that brings new text to
    the one judgement of all other text, its index and that text (`_culprits`).

    Raises `_TooMuchToJudge` for more than `_MOST_JUDGED` messages (not counting up to
    `_MOST_REJUDGED` results judged again: `_let_through_unquoted`), and for client text
    nesting deeper than `_DEEPEST` or holding more than `_MOST_VALUES` values.
    """
    messages = input.get("messages") or []
    out: list[tuple[list[str], list[Any]]] = []
    marks: list[str] = []
    texts: list[str] = []
    walk = _Walk()
    #: The strings of each new mark, and those the message being read brings.
    strings_of: dict[str, list[str]] = {}
    brought: list[str] = []

    def other(mark: str | None, values: list[Any]) -> None:
        if mark is None:  # not JSON (input built in process): walked to say why, if it can
            walk.strings(values)
            raise _TooMuchToJudge(_UNCHECKABLE)
        if mark not in seen:
            if mark not in marks:
                marks.append(mark)
                strings_of[mark] = walk.strings(values)
                texts.extend(strings_of[mark])
            brought.extend(strings_of[mark])

    called = called_ids(messages)
    #: The user messages read back to back so far (`_apart` ends them), and the index in
    #: `out` of the judgement of the last new one among them.
    stretch: list[tuple[int, bool]] = []
    stretch_judged: int | None = None
    #: How many judgements of `out` are of results a thread stored before let through.
    rejudged = 0

    def stretch_ends() -> None:
        nonlocal stretch_judged
        if stretch_judged is not None and len(stretch) > 1:
            # The model reads them as one (the Anthropic adapter sends one turn): judged
            # also as one message, so a word split across two is still that word. Once per
            # stretch, with its last new message: each text is judged at most twice.
            judgement = out[stretch_judged][1]
            judgement[-1] = {**judgement[-1], "content": _stretch_parts(messages, stretch)}
        stretch.clear()
        stretch_judged = None

    for index, message in enumerate(messages):
        if not isinstance(message, dict) or index in dropped:
            continue
        if message.get("role") == "user":
            stretch.append((index, False))  # (new to the thread: below)
        elif _apart(message):
            stretch_ends()
        brought.clear()
        name = message.get("name")
        if isinstance(name, str) and name and index not in withheld:
            other(_mark("name", name), [name])
        role = message.get("role")
        # A result no call of the history asked for reaches the model as the user's words
        # (`paired_tool_calls`): it is judged as theirs, allowed topics and all, and marked,
        # as the quote the model reads (its role and content left its error and call id out).
        # (A withheld one is paired: `stand_ins` leaves the others out.)
        if _judged_as_users(message, called):
            read = _as_read(message) if role == "tool" else message
            mark = judged_mark(read)
            if mark not in seen:
                if role == "tool" and _let_through_unquoted(message, seen):
                    if rejudged == _MOST_REJUDGED:
                        raise _TooMuchToJudge(_TOO_MANY_REJUDGED)
                    rejudged += 1
                elif len(out) - rejudged == _MOST_JUDGED:
                    raise _TooMuchToJudge(_TOO_MANY_MESSAGES)
                message = read
                # The messages just before it, as context (a judge reads a few of them):
                # whole prefixes would cost the square of the request's length.
                start = max(0, index - _CONTEXT)
                context = [m for at, m in enumerate(messages[start:index], start)
                           if at not in dropped]
                out.append(([mark], [*context, {**message, "role": "user"}]))
                if sources is not None:
                    sources.append(index)
                if role == "user":
                    stretch[-1] = (index, True)
                    stretch_judged = len(out) - 1
        elif index not in withheld:
            for mark, values in history_texts(message):
                other(mark, values)
        if brought and pieces is not None:
            pieces.append((index, list(brought)))
    stretch_ends()
    for entry in input.get("context") or ():
        if isinstance(entry, dict):
            other(_mark("context", entry.get("description"), entry.get("value")),
                  [entry.get("description"), entry.get("value")])
    for tool in input.get("tools") or ():
        if isinstance(tool, dict) and tool not in offered:
            other(_mark("tool", tool.get("name"), tool.get("description"),
                        tool.get("parameters")),
                  [tool.get("name"), tool.get("description"), tool.get("parameters")])
    for entry_mark, values in _state_entries(input.get("state")):
        other(entry_mark, values)
    # Of `forwardedProps` a LangGraph interrupt's answer is judged: the rest (GraphQL
    # `properties`, an agent's `config`) is the app's data, auth tokens say, which must not
    # go to a judge model, and which no model reads as the user's words...
    props = input.get("forwardedProps")
    command = props.get("command") if isinstance(props, dict) else None
    if isinstance(command, dict) and command.get("resume") is not None:
        other(_value_mark("resume", None, command["resume"]), [command["resume"]])
    # ... and the entries the agent takes as input (a LangGraph graph merges those named like
    # its state keys into its input): state by another road.
    for key in as_input:
        if isinstance(props, dict) and key in props:
            other(_value_mark("forwardedProps", key, props[key]), [props[key]])
    for entry in input.get("resume") or ():
        if isinstance(entry, dict):
            payload = entry.get("payload")
            other(_value_mark("resume", None, payload), [payload])
    if texts:
        if len(out) - rejudged == _MOST_JUDGED:
            raise _TooMuchToJudge(_TOO_MANY_MESSAGES)
        out.append((marks, [{"id": "client-text", "role": "user", CLIENT_TEXT: True,
                             "content": [{"type": "text", "text": t} for t in texts]}]))
        if sources is not None:
            sources.append(None)
    elif marks and out:  # new, but without text (numbers, say): kept with what is judged
        out[0][0].extend(marks)
    if out:
        return out
    if sources is not None:
        sources.append(None)
    return [(marks, [m for i, m in enumerate(messages) if i not in dropped])]


async def start_run(runtime: Host, agent_id: str, agent: Agent, input: RunInput,
                    context: RunContext, request: RequestInfo | None,
                    topics: tuple[Sequence[str], Sequence[str]] | None,
                    registered: Agent | None = None,
                    answering: RequestInfo | None = None,
                    unstored: bool = False) -> ActiveRun:
    """`request` asks for the run; `answering` (without `request`) answered an approval whose
    run this is: the run is theirs, on a thread whose owner stays whoever it is. An
    `unstored` run is kept out of its thread (`RunManager.begin_unstored`)."""
    asker = request if request is not None else answering
    principal = asker.principal if asker is not None else None
    context.principal = principal
    if asker is not None:
        context.annotations = asker.annotations
    lease: Lease | None = None
    if runtime.limiter is not None and request is not None:
        lease = await runtime.limiter.acquire(request)
    try:
        owner = None  # an answer's run is on a thread whose owner it does not change
        remembered: Callable[[str], Awaitable[bool]] | None = None
        if principal is not None and request is not None:
            owner = owner_of(principal)
            keeper = registered or agent

            async def kept_by_agent(thread_id: str) -> bool:
                loaded = await keeper.load_state(thread_id, headers=context.headers)
                return loaded is not None and loaded.exists

            remembered = kept_by_agent

        begin = runtime.runs.begin_unstored if unstored else runtime.runs.begin
        run = await begin(agent_id, agent, input, context, owner, remembered)
    except BaseException:
        if lease is not None:  # no run started: nothing of it counts (a busy thread, say)
            await lease.give_back()
        raise
    # From here on, a run never driven gives back the caller's slot and ends its span.
    run.on_abandon = lambda run: _abandoned(run, lease)
    try:
        if runtime.guardrails or topics is not None:
            verdict = ALLOWED
            allowed = runtime.allowed_marks
            judged_for = (owner_of(principal) if principal is not None else None,
                          topic_rules(topics))
            # A run kept out of threads has no thread's marks: what this process let through
            # for the same person and rules stands in (a chat's history, sent again).
            if unstored:
                seen = allowed.seen_by(*judged_for)
            else:
                seen = run.seen_message_ids
                # Its thread's marks, remembered again: a suggestion after this turn does not
                # judge the chat's history again, even once this process forgot it (a
                # restart, the bound) or another worker judged it.
                allowed.add(judged_for[0], _KEPT,
                            (m for m in seen if m.startswith(JUDGED_MARK_PREFIX)))
            offered = agent.tools.specs() if isinstance(agent, ServerToolsAgent) else []
            messages = input.raw.get("messages") or []
            dropped = refused_before(messages, seen)
            withheld = stand_ins(messages, seen, _tool_names(input.raw, offered)) \
                if _holds_refused(seen, WITHHELD_MARK_PREFIX) else {}
            if dropped or withheld:  # the agent never reads what was refused, whatever its kind
                run.agent_input = run.agent_input.with_messages(
                    {**withheld, **dict.fromkeys(dropped)})
            # Judged as the agent reads them: stand-ins for the messages withheld.
            shown = [withheld.get(i, m) for i, m in enumerate(messages)]
            sources: list[int | None] = []
            pieces: list[tuple[int, list[str]]] = []
            refused_at: int | None = None
            culprits: list[int] = []
            try:
                # The runtime's own answer to an approval (a deadline's timeout) is not a
                # client's text: judging it would cost a judge call, or refuse the timeout.
                props = input.raw.get("forwardedProps")
                as_input = (registered or agent).forwarded_input(props) \
                    if isinstance(props, dict) and props else ()
                to_judge = [] if is_runtime_answer(input) else judged(
                    {**input.raw, "messages": shown}, seen, offered, as_input,
                    dropped | {i for i, m in withheld.items() if m is None}, sources,
                    withheld, pieces)
            except _TooMuchToJudge as exc:
                to_judge, verdict = [], exc.verdict
            if to_judge:
                with run.log_context():  # a guardrail's failure names the run it judged
                    verdict, refused_at, culprits = await _judged_unless_stopped(
                        runtime, run, to_judge, principal, topics,
                        pieces if None in sources else [])
            source = sources[refused_at] if refused_at is not None else None
            refused_marks: list[str] = []
            if source is not None and not check_failed(verdict):
                # Kept with the thread, as what was let through is: sent back with the
                # chat's history, the message refuses no later turn. (Not when a guardrail
                # failed: then it is judged again, once the guardrail is back.)
                refused_marks.append(refused_mark(messages[source]))
            elif refused_at is not None and not check_failed(verdict):
                # The same for the other client messages found refused on their own: sent
                # back, each is given to the agent as a stand-in (`_withheld`).
                refused_marks.extend(withheld_mark(messages[i]) for i in culprits)
            if refused_marks:
                run.extra_ids.update(refused_marks)
                allowed.add(judged_for[0], judged_for[1], refused_marks)

            def written_marks(events: list[Event]) -> set[str]:
                marks = output_marks(events)
                allowed.add(judged_for[0], _KEPT, marks)
                return marks

            run.output_marks = written_marks
            if not verdict.allowed:
                run.agent = RefusalAgent(verdict.reason)
                run.refusal = verdict.reason
                _log.info("guardrail refused a run", agent=agent_id, thread_id=run.thread_id,
                          run_id=run.run_id)
        if runtime.observed:
            telemetry = runtime.telemetry
            if telemetry is not None:
                context.telemetry = telemetry.run_started(
                    agent_id, run.thread_id, run.run_id, principal.id if principal else None)
            started = time.monotonic()

            def ended(run: ActiveRun) -> None:
                _ended(runtime, run, asker, time.monotonic() - started)

            run.on_end = ended
            if lease is not None:
                run.give_slot_back = partial(_give_back, lease)
    except BaseException:
        await run.abandon()
        raise
    return run


async def _judged_unless_stopped(runtime: Host, run: ActiveRun,
                                 to_judge: list[tuple[list[str], list[Any]]],
                                 principal: Principal | None,
                                 topics: tuple[Sequence[str], Sequence[str]] | None,
                                 pieces: list[tuple[int, list[str]]]
                                 ) -> tuple[Verdict, int | None, list[int]]:
    """The guardrails' verdict on `to_judge`, the index of the judgement refused, and when
    the one of all other client text (brought by `pieces`' messages) was refused, the
    indices of the messages refused on their own (`_culprits`), in a
    task a stop (or a shutdown) cancels: a run
    stopped while judged is not left waiting on them, and is driven at once to its stop's
    end, its agent never asked (`ActiveRun.cancel`)."""
    checking = asyncio.ensure_future(_judge(runtime, run, to_judge, principal, topics,
                                            pieces))
    run.on_cancel = checking.cancel
    try:
        return await checking
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if run.cancel_reason is None or task is None or task.cancelling():
            raise
        return ALLOWED, None, []  # (never acted on: the run stops before its agent is asked)
    finally:
        run.on_cancel = None


async def _judge(runtime: Host, run: ActiveRun, to_judge: list[tuple[list[str], list[Any]]],
                 principal: Principal | None,
                 topics: tuple[Sequence[str], Sequence[str]] | None,
                 pieces: list[tuple[int, list[str]]]
                 ) -> tuple[Verdict, int | None, list[int]]:
    for index, (marks, messages) in enumerate(to_judge):
        verdict = await check_input(runtime.guardrails, messages, principal, topics,
                                    runtime.guardrail_timeout)
        if not verdict.allowed:
            culprits: list[int] = []
            if _is_other_text(messages) and not check_failed(verdict):
                culprits = await _culprits(runtime, pieces, principal, topics,
                                           _MOST_JUDGED - index - 1)
            return verdict, index, culprits
        run.extra_ids.update(marks)  # kept with the thread once the run is stored
        runtime.allowed_marks.add(owner_of(principal) if principal is not None else None,
                                  topic_rules(topics), marks)
    return ALLOWED, None, []


def _is_other_text(messages: list[Any]) -> bool:
    return bool(messages) and isinstance(messages[-1], dict) \
        and bool(messages[-1].get(CLIENT_TEXT))


async def _culprits(runtime: Host, pieces: list[tuple[int, list[str]]],
                    principal: Principal | None,
                    topics: tuple[Sequence[str], Sequence[str]] | None, calls: int
                    ) -> list[int]:
    """The indices of the messages whose text (of `pieces`) the guardrails refuse on its
    own, each judged as the other client text is: at most `calls` judgements (none past
    it: the run's bound on judge calls), and only a guardrail's verdict counts (a failure
    marks nothing)."""
    if len(pieces) > calls:
        return []
    found = []
    for index, texts in pieces:
        verdict = await check_input(
            runtime.guardrails, [{"id": "client-text", "role": "user", CLIENT_TEXT: True,
                                  "content": [{"type": "text", "text": t} for t in texts]}],
            principal, topics, runtime.guardrail_timeout)
        if not verdict.allowed and not check_failed(verdict):
            found.append(index)
    return found


def _tool_names(input: Mapping[str, Any], offered: Sequence[Mapping[str, Any]]) -> set[str]:
    """The names of the run's tools (the client's, judged with its text, and the runtime's
    own): a withheld tool call keeps its name only if it is one of them."""
    tools = [*(input.get("tools") or ()), *offered]
    return {tool["name"] for tool in tools
            if isinstance(tool, Mapping) and isinstance(tool.get("name"), str)}


async def _abandoned(run: ActiveRun, lease: Lease | None) -> None:
    """A run reserved and never driven: its caller's slot and its span end with it."""
    if lease is not None:
        await lease.release_quietly()
    if run.context.telemetry is not None:
        run.context.telemetry.end("abandoned", None)


def _outcome(run: ActiveRun) -> tuple[str, dict[str, Any] | None]:
    last: Event = {}
    for event in reversed(run.events):
        if event["type"] in ev.TERMINAL_TYPES:
            last = event
            break
    if last.get("type") == ev.RUN_ERROR:
        return "error", {"message": last.get("message"), "code": last.get("code")}
    if run.refusal is not None:
        return "refused", None
    if run.cancel_reason == "stop":
        return "stopped", None
    if run.cancel_reason == "disconnect":
        return "disconnected", None
    outcome = last.get("outcome")
    if (isinstance(outcome, dict) and outcome.get("type") == "interrupt") or any(
            e["type"] == ev.CUSTOM and e.get("name") == "on_interrupt" for e in run.compacted):
        return "interrupted", None
    return "finished", None


def _give_back(lease: Lease) -> asyncio.Future[None] | None:
    """Start giving the caller's slot back (`drain_releases` waits for it): its release."""
    giving = lease.end()
    if giving is not None:
        _pending.add(giving)
        giving.add_done_callback(_pending.discard)
    return giving


def _ended(runtime: Host, run: ActiveRun, request: RequestInfo | None,
           duration: float) -> None:
    outcome, error = _outcome(run)
    context = run.context
    if context.telemetry is not None:
        context.telemetry.end(outcome, error)
    hooks = runtime.hooks
    principal = context.principal
    if hooks.on_run_finished is not None:
        hooks.run_finished(RunFinished(
            agent_id=run.agent_id, thread_id=run.thread_id, run_id=run.run_id,
            principal=principal, new_messages=events_to_messages([run.compacted]),
            usage=dict(context.usage), outcome=outcome, duration=duration, error=error,
            annotations=context.annotations, suggestion=run.unstored))
    if error is not None and hooks.on_error is not None:
        hooks.error(ErrorInfo(
            message=str(error.get("message") or ""), code=str(error.get("code") or ""),
            agent_id=run.agent_id, thread_id=run.thread_id, run_id=run.run_id,
            principal=principal, request_id=request.request_id if request else None))


_pending: set[asyncio.Task[None]] = set()


async def drain_releases(timeout: float) -> None:  # noqa: ASYNC109 - a grace period
    """Wait up to `timeout` seconds for the callers' slots still being given back."""
    tasks = list(_pending)
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
