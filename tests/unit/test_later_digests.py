"""A placement's decision record digests its input in two parts (``events.input_digest_later``,
``workers.base.LaterDigests``): what reads the node map, a live inventory view that the
reservation's ``Inventory.apply`` changes in place, at the call; the JSON and hash of the rest
later, while the reservation's script is in flight (``workers.allocate``). The digest is
``input_digest_of``'s at the call, whatever the view became since; records still to finish are
finished when their block is left by an exception (a failed plan publishes its records)."""

from __future__ import annotations

from typing import Any

import pytest

from aios_blocks.policies import capacity, node_digest
from aios_blocks.schemas import events as ev
from aios_blocks.workers.base import _LATER, LaterDigests


def _view(n: int) -> capacity.Nodes:
    return capacity.Nodes({
        f"n{i}": {"node_id": f"n{i}", "healthy": True, "cpu_free": 8.0, "memory_free": 1024.0,
                  "gpus": [{"id": f"n{i}-g0", "free": 1000, "memory_free": 80, "memory_total": 80}], "labels": {}}
        for i in range(n)
    })


def _input(view: capacity.Nodes) -> dict[str, Any]:
    return {"action": "allocation", "payload": {
        "block": {"blockId": "b1", "instances": {}}, "cluster": {"id": "c0", "labels": {}},
        "cluster_metrics": {"node_count": len(view), "nodes": view}, "healthy_nodes": capacity.healthy_ids(view)}}


def test_the_later_part_reads_no_node_map() -> None:
    view = _view(130)  # three chunks of the root
    data = _input(view)
    at_call = ev.input_digest_of(data, node_digest.nodes_root)
    later = ev.input_digest_later(data, node_digest.nodes_root)
    # the reservation taken in place (``Inventory.apply``): a new view, the version moves on
    view["n3"] = {**view["n3"], "cpu_free": 7.0}
    del view["n5"]
    assert ev.input_digest_of(data, node_digest.nodes_root) != at_call
    assert later() == at_call
    # an input without a node map: its JSON's digest, as before
    plain = {"action": "selection", "payload": {"x": [1, 2]}}
    assert ev.input_digest_later(plain)() == ev.input_digest_of(plain)


def _decision() -> ev.Decision:
    return ev.Decision("b1", "resourceAllocator", "r", "builtin:fgd-plus", None, "allocation", "")


def test_records_are_finished_when_asked_and_when_left_by_an_exception() -> None:
    later = LaterDigests()
    with later:
        assert _LATER.get() is later
        d = _decision()
        later.pending.append((d, lambda: "abc"))
    assert _LATER.get() is None
    assert d.input_digest == ""  # not yet: the caller finishes them once the script is sent
    later.finish()
    later.finish()  # once
    assert d.input_digest == "abc" and later.pending == []
    failed = LaterDigests()
    with pytest.raises(RuntimeError), failed:
        e = _decision()
        failed.pending.append((e, lambda: "def"))
        raise RuntimeError("the plan failed")
    assert e.input_digest == "def"  # its record may be published with the failure
