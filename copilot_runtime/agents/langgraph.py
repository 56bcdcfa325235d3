"""`LangGraphAgent`: a compiled LangGraph graph running in this process.

Built on `ag-ui-langgraph` (see `_lg_bridge` for what it does and what is added to it):
every run clones the translator, so concurrent runs share nothing but the graph and its
checkpointer. The graph must have a checkpointer, because the translator reads the thread's
checkpoint to merge the client's messages and to find interrupts; the thread id is the
AG-UI `threadId`. With a `copilot_runtime.checkpointers` checkpointer (SQLite or
PostgreSQL), threads and pending interrupts survive a restart.

Frontend tools reach the graph as `state["copilotkit"]["actions"]` (and `state["tools"]`),
the context as `state["copilotkit"]["context"]`: the `CopilotKitState` convention of the
`copilotkit` SDK. The client's `state` is the graph's input state (filtered to the keys of
its input schema), and so are the `forwardedProps` entries named like one of those keys
(as ag-ui-langgraph merges them: `forwarded_input` names them, for guardrails to judge);
state changes come back as `STATE_SNAPSHOT`, then `STATE_DELTA`. The client's run config
(`forwardedProps.config`) sets only what `_lg_config` lets a client set.
Raw LangChain events stay off the wire unless `emit_raw_events=True`.

Interrupts (`langgraph.types.interrupt(value)`) end the run. How the client hears of them
depends on what it understands (`interrupts="auto"`): a client that declares an AG-UI
`protocolVersion` (`@ag-ui/client` 1.0) gets `RUN_FINISHED` with the interrupt outcome and
resumes with `RunAgentInput.resume`; older clients (`@ag-ui/client` 0.0.x, which send no
version) get the `on_interrupt` custom event CopilotKit's `useInterrupt` listens for, and
resume with `forwardedProps.command.resume`. 0.0.59 would parse the outcome too, but then
refuses a next run that does not answer it through `resume`, which the custom-event UIs
never send: so they are not given it. Each interrupt is recorded as a pending approval
(see `copilot_runtime.approvals.ledger`) before the client hears of it.

Several interrupts can wait at once (parallel nodes, `Send` workers). `resume` entries name
theirs by id. The legacy answer (and GraphQL's `metaEvents`) names none: it answers the
interrupt whose question it quotes (`forwardedProps.command.interruptEvent`, the meta
event's `value`), the first of them in the checkpoint's order when several asked the same;
one that quotes no waiting question is refused (`INTERRUPT_NOT_PENDING`), one that quotes
none at all too (`INVALID_REQUEST`). The interrupts left unanswered are announced again
when the run ends. A new user message that answers none of them is refused
(`APPROVAL_ERROR`): the graph could not take it, and the base would drop it.

The graph's recursion limit and its checkpointer's database errors end a run with precise
codes (`AGENT_EXECUTION_ERROR`, `SERVICE_UNAVAILABLE`); anything else it raises is the
runtime's generic `AGENT_ERROR`, its text in the log only.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, Literal

import openai
import orjson
import pydantic
import structlog
from ag_ui.core import ResumeEntry
from ag_ui_langgraph import LangGraphAgent as _BaseBridge  # type: ignore[import-untyped]
from ag_ui_langgraph.utils import camel_to_snake  # type: ignore[import-untyped]
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import ToolNode

from copilot_runtime import events as ev
from copilot_runtime._exceptions import (
    AgentExecutionError,
    ApprovalError,
    ConfigurationError,
    InvalidRequestError,
    NothingToResumeError,
    ServiceUnavailableError,
    UpstreamError,
    UpstreamTimeoutError,
)
from copilot_runtime._input import RunInput
from copilot_runtime._limits import MAX_JSON_DEPTH, check_json_text, too_deep
from copilot_runtime.agents._lg_bridge import CopilotKitLangGraphBridge
from copilot_runtime.agents._lg_config import (
    check_client_context,
    client_run_config,
    context_key_names,
    graph_config_keys,
    recursion_bound,
)
from copilot_runtime.agents._lg_events import (
    InterruptChannel,
    WireEncoder,
    channel_for,
    filter_interrupt_event,
)
from copilot_runtime.agents._lg_shown import is_shown
from copilot_runtime.agents._lg_state import (
    load_graph_state,
    schema_keys,
    thread_state_from_values,
)
from copilot_runtime.agents._lg_values import json_shown
from copilot_runtime.agents.base import Agent, AgentThreadState, RunContext
from copilot_runtime.approvals.ledger import ApprovalStore, MemoryApprovalStore
from copilot_runtime.approvals.resume import Claims, claim_resume, record_interrupts
from copilot_runtime.checkpointers import DurableCheckpointer
from copilot_runtime.events import Event, EventBatches

#: How often, and how far apart, a run's interrupts are offered to a ledger that cannot be
#: reached before the run fails (they are recorded later: `record_waiting`).
_LEDGER_TRIES = 5
_LEDGER_RETRY_SECONDS = 0.5


def _as_interrupt(interrupt_id: str, value: Any) -> dict[str, Any]:
    """A checkpoint's interrupt as an AG-UI interrupt outcome carries it (`record_interrupts`
    reads it so): its value, and the deadline the value names."""
    interrupt: dict[str, Any] = {"id": interrupt_id, "metadata": {"langgraph": {"raw": value}}}
    if isinstance(value, dict) and value.get("expiresAt") is not None:
        interrupt["expiresAt"] = value["expiresAt"]
    return interrupt


try:  # the `postgres` extra
    from psycopg import Error as _PostgresError
    _STORAGE_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, _PostgresError)
except ImportError:  # pragma: no cover - installed without it
    _STORAGE_ERRORS = (sqlite3.Error,)
#: The modules a checkpointer's (or the approval ledger's) code lives in: a database error
#: raised through one of them is the store's, not one of the graph's own queries.
_CHECKPOINT_MODULES = ("langgraph.checkpoint.", "copilot_runtime.checkpointers",
                       "copilot_runtime.approvals")

_STORE_UNAVAILABLE = "The checkpoint store cannot be used right now; try again later"
#: The inbound body limit `create_app` sets by default (`max_body_size`): a state the
#: client would send back larger than this is refused with 413 (see `state_warning_bytes`).
_DEFAULT_BODY_LIMIT = 8 * 1024 * 1024
#: How many threads `LangGraphAgent` remembers having warned of an oversized state for.
#: (Its states are held to the built-in agent's depth bound: the request body a client sends
#: a state back in is one level more.)
_STATE_DEPTH = MAX_JSON_DEPTH - 1
_WARNED_THREADS = 10_000
#: The `configurable` key LangGraph reads a run's checkpoint durability from.
DURABILITY_KEY = "__pregel_durability"
# The `copilotkit_interrupt` question inside its interrupt's value (what GraphQL shows).
_COPILOTKIT_QUESTION = "__copilotkit_interrupt_value__"

__all__ = ["LangGraphAgent"]

_log = structlog.get_logger("copilot_runtime.agents")


class LangGraphAgent(Agent):
    """A LangGraph graph compiled with a checkpointer.

    `name` is the agent's name inside the graph's events; `config` is the base
    `RunnableConfig` of every run. `interrupts` chooses how interrupts reach clients:
    `"auto"` (see the module docstring), `"outcome"`, `"legacy"` or `"both"`.
    `approvals` is the approval ledger; by default the checkpointer's own
    (`DurableCheckpointer.approvals`), else one in memory. `state_deltas=False` sends every
    state change as a snapshot. `durability` is LangGraph's checkpoint durability for every
    run: "sync" by default (each step stored before the next runs: an approved action done
    just before a crash is not done again), "async" (LangGraph's own default) or "exit"; a
    `config` that sets it wins. `state_warning_bytes` (the default body limit, 8 MiB):
    a run whose last state, as JSON, is larger logs a warning, once per thread, since the
    client sending it back as its next run's `state` would be refused (413); None turns
    it off. Set it to the app's `max_body_size` when that is not the default. A state
    nested deeper than a client can send back (63 levels) is warned of too, once per thread.
    """

    class_name = "LangGraphAgent"
    keeps_threads_here = True

    def __init__(
        self,
        *,
        name: str,
        graph: Any,
        description: str = "",
        config: Mapping[str, Any] | None = None,
        emit_raw_events: bool = False,
        interrupts: Literal["auto", "outcome", "legacy", "both"] = "auto",
        approvals: ApprovalStore | None = None,
        state_deltas: bool = True,
        durability: Literal["sync", "async", "exit"] = "sync",
        state_warning_bytes: int | None = _DEFAULT_BODY_LIMIT,
    ) -> None:
        super().__init__(description=description)
        checkpointer = getattr(graph, "checkpointer", None)
        if checkpointer is None:
            raise ConfigurationError(
                f"LangGraphAgent {name!r} needs a graph compiled with a checkpointer, "
                "e.g. graph.compile(checkpointer=copilot_runtime.checkpointers.checkpointer())")
        self.name = name
        self.graph = graph
        self.state_deltas = state_deltas
        self.interrupts = interrupts
        self.state_warning_bytes = state_warning_bytes
        # (thread, "size" or "depth") warned of, oldest first
        self._warned: dict[tuple[str, str], None] = {}
        self._input_keys: frozenset[str] | None = None
        # The `configurable` keys a client may set (`_lg_config`), read on first use.
        self._config_keys: frozenset[str] | None = None
        # ... and, per key, all the keys of its context field (its pydantic aliases).
        self._config_names: dict[str, frozenset[str]] = {}
        # "sync": each step's checkpoint is stored before the next step runs. With LangGraph's
        # default ("async") the node after an interrupt ran, its effects done, while the
        # checkpoint saying the interrupt was answered was still being written: a crash then
        # left the interrupt pending, and recovery sent the answer (and applied it) again.
        # LangGraph reads the mode from this configurable key when none is passed to a run
        # (it is how subgraphs inherit it); tests/test_lg_bridge_contract.py pins the name.
        base = dict(config) if config else {}
        base["configurable"] = {DURABILITY_KEY: durability, **(base.get("configurable") or {})}
        self.config = base
        self._approvals: ApprovalStore = approvals or getattr(
            checkpointer, "approvals", None) or MemoryApprovalStore()
        # Both interrupt forms are produced; `filter_interrupt_event` keeps the client's.
        self._template = CopilotKitLangGraphBridge(
            name=name, graph=graph, description=description or None,
            config=dict(base), emit_raw_events=emit_raw_events,
            emit_interrupt_outcome=True, enable_legacy_on_interrupt_event=True)

    @property
    def approvals(self) -> ApprovalStore:
        return self._approvals

    @property
    def checkpointer(self) -> Any:
        """The graph's checkpointer (the runtime's readiness probe pings it, when it can)."""
        return self.graph.checkpointer

    def capabilities(self) -> dict[str, Any]:
        capabilities: dict[str, Any] = self._template.get_capabilities()
        capabilities["state"] = {**capabilities.get("state", {}), "deltas": self.state_deltas}
        capabilities["tools"] = {"supported": True, "clientProvided": True}
        return capabilities

    def forwarded_input(self, forwarded_props: Mapping[str, Any]) -> Collection[str]:
        """The `forwardedProps` entries named like a key of the graph's input state (in
        snake_case, as ag-ui-langgraph and CopilotKit's own runtimes spell them): those
        merge into the graph's input, under the client's `state`."""
        if self._input_keys is None:
            self._input_keys = frozenset(
                self._template.get_schema_keys(self.config)["input"])
        keys = self._input_keys
        return [key for key in forwarded_props if camel_to_snake(key) in keys]

    async def pending_interrupts(self, thread_id: str) -> dict[str, Any]:
        """The interrupts the thread's graph waits on, by id, with their values."""
        return (await self._waits(thread_id))[0]

    async def pending_interrupt_ids(self, thread_id: str) -> set[str]:
        return set(await self.pending_interrupts(thread_id))

    async def parked(self, thread_id: str) -> bool:
        """Whether the thread's graph stopped between steps: steps left to run and none of
        them waiting on an interrupt (the run driving it was cut short)."""
        return (await self._waits(thread_id))[1]

    async def _waits(self, thread_id: str) -> tuple[dict[str, Any], bool]:
        """The interrupts the graph waits on (by id, with their values), and whether it is
        parked (see `parked`)."""
        with self._reading():
            state = await self.graph.aget_state(self._graph_config(thread_id))
        interrupts = _BaseBridge._collect_interrupts(state.tasks or ())
        return ({i.id: i.value for i in interrupts if getattr(i, "id", None)},
                bool(state.next) and not interrupts)

    async def record_waiting(self, thread_id: str, agent_id: str) -> None:
        """Write to the ledger the interrupts the thread's graph waits on (those it holds
        already stay as they are). A run whose worker died, or whose ledger write failed,
        after its checkpoint was written left them out of the ledger: never listed, their
        deadline never reached. Asked when the thread's approvals are listed and when a
        message is refused because the graph waits."""
        try:
            waiting, _ = await self._waits(thread_id)
        except AgentExecutionError:  # its state unreadable: what it waits on is unknown
            _log.warning("a LangGraph thread's saved state does not fit its state schema: "
                         "the interrupts it waits on are not known", thread_id=thread_id,
                         agent=self.name)
            return
        if waiting:
            await self._approvals.add(record_interrupts(
                [_as_interrupt(interrupt_id, value) for interrupt_id, value in waiting.items()],
                thread_id=thread_id, agent_id=agent_id, channel="outcome"))

    async def load_state(self, thread_id: str, *,
                         headers: Mapping[str, str] | None = None) -> AgentThreadState:
        """The thread as the graph's checkpointer has it (GraphQL `loadAgentState`); as it
        was saved when the graph's state schema refuses it (runs fail, saying so)."""
        try:
            with self._reading():
                return await load_graph_state(self.graph, thread_id, self.config)
        except AgentExecutionError:
            with self._reading():
                saved = await self.graph.checkpointer.aget_tuple(self._graph_config(thread_id))
            values = dict(saved.checkpoint.get("channel_values") or {}) if saved else {}
            # (the raw channels hold every key: the output schema's cut applies as ever)
            return thread_state_from_values(thread_id, {
                key: value for key, value in values.items() if isinstance(key, str)
                and not key.startswith(("__", "branch:"))},
                schema_keys(self.graph, self.config)["output"])

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Reading a thread's checkpoint outside a run: its store failing is
        `ServiceUnavailableError`, as in runs; a saved state the graph's pydantic state
        schema refuses is `AgentExecutionError`, saying which keys."""
        try:
            yield
        except _STORAGE_ERRORS as exc:
            if not _raised_by_checkpointer(exc):
                raise
            _log.warning("the checkpoint store failed reading a LangGraph thread",
                         agent=self.name, error=repr(exc))
            raise ServiceUnavailableError(_STORE_UNAVAILABLE) from None
        except pydantic.ValidationError as exc:
            refusal = _schema_refusal(exc, self.name)
            if refusal is None:
                raise
            raise AgentExecutionError(self.name, refusal) from None

    async def forget_thread(self, thread_id: str) -> None:
        """Delete the thread's approvals and its checkpoints: each is tried even when the
        other fails (the first failure is raised after both; `NotImplementedError` from a
        checkpointer that cannot delete threads)."""
        failures: list[Exception] = []
        # A ledger of another make may not know how (`ApprovalStore` does not require it).
        forget = getattr(self._approvals, "forget_thread", None)
        if forget is not None:
            try:
                await forget(thread_id)
            except Exception as exc:
                failures.append(exc)
        saver = getattr(self.graph, "checkpointer", None)
        if saver is not None and hasattr(saver, "adelete_thread"):
            try:
                await saver.adelete_thread(thread_id)
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    def _graph_config(self, thread_id: str) -> dict[str, Any]:
        configurable = {**(self.config.get("configurable") or {}), "thread_id": thread_id}
        return {**self.config, "configurable": configurable}

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._failing_precisely(self._run(input, context), context.agent_id)

    async def _failing_precisely(self, batches: EventBatches, agent_id: str) -> EventBatches:
        """`batches`, with the graph's failures the client can act on told precisely: the
        recursion limit, and the checkpoint store failing (as the store's outage is when
        it cannot be opened). Anything else stays the runtime's generic `AGENT_ERROR`."""
        try:
            async for batch in batches:
                yield batch
        except GraphRecursionError as exc:
            found = re.search(r"limit of (\d+)", str(exc))
            steps = f" ({found.group(1)} steps)" if found else ""
            raise AgentExecutionError(agent_id, (
                f"Agent '{agent_id}' reached its recursion limit{steps} without finishing: "
                "its graph may loop, or needs a higher recursion_limit in its config")
                ) from None
        except _STORAGE_ERRORS as exc:
            if not _raised_by_checkpointer(exc):
                raise
            refusal = _data_refusal(exc)
            if refusal is not None:
                # The run's own data, not an outage: trying again would fail the same way.
                _log.warning("the checkpoint store refused a LangGraph run's data",
                             agent=agent_id, sqlstate=getattr(exc, "sqlstate", None))
                raise InvalidRequestError(refusal) from None
            _log.warning("the checkpoint store failed during a LangGraph run",
                         agent=agent_id, error=repr(exc))
            raise ServiceUnavailableError(_STORE_UNAVAILABLE) from None
        except pydantic.ValidationError as exc:
            refusal = _schema_refusal(exc, agent_id)
            if refusal is None:
                raise
            raise AgentExecutionError(agent_id, refusal) from None
        finally:
            aclose = getattr(batches, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _run(self, input: RunInput, context: RunContext) -> EventBatches:
        if not isinstance(input.model.state, dict | None):
            # The graph's input state: ag-ui-langgraph assigns keys into it.
            raise InvalidRequestError("A LangGraph agent's state must be a JSON object")
        run_config = self._run_config(input)
        channel = channel_for(self.interrupts, input.model.protocol_version)
        ledger_channel: Literal["outcome", "legacy"] = \
            "legacy" if channel == "legacy" else "outcome"
        thread_id = input.thread_id
        claims = Claims(input)
        if not (input.model.resume or _has_legacy_resume(input)):
            await self._refuse_if_another_agent_waits(thread_id, context.agent_id)
            input = await self._carrying_on(input)
        if input.model.resume or _has_legacy_resume(input):
            pending, parked = await self._waits(thread_id)
            if len(pending) > 1 and not input.model.resume:
                input = _legacy_answer_by_question(input, pending)
            elif pending and not input.model.resume:
                _check_quoted_question(input, pending)
            claims = await claim_resume(self._approvals, agent_id=context.agent_id,
                                        input=input, pending=set(pending),
                                        channel=ledger_channel, values=pending, parked=parked,
                                        principal_id=context.principal.id
                                        if context.principal is not None else None)
        settled = not claims.ids
        cut_short = False
        encoder = WireEncoder(state_deltas=self.state_deltas)
        bridge = self._template.clone()
        bridge.config = run_config
        try:
            async for batch in translate_bridge_run(bridge, claims.input, encoder):
                out = await self._interrupts_of(batch, channel, ledger_channel, thread_id,
                                                context.agent_id)
                if not settled and any(e["type"] in ev.TERMINAL_TYPES for e in out):
                    # The graph is done: settle before the client hears the run ended.
                    settled = True
                    await self._settle(claims, thread_id)
                if any(e["type"] == ev.RUN_FINISHED for e in out):
                    # (before the end is yielded: the runtime stops reading there)
                    self._check_state(encoder, thread_id)
                if out:
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            # A stop is the caller's choice: what the graph took is applied. A client that
            # left, a lost lease or a shutdown is not: the graph is carried on later.
            cut_short = context.cut_reason != "stop"
            raise
        except ApprovalError:
            # Refused because the graph waits: what it waits on is in the ledger from now
            # (listed, timed out), however its interrupting run ended.
            with contextlib.suppress(Exception):
                await self.record_waiting(thread_id, context.agent_id)
            raise
        finally:
            if not settled:  # stopped, failed or cancelled before its end
                await self._settle(claims, thread_id, cut_short=cut_short)

    def _run_config(self, input: RunInput) -> dict[str, Any]:
        """The run's config: the agent's, with what the client's `forwardedProps.config`
        (1.10's `agentStates[].config`) may set (see `_lg_config`)."""
        props = input.model.forwarded_props
        sent = props.get("config") if isinstance(props, dict) else None
        if sent is None:
            return dict(self.config)
        schema = getattr(self.graph, "context_schema", None)
        if self._config_keys is None:
            self._config_keys = graph_config_keys(self.graph)
            self._config_names = context_key_names(schema)
        config = client_run_config(self.config, sent, self._config_keys,
                                   recursion_bound(self.config), names=self._config_names)
        configurable = config.get("configurable") or {}
        # (the operator's keys are never replaced: what is new is the client's)
        checked = check_client_context(
            schema, configurable, configurable.keys() - (self.config.get("configurable") or {}))
        if checked:
            config["configurable"] = {**configurable, **checked}
        return config

    def _check_state(self, encoder: WireEncoder, thread_id: str) -> None:
        """Warn, once per thread, of a state the client could not send back."""
        if encoder.state is None:
            return
        if too_deep(encoder.state, _STATE_DEPTH) and self._first_warning(thread_id, "depth"):
            _log.warning("a LangGraph thread's state is nested deeper than a client can send "
                         "back: a client that sends it back (useCoAgent, @ag-ui/client) is "
                         "refused ('nested too deep') on its next run; keep deep data out of "
                         "the graph's output state (its output_schema)", thread_id=thread_id,
                         agent=self.name, limit=_STATE_DEPTH)
        limit = self.state_warning_bytes
        if limit is None:
            return
        size = len(orjson.dumps(encoder.state, option=orjson.OPT_NON_STR_KEYS))
        if size > limit and self._first_warning(thread_id, "size"):
            _log.warning("a LangGraph thread's state is larger than the inbound body limit: "
                         "a client that sends it back (useCoAgent, @ag-ui/client) gets 413 on "
                         "its next run; keep large data out of the graph's output state (its "
                         "output_schema) or raise max_body_size", thread_id=thread_id,
                         agent=self.name, state_bytes=size, limit=limit)

    def _first_warning(self, thread_id: str, about: str) -> bool:
        """Whether `thread_id` is yet to be warned `about` this (and note that it is now)."""
        if (thread_id, about) in self._warned:
            return False
        self._warned[(thread_id, about)] = None
        if len(self._warned) > _WARNED_THREADS:
            del self._warned[next(iter(self._warned))]
        return True

    async def _refuse_if_another_agent_waits(self, thread_id: str, agent_id: str) -> None:
        """Refuse a run on a thread whose checkpoint another agent's graph waits on.

        Agents that share a checkpointer (and so its ledger) share its threads: this graph
        cannot read the other's interrupt (its nodes are not this graph's), so it would start
        over on the other's checkpoint and the approval would be withdrawn. The ledger says
        whose approval waits (one read by thread); the checkpoint's own pending interrupts
        say whether it still does (one the ledger kept by mistake blocks nothing)."""
        others = [a for a in await self._approvals.find(thread_id=thread_id)
                  if a.agent_id != agent_id]
        if not others:
            return
        stored = await self._stored_interrupt_ids(thread_id)
        waiting = sorted({a.agent_id for a in others if stored is None or a.id in stored})
        if waiting:
            raise ApprovalError(
                f"Thread '{thread_id}' waits for an answer to an approval of agent "
                f"'{waiting[0]}': answer it first (agent '{agent_id}' was not run on the "
                "thread, whose checkpoints the two agents share)")

    async def _stored_interrupt_ids(self, thread_id: str) -> set[str] | None:
        """The ids of the interrupts the thread's latest checkpoint holds, whichever graph
        wrote it (a subgraph's are there too); None if the checkpointer cannot say."""
        saver = getattr(self.graph, "checkpointer", None)
        if not isinstance(saver, BaseCheckpointSaver):
            return None
        found = await saver.aget_tuple(self._graph_config(thread_id))  # type: ignore[arg-type]
        ids: set[str] = set()
        for _, channel, value in (found.pending_writes or ()) if found is not None else ():
            if channel == "__interrupt__":  # (LangGraph's INTERRUPT, private since 1.0)
                for interrupt in value if isinstance(value, list | tuple) else (value,):
                    if isinstance(getattr(interrupt, "id", None), str):
                        ids.add(interrupt.id)
        return ids

    async def _carrying_on(self, input: RunInput) -> RunInput:
        """`input`, or, when the thread's graph took an approval's answer and its run died
        between two steps (recovery has not carried it on yet), a resume with the stored
        answers: new input would start the graph over and drop the approved step (LangGraph
        discards the steps left). The new messages are not lost: the client sends them
        again with its next run, and the bridge adds what the graph has not seen."""
        taken = [a for a in await self._approvals.unapplied() if a.thread_id == input.thread_id]
        if not taken or not (await self._waits(input.thread_id))[1]:
            return input
        _log.info("carrying on a graph an approval's run left mid-way, before new input",
                  thread_id=input.thread_id)
        return input.replace(resume=[ResumeEntry(interrupt_id=a.id, status="resolved",
                                                 payload=a.answer) for a in taken])

    async def _interrupts_of(self, batch: Sequence[Event],
                             channel: InterruptChannel,
                             ledger_channel: Literal["outcome", "legacy"], thread_id: str,
                             agent_id: str) -> list[Event]:
        """The batch as the client should see it; a run's interrupts go to the ledger first."""
        out: list[Event] = []
        for event in batch:
            if event["type"] == ev.RUN_FINISHED:
                outcome = event.get("outcome")
                if isinstance(outcome, dict) and outcome.get("type") == "interrupt":
                    interrupts = outcome.get("interrupts") or ()
                    approvals = record_interrupts(interrupts, thread_id=thread_id,
                                                  agent_id=agent_id, channel=ledger_channel)
                    # The checkpoint waits on them already: a ledger away for a moment (a
                    # failover) is waited for, a little, before the run fails.
                    for attempt in range(_LEDGER_TRIES):
                        try:
                            await self._approvals.add(approvals)
                            break
                        except ServiceUnavailableError:
                            if attempt == _LEDGER_TRIES - 1:
                                raise
                            await asyncio.sleep(_LEDGER_RETRY_SECONDS)
                    await self._warn_of_shared_tasks(thread_id)
            kept = filter_interrupt_event(event, channel)
            if kept is not None:
                out.append(kept)
        return out

    async def _warn_of_shared_tasks(self, thread_id: str) -> None:
        """Log when a task waiting on an interrupt runs several tool calls at once (a
        `ToolNode` given a model answer with several calls), or waits on several
        interrupts. LangGraph hands a task's answers to its `interrupt()` calls in the
        order they are called: tools running concurrently race for them, so when more
        than one of them asks, an answer can reach the wrong tool (it mostly does under
        streaming). The runtime cannot tell which answer was meant; the graph can avoid
        it (one task per call, or no parallel tool calls)."""
        try:
            state = await self.graph.aget_state(self._graph_config(thread_id))
        except Exception:  # a warning is not worth failing the run for
            return
        calls = _unanswered_tool_calls((state.values or {}).get("messages") or ())
        for task in state.tasks or ():
            if not task.interrupts:
                continue
            node = (getattr(self.graph, "nodes", None) or {}).get(task.name)
            sharing = calls if isinstance(getattr(node, "bound", None), ToolNode) else 0
            if len(task.interrupts) > 1 or sharing > 1:
                _log.warning(
                    "an interrupt waits in a LangGraph task that runs several tool calls "
                    "at once: if more than one of them calls interrupt(), LangGraph may "
                    "hand an answer to the wrong one; give each interrupting call its own "
                    "task (Send) or disable parallel tool calls", thread_id=thread_id,
                    task=task.name, tool_calls=sharing, interrupts=len(task.interrupts))

    async def _settle(self, claims: Claims, thread_id: str, *, cut_short: bool = False
                      ) -> None:
        try:
            pending, parked = await self._waits(thread_id)
            await claims.settle(self._approvals, set(pending), unfinished=cut_short and parked)
        except Exception:
            # The ledger stays "answered, not applied": the next start sends the answer
            # again if the graph still waits, which is what a crash here would need too.
            _log.exception("could not settle approvals", thread_id=thread_id)

    async def aclose(self) -> None:
        saver = self.graph.checkpointer
        # Only one of `copilot_runtime.checkpointers` (opened again on its next use): another
        # is the application's, to close itself (a graph compiled once serves each runtime).
        if isinstance(saver, DurableCheckpointer):
            await saver.aclose()


#: SQLSTATEs of text PostgreSQL cannot hold in the database's encoding (U+0000 above all).
_UNKEEPABLE_CHARACTER_STATES = frozenset({"22P05", "22021"})


def _data_refusal(exc: BaseException) -> str | None:
    """What to tell the client when the store refused the run's data (SQLSTATE class 22,
    data exception), else None. The store's own text is not echoed: it quotes the data."""
    sqlstate = getattr(exc, "sqlstate", None)
    if not isinstance(sqlstate, str) or not sqlstate.startswith("22"):
        return None
    if sqlstate in _UNKEEPABLE_CHARACTER_STATES:
        return ("The checkpoint store cannot keep this run's data: its text holds a "
                "character the store cannot keep (U+0000, NUL); send it without")
    return ("The checkpoint store cannot keep this run's data: it holds a value the store "
            "refuses")


def _schema_refusal(exc: pydantic.ValidationError, agent_id: str) -> str | None:
    """What to tell the client when LangGraph's reading of the thread's saved state into
    the graph's pydantic state schema (`_coerce_state`) raised `exc`, else None (a node's
    own validation). The refused values are not echoed: they are the thread's data."""
    tb = exc.__traceback__
    while tb is not None and not (tb.tb_frame.f_code.co_name == "_coerce_state" and str(
            tb.tb_frame.f_globals.get("__name__") or "").startswith("langgraph.")):
        tb = tb.tb_next
    if tb is None:
        return None
    errors = exc.errors()
    keys = ", ".join(dict.fromkeys(str(e["loc"][0]) for e in errors if e.get("loc")))
    reason = f": {errors[0]['msg']}" if errors else ""
    return (f"Agent '{agent_id}' cannot read this thread: its saved state does not fit the "
            f"graph's state schema ({keys}{reason}); go on in a new thread, or correct the "
            "value in the checkpoint")


def _raised_by_checkpointer(exc: BaseException) -> bool:
    """Whether `exc` came through a checkpointer's code (its traceback's modules)."""
    tb = exc.__traceback__
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__") or "")
        if module.startswith(_CHECKPOINT_MODULES):
            return True
        tb = tb.tb_next
    return False


def _has_legacy_resume(input: RunInput) -> bool:
    props = input.model.forwarded_props
    command = props.get("command") if isinstance(props, dict) else None
    return isinstance(command, dict) and command.get("resume") is not None


def _unanswered_tool_calls(messages: Sequence[Any]) -> int:
    """How many tool calls of the last assistant message have no result yet."""
    answered: set[str] = set()
    for message in reversed(messages):
        if isinstance(message, ToolMessage):
            answered.add(message.tool_call_id)
        elif isinstance(message, AIMessage):
            return sum(1 for call in message.tool_calls if call.get("id") not in answered)
    return 0


def _legacy_answer_by_question(input: RunInput, pending: Mapping[str, Any]) -> RunInput:
    """`input` with its legacy answer (which names no interrupt) as a `resume` entry for
    the pending interrupt whose question it quotes: LangGraph refuses a bare answer while
    several interrupts wait. See the module docstring for the rule."""
    props = dict(input.model.forwarded_props or {})
    command = props.pop("command")
    answer = command.get("resume")
    if _no_answer(answer):
        return input
    asked = command.get("interruptEvent")
    if asked is None or asked == "":
        raise InvalidRequestError(
            f"Thread '{input.thread_id}' waits on {len(pending)} interrupts: the answer must "
            "say which one it is for (resume entries with its interruptId, or the question "
            "it answers in forwardedProps.command.interruptEvent)")
    interrupt_id = _asking(asked, pending)
    if interrupt_id is None:
        raise NothingToResumeError(
            f"Thread '{input.thread_id}' waits on {len(pending)} interrupts, none of which "
            "asked the question this answers: it may have been answered already")
    return input.replace(forwarded_props=props, resume=[ResumeEntry(
        interrupt_id=interrupt_id, status="resolved",
        payload=_parsed(answer, "The resume answer"))])


def _check_quoted_question(input: RunInput, pending: Mapping[str, Any]) -> None:
    """Refuse a legacy answer that quotes a question the one pending interrupt does not ask:
    it answers an earlier question (another tab, or a reviewer over HTTP, answered that
    one and the graph asked again), and taking it would approve what its sender never saw.
    An answer that quotes nothing goes to the one interrupt, as old clients expect."""
    command = (input.model.forwarded_props or {}).get("command") or {}
    asked = command.get("interruptEvent") if isinstance(command, Mapping) else None
    if asked is None or asked == "" or _no_answer(command.get("resume")):
        return
    if _asking(asked, pending) is None:
        raise NothingToResumeError(
            f"Thread '{input.thread_id}' no longer asks the question this answers: it may "
            "have been answered already, and the thread now asks another")


def _no_answer(answer: Any) -> bool:
    """Whether a legacy answer is none at all: {} or null, or either as JSON text (the
    approval ledger's rule, `claim_resume`: the questions are asked again)."""
    return _parsed(answer, "The resume answer") in (None, {})


def _asking(asked: Any, pending: Mapping[str, Any]) -> str | None:
    """The id of the pending interrupt whose question `asked` quotes (as JSON text, or the
    value itself), or None."""
    quoted = [_parsed(asked, "The question answered"), asked] if isinstance(asked, str) \
        else [asked]
    for interrupt_id, value in pending.items():
        question = json_shown(value)  # (quoted as a browser read it: `is_shown`)
        questions = [question]
        if isinstance(question, dict) and _COPILOTKIT_QUESTION in question:
            questions.append(question[_COPILOTKIT_QUESTION])
        if any(is_shown(q, given) for q in questions for given in quoted):
            return str(interrupt_id)
    return None


def _parsed(text: Any, what: str) -> Any:
    """A legacy value sent as JSON text is meant as the value it encodes."""
    if not isinstance(text, str):
        return text
    try:
        return check_json_text(text, what)
    except orjson.JSONDecodeError:
        return text


async def translate_bridge_run(bridge: CopilotKitLangGraphBridge, input: RunInput,
                               encoder: WireEncoder) -> EventBatches:
    """Run `bridge` on `input`, yielding wire events; model failures become `UpstreamError`.

    Shared with `LangGraphPlatformAgent`, whose bridge drives a remote graph.
    """
    try:
        async for event in bridge.stream(input.model):
            wire = encoder.encode(event)
            if wire is not None:
                yield (wire,)
    except openai.APIError as exc:
        # The client learns what kind of failure it was; the provider's own text goes to
        # the log (it may name deployments, keys or internal hosts).
        _log.warning("model call failed in a LangGraph run", error=repr(exc))
        if isinstance(exc, openai.APITimeoutError):
            raise UpstreamTimeoutError("The model provider did not answer in time") from None
        if isinstance(exc, openai.APIStatusError):
            raise UpstreamError(f"The model provider answered HTTP {exc.status_code}",
                                status=exc.status_code) from None
        raise UpstreamError("The model provider could not be reached") from None
