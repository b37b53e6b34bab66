"""Placement throughput and latency end to end, through the real workers (``Supervisor``: parser,
gateway, controller, simulated agent, one process each) on embedded NATS JetStream and Redis.

For 10 clusters x 100 nodes x 8 GPUs and 10 x 1,000 (quick: 10 x 20 only):

* create -> ready latency p50/p99/max, one block at a time (unloaded);
* peak: a burst of 1-instance blocks submitted at once -> blocks/s until the last is ready;
* the same latency at 80 % of that peak, blocks submitted open-loop at 0.8 x peak;
* instance placements/s: a burst of scale calls on existing blocks.

Rates are also given as a fraction of the raw JetStream publish limit, counting the stream
messages each block or placement really costs (measured, decision records included); latencies
as the raw floor (critical-path steps x raw step time + the simulated start) over the measured.

    .venv/bin/python -m bench.placement [--quick]
"""

from __future__ import annotations

import os

try:
    from . import common, harness, raw
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    import harness  # type: ignore[no-redef]
    import raw  # type: ignore[no-redef]

#: consumer steps on a 1-instance block's critical path: create, parsed, dry_run, dry_run.result,
#: allocation, instance.create, added (-> ready)
CRITICAL_STEPS = 7
SIM_START_S = float(os.environ.get("AIOS_SIM_START_DELAY_S", 0.05))

#: (clusters, nodes, latency samples, burst blocks, paced blocks, scale calls) — sized so the
#: whole `make bench` fits in a few minutes on 2 cores
FULL = [(10, 100, 30, 150, 120, 150), (10, 1000, 20, 100, 80, 100)]
QUICK = [(10, 20, 10, 40, 30, 30)]


async def scenario(clusters: int, nodes: int, lat_n: int, burst_n: int, paced_n: int, scale_n: int) -> list[common.Row]:
    g = f"2 placement {clusters}x{nodes}x8"
    size = f"{clusters} clusters x {nodes} nodes x 8 GPUs"
    rows: list[common.Row] = []
    async with harness.stack(clusters, nodes, tag="placement") as st:
        rows.append(common.row(g, "create->ready of the first block after adding the clusters (cold)", st.cold_s * 1000, "ms", None,
                               "workers load the new clusters' nodes (prefetched on the cluster hint) while it is placed"))
        lat = []
        for _ in range(lat_n):
            kind, s = await st.submit_wait()
            if kind == "ready":
                lat.append(s)
        p50 = common.pct(lat, 50)
        floor = CRITICAL_STEPS / (common.raw(common.JS_STEP) or float("inf")) + SIM_START_S
        for name, v in (("p50", p50), ("p99", common.pct(lat, 99)), ("max", max(lat, default=float("nan")))):
            rows.append(common.row(g, f"create->ready {name}, unloaded", v * 1000, "ms", common.floor_fraction(v, CRITICAL_STEPS, SIM_START_S),
                                   f"n={len(lat)} sequential; includes {SIM_START_S * 1000:.0f} ms simulated start; floor {floor * 1000:.0f} ms"))
        before, before_bytes = await st.stream_messages(), await st.stream_bytes()
        bids, secs = await st.burst(burst_n, timeout=240)
        per_block = (await st.stream_messages() - before) / max(1, burst_n)
        kb_per_block = (await st.stream_bytes() - before_bytes) / max(1, burst_n) / 1024
        ready = sum(1 for b in bids if st.tracker.done.get(b, ("",))[0] == "ready")
        peak = ready / secs
        rows.append(common.row(g, "blocks/s end to end (create->ready, 1 instance), burst", peak, "blocks/s",
                               common.fraction(peak, common.JS_PUBLISH, per_block),
                               f"{burst_n} at once, {ready} ready; {per_block:.1f} stream msgs/block, {kb_per_block:.1f} KB/block ({size})"))
        rate = max(0.5, 0.8 * peak)
        paced = await st.paced(paced_n, rate, timeout=240)
        for name, p in (("p50", 50), ("p99", 99)):
            v = common.pct(paced, p)
            rows.append(common.row(g, f"create->ready {name} at 80% of peak", v * 1000, "ms",
                                   common.floor_fraction(v, CRITICAL_STEPS, SIM_START_S), f"{len(paced)} blocks open-loop at {rate:.1f}/s"))
        rows.append(common.row(g, "create->ready max at 80% of peak", max(paced, default=float("nan")) * 1000, "ms",
                               common.floor_fraction(max(paced, default=1.0), CRITICAL_STEPS, SIM_START_S), ""))
        # scale targets: blocks with room to grow (maxInstances 64: their dry_run simulates 64 placements)
        tbids, _ = await st.burst(10, 120, {**harness.SPEC, "maxInstances": 64})
        targets = [b for b in tbids if st.tracker.done.get(b, ("",))[0] == "ready"]
        if not targets:
            kinds = sorted({st.tracker.done.get(b, ("timeout",))[0] for b in tbids})
            rows.append(common.row(g, "instance placements/s (scale calls on existing blocks)", float("nan"), "placements/s", None,
                                   f"no scale target became ready ({kinds}); see {st.data / 'logs'}"))
            return rows
        before = await st.stream_messages()
        placed, failed, secs = await st.scale_burst(targets, scale_n, timeout=240)
        per_placement = (await st.stream_messages() - before) / max(1, scale_n)
        rows.append(common.row(g, "instance placements/s (scale calls on existing blocks)", placed / secs, "placements/s",
                               common.fraction(placed / secs, common.JS_PUBLISH, per_placement),
                               f"{scale_n} at once over {len(targets)} blocks, {failed} failed; {per_placement:.1f} stream msgs/placement"))
    return rows


def figures(quick: bool = False) -> list[common.Row]:
    raw.ensure_raw()
    rows: list[common.Row] = []
    for cfg in QUICK if quick else FULL:
        rows += common.run(scenario(*cfg))
    return rows


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
