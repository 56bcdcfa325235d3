"""`LangGraphPlatformAgent`: a graph deployed on LangGraph Platform (or `langgraph dev`).

The same translator as the in-process `LangGraphAgent` (`_lg_bridge`) drives the remote
graph through `_PlatformGraph`, a stand-in for a compiled graph whose every call is a
`langgraph-sdk` request, so both kinds stream, snapshot state, interrupt and honour the
CopilotKit conventions alike. What is particular to the platform:

* **Threads.** Platform thread ids are UUIDs. An AG-UI `threadId` that is a UUID in its
  canonical form (and not a version 5 one) is used as it is; any other id maps to a stable
  UUID5 of its own, so the same conversation always lands on the same platform thread, and
  no two runtime threads (each with its owner) share one. A thread that does not exist yet
  is created on first use.
* **Assistant.** `graph_id` is resolved once with `assistants.search` (a configured
  `assistant_id` past its first page with `assistants.get`), and its input and
  output schemas with `assistants.get_schemas`; the client's state is filtered to the input
  schema's keys before it is sent, as the translator does in-process.
* **Runs.** `runs.stream(..., stream_mode=["events", "custom"])`: the graph's
  `astream_events` as JSON, which the translator needs (the state comes from those events
  and the final thread state, so the `values`/`updates` modes would only double the
  traffic), and what nodes write with `get_stream_writer()`, sent on as the
  `langgraph_stream_writer` custom event, as in-process. `on_disconnect="cancel"`:
  stopping the run in the runtime cancels it on the platform.
* **How a run ends.** `langgraph-api` closes a finished run's stream without an end event
  (an `end` event is only what some compatible servers send); a failed one sends `error`
  first; a run that timed out or was cancelled there sends nothing. A stream that closes
  without `end` or `error` is therefore checked against the run's status (`runs.get`): only
  "success" finishes the run; a run still going (a proxy or a restart cut the stream) ends
  with `UPSTREAM_CONNECTION_ERROR` and is cancelled, a failed, timed-out or cancelled one
  with its own message.
* **Errors.** As in-process: the graph's recursion limit is `AGENT_EXECUTION_ERROR`, and
  the platform's storage failing (HTTP 503 from its API, or a run failing with a database
  connection error) is `SERVICE_UNAVAILABLE`. Any other failure of the graph is
  `UPSTREAM_ERROR` naming its class, never its message; so is an answer that is not the
  JSON expected (a proxy's HTML page, an object where a list belongs), saying so, and
  an event the translator cannot read (a field of another type than LangChain writes).
* **Bounds.** One record of the run stream is bounded as every remote reader's
  (`MAX_UPSTREAM_EVENT_BYTES`), any other answer by `MAX_ANSWER_BYTES`: past them the
  run (or the call) fails with `UPSTREAM_ERROR`. Answers are asked for uncompressed; one
  gzipped regardless is bounded as it expands (decoded here, not by httpx).
* **Non-finite numbers.** Python writes NaN and the infinities into JSON text as bare
  words no JSON parser takes; in a tool call's arguments (streamed or in a message) they
  are sent on as `null`, as `JSON.stringify` has it.
* **Headers.** `api_key` and `headers` go with every request, and the client's request
  headers allowed by `header_policy` too, but for the names the operator set (theirs win).
  A run's `forwardedProps.authorization` (the 1.x `properties.authorization`, a user's
  token) goes as `authorization: Bearer <it>`, as the 1.10 runtime sent it, unless the
  operator set that header.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Final

import httpx
import structlog
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    HumanMessageChunk,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
    ToolMessageChunk,
)
from langgraph.types import Command, Interrupt, PregelTask, StateSnapshot
from langgraph_sdk.client import LangGraphClient
from langgraph_sdk.errors import NotFoundError

from copilot_runtime._exceptions import (
    AgentExecutionError,
    ConfigurationError,
    InvalidRequestError,
    ServiceUnavailableError,
    UpstreamConnectionError,
    UpstreamError,
    UpstreamTimeoutError,
    header_secrets,
    quoted,
    scrub_secrets,
)
from copilot_runtime._held import MAX_UPSTREAM_EVENT_BYTES
from copilot_runtime._input import RunInput
from copilot_runtime.agents._http_client import REDIRECT_NOT_FOLLOWED
from copilot_runtime.agents._lg_bridge import CopilotKitLangGraphBridge
from copilot_runtime.agents._lg_config import (
    client_run_config,
    declared_keys,
    recursion_bound,
)
from copilot_runtime.agents._lg_events import WireEncoder
from copilot_runtime.agents._lg_state import schema_keys, thread_state_from_values
from copilot_runtime.agents.base import Agent, AgentThreadState, RunContext
from copilot_runtime.agents.langgraph import translate_bridge_run
from copilot_runtime.events import EventBatches
from copilot_runtime.headers import HeaderPolicy

__all__ = ["LangGraphPlatformAgent", "finite_json_text", "platform_thread_id"]

_log = structlog.get_logger("copilot_runtime.agents")


# UUID5 namespace for AG-UI thread ids that are not UUIDs (fixed: the mapping must be stable).
_THREAD_NAMESPACE: Final = uuid.UUID("6f0b8f8e-6f3c-4d7e-9a57-0c0a7c9f4e21")


def platform_thread_id(thread_id: str) -> str:
    """The platform thread for an AG-UI thread id (see the module docstring).

    One-to-one: the runtime keeps an owner per thread id, so two ids must never name one
    platform thread (a "ck-" prefix, upper case, no hyphens, braces or "urn:uuid:" would
    otherwise open someone else's conversation under an id nobody owns). Only the canonical
    spelling of a UUID that is not a version 5 one is used as it is; every other id, a
    UUID5 included, maps to its own UUID5 (never equal to an id used as it is)."""
    try:
        parsed = uuid.UUID(thread_id)
    except ValueError:
        parsed = None
    if parsed is not None and parsed.version != 5 and str(parsed) == thread_id:
        return thread_id
    return str(uuid.uuid5(_THREAD_NAMESPACE, thread_id))


class LangGraphPlatformAgent(Agent):
    """The graph `graph_id` of the deployment at `deployment_url`.

    `assistant_id` picks one of the graph's assistants (default: the first found).
    `headers` (and `api_key`, sent as `x-api-key`) go with every request; `timeout` bounds
    each read, `connect_retries` the attempts to connect. Connections to the platform are
    not capped: a run streams over one for as long as it lasts, and may read the thread's
    state over another meanwhile (a graph with subgraphs), so any cap lets runs wait on each
    other.
    """

    class_name = "LangGraphPlatformAgent"

    def __init__(
        self,
        *,
        deployment_url: str,
        graph_id: str,
        api_key: str | None = None,
        assistant_id: str | None = None,
        name: str | None = None,
        description: str = "",
        config: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        header_policy: HeaderPolicy | None = None,
        timeout: float = 300.0,
        connect_retries: int = 2,
        state_deltas: bool = True,
        emit_interrupt_outcome: bool = False,
        legacy_interrupt_events: bool = True,
    ) -> None:
        super().__init__(description=description)
        if not deployment_url.startswith(("http://", "https://")):
            raise ConfigurationError(
                f"deployment_url must be http(s), got {deployment_url!r}")
        self.deployment_url = deployment_url.rstrip("/")
        self.graph_id = graph_id
        self.assistant_id = assistant_id
        self.name = name or graph_id
        self.config = dict(config or {})
        self.header_policy = header_policy or HeaderPolicy()
        self.state_deltas = state_deltas
        self._bridge_flags = {"emit_interrupt_outcome": emit_interrupt_outcome,
                              "enable_legacy_on_interrupt_event": legacy_interrupt_events}
        static = {name.lower(): value for name, value in (headers or {}).items()}
        if api_key:
            static["x-api-key"] = api_key
        #: Blanked in what the platform says (it may echo the key it was sent).
        self._secrets = header_secrets(static)
        #: The names whose values are the operator's: a client's are never sent instead.
        self._static_names = frozenset(static)
        # The SDK's own client, but with the connection retries ours to choose: its default
        # (5, with backoff) makes an unreachable deployment take ~8 s to report.
        # Answers uncompressed: their bytes are counted as they come (`_BoundedTransport`),
        # and a compressed one's count would not bound what it expands to.
        # No pool limit: each run streams over a connection of its own for as long as it
        # lasts, and httpx's default (100) held the 101st run back silently until one ended.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=20)

        def new_client() -> LangGraphClient:
            return LangGraphClient(httpx.AsyncClient(
                base_url=self.deployment_url, headers={"accept-encoding": "identity", **static},
                transport=_BoundedTransport(httpx.AsyncHTTPTransport(retries=connect_retries,
                                                                     limits=limits)),
                timeout=httpx.Timeout(timeout, connect=10.0)))

        self._new_client = new_client
        self._made: LangGraphClient | None = None
        self._resolved: tuple[str, dict[str, Any]] | None = None
        #: The chosen assistant's own `config` and `context` (its search's answer): the
        #: Platform lays a run's over them, so what they set stays the operator's.
        self._assistant_config: Mapping[str, Any] = {}
        self._assistant_context: Mapping[str, Any] = {}

    def capabilities(self) -> dict[str, Any]:
        return {"identity": {"type": "langgraph"},
                "humanInTheLoop": {"supported": True, "interrupts": True},
                "state": {"snapshots": True, "deltas": self.state_deltas,
                          "persistentState": True},
                "tools": {"supported": True, "clientProvided": True},
                "transport": {"streaming": True}}

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input, context)

    def _forwarded(self, headers: Mapping[str, str] | None) -> dict[str, str | bytes]:
        """The client's headers the policy forwards, minus those the operator set: the SDK
        lays a request's headers over the client's defaults, so a forwarded `x-api-key` or
        `Authorization` would replace the operator's (as `HttpAgent`, the operator's win).
        Their values go as the bytes the client sent (`_header_bytes`): the SDK types a
        request's headers as text, but hands them to httpx as they are."""
        return {name: _header_bytes(value)
                for name, value in self.header_policy.select(headers or {}).items()
                if name not in self._static_names}

    async def _run(self, input: RunInput, context: RunContext) -> EventBatches:
        headers = self._forwarded(context.headers)
        known = self._secrets
        token = _user_token(input.model.forwarded_props)
        if token and "authorization" not in self._static_names:
            headers["authorization"] = f"Bearer {token}"
            known = (*known, token)  # (blanked should the platform echo it)
        what = f"LangGraph Platform agent '{context.agent_id}'"
        try:
            assistant_id, schemas = await self._assistant(headers, what)
            graph = _PlatformGraph(self._client, assistant_id, schemas, headers,
                                   agent_id=context.agent_id, known=known)
            config = self._run_config(input, schemas)
            bridge = CopilotKitLangGraphBridge(
                name=self.name, graph=graph, description=self.description or None,
                config=config or None, emit_raw_events=False, **self._bridge_flags)
            async for batch in translate_bridge_run(
                    bridge, input, WireEncoder(state_deltas=self.state_deltas)):
                yield batch
        except httpx.HTTPError as exc:
            raise _upstream_error(what, exc) from None
        except _UNUSABLE as exc:
            if not graph.translating:
                raise  # (not the platform's event: the agent's own failure)
            # The translator met a field of another type than LangChain writes (a list for
            # a node's name, a number for a tool call's id): the platform's error, as a
            # legacy endpoint's line of an unexpected shape. Its text may quote the event.
            _log.warning("LangGraph Platform event of an unexpected shape",
                         agent=context.agent_id, error=type(exc).__name__)
            raise UpstreamError("The LangGraph Platform sent an event of an unexpected "
                                "shape") from None

    def _run_config(self, input: RunInput, schemas: Mapping[str, Any]) -> dict[str, Any]:
        """The run's config: the agent's, with what the client's `forwardedProps.config`
        may set (see `_lg_config`): the `configurable` keys the assistant's config and
        context schemas declare and neither the agent nor the assistant sets, a lower
        `recursion_limit`."""
        props = input.model.forwarded_props
        sent = props.get("config") if isinstance(props, dict) else None
        assistant = self._assistant_config
        configurable = assistant.get("configurable")
        operator = {*(configurable if isinstance(configurable, Mapping) else ()),
                    *self._assistant_context}
        return client_run_config(self.config, sent, declared_keys(
            schemas.get("config_schema"), schemas.get("context_schema")),
            recursion_bound(self.config, assistant), operator)

    async def load_state(self, thread_id: str, *,
                         headers: Mapping[str, str] | None = None) -> AgentThreadState:
        """The platform thread's current values (`threads.get_state`); a thread the
        platform does not know does not exist."""
        forwarded: Mapping[str, Any] = self._forwarded(headers)
        what = self._graph_named()
        try:
            assistant_id, schemas = await self._assistant(forwarded, what)
            state = await self._client.threads.get_state(platform_thread_id(thread_id),
                                                         headers=forwarded)
            values = state.get("values")  # (empty for a thread without any: none)
            # Cut to the output schema's keys, as the run's snapshots are.
            graph = _PlatformGraph(self._client, assistant_id, schemas, forwarded,
                                   agent_id=self.name, known=self._secrets)
            return thread_state_from_values(thread_id, _thread_values(values) if values
                                            else None, schema_keys(graph)["output"])
        except NotFoundError:
            return AgentThreadState(thread_id, exists=False)
        except httpx.HTTPError as exc:
            raise _upstream_error(what, exc) from None
        except _UNUSABLE as exc:
            raise _unusable(what, "its thread's state", exc, self._secrets) from None

    async def forget_thread(self, thread_id: str) -> None:
        """Delete the platform's thread (one it does not know is forgotten already)."""
        try:
            await self._client.threads.delete(platform_thread_id(thread_id))
        except NotFoundError:
            return
        except httpx.HTTPError as exc:
            raise _upstream_error(self._graph_named(), exc) from None

    def _graph_named(self) -> str:
        """Who failed, outside a run: the graph (the runtime's id for this agent is not
        known here; the graph's name, said as the agent's, read as a wrong agent id)."""
        return f"The LangGraph Platform's graph '{self.graph_id}'"

    async def _assistant(self, headers: Mapping[str, Any],
                         what: str) -> tuple[str, dict[str, Any]]:
        """The assistant to run and its schemas, looked up once."""
        if self._resolved is None:
            try:
                self._resolved = await self._look_up_assistant(headers)
            except _UNUSABLE as exc:
                raise _unusable(what, "its assistants or their schemas", exc,
                                self._secrets) from None
        return self._resolved

    async def _look_up_assistant(self, headers: Mapping[str, Any]
                                 ) -> tuple[str, dict[str, Any]]:
        try:
            found = await self._client.assistants.search(
                graph_id=self.graph_id, limit=100, headers=headers)
        except NotFoundError:  # the server answers 404 for a graph it does not know
            found = []
        if not isinstance(found, list):
            raise TypeError("the assistants search answered no list")
        chosen: Mapping[str, Any] | None = next(
            (a for a in found if self.assistant_id in (None, a["assistant_id"])), None)
        if chosen is None and self.assistant_id is not None:
            chosen = await self._configured_assistant(headers)
        if chosen is None:
            raise UpstreamError(f"The LangGraph deployment has no assistant for graph "
                                f"'{self.graph_id}'")
        assistant_id = str(chosen["assistant_id"])
        config, context = chosen.get("config"), chosen.get("context")
        self._assistant_config = config if isinstance(config, Mapping) else {}
        self._assistant_context = context if isinstance(context, Mapping) else {}
        schemas = dict(await self._client.assistants.get_schemas(assistant_id,
                                                                 headers=headers))
        return assistant_id, schemas

    async def _configured_assistant(self, headers: Mapping[str, Any]
                                    ) -> Mapping[str, Any] | None:
        """The configured assistant, asked for by its id (the search gives one page only: a
        graph may have many, one per user), when it is this agent's graph's."""
        try:
            assistant = await self._client.assistants.get(str(self.assistant_id),
                                                          headers=headers)
        except NotFoundError:
            return None
        if not isinstance(assistant, Mapping):
            raise TypeError("the assistant answered is not an object")
        return assistant if assistant.get("graph_id") == self.graph_id else None

    @property
    def _client(self) -> LangGraphClient:
        # Made on first use, and again after `aclose` (the runtime started again: an app's
        # lifespan run twice), as a closed client cannot send.
        if self._made is None:
            self._made = self._new_client()
        return self._made

    async def aclose(self) -> None:
        client, self._made = self._made, None
        if client is not None:
            await client.aclose()


