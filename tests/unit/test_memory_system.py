"""The workers' wiring, in memory (no servers): the real routers, handlers and Lua scripts on an
in-memory bus and fakeredis. Milliseconds per block; the integration tests keep the real servers."""

from __future__ import annotations

from aios_blocks.bus.catalog import E
from aios_blocks.schemas.events import InventoryHint
from aios_blocks.schemas.spec import Node
from aios_blocks.settings import Settings
from aios_blocks.testing import MemorySystem

SPEC = {"blockComponentURI": "aios://test/model", "minInstances": 2, "maxInstances": 3}


def answers(s: MemorySystem, bid: str) -> list[dict[str, object]]:
    """A block's dry_run answers: not stored apart, but in each round's post_dry_run."""
    return [a for post in s.bus.events(E.block_post_dry_run, bid=bid) for a in post["answers"]]


async def test_a_block_goes_from_create_to_ready_through_every_worker() -> None:
    async with MemorySystem.open() as s:
        await s.add_component()
        for c in ("c1", "c2"):
            await s.add_sim_cluster(c, nodes=2, gpus=2)
        bid = await s.submit(dict(SPEC))
        await s.run()
        block = await s.store.get_block(bid)
        assert block is not None and block["status"] == "ready", block
        insts = await s.store.instances(bid)
        assert len(insts) == 2 and {i["status"] for i in insts.values()} == {"running"}
        (ready,) = s.bus.events(E.block_ready, bid=bid)
        assert sorted(ready["instances"]) == sorted(insts)
        # the story on the stream, in order, each step once
        kinds = [m.event.name for m in s.bus.stream if m.event is not None and m.subject.startswith(f"aios.block.{bid}.")]
        for step in ("block.create", "block.parsed", "block.selection", "block.post_dry_run", "block.placement", "block.ready"):
            assert kinds.count(step) == 1, (step, kinds)
        assert kinds.index("block.placement") < kinds.index("block.ready")
        assert s.dead == []


async def test_delete_stops_and_releases_everything() -> None:
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        bid = await s.submit(dict(SPEC))
        await s.run()
        cluster = (await s.store.get_block(bid))["cluster"]
        assert len(await s.store.reservations(cluster)) == 2
        await s.delete(bid)
        await s.run()
        assert (await s.store.get_block(bid))["status"] == "deleted"
        assert await s.store.instances(bid) == {} and await s.store.reservations(cluster) == []
        assert len(s.bus.events(E.block_deleted, bid=bid)) == 1


async def test_a_gang_that_fits_nowhere_fails_with_the_reason_and_holds_nothing() -> None:
    async with MemorySystem.open(Settings(sim_start_delay_s=0, dry_run_deadline_s=0.05, dry_run_patience_s=0.05)) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=1, gpus=1)
        # queue: false: it fails rather than waiting pending for capacity (issue 36)
        bid = await s.submit({**SPEC, "minInstances": 3, "maxInstances": 3, "queue": False})
        await s.run(wait_deferred=1.0)  # the gather waits for its deadline when no cluster can hold it
        block = await s.store.get_block(bid)
        assert block["status"] == "failed" and block["reason"], block
        assert await s.store.reservations("c1") == []
        # the dry_run says why, per node: explain shows capacity reasons, not only affinity ones
        # (round 0 asked none: its only candidate; the allocation failed, round 1 asked it)
        results = [r for r in answers(s, bid) if not r["skipped"]]
        assert results and all(r["shortfall"] == 2 for r in results)
        assert results[0]["rejected_nodes"] == {}  # its one node can take one instance: no node is rejected
        await s.add_sim_cluster("c2", nodes=2, gpus=1)
        await s.store.put_node(Node(id="c2-n1", cluster="c2", cpu=64, memory=512))  # too little memory, no GPU
        await s.bus.emit(E.inventory_hint, InventoryHint("c2"))
        bid2 = await s.submit({**SPEC, "minInstances": 3, "maxInstances": 3, "queue": False})
        await s.run(wait_deferred=1.0)
        reasons = {r["cluster_id"]: r["rejected_nodes"] for r in answers(s, bid2)}
        assert reasons.get("c2") == {"c2-n1": "capacity: memory 512 MiB free < 1024"}, reasons


