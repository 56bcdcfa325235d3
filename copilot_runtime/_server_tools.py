"""Server-side tools for agents: runtime actions and other agents, answered by the runtime.

CopilotKit 1.x runtimes gave an agent more tools than the frontend's: the runtime's
server-side actions, and every other agent (never the agent itself, which could then call
itself without end). When the agent calls one of them, the runtime answers in the same run:

* an action runs here, and its result (or its error, for the model) follows the call;
* another agent is handed the conversation: the call's result says that the agent started,
  then that agent's run streams into the same run, between the custom events
  `AGENT_STARTED` and `AGENT_FINISHED` (so a protocol can attribute its state to it); its
  own RUN_STARTED and RUN_FINISHED are left out, and its RUN_ERROR ends the whole run.

A messages snapshot the agent sends after such answers (a LangGraph checkpoint) gets them,
each right after the message holding its call (and the results already following that):
a client takes a snapshot for the whole conversation, and the agent's does not have them
until the next turn brings them.

`ServerToolsAgent` wraps the agent of such a run. Which runs get it is the protocol's
choice: the GraphQL protocol of 1.x does this, the AG-UI protocol of 1.50+ does not.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final

from copilot_runtime import events as ev
from copilot_runtime._compaction import events_to_messages
from copilot_runtime._exceptions import ActionError
from copilot_runtime._input import RunInput
from copilot_runtime.actions import Action
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.events import Event, EventBatches

__all__ = ["AGENT_FINISHED", "AGENT_STARTED", "ServerTools", "ServerToolsAgent"]

AGENT_STARTED: Final = ev.AGENT_STARTED
AGENT_FINISHED: Final = ev.AGENT_FINISHED
_NO_PARAMETERS: Final = {"type": "object", "properties": {}}

#: Given another agent's id: that agent, ready to run (wrapped again if it has tools too),
#: and its input for this conversation.
StartAgent = Callable[[str], tuple[Agent, RunInput]]


@dataclass(frozen=True, slots=True)
class ServerTools:
    """What one agent is offered besides the frontend's tools."""

    actions: Mapping[str, Action] = field(default_factory=dict)
    #: The other agents, by id, with the description the model sees.
    agents: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.actions or self.agents)

    def specs(self) -> list[dict[str, Any]]:
        """The tools as `RunAgentInput.tools` lists them, actions first."""
        tools = [{"name": a.name, "description": a.description, "parameters": a.parameters}
                 for a in self.actions.values()]
        tools.extend({"name": agent_id,
                      "description": description or f"Hands the conversation to the agent "
                                                    f"'{agent_id}'",
                      "parameters": dict(_NO_PARAMETERS)}
                     for agent_id, description in self.agents.items()
                     if agent_id not in self.actions)
        return tools


