"""Reading AG-UI events that arrive from another process: SSE framing, nulls, order.

`SSEDecoder` turns the bytes of an SSE body into `data:` payloads as they arrive, whatever
the read boundaries; the common frame (`data: {json}` alone) costs one `startswith` and a
slice. `RemoteEventChecker` takes the decoded events of one run and makes them what the
runtime's own agents produce: null fields dropped (JSON from other producers has them;
the newest clients reject them) but where the application's data itself may be null,
`*_CHUNK` events expanded into START/CONTENT/END as the
clients' own `transformChunks` does, unknown event types dropped, and the ordering rules
the clients enforce checked, so a broken remote agent fails the run with a message that
names the mistake instead of failing it later in a browser.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, Final

import orjson
import structlog
from ag_ui.core import Event as AGUIEvent
from pydantic import TypeAdapter, ValidationError

from copilot_runtime import events as ev
from copilot_runtime._exceptions import ChunkError, UpstreamError, quoted
from copilot_runtime._held import HeldBytes
from copilot_runtime._limits import MAX_JSON_DEPTH, decode_json, nests_too_deep
from copilot_runtime.agents._state_diff import state_patch
from copilot_runtime.event_order import (
    EMPTY_DELTA,
    REQUIRED_FIELDS,
    ChunkState,
    OrderChecker,
    expand_chunk,
)
from copilot_runtime.events import Event, EventType

__all__ = ["RemoteEventChecker", "SSEDecoder", "StateDeltaEncoder", "strip_nulls"]

_log = structlog.get_logger("copilot_runtime.agents")

_KNOWN_TYPES: Final = frozenset(t.value for t in EventType)
_CHUNKS: Final = frozenset({ev.TEXT_MESSAGE_CHUNK, ev.TOOL_CALL_CHUNK})


#: A UTF-8 byte order mark, which the SSE spec lets a stream open with.
_BOM: Final = b"\xef\xbb\xbf"


class SSEDecoder:
    """Incremental SSE parser: `feed(bytes)` returns the complete `data:` payloads so far,
    `close()` those of a last frame the stream ended without its blank line.

    Each read is looked at once (`HeldBytes` keeps an unfinished frame's reads apart until
    one can end it), and a frame longer than the bound fails as the remote's error. Lines
    end as the spec says: CRLF, LF or a CR alone; one leading BOM is skipped.
    """

    __slots__ = ("_held", "_skip_lf", "_start")

    def __init__(self, source: str = "The remote agent") -> None:
        self._held = HeldBytes(source, UpstreamError, end=b"\n\n")
        # The last read ended with a CR, which ended its line at once (waiting for the next
        # read held a `\r\r` stream's last event back): an LF opening the next read is the
        # rest of that CRLF.
        self._skip_lf = False
        self._start: bytes | None = b""  # the stream's first bytes while a BOM may be split

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._start is not None:
            chunk = self._without_bom(chunk)
        if self._skip_lf and chunk:  # (an empty read says nothing about the next byte)
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\r" in chunk:
            self._skip_lf = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        joined = self._held.take(chunk)
        if joined is None:
            return []
        frames = joined.split(b"\n\n")
        self._held.hold(frames.pop())
        return _payloads(frames)

    def close(self) -> list[bytes]:
        """The payloads of what is held at the end of the stream: a last frame without its
        blank line is read, as the clients' own parser reads it."""
        rest = self._held.rest().rstrip(b"\n")
        return _payloads([rest]) if rest else []

    def pending(self) -> bool:
        """True when bytes of an unfinished frame are buffered."""
        return self._held.held()

    def _without_bom(self, chunk: bytes) -> bytes:
        start = self._start + chunk if self._start else chunk
        if len(start) < len(_BOM) and _BOM.startswith(start):
            self._start = start  # (a read of one or two bytes: wait for the rest)
            return b""
        self._start = None
        return start[len(_BOM):] if start.startswith(_BOM) else start


