"""Whether a value a client sends back is a graph's value as the client was shown it.

A client echoes its state, and quotes an interrupt's question, as it read them: a set's
items in the order some process showed them (its hash order, before `json_safe` sorted
them), an integer beyond 2**53 as the nearest double (a browser's number), true never as 1.
`==` on the JSON form took a set below the top level in another order, or a rounded id, for
a change (written over the checkpoint: a list where the node wants a set, another id), and
1 for true (a client's real change dropped). `is_shown` compares as the client reads, at
any depth.
"""

from __future__ import annotations

import math
from collections import Counter
from decimal import Decimal
from typing import Any

from copilot_runtime.agents._lg_values import Unordered, json_order

__all__ = ["is_shown"]

# A set's items pair off by trial beyond their sorted order only up to this many alike
# (`_loose`): past it a client's echo in another order reads as a change.
_MAX_ALIKE = 64


def is_shown(shown: Any, given: Any) -> bool:
    """Whether the client's `given` is `shown` (a `json_shown` value) as the client read it."""
    if isinstance(shown, float) and not math.isfinite(shown):
        shown = None  # (JSON.stringify writes null)
    if isinstance(shown, bool) or isinstance(given, bool):
        return isinstance(shown, bool) and isinstance(given, bool) and shown == given
    if isinstance(shown, int | float):
        if not isinstance(given, int | float):
            return False
        if isinstance(given, int) and not _a_double(given):
            # No browser sends it (a client reading integers whole did): exactly, or changed.
            return isinstance(shown, int) and shown == given
        return _number(shown) == _number(given)
    if isinstance(shown, Unordered):
        return isinstance(given, list) and len(given) == len(shown) and _paired(shown, given)
    if isinstance(shown, list):
        return isinstance(given, list) and len(given) == len(shown) and all(
            is_shown(item, other) for item, other in zip(shown, given, strict=True))
    if isinstance(shown, dict):
        return isinstance(given, dict) and given.keys() == shown.keys() and all(
            is_shown(item, given[key]) for key, item in shown.items())
    if isinstance(shown, str):
        return isinstance(given, str) and shown == given
    return shown is None and given is None


def _a_double(value: int) -> bool:
    """Whether a browser can send the integer: a double as JavaScript prints it (its
    shortest decimal: 2**60 as 1152921504606847000, never as 1152921504606846976)."""
    try:
        nearest = float(value)
    except OverflowError:
        return False
    return int(Decimal(repr(nearest))) == value


def _number(value: int | float) -> int | float:
    """`value` as JavaScript reads it: a double, an integer beyond 2**53 the nearest one."""
    try:
        return float(value)
    except OverflowError:  # beyond any double: no client sends it as a number anyway
        return value


def _paired(shown: list[Any], given: list[Any]) -> bool:
    """Whether each of a set's `shown` items is shown as its own item of `given`, in any
    order. In sorted order first (a client's echo mostly is); else among the items alike."""
    try:
        ordered = sorted(given, key=json_order)
    except TypeError:  # (an integer beyond 64 bits: JSON text some parsers keep whole)
        ordered = given
    if all(is_shown(item, other) for item, other in zip(shown, ordered, strict=True)):
        return True
    alike: dict[Any, tuple[list[Any], list[Any]]] = {}
    for item in shown:
        alike.setdefault(_loose(item), ([], []))[0].append(item)
    for other in given:
        if (key := _loose(other)) not in alike:
            return False
        alike[key][1].append(other)
    return all(len(items) == len(others) and len(items) <= _MAX_ALIKE
               and _matched(items, others) for items, others in alike.values())


def _loose(value: Any) -> Any:
    """A key that items shown as each other share: their JSON with every list's order left
    out (which items are sets the client's side does not tell)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ("null",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, str):
        return ("str", str(value))
    if isinstance(value, int | float):
        return ("number", _number(value))
    if isinstance(value, list):
        return ("list", frozenset(Counter(_loose(item) for item in value).items()))
    if isinstance(value, dict):
        return ("dict", frozenset((key, _loose(item)) for key, item in value.items()))
    return ("other", repr(value))


def _matched(shown: list[Any], given: list[Any]) -> bool:
    """Whether `shown` and `given` pair off, each pair `is_shown`: by augmenting paths, as a
    first fit can take the one item another needs (a frozenset's and a tuple's)."""
    taker: list[int | None] = [None] * len(given)

    def place(index: int, tried: set[int]) -> bool:
        for at, other in enumerate(given):
            if at not in tried and is_shown(shown[index], other):
                tried.add(at)
                held = taker[at]
                if held is None or place(held, tried):
                    taker[at] = index
                    return True
        return False

    return all(place(index, set()) for index in range(len(shown)))
