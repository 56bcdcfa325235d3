"""A scripted stand-in for a LangGraph Platform deployment, for what a real one rarely does
on demand: a run stream cut short, an `error` event of a given class, a run that timed
out, an answer of HTTP 503, text no client can parse, an HTML page where JSON belongs.

It answers the few routes `LangGraphPlatformAgent` calls, as `langgraph-api` shapes them:
the assistant search and schemas, a thread's state (its `values` fixed by the test), the
run stream (the test's SSE frames, in order, then the connection closes) and the run's
status. Serve it with `tests.conftest.serve(fake.app)`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

ASSISTANT_ID = "a0000000-0000-4000-8000-000000000001"
RUN_ID = "r0000000-0000-4000-8000-000000000001"
_SCHEMA = {"type": "object", "properties": {"messages": {"type": "array"}}}


def frame(event: str, data: Any) -> bytes:
    """One SSE frame as `langgraph-api` writes it (`data` JSON, or bytes as they are)."""
    body = data if isinstance(data, bytes) else json.dumps(data).encode()
    return b"event: " + event.encode() + b"\r\ndata: " + body + b"\r\n\r\n"


def model_stream(text: str, *, node: str = "chat", run_id: str = "m1") -> dict[str, Any]:
    """A LangChain `on_chat_model_stream` event carrying `text`."""
    return {"event": "on_chat_model_stream", "name": "ChatOpenAI", "run_id": run_id,
            "parent_ids": [], "tags": [], "metadata": {"langgraph_node": node},
            "data": {"chunk": {"type": "AIMessageChunk", "id": "ai-1", "content": text}}}


def tool_call_stream(args: str, *, name: str | None = None, call_id: str | None = None,
                     run_id: str = "m1") -> dict[str, Any]:
    """An `on_chat_model_stream` event carrying one tool call chunk."""
    chunk = {"type": "tool_call_chunk", "index": 0, "args": args, "name": name, "id": call_id}
    return {"event": "on_chat_model_stream", "name": "ChatOpenAI", "run_id": run_id,
            "parent_ids": [], "tags": [], "metadata": {"langgraph_node": "chat"},
            "data": {"chunk": {"type": "AIMessageChunk", "id": "ai-1", "content": "",
                               "tool_call_chunks": [chunk]}}}


@dataclass
class FakePlatform:
    """`frames`: the run stream's SSE bytes; `run_status`: what `GET .../runs/{id}` says
    (None: 404, a server that does not keep its runs);
    `values`: the thread's state; `fail_with`: an HTTP status every route answers with;
    `unusable`: "search", "state" or "stream": that route answers 200 with an HTML page (a
    proxy's), or "search-object": the assistant search answers an object; `redirect`:
    (route, status): that route ("search", "stream", "cancel" or "delete", a thread's)
    answers that 3xx status, pointing at another host (a proxy's move to https, a moved
    deployment)."""

    frames: list[bytes] = field(default_factory=list)
    run_status: str | None = "success"
    values: dict[str, Any] = field(default_factory=dict)
    fail_with: int | None = None
    unusable: str | None = None
    redirect: tuple[str, int] | None = None
    #: The routes called, as "METHOD path", in order.
    calls: list[str] = field(default_factory=list)
    #: The headers of each call, in the same order.
    headers: list[dict[str, str]] = field(default_factory=list)
    #: What the schemas route answers (None: every schema `{messages}` only).
    schemas: dict[str, Any] | None = None
    #: The JSON body of each run stream's request, in order.
    run_bodies: list[dict[str, Any]] = field(default_factory=list)
    #: More of the assistant the search answers (its `config`, `context`).
    assistant: dict[str, Any] = field(default_factory=dict)

    @property
    def app(self) -> Starlette:
        async def any_route(request: Request) -> Response:
            self.calls.append(f"{request.method} {request.url.path}")
            self.headers.append(dict(request.headers))
            if self.fail_with is not None:
                return JSONResponse({"detail": "Service Unavailable"},
                                    status_code=self.fail_with)
            path = request.url.path
            if self.redirect is not None and _is_route(self.redirect[0], request):
                return Response(status_code=self.redirect[1],
                                headers={"Location": f"https://elsewhere.invalid{path}"})
            if self.unusable == "search-object" and path == "/assistants/search":
                return JSONResponse({"assistants": []})
            if self.unusable is not None and path.endswith(
                    {"search": "/search", "state": "/state", "stream": "/runs/stream"}.get(
                        self.unusable, "?")):
                return Response("<html><body>Gateway</body></html>", media_type="text/html")
            return await self._answer(request)

        return Starlette(routes=[Route("/{path:path}", any_route,
                                       methods=["GET", "POST", "DELETE", "PATCH"])])

    async def _answer(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        if path == "/assistants/search":
            return JSONResponse([{"assistant_id": ASSISTANT_ID, "graph_id": "fake",
                                  **self.assistant}])
        if path.endswith("/schemas"):
            return JSONResponse(self.schemas or {
                "graph_id": "fake", "input_schema": _SCHEMA, "output_schema": _SCHEMA,
                "state_schema": _SCHEMA})
        if path.endswith("/state"):
            return JSONResponse({"values": self.values, "next": [], "tasks": [],
                                 "checkpoint": {"checkpoint_id": "c1", "checkpoint_ns": ""},
                                 "metadata": {}, "created_at": None})
        if path.endswith("/runs/stream") and method == "POST":
            self.run_bodies.append(json.loads(await request.body()))
            thread = path.split("/")[2]
            return StreamingResponse(
                self._stream(), media_type="text/event-stream",
                headers={"Content-Location": f"/threads/{thread}/runs/{RUN_ID}"})
        if f"/runs/{RUN_ID}" in path and self.run_status is not None:
            if path.endswith("/cancel"):
                return Response(status_code=202)
            return JSONResponse({"run_id": RUN_ID, "status": self.run_status})
        if path == "/threads" and method == "POST":
            return JSONResponse({"thread_id": "t", "values": None})
        return JSONResponse({"detail": "not found"}, status_code=404)

    async def _stream(self) -> AsyncIterator[bytes]:
        yield frame("metadata", {"run_id": RUN_ID, "attempt": 1})
        for item in self.frames:
            yield item


def _is_route(route: str, request: Request) -> bool:
    """Whether `request` is the call `route` names (see `FakePlatform.redirect`)."""
    path, method = request.url.path, request.method
    return {"search": path == "/assistants/search",
            "stream": path.endswith("/runs/stream"),
            "cancel": path.endswith("/cancel"),
            "delete": method == "DELETE" and path.startswith("/threads/")}[route]
