"""Process CPU per block of the placement path in one process (``testing.MemorySystem``: the real
parser, gateway, controller and simulated fleet handlers on an in-memory bus and fakeredis), so two
trees compare without the servers' and the other processes' noise. Figures, never a test.

    PYTHONPATH=<tree>/src .venv/bin/python -m bench.inproc_cpu [BLOCKS] [--profile OUT.prof]

3 clusters x 100 nodes x 8 GPUs, 5 warm-up blocks, then BLOCKS (default 60) one-instance blocks
submitted at once and delivered to the end; prints CPU and wall per block. fakeredis' own work is
most of it; call counts (``--profile``) show what a change added.
"""

from __future__ import annotations

import asyncio
import cProfile
import sys
import time

import aios_blocks
from aios_blocks.settings import Settings
from aios_blocks.testing import MemorySystem

SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 4}


async def main(n: int, profile: str) -> None:
    async with MemorySystem.open(Settings(sim_start_delay_s=0.0, dry_run_deadline_s=5.0)) as s:
        await s.add_component()
        for c in range(3):
            await s.add_sim_cluster(f"c{c}", nodes=100, gpus=8)
        await s.run()
        for _ in range(5):
            await s.submit(dict(SPEC))
        await s.run()
        prof = cProfile.Profile() if profile else None
        t0, w0 = time.process_time(), time.perf_counter()
        if prof:
            prof.enable()
        for _ in range(n):
            await s.submit(dict(SPEC))
        await s.run()
        if prof:
            prof.disable()
            prof.dump_stats(profile)
        cpu, wall = time.process_time() - t0, time.perf_counter() - w0
        print(f"{aios_blocks.__file__}: " f"cpu/block {1000 * cpu / n:.3f} ms  wall/block {1000 * wall / n:.3f} ms  dead={len(s.dead)}")


if __name__ == "__main__":
    args = sys.argv[1:]
    out = ""
    if "--profile" in args:
        i = args.index("--profile")
        out = args[i + 1]
        del args[i:i + 2]
    asyncio.run(main(int(args[0]) if args else 60, out))
