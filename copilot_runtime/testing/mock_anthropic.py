"""A deterministic loopback server that speaks Anthropic's Messages API (`POST /v1/messages`).

It lets the real `anthropic` SDK run end to end without a network or a key, with the same
script as `MockOpenAIServer` (``call:NAME {json}``, ``error:NNN``, ``breaks:N``, ``slow:MS``,
``chunks:N``, else ``echo: <text of the last message>``; after tool results the echo is of
the last result). ``think:`` before a message adds a thinking block when the request
enables thinking.

Like the real API it refuses what the real API refuses, with its error shapes: a missing key
(401) or ``anthropic-version`` header, a missing ``max_tokens``, a ``system`` role among the
messages, tool arguments that are not objects, a ``tool_use`` without its ``tool_result`` first in
the next turn (or a result without its call), a ``tool_result`` with ``is_error`` holding
anything but text, blank text blocks, tool schemas that are not
objects or have a combinator (``anyOf``...) at the top, two tools of one name,
``tool_choice`` without tools, a temperature outside 0..1, thinking with a forced
``tool_choice``, an empty ``messages``. A 429 carries ``retry-after``.
Run it alone with ``python -m copilot_runtime.testing.mock_anthropic``.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import orjson
from aiohttp import web

from copilot_runtime.testing.loopback import (
    LoopbackServer,
    Refused,
    serve_from_command_line,
    stream,
)
from copilot_runtime.testing.mock_openai import _plan, _split

__all__ = ["MockAnthropicServer"]

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}



def _block_text(block: Any) -> str:
    if not isinstance(block, dict):
        return ""
    if block.get("type") == "text":
        return str(block.get("text", ""))
    if block.get("type") == "tool_result":
        content = block.get("content")
        if isinstance(content, list):
            return "".join(_block_text(b) for b in content)
        return content if isinstance(content, str) else ""
    return ""


def _last_turn(body: dict[str, Any]) -> dict[str, Any]:
    """The last turn in the OpenAI shape the shared script reads."""
    last = body["messages"][-1]
    content = last.get("content")
    tool_choice = (body.get("tool_choice") or {}).get("type")
    openai_body: dict[str, Any] = {"tool_choice": "none" if tool_choice == "none" else None}
    if isinstance(content, str):
        openai_body["messages"] = [{"role": last["role"], "content": content}]
        return openai_body
    results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
    if results:
        openai_body["messages"] = [{"role": "tool", "content": _block_text(results[-1])}]
    else:
        openai_body["messages"] = [{"role": last["role"],
                                    "content": "".join(_block_text(b) for b in content)}]
    return openai_body


def validate(body: Any) -> None:
    """Refuse, as the real API does, the requests it would refuse."""
    if not isinstance(body, dict):
        raise Refused("request body must be a JSON object")
    for key in ("model", "max_tokens", "messages"):
        if key not in body:
            raise Refused(f"{key}: Field required")
    if not isinstance(body["max_tokens"], int) or body["max_tokens"] < 1:
        raise Refused("max_tokens: must be a positive integer")
    temperature = body.get("temperature")
    if temperature is not None and not 0 <= temperature <= 1:
        raise Refused("temperature: must be between 0 and 1")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled" \
            and temperature not in (None, 1):
        raise Refused("temperature may only be set to 1 when thinking is enabled")
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        raise Refused("system: Input should be a valid string or list")
    tools = body.get("tools") or []
    for i, tool in enumerate(tools):
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise Refused(f"tools.{i}.custom.input_schema.type: Field required")
        if any(key in schema for key in ("oneOf", "allOf", "anyOf")):
            raise Refused(f"tools.{i}.custom.input_schema: input_schema does not support "
                          "oneOf, allOf, or anyOf at the top level")
    if len({tool.get("name") for tool in tools}) < len(tools):
        raise Refused("tools: Tool names must be unique.")
    if body.get("tool_choice") is not None and not tools:
        raise Refused("tool_choice may only be specified while providing tools")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise Refused("messages: at least one message is required")
    thinking_on = isinstance(thinking, dict) and thinking.get("type") == "enabled"
    if thinking_on and (body.get("tool_choice") or {}).get("type") in ("any", "tool"):
        raise Refused("Thinking may not be enabled when tool_choice forces tool use.")
    # A tool loop is one assistant turn: its first assistant message must start with the
    # signed thinking (later rounds carry none).
    start = 0
    for index in range(len(messages) - 1, -1, -1):
        content = messages[index].get("content")
        if messages[index].get("role") == "user" and not (isinstance(content, list) and all(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in content)):
            start = index + 1
            break
    assistants = [m for m in messages[start:] if m.get("role") == "assistant"
                  and isinstance(m.get("content"), list)]
    if thinking_on and assistants and messages[-1].get("role") == "user" and any(
            b.get("type") == "tool_use" for b in assistants[0]["content"]):
        first = assistants[0]["content"][0]
        if first.get("type") not in ("thinking", "redacted_thinking") or (
                first.get("type") == "thinking" and not first.get("signature")):
            raise Refused(
                "messages: Expected `thinking` or `redacted_thinking`, but found "
                f"`{first.get('type')}`. When `thinking` is enabled, a final `assistant` "
                "message must start with a thinking block.")
    pending: list[str] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise Refused(f'messages.{i}.role: Input should be "user" or "assistant"')
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list) or not blocks:
            raise Refused(f"messages.{i}: all messages must have non-empty content")
        results = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
        if pending:
            # (the results come first: a text or image block before one leaves it unmatched)
            leading = itertools.takewhile(lambda b: b.get("type") == "tool_result", blocks)
            first = [b.get("tool_use_id") for b in leading]
            missing = [p for p in pending if p not in first]
            if role != "user" or missing:
                raise Refused(
                    f"messages.{i}: `tool_use` ids were found without `tool_result` blocks "
                    f"immediately after: {', '.join(missing or pending)}. Each `tool_use` "
                    f"block must have a corresponding `tool_result` block in the next message.")
        for result in results:
            if result not in pending:
                raise Refused(f"messages.{i}.content: unexpected `tool_use_id` found in "
                               f"`tool_result` blocks: {result}. Each `tool_result` block must "
                               f"have a corresponding `tool_use` block in the previous message.")
        pending = []
        for j, block in enumerate(blocks):
            kind = block.get("type")
            if kind == "text" and not str(block.get("text", "")).strip():
                raise Refused(f"messages.{i}.content.{j}.text: text content blocks must "
                               f"contain non-whitespace text")
            if kind == "tool_result" and block.get("is_error") and isinstance(
                    block.get("content"), list) and any(
                    not isinstance(b, dict) or b.get("type") != "text"
                    for b in block["content"]):
                raise Refused(f"messages.{i}.content.{j}.tool_result: all content must be "
                               f"type 'text' if 'is_error' is true")
            if kind == "tool_use":
                if role != "assistant":
                    raise Refused(f"messages.{i}.content.{j}: tool_use in a user turn")
                if not isinstance(block.get("input"), dict):
                    raise Refused(f"messages.{i}.content.{j}.tool_use.input: Input should be "
                                   f"a valid dictionary")
                pending.append(block.get("id"))


class MockAnthropicServer(LoopbackServer):
    """The mock as an object: ``async with MockAnthropicServer() as llm: llm.base_url``.

    ``requests`` holds every request body received, parsed; ``headers`` their headers.
    ``statuses`` is a status to answer the next requests with before their plan (e.g.
    ``[529, 429]``: two failures, then the answer); ``retry_after`` adds that `Retry-After`.
    """

    #: The Messages API's bound on a request: 32 MB.
    max_body = 32 * 1024**2

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, chunks: int = 10,
                 delay_ms: float = 0) -> None:
        super().__init__(host, port)
        self.chunks = chunks
        self.delay = delay_ms / 1000
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.statuses: list[int] = []
        self.retry_after: str | None = None
        self.record = True
        self.cancelled_streams = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def too_large(self) -> web.Response:
        return _error(413, "Request exceeds the maximum allowed number of bytes.")

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._messages)
        # Claude on Vertex AI: the model in the path, the version in the body.
        app.router.add_post(
            "/v1/projects/{project}/locations/{region}/publishers/anthropic/models/{call}",
            self._messages)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        vertex = "call" in request.match_info
        if not request.headers.get("x-api-key") and not request.headers.get("authorization"):
            return _error(401, "x-api-key header is required")
        if not vertex and not request.headers.get("anthropic-version"):
            return _error(400, "anthropic-version: header is required")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return _error(400, "There was an error parsing the body of your request")
        if vertex:
            model, _, method = request.match_info["call"].partition(":")
            if not isinstance(body, dict) or "anthropic_version" not in body \
                    or "model" in body or method not in ("rawPredict", "streamRawPredict"):
                return _error(400, "a Vertex request names the model in its path and the "
                                   "anthropic_version in its body")
            body["model"] = model
        if self.record:
            self.requests.append(body)
            self.headers.append(dict(request.headers))
        if self.statuses:
            status = self.statuses.pop(0)
            failure = _error(status, f"mock error {status}")
            if self.retry_after is not None:
                failure.headers["Retry-After"] = self.retry_after
            return failure
        try:
            validate(body)
        except Refused as exc:
            return _error(exc.status, str(exc))
        script = _last_turn(body)
        text = script["messages"][0]["content"]
        think = text.startswith("think:")
        if think:
            script["messages"][0]["content"] = text[len("think:"):].lstrip()
        plan = _plan(script, self.delay)
        if plan.error_status is not None:
            return _error(plan.error_status, f"mock error {plan.error_status}")
        digest = hashlib.sha256(raw).hexdigest()
        thinking = None
        if think and (body.get("thinking") or {}).get("type") == "enabled":
            thinking = "Thinking about: " + script["messages"][0]["content"]
        chunks = plan.chunks or self.chunks
        frames = _frames(plan, body, digest, chunks, thinking)
        if not body.get("stream"):
            return web.json_response(_complete(plan, body, digest, thinking))
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            "request-id": "req_mock" + digest[:16]})
        await response.prepare(request)
        if not await stream(request, response, frames, delay=plan.delay,
                            cut_after=None if plan.break_after is None
                            else plan.break_after + 3):
            self.cancelled_streams += 1
        return response


def _error(status: int, message: str) -> web.Response:
    headers = {"retry-after": "7"} if status == 429 else {}
    return web.json_response(
        {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                    "message": message}, "request_id": "req_mock"},
        status=status, headers=headers)


def _tokens(body: dict[str, Any]) -> int:
    return len(orjson.dumps(body.get("messages"))) // 4 + 1


def _tool_id(digest: str, index: int) -> str:
    return f"toolu_{digest[20:40]}{index:02d}"


def _complete(plan: Any, body: dict[str, Any], digest: str,
              thinking: str | None) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if thinking:
        content.append({"type": "thinking", "thinking": thinking, "signature": "sig" + digest})
    if plan.tool_calls:
        content.extend({"type": "tool_use", "id": _tool_id(digest, i), "name": name,
                        "input": orjson.loads(args)}
                       for i, (name, args) in enumerate(plan.tool_calls))
    else:
        content.append({"type": "text", "text": plan.text})
    return {"id": "msg_mock" + digest[:20], "type": "message", "role": "assistant",
            "model": body["model"], "content": content,
            "stop_reason": "tool_use" if plan.tool_calls else "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": _tokens(body), "output_tokens": len(plan.text) // 4 + 1}}


def _frames(plan: Any, body: dict[str, Any], digest: str, chunks: int,
            thinking: str | None) -> list[bytes]:
    def frame(event: dict[str, Any]) -> bytes:
        kind: str = event["type"]
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    frames = [frame({"type": "message_start", "message": {
        "id": "msg_mock" + digest[:20], "type": "message", "role": "assistant",
        "model": body["model"], "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": _tokens(body), "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0, "output_tokens": 1}}}),
        frame({"type": "ping"})]
    index = 0
    if thinking:
        frames.append(frame({"type": "content_block_start", "index": 0,
                             "content_block": {"type": "thinking", "thinking": "",
                                               "signature": ""}}))
        frames.extend(frame({"type": "content_block_delta", "index": 0,
                             "delta": {"type": "thinking_delta", "thinking": piece}})
                      for piece in _split(thinking, 3))
        frames.append(frame({"type": "content_block_delta", "index": 0,
                             "delta": {"type": "signature_delta", "signature": "sig" + digest}}))
        frames.append(frame({"type": "content_block_stop", "index": 0}))
        index = 1
    if plan.tool_calls:
        for i, (name, args) in enumerate(plan.tool_calls):
            frames.append(frame({"type": "content_block_start", "index": index + i,
                                 "content_block": {"type": "tool_use",
                                                   "id": _tool_id(digest, i), "name": name,
                                                   "input": {}}}))
            frames.extend(frame({"type": "content_block_delta", "index": index + i,
                                 "delta": {"type": "input_json_delta", "partial_json": piece}})
                          for piece in _split(args, max(2, min(chunks, 8))))
            frames.append(frame({"type": "content_block_stop", "index": index + i}))
        reason, out = "tool_use", "".join(a for _, a in plan.tool_calls)
    else:
        frames.append(frame({"type": "content_block_start", "index": index,
                             "content_block": {"type": "text", "text": ""}}))
        frames.extend(frame({"type": "content_block_delta", "index": index,
                             "delta": {"type": "text_delta", "text": piece}})
                      for piece in _split(plan.text, chunks))
        frames.append(frame({"type": "content_block_stop", "index": index}))
        reason, out = "end_turn", plan.text
    frames.append(frame({"type": "message_delta",
                         "delta": {"stop_reason": reason, "stop_sequence": None},
                         "usage": {"output_tokens": len(out) // 4 + 1}}))
    frames.append(frame({"type": "message_stop"}))
    return frames


def main(argv: list[str] | None = None, *,
         prog: str = "python -m copilot_runtime.testing.mock_anthropic") -> None:
    serve_from_command_line(MockAnthropicServer, name="Anthropic", port=8091,
                            description=__doc__.splitlines()[0] if __doc__ else None,
                            argv=argv, prog=prog)


if __name__ == "__main__":
    main()
