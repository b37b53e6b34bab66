"""The online replay's table (issue 36, docs/priority.md "Online replay"): the trace's workloads x
{preemption, no preemption, FIFO}, in trace time (``trace/online.py``, in-process).

    .venv/bin/python -m bench.trace_online [--load 300] [--cluster-share 0.2] [--workloads default,gpushare60,multigpu50]
        [--modes preemption,no-preemption,fifo] [--rebalance] [--json out.json] [--plot out.png]

Columns: LS+Guaranteed wait p99 (all / steady state: arrivals after the first 10 % of the span),
BE wait p99, mean GPU allocation, preemptions (victim instances), cascades, GPU-seconds lost,
preemptions that freed more than the need + one node's GPUs, pending at the end of the trace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from aios_blocks.trace import online
from aios_blocks.trace import online_rebalance as orb
from aios_blocks.trace.inventory import load_nodes

from .common import _cmd

HERE = Path(__file__).resolve().parent
DIRS = (HERE.parent.parent / "shared" / "traces" / "openb-2023", HERE / "traces" / "openb-2023")


def pods(workload: str) -> Path:
    for d in DIRS:
        p = d / f"openb_pod_list_{workload}.csv"
        if p.exists():
            return p
    raise SystemExit(f"no openb_pod_list_{workload}.csv in {', '.join(map(str, DIRS))}")


def code_version() -> str:
    """The code a run measured: the commit, and the files of src/ changed from it (a shared tree's
    uncommitted edits decide too). Two runs that differ are first compared by this line: the
    replay itself is deterministic (tests/unit/test_online_determinism.py)."""
    commit = _cmd(["git", "rev-parse", "--short", "HEAD"]) or "?"
    dirty = _cmd(["git", "diff", "--name-only", "HEAD", "--", "src"]).split()
    return commit + (f" + uncommitted {', '.join(sorted(dirty))}" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="default,gpushare60,multigpu50")
    ap.add_argument("--modes", default="preemption,no-preemption,fifo")
    ap.add_argument("--load", type=float, default=1.0)
    ap.add_argument("--cluster-share", type=float, default=1.0)
    ap.add_argument("--policy", default=online.DEFAULT_POLICY)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--rebalance", action="store_true",
                    help="each mode with the rebalancer (moves before preemption and the worker's rounds, "
                    "trace/online_rebalance.py; mode shown as MODE+rebalance)")
    a = ap.parse_args()
    nodes = load_nodes(pods("default").with_name("openb_node_list_gpu_node.csv"), "trace")
    rows = []
    code = code_version()
    print(f"load x{a.load:g}, cluster share {a.cluster_share:g}, policy {a.policy}, seed {a.seed}; code {code}")
    print("| workload | mode | LS+G wait p99 s (steady) | BE wait p99 s | mean GPU alloc % | preemptions (victims) | cascades "
          "| GPU-s lost | over bound | pending at end | run s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for wl in a.workloads.split(","):
        timed, drawn = online.load_timed(pods(wl), a.seed)
        tag = f"{wl} ({drawn} times drawn)" if drawn else wl
        for mode in a.modes.split(","):
            t0 = time.perf_counter()
            if a.rebalance:
                r = asyncio.run(orb.replay(nodes, timed, online.Mode(mode), a.policy, a.seed, workload=wl, drawn=drawn,
                                           load=a.load, cluster_share=a.cluster_share))
            else:
                r = asyncio.run(online.replay_online(nodes, timed, online.Mode(mode), a.policy, a.seed, workload=wl,
                                                     drawn=drawn, load=a.load, cluster_share=a.cluster_share)).as_dict()
            r["run_s"] = round(time.perf_counter() - t0, 1)
            r["code"] = code
            rows.append(r)
            print(f"| {tag} | {r['mode']} | {r['ls_wait_p99']:g} ({r['ls_wait_p99_steady']:g}) "
                  f"| {r['be_wait_p99']:g} | {r['alloc_mean']:.2f} | {r['preemptions']} ({r['victims']}) | {r['cascades']} "
                  f"| {r['gpu_s_lost']:g} | {r['freed_over_bound']} | {r['pending_end']} | {r['run_s']} |", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    if a.plot:
        online.draw(rows, a.plot)


if __name__ == "__main__":
    main()
