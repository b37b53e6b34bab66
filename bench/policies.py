"""Policy evaluation cost per call: Python built-in vs Starlark twin vs LXD scriptlet, called
directly (``eval()`` on the compiled, cached instance) and through the runtime (thread hop, time
limit, shape check: what a worker pays), on the controller's payload for 8 and 50 nodes; up to
300 calls each way, at most ~1.5 s each (20 calls at least).
The Python built-in ``builtin:binpack`` is the baseline of the ratios. In process. Figures only.

    .venv/bin/python -m bench.policies [--quick]
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

try:
    from . import common
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]

from aios_blocks.handlers.controller import payload
from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.state.store import node_view

GROUP = "3 policy cost per call (in process)"
BASELINE = "python builtin:binpack"
CASES = {
    BASELINE: "builtin:binpack",
    "starlark binpack.star": str(common.ROOT / "examples" / "binpack.star"),
    "starlark LXD most-free-memory": str(common.ROOT / "examples" / "lxd_most_free_memory.star"),
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


#: seconds each way (eval, runtime) of one case at most: ``calls`` or fewer (20 at least)
BUDGET_S = 1.5


async def time_calls(rt: PolicyRuntime, uri: str, data: dict[str, Any], calls: int) -> tuple[float, float, int]:
    """Median µs of ``eval()`` and of ``runtime.invoke``, and how many calls each."""
    rule = {"name": "resourceAllocator", "policyRuleURI": uri, "parameters": {}, "settings": {}}
    await rt.invoke(rule, "bench", data, {})  # compile + instantiate once (cached afterwards)
    inst, _, _ = await rt.instance(rule, "bench")
    direct: list[float] = []
    end = time.perf_counter() + BUDGET_S
    while len(direct) < calls and (len(direct) < 20 or time.perf_counter() < end):
        t = time.perf_counter()
        inst.eval({}, data, {})
        direct.append(time.perf_counter() - t)
    via: list[float] = []
    end = time.perf_counter() + BUDGET_S
    while len(via) < len(direct):
        t = time.perf_counter()
        await rt.invoke(rule, "bench", data, {})
        via.append(time.perf_counter() - t)
        if len(via) >= 20 and time.perf_counter() > end:
            break
    return statistics.median(direct) * 1e6, statistics.median(via) * 1e6, min(len(direct), len(via))


async def measure(quick: bool) -> list[common.Row]:
    sizes, calls = ([8], 100) if quick else ([8, 50], 300)
    step_us = 1e6 / common.raw(common.JS_STEP) if common.raw(common.JS_STEP) else None
    rt = PolicyRuntime(allow_files=True)
    rows: list[common.Row] = []
    for n in sizes:
        nodes = nodes_of(n)
        ir = {"blockId": "b", "minInstances": 1, "maxInstances": 4, "policies": {},
              "resources": {"gpus": 1, "gpuMemory": 0, "cpu": 2, "memory": 1024}}
        for action in ("allocation", "dry_run"):
            data = {"action": action, "payload": payload(ir, {"id": "c", "labels": {}}, nodes)}
            base: tuple[float, float] | None = None
            for label, uri in CASES.items():
                direct, via, n_calls = await time_calls(rt, uri, data, calls)
                base = base or (direct, via)
                ratio = "" if label == BASELINE else f"; x{direct / base[0]:.1f} / x{via / base[1]:.1f} of the Python built-in"
                rows.append(common.row(
                    GROUP, f"{label}, {action}, {n} nodes: via runtime", via, "us", step_us / via if step_us else None,
                    f"eval() alone {direct:.0f} us{ratio}; median of {n_calls} calls; of_raw_limit = raw step time / cost",
                ))
    return rows


def figures(quick: bool = False) -> list[common.Row]:
    return common.run(measure(quick))


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