async def test_a_redelivered_message_has_the_effect_of_one() -> None:
    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        bid = await s.submit(dict(SPEC))
        await s.run()
        before = len(s.bus.stream)
        # every stored message of the block delivered again to every consumer (a crash before the acks)
        s.bus.pending.extend(m.seq for m in s.bus.stream)
        await s.run()
        assert (await s.store.get_block(bid))["status"] == "ready"
        assert len(await s.store.reservations("c1")) == 2
        assert len(s.bus.stream) == before  # everything it published again was a duplicate


async def test_a_decision_record_keeps_the_input_as_it_was_at_the_call() -> None:
    """The record rides on the step's event, published after the planner has changed the snapshot
    the input came from: its digest and the parts of the input it keeps (``given``: the
    block_metrics, which are not state) are those of the input the policy got. The input itself
    is not in the record (rebuilt by replay)."""
    import msgspec

    from aios_blocks.schemas.events import input_digest

    async with MemorySystem.open() as s:
        payload = {"nodes": {"n1": {"gpus_free": 1}}, "block_metrics": {"rps": 5}}
        data = {"action": "allocation", "payload": payload}
        at_call = input_digest(msgspec.json.encode(data))
        rule = {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack"}
        d = await s.worker.record("b", "resourceAllocator", rule, data, {"node_id": "n1"}, "", 0.001)
        payload["nodes"]["n1"]["gpus_free"] = 0  # the planner takes the GPU
        payload["block_metrics"]["rps"] = 9
        recorded = msgspec.json.decode(msgspec.json.encode(d))
        assert recorded["input_digest"] == at_call and recorded["given"] == {"block_metrics": {"rps": 5}}
        assert "input" not in recorded and recorded["output"] == {"node_id": "n1"}


async def test_a_lost_dry_run_query_is_asked_again_at_the_deadline() -> None:
    """The dry_run query is not stored (core NATS): one taken by a controller that then stopped is
    gone. The gather's timer asks the clusters that have not answered again, and the block is
    placed; the stream holds no query, only the answers."""
    async with MemorySystem.open(Settings(sim_start_delay_s=0, dry_run_deadline_s=0.05, dry_run_patience_s=5.0)) as s:
        await s.add_component()
        for c in ("c1", "c2"):
            await s.add_sim_cluster(c, nodes=2, gpus=2)
        dropped: list[str] = []
        i = next(i for i, (spec, _) in enumerate(s.bindings) if E.cluster_dry_run.filter() in spec.core_filters)
        spec, handler = s.bindings[i]

        async def dies_holding_its_first_queries(d):  # type: ignore[no-untyped-def]
            if E.cluster_dry_run.match(d.subject) and len(dropped) < 2:
                dropped.append(d.subject)
                return None  # taken, never answered: the controller stopped with it
            return await handler(d)

        s.bindings[i] = (spec, dies_holding_its_first_queries)
        bid = await s.submit(dict(SPEC))
        await s.run(wait_deferred=1.0)
        assert sorted(dropped) == ["aios.cluster.c1.dry_run", "aios.cluster.c2.dry_run"]
        block = await s.store.get_block(bid)
        assert block is not None and block["status"] == "ready", block
        asked = [subj for subj, _ in s.query_log if E.cluster_dry_run.match(subj)]
        assert sorted(asked) == sorted(dropped * 2)  # each cluster asked twice: once at selection, once at the deadline
        assert not [m for m in s.bus.stream if E.cluster_dry_run.match(m.subject)]
        (post,) = s.bus.events(E.block_post_dry_run, bid=bid)  # the first usable late answer decided
        assert post["cluster_id"] in ("c1", "c2") and post["scores"][post["cluster_id"]] > 0
        # the round stores the answers it decided on: the chosen cluster's at least
        got = {r["cluster_id"] for r in answers(s, bid)}
        assert post["cluster_id"] in got and got <= {"c1", "c2"}


async def test_a_dry_run_decision_names_the_state_its_round_started_from() -> None:
    """A query has no stream sequence of its own: the dry_run's decision record carries the
    sequence of the ``parsed`` event the gateway handled (``blocks explain`` rebuilds from there).
    The one cluster is asked too (``dry_run_single``; else its round skips the dry run)."""
    async with MemorySystem.open(Settings(dry_run_single=True)) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        bid = await s.submit(dict(SPEC))
        await s.run()
        (parsed,) = [m for m in s.bus.stream if m.subject == E.block_parsed.subject(bid=bid)]
        (result,) = answers(s, bid)
        # answers are not stored apart: the round's post_dry_run carries them
        assert not [m for m in s.bus.stream if E.block_dry_run_result.match(m.subject)]
        assert result["decisions"] and {d["at"] for d in result["decisions"]} == {parsed.seq}


async def test_a_block_scaled_to_its_target_fills_a_small_cluster_exactly() -> None:
    """Scale 1 -> 8 (``block.scale.target``) on a cluster of exactly 8 GPUs: the controller's
    scale steps fill it, every GPU held once, a reservation for each instance."""
    from aios_blocks.schemas.events import ScaleTarget

    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=4)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 8})
        await s.run()
        gen = int((await s.store.get_block(bid))["gen"])
        await s.bus.emit(E.block_scale_target, ScaleTarget(bid, "up", 8, gen=gen))
        await s.run(wait_deferred=2.0)
        insts = await s.store.instances(bid)
        assert len(insts) == 8 and {i["status"] for i in insts.values()} == {"running"}, insts
        gpus = [g for i in insts.values() for g in i["gpus"]]
        assert len(gpus) == len(set(gpus)) == 8  # every GPU once
        assert len(await s.store.reservations("c1")) == 8
        assert s.dead == []


