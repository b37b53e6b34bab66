"""Make-before-break moves on the in-memory system (the real routers, handlers and Lua scripts on
an in-memory bus and fakeredis; docs/rebalance.md): the whole story of a move, a move that finds
no room, one request delivered twice, the disruption budget, the cluster's rate limit, a new
instance that fails before its switch, and the sweep that finishes a move its controller left."""

from __future__ import annotations

import time
from typing import Any

from aios_blocks.bus.catalog import E
from aios_blocks.handlers import moves as mv
from aios_blocks.schemas.moves import MoveRequested
from aios_blocks.settings import Settings
from aios_blocks.state.moves import MoveStore
from aios_blocks.testing import MemorySystem
from aios_blocks.workers.moves import MoveSweeper


async def _block(s: MemorySystem, n: int = 2, nodes: int = 3, gpus: int = 1, **spec: Any) -> str:
    await s.add_component()
    await s.add_sim_cluster("c1", nodes=nodes, gpus=gpus)
    bid = await s.submit({"blockComponentURI": "aios://test/model", "minInstances": n, "maxInstances": n, **spec})
    await s.run()
    assert (await s.store.get_block(bid) or {})["status"] == "ready"
    return bid


def _move(bid: str, iid: str, mid: str = "m1", to: str = "") -> MoveRequested:
    return MoveRequested(bid, mid, iid, to_node=to, reason="test", requested_by="test")


def _steps(s: MemorySystem, bid: str) -> list[tuple[str, str]]:
    out = []
    for e in (E.block_move_started, E.block_move_switched, E.block_move_completed, E.block_move_failed):
        out += [(e.name.rsplit(".", 1)[1], d["move_id"]) for d in s.bus.events(e, bid=bid)]
    return sorted(out)


async def test_a_move_starts_the_new_instance_switches_when_it_runs_then_removes_the_old_one() -> None:
    async with MemorySystem.open() as s:
        bid = await _block(s)
        insts = await s.store.instances(bid)
        old = f"{bid}-0"
        free = next(n for n in ("c1-n0", "c1-n1", "c1-n2") if n not in {r["node"] for r in insts.values()})
        await s.bus.emit(E.block_move_requested, _move(bid, old, to=free))
        await s.run()
        after = await s.store.instances(bid)
        new = mv.new_instance_id(bid, "m1")
        assert old not in after and after[new]["node"] == free and after[new]["status"] == "running"
        assert _steps(s, bid) == [("completed", "m1"), ("started", "m1"), ("switched", "m1")]
        # the old one was told to drain (the scale-down's path: drain_s) only after the new one ran
        (remove,) = [d for d in s.bus.events(E.node_instance_remove) if d["instance_id"] == old]
        assert remove["drain_s"] == s.worker.settings.scale_down_grace_s
        order = [m.subject for m in s.bus.stream]
        assert order.index(f"aios.block.{bid}.instance.{new}.added") < order.index(f"aios.node.{insts[old]['node']}.instance.remove")
        (started,) = s.bus.events(E.block_move_started, bid=bid)
        assert started["to_node"] == free and started["from_node"] == insts[old]["node"]
        rec = await MoveStore(s.store.r).get(bid, "m1")
        assert rec is not None and rec["phase"] == "completed"


async def test_a_move_to_a_full_node_fails_and_the_old_instance_keeps_serving() -> None:
    async with MemorySystem.open() as s:
        bid = await _block(s, n=2, nodes=2)  # each node's one GPU taken
        before = await s.store.instances(bid)
        other = before[f"{bid}-1"]["node"]
        await s.bus.emit(E.block_move_requested, _move(bid, f"{bid}-0", to=other))
        await s.run()
        assert await s.store.instances(bid) == before
        (failed,) = s.bus.events(E.block_move_failed, bid=bid)
        assert failed["reason"].startswith("no room for the new instance") and _steps(s, bid) == [("failed", "m1")]


