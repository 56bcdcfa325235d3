"""Reading AG-UI events that arrive from another process: SSE framing, nulls, order.

`SSEDecoder` turns the bytes of an SSE body into `data:` payloads as they arrive, whatever
the read boundaries; the common frame (`data: {json}` alone) costs one `startswith` and a
slice. `RemoteEventChecker` takes the decoded events of one run and makes them what the
runtime's own agents produce: null fields dropped (JSON from other producers has them;
the newest clients reject them), `*_CHUNK` events expanded into START/CONTENT/END as the
clients' own `transformChunks` does, unknown event types dropped, and the ordering rules
the clients enforce checked, so a broken remote agent fails the run with a message that
names the mistake instead of failing it later in a browser.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import jsonpatch
import orjson
import structlog

from copilot_runtime import events as ev
from copilot_runtime._exceptions import UpstreamError
from copilot_runtime.events import Event, EventType

__all__ = ["RemoteEventChecker", "SSEDecoder", "StateDeltaEncoder", "strip_nulls"]

_log = structlog.get_logger("copilot_runtime.agents")

_KNOWN_TYPES: Final = frozenset(t.value for t in EventType)
# Fields whose values are the application's data: a null inside them is meaningful.
_USER_DATA_KEYS: Final = frozenset({
    "snapshot", "delta", "value", "result", "state", "input", "payload", "event",
    "rawEvent", "content", "patch", "forwardedProps",
})


class SSEDecoder:
    """Incremental SSE parser: `feed(bytes)` returns the complete `data:` payloads so far."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            # A CR at the very end may be the first half of a CRLF split across reads.
            keep_cr = buffer.endswith(b"\r")
            buffer = buffer[:-1] if keep_cr else buffer
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if keep_cr:
                buffer += b"\r"
        frames = buffer.split(b"\n\n")
        self._buffer = frames.pop()
        payloads: list[bytes] = []
        for frame in frames:
            if frame.startswith(b"data: ") and b"\n" not in frame:
                payloads.append(frame[6:])
                continue
            lines = [line for line in frame.split(b"\n") if line.startswith(b"data:")]
            if lines:
                payloads.append(b"\n".join(
                    line[6:] if line.startswith(b"data: ") else line[5:] for line in lines))
        return payloads

    def pending(self) -> bool:
        """True when bytes of an unfinished frame are buffered."""
        return bool(self._buffer.strip())