# -- bounded answers -------------------------------------------------------------------

#: The largest answer that is not an event stream (a thread's state, its history, the
#: assistants): a state far larger than one event may be, as large as the runtime patches.
MAX_ANSWER_BYTES: Final = 64 * 1024 * 1024
#: How an SSE record ends: a blank line, whichever line ends (LF, CRLF, CR) close it.
_RECORD_BREAKS: Final = (b"\n\n", b"\r\r", b"\n\r")


class _BoundedBody(httpx.AsyncByteStream):
    """An answer's bytes as they come, failing as the platform's error past a bound: an
    event stream's record (the SDK's decoders hold one without limit) past
    `MAX_UPSTREAM_EVENT_BYTES`, as every remote reader's; any other answer (read whole)
    past `MAX_ANSWER_BYTES`."""

    def __init__(self, inner: httpx.AsyncByteStream, *, events: bool) -> None:
        self._inner = inner
        self._events = events
        self._limit = MAX_UPSTREAM_EVENT_BYTES if events else MAX_ANSWER_BYTES
        self._size = 0  # of the record (or answer) so far
        self._last = b""  # the last byte read: a break may fall across two reads

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._count(chunk)
            yield chunk

    def _count(self, chunk: bytes) -> None:
        if not chunk:
            return
        after = -1
        if self._events:
            after = max(chunk.rfind(end) for end in _RECORD_BREAKS)
            after = after + 2 if after >= 0 else (
                1 if self._last + chunk[:1] in _RECORD_BREAKS else -1)
            self._last = chunk[-1:]
        self._size = len(chunk) - after if after >= 0 else self._size + len(chunk)
        if self._size > self._limit:
            raise UpstreamError(
                f"The LangGraph Platform sent an event larger than {self._limit} bytes"
                if self._events else
                f"The LangGraph Platform answered more than {self._limit} bytes")

    async def aclose(self) -> None:
        await self._inner.aclose()


