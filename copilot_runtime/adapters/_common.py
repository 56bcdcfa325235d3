"""Helpers the provider adapters share: AG-UI content access and upstream error causes."""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar
from urllib.parse import unquote

import orjson
import structlog
from ag_ui.core import ToolCall

from copilot_runtime._exceptions import JSONTooDeepError, UpstreamError
from copilot_runtime._limits import check_json_text
from copilot_runtime.adapters.base import ChatDelta, ChatRequest, StreamEnd
from copilot_runtime.threads.base import ThreadOwner

_E = TypeVar("_E", bound=BaseException)
_V = TypeVar("_V")
#: A kept value's key: (thread id, its owner, the call's id).
_KeptKey = tuple[str, ThreadOwner | None, str]

#: The user turn sent for a history with none (a run started with no messages, or only a
#: system one or UI state: `runAgent()` on load): Anthropic and Gemini refuse a request
#: without any, and Chat Completions one of no messages at all; every adapter sends this.
OPENING_TURN = "Begin."

#: Gemini's finish reasons (its enum's names) → the runtime's: what the direct adapter and a
#: LangChain model (ChatGoogleGenerativeAI's `finish_reason`) report alike.
GEMINI_FINISH_REASONS = {"STOP": "stop", "MAX_TOKENS": "length", **dict.fromkeys((
    "SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII", "IMAGE_SAFETY",
    "IMAGE_PROHIBITED_CONTENT", "IMAGE_RECITATION", "MODEL_ARMOR"), "content_filter")}
#: Gemini's finish reasons that say the model failed to give an answer: the run's error, not
#: an empty answer that looks finished.
GEMINI_FAILED_REASONS = {
    "MALFORMED_FUNCTION_CALL": "Gemini produced a malformed function call",
    "MALFORMED_RESPONSE": "Gemini produced a malformed answer",
    "UNEXPECTED_TOOL_CALL": "Gemini called a tool where none was allowed",
    "TOO_MANY_TOOL_CALLS": "Gemini called more tools than it may in one answer",
    "MISSING_THOUGHT_SIGNATURE": "Gemini refused the history: a thought signature is missing",
}

#: The thread a value is kept for, and its owner (None: no authentication). A deleted
#: thread's id is free again and may become another principal's: the owner tells them apart.
OwnedThread = tuple[str, ThreadOwner | None]


def request_thread(request: ChatRequest) -> OwnedThread | None:
    """The thread `request` is for, with its owner; None when it names none (an adapter
    called outside any run). Not the run's from the log context: that names no owner."""
    return None if not request.thread_id else (request.thread_id, request.thread_owner)


