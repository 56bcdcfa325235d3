"""The built-in LLM agent: a chat model, server-side actions and the frontend's tools.

Each step streams one model answer. Server-side actions the model calls run inside the run
and their results go back to the model, step after step, until it answers without calling
one (or `max_steps` is reached; the last step forbids tools so the user always gets an
answer). When the model calls a frontend tool the run ends, the client executes the tool and
starts the next run with the result.

On AG-UI runs the model also sees the application state the client shares (the input's
`state`) and may change it with the state tools of `_shared_state`; GraphQL runs (1.10
clients, whose runtime had no such tools) see neither.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from ag_ui.core import (
    AssistantMessage,
    FunctionCall,
    Message,
    ToolCall,
    ToolMessage,
)

from copilot_runtime._exceptions import (
    ActionError,
    ConfigurationError,
    ContentFilteredError,
    InvalidRequestError,
    ModelNotAllowedError,
    OutputTruncatedError,
    UpstreamError,
)
from copilot_runtime._input import RunInput
from copilot_runtime._limits import HELD_BOUND, HeldTooLarge, decode_json
from copilot_runtime._strings import not_one_string
from copilot_runtime.actions import Action
from copilot_runtime.adapters.base import (
    ChatDelta,
    ChatRequest,
    EncryptedReasoning,
    ReasoningDelta,
    ServiceAdapter,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
    configured_model,
    spent_before,
)
from copilot_runtime.agents._shared_state import (
    DELTA_TOOL,
    SNAPSHOT_TOOL,
    SharedState,
    StateChange,
)
from copilot_runtime.agents.base import Agent, RunContext
from copilot_runtime.auth import owner_of
from copilot_runtime.events import (
    TEXT_MESSAGE_CONTENT,
    Event,
    EventBatches,
    LastBatch,
    failed_tool_content,
    reasoning_content,
    reasoning_encrypted_value,
    reasoning_end,
    reasoning_start,
    run_finished,
    text_message_end,
    text_message_start,
    tool_call_args,
    tool_call_end,
    tool_call_result,
    tool_call_start,
)
from copilot_runtime.threads.base import ThreadOwner

__all__ = ["BuiltInAgent"]


# What a tool call's events have said so far.
_HELD, _OPEN, _ENDED = 0, 1, 2


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    #: `_HELD` until its name is known (TOOL_CALL_START needs it), then `_OPEN`, `_ENDED`.
    said: int = _HELD

    def start(self, message_id: str, out: list[Event]) -> None:
        """Its TOOL_CALL_START, and the arguments that came before its name."""
        self.said = _OPEN
        out.append(tool_call_start(self.id, self.name, message_id))
        if self.arguments:
            out.append(tool_call_args(self.id, "".join(self.arguments)))

    def complete(self) -> bool:
        """Whether its arguments so far are a whole JSON value (no piece can follow)."""
        try:
            decode_json("".join(self.arguments))  # (as the action reads them)
        except orjson.JSONDecodeError:
            return False
        return True


@dataclass(slots=True)
class _Turn:
    """What every step of one run sends the model: tools, settings, the growing history."""

    tools: list[ToolSpec]
    #: The tools the client runs (the rest are this agent's server-side actions).
    frontend: set[str]
    history: list[Message]
    system_prompt: str | None
    settings: dict[str, Any]
    #: The application state the model sees and may change (None: it sees none).
    shared: SharedState | None = None
    #: The run's thread and its owner: what an adapter keeps of an answer goes back only to
    #: their requests.
    thread_id: str | None = None
    thread_owner: ThreadOwner | None = None


@dataclass(slots=True)
class _Answer:
    """One streamed model answer: its events as deltas arrive, then its message."""

    message_id: str
    #: The tool call ids the run's history and its answers so far hold (shared by them).
    taken: set[str] = field(default_factory=set)
    text: list[str] = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    by_index: dict[int, _Call] = field(default_factory=dict)
    text_open: bool = False
    open_call: _Call | None = None
    #: How the stream ended (finish reason, token usage), once it has.
    end: StreamEnd | None = None
    #: Whether the client understands REASONING_* events (AG-UI 1.0 clients declare it);
    #: for the others the model's reasoning is left out.
    show_reasoning: bool = False
    reasoning_id: str | None = None
    #: The answer's signed reasoning (`EncryptedReasoning`): the call it goes on, its value,
    #: and whether its event was sent (it waits for the call's TOOL_CALL_START).
    signed: tuple[_Call, str] | None = None
    signed_said: bool = False
    #: The length of the arguments held that no event sent (a call's before its name).
    held: int = 0
    #: The most it may hold (the run's bound: `HELD_BOUND`).
    held_most: int = field(default_factory=HELD_BOUND.get)

    def translate(self, deltas: Sequence[ChatDelta]) -> list[Event]:
        """The events of one batch of deltas.

        The hot path: the state lives in locals for the loop and is stored once per batch.
        """
        batch: list[Event] = []
        message_id, text, calls, by_index = self.message_id, self.text, self.calls, self.by_index
        taken = self.taken
        text_open, open_call = self.text_open, self.open_call
        for delta in deltas:
            if self.reasoning_id is not None and type(delta) is not ReasoningDelta:
                batch.extend(reasoning_end(self.reasoning_id))  # reasoning comes first
                self.reasoning_id = None
            if type(delta) is TextDelta:
                if not text_open:
                    if open_call is not None or calls:
                        continue  # text after tool calls: not shown by any client
                    batch.append(text_message_start(message_id))
                    text_open = True
                piece = delta.text
                text.append(piece)
                # `text_message_content`, without a call per piece
                batch.append({"type": TEXT_MESSAGE_CONTENT, "messageId": message_id,
                              "delta": piece})
            elif type(delta) is ToolCallDelta:
                call = by_index.get(delta.call_index)
                if call is None:
                    if text_open:
                        batch.append(text_message_end(message_id))
                        text_open = False
                    # The call before ends here unless its arguments are unfinished: then
                    # the provider interleaves parallel calls (0, 1, 0, 1) and it ends with
                    # the answer, as no piece may follow a call's TOOL_CALL_END.
                    if open_call is not None and open_call.said == _OPEN \
                            and open_call.complete():
                        open_call.said = _ENDED
                        batch.append(tool_call_end(open_call.id))
                    call_id = delta.id
                    if not call_id or call_id in taken:
                        # A taken id (parallel calls under one, a provider numbering each
                        # answer's calls from 0): each result went back to the model as the
                        # first call's of the id, and the thread kept calls under one id.
                        call_id = f"call_{uuid.uuid4().hex[:24]}"
                    taken.add(call_id)
                    call = _Call(call_id, "")
                    by_index[delta.call_index] = call
                    calls.append(call)
                    open_call = call
                if delta.arguments:
                    call.arguments.append(delta.arguments)
                    if call.said == _OPEN:
                        batch.append(tool_call_args(call.id, delta.arguments))
                    else:  # (no event: the run's bound would never count them)
                        self.held += len(delta.arguments)
                        if self.held > self.held_most:
                            raise HeldTooLarge("tool call's arguments", self.held_most)
                if call.said == _HELD and delta.name:
                    call.name = delta.name  # it may come after the id, as the SDK allows
                    call.start(message_id, batch)
            elif type(delta) is ReasoningDelta:
                if self.show_reasoning and delta.text:
                    if self.reasoning_id is None:
                        self.reasoning_id = str(uuid.uuid4())
                        batch.extend(reasoning_start(self.reasoning_id))
                    batch.append(reasoning_content(self.reasoning_id, delta.text))
            elif type(delta) is EncryptedReasoning:
                signed_call = by_index.get(delta.call_index)
                if signed_call is not None:
                    self.signed = (signed_call, delta.value)
                    self._say_signed(batch)
            else:
                self.end = delta  # type: ignore[assignment]
        self.text_open, self.open_call = text_open, open_call
        return batch

    def close(self) -> list[Event]:
        """The end events of the text or tool call still open when the stream ended."""
        tail: list[Event] = []
        if self.reasoning_id is not None:
            tail.extend(reasoning_end(self.reasoning_id))
            self.reasoning_id = None
        if self.text_open:
            tail.append(text_message_end(self.message_id))
            self.text_open = False
        for call in self.calls:
            if call.said == _HELD:
                call.start(self.message_id, tail)  # no name ever came: said as it is
            if call.said == _OPEN:
                call.said = _ENDED
                tail.append(tool_call_end(call.id))
        self._say_signed(tail)
        self.open_call = None
        return tail

    def _say_signed(self, out: list[Event]) -> None:
        """The REASONING_ENCRYPTED_VALUE of the answer's signed reasoning, once its call
        started (for the clients that know the event: those shown reasoning)."""
        if self.signed is None or self.signed_said or not self.show_reasoning \
                or self.signed[0].said == _HELD:
            return
        self.signed_said = True
        out.append(reasoning_encrypted_value("tool-call", self.signed[0].id, self.signed[1]))

    def cut_call(self) -> _Call | None:
        """The first call whose arguments are not whole JSON (read once, at the answer's
        end: an answer cut at the token limit may have stopped in the middle of them)."""
        return next((c for c in self.calls if not c.complete()), None)

    def broken_call(self, frontend: set[str]) -> _Call | None:
        """The first call of a frontend tool whose arguments are not JSON, though the answer
        ended as it should (a small model's single quotes, a provider's cut input): the
        client would be handed them. No arguments at all are the empty object, as an
        action takes them."""
        return next((c for c in self.calls if c.name in frontend and c.arguments
                     and not c.complete()), None)

    def message(self) -> AssistantMessage:
        """The answer as the assistant message the next step's history holds."""
        calls = [ToolCall(id=c.id, function=FunctionCall(
            name=c.name, arguments="".join(c.arguments))) for c in self.calls]
        if self.signed is not None:  # (read back should the adapter no longer hold it)
            at = self.calls.index(self.signed[0])
            calls[at] = calls[at].model_copy(update={"encrypted_value": self.signed[1]})
        return AssistantMessage(id=self.message_id, content="".join(self.text) or None,
                                tool_calls=calls or None)


