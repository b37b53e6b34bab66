"""Whether a stored history keeps every selection round's steps in causal order: per block,
generation and round, ``selection`` < ``post_dry_run`` < ``cluster.allocation`` < the allocation's
``placement`` (a step stored without its round's selection counts too), and what the fold
(``recovery.fold``: ``blocks recover``/``check``) makes of each block's status. A round out of
order folds wrong: its post_dry_run and placement meet a block that is not yet ``selecting``.

Run: ``.venv/bin/python -m bench.console --blocks 10000 --dump /tmp/console-stream.pkl`` then
``.venv/bin/python -m bench.stream_order /tmp/console-stream.pkl`` (exit status 1 when a round is
out of order).
"""

from __future__ import annotations

import argparse
import collections
import json
import pickle
from pathlib import Path
from typing import Any

from aios_blocks.recovery.fold import fold

STEPS = ("selection", "post_dry_run", "allocation", "placement")


def rounds(msgs: list[tuple[str, bytes, int, float]]) -> dict[tuple[str, Any, Any], dict[str, int]]:
    """(block, gen, round) -> the stream sequence of each of its steps (the first stored)."""
    out: dict[tuple[str, Any, Any], dict[str, int]] = collections.defaultdict(dict)
    for subject, raw, seq, _ts in msgs:
        parts = subject.split(".")
        if len(parts) < 4 or parts[3] not in STEPS:
            continue
        try:
            data = json.loads(raw).get("data")
        except (ValueError, AttributeError):
            continue
        if not isinstance(data, dict):
            continue
        if parts[1] == "block" and parts[3] in ("selection", "post_dry_run"):
            bid = parts[2]
        elif parts[1] == "cluster" and parts[3] == "allocation":
            bid = data.get("block_id", "")
        elif parts[1] == "block" and parts[3] == "placement" and data.get("action") == "allocation":
            bid = parts[2]
        else:
            continue
        out[(bid, data.get("gen"), data.get("attempt", 0))].setdefault(parts[3], seq)
    return out


def out_of_order(steps: dict[tuple[str, Any, Any], dict[str, int]]) -> list[tuple[tuple[str, Any, Any], dict[str, int]]]:
    bad = []
    for key, seqs in steps.items():
        order = [seqs[s] for s in STEPS if s in seqs]
        if order != sorted(order) or ("selection" not in seqs and len(seqs) > 0):
            bad.append((key, seqs))
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", type=Path, help="a stream dumped by bench/console.py --dump (pickle)")
    args = ap.parse_args()
    msgs = pickle.loads(args.dump.read_bytes())
    steps = rounds(msgs)
    bad = out_of_order(steps)
    image = fold(iter(msgs)).image(include_gathers=False)
    statuses = collections.Counter(v.get("status") for k, v in image.items()
                                   if k.startswith("aios:block:") and k.count(":") == 2 and isinstance(v, dict))
    print(f"{len(msgs)} messages, {len(steps)} rounds, {len(bad)} out of order")
    for key, seqs in bad[:20]:
        print(f"  {key}: {seqs}")
    print(f"the fold's block statuses: {dict(statuses)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
