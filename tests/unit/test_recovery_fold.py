"""The fold (recovery.fold) without servers: lifecycle events -> the Redis image, idempotent
under duplicates, and the digest's normalisation (recovery.image)."""

from __future__ import annotations

from typing import Any

import msgspec

from aios_blocks.recovery import image as im
from aios_blocks.recovery.fold import Fold
from aios_blocks.recovery.invariants import check_image
from aios_blocks.state import keys

IR = {
    "blockId": "b1", "minInstances": 1, "maxInstances": 2,
    "resources": {"gpus": 1, "gpuMemory": 0, "cpu": 2, "memory": 100},
    "policies": {"resourceAllocator": {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "settings": {}}},
}


def ev(data: Any) -> bytes:
    return msgspec.json.encode({"id": "x", "source": "t", "type": "t", "subject": "s", "time": "t", "data": data})


def run(f: Fold, events: list[tuple[str, Any]]) -> None:
    for n, (subject, data) in enumerate(events, start=f.last_seq + 1):
        f.apply(subject, data if isinstance(data, bytes) else ev(data), n, 0.0)


NODE = {"id": "n1", "cluster": "c1", "labels": {"rack": "r1"}, "cpu": 8, "memory": 1000,
        "gpus": [{"id": "g1", "model": "m", "memory": 500}, {"id": "g2", "model": "m", "memory": 500}]}
PLACED = {"block_id": "b1", "gen": 2, "cluster_id": "c1", "action": "allocation",
          "placements": [{"instance_id": "b1-0", "node_id": "n1", "gpus": ["g1"]}]}
INST = {"block_id": "b1", "gen": 2, "instance_id": "b1-0", "node_id": "n1", "gpus": ["g1"]}


def placed() -> Fold:
    f = Fold()
    run(f, [
        ("aios.node.n1.registered", {"node": NODE, "agent": "", "runtime": "sim"}),
        ("aios.block.b1.create", b'{"blockComponentURI": "x", "minInstances": 1, "maxInstances": 2}'),
        ("aios.block.b1.parsed", {"block_id": "b1", "gen": 2, "ir": IR}),
        ("aios.block.b1.selection", {"block_id": "b1", "gen": 2, "candidates": ["c1"]}),
        ("aios.block.b1.post_dry_run", {"block_id": "b1", "gen": 2, "cluster_id": "c1", "scores": {"c1": 1}}),
        ("aios.block.b1.placement", PLACED),
        ("aios.block.b1.instance.b1-0.added", INST),
        ("aios.block.b1.ready", {"block_id": "b1", "gen": 2, "status": "ready"}),
    ])
    return f


def test_lifecycle_to_ready_reserves_exactly_like_the_lua_script() -> None:
    img = placed().image()
    assert img["aios:block:b1"]["status"] == "ready" and img["aios:block:b1"]["cluster"] == "c1"
    assert img["aios:block:b1"]["digest"]  # the create body's digest, as the parser stores it
    node = img[keys.node_key("c1", "n1")]
    assert node["cpu_used"] == "2" and node["mem_used"] == "100"
    assert (node["g:g1:mem"], node["g:g1:n"], node["g:g1:x"]) == ("500", "1", "1")  # exclusive: whole GPU
    res = img[keys.res_key("c1", "b1-0")]
    assert msgspec.json.decode(res["gpus"]) == {"g1": 500} and res["exclusive"] == "1"
    assert msgspec.json.decode(img["aios:block:b1:inst"]["b1-0"])["status"] == "running"
    assert img["aios:nodeindex"] == {"n1": "c1"} and img["aios:nodeinst:n1"] == {"b1-0": "b1"}
    assert check_image(img, {"b1"}).ok