class ServerToolsAgent(Agent):
    """`agent`, with its calls to `tools` answered by the runtime (see the module doc)."""

    class_name = "ServerToolsAgent"

    def __init__(self, agent: Agent, tools: ServerTools, start_agent: StartAgent) -> None:
        super().__init__(description=agent.description)
        self.agent = agent
        self.tools = tools
        self.start_agent = start_agent

    def capabilities(self) -> dict[str, Any] | None:
        return self.agent.capabilities()

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input, context)

    async def _run(self, input: RunInput, context: RunContext) -> EventBatches:
        handled = {*self.tools.actions, *self.tools.agents}
        calls: dict[str, tuple[str, list[str]]] = {}
        answers: list[_Answer] = []
        async with _closing(self.agent.run(input, context)) as batches:
            async for batch in batches:
                start = 0
                # (by index: a snapshot amended below replaces `batch` with a copy)
                for index in range(len(batch)):
                    event = batch[index]
                    kind = event["type"]
                    if kind == ev.TOOL_CALL_START:
                        if event.get("toolCallName") in handled:
                            calls[event["toolCallId"]] = (event["toolCallName"], [])
                    elif kind == ev.TOOL_CALL_ARGS:
                        call = calls.get(event["toolCallId"])
                        if call is not None:
                            call[1].append(event["delta"])
                    elif kind == ev.TOOL_CALL_END and event["toolCallId"] in calls:
                        # The call as far as it goes, then its answer, then the rest.
                        yield batch[start:index + 1]
                        start = index + 1
                        name, pieces = calls.pop(event["toolCallId"])
                        answered = _Answer(event["toolCallId"])
                        answers.append(answered)
                        async for answer in self._answer(event["toolCallId"], name,
                                                         "".join(pieces), context):
                            answered.batches.append(answer)
                            yield answer
                    elif kind == ev.MESSAGES_SNAPSHOT and answers and not any(
                            later["type"] == ev.MESSAGES_SNAPSHOT for later in batch[index + 1:]):
                        # (one followed by another in its batch only orders a merging
                        # client's messages before that one: left as it is)
                        amended = _with_answers(event, answers, input)
                        if amended is not event:
                            batch = [*batch[:index], amended, *batch[index + 1:]]
                if start == 0:
                    yield batch
                elif start < len(batch):
                    yield batch[start:]

    async def _answer(self, call_id: str, name: str, arguments: str,
                      context: RunContext) -> EventBatches:
        action = self.tools.actions.get(name)
        if action is not None:
            error = None
            try:
                content = await action.execute(arguments)
            except ActionError as exc:
                content, error = ev.failed_tool_content(exc.message), exc.message
            yield [ev.tool_call_result(str(uuid.uuid4()), call_id, content, error=error)]
            return
        agent, input = self.start_agent(name)
        yield [ev.tool_call_result(str(uuid.uuid4()), call_id, f"{name} agent started"),
               ev.custom(AGENT_STARTED, {"agentName": name, "runId": input.run_id})]
        # The agent handed to acts for the same caller: it sees who asks, as the first did.
        sub_context = RunContext(agent_id=name, headers=context.headers,
                                 follow_up_server_tools=context.follow_up_server_tools,
                                 principal=context.principal,
                                 annotations=context.annotations)
        async with _closing(agent.run(input, sub_context)) as batches:
            async for batch in batches:
                out: list[Event] = []
                ended = False
                for event in batch:
                    kind = event["type"]
                    if kind == ev.RUN_ERROR:
                        yield [*out, event]  # ends the whole run: nothing is read after it
                        return
                    if kind == ev.RUN_FINISHED:
                        ended = True  # the end of that agent's part, not of the run
                        break
                    if kind != ev.RUN_STARTED:
                        out.append(event)
                if out:
                    yield out
                if ended:
                    break
        yield [ev.custom(AGENT_FINISHED, {"agentName": name})]


@dataclass(slots=True)
class _Answer:
    """What the runtime answered one call with, read only if a snapshot follows it."""

    call_id: str
    batches: list[Sequence[Event]] = field(default_factory=list)
    #: The messages `batches` make; built once, for the first snapshot after them (a run
    #: may send one a step, and a handed-over agent's answer may be thousands of batches).
    _messages: list[dict[str, Any]] | None = None

    def messages(self) -> list[dict[str, Any]]:
        if self._messages is None:
            # (complete: the agent's next batch, a snapshot among them, comes after it)
            events = [event for batch in self.batches for event in batch]  # (one run's)
            self._messages, self.batches = events_to_messages([events]), []
        return self._messages


def _with_answers(snapshot: Event, answers: Sequence[_Answer], input: RunInput) -> Event:
    """The agent's messages snapshot with the messages the runtime answered with in this run
    (results, a handed-over agent's messages), each answer right after its call's message
    and the results following it, as the stored thread has them. The agent's conversation
    (a LangGraph checkpoint) knows nothing of them, and a client takes a snapshot for the
    whole conversation: it would lose them, and the next turn would send a call without its
    result. (The agent learns them from that next turn's messages.)"""
    messages = snapshot.get("messages")
    if not isinstance(messages, list):
        return snapshot
    known = {m.get("id") for m in messages if isinstance(m, dict)}
    known.update(m.get("id") for m in input.raw.get("messages") or () if isinstance(m, dict))
    amended: list[Any] | None = None
    for answer in answers:
        missing = [m for m in answer.messages() if m["id"] not in known]
        if not missing:
            continue
        known.update(m["id"] for m in missing)
        if amended is None:
            amended = list(messages)
        at = _after_call(amended, answer.call_id)
        amended[at:at] = missing
    return snapshot if amended is None else {**snapshot, "messages": amended}


def _after_call(messages: list[Any], call_id: str) -> int:
    """Where the answer to `call_id` goes: after the last message holding that call (an id
    may be used again in a later turn) and the tool results right after it, which a model
    provider wants before any other message; at the end when no message holds it."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        calls = message.get("toolCalls") if isinstance(message, dict) else None
        if isinstance(calls, list) and any(isinstance(c, dict) and c.get("id") == call_id
                                           for c in calls):
            index += 1
            while index < len(messages) and isinstance(messages[index], dict) \
                    and messages[index].get("role") == "tool":
                index += 1
            return index
    return len(messages)


@asynccontextmanager
async def _closing(batches: EventBatches) -> AsyncIterator[EventBatches]:
    """Close an agent's stream however the reading ends (its upstream request with it)."""
    try:
        yield batches
    finally:
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()
