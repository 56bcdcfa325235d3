"""The legacy CopilotKit remote-endpoint formats, to and from AG-UI.

Outbound: AG-UI messages as the typed message JSON (`TextMessage`, `ActionExecutionMessage`,
`ResultMessage`) that `/agents/execute` expects, and CopilotKit `Parameter` lists from
`/info` as JSON schemas. Inbound: the `/agents/execute` JSONL stream in both its forms,
as AG-UI events: LangChain `astream_events` plus `on_copilotkit_*` events (agents of type
`langgraph`), or CopilotKit runtime events (any other type). Node changes in state syncs
become STEP events and the synced state a STATE_SNAPSHOT/DELTA, which is what the GraphQL
protocol later turns back into `AgentStateMessage`s. The conversation a sync carries (the
SDK sends the checkpoint's at the end of a run) becomes a MESSAGES_SNAPSHOT: the client
then holds the checkpoint's own message ids, which the SDK needs back to tell what it
already has, and sees the messages a node returned without streaming them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from copilot_runtime import events as ev
from copilot_runtime._exceptions import UpstreamError, quoted
from copilot_runtime._limits import MAX_JSON_DEPTH, decode_json, nests_too_deep
from copilot_runtime.agents._wire import StateDeltaEncoder
from copilot_runtime.events import Event
from copilot_runtime.messages import from_json_representation

__all__ = ["LangGraphJsonlTranslator", "RuntimeEventTranslator", "parameters_schema"]



# -- outbound -------------------------------------------------------------------------

def parameters_schema(parameters: Any) -> dict[str, Any]:
    """A CopilotKit `Parameter` list (`{name, type, description, required, enum,
    attributes}`, types like `string`, `object`, `number[]`) as a JSON schema object."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in parameters or ():
        if not isinstance(parameter, dict) or not isinstance(parameter.get("name"), str):
            continue
        properties[parameter["name"]] = _parameter_schema(parameter)
        if parameter.get("required", True) is not False:
            required.append(parameter["name"])
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _parameter_schema(parameter: dict[str, Any]) -> dict[str, Any]:
    kind = str(parameter.get("type") or "string")
    array = kind.endswith("[]")
    base = kind[:-2] if array else kind
    if base == "object":
        schema = parameters_schema(parameter.get("attributes"))
    else:
        schema = {"type": base if base in ("string", "number", "boolean") else "string"}
        if isinstance(parameter.get("enum"), list):
            schema["enum"] = parameter["enum"]
    if array:
        schema = {"type": "array", "items": schema}
    if parameter.get("description"):
        schema["description"] = parameter["description"]
    return schema


# -- inbound --------------------------------------------------------------------------

class _Translator:
    """What both JSONL forms share: open message/call tracking, steps and state; `known`:
    the secrets the request carried, blanked in what the remote says; `history`: the ids of
    the messages the run was given."""

    def __init__(self, source: str, known: Sequence[str] = (),
                 history: Iterable[str] = ()) -> None:
        self.source = source
        self.known = known
        self.text: str | None = None
        self.call: str | None = None
        self.step: str | None = None
        self.announced_calls: set[str] = set()
        self.states = StateDeltaEncoder()
        #: The ids of the messages the client holds: the run's input, then what it streamed.
        self.held: set[str] = set(history)
        self.snapshot: list[dict[str, Any]] | None = None

    def close_text(self, out: list[Event]) -> None:
        if self.text is not None:
            out.append(ev.text_message_end(self.text))
            self.text = None

    def close_call(self, out: list[Event]) -> None:
        if self.call is not None:
            out.append(ev.tool_call_end(self.call))
            self.call = None

    def start_call(self, call_id: str, name: str, parent: str | None, out: list[Event]) -> None:
        self.close_text(out)
        self.close_call(out)
        out.append(ev.tool_call_start(call_id, name, parent))
        self.call = call_id
        self.announced_calls.add(call_id)
        self.held.add(parent or call_id)

    def tool_result(self, message_id: str, call_id: str, content: str,
                    out: list[Event]) -> None:
        out.append(ev.tool_call_result(message_id, call_id, content))
        self.held.add(message_id)

    def text_delta(self, message_id: str, delta: str, out: list[Event]) -> None:
        self.close_call(out)
        if self.text != message_id:
            self.close_text(out)
            out.append(ev.text_message_start(message_id))
            self.text = message_id
            self.held.add(message_id)
        out.append(ev.text_message_content(message_id, delta))

    def state_sync(self, node: str | None, active: bool, state: Any, out: list[Event]) -> None:
        """A state sync of the remote: node transitions as steps, then the state."""
        node = None if node in (None, "__end__") else node
        if active and node is not None and node != self.step:
            self.finish_step(out)
            out.append(ev.step_started(node))
            self.step = node
        messages = None
        if isinstance(state, dict):
            messages = state.get("messages")
            state = {k: v for k, v in state.items() if k != "messages"}
        event = self.states.encode(state)
        if event is not None:
            out.append(event)
        if _conversation(messages):
            self.messages_snapshot(from_json_representation(messages), out)
        if not active and node is not None and node == self.step:
            self.finish_step(out)

    def messages_snapshot(self, messages: list[dict[str, Any]], out: list[Event]) -> None:
        """The remote's conversation (AG-UI messages) as the client's.

        A client merging a snapshot keeps the messages it holds where they are and puts
        the others after them; a message new to it before one it holds (the tool result
        streamed under an id of ours, the checkpoint's own id unknown until now; a node's
        message before a streamed answer) would land after it, a history models refuse.
        Then a snapshot of what precedes the first new message goes first (that message
        too when nothing does: an empty one would blank the chat): the merge of the whole
        one after it keeps the remote's order. An empty conversation is left alone, as the
        1.10 client does."""
        if not messages or messages == self.snapshot:
            return
        self.close_text(out)
        self.close_call(out)
        first_new = next((i for i, m in enumerate(messages) if m["id"] not in self.held),
                         len(messages))
        if any(m["id"] in self.held for m in messages[first_new:]):
            out.append(ev.messages_snapshot(messages[:max(first_new, 1)]))
        out.append(ev.messages_snapshot(messages))
        self.held = {m["id"] for m in messages}
        self.snapshot = messages

    def finish_step(self, out: list[Event]) -> None:
        if self.step is not None:
            out.append(ev.step_finished(self.step))
            self.step = None

    def failure(self, kind: Any) -> UpstreamError:
        said = quoted(kind, 100, self.known) if isinstance(kind, str) and kind else None
        detail = f" ({said})" if said else ""
        return UpstreamError(f"{self.source} failed{detail}")


