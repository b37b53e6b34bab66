"""Medians of ``bench/ab_targets.sh`` output, per side, and the per-round ratios of the second side
over the first (on a shared box only figures of one round compare).

    bash bench/ab_targets.sh /tmp/base 6 --quick > ab.txt
    .venv/bin/python bench/ab_medians.py ab.txt
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict

#: figure -> the pattern of its value in a round's table (cells joined on one line)
FIGURES = {
    "burst blocks/s": r"burst \(simulated start 0\) │ ([\d.]+)",
    "CPU per block, all ms": r"CPU per block, all processes │ ([\d.]+)",
    "controller CPU per block ms": r"ms per block:[^│]*?controller-0 ([\d.]+)",
    "front CPU per block ms": r"ms per block:[^│]*?front-0 ([\d.]+)",
    "placements/s": r"scale calls on existing blocks\) │ ([\d.]+)",
    "CPU per placement ms": r"([\d.]+) ms CPU per placement",
    "controller CPU per placement ms": r"CPU per placement \(controller-0 ([\d.]+)",
    "create->ready p50 ms": r"unloaded \(simulated start 0\) │ ([\d.]+)",
}


def parse(text: str) -> dict[str, dict[str, list[float]]]:
    """side -> figure -> one value per round, in round order."""
    rows: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for chunk in re.split(r"^== ", text, flags=re.M)[1:]:
        side = chunk.split(",")[0]
        flat = re.sub(r"\s+", " ", re.sub(r"(\s*│){6}\s*", " ", chunk))  # a wrapped note's continuation
        for name, pat in FIGURES.items():
            m = re.search(pat, flat)
            if m:
                rows[side][name].append(float(m.group(1)))
    return rows


def report(rows: dict[str, dict[str, list[float]]]) -> str:
    out = []
    for side, figs in rows.items():
        out.append(f"{side} ({max((len(v) for v in figs.values()), default=0)} rounds): median (range)")
        out += [f"  {k:32s} {statistics.median(v):8.2f} ({min(v):.2f}-{max(v):.2f})" for k, v in figs.items()]
    if len(rows) == 2:
        a, b = rows
        out.append(f"{b} / {a}, per round: median (each round)")
        for k, v in rows[a].items():
            rs = [y / x for x, y in zip(v, rows[b].get(k, []), strict=False) if x]
            if rs:
                out.append(f"  {k:32s} {statistics.median(rs):6.3f} ({', '.join(f'{r:.2f}' for r in rs)})")
    return "\n".join(out)


if __name__ == "__main__":
    print(report(parse("".join(open(p).read() for p in sys.argv[1:]))))
