"""A deterministic loopback server that speaks OpenAI's Chat Completions wire format.

It lets the real `openai` SDK (and any other OpenAI client, such as the TypeScript runtime's)
run end to end without a network or a key. What it answers depends on the last message:

* a user message ``call:NAME {json}``: a tool call to NAME with those arguments, the arguments
  streamed in pieces; several ``call:`` lines give several tool calls in one answer (unless
  the request says ``tool_choice: "none"``);
* a request whose ``tool_choice`` forces a function NAME, and a user message with a
  ``call:NAME {json}`` line among other text (a prompt the client wrote around the test's
  line, as `@copilotkit/core`'s suggestions do): that one call;
* ``error:NNN``: HTTP NNN with an OpenAI error body;
* ``breaks:N text``: N content pieces, then the connection is cut mid-stream;
* ``slow:MS text``: MS milliseconds between pieces (to stop or disconnect mid-stream);
* ``chunks:N text``: the answer in N pieces, whatever the server's ``chunks`` setting;
* anything else: ``echo: <text of the last message>`` (a tool result's content included),
  split into ``chunks`` pieces on code-point boundaries.

Like the real API it refuses (400, ``invalid_request_error``) a history whose tool calls are
not each answered by the tool messages right after them, a tool message that answers no
call of the assistant message before it, and one whose content has a part other than text
(an image, audio or a file: only a user message takes those); a tool whose parameters are
not an object schema or have a combinator, ``enum``, ``const`` or ``not`` at the top; and,
for a reasoning model (``o1``, ``o3-mini``, ``gpt-5``...; not ``gpt-5-chat-latest``),
``max_tokens``, a ``temperature`` other than 1 (but from ``gpt-5.1`` on with
``reasoning_effort: "none"``) and ``stop`` (but for ``o1`` and ``o3-mini``), with the real
API's words.

Chunk ids derive from a hash of the request, so the same request gets the same bytes.
Run it alone with ``python -m copilot_runtime.testing.mock_openai --port 8090``.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from copilot_runtime.testing.loopback import (
    LoopbackServer,
    serve_from_command_line,
    stream,
)

__all__ = ["MockOpenAIServer"]

_CREATED = 1700000000
_CALL = re.compile(r"^call:([A-Za-z0-9_\-]+)\s*(.*)$", re.S)
_DIRECTIVE = re.compile(r"^(error|breaks|slow|chunks):(\d+)\s*(.*)$", re.S)
# The model names OpenAI runs as reasoning models: the o series and GPT-5 on, but the chat
# model of a major version (`gpt-5-chat-latest`; a minor version's, `gpt-5.1-chat-latest`,
# reasons); the version is kept to tell 5 from 5.1.
_REASONING_MODEL = re.compile(
    r"^(?:o\d+(?:-.*)?|gpt-(\d+)(?:(\.\d+)(?:-.*)?|(?:-(?!chat).*)?))$", re.S)
# The reasoning models that take `stop`: o1 itself and o3-mini (o1-mini, o1-preview, o3,
# o4-mini and the GPT-5 family refuse it).
_TAKES_STOP = re.compile(r"^(?:o1(?:-\d{4}-\d\d-\d\d)?|o3-mini(?:-.*)?)$", re.S)


def _text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _split(text: str, pieces: int) -> list[str]:
    if not text:
        return [""]
    n = max(1, min(pieces, len(text)))
    return [text[i * len(text) // n : (i + 1) * len(text) // n] for i in range(n)]


@dataclass
class _Plan:
    text: str = ""
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    error_status: int | None = None
    break_after: int | None = None
    delay: float = 0.0
    chunks: int | None = None


def _plan(body: dict[str, Any], delay: float) -> _Plan:
    messages = body.get("messages") or [{}]
    last = messages[-1] if isinstance(messages[-1], dict) else {}
    text = _text_of(last).strip()
    plan = _Plan(delay=delay)
    tools_allowed = body.get("tool_choice") != "none"
    forced = _forced_tool(body.get("tool_choice"))
    if forced is not None and last.get("role") == "user":
        arguments = _forced_arguments(text, forced)
        if arguments is not None:
            plan.tool_calls.append((forced, arguments))
            return plan
    if last.get("role") == "user":
        calls = [_CALL.match(line.strip()) for line in text.splitlines() if line.strip()]
        if tools_allowed and calls and all(calls):
            for match in calls:
                assert match is not None
                raw_args = match.group(2).strip() or "{}"
                # Malformed arguments pass through verbatim, as a real model may send them.
                with contextlib.suppress(orjson.JSONDecodeError):
                    raw_args = orjson.dumps(orjson.loads(raw_args)).decode()
                plan.tool_calls.append((match.group(1), raw_args))
            return plan
        directive = _DIRECTIVE.match(text)
        if directive:
            kind, number = directive.group(1), int(directive.group(2))
            if kind == "error":
                plan.error_status = number
            elif kind == "breaks":
                plan.break_after = number
            elif kind == "chunks":
                plan.chunks = max(1, number)
            else:
                plan.delay = number / 1000
    plan.text = "echo: " + _text_of(last)
    return plan


def _forced_tool(tool_choice: Any) -> str | None:
    """The function `tool_choice` forces the model to call, or None."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str):
            return name
    return None


