"""The console's past moment on a long stream (issue 37: <= 2 s at 1M events), measured on the
console's own ``Feed`` (``console/feed.py``: its checkpoints and kept messages, the same code the
server runs) without a server: the stream of a ``bench/console.py --dump`` run, repeated until it
has ``--events`` messages (each copy's blocks renamed, so the fold holds every copy's blocks),
fed to a ``Feed`` as its consumer would, then ``Feed.at(seq)``, the overview and the GPU map at random
sequences (each new: no cache), with the load average before and after.

Run: ``.venv/bin/python -m bench.console --blocks 10000 --dump /tmp/console-stream.pkl`` then
``.venv/bin/python -m bench.console_past /tmp/console-stream.pkl --events 1000000``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import pickle
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from aios_blocks.console import projection
from aios_blocks.console.feed import CHECK_BYTES, Feed
from aios_blocks.projections.lines import line


def amplified(msgs: list[tuple[str, bytes, int, float]], n: int) -> Iterator[tuple[str, bytes, int, float]]:
    """``msgs`` then copies of their block events (block ids suffixed ``-cK``) until ``n``."""
    blocks = [m for m in msgs if m[0].startswith("aios.block.")]
    seq, ts = 0, msgs[0][3] if msgs else 0.0
    for subject, raw, _, _ in msgs:
        seq += 1
        ts += 0.0001
        yield subject, raw, seq, ts
        if seq >= n:
            return
    k = 0
    while seq < n:
        k += 1
        for subject, raw, _, _ in blocks:
            bid = subject.split(".", 3)[2]
            new = f"{bid}-c{k}"
            seq += 1
            ts += 0.0001
            yield subject.replace(f".{bid}.", f".{new}.", 1), raw.replace(bid.encode(), new.encode()), seq, ts
            if seq >= n:
                return


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def run(msgs: list[tuple[str, bytes, int, float]], events: int, asks: int, check_bytes: int = CHECK_BYTES) -> None:
    feed = Feed(None, lambda subject, env: line(subject, env)[1], check_bytes=check_bytes)  # type: ignore[arg-type]  # (no stream read)
    proc = psutil.Process()
    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    t0 = time.perf_counter()
    for i, m in enumerate(amplified(msgs, events)):
        feed.apply(*m)
        if i % 20_000 == 0:
            await asyncio.sleep(0)
    fed = time.perf_counter() - t0
    feed.caught_up.set()
    last = feed.fold.last_seq
    rng = random.Random(42)
    times, cpus, folds, views, after = [], [], [], [], []
    for seq in sorted(rng.sample(range(1, last), asks)):
        base = max((c.seq for c in feed.checks.items if c.seq <= seq), default=0)
        t, c = time.perf_counter(), time.process_time()
        f = await feed.at(seq)
        t1 = time.perf_counter()
        projection.overview(f)
        projection.gpumap(f)
        t2 = time.perf_counter()
        times.append(t2 - t)
        cpus.append(time.process_time() - c)
        folds.append(t1 - t)
        views.append(t2 - t1)
        after.append(seq - base)
        print(f"  seq {seq:,}: {times[-1]:.2f} s ({cpus[-1]:.2f} s of CPU; {after[-1]:,} events folded after the checkpoint)",
              flush=True)
    items = feed.checks.items
    gaps = [b.seq - a.seq for a, b in itertools.pairwise(items)]
    print(f"past moment at {last:,} events ({len(msgs):,} from the dump, {len(feed.fold.blocks):,} blocks, "
          f"{len(feed.fold.nodes):,} nodes at the end): fed in {fed:.1f} s ({last / fed:,.0f} events/s)")
    print(f"  checkpoints: {len(items)} (about {feed.checks.bytes() / 2**20:.0f} MiB of their own, every "
          f"{max(gaps, default=0):,} events at most now); kept messages: {feed.kept.bytes / 2**20:.0f} MiB compressed, "
          f"from seq {feed.kept.first or 1:,}; RSS {proc.memory_info().rss / 2**20:.0f} MiB")
    print(f"  Feed.at(seq) + the overview + the GPU map, {asks} random sequences: median {statistics.median(times):.2f} s, "
          f"p95 {pct(times, 0.95):.2f} s, max {max(times):.2f} s (Feed.at: checkpoint restored + events after it "
          f"folded, median {statistics.median(folds):.2f} s over a median {statistics.median(after):,.0f} events; "
          f"the two views: median {statistics.median(views):.2f} s); the process's CPU time: median "
          f"{statistics.median(cpus):.2f} s, p95 {pct(cpus, 0.95):.2f} s")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("dump", type=Path, help="bench/console.py --dump's file")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--asks", type=int, default=10)
    ap.add_argument("--check-mib", type=int, default=CHECK_BYTES // 2**20, help="the checkpoints' budget (MiB, as Checkpoints.bytes estimates it)")
    args = ap.parse_args()
    asyncio.run(run(pickle.loads(args.dump.read_bytes()), args.events, args.asks, args.check_mib * 2**20))


if __name__ == "__main__":
    main()
