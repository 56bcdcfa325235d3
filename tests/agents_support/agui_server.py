"""A scripted remote AG-UI agent server on loopback, for `HttpAgent` tests.

`POST /agent` takes a `RunAgentInput` and answers AG-UI SSE like a Python AG-UI server
would (`protocolVersion` on RUN_STARTED, explicit nulls in optional fields). What it does
depends on the last message:

* ``die:N``: N events after RUN_STARTED, then the connection is cut (the process dies);
* ``error:NNN``: HTTP NNN with a JSON error body;
* ``slow:MS text``: the normal answer with MS milliseconds between events;
* ``hang``: RUN_STARTED, then silence;
* ``noend``: a message, then the stream closes without RUN_FINISHED;
* ``chunks``: the answer as TEXT_MESSAGE_CHUNK and TOOL_CALL_CHUNK events;
* ``broken``: content for a message that was never started;
* ``runerror``: RUN_ERROR with a code;
* ``tool:NAME {json}``: a call to the frontend tool NAME;
* a tool result: ``remote got: <content>``;
* anything else: a step, a state snapshot and delta, and ``remote: <text>``.

Every request (headers and body) is kept in `requests`. Run it alone with
``python -m tests.agents_support.agui_server --port 8100``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
from typing import Any

import orjson
from aiohttp import web

from copilot_runtime.testing.loopback import LoopbackServer, pause

_DIRECTIVE = re.compile(r"^(die|error|slow):(\d+)\s*(.*)$", re.S)
_TOOL = re.compile(r"^tool:([A-Za-z0-9_-]+)\s*(.*)$", re.S)


def _last_text(body: dict[str, Any]) -> tuple[str, str]:
    messages = body.get("messages") or [{}]
    last = messages[-1] if isinstance(messages[-1], dict) else {}
    content = last.get("content")
    return str(last.get("role", "")), content if isinstance(content, str) else ""


def script(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The events to send for `body`, and how: {"die": n, "delay": s, "status": code}."""
    thread, run = body.get("threadId", ""), body.get("runId", "")
    role, text = _last_text(body)
    how: dict[str, Any] = {}
    started = {"type": "RUN_STARTED", "threadId": thread, "runId": run,
               "parentRunId": None, "protocolVersion": "1.0"}
    finished = {"type": "RUN_FINISHED", "threadId": thread, "runId": run, "result": None}
    message_id = f"msg-{run}"

    def message(reply: str, pieces: int = 3) -> list[dict[str, Any]]:
        size = max(1, -(-len(reply) // pieces))
        return [
            {"type": "TEXT_MESSAGE_START", "messageId": message_id, "role": "assistant",
             "timestamp": None},
            *({"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id,
               "delta": reply[i:i + size]} for i in range(0, len(reply), size)),
            {"type": "TEXT_MESSAGE_END", "messageId": message_id}]

    directive = _DIRECTIVE.match(text)
    if directive:
        kind, number, rest = directive.group(1), int(directive.group(2)), directive.group(3)
        if kind == "error":
            return [], {"status": number}
        if kind == "die":
            how["die"] = number
        else:
            how["delay"] = number / 1000
        text = rest or text
    if role == "tool":
        return [started, *message(f"remote got: {text}"), finished], how
    if text == "hang":
        return [started], {"hang": True}
    if text == "noend":
        return [started, *message("no end")], how
    if text == "broken":
        return [started, {"type": "TEXT_MESSAGE_CONTENT", "messageId": "ghost",
                          "delta": "boo"}, finished], how
    if text == "runerror":
        return [started, {"type": "RUN_ERROR", "message": "remote agent failed on purpose",
                          "code": "REMOTE_FAILURE"}], how
    if text == "chunks":
        return [started,
                {"type": "TEXT_MESSAGE_CHUNK", "messageId": message_id, "role": "assistant",
                 "delta": "chunked "},
                {"type": "TEXT_MESSAGE_CHUNK", "delta": "text"},
                {"type": "TOOL_CALL_CHUNK", "toolCallId": "call-chunk", "toolCallName": "lookup",
                 "parentMessageId": message_id, "delta": '{"q":'},
                {"type": "TOOL_CALL_CHUNK", "delta": '"x"}'},
                finished], how
    tool = _TOOL.match(text)
    if tool:
        call = f"call-{run}"
        return [started,
                {"type": "TOOL_CALL_START", "toolCallId": call, "toolCallName": tool.group(1),
                 "parentMessageId": message_id},
                {"type": "TOOL_CALL_ARGS", "toolCallId": call, "delta": tool.group(2) or "{}"},
                {"type": "TOOL_CALL_END", "toolCallId": call},
                finished], how
    state = body.get("state") or {}
    runs = (state.get("runs") or 0) + 1 if isinstance(state, dict) else 1
    return [started,
            {"type": "STEP_STARTED", "stepName": "plan"},
            {"type": "STATE_SNAPSHOT", "snapshot": {
                "runs": runs, "stage": "planning", "lastInput": text, "nothing": None}},
            {"type": "STATE_DELTA", "delta": [
                {"op": "replace", "path": "/stage", "value": "answering"}]},
            *message(f"remote: {text}"),
            {"type": "STEP_FINISHED", "stepName": "plan"},
            finished], how


class ScriptedAGUIServer(LoopbackServer):
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.requests: list[dict[str, Any]] = []
        self.disconnects = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/agent"

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/agent", self._agent)

    async def _agent(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.requests.append({"headers": {k.lower(): v for k, v in request.headers.items()},
                              "body": body})
        events, how = script(body)
        if "status" in how:
            return web.json_response({"error": f"remote error {how['status']}"},
                                     status=how["status"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            for index, event in enumerate(events):
                if "die" in how and index > how["die"]:
                    assert request.transport is not None
                    request.transport.abort()  # as if the agent's process died
                    return response
                await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
                if how.get("delay") and not await pause(request, how["delay"]):
                    self.disconnects += 1
                    return response
            if how.get("hang") and not await pause(request, 3600):
                self.disconnects += 1
                return response
            await response.write_eof()
        except ConnectionResetError:
            self.disconnects += 1
        return response


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="scripted AG-UI agent server")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args(argv)
    server = ScriptedAGUIServer(port=args.port)

    async def serve() -> None:
        await server.start()
        print(f"AG-UI agent listening on {server.url}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
