"""A deterministic loopback server that speaks the Gemini API's `generateContent` and
`streamGenerateContent?alt=sse` (`POST /v1beta/models/{model}:...`).

It lets the real `google-genai` SDK run end to end without a network or a key, with the same
script as `MockOpenAIServer` (``call:NAME {json}``, ``error:NNN``, ``breaks:N``, ``slow:MS``,
``chunks:N``, else ``echo: <text of the last message>``; after function responses the echo
is of the last response: its ``output`` when that is all it holds, else its JSON).

Like the real API it refuses what the real API refuses, with its error shapes: a missing
key, roles other than ``user``/``model``, empty parts, a function-call turn not answered by
as many function responses (in a turn holding nothing else), arguments or responses that
are not objects, and schema keywords outside the OpenAPI subset (``additionalProperties``,
``$ref``, ...), enums on non-strings, arrays without ``items``, empty ``properties``.
Function calls of Gemini 3
carry a ``thoughtSignature``; a later request that replays the call without it is refused.
Run it alone with ``python -m copilot_runtime.testing.mock_gemini``.
"""

from __future__ import annotations

import base64
import hashlib
import re
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

__all__ = ["MockGeminiServer"]

#: The names the API takes for a function (its 400 for any other quotes this rule).
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,63}")
_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
           404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE",
           504: "DEADLINE_EXCEEDED"}
_SCHEMA_KEYS = frozenset({
    "type", "format", "title", "description", "nullable", "enum", "maxItems", "minItems",
    "properties", "required", "minProperties", "maxProperties", "minLength", "maxLength",
    "pattern", "example", "anyOf", "propertyOrdering", "default", "items", "minimum",
    "maximum"})
_TYPES = frozenset({"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT"})
# Leading bytes that base64 writes as "+" and "/", as a real (random) signature has.
_SIGNATURE = base64.b64encode(b"\xfb\xff\xbfmock-thought-signature").decode()
_UNSIGNED = base64.urlsafe_b64decode("skip_thought_signature_validator")


def _is_signature(value: Any) -> bool:
    """Whether `value` is the mock's signature, in either base64 alphabet (the API reads
    bytes fields in both, and the SDK writes the URL-safe one)."""
    if not isinstance(value, str):
        return False
    try:
        decoded = base64.b64decode(value.translate(str.maketrans("-_", "+/")), validate=True)
    except ValueError:
        return False
    # (and, as the API does, the documented stand-in for a signature not known)
    return decoded in (base64.b64decode(_SIGNATURE), _UNSIGNED)



def _camel(key: str) -> str:
    """A field name as protobuf's JSON reader takes it: `any_of` is `anyOf` (the SDK writes
    the proto's own names, the REST documentation the JSON ones; the API reads both)."""
    head, *rest = key.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise Refused(f"Invalid JSON payload received. {where}: expected an object")
    for key in schema:
        if _camel(key) not in _SCHEMA_KEYS:
            raise Refused(f'Invalid JSON payload received. Unknown name "{key}" at '
                           f"'{where}': Cannot find field.")
    schema = {_camel(key): value for key, value in schema.items()}
    kind = str(schema.get("type", "")).upper()
    if kind and kind not in _TYPES:
        raise Refused(f"{where}.type: invalid value {schema.get('type')!r}")
    if "enum" in schema and kind != "STRING":
        raise Refused(f"{where}.enum: only allowed for STRING type")
    if kind == "ARRAY" and "items" not in schema:
        raise Refused(f"{where}.items: missing field.")
    if "properties" in schema:
        if not schema["properties"]:
            raise Refused(f"{where}.properties: should be non-empty for OBJECT type")
        for name, value in schema["properties"].items():
            _check_schema(value, f"{where}.properties[{name}]")
    if "items" in schema:
        _check_schema(schema["items"], f"{where}.items")
    for i, member in enumerate(schema.get("anyOf") or ()):
        _check_schema(member, f"{where}.anyOf[{i}]")


