"""Google Gemini, on the Gemini API or Vertex AI, through the official `google-genai` SDK.

The SDK builds, authenticates and sends `streamGenerateContent` and decodes its answer;
there is no supported way to read its raw bytes, so its response objects are read here,
only the fields the answer needs.

What Gemini refuses is repaired on the way out: tool parameter schemas are converted to the
OpenAPI subset it accepts (`to_gemini_schema`, each rule tested), every function call gets a
function response in the next turn, arguments and responses are always objects, system and
developer messages go to `system_instruction`. Gemini 3 signs its function calls
(`thought_signature`) and refuses a history that drops the signature; the adapter remembers
the signatures of the calls it streamed, by call id, and puts them back.
"""

from __future__ import annotations

import base64
import binascii
import os
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import aiohttp
import orjson
from ag_ui.core import (
    AssistantMessage,
    DeveloperMessage,
    Message,
    SystemMessage,
    ToolMessage,
    UserMessage,
)
from google import genai
from google.genai import errors as genai_errors
from google.genai import types as genai_types

from copilot_runtime._exceptions import (
    ConfigurationError,
    UpstreamConnectionError,
    UpstreamError,
    UpstreamTimeoutError,
)
from copilot_runtime.adapters._common import arguments_object, text_of, usage
from copilot_runtime.adapters.base import (
    ChatDelta,
    ChatRequest,
    ReasoningDelta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
)

__all__ = ["GoogleGenAIAdapter", "to_gemini_contents", "to_gemini_schema"]

_MISSING_RESULT = "The tool call was not answered: no result was recorded for it."
_FINISH_REASONS = {"STOP": "stop", "MAX_TOKENS": "length", "SAFETY": "content_filter",
                   "RECITATION": "content_filter", "BLOCKLIST": "content_filter",
                   "PROHIBITED_CONTENT": "content_filter", "SPII": "content_filter",
                   "IMAGE_SAFETY": "content_filter"}
_SIGNATURES_KEPT = 4096