def test_check_names_a_block_holding_more_instances_than_its_max() -> None:
    img = placed().image()
    inst = img["aios:block:b1:inst"]["b1-0"]
    img["aios:block:b1:inst"].update({"b1-1": inst, "b1-2": inst})  # maxInstances is 2
    rep = check_image(img, {"b1"})
    assert "block b1: 3 instances > maxInstances 2" in rep.violations
    live = check_image(img, {"b1"}, settled=False)  # a reassignment in flight holds one more
    assert "block b1: 3 instances > maxInstances 2" in live.warnings
    assert "block b1: 3 instances > maxInstances 2" not in live.violations


def test_check_names_a_record_whose_key_is_not_a_hash_instead_of_crashing() -> None:
    # `blocks check` with a block's key holding a string (a damaged key) ended in a traceback
    # ("'str' object has no attribute 'get'") and said no violation
    img: Any = placed().image()
    img["aios:block:b2"] = "x"
    img["aios:block:b1:inst"] = ["b1-0"]
    rep = check_image(img, {"b1", "b2"})
    assert "block b2: its Redis key holds a string, not a hash (`blocks recover --force` rebuilds it)" in rep.violations
    assert "instances of block b1: its Redis key holds a list, not a hash (`blocks recover --force` rebuilds it)" in rep.violations
    assert not rep.ok


def test_duplicates_change_nothing_and_delete_releases_everything() -> None:
    f = placed()
    before = im.digest(f.image())
    run(f, [("aios.block.b1.placement", PLACED), ("aios.block.b1.instance.b1-0.added", INST)])
    assert im.digest(f.image()) == before  # a redelivered step reuses its reservation
    run(f, [
        ("aios.block.b1.delete", {"block_id": "b1", "request_id": "r"}),
        ("aios.node.n1.instance.remove", {**INST, "cluster_id": "c1", "gpus": []}),
        ("aios.block.b1.instance.b1-0.removed", INST),
        ("aios.block.b1.instance.b1-0.removed", INST),  # twice: nothing more to release
        ("aios.block.b1.deleted", {"block_id": "b1", "gen": 2, "status": "deleted"}),
    ])
    img = f.image()
    assert img["aios:block:b1"]["status"] == "deleted"
    assert keys.res_key("c1", "b1-0") not in img and "aios:block:b1:inst" not in img
    node = img[keys.node_key("c1", "n1")]
    assert (node["g:g1:mem"], node["g:g1:n"], node["g:g1:x"], node["cpu_used"]) == ("0", "0", "0", "0")
    assert f.anomalies == []
    assert check_image(img, {"b1"}).ok


def test_a_delete_stored_before_its_block_still_ends_deleted() -> None:
    """The delete request published right after the create reaches the stream before the
    parser's ``submitted``/``parsed`` (soak, issue 39); the controller handled it once the block
    existed and reported ``deleted``; the gateway's late ``selection`` must not revive it."""
    f = Fold()
    run(f, [
        ("aios.block.b1.delete", {"block_id": "b1", "request_id": "r"}),
        ("aios.block.b1.create", b'{"blockComponentURI": "x", "minInstances": 1, "maxInstances": 2}'),
        ("aios.block.b1.parsed", {"block_id": "b1", "gen": 2, "ir": IR}),
        ("aios.block.b1.deleted", {"block_id": "b1", "gen": 2, "status": "deleted"}),
        ("aios.block.b1.selection", {"block_id": "b1", "gen": 2, "candidates": ["c1"]}),
    ])
    assert f.image()["aios:block:b1"]["status"] == "deleted"
    assert check_image(f.image(), {"b1"}).ok


def test_a_block_whose_deleted_fact_was_stored_before_it_ends_deleted() -> None:
    """The parser wrote the block to Redis and was slow to store ``submitted``/``parsed`` (killed,
    or its server cut off); the controller deleted the block it found meanwhile, and its
    ``deleted`` came first in the stream (soak, issue 39). Not a block left ``parsed``."""
    f = Fold()
    run(f, [
        ("aios.block.b1.delete", {"block_id": "b1", "request_id": "r"}),
        ("aios.block.b1.deleted", {"block_id": "b1", "gen": 2, "status": "deleted"}),
        ("aios.block.b1.create", b'{"blockComponentURI": "x", "minInstances": 1, "maxInstances": 2}'),
        ("aios.block.b1.parsed", {"block_id": "b1", "gen": 2, "ir": IR}),
    ])
    assert f.image()["aios:block:b1"]["status"] == "deleted"
    assert check_image(f.image(), {"b1"}).ok


