"""``state.store.node_view``: the node hash the reservation scripts write, as every placement
policy sees it (free figures, draining, virtual cluster, fields not written yet)."""

from __future__ import annotations

import json

from aios_blocks.state.store import node_view

SPEC = json.dumps({"id": "n1", "cluster": "c", "labels": {"rack": "2"},
                   "gpus": [{"id": "g0", "model": "H100", "memory": 80000}, {"id": "g1", "memory": 100}]})


def test_a_node_with_usage_reads_its_free_figures() -> None:
    h = {"spec": SPEC, "cpu": "1", "cpu_used": "0.7", "memory": "4096", "mem_used": "1024", "healthy": "1",
         "g:g0:total": "81920", "g:g0:mem": "500", "g:g0:n": "2", "g:g0:share": "300", "g:g1:x": "1", "g:g1:n": "1",
         "g:g1:mem": "100"}
    assert node_view(h) == {
        "node_id": "n1", "cluster": "c", "labels": {"rack": "2"}, "healthy": True,
        "cpu": 1.0, "cpu_free": 0.3, "memory": 4096, "memory_free": 3072,  # 1 - 0.7, not 0.30000000000000004
        "gpus": [
            {"id": "g0", "model": "H100", "memory": 81920, "memory_used": 500, "memory_free": 81420, "instances": 2,
             "exclusive": False, "share_free": 700},
            {"id": "g1", "model": "", "memory": 100, "memory_used": 100, "memory_free": 0, "instances": 1,
             "exclusive": True, "share_free": 1000},
        ],
    }


def test_a_bare_hash_reads_as_empty_and_unhealthy() -> None:
    v = node_view({"spec": json.dumps({"id": "n1", "cluster": "c"})})
    assert v == {"node_id": "n1", "cluster": "c", "labels": {}, "healthy": False, "cpu": 0.0, "cpu_free": 0.0,
                 "memory": 0, "memory_free": 0, "gpus": []}
    [g] = node_view({"spec": json.dumps({"id": "n1", "cluster": "c", "gpus": [{"id": "g0"}]})})["gpus"]
    assert g["memory"] == 0 and g["instances"] == 0 and g["share_free"] == 1000


def test_a_draining_node_reads_unhealthy_and_draining_and_its_virtual_cluster_is_named() -> None:
    v = node_view({"spec": SPEC, "healthy": "1", "drain": "1", "vc": "team-a"})
    assert v["healthy"] is False and v["draining"] is True and v["virtualCluster"] == "team-a"
    v = node_view({"spec": SPEC, "healthy": "1", "drain": "0", "vc": ""})
    assert v["healthy"] is True and "draining" not in v and "virtualCluster" not in v