class GoogleGenAIAdapter:
    """Gemini with streaming text and function calls.

    `client` may be a ready `google.genai.Client` (for Vertex AI:
    ``genai.Client(vertexai=True, project=..., location=...)``); otherwise one is made for the
    Gemini API with `api_key` (or `GOOGLE_API_KEY` / `GEMINI_API_KEY`). `thinking` is
    Gemini's thinking config (``{"include_thoughts": True}`` streams its thought summaries).
    """

    provider = "google"

    def __init__(
        self,
        *,
        model: str = "gemini-2.5-flash",
        api_key: str | None = None,
        base_url: str | None = None,
        client: genai.Client | None = None,
        timeout: float = 120.0,
        max_retries: int = 2,
        thinking: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.thinking = thinking
        self._client = client
        self._session: aiohttp.ClientSession | None = None
        self._api_key = (api_key or os.environ.get("GOOGLE_API_KEY")
                         or os.environ.get("GEMINI_API_KEY"))
        self._base_url = base_url
        self._timeout = timeout
        self._max_retries = max_retries
        # call id → Gemini's thought signature of that call, for the calls streamed lately
        self._signatures: OrderedDict[str, bytes] = OrderedDict()
        if client is None and not self._api_key:
            raise ConfigurationError(
                "GoogleGenAIAdapter needs api_key (or GOOGLE_API_KEY / GEMINI_API_KEY)")

    @property
    def client(self) -> genai.Client:
        if self._client is None:
            retry = (genai_types.HttpRetryOptions(attempts=self._max_retries + 1)
                     if self._max_retries else None)
            # Our own aiohttp session: the SDK's default one subclasses ClientSession, which
            # aiohttp deprecates (a warning on every first request). Made inside the loop.
            self._session = aiohttp.ClientSession()
            self._client = genai.Client(api_key=self._api_key, http_options=genai_types.HttpOptions(
                base_url=self._base_url, timeout=int(self._timeout * 1000),
                retry_options=retry, aiohttp_client=self._session))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aio.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def build_config(self, request: ChatRequest) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(contents, config) of the `generate_content_stream` call for `request`."""
        system, contents = to_gemini_contents(request.messages, self._signatures)
        if request.system_prompt:
            system.insert(0, request.system_prompt)
        config: dict[str, Any] = {}
        if system:
            config["system_instruction"] = "\n\n".join(system)
        if request.tools:
            declarations = []
            for tool in request.tools:
                declaration: dict[str, Any] = {"name": tool.name,
                                               "description": tool.description}
                parameters = to_gemini_schema(tool.parameters)
                if parameters.get("properties"):
                    declaration["parameters"] = parameters
                declarations.append(declaration)
            config["tools"] = [{"function_declarations": declarations}]
            choice = request.tool_choice
            if choice in ("auto", "none", "required"):
                mode = {"auto": "AUTO", "none": "NONE", "required": "ANY"}[choice]
                config["tool_config"] = {"function_calling_config": {"mode": mode}}
            elif choice:
                config["tool_config"] = {"function_calling_config": {
                    "mode": "ANY", "allowed_function_names": [choice]}}
        if self.thinking is not None:
            config["thinking_config"] = self.thinking
        if request.temperature is not None:
            config["temperature"] = request.temperature
        if request.max_tokens is not None:
            config["max_output_tokens"] = request.max_tokens
        if request.stop:
            config["stop_sequences"] = request.stop
        return contents, config

    async def stream(self, request: ChatRequest) -> AsyncIterator[Sequence[ChatDelta]]:
        contents, config = self.build_config(request)
        finish: str | None = None
        calls = 0
        meta: Any = None
        try:
            # Plain dicts in the SDK's field names: it validates them into its own types.
            chunks = await self.client.aio.models.generate_content_stream(
                model=request.model or self.model, contents=cast(Any, contents),
                config=cast(Any, config))
            async for chunk in chunks:
                out: list[ChatDelta] = []
                if chunk.usage_metadata is not None:
                    meta = chunk.usage_metadata
                for candidate in (chunk.candidates or ())[:1]:
                    for part in (candidate.content.parts or ()) if candidate.content else ():
                        if part.function_call is not None:
                            call = part.function_call
                            call_id = call.id or f"call_{uuid.uuid4().hex[:24]}"
                            if part.thought_signature:
                                self._remember(call_id, part.thought_signature)
                            out.append(ToolCallDelta(calls, call_id, call.name or "",
                                                     orjson.dumps(call.args or {}).decode()))
                            calls += 1
                        elif part.text:
                            out.append(ReasoningDelta(part.text) if part.thought
                                       else TextDelta(part.text))
                    if candidate.finish_reason is not None:
                        reason = str(candidate.finish_reason.value)
                        if reason == "MALFORMED_FUNCTION_CALL":
                            raise UpstreamError("Gemini produced a malformed function call")
                        finish = _FINISH_REASONS.get(reason, reason.lower())
                if chunk.prompt_feedback is not None and chunk.prompt_feedback.block_reason:
                    raise UpstreamError(
                        f"Gemini blocked the prompt: {chunk.prompt_feedback.block_reason.value}")
                if out:
                    yield out
            if finish is None:
                raise UpstreamConnectionError(
                    "The Gemini stream ended before the answer was complete")
            if calls and finish == "stop":
                finish = "tool_calls"
            yield [StreamEnd(finish, usage(
                meta.prompt_token_count if meta else None,
                meta.candidates_token_count if meta else None,
                reasoning_tokens=meta.thoughts_token_count if meta else None))]
        except genai_errors.APIError as exc:
            raise UpstreamError(f"Gemini request failed with HTTP {exc.code}: "
                                f"{exc.message or exc.status}", status=exc.code) from None
        except (TimeoutError, aiohttp.ServerTimeoutError):
            raise UpstreamTimeoutError("Gemini request timed out") from None
        except aiohttp.ClientConnectorError:
            raise UpstreamConnectionError("Could not reach the Gemini API") from None
        except aiohttp.ClientError:
            raise UpstreamConnectionError(
                "The Gemini stream broke off before the answer was complete") from None

    def _remember(self, call_id: str, signature: bytes) -> None:
        self._signatures[call_id] = signature
        if len(self._signatures) > _SIGNATURES_KEPT:
            self._signatures.popitem(last=False)


# ---- history ---------------------------------------------------------------------------------


def to_gemini_contents(messages: Sequence[Message], signatures: dict[str, bytes] | None = None,
                       ) -> tuple[list[str], list[dict[str, Any]]]:
    """AG-UI history → (system texts, Gemini contents), repaired as the module says."""
    system: list[str] = []
    turns: list[tuple[str, list[dict[str, Any]]]] = []
    names: dict[str, str] = {}  # call id → function name, for the responses
    for message in messages:
        if isinstance(message, UserMessage):
            _append(turns, "user", _user_parts(message.content))
        elif isinstance(message, AssistantMessage):
            parts: list[dict[str, Any]] = []
            text = text_of(message.content)
            if text:
                parts.append({"text": text})
            for call in message.tool_calls or ():
                names[call.id] = call.function.name
                part: dict[str, Any] = {"function_call": {
                    "name": call.function.name,
                    "args": arguments_object(call.function.arguments)}, "_id": call.id}
                signature = (signatures or {}).get(call.id)
                if signature:
                    part["thought_signature"] = signature
                parts.append(part)
            _append(turns, "model", parts)
        elif isinstance(message, ToolMessage):
            content = text_of(message.content) or ""
            response = _response_object(content)
            if message.error:
                response = {"error": message.error, **response}
            _append(turns, "user", [{"function_response": {
                "name": names.get(message.tool_call_id, ""), "response": response},
                "_id": message.tool_call_id}])
        elif isinstance(message, SystemMessage | DeveloperMessage):
            text = text_of(message.content)
            if text:
                system.append(text)
    return system, _pair_responses(turns, names)


def _response_object(content: str) -> dict[str, Any]:
    try:
        value = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {"output": content}
    return value if isinstance(value, dict) else {"output": content}


def _append(turns: list[tuple[str, list[dict[str, Any]]]], role: str,
            parts: list[dict[str, Any]]) -> None:
    if not parts:
        return
    if turns and turns[-1][0] == role:
        turns[-1][1].extend(parts)
    else:
        turns.append((role, parts))


def _pair_responses(turns: list[tuple[str, list[dict[str, Any]]]],
                    names: dict[str, str]) -> list[dict[str, Any]]:
    """Each model turn's calls answered, in order, by the next user turn; orphans become text."""
    responses: dict[str, dict[str, Any]] = {}
    for role, parts in turns:
        if role == "user":
            for part in parts:
                if "function_response" in part:
                    responses.setdefault(part["_id"], part)
    out: list[dict[str, Any]] = []
    pending: list[str] = []

    def answers() -> list[dict[str, Any]]:
        return [_strip(responses.get(i) or {"function_response": {
            "name": names.get(i, ""), "response": {"error": _MISSING_RESULT}}})
            for i in pending]

    for role, parts in turns:
        if role == "model":
            if pending:
                out.append({"role": "user", "parts": answers()})
            pending = [p["_id"] for p in parts if "function_call" in p]
            out.append({"role": "model", "parts": [_strip(p) for p in parts]})
            continue
        answered = answers()
        rest = []
        for part in parts:
            if "function_response" not in part:
                rest.append(part)
            elif part["_id"] not in pending:
                rest.append({"text": f"(Result of tool call {part['_id']}: "
                                     f"{orjson.dumps(part['function_response']['response']).decode()})"})
        pending = []
        if answered or rest:
            out.append({"role": "user", "parts": answered + rest})
    if pending:
        out.append({"role": "user", "parts": answers()})
    return out


def _strip(part: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in part.items() if k != "_id"}


def _user_parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content}] if content else []
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = getattr(part, "type", None)
        if kind == "text":
            if part.text:
                parts.append({"text": part.text})
        elif kind in ("image", "audio", "video", "document"):
            source = part.source
            mime = getattr(source, "mime_type", None) or _DEFAULT_MIME[kind]
            if source.type == "data":
                try:
                    data = base64.b64decode(source.value, validate=True)
                except (binascii.Error, ValueError):
                    continue  # not base64: nothing the model could read
                parts.append({"inline_data": {"mime_type": mime, "data": data}})
            elif source.type in ("url", "file"):
                parts.append({"file_data": {"file_uri": source.value, "mime_type": mime}})
    return parts