def validate(body: Any, signed: set[str]) -> None:
    """Refuse, as the real API does, the requests it would refuse."""
    if not isinstance(body, dict):
        raise Refused("Invalid JSON payload received.")
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise Refused("* GenerateContentRequest.contents: contents is not specified")
    for t, tool in enumerate(body.get("tools") or ()):
        for f, declaration in enumerate(tool.get("functionDeclarations") or ()):
            if not _NAME.fullmatch(str(declaration.get("name", ""))):
                raise Refused(f"* GenerateContentRequest.tools[{t}].function_declarations[{f}]"
                               f".name: Invalid function name. Must start with a letter or an "
                               f"underscore. Must be alphameric (a-z, A-Z, 0-9), underscores "
                               f"(_), dots (.), colons (:), or dashes (-), with a maximum "
                               f"length of 64.")
            if "parameters" in declaration:
                _check_schema(declaration["parameters"],
                              f"tools[{t}].function_declarations[{f}].parameters")
    temperature = (body.get("generationConfig") or {}).get("temperature")
    if temperature is not None and not 0 <= temperature <= 2:
        raise Refused("generation_config.temperature: must be in [0.0, 2.0]")
    calls = 0
    for i, content in enumerate(contents):
        role = content.get("role", "user")
        if role not in ("user", "model"):
            raise Refused(f"Please use a valid role: user, model. (contents[{i}])")
        parts = content.get("parts")
        if not isinstance(parts, list) or not parts:
            raise Refused(f"* GenerateContentRequest.contents[{i}].parts: contents.parts "
                           f"must not be empty.")
        responses = [p for p in parts if "functionResponse" in p]
        if (calls and len(responses) != calls) or 0 < len(responses) < len(parts):
            # (a turn of function responses holding text or data beside them is refused too)
            raise Refused("Please ensure that the number of function response parts is equal "
                           "to the number of function call parts of the function call turn.")
        for part in responses:
            if not isinstance(part["functionResponse"].get("response"), dict):
                raise Refused(f"contents[{i}].functionResponse.response: must be an object")
        calls = 0
        for part in parts:
            call = part.get("functionCall")
            if call is None:
                continue
            if role != "model":
                raise Refused(f"contents[{i}]: functionCall in a user turn")
            if not isinstance(call.get("args", {}), dict):
                raise Refused(f"contents[{i}].functionCall.args: must be an object")
            # Gemini 3 signs the first call of a turn, and checks that one comes back.
            if not calls and call.get("name") in signed \
                    and not _is_signature(part.get("thoughtSignature")):
                raise Refused(f"Function call is missing a thought_signature in functionCall "
                               f"parts. (contents[{i}])")
            calls += 1


def _last_turn(body: dict[str, Any]) -> dict[str, Any]:
    """The last turn in the OpenAI shape the shared script reads."""
    last = body["contents"][-1]
    parts = last.get("parts") or []
    mode = (((body.get("toolConfig") or {}).get("functionCallingConfig")) or {}).get("mode")
    script: dict[str, Any] = {"tool_choice": "none" if mode == "NONE" else None}
    responses = [p["functionResponse"] for p in parts if "functionResponse" in p]
    if responses:
        response = responses[-1].get("response")
        text = (response["output"] if isinstance(response, dict) and list(response) == ["output"]
                and isinstance(response["output"], str) else orjson.dumps(response).decode())
        script["messages"] = [{"role": "tool", "content": text}]
    else:
        script["messages"] = [{"role": last.get("role", "user"),
                               "content": "".join(p.get("text", "") for p in parts)}]
    return script