#: The content encodings a platform (or a proxy before it) may use though asked for none,
#: and zlib's `wbits` for each ("deflate" is zlib's format; 32 also takes gzip's).
_INFLATABLE: Final = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
                      "deflate": 32 + zlib.MAX_WBITS}
#: The most a read's compressed bytes expand into at a time (so a bound is met before a
#: small read has expanded whole).
_INFLATED_PIECE: Final = 64 * 1024


def _decoded(stream: httpx.AsyncByteStream, headers: httpx.Headers
             ) -> httpx.AsyncByteStream:
    """An answer's body decoded here rather than by httpx, which decodes after the
    transport: the bound must count the bytes it expands to. Its `content-encoding` header
    is taken off (httpx would decode again); an encoding zlib cannot read, refused."""
    # ("gzip, identity": identity is no encoding; two compressions are not undone)
    encodings = [part.strip() for part in headers.get("content-encoding", "").lower().split(",")]
    encodings = [part for part in encodings if part not in ("", "identity")]
    if not encodings:
        headers.pop("content-encoding", None)
        return stream
    encoding = ", ".join(encodings)
    wbits = _INFLATABLE.get(encoding)
    if wbits is None:
        raise UpstreamError(f"The LangGraph Platform answered in content encoding "
                            f"{quoted(encoding, 40)}, which it was not asked for")
    del headers["content-encoding"]
    headers.pop("content-length", None)  # (the compressed bytes')
    return _Inflated(stream, wbits)


