"""What a stream parser holds between reads: the start of a record that has not ended yet.

Every upstream sends records ended by a separator (a provider's or a remote agent's SSE
event, a legacy endpoint's JSONL line), and a read may stop anywhere. The reads of an
unfinished record are kept apart and joined only when a read could end it: joining at every
read costs the square of a long record's length. What is held is bounded, so an upstream
that never ends a record fails its run instead of filling the memory.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_UPSTREAM_EVENT_BYTES", "HeldBytes"]

#: The largest record (one event, one line) an upstream may send: far beyond any real one.
MAX_UPSTREAM_EVENT_BYTES: Final = 16 * 1024 * 1024


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