def _payloads(frames: list[bytes]) -> list[bytes]:
    """The `data:` payloads of complete SSE frames (their lines ended by LF)."""
    payloads: list[bytes] = []
    for frame in frames:
        if frame.startswith(b"data: ") and b"\n" not in frame:
            payloads.append(frame[6:])
            continue
        if frame.startswith(b"id: "):  # this runtime's frames: `id: N` then one data line
            data = frame.find(b"\ndata: ") + 1
            if data and frame.find(b"\n", data) < 0:
                payloads.append(frame[data + 6:])
                continue
        lines = [line for line in frame.split(b"\n") if line.startswith(b"data:")]
        if lines:
            payloads.append(b"\n".join(
                line[6:] if line.startswith(b"data: ") else line[5:] for line in lines))
    return payloads


def strip_nulls(value: Any) -> Any:
    """`value` without null-valued keys, recursively, except inside application data and
    where the application's data may be null itself (`events.NULLABLE_DATA_KEYS`)."""
    if isinstance(value, dict):
        return {key: item if key in ev.APPLICATION_DATA_KEYS else strip_nulls(item)
                for key, item in value.items()
                if item is not None or key in ev.NULLABLE_DATA_KEYS}
    if isinstance(value, list):
        return [strip_nulls(item) for item in value]
    return value


def _shape_problem(event: dict[str, Any]) -> str | None:
    """What makes a remote event unusable downstream (clients' schemas, the thread routes,
    the encoder's depth), beyond the order rules; None if nothing."""
    kind = event["type"]
    if kind == ev.MESSAGES_SNAPSHOT:
        messages = event.get("messages")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("id"), str)
                and isinstance(m.get("role"), str) for m in messages):
            return "whose 'messages' is not a list of messages with string ids and roles"
    elif kind == ev.STATE_DELTA:
        delta = event.get("delta")
        if not isinstance(delta, list) or not all(isinstance(op, dict) for op in delta):
            return "whose 'delta' is not a JSON Patch (a list of operations)"
    elif kind == ev.RUN_ERROR and "code" in event and not isinstance(event["code"], str):
        return "with a 'code' that is not a string"
    return None


#: Checked against the AG-UI schema, as a client's `@ag-ui/client` checks each event: every
#: type but a stream's tokens (a few string fields each, which the order rules check, and
#: which come by the thousand).
_SCHEMA: Final = TypeAdapter(AGUIEvent)
_NOT_SCHEMA_CHECKED: Final = frozenset({
    ev.TEXT_MESSAGE_CONTENT, ev.TOOL_CALL_ARGS, ev.TEXT_MESSAGE_CHUNK, ev.TOOL_CALL_CHUNK,
    EventType.REASONING_MESSAGE_CONTENT.value, EventType.REASONING_MESSAGE_CHUNK.value})
#: The run's own start and end, checked with these in place of their ids (the runtime sets
#: those, whatever the remote sent). RUN_STARTED's `input`, an echo of the request the
#: runtime replaces with its own, is left out: checking it would walk the whole history.
_RUN_IDS: Final = {"threadId": "-", "runId": "-"}
_ENVELOPE: Final = frozenset({ev.RUN_STARTED, ev.RUN_FINISHED})
_ROLES: Final = frozenset({"developer", "system", "assistant", "user"})


def _schema_problem(event: dict[str, Any]) -> str | None:
    """Where `event` breaks the AG-UI schema (which a client enforces), or None."""
    kind = event["type"]
    if kind in _ENVELOPE:
        event = {key: item for key, item in event.items() if key != "input"} | _RUN_IDS
    elif kind in _NOT_SCHEMA_CHECKED:
        # A token's own fields: the order rules hold its ids and text to strings.
        if "timestamp" in event and (not isinstance(event["timestamp"], int)
                                     or isinstance(event["timestamp"], bool)):
            return "with a 'timestamp' that is not an integer"
        if "role" in event and event["role"] not in _ROLES:
            return "with a 'role' no client knows"
        return None
    for key in REQUIRED_FIELDS.get(kind, ()):  # (in the order rules' words, not pydantic's)
        if not isinstance(event.get(key), str):
            return f"without a string '{key}'"
    try:
        _SCHEMA.validate_python(event)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False, include_context=False)[0]
        where = ".".join(str(part) for part in error["loc"][1:] if part != kind) or "the event"
        said = quoted(error["msg"], 160) or "invalid"  # (it may quote what the remote sent)
        return f"that does not match the AG-UI schema ({where[:120]}: {said})"
    return None