class _Inflated(httpx.AsyncByteStream):
    """A gzip or deflate body, expanded a bounded piece at a time."""

    def __init__(self, inner: httpx.AsyncByteStream, wbits: int) -> None:
        self._inner = inner
        self._wbits = wbits

    async def __aiter__(self) -> AsyncIterator[bytes]:
        inflater = zlib.decompressobj(self._wbits)
        started = False
        try:
            async for chunk in self._inner:
                data = chunk
                if not started and data:
                    started = True
                    if self._wbits == _INFLATABLE["deflate"]:
                        # "deflate" sent raw, without zlib's header (as some servers do)
                        try:
                            zlib.decompressobj(self._wbits).decompress(data[:2])
                        except zlib.error:
                            inflater = zlib.decompressobj(-zlib.MAX_WBITS)
                while not inflater.eof:
                    piece = inflater.decompress(data, _INFLATED_PIECE)
                    data = inflater.unconsumed_tail
                    if piece:
                        yield piece
                    if not data and len(piece) < _INFLATED_PIECE:
                        break  # (a full piece may have more behind it)
            rest = inflater.flush()
            if rest:
                yield rest
        except zlib.error:
            raise UpstreamError("The LangGraph Platform answered with a compressed body "
                                "that does not decompress") from None

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedTransport(httpx.AsyncBaseTransport):
    """`inner`, its answers' bytes bounded (`_BoundedBody`), a redirect refused.

    The SDK raises only from HTTP 400: a 3xx passed for success (a thread delete said done
    while the platform kept the thread). It is not followed either, as `HttpAgent`'s are not:
    the request's credentials would go along to wherever it points."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if 300 <= response.status_code < 400:
            await response.aclose()
            raise UpstreamError(f"The LangGraph Platform answered HTTP "
                                f"{response.status_code}{REDIRECT_NOT_FOLLOWED}")
        if isinstance(response.stream, httpx.AsyncByteStream):
            events = "text/event-stream" in response.headers.get("content-type", "")
            try:
                decoded = _decoded(response.stream, response.headers)
            except UpstreamError:
                await response.aclose()
                raise
            response.stream = _BoundedBody(decoded, events=events)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


# -- the remote graph ------------------------------------------------------------------

_MESSAGE_TYPES: Final[dict[str, type[BaseMessage]]] = {
    "human": HumanMessage, "ai": AIMessage, "system": SystemMessage, "tool": ToolMessage,
    "remove": RemoveMessage, "AIMessageChunk": AIMessageChunk,
    "HumanMessageChunk": HumanMessageChunk, "ToolMessageChunk": ToolMessageChunk,
}
# Recomputed by the chunk class from `tool_call_chunks`; passing them too would conflict.
_DERIVED_CHUNK_FIELDS: Final = ("tool_calls", "invalid_tool_calls")


def revive(value: Any) -> Any:
    """Platform JSON with the LangChain messages in it made message objects again."""
    if isinstance(value, dict):
        kind = value.get("type")
        cls = _MESSAGE_TYPES.get(kind) if isinstance(kind, str) and "content" in value \
            else None
        if cls is not None:
            fields = {k: v for k, v in value.items() if v is not None and k != "type"}
            if kind is not None and kind.endswith("Chunk"):
                for key in _DERIVED_CHUNK_FIELDS:
                    fields.pop(key, None)
                if isinstance(fields.get("tool_call_chunks"), list):
                    # (their `args` text is parsed into `tool_calls`: Python's parser
                    # takes NaN, which the snapshot then writes back out as bare NaN)
                    fields["tool_call_chunks"] = [
                        {**c, "args": finite_json_text(c["args"])}
                        if isinstance(c, dict) and isinstance(c.get("args"), str) else c
                        for c in fields["tool_call_chunks"]]
            try:
                return cls(**fields)
            except (TypeError, ValueError, AttributeError):  # (a field of the wrong type)
                return value
        return {key: revive(item) for key, item in value.items()}
    if isinstance(value, list):
        return [revive(item) for item in value]
    return value


def _thread_values(values: Any) -> Any:
    """A thread's state values from the platform, revived; a TypeError when they are not an
    object, or their messages no list of messages (a field of the wrong type: the
    translator would trip on it)."""
    if not isinstance(values, dict):
        raise TypeError("the thread's state values are not an object")
    revived = revive(values)
    messages = revived.get("messages")
    if messages is not None and not (isinstance(messages, list) and all(
            isinstance(m, BaseMessage) for m in messages)):
        raise TypeError("the thread's messages are not a list of LangChain messages")
    return revived


def _snapshot(thread_id: str, state: Mapping[str, Any]) -> StateSnapshot:
    if not isinstance(state.get("metadata"), dict | None):
        raise TypeError("the thread's state metadata is not an object")
    checkpoint = state.get("checkpoint") or {}
    configurable: dict[str, Any] = {"thread_id": thread_id,
                                    "checkpoint_ns": checkpoint.get("checkpoint_ns", "")}
    if checkpoint.get("checkpoint_id"):
        configurable["checkpoint_id"] = checkpoint["checkpoint_id"]
    tasks = tuple(
        PregelTask(id=task.get("id", ""), name=task.get("name", ""), path=(),
                   error=task.get("error"), state=None, result=task.get("result"),
                   interrupts=tuple(_interrupt(i, task.get("id"), n)
                                    for n, i in enumerate(task.get("interrupts") or ())))
        for task in state.get("tasks") or ())
    return StateSnapshot(
        values=_thread_values(state.get("values") or {}), next=tuple(state.get("next") or ()),
        config={"configurable": configurable}, metadata=state.get("metadata"),
        created_at=state.get("created_at"), parent_config=None, tasks=tasks,
        interrupts=tuple(i for task in tasks for i in task.interrupts))


def _interrupt(raw: Mapping[str, Any], task_id: Any, position: int) -> Interrupt:
    """One of a task's interrupts. Those langgraph < 0.4 wrote have no `id` (the translator
    refuses an interrupt without one, and the thread stayed stuck): each gets the id that
    version knew it by, of its `ns` (as langgraph's own `Interrupt(ns=...)` derives it), so a
    map of answers by id reaches it, and a single answer goes bare, as it takes one; without
    an `ns` either, one of its task and its place there, stable while the thread waits."""
    value, found, ns = raw.get("value"), raw.get("id"), raw.get("ns")
    if found:
        return Interrupt(value=value, id=str(found))
    if isinstance(ns, list) and ns and all(isinstance(part, str) for part in ns):
        legacy: dict[str, Any] = {"ns": ns}  # (a keyword langgraph keeps for these, untyped)
        return Interrupt(value=value, **legacy)
    return Interrupt(value=value, id=f"{task_id}:{position}")


#: How the SDK says a run stream's answer is not an event stream (an `httpx.TransportError`).
_NOT_AN_EVENT_STREAM: Final = "Expected response header Content-Type to contain"
#: What an answer that is not the JSON expected fails with when read: not JSON (the SDK's
#: `orjson` decode error is a ValueError), or JSON of another shape.
_UNUSABLE: Final = (ValueError, TypeError, KeyError, AttributeError)


def _header_bytes(value: str) -> bytes:
    """A forwarded header's value as the client sent it. The runtime reads a request's
    header bytes as latin-1, whose encoding gives them back; httpx would encode the text as
    ASCII, and fail (before sending) on any other byte. Text latin-1 cannot hold was not
    read that way: it goes as UTF-8."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogateescape")


