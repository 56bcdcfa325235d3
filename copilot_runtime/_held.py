"""What a stream parser holds between reads: the start of a record that has not ended yet.

Every upstream sends records ended by a separator (a provider's or a remote agent's SSE
event, a legacy endpoint's JSONL line), and a read may stop anywhere. The reads of an
unfinished record are kept apart and joined only when a read could end it: joining at every
read costs the square of a long record's length. What is held is bounded, so an upstream
that never ends a record fails its run instead of filling the memory.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_UPSTREAM_EVENT_BYTES", "HeldBytes", "by_events", "event_stream"]

#: The largest record (one event, one line) an upstream may send: far beyond any real one.
MAX_UPSTREAM_EVENT_BYTES: Final = 16 * 1024 * 1024
#: UTF-8's byte-order mark, which the SSE spec drops from the start of a stream.
_BOM: Final = b"\xef\xbb\xbf"


class HeldBytes:
    """The unfinished record of one stream, between its reads.

    `take(read)` is what to parse now: the read itself when nothing is held, the held
    record joined with the read when the read may end it, or None (nothing to parse yet).
    The parser parses what ended and gives the rest back with `hold(rest)`. `end` is the
    separator, seen after the parser's own line-end normalisation; one that falls across two
    reads is found. A record held past `MAX_UPSTREAM_EVENT_BYTES` raises `error`, saying
    "`source` sent `record` larger than N bytes".
    """

    __slots__ = ("_end", "_error", "_limit", "_parts", "_record", "_size", "_source")

    def __init__(self, source: str, error: type[Exception], *, end: bytes = b"\n",
                 record: str = "an event") -> None:
        self._source, self._error, self._end, self._record = source, error, end, record
        self._limit = MAX_UPSTREAM_EVENT_BYTES
        self._parts: list[bytes] = []  # the reads of the unfinished record
        self._size = 0

    def take(self, read: bytes) -> bytes | None:
        parts = self._parts
        if not parts:
            return read
        end = self._end
        ends = end in read or (len(end) > 1 and end in parts[-1][1 - len(end):]
                               + read[:len(end) - 1])
        if read:
            parts.append(read)
            self._grow(len(read))
        if not ends:
            return None
        self._parts, self._size = [], 0
        return b"".join(parts)

    def events(self, read: bytes) -> bytes | None:
        """The server-sent events `read` completes, after what is held before it: the text up
        to the last blank line, CRLF line ends made LF, the rest held. None while no event
        has ended."""
        buffer = self.take(read)
        if buffer is None:
            return None
        if b"\r" in buffer:  # CRLF line ends, which the SSE spec allows (JSON has no raw CR)
            buffer = buffer.replace(b"\r\n", b"\n")
        end = buffer.rfind(b"\n\n")
        if end < 0:
            self.hold(buffer)
            return None
        self.hold(buffer[end + 2 :])
        return buffer[:end]

    def hold(self, rest: bytes) -> None:
        """Keep `rest`, the unfinished record that follows the last complete one."""
        if rest:
            self._parts, self._size = [rest], 0
            self._grow(len(rest))

    def held(self) -> bool:
        """True when more than whitespace is held."""
        return any(part.strip() for part in self._parts)

    def rest(self) -> bytes:
        """What is held, given up (the stream ended without ending its last record)."""
        rest = b"".join(self._parts)
        self._parts, self._size = [], 0
        return rest

    def _grow(self, size: int) -> None:
        self._size += size
        if self._size > self._limit:
            raise self._error(f"{self._source} sent {self._record} larger than "
                              f"{self._limit} bytes")


def event_stream(source: str, error: type[Exception]) -> HeldBytes:
    """The `HeldBytes` of a server-sent event stream, which reads the stream's start as the
    SSE spec does: a leading byte-order mark dropped, and lines ended by a bare "\\r" when
    the first one is. Its start is read by classes of their own, which then make it a plain
    `HeldBytes` (or one of bare "\\r" lines): nothing is added to a read after the start.
    """
    return _StreamStart(source, error)


def by_events(held: HeldBytes) -> None:
    """`held`, from now on giving what a read completes only once a blank line may have come,
    every line end read as "\\n": for a parser that reads line by line, once its stream sent
    an event over several lines before the event's end came (see `adapters._sse`). What a
    read ends is then read once, not again with each line that follows it."""
    if type(held) is not _ByEvents:
        _become(held, _ByEvents)
        held._end = b"\n\n"
        held._parts = [_lines_ended_by_lf(part) for part in held._parts]


def _lines_ended_by_lf(data: bytes) -> bytes:
    # (a "\r\n" across two reads reads as two line ends: only in this rare stream's rare case)
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


class _ByEvents(HeldBytes):
    """See `by_events`."""

    __slots__ = ()

    def take(self, read: bytes) -> bytes | None:
        return HeldBytes.take(self, _lines_ended_by_lf(read))


def _become(held: HeldBytes, kind: type[HeldBytes]) -> None:
    """`held`, read on as a `kind` (its fields the same: these classes add none)."""
    held.__class__ = kind


class _StreamStart(HeldBytes):
    """A stream until its first bytes say whether they are a byte-order mark."""

    __slots__ = ()

    def take(self, read: bytes) -> bytes | None:
        read = self.rest() + read  # (at most the mark's first two bytes are held)
        if len(read) < len(_BOM) and _BOM.startswith(read):
            self.hold(read)
            return None
        _become(self, _FirstLine)
        return self.take(read.removeprefix(_BOM))


class _FirstLine(HeldBytes):
    """A stream until its first line end, which says how its lines end: "\\n" or "\\r\\n"
    (read as they come), or a bare "\\r" (`_BareCR`)."""

    __slots__ = ()

    def take(self, read: bytes) -> bytes | None:
        # (nothing held has a line end, but for a "\r" that ended the last read)
        seen = b"\r" + read if self._parts and self._parts[-1].endswith(b"\r") else read
        cr, lf = seen.find(b"\r"), seen.find(b"\n")
        if 0 <= lf < cr or cr < 0 <= lf or seen[cr + 1:cr + 2] == b"\n":
            _become(self, HeldBytes)
        elif 0 <= cr < len(seen) - 1:
            _become(self, _BareCR)
            self._parts = [part.replace(b"\r", b"\n") for part in self._parts]
        else:  # no line end yet, or a "\r" last: not known yet (no record can have ended)
            return HeldBytes.take(self, read)
        return self.take(read)


class _BareCR(HeldBytes):
    """A stream whose lines end with a bare "\\r", which the SSE spec allows: read as "\\n"."""

    __slots__ = ()

    def take(self, read: bytes) -> bytes | None:
        return HeldBytes.take(self, _lines_ended_by_lf(read))
