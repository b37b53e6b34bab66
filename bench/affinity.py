"""Cost of affinity filtering + scoring per placement, at 1,000 and 10,000 nodes.

Measures ``policies.affinity.annotate`` (what the gateway filter and every allocator call do)
over a whole cluster's node views, for a block carrying a realistic mix of entries, against the
same pass with no affinity as the baseline (the node-view copy every annotated call makes).
Figures only, never pass/fail.

    .venv/bin/python bench/affinity.py [--sizes 1000 10000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from aios_blocks.policies import affinity, capacity
from aios_blocks.schemas.affinity import normalize


def make_nodes(n: int, gpus: int = 8) -> dict[str, dict[str, Any]]:
    nodes = {}
    for i in range(n):
        nid = f"n{i}"
        nodes[nid] = {
            "node_id": nid, "cluster": "c", "healthy": True, "cpu": 64.0, "cpu_free": 64.0,
            "memory": 524288, "memory_free": 524288,
            "labels": {"rack": str(i % 64), **({"trust-domain": "attested"} if i % 3 == 0 else {})},
            "gpus": [{"id": f"{nid}-g{g}", "model": "sim", "memory": 81920, "memory_used": 0, "memory_free": 81920,
                      "instances": 0, "exclusive": False} for g in range(gpus)],
        }
    return nodes


ENTRIES = [
    {"category": "Trust", "strength": "Required", "target": {"type": "TrustDomain", "value": "attested"}},
    {"category": "Topology", "strength": "Required", "anti": True, "target": {"type": "ServiceId", "value": "blk"}},
    {"category": "Topology", "strength": "Preferred", "anti": True, "target": {"type": "RackId", "value": 7}},
    {"category": "Resource", "strength": "Preferred", "target": {"type": "ResourceId", "value": "n42-g3"}},
]


def measure(nodes: dict[str, dict[str, Any]], entries: list[dict[str, Any]], index: affinity.Index, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        work = capacity.copy_nodes(nodes)
        if entries:
            affinity.annotate(work, entries, index)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    entries = msgspec.to_builtins(normalize(ENTRIES))
    index = affinity.empty_index()
    for k in range(16):  # the block already runs 16 replicas
        index = affinity.add_to_index(index, "blk", f"blk-{k}", f"n{k * 5}", str((k * 5) % 64))
    table = Table(title="affinity filter+score per placement (one pass over a cluster's nodes)")
    for col in ("nodes", "baseline (copy only)", "with 4 entries", "affinity cost", "per node"):
        table.add_column(col, justify="right")
    results = []
    for n in args.sizes:
        nodes = make_nodes(n)
        measure(nodes, entries, index, 2)  # warm the id cache
        base = measure(nodes, [], index, args.repeat)
        full = measure(nodes, entries, index, args.repeat)
        cost = full - base
        results.append({"nodes": n, "baseline_ms": base * 1e3, "with_affinity_ms": full * 1e3, "affinity_ms": cost * 1e3,
                        "per_node_us": cost / n * 1e6, "ratio_to_baseline": full / base})
        table.add_row(str(n), f"{base * 1e3:.2f} ms", f"{full * 1e3:.2f} ms", f"{cost * 1e3:.2f} ms", f"{cost / n * 1e6:.2f} µs")
    Console().print(table)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "affinity.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
