"""A round whose only candidate is the cluster the built-in clusterAllocator will choose asks no
dry_run (``workers.gateway.skip_reason``; docs/trace.md "Live vs Ray"): the gateway records a
skipped answer in the round's gather and decides it in the same handler, its selection,
post_dry_run and allocation stored in one commit, so the create crosses two steps fewer. What must not change: every step's event (selection, post_dry_run with the answer and
why, allocation), the state the stream folds to, the crash path (the round's timer), and a block
that does not fit still gets a dry run (round 1) saying why."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from aios_blocks.bus.catalog import E
from aios_blocks.projections.explain import explain
from aios_blocks.recovery import image as im
from aios_blocks.recovery.fold import fold
from aios_blocks.recovery.rebuild import read_image
from aios_blocks.settings import Settings
from aios_blocks.testing import MemorySystem
from aios_blocks.workers.gateway import skip_reason

SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 2, "maxInstances": 3}
FAST = {"sim_start_delay_s": 0, "dry_run_deadline_s": 0.05, "dry_run_patience_s": 0.05}


def asked(s: MemorySystem) -> list[str]:
    """The clusters a dry_run query went to (core NATS: not stored, in the system's query log)."""
    return [subj.split(".")[2] for subj, _ in s.query_log if E.cluster_dry_run.match(subj)]


def story(s: MemorySystem, bid: str) -> list[tuple[str, dict[str, Any]]]:
    return [(m.subject, msgspec.json.decode(m.data)) for m in s.bus.stream if m.subject.startswith(f"aios.block.{bid}.")]


async def folds_to_the_state(s: MemorySystem, bid: str) -> None:
    """The block's record and instances fold from the stream to what Redis holds (``blocks
    check``'s comparison; the in-memory inventory is written to Redis, not the stream, so its
    nodes and reservations are left out here)."""
    f = fold((m.subject, m.data, m.seq, time.time()) for m in s.bus.stream)
    ours = (f"aios:block:{bid}", f"aios:block:{bid}:inst")
    img = {k: v for k, v in (await read_image(s.store.r)).items() if k in ours}
    rebuilt = {k: v for k, v in f.image(include_gathers=False).items() if k in ours}
    assert img and im.digest(img) == im.digest(rebuilt), im.diff(img, rebuilt)


async def test_the_only_candidate_is_allocated_without_a_dry_run_and_explain_says_so() -> None:
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        bid = await s.submit(dict(SPEC))
        await s.run()
        block = await s.store.get_block(bid)
        assert block is not None and block["status"] == "ready", block
        assert asked(s) == []  # no query went out
        (post,) = s.bus.events(E.block_post_dry_run, bid=bid)
        assert post["cluster_id"] == "c1"
        (answer,) = post["answers"]
        assert answer["skipped"] == "dry run skipped: c1 is the only candidate" and answer["decisions"] == []
        # the clusterAllocator's post_dry_run call is still made and recorded
        assert [d["action"] for d in post["decisions"]] == ["post_dry_run"]
        assert len(s.bus.events(E.cluster_allocation)) == 1
        x = explain(story(s, bid))
        (r,) = x["rounds"]
        assert r["chosen"] == "c1" and "dry run skipped: c1 is the only candidate" in r["why"]
        assert r["dry_run"]["c1"]["skipped"]
        await folds_to_the_state(s, bid)
        assert s.dead == []


async def test_two_candidates_or_the_setting_ask_every_cluster() -> None:
    async with MemorySystem.open() as s:
        await s.add_component()
        for c in ("c1", "c2"):
            await s.add_sim_cluster(c, nodes=2, gpus=2)
        bid = await s.submit(dict(SPEC))
        await s.run()
        assert sorted(asked(s)) == ["c1", "c2"]
        (post,) = s.bus.events(E.block_post_dry_run, bid=bid)
        assert all(not a["skipped"] for a in post["answers"]) and len(post["answers"]) == 2
    async with MemorySystem.open(Settings(dry_run_single=True)) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        bid = await s.submit(dict(SPEC))
        await s.run()
        assert asked(s) == ["c1"]
        (post,) = s.bus.events(E.block_post_dry_run, bid=bid)
        assert [a["skipped"] for a in post["answers"]] == [""]


def test_only_a_first_round_with_one_candidate_no_affinity_and_the_builtin_allocator_skips() -> None:
    ir: dict[str, Any] = {"blockId": "b"}
    rank = "builtin:cluster-rank"
    assert skip_reason(ir, ["c1"], 0, rank, False) == "dry run skipped: c1 is the only candidate"
    assert skip_reason(ir, ["c1", "c2"], 0, rank, False) == ""
    assert skip_reason(ir, ["c1"], 1, rank, False) == ""  # a round after a failed allocation
    assert skip_reason(ir, ["c1"], 0, "mine:Allocator", False) == ""  # a policy that may weigh the answer
    assert skip_reason({**ir, "affinity": [{"type": "Required"}]}, ["c1"], 0, rank, False) == ""
    assert skip_reason(ir, ["c1"], 0, rank, True) == ""  # AIOS_DRY_RUN_SINGLE


async def test_a_gang_that_does_not_fit_gets_its_dry_run_in_the_next_round_and_fails_with_its_count() -> None:
    async with MemorySystem.open(Settings(**FAST)) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=1, gpus=1)
        bid = await s.submit({**SPEC, "minInstances": 3, "maxInstances": 3, "queue": False})
        await s.run(wait_deferred=1.0)
        block = await s.store.get_block(bid)
        assert block is not None and block["status"] == "failed", block
        assert "no cluster can hold minInstances (3) at once: c1 fits 1" in block["reason"]
        assert await s.store.reservations("c1") == []
        assert len(s.bus.events(E.block_allocation_failed, bid=bid)) == 1  # round 0, no dry run
        assert asked(s) == ["c1"]  # round 1 asked
        posts = s.bus.events(E.block_post_dry_run, bid=bid)
        assert [p["attempt"] for p in posts] == [0, 1]
        assert posts[1]["answers"][0]["shortfall"] == 2 and not posts[1]["answers"][0]["skipped"]
        await folds_to_the_state(s, bid)


