"""``recovery.inputs`` on a hand-made stream (no servers): a recorded dry_run's input is rebuilt
from the facts alone and checked by digest, also when the state the step read held a reservation
published after the step's own event; a record whose digest no state gives is a ``mismatch``,
never shown as an input. The recorded digests here come from node views built the way
``Store.put_node`` / ``RESERVE_GANG`` leave a node's hash, not from the fold."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from aios_blocks.handlers import controller as hc
from aios_blocks.policies import contract, node_digest
from aios_blocks.recovery import inputs
from aios_blocks.schemas import events as ev
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.state.store import node_view

IR: dict[str, Any] = {
    "blockId": "rb1", "minInstances": 1, "maxInstances": 1, "resources": {"gpus": 1, "cpu": 1.0, "memory": 1024, "gpuMemory": 0},
    "policies": {
        "clusterAllocator": {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank", "parameters": {}, "settings": {}},
        "resourceAllocator": {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {}},
    },
    "affinity": [],
}
NODES = [Node(id=f"rc1-n{i}", cluster="rc1", gpus=[Gpu(id=f"rc1-n{i}-g{g}") for g in range(2)]) for i in range(2)]


def msg(subject: str, data: Any, seq: int) -> tuple[str, bytes, int, float]:
    return subject, ev.envelope(f"id{seq}", "/test", "io.aios.x", subject, data), seq, float(seq)


def hashes(taken: dict[str, str]) -> dict[str, dict[str, str]]:
    """Node hashes as ``put_node`` writes them, with ``taken`` (GPU -> node) reserved exclusively
    for one 1-CPU, 1024 MiB instance each, as the reservation script counts it."""
    out = {}
    for n in NODES:
        h = {"spec": n.model_dump_json(), "cpu": "64", "memory": str(n.memory), "healthy": "1"}
        h.update({f"g:{g.id}:total": str(g.memory) for g in n.gpus})
        mine = [g for g, nid in taken.items() if nid == n.id]
        if mine:
            h["cpu_used"], h["mem_used"] = str(len(mine)), str(1024 * len(mine))
            for g in mine:
                h[f"g:{g}:mem"], h[f"g:{g}:n"], h[f"g:{g}:x"] = "81920", "1", "1"
        out[n.id] = h
    return out


def live_input(taken: dict[str, str]) -> bytes:
    """The dry_run input as the controller builds it from Redis views."""
    views = {nid: node_view(h) for nid, h in sorted(hashes(taken).items())}
    got: list[bytes] = []

    async def invoke(data: dict[str, Any]) -> Any:
        got.append(msgspec.json.encode(data))
        return {"selection_score_data": {"score": 1.0, "node_info": {"node_id": "rc1-n0", "gpus": ["rc1-n0-g1"]}}}

    asyncio.run(hc.dry_run(IR, {"id": "rc1", "labels": {}}, views, invoke))
    return got[0]


def stream(digest: str, late_placement: bool) -> list[tuple[str, bytes, int, float]]:
    """The facts, then rb1's dry_run and its result (recording ``digest``, at the request's
    sequence); another block's placement after them (``late_placement``) or before them."""
    facts: list[tuple[str, Any]] = [("aios.cluster.rc1.registered", ev.ClusterRegistered({"id": "rc1", "labels": {}}))]
    facts += [(f"aios.node.{n.id}.registered", ev.NodeRegistered(n.model_dump(mode="json"))) for n in NODES]
    facts.append(("aios.block.rb1.parsed", ev.Parsed("rb1", 4, IR)))
    placed = ev.PlacementMade("rb0", 7, "rc1", "allocation", [ev.Placement("rb0-0", "rc1-n0", ["rc1-n0-g0"])])
    other: list[tuple[str, Any]] = [("aios.block.rb0.parsed", ev.Parsed("rb0", 7, {**IR, "blockId": "rb0"})),
                                    ("aios.block.rb0.placement", placed)]
    if not late_placement:
        facts += other
    request = len(facts) + 1
    output = {"selection_score_data": {"score": 1.0, "node_info": {"node_id": "rc1-n0", "gpus": ["rc1-n0-g1"]}}}
    decision = ev.Decision("rb1", "resourceAllocator", "resourceAllocator", "builtin:binpack", None, "dry_run", digest,
                           output, at=request)
    facts.append(("aios.cluster.rc1.dry_run", ev.DryRunRequest("rb1", 4, "rc1")))
    facts.append(("aios.block.rb1.dry_run.result", ev.DryRunResult("rb1", 4, "rc1", 1.0, decisions=[decision])))
    if late_placement:  # another block's reservation, taken before the dry_run read Redis, published after it
        facts += other
    return [msg(subject, data, seq) for seq, (subject, data) in enumerate(facts, start=1)]


def rebuilt(messages: list[tuple[str, bytes, int, float]]) -> inputs.Call:
    steps = asyncio.run(inputs.rebuild(messages, "rb1"))
    assert len(steps) == 1 and len(steps[0].calls) == 1
    return steps[0].calls[0]