def _forced_arguments(text: str, name: str) -> str | None:
    """The arguments a ``call:NAME {json}`` line of `text` gives the forced tool, or None."""
    for line in text.splitlines():
        match = _CALL.match(line.strip())
        if match is not None and match.group(1) == name:
            raw_args = match.group(2).strip() or "{}"
            with contextlib.suppress(orjson.JSONDecodeError):
                raw_args = orjson.dumps(orjson.loads(raw_args)).decode()
            return raw_args
    return None


class MockOpenAIServer(LoopbackServer):
    """The mock as an object: ``async with MockOpenAIServer() as llm: llm.base_url``.

    ``requests`` holds every request body received, parsed, for assertions; ``headers`` the
    headers of each (names lower-cased), and ``statuses`` a status to answer the next
    requests with before their plan (e.g. ``[503, 429]``: two failures, then the answer;
    ``retry_after`` adds that `Retry-After` to them).
    """

    #: The API's bound on a request (its image guide: 50 MB of payload per request).
    max_body = 50 * 1024**2

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
        self.active_streams = 0
        #: Streams the client abandoned before their end (a stop or a disconnect upstream).
        self.cancelled_streams = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def too_large(self) -> web.Response:
        return _error(413, f"The request body exceeds the maximum size of {self.max_body} "
                           "bytes", "invalid_request_error")

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/audio/transcriptions", self._transcriptions)
        app.router.add_get("/healthz", self._health)

    async def _transcriptions(self, request: web.Request) -> web.Response:
        """OpenAI's transcription API: multipart `file` and `model` in, `{"text"}` out; the
        text says what arrived (`heard <bytes> bytes of <type> as <model>`)."""
        form = await request.post()
        upload, model = form.get("file"), form.get("model")
        if self.record:
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if not isinstance(upload, web.FileField) or not isinstance(model, str):
            return _error(400, "file and model are required", "invalid_request_error")
        if self.statuses:
            return _error(self.statuses.pop(0), "mock error", "server_error")
        data = upload.file.read()
        if not data:
            return _error(400, "Audio file is empty or unreadable", "invalid_request_error")
        return web.json_response(
            {"text": f"heard {len(data)} bytes of {upload.content_type} as {model}"})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "gpt-4o", "object": "model", "created": _CREATED, "owned_by": "mock"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return _error(400, "invalid JSON body", "invalid_request_error")
        if self.record:
            self.requests.append(body)
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
        refused = (_refusal(body.get("messages")) or _tool_content_refusal(body.get("messages"))
                   or _reasoning_refusal(body)
                   or _tools_refusal(body.get("tools")))
        if refused is not None:
            message, param, *code = refused
            return _error(400, message, "invalid_request_error", param, *code)
        if self.statuses:
            status = self.statuses.pop(0)
            failure = _error(status, f"mock error {status}", "server_error")
            if self.retry_after is not None:
                failure.headers["Retry-After"] = self.retry_after
            return failure
        plan = _plan(body, self.delay)
        chunks = plan.chunks or int(request.query.get("chunks", self.chunks))
        if plan.error_status is not None:
            return _error(plan.error_status, f"mock error {plan.error_status}", "server_error")
        digest = hashlib.sha256(raw).hexdigest()
        completion_id = "chatcmpl-mock" + digest[:20]
        model = body.get("model", "gpt-4o")
        if not body.get("stream"):
            return web.json_response(_complete(plan, completion_id, model, digest, body))
        frames = _stream_frames(plan, completion_id, model, digest, body, chunks)
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await response.prepare(request)
        self.active_streams += 1
        try:
            if not await stream(request, response, frames, delay=plan.delay,
                                cut_after=None if plan.break_after is None
                                else plan.break_after + 1):
                self.cancelled_streams += 1
        finally:
            self.active_streams -= 1
        return response


