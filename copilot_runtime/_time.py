"""Timestamps as the wire protocols write them: ISO 8601 in UTC with milliseconds and `Z`."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

__all__ = ["iso_time", "now_iso", "parse_time"]


def iso_time(timestamp: float) -> str:
    """`2026-01-02T03:04:05.678Z` for epoch seconds."""
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def now_iso() -> str:
    return iso_time(time.time())


def parse_time(value: Any) -> float | None:
    """An ISO 8601 time (as AG-UI's `expiresAt`) or epoch seconds; None if neither, or if
    no clock reaches it (NaN, infinities, beyond year 9999): `iso_time` could not write it,
    and every listing of the approval holding it would fail."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and value:
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)  # a time without a zone is taken as UTC
        try:  # (year 9999 an hour west of UTC is in year 10000 in UTC)
            seconds = parsed.timestamp()
        except (OverflowError, ValueError):
            return None
    else:
        return None
    try:
        datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, ValueError, OSError):  # (NaN is a ValueError)
        return None
    return seconds