def test_a_cluster_chosen_before_a_delete_handled_later_stays_on_the_block() -> None:
    """The delete request is stored before the gateway's ``post_dry_run``, but the gateway's
    CHOOSE took first in Redis (its allocation request says so): the deleted block keeps the
    cluster, as in Redis (soak, issue 39)."""
    f = Fold()
    run(f, [
        ("aios.node.n1.registered", {"node": NODE, "agent": "", "runtime": "sim"}),
        ("aios.block.b1.create", b'{"blockComponentURI": "x", "minInstances": 1, "maxInstances": 2}'),
        ("aios.block.b1.parsed", {"block_id": "b1", "gen": 2, "ir": IR}),
        ("aios.block.b1.selection", {"block_id": "b1", "gen": 2, "candidates": ["c1"]}),
        ("aios.block.b1.delete", {"block_id": "b1", "request_id": "r"}),
        ("aios.block.b1.post_dry_run", {"block_id": "b1", "gen": 2, "cluster_id": "c1", "scores": {"c1": 1}}),
        ("aios.cluster.c1.allocation", {"block_id": "b1", "gen": 2, "cluster_id": "c1"}),
        ("aios.block.b1.deleted", {"block_id": "b1", "gen": 2, "status": "deleted"}),
    ])
    b = f.image()["aios:block:b1"]
    assert b["status"] == "deleted" and b["cluster"] == "c1"


def test_stale_and_foreign_facts_are_ignored() -> None:
    f = placed()
    before = im.digest(f.image())
    run(f, [
        ("aios.block.b1.instance.b1-0.removed", {**INST, "gen": 1}),  # an older generation
        ("aios.block.b1.instance.b1-0.removed", {**INST, "node_id": "n9"}),  # a copy elsewhere
        ("aios.block.b1.failed", {"block_id": "b1", "gen": 1, "status": "failed", "reason": "old"}),
        ("aios.block.zz.ready", {"block_id": "zz", "gen": 5}),
        ("aios.block.b1.decision", {"anything": 1}),
        ("aios.block.b1.parsed", b"\xff not json"),
    ])
    assert im.digest(f.image()) == before
    # the ready without a status and the parsed that is not JSON do not decode into their payloads:
    # skipped and counted, as a live consumer dead-letters them (the decision is not the fold's)
    assert f.undecodable == 2


def test_one_instance_added_on_two_nodes_is_an_anomaly() -> None:
    f = placed()
    run(f, [("aios.block.b1.instance.b1-0.added", {**INST, "node_id": "n2"})])
    assert any("runs on" in a for a in f.anomalies)


def test_digest_ignores_volatile_fields_and_zero_usage_but_not_state() -> None:
    img = placed().image()
    same = {k: (dict(v) if isinstance(v, dict) else v) for k, v in img.items()}
    same["aios:block:b1"]["updated"] = "123.4"
    same["aios:block:b1"]["version"] = "9"
    same[keys.node_key("c1", "n1")]["g:g2:n"] = "0"  # Redis keeps zeroed counters
    same["aios:ctx:b1.resourceAllocator"] = {"k": "v"}
    same["aios:blocks"] = im.ZSet({"b1": 99.0})
    assert im.digest(same) == im.digest(img)
    changed = {**same, "aios:block:b1": {**same["aios:block:b1"], "status": "failed"}}
    assert im.digest(changed) != im.digest(img)
    assert any("status" in line for line in im.diff(img, changed))