async def test_a_request_delivered_twice_is_one_move() -> None:
    async with MemorySystem.open() as s:
        bid = await _block(s)
        await s.bus.emit(E.block_move_requested, _move(bid, f"{bid}-0"))
        (msg,) = [m for m in s.bus.stream if m.subject.endswith(".move.requested")]
        s.bus.pending.append(msg.seq)  # delivered again, as after a lost ack
        await s.run()
        assert _steps(s, bid) == [("completed", "m1"), ("started", "m1"), ("switched", "m1")]
        assert len(await s.store.instances(bid)) == 2 and mv.new_instance_id(bid, "m1") in await s.store.instances(bid)


async def test_two_moves_at_once_respect_the_disruption_budget() -> None:
    async with MemorySystem.open() as s:
        bid = await _block(s, n=2, nodes=4)
        await s.bus.emit(E.block_move_requested, _move(bid, f"{bid}-0", "m1"))
        await s.bus.emit(E.block_move_requested, _move(bid, f"{bid}-1", "m2"))
        msgs = [m for m in s.bus.stream if m.subject.endswith(".move.requested")]
        await s.deliver_together(msgs)
        await s.run(wait_deferred=5)  # (a delivery retried: the in-process plan lock may belong to an earlier test's loop)
        failed = s.bus.events(E.block_move_failed, bid=bid)
        assert len(s.bus.events(E.block_move_started, bid=bid)) == 1 and len(failed) == 1
        assert failed[0]["reason"] == "disruption budget: 1 of the block's moves open, maxMoving 1"
        assert [k for k, _ in _steps(s, bid)].count("completed") == 1


async def test_a_budget_of_two_lets_two_move_at_once() -> None:
    async with MemorySystem.open() as s:
        bid = await _block(s, n=2, nodes=4, maxMoving=2)
        for i in range(2):
            await s.bus.emit(E.block_move_requested, _move(bid, f"{bid}-{i}", f"m{i}"))
        await s.deliver_together([m for m in s.bus.stream if m.subject.endswith(".move.requested")])
        await s.run(wait_deferred=5)
        assert len(s.bus.events(E.block_move_started, bid=bid)) == 2 and not s.bus.events(E.block_move_failed, bid=bid)
        assert [k for k, _ in _steps(s, bid)].count("completed") == 2


async def test_the_cluster_rate_limit_fails_a_move_past_it() -> None:
    async with MemorySystem.open(Settings(sim_start_delay_s=0.0, move_rate_limit=1)) as s:
        bid = await _block(s, n=1, nodes=3)
        await s.bus.emit(E.block_move_requested, _move(bid, f"{bid}-0", "m1"))
        await s.run()
        new = mv.new_instance_id(bid, "m1")
        await s.bus.emit(E.block_move_requested, _move(bid, new, "m2"))
        await s.run()
        (failed,) = s.bus.events(E.block_move_failed, bid=bid)
        assert failed["move_id"] == "m2" and failed["reason"].startswith("rate limit: 1 move(s) per 60 s in cluster c1")


async def test_a_new_instance_that_fails_before_the_switch_fails_the_move_and_leaves_the_old_one() -> None:
    async with MemorySystem.open(Settings(sim_start_delay_s=0.0, sim_fail_rate=0.0)) as s:
        bid = await _block(s, n=1, nodes=2)
        before = await s.store.instances(bid)
        await s.bus.emit(E.block_move_requested, _move(bid, f"{bid}-0"))
        # deliver only the request: the new instance's start is then reported failed by hand
        while not s.bus.events(E.block_move_started, bid=bid):
            seq = s.bus.pending.popleft()
            msg = s.bus.stream[seq - 1]
            if msg.subject.endswith(".move.requested"):
                spec, handler = next((sp, h) for sp, h in s.bindings if sp.durable == "lifecycle")
                await s._deliver(spec.durable, handler, msg)
        new = mv.new_instance_id(bid, "m1")
        rec = (await s.store.instances(bid))[new]
        from aios_blocks.schemas.events import InstanceEvent

        s.bus.pending.clear()
        await s.bus.emit(E.instance_failed, InstanceEvent(bid, int((await s.store.get_block(bid) or {})["gen"]), new, rec["node"], [], "boom"))
        await s.run()
        (failed,) = s.bus.events(E.block_move_failed, bid=bid)
        assert "failed: boom" in failed["reason"]
        assert await s.store.instances(bid) == before  # the new one removed and released, the old one as it was
        assert not s.bus.events(E.cluster_reassignment)  # not replaced: the move owned it


