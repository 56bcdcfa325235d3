"""Summarise a `py-spy record --format raw` file: top functions by own and by inclusive samples.

    python bench/pyspy_summary.py RAW [--top 25]

Each line of RAW is a stack, outermost frame first, `;`-separated, then a space and a count.
Frames are `function (file:line)`; line numbers are dropped so one function is one row.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_LINE = re.compile(r":\d+\)$")
_SITE = re.compile(
    r"\((?:.*/site-packages/|.*/lib/python3\.\d+/|.*/(?=copilot_runtime/|bench/))?(.*)\)$"
)


def _short(frame: str) -> str:
    frame = _LINE.sub(")", frame)
    match = _SITE.search(frame)
    return frame[: match.start()] + f"({match.group(1)})" if match else frame


def _package(frame: str) -> str:
    match = re.search(r"\(([^/)]+)", frame)
    name = match.group(1) if match else "?"
    return name.removesuffix(".py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    total = 0
    with open(args.raw, encoding="utf-8") as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = [_short(f) for f in stack.split(";")]
            own[frames[-1]] += n
            packages[_package(frames[-1])] += n
            for frame in set(frames):
                inclusive[frame] += n
    if not total:
        print("no samples")
        return

    def show(title: str, counter: Counter[str]) -> None:
        print(f"\n{title}")
        for name, n in counter.most_common(args.top):
            print(f"{100 * n / total:5.1f}%  {name}")

    print(f"{total} samples")
    show("own time by package (where the sampled frame's code lives)", packages)
    show("own time by function", own)
    # frames on (nearly) every stack (the entry point, the event loop) say nothing; skip them
    inner = Counter({name: n for name, n in inclusive.items() if n < 0.8 * total})
    show("inclusive time by function (frames on more than 80% of the stacks left out)", inner)


if __name__ == "__main__":
    main()
