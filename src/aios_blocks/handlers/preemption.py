"""The ``preemption`` policy's input, built from the state's views (issue 36, docs/priority.md).
Pure: node views (``state.nodes.node_view``) and the blocks placed in the cluster in, the seed-
shaped input of ``builtin:preempt-min`` out. The controller's preemption step (a later session)
and ``blocks preempt --dry-run`` both build it here."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from typing import Any

from ..schemas.catalog import E, Emit
from ..schemas.priority import NO_CLASS_PRIORITY, Preempted, Preempting, PreemptReason
from ..schemas.sharing import SHARING_KEY


def gpu_free(g: Mapping[str, Any]) -> float:
    """The free part of a GPU's compute: whole when nothing uses it, nothing when an instance
    holds it whole, else what sharing instances left (``share_free`` thousandths)."""
    if int(g.get("instances") or 0) == 0:
        return 1.0
    if g.get("exclusive"):
        return 0.0
    return max(0.0, int(g.get("share_free", 0)) / 1000)


def share_of(ir: Mapping[str, Any]) -> bool:
    """Whether the block's instances share their GPUs (``gateway.share_of``: its resourceAllocator's
    ``gpuSharing``), on an IR read as a mapping."""
    rule = (ir.get("policies") or {}).get("resourceAllocator") or {}
    return bool((rule.get("settings") or {}).get(SHARING_KEY, False))


def gpu_input(g: Mapping[str, Any]) -> dict[str, Any]:
    """One GPU as the planner reads it: its model, its free part, its memory and what of it is
    free (MiB), its instances and whether one holds it whole (``capacity.gpu_usable`` reads these)."""
    return {"model": g.get("model", ""), "free": gpu_free(g), "memory": int(g.get("memory") or 0),
            "memory_free": int(g.get("memory_free") or 0), "instances": int(g.get("instances") or 0),
            "exclusive": bool(g.get("exclusive"))}


def cluster_input(cid: str, views: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The healthy nodes as the planner reads them: free CPU, memory and each GPU (``gpu_input``)."""
    nodes = {}
    for nid, v in sorted(views.items()):
        if not v.get("healthy", True):
            continue
        nodes[nid] = {"cpu_free": v.get("cpu_free", 0), "mem_free": v.get("memory_free", 0),
                      "gpus": {g["id"]: gpu_input(g) for g in v.get("gpus", [])}}
    return {"cluster_id": cid, "nodes": nodes}


def block_input(bid: str, ir: Mapping[str, Any]) -> dict[str, Any]:
    return {"block_id": bid, "priority": int(ir.get("priority", NO_CLASS_PRIORITY)),
            "priorityClass": ir.get("priorityClass", ""), "minInstances": int(ir.get("minInstances") or 0),
            "resources": dict(ir.get("resources") or {}), "gpuSharing": share_of(ir)}


def candidates(placed: Iterable[Mapping[str, Any]], nodes: Iterable[str], skip: str = "") -> list[dict[str, Any]]:
    """The blocks with instances on these nodes (rows ``{block_id, ir, created, instances}``), each
    with its priority, age, ``preemptible``, ``minInstances`` and its instances there."""
    on = set(nodes)
    out = []
    for row in placed:
        if row["block_id"] == skip:
            continue
        ir = row.get("ir") or {}
        res = ir.get("resources") or {}
        sharing = share_of(ir)
        # what it holds of each GPU's compute: its gpuShare when it shares (0: memory alone), else all
        share = float(res.get("gpuShare") or 0.0) if sharing else 1.0
        insts = {iid: {"node_id": i.get("node"), "gpus": list(i.get("gpus") or []),
                       "share": share, "cpu": float(res.get("cpu") or 0.0),
                       "memory": float(res.get("memory") or 0), "created": float(row.get("created") or 0),
                       "gpuMemory": float(res.get("gpuMemory") or 0), "gpuSharing": sharing}
                 for iid, i in (row.get("instances") or {}).items() if i.get("node") in on}
        if insts:
            out.append({**block_input(row["block_id"], ir), "gen": int(row.get("gen") or 0),
                        "created": float(row.get("created") or 0),
                        "preemptible": ir.get("preemptible") is not False, "instances": insts})
    return out


