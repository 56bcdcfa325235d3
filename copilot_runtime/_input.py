"""Parsing and validating AG-UI `RunAgentInput` as both client generations send it.

`@ag-ui/client` 0.0.x always sends `tools` and `context` and may send pre-1.0 `binary`
content parts; 1.0 may omit the lists and sends media parts. Both are accepted: legacy parts
are rewritten into their 1.0 form before `ag_ui.core.RunAgentInput` validates the body.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, get_args

import orjson
import pydantic
from ag_ui.core import BinaryInputContent, RunAgentInput
from pydantic.alias_generators import to_camel, to_snake

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

    def with_messages(self, replaced: Mapping[int, dict[str, Any] | None]) -> RunInput:
        """A copy whose messages at `replaced`'s indices are its JSON messages (left out
        where None), in the model and in the JSON alike."""
        models = [model if index not in replaced else type(model).model_validate(replaced[index])
                  for index, model in enumerate(self.model.messages)
                  if replaced.get(index, model) is not None]
        raw = dict(self.raw)
        raw["messages"] = [replaced.get(index, message)
                           for index, message in enumerate(self.raw.get("messages") or ())
                           if replaced.get(index, message) is not None]
        return RunInput(self.model.model_copy(update={"messages": models}), raw,
                        self.transient)


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
    names = _python_field_names()
    # Whether some object where a model sits names a field by its Python name: only then is
    # the model walked for them (`_python_names`); a long history's walk costs a fraction of
    # its validation, this look at its objects' keys much less. `_GATED` lists where it looks.
    suspect = not names.isdisjoint(data) or any(
        _named_in(data.get(key), names) for key in ("resume", "tools", "context"))
    # Legacy `binary` parts are rewritten before validation: their fields are named here.
    named: list[dict[str, Any]] = []
    if isinstance(messages, list) and items <= MAX_INPUT_ITEMS:  # else refused below
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                continue  # left for the model to reject
            calls = message.get("toolCalls")
            if isinstance(calls, list):
                items += len(calls)
                suspect = suspect or _named_in(calls, names, "function")
            content = message.get("content")
            if isinstance(content, list):
                items += len(content)
                if items > MAX_INPUT_ITEMS:
                    break
                suspect = suspect or _named_in(content, names, "source")
                for at, part in enumerate(content):
                    if isinstance(part, dict) and part.get("type") == "binary":
                        where = ["messages", index, "content", at]
                        named.extend(_python_named(BinaryInputContent, part, where))
                        if not any(part.get(key) for key in ("id", "url", "data")):
                            # (else it would be upgraded to an empty attachment)
                            named.append({"path": where, "code": "missing_source",
                                          "message": "A binary part needs one of id, url "
                                                     "or data"})
                message["content"] = [_upgrade_part(p) for p in content]
            suspect = suspect or not names.isdisjoint(message)
    if items > MAX_INPUT_ITEMS:
        raise InvalidRequestError("Invalid request body", orjson.dumps([{
            "path": [], "code": "too_many_items",
            "message": f"The input lists more than {MAX_INPUT_ITEMS:,} items (messages, "
                       "their content parts and tool calls, tools and context entries)"}],
            option=orjson.OPT_INDENT_2).decode())
    try:
        # By alias only: a field's Python name (`tool_calls`) is then an extra key, not the
        # field, so that what the model holds is what the JSON says (guardrails and remote
        # agents read the JSON). `_python_names` refuses such keys.
        model = RunAgentInput.model_validate(data, by_name=False)
    except pydantic.ValidationError as exc:
        raise InvalidRequestError("Invalid request body", validation_details(exc)) from None
    issues = [{"path": [key], "code": "invalid_id", "message": f"The id {problem}"}
              for key, value in (("threadId", model.thread_id), ("runId", model.run_id),
                                 ("parentRunId", model.parent_run_id))
              if value is not None and (problem := id_problem(value, new=True)) is not None]
    issues.extend(named)
    if suspect:
        issues.extend(_python_names(model))
    if issues:
        raise InvalidRequestError("Invalid request body",
                                  orjson.dumps(issues[:20], option=orjson.OPT_INDENT_2).decode())
    return RunInput(model, data)


@dataclass(frozen=True, slots=True)
class _Shape:
    """What `_python_names` needs of a model class."""

    #: Its fields whose alias differs from their Python name: Python name → alias.
    renamed: dict[str, str]
    #: Its fields that may hold models (or lists of them), with their aliases.
    nested: tuple[tuple[str, str], ...]


_SHAPES: dict[type[pydantic.BaseModel], _Shape] = {}


def _shape(cls: type[pydantic.BaseModel]) -> _Shape:
    shape = _SHAPES.get(cls)
    if shape is None:
        fields = cls.model_fields
        shape = _SHAPES[cls] = _Shape(
            {name: field.alias for name, field in fields.items()
             if field.alias is not None and field.alias != name},
            tuple((name, field.alias or name) for name, field in fields.items()
                  if _holds_models(field.annotation)))
    return shape


def _holds_models(annotation: Any) -> bool:
    return bool(_model_classes(annotation))


#: Where `parse_run_input` looks for Python field names before it walks the model: every
#: field that holds models, from `RunAgentInput` down (a test holds it to ag_ui's models).
_GATED = frozenset({"messages", "messages.content", "messages.content.source",
                    "messages.toolCalls", "messages.toolCalls.function", "resume", "tools",
                    "context"})


@functools.cache
def _python_field_names() -> frozenset[str]:
    """The Python names of the fields, at any depth of `RunAgentInput`, that have an alias."""
    names: set[str] = set()
    classes: list[type[pydantic.BaseModel]] = [RunAgentInput]
    for cls in classes:
        names.update(_shape(cls).renamed)
        for name, _ in _shape(cls).nested:
            classes.extend(c for c in _model_classes(cls.model_fields[name].annotation)
                           if c not in classes)
    return frozenset(names)


def _model_classes(annotation: Any) -> list[type[pydantic.BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [c for arg in get_args(annotation) for c in _model_classes(arg)]


def _named_in(values: Any, names: frozenset[str], inner: str | None = None) -> bool:
    """Whether an object of the list `values` (or its `inner` object) has a key of `names`."""
    if not isinstance(values, list):
        return False
    for value in values:
        if isinstance(value, dict) and not names.isdisjoint(value):
            return True
        nested = value.get(inner) if inner is not None and isinstance(value, dict) else None
        if isinstance(nested, dict) and not names.isdisjoint(nested):
            return True
    return False


def _python_named(cls: type[pydantic.BaseModel], keys: Iterable[str],
                  path: list[Any]) -> list[dict[str, Any]]:
    renamed = _shape(cls).renamed
    return [{"path": [*path, key], "code": "python_field_name",
             "message": f"`{key}` is not an AG-UI field name: the field is `{renamed[key]}`"}
            for key in keys if key in renamed]


def _python_names(model: pydantic.BaseModel) -> list[dict[str, Any]]:
    """Where `model`, validated by alias only, was sent a field by its Python name
    (`tool_calls` for `toolCalls`), as issues. The models take either name (populate by
    name) and agents read them, but guardrails and remote agents read the JSON: with both,
    each read its own. Such a key is an extra of the model that has the field. Only the
    fields that hold models are walked (messages, their parts and tool calls...), never the
    JSON values (`state`, `forwardedProps`): a long history costs a fraction of validating
    it.
    """
    issues: list[dict[str, Any]] = []
    # Each model, its parent's index and its step from there (a path is made only when
    # needed: breadth first, the list grows as it is walked).
    nodes: list[tuple[pydantic.BaseModel, int, Any]] = [(model, -1, None)]
    shapes = _SHAPES
    for index, (node, _, _) in enumerate(nodes):
        cls = type(node)
        shape = shapes.get(cls) or _shape(cls)
        extra = node.__pydantic_extra__
        if extra and not shape.renamed.keys().isdisjoint(extra):
            issues.extend(_python_named(cls, extra, _path(nodes, index)))
        for name, key in shape.nested:
            value = getattr(node, name)
            if type(value) is list:
                for at, item in enumerate(value):
                    if isinstance(item, pydantic.BaseModel):
                        nodes.append((item, index, (key, at)))
            elif isinstance(value, pydantic.BaseModel):
                nodes.append((value, index, key))
    return issues


def _path(nodes: list[tuple[pydantic.BaseModel, int, Any]], index: int) -> list[Any]:
    steps: list[Any] = []
    while index > 0:
        _, index, step = nodes[index]
        steps[:0] = step if isinstance(step, tuple) else (step,)
    return steps


def validation_details(exc: pydantic.ValidationError) -> str:
    """The errors as JSON text: where, what and why, without echoing the input back."""
    issues = [
        {"path": list(err["loc"]), "code": err["type"], "message": err["msg"] + _named(err)}
        for err in exc.errors(include_url=False)[:20]
    ]
    return orjson.dumps(issues, option=orjson.OPT_INDENT_2).decode()


def _named(error: Any) -> str:
    """For a missing field the client sent by its Python name (`tool_call_id`), which the
    models take by alias only, a hint saying so."""
    field = error["loc"][-1] if error["loc"] else None
    given = error.get("input")
    if error["type"] != "missing" or not isinstance(field, str) or not isinstance(given, dict):
        return ""
    name = to_snake(field)
    return f" (`{name}` is not an AG-UI field name: the field is `{field}`)" \
        if name != field and name in given else ""


_MEDIA = ("image", "audio", "video")


def _upgrade_part(part: Any) -> Any:
    if not isinstance(part, dict) or part.get("type") != "binary":
        return part
    mime = part.get("mimeType") or "application/octet-stream"
    kind = mime.split("/", 1)[0].strip().lower()  # (MIME types are case-insensitive)
    kind = kind if kind in _MEDIA else "document"
    source: dict[str, Any]
    if part.get("url"):
        source = {"type": "url", "value": part["url"], "mimeType": mime}
    elif part.get("data") or not part.get("id"):  # (neither: refused by `parse_run_input`)
        source = {"type": "data", "value": part.get("data") or "", "mimeType": mime}
    else:  # a file the provider already holds, by its id: kept as that id, never emptied
        source = {"type": "file", "value": part["id"], "mimeType": mime}
    upgraded: dict[str, Any] = {"type": kind, "source": source}
    if part.get("id"):
        upgraded["id"] = part["id"]
    if part.get("filename"):  # where AG-UI's own upgrade keeps it (a provider may need it)
        upgraded["metadata"] = {"filename": part["filename"]}
    return upgraded
