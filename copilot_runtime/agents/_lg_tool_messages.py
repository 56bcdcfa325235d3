"""A client's tool results as a LangGraph graph takes them, and back as the client sent them.

AG-UI lets a tool message carry parts (text, image, audio, video, document) and an `error`.
ag-ui-langgraph hands the parts to LangChain as they are, so the model and the checkpoint
got each part's Python repr (and a snapshot read no text: the result showed as ""); and of
`error` it keeps only `status="error"`, so the model read an empty result, and a snapshot
showed the word "error" as the failure.

`for_graph` rewrites those results as text, which every provider takes in a tool message
(OpenAI's Chat Completions refuses an image there with a 400, and the checkpoint would keep
it, failing every later run of the thread): the text parts, then a line naming each media
part; an error is folded in when the result says nothing else (`Error: ...`), as the
built-in agent does. The runtime adds no message of its own to the graph's checkpoint, so
the media stay out of the model's view. What the client sent rides along in
`additional_kwargs` (which model integrations do not send), and `for_client` gives the
client back its own message while the graph has left the result as written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ag_ui_langgraph.utils import langchain_messages_to_agui  # type: ignore[import-untyped]
from langchain_core.messages import ToolMessage

from copilot_runtime.messages import media_type, text_of

__all__ = ["for_client", "for_graph", "repaired", "to_agui"]

#: Where a tool result keeps what the client sent that LangChain has no field for:
#: `error` (its text), `folded` (the text put before the result for that error) and
#: `parts` (the client's content parts, as JSON).
_KEPT: Final = "copilot_runtime"


def for_graph(messages: Sequence[Any], given: Sequence[Any]) -> list[Any]:
    """The base's LangChain `messages` with each tool result rebuilt from the client's
    AG-UI tool message of the same id (among `given`)."""
    sent = {m.id: m for m in given if getattr(m, "role", None) == "tool"}
    out = []
    for message in messages:
        client = sent.get(message.id) if isinstance(message, ToolMessage) else None
        out.append(message if client is None else _tool_result(message, client))
    return out


def repaired(merged: Sequence[Any], results: Sequence[Any]) -> list[Any]:
    """`merged` with each tool message that answers a call of a result among `results` (the
    `for_graph` messages) under another id given that result's status and kept fields.

    ag-ui-langgraph writes the client's result over a placeholder LangGraph left for an
    interrupted call, keeping the placeholder's id and copying the content only: the
    client's error reached the model as a success, and its snapshot showed no error."""
    by_call = {m.tool_call_id: m for m in results if isinstance(m, ToolMessage)}
    out = []
    for message in merged:
        result = by_call.get(message.tool_call_id) if isinstance(message, ToolMessage) \
            else None
        if result is not None and result.id != message.id:
            message = message.model_copy(update={
                "status": result.status, "additional_kwargs": {
                    **message.additional_kwargs, **result.additional_kwargs}})
        out.append(message)
    return out


def to_agui(messages: Sequence[Any]) -> list[Any]:
    """LangChain messages → AG-UI messages, by ag-ui-langgraph's converter, with the tool
    results `for_graph` rewrote as the client sent them (`for_client`)."""
    return for_client(langchain_messages_to_agui(messages), messages)


def for_client(converted: Sequence[Any], messages: Sequence[Any]) -> list[Any]:
    """`converted` (AG-UI messages the base made of LangChain `messages`) with each tool
    result's error text and parts restored."""
    results = {str(m.id): m for m in messages if isinstance(m, ToolMessage)}
    out = []
    for agui in converted:
        result = results.get(agui.id) if agui.role == "tool" else None
        out.append(agui if result is None else _restored(agui, result))
    return out


def _tool_result(message: ToolMessage, client: Any) -> ToolMessage:
    parts = client.content if isinstance(client.content, list) else None
    error = client.error
    kept: dict[str, Any] = {}
    folded = None
    if error:
        kept["error"] = error
        if not text_of(client.content):  # (as the built-in agent: the error is the result)
            folded = kept["folded"] = f"Error: {error}"
    if parts is not None:
        kept["parts"] = [part.model_dump(mode="json", by_alias=True, exclude_none=True)
                         for part in parts]
        content = _as_text(parts, folded)
    else:
        content = folded or client.content
    extra = {**message.additional_kwargs, _KEPT: kept} if kept else message.additional_kwargs
    return ToolMessage(id=message.id, content=content, tool_call_id=message.tool_call_id,
                       name=message.name, status="error" if error else "success",
                       additional_kwargs=extra)


def _as_text(parts: Sequence[Any], folded: str | None) -> str:
    """Parts as the text a graph gets: the folded error, the text parts, then a line
    naming each media part."""
    lines = [line for line in (folded, text_of(parts)) if line]
    return "\n".join([*lines, *(_named(part) for part in parts
                                if getattr(part, "type", None) != "text")])


_DATA_URL_TYPE = re.compile(r"data:([\w.+-]{1,60}/[\w.+-]{1,60})[;,]", re.IGNORECASE)
#: The longest URL or file id a media part's line names whole.
_NAMED_CHARS = 300


def _named(part: Any) -> str:
    """A media part as a line of text: its kind, its type and where it is (never inline
    data, which a model would read as text)."""
    source = getattr(part, "source", None)
    facts = [media_type(source) or ""]
    value = str(source.value) if source is not None and source.value else ""
    if value[:5].lower() == "data:":  # a data URL is inline data: its type alone
        declared = _DATA_URL_TYPE.match(value)
        facts[0] = facts[0] or (declared.group(1).lower() if declared else "")
    elif source is not None and source.type != "data" and value:
        # (a place, named briefly: a URL or file id of any length went into the text)
        facts.append(value if len(value) <= _NAMED_CHARS else value[:_NAMED_CHARS] + "...")
    named = ", ".join(fact for fact in facts if fact)
    return f"[{getattr(part, 'type', 'media')} attachment{': ' + named if named else ''}]"


def _restored(agui: Any, result: ToolMessage) -> Any:
    kept = result.additional_kwargs.get(_KEPT)
    kept = kept if isinstance(kept, Mapping) else {}
    update: dict[str, Any] = {}
    error, folded = kept.get("error"), kept.get("folded")
    folded = folded if isinstance(folded, str) else None
    if isinstance(error, str) and result.status == "error":  # (else a node resolved it)
        update["error"] = error
    content = result.content
    parts = kept.get("parts")
    if isinstance(parts, list) and isinstance(content, str):
        restored = _validated(agui, {**update, "content": parts})
        # (the parts only while the graph left the result as it was written)
        if restored is not None and content == _as_text(restored.content, folded):
            return restored
    if folded is not None and isinstance(content, str) and (
            content == folded or content.startswith(folded + "\n")):
        # (the error's line still leads what the graph kept: what follows is the result)
        update["content"] = content[len(folded) + 1:]
    return (_validated(agui, update) or agui) if update else agui


def _validated(agui: Any, update: Mapping[str, Any]) -> Any:
    """`agui` with `update` (fields by name, content as JSON), validated as its model is;
    None when the stored value no longer validates (a message kept by another version)."""
    fields = {**agui.model_dump(exclude_none=True), **update}
    try:
        return type(agui).model_validate(fields)
    except ValueError:
        return None
