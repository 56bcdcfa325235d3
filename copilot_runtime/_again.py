"""How often a failure that repeats is logged."""

from __future__ import annotations

__all__ = ["worth_logging"]


def worth_logging(in_a_row: int) -> bool:
    """Whether the `in_a_row`th failure in a row is logged: the 1st, 2nd, 4th, 8th...; an
    outage retried every second is a dozen lines an hour, not thousands."""
    return in_a_row > 0 and in_a_row & (in_a_row - 1) == 0
