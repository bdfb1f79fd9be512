"""Read a py-spy profile in its raw (collapsed stacks) format and print where the time went.

    python -m bench.profile_top bench/out/profile/gateway-web-100-b2b.txt [--top 40] [--under NAME]
                                [--callees FUNCTION]

Each line of the file is `frame;frame;...;frame count` (py-spy's `--format raw`; a frame
reads `function (file:line)`). Printed: the functions with the most samples of their own
("self") and the most samples anywhere on the stack ("total", each stack counted once per
function), as a share of all samples. `--under NAME` keeps only the stacks that pass through
a function whose name contains NAME (e.g. `_turn`), to split one path's cost.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def frame_name(frame: str) -> str:
    """`func (path/to/file.py:123)` → `func (path/to/file.py)`: lines of one function merge."""
    match = FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    return f"{match['func']} ({match['file']})"


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    stacks: list[tuple[list[str], int]] = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        head, _, count = line.rpartition(" ")
        if not head or not count.isdigit():
            continue
        stacks.append(([frame_name(f) for f in head.split(";") if f], int(count)))
    return stacks


def report(stacks: list[tuple[list[str], int]], top: int) -> list[str]:
    total = sum(n for _, n in stacks)
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    for frames, n in stacks:
        if frames:
            own[frames[-1]] += n
        for name in set(frames):
            anywhere[name] += n
    lines = [f"{total} samples"]
    for title, counts in (("self", own), ("total", anywhere)):
        lines.append(f"\n{title:>6}  function")
        for name, n in counts.most_common(top):
            lines.append(f"{100 * n / max(1, total):5.1f}%  {name}")
    return lines


def callees(stacks: list[tuple[list[str], int]], name: str, top: int) -> list[str]:
    """Where the samples under the function `name` (its outermost call) go: its callees'
    totals, and its own share."""
    total = sum(n for _, n in stacks)
    under: Counter[str] = Counter()
    inside = own = 0
    for frames, n in stacks:
        at = next((i for i, f in enumerate(frames) if name == f.split(" (")[0]), None)
        if at is None:
            continue
        inside += n
        if at + 1 < len(frames):
            under[frames[at + 1]] += n
        else:
            own += n
    lines = [f"{name}: {100 * inside / max(1, total):.1f}% of all samples; of those:",
             f"{100 * own / max(1, inside):5.1f}%  (itself)"]
    for callee, n in under.most_common(top):
        lines.append(f"{100 * n / max(1, inside):5.1f}%  {callee}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--under", default=None, help="only stacks through a function whose name contains this")
    parser.add_argument("--callees", default=None, metavar="FUNCTION",
                        help="where the samples under FUNCTION (e.g. SessionManager._turn) go, by callee")
    args = parser.parse_args()
    stacks = read_stacks(args.profile)
    if args.callees:
        print("\n".join(callees(stacks, args.callees, args.top)))
        return 0
    if args.under:
        stacks = [(frames, n) for frames, n in stacks if any(args.under in f.split(" (")[0] for f in frames)]
    print("\n".join(report(stacks, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
