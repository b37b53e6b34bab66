"""How often ``builtin:rebalance-min`` makes room for a pending block that CPU (or memory), not
GPUs, keeps out (issue 38, docs/rebalance.md "CPU and memory"), against the planner at another
revision, on seeded random clusters shaped like the trace's nodes (8 GPUs, 96 CPU, 512 GiB):
instances of 0-8 GPUs with 2-48 CPU (CPU-only ones too) placed at random until most CPU is taken,
then a pending block of 1-8 GPUs whose GPUs are free on some node but whose CPU (or memory) is
not. ``oracle``: one move exists (some instance off a node with the block's GPUs free, to a node
it fits, after which the block fits there), fragmentation rules aside: the room one move could
make at most.

    .venv/bin/python -m bench.trace_rebalance_cpu [--scenarios 300] [--against 050b7e4~1] [--memory]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aios_blocks.policies.builtin import preempt as bp
from aios_blocks.policies.builtin import rebalance as rb

ROOT = Path(__file__).resolve().parent.parent


def planner_at(rev: str) -> Any:
    """``policies/builtin/rebalance.py`` as it was at ``rev``, loaded beside the current one."""
    src = subprocess.run(["git", "show", f"{rev}:src/aios_blocks/policies/builtin/rebalance.py"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "rebalance_at.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("aios_blocks.policies.builtin.rebalance_at", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def scenario(seed: int, memory: bool) -> dict[str, Any] | None:
    rnd = random.Random(seed)
    nodes = {f"n{k:03d}": {"cpu_free": 96.0, "mem_free": 512.0 * 1024,
                           "gpus": {f"n{k:03d}-g{g}": {"model": "A", "free": 1.0} for g in range(8)}} for k in range(240)}
    movable = []
    for b in range(rnd.randint(900, 1560)):
        gpus = rnd.choice((0, 0, 1, 1, 1, 1, 2, 4, 8))
        cpu = float(rnd.choice((2, 4, 8, 8, 16, 24, 32, 48)))
        mem = float(rnd.choice((4, 16, 32, 64, 128))) * 1024
        spots = [nid for nid, n in nodes.items() if n["cpu_free"] >= cpu and n["mem_free"] >= mem
                 and sum(1 for v in n["gpus"].values() if v["free"] >= 1) >= gpus]
        if not spots:
            continue
        nid = rnd.choice(spots)
        n = nodes[nid]
        got = [g for g, v in n["gpus"].items() if v["free"] >= 1][:gpus]
        for g in got:
            n["gpus"][g]["free"] = 0.0
        n["cpu_free"] -= cpu
        n["mem_free"] -= mem
        movable.append({"block_id": f"b{b}", "priority": 0, "created": float(b), "minInstances": 1, "moving": 0,
                        "instances": {f"b{b}-0": {"node_id": nid, "gpus": got, "share": 1.0, "cpu": cpu, "memory": mem}}})
    gpus = rnd.choice((1, 2, 4, 8))
    res = {"gpus": gpus, "cpu": float(rnd.choice((4, 8, 16, 32))), "memory": float(rnd.choice((8, 16, 64))) * 1024}
    data = {"action": "rebalance", "maxMoves": 2, "trigger": "pending", "cluster": {"cluster_id": "c", "nodes": nodes},
            "movable": movable, "pending": [{"block_id": "p", "priority": 100, "minInstances": 1, "resources": res}]}
    parsed = bp._nodes(data["cluster"])
    need = bp.need_of(data["pending"][0])
    if bp.placement(parsed, need):
        return None  # fits now
    by_gpus = bp.Need(need.gpus, 0.0, 0.0, 0.0, frozenset(), 1)
    if not any(bp.node_fits(n, by_gpus, 1) for n in parsed.values()):
        return None  # GPUs short everywhere: not the case measured
    short = [n for n in parsed.values() if bp.node_fits(n, by_gpus, 1)]
    mem_short = all(n.mem < need.memory for n in short)
    if memory != mem_short:
        return None
    return data


def oracle(data: dict[str, Any]) -> bool:
    """Whether one move makes room (fragmentation rules aside)."""
    nodes = bp._nodes(data["cluster"])
    need = bp.need_of(data["pending"][0])
    insts, _ = rb.movable(data, None)
    for i in insts:
        src = rb._copy(nodes[i.node])
        rb.Cluster.release(src, i)
        if not bp.node_fits(src, need, 1):
            continue
        if any(nid != i.node and rb.Cluster.pick(n, i) is not None for nid, n in nodes.items()):
            return True
    return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", type=int, default=300)
    ap.add_argument("--against", default="050b7e4~1", help="the planner's revision to compare with")
    ap.add_argument("--memory", action="store_true", help="blocks kept out by memory (else by CPU)")
    a = ap.parse_args()
    old = planner_at(a.against)
    out: dict[str, Any] = {"against": a.against, "kept_out_by": "memory" if a.memory else "cpu", "scenarios": 0,
                           "one_move_exists": 0, "plans_now": 0, "plans_before": 0, "moves_now": 0, "moves_before": 0,
                           "cpu_s_now": 0.0, "cpu_s_before": 0.0}
    seed = 0
    while out["scenarios"] < a.scenarios:
        seed += 1
        data = scenario(seed, a.memory)
        if data is None:
            continue
        out["scenarios"] += 1
        out["one_move_exists"] += oracle(data)
        for tag, mod in (("now", rb), ("before", old)):
            c0 = time.process_time()
            got = mod.plan(data)
            out[f"cpu_s_{tag}"] += time.process_time() - c0
            if got["moves"]:
                out[f"plans_{tag}"] += 1
                out[f"moves_{tag}"] += len(got["moves"])
    out["cpu_s_now"], out["cpu_s_before"] = round(out["cpu_s_now"], 1), round(out["cpu_s_before"], 1)
    out["seeds"] = seed
    print(json.dumps(out))


if __name__ == "__main__":
    main()