class MockGeminiServer(LoopbackServer):
    """The mock as an object: ``async with MockGeminiServer() as llm: llm.base_url``.

    ``requests`` holds every request body received, parsed; ``paths`` their paths;
    ``headers`` their headers (names lower-cased). ``statuses`` is a status to answer the next
    requests with before their plan (e.g. ``[503, 429]``: two failures, then the answer). With
    ``sign_calls`` (the default) function calls carry a thought signature, as Gemini 3's do.
    """

    #: The API's bound on a request (what inline data may add up to): 20 MB.
    max_body = 20 * 1024**2

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, chunks: int = 10,
                 delay_ms: float = 0, sign_calls: bool = True) -> None:
        super().__init__(host, port)
        self.chunks = chunks
        self.delay = delay_ms / 1000
        self.sign_calls = sign_calls
        self.requests: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.statuses: list[int] = []
        self.record = True
        self.cancelled_streams = 0
        self._signed: set[str] = set()  # names of functions whose calls were signed

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def too_large(self) -> web.Response:
        return _error(400, f"Request payload size exceeds the limit: {self.max_body} bytes.")

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/{version}/models/{call}", self._generate)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        model, _, method = request.match_info["call"].partition(":")
        if method not in ("generateContent", "streamGenerateContent"):
            return _error(404, f"method {method!r} not found")
        if not request.headers.get("x-goog-api-key") and "key" not in request.query:
            return _error(403, "Method doesn't allow unregistered callers. Please use an API key.")
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return _error(400, "Invalid JSON payload received.")
        if self.record:
            self.requests.append(body)
            self.paths.append(request.path_qs)
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.statuses:
            status = self.statuses.pop(0)
            return _error(status, f"mock error {status}")
        try:
            validate(body, self._signed)
        except Refused as exc:
            return _error(exc.status, str(exc))
        plan = _plan(_last_turn(body), self.delay)
        if plan.error_status is not None:
            return _error(plan.error_status, f"mock error {plan.error_status}")
        digest = hashlib.sha256(raw).hexdigest()
        if self.sign_calls:
            self._signed.update(name for name, _ in plan.tool_calls)
        chunks = _chunks(plan, body, model, digest, plan.chunks or self.chunks, self.sign_calls)
        if method == "generateContent":
            return web.json_response(_merge(chunks))
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        frames = [b"data: " + orjson.dumps(c) + b"\r\n\r\n" for c in chunks]
        if not await stream(request, response, frames, delay=plan.delay,
                            cut_after=None if plan.break_after is None
                            else plan.break_after):
            self.cancelled_streams += 1
        return response


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"code": status, "message": message,
                                        "status": _STATUS.get(status, "UNKNOWN")}},
                             status=status)


def _chunks(plan: Any, body: dict[str, Any], model: str, digest: str, pieces: int,
            sign: bool) -> list[dict[str, Any]]:
    prompt = len(orjson.dumps(body.get("contents"))) // 4 + 1

    def chunk(parts: list[dict[str, Any]], finish: str | None, out: str) -> dict[str, Any]:
        candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": 0}
        if finish:
            candidate["finishReason"] = finish
        completion = len(out) // 4 + 1
        return {"candidates": [candidate],
                "usageMetadata": {"promptTokenCount": prompt, "candidatesTokenCount": completion,
                                  "totalTokenCount": prompt + completion},
                "modelVersion": model, "responseId": "mock" + digest[:20]}

    if plan.tool_calls:
        parts = []
        for i, (name, args) in enumerate(plan.tool_calls):
            part: dict[str, Any] = {"functionCall": {"name": name, "args": orjson.loads(args)}}
            if sign and i == 0:
                part["thoughtSignature"] = _SIGNATURE
            parts.append(part)
        return [chunk(parts, "STOP", "".join(a for _, a in plan.tool_calls))]
    texts = _split(plan.text, pieces)
    out = [chunk([{"text": piece}], None, "".join(texts[: i + 1]))
           for i, piece in enumerate(texts)]
    out[-1]["candidates"][0]["finishReason"] = "STOP"
    return out


def _merge(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    for c in chunks:
        parts.extend(c["candidates"][0]["content"]["parts"])
    text = "".join(p.get("text", "") for p in parts)
    merged = [p for p in parts if "text" not in p]
    if text:
        merged.insert(0, {"text": text})
    last = dict(chunks[-1])
    last["candidates"] = [{**last["candidates"][0],
                           "content": {"parts": merged, "role": "model"}}]
    return last


def main(argv: list[str] | None = None, *,
         prog: str = "python -m copilot_runtime.testing.mock_gemini") -> None:
    serve_from_command_line(MockGeminiServer, name="Gemini", port=8092,
                            description=__doc__.splitlines()[0] if __doc__ else None,
                            argv=argv, prog=prog)


if __name__ == "__main__":
    main()