def _conversation(items: Any) -> bool:
    """Whether `items` is a conversation in the SDK's JSON representation (what its
    LangGraph agent syncs at the end of a run): every item has an id and is a text, a tool
    call or a tool result of that form. A CrewAI flow's `copilotkit_emit_state` sends the
    flow's own state, whose raw OpenAI-shaped messages (calls and results without ids)
    would make a snapshot that wipes what the run streamed."""
    return isinstance(items, list) and bool(items) and all(
        isinstance(item, dict) and isinstance(item.get("id"), str) and (
            ("arguments" in item and "name" in item)
            or ("result" in item and "actionExecutionId" in item)
            or ("content" in item and item.get("role") in ("user", "assistant", "system")
                and "tool_calls" not in item))
        for item in items)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _lc_fields(value: Any) -> dict[str, Any]:
    """The fields of a LangChain object as `langchain_core.load.dumps` serialises it."""
    if isinstance(value, dict):
        kwargs = value.get("kwargs")
        return kwargs if value.get("lc") == 1 and isinstance(kwargs, dict) else value
    return {}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the first text part, as the TS runtime
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                return str(part.get("text") or "")
    return ""


class LangGraphJsonlTranslator(_Translator):
    """`/agents/execute` lines of a `langgraph` agent (LangChain events) as AG-UI events."""

    def translate(self, line: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        kind = line.get("event")
        data, metadata = _dict(line.get("data")), _dict(line.get("metadata"))
        if kind == "on_copilotkit_state_sync":
            self.state_sync(line.get("node_name"), bool(line.get("active")),
                            line.get("state"), out)
        elif kind == "on_chat_model_stream":
            self._model_chunk(_lc_fields(data.get("chunk")), metadata, out)
        elif kind == "on_chat_model_end":
            self.close_text(out)
            self.close_call(out)
        elif kind == "on_tool_end":
            self._tool_result(_lc_fields(data.get("output")), out)
        elif kind == "on_custom_event":
            self._custom(str(line.get("name")), data, out)
        elif kind in (ev.LEGACY_INTERRUPT, ev.COPILOTKIT_INTERRUPT):
            self.close_text(out)
            self.close_call(out)
            out.append(ev.custom(kind, line.get("value", data)))
        elif kind in ("on_copilotkit_error", "error"):
            raise self.failure(_dict(data.get("error")).get("type"))
        return out

    def _model_chunk(self, chunk: dict[str, Any], metadata: dict[str, Any],
                     out: list[Event]) -> None:
        message_id = str(chunk.get("id") or "")
        finish = (chunk.get("response_metadata") or {}).get("finish_reason")
        emit_messages = metadata.get("copilotkit:emit-messages", True) is not False
        wanted = metadata.get("copilotkit:emit-tool-calls", True)
        for call in chunk.get("tool_call_chunks") or ():
            # (a chunk repeating the id and name of the call it continues does not start it
            # again)
            if call.get("name") and call.get("id") and call["id"] != self.call:
                visible = wanted if isinstance(wanted, bool) else (
                    call["name"] == wanted if isinstance(wanted, str) else call["name"] in wanted)
                if visible:
                    self.start_call(call["id"], call["name"], message_id or None, out)
                else:
                    self.close_call(out)
            if call.get("args") and self.call is not None:
                out.append(ev.tool_call_args(self.call, call["args"]))
        content = _text(chunk.get("content"))
        if content and not chunk.get("tool_call_chunks") and emit_messages and message_id:
            self.text_delta(message_id, content, out)
        if finish:
            self.close_text(out)
            self.close_call(out)

    def _tool_result(self, output: dict[str, Any], out: list[Event]) -> None:
        call_id = output.get("tool_call_id")
        if not isinstance(call_id, str) or call_id not in self.announced_calls:
            return  # a result for a call the client never saw
        self.close_text(out)
        self.close_call(out)
        content = output.get("content")
        # (ToolNode's message has no id until the checkpoint gives it one: the run's
        # messages snapshot then tells the client that one)
        self.tool_result(str(output.get("id") or f"result-{call_id}"), call_id,
                         content if isinstance(content, str)
                         else orjson.dumps(content).decode(), out)

    def _custom(self, name: str, data: Any, out: list[Event]) -> None:
        if name == "copilotkit_manually_emit_message" and isinstance(data, dict):
            message_id = str(data.get("message_id") or uuid.uuid4())
            self.close_text(out)
            self.text_delta(message_id, str(data.get("message") or ""), out)
            self.close_text(out)
        elif name == "copilotkit_manually_emit_tool_call" and isinstance(data, dict):
            call_id = str(data.get("id") or uuid.uuid4())
            args = data.get("args")
            self.start_call(call_id, str(data.get("name") or ""), call_id, out)
            out.append(ev.tool_call_args(call_id, args if isinstance(args, str)
                                         else orjson.dumps(args).decode()))
            self.close_call(out)
        elif name == "copilotkit_exit":
            out.append(ev.custom("Exit", True))
        elif name != "copilotkit_manually_emit_intermediate_state":
            # (intermediate state already arrives as a state sync)
            out.append(ev.custom(name, data))


class RuntimeEventTranslator(_Translator):
    """`/agents/execute` lines of other agents (CopilotKit runtime events) as AG-UI events."""

    def translate(self, line: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        kind = line.get("type")
        if kind == "TextMessageStart":
            self.close_text(out)
            out.append(ev.text_message_start(str(line.get("messageId"))))
            self.text = str(line.get("messageId"))
            self.held.add(self.text)
        elif kind == "TextMessageContent":
            if line.get("content"):
                out.append(ev.text_message_content(str(line.get("messageId")),
                                                   str(line["content"])))
        elif kind == "TextMessageEnd":
            out.append(ev.text_message_end(str(line.get("messageId"))))
            self.text = None
        elif kind == "ActionExecutionStart":
            self.start_call(str(line.get("actionExecutionId")), str(line.get("actionName")),
                            line.get("parentMessageId"), out)
        elif kind == "ActionExecutionArgs":
            args = line.get("args")
            if args:  # (an object's arguments as JSON, what a client parses)
                out.append(ev.tool_call_args(str(line.get("actionExecutionId")), args
                                             if isinstance(args, str)
                                             else orjson.dumps(args).decode()))
        elif kind == "ActionExecutionEnd":
            out.append(ev.tool_call_end(str(line.get("actionExecutionId"))))
            self.call = None
        elif kind == "ActionExecutionResult":
            call_id = str(line.get("actionExecutionId"))
            result = line.get("result")
            self.tool_result(f"result-{call_id}", call_id, result if isinstance(result, str)
                             else orjson.dumps(result).decode(), out)
        elif kind == "AgentStateMessage":
            state = line.get("state")
            if isinstance(state, str):
                try:
                    text, state = state, decode_json(state)
                except orjson.JSONDecodeError:
                    state = {}
                else:
                    if nests_too_deep(state, text):
                        raise UpstreamError(f"{self.source} sent state nested deeper than "
                                            f"{MAX_JSON_DEPTH} levels")
            self.state_sync(line.get("nodeName"), bool(line.get("active")), state, out)
        elif kind == "MetaEvent":
            out.append(ev.custom(str(line.get("name")), line.get("value")))
        elif kind == "RunError":
            error = ev.run_error(str(line.get("message") or f"{self.source} failed"))
            if isinstance(line.get("code"), str):
                error["code"] = line["code"]
            out.append(error)
        return out