def _needs_strip(event: dict[str, Any]) -> bool:
    for key, item in event.items():
        if item is None and key not in ev.NULLABLE_DATA_KEYS:
            return True
        if key not in ev.APPLICATION_DATA_KEYS and isinstance(item, dict | list):
            return True
    return False


#: A remote's RUN_ERROR `code` passed on as it is (clients show it, GraphQL as the
#: `originalErrorType`): a short plain token, no secret; any other is UPSTREAM_ERROR.
_PLAIN_CODE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _relayed_error(event: Event, source: str, known: Sequence[str]) -> Event:
    """A remote's RUN_ERROR as the client may read it: its message `quoted`, its code a
    plain token (a stack trace, a path or a key in either stays with the remote)."""
    message, code = event.get("message"), event.get("code")
    if isinstance(message, str):
        said = quoted(message, 500, known)
        if said != message:
            event = {**event, "message": said or f"{source} failed (its message is withheld: "
                     "it held a stack trace or a file path)"}
    if isinstance(code, str) and not (_PLAIN_CODE.fullmatch(code)
                                      and quoted(code, 64, known) == code):
        event = {**event, "code": UpstreamError.code}
    return event


#: Unknown event types logged in one run before the rest are dropped unlogged.
_UNKNOWN_LOGGED = 5


class RemoteEventChecker:
    """Normalises and checks one run's events from a remote producer named `source`.

    Chunks are expanded and the order rules checked by the core's `event_order`, strictly:
    a remote agent that breaks them fails its run with a message naming the mistake (an
    empty content delta, which the newer clients take, is dropped instead). What
    the remote says is passed on `quoted`, the `known` secrets (the credentials its request
    carried) blanked.
    """

    def __init__(self, source: str, known: Sequence[str] = ()) -> None:
        self.source = source
        self.known = known
        #: The unknown event types logged in this run (each once, a few at most: a remote
        #: agent sending thousands of them wrote a log line for each).
        self._unknown: set[str] = set()
        self._chunks = ChunkState()
        self._order = OrderChecker(run_started_first=False)
        #: What was wrong with the remote's stream, found after the events `payloads`
        #: returned with it.
        self.failure: UpstreamError | None = None

    @property
    def finished(self) -> bool:
        return self._order.finished

    def _drop_unknown(self, kind: str) -> None:
        """Log the first events of a type no protocol knows, once a type and a few a run."""
        unknown = self._unknown
        if kind in unknown or len(unknown) > _UNKNOWN_LOGGED:
            return
        unknown.add(kind)
        if len(unknown) > _UNKNOWN_LOGGED:
            _log.warning("dropping events of more unknown types; not logging them in this run",
                         source=self.source)
        else:
            _log.warning("dropping events of an unknown type", source=self.source, type=kind)

    def payloads(self, payloads: Iterable[bytes]) -> list[Event]:
        """Decode SSE `data:` payloads (JSON objects) and check them.

        At a bad one the events before it are returned and its error kept as `failure`, for
        the caller to raise once it has passed them on (what a client sees must not depend
        on how the network split the stream); a later call raises it.
        """
        if self.failure is not None:
            raise self.failure
        events: list[Any] = []
        failure: UpstreamError | None = None
        for payload in payloads:
            try:
                event = decode_json(payload)
            except orjson.JSONDecodeError:
                # Quoted as any upstream's words are: without the credentials, paths and
                # stack traces a broken event may hold.
                said = quoted(payload[:80].decode("utf-8", "replace"), known=self.known)
                failure = self._error("sent an event that is not valid JSON" + (
                    f": {said!r}" if said else ""))
                break
            if nests_too_deep(event, payload):  # before anything walks it recursively
                failure = self._error(f"sent an event nested deeper than {MAX_JSON_DEPTH} "
                                      "levels")
                break
            events.append(event)
        checked, self.failure = self._checked(events, failure)
        return checked

    def events(self, events: Iterable[Any]) -> list[Event]:
        """Check decoded events (a JSONL line's, translated) as `payloads` checks SSE ones:
        those before a bad one returned, its error kept as `failure`."""
        if self.failure is not None:
            raise self.failure
        checked, self.failure = self._checked(events, None)
        return checked

    def check(self, events: Iterable[Any]) -> list[Event]:
        """Check decoded events; raise at the first bad one."""
        checked, failure = self._checked(events, None)
        if failure is not None:
            raise failure
        return checked

    def _checked(self, events: Iterable[Any], failure: UpstreamError | None
                 ) -> tuple[list[Event], UpstreamError | None]:
        """The events fit to pass on, up to the first bad one, and its error (else
        `failure`, the error of what came after them). Each stage stops at its first bad
        event; its error wins over a later one's."""
        known, failure = self._known(events, failure)
        expanded: list[Event] = []
        try:
            for event in known:
                if event["type"] in _CHUNKS:
                    expand_chunk(event, self._chunks, expanded)
                else:
                    self._chunks.close(event, expanded)
                    expanded.append(event)
        except ChunkError as exc:
            failure = self._error(f"sent {exc}")
        return self._ordered(expanded, failure)

    def _known(self, events: Iterable[Any], failure: UpstreamError | None
               ) -> tuple[list[Event], UpstreamError | None]:
        """The events of known types, normalised, up to the first of a wrong shape."""
        known: list[Event] = []
        for event in events:
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                return known, self._error("sent an event without a string 'type'")
            if _needs_strip(event):
                event = strip_nulls(event)
            if event["type"] not in _KNOWN_TYPES:
                self._drop_unknown(event["type"])
                continue
            problem = _shape_problem(event) or _schema_problem(event)
            if problem is not None:
                return known, self._error(f"sent {event['type']} {problem}")
            if event["type"] == ev.RUN_ERROR:
                event = _relayed_error(event, self.source, self.known)
            known.append(event)
        return known, failure

    def _ordered(self, expanded: list[Event], failure: UpstreamError | None
                 ) -> tuple[list[Event], UpstreamError | None]:
        """The events in the order the clients accept, up to the first out of order."""
        out: list[Event] = []
        for event in expanded:
            if self._order.finished:
                # Anything after the remote's terminal event is not part of the run, a bad
                # event included.
                return out, None
            if event["type"] == ev.RUN_STARTED:
                out.append(event)  # the run manager drops it: it sends the run's own
                continue
            problem = self._order.check(event)
            if problem is not None:
                if problem == EMPTY_DELTA:
                    continue  # dropped, as the run's own are (clients since 0.0.59 take it)
                # (it names the remote's ids: quoted as its words are, and bounded)
                said = quoted(f"sent {event['type']} {problem}", 300, self.known)
                return out, self._error(said or f"sent {event['type']} out of order (its ids "
                                        "are withheld: they held a stack trace or a file path)")
            out.append(event)
        return out, None if self._order.finished else failure

    def end_of_stream(self) -> None:
        """Raise unless the remote ended the run before closing its stream."""
        if not self.finished:
            raise self._error("closed its stream before the end of the run "
                              "(no RUN_FINISHED or RUN_ERROR)")

    def _error(self, what: str) -> UpstreamError:
        return UpstreamError(f"{self.source} {what}")


