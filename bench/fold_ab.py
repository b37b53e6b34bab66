"""The fold alone (``recovery.fold.Fold.apply`` + ``image``), in process, over the synthetic
lifecycles of ``bench/recovery.py`` (no servers): events per second and the image digest, so two
checkouts can be compared in the same run (A/B) and shown to rebuild the same state. The CPU time per event (best of 5, the process's own)
says more than the wall time on a shared box.

    PYTHONPATH=<checkout>/src .venv/bin/python bench/fold_ab.py 200000
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec

from bench.recovery import IR, KEEP, inventory, lifecycle


def messages(total: int) -> list[tuple[str, bytes, int, float]]:
    out: list[tuple[str, bytes, int, float]] = []
    enc = msgspec.json.encode

    def add(subject: str, kind: str, data: object) -> None:
        env = {"specversion": "1.0", "id": f"bench:{len(out) + 1}", "source": "bench", "type": f"io.aios.{kind}",
               "subject": subject, "time": "2026-01-01T00:00:00Z", "datacontenttype": "application/json", "data": data}
        out.append((subject, enc(env), len(out) + 1, 1.0))

    for ev in inventory():
        add(*ev)
    i = 0
    while len(out) < total:
        bid = f"b{i}"
        spec = {**IR, "blockId": bid}
        spec.pop("policies")
        gen = len(out) + 1
        add(f"aios.block.{bid}.submitted", "block.submitted",
            {"block_id": bid, "gen": gen, "subject": f"aios.block.{bid}.create", "digest": f"{i:016x}", "spec": spec})
        for ev in lifecycle(i, gen, keep=i >= total // 14 - KEEP):
            add(*ev)
        i += 1
    return out


def main() -> None:
    from aios_blocks.recovery import image as im
    from aios_blocks.recovery.fold import Fold

    msgs = messages(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000)
    best, cpu = 0.0, float("inf")
    for _ in range(5):
        gc.disable()
        t0, c0 = time.perf_counter(), time.process_time()
        f = Fold()
        for m in msgs:
            f.apply(*m)
        img = f.image(include_gathers=False)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        gc.enable()
        best, cpu = max(best, len(msgs) / dt), min(cpu, dc)
    print(f"{len(msgs):,} events: best of 5 {best:,.0f} events/s, {cpu / len(msgs) * 1e6:.2f} us CPU per event (fold + image); "
          f"digest {im.digest(img)[:16]}; anomalies {len(f.anomalies)}")


if __name__ == "__main__":
    main()
