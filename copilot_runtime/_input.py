"""Parsing and validating AG-UI `RunAgentInput` as both client generations send it.

`@ag-ui/client` 0.0.x always sends `tools` and `context` and may send pre-1.0 `binary`
content parts; 1.0 may omit the lists and sends media parts. Both are accepted: legacy parts
are rewritten into their 1.0 form before `ag_ui.core.RunAgentInput` validates the body.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
import pydantic
from ag_ui.core import RunAgentInput
from pydantic.alias_generators import to_camel

from copilot_runtime._exceptions import InvalidRequestError
from copilot_runtime._limits import LARGE_JSON, MAX_INPUT_ITEMS, check_json_depth, decode_json
from copilot_runtime.threads.base import id_problem

__all__ = ["RunInput", "parse_json_body_off_loop", "parse_run_input", "validation_details"]


@dataclass(slots=True)
class RunInput:
    """A validated run request: the typed model, and the JSON it came from (for echoing)."""

    model: RunAgentInput
    raw: dict[str, Any]
    #: The ids of messages the client makes again for every request (the 1.10 client's
    #: instructions, a system message of a new id each time): the agent is given them, the
    #: thread keeps none (kept, they piled up one a request, and went back to the model).
    transient: frozenset[str] = frozenset()

    @property
    def thread_id(self) -> str:
        return self.model.thread_id

    @property
    def run_id(self) -> str:
        return self.model.run_id

    def replace(self, **fields: Any) -> RunInput:
        """A copy with `fields` (`RunAgentInput` field names) changed in the model and in
        the JSON alike, so what the agent runs on and what `RUN_STARTED` echoes agree."""
        model = self.model.model_copy(update=fields)
        raw = dict(self.raw)
        dumped = model.model_dump(mode="json", by_alias=True, include=set(fields))
        for name in fields:
            key = to_camel(name)
            if dumped.get(key) is None:
                raw.pop(key, None)
            else:
                raw[key] = dumped[key]
        return RunInput(model, raw, self.transient)


def parse_json_body(body: bytes) -> Any:
    """Decode a request body, held to `MAX_JSON_DEPTH` (every JSON body enters here); an
    escaped lone surrogate (a browser's string cut inside an emoji) reads as U+FFFD."""
    try:
        data = decode_json(body)
    except orjson.JSONDecodeError as exc:
        detail = "Request body is empty" if not body.strip() else f"Malformed JSON: {exc.msg}"
        raise InvalidRequestError("Invalid request body", detail) from None
    check_json_depth(data, body)
    return data


async def parse_json_body_off_loop(body: bytes) -> Any:
    """`parse_json_body`, in a thread for a body of `LARGE_JSON` or more: the depth check
    walks every container in Python, seconds for millions of them (8 MiB of `[],`), which
    on the event loop held every stream and probe of the worker; a thread yields the GIL to
    the loop as it walks. (The decode holds the GIL wherever it runs: `decode_json` keeps
    it short.)"""
    if len(body) < LARGE_JSON:
        return parse_json_body(body)
    return await asyncio.to_thread(parse_json_body, body)


def parse_run_input(data: Any) -> RunInput:
    """Validate decoded JSON as a `RunAgentInput`; raise `InvalidRequestError` with details."""
    if not isinstance(data, dict):
        raise InvalidRequestError("Invalid request body", "The body must be a JSON object")
    items = sum(len(v) for key in ("messages", "tools", "context")
                if isinstance(v := data.get(key), list))
    messages = data.get("messages")
    if isinstance(messages, list) and items <= MAX_INPUT_ITEMS:  # else refused below
        for message in messages:
            if not isinstance(message, dict):
                continue  # left for the model to reject
            calls = message.get("toolCalls")
            if isinstance(calls, list):
                items += len(calls)
            content = message.get("content")
            if isinstance(content, list):
                items += len(content)
                if items > MAX_INPUT_ITEMS:
                    break
                message["content"] = [_upgrade_part(p) for p in content]
    if items > MAX_INPUT_ITEMS:
        raise InvalidRequestError("Invalid request body", orjson.dumps([{
            "path": [], "code": "too_many_items",
            "message": f"The input lists more than {MAX_INPUT_ITEMS:,} items (messages, "
                       "their content parts and tool calls, tools and context entries)"}],
            option=orjson.OPT_INDENT_2).decode())
    try:
        model = RunAgentInput.model_validate(data)
    except pydantic.ValidationError as exc:
        raise InvalidRequestError("Invalid request body", validation_details(exc)) from None
    issues = [{"path": [key], "code": "invalid_id", "message": f"The id {problem}"}
              for key, value in (("threadId", model.thread_id), ("runId", model.run_id),
                                 ("parentRunId", model.parent_run_id))
              if value is not None and (problem := id_problem(value, new=True)) is not None]
    if issues:
        raise InvalidRequestError("Invalid request body",
                                  orjson.dumps(issues, option=orjson.OPT_INDENT_2).decode())
    return RunInput(model, data)


def validation_details(exc: pydantic.ValidationError) -> str:
    """The errors as JSON text: where, what and why, without echoing the input back."""
    issues = [
        {"path": list(err["loc"]), "code": err["type"], "message": err["msg"]}
        for err in exc.errors(include_url=False)[:20]
    ]
    return orjson.dumps(issues, option=orjson.OPT_INDENT_2).decode()


_MEDIA = ("image", "audio", "video")


def _upgrade_part(part: Any) -> Any:
    if not isinstance(part, dict) or part.get("type") != "binary":
        return part
    mime = part.get("mimeType") or "application/octet-stream"
    kind = mime.split("/", 1)[0]
    kind = kind if kind in _MEDIA else "document"
    if part.get("url"):
        source = {"type": "url", "value": part["url"], "mimeType": mime}
    else:
        source = {"type": "data", "value": part.get("data") or "", "mimeType": mime}
    upgraded: dict[str, Any] = {"type": kind, "source": source}
    if part.get("id"):
        upgraded["id"] = part["id"]
    if part.get("filename"):  # where AG-UI's own upgrade keeps it (a provider may need it)
        upgraded["metadata"] = {"filename": part["filename"]}
    return upgraded