def preempt_input(bid: str, ir: Mapping[str, Any], cid: str, views: Mapping[str, Mapping[str, Any]],
                  placed: Iterable[Mapping[str, Any]], min_delta: int, preempted_by: str = "") -> dict[str, Any]:
    """The whole input of one ``preempt`` call (``min_delta``: ``Settings.preempt_min_delta``).
    ``preempted_by``: the block waits because that one preempted it (``block.preemptedBy``: the
    planner then chooses no victim: no cascades)."""
    cluster = cluster_input(cid, views)
    block = block_input(bid, ir)
    if preempted_by:
        block["preemptedBy"] = preempted_by
    return {"action": "preempt", "minDelta": min_delta, "block": block, "cluster": cluster,
            "candidates": candidates(placed, cluster["nodes"], skip=bid)}


def _victims(data: Mapping[str, Any], output: Mapping[str, Any]) -> dict[str, list[str]]:
    """The chosen instances that are candidates', per victim block (instance ids sorted)."""
    chosen = sorted({iid for ids in (output.get("victims") or {}).values() for iid in ids})
    by_inst = {iid: c for c in data.get("candidates") or () for iid in c.get("instances") or {}}
    victims: dict[str, list[str]] = {}
    for iid in chosen:
        if iid in by_inst:
            victims.setdefault(str(by_inst[iid]["block_id"]), []).append(iid)
    return victims


def _preempted(data: Mapping[str, Any], victims: Mapping[str, list[str]], bid: str, priority: int, gen: int,
               reason: str) -> list[Emit]:
    """One ``block.preempted`` per victim block, in block id order."""
    by_block = {str(c["block_id"]): c for c in data.get("candidates") or ()}
    return [Emit(E.block_preempted, Preempted(
        v, int(by_block[v].get("gen") or 0), bid, gen, str(reason),
        {iid: str(by_block[v]["instances"][iid].get("node_id")) for iid in iids},
        int(by_block[v].get("priority") or 0), priority)) for v, iids in sorted(victims.items())]


def _gpus_freed(data: Mapping[str, Any], victims: Mapping[str, list[str]]) -> int:
    by_inst = {iid: c for c in data.get("candidates") or () for iid in c.get("instances") or {}}
    return sum(len(by_inst[i]["instances"][i].get("gpus") or ()) for ids in victims.values() for i in ids)


def events(data: Mapping[str, Any], output: Mapping[str, Any], gen: int, request_id: str,
           reason: str = PreemptReason.PRIORITY, short: int = 0) -> list[Emit]:
    """The events of a preemption the policy chose (``output``, on the input ``data``): one
    ``block.preempted`` per victim block (the preemptor, the reason, the instances it loses and
    where they were), then the preemptor's ``block.preempting`` (its victims, the GPUs freed;
    ``short``: the missing instances of a short ready preemptor it is for, 0 for a waiting one).
    None when it chose no victim. The controller's step emits them (a later session)."""
    victims = _victims(data, output)
    if not victims:
        return []
    block = data.get("block") or {}
    bid, priority = str(block.get("block_id")), int(block.get("priority") or 0)
    out = _preempted(data, victims, bid, priority, gen, reason)
    out.append(Emit(E.block_preempting, Preempting(bid, gen, str(reason), victims, _gpus_freed(data, victims), request_id,
                                                   short)))
    return out