def test_a_dry_run_input_is_rebuilt_from_the_facts() -> None:
    raw = live_input({})
    call = rebuilt(stream(ev.input_digest(raw), late_placement=True))
    assert call.status == "rebuilt" and call.state_seq == 5  # the request's own sequence
    assert msgspec.json.encode(call.input) == raw
    # the same input when the other block was placed before the request
    call = rebuilt(stream(ev.input_digest(live_input({"rc1-n0-g0": "rc1-n0"})), late_placement=False))
    assert call.status == "rebuilt" and call.state_seq == 7


def test_a_reservation_published_after_the_step_is_found_past_its_version() -> None:
    raw = live_input({"rc1-n0-g0": "rc1-n0"})
    call = rebuilt(stream(ev.input_digest(raw), late_placement=True))
    assert call.status == "rebuilt" and call.state_seq == 8
    assert msgspec.json.encode(call.input) == raw
    gpus = {g["id"]: g for g in call.input["payload"]["cluster_metrics"]["nodes"]["rc1-n0"]["gpus"]}
    assert gpus["rc1-n0-g0"]["instances"] == 1


def test_state_before_the_version_is_not_tried_and_a_wrong_digest_is_a_mismatch() -> None:
    # the placement happened (in Redis and the stream) before the dry_run: an input without it
    # is not what the step read
    raw = live_input({})
    call = rebuilt(stream(ev.input_digest(raw), late_placement=False))
    assert call.status == "mismatch" and call.input is None
    call = rebuilt(stream("0" * 24, late_placement=True))
    assert call.status == "mismatch" and call.input is None


def test_a_cluster_allocators_output_is_recorded_as_the_chosen_ids() -> None:
    entry = {"cluster_id": "c1", "id": "c1", "labels": {}, "metrics": {"gpus": 8}}
    assert contract.essential("selection", {"clusters": [entry, "c2"]}) == {"clusters": [{"cluster_id": "c1"}, {"cluster_id": "c2"}]}
    assert contract.essential("post_dry_run", entry) == {"cluster_id": "c1"}
    out = {"node_id": "n1", "gpus": ["g0"]}
    assert contract.essential("allocation", out) is out


def test_an_instance_record_in_a_policy_input_is_the_same_whatever_order_its_fields_came_in() -> None:
    """Redis and the Lua scripts may re-encode a record with its fields in another order: the
    input holds them by name, without the controller's own clock (``since``), whichever order
    was seen first (the order cache is keyed by the order seen)."""
    rec = {"status": "running", "node": "n1", "gpus": ["g1"], "since": 17.5, "gen": 2}
    other = dict(reversed(list(rec.items())))
    first, second = hc.canonical_record(rec), hc.canonical_record(other)
    assert list(first.items()) == list(second.items()) == [("gen", 2), ("gpus", ["g1"]), ("node", "n1"), ("status", "running")]
    rec2 = {**rec, "endpoint": "http://x"}  # another shape: its own order
    assert list(hc.canonical_record(rec2)) == ["endpoint", "gen", "gpus", "node", "status"]
    # the input's digest does not depend on the order either
    assert ev.input_digest_of({"instances": {"i": first}}) == ev.input_digest_of({"instances": {"i": second}})


# -- plans stored out of the order they reserved in (recovery.inputs.Placed) ------------------------
#: each block's one instance: the GPU its plan chose
CHOSEN = {"ra": ("rc1-n0", "rc1-n0-g0"), "rb": ("rc1-n0", "rc1-n0-g1"), "rc": ("rc1-n1", "rc1-n1-g0")}


def plan_digest(bid: str, taken: list[str]) -> str:
    """The digest of ``bid``'s allocation input as the controller records it (``Worker.record``),
    planned on Redis views where the blocks ``taken`` hold their GPUs."""
    views = {nid: node_view(h) for nid, h in sorted(hashes({CHOSEN[b][1]: CHOSEN[b][0] for b in taken}).items())}
    got: list[str] = []

    async def invoke(data: dict[str, Any]) -> Any:
        got.append(ev.input_digest_of(data, node_digest.nodes_root))
        return {"node_id": CHOSEN[bid][0], "gpus": [CHOSEN[bid][1]]}

    asyncio.run(hc.plan({**IR, "blockId": bid}, {"id": "rc1", "labels": {}}, views, "allocation", [hc.instance_id(bid, 0)], invoke))
    assert len(got) == 1
    return got[0]


