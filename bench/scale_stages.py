"""A scale burst timed stage by stage (docs/benchmarks.md, "Issue 35's refactors"): when the scale
calls returned, the controller's first and last ``node.instance.create``, the first and last
``instance.added``. Placements/s is a wall figure of a ~1 s burst; this says which stage moved.

    cd <tree> && PYTHONPATH=src /work/main/.venv/bin/python -m bench.scale_stages [CALLS]    # default 640

(from the tree's root, its own ``bench.harness``: copy this file into an older tree's ``bench/``)

10 clusters x 100 nodes x 8 GPUs, simulated start 0, the kinds grouped as ``blocks up`` runs them;
10 blocks, then CALLS scale calls over them at once (as ``bench.targets``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import msgspec

from bench import harness


async def main(n: int) -> None:
    os.environ["AIOS_SIM_START_DELAY_S"] = "0"
    async with harness.stack(10, 100, tag="stages", grouped=True) as st:
        creates: dict[str, float] = {}

        async def on_create(msg: Any) -> None:
            d = msgspec.json.decode(msg.data)
            d = d.get("data", d)
            creates.setdefault(str(d.get("instance_id") or d.get("iid")), time.perf_counter())

        await st.client.bus.subscribe("aios.node.*.instance.create", on_create)
        await st.client.bus.nc.flush()
        bids, _ = await st.burst(10, 120, {**harness.SPEC, "maxInstances": 2 + n // 10})
        creates.clear()
        back: list[float] = []
        scale = st.client.scale

        async def timed(bid: str) -> str:
            rid = await scale(bid)
            back.append(time.perf_counter() - t0)
            return rid

        st.client.scale = timed
        t0 = time.perf_counter()
        placed, failed, secs = await st.scale_burst(bids, n, timeout=300)
        c = sorted(v - t0 for v in creates.values())
        a = sorted(v - t0 for v in st.tracker.added.values() if v >= t0)
        print(f"calls back {min(back):.3f}-{max(back):.3f} s; creates {len(c)} {c[0]:.3f}-{c[-1]:.3f} s; "
              f"added {len(a)} {a[0]:.3f}-{a[-1]:.3f} s; {placed} placed, {failed} failed, {placed / secs:.0f}/s")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 640))