def _error(status: int, message: str, kind: str, param: str | None = None,
           code: str | None = None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status=status)


def _tools_refusal(tools: Any) -> tuple[str, str, str] | None:
    """Why the real API refuses a tool's parameters (the message, `param` and `code`), or
    None: the top of each must be an object schema with no combinator, enum, const or not."""
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or "parameters" not in function:
            continue
        schema, name = function["parameters"], function.get("name")
        where = f"tools[{i}].function.parameters"
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind != "object":
            return (f"Invalid schema for function '{name}': schema must be a JSON Schema of "
                    f"'type: \"object\"', got 'type: \"{kind}\"'.", where,
                    "invalid_function_parameters")
        if any(key in schema for key in ("oneOf", "anyOf", "allOf", "enum", "const", "not")):
            return (f"Invalid schema for function '{name}': schema must have type 'object' and "
                    "not have 'oneOf'/'anyOf'/'allOf'/'enum'/'const'/'not' at the top level.",
                    where, "invalid_function_parameters")
    return None


def _reasoning_refusal(body: dict[str, Any]) -> tuple[str, str, str] | None:
    """Why the real API refuses `body`'s settings for a reasoning model (the message, the
    `param` and the `code` it sends), or None."""
    model = body.get("model")
    if not isinstance(model, str):
        return None
    match = _REASONING_MODEL.match(model)
    if match is None or (match.group(1) is not None and int(match.group(1)) < 5):
        return None
    if "max_tokens" in body:
        return ("Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                "'max_completion_tokens' instead.", "max_tokens", "unsupported_parameter")
    temperature = body.get("temperature")
    # GPT-5.1 and later sample again when told not to reason.
    sampling = (match.group(1) is not None and (int(match.group(1)) > 5 or bool(
        match.group(2))) and body.get("reasoning_effort") == "none")
    if temperature is not None and temperature != 1 and not sampling:
        return (f"Unsupported value: 'temperature' does not support {temperature} with this "
                "model. Only the default (1) value is supported.", "temperature",
                "unsupported_value")
    if body.get("stop") and not _TAKES_STOP.match(model):
        return ("Unsupported parameter: 'stop' is not supported with this model.", "stop",
                "unsupported_parameter")
    return None


def _refusal(messages: Any) -> tuple[str, str] | None:
    """Why the real API refuses `messages` for their tool calls (and the `param` it names),
    or None."""
    if not isinstance(messages, list):
        return None
    waiting: list[Any] = []  # the call ids of the last assistant message not yet answered
    asked_at = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":
            if message.get("tool_call_id") not in waiting:
                return ("Invalid parameter: messages with role 'tool' must be a response to a "
                        "preceeding message with 'tool_calls'.", f"messages.[{i}].role")
            waiting.remove(message["tool_call_id"])
            continue
        if waiting:
            break
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if calls:
            waiting = [call.get("id") for call in calls if isinstance(call, dict)]
            asked_at = i
    if waiting:
        return ("An assistant message with 'tool_calls' must be followed by tool messages "
                "responding to each 'tool_call_id'. The following tool_call_ids did not have "
                f"response messages: {', '.join(map(str, waiting))}", f"messages.[{asked_at}].role")
    return None


def _tool_content_refusal(messages: Any) -> tuple[str, str, str] | None:
    """Why the real API refuses a tool message's content parts (the message, `param` and
    `code`), or None: a tool message takes text parts only."""
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(message, dict) or message.get("role") != "tool" \
                or not isinstance(message.get("content"), list):
            continue
        for j, part in enumerate(message["content"]):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is None:
                continue
            if kind == "image_url":
                return (f"Invalid 'messages[{i}]'. Image URLs are only allowed for messages "
                        "with role 'user', but this message with role 'tool' contains an "
                        "image URL.", f"messages[{i}]", "invalid_value")
            if kind != "text":
                return (f"Invalid value: '{kind}'. Supported values are: 'text'.",
                        f"messages[{i}].content[{j}].type", "invalid_value")
    return None


def _usage(body: dict[str, Any], out: str) -> dict[str, int]:
    prompt = sum(len(_text_of(m)) for m in body.get("messages") or [] if isinstance(m, dict))
    prompt, completion = prompt // 4 + 1, len(out) // 4 + 1
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _call_id(digest: str, index: int) -> str:
    return f"call_{digest[20:40]}{index:02d}"


def _complete(plan: _Plan, cid: str, model: str, digest: str,
              body: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": plan.text or None, "refusal": None}
    if plan.tool_calls:
        message["tool_calls"] = [
            {"id": _call_id(digest, i), "type": "function",
             "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(plan.tool_calls)]
    out = plan.text or "".join(a for _, a in plan.tool_calls)
    return {"id": cid, "object": "chat.completion", "created": _CREATED, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if plan.tool_calls else "stop"}],
            "usage": _usage(body, out)}


def _stream_frames(plan: _Plan, cid: str, model: str, digest: str, body: dict[str, Any],
                   chunks: int) -> list[bytes]:
    def frame(delta: dict[str, Any], finish: str | None = None) -> bytes:
        chunk = {"id": cid, "object": "chat.completion.chunk", "created": _CREATED,
                 "model": model, "system_fingerprint": "fp_mock",
                 "choices": [{"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": finish}]}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    frames: list[bytes] = []
    if plan.tool_calls:
        for index, (name, args) in enumerate(plan.tool_calls):
            head: dict[str, Any] = {"index": index, "id": _call_id(digest, index),
                                    "type": "function",
                                    "function": {"name": name, "arguments": ""}}
            delta: dict[str, Any] = {"tool_calls": [head]}
            if index == 0:
                delta = {"role": "assistant", "content": None, **delta, "refusal": None}
            frames.append(frame(delta))
            for piece in _split(args, max(2, min(chunks, 8))):
                frames.append(frame({"tool_calls": [
                    {"index": index, "function": {"arguments": piece}}]}))
        finish, out = "tool_calls", "".join(a for _, a in plan.tool_calls)
    else:
        frames.append(frame({"role": "assistant", "content": "", "refusal": None}))
        frames.extend(frame({"content": piece}) for piece in _split(plan.text, chunks))
        finish, out = "stop", plan.text
    frames.append(frame({}, finish))
    if (body.get("stream_options") or {}).get("include_usage"):
        frames.append(b"data: " + orjson.dumps({
            "id": cid, "object": "chat.completion.chunk", "created": _CREATED, "model": model,
            "system_fingerprint": "fp_mock", "choices": [], "usage": _usage(body, out)}) + b"\n\n")
    frames.append(b"data: [DONE]\n\n")
    return frames


def main(argv: list[str] | None = None, *,
         prog: str = "python -m copilot_runtime.testing.mock_openai") -> None:
    serve_from_command_line(MockOpenAIServer, name="OpenAI", port=8090,
                            description=__doc__.splitlines()[0] if __doc__ else None,
                            argv=argv, prog=prog)


if __name__ == "__main__":
    main()