async def test_concurrent_scale_steps_never_take_a_block_past_its_max_instances() -> None:
    """Scale steps handled at once (one fetched batch, or several controller copies) each see
    room when they start; the bound is checked again where it is atomic (the instance records,
    ``scripts.ADD_INSTANCES``): the block ends at ``maxInstances``, each step past it fails with
    the reason, and its reservation is released (no GPU held for an instance that is not there)."""
    from aios_blocks.schemas.events import ScaleRequest

    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=4)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 1, "maxInstances": 3})
        await s.run()
        gen = int((await s.store.get_block(bid))["gen"])
        before = len(s.bus.stream)
        for n in range(6):
            await s.bus.emit(E.cluster_scale, ScaleRequest(bid, "c1", f"r{n}", gen=gen))
        await s.deliver_together(s.bus.stream[before:])  # all at once, as one fetched batch
        await s.run()
        insts = await s.store.instances(bid)
        assert len(insts) == 3 and {i["status"] for i in insts.values()} == {"running"}, insts
        failed = s.bus.events(E.block_scale_failed, bid=bid)
        assert len(failed) == 4 and {f["reason"] for f in failed} == {"already at maxInstances (3)"}, failed
        assert len(await s.store.reservations("c1")) == 3  # the refused steps' reservations released
        assert len(s.bus.events(E.node_instance_create)) == 3  # nothing started for them
        assert s.dead == []


