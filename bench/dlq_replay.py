"""``blocks dlq replay --all`` over many dead letters (docs/dead-letters.md "How fast"): embedded
NATS and Redis, a durable on ``aios.cluster.dlq-bench.*``, ``N`` originals stored in ``AIOS`` and a
dead letter of each (as the consumer runner stores them), then the real command in its own
process, as an operator runs it. Reported: the listing alone (``blocks dlq --json``: what every
replay reads first), the replay's wall time, and letters/s of the replay less that listing; each
letter's copy and mark checked stored.

    .venv/bin/python -m bench.dlq_replay [N]        # N: 2000 by default
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from . import common  # (it puts the repo root on sys.path)
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]  # noqa: F401

from aios_blocks.bus import subjects
from aios_blocks.bus.catalog import E
from aios_blocks.bus.nats_bus import Bus
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.events import DeadLetter

DURABLE = "dlq-bench"
SUBJECT = "aios.cluster.dlq-bench.reassignment"


def blocks(servers: EmbeddedServers, *args: str) -> tuple[float, int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOS_")} | {
        "AIOS_NATS_URL": servers.nats_url, "AIOS_REDIS_URL": servers.redis_url, "COLUMNS": "250"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "aios_blocks.cli", *args], env=env, capture_output=True, text=True, timeout=1800)
    return time.perf_counter() - t0, r.returncode, r.stdout, r.stderr


async def letters(servers: EmbeddedServers, n: int) -> None:
    bus = await Bus.open(servers.nats_url)
    try:
        await bus.ensure_stream()
        await bus.ensure_consumer(subjects.ConsumerSpec(DURABLE, ("aios.cluster.dlq-bench.*",)))
        step = 500
        for lo in range(0, n, step):
            acks = await asyncio.gather(*[await bus.js.publish_async(
                SUBJECT, json.dumps({"id": f"evt-{i}", "data": {"i": i}}).encode(),
                headers={"Nats-Msg-Id": f"evt-{i}", "Content-Type": "application/json"}) for i in range(lo, min(n, lo + step))])
            await asyncio.gather(*[await bus.js.publish_async(*_letter_msg(bus, i, int(a.seq))) for i, a in enumerate(acks, lo)])
    finally:
        await bus.close()


def _letter_msg(bus: Bus, i: int, seq: int) -> tuple[str, bytes]:
    letter = DeadLetter(subject=SUBJECT, consumer=DURABLE, error="No space left on device", deliveries=5, stream_seq=seq,
                        data=json.dumps({"id": f"evt-{i}", "data": {"i": i}}), headers={"Content-Type": "application/json"})
    subject = E.dead_letter.subject(consumer=DURABLE, subject=SUBJECT)
    return subject, bus.encode(subject, E.dead_letter.name, letter, f"dlq:{DURABLE}:{seq}")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    with tempfile.TemporaryDirectory() as tmp:
        servers = EmbeddedServers(data_dir=Path(tmp) / "data").start()
        try:
            asyncio.run(letters(servers, n))
            listing, rc, out, errs = blocks(servers, "dlq", "--json")
            assert rc == 0 and len(out.splitlines()) == n, (rc, errs[-2000:])
            wall, rc, out, errs = blocks(servers, "dlq", "replay", "--all", "--json")
            rows = [json.loads(line) for line in out.splitlines()]
            replayed = sum(r["outcome"] == "replayed" for r in rows)
            assert rc == 0 and replayed == n, (rc, replayed, errs[-2000:])
            _, rc, out, _ = blocks(servers, "dlq", "--json")
            assert all(len(json.loads(line)["replayed"]) == 1 for line in out.splitlines())  # every one marked
        finally:
            servers.stop()
    print(f"dlq replay of {n} letters: listing {listing:.2f} s, replay command {wall:.2f} s, "
          f"{n / max(1e-9, wall - listing):.0f} letters/s (less the listing), {n / wall:.0f} letters/s (whole command)")


if __name__ == "__main__":
    main()