def _user_token(props: Any) -> str | None:
    """A run's `forwardedProps.authorization`, refused when no HTTP header can hold it (a
    line break would inject another header; the HTTP client's error would quote it)."""
    token = props.get("authorization") if isinstance(props, dict) else None
    if token is None or token == "":
        return None
    if not isinstance(token, str) or not (token.isascii() and token.isprintable()):
        raise InvalidRequestError("forwardedProps.authorization (properties.authorization) "
                                  "must be text an HTTP header can hold: printable ASCII")
    return token


def _unusable(what: str, part: str, exc: Exception, known: Sequence[str] = ()
              ) -> UpstreamError:
    """The error for a platform answer that is not the JSON expected (an HTML page a proxy
    answered, an object where a list belongs); the details go to the log, without the
    `known` secrets (an answer may echo the key it was sent)."""
    _log.warning("LangGraph Platform answer unusable", target=what, part=part,
                 error=scrub_secrets(repr(exc)[:2000], *known)[:300])
    return UpstreamError(f"{what} answered with something unusable ({part})")


def _upstream_error(what: str, exc: httpx.HTTPError
                    ) -> UpstreamError | ServiceUnavailableError:
    """The platform's HTTP failure as a message fit for the client (no URL, no internals).

    503 is how `langgraph-api` answers while its storage is overloaded or down: the
    runtime's own code for a store it cannot use, as the in-process agent's checkpointer."""
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeoutError(f"{what} did not answer in time")
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        if status == 503:
            return ServiceUnavailableError(f"{what} is unavailable (HTTP 503); try again later")
        # (no `status`: the platform's answer to the runtime is not the client's; a 401
        # there would read as the client's own credentials refused. An upstream failure
        # is the runtime's 503, as a run's failure says.)
        return UpstreamError(f"{what} answered HTTP {status}")
    if isinstance(exc, httpx.ConnectError):
        return UpstreamConnectionError(f"{what} could not be reached")
    said = str(exc)
    if type(exc) is httpx.TransportError and said.startswith(_NOT_AN_EVENT_STREAM):
        # (the SDK's own check of a run stream's answer, before any of its bytes)
        content_type = quoted(said.rpartition(" got ")[2], 80) or "?"
        return UpstreamError(f"{what} answered its run with content type {content_type}, "
                             "not an event stream")
    return UpstreamConnectionError(f"{what} closed the connection before its answer was "
                                   "complete")


