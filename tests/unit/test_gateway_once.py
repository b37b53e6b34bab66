"""The gateway's turn does each piece of work once (docs/trace.md "Where a create's time goes"): a
round decided in its ``parsed`` handler (``workers.gateway._decide_now``) gives its
post_dry_run the cluster's entry the selection's filter made over the same snapshot, not one
made again by ``handlers.gateway.scoped_entry``; the post_dry_run's input is the same."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from aios_blocks.bus.catalog import E
from aios_blocks.handlers import gateway as h
from aios_blocks.settings import Settings
from aios_blocks.testing import MemorySystem

SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 1}


async def test_a_skipped_round_decides_on_the_selections_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict[str, Any]] = []
    scoped = h.scoped_entry

    def counted(*a: Any, **k: Any) -> dict[str, Any]:
        made.append(scoped(*a, **k))
        return made[-1]

    monkeypatch.setattr(h, "scoped_entry", counted)
    async with MemorySystem.open(Settings(sim_start_delay_s=0, dry_run_deadline_s=0.05)) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        bid = await s.submit(dict(SPEC))
        await s.run()
        block = await s.store.get_block(bid)
        assert block is not None and block["status"] == "ready", block
        (post,) = s.bus.events(E.block_post_dry_run, bid=bid)
        (sel,) = s.bus.events(E.block_selection, bid=bid)
        assert post["answers"][0]["skipped"] and s.query_log == []  # decided in the handler, no dry run
        # the post_dry_run decided on the entry the selection's filter made (one decision each)
        (chosen,) = [d for d in post["decisions"] if d["action"] == "post_dry_run"]
        (selected,) = [d for d in sel["decisions"] if d["action"] == "selection"]
        assert msgspec.json.decode(msgspec.json.encode(selected["output"]))["clusters"][0]["cluster_id"] == "c1"
        assert chosen["input_digest"] and selected["input_digest"]
    assert made == []  # no entry made a second time (was one per skipped round)
