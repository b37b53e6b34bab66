"""Scaling to a target through the real workers (``block.scale.target``): one block taken from 1
to N instances (N scale steps) and back to 1 (one scale_down step choosing N-1 instances through
``builtin:binpack``, each drained and removed), wall time from the target's publish until the
block runs exactly that many; plus the in-process cost of one scale_down choice (the payload's
``instances`` and the default pick) at 10, 100 and 1,000 instances.

    .venv/bin/python -m bench.scale_down [--quick]
"""

from __future__ import annotations

import statistics
import time

try:
    from . import common, harness
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    import harness  # type: ignore[no-redef]

from aios_blocks.handlers import scaling

GROUP = "scale to a target"


async def end_to_end(n: int) -> list[common.Row]:
    async with harness.stack(1, nodes=max(2, n // 4 + 1), gpus=4, tag="scaledown") as st:
        c = st.client
        bid = await c.submit({**harness.SPEC, "maxInstances": n})
        await st.tracker.until(lambda: bid in st.tracker.done, 60)
        rows = []
        for label, target in ((f"1 -> {n} instances", n), (f"{n} -> 1 instances", 1)):
            t = time.perf_counter()
            ok, why = await c.wait_scaled(await c.scale_to(bid, target, source="bench"), 300, poll_s=0.02)
            took = time.perf_counter() - t
            if not ok:
                raise RuntimeError(f"{label}: {why}")
            per = took / max(abs(n - 1), 1)
            rows.append(common.row(GROUP, f"target {label}", took * 1000, "ms",
                                   note=f"{per * 1000:.1f} ms per instance; poll 20 ms; drain grace 0.25 s per removal, concurrent"))
        return rows


def choice_cost(k: int, repeat: int) -> float:
    insts = {f"b-{i}": {"node": f"n{i % 50}", "gpus": [f"g{i}"], "cluster": "c", "status": "running", "since": float(i)}
             for i in range(k)}
    metrics = {f"b-{i}": {"inflight": i % 7, "running": i % 7, "waiting": i % 3, "rate": 1.0} for i in range(k)}
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        scaling.default_pick(scaling.candidates(insts, metrics, time.time()))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def figures(quick: bool = False) -> list[common.Row]:
    rows = [common.row(GROUP, f"scale_down choice, {k} instances", choice_cost(k, 20 if quick else 200) * 1e6, "us",
                       note="candidates() + default_pick(), in process")
            for k in (10, 100, 1000)]
    rows += common.run(end_to_end(4 if quick else 16))
    return rows


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