class _Stopped(Exception):
    pass


async def test_a_gateway_that_stops_after_deciding_a_skipped_round_is_finished_by_the_parsed_delivered_again() -> None:
    """The round is decided in the ``parsed`` handler (``gateway._decide_now``: the block's
    CHOOSE in Redis before its events are stored): a gateway that stops before the allocation is
    stored leaves the round chosen in Redis and nothing stored; the ``parsed`` delivered again
    finds it chosen and publishes the recorded round (once), the selection first."""
    async with MemorySystem.open(Settings(sim_start_delay_s=0, dry_run_deadline_s=0.05)) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        emit, emit_all = s.bus.emit, s.bus.emit_all
        stopped: list[object] = []

        async def emit_or_stop(event, payload, **kw):  # type: ignore[no-untyped-def]
            if event is E.cluster_allocation and not stopped:
                stopped.append(payload)
                raise _Stopped
            return await emit(event, payload, **kw)

        async def emit_all_or_stop(effects):  # type: ignore[no-untyped-def]
            effects = list(effects)
            if any(e.event is E.cluster_allocation for e in effects) and not stopped:
                stopped.append(effects)
                raise _Stopped
            return await emit_all(effects)

        s.bus.emit = emit_or_stop  # type: ignore[method-assign]
        s.bus.emit_all = emit_all_or_stop  # type: ignore[method-assign]
        bid = await s.submit(dict(SPEC))
        await s.run(wait_deferred=1.0)
        assert stopped
        block = await s.store.get_block(bid)
        assert block is not None and block["status"] == "ready", block
        assert len(s.bus.events(E.block_post_dry_run, bid=bid)) == 1
        assert len(s.bus.events(E.cluster_allocation)) == 1
        steps = [subj.rsplit(".", 1)[1] for subj, _ in story(s, bid)]
        assert steps.index("selection") < steps.index("post_dry_run") and steps.count("selection") == 1, steps
        assert asked(s) == []
        assert await s.store.gather_claim_due(time.time() + 3600) == ([], None)
        await folds_to_the_state(s, bid)
