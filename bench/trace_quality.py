"""A/B of ``builtin:fgd-plus``'s parameters on the GPU trace (docs/trace.md "Our policy"): the
in-process replay per seed and workload, with policy parameters set, each run's allocation at
100 % / 130 % arrived and its user CPU time, and the mean over seeds.

    .venv/bin/python -m bench.trace_quality [--policy fgd-plus] [--seeds 42,43,44]
        [--workloads default] [--traces DIR] [--jobs 2] [--param key=json ...] [--json FILE]

Runs are independent processes (``--jobs`` at a time); the decisions are the replay's own
(``blocks trace replay --in-process``), so the figures do not depend on the machine's load,
only the CPU time does (it is each run's user time, what compares under load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent / "traces" / "openb-2023"


def run_one(policy: str, seed: int, workload: str, traces: str, extra: dict[str, Any], ratio: float) -> dict[str, Any]:
    """One replay in this process, with ``extra`` added to the rule's parameters."""
    from aios_blocks.trace import replay as rp
    from aios_blocks.trace.inventory import load_nodes
    from aios_blocks.trace.workload import load_tasks

    folder = Path(traces)
    node_file = folder / "openb_node_list_gpu_node.csv"
    nodes = load_nodes(node_file if node_file.exists() else HERE / "openb_node_list_gpu_node.csv", "openb")
    tasks = load_tasks(folder / f"openb_pod_list_{workload}.csv")
    orig = rp.setup

    def setup(*a: Any, **kw: Any) -> rp.Setup:
        st = orig(*a, **kw)
        base = st.rule

        def rule(share: bool) -> dict[str, Any]:
            r = base(share)
            r["parameters"].update(extra)
            return r

        st.rule = rule
        return st

    rp.setup = setup
    cpu0 = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    try:
        res = asyncio.run(rp.replay(nodes, tasks, policy, seed, ratio, 0, workload)).as_dict()
    finally:
        rp.setup = orig
    cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu0
    return {"workload": workload, "seed": seed, "alloc_at_100": res["alloc_at_100"],
            "alloc_at_130": res[f"alloc_at_{round(ratio * 100)}"], "seconds": res["seconds"], "user_s": round(cpu, 1),
            "failed": res["failed"], "params": extra}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="fgd-plus")
    ap.add_argument("--seeds", default="42,43,44")
    ap.add_argument("--workloads", default="default")
    ap.add_argument("--traces", type=Path, default=HERE)
    ap.add_argument("--inflate", type=float, default=1.3)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--param", action="append", default=[], help="policy parameter key=json value (repeatable)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    extra = {k: json.loads(v) for k, v in (p.split("=", 1) for p in args.param)}
    seeds = [int(s) for s in args.seeds.split(",") if s]
    wls = [w for w in args.workloads.split(",") if w]
    jobs = [(args.policy, s, w, str(args.traces), extra, args.inflate) for w in wls for s in seeds]
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        futs = [pool.submit(run_one, *j) for j in jobs]
        out = []
        for f in futs:
            r = f.result()
            out.append(r)
            print(f"{r['workload']:<12} seed {r['seed']:>3}  {r['alloc_at_100']:7.2f} {r['alloc_at_130']:7.2f}  "
                  f"failed {r['failed']:>5}  user {r['user_s']:6.1f} s  wall {r['seconds']:6.1f} s  {extra}", flush=True)
    for w in wls:
        rows = [r for r in out if r["workload"] == w]
        if len(rows) > 1:
            print(f"{w:<12} mean     {statistics.mean(r['alloc_at_100'] for r in rows):7.2f} "
                  f"{statistics.mean(r['alloc_at_130'] for r in rows):7.2f}  ({len(rows)} seeds)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