async def test_the_sweep_fails_a_claim_its_controller_left_and_releases_the_reservation() -> None:
    async with MemorySystem.open() as s:
        bid = await _block(s, n=1, nodes=2)
        block = await s.store.get_block(bid)
        req = _move(bid, f"{bid}-0")
        rec = mv.record(req, block, (await s.store.instances(bid))[f"{bid}-0"], time.time() - 2 * mv.CLAIM_S)
        ms = MoveStore(s.store.r)
        assert (await ms.claim(rec, 1, time.time(), mv.KEEP_S))[0] == "ok"
        await ms.due(bid, "m1", rec["due"])
        assert await MoveSweeper(s.worker).tick() == 1
        await s.run()
        (failed,) = s.bus.events(E.block_move_failed, bid=bid)
        assert "claim lapsed" in failed["reason"]
        assert (await ms.get(bid, "m1") or {})["phase"] == "failed"


async def test_explain_and_the_event_lines_tell_a_move_step_by_step_with_its_reasons() -> None:
    import io

    import msgspec
    from rich.console import Console

    from aios_blocks.cli import render
    from aios_blocks.projections.explain import explain
    from aios_blocks.projections.lines import Lines

    async with MemorySystem.open() as s:
        bid = await _block(s, n=1, nodes=2)
        await s.bus.emit(E.block_move_requested, _move(bid, f"{bid}-0", "m1"))
        await s.bus.emit(E.block_move_requested, _move(bid, f"{bid}-0", "m2", to="nowhere"))
        await s.run()
        story = [(m.subject, msgspec.json.decode(m.data)) for m in s.bus.stream if m.subject.startswith(f"aios.block.{bid}.")]
        x = explain(story)
        m1, m2 = x["moves"]
        assert (m1["move_id"], m1["status"], m1["new"]) == ("m1", "completed", mv.new_instance_id(bid, "m1"))
        assert [st["step"] for st in m1["steps"]] == ["requested", "started", "switched", "completed"]
        assert all(st["reason"] == "test" for st in m1["steps"][:2])
        assert m2["status"] == "failed" and m2["steps"][-1]["reason"] == "node nowhere is not a node of cluster c1"
        assert {"step": "move m2", "reason": "node nowhere is not a node of cluster c1"} in x["failures"]
        out = io.StringIO()
        render.console, saved = Console(file=out, width=200), render.console
        try:
            render._render_explain(x)
        finally:
            render.console = saved
        assert f"move m1 completed: {bid}-0@" in out.getvalue() and "move m2 failed" in out.getvalue()
        lines = Lines()
        kind, detail = lines.line(*next(d for d in story if d[0].endswith(".move.switched")))
        assert kind == "move.switched" and detail.startswith(f"m1: {bid}-0@")


async def test_a_claimed_move_delivered_twice_at_once_places_one_new_instance() -> None:
    """A request whose first delivery claimed the move and stopped (its controller died), then
    delivered twice at once: one placement (the lease), its reservation where its record is."""
    async with MemorySystem.open() as s:
        bid = await _block(s, n=1, nodes=4)
        req = _move(bid, f"{bid}-0")
        rec = mv.record(req, await s.store.get_block(bid), (await s.store.instances(bid))[f"{bid}-0"], time.time())
        assert (await MoveStore(s.store.r).claim(rec, 1, time.time(), mv.KEEP_S))[0] == "ok"
        await s.bus.emit(E.block_move_requested, req)
        await s.bus.emit(E.block_move_requested, req, qualifier="again")  # a second message, same move
        await s.deliver_together([m for m in s.bus.stream if m.subject.endswith(".move.requested")])
        await s.run(wait_deferred=20)
        assert _steps(s, bid) == [("completed", "m1"), ("started", "m1"), ("switched", "m1")]
        new = mv.new_instance_id(bid, "m1")
        (res,) = await s.store.reservations_of("c1", [new])
        assert res is not None and res["node"] == (await s.store.instances(bid))[new]["node"]
        assert len(await s.store.reservations("c1")) == 1
        assert len({d["placements"][0]["node_id"] for d in s.bus.events(E.block_placement, bid=bid) if d["request_id"] == "move-m1"}) == 1


