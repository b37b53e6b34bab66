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
    .venv/bin/python -m bench.scaleout --blocks 1000 --clusters 10 --nodes 100 --copies 1,2,4 [--all-kinds] [--repeat 2]

The second form sizes the run for a machine with cores to spare (docs/benchmarks.md, "Scale-out on
16 cores"): ``--all-kinds`` also runs the parser and the simulated agents in ``copies`` processes,
so that only NATS and Redis stay single; ``--repeat`` alternates the layouts that many times.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

try:
    from . import common, harness, raw, targets
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    import harness  # type: ignore[no-redef]
    import raw  # type: ignore[no-redef]
    import targets  # type: ignore[no-redef]

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


async def one(copies: int, blocks: int, clusters: int = CLUSTERS, nodes: int = NODES,
              all_kinds: bool = False) -> tuple[list[common.Row], float]:
    others = copies if all_kinds else 1
    layout = {"parser": others, "gateway": copies, "controller": copies, "agent-sim": others}
    with common.env_set("AIOS_SIM_START_DELAY_S", "0"), _client_cpu() as client_cpu:  # as bench.targets' burst row
        async with harness.stack(clusters, nodes, layout=layout, tag="scaleout", grouped=False) as st:
            before = await st.stream_messages()
            s0, c0 = await targets.sample(st), client_cpu()
            bids, secs = await st.burst(blocks, timeout=300)
            used = (await targets.sample(st)).minus(s0)
            used.cpu["bench client"] = client_cpu() - c0
            per_block = (await st.stream_messages() - before) / blocks
            rows, rate = await _tally(st, copies, blocks, bids, secs, per_block, used)
    return rows, rate


@contextlib.contextmanager
def _client_cpu() -> Iterator[Callable[[], float]]:
    """This process's CPU seconds (the bench client: submits and tracks every block)."""
    yield lambda: sum(os.times()[:2])


def _busy(used: targets.Sample, secs: float, blocks: int) -> str:
    """Per kind: CPU ms per block (all its copies) and how busy its busiest copy was (1.00 = a core)."""
    kinds: dict[str, list[float]] = {}
    for name, cpu in used.cpu.items():
        kinds.setdefault(re.sub(r"-\d+$", "", name), []).append(cpu)
    parts = [f"{k} {sum(v) / blocks * 1000:.2f} ms/block, busiest {max(v) / secs:.2f}"
             for k, v in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))]
    return "CPU during the burst: " + "; ".join(parts)


async def _tally(st: harness.Stack, copies: int, blocks: int, bids: list[str], secs: float, per_block: float,
                 used: targets.Sample) -> tuple[list[common.Row], float]:
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
    note += "; " + _busy(used, secs, blocks)
    rows = [
        common.row(GROUP, f"{copies} gateway + {copies} controller processes: blocks/s", rate, "blocks/s",
                   common.fraction(rate, common.JS_PUBLISH, per_block), note),
        common.row(GROUP, f"{copies} + {copies} processes: anything processed twice", float(twice), "count", None,
                   "sum of the duplicate counts above (0 = nothing done twice)"),
    ]
    return rows, rate


def figures(quick: bool = False, blocks: int | None = None, clusters: int = CLUSTERS, nodes: int = NODES,
            copies: tuple[int, ...] = (1, 2, 4), all_kinds: bool = False, repeat: int = 1) -> list[common.Row]:
    raw.ensure_raw()
    blocks = blocks or (60 if quick else 200)
    rows: list[common.Row] = []
    base: list[float] = []
    for rnd in range(repeat):
        for n in copies:
            r, rate = common.run(one(n, blocks, clusters, nodes, all_kinds))
            if n == copies[0]:
                base.append(rate)
            r[0]["note"] = (f"round {rnd + 1}: " if repeat > 1 else "") + f"x{rate / base[-1]:.2f} of {copies[0]} cop" \
                f"{'y' if copies[0] == 1 else 'ies'}; " + r[0]["note"]
            rows += r
            print(f"  {n} + {n}{' (all kinds)' if all_kinds else ''}: {rate:.0f} blocks/s ({r[0]['note'][:60]})", flush=True)
    cores = os.cpu_count() or 0
    rows[0]["note"] += (f" ({clusters} clusters x {nodes} nodes x 8 GPUs, {cores} cores shared by every process"
                        + ("; parser and simulated agents as many copies" if all_kinds else "; one parser, one agent process")
                        + ")")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="60 blocks instead of 200")
    ap.add_argument("--blocks", type=int, help="blocks per burst (default 200, 60 with --quick)")
    ap.add_argument("--clusters", type=int, default=CLUSTERS)
    ap.add_argument("--nodes", type=int, default=NODES, help="nodes per cluster (8 GPUs each)")
    ap.add_argument("--copies", default="1,2,4", help="copies of gateway and controller, comma-separated")
    ap.add_argument("--all-kinds", action="store_true", help="run the parser and the simulated agents in as many copies")
    ap.add_argument("--repeat", type=int, default=1, help="alternate the layouts this many times")
    a = ap.parse_args()
    copies = tuple(int(c) for c in a.copies.split(","))
    common.standalone(lambda quick: figures(quick, a.blocks, a.clusters, a.nodes, copies, a.all_kinds, a.repeat),
                      quick=a.quick, module="scaleout")


if __name__ == "__main__":
    main()
