"""Durations as settings give them: a positive number of seconds, at most 100 years."""

from __future__ import annotations

import math

from copilot_runtime._exceptions import ConfigurationError

__all__ = ["MAX_SECONDS", "checked_seconds"]

#: The longest duration a setting takes (100 years): beyond it a deadline is not a date any
#: clock can write, nor a delay an event loop's timer (milliseconds in 64 bits) can hold.
MAX_SECONDS: float = 100 * 365.25 * 24 * 3600


def checked_seconds(value: float | None, what: str, *, none_means: str) -> float | None:
    """`value` as a setting's seconds, or ConfigurationError naming `what`: a positive, finite
    number of seconds (at most `MAX_SECONDS`), or None (which `none_means`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{what} must be a number of seconds or None, "
                                 f"not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
        raise ConfigurationError(
            f"{what} must be more than 0 and at most {MAX_SECONDS:.0f} seconds "
            f"(100 years), got {value!r}; use None for {none_means}")
    return value
