"""Peer, side by side: the same placement workload on Ray placement groups, in the same run.

Ray gets the simulated GPUs as a custom resource (``sim_gpu``, one unit per simulated GPU) on a
local Ray instance (``ray.init(num_cpus=2, resources=...)``, all on this machine); a block is a
placement group of one bundle ``{"sim_gpu": 1}``, "ready" when ``pg.ready()`` resolves. Measured:
create -> ready latency one at a time and a burst of groups at once, then our figures for the
same workload (10 clusters x 100 nodes x 8 GPUs, 1-instance blocks) and the ratio.

Ray's side places a bundle in its GCS and starts nothing; ours also runs the simulated agent's
50 ms start and records every step in JetStream. Skipped, with how to enable it, when ``ray`` is
not installed (``make bench-peer`` installs it into the venv).

    .venv/bin/python -m bench.peer [--quick]
"""

from __future__ import annotations

import importlib.util

try:
    from . import common, harness, raw
    from .ray_groups import ray_figures
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    import harness  # type: ignore[no-redef]
    import raw  # type: ignore[no-redef]
    from ray_groups import ray_figures  # type: ignore[no-redef]

GROUP = "6 peer: Ray placement groups"
CLUSTERS, NODES, GPUS = 10, 100, 8


async def ours(lat_n: int, burst_n: int) -> tuple[list[float], float]:
    async with harness.stack(CLUSTERS, NODES, tag="peer") as st:
        lat = []
        for _ in range(lat_n):
            kind, s = await st.submit_wait()
            if kind == "ready":
                lat.append(s)
        bids, secs = await st.burst(burst_n, timeout=240)
        ready = sum(1 for b in bids if st.tracker.done.get(b, ("",))[0] == "ready")
    return lat, ready / secs


def figures(quick: bool = False) -> list[common.Row]:
    if importlib.util.find_spec("ray") is None:
        return [common.row(GROUP, "Ray placement groups", float("nan"), "", None,
                           "skipped: ray is not installed; `make bench-peer` installs it into the venv and runs this")]
    raw.ensure_raw()
    lat_n, burst_n = (10, 40) if quick else (30, 150)
    r_lat, r_rate = ray_figures(lat_n, burst_n)
    o_lat, o_rate = common.run(ours(lat_n, burst_n))
    work = f"{CLUSTERS} x {NODES} x {GPUS} simulated GPUs, 1-GPU blocks"
    return [
        common.row(GROUP, "Ray: placement group create->ready p50", common.pct(r_lat, 50) * 1000, "ms", None, f"n={lat_n}; {work}"),
        common.row(GROUP, "Ray: placement groups/s, burst", r_rate, "groups/s", None, f"{burst_n} at once"),
        common.row(GROUP, "ours: create->ready p50 (same run)", common.pct(o_lat, 50) * 1000, "ms",
                   common.floor_fraction(common.pct(o_lat, 50), 7, 0.05), "includes the 50 ms simulated start"),
        common.row(GROUP, "ours: blocks/s, burst (same run)", o_rate, "blocks/s", None, f"{burst_n} at once"),
        common.row(GROUP, "ours / Ray: throughput", o_rate / r_rate, "x", None, ">1 = we place faster"),
        common.row(GROUP, "ours / Ray: p50 latency", common.pct(o_lat, 50) / common.pct(r_lat, 50), "x", None, "<1 = we are faster"),
    ]


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
