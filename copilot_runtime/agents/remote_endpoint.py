"""`CopilotKitRemoteEndpoint`: a service built with the `copilotkit` SDK's `add_fastapi_endpoint`.

`discover()` asks the service's `/info` for its actions and agents. Each action becomes an
`Action` (a server-side action for the built-in agent) whose handler calls
`/actions/execute`; each agent becomes a `RemoteEndpointAgent`, whose runs call
`/agents/execute` and translate its JSONL stream (`_legacy`). `agent_state()` reads
`/agents/state` (the GraphQL protocol's `loadAgentState`). Those answers are read up to
`MAX_ANSWER_BYTES`, a stream's lines up to `MAX_UPSTREAM_EVENT_BYTES` each.

Retries follow the TypeScript runtime (3 retries, exponential backoff from 1 s up to 5 s,
on 408/429/502/503/504 and connection failures), limited to what is safe to repeat:
`/info` and `/agents/state` read only, so they retry on all of those; `/actions/execute`
and `/agents/execute` have effects, so they retry only when the request provably did not
run (no connection, or 408/429/503) and never once an answer has started.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import orjson
import structlog

from copilot_runtime._exceptions import (
    ActionError,
    ConfigurationError,
    UpstreamError,
    header_secrets,
)
from copilot_runtime._held import MAX_UPSTREAM_EVENT_BYTES, HeldBytes
from copilot_runtime._input import RunInput
from copilot_runtime._limits import MAX_JSON_DEPTH, decode_json, nests_too_deep
from copilot_runtime.actions import Action
from copilot_runtime.agents._http_client import (
    SessionHolder,
    Timeouts,
    error_for_exception,
    error_for_status,
)
from copilot_runtime.agents._legacy import (
    LangGraphJsonlTranslator,
    RuntimeEventTranslator,
    parameters_schema,
)
from copilot_runtime.agents._wire import RemoteEventChecker
from copilot_runtime.agents.base import Agent, AgentThreadState, RunContext
from copilot_runtime.events import EventBatches
from copilot_runtime.headers import HeaderPolicy, for_aiohttp
from copilot_runtime.messages import from_json_representation, to_legacy
from copilot_runtime.threads.base import id_problem

__all__ = ["CopilotKitRemoteEndpoint", "RemoteDiscovery", "RemoteEndpointAgent",
           "RetryPolicy"]

_log = structlog.get_logger("copilot_runtime.agents")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of a remote call: `retries` more attempts, waiting `base_delay * 2**n` (at
    most `max_delay`) seconds before each."""

    retries: int = 3
    base_delay: float = 1.0
    max_delay: float = 5.0
    #: Statuses that mean "try again" for a call that is safe to repeat.
    statuses: frozenset[int] = frozenset({408, 429, 502, 503, 504})
    #: The subset that also means "your request did not run", for calls with effects.
    unprocessed_statuses: frozenset[int] = frozenset({408, 429, 503})

    def delay(self, attempt: int) -> float:
        return float(min(self.base_delay * 2 ** attempt, self.max_delay))


@dataclass(slots=True)
class RemoteDiscovery:
    """What a remote endpoint offers: agents by name, and actions."""

    agents: dict[str, RemoteEndpointAgent] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)