def reclaim_plan(bid: str, ir: Mapping[str, Any], victims: Iterable[str],
                 placed: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A quota reclamation as a preemption (``policies.quota.decide``'s ``reclaim``): the input
    (the block, the victim blocks with all their instances wherever they run) and the output
    (every instance of each victim, per node) that ``events`` reads, reason ``InCohortReclamation``."""
    chosen = set(victims)
    rows = [r for r in placed if r["block_id"] in chosen]
    nodes = {i.get("node") for r in rows for i in (r.get("instances") or {}).values()}
    cands = candidates(rows, [n for n in nodes if n], skip=bid)
    out: dict[str, list[str]] = {}
    for c in cands:
        for iid, inst in c["instances"].items():
            out.setdefault(str(inst["node_id"]), []).append(iid)
    data = {"action": "preempt", "block": block_input(bid, ir), "candidates": cands}
    return data, {"victims": {n: sorted(ids) for n, ids in sorted(out.items())},
                  "blocks": {c["block_id"]: sorted(c["instances"]) for c in cands},
                  "reason": PreemptReason.IN_COHORT_RECLAMATION}


class Index:
    """The planner's input kept up to date as blocks are placed and removed, instead of rebuilt
    from every node view and every placed block per plan (``trace/online.py``: one plan read
    every running block below the preemptor). Holds the healthy nodes in the planner's shape
    (``cluster_input``) and each placed block's candidate row (``candidates``) by priority and by
    node. ``input`` returns what ``preempt_input`` returns on the same state: the same dict, the
    candidates in the order they were added (``tests/unit/test_trace_online.py`` checks it)."""

    def __init__(self, cid: str, views: Mapping[str, Mapping[str, Any]]):
        self.cid = cid
        self.nodes: dict[str, Any] = cluster_input(cid, views)["nodes"]
        self.seq = 0
        #: priority -> block id -> (seq, candidate row); insertion (seq) order within a priority
        self.by_priority: dict[int, dict[str, tuple[int, dict[str, Any]]]] = {}
        #: node id -> block id -> candidate row (the whole row: its instances there are filtered by the reader)
        self.by_node: dict[str, dict[str, dict[str, Any]]] = {}
        self._where: dict[str, tuple[int, list[str]]] = {}

    def node(self, nid: str, view: Mapping[str, Any]) -> None:
        """A node view changed (an instance placed or gone): its planner shape again."""
        one = cluster_input(self.cid, {nid: view})["nodes"]
        if nid in one:
            if nid not in self.nodes:  # keep the sorted order cluster_input gives
                self.nodes = dict(sorted({**self.nodes, **one}.items()))
            else:
                self.nodes[nid] = one[nid]
        elif nid in self.nodes:
            del self.nodes[nid]

    def add(self, row: Mapping[str, Any]) -> None:
        """A placed block (a ``candidates`` row: ``{block_id, ir, created, gen, instances}``)."""
        rows = candidates([row], self.nodes)
        if not rows:
            return
        c = rows[0]
        self.seq += 1
        bid, prio = str(c["block_id"]), int(c["priority"])
        self.by_priority.setdefault(prio, {})[bid] = (self.seq, c)
        on = sorted({str(i["node_id"]) for i in c["instances"].values()})
        for nid in on:
            self.by_node.setdefault(nid, {})[bid] = c
        self._where[bid] = (prio, on)

    def remove(self, bid: str) -> None:
        prio, on = self._where.pop(bid, (None, []))
        if prio is None:
            return
        self.by_priority[prio].pop(bid, None)
        if not self.by_priority[prio]:
            del self.by_priority[prio]
        for nid in on:
            self.by_node[nid].pop(bid, None)

    def below(self, floor: int, skip: str = "") -> list[dict[str, Any]]:
        """The candidates at priority <= ``floor`` (all the planner may take), in the order added."""
        buckets = [list(b.values()) for p, b in self.by_priority.items() if p <= floor]
        return [c for _s, c in heapq.merge(*buckets, key=lambda t: t[0]) if c["block_id"] != skip]

    def input(self, bid: str, ir: Mapping[str, Any], min_delta: int, preempted_by: str = "",
              floor: int | None = None) -> dict[str, Any]:
        """``preempt_input`` on the indexed state (``floor``: only the candidates that low; the
        planner passes over the others anyway). The node dicts are shared: read, never change."""
        block = block_input(bid, ir)
        if preempted_by:
            block["preemptedBy"] = preempted_by
        cands = self.below(max(self.by_priority, default=0) if floor is None else floor, skip=bid)
        return {"action": "preempt", "minDelta": min_delta, "block": block,
                "cluster": {"cluster_id": self.cid, "nodes": self.nodes}, "candidates": cands}

    def on_node(self, nid: str) -> list[dict[str, Any]]:
        return list(self.by_node.get(nid, {}).values())
