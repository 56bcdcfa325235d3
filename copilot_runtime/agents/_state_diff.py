"""The RFC 6902 patch from one JSON state to the next, as the runtime sends it to clients.

jsonpatch's `make_patch` took time quadratic in a list's length (an item put in front of
12,000 held the event loop for seconds), compared with Python's `==`, for which `True`
equals 1 (a flag going from 0 to false was never sent), and wrote `move`s that
fast-json-patch, as `@ag-ui/client` calls it, refuses (the client then kept its old state
and sent it back). `state_patch` walks both values once: objects key by key; lists past the
items both start and end with, item by item, then items removed or added there; a value
whose JSON type changed replaced whole; only `add`, `remove` and `replace`. A list
whose item-by-item patch would be larger than the list itself is replaced whole, and a
patch larger than `limit` bytes is given up (the caller sends a snapshot).
"""

from __future__ import annotations

from typing import Any, Final

import orjson

__all__ = ["state_patch"]

# An operation's bytes besides its path and value: {"op":"replace","path":"","value":},
_OP_BYTES: Final = 36
# Keys fast-json-patch refuses in a path ("prototype" only after "constructor"; any here):
# the part that holds one goes whole.
_REFUSED_KEYS: Final = frozenset({"__proto__", "prototype"})
_NO_VALUE: Final = object()  # (a `remove`'s: None is JSON's null)


class _TooLarge(Exception):
    """The patch outgrew its budget."""


def state_patch(old: dict[str, Any], new: dict[str, Any],
                limit: int) -> list[dict[str, Any]] | None:
    """The operations that make `old` into `new` (both JSON values: what `orjson` reads),
    or None when they would take more than about `limit` bytes."""
    diff = _Diff(limit)
    try:
        diff.objects("", old, new)
    except _TooLarge:
        return None
    return diff.ops


class _Diff:
    __slots__ = ("left", "ops")

    def __init__(self, budget: int) -> None:
        self.ops: list[dict[str, Any]] = []
        self.left = budget

    def value(self, path: str, old: Any, new: Any) -> None:
        if _same(old, new):
            return
        if isinstance(old, dict) and isinstance(new, dict):
            self.objects(path, old, new)
        elif isinstance(old, list) and isinstance(new, list):
            self.lists(path, old, new)
        else:
            self.emit("replace", path, new)

    def objects(self, path: str, old: dict[str, Any], new: dict[str, Any]) -> None:
        for key in old:
            if key not in new:
                self.emit("remove", _child(path, key))
        for key, item in new.items():
            if key in old:
                self.value(_child(path, key), old[key], item)
            else:
                self.emit("add", _child(path, key), item)

    def lists(self, path: str, old: list[Any], new: list[Any]) -> None:
        size = _size(new)
        items = _Diff(min(size, self.left))
        try:
            items.items(path, old, new)
        except _TooLarge:  # (most items changed, or were shifted by more than were kept)
            self.emit("replace", path, new, size=size)
            return
        self.ops += items.ops
        self.left -= min(size, self.left) - items.left

    def items(self, path: str, old: list[Any], new: list[Any]) -> None:
        """What lies between the items both lists start with and those both end with:
        changed item by item, then the old list's rest removed or the new one's added."""
        start, end = 0, min(len(old), len(new))
        while start < end and _same(old[start], new[start]):
            start += 1
        kept = 0
        while kept < end - start and _same(old[-1 - kept], new[-1 - kept]):
            kept += 1
        old_end, new_end = len(old) - kept, len(new) - kept
        common = min(old_end, new_end)
        for index in range(start, common):
            self.value(f"{path}/{index}", old[index], new[index])
        for index in reversed(range(common, old_end)):  # (from the last: indices hold)
            self.emit("remove", f"{path}/{index}")
        for index in range(common, new_end):
            self.emit("add", f"{path}/{index}", new[index])

    def emit(self, op: str, path: str, value: Any = _NO_VALUE, size: int = -1) -> None:
        """Add an operation (`size`: its value's JSON bytes, when known), or raise
        `_TooLarge` when the budget cannot take it."""
        cost = _OP_BYTES + len(path)
        if value is not _NO_VALUE:
            cost += size if size >= 0 else _size(value)
        self.left -= cost
        if self.left < 0:
            raise _TooLarge
        self.ops.append({"op": op, "path": path} if value is _NO_VALUE
                        else {"op": op, "path": path, "value": value})


def _same(old: Any, new: Any) -> bool:
    """Equal as JSON: Python's `==` takes True for 1 (and sees no type inside a list)."""
    if type(old) is not type(new) or old != new:
        return False
    return not isinstance(new, dict | list) or orjson.dumps(old) == orjson.dumps(new)


def _child(path: str, key: Any) -> str:
    if not isinstance(key, str) or key in _REFUSED_KEYS:
        raise _TooLarge  # (the list that holds it goes whole, or the state as a snapshot)
    return f"{path}/{key.replace('~', '~0').replace('/', '~1')}"


def _size(value: Any) -> int:
    return len(orjson.dumps(value))