def test_the_fold_rebuilds_the_endpoint_an_added_fact_carried() -> None:
    f = placed()
    assert "endpoint" not in msgspec.json.decode(f.image()["aios:block:b1:inst"]["b1-0"])  # none reported
    run(f, [("aios.block.b1.instance.b1-0.added", {**INST, "endpoint": "http://127.0.0.1:41234"})])
    rec = msgspec.json.decode(f.image()["aios:block:b1:inst"]["b1-0"])
    assert rec["endpoint"] == "http://127.0.0.1:41234" and rec["status"] == "running"
    # a later repeat with none (an adopted instance whose agent knows no port) keeps it, as the store does
    run(f, [("aios.block.b1.instance.b1-0.added", INST)])
    assert msgspec.json.decode(f.image()["aios:block:b1:inst"]["b1-0"])["endpoint"] == "http://127.0.0.1:41234"


def test_the_fold_keeps_the_desired_count_like_the_controller_and_marks_scale_down_choices() -> None:
    f = placed()
    target = {"block_id": "b1", "request_id": "t1", "target": 5, "reason": "busy", "source": "autoscaler", "gen": 2}
    run(f, [("aios.block.b1.scale.target", target)])
    b = f.blocks["b1"]
    late = int(b["desired_seq"])
    assert (b["desired"], b["desired_request"], b["desired_reason"]) == (
        "2", "t1", "autoscaler: busy; clamped: 5 lowered to maxInstances 2")
    # an older target folded after a later one (sequence order decides) changes nothing
    f.apply("aios.block.b1.scale.target", ev({**target, "request_id": "t0", "target": 1}), late - 1, 0.0)
    assert f.blocks["b1"]["desired_request"] == "t1"
    # a target for another generation, or for an unknown block, changes nothing
    run(f, [("aios.block.b1.scale.target", {**target, "request_id": "t9", "gen": 1}),
            ("aios.block.b9.scale.target", {**target, "block_id": "b9"})])
    assert f.blocks["b1"]["desired_request"] == "t1" and "b9" not in f.blocks
    chosen = {"block_id": "b1", "gen": 2, "cluster_id": "c1", "request_id": "t1:down", "instance_id": "b1-0",
              "node_id": "n1", "chosen_by": "default"}
    run(f, [("aios.block.b1.scale_down.chosen", chosen)])
    inst = f.instances["b1"]["b1-0"]
    assert inst["status"] == "removing" and inst["drain"] == "t1:down"
    # the live record's placement time is the controller's clock: not compared
    live = {**inst, "since": 12345.6}
    assert im.normalise(keys.inst_key("b1"), {"b1-0": msgspec.json.encode(live).decode()}) == \
        im.normalise(keys.inst_key("b1"), {"b1-0": msgspec.json.encode(inst).decode()})


def test_the_fold_rebuilds_where_a_blocks_sidecars_run() -> None:
    f = placed()
    run(f, [("aios.node.n1.sidecar.start", {"block_id": "b1", "gen": 2, "cluster_id": "c1", "node_id": "n1", "name": "store"}),
            ("aios.node.n1.sidecar.start", {"block_id": "b1", "gen": 1, "cluster_id": "c1", "node_id": "n9", "name": "old"})])
    assert f.image()["aios:block:b1"]["sidecar_node"] == "n1"  # an older generation's command changes nothing


