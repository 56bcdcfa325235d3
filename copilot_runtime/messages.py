"""Every conversion of a conversation between the shapes it takes, in one place.

The runtime's own shape is the AG-UI message as JSON (camelCase dicts: `{"id", "role",
"content", "toolCalls", "toolCallId"}`); each other shape converts to or from it here:

* `from_graphql_inputs`: the `MessageInput`s of a 1.x GraphQL request.
* `to_json_representation` / `from_json_representation`: the JSON representation react-core
  1.10 loads and saves, and a `copilotkit` SDK remote endpoint answers `/agents/state` with.
* `to_legacy`: the typed messages a `copilotkit` SDK remote endpoint reads.
* `to_openai`: Chat Completions messages (from the validated `ag_ui.core` models).
* `paired_tool_calls`: a history whose tool calls are each answered at once, as the model
  APIs require; `result_quote`: what it makes of a result no call asked for.
* `tool_media_after_results`: a tool result's attachments moved to a user turn after the
  results, for the APIs whose tool results take text only.
* `text_of`: the text of any message content.
* `attachment_filename`, `media_type`, `inline_image_type`, `unsupported_attachment`: what
  each provider's conversion reads of a user's file, and the error for a file its provider
  cannot take.

Streams of events become messages in `_compaction.events_to_messages`.
"""

from __future__ import annotations

import binascii
import re
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import orjson
from ag_ui.core import (
    AssistantMessage,
    DeveloperMessage,
    Message,
    SystemMessage,
    TextPart,
    ToolMessage,
    UserMessage,
)

from copilot_runtime._exceptions import JSONTooDeepError, UnsupportedAttachmentError
from copilot_runtime._limits import check_json_text

__all__ = [
    "attachment_filename",
    "attachment_source",
    "from_graphql_inputs",
    "from_json_representation",
    "inline_image_type",
    "media_type",
    "paired_tool_calls",
    "result_quote",
    "shows_attachments",
    "text_of",
    "to_json_representation",
    "to_legacy",
    "to_openai",
    "tool_media_after_results",
    "unsupported_attachment",
]

# The SDK requires `createdAt` on legacy messages and never reads it.
_CREATED_AT = "1970-01-01T00:00:00.000Z"
# Not sent back to a 1.10 client: it rebuilds its system prompt for every request.
_HIDDEN_ROLES = frozenset({"system", "developer"})