_DEFAULT_MIME = {"image": "image/png", "audio": "audio/wav", "video": "video/mp4",
                 "document": "application/pdf"}


# ---- tool schemas ----------------------------------------------------------------------------

_KEPT = frozenset({"description", "title", "nullable", "minItems", "maxItems", "minLength",
                   "maxLength", "pattern", "minProperties", "maxProperties", "minimum",
                   "maximum", "default", "example"})
_FORMATS = {"STRING": {"enum", "date-time"}, "NUMBER": {"float", "double"},
            "INTEGER": {"int32", "int64"}}
_TYPES = {"string": "STRING", "number": "NUMBER", "integer": "INTEGER", "boolean": "BOOLEAN",
          "array": "ARRAY", "object": "OBJECT"}
_MAX_DEPTH = 32


def to_gemini_schema(schema: Any) -> dict[str, Any]:
    """A JSON Schema as the OpenAPI subset Gemini's function declarations accept.

    `$ref`s are inlined (a recursive one ends as a plain object), `oneOf` becomes `anyOf`,
    `allOf` is merged, a `null` alternative becomes `nullable`, `const` becomes a one-value
    `enum`, enums of non-strings move into the description, unsupported formats and keywords
    (`additionalProperties`, `$schema`, `not`, `if`, ...) are dropped, `required` keeps only
    declared properties, an array gets `items` and a typeless schema a type.
    """
    if not isinstance(schema, dict):
        return {"type": "OBJECT"}
    definitions = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    return _convert(schema, definitions, 0, frozenset())


