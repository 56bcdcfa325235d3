"""Which SQLite failures are the file's rather than the statement's: a 503, tried again.

A file another connection holds, a full disk, a failing one, a file made read-only or gone:
each passes, and what asked may ask again (a run's end is written once it has passed). A
constraint or a bug in a statement is no outage: it fails as it is.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator

from copilot_runtime._exceptions import ServiceUnavailableError

__all__ = ["sqlite_outage", "sqlite_outages"]

#: The primary result codes (an extended one, such as SQLITE_BUSY_SNAPSHOT or
#: SQLITE_IOERR_WRITE, shares its low byte) of a file another connection holds...
_HELD = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})
#: ... and of one that cannot be written now: its disk full or failing, the file read-only,
#: or not to be opened (its directory removed).
_UNWRITABLE = frozenset({sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_READONLY,
                         sqlite3.SQLITE_CANTOPEN})


def sqlite_outage(exc: BaseException) -> str | None:
    """What a store cannot do now, if `exc` is an outage of its file (said to a client: no
    path); None for any other failure."""
    code = getattr(exc, "sqlite_errorcode", None)  # (not on errors raised by us)
    if not isinstance(exc, sqlite3.Error) or code is None:
        return None
    if code & 0xFF in _HELD:
        return "is busy: another connection holds its file"
    if code & 0xFF in _UNWRITABLE:
        return "cannot write its file now (a full or failing disk, or a read-only file)"
    return None


@contextlib.asynccontextmanager
async def sqlite_outages(store: str) -> AsyncIterator[None]:
    """An outage of the file (`sqlite_outage`) inside is a `ServiceUnavailableError` naming
    `store` ("The thread store")."""
    try:
        yield
    except sqlite3.Error as exc:
        why = sqlite_outage(exc)
        if why is None:
            raise
        raise ServiceUnavailableError(f"{store} {why}") from exc
