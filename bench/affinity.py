"""Cost of affinity filtering + scoring per placement, at 1,000 and 10,000 nodes.

Measures ``policies.affinity.annotate`` (what the gateway filter and every allocator call do)
over a whole cluster's node views, for a block carrying a realistic mix of entries (Required
trust domain, Required anti-affinity to its own 16 running replicas, Preferred rack
anti-affinity, Preferred GPU), against the same pass with no affinity as the baseline (the
node-view copy every annotated call makes). In process, no servers. Figures only.

    .venv/bin/python -m bench.affinity [--quick]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import msgspec

try:
    from . import common
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]

from aios_blocks.policies import affinity, capacity
from aios_blocks.schemas.affinity import normalize

GROUP = "3 affinity (1 cluster, in process)"


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
    """Median seconds of one copy (+ annotate) pass over ``nodes``."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        work = capacity.copy_nodes(nodes)
        if entries:
            affinity.annotate(work, entries, index)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def figures(quick: bool = False) -> list[common.Row]:
    sizes, repeat = ([1000], 8) if quick else ([1000, 10000], 20)
    entries = msgspec.to_builtins(normalize(ENTRIES))
    index = affinity.empty_index()
    for k in range(16):  # the block already runs 16 replicas
        index = affinity.add_to_index(index, "blk", f"blk-{k}", f"n{k * 5}", str((k * 5) % 64))
    step_ms = 1000 / common.raw(common.JS_STEP) if common.raw(common.JS_STEP) else None
    rows: list[common.Row] = []
    for n in sizes:
        nodes = make_nodes(n)
        measure(nodes, entries, index, 2)  # warm the id cache
        base = measure(nodes, [], index, repeat) * 1e3
        full = measure(nodes, entries, index, repeat) * 1e3
        cost = full - base
        rows += [
            common.row(GROUP, f"node-view copy at {n:,} nodes (baseline, no affinity)", base, "ms",
                       step_ms / base if step_ms else None, f"median of {repeat}; of_raw_limit = raw step time / cost"),
            common.row(GROUP, f"copy + affinity filter/score at {n:,} nodes (4 entries)", full, "ms",
                       step_ms / full if step_ms else None,
                       f"x{full / base:.2f} of the baseline; 2 Required + 2 Preferred entries, 16 replicas in the index"),
            common.row(GROUP, f"affinity cost per node at {n:,} nodes", cost / n * 1e3, "us", None,
                       f"(copy + affinity - baseline) / nodes = {cost:.2f} ms per pass"),
        ]
    return rows


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