async def test_the_nodes_changed_in_one_turn_of_the_loop_go_out_as_one_inventory_hint_per_cluster() -> None:
    """``Worker.hint``: the nodes that handlers running together changed (a fetched batch's
    reservations, whose replies come back in one Redis pipeline) go out as one hint per cluster
    naming all of them, after the turn; a hint for a whole cluster goes at once."""
    import asyncio

    import msgspec

    async with MemorySystem.open() as s:
        w, hinted = s.worker, len(s.bus.core)
        await asyncio.gather(w.hint("c1", ["c1-n2"], applied=True), w.hint("c1", ["c1-n0", "c1-n2"], applied=True),
                             w.hint("c2", ["c2-n1"], applied=True))
        await asyncio.sleep(0)
        hints = [msgspec.json.decode(b) for _, b in s.bus.core[hinted:]]
        assert hints == [{"cluster": "c1", "nodes": ["c1-n0", "c1-n2"], "origin": w.origin},
                         {"cluster": "c2", "nodes": ["c2-n1"], "origin": w.origin}]
        hinted = len(s.bus.core)
        await w.hint("c1", None)  # the whole cluster: now
        assert [msgspec.json.decode(b) for _, b in s.bus.core[hinted:]] == [{"cluster": "c1", "origin": w.origin}]


async def test_two_reassignments_of_one_instance_handled_at_once_place_one_replacement() -> None:
    """A health verdict and an operator's request for the same instance, in one batch: the first
    claims the instance (``Store.claim_replacement``), places a replacement and sends the old one
    away; the second waits for the claim, then finds the instance on its way out (or gone) and
    fails with the reason, placing nothing (it used to place a second replacement)."""
    from aios_blocks.schemas.events import ReassignRequest

    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=4)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 2, "maxInstances": 2})
        await s.run()
        old = sorted(await s.store.instances(bid))[0]
        before = len(s.bus.stream)
        for n in range(2):
            await s.bus.emit(E.cluster_reassignment, ReassignRequest(bid, "c1", f"re{n}", old, "test"))
        await s.deliver_together(s.bus.stream[before:])  # both at once, as one fetched batch
        await s.run(wait_deferred=1.0)
        insts = await s.store.instances(bid)
        assert old not in insts and len(insts) == 2 and {i["status"] for i in insts.values()} == {"running"}, insts
        (failed,) = s.bus.events(E.block_reassignment_failed, bid=bid)
        # by its next try the old instance is on its way out, or already gone
        # (explain shows it: a stranger read a bare "no such instance" as a fault of the block)
        assert failed["reason"] in ("the instance is already being removed",
                                    f"no such instance: {old} was already replaced or removed (nothing left to move)"), failed
        assert len(await s.store.reservations("c1")) == 2
        assert await s.store.r.keys("aios:meta:*replace*") == []  # both claims given back
        assert s.dead == []


async def test_a_reassignment_whose_instance_another_controller_copy_is_replacing_places_nothing() -> None:
    """The claim is in Redis, so it holds across controller copies: while another copy's request
    holds it, a reassignment of the same instance waits (redelivered with backoff) and, if it
    never comes free, fails naming the holder; nothing is placed and the claim stays its
    holder's. Once given back, a reassignment goes ahead."""
    from aios_blocks.schemas.events import ReassignRequest

    async with MemorySystem.open(Settings(sim_start_delay_s=0.0, reassign_attempts=2)) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=4)
        bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": 2, "maxInstances": 2})
        await s.run()
        old = sorted(await s.store.instances(bid))[0]
        assert await s.store.claim_replacement(bid, old, "other-copy", 60) == "other-copy"
        creates = len(s.bus.events(E.node_instance_create))
        await s.bus.emit(E.cluster_reassignment, ReassignRequest(bid, "c1", "mine", old, "test"))
        await s.run(wait_deferred=1.0)  # delivery 1 defers 0.5 s; delivery 2 (the last) fails
        (failed,) = s.bus.events(E.block_reassignment_failed, bid=bid)
        assert failed["reason"] == "the instance is already being replaced (request other-copy)", failed
        assert len(s.bus.events(E.node_instance_create)) == creates  # nothing placed
        assert set(await s.store.instances(bid)) >= {old} and len(await s.store.instances(bid)) == 2
        assert await s.store.claim_replacement(bid, old, "someone", 60) == "other-copy"  # still the holder's

        await s.store.release_replacement(bid, old, "someone")  # not the holder: no effect
        assert await s.store.claim_replacement(bid, old, "x", 60) == "other-copy"
        await s.store.release_replacement(bid, old, "other-copy")
        await s.bus.emit(E.cluster_reassignment, ReassignRequest(bid, "c1", "after", old, "test"))
        await s.run(wait_deferred=1.0)
        insts = await s.store.instances(bid)
        assert old not in insts and len(insts) == 2, insts
        assert len(s.bus.events(E.node_instance_create)) == creates + 1
        assert s.dead == []


