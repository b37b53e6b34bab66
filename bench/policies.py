"""Policy evaluation cost per call: Python built-in vs Starlark twin vs LXD scriptlet, cached
(compiled once, instance reused) and through the runtime (thread hop, time limit, shape check).
Figures only.

    .venv/bin/python bench/policies.py [--nodes 8 50] [--calls 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from aios_blocks.handlers.controller import payload
from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.state.store import node_view

HERE = Path(__file__).parent
STAR = HERE.parent / "tests" / "unit" / "starlark_policies"
CASES = {
    "python builtin:binpack": "builtin:binpack",
    "starlark binpack.star": str(STAR / "binpack.star"),
    "starlark LXD most-free-memory": str(STAR / "lxd_most_free_memory.star"),
}


def nodes_of(n: int) -> dict[str, dict[str, Any]]:
    out = {}
    for i in range(n):
        spec = {"id": f"n{i}", "cluster": "c", "labels": {"rack": str(i % 4)}, "gpus": [{"id": f"n{i}-g{g}", "model": "sim", "memory": 81920} for g in range(8)]}
        h = {"spec": json.dumps(spec), "cpu": "64", "memory": str(512 * 1024), "healthy": "1", "cpu_used": str(i % 7)}
        for g in range(8):
            h[f"g:n{i}-g{g}:total"] = "81920"
            if (i + g) % 3 == 0:
                h[f"g:n{i}-g{g}:n"], h[f"g:n{i}-g{g}:mem"] = "1", "81920"
        out[f"n{i}"] = node_view(h)
    return out


async def time_calls(rt: PolicyRuntime, uri: str, data: dict[str, Any], calls: int) -> tuple[float, float]:
    rule = {"name": "resourceAllocator", "policyRuleURI": uri, "parameters": {}, "settings": {}}
    await rt.invoke(rule, "bench", data, {})  # compile + instantiate once (cached afterwards)
    inst, _, _ = await rt.instance(rule, "bench")
    direct = []
    for _ in range(calls):
        t = time.perf_counter()
        inst.eval({}, data, {})
        direct.append(time.perf_counter() - t)
    via = []
    for _ in range(calls):
        t = time.perf_counter()
        await rt.invoke(rule, "bench", data, {})
        via.append(time.perf_counter() - t)
    return statistics.median(direct) * 1e6, statistics.median(via) * 1e6


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    rt = PolicyRuntime(allow_files=True)
    rows = []
    for n in args.nodes:
        nodes = nodes_of(n)
        ir = {"blockId": "b", "minInstances": 1, "maxInstances": 4, "policies": {},
              "resources": {"gpus": 1, "gpuMemory": 0, "cpu": 2, "memory": 1024}}
        for action in ("allocation", "dry_run"):
            data = {"action": action, "payload": payload(ir, {"id": "c", "labels": {}}, nodes)}
            for label, uri in CASES.items():
                direct, via = await time_calls(rt, uri, data, args.calls)
                rows.append({"nodes": n, "action": action, "policy": label, "eval_us": direct, "runtime_us": via})
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 50])
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    rows = asyncio.run(main(a))
    t = Table(title="policy cost per call (median; compiled and instantiated once)")
    for col in ("nodes", "action", "policy", "eval() µs", "via runtime µs"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["nodes"]), r["action"], r["policy"], f"{r['eval_us']:.0f}", f"{r['runtime_us']:.0f}")
    Console().print(t)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "policies.json").write_text(json.dumps(rows, indent=2))
