"""A client's tool results as a LangGraph graph takes them, and back as the client sent them.

AG-UI lets a tool message carry parts (text, image, audio, video, document) and an `error`.
ag-ui-langgraph hands the parts to LangChain as they are, so the model and the checkpoint
got each part's Python repr (and a snapshot read no text: the result showed as ""); and of
`error` it keeps only `status="error"`, so the model read an empty result, and a snapshot
showed the word "error" as the failure.

`for_graph` rewrites those results as the built-in agent sends them: parts as LangChain
content blocks (media in LangChain's standard form, or a line of text where no block can
carry it), and an error folded into the content when the result says nothing else
(`Error: ...`). The client's error text rides along in `additional_kwargs`, which model
integrations do not send, so `for_client` gives the client back its own message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from ag_ui_langgraph.utils import (  # type: ignore[import-untyped]
    convert_langchain_multimodal_to_agui,
    langchain_messages_to_agui,
)
from langchain_core.messages import ToolMessage

from copilot_runtime.messages import media_type, text_of

__all__ = ["for_client", "for_graph", "to_agui"]

#: Where a tool result keeps what the client sent that LangChain has no field for.
_KEPT: Final = "copilot_runtime"
#: LangChain's standard block type for each AG-UI media part.
_BLOCK_TYPES: Final = {"image": "image", "audio": "audio", "video": "video",
                       "document": "file"}


def for_graph(messages: Sequence[Any], given: Sequence[Any]) -> list[Any]:
    """The base's LangChain `messages` with each tool result rebuilt from the client's
    AG-UI tool message of the same id (among `given`)."""
    sent = {m.id: m for m in given if getattr(m, "role", None) == "tool"}
    out = []
    for message in messages:
        client = sent.get(message.id) if isinstance(message, ToolMessage) else None
        out.append(message if client is None else _tool_result(message, client))
    return out


def to_agui(messages: Sequence[Any]) -> list[Any]:
    """LangChain messages → AG-UI messages, by ag-ui-langgraph's converter, with the tool
    results `for_graph` rewrote as the client sent them (`for_client`)."""
    return for_client(langchain_messages_to_agui(messages), messages)


def for_client(converted: Sequence[Any], messages: Sequence[Any]) -> list[Any]:
    """`converted` (AG-UI messages the base made of LangChain `messages`) with each tool
    result's error text and media parts restored."""
    results = {str(m.id): m for m in messages if isinstance(m, ToolMessage)}
    out = []
    for agui in converted:
        result = results.get(agui.id) if agui.role == "tool" else None
        out.append(agui if result is None else _restored(agui, result))
    return out


def _tool_result(message: ToolMessage, client: Any) -> ToolMessage:
    content: Any = client.content
    if isinstance(content, list):
        content = [_block(part) for part in content]
    error = client.error
    kept: dict[str, Any] = {}
    if error:
        kept["error"] = error
        if not text_of(content):  # (as the built-in agent: the error is the result)
            kept["folded"] = True
            folded = f"Error: {error}"
            content = [{"type": "text", "text": folded}, *content] \
                if isinstance(content, list) and content else folded
    extra = {**message.additional_kwargs, _KEPT: kept} if kept else message.additional_kwargs
    return ToolMessage(id=message.id, content=content, tool_call_id=message.tool_call_id,
                       name=message.name, status="error" if error else "success",
                       additional_kwargs=extra)


def _block(part: Any) -> dict[str, Any]:
    """One AG-UI part as a LangChain content block; a media part whose source no standard
    block carries (a provider's file id, inline data of no stated type) as a line of text."""
    kind = getattr(part, "type", None)
    if kind == "text":
        return {"type": "text", "text": part.text}
    source = getattr(part, "source", None)
    block_type = _BLOCK_TYPES.get(str(kind))
    mime = media_type(source)
    if block_type is not None and source is not None and source.value:
        if source.type == "url":
            return {"type": block_type, "url": source.value,
                    **({"mime_type": mime} if mime else {})}
        if source.type == "data" and mime:
            return {"type": block_type, "base64": source.value, "mime_type": mime}
    named = f": {source.value}" if source is not None and source.type != "data" \
        and source.value else ""
    return {"type": "text", "text": f"[{kind} attachment{named}]"}


def _restored(agui: Any, result: ToolMessage) -> Any:
    kept = result.additional_kwargs.get(_KEPT)
    kept = kept if isinstance(kept, Mapping) else {}
    content = result.content
    update: dict[str, Any] = {}
    if isinstance(kept.get("error"), str):
        update["error"] = kept["error"]
    if kept.get("folded"):
        # (the client's result said nothing but its error; media it had follow the text)
        content = content[1:] if isinstance(content, list) else ""
        update["content"] = content
    if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") != "text" for b in content):
        update["content"] = convert_langchain_multimodal_to_agui(content, {})
    return agui.model_copy(update=update) if update else agui