def plans_stream(views: dict[str, list[str]], stored: list[str]) -> list[tuple[str, bytes, int, float]]:
    """Three blocks' allocation requests, in the order ra, rb, rc; each plan recorded on the view
    ``views[bid]``; their placements stored in the order ``stored``."""
    facts: list[tuple[str, Any]] = [("aios.cluster.rc1.registered", ev.ClusterRegistered({"id": "rc1", "labels": {}}))]
    facts += [(f"aios.node.{n.id}.registered", ev.NodeRegistered(n.model_dump(mode="json"))) for n in NODES]
    facts += [(f"aios.block.{b}.parsed", ev.Parsed(b, 3, {**IR, "blockId": b})) for b in CHOSEN]
    at = {}
    for b in CHOSEN:
        facts.append(("aios.cluster.rc1.allocation", ev.AllocationRequest(b, 3, "rc1")))
        at[b] = len(facts)
    for b in stored:
        nid, gpu = CHOSEN[b]
        decision = ev.Decision(b, "resourceAllocator", "resourceAllocator", "builtin:binpack", None, "allocation",
                               plan_digest(b, views[b]), {"node_id": nid, "gpus": [gpu]}, at=at[b])
        facts.append((f"aios.block.{b}.placement", ev.PlacementMade(b, 3, "rc1", "allocation", [ev.Placement(hc.instance_id(b, 0), nid, [gpu])],
                                                                    decisions=[decision])))
    return [msg(subject, data, seq) for seq, (subject, data) in enumerate(facts, start=1)]


def test_a_plan_whose_view_held_reservations_stored_after_a_later_requests_is_rebuilt() -> None:
    """One controller planned ra, rb, rc in their requests' order, each view holding the
    reservations before it, but stored rc's placement first (handled alone, its batch committed
    before the batch of ra and rb): rb's view (ra's GPU taken, not rc's) and rc's (both taken) are
    no state of the stream as stored; they are the state at their request with the reservations
    of the earlier requests, stored later, taken."""
    views = {"ra": [], "rb": ["ra"], "rc": ["ra", "rb"]}
    messages = plans_stream(views, stored=["rc", "ra", "rb"])
    steps = asyncio.run(inputs.rebuild(messages))
    got = {s.calls[0].decision["block_id"]: s.calls[0] for s in steps}
    assert {b: c.status for b, c in got.items()} == {"ra": "rebuilt", "rb": "rebuilt", "rc": "rebuilt"}
    # each at its own request's state, the input as the controller built it
    assert {b: c.state_seq for b, c in got.items()} == {"ra": 7, "rb": 8, "rc": 9}
    used = {b: sorted(g["id"] for n in c.input["payload"]["cluster_metrics"]["nodes"].values() for g in n["gpus"] if g["instances"])
            for b, c in got.items()}
    assert used == {"ra": [], "rb": ["rc1-n0-g0"], "rc": ["rc1-n0-g0", "rc1-n0-g1"]}


def test_reservations_taken_ahead_are_put_back() -> None:
    """``State.taken``: inside, the fold's nodes and reservations hold the placements; after, the
    fold is as it was (its node hashes, reservations and anomalies), so the stream's own placement
    event later takes the reservation as it would have."""
    messages = plans_stream({"ra": [], "rb": ["ra"], "rc": ["ra", "rb"]}, stored=["rc", "ra", "rb"])
    fold = inputs.Fold()
    for subject, raw, seq, ts in messages[:-3]:  # up to the requests, no placement stored yet
        fold.apply(subject, raw, seq, ts)
    st = inputs.State(fold)
    before = ({nid: n.hash() for nid, n in fold.nodes.items()}, dict(fold.reservations), list(fold.anomalies))
    placed = inputs.Placed(messages)
    ahead = [p for p in placed.items if p.block in ("ra", "rb")]
    with st.taken("rc1", ahead):
        n0 = st.nodes("rc1")["rc1-n0"]
        assert sorted(g["id"] for g in n0["gpus"] if g["instances"]) == ["rc1-n0-g0", "rc1-n0-g1"]
        assert set(fold.reservations) == {("rc1", "ra-0"), ("rc1", "rb-0")}
    assert ({nid: n.hash() for nid, n in fold.nodes.items()}, dict(fold.reservations), list(fold.anomalies)) == before
    assert not [g for g in st.nodes("rc1")["rc1-n0"]["gpus"] if g["instances"]]
    for subject, raw, seq, ts in messages[-3:]:
        fold.apply(subject, raw, seq, ts)
    assert set(fold.reservations) == {("rc1", "ra-0"), ("rc1", "rb-0"), ("rc1", "rc-0")}


def test_a_view_holding_a_later_request_s_reservation_is_still_a_mismatch() -> None:
    """Only the reservations of requests taken before the step's own are tried ahead of the
    stream: rb's view holding rc's reservation (rc requested after rb) with ra's stored first
    matches no state."""
    messages = plans_stream({"ra": [], "rb": ["rc"], "rc": ["ra"]}, stored=["ra", "rb", "rc"])
    got = {s.calls[0].decision["block_id"]: s.calls[0].status for s in asyncio.run(inputs.rebuild(messages))}
    assert got == {"ra": "rebuilt", "rb": "mismatch", "rc": "rebuilt"}