def test_a_deleted_blocks_scale_target_is_not_compared_but_a_live_ones_is() -> None:
    """A scale target stored just before a delete: the fold applies it (the block was ready at its
    place in the stream), the controller may have handled the delete first and refused it (soak
    finding, docs/reliability.md). Once the block is deleted, the digest leaves ``desired*`` out."""
    f = placed()
    target = {"block_id": "b1", "request_id": "t1", "target": 2, "reason": "r", "source": "autoscaler", "gen": 2}
    run(f, [("aios.block.b1.scale.target", target)])
    live = f.image()
    refused = {k: (type(v)(v) if isinstance(v, dict) else v) for k, v in live.items()}
    for k in ("desired", "desired_seq", "desired_request", "desired_reason"):
        refused["aios:block:b1"].pop(k)
    assert im.digest(refused) != im.digest(live)  # a live block's target is state: compared
    run(f, [("aios.block.b1.delete", {"block_id": "b1", "request_id": "d1"}),
            ("aios.block.b1.instance.b1-0.removed", INST),
            ("aios.block.b1.deleted", {"block_id": "b1", "gen": 2, "status": "deleted"})])
    folded = f.image()
    assert folded["aios:block:b1"]["status"] == "deleted" and folded["aios:block:b1"]["desired"] == "2"
    redis = {k: (type(v)(v) if isinstance(v, dict) else v) for k, v in folded.items()}
    for k in ("desired", "desired_seq", "desired_request", "desired_reason"):
        redis["aios:block:b1"].pop(k)
    assert im.digest(redis) == im.digest(folded), im.diff(redis, folded)
    # the rest of a deleted block is still compared
    assert im.digest({**redis, "aios:block:b1": {**redis["aios:block:b1"], "cluster": "c9"}}) != im.digest(folded)


def test_the_tenants_keys_are_known_kept_by_recover_and_not_digested() -> None:
    # `blocks check` warned "1 aios:* keys of unknown kind ... ['aios:tenants:limits']" after a plain
    # `blocks tenant add`: the limits (copied from the auth file) and the parser's pending sets
    from aios_blocks.state import tenants

    for key in (tenants.LIMITS, tenants.pending_key("team-a")):
        assert im.classify(key) == "kept", key
        assert im.classify(key) not in ("rebuilt", "volatile")  # the kinds recover drops (rebuild.drop_project_keys)
    assert im.classify("aios:tenantsomething") == "unknown"


def test_check_counts_a_sharing_instances_share_of_its_gpu_compute() -> None:
    # after `blocks trace replay --live` every GPU holding gpuShare instances was a violation:
    # "g:<gpu>:share=990 but its reservations add up to 0" (the reservation's `share` was not counted)
    ir = {**IR, "resources": {"gpus": 1, "gpuMemory": 100, "gpuShare": 0.4, "cpu": 2, "memory": 100},
          "policies": {"resourceAllocator": {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack",
                                             "settings": {"gpuSharing": True}}}}
    f = Fold()
    run(f, [
        ("aios.node.n1.registered", {"node": NODE, "agent": "", "runtime": "sim"}),
        ("aios.block.b1.create", b'{"blockComponentURI": "x", "minInstances": 1, "maxInstances": 2}'),
        ("aios.block.b1.parsed", {"block_id": "b1", "gen": 2, "ir": ir}),
        ("aios.block.b1.selection", {"block_id": "b1", "gen": 2, "candidates": ["c1"]}),
        ("aios.block.b1.post_dry_run", {"block_id": "b1", "gen": 2, "cluster_id": "c1", "scores": {"c1": 1}}),
        ("aios.block.b1.placement", PLACED),
        ("aios.block.b1.instance.b1-0.added", INST),
        ("aios.block.b1.ready", {"block_id": "b1", "gen": 2, "status": "ready"}),
    ])
    img = f.image()
    node = img[keys.node_key("c1", "n1")]
    assert node["g:g1:share"] == "400" and img[keys.res_key("c1", "b1-0")]["share"] == "400"  # as the script writes them
    rep = check_image(img, {"b1"})
    assert rep.ok, rep.violations
    node["g:g1:share"] = "1400"  # more than the GPU's compute, with reservations that say so
    img[keys.res_key("c1", "b1-0")]["share"] = "1400"
    assert check_image(img, {"b1"}).violations == [f"{keys.node_key('c1', 'n1')}: GPU g1 compute over capacity (1400 > 1000 thousandths)"]
    img[keys.res_key("c1", "b1-0")]["share"] = "400"  # a counter its reservations do not explain
    assert any("g:g1:share=1400 but its reservations add up to 400" in v for v in check_image(img, {"b1"}).violations)