#: The classes a platform run fails with when the platform's own storage fails (its
#: Postgres driver's and pool's connection errors, SQLite's): the platform does not say
#: which code raised them, and a graph seldom has a database of its own beside it.
_STORAGE_FAILURES: Final = frozenset({
    "OperationalError", "InterfaceError", "ConnectionTimeout", "ConnectionFailure",
    "PoolTimeout", "PoolClosed", "TooManyRequests"})
#: A run's status (`runs.get`) when its stream closed without `end` or `error`.
_STOPPED: Final = {
    "timeout": "timed out on the LangGraph Platform",
    "interrupted": "was cancelled on the LangGraph Platform (a cancel, or a newer run on "
                   "its thread, stopped it)",
    "rollback": "was rolled back on the LangGraph Platform",
}


#: How much of what the platform said of a failure the log keeps (its class and the start
#: of its message say what failed), and how far past that cut secrets are still looked for.
_LOGGED_ERROR_CHARS: Final = 1000
_SECRET_MARGIN: Final = 4096


def _for_log(error: Any, known: Sequence[str]) -> str:
    """A platform `error` event's data for the log: bounded, the `known` secrets (the
    operator's key and headers, which the platform may echo) and secret-looking values
    blanked, as they are for the client."""
    text = error if isinstance(error, str) else repr(error)
    cut = text[:_LOGGED_ERROR_CHARS + _SECRET_MARGIN]  # (blanked before the cut: none split)
    return scrub_secrets(cut, *known)[:_LOGGED_ERROR_CHARS]


def _run_error(agent_id: str, error: Any, known: Sequence[str] = ()) -> Exception:
    """The client's error for a platform `error` event (`{"error": class, "message": text}`):
    its class (the `known` secrets blanked), never its text (the graph's exception message),
    except what the runtime says in its own words, as in-process."""
    kind = error.get("error") if isinstance(error, dict) else None
    kind = kind if isinstance(kind, str) else None  # (an object names no class)
    message = error.get("message") if isinstance(error, dict) else None
    if kind == "GraphRecursionError":
        found = re.search(r"limit of (\d+)", message) if isinstance(message, str) else None
        steps = f" ({found.group(1)} steps)" if found else ""
        return AgentExecutionError(agent_id, (
            f"Agent '{agent_id}' reached its recursion limit{steps} without finishing: "
            "its graph may loop, or needs a higher recursion_limit in its config"))
    if kind in _STORAGE_FAILURES:
        return ServiceUnavailableError("The LangGraph Platform's checkpoint store cannot be "
                                       "used right now; try again later")
    name = quoted(kind, 80, known) if kind is not None else None
    return UpstreamError(f"The graph failed on the LangGraph Platform ({name})" if name
                         else "The graph failed on the LangGraph Platform")


