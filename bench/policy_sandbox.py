"""A user Python policy's cost per call, in a thread of the worker vs in a policy process
(AIOS_PYTHON_POLICY_SANDBOX=thread|process): ``runtime.invoke`` of seed 000's first-fit example
(examples/first_fit.py) on the controller's allocation payload for 100 and 1,213 nodes (8 GPUs
each; the latter sampled as by default, and whole), warm (compiled, instance built, process started); the median of up to 200 calls, at most
~2 s each way. The process mode's extra is the pickled round trip of the input. Figures only.

    .venv/bin/python -m bench.policy_sandbox [--quick]
"""

from __future__ import annotations

import pickle
import statistics
import time
from typing import Any

try:
    from . import common
    from .policies import nodes_of
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    from policies import nodes_of  # type: ignore[no-redef]

from aios_blocks.handlers.controller import payload
from aios_blocks.policies.runtime import PolicyRuntime

GROUP = "3 Python policy call: thread vs process"
POLICY = str(common.ROOT / "examples" / "first_fit.py")
BUDGET_S = 2.0


async def median_us(rt: PolicyRuntime, data: dict[str, Any], calls: int) -> tuple[float, int]:
    rule = {"name": "resourceAllocator", "policyRuleURI": POLICY, "parameters": {}, "settings": {}}
    for _ in range(3):  # compile, build, start the process, warm caches
        await rt.invoke(rule, "bench", data, {})
    took: list[float] = []
    end = time.perf_counter() + BUDGET_S
    while len(took) < calls and (len(took) < 20 or time.perf_counter() < end):
        t = time.perf_counter()
        await rt.invoke(rule, "bench", data, {})
        took.append(time.perf_counter() - t)
    return statistics.median(took) * 1e6, len(took)


async def measure(quick: bool) -> list[common.Row]:
    #: (nodes, sampleNodes): the default sample of 100 (a 1,213-node cluster's input holds the few
    #: sampled nodes), and 0 (every node: the largest input)
    sizes, calls = ([(100, None)], 50) if quick else ([(100, None), (1213, None), (1213, 0)], 200)
    runtimes = {mode: PolicyRuntime(allow_files=True, python_sandbox=mode) for mode in ("thread", "process")}
    rows: list[common.Row] = []
    for n, sample in sizes:
        policies = {} if sample is None else {"resourceAllocator": {"settings": {"sampleNodes": sample}}}
        ir = {"blockId": "b", "minInstances": 1, "maxInstances": 4, "policies": policies,
              "resources": {"gpus": 1, "gpuMemory": 0, "cpu": 2, "memory": 1024}}
        data = {"action": "allocation", "payload": payload(ir, {"id": "c", "labels": {}}, nodes_of(n))}
        size = len(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))
        got = {mode: await median_us(rt, data, calls) for mode, rt in runtimes.items()}
        for mode, (us, k) in got.items():
            extra = "" if mode == "thread" else f"; +{us - got['thread'][0]:,.0f} us (x{us / got['thread'][0]:.1f}) over a thread"
            label = f"{n} nodes" + (", unsampled" if sample == 0 else "")
            rows.append(common.row(GROUP, f"first_fit.py allocation, {label}, {mode}", us, "us", None,
                                   f"median of {k} calls; input pickled {size / 1024:,.0f} KiB{extra}"))
    return rows


def figures(quick: bool = False) -> list[common.Row]:
    return common.run(measure(quick))


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
