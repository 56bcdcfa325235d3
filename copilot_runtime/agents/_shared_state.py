"""The application state a client shares with the built-in agent (the run input's `state`).

The model reads the state in its system prompt and may change it with two tools: one that
replaces it (answered with `STATE_SNAPSHOT`) and one that patches it with RFC 6902 operations
(answered with `STATE_DELTA`). The tool names are the ones CopilotKit's clients and the
TypeScript runtime use, so apps that render or watch those calls keep working. A call that
cannot be applied is answered to the model as a tool error and leaves the state unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import orjson

from copilot_runtime import events as ev
from copilot_runtime._compaction import StateTooLarge, patched_state
from copilot_runtime._limits import MAX_JSON_DEPTH, decode_json, too_deep
from copilot_runtime.adapters.base import ToolSpec
from copilot_runtime.events import Event

__all__ = ["DELTA_TOOL", "MAX_STATE_BYTES", "SNAPSHOT_TOOL", "SharedState", "StateChange"]

SNAPSHOT_TOOL: Final = "AGUISendStateSnapshot"
DELTA_TOOL: Final = "AGUISendStateDelta"
#: The largest state, as encoded JSON, the model may leave: the default inbound body limit
#: (`create_app`'s `max_body_size`), so the client can send the state back with its next run.
MAX_STATE_BYTES: Final = 8 * 1024 * 1024
#: The patch operations offered: `test` is left out, as Python's equality (`1 == True`)
#: differs from the client's and a test passing here could fail the client's patch.
_OPERATIONS: Final = ("add", "remove", "replace", "move", "copy")
_MEMBERS: Final = frozenset({"op", "path", "from", "value"})
#: How much of a library's reason for refusing a patch the model is told.
_REASON_CHARS: Final = 200

_SNAPSHOT_SPEC = ToolSpec(
    SNAPSHOT_TOOL,
    "Replace the whole application state with a new JSON object.",
    {"type": "object",
     "properties": {"snapshot": {"type": "object",
                                 "description": "The complete new application state."}},
     "required": ["snapshot"]},
)
_DELTA_SPEC = ToolSpec(
    DELTA_TOOL,
    "Change parts of the application state with JSON Patch (RFC 6902) operations.",
    {"type": "object",
     "properties": {"delta": {
         "type": "array",
         "description": "The operations, applied in order.",
         "items": {"type": "object", "properties": {
             "op": {"type": "string", "enum": list(_OPERATIONS)},
             "path": {"type": "string",
                      "description": "JSON Pointer to the changed place, e.g. /items/0"},
             "from": {"type": "string",
                      "description": "JSON Pointer to the source (move and copy only)"},
             "value": {"description": "The new value (add and replace only)"},
         }, "required": ["op", "path"]},
     }},
     "required": ["delta"]},
)


@dataclass(frozen=True, slots=True)
class StateChange:
    """What one state tool call did: the event it sends (None when refused) and the tool
    result the model reads, with why it failed."""

    event: Event | None
    content: str
    error: str | None = None


class SharedState:
    """One run's view of the application state, changed by the model's state tool calls.

    `offered` names the state tools the model is given (empty: it only reads the state).
    """

    def __init__(self, state: Any, offered: frozenset[str]) -> None:
        # A client that sent no state holds an empty object, which a first patch applies to.
        self.value: Any = {} if state is None else state
        self.offered = offered

    def tools(self) -> list[ToolSpec]:
        return [spec for spec in (_SNAPSHOT_SPEC, _DELTA_SPEC) if spec.name in self.offered]

    def prompt(self) -> str | None:
        """The system prompt's part about the state: None unless it is a non-empty object."""
        if not isinstance(self.value, dict) or not self.value:
            return None
        names = [spec.name for spec in self.tools()]
        how = (f"Change it only with {' or '.join(names)}." if names
               else "You can read it but not change it.")
        text = orjson.dumps(self.value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
        return (f"The application shares its current state with you as JSON. {how}\n"
                f"```json\n{text.decode()}\n```")

    def apply(self, name: str, arguments: str) -> StateChange:
        """Carry out the state tool call `name` with its `arguments` (JSON text)."""
        try:
            # Read as a server action's arguments are: an escaped lone surrogate (the model
            # cut an emoji) is U+FFFD, not a refusal.
            args = decode_json(arguments or "{}")
        except orjson.JSONDecodeError:
            return _refused("the arguments are not valid JSON")
        if not isinstance(args, dict):
            return _refused("the arguments must be a JSON object")
        if name == SNAPSHOT_TOOL:
            snapshot = args.get("snapshot")
            if not isinstance(snapshot, dict):
                return _refused("`snapshot` must be a JSON object: the whole new state")
            return self._become(snapshot, ev.state_snapshot(snapshot))
        delta = args.get("delta")
        problem = _patch_problem(delta)
        if problem is not None or not isinstance(delta, list):
            return _refused(problem or "`delta` must be a list")
        import jsonpatch  # loaded by the first patch only (it loads difflib)

        try:
            patched = patched_state(self.value, delta, max_bytes=MAX_STATE_BYTES)
        except StateTooLarge as exc:
            return _refused(str(exc))
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError,
                ValueError, KeyError, IndexError, RecursionError,
                orjson.JSONEncodeError) as exc:
            reason = str(exc)[:_REASON_CHARS] or type(exc).__name__
            return _refused(f"the patch does not apply to the current state: {reason}")
        if not isinstance(patched, dict):
            return _refused("the patch must leave the state a JSON object")
        # Only the operations' own members go to the client, whatever else the model added.
        operations = [{k: v for k, v in op.items() if k in _MEMBERS} for op in delta]
        return self._become(patched, ev.state_delta(operations))

    def _become(self, state: dict[str, Any], event: Event) -> StateChange:
        """Take `state` if it is within the bounds a client can send back."""
        if too_deep(state, MAX_JSON_DEPTH - 1):  # the request body holding it is one level
            return _refused(f"the state would nest deeper than {MAX_JSON_DEPTH - 1} levels")
        try:
            size = len(orjson.dumps(state))
        except (orjson.JSONEncodeError, TypeError):
            return _refused("the state cannot be encoded as JSON")
        if size > MAX_STATE_BYTES:
            return _refused(f"the state would be larger than {MAX_STATE_BYTES} bytes of JSON")
        self.value = state
        return StateChange(event, orjson.dumps({"status": "state updated"}).decode())


def _patch_problem(delta: Any) -> str | None:
    """Why `delta` is not a JSON Patch of the offered operations, or None."""
    if not isinstance(delta, list):
        return "`delta` must be a list of JSON Patch operations"
    for index, operation in enumerate(delta):
        if not isinstance(operation, dict) or not isinstance(operation.get("path"), str):
            return f"operation {index} must be an object with a string `path`"
        if operation.get("op") not in _OPERATIONS:
            return f"operation {index}: `op` must be one of {', '.join(_OPERATIONS)}"
        if operation["op"] in ("add", "replace") and "value" not in operation:
            return f"operation {index} ({operation['op']}) needs a `value`"
        if operation["op"] in ("move", "copy") and not isinstance(operation.get("from"), str):
            return f"operation {index} ({operation['op']}) needs a string `from`"
    return None


def _refused(message: str) -> StateChange:
    return StateChange(None, ev.failed_tool_content(message), message)
