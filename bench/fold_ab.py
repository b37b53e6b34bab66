"""The fold alone (``recovery.fold.Fold.apply`` + ``image``), in process, over the synthetic
lifecycles of ``bench/recovery.py`` (no servers): events per second and the image digest, so two
checkouts can be compared in the same run (A/B) and shown to rebuild the same state.

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
    best = 0.0
    for _ in range(3):
        gc.disable()
        t0 = time.perf_counter()
        f = Fold()
        for m in msgs:
            f.apply(*m)
        img = f.image(include_gathers=False)
        dt = time.perf_counter() - t0
        gc.enable()
        best = max(best, len(msgs) / dt)
    print(f"{len(msgs):,} events: best of 3 {best:,.0f} events/s (fold + image); digest {im.digest(img)}; anomalies {len(f.anomalies)}")


if __name__ == "__main__":
    main()
