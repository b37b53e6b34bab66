"""The core's cost per block, the figures issue 14's targets are stated in, end to end through the
real workers (``Supervisor``: parser, gateway, controller, simulated agent) on embedded NATS
JetStream (``sync_interval: always``) and Redis, 10 clusters x 100 nodes x 8 GPUs, simulated
start 0 (every figure here is the control plane's own cost):

* create -> ready p50, unloaded (one block at a time, after ``WARM`` blocks, as the Ray side warms);
* blocks/s end to end: a burst of 600 one-instance blocks (quick: 150) submitted at once;
* per block of that burst: stored messages, KB stored, Redis round trips (the server's
  ``total_reads_processed``: one per request or pipeline a client sends), Redis commands, and CPU
  summed over every process (workers, nats-server, redis-server; the benchmark's own client
  apart), with each process's share in the note;
* instance placements/s: a burst of scale calls on existing blocks;
* Ray placement groups on the same workload, in the same run (when ray is installed), and the
  targets' ratios to it.

The workers run grouped in processes as ``blocks up`` runs them (``supervisor.DEFAULT_GROUPS``),
unless ``AIOS_BENCH_GROUPED`` is set (``bench/ab_targets.sh`` sets it per side).

    .venv/bin/python -m bench.targets [--quick]
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

try:
    from . import common, harness, raw
    from .ray_groups import ray_figures
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    import harness  # type: ignore[no-redef]
    import raw  # type: ignore[no-redef]
    from ray_groups import ray_figures  # type: ignore[no-redef]

GROUP = "2 core targets 10x100x8"
CLUSTERS, NODES = 10, 100
TICK = os.sysconf("SC_CLK_TCK")
#: blocks placed before the p50 is measured (first-use costs: component read, policy instances)
WARM = 3


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (its threads included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15 of stat)


@dataclass
class Sample:
    messages: int
    bytes: int
    redis_commands: int
    redis_reads: int
    cpu: dict[str, float] = field(default_factory=dict)
    #: Redis calls by command (``INFO commandstats``)
    calls: dict[str, int] = field(default_factory=dict)

    def minus(self, other: Sample) -> Sample:
        return Sample(
            self.messages - other.messages, self.bytes - other.bytes, self.redis_commands - other.redis_commands,
            self.redis_reads - other.redis_reads, {k: v - other.cpu.get(k, 0.0) for k, v in self.cpu.items()},
            {k: v - other.calls.get(k, 0) for k, v in self.calls.items() if v - other.calls.get(k, 0)},
        )


async def sample(st: harness.Stack) -> Sample:
    info = await st.client.bus.js.stream_info("AIOS")
    r = st.client.store.r
    stats = await r.info("stats")
    server = await r.info("server")
    cmdstats = await r.info("commandstats")
    pids: dict[str, int] = {}
    for (kind, idx), proc in st.sup.procs.items():
        if proc.poll() is None:
            pids[f"{kind}-{idx}"] = proc.pid
    with contextlib.suppress(OSError, ValueError):
        pids["nats-server"] = int((st.data / "nats.pid").read_text().strip())
    with contextlib.suppress(KeyError, ValueError):
        pids["redis-server"] = int(server["process_id"])
    return Sample(
        int(info.state.messages), int(info.state.bytes), int(stats["total_commands_processed"]),
        int(stats["total_reads_processed"]), {k: _cpu_s(p) for k, p in pids.items()},
        {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in cmdstats.items() if isinstance(v, dict)},
    )


def _shares(d: Sample, n: int) -> str:
    """Each process's CPU per unit of work, in ms, largest first."""
    return ", ".join(f"{k} {v / max(1, n) * 1000:.2f}" for k, v in sorted(d.cpu.items(), key=lambda kv: -kv[1]))