_log = structlog.get_logger("copilot_runtime.agents.builtin")
#: The most tools a run offers unless `BuiltInAgent(max_tools=)` says otherwise: OpenAI
#: refuses a request offering more than 128.
MAX_OFFERED_TOOLS = 128


class BuiltInAgent(Agent):
    """An agent that is one LLM behind a `ServiceAdapter`, with server-side actions.

    `state_tools` says when the model is offered the state tools on AG-UI runs: by default
    (None) when the client shares a non-empty state, True on every run (as the TypeScript
    runtime does: a model may then fill in an empty state), False never (it still reads the
    state). Offering tools on every run would break plain chat with a model that takes no
    tools (a LangChain model without `bind_tools`, a server that refuses `tools`).

    A run offers at most `max_tools` tools (None: no bound): past it, MCP servers' tools
    (`Action.expendable`) are left out, the last listed first, with a warning naming them.
    Each server's own `max_tools` bounds it alone; two of them at their default (100 each)
    made every run offer 200, which OpenAI refuses.
    """

    class_name = "BuiltInAgent"

    def __init__(
        self,
        adapter: ServiceAdapter,
        *,
        actions: Iterable[Action] = (),
        description: str = "",
        instructions: str | None = None,
        max_steps: int = 10,
        allowed_models: Iterable[str] | None = None,
        state_tools: bool | None = None,
        max_tools: int | None = MAX_OFFERED_TOOLS,
    ) -> None:
        super().__init__(description=description)
        if max_tools is not None and max_tools < 1:
            raise ConfigurationError("max_tools must be at least 1 (or None)")
        self.max_tools = max_tools
        #: The tools the latest run that left some out left out (each new set is logged).
        #: The sets of tools left out that were warned of (shared by the copies a request's
        #: own MCP servers run on: each copy warned again, every run), a few at most.
        self._left_out_warned: dict[frozenset[str], None] = {}
        #: The models a client may pick with `forwardedProps.model` (None: any).
        not_one_string(allowed_models, "allowed_models")
        self.allowed_models = list(allowed_models) if allowed_models is not None else None
        if max_steps < 1:
            raise ConfigurationError("max_steps must be at least 1")
        self.adapter = adapter
        self.actions: dict[str, Action] = {}
        for item in actions:
            if item.name in self.actions:
                raise ConfigurationError(f"Two actions are named {item.name!r}")
            self.actions[item.name] = item
        self.instructions = instructions
        self.max_steps = max_steps
        #: When the model may change the application state (it reads it either way): None
        #: when the client shares a non-empty state, True always, False never.
        self.state_tools = state_tools

    def capabilities(self) -> dict[str, Any]:
        return {"tools": {"supported": True, "clientProvided": True},
                "transport": {"streaming": True}}

    async def aclose(self) -> None:
        await self.adapter.aclose()

    async def forget_thread(self, thread_id: str) -> None:
        # What the adapter keeps of the thread (reasoning for its tool loop) goes with it:
        # a later thread of its id, whoever's, must not be given it.
        forget = getattr(self.adapter, "forget_thread", None)
        if forget is not None:
            await forget(thread_id)

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input, context)

    async def _run(self, input: RunInput, context: RunContext) -> EventBatches:
        follow_up = context.follow_up_server_tools
        turn = self._turn(input, shares_state=follow_up)
        # Under authentication, who asks for the run owns its thread (the runtime lets
        # nobody else run on it).
        turn.thread_owner = None if context.principal is None else owner_of(context.principal)
        wanted = turn.settings.get("model")
        if wanted is not None and self.allowed_models is not None and (
                wanted not in self.allowed_models):
            raise ModelNotAllowedError(wanted, self.allowed_models)
        telemetry = context.telemetry
        # REASONING_* events only for clients that declare AG-UI 1.0 (older ones throw on
        # unknown event types; the GraphQL edge declares no version): others never see them.
        version = input.model.protocol_version or "0"
        show_reasoning = version.split(".", 1)[0] not in ("", "0")
        taken = _call_ids(turn.history)
        # The model each call asks for unless the client chose one (read once per run).
        configured = configured_model(self.adapter) if telemetry is not None else None
        for step in range(self.max_steps):
            # The streaming step: one model answer, its events as they arrive.
            answer = _Answer(str(uuid.uuid4()), taken, show_reasoning=show_reasoning)
            last_step = follow_up and step == self.max_steps - 1
            request = self._request(turn, first_step=step == 0, last_step=last_step)
            span = telemetry.model_call(self.adapter.provider, request.model or configured) \
                if telemetry is not None else None
            try:
                async for deltas in self.adapter.stream(request):
                    batch = answer.translate(deltas)
                    if answer.end is not None:
                        reason = answer.end.finish_reason
                        if reason not in _WHOLE and (cut := answer.cut_call()) is not None:
                            # Never a finished call with broken arguments (the client or
                            # an action would run it): whatever cut it, the run ends here.
                            if batch:
                                yield batch
                            raise _cut_call_error(reason, cut.name, self.adapter.provider)
                        if answer.calls and (broken := answer.broken_call(
                                turn.frontend)) is not None:
                            # An action tells the model its arguments are not JSON; the
                            # client's tool would throw on them, so the run ends here too.
                            if batch:
                                yield batch
                            raise _broken_call_error(broken.name, self.adapter.provider)
                        # The stream's last read: its closing events go in the same write,
                        # and so do the run's when no server-side action is left to run.
                        batch.extend(answer.close())
                        if batch and not any(c.name not in turn.frontend
                                             for c in answer.calls):
                            batch = LastBatch(batch)
                    if batch:
                        yield batch
            except BaseException as exc:
                # An answer that fails the run once its end came (a call cut at the token
                # limit or by a filter), or once the provider counted its tokens (an error
                # mid-stream), used its tokens all the same: they were billed.
                _record_end(answer.end or spent_before(exc), context.usage, span, exc)
                raise
            end = answer.end
            _record_end(end, context.usage, span)
            reason = end.finish_reason if end is not None else None
            if reason in _NOT_ENDED:  # (checked once per answer, never per piece)
                _check_ended(reason, answer, self.adapter.provider)
            tail = answer.close()
            if tail:
                yield tail
            # The tool step: run the server-side actions the answer called.
            server_calls = [c for c in answer.calls if c.name not in turn.frontend]
            if not server_calls:
                if reason in _CUT and answer.text:
                    # A finished answer, cut short: its RUN_FINISHED says why it ended.
                    model = input.model
                    yield [run_finished(model.thread_id, model.run_id,
                                        result={"finishReason": reason})]
                return  # a plain answer, or only frontend tools: the client runs them
            turn.history.append(answer.message())  # only a next step reads the history
            yield await self._run_tools(server_calls, turn, telemetry)
            if len(server_calls) < len(answer.calls) or not follow_up:
                return  # the client has tools to run, or sends the follow-up itself

    def _within_budget(self, tools: list[ToolSpec]) -> list[ToolSpec]:
        """`tools` without the expendable ones (MCP servers') past `max_tools`."""
        excess = len(tools) - (self.max_tools if self.max_tools is not None else len(tools))
        if excess <= 0:
            return tools
        expendable = [tool.name for tool in tools
                      if (action := self.actions.get(tool.name)) is not None
                      and action.expendable]
        left_out = expendable[-excess:] if expendable else []
        key = frozenset(left_out)
        if key not in self._left_out_warned:  # (once per set, not once per run)
            if len(self._left_out_warned) >= 32:
                self._left_out_warned.pop(next(iter(self._left_out_warned)))
            self._left_out_warned[key] = None
            _log.warning("MCP tools left out of runs: more tools than the agent's max_tools",
                         tools=len(tools), max_tools=self.max_tools, left_out=left_out)
        dropped = set(left_out)
        return [tool for tool in tools if tool.name not in dropped]

    def _turn(self, input: RunInput, *, shares_state: bool = True) -> _Turn:
        model = input.model
        tools = [ToolSpec(a.name, a.description, a.parameters) for a in self.actions.values()]
        # A name the client sends twice (a component mounted twice) is one tool, the last, as
        # the client's own registry keeps it: some APIs refuse a request that names one twice.
        frontend: dict[str, ToolSpec] = {}
        for tool in model.tools or ():
            if tool.name not in self.actions:
                frontend[tool.name] = ToolSpec(
                    tool.name, tool.description,
                    tool.parameters or {"type": "object", "properties": {}})
        tools.extend(frontend.values())
        shared = None
        if shares_state:
            # A name an action or a frontend tool already has stays theirs.
            wanted = self.state_tools if self.state_tools is not None else (
                isinstance(model.state, dict) and bool(model.state))
            offered = frozenset({SNAPSHOT_TOOL, DELTA_TOOL} - self.actions.keys()
                                - frontend.keys()) if wanted else frozenset()
            shared = SharedState(model.state, offered)
            tools.extend(shared.tools())
        tools = self._within_budget(tools)
        settings = model_settings(model.forwarded_props)
        _check_forced_tool(settings, tools)
        return _Turn(tools=tools, frontend=set(frontend),
                     history=list(model.messages),
                     system_prompt=self._system_prompt(model.context or ()),
                     settings=settings, shared=shared, thread_id=input.thread_id)

    @staticmethod
    def _request(turn: _Turn, *, first_step: bool, last_step: bool) -> ChatRequest:
        """The next step's request; the last step of a follow-up run forbids tools."""
        settings = turn.settings
        choice = settings.get("tool_choice")
        if last_step and turn.tools:
            choice = "none"
        elif not first_step and choice not in (None, "auto", "none"):
            # A forced tool is forced once: forcing it again after its result would have
            # an obedient model call it on every step until the step limit.
            choice = "auto"
        # The state as it is now: a step after a state tool call sees the change.
        state_part = turn.shared.prompt() if turn.shared is not None else None
        system_prompt = "\n\n".join(p for p in (turn.system_prompt, state_part) if p) or None
        return ChatRequest(
            messages=turn.history, tools=turn.tools, system_prompt=system_prompt,
            model=settings.get("model"), temperature=settings.get("temperature"),
            max_tokens=settings.get("max_tokens"), stop=settings.get("stop"),
            tool_choice=choice, thread_id=turn.thread_id, thread_owner=turn.thread_owner,
        )

    async def _run_tools(self, calls: list[_Call], turn: _Turn,
                         telemetry: Any = None) -> list[Event]:
        """Run `calls` concurrently; their results as events, and in the history.

        State tool calls change the state first, one after the other in the model's order;
        each one's STATE_SNAPSHOT or STATE_DELTA goes just before its result."""
        shared, history = turn.shared, turn.history
        changes = [_change_state(shared, c, telemetry)
                   if shared is not None and c.name in shared.offered else None for c in calls]
        results = iter(await asyncio.gather(*(
            self._execute(c, telemetry) for c, change in zip(calls, changes, strict=True)
            if change is None)))
        batch: list[Event] = []
        for call, change in zip(calls, changes, strict=True):
            if change is None:
                content, error = next(results)
            else:
                content, error = change.content, change.error
                if change.event is not None:
                    batch.append(change.event)
            result_id = str(uuid.uuid4())
            batch.append(tool_call_result(result_id, call.id, content, error=error))
            history.append(ToolMessage(id=result_id, tool_call_id=call.id, content=content,
                                       error=error))
        return batch

    async def _execute(self, call: _Call, telemetry: Any = None) -> tuple[str, str | None]:
        """The tool's result, and why it failed (None when it did not)."""
        action = self.actions.get(call.name)
        if action is None:
            message = f"there is no tool named {call.name!r}"
            return failed_tool_content(message), message
        if telemetry is not None:
            with telemetry.tool_call(call.name) as span:
                span.set_attribute("gen_ai.tool.call.id", call.id)
                content, error = await self._execute_action(action, call)
                if error is not None:
                    telemetry.tool_failed(span)
                return content, error
        return await self._execute_action(action, call)

    @staticmethod
    async def _execute_action(action: Action, call: _Call) -> tuple[str, str | None]:
        try:
            return await action.execute("".join(call.arguments)), None
        except ActionError as exc:
            return failed_tool_content(exc.message), exc.message

    def _system_prompt(self, context: Sequence[Any]) -> str | None:
        parts = [self.instructions] if self.instructions else []
        if context:
            lines = [f"- {c.description}: {c.value}" for c in context]
            parts.append("The application shared this context with you:\n" + "\n".join(lines))
        return "\n\n".join(parts) or None


