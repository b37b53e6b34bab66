"""AIOS_MAX_SPEC_BYTES reaches the parser through its Settings (schemas/ir.py reads no setting at
import, issue 35): a spec over the setting is rejected naming the limit, the same spec under the
default is not refused for its size."""

from __future__ import annotations

from aios_blocks.schemas.catalog import E
from aios_blocks.settings import Settings
from aios_blocks.testing import MemorySystem

#: ~3 KiB of labels: over a 2 KiB limit, far under the default 256 KiB
SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1,
        "labels": {f"k{i}": "v" * 40 for i in range(60)}}


async def _errors(settings: Settings) -> list[str]:
    async with MemorySystem.open(settings) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=1, gpus=1)
        bid = await s.submit(dict(SPEC))
        await s.run()
        return [e["message"] for r in s.bus.events(E.block_rejected, bid=bid) for e in r["errors"]]


async def test_the_parser_takes_the_spec_size_limit_from_its_settings() -> None:
    base = {"sim_start_delay_s": 0.0, "dry_run_deadline_s": 5.0}
    small = await _errors(Settings(max_spec_bytes=2048, **base))
    assert any("the limit is 2048 (AIOS_MAX_SPEC_BYTES)" in m for m in small), small
    assert not any("AIOS_MAX_SPEC_BYTES" in m for m in await _errors(Settings(**base)))