def strip_nulls(value: Any) -> Any:
    """`value` without null-valued keys, recursively, except inside application data."""
    if isinstance(value, dict):
        return {key: item if key in _USER_DATA_KEYS else strip_nulls(item)
                for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [strip_nulls(item) for item in value]
    return value


def _needs_strip(event: dict[str, Any]) -> bool:
    for key, item in event.items():
        if item is None or (key not in _USER_DATA_KEYS and isinstance(item, dict | list)):
            return True
    return False


# The string fields each tracked event must carry for the order checks to make sense.
_REQUIRED: Final[dict[str, tuple[str, ...]]] = {
    ev.TEXT_MESSAGE_START: ("messageId",),
    ev.TEXT_MESSAGE_CONTENT: ("messageId", "delta"),
    ev.TEXT_MESSAGE_END: ("messageId",),
    ev.TOOL_CALL_START: ("toolCallId", "toolCallName"),
    ev.TOOL_CALL_ARGS: ("toolCallId", "delta"),
    ev.TOOL_CALL_END: ("toolCallId",),
    ev.TOOL_CALL_RESULT: ("messageId", "toolCallId", "content"),
    ev.RUN_ERROR: ("message",),
}


class RemoteEventChecker:
    """Normalises and checks one run's events from a remote producer named `source`."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.finished = False
        self._open_text: set[str] = set()
        self._open_calls: set[str] = set()
        self._chunk_text: str | None = None
        self._chunk_call: str | None = None

    def payloads(self, payloads: Iterable[bytes]) -> list[Event]:
        """Decode SSE `data:` payloads (JSON objects) and check them."""
        events: list[Event] = []
        for payload in payloads:
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError:
                raise self._error(f"sent an event that is not valid JSON: {payload[:80]!r}") \
                    from None
            events.append(event)
        return self.check(events)

    def check(self, events: Iterable[Any]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if self.finished:
                break  # anything after the remote's terminal event is not part of the run
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise self._error("sent an event without a string 'type'")
            if _needs_strip(event):
                event = strip_nulls(event)
            kind = event["type"]
            if kind not in _KNOWN_TYPES:
                _log.warning("dropping an event of unknown type", source=self.source, type=kind)
                continue
            if kind == ev.TEXT_MESSAGE_CHUNK or kind == ev.TOOL_CALL_CHUNK:
                self._expand_chunk(event, out)
                continue
            self._close_chunks(event, out)
            self._track(event)
            out.append(event)
        return out

    def end_of_stream(self) -> None:
        """Raise unless the remote ended the run before closing its stream."""
        if not self.finished:
            raise self._error("closed its stream before the end of the run "
                              "(no RUN_FINISHED or RUN_ERROR)")

    # -- internals ---------------------------------------------------------------------

    def _error(self, what: str) -> UpstreamError:
        return UpstreamError(f"{self.source} {what}")

    def _track(self, event: Event) -> None:
        kind = event["type"]
        required = _REQUIRED.get(kind)
        if required is not None:
            for key in required:
                if not isinstance(event.get(key), str):
                    raise self._error(f"sent {kind} without a string '{key}'")
        if kind == ev.TEXT_MESSAGE_CONTENT or kind == ev.TEXT_MESSAGE_END:
            if event["messageId"] not in self._open_text:
                raise self._error(f"sent {kind} for message '{event['messageId']}', "
                                  "which is not open")
            if kind == ev.TEXT_MESSAGE_END:
                self._open_text.discard(event["messageId"])
        elif kind == ev.TOOL_CALL_ARGS or kind == ev.TOOL_CALL_END:
            if event["toolCallId"] not in self._open_calls:
                raise self._error(f"sent {kind} for tool call '{event['toolCallId']}', "
                                  "which is not open")
            if kind == ev.TOOL_CALL_END:
                self._open_calls.discard(event["toolCallId"])
        elif kind == ev.TEXT_MESSAGE_START:
            if event["messageId"] in self._open_text:
                raise self._error(f"started message '{event['messageId']}' twice")
            self._open_text.add(event["messageId"])
        elif kind == ev.TOOL_CALL_START:
            if event["toolCallId"] in self._open_calls:
                raise self._error(f"started tool call '{event['toolCallId']}' twice")
            self._open_calls.add(event["toolCallId"])
        elif kind in ev.TERMINAL_TYPES:
            self.finished = True

    def _expand_chunk(self, event: Event, out: list[Event]) -> None:
        """One `*_CHUNK` event as the START/CONTENT/END events it stands for."""
        if event["type"] == ev.TEXT_MESSAGE_CHUNK:
            message_id = event.get("messageId") or self._chunk_text
            if not isinstance(message_id, str):
                raise self._error("sent a first TEXT_MESSAGE_CHUNK without a messageId")
            if message_id != self._chunk_text:
                self._close_chunks(None, out)
                start = ev.text_message_start(message_id, event.get("role") or "assistant")
                self._track(start)
                out.append(start)
                self._chunk_text = message_id
            if event.get("delta"):
                content = ev.text_message_content(message_id, event["delta"])
                self._track(content)
                out.append(content)
            return
        call_id = event.get("toolCallId") or self._chunk_call
        if not isinstance(call_id, str):
            raise self._error("sent a first TOOL_CALL_CHUNK without a toolCallId")
        if call_id != self._chunk_call:
            self._close_chunks(None, out)
            name = event.get("toolCallName")
            if not isinstance(name, str):
                raise self._error("sent a first TOOL_CALL_CHUNK without a toolCallName")
            start = ev.tool_call_start(call_id, name, event.get("parentMessageId"))
            self._track(start)
            out.append(start)
            self._chunk_call = call_id
        if event.get("delta"):
            args = ev.tool_call_args(call_id, event["delta"])
            self._track(args)
            out.append(args)

    def _close_chunks(self, next_event: Event | None, out: list[Event]) -> None:
        """End a chunked message or call when another kind of event follows it."""
        if self._chunk_text is not None:
            closes_itself = next_event is not None and next_event["type"] == \
                ev.TEXT_MESSAGE_END and next_event.get("messageId") == self._chunk_text
            if not closes_itself:
                end = ev.text_message_end(self._chunk_text)
                self._track(end)
                out.append(end)
            self._chunk_text = None
        if self._chunk_call is not None:
            closes_itself = next_event is not None and next_event["type"] == \
                ev.TOOL_CALL_END and next_event.get("toolCallId") == self._chunk_call
            if not closes_itself:
                end = ev.tool_call_end(self._chunk_call)
                self._track(end)
                out.append(end)
            self._chunk_call = None


class StateDeltaEncoder:
    """One run's state changes as events: the first as a snapshot, then deltas.

    A changed state goes out as an RFC 6902 `STATE_DELTA` when that is smaller than the
    snapshot, an unchanged one not at all. Give it JSON-ready values it may keep.
    """

    __slots__ = ("_sent", "_state", "deltas")

    def __init__(self, *, deltas: bool = True) -> None:
        self.deltas = deltas
        self._state: Any = None
        self._sent = False

    def encode(self, state: Any) -> Event | None:
        previous, sent = self._state, self._sent
        self._state, self._sent = state, True
        if not sent or not self.deltas:
            return ev.state_snapshot(state)
        if state == previous:
            return None
        if not isinstance(state, dict) or not isinstance(previous, dict):
            return ev.state_snapshot(state)
        patch: list[dict[str, Any]] = jsonpatch.make_patch(previous, state).patch
        if _json_size(patch) < _json_size(state):
            return ev.state_delta(patch)
        return ev.state_snapshot(state)


def _json_size(value: Any) -> int:
    return len(orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS))
