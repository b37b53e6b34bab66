"""The console's views, computed from a ``recovery.fold.Fold``: the state ``blocks recover``
rebuilds Redis from, so the live page and a past moment (the stream folded up to a sequence) are
one code path. Pure: no I/O; each function returns the JSON a view draws."""

from __future__ import annotations

import functools
import heapq
from collections import Counter
from typing import Any

import msgspec

from ..policies.builtin.frag import Workload
from ..policies.capacity import SHARE_UNITS
from ..projections.explain import explain
from ..recovery.fold import Fold, NodeState
from ..schemas.lifecycle import BlockStatus

_json = msgspec.json

#: statuses still on their way to ready: the pending queue (``pending``: fits nowhere now and waits
#: for capacity, docs/priority.md) and the steps in flight
PENDING = (BlockStatus.PENDING, BlockStatus.PARSED, BlockStatus.SELECTING, BlockStatus.ALLOCATING, BlockStatus.PLACING)
#: statuses a failure list shows, with their reasons
FAILED = (BlockStatus.FAILED, BlockStatus.REJECTED)
#: statuses whose blocks hold (or want) capacity: their shapes are the workload FGD measures against
LIVE = (*PENDING, BlockStatus.READY)
#: the workload when no live block says one: a task of one whole GPU
DEFAULT_WORKLOAD = ({"cpu": 0.0, "gpus": 1, "weight": 1.0},)


@functools.lru_cache(maxsize=16384)
def _decoded(text: str) -> dict[str, Any]:
    """A record's JSON, decoded once per distinct text (a node's spec and a block's IR change
    rarely; each view reads them all): read only, shared between calls."""
    try:
        out = _json.decode(text)
    except msgspec.DecodeError:
        return {}
    return out if isinstance(out, dict) else {}


def _spec(node: NodeState) -> dict[str, Any]:
    return _decoded(node.spec)


def _ir(block: dict[str, str]) -> dict[str, Any]:
    return _decoded(block.get("ir") or "{}")


def block_name(ir: dict[str, Any]) -> str:
    """What a person named the block: ``blockMetadata.name``, else ``parameters.name`` (free text:
    the page shows it as text, never as markup)."""
    for part in ("blockMetadata", "parameters"):
        value = ir.get(part)
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            return str(value["name"])[:200]
    return ""


def gpu_alloc(node: NodeState, gpu: str) -> int:
    """Thousandths of the GPU held: all of it when an instance holds it whole, else the sharing
    instances' ``gpuShare``, else (memory-only sharing) the share of its memory taken."""
    mem, count, whole = node.gpu_use.get(gpu, (0, 0, 0))
    if whole:
        return SHARE_UNITS
    share = node.gpu_share.get(gpu, 0)
    if share > 0:
        return min(SHARE_UNITS, share)
    total = node.gpu_total.get(gpu, 0)
    if count > 0 and total > 0:
        return min(SHARE_UNITS, max(1, round(mem * SHARE_UNITS / total)))
    return 0


def workload(f: Fold) -> Workload:
    """The live blocks' task shapes, each weighted by its blocks' wanted instances: the workload
    FGD's fragmentation is measured against (``policies/builtin/frag.py``)."""
    shapes: Counter[tuple[float, int, float, tuple[str, ...]]] = Counter()
    for b in f.blocks.values():
        if b.get("status") not in LIVE:
            continue
        shape, least = _shape(b.get("ir") or "{}")
        desired = b.get("desired")
        shapes[shape] += max(1, int(desired) if desired else least)
    return _workload(tuple(sorted(shapes.items())))


@functools.lru_cache(maxsize=65536)
def _shape(ir_text: str) -> tuple[tuple[float, int, float, tuple[str, ...]], int]:
    """A block's task shape (CPU, GPUs, gpuShare, GPU models) and its minInstances, per IR text."""
    ir = _decoded(ir_text)
    r = ir.get("resources") or {}
    return ((float(r.get("cpu", 0) or 0), int(r.get("gpus", 0) or 0), float(r.get("gpuShare", 0) or 0),
             tuple(r.get("gpuModels") or ())), int(ir.get("minInstances") or 1))


@functools.lru_cache(maxsize=8)
def _workload(shapes: tuple[tuple[tuple[float, int, float, tuple[str, ...]], int], ...]) -> Workload:
    """One ``Workload`` per distinct set of shapes: its memo of node figures carries over between
    requests while the live blocks' shapes stay the same."""
    if not shapes:
        return Workload([dict(s) for s in DEFAULT_WORKLOAD])
    return Workload([{"cpu": c, "gpus": g, "gpuShare": s, "gpuModels": list(m), "weight": float(w)}
                     for (c, g, s, m), w in shapes])


def node_cells(node: NodeState) -> list[int]:
    return [gpu_alloc(node, g) for g in node.gpu_total]


