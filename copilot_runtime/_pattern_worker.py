"""The child process where `PatternGuardrail` searches (run as a script: `python -I -S
this_file`, so it imports nothing but the standard library).

A pattern that backtracks for minutes holds this process, which the runtime kills at the
guardrail's timeout, and never the server's event loop (`re` holds the GIL: a thread would
not free it). Each request is one line of JSON, `[[[pattern, flags], ...], [text, ...]]`;
the answer is one line, the index of the first pattern that matches a text or its
normalised form, or -1.
"""

from __future__ import annotations

import json
import re
import sys
import unicodedata

_SPACE = re.compile(r"\s+")


def normalised(text: str) -> str:
    """`text` as a reader sees it: compatibility forms folded (fullwidth letters,
    ligatures), invisible format characters (zero-width spaces, soft hyphens) removed, and
    every run of whitespace one space."""
    if not text.isascii():  # ASCII has neither compatibility forms nor format characters
        text = unicodedata.normalize("NFKC", text)
        text = "".join(c for c in text if unicodedata.category(c) != "Cf")
    return _SPACE.sub(" ", text)


def first_match(patterns: list[re.Pattern[str]], texts: list[str]) -> int:
    for text in texts:
        folded = normalised(text)
        forms = (text,) if folded == text else (text, folded)
        for index, pattern in enumerate(patterns):
            if any(pattern.search(form) for form in forms):
                return index
    return -1


def main() -> None:
    compiled: dict[tuple[str, int], re.Pattern[str]] = {}
    for line in sys.stdin.buffer:
        sources, texts = json.loads(line)
        patterns = []
        for source, flags in sources:
            key = (source, flags)
            if key not in compiled:
                compiled[key] = re.compile(source, flags)
            patterns.append(compiled[key])
        sys.stdout.write(f"{first_match(patterns, texts)}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