async def test_a_new_instance_running_before_its_move_said_started_is_switched_at_once(monkeypatch: Any) -> None:
    """A fast agent: the new instance's ``added`` handled before the move's record said started
    (``after_added`` found the move only claimed). The placing step switches it then, not the
    sweep ``AIOS_MOVE_READY_TIMEOUT_S`` later."""
    from aios_blocks.workers import moves as wm

    async with MemorySystem.open() as s:
        bid = await _block(s, n=1, nodes=2)
        real_start = wm.start

        async def start_then_run(w: Any, ir: Any, gen: int, cid: str, action: str, placements: Any, *a: Any, **kw: Any) -> Any:
            out = await real_start(w, ir, gen, cid, action, placements, *a, **kw)
            for p in placements:  # as the lifecycle's on_added would have recorded it
                await s.store.set_instance_status(bid, p["iid"], "running", "http://127.0.0.1:1")
            return out

        monkeypatch.setattr(wm, "start", start_then_run)
        await s.bus.emit(E.block_move_requested, _move(bid, f"{bid}-0"))
        (msg,) = [m for m in s.bus.stream if m.subject.endswith(".move.requested")]
        s.bus.pending.remove(msg.seq)
        spec, handler = next((sp, h) for sp, h in s.bindings if sp.durable == "lifecycle")
        await s._deliver(spec.durable, handler, msg)  # that request only: no added is delivered
        assert [k for k, _ in _steps(s, bid)] == ["started", "switched"]
        assert (await s.store.instances(bid))[f"{bid}-0"]["status"] == "removing"


async def test_a_moves_to_gpus_are_the_gpus_the_new_instance_is_reserved() -> None:
    """The rebalancer's GPUs go through the request to the reservation: on a 4-GPU node the
    allocator (binpack, the topology pass) would take g0; the move asks for g3 and gets it. GPUs
    that are not free there fail the move, the old instance serving on."""
    async with MemorySystem.open() as s:
        bid = await _block(s, n=1, nodes=2, gpus=4)
        old = f"{bid}-0"
        src = (await s.store.instances(bid))[old]["node"]
        dst = next(n for n in ("c1-n0", "c1-n1") if n != src)
        req = MoveRequested(bid, "m1", old, to_node=dst, reason="test", requested_by="test", to_gpus=[f"{dst}-g3"])
        await s.bus.emit(E.block_move_requested, req)
        await s.run()
        new = mv.new_instance_id(bid, "m1")
        after = await s.store.instances(bid)
        assert after[new]["node"] == dst and after[new]["gpus"] == [f"{dst}-g3"], after
        (started,) = s.bus.events(E.block_move_started, bid=bid)
        assert started["gpus"] == [f"{dst}-g3"]
        (create,) = [d for d in s.bus.events(E.node_instance_create) if d["instance_id"] == new]
        assert create["gpus"] == [f"{dst}-g3"]
        # back to the first node, on a GPU that does not exist there: refused at the reservation
        req2 = MoveRequested(bid, "m2", new, to_node=src, reason="test", requested_by="test", to_gpus=[f"{dst}-g3"])
        await s.bus.emit(E.block_move_requested, req2)
        await s.run()
        (failed,) = s.bus.events(E.block_move_failed, bid=bid)
        assert failed["move_id"] == "m2" and "the GPUs asked for" in failed["reason"], failed
        assert (await s.store.instances(bid))[new]["status"] == "running"
        # GPUs without a node: refused before any claim
        req3 = MoveRequested(bid, "m3", new, reason="test", requested_by="test", to_gpus=[f"{src}-g1"])
        await s.bus.emit(E.block_move_requested, req3)
        await s.run()
        assert any(d["move_id"] == "m3" and "without a to_node" in d["reason"] for d in s.bus.events(E.block_move_failed, bid=bid))
