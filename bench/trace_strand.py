"""Where the unallocated GPUs of a trace replay are (docs/trace.md "Where the idle GPUs are").

    .venv/bin/python -m bench.trace_strand [--policy fgd-plus] [--seed 42] [--workload default]
        [--traces DIR] [--at 100] [--param key=value ...]

Replays like ``blocks trace replay --in-process`` and, when the arrived GPU requests reach
``--at`` % of the cluster's, classifies each node's free GPU compute:

* ``cpu``: whole free GPUs on a node whose free CPU is below the smallest CPU of a GPU shape of
  the workload (stranded by CPU);
* ``memory``: the same by free memory (below the smallest memory of a GPU shape), CPU sufficing;
* ``share``: free compute of partly used GPUs (a share's leftover);
* ``usable``: whole free GPUs a GPU shape could still take.

and prints the totals per node type, plus what the failed tasks looked like (by shape kind).
Measurement only: the decisions are the replay's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from aios_blocks.policies.builtin.frag import UNITS, gpu_left, node_model
from aios_blocks.trace import replay as rp
from aios_blocks.trace.inventory import load_nodes
from aios_blocks.trace.workload import Task, load_tasks

HERE = Path(__file__).resolve().parent / "traces" / "openb-2023"


def classify(views: dict[str, dict[str, Any]], tasks: list[Task]) -> dict[str, Any]:
    """Free GPU compute per (node type, reason), in GPUs."""
    gpu_tasks = [t for t in tasks if t.num_gpu]
    min_cpu = min(t.cpu_milli for t in gpu_tasks) / 1000
    min_mem = min(t.memory_mib for t in gpu_tasks)
    out: dict[str, Counter[str]] = defaultdict(Counter)
    cpu_left: dict[str, float] = Counter()
    held: Counter[int] = Counter()
    for v in views.values():
        left = gpu_left(v)
        kind = f"{node_model(v)}x{len(left)}"
        out[kind]["gpus"] += len(left)
        for x in left:
            if 0 < x < UNITS:
                out[kind]["share"] += x / UNITS
            elif x == UNITS:
                if v["cpu_free"] + 1e-9 < min_cpu:
                    out[kind]["cpu"] += 1
                elif v["memory_free"] < min_mem:
                    out[kind]["memory"] += 1
                else:
                    out[kind]["usable"] += 1
        cpu_left[kind] += v["cpu_free"]
        for g in v["gpus"]:
            x = 0 if g["exclusive"] else int(g.get("share_free", UNITS))
            if 0 < x < UNITS:
                held[x] += 1
    by_type = {k: {**{r: round(c[r], 2) for r in c}, "cpu_free": round(cpu_left[k], 1)} for k, c in sorted(out.items())}
    return {"types": by_type, "share_free": dict(sorted(held.items()))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="fgd-plus")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--workload", default="default")
    ap.add_argument("--traces", type=Path, default=HERE)
    ap.add_argument("--at", type=int, default=100, help="arrived %% at which to classify")
    ap.add_argument("--param", action="append", default=[], help="extra policy parameter key=json value")
    args = ap.parse_args(argv)
    nodes = load_nodes(HERE / "openb_node_list_gpu_node.csv", "openb")
    tasks = load_tasks(args.traces / f"openb_pod_list_{args.workload}.csv")
    extra = {k: json.loads(v) for k, v in (p.split("=", 1) for p in args.param)}
    snap: dict[str, Any] = {}
    failed: Counter[str] = Counter()

    class Probe(rp.Ledger):
        def add(self, t: Task, placed: tuple[str, list[str]] | None) -> None:
            if placed is None and not snap:
                kind = "cpu-only" if not t.num_gpu else "share" if t.sharing else f"{t.num_gpu}gpu"
                failed[f"{kind} cpu={t.cpu_milli / 1000:g}"] += 1
            super().add(t, placed)
            if not snap and self.arrived * 100 >= args.at * self.st.cluster_milli:
                snap.update(classify(self.views, tasks))
                snap["alloc"] = round(100 * self.allocated / self.st.cluster_milli, 3)

    orig_setup, orig_ledger = rp.setup, rp.Ledger

    def setup(*a: Any, **kw: Any) -> rp.Setup:
        st = orig_setup(*a, **kw)
        base = st.rule

        def rule(share: bool) -> dict[str, Any]:
            r = base(share)
            r["parameters"].update(extra)
            return r

        st.rule = rule  # type: ignore[method-assign]
        return st

    rp.setup, rp.Ledger = setup, Probe  # type: ignore[assignment,misc]
    try:
        res = asyncio.run(rp.replay(nodes, tasks, args.policy, args.seed, 1.3, 0, args.workload))
    finally:
        rp.setup, rp.Ledger = orig_setup, orig_ledger  # type: ignore[misc]
    d = res.as_dict()
    print(f"{args.policy} {extra} seed {args.seed} {args.workload}: {d['alloc_at_100']} / {d['alloc_at_130']}")
    print(f"at {args.at} %: allocation {snap.pop('alloc')} %; free GPU compute (GPUs) by node type and reason:")
    tot: Counter[str] = Counter()
    for kind, c in snap["types"].items():
        print(f"  {kind:<12} {c}")
        tot.update({k: v for k, v in c.items() if k not in ("gpus", "cpu_free")})
    print("  total", {k: round(v, 2) for k, v in tot.items()})
    frees = snap["share_free"]
    print("  partly used GPUs by free thousandths (count; GPUs of compute):")
    print("   ", ", ".join(f"{x}:{n}" for x, n in frees.items()))
    bands = Counter({f"<{b}": 0 for b in (160, 230, 320, 470, 1000)})
    for x, n in frees.items():
        band = next(b for b in (160, 230, 320, 470, 1000) if x < b)
        bands[f"<{band}"] += x * n / UNITS
    print("   compute in free bands:", {k: round(v, 1) for k, v in bands.items()})
    print(f"failed before {args.at} % (top 12):", failed.most_common(12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