class KeptForThreads(Generic[_V]):
    """What an adapter keeps of an answer for its tool loop's next request (its reasoning,
    signed thinking, a thought signature), by the answer's first tool call; bounded: past
    `most` (each value counted by `size`, else as 1), the least recently kept goes first.

    A value goes back only into a request of the thread and owner it was kept for, on a
    call of the same id and of the same name and arguments where they were known as it was
    kept. Call ids are the provider's (Kimi K2 names calls `functions.NAME:IDX` in every
    conversation) and a history's are the client's to write: kept by id alone, one user's
    reasoning went out in another user's requests. A thread's values go when it is deleted
    (`forget`): a later thread of its id, whoever's, starts with none.
    """

    __slots__ = ("_entries", "_most", "_of_thread", "_size", "held")

    def __init__(self, most: int, size: Callable[[_V], int] | None = None) -> None:
        #: (thread, owner, call id) → (the call's name, hash of its arguments, the value, what
        #: it counted for as it was kept: a value may grow after, as a parser's thinking).
        self._entries: OrderedDict[_KeptKey, tuple[str | None, int | None, _V, int]] = \
            OrderedDict()
        #: thread id → the keys of its entries (whatever their owner), for `forget`.
        self._of_thread: dict[str, set[_KeptKey]] = {}
        self._most = most
        self._size = size
        #: What the kept values count for, all together.
        self.held = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, thread: OwnedThread, call_id: str, name: str | None, value: _V,
             arguments: str | None = None) -> None:
        """Keep `value` for `thread`'s call `call_id`. `name` and `arguments` are None when
        not known yet, and then not checked (a call's arguments still stream as the reasoning
        before it is kept)."""
        size = 1 if self._size is None else self._size(value)
        key = (*thread, call_id)
        self._drop(key)  # (also when this value is too large to keep: none is kept then)
        if size > self._most:
            return
        self._entries[key] = (name, None if arguments is None else hash(arguments), value, size)
        self._of_thread.setdefault(thread[0], set()).add(key)
        self.held += size
        while self.held > self._most:
            self._drop(next(iter(self._entries)))

    def get(self, thread: OwnedThread | None, call_id: str, name: str,
            arguments: str) -> _V | None:
        """The value kept for `thread`'s call `call_id`, if it is that call."""
        kept = None if thread is None else self._entries.get((*thread, call_id))
        if kept is None or (kept[0] is not None and kept[0] != name) or (
                kept[1] is not None and kept[1] != hash(arguments)):
            return None
        return kept[2]

    def forget(self, thread_id: str) -> None:
        """Drop what is kept for the thread `thread_id`, whoever's (it was deleted)."""
        for key in tuple(self._of_thread.get(thread_id, ())):
            self._drop(key)

    def _drop(self, key: _KeptKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.held -= entry[3]
        keys = self._of_thread[key[0]]
        keys.discard(key)
        if not keys:
            del self._of_thread[key[0]]


def by_call_id(kept: Mapping[str, _V]) -> Callable[[ToolCall], _V | None]:
    """A lookup of what `kept` holds for a call, by the call's id."""
    return lambda call: kept.get(call.id)


def find_cause(exc: BaseException, kind: type[_E]) -> _E | None:
    """The first exception of `kind` in the cause/context chain of `exc`."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def after(deltas: list[ChatDelta], error: UpstreamError,
          spent: StreamEnd | None = None) -> UpstreamError:
    """`error`, carrying the `deltas` its read parsed before it: the adapter's route delivers
    them first (`UpstreamError.pending`), whatever the TCP reads were. `spent`: the
    answer's end as far as the provider told it (its token counts), see `spent_before`."""
    error.pending = deltas
    if spent is not None and spent.usage:
        error.spent = spent
    return error


def cause_text(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    return str(cause) if cause is not None and str(cause) else str(exc)


def text_of(content: Any) -> str | None:
    """The text of an AG-UI message's content (a string, or parts of which the text ones count)."""
    if content is None or isinstance(content, str):
        return content
    parts = [getattr(p, "text", None) for p in content]
    return "".join(p for p in parts if p)


def arguments_object(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as an object, which Anthropic and Gemini insist on.

    Models (and clients replaying history) sometimes send an empty string, a non-object or
    broken JSON; the value is kept, wrapped, so the model still sees what it sent. JSON
    nested deeper than a request may be is kept as its text (decoded, no request could
    carry it: every later run of the thread failed).
    """
    if not arguments.strip():
        return {}
    try:
        value = check_json_text(arguments, "Tool-call arguments")
    except (orjson.JSONDecodeError, JSONTooDeepError):
        return {"raw_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def error_body_message(body: Any) -> str | None:
    """The human message of a provider's JSON error body (`{"error": {"message": ...}}`
    shapes), as it is: pass it on through `upstream_said`."""
    if isinstance(body, dict):
        message = body.get("message")
        error = body.get("error")
        if not isinstance(message, str) and isinstance(error, dict):
            message = error.get("message")
        if isinstance(message, str) and message:
            return message
    return None


def usage(prompt: int | None, completion: int | None, **extra: Any) -> dict[str, Any]:
    """Token usage in one shape for every provider (the OpenAI names, which clients know)."""
    prompt, completion = prompt or 0, completion or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, **{k: v for k, v in extra.items() if v}}


#: Keywords the providers refuse at the top of a tool's schema (Anthropic: the three
#: combinators; OpenAI: these and `enum`, `const`, `not`).
_TOP_REFUSED = ("anyOf", "oneOf", "allOf", "enum", "const", "not")
#: How deep combinators inside combinators are flattened (deeper members add no properties).
_MAX_FLATTEN = 4
#: Steps of work (references followed, members and properties merged, nodes walked) one
#: schema may cost (~2 µs each): unions of references without a cycle still cost
#: members^depth. Real schemas take far fewer (a 20 KB pydantic union of ten nested models:
#: ~1,800).
_BUDGET = 10_000
#: Keywords that say nothing about which values a schema accepts.
_ANNOTATIONS = frozenset({"$ref", "title", "description", "$comment", "examples", "example",
                          "default", "deprecated", "readOnly", "writeOnly"})
_log = structlog.get_logger("copilot_runtime.adapters")
#: Tools already warned about (bounded: names come from clients).
_warned: set[str] = set()


#: Flattened schemas kept, by a digest of their JSON text: adapters ask for every tool's schema
#: on each model request and each step of a tool loop, and a frontend tool arrives as a new
#: object each request (an identity would miss; its text and digest cost ~0.05 ms for 20 KB,
#: flattening it ~1.5 ms). Bounded (each kept outcome may hold up to its schema's size).
_cache: OrderedDict[bytes, dict[str, Any]] = OrderedDict()
_CACHED_TOOLS = 256
_CACHED_MAX_BYTES = 64 * 1024


class _TooCostly(Exception):
    """The schema spent its budget: it is offered open instead."""


class _Budget:
    __slots__ = ("left",)

    def __init__(self, steps: int) -> None:
        self.left = steps

    def spend(self, steps: int = 1) -> None:
        self.left -= steps
        if self.left < 0:
            raise _TooCostly


def tool_schema(parameters: Any, name: str = "") -> dict[str, Any]:
    """A tool's parameters as every provider takes them at the top: an object schema without
    a combinator, `enum`, `const`, `not` or `$ref` (each of these, or a missing `type`, made
    the provider refuse the whole request, so one MCP tool or frontend tool failed every run).

    A `$ref` (at the top or a combinator's member) is followed first. `allOf` members are
    merged; `anyOf`/`oneOf` become one object that accepts what any of them accepted: the
    union of their properties (a property two members declare apart takes either schema),
    required only what every member requires, the alternatives told in the description for
    the model. A `$ref` left pointing into what was flattened away points at a copy of its
    old target in the definitions. A schema that needs none of this is returned as it is;
    one that would cost too much work to flatten is offered as an open object.
    """
    if not isinstance(parameters, dict) or not parameters:
        return {"type": "object", "properties": {}}
    if parameters.get("type") == "object" and "$ref" not in parameters \
            and not any(k in parameters for k in _TOP_REFUSED):
        return parameters
    try:
        text: bytes | None = orjson.dumps(parameters)
    except (orjson.JSONEncodeError, TypeError):
        text = None  # (not JSON, or nested past orjson's depth: flattened every time)
    key = hashlib.blake2b(text, digest_size=16).digest() \
        if text is not None and len(text) <= _CACHED_MAX_BYTES else None
    if key is not None and (cached := _cache.get(key)) is not None:
        with contextlib.suppress(KeyError):  # (evicted meanwhile by another thread)
            _cache.move_to_end(key, last=True)
        return cached
    out = _flattened_tool(parameters, name, text)
    if key is not None:
        _cache[key] = out
        if len(_cache) > _CACHED_TOOLS:
            with contextlib.suppress(KeyError):
                _cache.popitem(last=False)
    return out


def _flattened_tool(parameters: dict[str, Any], name: str, text: bytes | None) -> dict[str, Any]:
    budget = _Budget(_BUDGET)
    try:
        return _repaired(_flattened(parameters, 0, parameters, frozenset({id(parameters)}),
                                    budget), parameters, budget, text)
    except _TooCostly:
        if name not in _warned:
            if len(_warned) >= 1024:
                _warned.clear()
            _warned.add(name)
            _log.warning("tool schema too costly to flatten: offered with open parameters",
                         tool=name)
        out: dict[str, Any] = {"type": "object", "properties": {}}
        if isinstance(parameters.get("description"), str):
            out["description"] = parameters["description"]
        return out


def _flattened(schema: dict[str, Any], depth: int, root: dict[str, Any],
               path: frozenset[int], budget: _Budget) -> dict[str, Any]:
    """`schema` flattened; `path`: the schemas (by identity) being flattened around it."""
    schema, path, _ = _resolved(schema, root, path, budget)
    # (a `$ref` still here is remote, dangling or a cycle: no provider could follow it)
    out = {k: v for k, v in schema.items() if k not in _TOP_REFUSED and k != "$ref"}
    out["type"] = "object"
    properties = dict(out["properties"]) if isinstance(out.get("properties"), dict) else {}
    required = [r for r in out.get("required") or () if isinstance(r, str)] \
        if isinstance(out.get("required"), list) else []
    for member in _objects(schema.get("allOf"), depth, root, path, budget):
        _add_properties(properties, member.get("properties"), budget)
        required += [r for r in member.get("required") or () if isinstance(r, str)] \
            if isinstance(member.get("required"), list) else []
    alternatives = [m for key in ("anyOf", "oneOf")
                    for m in _objects(schema.get(key), depth, root, path, budget)]
    if "anyOf" in schema or "oneOf" in schema:
        out.pop("discriminator", None)  # (OpenAPI's: names the alternatives just removed)
    if alternatives:
        sets = []
        for member in alternatives:
            _add_properties(properties, member.get("properties"), budget)
            wanted = member.get("required")
            sets.append([r for r in wanted if isinstance(r, str)]
                        if isinstance(wanted, list) else [])
        # (a name every alternative requires is still required; the rest depend on the choice)
        required += [r for r in sets[0] if all(r in s for s in sets[1:])]
        told = "; ".join(f"({i}) " + (", ".join(s) if s else "no required arguments")
                         for i, s in enumerate(sets, 1))
        keyword = "exactly one" if "oneOf" in schema and "anyOf" not in schema else "at least one"
        note = f"Arguments: {keyword} of these sets of required names: {told}."
        description = out.get("description")
        out["description"] = f"{description}\n{note}" if isinstance(description, str) \
            and description else note
    out["properties"] = properties
    if required:
        out["required"] = list(dict.fromkeys(required))
    else:
        out.pop("required", None)
    return out


def _objects(members: Any, depth: int, root: dict[str, Any], path: frozenset[int],
             budget: _Budget) -> list[dict[str, Any]]:
    """The object members of a combinator, each `$ref` followed and each flattened in turn (a
    member with nothing to say about properties, such as `{"type": "string"}`, adds none).

    A member repeated, or a reference to a schema being flattened on this path (whose
    properties are already in: `X = anyOf[X, ...]`), is taken once or not at all: following
    them again cost members^depth."""
    if not isinstance(members, list):
        return []
    found = []
    taken: set[Any] = set()
    for member in members:
        if not isinstance(member, dict):
            continue
        budget.spend()
        ref = member.get("$ref")
        key = ref if isinstance(ref, str) and len(member) == 1 else id(member)
        if key in taken:
            continue
        taken.add(key)
        resolved, inner, looped = _resolved(member, root, path | {id(member)}, budget)
        if looped and resolved.keys() <= _ANNOTATIONS:
            continue
        if depth < _MAX_FLATTEN and any(k in resolved for k in _TOP_REFUSED):
            resolved = _flattened(resolved, depth + 1, root, inner, budget)
        found.append(resolved)
    return found


#: How many `$ref`s in a row are followed (a longer chain is left as it is).
_MAX_REF_HOPS = 8
#: A `"$ref": "..."` member in orjson's compact text (in data too: a few more to compare).
_REF_TEXT = re.compile(rb'"\$ref":("(?:[^"\\]|\\.)*")')
#: A `$ref` to the schema `true` follows this (one object: its identity is on paths).
_ANYTHING: dict[str, Any] = {}
#: What `_pointed` answers for a reference to nothing it can find.
_MISSING: Any = object()
#: Keywords whose values are data, not schemas: a "$ref" key in them refers to nothing.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example"})
#: Keywords whose values map names (any name, "enum" too) to schemas.
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                            "dependentSchemas", "dependencies"})


def _pointed(root: Any, ref: Any) -> Any:
    """What the local reference `ref` (`#`, or `#` and a JSON pointer: `#/$defs/X`,
    `#/anyOf/0/properties/home`) names in `root`, or `_MISSING` (a remote one, an anchor)."""
    if not isinstance(ref, str) or not ref.startswith("#") or ref[1:2] not in ("", "/"):
        return _MISSING
    node = root
    for token in unquote(ref[1:]).split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isascii() and token.isdigit() \
                and int(token) < len(node):
            node = node[int(token)]
        else:
            return _MISSING
    return node


def _resolved(schema: dict[str, Any], root: dict[str, Any], path: frozenset[int],
              budget: _Budget) -> tuple[dict[str, Any], frozenset[int], bool]:
    """`schema` with the `$ref`s at its top followed in `root`, its own keywords over the
    target's (properties and required of both); as it is where a reference leads nowhere or
    back (pydantic's unions are `$ref`s to `$defs`, zod's named schemas a top-level one).
    Also `path` with the targets followed, and whether a `$ref` was left because its target
    is on `path` (being flattened already)."""
    seen: set[str] = set()
    while isinstance(ref := schema.get("$ref"), str) and len(seen) < _MAX_REF_HOPS:
        budget.spend()
        target = _pointed(root, ref)
        target = _ANYTHING if target is True else target
        if not isinstance(target, dict) or ref in seen:
            break
        if id(target) in path:
            return schema, path, True
        seen.add(ref)
        path |= {id(target)}
        own = {k: v for k, v in schema.items() if k != "$ref"}
        merged = {**target, **own}
        if isinstance(target.get("properties"), dict) and isinstance(own.get("properties"), dict):
            merged["properties"] = {**target["properties"], **own["properties"]}
        if isinstance(target.get("required"), list) and isinstance(own.get("required"), list):
            merged["required"] = [*target["required"], *own["required"]]
        schema = merged
    return schema, path, False


def _repaired(out: dict[str, Any], root: dict[str, Any], budget: _Budget,
              text: bytes | None = None) -> dict[str, Any]:
    """`out` (flattened from `root`) with each local `$ref` that no longer names what it named
    in `root` (zod's `#/anyOf/0/properties/home`, into a combinator flattened away; `#`, the
    root) pointed at a copy of its old target added to the definitions: a dangling one made
    the provider refuse the request."""
    names: set[str] = set()
    for key in ("$defs", "definitions"):
        if isinstance(out.get(key), dict):
            names.update(out[key])
    home = "definitions" if not isinstance(out.get("$defs"), dict) \
        and isinstance(out.get("definitions"), dict) else "$defs"
    moved: dict[str, str] = {}
    intact: set[str] = set()  # (each compared once: a target may be large)
    pending: list[tuple[str, Any]] = []

    def holds(ref: str) -> bool:
        was = _pointed(root, ref)
        got = _pointed(out, ref)
        return was is _MISSING or got is was or got == was

    # (mostly every `$ref` still holds: `out` is then kept as it is, not copied node by node;
    # flattening makes no `$ref`, so those of `root`'s JSON `text` are all `out` may hold)
    refs: set[str] = set()
    if text is None:
        _collect_refs(out, refs, budget)
    else:
        for found in _REF_TEXT.finditer(text):
            budget.spend()
            ref = orjson.loads(found.group(1))
            if isinstance(ref, str):
                refs.add(ref)
    intact.update(ref for ref in refs if holds(ref))
    if len(intact) == len(refs):
        return out

    def fixed(node: Any, named: bool = False) -> Any:
        budget.spend()
        if isinstance(node, list):
            return [fixed(v) for v in node]
        if not isinstance(node, dict):
            return node
        if named:
            return {k: fixed(v) for k, v in node.items()}
        new = {k: v if k in _DATA_KEYWORDS else fixed(v, k in _NAMED_SCHEMAS)
               for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in moved and ref not in intact:
            was = _pointed(root, ref)
            if holds(ref):
                intact.add(ref)  # (one `root` could not follow either is left as it was)
            else:
                # (Gemini's converter finds a definition by the last segment: kept unique)
                last = ref.rsplit("/", 1)[-1] if "/" in ref else "root"
                base = "flat_" + re.sub(r"[^A-Za-z0-9_]", "_", last)
                name, n = base, 1
                while name in names:
                    n += 1
                    name = f"{base}_{n}"
                names.add(name)
                moved[ref] = f"#/{home}/{name}"
                pending.append((name, was))
        if isinstance(ref, str) and ref in moved:
            new["$ref"] = moved[ref]
        return new

    result: dict[str, Any] = fixed(out)
    added: dict[str, Any] = {}
    while pending:
        name, target = pending.pop()
        if target is root:  # (its definitions stay where they are, at the top)
            target = {k: v for k, v in root.items()
                      if k not in ("$defs", "definitions", "$schema", "$id")}
        added[name] = fixed(target)
    if added:
        kept = result.get(home)
        result[home] = {**(kept if isinstance(kept, dict) else {}), **added}
    return result


def _collect_refs(node: Any, refs: set[str], budget: _Budget, named: bool = False) -> None:
    """The `$ref`s in `node` (walked as `_repaired` walks it) added to `refs`."""
    budget.spend()
    if isinstance(node, list):
        for value in node:
            _collect_refs(value, refs, budget)
    elif isinstance(node, dict):
        if named:
            for value in node.values():
                _collect_refs(value, refs, budget)
            return
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                refs.add(v)
            elif k not in _DATA_KEYWORDS:
                _collect_refs(v, refs, budget, k in _NAMED_SCHEMAS)


def _add_properties(properties: dict[str, Any], more: Any, budget: _Budget) -> None:
    """`more`'s property schemas added to `properties`; one declared apart takes either."""
    if not isinstance(more, dict):
        return
    for name, schema in more.items():
        budget.spend()
        if name not in properties:
            properties[name] = schema
        elif properties[name] != schema:
            mine = properties[name]
            members = mine["anyOf"] if isinstance(mine, dict) and list(mine) == ["anyOf"] \
                else [mine]
            budget.spend(len(members))
            if schema not in members:
                properties[name] = {"anyOf": [*members, schema]}