def to_legacy(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """AG-UI messages → the typed messages a `copilotkit` SDK remote endpoint reads
    (`/agents/execute`): `TextMessage`, `ActionExecutionMessage`, `ResultMessage`."""
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for message in messages:
        role, message_id = message.get("role"), str(message.get("id") or uuid.uuid4())
        content = message.get("content")
        if isinstance(content, list):  # multimodal parts: the legacy format has text only
            content = text_of(content)
        if role in ("user", "system", "developer") or (role == "assistant" and content):
            out.append({"id": message_id, "createdAt": _CREATED_AT, "type": "TextMessage",
                        "role": "system" if role == "developer" else role,
                        "content": content or ""})
        if role == "assistant":
            for call in message.get("toolCalls") or ():
                function = call.get("function") or {}
                call_names[call["id"]] = function.get("name", "")
                arguments = _arguments(function.get("arguments"))
                out.append({"id": call["id"], "createdAt": _CREATED_AT,
                            "type": "ActionExecutionMessage", "name": function.get("name", ""),
                            "arguments": arguments, "parentMessageId": message_id})
        elif role == "tool":
            call_id = str(message.get("toolCallId") or "")
            result = content if isinstance(content, str) else ""
            error = message.get("error")
            if error and not result:  # (the format has no error field: as the built-in agent)
                result = f"Error: {error}"
            out.append({"id": message_id, "createdAt": _CREATED_AT, "type": "ResultMessage",
                        "actionExecutionId": call_id,
                        "actionName": call_names.get(call_id, ""),
                        "result": result})
    return out


def from_json_representation(items: Any) -> list[dict[str, Any]]:
    """The JSON message representation (what a remote endpoint's `/agents/state` answers,
    what react-core 1.10 saves) → AG-UI messages.

    Its items are told apart by their keys: `content` a text, `arguments` a tool call of the
    assistant message `parentMessageId`, `result` a tool result; agent-state items are not
    conversation and are left out.
    """
    out: list[dict[str, Any]] = []
    by_id: dict[str, dict[str, Any]] = {}
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        if "arguments" in item:
            parent_id = str(item.get("parentMessageId") or item["id"])
            parent = by_id.get(parent_id)
            if parent is None or parent.get("role") != "assistant":
                parent = by_id[parent_id] = {"id": parent_id, "role": "assistant"}
                out.append(parent)
            arguments = item["arguments"]
            parent.setdefault("toolCalls", []).append({
                "id": item["id"], "type": "function", "function": {
                    "name": str(item.get("name") or ""),
                    "arguments": arguments if isinstance(arguments, str)
                    else orjson.dumps(arguments).decode()}})
        elif "result" in item:
            result = item["result"]
            out.append({"id": item["id"], "role": "tool",
                        "toolCallId": str(item.get("actionExecutionId") or ""),
                        "content": result if isinstance(result, str)
                        else orjson.dumps(result).decode()})
        elif "content" in item and item.get("role") in ("user", "assistant", "system"):
            message = {"id": item["id"], "role": item["role"],
                       "content": str(item.get("content") or "")}
            by_id[item["id"]] = message
            out.append(message)
    return out


def to_json_representation(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """AG-UI messages → the JSON representation react-core 1.10 loads
    (`loadMessagesFromJsonRepresentation`, which tells items apart by their keys:
    `content` a text, `arguments` a tool call, `result` a tool result).

    System and developer messages are left out: the 1.10 client rebuilds its system prompt
    for every request, so a loaded one would be sent twice. An attachment, which that
    client cannot load, is shown as a placeholder (`[image]`) after the message's text.
    """
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    answered: set[str] = set()
    for message in messages:
        role = message.get("role")
        message_id = message.get("id")
        if role in _HIDDEN_ROLES or not isinstance(message_id, str):
            continue
        if role == "tool":
            call_id = message.get("toolCallId")
            if not isinstance(call_id, str) or call_id in answered:
                continue  # the same result stored twice (by the run and by the follow-up)
            answered.add(call_id)
            result = text_of(message.get("content"))
            error = message.get("error")
            if error and not result:  # (the format has no error field: as `to_legacy`)
                result = f"Error: {error}"
            out.append({"id": message_id, "actionExecutionId": call_id,
                        "actionName": names.get(call_id, ""), "result": result})
            continue
        content = _shown(message.get("content"))
        calls = message.get("toolCalls") or ()
        if role in ("user", "assistant") and (content or not calls):
            item: dict[str, Any] = {"id": message_id, "role": role, "content": content}
            if role == "assistant":
                item["parentMessageId"] = message_id
            out.append(item)
        for call in calls:
            function = call.get("function") or {}
            names[call["id"]] = function.get("name", "")
            arguments = _arguments(function.get("arguments"))
            out.append({"id": call["id"], "name": function.get("name", ""),
                        "arguments": arguments, "parentMessageId": message_id})
    return out


#: What the 1.10 client is shown of an attachment: it loads text messages only, and one
#: loaded empty is sent back empty (a GraphQL turn puts the stored one back in its place:
#: `stored_in_place`).
_SHOWN_KINDS = frozenset({"image", "audio", "video", "document"})
_SHOWN = re.compile(r"\[(?:image|audio|video|document)\]\Z")


def _shown(content: Any) -> str:
    """`text_of(content)`, with a `[kind]` placeholder for each attachment after it."""
    text = text_of(content)
    if not isinstance(content, list):
        return text
    kinds = [kind for part in content if isinstance(part, Mapping)
             and (kind := part.get("type")) in _SHOWN_KINDS]
    if not kinds:
        return text
    shown = " ".join(f"[{kind}]" for kind in kinds)
    return f"{text}\n{shown}" if text else shown


def shows_attachments(text: str) -> bool:
    """Whether `text` may be a message `to_json_representation` gave with attachments
    shown as placeholders (the text a 1.10 client sends back after loading it)."""
    return _SHOWN.search(text) is not None


def text_of(content: Any) -> str:
    """The text of a message's content: a string as it is, or its text parts joined
    (parts as JSON dicts or `ag_ui.core` models); "" for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping):
                if part.get("type") == "text":
                    texts.append(str(part.get("text") or ""))
            elif getattr(part, "type", None) == "text":
                texts.append(str(getattr(part, "text", "") or ""))
        return "".join(texts)
    return ""


def from_graphql_inputs(messages: Collection[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The 1.x GraphQL `MessageInput`s → AG-UI messages, in model-ready order."""
    out: list[dict[str, Any]] = []
    ids: set[str] = set()
    turn: dict[str, dict[str, Any]] = {}  # the current answer's assistant messages, by id
    calls: set[str] = set()
    answered: set[str] = set()

    def add(message: dict[str, Any]) -> dict[str, Any]:
        out.append(message)
        ids.add(message["id"])
        return message

    for item in messages:
        message_id = item["id"]
        text = item.get("textMessage")
        call = item.get("actionExecutionMessage")
        result = item.get("resultMessage")
        image = item.get("imageMessage")
        if text is not None:
            role = text["role"]
            if role == "assistant":
                existing = turn.get(message_id)
                if existing is not None:  # its tool calls came first
                    existing["content"] = text["content"]
                else:
                    turn[message_id] = add({"id": message_id, "role": "assistant",
                                            "content": text["content"]})
                continue
            if role == "tool":
                continue  # a tool message needs the call it answers, which text cannot name
            turn = {}
            add({"id": message_id, "role": "user" if role == "user" else "developer",
                 "content": text["content"]})
        elif call is not None:
            parent = call.get("parentMessageId")
            target = turn.get(parent) if parent else None
            if target is None:
                own_id = parent if parent and parent not in ids else message_id
                target = add({"id": own_id, "role": "assistant"})
                turn[own_id] = target
                if parent:
                    turn[parent] = target
            target.setdefault("toolCalls", []).append({
                "id": message_id, "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]}})
            calls.add(message_id)
        elif result is not None:
            call_id = result["actionExecutionId"]
            if call_id in calls and call_id not in answered:
                answered.add(call_id)
                add({"id": message_id, "role": "tool", "toolCallId": call_id,
                     "content": result["result"]})
        elif image is not None:
            turn = {}
            add({"id": message_id, "role": "user", "content": [{
                "type": "image", "source": {"type": "data", "value": image["bytes"],
                                            "mimeType": f"image/{image['format']}"}}]})
        # agentStateMessage: UI state, never model input
    return out


#: What a model reads as the result of a tool call the history has none for.
MISSING_RESULT = "The tool call was not answered: no result was recorded for it."
#: Messages no model reads (UI state): they neither answer nor interrupt a tool call.
_NOT_MODEL_INPUT = frozenset({"activity", "reasoning"})


def paired_tool_calls(messages: Sequence[Message]) -> Sequence[Message]:
    """`messages` with each assistant message's tool calls followed at once by one result
    each, as the model APIs require (Chat Completions refuses anything else with a 400, on
    every later run of the thread): its own result, wherever the history has it, else one
    saying none was recorded (a client that lost it, a run cut before its tools ran). A
    result no call in the history asked for becomes a user message quoting it. A history
    already so is returned as it is."""
    if _paired(messages):
        return messages
    results: dict[str, ToolMessage] = {}
    called: set[str] = set()
    for message in messages:
        if isinstance(message, ToolMessage):
            results.setdefault(message.tool_call_id, message)
        elif isinstance(message, AssistantMessage):
            called.update(call.id for call in message.tool_calls or ())
    out: list[Message] = []
    for message in messages:
        if isinstance(message, ToolMessage):
            if message.tool_call_id not in called:
                quoted = result_quote(message.tool_call_id, message.content, message.error)
                media = _media_parts(message.content)
                out.append(UserMessage(id=message.id, content=(
                    [TextPart(text=quoted), *media] if media else quoted)))
            continue  # (placed after its call)
        out.append(message)
        if isinstance(message, AssistantMessage):
            for call in message.tool_calls or ():
                out.append(results.get(call.id) or ToolMessage(
                    id=f"{call.id}-result", tool_call_id=call.id, content=MISSING_RESULT,
                    error=MISSING_RESULT))
    return out


def result_quote(tool_call_id: str, content: Any, error: str | None) -> str:
    """The text of the user message `paired_tool_calls` makes of a result no call asked for
    (its attachments after it): its call id, and its text, else its error. Guardrails judge
    this text as the user's (`_trust`)."""
    return f"(Result of tool call {tool_call_id}: {text_of(content) or error or ''})"


def _paired(messages: Sequence[Message]) -> bool:
    waiting: list[str] = []  # the calls of the last assistant message not yet answered
    for message in messages:
        role = message.role
        if role == "tool":
            if message.tool_call_id not in waiting:  # type: ignore[union-attr]
                return False
            waiting.remove(message.tool_call_id)  # type: ignore[union-attr]
        elif waiting:
            if role not in _NOT_MODEL_INPUT:
                return False
        elif role == "assistant":
            calls = message.tool_calls  # type: ignore[union-attr]
            if calls:
                waiting = [call.id for call in calls]
                if len(set(waiting)) != len(waiting):
                    return False
    return not waiting


def _media_parts(content: Any) -> list[Any]:
    """The parts of a message's content that are not text (its attachments)."""
    if not isinstance(content, list):
        return []
    return [part for part in content if getattr(part, "type", "text") != "text"]


def tool_media_after_results(messages: Sequence[Message], *,
                             failed_only: bool = False) -> Sequence[Message]:
    """A paired history (`paired_tool_calls`) with each tool result's attachments moved
    into a user message after the results of its assistant message (tool call and results
    stay together, as the APIs require): a short text naming the call, then the parts, for
    the user-message conversion to send or refuse. For the APIs whose tool results take
    text only (Chat Completions, Gemini, LangChain's messages); before, they were dropped.
    `failed_only`: only a failed result's (Anthropic's `tool_result` takes images and
    documents, but text only with `is_error`)."""
    out: list[Message] = []
    names: dict[str, str] = {}
    waiting: list[Message] = []  # the attachments of the results since the last call
    for message in messages:
        if isinstance(message, ToolMessage):
            media = _media_parts(message.content) if message.error or not failed_only \
                else []
            if media:
                call = message.tool_call_id
                name = names.get(call)
                said = f"{name} ({call})" if name else call
                waiting.append(UserMessage(id=f"{message.id}-attachments", content=[
                    TextPart(text=f"(Attachments of the result of tool call {said}:)"),
                    *media]))
                message = message.model_copy(update={"content": text_of(message.content)})
            out.append(message)
            continue
        if waiting and message.role not in _NOT_MODEL_INPUT:
            out.extend(waiting)
            waiting = []
        if isinstance(message, AssistantMessage):
            names.update((c.id, c.function.name) for c in message.tool_calls or ())
        out.append(message)
    out.extend(waiting)
    return out


def to_openai(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """AG-UI messages (`ag_ui.core` models) → Chat Completions messages, tool calls
    paired (`paired_tool_calls`), a tool result's attachments after the results
    (`tool_media_after_results`: a tool message takes text only)."""
    out: list[dict[str, Any]] = []
    for message in tool_media_after_results(paired_tool_calls(messages)):
        if isinstance(message, UserMessage):
            content = _openai_user_content(message.content)
            if content != []:  # the API refuses an empty content array with a 400
                out.append({"role": "user", "content": content})
        elif isinstance(message, AssistantMessage):
            item: dict[str, Any] = {"role": "assistant", "content": _text(message.content)}
            if message.tool_calls:
                item["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": c.function.arguments}}
                    for c in message.tool_calls
                ]
            if item["content"] is None and "tool_calls" not in item:
                item["content"] = ""
            out.append(item)
        elif isinstance(message, ToolMessage):
            content = _text(message.content) or ""
            if message.error:
                content = content or f"Error: {message.error}"
            out.append({"role": "tool", "tool_call_id": message.tool_call_id,
                        "content": content})
        elif isinstance(message, SystemMessage):
            out.append({"role": "system", "content": _text(message.content) or ""})
        elif isinstance(message, DeveloperMessage):
            out.append({"role": "developer", "content": _text(message.content) or ""})
        # activity and reasoning messages are UI state, not model input
    return out


def _text(content: Any) -> str | None:
    return None if content is None else text_of(content)


#: Chat Completions' `input_audio` formats, by the MIME types clients give those files.
_OPENAI_AUDIO_FORMATS = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav",
                         "audio/vnd.wave": "wav", "audio/mpeg": "mp3", "audio/mp3": "mp3",
                         "audio/mpeg3": "mp3", "audio/x-mpeg-3": "mp3"}
_OPENAI = "OpenAI Chat Completions"


def _openai_user_content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = getattr(part, "type", None)
        if kind == "text":
            parts.append({"type": "text", "text": part.text})
            continue
        source = attachment_source(_OPENAI, part)
        mime = inline_image_type(_OPENAI, part) if kind == "image" else media_type(source)
        if kind == "image" and source.type != "file":
            url = source.value if source.type == "url" else \
                f"data:{mime or 'image/png'};base64,{source.value}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "image":
            raise unsupported_attachment(_OPENAI, part, "images go inline or by URL")
        elif kind == "audio":
            audio_format = _OPENAI_AUDIO_FORMATS.get(mime or "")
            if source.type != "data" or audio_format is None:
                raise unsupported_attachment(
                    _OPENAI, part, "audio goes only as inline WAV or MP3 data")
            parts.append({"type": "input_audio",
                          "input_audio": {"data": source.value, "format": audio_format}})
        elif kind == "document" and source.type == "file":
            parts.append({"type": "file", "file": {"file_id": source.value}})
        elif kind == "document" and source.type == "data" and mime in ("application/pdf", None):
            parts.append({"type": "file", "file": {
                "filename": attachment_filename(part, "attachment.pdf"),
                "file_data": f"data:application/pdf;base64,{source.value}"}})
        elif kind == "document":
            raise unsupported_attachment(
                _OPENAI, part, "documents go only as inline PDF data or an uploaded file's id")
        else:
            raise unsupported_attachment(_OPENAI, part, f"it has no {kind} input")
    return parts


def media_type(source: Any) -> str | None:
    """A part source's MIME type, lower case and without parameters (`audio/wav;
    codecs=1` is `audio/wav`); None when the client gave none."""
    mime = getattr(source, "mime_type", None)
    if not isinstance(mime, str) or not mime.strip():
        return None
    return mime.split(";", 1)[0].strip().lower()


#: The image types OpenAI and Anthropic read; `image/jpg` (no registered type, but what a
#: GraphQL `imageMessage` of format `jpg` becomes) is JPEG.
_IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
_IMAGE_ALIASES = {"image/jpg": "image/jpeg"}


def inline_image_type(provider: str, part: Any) -> str | None:
    """The media type an image part is sent with (None: the client gave none), refused up
    front when given inline as a type or data `provider` (OpenAI, Anthropic) cannot read:
    else the API refused it with an error that named nothing (a PDF or an SVG sent as an
    image, data that is not base64). By URL or file id the provider reads the type itself."""
    source = part.source
    mime = media_type(source)
    if source.type != "data":
        return mime
    mime = _IMAGE_ALIASES.get(mime or "", mime)
    if mime is not None and mime not in _IMAGE_TYPES:
        raise unsupported_attachment(provider, part, "images go as PNG, JPEG, GIF or WebP")
    try:  # (checked where it is, once per part: the bytes are not kept)
        binascii.a2b_base64(source.value, strict_mode=True)
    except (binascii.Error, ValueError, TypeError):
        raise unsupported_attachment(provider, part, "its data is not base64") from None
    return mime


#: The longest name an attachment is sent on with (a model needs a hint, not an essay).
_FILENAME_LIMIT = 100
# Characters a provider might read as structure (paths, quotes, controls) in a name.
_FILENAME_UNSAFE = re.compile(r"[^\w .()+-]+")


def attachment_filename(part: Any, default: str | None) -> str | None:
    """The name the client gave a media part (`metadata.filename`, where AG-UI puts a legacy
    `binary` part's `filename`), as a bounded base name of safe characters; `default` when
    it gave none (or nothing of it is left)."""
    metadata = getattr(part, "metadata", None)
    name = metadata.get("filename") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str):
        return default
    name = re.split(r"[\\/]", name)[-1]  # a path's last part: where it came from is no one's
    name = _FILENAME_UNSAFE.sub("_", name).strip(" ._")
    if len(name) > _FILENAME_LIMIT:  # (cut in the stem, so the extension still says the type)
        stem, dot, extension = name.rpartition(".")
        extension = extension[:16] if dot and stem else ""
        suffix = f".{extension}" if extension else ""
        name = name[:_FILENAME_LIMIT - len(suffix)].rstrip(" ._") + suffix
    return name or default


# What a MIME type is written with; anything else in one a client sent is not echoed back.
_MIME_UNSAFE = re.compile(r"[^\w.+/-]+")
_SOURCE_WORDS = {"data": "inline data", "url": "a URL", "file": "a provider file id"}


def attachment_source(provider: str, part: Any) -> Any:
    """A media part's source, which `provider` is to be sent; an attachment with no bytes
    (empty inline data, as a GraphQL `imageMessage` may carry) fails the run instead of
    reaching the model as an empty file."""
    source = part.source
    if source.type == "data" and not source.value:
        raise unsupported_attachment(provider, part, "its data is empty")
    return source


def unsupported_attachment(provider: str, part: Any, why: str) -> UnsupportedAttachmentError:
    """The error failing a run whose user (or tool) message has `part`, which `provider`
    cannot take (`why` says what it does take): the kind, type and form of the file, never
    its bytes."""
    kind = str(getattr(part, "type", "unknown"))[:20]
    source = getattr(part, "source", None)
    how = _SOURCE_WORDS.get(str(getattr(source, "type", "")), "an unknown source")
    mime = media_type(source)
    shown = f" ({_MIME_UNSAFE.sub('_', mime)[:80]})" if mime else ""
    return UnsupportedAttachmentError(
        f"{provider} cannot take the {kind} attachment{shown} given as {how}: {why}")


def _arguments(text: Any) -> Any:
    """Tool-call arguments decoded for the 1.10 protocol; {} when malformed or nested too
    deep to re-encode (as text they may be any depth; decoded, they are held to the bound)."""
    try:
        return check_json_text(text or "{}", "Arguments")
    except (orjson.JSONDecodeError, JSONTooDeepError, TypeError):
        return {}
