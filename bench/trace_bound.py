"""How high the GPU allocation at 100 % arrived can go on a trace workload, whatever the policy
(docs/trace.md "Where the idle GPUs are, and how high it can go").

    .venv/bin/python -m bench.trace_bound [--workload default] [--seeds 42,43,44] [--traces DIR]

For each seed, the replay's task list (the same inflated, shuffled list as ``blocks trace
replay``) up to 100 % arrived, in a model with no CPUs, memory, nodes or GPU models: whole-GPU
tasks take idle GPUs, shares are packed onto GPUs (bins of 1000 thousandths). Printed:

* ``online``: the allocation when the shares are placed in arrival order by best fit (the
  fullest GPU that fits), by FGD's measure for one GPU, and by the share prices of
  ``builtin:fgd-plus`` (``share_prices.SharePrices``: the least loss, then best fit);
* ``bound``: an upper bound for any placement, the configuration LP (every set of shares that
  fits on a GPU is a column) maximising the compute placed, with every share that arrived before
  ``--forced`` % placed (a policy places a task while a GPU fits it: until ~97 % arrived on
  these workloads idle GPUs remain). Needs scipy (``pip install scipy``); skipped without it.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from aios_blocks.policies.builtin.share_prices import SharePrices
from aios_blocks.trace.inventory import load_nodes
from aios_blocks.trace.workload import Task, inflate, load_tasks, typical_shapes

HERE = Path(__file__).resolve().parent / "traces" / "openb-2023"
UNITS = 1000


def arrived(pods: list[Task], cluster_milli: int, pct: float) -> list[Task]:
    """The tasks submitted before the arrived GPU requests reach ``pct`` % of the cluster's."""
    out, total = [], 0
    for t in pods:
        if total * 100 >= pct * cluster_milli:
            break
        out.append(t)
        total += t.milli_total
    return out


def online(pods: list[Task], gpus: int, score: Callable[[int, int], float]) -> float:
    """Allocation (%) when whole-GPU tasks take idle GPUs and each share goes to the GPU (free
    amount ``h``, 1000 for an idle one) with the lowest ``(score(h, share), h)``."""
    gaps: Counter[int] = Counter()
    idle, held = gpus, 0
    for t in pods:
        if not t.num_gpu:
            continue
        if not t.sharing:
            if idle >= t.num_gpu:
                idle -= t.num_gpu
                held += t.milli_total
            continue
        s = t.gpu_milli
        cands = [h for h, n in gaps.items() if n and h >= s] + ([UNITS] if idle else [])
        if not cands:
            continue
        h = min(cands, key=lambda h: (score(h, s), h))
        if h == UNITS:
            idle -= 1
        else:
            gaps[h] -= 1
        if h > s:
            gaps[h - s] += 1
        held += s
    return 100 * held / (gpus * UNITS)


def lp_bound(pods: list[Task], forced: list[Task], gpus: int) -> float | None:
    """The configuration LP's optimum (% of the cluster), or None without scipy."""
    try:
        import numpy as np
        from scipy.optimize import linprog
    except ImportError:
        return None
    whole = sum(t.num_gpu for t in pods if t.num_gpu and not t.sharing)
    have = Counter(t.gpu_milli for t in pods if t.sharing)
    must = Counter(t.gpu_milli for t in forced if t.sharing)
    sizes = sorted(have, reverse=True)
    confs: list[tuple[int, ...]] = []

    def rec(i: int, room: int, cur: list[int]) -> None:
        if i == len(sizes):
            if any(cur):
                confs.append(tuple(cur))
            return
        for k in range(min(have[sizes[i]], room // sizes[i]) + 1):
            cur.append(k)
            rec(i + 1, room - k * sizes[i], cur)
            cur.pop()

    rec(0, UNITS, [])
    a = np.array(confs, dtype=float)
    n = len(confs)
    # variables: GPUs given to whole-GPU tasks, then how many GPUs hold each configuration
    c = -np.concatenate([[float(UNITS)], a @ np.array(sizes, dtype=float)])
    rows, rhs = [np.concatenate([[1.0], np.ones(n)])], [float(gpus)]
    for i, s in enumerate(sizes):
        rows.append(np.concatenate([[0.0], a[:, i]]))
        rhs.append(float(have[s]))
        rows.append(np.concatenate([[0.0], -a[:, i]]))
        rhs.append(-float(must[s]))
    res = linprog(c, A_ub=np.array(rows), b_ub=np.array(rhs), bounds=[(0, whole)] + [(0, None)] * n, method="highs")
    return float(-100 * res.fun / (gpus * UNITS)) if res.success else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="default")
    ap.add_argument("--seeds", default="42,43,44")
    ap.add_argument("--forced", type=float, default=95.0, help="shares arrived before this %% are placed in the bound")
    ap.add_argument("--traces", type=Path, default=HERE)
    args = ap.parse_args(argv)
    nodes = load_nodes(HERE / "openb_node_list_gpu_node.csv", "openb")
    gpus = sum(len(n.gpus) for n in nodes)
    tasks = load_tasks(args.traces / f"openb_pod_list_{args.workload}.csv")
    shapes = typical_shapes(tasks)
    prices = SharePrices.of_shapes(shapes)
    big: dict[int, float] = Counter()  # FGD's measure for one GPU: the weight of the shares too big
    for s in shapes:
        units = round(float(s.get("gpuShare") or 0) * UNITS) or UNITS
        big[units] += float(s["weight"]) * (int(s["gpus"]) if units == UNITS else 1) if s["gpus"] else 0

    def fgd(h: int, s: int) -> float:
        def frag(x: int) -> float:
            return x * sum(w for u, w in big.items() if u > x)
        return frag(h - s) - frag(h)

    for seed in [int(s) for s in args.seeds.split(",") if s]:
        pods = inflate(tasks, gpus * UNITS, 1.3, seed)
        upto = arrived(pods, gpus * UNITS, 100)
        bf = online(upto, gpus, lambda h, s: 0)
        fg = online(upto, gpus, fgd)
        pd = online(upto, gpus, prices.loss) if prices else bf
        bound = lp_bound(upto, arrived(pods, gpus * UNITS, args.forced), gpus)
        shown = f"{bound:.2f}" if bound is not None else "(no scipy)"
        print(f"{args.workload} seed {seed}: online best-fit {bf:.2f}, FGD measure {fg:.2f}, share prices {pd:.2f}; "
              f"LP bound (shares before {args.forced:g} % placed) {shown}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
