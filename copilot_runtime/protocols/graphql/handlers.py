"""The GraphQL protocol of CopilotKit 1.0 to 1.10 on the runtime's base URL.

    POST {base}  {"query", "variables", "operationName"}   any operation
    GET  {base}?query=...&variables=...&operationName=...   queries only

Queries (`hello`, `availableAgents`, `loadAgentState`, introspection) run through
graphql-core. `generateCopilotResponse` does not: its document is parsed, validated and
compiled once (`documents`), its variables are coerced once per request, and the run's
events are encoded straight into increments (`increments`) while `stream_run` drives the
run, so a client that leaves cancels it and its upstream LLM request.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from inspect import isawaitable
from typing import Any

import orjson
from graphql import (
    ExecutionResult,
    GraphQLError,
    OperationDefinitionNode,
    OperationType,
    experimental_execute_incrementally,
    get_operation_ast,
)
from graphql.execution.values import get_argument_values

from copilot_runtime._exceptions import (
    ClientDisconnected,
    CopilotRuntimeError,
    InvalidRequestError,
    RateLimitedError,
)
from copilot_runtime._limits import check_json_text
from copilot_runtime.protocols.graphql.agent_tools import (
    answered_later,
    session_run,
    with_request_mcp,
)
from copilot_runtime.protocols.graphql.documents import DocumentCache, Prepared
from copilot_runtime.protocols.graphql.errors import error_extensions, said_of
from copilot_runtime.protocols.graphql.increments import ResponseEncoder, result_message_ids
from copilot_runtime.protocols.graphql.plan import ROOT_FIELD, OperationPlan
from copilot_runtime.protocols.graphql.queries import (
    QueryContext,
    agent_not_found,
    query_root,
    stored_in_place,
)
from copilot_runtime.protocols.graphql.schema import copilot_schema
from copilot_runtime.protocols.graphql.transport import (
    MULTIPART,
    accepts_multipart,
    json_content_type,
    request_errors,
    send_refusal,
    send_result,
    version_header,
)
from copilot_runtime.protocols.graphql.variables import VariableCoercer
from copilot_runtime.protocols.http import Request, leaving_seen, stream_run
from copilot_runtime.runtime import CopilotRuntime

__all__ = ["GraphQLProtocol"]


#: Fields one query may resolve. The document bounds hold what is written, not what a
#: list multiplies at execution: 300 selections walking the schema's types under aliases
#: resolved ~22,000 fields, holding the event loop ~0.5 s on every request. A whole
#: introspection query resolves ~3,200.
MAX_RESOLVED_FIELDS = 4_000


class _FieldBudget:
    """graphql-core middleware counting the fields a query resolves; past the budget each
    field fails at once (its subtree never resolves) and `spent` says the answer is a 400."""

    __slots__ = ("left", "spent")

    def __init__(self, fields: int) -> None:
        self.left = fields
        self.spent = False

    def resolve(self, resolve: Any, root: Any, info: Any, **args: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            self.spent = True
            raise GraphQLError("field budget spent")
        return resolve(root, info, **args)


class _BadRequest(Exception):
    """A request that cannot be executed: answered 400 (or `status`) with these errors."""

    def __init__(self, payload: dict[str, Any], status: int = 400,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__()
        self.payload = payload
        self.status = status
        self.headers = headers or []


def _bad(message: str, status: int = 400, allow: bytes | None = None,
         code: str = "BAD_REQUEST") -> _BadRequest:
    errors = {"errors": [{"message": message, "extensions": {"code": code}}]}
    return _BadRequest(errors, status, [(b"allow", allow)] if allow else [])


def _persisted_only(extensions: Any, status: int = 400,
                    allow: bytes | None = None) -> _BadRequest | None:
    """The refusal of an automatic persisted query's hash sent without its text, if that is
    what `extensions` holds: Apollo's persisted-query link matches this message (older) or
    code (newer), then sends the query itself."""
    if isinstance(extensions, dict) and "persistedQuery" in extensions:
        return _bad("PersistedQueryNotSupported", status, allow, "PERSISTED_QUERY_NOT_SUPPORTED")
    return None


class GraphQLProtocol:
    def __init__(self, runtime: CopilotRuntime, *, keepalive: float | None = 15.0) -> None:
        self.runtime = runtime
        #: Seconds of silence after which a response in progress gets a keep-alive.
        self.keepalive = keepalive
        self.schema = copilot_schema()
        self.documents = DocumentCache(self.schema)
        self.variables = VariableCoercer(self.schema)
        self._root = query_root(runtime)

    # -- entry points --------------------------------------------------------------------

    async def post(self, request: Request, data: dict[str, Any]) -> None:
        """Serve a decoded POST body that has a `query`."""
        try:
            query = data.get("query")
            variables = data.get("variables")
            name = data.get("operationName")
            if not isinstance(query, str) or not query.strip():
                raise _persisted_only(data.get("extensions")) or _bad(
                    "The request has no GraphQL query")
            if variables is not None and not isinstance(variables, dict):
                raise _bad("'variables' must be a JSON object")
            if name is not None and not isinstance(name, str):
                raise _bad("'operationName' must be a string")
            await self._serve(request, query, variables or {}, name, via_get=False)
        except _BadRequest as exc:
            await send_refusal(request, exc.status, exc.payload, exc.headers)

    async def get(self, request: Request) -> None:
        """Serve `GET ?query=` (queries only, as GraphQL over HTTP allows)."""
        params = urllib.parse.parse_qs(request.query.decode("latin-1"))
        try:
            query = params.get("query", [""])[0]
            variables: Any = None
            if params.get("variables", [""])[0]:
                try:
                    variables = check_json_text(params["variables"][0], "'variables'")
                except orjson.JSONDecodeError:
                    raise _bad("'variables' is not valid JSON") from None
                except InvalidRequestError as exc:
                    raise _bad(exc.message) from None
            if variables is not None and not isinstance(variables, dict):
                raise _bad("'variables' must be a JSON object")
            if not query.strip():
                raise _bad("The request has no GraphQL query")
            name = params.get("operationName", [None])[0]
            await self._serve(request, query, variables or {}, name, via_get=True)
        except _BadRequest as exc:
            await send_refusal(request, exc.status, exc.payload, exc.headers)

    async def not_one_operation(self, request: Request, data: Any) -> None:
        """The answer to a JSON body without `query` (nor the envelope's `method`): a batch,
        a persisted query's hash, anything else."""
        if isinstance(data, dict):
            await self.post(request, data)
            return
        message = ("Batched requests are not supported: send one operation per request"
                   if isinstance(data, list) else
                   'The request body must be a JSON object: {"query": ...}')
        error = _bad(message)
        await send_refusal(request, error.status, error.payload)

    async def not_served(self, request: Request, status: int, message: str) -> None:
        """A request this endpoint does not serve (a method, a content type), in the error
        form the 1.10 client reads; a GET with a persisted query's hash says that it is not
        supported, so an APQ client sends the query itself."""
        allow = b"POST" if status == 405 else None
        error = None
        if request.method == "GET":
            params = urllib.parse.parse_qs(request.query.decode("latin-1"))
            try:
                extensions = check_json_text(params.get("extensions", ["null"])[0],
                                             "'extensions'")
            except (orjson.JSONDecodeError, InvalidRequestError):
                extensions = None
            error = _persisted_only(extensions, status, allow)
        error = error or _bad(message, status, allow)
        await send_refusal(request, error.status, error.payload, error.headers)

    async def invalid_json(self, request: Request, message: str | None = None) -> None:
        """The answer to a GraphQL client whose body is not JSON (or nests too deep)."""
        message = message or "The request body is not valid JSON"
        await send_refusal(request, 400, {"errors": [
            {"message": message, "extensions": {"code": "BAD_REQUEST"}}]})

    async def refuse(self, request: Request, status: int, message: str, code: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """The answer to a 1.10 client's request the endpoint refuses before GraphQL reads
        it (credentials, a hook, the body's size or pace, a failure): see `send_refusal`."""
        await send_refusal(request, status, {"errors": [{"message": message, "extensions": {
            "code": code, "statusCode": status}}], "data": None}, headers)

    # -- operations ----------------------------------------------------------------------

    async def _serve(self, request: Request, query: str, variables: dict[str, Any],
                     name: str | None, *, via_get: bool) -> None:
        prepared = self.documents.get(query)
        if prepared.document is None:
            raise _BadRequest(request_errors(prepared.errors, prepared.code))
        operation = get_operation_ast(prepared.document, name)
        if operation is None:
            raise _bad(f"Unknown operation named '{name}'" if name else
                       "The document has several operations: name one in 'operationName'")
        if operation.operation != OperationType.QUERY and via_get:
            raise _bad("Only queries may be sent with GET; use POST", 405, allow=b"POST")
        coerced = prepared.coerce(self.variables, operation, variables, slow=False)
        if coerced is None:  # a variable graphql-core must judge: its walk, off the loop
            coerced = await asyncio.to_thread(prepared.coerce, self.variables, operation,
                                              variables)
            assert coerced is not None
        if isinstance(coerced, list):
            raise _BadRequest(request_errors(coerced))
        if operation.operation == OperationType.MUTATION:
            plan = self._plan(prepared, operation, coerced)
            await self._generate(request, plan, coerced)
        else:
            await self._query(request, prepared, operation, variables)

    async def _query(self, request: Request, prepared: Prepared,
                     operation: OperationDefinitionNode, variables: dict[str, Any]) -> None:
        name = operation.name.value if operation.name else None
        # The schema has @defer/@stream, which graphql-core's plain `execute` refuses; the
        # document has them removed, so the result always comes in one piece.
        budget = _FieldBudget(MAX_RESOLVED_FIELDS)
        result = experimental_execute_incrementally(
            self.schema, prepared.plain(), root_value=self._root, variable_values=variables,
            operation_name=name, middleware=[budget],
            context_value=QueryContext(request.forwardable_headers(
                credentials=self.runtime.forwards_credentials), request.info))
        if isawaitable(result):
            result = await result
        assert isinstance(result, ExecutionResult)
        if budget.spent:
            error = _bad(f"The query resolves more than {MAX_RESOLVED_FIELDS:,} fields: "
                         "ask for fewer")
            await send_refusal(request, error.status, error.payload)
            return
        payload: dict[str, Any] = {}
        if result.errors:
            payload["errors"] = [e.formatted for e in result.errors]
        payload["data"] = result.data
        await send_result(request, 200, orjson.dumps(payload))

    def _plan(self, prepared: Prepared, operation: OperationDefinitionNode,
              coerced: Any) -> OperationPlan:
        try:
            return prepared.plan(self.schema, operation, coerced)
        except GraphQLError as exc:
            raise _BadRequest(request_errors([exc], "GRAPHQL_VALIDATION_FAILED")) from None

    async def _generate(self, request: Request, plan: OperationPlan, coerced: Any) -> None:
        mutation = self.schema.mutation_type
        assert mutation is not None
        try:
            args = get_argument_values(mutation.fields[ROOT_FIELD], plan.field_node, coerced)
        except GraphQLError as exc:
            raise _BadRequest(request_errors([exc])) from None
        runtime = self.runtime
        try:
            wanted, agent = session_run(
                runtime, args["data"], args.get("properties"),
                has_public_key=b"x-copilotcloud-public-api-key" in request.headers)
            if wanted.agent_id not in runtime.agents:
                raise agent_not_found(wanted.agent_id, runtime)
            agent = with_request_mcp(runtime, args.get("properties"), wanted.agent_id, agent)
            forwarded = request.forwardable_headers(
                credentials=runtime.forwards_credentials)
            # `agent`, when set, is the session's agent wrapped with its server-side tools.
            run_input = await stored_in_place(runtime, wanted.input, request.info)
            with leaving_seen(request):
                run = await runtime.start_run(wanted.agent_id, run_input, forwarded,
                                              follow_up_server_tools=False, agent=agent,
                                              request=request.info,
                                              topics=_topics(args["data"]))
        except ClientDisconnected:
            return  # left while its run waited for a stopped one: nobody to answer
        except RateLimitedError as exc:
            # Before anything streamed: the plain HTTP answer, so other clients and proxies
            # see it (the 1.10 client gets 200: `send_refusal`).
            error = GraphQLError(exc.message, plan.field_node, path=[plan.root_key],
                                 extensions=error_extensions(exc, exc.message))
            await send_refusal(request, 429, {"errors": [error.formatted], "data": None},
                               [(b"retry-after", str(exc.retry_after).encode())])
            return
        except CopilotRuntimeError as exc:
            said = said_of(exc)
            error = GraphQLError(said, plan.field_node, path=[plan.root_key],
                                 extensions=error_extensions(exc, said))
            await send_result(request, 200, orjson.dumps(
                {"errors": [error.formatted], "data": None}))
            return
        # Its follow-up sends a server-side action's result back under the response's id,
        # not the thread's: the thread keeps that id too, so the result is not kept again.
        run.wire_ids = result_message_ids
        async with run:  # given back if anything fails or is cancelled before it drives
            encoder = ResponseEncoder(
                plan, thread_id=wanted.input.thread_id, run_id=wanted.client_run_id,
                frontend_tools=wanted.frontend_tools,
                answered_later=answered_later(runtime, wanted),
                stopped=lambda: run.cancel_reason == "stop",
                incremental=accepts_multipart(request),
                agent_name=wanted.agent_id, agent_run_id=wanted.input.run_id,
                agent_state=wanted.input.raw.get("state"), refusal=run.refusal)
            if encoder.incremental:
                headers = [MULTIPART, *version_header(request)]
            else:
                headers = [(b"content-type", json_content_type(request)), *version_header(request)]
            await stream_run(request, run, encoder.encode, headers, keepalive=self.keepalive,
                             heartbeat=encoder.keepalive)


def _topics(data: Any) -> tuple[list[str], list[str]] | None:
    """`cloud.guardrails.inputValidationRules` as (allowed, denied) topics, if asked for."""
    guardrails = ((data.get("cloud") or {}).get("guardrails") or {}) if isinstance(
        data, dict) else {}
    rules = guardrails.get("inputValidationRules") or {}
    allow = [t for t in rules.get("allowList") or () if isinstance(t, str)]
    deny = [t for t in rules.get("denyList") or () if isinstance(t, str)]
    return (allow, deny) if allow or deny else None