class _PlatformGraph:
    """What the translator uses of a compiled graph, answered by the platform's API."""

    #: No subgraph detection: nodes bound to subgraphs are not visible over the API.
    nodes: dict[str, Any] = {}  # noqa: RUF012 - read-only, as the translator reads it
    context_schema = None

    def __init__(self, client: LangGraphClient, assistant_id: str, schemas: dict[str, Any],
                 headers: Mapping[str, Any], *, agent_id: str,
                 known: Sequence[str] = ()) -> None:
        self.agent_id = agent_id
        self.known = known
        self.what = f"LangGraph Platform agent '{agent_id}'"
        self.client = client
        self.assistant_id = assistant_id
        self.schemas = schemas
        self.headers = dict(headers)
        #: True while the translator handles an event of the run stream: what fails then
        #: failed on the platform's event.
        self.translating = False

    # schemas
    def get_input_jsonschema(self, config: Any = None) -> dict[str, Any]:
        schema = self.schemas.get("input_schema") or self.schemas.get("state_schema") or {}
        return dict(schema)

    def get_output_jsonschema(self, config: Any = None) -> dict[str, Any]:
        schema = self.schemas.get("output_schema") or self.schemas.get("state_schema") or {}
        return dict(schema)

    @contextlib.contextmanager
    def _reading(self, part: str) -> Iterator[None]:
        """Raise `_unusable` for an answer about `part` that is not the JSON expected."""
        try:
            yield
        except _UNUSABLE as exc:
            raise _unusable(self.what, part, exc) from None

    # threads
    @staticmethod
    def _thread(config: Mapping[str, Any]) -> str:
        return platform_thread_id(str(config["configurable"]["thread_id"]))

    async def aget_state(self, config: Mapping[str, Any]) -> StateSnapshot:
        thread = self._thread(config)
        with self._reading("its thread's state"):
            try:
                state = await self.client.threads.get_state(thread, headers=self.headers)
            except NotFoundError:
                await self.client.threads.create(thread_id=thread, if_exists="do_nothing",
                                                 headers=self.headers)
                state = await self.client.threads.get_state(thread, headers=self.headers)
            return _snapshot(config["configurable"]["thread_id"], state)

    async def aget_state_history(self, config: Mapping[str, Any]
                                 ) -> AsyncIterator[StateSnapshot]:
        with self._reading("its thread's history"):
            history = [_snapshot(config["configurable"]["thread_id"], state)
                       for state in await self.client.threads.get_history(
                           self._thread(config), limit=1000, headers=self.headers)]
        for snapshot in history:
            yield snapshot

    async def aupdate_state(self, config: Mapping[str, Any], values: Any,
                            as_node: str | None = None) -> dict[str, Any]:
        configurable = config["configurable"]
        with self._reading("its state update"):
            answer = await self.client.threads.update_state(
                self._thread(config), values, as_node=as_node,
                checkpoint_id=configurable.get("checkpoint_id"), headers=self.headers)
            checkpoint = answer.get("checkpoint") or {}
            return {"configurable": {"thread_id": configurable["thread_id"],
                                     "checkpoint_ns": checkpoint.get("checkpoint_ns", ""),
                                     "checkpoint_id": checkpoint.get("checkpoint_id")}}

    # runs
    async def astream_events(self, input: Any, config: Mapping[str, Any] | None = None, *,
                             subgraphs: bool = False, version: str = "v2",
                             context: Mapping[str, Any] | None = None
                             ) -> AsyncIterator[dict[str, Any]]:
        config = dict(config or {})
        configurable = dict(config.get("configurable") or {})
        thread = platform_thread_id(str(configurable.pop("thread_id")))
        checkpoint_id = configurable.pop("checkpoint_id", None)
        configurable.pop("checkpoint_ns", None)
        run_config = {key: value for key, value in config.items()
                      if key in ("tags", "recursion_limit", "metadata")}
        if configurable:
            run_config["configurable"] = configurable
        command: dict[str, Any] | None = None
        if isinstance(input, Command):
            command = {key: value for key, value in (
                ("resume", input.resume), ("update", input.update),
                ("goto", input.goto or None)) if value is not None}
            input = None
        # (the SDK types `command` and `config` as TypedDicts; these dicts are their shape)
        runs: Any = self.client.runs
        created: list[str] = []
        stream = runs.stream(
            thread, self.assistant_id, input=input, command=command,
            stream_mode=["events", "custom"], stream_subgraphs=subgraphs,
            config=run_config or None, checkpoint_id=checkpoint_id, on_disconnect="cancel",
            headers=self.headers, on_run_created=lambda made: created.append(made["run_id"]))
        arguments = _FiniteArguments()
        run_id: str | None = None
        try:
            async for part in stream:
                kind = part.event.partition("|")[0]
                if kind in ("events", "custom"):
                    event = _stream_event(arguments.of(part.data)) if kind == "events" \
                        else _written(part.data)
                    self.translating = True
                    yield event
                    self.translating = False
                elif kind == "metadata" and isinstance(part.data, dict):
                    run_id = str(part.data.get("run_id") or "") or run_id
                elif kind == "end":
                    return
                elif kind == "error":
                    _log.warning("LangGraph Platform run failed", assistant=self.assistant_id,
                                 error=_for_log(part.data, self.known))
                    raise _run_error(self.agent_id, part.data, self.known)
        except json.JSONDecodeError:  # the SDK's SSE decoder met a frame that is no JSON
            raise UpstreamError("The LangGraph Platform sent an event that is not JSON") from None
        await self._check_ended(thread, run_id or (created[0] if created else None))

    async def _check_ended(self, thread: str, run_id: str | None) -> None:
        """Raise unless the run whose stream closed without `end` or `error` succeeded
        (see the module docstring): the close alone does not say it finished."""
        if run_id is None:  # (`langgraph-api` names it in its first event)
            raise UpstreamConnectionError("The LangGraph Platform's run stream closed before "
                                          "the run ended")
        try:
            with self._reading("its run"):
                run = await self.client.runs.get(thread, run_id, headers=self.headers)
        except NotFoundError:
            # A server that streams runs but does not keep them: nothing to tell a cut
            # stream by, and (as the SDK's own check has it) no reason to fail the run.
            _log.warning("the LangGraph Platform does not know the run it streamed; taken "
                         "as finished", run_id=run_id)
            return
        status = run.get("status") if isinstance(run, dict) else None
        if status == "success":
            return
        if status in ("pending", "running"):
            # Cut short (a proxy, a restart): the run goes on there, unwatched; stopped
            # as a client that left stops it (a failure to is not what the client hears).
            with contextlib.suppress(httpx.HTTPError, UpstreamError):
                await self.client.runs.cancel(thread, run_id, headers=self.headers)
            raise UpstreamConnectionError("The LangGraph Platform's run stream closed before "
                                          "the run ended")
        _log.warning("LangGraph Platform run ended without success", run_id=run_id,
                     status=status)
        if status == "timeout":
            raise UpstreamTimeoutError(f"The graph's run {_STOPPED['timeout']}")
        if isinstance(status, str) and status in _STOPPED:
            raise UpstreamError(f"The graph's run {_STOPPED[status]}")
        raise UpstreamError("The graph failed on the LangGraph Platform")