#: Finish reasons of answers the model ended itself, as the adapters word them (None: an
#: adapter that tells none); any other end may have cut a call's arguments.
_WHOLE = frozenset({None, "stop", "tool_calls", "function_call"})
#: Finish reasons of answers that may not be usable as they are (see `_check_ended`).
_NOT_ENDED = frozenset({"length", "content_filter", "pause_turn"})
#: Those of answers cut short whose text stays a finished answer.
_CUT = frozenset({"length", "content_filter"})


def _cut_call_error(reason: str | None, name: str, provider: str) -> Exception:
    """The run's error when the answer ended with `reason` in the middle of a call's
    arguments (a call said finished would have the client or an action run it)."""
    if reason == "length":
        return OutputTruncatedError(
            f"The model's call of {name!r} was cut off at its output token limit "
            "(maxTokens): its arguments are incomplete")
    if reason == "content_filter":
        return ContentFilteredError(
            f"The model's call of {name!r} was cut off by the {provider} content filter: "
            "its arguments are incomplete")
    return UpstreamError(
        f"The {provider} model's answer ended ({reason}) in the middle of its call of "
        f"{name!r}: its arguments are incomplete")


def _broken_call_error(name: str, provider: str) -> UpstreamError:
    """The run's error when the answer ended as it should, but a frontend tool's call has
    arguments that are not JSON."""
    return UpstreamError(
        f"The {provider} model called {name!r} with arguments that are not JSON: the "
        "client's tool cannot take them")