class StateDeltaEncoder:
    """One run's state changes as events: the first as a snapshot, then deltas.

    A changed state goes out as an RFC 6902 `STATE_DELTA` (`state_patch`: linear in the
    state's size, only operations the clients apply) when that is smaller than the
    snapshot, an unchanged one not at all. Give it JSON-ready values it may keep.
    """

    __slots__ = ("_encoded", "_sent", "_state", "deltas")

    def __init__(self, *, deltas: bool = True) -> None:
        self.deltas = deltas
        self._state: Any = None
        self._encoded = b""
        self._sent = False

    def encode(self, state: Any) -> Event | None:
        if not self.deltas:  # (each state goes whole: no encoding to compare the next with)
            self._state, self._encoded, self._sent = state, b"", True
            return ev.state_snapshot(state)
        previous, previous_encoded, sent = self._state, self._encoded, self._sent
        encoded = orjson.dumps(state, option=orjson.OPT_NON_STR_KEYS)
        self._state, self._encoded, self._sent = state, encoded, True
        if not sent:
            return ev.state_snapshot(state)
        if encoded == previous_encoded:  # (JSON's equality: `==` takes True for 1)
            return None
        if not isinstance(state, dict) or not isinstance(previous, dict):
            return ev.state_snapshot(state)
        patch = state_patch(previous, state, len(encoded) - 1)
        if patch is None:
            return ev.state_snapshot(state)
        return ev.state_delta(patch) if patch else None