class CopilotKitRemoteEndpoint:
    """The `copilotkit` SDK service at `url` (the prefix given to `add_fastapi_endpoint`).

    `headers` go with every request; `header_policy` picks which of a client's request
    headers its agents' runs forward (actions run without the client's request). `properties`
    are sent as the CopilotKit `properties` of every call.
    """

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        header_policy: HeaderPolicy | None = None,
        properties: Mapping[str, Any] | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigurationError(f"CopilotKitRemoteEndpoint url must be http(s), got {url!r}")
        self.url = url.rstrip("/")
        self.headers = {name.lower(): value for name, value in (headers or {}).items()}
        self.header_policy = header_policy or HeaderPolicy()
        self.properties = dict(properties or {})
        self.timeouts = timeouts or Timeouts()
        self.retry = retry or RetryPolicy()
        self._sessions = SessionHolder()

    # -- calls ---------------------------------------------------------------------------

    async def discover(self, headers: Mapping[str, str] | None = None) -> RemoteDiscovery:
        """The endpoint's agents and actions, from `POST /info`."""
        info = await self._json("/info", {"properties": self.properties}, "The remote endpoint",
                                headers, safe=True)
        found = RemoteDiscovery()
        actions, agents = info.get("actions") or [], info.get("agents") or []
        if not isinstance(actions, list) or not isinstance(agents, list):
            raise UpstreamError("The remote endpoint answered /info with 'actions' or "
                                "'agents' that is not a list")
        names: set[str] = set()
        for item in actions:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                continue
            # One action the runtime cannot offer is left out, not the endpoint's others
            # (a name a model cannot call, parameters of the wrong shape, a name twice).
            name = item["name"]
            try:
                if name in names:
                    raise ConfigurationError("the endpoint offers another action of this name")
                found.actions.append(self._action(item))
                names.add(name)
            except (ConfigurationError, TypeError, ValueError, AttributeError,
                    RecursionError) as exc:
                _log.warning("remote action left out", action=name[:100],
                             reason=str(exc)[:200] if isinstance(exc, ConfigurationError)
                             else f"its parameters are of an unexpected shape ({exc!r:.100})")
        for item in agents:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                name = item["name"]
                if not name or "/" in name or id_problem(name) is not None:
                    _log.warning("remote agent left out: its name cannot be an agent id",
                                 agent=name[:100])
                    continue
                found.agents[name] = RemoteEndpointAgent(
                    self, name, kind=str(item.get("type") or ""),
                    description=str(item.get("description") or ""))
        return found

    async def execute_action(self, name: str, arguments: Mapping[str, Any],
                             headers: Mapping[str, str] | None = None) -> Any:
        """`POST /actions/execute`: the action's `result`."""
        answer = await self._json("/actions/execute", {
            "name": name, "arguments": dict(arguments), "properties": self.properties},
            f"Remote action '{name}'", headers, safe=False)
        return answer.get("result")

    async def agent_state(self, name: str, thread_id: str,
                          headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """`POST /agents/state`: `{threadId, threadExists, state, messages}`."""
        return await self._json("/agents/state", {
            "threadId": thread_id, "name": name, "properties": self.properties},
            f"Remote agent '{name}'", headers, safe=True)

    async def aclose(self) -> None:
        await self._sessions.aclose()

    # -- plumbing ------------------------------------------------------------------------

    def _action(self, item: dict[str, Any]) -> Action:
        name: str = item["name"]

        async def call_remote(**arguments: Any) -> Any:
            try:
                return await self.execute_action(name, arguments)
            except UpstreamError as exc:
                raise ActionError(exc.message) from None

        return Action(name, call_remote, description=str(item.get("description") or ""),
                      parameters=parameters_schema(item.get("parameters")))

    def request_headers(self, forwarded: Mapping[str, str] | None) -> dict[str, str]:
        return {**for_aiohttp(self.header_policy.select(forwarded or {})), **self.headers,
                "content-type": "application/json"}

    async def _json(self, path: str, body: dict[str, Any], what: str,
                    forwarded: Mapping[str, str] | None, *, safe: bool) -> dict[str, Any]:
        async with self.post(path, body, what, forwarded, safe=safe) as response:
            try:
                text = await _bounded_body(response, what)
                answer = decode_json(text)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise error_for_exception(exc, what, self.url + path) from None
            except orjson.JSONDecodeError:
                raise UpstreamError(f"{what} answered with something other than JSON") \
                    from None
        if not isinstance(answer, dict):
            raise UpstreamError(f"{what} answered with something other than a JSON object")
        if nests_too_deep(answer, text):
            raise UpstreamError(f"{what} answered with JSON nested deeper than {MAX_JSON_DEPTH} "
                                "levels")
        return answer

    def post(self, path: str, body: dict[str, Any], what: str,
             forwarded: Mapping[str, str] | None, *, safe: bool) -> _Post:
        return _Post(self, path, body, what, forwarded, safe)


#: The largest answer read from `/info`, `/actions/execute` or `/agents/state`: one line of
#: the endpoint's run streams may be as large (`MAX_UPSTREAM_EVENT_BYTES`), and a thread's
#: state is what such a line carries; an action's result is refused past a far smaller
#: bound anyway (`actions.MAX_ACTION_RESULT_BYTES`).
MAX_ANSWER_BYTES: Final = MAX_UPSTREAM_EVENT_BYTES


async def _bounded_body(response: aiohttp.ClientResponse, what: str) -> bytes:
    """The answer's body, read as it comes; past `MAX_ANSWER_BYTES` (or declared so) the
    remote's error, before the rest is read."""
    limit = MAX_ANSWER_BYTES
    error = UpstreamError(f"{what} answered more than {limit} bytes")
    if response.content_length is not None and response.content_length > limit:
        raise error
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise error
        parts.append(chunk)
    return b"".join(parts)


class _Post:
    """`async with`: a POST that retries per the policy, yielding a 2xx response."""

    def __init__(self, endpoint: CopilotKitRemoteEndpoint, path: str, body: dict[str, Any],
                 what: str, forwarded: Mapping[str, str] | None, safe: bool) -> None:
        self.endpoint, self.path, self.what, self.safe = endpoint, path, what, safe
        self.body = orjson.dumps(body)
        self.headers = endpoint.request_headers(forwarded)
        self.response: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        endpoint, policy = self.endpoint, self.endpoint.retry
        url = endpoint.url + self.path
        retry_statuses = policy.statuses if self.safe else policy.unprocessed_statuses
        for attempt in range(policy.retries + 1):
            last = attempt == policy.retries
            try:
                response = await endpoint._sessions.get().post(
                    url, data=self.body, headers=self.headers,
                    timeout=endpoint.timeouts.client_timeout(),
                    allow_redirects=False)  # (see `HttpAgent`: headers would follow it)
            except aiohttp.ClientConnectorError as exc:  # never connected: safe to repeat
                if last:
                    raise error_for_exception(exc, self.what, url) from None
            except (aiohttp.ClientError, TimeoutError) as exc:
                if last or not self.safe:
                    raise error_for_exception(exc, self.what, url) from None
            else:
                if response.status < 300:
                    self.response = response
                    return response
                if last or response.status not in retry_statuses:
                    error = await error_for_status(response, self.what,
                                                   header_secrets(endpoint.headers))
                    response.release()
                    raise error
                response.release()
            _log.info("retrying remote call", target=self.what, attempt=attempt + 1)
            await asyncio.sleep(policy.delay(attempt))
        raise AssertionError("unreachable")  # the last attempt returns or raises

    async def __aexit__(self, *exc_info: object) -> None:
        if self.response is not None:
            self.response.release()


class RemoteEndpointAgent(Agent):
    """An agent of a `CopilotKitRemoteEndpoint`; `kind` is its `type` from `/info`."""

    class_name = "RemoteEndpointAgent"

    def __init__(self, endpoint: CopilotKitRemoteEndpoint, name: str, *, kind: str = "",
                 description: str = "") -> None:
        super().__init__(description=description)
        self.endpoint = endpoint
        self.name = name
        self.kind = kind

    def capabilities(self) -> dict[str, Any]:
        return {"tools": {"supported": True, "clientProvided": True},
                "transport": {"streaming": True}}

    def run(self, input: RunInput, context: RunContext) -> EventBatches:
        return self._run(input, context)

    async def _run(self, input: RunInput, context: RunContext) -> EventBatches:
        what = f"Remote agent '{context.agent_id}'"
        known = header_secrets(self.endpoint.headers)  # (a remote may echo its key)
        history = [m["id"] for m in input.raw.get("messages") or ()
                   if isinstance(m, dict) and isinstance(m.get("id"), str)]
        translator = (LangGraphJsonlTranslator(what, known, history) if self.kind == "langgraph"
                      else RuntimeEventTranslator(what, known, history))
        checker = RemoteEventChecker(what, known)
        url = self.endpoint.url + "/agents/execute"
        async with self.endpoint.post("/agents/execute", self._body(input), what,
                                      context.headers, safe=False) as response:
            try:
                async for line in _json_lines(response.content, what):
                    try:
                        translated = translator.translate(line)
                    except (AttributeError, TypeError, KeyError, ValueError):
                        raise UpstreamError(f"{what} sent a line of an unexpected shape") \
                            from None
                    batch = checker.events(translated)
                    if batch:
                        yield batch
                    if checker.failure is not None:
                        raise checker.failure  # after the good events of the same line
                    if checker.finished:
                        return
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise error_for_exception(exc, what, url) from None
        tail = checker.events(_closing(translator))
        if tail:
            yield tail
        if checker.failure is not None:
            raise checker.failure

    async def load_state(self, thread_id: str, *,
                         headers: Mapping[str, str] | None = None) -> AgentThreadState:
        """The thread as the service keeps it (`/agents/state`)."""
        answer = await self.endpoint.agent_state(self.name, thread_id, headers)
        state = answer.get("state")
        return AgentThreadState(
            thread_id, exists=bool(answer.get("threadExists")),
            state={k: v for k, v in state.items() if k != "messages"}
            if isinstance(state, dict) else {},
            messages=from_json_representation(answer.get("messages")))

    async def aclose(self) -> None:
        # The endpoint's connections are shared by its agents and actions; closing them
        # twice is harmless, and a later call opens a new pool.
        await self.endpoint.aclose()

    def _body(self, input: RunInput) -> dict[str, Any]:
        model, raw = input.model, input.raw
        props = raw.get("forwardedProps")
        forwarded: dict[str, Any] = props if isinstance(props, dict) else {}
        body: dict[str, Any] = {
            "name": self.name, "threadId": model.thread_id,
            "state": raw.get("state") if isinstance(raw.get("state"), dict) else {},
            "messages": to_legacy(raw.get("messages") or ()),
            "actions": [{"name": t.name, "description": t.description,
                         "parameters": t.parameters or {"type": "object", "properties": {}}}
                        for t in model.tools or ()],
            "properties": {**self.endpoint.properties, **forwarded},
            "metaEvents": [],
        }
        if isinstance(forwarded.get("nodeName"), str):
            body["nodeName"] = forwarded["nodeName"]
        if isinstance(forwarded.get("config"), dict):
            body["config"] = forwarded["config"]
        resume = _resume_value(input)
        if resume is not None:
            body["metaEvents"] = [{"name": "LangGraphInterruptEvent", "value": "",
                                   "response": resume}]
        return body


def _resume_value(input: RunInput) -> Any:
    """The interrupt answer of a run: AG-UI `resume`, or the legacy `command.resume`."""
    for entry in input.model.resume or ():
        if entry.status == "resolved":
            payload = entry.payload
            return payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    props = input.raw.get("forwardedProps")  # (a client may send any JSON there)
    command = props.get("command") if isinstance(props, dict) else None
    return command.get("resume") if isinstance(command, dict) else None


def _closing(translator: LangGraphJsonlTranslator | RuntimeEventTranslator) -> list[Any]:
    """The end of a JSONL stream is the end of the run: close what it left open."""
    tail: list[Any] = []
    translator.close_text(tail)
    translator.close_call(tail)
    translator.finish_step(tail)
    return tail


async def _json_lines(content: aiohttp.StreamReader, what: str
                      ) -> AsyncIterator[dict[str, Any]]:
    """The objects of a JSONL body, as lines complete (blank lines skipped); a line held past
    the bound (`HeldBytes`) is the remote's error, said of `what` (the agent, named)."""
    held = HeldBytes(what, UpstreamError, record="a line")
    async for chunk in content.iter_any():
        data = held.take(chunk)
        if data is None:
            continue
        *lines, rest = data.split(b"\n")
        held.hold(rest)
        for line in lines:
            if line.strip():
                yield _parse_line(line, what)
    rest = held.rest()
    if rest.strip():
        yield _parse_line(rest, what)


def _parse_line(line: bytes, what: str) -> dict[str, Any]:
    try:
        value = decode_json(line)
    except orjson.JSONDecodeError:
        raise UpstreamError(f"{what} sent a line that is not JSON") from None
    if not isinstance(value, dict):
        raise UpstreamError(f"{what} sent a line that is not a JSON object")
    if nests_too_deep(value, line):
        raise UpstreamError(f"{what} sent a line nested deeper than {MAX_JSON_DEPTH} levels")
    return value