def _check_ended(reason: str | None, answer: _Answer, provider: str) -> None:
    """The run's error when the answer that ended with `reason` is not one: the content
    filter or the token limit left nothing, or the turn was paused."""
    if reason == "pause_turn":
        # Continuing needs the answer's server-tool blocks, which the adapters do not keep.
        raise UpstreamError(
            f"The {provider} model paused its turn (a long-running server tool) before it "
            "finished its answer; continuing a paused turn is not supported")
    if answer.text or answer.calls:
        return
    if reason == "content_filter":
        raise ContentFilteredError(
            f"The model gave no answer: the {provider} content filter withheld it")
    raise OutputTruncatedError(
        "The model gave no answer: it reached its output token limit (maxTokens) before "
        "it said anything (its reasoning may have used every token)")


def _change_state(shared: SharedState, call: _Call, telemetry: Any) -> StateChange:
    """A state tool call carried out, under a tool span as an action's call is."""
    if telemetry is None:
        return shared.apply(call.name, "".join(call.arguments))
    with telemetry.tool_call(call.name) as span:
        span.set_attribute("gen_ai.tool.call.id", call.id)
        change = shared.apply(call.name, "".join(call.arguments))
        if change.error is not None:
            telemetry.tool_failed(span)
        return change


def _call_ids(history: Sequence[Message]) -> set[str]:
    """The tool call ids `history` holds, its calls' and its results'."""
    ids: set[str] = set()
    for message in history:
        if isinstance(message, AssistantMessage):
            ids.update(call.id for call in message.tool_calls or ())
        elif isinstance(message, ToolMessage):
            ids.add(message.tool_call_id)
    return ids