def stranded_units(node: NodeState, cells: list[int], wl: Workload) -> float:
    """The node's free GPU compute (thousandths) a task of the workload could not use, on average:
    FGD's fragmentation of the node divided by the workload's weight."""
    if not wl.total or not cells:
        return 0.0
    spec = _spec(node)
    model = str((spec.get("gpus") or [{}])[0].get("model", ""))
    cpu_free = float(node.cpu) - float(node.cpu_used or 0.0)
    left = tuple(SHARE_UNITS - c for c in cells)
    return wl.frag(model, cpu_free, left) / wl.total


def overview(f: Fold, recent: dict[str, float] | None = None) -> dict[str, Any]:
    """Clusters with nodes and GPUs used / free / stranded, blocks by status, the pending queue,
    recent failures with their reasons; ``recent``: event rates (per second) the feed measured."""
    wl = workload(f)
    clusters: dict[str, dict[str, Any]] = {
        cid: {"id": cid, "nodes": 0, "healthy": 0, "gpus": 0, "used": 0.0, "free": 0.0, "stranded": 0.0} for cid in f.clusters
    }
    for node in f.nodes.values():
        c = clusters.setdefault(node.cluster, {"id": node.cluster, "nodes": 0, "healthy": 0, "gpus": 0, "used": 0.0,
                                               "free": 0.0, "stranded": 0.0})
        cells = node_cells(node)
        c["nodes"] += 1
        c["healthy"] += 1 if node.healthy else 0
        c["gpus"] += len(cells)
        used = sum(cells) / SHARE_UNITS
        c["used"] += used
        c["free"] += len(cells) - used
        c["stranded"] += stranded_units(node, cells, wl) / SHARE_UNITS
    rows = sorted(clusters.values(), key=lambda c: c["id"])
    for c in rows:
        for k in ("used", "free", "stranded"):
            c[k] = round(c[k], 2)
    totals = {k: round(sum(c[k] for c in rows), 2) for k in ("nodes", "healthy", "gpus", "used", "free", "stranded")}
    by_status: Counter[str] = Counter()
    waiting, failed = [], []
    for bid, b in f.blocks.items():
        status = b.get("status", "")
        by_status[status] += 1
        if status in PENDING:
            waiting.append(bid)
        elif status in FAILED:
            failed.append(bid)
    newest = f.block_order.get
    pending = [_row(f, bid) for bid in heapq.nlargest(20, waiting, key=lambda bid: newest(bid, 0.0))]
    failures = [_row(f, bid) for bid in heapq.nlargest(20, failed, key=lambda bid: newest(bid, 0.0))]
    return {"seq": f.last_seq, "clusters": rows, "totals": totals, "blocks": dict(sorted(by_status.items())),
            "pending": pending, "failures": failures, "rates": recent or {}}


def gpumap(f: Fold, label: str = "") -> dict[str, Any]:
    """Every node as ``[id, cluster, model, healthy, rack, [thousandths held per GPU], stranded
    thousandths]``, sorted by cluster, GPU model, rack and id: compact enough to draw 6,000 GPUs at
    once. ``label``: ``key=value``, only the nodes with that label."""
    key, _, value = label.partition("=")
    wl = workload(f)
    out: list[list[Any]] = []
    gpus = 0
    for nid, node in f.nodes.items():
        spec = _spec(node)
        labels = spec.get("labels") or {}
        if key and labels.get(key) != value:
            continue
        cells = node_cells(node)
        model = str((spec.get("gpus") or [{}])[0].get("model", "")) if cells else "cpu"
        gpus += len(cells)
        out.append([nid, node.cluster, model, 1 if node.healthy else 0, str(labels.get("rack", "")), cells,
                    round(stranded_units(node, cells, wl))])
    out.sort(key=lambda n: (n[1], n[2], n[4], n[0]))
    return {"seq": f.last_seq, "nodes": out, "gpus": gpus}


def gpu_detail(f: Fold, nid: str, gpu: str | None) -> dict[str, Any] | None:
    """One node (and one of its GPUs): its GPUs and the instances on it, with their blocks."""
    node = f.nodes.get(nid)
    if node is None:
        return None
    spec = _spec(node)
    gpus = [{"id": g["id"], "model": g.get("model", ""), "memory": g.get("memory", 0), "alloc": gpu_alloc(node, g["id"])}
            for g in spec.get("gpus") or []]
    instances = []
    for iid, bid in sorted(f.node_insts.get(nid, {}).items()):
        inst = f.instances.get(bid, {}).get(iid)
        if inst is None:
            continue
        if gpu and gpu not in inst.get("gpus", []):
            continue
        b = f.blocks.get(bid, {})
        instances.append({"instance": iid, "block": bid, "name": block_name(_ir(b)), "status": inst.get("status", ""),
                          "gpus": inst.get("gpus", []), "block_status": b.get("status", "")})
    return {"seq": f.last_seq, "node": nid, "cluster": node.cluster, "healthy": node.healthy, "labels": spec.get("labels") or {},
            "cpu": node.cpu, "cpu_used": node.cpu_used or 0.0, "gpu": gpu or "", "gpus": gpus, "instances": instances}


