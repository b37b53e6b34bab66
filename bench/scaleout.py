"""Worker scale-out: 1, 2 and 4 copies of the controller and of the gateway (separate processes,
``Supervisor`` layout) sharing their durable consumers; a burst of blocks; throughput and whether
anything was processed twice.

"Twice" is read back from the stream and the consumers after the run:

* placements per block (a gang is placed once), instance ids placed more than once, GPUs held
  by two placements at once (double-booking);
* decision records per step (selection, post_dry_run, allocation once per block; dry_run once
  per candidate cluster);
* JetStream redeliveries of the gateway / controller / lifecycle consumers (a message handed to a
  second copy because the first did not ack in time).

    .venv/bin/python -m bench.scaleout [--quick]
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

try:
    from . import common, harness, raw
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    import harness  # type: ignore[no-redef]
    import raw  # type: ignore[no-redef]

from aios_blocks.bus import subjects
from aios_blocks.cli.client import decisions_of, event_kind
from aios_blocks.settings import load as load_settings

GROUP = "4 worker scale-out"
CLUSTERS, NODES = 10, 20


def duplicates(history: list[tuple[str, dict[str, Any], int]], bids: set[str]) -> dict[str, int]:
    """Counts of anything done more than once, from the blocks' recorded events.

    Expected decision records per block: one selection and one post_dry_run per selection round,
    one dry_run per candidate of each round, and one allocation per commit attempt (an attempt
    that lost a reservation race re-plans on a fresher snapshot; a round that lost
    ``COMMIT_RETRIES`` of them sends the block back through selection). Records beyond that were
    produced by a step handled twice."""
    placements: Counter[tuple[str, int]] = Counter()
    iids: Counter[str] = Counter()
    gpus: Counter[str] = Counter()
    decisions: Counter[tuple[str, str]] = Counter()
    rounds: Counter[str] = Counter()
    candidates: Counter[str] = Counter()
    attempts: Counter[str] = Counter()
    for subject, env, _seq in history:
        bid, kind = subject.split(".")[2], event_kind(subject)
        if bid not in bids:
            continue
        data = env.get("data") or {}
        if kind == "placement" and data.get("action") == "allocation":
            placements[(bid, int(data.get("gen", 0)))] += 1
            attempts[bid] += max(1, int(data.get("attempts", 1)))
            for p in data.get("placements", []):
                iids[p["instance_id"]] += 1
                for g in p.get("gpus", []):
                    gpus[g] += 1
        elif kind == "selection":
            rounds[bid] += 1
            candidates[bid] += len(data.get("candidates", []))
        elif kind == "allocation.failed":
            attempts[bid] += load_settings().commit_retries
        for d in decisions_of(subject, data):
            decisions[(bid, str(d.get("action")))] += 1
    extra = 0
    for (bid, action), count in decisions.items():
        want = {"dry_run": candidates[bid], "allocation": attempts[bid]}.get(action, rounds[bid])
        extra += max(0, count - want)
    return {
        "placements": sum(c - 1 for c in placements.values() if c > 1),
        "instance_ids": sum(c - 1 for c in iids.values() if c > 1),
        "gpus_double_booked": sum(1 for c in gpus.values() if c > 1),
        "decision_records": extra,
        "blocks_placed": len(placements),
        "reselections": sum(rounds.values()) - len(rounds),
        "replans": sum(attempts.values()) - len(placements),
    }


def failure_reasons(history: list[tuple[str, dict[str, Any], int]], bids: set[str]) -> Counter[str]:
    """Why blocks ended ``failed``: their reasons with cluster names and numbers folded, counted."""
    out: Counter[str] = Counter()
    for subject, env, _seq in history:
        if subject.split(".")[2] in bids and event_kind(subject) == "failed":
            reason = str((env.get("data") or {}).get("reason", "?"))
            out[re.sub(r"\bc\d+(-n\d+)?\b|\d+", "N", reason)[:160]] += 1
    return out


async def redeliveries(st: harness.Stack) -> dict[str, int]:
    """JetStream redeliveries per consumer. The gateway's include its gather-deadline timers, which
    wait by NAK-with-delay (a redelivery by design, not work done twice)."""
    out = {}
    for spec in (subjects.GATEWAY, subjects.controller(), subjects.LIFECYCLE):
        info = await st.client.bus.js.consumer_info(subjects.STREAM, spec.durable)
        out[spec.durable] = int(info.num_redelivered or 0)
    return out


async def one(copies: int, blocks: int) -> tuple[list[common.Row], float]:
    layout = {"parser": 1, "gateway": copies, "controller": copies, "agent-sim": 1}
    async with harness.stack(CLUSTERS, NODES, layout=layout, tag="scaleout") as st:
        before = await st.stream_messages()
        bids, secs = await st.burst(blocks, timeout=300)
        per_block = (await st.stream_messages() - before) / blocks
        ready = sum(1 for b in bids if st.tracker.done.get(b, ("",))[0] == "ready")
        history = await st.client.history("*", idle=1.0)
        dup = duplicates(history, set(bids))
        reasons = failure_reasons(history, set(bids))
        redelivered = await redeliveries(st)
    rate = ready / secs
    twice = dup["placements"] + dup["instance_ids"] + dup["gpus_double_booked"] + dup["decision_records"]
    note = (f"{blocks} blocks, {ready} ready, {dup['blocks_placed']} placed; duplicates: placements {dup['placements']}, "
            f"instance ids {dup['instance_ids']}, GPUs double-booked {dup['gpus_double_booked']}, extra decision records "
            f"{dup['decision_records']}; by design: {dup['replans']} re-plans after reservation conflicts, "
            f"{dup['reselections']} re-selections; "
            "JetStream redeliveries " + ", ".join(f"{k} {v}" for k, v in redelivered.items())
            + " (gateway: deadline timers included)")
    if reasons:
        note += "; failed: " + ", ".join(f"{n} x {r}" for r, n in reasons.most_common(3))
    rows = [
        common.row(GROUP, f"{copies} gateway + {copies} controller processes: blocks/s", rate, "blocks/s",
                   common.fraction(rate, common.JS_PUBLISH, per_block), note),
        common.row(GROUP, f"{copies} + {copies} processes: anything processed twice", float(twice), "count", None,
                   "sum of the duplicate counts above (0 = nothing done twice)"),
    ]
    return rows, rate


def figures(quick: bool = False) -> list[common.Row]:
    raw.ensure_raw()
    blocks = 60 if quick else 200
    rows: list[common.Row] = []
    base = None
    for copies in (1, 2, 4):
        r, rate = common.run(one(copies, blocks))
        base = base or rate
        r[0]["note"] = f"x{rate / base:.2f} of 1 copy; " + r[0]["note"]
        rows += r
    rows[0]["note"] += f" ({CLUSTERS} clusters x {NODES} nodes x 8 GPUs, 2 cores shared by every process)"
    return rows


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
