"""Settings that take several strings, held to not being given one.

A `str` is itself an iterable of strings, so `approver_roles="approver"` type-checks as
`Iterable[str]` and silently becomes its letters: {"a", "e", "o", ...}. Refused instead.
"""

from __future__ import annotations

from copilot_runtime._exceptions import ConfigurationError

__all__ = ["not_one_string"]


def not_one_string(value: object, what: str) -> None:
    """ConfigurationError naming `what` when `value`, meant as several strings, is one string
    (or bytes, whose items are numbers)."""
    if isinstance(value, str | bytes | bytearray):
        raise ConfigurationError(
            f"{what} takes several strings, not one string: write ({value!r},) "
            f"or [{value!r}]")
