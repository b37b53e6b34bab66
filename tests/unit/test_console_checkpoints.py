"""The console's checkpoints that share what did not change (console/checkpoints.py): a past
moment started from one is the fold of the stream from its start, field for field and in the
same order, however often the checkpoints were taken, and folding from one never changes it."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
from typing import Any

import msgspec
import pytest

from aios_blocks.console import projection as pj
from aios_blocks.console.checkpoints import Checkpoints, restore, thaw
from aios_blocks.console.feed import Feed
from aios_blocks.recovery.fold import Fold


def ev(data: Any) -> bytes:
    return msgspec.json.encode({"id": "x", "source": "t", "type": "t", "subject": "s", "time": "t", "data": data})


def node(nid: str, cluster: str = "c1", rack: str = "r1") -> dict[str, Any]:
    return {"id": nid, "cluster": cluster, "labels": {"rack": rack}, "cpu": 8, "memory": 1000,
            "gpus": [{"id": f"{nid}-g{g}", "model": "A100", "memory": 500} for g in range(2)]}


def ir(bid: str, tenant: str) -> dict[str, Any]:
    return {"blockId": bid, "blockComponentURI": "aios://t/m", "minInstances": 1, "maxInstances": 2,
            "resources": {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 10}, "labels": {"tenant": tenant},
            "policies": {"resourceAllocator": {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "settings": {}}}}


def story(seed: int, n: int = 400) -> list[tuple[str, bytes, int, float]]:
    """A seeded stream: nodes registered, removed and registered again, blocks created (ids
    reused after a delete), placed, their instances added and removed, deleted, failed."""
    rng = random.Random(seed)
    out: list[tuple[str, Any]] = []
    nodes = [f"n{i}" for i in range(4)]
    for nid in nodes:
        out.append((f"aios.node.{nid}.registered", {"node": node(nid), "agent": "", "runtime": "sim"}))
    gen = 1
    live: dict[str, tuple[int, list[tuple[str, str, str]]]] = {}  # bid -> (gen, [(iid, node, gpu)])
    while len(out) < n:
        r = rng.random()
        bid = f"b{rng.randrange(12)}"
        if r < 0.05:
            nid = rng.choice(nodes)
            if rng.random() < 0.5:
                out.append((f"aios.node.{nid}.removed", {"node_id": nid, "cluster_id": "c1"}))
            else:
                out.append((f"aios.node.{nid}.registered", {"node": node(nid, rack=rng.choice("xy")), "agent": "", "runtime": "sim"}))
        elif r < 0.1:
            out.append((f"aios.node.{rng.choice(nodes)}.health", {"node_id": "", "healthy": rng.random() < 0.6}))
        elif bid not in live:
            gen += 1
            live[bid] = (gen, [])
            out.append((f"aios.block.{bid}.submitted", {"block_id": bid, "gen": gen, "digest": f"d{gen}"}))
            out.append((f"aios.block.{bid}.parsed", {"block_id": bid, "gen": gen, "ir": ir(bid, rng.choice(["t1", "t2"]))}))
            out.append((f"aios.block.{bid}.selection", {"block_id": bid, "gen": gen, "candidates": ["c1"]}))
            out.append((f"aios.block.{bid}.post_dry_run", {"block_id": bid, "gen": gen, "cluster_id": "c1", "scores": {"c1": 1}}))
        else:
            g, insts = live[bid]
            if r < 0.45:
                nid = rng.choice(nodes)
                iid = f"{bid}-{g}-{len(insts)}"
                gpu = f"{nid}-g{rng.randrange(2)}"
                insts.append((iid, nid, gpu))
                out.append((f"aios.block.{bid}.placement", {"block_id": bid, "gen": g, "cluster_id": "c1",
                                                            "action": "allocation" if len(insts) == 1 else "scale",
                                                            "placements": [{"instance_id": iid, "node_id": nid, "gpus": [gpu]}]}))
                inst = {"block_id": bid, "gen": g, "instance_id": iid, "node_id": nid, "gpus": [gpu]}
                out.append((f"aios.block.{bid}.instance.{iid}.added", inst))
                out.append((f"aios.block.{bid}.ready", {"block_id": bid, "gen": g, "status": "ready"}))
            elif r < 0.6 and insts:
                iid, nid, gpu = insts.pop(rng.randrange(len(insts)))
                out.append((f"aios.block.{bid}.instance.{iid}.removed",
                            {"block_id": bid, "gen": g, "instance_id": iid, "node_id": nid, "gpus": [gpu]}))
            elif r < 0.7:
                out.append((f"aios.block.{bid}.scale.target", {"block_id": bid, "gen": g, "target": rng.randrange(1, 3),
                                                               "source": "cli", "reason": "", "request_id": f"s{len(out)}"}))
            elif r < 0.8:
                out.append((f"aios.block.{bid}.failed", {"block_id": bid, "gen": g, "status": "failed", "reason": "<x> broke"}))
            else:
                out.append((f"aios.block.{bid}.delete", {"block_id": bid, "request_id": f"r{len(out)}"}))
                for iid, nid, gpu in insts:
                    out.append((f"aios.block.{bid}.instance.{iid}.removed",
                                {"block_id": bid, "gen": g, "instance_id": iid, "node_id": nid, "gpus": [gpu]}))
                out.append((f"aios.block.{bid}.deleted", {"block_id": bid, "gen": g, "status": "deleted"}))
                del live[bid]
    return [(s, ev(d), i, float(i)) for i, (s, d) in enumerate(out, start=1)]


def full(msgs: list[tuple[str, bytes, int, float]], upto: int) -> Fold:
    f = Fold()
    for m in msgs[:upto]:
        f.apply(*m)
    return f


def same(a: Fold, b: Fold) -> None:
    """Every field equal, and every dict in the same order (the views iterate them)."""
    for fld in dataclasses.fields(Fold):
        x, y = getattr(a, fld.name), getattr(b, fld.name)
        assert x == y, fld.name
        if isinstance(x, dict):
            assert list(x) == list(y), fld.name


@pytest.mark.parametrize("seed,every", [(1, 1), (2, 3), (3, 7), (4, 25)])
def test_a_past_moment_from_a_checkpoint_is_the_fold_from_the_start(seed: int, every: int) -> None:
    msgs = story(seed)
    assert any(".removed" in s and "node" in s for s, *_ in msgs)  # (the story moves keys to the end)

    async def go() -> None:
        feed = Feed(None, lambda s, e: "", check_every=every, checkpoints=16, chunk=32)  # type: ignore[arg-type]
        for m in msgs:
            feed.apply(*m)
        feed.caught_up.set()
        assert 1 < len(feed.checks.items) <= 16
        seqs = list(range(1, len(msgs)))
        for rounds in range(2):  # (twice, in another order: folding from a checkpoint left it as it was)
            random.Random(seed + rounds).shuffle(seqs)
            for seq in seqs[:120]:
                feed._past.clear()
                then, ref = await feed.at(seq), full(msgs, seq)
                same(then, ref)
                assert pj.overview(then) == pj.overview(ref) and pj.gpumap(then) == pj.gpumap(ref), seq
                assert pj.blocks_page(then, tenant="t1") == pj.blocks_page(ref, tenant="t1"), seq

    asyncio.run(go())


def test_a_checkpoint_copies_only_what_changed_and_shares_the_rest() -> None:
    msgs = story(5)
    f = Fold()
    checks = Checkpoints(f)
    for m in msgs[:301]:
        checks.gate.open = True
        f.apply(*m)
        checks.gate.open = False
        if m[2] in (300, 301):
            checks.take()
    a, b = checks.items
    reached = {s.split(".")[2] for s, *_ in msgs[300:301]}
    olds = {bid: v for s in a.shards["blocks"] for bid, v in s.entries.items()}
    news = {bid: v for s in b.shards["blocks"] for bid, v in s.entries.items()}
    shared = [bid for bid in news if bid in olds and news[bid] is olds[bid]]
    assert len(shared) >= len(news) - 1 and set(news) - set(shared) <= reached
    same(restore(b), f)
    same(restore(a), full(msgs, 300))


def test_thaw_shares_no_container() -> None:
    v = {"a": [1, {"b": {2, 3}}], "c": ("x", [4]), "d": "s"}
    w = thaw(v)
    assert w == v and w is not v and w["a"] is not v["a"] and w["a"][1]["b"] is not v["a"][1]["b"]
    assert w["c"][1] is not v["c"][1] and w["d"] is v["d"]


def test_the_checkpoints_bytes_count_each_shard_once_and_thinning_frees_some() -> None:
    msgs = story(6)
    f = Fold()
    checks = Checkpoints(f)
    for m in msgs:
        checks.gate.open = True
        f.apply(*m)
        checks.gate.open = False
        if m[2] % 20 == 0:
            checks.take()

    def distinct() -> int:
        seen = {id(s): s.bytes + sys.getsizeof(s.entries) for cp in checks.items for ss in cp.shards.values() for s in ss}
        return sum(seen.values())

    assert checks.bytes() == distinct() > 0
    before = checks.bytes()
    checks.thin()
    assert checks.bytes() == distinct() < before