def _written(value: Any) -> dict[str, Any]:
    """What a node wrote with `get_stream_writer()` (the platform's "custom" mode), as the
    root graph's `on_chain_stream` event the translator reads it from in-process."""
    return {"event": "on_chain_stream", "name": "LangGraph", "run_id": None, "parent_ids": [],
            "tags": [], "metadata": {}, "data": {"chunk": ("custom", value)}}


class _FiniteArguments:
    """Streams tool call arguments with their non-finite numbers made null, one scanner
    per tool call chunk stream (a model call and its chunk index)."""

    def __init__(self) -> None:
        self._scanners: dict[tuple[Any, Any], _FiniteJSONText] = {}

    def of(self, event: Any) -> Any:
        """`event` (the platform's JSON, before `revive`) with its arguments rewritten."""
        if not isinstance(event, dict) or event.get("event") != "on_chat_model_stream":
            return event
        data = event.get("data")
        chunk = data.get("chunk") if isinstance(data, dict) else None
        calls = chunk.get("tool_call_chunks") if isinstance(chunk, dict) else None
        for call in calls if isinstance(calls, list) else ():
            args = call.get("args") if isinstance(call, dict) else None
            if isinstance(args, str) and args:
                key = (event.get("run_id"), call.get("index"))
                scanner = self._scanners.get(key)
                if scanner is None:
                    scanner = self._scanners[key] = _FiniteJSONText()
                call["args"] = scanner.feed(args)
        return event


class _FiniteJSONText:
    """JSON text arriving in pieces, with the bare words Python's `json` writes for NaN and
    the infinities replaced by `null` (outside strings). A piece ending in what may be the
    start of one is held back until the next shows what it was."""

    _WORDS: Final = ("NaN", "Infinity", "-Infinity")
    _SPECIAL: Final = frozenset('"\\NI-')

    def __init__(self) -> None:
        self._in_string = False
        self._escaped = False
        self._held = ""

    def feed(self, piece: str) -> str:
        if not self._held and not self._escaped and self._SPECIAL.isdisjoint(piece):
            return piece  # nothing here changes the scanner's state or needs rewriting
        text, self._held = self._held + piece, ""
        out: list[str] = []
        i = 0
        while i < len(text):
            char = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "NI-":
                rest = text[i:i + 9]
                word = next((w for w in self._WORDS if rest.startswith(w)), None)
                if word is not None:
                    out.append("null")
                    i += len(word)
                    continue
                if i + len(rest) == len(text) and any(w.startswith(rest) for w in self._WORDS):
                    self._held = rest
                    break
            out.append(char)
            i += 1
        return "".join(out)


def finite_json_text(*pieces: str) -> str:
    """JSON text, given whole or in `pieces`, with NaN and the infinities as `null`."""
    scanner = _FiniteJSONText()
    return "".join(scanner.feed(piece) for piece in pieces)


#: What the translation reads of each event, and what each must be: a kind and its name.
_EVENT_FIELDS: tuple[tuple[str, type, str], ...] = (
    ("data", dict, "an object"), ("metadata", dict, "an object"), ("name", str, "a string"),
    ("run_id", str, "a string"), ("tags", list, "a list"), ("parent_ids", list, "a list"))


def _stream_event(data: Any) -> dict[str, Any]:
    """One of the platform's LangChain stream events, its chunks and outputs revived."""
    if not isinstance(data, dict) or not isinstance(data.get("event"), str):
        raise UpstreamError("The LangGraph Platform sent an event that is not a LangChain "
                            "stream event")
    for key, kind, named in _EVENT_FIELDS:
        # (A list of metadata, a string of data failed the translation as the agent's own
        # bug: AGENT_ERROR, "failed unexpectedly".)
        if data.get(key) is not None and not isinstance(data[key], kind):
            raise UpstreamError("The LangGraph Platform sent an event that is not a LangChain "
                                f"stream event (its '{key}' is not {named})")
    event = dict(data)
    inner = event.get("data")
    if isinstance(inner, dict):
        event["data"] = {key: revive(item) if key in ("chunk", "output") else item
                         for key, item in inner.items()}
    return event
