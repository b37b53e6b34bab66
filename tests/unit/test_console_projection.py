"""The console's views as pure functions of the fold (console/projection.py), its subject filter
and its past moment folded from the messages it kept (console/feed.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from aios_blocks.console import projection as pj
from aios_blocks.console.feed import Feed, subject_matches
from aios_blocks.recovery.fold import Fold

IR = {
    "blockId": "b1", "blockComponentURI": "aios://t/m", "minInstances": 1, "maxInstances": 2,
    "resources": {"gpus": 1, "gpuMemory": 0, "cpu": 2, "memory": 100},
    "parameters": {"name": "<b>mine</b>"}, "labels": {"tenant": "t1"},
    "policies": {"resourceAllocator": {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "settings": {}}},
}
NODE = {"id": "n1", "cluster": "c1", "labels": {"rack": "r1", "zone": "z"}, "cpu": 8, "memory": 1000,
        "gpus": [{"id": "g1", "model": "A100", "memory": 500}, {"id": "g2", "model": "A100", "memory": 500}]}
NODE2 = {"id": "n2", "cluster": "c1", "labels": {"rack": "r2"}, "cpu": 1, "memory": 1000,
         "gpus": [{"id": "h1", "model": "A100", "memory": 500}]}
PLACED = {"block_id": "b1", "gen": 2, "cluster_id": "c1", "action": "allocation",
          "placements": [{"instance_id": "b1-0", "node_id": "n1", "gpus": ["g1"]}]}
INST = {"block_id": "b1", "gen": 2, "instance_id": "b1-0", "node_id": "n1", "gpus": ["g1"]}


def ev(data: Any) -> bytes:
    return msgspec.json.encode({"id": "x", "source": "t", "type": "t", "subject": "s", "time": "t", "data": data})


STORY: list[tuple[str, Any]] = [
    ("aios.node.n1.registered", {"node": NODE, "agent": "", "runtime": "sim"}),
    ("aios.node.n2.registered", {"node": NODE2, "agent": "", "runtime": "sim"}),
    ("aios.block.b1.parsed", {"block_id": "b1", "gen": 2, "ir": IR}),
    ("aios.block.b1.selection", {"block_id": "b1", "gen": 2, "candidates": ["c1"]}),
    ("aios.block.b1.post_dry_run", {"block_id": "b1", "gen": 2, "cluster_id": "c1", "scores": {"c1": 1}}),
    ("aios.block.b1.placement", PLACED),
    ("aios.block.b1.instance.b1-0.added", INST),
    ("aios.block.b1.ready", {"block_id": "b1", "gen": 2, "status": "ready"}),
    ("aios.block.b2.parsed", {"block_id": "b2", "gen": 9, "ir": {**IR, "blockId": "b2", "parameters": {}, "labels": {"tenant": "t2"}}}),
    ("aios.block.b3.rejected", {"block_id": "b3", "gen": 10, "errors": [{"path": "$.minInstances", "message": "too big"}]}),
    ("aios.block.b1.delete", {"block_id": "b1", "request_id": "r"}),
    ("aios.block.b1.instance.b1-0.removed", INST),
    ("aios.block.b1.deleted", {"block_id": "b1", "gen": 2, "status": "deleted"}),
]


def messages(upto: int | None = None) -> list[tuple[str, bytes, int, float]]:
    out = [(s, ev(d), n, float(n)) for n, (s, d) in enumerate(STORY, start=1)]
    return out if upto is None else out[:upto]


def folded(upto: int | None = None) -> Fold:
    f = Fold()
    for m in messages(upto):
        f.apply(*m)
    return f


def test_the_overview_counts_gpus_used_free_and_blocks_by_status_with_reasons() -> None:
    o = pj.overview(folded(8))  # b1 ready on g1
    assert o["totals"]["nodes"] == 2 and o["totals"]["gpus"] == 3
    assert o["totals"]["used"] == 1.0 and o["totals"]["free"] == 2.0
    assert o["blocks"] == {"ready": 1}
    o = pj.overview(folded(10))
    assert o["blocks"] == {"parsed": 1, "ready": 1, "rejected": 1}
    assert [b["id"] for b in o["pending"]] == ["b2"]
    assert o["failures"][0]["id"] == "b3" and o["failures"][0]["reason"] == "$.minInstances: too big"
    assert pj.PENDING[0] == "pending"  # a block waiting for capacity is in the queue (docs/priority.md)


def test_stranded_is_the_free_compute_the_workload_cannot_use() -> None:
    f = folded(10)
    # the live blocks want 2 CPUs and one GPU each: n2 has 1 CPU, so its free GPU is stranded;
    # n1 has 6 CPUs free and a free GPU: nothing stranded there
    assert pj.stranded_units(f.nodes["n2"], pj.node_cells(f.nodes["n2"]), pj.workload(f)) == 1000
    assert pj.stranded_units(f.nodes["n1"], pj.node_cells(f.nodes["n1"]), pj.workload(f)) == 0
    assert pj.overview(f)["totals"]["stranded"] == 1.0


def test_the_gpu_map_has_every_node_and_gpu_with_its_share_held_and_filters_by_label() -> None:
    m = pj.gpumap(folded(8))
    assert m["gpus"] == 3
    assert [n[0] for n in m["nodes"]] == ["n1", "n2"]  # cluster, model, rack, id
    assert m["nodes"][0][2:6] == ["A100", 1, "r1", [1000, 0]]
    only = pj.gpumap(folded(8), "zone=z")
    assert [n[0] for n in only["nodes"]] == ["n1"] and only["gpus"] == 2
    d = pj.gpu_detail(folded(8), "n1", "g1")
    assert d is not None and [(i["instance"], i["block"], i["name"]) for i in d["instances"]] == [("b1-0", "b1", "<b>mine</b>")]
    assert pj.gpu_detail(folded(8), "n1", "g2")["instances"] == []  # type: ignore[index]
    assert pj.gpu_detail(folded(8), "nope", None) is None


def test_the_blocks_table_searches_filters_and_pages_on_the_server() -> None:
    f = folded(10)
    assert [r["id"] for r in pj.blocks_page(f)["rows"]] == ["b3", "b2", "b1"]  # newest first
    assert [r["id"] for r in pj.blocks_page(f, q="mine")["rows"]] == ["b1"]  # the name, in the IR
    assert [r["id"] for r in pj.blocks_page(f, status="parsed")["rows"]] == ["b2"]
    assert [r["id"] for r in pj.blocks_page(f, cluster="c1")["rows"]] == ["b1"]
    assert [r["id"] for r in pj.blocks_page(f, label="tenant=t1")["rows"]] == ["b1"]
    assert [r["id"] for r in pj.blocks_page(f, policy="builtin:binpack")["rows"]] == ["b2", "b1"]
    assert pj.blocks_page(f, policy="builtin:spread")["rows"] == []
    page = pj.blocks_page(f, page=1, per=2)
    assert page["total"] == 3 and [r["id"] for r in page["rows"]] == ["b1"]


def test_a_blocks_page_has_its_explain_and_timeline() -> None:
    evs = [(n, float(n), s, msgspec.json.decode(raw)) for s, raw, n, _ in messages(8) if s.startswith("aios.block.b1.")]
    d = pj.block_detail(folded(8), "b1", evs, lambda s, e: s.rsplit(".", 1)[1])
    assert d is not None
    assert d["block"]["status"] == "ready" and d["block"]["name"] == "<b>mine</b>"
    assert [i["instance"] for i in d["instances"]] == ["b1-0"]
    assert [t["step"] for t in d["timeline"]][:2] == ["parsed", "selection"]
    assert [(t["step"], t["instance"]) for t in d["timeline"]][-2] == ("instance added", "b1-0")
    assert d["explain"]["rounds"][0]["chosen"] == "c1"
    assert pj.block_detail(folded(8), "zz", [], None) is None


def test_subject_filters_take_nats_wildcards_or_a_substring() -> None:
    assert subject_matches("aios.block.*.ready", "aios.block.b1.ready")
    assert not subject_matches("aios.block.*.ready", "aios.block.b1.instance.i.added")
    assert subject_matches("aios.node.>", "aios.node.n1.health")
    assert not subject_matches("aios.node.>", "aios.node")
    assert subject_matches("b1", "aios.block.b1.ready") and subject_matches("", "x")


def test_a_past_moment_is_the_stream_folded_up_to_it() -> None:
    async def go() -> None:
        feed = Feed(None, lambda s, e: "")  # type: ignore[arg-type]  # (kept messages: no stream read)
        for m in messages():
            feed.apply(*m)
        feed.caught_up.set()
        assert feed.fold.blocks["b1"]["status"] == "deleted"
        then = await feed.at(8)
        assert then.blocks["b1"]["status"] == "ready" and set(then.instances["b1"]) == {"b1-0"}
        assert then.last_seq == 8 and pj.overview(then)["blocks"] == {"ready": 1}
        assert pj.overview(then) == pj.overview(folded(8))  # the same fold, the same view
        assert await feed.at(8) is then  # kept for the slider
        assert len(feed.block_events("b1", 8)) == 6 and len(feed.block_events("b1")) == 9
        assert [e["seq"] for e in feed.tail][-1] == len(STORY)

    asyncio.run(go())


def test_a_past_moment_starts_from_the_nearest_checkpoint_of_the_live_fold() -> None:
    async def go() -> None:
        feed = Feed(None, lambda s, e: "", check_every=1, checkpoints=8)  # type: ignore[arg-type]
        for m in messages():
            feed.apply(*m)
        feed.caught_up.set()
        # 13 events, a checkpoint after each at first: thinned out past 8, the newest kept
        seqs = [c.seq for c in feed.checks.items]
        assert 0 < len(seqs) <= 8 and seqs[-1] == 13 and seqs[0] == 1
        for seq in range(1, len(STORY)):
            then = await feed.at(seq)
            assert pj.overview(then) == pj.overview(folded(seq)), seq
            assert then.blocks == folded(seq).blocks and then.last_seq == seq

    asyncio.run(go())


def test_the_kept_messages_are_compressed_chunks_and_the_oldest_go_past_the_budget() -> None:
    from aios_blocks.console.feed import Kept

    msgs = [(f"aios.x.{i}", b"y" * 100, i, float(i)) for i in range(1, 101)]
    kept = Kept(budget=10**9, chunk=8)
    for m in msgs:
        kept.add(*m)
    assert len(kept.chunks) == 12 and len(kept.open) == 4 and kept.covers(0)
    for after, upto in ((0, 100), (0, 5), (7, 8), (8, 9), (30, 77), (95, 100), (100, 100)):
        assert list(kept.between(after, upto)) == msgs[after:upto], (after, upto)
    small = Kept(budget=sum(len(c[2]) for c in kept.chunks[-3:]), chunk=8)  # room for the last 3 chunks
    for m in msgs:
        small.add(*m)
    assert len(small.chunks) == 3 and small.first == 73
    assert small.covers(72) and not small.covers(71)
    assert list(small.between(72, 100)) == msgs[72:]


def test_a_past_moment_folds_from_the_kept_chunks_after_the_checkpoint() -> None:
    async def go() -> None:
        feed = Feed(None, lambda s, e: "", check_every=5, chunk=2)  # type: ignore[arg-type]
        for m in messages():
            feed.apply(*m)
        feed.caught_up.set()
        for seq in range(1, len(STORY)):
            then = await feed.at(seq)
            assert then.blocks == folded(seq).blocks and then.nodes == folded(seq).nodes and then.last_seq == seq
        assert [c.seq for c in feed.checks.items] == [5, 10]

    asyncio.run(go())


def test_tenant_and_priority_filters_and_the_maps_rack_groups_and_deltas() -> None:
    f = folded(10)
    assert [r["id"] for r in pj.blocks_page(f, tenant="t1")["rows"]] == ["b1"]
    assert [r["id"] for r in pj.blocks_page(f, tenant="t2")["rows"]] == ["b2"]
    assert pj.blocks_page(f)["tenants"] == ["t1", "t2"]
    assert pj.who(msgspec.json.encode({**IR, "priorityClass": "high"}).decode()) == ("t1", "high")
    assert pj.who(msgspec.json.encode({**IR, "tenant": "own", "labels": {}}).decode()) == ("own", "")  # the IR's field first
    assert pj.who(msgspec.json.encode({"virtualClusterId": "v1"}).decode()) == ("v1", "")
    assert pj.blocks_page(f, priority="high")["rows"] == []
    m = pj.gpumap(folded(8), tenant="t1")  # b1 (t1) holds g1 of n1
    assert [(n[0], n[7]) for n in m["nodes"]] == [("n1", [0])] and m["marked"] == 1
    assert pj.gpumap(folded(8), tenant="t2")["nodes"] == []
    assert [(g["rack"], g["nodes"], g["gpus"]) for g in pj.gpumap(folded(8))["groups"]] == [("r1", 1, 2), ("r2", 1, 1)]
    delta = pj.gpumap_delta(pj.gpumap(folded(3)), pj.gpumap(folded(8)))  # (b1 placed on n1 meanwhile)
    assert delta["delta"] and delta["since"] == 3 and [n[0] for n in delta["nodes"]] == ["n1"] and delta["gone"] == []