def _row(f: Fold, bid: str) -> dict[str, Any]:
    b = f.blocks[bid]
    ir = _ir(b)
    insts = f.instances.get(bid, {})
    return {"id": bid, "name": block_name(ir), "status": b.get("status", ""), "cluster": b.get("cluster", ""),
            "instances": len(insts), "running": sum(1 for i in insts.values() if i.get("status") == "running"),
            "desired": int(b.get("desired") or ir.get("minInstances") or 0), "component": ir.get("blockComponentURI", ""),
            "reason": _reason(b), "created": f.block_order.get(bid, 0.0)}


def _reason(b: dict[str, str]) -> str:
    """A failed block's reason; a rejected one's errors as ``path: message`` lines."""
    raw = b.get("reason", "")
    if b.get("status") == BlockStatus.REJECTED and raw.startswith("["):
        try:
            errs = _json.decode(raw)
            return "; ".join(f"{e.get('path', '')}: {e.get('message', '')}" for e in errs if isinstance(e, dict))
        except msgspec.DecodeError:
            pass
    return raw


@functools.lru_cache(maxsize=65536)
def _facets(ir_text: str) -> tuple[frozenset[str], frozenset[str]]:
    """A block's labels as ``key=value`` and its policies' URIs, per IR text (the table's filters)."""
    ir = _decoded(ir_text)
    labels = ir.get("labels") or {}
    policies = ir.get("policies") or {}
    uris = policies.values() if isinstance(policies, dict) else policies
    return (frozenset(f"{k}={v}" for k, v in labels.items()) if isinstance(labels, dict) else frozenset(),
            frozenset(str(p.get("policyRuleURI", "")) for p in uris if isinstance(p, dict)))


def blocks_page(f: Fold, q: str = "", status: str = "", cluster: str = "", page: int = 0, per: int = 50,
                label: str = "", policy: str = "") -> dict[str, Any]:
    """One page of the blocks, newest first: ``q`` a substring of the id, name or component;
    ``status`` and ``cluster`` exact; ``label`` a ``key=value`` of its labels (a tenant, a QoS
    class); ``policy`` one of its policies' URIs. Filtering reads the fold's records (each IR
    decoded once per distinct text), so it stays quick at 10,000+ blocks."""
    per = max(1, min(per, 500))
    needle = q.lower()
    chosen = []
    for bid, b in f.blocks.items():
        if status and b.get("status") != status:
            continue
        if cluster and b.get("cluster") != cluster:
            continue
        if needle and needle not in bid.lower() and needle not in b.get("ir", "").lower():
            continue
        if label or policy:
            labels, uris = _facets(b.get("ir") or "{}")
            if (label and label not in labels) or (policy and policy not in uris):
                continue
        chosen.append(bid)
    chosen.sort(key=lambda bid: (f.block_order.get(bid, 0.0), bid), reverse=True)
    page = max(0, page)
    rows = [_row(f, bid) for bid in chosen[page * per:(page + 1) * per]]
    return {"seq": f.last_seq, "total": len(chosen), "page": page, "per": per, "rows": rows,
            "statuses": [s.value for s in BlockStatus], "clusters": sorted(f.clusters)}


def _step(subject: str) -> str:
    """``aios.block.B.placement`` -> ``placement``; an instance's ``instance.I.added`` -> ``instance added``."""
    tail = subject.split(".", 3)[3] if subject.count(".") >= 3 else subject
    if tail.startswith("instance."):
        return "instance " + tail.rpartition(".")[2]
    return tail


def _instance(subject: str) -> str:
    parts = subject.split(".")
    return parts[4] if len(parts) > 5 and parts[3] == "instance" else ""


def block_detail(f: Fold, bid: str, events: list[tuple[int, float, str, dict[str, Any]]],
                 line: Any = None) -> dict[str, Any] | None:
    """A block's record, instances, ``blocks explain``'s fold of its events and its story as a
    timeline (each event: sequence, time, step, ``blocks replay``'s line through ``line``)."""
    if bid not in f.blocks and not events:
        return None
    b = f.blocks.get(bid, {})
    ir = _ir(b)
    row = _row(f, bid) if bid in f.blocks else {"id": bid, "status": "unknown", "name": "", "reason": ""}
    x = explain([(s, env) for _, _, s, env in events])
    timeline = [{"seq": seq, "time": str(env.get("time") or ""), "ts": ts, "step": _step(s), "instance": _instance(s),
                 "line": line(s, env) if line else ""} for seq, ts, s, env in events]
    instances = [{"instance": iid, **{k: v for k, v in inst.items() if k in ("node", "gpus", "cluster", "status", "endpoint", "since")}}
                 for iid, inst in sorted(f.instances.get(bid, {}).items())]
    return {"seq": f.last_seq, "block": row, "ir": {k: ir.get(k) for k in ("blockComponentURI", "minInstances", "maxInstances",
                                                                           "resources", "labels", "parameters")},
            "desired_reason": b.get("desired_reason", ""), "instances": instances, "explain": x, "timeline": timeline}
