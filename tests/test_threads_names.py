"""Names given to threads (`PATCH threads/{id}`) and the titles taken from their first
message show in lists as they are: blank is no name, and nothing in one can break a line,
drive a terminal, or make it read as other text.

Before: "" and "   " were kept as names (a list then showed a blank where the title would
have been), and C1 control characters ("\\x85" breaks a line, "\\x9b" starts a terminal
escape), line separators and bidirectional overrides ("Trojan Source") passed both.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from copilot_runtime import events as ev
from copilot_runtime.threads.base import title_of
from tests import test_threads_resume as resume
from tests.conftest import Served
from tests.test_trust_ownership import call

pytestmark = pytest.mark.timeout(60)

#: A runtime served on each store (memory, SQLite, PostgreSQL), as the resume tests have it.
store_url = resume.store_url
served = resume.served

REFUSED = ["a\x85b", "a\x9b31mb", "a\u2028b", "a\u2029b", "evil\u202eexe.txt", "a\u2066b\u2069",
           "a\u202ab", "a\x00b", "a\nb", "a\x7fb"]


async def rename(served: Served, name: Any) -> tuple[int, Any]:
    status, body, _ = await call(served, "PATCH", "/threads/t", None, {"name": name})
    return status, orjson.loads(body)


async def test_names_are_kept_as_lists_show_them(served: Served) -> None:
    await resume.run_ids(served, "t", "hello", "r1")
    for blank in ("", "   ", "\t", "\u3000"):
        assert await rename(served, blank) == (200, {"id": "t", "name": None}), repr(blank)
    assert await rename(served, "  Plans  ") == (200, {"id": "t", "name": "Plans"})
    for name in ("é" * 200, "👨‍👩‍👧 family", "עברית\u200f", "a" * 190 + "   "):
        status, body = await rename(served, name)
        assert (status, body["name"]) == (200, name.strip()), name
    for name in REFUSED:
        status, body = await rename(served, name)
        assert status == 400, repr(name)
        assert "control characters" in body["error"]
    status, body, _ = await call(served, "GET", "/threads", None)
    assert [t["name"] for t in orjson.loads(body)["threads"]] == ["a" * 190]


def test_titles_hold_none_of_it() -> None:
    for text in REFUSED:
        started = ev.run_started("t", "r", {"messages": [
            {"id": "u", "role": "user", "content": text}]})
        title = title_of([started])
        assert title == " ".join(title.split()), repr(text)
        assert not any(c in title for c in "\x85\x9b\u2028\u2029\u202e\u2066\u2069\u202a"), \
            repr(title)