async def scenario(lat_n: int, burst_n: int, scale_n: int) -> list[common.Row]:
    rows: list[common.Row] = []
    # the kinds in processes as `blocks up` runs them, unless AIOS_BENCH_GROUPED says (ab_targets.sh)
    grouped = None if "AIOS_BENCH_GROUPED" in os.environ else True
    with common.env_set("AIOS_SIM_START_DELAY_S", "0"):  # the workers the stack spawns inherit it
        async with harness.stack(CLUSTERS, NODES, tag="targets", grouped=grouped) as st:
            for _ in range(WARM):  # as the Ray side warms its first groups (bench/ray_groups.py)
                await st.submit_wait()
            lat = []
            for _ in range(lat_n):
                kind, s = await st.submit_wait()
                if kind == "ready":
                    lat.append(s)
            rows.append(common.row(GROUP, "create->ready p50, unloaded (simulated start 0)", common.pct(lat, 50) * 1000, "ms",
                                   common.floor_fraction(common.pct(lat, 50), 7), f"n={len(lat)} sequential; target <= 15 ms"))
            before = await sample(st)
            bids, secs = await st.burst(burst_n, timeout=300)
            d = (await sample(st)).minus(before)
            ready = sum(1 for b in bids if st.tracker.done.get(b, ("",))[0] == "ready")
            n = max(1, burst_n)
            rows.append(common.row(GROUP, "blocks/s end to end, burst (simulated start 0)", ready / secs, "blocks/s",
                                   common.fraction(ready / secs, common.JS_PUBLISH, d.messages / n),
                                   f"{burst_n} at once, {ready} ready; target >= 300/s"))
            rows.append(common.row(GROUP, "stored messages per block", d.messages / n, "msgs", None, "target <= 14"))
            rows.append(common.row(GROUP, "KB stored per block", d.bytes / n / 1024, "KB", None, "target <= 15"))
            rows.append(common.row(GROUP, "Redis round trips per block", d.redis_reads / n, "round trips", None,
                                   f"server read events (requests or pipelines); {d.redis_commands / n:.1f} commands per block ("
                                   + ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(d.calls.items(), key=lambda kv: -kv[1])[:8])
                                   + "); target <= 15"))
            total = sum(d.cpu.values())
            shares = _shares(d, n)
            rows.append(common.row(GROUP, "CPU per block, all processes", total / n * 1000, "ms", None,
                                   f"ms per block: {shares}; target <= 5"))
            # the same burst with each create published on its own (a plain NATS client's way):
            # one disk sync per create before the workers can store anything of theirs
            obids, osecs = await st.burst(burst_n, timeout=300, one_by_one=True)
            oready = sum(1 for b in obids if st.tracker.done.get(b, ("",))[0] == "ready")
            rows.append(common.row(GROUP, "blocks/s end to end, burst, creates published one by one", oready / osecs,
                                   "blocks/s", None,
                                   f"{burst_n} at once, {oready} ready; each create its own publish (a plain NATS client), "
                                   "where Client.submit stores creates gathered at once as atomic batches"))
            # room for every call: one instance each to start with, plus their share of the calls
            tbids, _ = await st.burst(10, 120, {**harness.SPEC, "maxInstances": 1 + -(-scale_n // 10)})
            targets = [b for b in tbids if st.tracker.done.get(b, ("",))[0] == "ready"]
            if targets:
                before = await sample(st)
                placed, failed, secs = await st.scale_burst(targets, scale_n, timeout=300)
                d = (await sample(st)).minus(before)
                rows.append(common.row(GROUP, "instance placements/s (scale calls on existing blocks)", placed / secs,
                                       "placements/s", None,
                                       f"{scale_n} at once over {len(targets)} blocks, {failed} failed; "
                                       f"{d.messages / max(1, scale_n):.1f} msgs, {d.redis_reads / max(1, scale_n):.1f} "
                                       f"Redis round trips, {sum(d.cpu.values()) / max(1, scale_n) * 1000:.2f} ms CPU "
                                       f"per placement ({_shares(d, scale_n)}); target >= 700/s"))
    return rows


def _value(rows: list[common.Row], figure: str) -> float:
    return next((r["value"] for r in rows if r["figure"].startswith(figure)), float("nan"))


def peer_rows(rows: list[common.Row], lat_n: int, burst_n: int) -> list[common.Row]:
    """Ray placement groups on the same workload (``bench/ray_groups.py``: 1-bundle groups over
    the same simulated GPUs, ``lat_n`` one at a time then ``burst_n`` at once), after our side, and
    the targets' ratios: blocks/s >= Ray's groups/s, placements/s >= 1.5 x."""
    if os.environ.get("AIOS_BENCH_NO_PEER"):  # bench/ab_targets.sh runs Ray once per round itself
        return []
    if importlib.util.find_spec("ray") is None:
        return [common.row(GROUP, "Ray placement groups, same workload", float("nan"), "", None,
                           "skipped: ray is not installed; `make bench-peer` installs it into the venv")]
    r_lat, r_rate = ray_figures(lat_n, burst_n)
    blocks, placements = _value(rows, "blocks/s end to end"), _value(rows, "instance placements/s")
    return [
        common.row(GROUP, "Ray: placement groups/s, burst (same run)", r_rate, "groups/s", None,
                   f"{burst_n} 1-bundle groups at once over {CLUSTERS * NODES * 8} simulated GPUs"),
        common.row(GROUP, "Ray: placement group create->ready p50 (same run)", common.pct(r_lat, 50) * 1000, "ms", None,
                   f"n={lat_n} sequential"),
        common.row(GROUP, "blocks/s / Ray groups/s", blocks / r_rate, "x", None, "target >= 1"),
        common.row(GROUP, "placements/s / Ray groups/s", placements / r_rate, "x", None, "target >= 1.5"),
    ]


def figures(quick: bool = False) -> list[common.Row]:
    raw.ensure_raw()
    lat_n, burst_n, scale_n = (10, 150, 150) if quick else (30, 600, 640)
    rows: list[common.Row] = common.run(scenario(lat_n, burst_n, scale_n))
    return rows + peer_rows(rows, lat_n, burst_n)


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