def _convert(schema: Any, definitions: dict[str, Any], depth: int,
             seen: frozenset[str]) -> dict[str, Any]:
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return {"type": "OBJECT"}
    ref = schema.get("$ref")
    if isinstance(ref, str):
        name = ref.rsplit("/", 1)[-1]
        target = definitions.get(name)
        if target is None or name in seen:
            return {"type": "OBJECT", **_text_keys(schema)}
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return _convert(merged, definitions, depth + 1, seen | {name})
    schema = dict(schema)
    for member in schema.pop("allOf", None) or ():
        if isinstance(member, dict):
            resolved = member
            if "$ref" in member:
                resolved = definitions.get(str(member["$ref"]).rsplit("/", 1)[-1], {})
            for key, value in resolved.items():
                if key == "properties":
                    schema["properties"] = {**schema.get("properties", {}), **value}
                elif key == "required":
                    schema["required"] = [*schema.get("required", []), *value]
                else:
                    schema.setdefault(key, value)
    out: dict[str, Any] = {k: schema[k] for k in _KEPT if k in schema}
    nullable = False
    kind = schema.get("type")
    if isinstance(kind, list):
        nullable = "null" in kind
        kinds = [k for k in kind if k != "null"]
        if len(kinds) == 1:
            kind = kinds[0]
        else:
            kind = None
            schema.setdefault("anyOf", [{"type": k} for k in kinds])
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(alternatives, list):
        members = [a for a in alternatives if not (isinstance(a, dict) and a.get("type") == "null")]
        nullable = nullable or len(members) < len(alternatives)
        converted = [_convert(a, definitions, depth + 1, seen) for a in members]
        if len(converted) == 1:
            out = {**converted[0], **out}
            kind = None
        elif converted:
            out["anyOf"] = converted
    if nullable:
        out["nullable"] = True
    if "const" in schema:
        schema["enum"] = [schema["const"]]
    if kind is None and "anyOf" not in out and "type" not in out:
        kind = ("object" if "properties" in schema else "array" if "items" in schema
                else "string" if "enum" in schema or not alternatives else None)
    if isinstance(kind, str) and kind in _TYPES:
        out["type"] = _TYPES[kind]
    gemini_type = out.get("type")
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        if gemini_type == "STRING" and all(isinstance(v, str) for v in enum):
            out["enum"] = enum
        else:
            values = ", ".join(orjson.dumps(v).decode() for v in enum)
            out["description"] = (f"{out.get('description', '')} (one of: {values})").strip()
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS.get(str(gemini_type), ()):
        out["format"] = fmt
    if "exclusiveMinimum" in schema and isinstance(schema["exclusiveMinimum"], int | float):
        out.setdefault("minimum", schema["exclusiveMinimum"])
    if "exclusiveMaximum" in schema and isinstance(schema["exclusiveMaximum"], int | float):
        out.setdefault("maximum", schema["exclusiveMaximum"])
    if gemini_type == "OBJECT":
        properties = schema.get("properties")
        if isinstance(properties, dict) and properties:
            out["properties"] = {name: _convert(value, definitions, depth + 1, seen)
                                 for name, value in properties.items()}
            required = [r for r in schema.get("required") or () if r in properties]
            if required:
                out["required"] = list(dict.fromkeys(required))
    elif gemini_type == "ARRAY":
        out["items"] = _convert(schema.get("items") or {"type": "string"}, definitions,
                                depth + 1, seen)
    if "default" in out and gemini_type == "OBJECT":
        del out["default"]
    return out


def _text_keys(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: schema[k] for k in ("description", "title") if k in schema}
