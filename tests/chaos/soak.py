"""The soak (``make soak``; issue 39 item 4; not in ``make test``): the partition suite's rig
(``chaos.rig``: 3 NATS servers behind cuttable links, R3 stream, 6-node Redis Cluster, the normal
workers) under a bounded run of mixed creates, scales, deletes and tasks, with random faults from
the partition suite's list, at half the peak rate measured first.

1. Peak: a burst of creates sent at once; placements per second until all are ready; they are
   deleted again. The run's rate is half that (``--rate`` overrides).
2. ``--minutes`` (default 30) of operations at that rate: create 40 %, delete 25 %, task 20 %,
   scale 15 % (a scale target of 1 or 2 on a ready block), the live blocks kept under a cap so
   that the GPUs do not run out; every ``--fault-every`` seconds (jittered) one fault: cut the
   stream leader off (then heal), fail over a Redis primary, SIGSTOP a NATS server, SIGKILL a
   worker.
3. Every minute: ``blocks check --live`` (in-flight blocks allowed; a GPU over capacity, an
   instance twice, a block stuck, count as violations).
4. At the end: every acknowledged create terminal (ready/deleted, or refused with a reason),
   ``Rig.final_checks`` (``blocks check`` settled, ``blocks recover --force``, Redis digest =
   stream digest, ``blocks check`` again, no GPU with two holders); the figures printed
   (and written as JSON with ``--json PATH``). Exit 1 on any violation.

Run: ``python -m tests.chaos.soak --minutes 5`` (from the repository root)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aios_blocks.bus import subjects

from .conftest import TERMINAL_STATUSES, spec, wait_terminal
from .rig import Probe, Rig

CLUSTERS, NODES, GPUS = 3, 4, 8
LAYOUT = {"parser": 1, "gateway": 2, "controller": 2, "agent-sim": 1, "executor": 1, "mapper": 1}
MIX = (("create", 40), ("delete", 25), ("task", 20), ("scale", 15))
FAULTS = ("partition", "redis", "sigstop", "kill")


async def _status(rig: Rig, bids: list[str]) -> dict[str, str]:
    pipe = rig.client.store.r.pipeline(transaction=False)
    for b in bids:
        pipe.hget(f"aios:block:{b}", "status")
    return {b: s for b, s in zip(bids, await pipe.execute(), strict=True) if s}


async def peak_rate(rig: Rig, n: int) -> float:
    """Placements per second of ``n`` creates sent at once (then deleted)."""
    probe = Probe(rig.client, spec(minInstances=1, maxInstances=2), "peak")
    t0 = time.monotonic()
    await asyncio.gather(*(probe.publish(f"peak-{i}", probe.body) for i in range(n)))
    status = await wait_terminal(rig.client, set(probe.acked), timeout=300)
    took = time.monotonic() - t0
    ready = sum(1 for s in status.values() if s == "ready")
    for bid in probe.acked:
        try:
            await rig.client.delete(bid)
        except LookupError:
            pass
    await wait_terminal(rig.client, set(probe.acked), timeout=120)
    return ready / took


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    os.environ["AIOS_STREAM_REPLICAS"] = "3"
    data = Path(args.data_dir or tempfile.mkdtemp(prefix="aios-soak-"))
    rig = await Rig(data, layout=dict(LAYOUT)).start()
    fig: dict[str, Any] = {"seed": args.seed, "minutes": args.minutes, "data_dir": str(data)}
    ops: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    checks: list[dict[str, Any]] = []
    partitions: list[dict[str, float]] = []
    unreachable = 0  # minute checks that could not reach the servers (retried)
    try:
        for i in range(CLUSTERS):
            await rig.client.add_sim_cluster(f"c{i}", nodes=NODES, gpus=GPUS)
        peak = await peak_rate(rig, args.peak_burst)
        rate = args.rate or peak / 2
        fig.update(peak_placements_per_s=round(peak, 2), rate_ops_per_s=round(rate, 2))
        print(f"peak {peak:.2f} placements/s; soak at {rate:.2f} ops/s for {args.minutes} min", flush=True)

        probe = Probe(rig.client, spec(minInstances=1, maxInstances=2), "s")
        live: list[str] = []  # created and not yet deleted by us
        cap = CLUSTERS * NODES * GPUS // 3  # blocks of at most 2 one-GPU instances: room to spare
        t_end = time.monotonic() + args.minutes * 60
        next_check = time.monotonic() + 60
        next_fault = time.monotonic() + rng.uniform(0.5, 1.5) * args.fault_every
        fault_task: asyncio.Task[None] | None = None
        pending: set[asyncio.Task[None]] = set()
        watcher = asyncio.create_task(probe._watch())

        async def one(kind: str) -> None:
            try:
                if kind == "create":
                    probe.n += 1
                    bid = f"s-{probe.n}"
                    live.append(bid)
                    await probe.publish(bid, probe.body)
                elif kind == "delete":
                    await rig.client.delete(live.pop(rng.randrange(len(live))))
                elif kind == "task":
                    bid = rng.choice([b for b in live if b in probe.ready] or [""])
                    status, _, _ = await rig.client.task(bid, b'{"soak": 1}', timeout=10)
                    if status != 200:
                        raise RuntimeError(f"task status {status}")
                else:
                    bid = rng.choice([b for b in live if b in probe.ready] or [""])
                    await rig.client.scale_to(bid, rng.choice([1, 2]), "soak", "soak")
                ops[kind] += 1
            except Exception as exc:  # an operation refused or timed out: availability, not safety
                errors[f"{kind}:{type(exc).__name__}"] += 1

        async def fault() -> None:
            kind = rng.choice(FAULTS)
            faults[kind] += 1
            rig.kill_worker(rng)  # a worker SIGKILLed during each
            try:
                if kind == "partition":
                    stream = rng.choice([subjects.STREAM, subjects.STREAM_INTAKE])
                    partitions.append(await rig.partition_leader(rng.uniform(6, 12), stream, probe))
                elif kind == "redis":
                    await rig.redis_failover(rng)
                elif kind == "sigstop":
                    await rig.pause_server(rng.choice(rig.nats.names()), rng.uniform(6, 12))
            except Exception as exc:
                errors[f"fault-{kind}:{type(exc).__name__}"] += 1
                rig.note(f"fault {kind} failed: {exc!r}")

        while time.monotonic() < t_end:
            now = time.monotonic()
            if now >= next_fault and (fault_task is None or fault_task.done()):
                fault_task = asyncio.create_task(fault())
                next_fault = now + rng.uniform(0.5, 1.5) * args.fault_every
            if now >= next_check:
                next_check = now + 60
                for _ in range(5):  # rc 2: the command could not reach the servers (a fault under way)
                    rep = await rig.blocks_check(settled=False, attempts=1)
                    if rep["rc"] in (0, 1):
                        break
                    unreachable += 1
                    await asyncio.sleep(3)
                checks.append({"t_min": round((args.minutes * 60 - (t_end - now)) / 60, 1), "rc": rep["rc"],
                               "violations": rep.get("violations", [])[:5]})
                print(f"check at {checks[-1]['t_min']} min: rc {rep['rc']} {rep.get('violations', [])[:3]}", flush=True)
            kind = rng.choices([k for k, _ in MIX], [w for _, w in MIX])[0]
            if (kind == "create" and len(live) >= cap) or (kind == "delete" and not live):
                kind = "delete" if live else "create"
            t = asyncio.create_task(one(kind))
            pending.add(t)
            t.add_done_callback(pending.discard)
            await asyncio.sleep(rng.expovariate(rate))
        if fault_task is not None:
            await fault_task
        await asyncio.gather(*pending)
        watcher.cancel()

        # the end: every acknowledged create answered, the invariants settled, recover to the same digest
        created = set(probe.acked)
        status = await wait_terminal(rig.client, created, timeout=300)
        unanswered = sorted(created - set(status))
        final = await _status(rig, sorted(created))
        by_status = Counter(final.values())
        no_reason = [b for b, s in final.items() if s in ("failed", "rejected")
                     and not ((await rig.client.store.get_block(b)) or {}).get("reason")]
        checked_violations, checked = await rig.final_checks([f"c{i}" for i in range(CLUSTERS)])
        took = sorted(probe.ready[b] - probe.acked[b] for b in probe.ready)
        violations = (
            [f"unanswered create {b}" for b in unanswered[:20]]
            + [f"refused without reason {b}" for b in no_reason[:20]]
            + checked_violations
            + [f"minute check {c['t_min']}: {c['violations']}" for c in checks if c["rc"] != 0]
        )
        fig.update(
            ops=dict(ops), op_errors=dict(errors), faults=dict(faults), creates=len(created),
            final_status=dict(by_status), terminal=sum(by_status[s] for s in TERMINAL_STATUSES),
            create_to_ready_p50_s=round(statistics.median(took), 2) if took else None,
            create_to_ready_p95_s=round(took[int(len(took) * 0.95)], 2) if took else None,
            partitions=partitions, minute_checks=len(checks), minute_checks_unreachable_retried=unreachable, minute_checks_failed=sum(c["rc"] != 0 for c in checks),
            final_check_before_recover_rc=checked["check_before_recover"], final_counts=checked["counts"],
            diverged_before_recover=checked["diverged_before_recover"], violations=violations,
            supervisor_restarts=rig.sup.restarts, fault_log=rig.log,
        )
        return fig
    finally:
        await rig.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.chaos.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the mixed load runs (default 30)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", type=float, default=0.0, help="operations per second (default: half the measured peak)")
    ap.add_argument("--peak-burst", type=int, default=40, help="creates in the peak measurement")
    ap.add_argument("--fault-every", type=float, default=45.0, help="mean seconds between faults")
    ap.add_argument("--data-dir", default="", help="where the servers keep their data and logs (default: a temp dir)")
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args(argv)
    fig = asyncio.run(soak(args))
    out = json.dumps(fig, indent=2, default=str)
    print(out)
    if args.json:
        Path(args.json).write_text(out)
    print(f"\n{len(fig['violations'])} invariant violation(s)")
    return 1 if fig["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
