"""What the stream stores per block, by event: a burst of one-instance blocks on the targets'
inventory (10 clusters x 100 nodes x 8 GPUs), then every message stored during it, grouped by
catalog event (subject pattern), with its count and bytes per block (subject + headers + body,
as JetStream counts them, less its fixed per-message overhead); then every recorded policy
call's input rebuilt by replay (``recovery.inputs``) and checked against its digest.

    .venv/bin/python -m bench.stored [--quick]
"""

from __future__ import annotations

import time
from collections import defaultdict

try:
    from . import common, harness, raw
except ImportError:  # run as a script
    import common  # type: ignore[no-redef]
    import harness  # type: ignore[no-redef]
    import raw  # type: ignore[no-redef]

from aios_blocks.bus import catalog
from aios_blocks.recovery import inputs
from aios_blocks.recovery.rebuild import read_stream

GROUP = "stored messages by event, 10x100x8"


async def scenario(burst_n: int) -> list[common.Row]:
    rows: list[common.Row] = []
    with common.env_set("AIOS_SIM_START_DELAY_S", "0"):  # the workers the stack spawns inherit it
        async with harness.stack(10, 100, tag="stored") as st:
            info = await st.client.bus.js.stream_info("AIOS")
            first = int(info.state.last_seq)
            await st.burst(burst_n, timeout=300)
            info = await st.client.bus.js.stream_info("AIOS")
            total_bytes = int(info.state.bytes)
            count: dict[str, int] = defaultdict(int)
            size: dict[str, int] = defaultdict(int)
            seen = 0

            def on_msg(subject: str, body: bytes, seq: int, ts: float) -> None:
                nonlocal seen
                if seq <= first:
                    return
                seen += 1
                hit = catalog.parse(subject)
                name = hit[0].name if hit else subject
                count[name] += 1
                size[name] += len(subject) + len(body)

            await read_stream(st.client.bus, on_msg)
            n = max(1, burst_n)
            # every decision's input rebuilt by replay and checked by digest (recovery.inputs)
            messages = await st.client.stream()
            t0 = time.perf_counter()
            steps = await inputs.rebuild(messages)
            secs = time.perf_counter() - t0
            checks: dict[str, int] = defaultdict(int)
            for c in inputs.calls(steps):
                checks[c.status] += 1
            total = sum(checks.values())
            for name in sorted(count, key=lambda k: -size[k]):
                rows.append(common.row(GROUP, name, count[name] / n, "msgs", None, f"{size[name] / n / 1024:.2f} KB per block"))
            rows.append(common.row(GROUP, "all", seen / n, "msgs", None,
                                   f"{sum(size.values()) / n / 1024:.2f} KB per block (stream total {total_bytes / 1024:.0f} KB)"))
            rows.append(common.row(GROUP, "policy inputs rebuilt by replay, digest equal", checks["rebuilt"], "calls", None,
                                   f"of {total} recorded ({dict(checks)}); {secs:.1f} s to fold {len(messages)} messages "
                                   "and rebuild them all"))
    return rows


def figures(quick: bool = False) -> list[common.Row]:
    raw.ensure_raw()
    return common.run(scenario(50 if quick else 300))


def main() -> None:
    common.standalone(figures)


if __name__ == "__main__":
    main()