def _record_end(end: StreamEnd | None, total: dict[str, int], span: Any,
                error: BaseException | None = None) -> None:
    """What the answer's end said (finish reason, usage) in the run's usage and on its
    model call's span (None: no telemetry), whether the run goes on or fails."""
    if end is not None and end.usage:
        _add_usage(total, end.usage)
    if span is not None:
        span.end(end.finish_reason if end else None, end.usage if end else None, error)


def _add_usage(total: dict[str, int], usage: dict[str, Any]) -> None:
    """Sum an OpenAI-style usage object into the run's `input_tokens`/`output_tokens`."""
    for source, name in (("prompt_tokens", "input_tokens"), ("completion_tokens",
                                                             "output_tokens"),
                         ("input_tokens", "input_tokens"), ("output_tokens", "output_tokens")):
        value = usage.get(source)
        if isinstance(value, int) and not isinstance(value, bool):
            total[name] = total.get(name, 0) + value


_SETTING_KEYS = {
    "model": "model", "temperature": "temperature", "maxTokens": "max_tokens",
    "max_tokens": "max_tokens", "stop": "stop", "toolChoice": "tool_choice",
    "tool_choice": "tool_choice",
}


def model_settings(forwarded_props: Any) -> dict[str, Any]:
    """Model parameters a client may pass in `forwardedProps`, checked for type."""
    if not isinstance(forwarded_props, dict):
        return {}
    source = dict(forwarded_props)
    nested = source.get("forwardedParameters")
    if isinstance(nested, dict):
        source.update(nested)
    settings: dict[str, Any] = {}
    for key, name in _SETTING_KEYS.items():
        if key not in source or source[key] is None:
            continue
        value = source[key]
        if name == "model" and not isinstance(value, str):
            raise InvalidRequestError("forwardedProps.model must be a string")
        if name == "temperature" and (isinstance(value, bool)
                                      or not isinstance(value, int | float)):
            raise InvalidRequestError("forwardedProps.temperature must be a number")
        if name == "max_tokens" and (isinstance(value, bool) or not isinstance(value, int)
                                     or value < 1):
            raise InvalidRequestError("forwardedProps.maxTokens must be a positive integer")
        if name == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise InvalidRequestError("forwardedProps.stop must be a string or strings")
        if name == "tool_choice":
            value = _tool_choice(value)
        settings[name] = value
    return settings