class _Stopped(Exception):
    """The gateway process died here (in the test: the wrapper below swallows it, losing the answer)."""


async def test_a_gateway_that_stops_after_deciding_is_finished_by_the_rounds_timer() -> None:
    """Answers are not stored, so no redelivery finishes a decider that stopped half-way: the
    round's timer stays until the decision's events are stored, and then decides again (the
    recorded outcome, published once)."""
    import time

    # the one cluster is asked its dry_run (``dry_run_single``): the decision is the answer's
    # handler's, not the parsed handler's (a skipped round's, tests/integration/test_skip_commit.py)
    async with MemorySystem.open(Settings(sim_start_delay_s=0, dry_run_deadline_s=0.05, dry_run_single=True)) as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        i = next(i for i, (spec, _) in enumerate(s.bindings) if E.block_dry_run_result.filter() in spec.core_filters)
        spec, handler = s.bindings[i]
        emit = s.bus.emit
        stopped: list[object] = []

        async def emit_or_stop(event, payload, **kw):  # type: ignore[no-untyped-def]
            if event is E.cluster_allocation and not stopped:
                stopped.append(payload)  # post_dry_run stored, block allocating, the allocation not sent
                raise _Stopped
            return await emit(event, payload, **kw)

        async def stops_mid_decision(d):  # type: ignore[no-untyped-def]
            try:
                return await handler(d)
            except _Stopped:
                return None  # the process died: the answer it held is gone, nothing retries it

        s.bus.emit = emit_or_stop  # type: ignore[method-assign]
        s.bindings[i] = (spec, stops_mid_decision)
        bid = await s.submit(dict(SPEC))
        await s.run(wait_deferred=1.0)
        assert stopped
        block = await s.store.get_block(bid)
        assert block is not None and block["status"] == "ready", block
        assert len(s.bus.events(E.block_post_dry_run, bid=bid)) == 1
        assert len(s.bus.events(E.cluster_allocation)) == 1
        assert await s.store.gather_claim_due(time.time() + 3600) == ([], None)  # the timer went with it


async def test_a_decided_round_leaves_no_gather_and_a_late_answer_decides_nothing() -> None:
    """Once a round's decision is stored its gather goes (the answers are in its post_dry_run);
    an answer that comes later finds no open round: no second decision, no failure."""
    from aios_blocks.schemas.events import DryRunResult
    from aios_blocks.state.keys import gather_key

    async with MemorySystem.open() as s:
        await s.add_component()
        await s.add_sim_cluster("c1", nodes=2, gpus=2)
        bid = await s.submit(dict(SPEC))
        await s.run()
        block = await s.store.get_block(bid)
        assert block is not None and block["status"] == "ready", block
        assert not await s.store.r.exists(gather_key(bid, block["gen"], 0))
        (post,) = s.bus.events(E.block_post_dry_run, bid=bid)
        assert [a["cluster_id"] for a in post["answers"]] == ["c1"]
        # a usable answer, late: without an open round nobody tries to decide (no ``decided`` claim)
        await s.bus.emit(E.block_dry_run_result, DryRunResult(bid, block["gen"], "c1", 1.0, attempt=0))
        await s.run()
        assert await s.store.r.hget(gather_key(bid, block["gen"], 0), "decided") is None
        assert len(s.bus.events(E.block_post_dry_run, bid=bid)) == 1
        after = await s.store.get_block(bid)
        assert after is not None and after["status"] == "ready", after
