"""Server-sent events read as the SSE spec reads them, for the rare stream the parsers' fast
path, one JSON value per `data:` line, cannot read: an event whose data is split over several
`data:` lines, which the spec joins with "\\n". Used only once a line failed to decode."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["event_data", "line_at"]


def line_at(lines: Sequence[bytes], line: bytes) -> int:
    """Where `line`, one of `lines` (a `data:` line: an object of its own), is in them."""
    return next(at for at, seen in enumerate(lines) if seen is line)


def event_data(lines: Sequence[bytes], *, ended: bool) -> tuple[list[bytes], list[bytes]]:
    """The data of each event of `lines` (its `data:` lines' values joined with "\\n"; an
    event without any is left out), and the lines of the last one when it has not ended.

    `ended`: the lines end with an event's end (a blank line cut off them); else the lines
    after the last blank line are an event still to come, given back to be held.
    """
    data: list[bytes] = []
    values: list[bytes] = []
    start = 0
    for at, line in enumerate(lines):
        if line in (b"", b"\r"):  # a blank line (after "\n", or the "\r" of "\r\n") ends it
            if values:
                data.append(b"\n".join(values))
                values = []
            start = at + 1
        elif line.startswith(b"data:"):
            value = line[5:]
            values.append(value[1:] if value.startswith(b" ") else value)
    if not ended:
        return data, list(lines[start:])
    if values:
        data.append(b"\n".join(values))
    return data, []