#: The `toolChoice` words that name no tool (the rest name the one tool the model must call).
TOOL_CHOICE_WORDS = frozenset({"auto", "none", "required"})
_TOOL_CHOICE_FORMS = ('forwardedProps.toolChoice must be "auto", "none", "required" (or "any"), '
                      'a tool\'s name, or {"type": "function", "function": '
                      '{"name": <a tool\'s name>}}')


def _tool_choice(value: Any) -> str:
    """`toolChoice` as the adapters take it: a word or the forced tool's name. The OpenAI
    object form (what `@copilotkit/core` 1.75 sends to force its suggestion tool) means
    the same as the name alone."""
    if isinstance(value, str):
        # LangChain's word for "some tool" (what `bind_tools` takes): the adapters know it
        # as "required", and would send "any" as a tool's name.
        return "required" if value == "any" else value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) <= {
            "type", "function"}:
        function = value.get("function")
        if isinstance(function, dict) and set(function) == {"name"} \
                and isinstance(function["name"], str) and function["name"]:
            return function["name"]
    raise InvalidRequestError(_TOOL_CHOICE_FORMS)


def _check_forced_tool(settings: dict[str, Any], tools: Sequence[ToolSpec]) -> None:
    """Refuse a forced tool the run does not offer: the adapters would drop it silently (a
    run without tools) or the provider would refuse the request with a less clear error."""
    choice = settings.get("tool_choice")
    if choice is None or choice in TOOL_CHOICE_WORDS:
        return
    if not any(tool.name == choice for tool in tools):
        raise InvalidRequestError(
            f"forwardedProps.toolChoice names {choice!r}, which is not one of this run's tools")
